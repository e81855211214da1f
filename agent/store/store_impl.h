/*
 * store_impl.h - private to the store module (store.c, schema_sql.c): the
 * migrations compiled into the binary.
 */
#ifndef DS_AGENT_STORE_IMPL_H
#define DS_AGENT_STORE_IMPL_H

typedef struct store_migration {
	int version;      /* NNNN of schema/NNNN_name.sql; 1, 2, 3 ... without gaps */
	const char *file; /* "schema/0001_init.sql", for messages */
	const char *sql;  /* the file's text, NUL-terminated */
} store_migration;

/* In version order, ended by {0}. */
extern const store_migration store_migrations[];

#endif

/*
 * schema_sql.c - the SQL migrations of schema/ compiled into the binary.
 *
 * Each schema/NNNN_name.sql is pulled in verbatim by the assembler's .incbin
 * (the compiler runs at the repository root, so the paths are relative to it)
 * and ended with a NUL byte; no generator step, no copy of the SQL in C.
 * Adding a migration = adding its file to schema/ and one EMBED line plus one
 * table row here (tests/unit/test_keys.c checks that the table and the folder
 * agree).  Note: -MMD does not see .incbin, so after editing a .sql file (only
 * while it has not landed: migrations are append-only) touch this file.
 *
 * Read-only data; used by store.c only.
 */
#include "agent/store/store_impl.h"

#include <stddef.h>

/* Defines the hidden global symbol SYM holding FILE's bytes and a NUL. */
#define EMBED(sym, file)                                                         \
	__asm__(".section .rodata\n"                                              \
		".global " #sym "\n"                                             \
		".hidden " #sym "\n"                                             \
		".type " #sym ", @object\n"                                      \
		#sym ":\n"                                                       \
		".incbin \"" file "\"\n"                                         \
		".byte 0\n"                                                      \
		".size " #sym ", . - " #sym "\n"                                 \
		".previous\n")

EMBED(store_sql_0001, "schema/0001_init.sql");
EMBED(store_sql_0002, "schema/0002_cluster.sql");
EMBED(store_sql_0003, "schema/0003_member_events_ts.sql");
EMBED(store_sql_0004, "schema/0004_plans.sql");

extern const char store_sql_0001[];
extern const char store_sql_0002[];
extern const char store_sql_0003[];
extern const char store_sql_0004[];

const store_migration store_migrations[] = {
	{.version = 1, .file = "schema/0001_init.sql", .sql = store_sql_0001},
	{.version = 2, .file = "schema/0002_cluster.sql", .sql = store_sql_0002},
	{.version = 3, .file = "schema/0003_member_events_ts.sql", .sql = store_sql_0003},
	{.version = 4, .file = "schema/0004_plans.sql", .sql = store_sql_0004},
	{.version = 0},
};

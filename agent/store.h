/*
 * store.h - the agent's SQLite database (DATA_DIR/dsagent.db).
 *
 * The only module that runs SQL.  store_open creates the data directory
 * (0700) and the database when missing, turns on WAL, a busy timeout and
 * foreign keys, and applies the numbered migrations of schema/ (compiled into
 * the binary) that the file lacks, each in its own transaction that also sets
 * PRAGMA user_version.  A database written by a newer dsagent (user_version
 * above what this binary knows) is refused, never modified.
 *
 * Threading: one connection guarded by a mutex; every function may be called
 * from any thread.  Times are Unix seconds (UTC).
 */
#ifndef DS_AGENT_STORE_H
#define DS_AGENT_STORE_H

#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

typedef struct store store;

#define STORE_NAME_MAX 64 /* key names: 1..64 characters */
#define STORE_PREFIX_LEN 8
#define STORE_HASH_LEN 32

/* One row of api_keys, with usage totals summed from key_usage when it comes
 * from store_key_list (zero from store_key_insert).  0 in expires, revoked_at,
 * last_used means NULL (never / not revoked / never used); 0 in rpm, tpm,
 * max_concurrency means unlimited. */
typedef struct store_key {
	int64_t id;
	char name[STORE_NAME_MAX + 1];
	char prefix[STORE_PREFIX_LEN + 1];
	uint8_t hash[STORE_HASH_LEN];
	int64_t created, expires, revoked_at, last_used;
	int64_t rpm, tpm, max_concurrency;
	int64_t requests, prompt_tokens, completion_tokens;
} store_key;

/* Opens or creates DATA_DIR/dsagent.db; NULL with err filled on failure
 * (DS_EIO: directory or file; DS_EUNSUPPORTED: the database is newer than this
 * binary; DS_EFORMAT: not a database or a migration failed). */
store *store_open(const char *data_dir, ds_err *err);
/* NULL is a no-op. */
void store_close(store *s);

/* user_version of the open database; the newest version this binary knows. */
int store_schema_version(store *s);
int store_schema_latest(void);
/* Path of the database file; borrowed until store_close. */
const char *store_path(const store *s);

/* Inserts k (id ignored) and sets k->id.  DS_EBUSY when a key that is not
 * revoked already has this name or this hash (message says which). */
int store_key_insert(store *s, store_key *k, ds_err *err);

/* All keys (revoked ones too when include_revoked), ordered by id, with usage
 * totals.  *out is malloc'd (caller frees with free(); NULL when *n == 0). */
int store_key_list(store *s, int include_revoked, store_key **out, size_t *n, ds_err *err);

/* One key by id with its totals; DS_ENOTFOUND when there is none. */
int store_key_get(store *s, int64_t id, store_key *out, ds_err *err);

/* Sets revoked_at = now unless already revoked (then *was_revoked = 1 and the
 * row is unchanged).  DS_ENOTFOUND for an unknown id.  was_revoked may be NULL. */
int store_key_revoke(store *s, int64_t id, int64_t now, int *was_revoked, ds_err *err);

/* Adds one request and its tokens to key_usage(id, day of now, UTC) and sets
 * last_used = now, in one transaction. */
int store_key_usage_add(store *s, int64_t id, int64_t now, int64_t prompt_tokens,
			int64_t completion_tokens, ds_err *err);

/* Appends to the event log; detail_json is a JSON object as text, or NULL. */
int store_event_add(store *s, int64_t ts, const char *kind, const char *detail_json,
		    ds_err *err);

typedef struct store_event {
	int64_t id, ts;
	char kind[64];
	char *detail; /* malloc'd JSON text or NULL */
} store_event;

/* Events with id > after_id, oldest first, at most max.  *out is malloc'd;
 * free it with store_events_free. */
int store_event_list(store *s, int64_t after_id, size_t max, store_event **out, size_t *n,
		     ds_err *err);
void store_events_free(store_event *ev, size_t n);

#endif

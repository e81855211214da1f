/*
 * store.c - the agent's SQLite database (see store.h).
 *
 * Callers: agent/keys.c (api_keys, key_usage, events) and agent/main.c
 * (open/close).  Calls: sqlite3 only; the SQL text of the schema comes from
 * schema/ through schema_sql.c.
 *
 * Open sequence:
 *
 *   mkdir -p DATA_DIR (0700) -> sqlite3_open_v2(dsagent.db, CREATE)
 *     -> busy_timeout, journal_mode=WAL, synchronous=NORMAL, foreign_keys=ON
 *     -> user_version v:  v > latest  -> refuse (DS_EUNSUPPORTED)
 *                         v < latest  -> for each migration m > v:
 *                                          BEGIN IMMEDIATE; m.sql;
 *                                          PRAGMA user_version = m; COMMIT
 *
 * Invariants:
 *  1. user_version equals the number of the last migration applied, and a
 *     migration and its user_version change commit together or not at all
 *     (BEGIN IMMEDIATE also keeps two agents on one file from racing).
 *  2. Migrations are append-only: a file of schema/ never changes once landed.
 *  3. Every statement runs with s->mu held; no sqlite3_stmt outlives a call.
 *
 * Threading: any thread; one connection serialised by s->mu.
 */
#include "agent/store.h"
#include "agent/store_impl.h"
#include "common/strutil.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define BUSY_TIMEOUT_MS 5000

struct store {
	sqlite3 *db;
	pthread_mutex_t mu;
	char path[PATH_MAX];
};

int store_schema_latest(void)
{
	int v = 0;
	for (const store_migration *m = store_migrations; m->sql; m++)
		v = m->version;
	return v;
}

const char *store_path(const store *s)
{
	return s->path;
}

/* DS_* code of the connection's last SQLite error. */
static int ds_code(store *s)
{
	int code = sqlite3_errcode(s->db) & 0xff;
	if (code == SQLITE_BUSY || code == SQLITE_LOCKED)
		return DS_EBUSY;
	if (code == SQLITE_NOTADB || code == SQLITE_CORRUPT)
		return DS_EFORMAT;
	return DS_EIO;
}

static int db_fail(store *s, ds_err *err, const char *what)
{
	return ds_err_set(err, ds_code(s), "%s: %s: %s", s->path, what, sqlite3_errmsg(s->db));
}

/* mkdir -p with mode 0700 for every directory it creates. */
static int make_dirs(const char *dir, ds_err *err)
{
	char p[PATH_MAX];
	if (!dir || !dir[0])
		return ds_err_set(err, DS_EINVAL, "the data directory path is empty");
	if (ds_strlcpy(p, dir, sizeof p) >= sizeof p)
		return ds_err_set(err, DS_EINVAL, "data directory path is too long: %s", dir);
	for (char *c = p + 1;; c++) {
		if (*c != '/' && *c != '\0')
			continue;
		char saved = *c;
		*c = '\0';
		if (mkdir(p, 0700) != 0 && errno != EEXIST)
			return ds_err_set(err, DS_EIO, "cannot create the data directory %s: %s", p,
					  strerror(errno));
		*c = saved;
		if (!saved)
			break;
	}
	struct stat st;
	if (stat(p, &st) != 0 || !S_ISDIR(st.st_mode))
		return ds_err_set(err, DS_EIO, "data directory %s is not a directory", p);
	return DS_OK;
}

static int exec(store *s, const char *sql, const char *what, ds_err *err)
{
	char *msg = NULL;
	if (sqlite3_exec(s->db, sql, NULL, NULL, &msg) == SQLITE_OK)
		return DS_OK;
	int rc = ds_err_set(err, ds_code(s), "%s: %s: %s", s->path, what,
			    msg ? msg : sqlite3_errmsg(s->db));
	sqlite3_free(msg);
	return rc;
}

static int read_user_version(store *s, int *v, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	if (sqlite3_prepare_v2(s->db, "PRAGMA user_version", -1, &st, NULL) != SQLITE_OK)
		return db_fail(s, err, "reading user_version");
	int rc = sqlite3_step(st);
	if (rc == SQLITE_ROW)
		*v = sqlite3_column_int(st, 0);
	sqlite3_finalize(st);
	return rc == SQLITE_ROW ? DS_OK : db_fail(s, err, "reading user_version");
}

static int migrate(store *s, ds_err *err)
{
	int v = 0, latest = store_schema_latest();
	int rc = read_user_version(s, &v, err);
	if (rc)
		return rc;
	if (v > latest)
		return ds_err_set(err, DS_EUNSUPPORTED,
				  "%s has schema version %d but this dsagent knows versions up to "
				  "%d: it was written by a newer dsagent; upgrade dsagent (the "
				  "file was left unchanged)",
				  s->path, v, latest);
	for (const store_migration *m = store_migrations; m->sql; m++) {
		if (m->version <= v)
			continue;
		/* Re-read inside the write lock: another process may have migrated. */
		rc = exec(s, "BEGIN IMMEDIATE", "starting a migration", err);
		if (rc)
			return rc;
		int now_v = 0;
		rc = read_user_version(s, &now_v, err);
		if (rc == DS_OK && now_v < m->version) {
			rc = exec(s, m->sql, m->file, err);
			if (rc == DS_OK) {
				char sql[64];
				snprintf(sql, sizeof sql, "PRAGMA user_version = %d", m->version);
				rc = exec(s, sql, "setting user_version", err);
			}
		}
		if (rc) {
			sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
			return ds_err_wrap(err, "migration %s", m->file);
		}
		rc = exec(s, "COMMIT", "committing a migration", err);
		if (rc) {
			sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
			return rc;
		}
	}
	return DS_OK;
}

store *store_open(const char *data_dir, ds_err *err)
{
	store *s = calloc(1, sizeof *s);
	if (!s) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	pthread_mutex_init(&s->mu, NULL);
	int rc = make_dirs(data_dir, err);
	if (rc)
		goto out;
	if ((size_t)snprintf(s->path, sizeof s->path, "%s/dsagent.db", data_dir) >= sizeof s->path) {
		rc = ds_err_set(err, DS_EINVAL, "data directory path is too long: %s", data_dir);
		goto out;
	}
	if (sqlite3_open_v2(s->path, &s->db,
			    SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
			    NULL) != SQLITE_OK) {
		rc = ds_err_set(err, DS_EIO, "cannot open the database %s: %s", s->path,
				s->db ? sqlite3_errmsg(s->db) : "out of memory");
		goto out;
	}
	/* Only hashes live here, but usage is nobody else's business; the WAL and
	 * shared-memory files take the database file's mode. */
	chmod(s->path, 0600);
	sqlite3_busy_timeout(s->db, BUSY_TIMEOUT_MS);
	rc = exec(s, "PRAGMA journal_mode = WAL", "turning on WAL", err);
	if (!rc)
		rc = exec(s, "PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON",
			  "setting pragmas", err);
	if (!rc)
		rc = migrate(s, err);
out:
	if (rc) {
		store_close(s);
		return NULL;
	}
	return s;
}

void store_close(store *s)
{
	if (!s)
		return;
	if (s->db)
		sqlite3_close_v2(s->db);
	pthread_mutex_destroy(&s->mu);
	free(s);
}

int store_schema_version(store *s)
{
	int v = -1;
	pthread_mutex_lock(&s->mu);
	if (read_user_version(s, &v, NULL) != DS_OK)
		v = -1;
	pthread_mutex_unlock(&s->mu);
	return v;
}

/* ---- statements ---- */

static int prep(store *s, const char *sql, sqlite3_stmt **st, ds_err *err)
{
	if (sqlite3_prepare_v2(s->db, sql, -1, st, NULL) != SQLITE_OK)
		return db_fail(s, err, "preparing a statement");
	return DS_OK;
}

/* Binds v, or NULL when v == 0 (the "never / unlimited" convention). */
static void bind_opt(sqlite3_stmt *st, int i, int64_t v)
{
	if (v)
		sqlite3_bind_int64(st, i, v);
	else
		sqlite3_bind_null(st, i);
}

static void text_col(sqlite3_stmt *st, int i, char *out, size_t n)
{
	const unsigned char *t = sqlite3_column_text(st, i);
	ds_strlcpy(out, t ? (const char *)t : "", n);
}

#define KEY_COLS                                                                  \
	"k.id, k.name, k.prefix, k.hash, k.created, k.expires, k.revoked_at, "      \
	"k.last_used, k.rpm, k.tpm, k.max_concurrency, "                            \
	"COALESCE(SUM(u.requests), 0), COALESCE(SUM(u.prompt_tokens), 0), "         \
	"COALESCE(SUM(u.completion_tokens), 0) "                                    \
	"FROM api_keys k LEFT JOIN key_usage u ON u.key_id = k.id "

static void key_row(sqlite3_stmt *st, store_key *k)
{
	memset(k, 0, sizeof *k);
	k->id = sqlite3_column_int64(st, 0);
	text_col(st, 1, k->name, sizeof k->name);
	text_col(st, 2, k->prefix, sizeof k->prefix);
	const void *h = sqlite3_column_blob(st, 3);
	if (h && sqlite3_column_bytes(st, 3) == STORE_HASH_LEN)
		memcpy(k->hash, h, STORE_HASH_LEN);
	k->created = sqlite3_column_int64(st, 4);
	k->expires = sqlite3_column_int64(st, 5); /* NULL reads as 0 */
	k->revoked_at = sqlite3_column_int64(st, 6);
	k->last_used = sqlite3_column_int64(st, 7);
	k->rpm = sqlite3_column_int64(st, 8);
	k->tpm = sqlite3_column_int64(st, 9);
	k->max_concurrency = sqlite3_column_int64(st, 10);
	k->requests = sqlite3_column_int64(st, 11);
	k->prompt_tokens = sqlite3_column_int64(st, 12);
	k->completion_tokens = sqlite3_column_int64(st, 13);
}

int store_key_insert(store *s, store_key *k, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc, in_tx = 0;
	pthread_mutex_lock(&s->mu);
	rc = exec(s, "BEGIN IMMEDIATE", "creating a key", err);
	if (rc)
		goto out;
	in_tx = 1;
	rc = prep(s, "SELECT id FROM api_keys WHERE name = ?1 AND revoked_at IS NULL", &st, err);
	if (rc)
		goto out;
	sqlite3_bind_text(st, 1, k->name, -1, SQLITE_STATIC);
	int step = sqlite3_step(st);
	if (step == SQLITE_ROW) {
		rc = ds_err_set(err, DS_EBUSY,
				"a key named '%s' already exists (id %lld); revoke it first or "
				"choose another name",
				k->name, (long long)sqlite3_column_int64(st, 0));
		goto out;
	}
	if (step != SQLITE_DONE) {
		rc = db_fail(s, err, "looking up a key name");
		goto out;
	}
	sqlite3_finalize(st);
	st = NULL;
	rc = prep(s,
		  "INSERT INTO api_keys (name, prefix, hash, created, expires, rpm, tpm, "
		  "max_concurrency) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
		  &st, err);
	if (rc)
		goto out;
	sqlite3_bind_text(st, 1, k->name, -1, SQLITE_STATIC);
	sqlite3_bind_text(st, 2, k->prefix, -1, SQLITE_STATIC);
	sqlite3_bind_blob(st, 3, k->hash, STORE_HASH_LEN, SQLITE_STATIC);
	sqlite3_bind_int64(st, 4, k->created);
	bind_opt(st, 5, k->expires);
	bind_opt(st, 6, k->rpm);
	bind_opt(st, 7, k->tpm);
	bind_opt(st, 8, k->max_concurrency);
	step = sqlite3_step(st);
	if ((step & 0xff) == SQLITE_CONSTRAINT) {
		rc = ds_err_set(err, DS_EBUSY, "key '%s' clashes with an existing key: %s",
				k->name, sqlite3_errmsg(s->db));
		goto out;
	}
	if (step != SQLITE_DONE) {
		rc = db_fail(s, err, "inserting a key");
		goto out;
	}
	k->id = sqlite3_last_insert_rowid(s->db);
	k->requests = k->prompt_tokens = k->completion_tokens = 0;
	sqlite3_finalize(st);
	st = NULL;
	rc = exec(s, "COMMIT", "creating a key", err);
	if (rc == DS_OK)
		in_tx = 0;
out:
	sqlite3_finalize(st);
	if (in_tx)
		sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

int store_key_list(store *s, int include_revoked, store_key **out, size_t *n, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	store_key *v = NULL;
	size_t cnt = 0, cap = 0;
	int rc;
	*out = NULL;
	*n = 0;
	pthread_mutex_lock(&s->mu);
	rc = prep(s,
		  include_revoked ? "SELECT " KEY_COLS "GROUP BY k.id ORDER BY k.id"
				  : "SELECT " KEY_COLS "WHERE k.revoked_at IS NULL "
				    "GROUP BY k.id ORDER BY k.id",
		  &st, err);
	if (rc)
		goto out;
	int step;
	while ((step = sqlite3_step(st)) == SQLITE_ROW) {
		if (cnt == cap) {
			size_t nc = cap ? cap * 2 : 16;
			store_key *nv = realloc(v, nc * sizeof *nv);
			if (!nv) {
				rc = ds_err_set(err, DS_ENOMEM, "out of memory listing keys");
				goto out;
			}
			v = nv;
			cap = nc;
		}
		key_row(st, &v[cnt++]);
	}
	if (step != SQLITE_DONE) {
		rc = db_fail(s, err, "listing keys");
		goto out;
	}
	*out = v;
	*n = cnt;
	v = NULL;
out:
	sqlite3_finalize(st);
	pthread_mutex_unlock(&s->mu);
	free(v);
	return rc;
}

int store_key_get(store *s, int64_t id, store_key *out, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc;
	pthread_mutex_lock(&s->mu);
	rc = prep(s, "SELECT " KEY_COLS "WHERE k.id = ?1 GROUP BY k.id", &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, id);
	int step = sqlite3_step(st);
	if (step == SQLITE_ROW)
		key_row(st, out);
	else if (step == SQLITE_DONE)
		rc = ds_err_set(err, DS_ENOTFOUND, "no key with id %lld", (long long)id);
	else
		rc = db_fail(s, err, "reading a key");
out:
	sqlite3_finalize(st);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

int store_key_revoke(store *s, int64_t id, int64_t now, int *was_revoked, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc;
	if (was_revoked)
		*was_revoked = 0;
	pthread_mutex_lock(&s->mu);
	rc = prep(s, "UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
		  &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, id);
	sqlite3_bind_int64(st, 2, now);
	if (sqlite3_step(st) != SQLITE_DONE) {
		rc = db_fail(s, err, "revoking a key");
		goto out;
	}
	if (sqlite3_changes(s->db) == 1)
		goto out;
	sqlite3_finalize(st);
	st = NULL;
	rc = prep(s, "SELECT 1 FROM api_keys WHERE id = ?1", &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, id);
	int step = sqlite3_step(st);
	if (step == SQLITE_ROW) {
		if (was_revoked)
			*was_revoked = 1;
	} else if (step == SQLITE_DONE) {
		rc = ds_err_set(err, DS_ENOTFOUND, "no key with id %lld", (long long)id);
	} else {
		rc = db_fail(s, err, "revoking a key");
	}
out:
	sqlite3_finalize(st);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

int store_key_usage_add(store *s, int64_t id, int64_t now, int64_t prompt_tokens,
			int64_t completion_tokens, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc, in_tx = 0;
	char day[16];
	time_t t = (time_t)now;
	struct tm tm;
	if (!gmtime_r(&t, &tm) || strftime(day, sizeof day, "%Y-%m-%d", &tm) == 0)
		return ds_err_set(err, DS_EINVAL, "time %lld cannot be written as a day",
				  (long long)now);
	pthread_mutex_lock(&s->mu);
	rc = exec(s, "BEGIN IMMEDIATE", "recording usage", err);
	if (rc)
		goto out;
	in_tx = 1;
	rc = prep(s,
		  "INSERT INTO key_usage (key_id, day, requests, prompt_tokens, "
		  "completion_tokens) VALUES (?1, ?2, 1, ?3, ?4) "
		  "ON CONFLICT (key_id, day) DO UPDATE SET requests = requests + 1, "
		  "prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
		  "completion_tokens = completion_tokens + excluded.completion_tokens",
		  &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, id);
	sqlite3_bind_text(st, 2, day, -1, SQLITE_STATIC);
	sqlite3_bind_int64(st, 3, prompt_tokens);
	sqlite3_bind_int64(st, 4, completion_tokens);
	int step = sqlite3_step(st);
	if ((step & 0xff) == SQLITE_CONSTRAINT) {
		rc = ds_err_set(err, DS_ENOTFOUND, "no key with id %lld", (long long)id);
		goto out;
	}
	if (step != SQLITE_DONE) {
		rc = db_fail(s, err, "recording usage");
		goto out;
	}
	sqlite3_finalize(st);
	st = NULL;
	rc = prep(s, "UPDATE api_keys SET last_used = ?2 WHERE id = ?1", &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, id);
	sqlite3_bind_int64(st, 2, now);
	if (sqlite3_step(st) != SQLITE_DONE) {
		rc = db_fail(s, err, "recording last use");
		goto out;
	}
	sqlite3_finalize(st);
	st = NULL;
	rc = exec(s, "COMMIT", "recording usage", err);
	if (rc == DS_OK)
		in_tx = 0;
out:
	sqlite3_finalize(st);
	if (in_tx)
		sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

int store_event_add(store *s, int64_t ts, const char *kind, const char *detail_json, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc;
	pthread_mutex_lock(&s->mu);
	rc = prep(s, "INSERT INTO events (ts, kind, detail) VALUES (?1, ?2, ?3)", &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, ts);
	sqlite3_bind_text(st, 2, kind, -1, SQLITE_STATIC);
	if (detail_json)
		sqlite3_bind_text(st, 3, detail_json, -1, SQLITE_STATIC);
	else
		sqlite3_bind_null(st, 3);
	if (sqlite3_step(st) != SQLITE_DONE)
		rc = db_fail(s, err, "recording an event");
out:
	sqlite3_finalize(st);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

void store_events_free(store_event *ev, size_t n)
{
	for (size_t i = 0; ev && i < n; i++)
		free(ev[i].detail);
	free(ev);
}

int store_event_list(store *s, int64_t after_id, size_t max, store_event **out, size_t *n,
		     ds_err *err)
{
	sqlite3_stmt *st = NULL;
	store_event *v = NULL;
	size_t cnt = 0;
	int rc;
	*out = NULL;
	*n = 0;
	if (max == 0)
		return DS_OK;
	if (max > 100000)
		max = 100000;
	v = calloc(max, sizeof *v);
	if (!v)
		return ds_err_set(err, DS_ENOMEM, "out of memory listing events");
	pthread_mutex_lock(&s->mu);
	rc = prep(s, "SELECT id, ts, kind, detail FROM events WHERE id > ?1 ORDER BY id LIMIT ?2",
		  &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, after_id);
	sqlite3_bind_int64(st, 2, (int64_t)max);
	int step;
	while ((step = sqlite3_step(st)) == SQLITE_ROW && cnt < max) {
		store_event *e = &v[cnt++];
		e->id = sqlite3_column_int64(st, 0);
		e->ts = sqlite3_column_int64(st, 1);
		text_col(st, 2, e->kind, sizeof e->kind);
		const unsigned char *d = sqlite3_column_text(st, 3);
		if (d && !(e->detail = strdup((const char *)d))) {
			rc = ds_err_set(err, DS_ENOMEM, "out of memory listing events");
			goto out;
		}
	}
	if (step != SQLITE_DONE && step != SQLITE_ROW) {
		rc = db_fail(s, err, "listing events");
		goto out;
	}
out:
	sqlite3_finalize(st);
	pthread_mutex_unlock(&s->mu);
	if (rc) {
		store_events_free(v, cnt);
		return rc;
	}
	if (cnt == 0) {
		free(v);
		v = NULL;
	}
	*out = v;
	*n = cnt;
	return DS_OK;
}

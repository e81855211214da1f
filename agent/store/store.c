/*
 * store.c - the agent's SQLite database (see store.h).
 *
 * Callers: agent/auth/keys.c (api_keys, key_usage, events), agent/main.c
 * (open/close, events), agent/cluster/cluster.c (nodes and their inventory tables,
 * member_events) and agent/cluster/election.c (elections, votes).  Calls: sqlite3 only; the SQL text of the schema comes from
 * schema/ through schema_sql.c.
 *
 * Open sequence:
 *
 *   mkdir -p DATA_DIR (0700) -> DATA_DIR/dsagent.lock: open (create 0600),
 *     flock(LOCK_EX | LOCK_NB); held: refuse (DS_EBUSY) naming the pid the
 *     holder wrote there; got it: write our pid -> sqlite3_open_v2(dsagent.db, CREATE)
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
 *  4. A node's nodes row and its rows in gpus, ib_ports, nics, links and
 *     gpu_nic change in one transaction (store_node_put): a reader never sees
 *     half an inventory, and a kill -9 leaves the old one or the new one.
 *  5. Security-relevant writes commit with synchronous=FULL (the WAL is
 *     fsync'd at COMMIT, so they survive a power cut, not only a crash):
 *     key creation and revocation, votes and elections (an epoch and its
 *     head).  Everything else keeps the connection's NORMAL (synced at
 *     checkpoints: a power cut may lose the last commits, never corrupt).
 *     An epoch never gets a second vote or a second head.
 *  6. One process at a time has a data directory: nothing in it but
 *     dsagent.lock is opened before the lock is held, and the lock (an open
 *     file description, close-on-exec so rank processes do not inherit it)
 *     lives until store_close or the process's end.
 *
 * Threading: any thread; one connection serialised by s->mu.
 */
#include "agent/store/store.h"
#include "agent/store/store_impl.h"
#include "common/strutil.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define BUSY_TIMEOUT_MS 5000

struct store {
	sqlite3 *db;
	pthread_mutex_t mu;
	int lock_fd; /* DATA_DIR/dsagent.lock, flock'ed (invariant 6); -1 = none */
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

/* Invariant 6: takes DATA_DIR/dsagent.lock or says who holds it. */
static int lock_data_dir(store *s, const char *data_dir, ds_err *err)
{
	char path[PATH_MAX];
	if ((size_t)snprintf(path, sizeof path, "%s/dsagent.lock", data_dir) >= sizeof path)
		return ds_err_set(err, DS_EINVAL, "data directory path is too long: %s", data_dir);
	s->lock_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (s->lock_fd < 0)
		return ds_err_set(err, DS_EIO, "cannot open the lock file %s: %s", path,
				  strerror(errno));
	if (flock(s->lock_fd, LOCK_EX | LOCK_NB) != 0) {
		int e = errno;
		char pid[32] = "";
		ssize_t n = e == EWOULDBLOCK ? pread(s->lock_fd, pid, sizeof pid - 1, 0) : -1;
		int64_t v = 0;
		if (n > 0) {
			pid[n] = 0;
			pid[strcspn(pid, "\n")] = 0;
		}
		close(s->lock_fd);
		s->lock_fd = -1;
		if (e != EWOULDBLOCK)
			return ds_err_set(err, DS_EIO, "cannot lock %s: %s", path, strerror(e));
		if (n > 0 && ds_parse_i64(pid, 1, INT32_MAX, &v) == DS_OK)
			return ds_err_set(err, DS_EBUSY,
					  "in use by another dsagent (pid %lld, which holds %s): stop "
					  "it first, or give this one another --data-dir",
					  (long long)v, path);
		return ds_err_set(err, DS_EBUSY,
				  "in use by another process (it holds %s; its pid is not written "
				  "yet): stop it first, or give this one another --data-dir",
				  path);
	}
	char pid[32];
	int n = snprintf(pid, sizeof pid, "%lld\n", (long long)getpid());
	if (ftruncate(s->lock_fd, 0) != 0 || pwrite(s->lock_fd, pid, (size_t)n, 0) != n)
		return ds_err_set(err, DS_EIO, "cannot write the pid to %s: %s", path,
				  strerror(errno));
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

/* Invariant 5: the next COMMIT (or autocommit statement) on this connection
 * fsyncs the WAL; durable_end goes back to NORMAL.  PRAGMA synchronous is a
 * setting of the connection, and every statement runs with s->mu held, so
 * the setting covers exactly the writes between the two calls. */
static int durable_begin(store *s, const char *what, ds_err *err)
{
	return exec(s, "PRAGMA synchronous = FULL", what, err);
}

static void durable_end(store *s)
{
	sqlite3_exec(s->db, "PRAGMA synchronous = NORMAL", NULL, NULL, NULL);
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
	s->lock_fd = -1;
	int rc = make_dirs(data_dir, err);
	if (!rc)
		rc = lock_data_dir(s, data_dir, err);
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
	if (s->lock_fd >= 0)
		close(s->lock_fd); /* releases the lock; the file stays */
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
	rc = durable_begin(s, "creating a key", err);
	if (rc)
		goto out;
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
	durable_end(s);
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
	rc = durable_begin(s, "revoking a key", err);
	if (rc)
		goto out;
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
	durable_end(s);
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

/* ---- the cluster record (schema/0002_cluster.sql) ---- */

/* Text or NULL for "" (the "unknown" convention of store_node). */
static void bind_str(sqlite3_stmt *st, int i, const char *v)
{
	if (v && *v)
		sqlite3_bind_text(st, i, v, -1, SQLITE_TRANSIENT);
	else
		sqlite3_bind_null(st, i);
}

static void bind_port(sqlite3_stmt *st, int i, int v)
{
	if (v > 0)
		sqlite3_bind_int(st, i, v);
	else
		sqlite3_bind_null(st, i);
}

/* A JSON value bound by kind: 'i' integer, 'b' boolean (0/1), 'r' number,
 * 't' string, 'j' any JSON (as compact text); anything else, or the wrong
 * type, is NULL.  Upper case = required: the caller skips the entry. */
static void bind_json(sqlite3_stmt *st, int i, const json_t *v, char kind)
{
	switch (kind | 0x20) {
	case 'i':
		if (json_is_integer(v)) {
			sqlite3_bind_int64(st, i, (sqlite3_int64)json_integer_value(v));
			return;
		}
		break;
	case 'b':
		if (json_is_boolean(v)) {
			sqlite3_bind_int(st, i, json_is_true(v));
			return;
		}
		break;
	case 'r':
		if (json_is_number(v)) {
			sqlite3_bind_double(st, i, json_number_value(v));
			return;
		}
		break;
	case 't':
		if (json_is_string(v)) {
			sqlite3_bind_text(st, i, json_string_value(v), -1, SQLITE_TRANSIENT);
			return;
		}
		break;
	case 'j':
		if (v) {
			char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
			if (t) {
				sqlite3_bind_text(st, i, t, -1, free);
				return;
			}
		}
		break;
	}
	sqlite3_bind_null(st, i);
}

static int json_kind_ok(const json_t *v, char kind)
{
	switch (kind | 0x20) {
	case 'i':
		return json_is_integer(v);
	case 't':
		return json_is_string(v);
	default:
		return v != NULL;
	}
}

/* o["a.b"] = o["a"]["b"] (one level), for the GPUs' health fields. */
static const json_t *jpath(const json_t *o, const char *key)
{
	const char *dot = strchr(key, '.');
	if (!dot)
		return json_object_get(o, key);
	char head[32];
	size_t n = (size_t)(dot - key);
	if (n >= sizeof head)
		return NULL;
	memcpy(head, key, n);
	head[n] = '\0';
	return json_object_get(json_object_get(o, head), dot + 1);
}

typedef struct child_col {
	const char *col;  /* SQL column */
	const char *key;  /* JSON key in the list entry; "#pos" = position in the list */
	char kind;        /* see bind_json */
} child_col;

#define CHILD_COLS_MAX 24

static const child_col gpu_cols[] = {
	{"idx", "index", 'I'},
	{"nvml_index", "nvml_index", 'i'},
	{"uuid", "uuid", 't'},
	{"name", "name", 't'},
	{"bus_id", "bus_id", 't'},
	{"numa_node", "numa_node", 'i'},
	{"compute_capability", "compute_capability", 't'},
	{"memory_total_bytes", "memory_total_bytes", 'i'},
	{"nvlinks", "nvlinks", 'i'},
	{"nvswitch", "nvswitch", 'b'},
	{"temperature_c", "health.temperature_c", 'i'},
	{"power_mw", "health.power_mw", 'i'},
	{"memory_used_bytes", "health.memory_used_bytes", 'i'},
	{"ecc_uncorrected_volatile", "health.ecc_uncorrected_volatile", 'i'},
	{"ecc_uncorrected_aggregate", "health.ecc_uncorrected_aggregate", 'i'},
	{"retired_pages_sbe", "health.retired_pages_sbe", 'i'},
	{"retired_pages_dbe", "health.retired_pages_dbe", 'i'},
	{"remapped_rows_correctable", "health.remapped_rows_correctable", 'i'},
	{"remapped_rows_uncorrectable", "health.remapped_rows_uncorrectable", 'i'},
	{"remapped_rows_pending", "health.remapped_rows_pending", 'b'},
	{"remapped_rows_failed", "health.remapped_rows_failed", 'b'},
	{NULL, NULL, 0},
};
static const child_col ib_cols[] = {
	{"device", "device", 'T'},
	{"port", "port", 'I'},
	{"bus_id", "bus_id", 't'},
	{"numa_node", "numa_node", 'i'},
	{"hca_type", "hca_type", 't'},
	{"fw_ver", "fw_ver", 't'},
	{"link_layer", "link_layer", 't'},
	{"state", "state", 't'},
	{"phys_state", "phys_state", 't'},
	{"rate_gbps", "rate_gbps", 'r'},
	{"width", "width", 'i'},
	{"speed", "speed", 't'},
	{"netdev", "netdev", 't'},
	{"gid_index", "gid_index", 'i'},
	{"usable", "usable", 'b'},
	{NULL, NULL, 0},
};
static const child_col nic_cols[] = {
	{"pos", "#pos", 'i'},
	{"name", "name", 'T'},
	{"ipv4", "ipv4", 'J'},
	{"ipv6", "ipv6", 'J'},
	{NULL, NULL, 0},
};
static const child_col link_cols[] = {
	{"a", "a", 'I'},
	{"b", "b", 'I'},
	{"level", "level", 't'},
	{"nvlinks", "nvlinks", 'i'},
	{"nvswitch", "nvswitch", 'b'},
	{"source", "source", 't'},
	{NULL, NULL, 0},
};
static const child_col gpu_nic_cols[] = {
	{"gpu", "gpu", 'I'},
	{"nic", "nic", 'T'},
	{"level", "level", 't'},
	{"source", "source", 't'},
	{NULL, NULL, 0},
};

static const struct child_table {
	const char *table; /* SQL table */
	const char *list;  /* inventory key of the list */
	const child_col *cols;
} child_tables[] = {
	{"gpus", "gpus", gpu_cols},
	{"ib_ports", "ib_ports", ib_cols},
	{"nics", "nics", nic_cols},
	{"links", "gpu_links", link_cols},
	{"gpu_nic", "gpu_nic", gpu_nic_cols},
};

/* Replaces the node's rows of one child table from inventory[list]. */
static int put_children(store *s, const struct child_table *t, const char *id,
			const json_t *inventory, ds_err *err)
{
	char sql[1024], del[128];
	sqlite3_stmt *st = NULL;
	int rc;
	snprintf(del, sizeof del, "DELETE FROM %s WHERE node_id = ?1", t->table);
	rc = prep(s, del, &st, err);
	if (rc)
		return rc;
	sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
	if (sqlite3_step(st) != SQLITE_DONE)
		rc = db_fail(s, err, "clearing a node's rows");
	sqlite3_finalize(st);
	st = NULL;
	if (rc)
		return rc;
	const json_t *list = json_object_get(inventory, t->list);
	if (!json_is_array(list) || json_array_size(list) == 0)
		return DS_OK;
	size_t o = (size_t)snprintf(sql, sizeof sql, "INSERT INTO %s (node_id", t->table);
	int ncol = 0;
	for (const child_col *c = t->cols; c->col; c++, ncol++)
		o += (size_t)snprintf(sql + o, sizeof sql - o, ", %s", c->col);
	o += (size_t)snprintf(sql + o, sizeof sql - o, ") VALUES (?1");
	for (int i = 0; i < ncol; i++)
		o += (size_t)snprintf(sql + o, sizeof sql - o, ", ?%d", i + 2);
	if (o + 2 >= sizeof sql)
		return ds_err_set(err, DS_EINTERNAL, "statement for %s too long", t->table);
	snprintf(sql + o, sizeof sql - o, ")");
	rc = prep(s, sql, &st, err);
	if (rc)
		return rc;
	for (size_t k = 0; k < json_array_size(list); k++) {
		const json_t *e = json_array_get(list, k);
		if (!json_is_object(e))
			continue;
		int skip = 0;
		for (const child_col *c = t->cols; c->col; c++)
			if (c->kind >= 'A' && c->kind <= 'Z' && !json_kind_ok(jpath(e, c->key), c->kind))
				skip = 1;
		if (skip)
			continue;
		sqlite3_reset(st);
		sqlite3_clear_bindings(st);
		sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
		int i = 2;
		for (const child_col *c = t->cols; c->col; c++, i++) {
			if (strcmp(c->key, "#pos") == 0)
				sqlite3_bind_int64(st, i, (sqlite3_int64)k);
			else
				bind_json(st, i, jpath(e, c->key), c->kind);
		}
		int step = sqlite3_step(st);
		if ((step & 0xff) == SQLITE_CONSTRAINT)
			continue; /* a duplicate key from a peer: the first one stays */
		if (step != SQLITE_DONE) {
			rc = db_fail(s, err, "writing a node's inventory");
			break;
		}
	}
	sqlite3_finalize(st);
	return rc;
}

static int valid_id(const char *id)
{
	if (!id || strlen(id) != STORE_ID_HEX - 1)
		return 0;
	for (const char *c = id; *c; c++)
		if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f')))
			return 0;
	return 1;
}

int store_node_put(store *s, const store_node *n, const json_t *inventory, const char *digest,
		   int64_t now, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc, in_tx = 0;
	if (!valid_id(n->id) || !n->name[0])
		return ds_err_set(err, DS_EINVAL, "node id '%s' is not 32 hex digits or has no name",
				  n->id);
	if (!json_is_object(inventory))
		return ds_err_set(err, DS_EINVAL, "the inventory of node %s is not a JSON object",
				  n->name);
	pthread_mutex_lock(&s->mu);
	rc = exec(s, "BEGIN IMMEDIATE", "writing a node", err);
	if (rc)
		goto out;
	in_tx = 1;
	rc = prep(s,
		  "INSERT INTO nodes (id, name, addr, control_port, api_port, status, role, epoch, "
		  "hostname, cpu_model, cpus, sockets, memory_bytes, compute_kind, ranks, "
		  "gpu_source, driver_version, cuda_driver_version, digest, inventory, first_seen, "
		  "last_seen, inventory_at, health_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, "
		  "?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?21, ?21) "
		  "ON CONFLICT (id) DO UPDATE SET name = excluded.name, addr = excluded.addr, "
		  "control_port = excluded.control_port, api_port = excluded.api_port, "
		  "status = excluded.status, role = excluded.role, epoch = excluded.epoch, "
		  "hostname = excluded.hostname, cpu_model = excluded.cpu_model, "
		  "cpus = excluded.cpus, sockets = excluded.sockets, "
		  "memory_bytes = excluded.memory_bytes, compute_kind = excluded.compute_kind, "
		  "ranks = excluded.ranks, gpu_source = excluded.gpu_source, "
		  "driver_version = excluded.driver_version, "
		  "cuda_driver_version = excluded.cuda_driver_version, digest = excluded.digest, "
		  "inventory = excluded.inventory, last_seen = MAX(nodes.last_seen, "
		  "excluded.last_seen), inventory_at = excluded.inventory_at, "
		  "health_at = excluded.health_at",
		  &st, err);
	if (rc)
		goto out;
	const json_t *host = json_object_get(inventory, "host");
	const json_t *comp = json_object_get(inventory, "compute");
	const json_t *src = json_object_get(inventory, "gpu_source");
	sqlite3_bind_text(st, 1, n->id, -1, SQLITE_STATIC);
	sqlite3_bind_text(st, 2, n->name, -1, SQLITE_STATIC);
	bind_str(st, 3, n->addr);
	bind_port(st, 4, n->control_port);
	bind_port(st, 5, n->api_port);
	sqlite3_bind_text(st, 6, n->status[0] ? n->status : "alive", -1, SQLITE_STATIC);
	bind_str(st, 7, n->role);
	sqlite3_bind_int64(st, 8, n->epoch);
	bind_json(st, 9, json_object_get(host, "hostname"), 't');
	bind_json(st, 10, json_object_get(host, "cpu_model"), 't');
	bind_json(st, 11, json_object_get(host, "cpus"), 'i');
	bind_json(st, 12, json_object_get(host, "sockets"), 'i');
	bind_json(st, 13, json_object_get(host, "memory_bytes"), 'i');
	bind_json(st, 14, json_object_get(comp, "kind"), 't');
	bind_json(st, 15, json_object_get(comp, "ranks"), 'i');
	bind_json(st, 16, json_object_get(src, "kind"), 't');
	bind_json(st, 17, json_object_get(src, "driver_version"), 't');
	bind_json(st, 18, json_object_get(src, "cuda_driver_version"), 'i');
	bind_str(st, 19, digest);
	bind_json(st, 20, inventory, 'j');
	sqlite3_bind_int64(st, 21, now);
	sqlite3_bind_int64(st, 22, n->last_seen ? n->last_seen : now);
	if (sqlite3_step(st) != SQLITE_DONE) {
		rc = db_fail(s, err, "writing a node");
		goto out;
	}
	sqlite3_finalize(st);
	st = NULL;
	for (size_t i = 0; i < sizeof child_tables / sizeof child_tables[0]; i++) {
		rc = put_children(s, &child_tables[i], n->id, inventory, err);
		if (rc)
			goto out;
	}
	rc = exec(s, "COMMIT", "writing a node", err);
	if (rc == DS_OK)
		in_tx = 0;
out:
	sqlite3_finalize(st);
	if (in_tx)
		sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

int store_node_seen(store *s, const store_node *n, int64_t now, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc;
	if (!valid_id(n->id) || !n->name[0])
		return ds_err_set(err, DS_EINVAL, "node id '%s' is not 32 hex digits or has no name",
				  n->id);
	pthread_mutex_lock(&s->mu);
	rc = prep(s,
		  "INSERT INTO nodes (id, name, addr, control_port, api_port, status, role, epoch, "
		  "first_seen, last_seen) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10) "
		  "ON CONFLICT (id) DO UPDATE SET name = excluded.name, "
		  "addr = COALESCE(excluded.addr, nodes.addr), "
		  "control_port = COALESCE(excluded.control_port, nodes.control_port), "
		  "api_port = COALESCE(excluded.api_port, nodes.api_port), "
		  "status = excluded.status, role = COALESCE(excluded.role, nodes.role), "
		  "epoch = excluded.epoch, last_seen = MAX(nodes.last_seen, excluded.last_seen)",
		  &st, err);
	if (rc)
		goto out;
	sqlite3_bind_text(st, 1, n->id, -1, SQLITE_STATIC);
	sqlite3_bind_text(st, 2, n->name, -1, SQLITE_STATIC);
	bind_str(st, 3, n->addr);
	bind_port(st, 4, n->control_port);
	bind_port(st, 5, n->api_port);
	sqlite3_bind_text(st, 6, n->status[0] ? n->status : "alive", -1, SQLITE_STATIC);
	bind_str(st, 7, n->role);
	sqlite3_bind_int64(st, 8, n->epoch);
	sqlite3_bind_int64(st, 9, now);
	sqlite3_bind_int64(st, 10, n->last_seen ? n->last_seen : now);
	if (sqlite3_step(st) != SQLITE_DONE)
		rc = db_fail(s, err, "recording a node");
out:
	sqlite3_finalize(st);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

void store_nodes_free(store_node *v, size_t n)
{
	for (size_t i = 0; v && i < n; i++)
		free(v[i].inventory);
	free(v);
}

#define NODE_COLS                                                                 \
	"SELECT id, name, addr, control_port, api_port, status, role, epoch, digest, " \
	"first_seen, last_seen, inventory_at, health_at, inventory FROM nodes "

/* Fills one store_node from a NODE_COLS row; DS_ENOMEM for the inventory. */
static int node_row(sqlite3_stmt *st, store_node *n)
{
	memset(n, 0, sizeof *n);
	text_col(st, 0, n->id, sizeof n->id);
	text_col(st, 1, n->name, sizeof n->name);
	text_col(st, 2, n->addr, sizeof n->addr);
	n->control_port = sqlite3_column_int(st, 3);
	n->api_port = sqlite3_column_int(st, 4);
	text_col(st, 5, n->status, sizeof n->status);
	text_col(st, 6, n->role, sizeof n->role);
	n->epoch = sqlite3_column_int64(st, 7);
	text_col(st, 8, n->digest, sizeof n->digest);
	n->first_seen = sqlite3_column_int64(st, 9);
	n->last_seen = sqlite3_column_int64(st, 10);
	n->inventory_at = sqlite3_column_int64(st, 11);
	n->health_at = sqlite3_column_int64(st, 12);
	const unsigned char *inv = sqlite3_column_text(st, 13);
	if (inv && !(n->inventory = strdup((const char *)inv)))
		return DS_ENOMEM;
	return DS_OK;
}

int store_node_list(store *s, store_node **out, size_t *n, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	store_node *v = NULL;
	size_t cnt = 0, cap = 0;
	int rc, step;
	*out = NULL;
	*n = 0;
	pthread_mutex_lock(&s->mu);
	rc = prep(s, NODE_COLS "ORDER BY name, id", &st, err);
	if (rc)
		goto out;
	while ((step = sqlite3_step(st)) == SQLITE_ROW) {
		if (cnt == cap) {
			size_t nc = cap ? cap * 2 : 16;
			store_node *nv = realloc(v, nc * sizeof *nv);
			if (!nv) {
				rc = ds_err_set(err, DS_ENOMEM, "out of memory listing nodes");
				goto out;
			}
			v = nv;
			cap = nc;
		}
		if (node_row(st, &v[cnt++]) != DS_OK) {
			rc = ds_err_set(err, DS_ENOMEM, "out of memory listing nodes");
			goto out;
		}
	}
	if (step != SQLITE_DONE) {
		rc = db_fail(s, err, "listing nodes");
		goto out;
	}
	*out = v;
	*n = cnt;
	v = NULL;
	cnt = 0;
out:
	sqlite3_finalize(st);
	pthread_mutex_unlock(&s->mu);
	store_nodes_free(v, cnt);
	return rc;
}

int store_member_event_add(store *s, int64_t ts, const char *node_id, const char *name,
			   const char *addr, const char *kind, const char *state,
			   const char *prev_state, int64_t incarnation, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc;
	pthread_mutex_lock(&s->mu);
	rc = prep(s,
		  "INSERT INTO member_events (ts, node_id, name, addr, kind, state, prev_state, "
		  "incarnation) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
		  &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, ts);
	sqlite3_bind_text(st, 2, node_id, -1, SQLITE_STATIC);
	sqlite3_bind_text(st, 3, name, -1, SQLITE_STATIC);
	bind_str(st, 4, addr);
	sqlite3_bind_text(st, 5, kind, -1, SQLITE_STATIC);
	sqlite3_bind_text(st, 6, state, -1, SQLITE_STATIC);
	bind_str(st, 7, prev_state);
	sqlite3_bind_int64(st, 8, incarnation);
	if (sqlite3_step(st) != SQLITE_DONE)
		rc = db_fail(s, err, "recording a membership event");
out:
	sqlite3_finalize(st);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

/* ---- elections and votes ---- */

static void bind_count(sqlite3_stmt *st, int i, int v)
{
	if (v >= 0)
		sqlite3_bind_int(st, i, v);
	else
		sqlite3_bind_null(st, i);
}

static void election_row(sqlite3_stmt *st, store_election *e)
{
	memset(e, 0, sizeof *e);
	e->epoch = sqlite3_column_int64(st, 0);
	text_col(st, 1, e->head, sizeof e->head);
	text_col(st, 2, e->candidate, sizeof e->candidate);
	e->votes = sqlite3_column_type(st, 3) == SQLITE_NULL ? -1 : sqlite3_column_int(st, 3);
	e->quorum = sqlite3_column_type(st, 4) == SQLITE_NULL ? -1 : sqlite3_column_int(st, 4);
	text_col(st, 5, e->outcome, sizeof e->outcome);
	e->ts = sqlite3_column_int64(st, 6);
	e->decided = sqlite3_column_int64(st, 7);
}

#define ELECTION_COLS "SELECT epoch, head_id, candidate, votes, quorum, outcome, ts, decided " \
		      "FROM elections "

int store_election_put(store *s, const store_election *e, store_election *out, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc, in_tx = 0;
	store_election row;
	if (e->epoch <= 0 || (e->head[0] && !valid_id(e->head)) ||
	    (e->candidate[0] && !valid_id(e->candidate)) || !e->outcome[0])
		return ds_err_set(err, DS_EINVAL,
				  "election row of epoch %lld: bad epoch, node id or outcome",
				  (long long)e->epoch);
	pthread_mutex_lock(&s->mu);
	rc = durable_begin(s, "recording an election", err);
	if (rc)
		goto out;
	rc = exec(s, "BEGIN IMMEDIATE", "recording an election", err);
	if (rc)
		goto out;
	in_tx = 1;
	rc = prep(s,
		  "INSERT INTO elections (epoch, head_id, candidate, votes, quorum, outcome, ts, "
		  "decided) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) "
		  "ON CONFLICT (epoch) DO UPDATE SET "
		  "head_id = COALESCE(elections.head_id, excluded.head_id), "
		  "candidate = COALESCE(excluded.candidate, elections.candidate), "
		  "votes = COALESCE(excluded.votes, elections.votes), "
		  "quorum = COALESCE(excluded.quorum, elections.quorum), "
		  "outcome = CASE WHEN elections.outcome IN ('standing', 'learned') "
		  "THEN excluded.outcome ELSE elections.outcome END, "
		  "decided = COALESCE(elections.decided, excluded.decided)",
		  &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, e->epoch);
	bind_str(st, 2, e->head);
	bind_str(st, 3, e->candidate);
	bind_count(st, 4, e->votes);
	bind_count(st, 5, e->quorum);
	sqlite3_bind_text(st, 6, e->outcome, -1, SQLITE_STATIC);
	sqlite3_bind_int64(st, 7, e->ts);
	bind_opt(st, 8, e->head[0] ? (e->decided ? e->decided : e->ts) : 0);
	if (sqlite3_step(st) != SQLITE_DONE) {
		rc = db_fail(s, err, "recording an election");
		goto out;
	}
	sqlite3_finalize(st);
	st = NULL;
	rc = prep(s, ELECTION_COLS "WHERE epoch = ?1", &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, e->epoch);
	if (sqlite3_step(st) != SQLITE_ROW) {
		rc = db_fail(s, err, "reading an election");
		goto out;
	}
	election_row(st, &row);
	if (e->head[0] && strcmp(row.head, e->head) != 0) {
		rc = ds_err_set(err, DS_EINTERNAL,
				"two heads in one epoch: epoch %lld has head %s, now told %s",
				(long long)e->epoch, row.head, e->head);
		goto out;
	}
	sqlite3_finalize(st);
	st = NULL;
	rc = exec(s, "COMMIT", "recording an election", err);
	if (rc == DS_OK) {
		in_tx = 0;
		if (out)
			*out = row;
	}
out:
	sqlite3_finalize(st);
	if (in_tx)
		sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
	durable_end(s);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

int store_election_list(store *s, size_t max, store_election **out, size_t *n, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	store_election *v = NULL;
	size_t cnt = 0;
	int rc, step;
	*out = NULL;
	*n = 0;
	if (max == 0)
		return DS_OK;
	if (max > 100000)
		max = 100000;
	pthread_mutex_lock(&s->mu);
	rc = prep(s, ELECTION_COLS "ORDER BY epoch DESC LIMIT ?1", &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, (int64_t)max);
	while ((step = sqlite3_step(st)) == SQLITE_ROW && cnt < max) {
		if (!v && !(v = calloc(max, sizeof *v))) {
			rc = ds_err_set(err, DS_ENOMEM, "out of memory listing elections");
			goto out;
		}
		election_row(st, &v[cnt++]);
	}
	if (step != SQLITE_DONE && step != SQLITE_ROW) {
		rc = db_fail(s, err, "listing elections");
		goto out;
	}
	for (size_t i = 0; i < cnt / 2; i++) { /* oldest first */
		store_election t = v[i];
		v[i] = v[cnt - 1 - i];
		v[cnt - 1 - i] = t;
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

int store_vote_put(store *s, int64_t epoch, const char *candidate, int64_t ts,
		   char existing[STORE_ID_HEX], ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc, in_tx = 0;
	if (existing)
		existing[0] = '\0';
	if (epoch <= 0 || !valid_id(candidate))
		return ds_err_set(err, DS_EINVAL, "vote in epoch %lld for '%s': bad epoch or id",
				  (long long)epoch, candidate ? candidate : "");
	pthread_mutex_lock(&s->mu);
	rc = durable_begin(s, "syncing a vote", err);
	if (rc)
		goto out;
	rc = exec(s, "BEGIN IMMEDIATE", "recording a vote", err);
	if (rc)
		goto out;
	in_tx = 1;
	rc = prep(s, "SELECT candidate FROM votes WHERE epoch = ?1", &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, epoch);
	int step = sqlite3_step(st);
	if (step == SQLITE_ROW) {
		char had[STORE_ID_HEX];
		text_col(st, 0, had, sizeof had);
		if (existing)
			ds_strlcpy(existing, had, STORE_ID_HEX);
		if (strcmp(had, candidate) != 0)
			rc = ds_err_set(err, DS_EBUSY, "already voted for %s in epoch %lld", had,
					(long long)epoch);
		goto out; /* rolled back: nothing was written */
	}
	if (step != SQLITE_DONE) {
		rc = db_fail(s, err, "reading a vote");
		goto out;
	}
	sqlite3_finalize(st);
	st = NULL;
	rc = prep(s, "INSERT INTO votes (epoch, candidate, ts) VALUES (?1, ?2, ?3)", &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, epoch);
	sqlite3_bind_text(st, 2, candidate, -1, SQLITE_STATIC);
	sqlite3_bind_int64(st, 3, ts);
	if (sqlite3_step(st) != SQLITE_DONE) {
		rc = db_fail(s, err, "recording a vote");
		goto out;
	}
	sqlite3_finalize(st);
	st = NULL;
	rc = exec(s, "COMMIT", "recording a vote", err);
	if (rc == DS_OK) {
		in_tx = 0;
		if (existing)
			ds_strlcpy(existing, candidate, STORE_ID_HEX);
	}
out:
	sqlite3_finalize(st);
	if (in_tx)
		sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
	durable_end(s);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

int store_vote_last(store *s, int64_t *epoch, char cand[STORE_ID_HEX], ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc;
	*epoch = 0;
	cand[0] = '\0';
	pthread_mutex_lock(&s->mu);
	rc = prep(s, "SELECT epoch, candidate FROM votes ORDER BY epoch DESC LIMIT 1", &st, err);
	if (rc)
		goto out;
	int step = sqlite3_step(st);
	if (step == SQLITE_ROW) {
		*epoch = sqlite3_column_int64(st, 0);
		text_col(st, 1, cand, STORE_ID_HEX);
	} else if (step != SQLITE_DONE) {
		rc = db_fail(s, err, "reading votes");
	}
out:
	sqlite3_finalize(st);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

int store_epoch_max(store *s, int64_t *out, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc;
	*out = 0;
	pthread_mutex_lock(&s->mu);
	rc = prep(s,
		  "SELECT MAX(COALESCE((SELECT MAX(epoch) FROM elections), 0), "
		  "COALESCE((SELECT MAX(epoch) FROM votes), 0))",
		  &st, err);
	if (rc)
		goto out;
	if (sqlite3_step(st) == SQLITE_ROW)
		*out = sqlite3_column_int64(st, 0);
	else
		rc = db_fail(s, err, "reading the highest epoch");
out:
	sqlite3_finalize(st);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

/* ---- shard plans (schema/0004_plans.sql) ---- */

static const char *const plan_statuses[] = {"planned", "launching", "serving", "failed",
					    "stopped", "superseded", NULL};

static int plan_status_ok(const char *st)
{
	for (int i = 0; st && plan_statuses[i]; i++)
		if (strcmp(st, plan_statuses[i]) == 0)
			return 1;
	return 0;
}

/* 1 when text is a JSON object (want_array 0) or an array of integers in
 * [0, world) (want_array 1). */
static int json_text_ok(const char *text, int want_array, int world)
{
	if (!text)
		return 0;
	json_t *j = json_loads(text, JSON_REJECT_DUPLICATES, NULL);
	int ok = j && (want_array ? json_is_array(j) : json_is_object(j));
	if (ok && want_array) {
		size_t i;
		json_t *v;
		json_array_foreach(j, i, v)
		{
			if (!json_is_integer(v) || json_integer_value(v) < 0 ||
			    json_integer_value(v) >= world)
				ok = 0;
		}
		ok = ok && json_array_size(j) > 0;
	}
	json_decref(j);
	return ok;
}

static int plan_check(const store_plan *p, ds_err *err)
{
	if (p->epoch <= 0)
		return ds_err_set(err, DS_EINVAL, "plan: epoch %lld is not a positive election epoch",
				  (long long)p->epoch);
	if (!p->model || !p->model[0])
		return ds_err_set(err, DS_EINVAL, "plan: no model path");
	if (p->tp < 1 || p->pp < 1 || p->ep < 1 || (int64_t)p->tp * p->pp * p->ep != p->world_size)
		return ds_err_set(err, DS_EINVAL, "plan: tp %d x pp %d x ep %d is not its world size %d",
				  p->tp, p->pp, p->ep, p->world_size);
	if (p->head_id[0] && !valid_id(p->head_id))
		return ds_err_set(err, DS_EINVAL, "plan: head id '%s' is not 32 hex digits", p->head_id);
	if (!plan_status_ok(p->status))
		return ds_err_set(err, DS_EINVAL, "plan: status '%s' is not one of planned, launching, "
				  "serving, failed, stopped, superseded", p->status);
	if (!json_text_ok(p->document, 0, 0))
		return ds_err_set(err, DS_EINVAL, "plan: the document is not a JSON object");
	if (!p->ranks)
		return ds_err_set(err, DS_EINVAL, "plan: no ranks");
	for (int r = 0; r < p->world_size; r++) {
		const store_plan_rank *k = &p->ranks[r];
		if (k->rank != r)
			return ds_err_set(err, DS_EINVAL, "plan: rank row %d says rank %d (rows must be "
					  "ranks 0..%d in order)", r, k->rank, p->world_size - 1);
		if (!valid_id(k->node_id))
			return ds_err_set(err, DS_EINVAL, "plan: rank %d: node id '%s' is not 32 hex "
					  "digits", r, k->node_id);
		if (k->device < -1 || k->stage < 0 || k->stage >= p->pp || k->tp_rank < 0 ||
		    k->tp_rank >= p->tp || k->ep_rank < 0 || k->ep_rank >= p->ep)
			return ds_err_set(err, DS_EINVAL, "plan: rank %d: device %d, stage %d, tp rank "
					  "%d, ep rank %d outside the plan %dx%dx%d", r, k->device,
					  k->stage, k->tp_rank, k->ep_rank, p->tp, p->pp, p->ep);
		if (k->layer_first < 0 || k->layer_count < 0 || k->expert_first < 0 ||
		    k->expert_count < 0)
			return ds_err_set(err, DS_EINVAL, "plan: rank %d: a negative layer or expert "
					  "range", r);
		if (!json_text_ok(k->env, 0, 0))
			return ds_err_set(err, DS_EINVAL, "plan: rank %d: env is not a JSON object", r);
	}
	for (size_t i = 0; i < p->n_groups; i++) {
		const store_comm_group *g = &p->groups[i];
		if (!g->name[0] || !json_text_ok(g->ranks, 1, p->world_size))
			return ds_err_set(err, DS_EINVAL, "plan: comm group '%s': ranks must be a "
					  "non-empty JSON array of world ranks 0..%d", g->name,
					  p->world_size - 1);
	}
	return DS_OK;
}

/* The newest plan's epoch (0 when there is none); under s->mu. */
static int plan_epoch_newest(store *s, int64_t *out, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc = prep(s, "SELECT COALESCE(MAX(epoch), 0) FROM plans", &st, err);
	if (rc)
		return rc;
	if (sqlite3_step(st) == SQLITE_ROW)
		*out = sqlite3_column_int64(st, 0);
	else
		rc = db_fail(s, err, "reading the plans' epoch");
	sqlite3_finalize(st);
	return rc;
}

/* Runs one prepared statement to completion; under s->mu. */
static int step_done(store *s, sqlite3_stmt *st, const char *what, ds_err *err)
{
	return sqlite3_step(st) == SQLITE_DONE ? DS_OK : db_fail(s, err, what);
}

static void bind_known(sqlite3_stmt *st, int i, int64_t v)
{
	if (v >= 0)
		sqlite3_bind_int64(st, i, v);
	else
		sqlite3_bind_null(st, i);
}

int store_plan_insert(store *s, store_plan *p, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc = plan_check(p, err), in_tx = 0;
	if (rc)
		return rc;
	pthread_mutex_lock(&s->mu);
	rc = exec(s, "BEGIN IMMEDIATE", "writing a plan", err);
	if (rc)
		goto out;
	in_tx = 1;
	int64_t newest = 0;
	rc = plan_epoch_newest(s, &newest, err);
	if (rc)
		goto out;
	if (p->epoch < newest) {
		rc = ds_err_set(err, DS_EPERM, "plan of epoch %lld refused: the newest plan is of epoch "
				"%lld (a newer head planned since)", (long long)p->epoch,
				(long long)newest);
		goto out;
	}
	rc = prep(s, "UPDATE plans SET status = 'superseded', status_at = ?1 "
		  "WHERE status IN ('planned', 'launching', 'serving')", &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, p->created);
	if ((rc = step_done(s, st, "superseding the plans", err)))
		goto out;
	sqlite3_finalize(st);
	rc = prep(s,
		  "INSERT INTO plans (epoch, created, head_id, model, tp, pp, ep, world_size, max_ctx, "
		  "max_seqs, status, status_at, reason, document) "
		  "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
		  &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, p->epoch);
	sqlite3_bind_int64(st, 2, p->created);
	bind_str(st, 3, p->head_id);
	sqlite3_bind_text(st, 4, p->model, -1, SQLITE_STATIC);
	sqlite3_bind_int(st, 5, p->tp);
	sqlite3_bind_int(st, 6, p->pp);
	sqlite3_bind_int(st, 7, p->ep);
	sqlite3_bind_int(st, 8, p->world_size);
	bind_count(st, 9, p->max_ctx);
	bind_count(st, 10, p->max_seqs);
	sqlite3_bind_text(st, 11, p->status, -1, SQLITE_STATIC);
	sqlite3_bind_int64(st, 12, p->status_at ? p->status_at : p->created);
	bind_str(st, 13, p->reason);
	sqlite3_bind_text(st, 14, p->document, -1, SQLITE_STATIC);
	if ((rc = step_done(s, st, "writing a plan", err)))
		goto out;
	sqlite3_finalize(st);
	int64_t id = sqlite3_last_insert_rowid(s->db);
	rc = prep(s,
		  "INSERT INTO plan_ranks (plan_id, rank, node_id, node_name, device, stage, tp_rank, "
		  "ep_rank, layer_first, layer_count, expert_first, expert_count, weight_bytes, "
		  "kv_bytes, env) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, "
		  "?15)",
		  &st, err);
	if (rc)
		goto out;
	for (int r = 0; r < p->world_size; r++) {
		const store_plan_rank *k = &p->ranks[r];
		sqlite3_reset(st);
		sqlite3_bind_int64(st, 1, id);
		sqlite3_bind_int(st, 2, k->rank);
		sqlite3_bind_text(st, 3, k->node_id, -1, SQLITE_STATIC);
		bind_str(st, 4, k->node_name);
		sqlite3_bind_int(st, 5, k->device);
		sqlite3_bind_int(st, 6, k->stage);
		sqlite3_bind_int(st, 7, k->tp_rank);
		sqlite3_bind_int(st, 8, k->ep_rank);
		sqlite3_bind_int(st, 9, k->layer_first);
		sqlite3_bind_int(st, 10, k->layer_count);
		sqlite3_bind_int(st, 11, k->expert_first);
		sqlite3_bind_int(st, 12, k->expert_count);
		bind_known(st, 13, k->weight_bytes);
		bind_known(st, 14, k->kv_bytes);
		sqlite3_bind_text(st, 15, k->env, -1, SQLITE_STATIC);
		if ((rc = step_done(s, st, "writing a plan's ranks", err)))
			goto out;
	}
	sqlite3_finalize(st);
	rc = prep(s, "INSERT INTO comm_groups (plan_id, name, ranks) VALUES (?1, ?2, ?3)", &st, err);
	if (rc)
		goto out;
	for (size_t i = 0; i < p->n_groups; i++) {
		sqlite3_reset(st);
		sqlite3_bind_int64(st, 1, id);
		sqlite3_bind_text(st, 2, p->groups[i].name, -1, SQLITE_STATIC);
		sqlite3_bind_text(st, 3, p->groups[i].ranks, -1, SQLITE_STATIC);
		if ((rc = step_done(s, st, "writing a plan's comm groups", err)))
			goto out;
	}
	sqlite3_finalize(st);
	st = NULL;
	rc = exec(s, "COMMIT", "writing a plan", err);
	if (rc == DS_OK) {
		in_tx = 0;
		p->id = id;
	}
out:
	sqlite3_finalize(st);
	if (in_tx)
		sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

static char *col_dup(sqlite3_stmt *st, int i)
{
	const unsigned char *t = sqlite3_column_text(st, i);
	return strdup(t ? (const char *)t : "");
}

static int64_t col_known(sqlite3_stmt *st, int i)
{
	return sqlite3_column_type(st, i) == SQLITE_NULL ? -1 : sqlite3_column_int64(st, i);
}

void store_plan_free(store_plan *p)
{
	if (!p)
		return;
	for (int r = 0; p->ranks && r < p->world_size; r++)
		free(p->ranks[r].env);
	for (size_t i = 0; p->groups && i < p->n_groups; i++)
		free(p->groups[i].ranks);
	free(p->ranks);
	free(p->groups);
	free(p->model);
	free(p->document);
	memset(p, 0, sizeof *p);
}

/* Reads the ranks and groups of out->id; under s->mu. */
static int plan_parts_get(store *s, store_plan *out, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc = prep(s,
		      "SELECT rank, node_id, node_name, device, stage, tp_rank, ep_rank, layer_first, "
		      "layer_count, expert_first, expert_count, weight_bytes, kv_bytes, env "
		      "FROM plan_ranks WHERE plan_id = ?1 ORDER BY rank",
		      &st, err);
	if (rc)
		return rc;
	sqlite3_bind_int64(st, 1, out->id);
	out->ranks = calloc((size_t)out->world_size, sizeof *out->ranks);
	int n = 0, step;
	while (out->ranks && (step = sqlite3_step(st)) == SQLITE_ROW) {
		if (n >= out->world_size || sqlite3_column_int(st, 0) != n) {
			rc = ds_err_set(err, DS_EFORMAT, "%s: plan %lld: rank rows do not match its world "
					"size %d", s->path, (long long)out->id, out->world_size);
			break;
		}
		store_plan_rank *k = &out->ranks[n++];
		k->rank = sqlite3_column_int(st, 0);
		text_col(st, 1, k->node_id, sizeof k->node_id);
		text_col(st, 2, k->node_name, sizeof k->node_name);
		k->device = sqlite3_column_int(st, 3);
		k->stage = sqlite3_column_int(st, 4);
		k->tp_rank = sqlite3_column_int(st, 5);
		k->ep_rank = sqlite3_column_int(st, 6);
		k->layer_first = sqlite3_column_int(st, 7);
		k->layer_count = sqlite3_column_int(st, 8);
		k->expert_first = sqlite3_column_int(st, 9);
		k->expert_count = sqlite3_column_int(st, 10);
		k->weight_bytes = col_known(st, 11);
		k->kv_bytes = col_known(st, 12);
		k->env = col_dup(st, 13);
	}
	if (!out->ranks)
		rc = ds_err_set(err, DS_ENOMEM, "out of memory");
	else if (!rc && n != out->world_size)
		rc = ds_err_set(err, DS_EFORMAT, "%s: plan %lld has %d rank rows for a world of %d",
				s->path, (long long)out->id, n, out->world_size);
	sqlite3_finalize(st);
	if (rc)
		return rc;
	rc = prep(s, "SELECT name, ranks FROM comm_groups WHERE plan_id = ?1 ORDER BY rowid", &st,
		  err);
	if (rc)
		return rc;
	sqlite3_bind_int64(st, 1, out->id);
	size_t cap = 0;
	while ((step = sqlite3_step(st)) == SQLITE_ROW) {
		if (out->n_groups == cap) {
			size_t nc = cap ? cap * 2 : 8;
			store_comm_group *g = realloc(out->groups, nc * sizeof *g);
			if (!g) {
				rc = ds_err_set(err, DS_ENOMEM, "out of memory");
				break;
			}
			out->groups = g;
			cap = nc;
		}
		store_comm_group *g = &out->groups[out->n_groups++];
		text_col(st, 0, g->name, sizeof g->name);
		g->ranks = col_dup(st, 1);
	}
	sqlite3_finalize(st);
	return rc;
}

int store_plan_get(store *s, int64_t id, store_plan *out, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	memset(out, 0, sizeof *out);
	pthread_mutex_lock(&s->mu);
	int rc = prep(s,
		      "SELECT id, epoch, created, head_id, model, tp, pp, ep, world_size, max_ctx, "
		      "max_seqs, status, status_at, reason, document FROM plans "
		      "WHERE ?1 = 0 OR id = ?1 ORDER BY id DESC LIMIT 1",
		      &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, id);
	int step = sqlite3_step(st);
	if (step == SQLITE_DONE) {
		rc = id ? ds_err_set(err, DS_ENOTFOUND, "no plan of version %lld", (long long)id)
			: ds_err_set(err, DS_ENOTFOUND, "no plan yet");
		goto out;
	}
	if (step != SQLITE_ROW) {
		rc = db_fail(s, err, "reading a plan");
		goto out;
	}
	out->id = sqlite3_column_int64(st, 0);
	out->epoch = sqlite3_column_int64(st, 1);
	out->created = sqlite3_column_int64(st, 2);
	text_col(st, 3, out->head_id, sizeof out->head_id);
	out->model = col_dup(st, 4);
	out->tp = sqlite3_column_int(st, 5);
	out->pp = sqlite3_column_int(st, 6);
	out->ep = sqlite3_column_int(st, 7);
	out->world_size = sqlite3_column_int(st, 8);
	out->max_ctx = (int)col_known(st, 9);
	out->max_seqs = (int)col_known(st, 10);
	text_col(st, 11, out->status, sizeof out->status);
	out->status_at = sqlite3_column_int64(st, 12);
	text_col(st, 13, out->reason, sizeof out->reason);
	out->document = col_dup(st, 14);
	sqlite3_finalize(st);
	st = NULL;
	if (!out->model || !out->document)
		rc = ds_err_set(err, DS_ENOMEM, "out of memory");
	else if (out->world_size < 1 || out->world_size > 1 << 20)
		rc = ds_err_set(err, DS_EFORMAT, "%s: plan %lld: world size %d", s->path,
				(long long)out->id, out->world_size);
	else
		rc = plan_parts_get(s, out, err);
out:
	sqlite3_finalize(st);
	pthread_mutex_unlock(&s->mu);
	if (rc)
		store_plan_free(out);
	return rc;
}

int store_plan_set_status(store *s, int64_t id, int64_t epoch, const char *status,
			  const char *reason, int64_t now, ds_err *err)
{
	sqlite3_stmt *st = NULL;
	int rc, in_tx = 0;
	if (!plan_status_ok(status))
		return ds_err_set(err, DS_EINVAL, "plan status '%s' is not one of planned, launching, "
				  "serving, failed, stopped, superseded", status ? status : "");
	pthread_mutex_lock(&s->mu);
	rc = exec(s, "BEGIN IMMEDIATE", "setting a plan's status", err);
	if (rc)
		goto out;
	in_tx = 1;
	rc = prep(s, "SELECT epoch FROM plans WHERE id = ?1", &st, err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, id);
	int step = sqlite3_step(st);
	if (step != SQLITE_ROW) {
		rc = step == SQLITE_DONE ? ds_err_set(err, DS_ENOTFOUND, "no plan of version %lld",
						      (long long)id)
					 : db_fail(s, err, "reading a plan");
		goto out;
	}
	int64_t plan_epoch = sqlite3_column_int64(st, 0);
	sqlite3_finalize(st);
	st = NULL;
	if (epoch < plan_epoch) {
		rc = ds_err_set(err, DS_EPERM, "plan %lld is of epoch %lld: a head of epoch %lld may "
				"not change it", (long long)id, (long long)plan_epoch,
				(long long)epoch);
		goto out;
	}
	rc = prep(s, "UPDATE plans SET status = ?2, reason = ?3, status_at = ?4 WHERE id = ?1", &st,
		  err);
	if (rc)
		goto out;
	sqlite3_bind_int64(st, 1, id);
	sqlite3_bind_text(st, 2, status, -1, SQLITE_STATIC);
	bind_str(st, 3, reason);
	sqlite3_bind_int64(st, 4, now);
	if ((rc = step_done(s, st, "setting a plan's status", err)))
		goto out;
	sqlite3_finalize(st);
	st = NULL;
	rc = exec(s, "COMMIT", "setting a plan's status", err);
	if (rc == DS_OK)
		in_tx = 0;
out:
	sqlite3_finalize(st);
	if (in_tx)
		sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

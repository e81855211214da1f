/*
 * test_keys.c - unit tests of agent/store/store (SQLite, migrations) and agent/keys
 * (key creation, hashing, authentication, limit windows, secret files).
 * Every test works in its own mkdtemp directory.  Names start with store_ or
 * keys_ (run them with `tests/unit store_` / `tests/unit keys_`).
 */
#include "agent/auth/keys.h"
#include "agent/store/store.h"
#include "agent/store/store_impl.h"
#include "tests/unit/unit.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sodium.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- helpers ---------------------------------------------------------------- */

typedef struct fixture {
	char *dir;
	store *st;
	keys_svc *k;
} fixture;

static int fx_open(fixture *f)
{
	ds_err e = {0};
	f->st = store_open(f->dir, &e);
	if (!f->st) {
		ut_fail(__FILE__, __LINE__, "store_open: %s", e.msg);
		return -1;
	}
	f->k = keys_new(f->st, f->dir, &e);
	if (!f->k) {
		ut_fail(__FILE__, __LINE__, "keys_new: %s", e.msg);
		return -1;
	}
	return 0;
}

static void fx_close(fixture *f)
{
	keys_free(f->k);
	store_close(f->st);
	f->k = NULL;
	f->st = NULL;
}

static int fx_init(fixture *f)
{
	memset(f, 0, sizeof *f);
	f->dir = ut_tmpdir_new("keys");
	if (!f->dir)
		return -1;
	return fx_open(f);
}

static void fx_free(fixture *f)
{
	fx_close(f);
	ut_tmpdir_free(f->dir);
	f->dir = NULL;
}

static void path_in(const fixture *f, const char *name, char *out, size_t n)
{
	snprintf(out, n, "%s/%s", f->dir, name);
}

static int mode_of(const char *path)
{
	struct stat st;
	return stat(path, &st) == 0 ? (int)(st.st_mode & 07777) : -1;
}

static int make_key(fixture *f, const char *name, int64_t rpm, int64_t tpm, int64_t conc,
		    keys_created *out)
{
	keys_params p = {name, 0, rpm, tpm, conc};
	ds_err e = {0};
	int rc = keys_create(f->k, &p, out, &e);
	if (rc)
		ut_fail(__FILE__, __LINE__, "keys_create(%s): %s", name, e.msg);
	return rc;
}

static char *read_all(const char *path, size_t *n)
{
	FILE *fp = fopen(path, "rb");
	*n = 0;
	if (!fp)
		return NULL;
	fseek(fp, 0, SEEK_END);
	long sz = ftell(fp);
	fseek(fp, 0, SEEK_SET);
	char *b = malloc((size_t)sz + 1);
	if (b && fread(b, 1, (size_t)sz, fp) == (size_t)sz) {
		*n = (size_t)sz;
		b[sz] = '\0';
	}
	fclose(fp);
	return b;
}

/* Does any file of dir contain needle (as raw bytes)? */
static int dir_contains(const char *dir, const char *needle)
{
	DIR *d = opendir(dir);
	struct dirent *ent;
	int found = 0;
	size_t nl = strlen(needle);
	while (d && (ent = readdir(d))) {
		if (ent->d_name[0] == '.')
			continue;
		char p[1024];
		size_t n;
		snprintf(p, sizeof p, "%s/%s", dir, ent->d_name);
		char *b = read_all(p, &n);
		for (size_t i = 0; b && n >= nl && i <= n - nl && !found; i++)
			found = memcmp(b + i, needle, nl) == 0;
		free(b);
	}
	if (d)
		closedir(d);
	return found;
}

/* Base time for the rate windows: random, with a random fraction. */
static double rand_base(void)
{
	return 1000.0 + (double)(ut_rand_u64() % 1000000) + (double)ut_rand_float(0.0f, 0.9f);
}

/* Admits a request of `seqs` sequences that queue in a waiting queue of
 * queue_cap places (0: they do not queue). */
static int admit(fixture *f, int64_t id, int64_t seqs, int64_t queue_cap, double t, keys_hold *h,
		 keys_denial *d, ds_err *e)
{
	keys_cost c = {.seqs = seqs, .queue_cap = queue_cap};
	return keys_admit(f->k, id, &c, t, h, d, e);
}

/* One request of one sequence that does not queue. */
static int admit1(fixture *f, int64_t id, double t, keys_hold *h, keys_denial *d, ds_err *e)
{
	return admit(f, id, 1, 0, t, h, d, e);
}

/* ---- store ------------------------------------------------------------------ */

TEST(store_migrations_match_schema_dir)
{
	/* Every schema/NNNN_*.sql is embedded, in order, byte for byte. */
	DIR *d = opendir("schema");
	CHECK(d != NULL); /* unit tests run from the repository root */
	if (!d)
		return;
	int files = 0;
	struct dirent *ent;
	while ((ent = readdir(d))) {
		size_t l = strlen(ent->d_name);
		if (l < 9 || strcmp(ent->d_name + l - 4, ".sql") != 0)
			continue;
		files++;
		int v = 0;
		CHECK_EQ(sscanf(ent->d_name, "%4d_", &v), 1);
		const store_migration *m = NULL;
		for (const store_migration *x = store_migrations; x->sql; x++)
			if (x->version == v)
				m = x;
		CHECK(m != NULL);
		if (!m)
			continue;
		char p[512];
		snprintf(p, sizeof p, "schema/%s", ent->d_name);
		CHECK_STR(m->file, p);
		size_t n;
		char *text = read_all(p, &n);
		CHECK(text != NULL);
		if (text)
			CHECK_STR(m->sql, text);
		free(text);
	}
	closedir(d);
	int i = 0;
	for (const store_migration *x = store_migrations; x->sql; x++) {
		CHECK_EQ(x->version, ++i); /* 1, 2, 3 ... without gaps */
	}
	CHECK_EQ(files, i);
	CHECK(files >= 1);
	CHECK_EQ(store_schema_latest(), i);
}

TEST(store_open_creates_dir_and_migrates_once)
{
	char *base = ut_tmpdir_new("keys");
	char dir[600];
	snprintf(dir, sizeof dir, "%s/a/b", base);
	ds_err e = {0};
	store *s = store_open(dir, &e);
	CHECK(s != NULL);
	if (!s) {
		fprintf(stderr, "    %s\n", e.msg);
		ut_tmpdir_free(base);
		return;
	}
	CHECK_EQ(mode_of(dir), 0700);
	CHECK_EQ(store_schema_version(s), store_schema_latest());
	char db[700];
	snprintf(db, sizeof db, "%s/dsagent.db", dir);
	CHECK_STR(store_path(s), db);
	CHECK_EQ(mode_of(db), 0600);
	store_key k = {0};
	snprintf(k.name, sizeof k.name, "first");
	snprintf(k.prefix, sizeof k.prefix, "abcdefgh");
	for (int i = 0; i < STORE_HASH_LEN; i++)
		k.hash[i] = (uint8_t)ut_rand_u64();
	k.created = 1700000000;
	CHECK_EQ(store_key_insert(s, &k, &e), DS_OK);
	CHECK(k.id > 0);
	store_close(s);

	/* Opening again applies nothing and keeps the data. */
	s = store_open(dir, &e);
	CHECK(s != NULL);
	if (s) {
		CHECK_EQ(store_schema_version(s), store_schema_latest());
		store_key *rows = NULL;
		size_t n = 0;
		CHECK_EQ(store_key_list(s, 1, &rows, &n, &e), DS_OK);
		CHECK_EQ(n, 1);
		if (n == 1) {
			CHECK_STR(rows[0].name, "first");
			CHECK(memcmp(rows[0].hash, k.hash, STORE_HASH_LEN) == 0);
			CHECK_EQ(rows[0].expires, 0);
			CHECK_EQ(rows[0].rpm, 0);
		}
		free(rows);
		/* WAL is on. */
		sqlite3 *raw = NULL;
		CHECK_EQ(sqlite3_open(db, &raw), SQLITE_OK);
		sqlite3_stmt *q = NULL;
		CHECK_EQ(sqlite3_prepare_v2(raw, "PRAGMA journal_mode", -1, &q, NULL), SQLITE_OK);
		CHECK_EQ(sqlite3_step(q), SQLITE_ROW);
		CHECK_STR((const char *)sqlite3_column_text(q, 0), "wal");
		sqlite3_finalize(q);
		sqlite3_close(raw);
	}
	store_close(s);
	ut_tmpdir_free(base);
}

TEST(store_refuses_newer_schema)
{
	char *dir = ut_tmpdir_new("keys");
	ds_err e = {0};
	store *s = store_open(dir, &e);
	CHECK(s != NULL);
	store_close(s);
	char db[600];
	snprintf(db, sizeof db, "%s/dsagent.db", dir);
	sqlite3 *raw = NULL;
	char sql[64];
	int newer = store_schema_latest() + 1 + (int)(ut_rand_u64() % 50);
	snprintf(sql, sizeof sql, "PRAGMA user_version = %d", newer);
	CHECK_EQ(sqlite3_open(db, &raw), SQLITE_OK);
	CHECK_EQ(sqlite3_exec(raw, sql, NULL, NULL, NULL), SQLITE_OK);
	sqlite3_close(raw);

	s = store_open(dir, &e);
	CHECK(s == NULL);
	CHECK_EQ(e.code, DS_EUNSUPPORTED);
	CHECK(strstr(e.msg, "newer dsagent") != NULL);
	char want[32];
	snprintf(want, sizeof want, "version %d", newer);
	CHECK(strstr(e.msg, want) != NULL);
	store_close(s);

	/* Left as it was. */
	CHECK_EQ(sqlite3_open(db, &raw), SQLITE_OK);
	sqlite3_stmt *q = NULL;
	sqlite3_prepare_v2(raw, "PRAGMA user_version", -1, &q, NULL);
	CHECK_EQ(sqlite3_step(q), SQLITE_ROW);
	CHECK_EQ(sqlite3_column_int(q, 0), newer);
	sqlite3_finalize(q);
	sqlite3_close(raw);
	ut_tmpdir_free(dir);
}

/* A database at version 2 with membership events (REAL seconds) migrates to
 * 3: the rows stay, ts becomes INTEGER seconds. */
TEST(store_migrates_member_event_times_to_integer_seconds)
{
	char *dir = ut_tmpdir_new("keys");
	if (!dir)
		return;
	char db[600];
	snprintf(db, sizeof db, "%s/dsagent.db", dir);
	sqlite3 *raw = NULL;
	CHECK_EQ(sqlite3_open(db, &raw), SQLITE_OK);
	for (int i = 0; store_migrations[i].version && store_migrations[i].version <= 2; i++)
		CHECK_EQ(sqlite3_exec(raw, store_migrations[i].sql, NULL, NULL, NULL), SQLITE_OK);
	CHECK_EQ(sqlite3_exec(raw, "PRAGMA user_version = 2", NULL, NULL, NULL), SQLITE_OK);
	double t = 1.7e9 + (double)(ut_rand_u64() % 1000000) + 0.75;
	char sql[256];
	snprintf(sql, sizeof sql,
		 "INSERT INTO member_events (ts, node_id, name, kind, state) "
		 "VALUES (%.3f, 'n1', 'a', 'member_join', 'alive')", t);
	CHECK_EQ(sqlite3_exec(raw, sql, NULL, NULL, NULL), SQLITE_OK);
	sqlite3_close(raw);

	ds_err e = {0};
	store *s = store_open(dir, &e);
	CHECK(s != NULL);
	if (s)
		CHECK_EQ(store_schema_version(s), store_schema_latest());
	store_close(s);

	CHECK_EQ(sqlite3_open(db, &raw), SQLITE_OK);
	sqlite3_stmt *q = NULL;
	sqlite3_prepare_v2(raw, "SELECT typeof(ts), ts, name FROM member_events", -1, &q, NULL);
	CHECK_EQ(sqlite3_step(q), SQLITE_ROW);
	CHECK_STR((const char *)sqlite3_column_text(q, 0), "integer");
	CHECK_EQ(sqlite3_column_int64(q, 1), (int64_t)t);
	CHECK_STR((const char *)sqlite3_column_text(q, 2), "a");
	CHECK_EQ(sqlite3_step(q), SQLITE_DONE);
	sqlite3_finalize(q);
	sqlite3_close(raw);
	ut_tmpdir_free(dir);
}

TEST(store_refuses_a_file_that_is_not_a_database)
{
	char *dir = ut_tmpdir_new("keys");
	char db[600];
	snprintf(db, sizeof db, "%s/dsagent.db", dir);
	FILE *fp = fopen(db, "wb");
	for (int i = 0; i < 4096; i++)
		fputc((int)(ut_rand_u64() & 0xff) | 1, fp);
	fclose(fp);
	ds_err e = {0};
	store *s = store_open(dir, &e);
	CHECK(s == NULL);
	CHECK(e.code != DS_OK);
	CHECK(strstr(e.msg, db) != NULL);
	store_close(s);
	ut_tmpdir_free(dir);
}

TEST(store_usage_sums_days_and_events_list)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	keys_created a;
	CHECK_EQ(make_key(&f, "usage", 0, 0, 0, &a), DS_OK);
	ds_err e = {0};
	int64_t day1 = 1750000000 + (int64_t)(ut_rand_u64() % 1000), day2 = day1 + 86400;
	int64_t p1 = 1 + (int64_t)(ut_rand_u64() % 1000), c1 = 1 + (int64_t)(ut_rand_u64() % 1000);
	int64_t p2 = 1 + (int64_t)(ut_rand_u64() % 1000), c2 = 1 + (int64_t)(ut_rand_u64() % 1000);
	CHECK_EQ(store_key_usage_add(f.st, a.info.id, day1, p1, c1, &e), DS_OK);
	CHECK_EQ(store_key_usage_add(f.st, a.info.id, day1 + 5, p2, c2, &e), DS_OK);
	CHECK_EQ(store_key_usage_add(f.st, a.info.id, day2, p1, c2, &e), DS_OK);
	CHECK_EQ(store_key_usage_add(f.st, 424242, day2, 1, 1, &e), DS_ENOTFOUND);
	store_key r;
	CHECK_EQ(store_key_get(f.st, a.info.id, &r, &e), DS_OK);
	CHECK_EQ(r.requests, 3);
	CHECK_EQ(r.prompt_tokens, p1 + p2 + p1);
	CHECK_EQ(r.completion_tokens, c1 + c2 + c2);
	CHECK_EQ(r.last_used, day2);
	CHECK_EQ(store_key_get(f.st, 999999, &r, &e), DS_ENOTFOUND);

	/* Two rows: one per day. */
	sqlite3 *raw = NULL;
	sqlite3_open(store_path(f.st), &raw);
	sqlite3_stmt *q = NULL;
	sqlite3_prepare_v2(raw, "SELECT COUNT(*) FROM key_usage", -1, &q, NULL);
	CHECK_EQ(sqlite3_step(q), SQLITE_ROW);
	CHECK_EQ(sqlite3_column_int(q, 0), 2);
	sqlite3_finalize(q);
	sqlite3_close(raw);

	CHECK_EQ(keys_revoke(f.k, a.info.id, NULL, &e), DS_OK);
	store_event *ev = NULL;
	size_t n = 0;
	CHECK_EQ(store_event_list(f.st, 0, 10, &ev, &n, &e), DS_OK);
	CHECK_EQ(n, 2);
	if (n == 2) {
		CHECK_STR(ev[0].kind, "key.created");
		CHECK_STR(ev[1].kind, "key.revoked");
		CHECK(ev[0].detail && strstr(ev[0].detail, "\"name\":\"usage\""));
		CHECK(ev[0].detail && !strstr(ev[0].detail, a.key + 4));
		CHECK(ev[1].id > ev[0].id);
	}
	store_events_free(ev, n);
	CHECK_EQ(store_event_list(f.st, 1 << 30, 10, &ev, &n, &e), DS_OK);
	CHECK_EQ(n, 0);
	fx_free(&f);
}

/* ---- keys: creation, listing, revocation ------------------------------------ */

TEST(keys_create_format_list_and_revoke)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	ds_err e = {0};
	keys_created a, b;
	int64_t rpm = 1 + (int64_t)(ut_rand_u64() % 100), tpm = 100 + (int64_t)(ut_rand_u64() % 1000);
	keys_params pa = {"ci-bot.1", 30, rpm, tpm, 4};
	time_t before = time(NULL);
	CHECK_EQ(keys_create(f.k, &pa, &a, &e), DS_OK);
	CHECK_EQ(make_key(&f, "Other_key", 0, 0, 0, &b), DS_OK);

	/* dsk- + 43 URL-safe base64 characters = 32 bytes */
	CHECK_EQ(strlen(a.key), KEYS_TEXT_LEN);
	CHECK(strncmp(a.key, "dsk-", 4) == 0);
	CHECK_EQ(strspn(a.key + 4, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"),
		 43);
	unsigned char raw[64];
	size_t rawlen = 0;
	CHECK_EQ(sodium_base642bin(raw, sizeof raw, a.key + 4, 43, NULL, &rawlen, NULL,
				   sodium_base64_VARIANT_URLSAFE_NO_PADDING),
		 0);
	CHECK_EQ(rawlen, 32);
	CHECK(strcmp(a.key, b.key) != 0);
	CHECK(strncmp(a.info.prefix, a.key + 4, 8) == 0 && strlen(a.info.prefix) == 8);
	CHECK(a.info.id > 0 && b.info.id > a.info.id);
	CHECK(a.info.created >= before && a.info.created <= time(NULL));
	CHECK_EQ(a.info.expires, a.info.created + 30 * 86400);

	store_key *rows = NULL;
	size_t n = 0;
	CHECK_EQ(keys_list(f.k, &rows, &n, &e), DS_OK);
	CHECK_EQ(n, 2);
	if (n == 2) {
		CHECK_EQ(rows[0].id, a.info.id);
		CHECK_STR(rows[0].name, "ci-bot.1");
		CHECK_STR(rows[0].prefix, a.info.prefix);
		CHECK_EQ(rows[0].rpm, rpm);
		CHECK_EQ(rows[0].tpm, tpm);
		CHECK_EQ(rows[0].max_concurrency, 4);
		CHECK_EQ(rows[0].revoked_at, 0);
		CHECK_EQ(rows[0].last_used, 0);
		CHECK_EQ(rows[1].expires, 0);
	}
	free(rows);
	CHECK_EQ(keys_count(f.k), 2);

	/* Names: format, and unique among unrevoked keys. */
	keys_created x;
	keys_params bad = {"ci-bot.1", 0, 0, 0, 0};
	CHECK_EQ(keys_create(f.k, &bad, &x, &e), DS_EBUSY);
	CHECK(strstr(e.msg, "ci-bot.1") != NULL);
	CHECK_EQ(x.key[0], '\0');
	const char *bad_names[] = {"", "has space", "slash/", "ünï", "x\n",
				   "0123456789012345678901234567890123456789012345678901234567890123"
				   "4"};
	for (size_t i = 0; i < sizeof bad_names / sizeof bad_names[0]; i++) {
		bad.name = bad_names[i];
		CHECK_EQ(keys_create(f.k, &bad, &x, &e), DS_EINVAL);
		CHECK(strstr(e.msg, "'name'") != NULL);
	}
	bad.name = NULL;
	CHECK_EQ(keys_create(f.k, &bad, &x, &e), DS_EINVAL);
	keys_params neg = {"neg", 0, -1, 0, 0};
	CHECK_EQ(keys_create(f.k, &neg, &x, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "'rpm'") != NULL);
	keys_params far = {"far", KEYS_MAX_EXPIRES_DAYS + 1, 0, 0, 0};
	CHECK_EQ(keys_create(f.k, &far, &x, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "'expires_days'") != NULL);
	keys_params longname = {"0123456789012345678901234567890123456789012345678901234567890123",
				0, 0, 0, 0};
	CHECK_EQ(keys_create(f.k, &longname, &x, &e), DS_OK); /* 64 is allowed */

	/* Revoke: at once, idempotent, unknown id. */
	store_key r;
	CHECK_EQ(keys_revoke(f.k, a.info.id, &r, &e), DS_OK);
	CHECK(r.revoked_at >= a.info.created);
	int64_t first = r.revoked_at;
	CHECK_EQ(keys_revoke(f.k, a.info.id, &r, &e), DS_OK);
	CHECK_EQ(r.revoked_at, first);
	CHECK_EQ(keys_revoke(f.k, 987654, NULL, &e), DS_ENOTFOUND);
	CHECK(strstr(e.msg, "987654") != NULL);
	CHECK_EQ(keys_count(f.k), 2);
	/* The name is free again once revoked. */
	keys_created again;
	CHECK_EQ(make_key(&f, "ci-bot.1", 0, 0, 0, &again), DS_OK);
	CHECK_EQ(keys_list(f.k, &rows, &n, &e), DS_OK);
	CHECK_EQ(n, 4);
	free(rows);
	fx_free(&f);
}

TEST(keys_hash_is_keyed_and_key_text_never_stored)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	keys_created a;
	CHECK_EQ(make_key(&f, "secret-test", 5, 0, 0, &a), DS_OK);
	/* Exercise the other writes too, then look at every file's bytes. */
	ds_err e = {0};
	keys_identity who;
	CHECK_EQ(keys_auth(f.k, a.key, time(NULL), &who, &e), DS_OK);
	keys_hold h;
	CHECK_EQ(admit1(&f, who.id, 10.0, &h, NULL, &e), DS_OK);
	CHECK_EQ(keys_finish(f.k, &h, 10.5, 7, 9, &e), DS_OK);

	/* hash = BLAKE2b-256(key = keys.secret, message = key text), recomputed here */
	char sp[600];
	path_in(&f, "keys.secret", sp, sizeof sp);
	size_t sn = 0;
	char *secret = read_all(sp, &sn);
	CHECK_EQ(sn, 32);
	CHECK_EQ(mode_of(sp), 0600);
	unsigned char want[32];
	crypto_generichash(want, 32, (const unsigned char *)a.key, strlen(a.key),
			   (const unsigned char *)secret, 32);
	CHECK(memcmp(want, a.info.hash, 32) == 0);
	unsigned char unkeyed[32];
	crypto_generichash(unkeyed, 32, (const unsigned char *)a.key, strlen(a.key), NULL, 0);
	CHECK(memcmp(unkeyed, a.info.hash, 32) != 0);
	free(secret);

	char probe[16];
	memcpy(probe, a.key + 4 + 8, 12); /* a piece past the stored prefix */
	probe[12] = '\0';
	CHECK(!dir_contains(f.dir, a.key));
	CHECK(!dir_contains(f.dir, a.key + 4));
	CHECK(!dir_contains(f.dir, probe));
	fx_close(&f); /* checkpoints the WAL into the main file */
	CHECK(!dir_contains(f.dir, a.key + 4));
	CHECK(!dir_contains(f.dir, probe));
	CHECK(dir_contains(f.dir, a.info.prefix)); /* the prefix is stored, as designed */
	fx_free(&f);
}

/* ---- keys: authentication ---------------------------------------------------- */

TEST(keys_auth_bearer_variants_wrong_revoked_expired)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	ds_err e = {0};
	keys_created a, b, x;
	CHECK_EQ(make_key(&f, "alpha", 0, 0, 0, &a), DS_OK);
	CHECK_EQ(make_key(&f, "beta", 0, 0, 0, &b), DS_OK);
	keys_params ep = {"short-lived", 1, 0, 0, 0};
	CHECK_EQ(keys_create(f.k, &ep, &x, &e), DS_OK);
	int64_t now = (int64_t)time(NULL);
	keys_identity who;
	char h[256];

	/* before and after the key */
	const char *forms[][2] = {{"Bearer ", ""}, {"bearer ", ""}, {"BEARER \t ", "  "},
				  {"", ""},	     {"  ", "\r\n"}, {"bEaReR ", ""}};
	for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
		snprintf(h, sizeof h, "%s%s%s", forms[i][0], b.key, forms[i][1]);
		CHECK_EQ(keys_auth(f.k, h, now, &who, &e), DS_OK);
		CHECK_EQ(who.id, b.info.id);
		CHECK_STR(who.name, "beta");
		CHECK_EQ(who.fail, KEYS_AUTH_OK);
	}
	snprintf(h, sizeof h, "Bearer %s", a.key);
	CHECK_EQ(keys_auth(f.k, h, now, &who, &e), DS_OK);
	CHECK_EQ(who.id, a.info.id);

	const char *missing[] = {NULL, "", "   ", "Bearer", "Bearer   ", "bearer\t"};
	for (size_t i = 0; i < sizeof missing / sizeof missing[0]; i++) {
		CHECK_EQ(keys_auth(f.k, missing[i], now, &who, &e), DS_EAUTH);
		CHECK_EQ(who.fail, KEYS_AUTH_MISSING);
	}

	/* Wrong keys: one character changed anywhere, a random well-formed key,
	 * another scheme, the key without its dsk- prefix, a huge token. */
	for (int t = 0; t < 8; t++) {
		char k2[KEYS_TEXT_SIZE];
		memcpy(k2, a.key, sizeof k2);
		size_t pos = 4 + (size_t)(ut_rand_u64() % 43);
		k2[pos] = k2[pos] == 'A' ? 'B' : 'A';
		snprintf(h, sizeof h, "Bearer %s", k2);
		CHECK_EQ(keys_auth(f.k, h, now, &who, &e), DS_EAUTH);
		CHECK_EQ(who.fail, KEYS_AUTH_INVALID);
		CHECK(strstr(e.msg, k2) == NULL);
	}
	snprintf(h, sizeof h, "Basic %s", a.key);
	CHECK_EQ(keys_auth(f.k, h, now, &who, &e), DS_EAUTH);
	CHECK_EQ(who.fail, KEYS_AUTH_INVALID);
	CHECK_EQ(keys_auth(f.k, a.key + 4, now, &who, &e), DS_EAUTH);
	CHECK_EQ(who.fail, KEYS_AUTH_INVALID);
	char big[2048];
	memset(big, 'k', sizeof big - 1);
	big[sizeof big - 1] = '\0';
	CHECK_EQ(keys_auth(f.k, big, now, &who, &e), DS_EAUTH);
	CHECK_EQ(who.fail, KEYS_AUTH_INVALID);

	/* Expiry: valid until created + 1 day. */
	CHECK_EQ(keys_auth(f.k, x.key, now, &who, &e), DS_OK);
	CHECK_EQ(keys_auth(f.k, x.key, x.info.expires - 1, &who, &e), DS_OK);
	CHECK_EQ(keys_auth(f.k, x.key, x.info.expires, &who, &e), DS_EAUTH);
	CHECK_EQ(who.fail, KEYS_AUTH_EXPIRED);
	CHECK(strstr(e.msg, "expired") != NULL);
	CHECK_EQ(keys_auth(f.k, x.key, now + 2 * 86400, &who, &e), DS_EAUTH);
	CHECK_EQ(who.fail, KEYS_AUTH_EXPIRED);

	/* Revocation takes effect on the next call. */
	CHECK_EQ(keys_revoke(f.k, a.info.id, NULL, &e), DS_OK);
	CHECK_EQ(keys_auth(f.k, a.key, now, &who, &e), DS_EAUTH);
	CHECK_EQ(who.fail, KEYS_AUTH_REVOKED);
	CHECK(strstr(e.msg, "revoked") != NULL && strstr(e.msg, a.key) == NULL);
	keys_hold held;
	CHECK_EQ(admit1(&f, a.info.id, 1.0, &held, NULL, &e), DS_EAUTH);
	CHECK_EQ(held.key_id, 0);
	CHECK_EQ(keys_auth(f.k, b.key, now, &who, &e), DS_OK);
	CHECK_EQ(keys_count(f.k), 2);
	fx_free(&f);
}

TEST(keys_survive_reopen)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	ds_err e = {0};
	keys_created a, b;
	CHECK_EQ(make_key(&f, "kept", 0, 0, 0, &a), DS_OK);
	CHECK_EQ(make_key(&f, "gone", 0, 0, 0, &b), DS_OK);
	CHECK_EQ(keys_revoke(f.k, b.info.id, NULL, &e), DS_OK);
	fx_close(&f);
	CHECK_EQ(fx_open(&f), 0);
	keys_identity who;
	CHECK_EQ(keys_auth(f.k, a.key, time(NULL), &who, &e), DS_OK);
	CHECK_EQ(who.id, a.info.id);
	CHECK_EQ(keys_auth(f.k, b.key, time(NULL), &who, &e), DS_EAUTH);
	CHECK_EQ(who.fail, KEYS_AUTH_REVOKED);
	CHECK_EQ(keys_count(f.k), 1);
	/* New ids keep growing after a reopen. */
	keys_created c;
	CHECK_EQ(make_key(&f, "later", 0, 0, 0, &c), DS_OK);
	CHECK(c.info.id > b.info.id);
	CHECK_EQ(keys_auth(f.k, c.key, time(NULL), &who, &e), DS_OK);
	CHECK_EQ(who.id, c.info.id);
	fx_free(&f);
}

/* ---- keys: limits -------------------------------------------------------------- */

TEST(keys_rpm_sliding_window)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	ds_err e = {0};
	keys_denial d;
	keys_created a;
	keys_hold h;
	int64_t rpm = 3 + (int64_t)(ut_rand_u64() % 5);
	CHECK_EQ(make_key(&f, "rpm", rpm, 0, 0, &a), DS_OK);
	double t0 = rand_base();
	double s0 = (double)(int64_t)t0; /* the second of the first bucket */
	/* rpm - 1 requests in t0's second, one 10 s later */
	for (int64_t i = 0; i < rpm - 1; i++) {
		CHECK_EQ(admit1(&f, a.info.id, t0 + 0.01 * (double)i, &h, &d, &e), DS_OK);
		CHECK_EQ(keys_finish(f.k, &h, t0, 1, 1, &e), DS_OK);
	}
	CHECK_EQ(admit1(&f, a.info.id, t0 + 10, &h, &d, &e), DS_OK);
	CHECK_EQ(keys_finish(f.k, &h, t0 + 10, 1, 1, &e), DS_OK);
	/* full: the first bucket leaves the window at s0 + 60 */
	double t = t0 + 20.3;
	CHECK_EQ(admit1(&f, a.info.id, t, &h, &d, &e), DS_EBUSY);
	CHECK_EQ(h.key_id, 0);
	CHECK_EQ(d.limit, KEYS_LIMIT_RPM);
	CHECK_STR(d.name, "rpm");
	CHECK_EQ(d.value, rpm);
	CHECK_EQ(d.retry_after_s, (int)ceil(s0 + 60 - t));
	CHECK(strstr(e.msg, "requests per minute") != NULL);
	CHECK_EQ(admit1(&f, a.info.id, s0 + 59.99, &h, &d, &e), DS_EBUSY);
	CHECK_EQ(d.retry_after_s, 1);
	/* Denied requests were not counted: at s0 + 60 there is room again. */
	CHECK_EQ(admit1(&f, a.info.id, s0 + 60, &h, &d, &e), DS_OK);
	CHECK_EQ(keys_finish(f.k, &h, s0 + 60, 0, 0, &e), DS_OK);
	/* Now [t0+10, s0+60] holds 2 requests; with rpm - 2 more it is full until
	 * the t0+10 bucket leaves at floor(t0+10) + 60. */
	for (int64_t i = 0; i < rpm - 2; i++) {
		CHECK_EQ(admit1(&f, a.info.id, s0 + 61, &h, &d, &e), DS_OK);
		CHECK_EQ(keys_finish(f.k, &h, s0 + 61, 0, 0, &e), DS_OK);
	}
	CHECK_EQ(admit1(&f, a.info.id, s0 + 62, &h, &d, &e), DS_EBUSY);
	CHECK_EQ(d.retry_after_s, (int)ceil(s0 + 70 - (s0 + 62)));
	/* usage in SQLite counted every finished request */
	store_key r;
	CHECK_EQ(store_key_get(f.st, a.info.id, &r, &e), DS_OK);
	CHECK_EQ(r.requests, rpm + 1 + rpm - 2);
	CHECK_EQ(r.prompt_tokens, rpm);
	CHECK(r.last_used > 0);
	fx_free(&f);
}

TEST(keys_tpm_window_counts_finished_tokens)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	ds_err e = {0};
	keys_denial d;
	keys_created a;
	keys_hold h;
	int64_t tpm = 100 + (int64_t)(ut_rand_u64() % 900);
	CHECK_EQ(make_key(&f, "tpm", 0, tpm, 0, &a), DS_OK);
	double t0 = rand_base();
	double s0 = (double)(int64_t)t0;
	int64_t p1 = tpm / 3, c1 = tpm / 5; /* first request: under the limit */
	CHECK_EQ(admit1(&f, a.info.id, t0, &h, &d, &e), DS_OK);
	CHECK_EQ(keys_finish(f.k, &h, t0, p1, c1, &e), DS_OK);
	CHECK_EQ(admit1(&f, a.info.id, t0 + 30, &h, &d, &e), DS_OK);
	/* second request pushes the window to tpm + 1 */
	CHECK_EQ(keys_finish(f.k, &h, t0 + 30, tpm - p1 - c1, 1, &e), DS_OK);
	double t = t0 + 40;
	CHECK_EQ(admit1(&f, a.info.id, t, &h, &d, &e), DS_EBUSY);
	CHECK_EQ(d.limit, KEYS_LIMIT_TPM);
	CHECK_EQ(d.value, tpm);
	/* dropping the first bucket leaves tpm - p1 - c1 + 1 < tpm */
	CHECK_EQ(d.retry_after_s, (int)ceil(s0 + 60 - t));
	CHECK(strstr(e.msg, "tokens per minute") != NULL);
	CHECK_EQ(admit1(&f, a.info.id, s0 + 60, &h, &d, &e), DS_OK);
	CHECK_EQ(keys_finish(f.k, &h, s0 + 60, 0, 0, &e), DS_OK);
	/* Tokens charged after the fact (a /tokenize of a huge text) fill the
	 * window by themselves until their bucket leaves. */
	CHECK_EQ(admit1(&f, a.info.id, s0 + 200.5, &h, &d, &e), DS_OK);
	CHECK_EQ(keys_finish(f.k, &h, s0 + 200.5, 5 * tpm, 0, &e), DS_OK);
	CHECK_EQ(admit1(&f, a.info.id, s0 + 201, &h, &d, &e), DS_EBUSY);
	CHECK_EQ(d.retry_after_s, 59);
	CHECK_EQ(admit1(&f, a.info.id, s0 + 260, &h, &d, &e), DS_OK);
	CHECK_EQ(keys_finish(f.k, &h, s0 + 260, 0, 0, &e), DS_OK);
	fx_free(&f);
}

TEST(keys_tpm_reserves_at_admission_and_settles_at_finish)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	ds_err e = {0};
	keys_denial d;
	keys_created a;
	keys_hold h1, h2, h3, h4;
	int64_t tpm = 1000;
	CHECK_EQ(make_key(&f, "tpm-res", 0, tpm, 0, &a), DS_OK);
	double t0 = rand_base(), s0 = (double)(int64_t)t0;
	/* a request that could never fit: DS_ERANGE, nothing held */
	CHECK_EQ(admit1(&f, a.info.id, t0, &h1, &d, &e), DS_OK);
	CHECK_EQ(keys_reserve(f.k, &h1, tpm + 1, t0, &d, &e), DS_ERANGE);
	CHECK_EQ(d.limit, KEYS_LIMIT_TPM);
	CHECK_EQ(d.retry_after_s, 0);
	CHECK(strstr(e.msg, "1001 tokens") != NULL && strstr(e.msg, "tpm 1000") != NULL);
	CHECK_EQ(keys_reserve(f.k, &h1, 600, t0, &d, &e), DS_OK);
	CHECK_EQ(h1.reserved, 600);
	/* in parallel: 600 reserved, 500 more do not fit although the window is
	 * empty; only an end frees a reservation, so retry in 1 s */
	CHECK_EQ(admit1(&f, a.info.id, t0, &h2, &d, &e), DS_OK);
	CHECK_EQ(keys_reserve(f.k, &h2, 500, t0, &d, &e), DS_EBUSY);
	CHECK_EQ(d.limit, KEYS_LIMIT_TPM);
	CHECK_EQ(d.retry_after_s, 1);
	CHECK(strstr(e.msg, "600 are reserved") != NULL);
	keys_drop(f.k, &h2);
	CHECK_EQ(h2.key_id, 0);
	CHECK_EQ(admit1(&f, a.info.id, t0, &h2, &d, &e), DS_OK);
	CHECK_EQ(keys_reserve(f.k, &h2, 400, t0, &d, &e), DS_OK); /* exactly tpm */
	/* nothing left: refused at admission, before any tokenizing */
	CHECK_EQ(admit1(&f, a.info.id, t0 + 1, &h3, &d, &e), DS_EBUSY);
	CHECK_EQ(d.limit, KEYS_LIMIT_TPM);
	CHECK_EQ(d.retry_after_s, 1);
	CHECK(strstr(e.msg, "1000 reserved") != NULL);
	/* settling: the first used 100 of its 600 */
	CHECK_EQ(keys_finish(f.k, &h1, t0 + 2, 40, 60, &e), DS_OK);
	CHECK_EQ(h1.key_id, 0);
	CHECK_EQ(admit1(&f, a.info.id, t0 + 2, &h3, &d, &e), DS_OK);
	CHECK_EQ(keys_reserve(f.k, &h3, 500, t0 + 2, &d, &e), DS_OK); /* 100 + 400 + 500 */
	CHECK_EQ(admit1(&f, a.info.id, t0 + 2, &h4, &d, &e), DS_EBUSY);
	CHECK_EQ(keys_finish(f.k, &h2, t0 + 3, 400, 0, &e), DS_OK);
	CHECK_EQ(keys_finish(f.k, &h3, t0 + 3, 450, 50, &e), DS_OK);
	/* window 1000 (100 in t0 + 2's second, 900 in t0 + 3's): 1 token fits
	 * once the first bucket leaves */
	CHECK_EQ(admit1(&f, a.info.id, t0 + 10, &h4, &d, &e), DS_EBUSY);
	CHECK_EQ(d.retry_after_s, (int)ceil((double)(int64_t)(t0 + 2) + 60 - (t0 + 10)));
	/* and 150 only once both have */
	CHECK_EQ(admit1(&f, a.info.id, (double)(int64_t)(t0 + 2) + 60, &h4, &d, &e), DS_OK);
	CHECK_EQ(keys_reserve(f.k, &h4, 150, (double)(int64_t)(t0 + 2) + 60, &d, &e), DS_EBUSY);
	CHECK_EQ(d.retry_after_s, 1);
	CHECK_EQ(keys_reserve(f.k, &h4, 100, (double)(int64_t)(t0 + 2) + 60, &d, &e), DS_OK);
	CHECK_EQ(keys_finish(f.k, &h4, s0 + 100, 1, 1, &e), DS_OK);
	/* usage holds what was used, not what was reserved; drops count nothing */
	store_key r;
	CHECK_EQ(store_key_get(f.st, a.info.id, &r, &e), DS_OK);
	CHECK_EQ(r.requests, 4);
	CHECK_EQ(r.prompt_tokens + r.completion_tokens, 100 + 400 + 500 + 2);
	fx_free(&f);
}

TEST(keys_concurrency_counts_sequences)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	ds_err e = {0};
	keys_denial d;
	keys_created a, u;
	int64_t conc = 2 + (int64_t)(ut_rand_u64() % 4);
	CHECK_EQ(make_key(&f, "conc", 0, 0, conc, &a), DS_OK);
	CHECK_EQ(make_key(&f, "free", 0, 0, 0, &u), DS_OK);
	double t = rand_base();
	keys_hold big, hs[8], one;
	/* more sequences than the limit: never (DS_ERANGE, no Retry-After) */
	CHECK_EQ(admit(&f, a.info.id, conc + 1, 0, t, &big, &d, &e), DS_ERANGE);
	CHECK_EQ(d.limit, KEYS_LIMIT_CONCURRENCY);
	CHECK_STR(d.name, "max_concurrency");
	CHECK_EQ(d.retry_after_s, 0);
	CHECK(strstr(e.msg, "sequences") != NULL);
	/* conc - 1 sequences in one request, then one more fits, then none */
	CHECK_EQ(admit(&f, a.info.id, conc - 1, 0, t, &big, &d, &e), DS_OK);
	CHECK_EQ(big.seqs, conc - 1);
	CHECK_EQ(admit(&f, a.info.id, 2, 0, t, &one, &d, &e), DS_EBUSY);
	CHECK_EQ(d.limit, KEYS_LIMIT_CONCURRENCY);
	CHECK_EQ(d.retry_after_s, 1);
	CHECK_EQ(admit1(&f, a.info.id, t, &one, &d, &e), DS_OK);
	CHECK_EQ(admit1(&f, a.info.id, t + 1, &hs[0], &d, &e), DS_EBUSY);
	CHECK_EQ(keys_finish(f.k, &big, t + 2, 3, 4, &e), DS_OK);
	CHECK_EQ(admit(&f, a.info.id, conc - 1, 0, t + 2, &big, &d, &e), DS_OK);
	CHECK_EQ(admit1(&f, a.info.id, t + 2, &hs[0], &d, &e), DS_EBUSY);
	keys_drop(f.k, &big);
	keys_drop(f.k, &one);
	for (int64_t i = 0; i < conc; i++)
		CHECK_EQ(admit1(&f, a.info.id, t + 3, &hs[i], &d, &e), DS_OK);
	CHECK_EQ(admit1(&f, a.info.id, t + 3, &one, &d, &e), DS_EBUSY);
	for (int64_t i = 0; i < conc; i++)
		CHECK_EQ(keys_finish(f.k, &hs[i], t + 3, 0, 0, &e), DS_OK);
	/* An unlimited key admits anything (in flight, per minute). */
	for (int i = 0; i < 500; i++) {
		CHECK_EQ(admit(&f, u.info.id, 1000, 0, t + 0.001 * i, &one, &d, &e), DS_OK);
		keys_drop(f.k, &one);
	}
	CHECK_EQ(admit1(&f, 777777, t, &one, &d, &e), DS_ENOTFOUND);
	/* an empty hold: every call is a no-op */
	keys_hold none;
	memset(&none, 0, sizeof none);
	CHECK_EQ(keys_reserve(f.k, &none, 5, t, &d, &e), DS_OK);
	CHECK_EQ(keys_finish(f.k, &none, t, 1, 1, &e), DS_OK);
	CHECK_EQ(keys_hold_revoked(f.k, &none, &e), 0);
	keys_dequeue(f.k, &none, 3);
	keys_drop(f.k, &none);
	fx_free(&f);
}

TEST(keys_queue_share_keeps_room_for_other_keys)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	CHECK_EQ(keys_queue_share(256, 0), 128);
	CHECK_EQ(keys_queue_share(256, 1), 85);
	CHECK_EQ(keys_queue_share(8, 6), 1);
	CHECK_EQ(keys_queue_share(1, 0), 1);
	ds_err e = {0};
	keys_denial d;
	keys_created a, b, c;
	CHECK_EQ(make_key(&f, "qa", 0, 0, 0, &a), DS_OK);
	CHECK_EQ(make_key(&f, "qb", 0, 0, 0, &b), DS_OK);
	CHECK_EQ(make_key(&f, "qc", 0, 0, 0, &c), DS_OK);
	double t = rand_base();
	keys_hold a1, a2, a3, b1, b2, c1;
	/* alone a key may queue half of 8 places; 5 sequences never fit */
	CHECK_EQ(admit(&f, a.info.id, 5, 8, t, &a1, &d, &e), DS_ERANGE);
	CHECK_EQ(d.limit, KEYS_LIMIT_QUEUE);
	CHECK_EQ(d.value, 4);
	CHECK(strstr(e.msg, "waiting queue") != NULL);
	CHECK_EQ(admit(&f, a.info.id, 2, 8, t, &a1, &d, &e), DS_OK);
	CHECK_EQ(admit(&f, a.info.id, 2, 8, t, &a2, &d, &e), DS_OK);
	CHECK_EQ(admit(&f, a.info.id, 1, 8, t, &a3, &d, &e), DS_EBUSY);
	CHECK_EQ(d.limit, KEYS_LIMIT_QUEUE);
	CHECK_EQ(d.retry_after_s, 1);
	/* sequences that do not queue are not limited by the share */
	CHECK_EQ(admit(&f, a.info.id, 3, 0, t, &a3, &d, &e), DS_OK);
	keys_drop(f.k, &a3);
	/* another key gets in: 8 / (1 + 2) = 2 while the first one waits */
	CHECK_EQ(admit(&f, b.info.id, 2, 8, t, &b1, &d, &e), DS_OK);
	CHECK_EQ(admit(&f, b.info.id, 1, 8, t, &b2, &d, &e), DS_EBUSY);
	CHECK_EQ(d.value, 2);
	/* a third still finds room: 8 / (2 + 2) = 2 */
	CHECK_EQ(admit(&f, c.info.id, 2, 8, t, &c1, &d, &e), DS_OK);
	/* the first key holds 4 of a share of 2 now; as the scheduler starts
	 * its sequences they leave the share */
	CHECK_EQ(admit(&f, a.info.id, 1, 8, t, &a3, &d, &e), DS_EBUSY);
	keys_dequeue(f.k, &a1, 2);
	CHECK_EQ(a1.queued, 0);
	keys_dequeue(f.k, &a2, 1);
	CHECK_EQ(admit(&f, a.info.id, 1, 8, t, &a3, &d, &e), DS_OK); /* 1 + 1 <= 2 */
	keys_dequeue(f.k, &a2, 5);					/* clamped to what it holds */
	CHECK_EQ(a2.queued, 0);
	/* once the others' sequences leave, the share grows back */
	keys_drop(f.k, &b1);
	CHECK_EQ(keys_finish(f.k, &c1, t, 0, 0, &e), DS_OK);
	CHECK_EQ(admit(&f, a.info.id, 3, 8, t, &b2, &d, &e), DS_OK); /* 1 + 3 <= 4 */
	keys_drop(f.k, &b2);
	keys_drop(f.k, &a3);
	keys_drop(f.k, &a2);
	keys_drop(f.k, &a1);
	CHECK_EQ(admit(&f, a.info.id, 4, 8, t, &a1, &d, &e), DS_OK);
	keys_drop(f.k, &a1);
	fx_free(&f);
}

TEST(keys_hold_sees_revocation)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	ds_err e = {0};
	keys_created a, b;
	CHECK_EQ(make_key(&f, "stays", 0, 0, 0, &a), DS_OK);
	CHECK_EQ(make_key(&f, "goes", 0, 0, 0, &b), DS_OK);
	keys_hold ha, hb;
	double t = rand_base();
	CHECK_EQ(admit1(&f, a.info.id, t, &ha, NULL, &e), DS_OK);
	CHECK_EQ(admit1(&f, b.info.id, t, &hb, NULL, &e), DS_OK);
	CHECK_EQ(keys_hold_revoked(f.k, &ha, &e), 0);
	CHECK_EQ(keys_hold_revoked(f.k, &hb, &e), 0);
	CHECK_EQ(keys_revoke(f.k, b.info.id, NULL, &e), DS_OK);
	CHECK_EQ(keys_hold_revoked(f.k, &ha, &e), 0);
	e = (ds_err){0};
	CHECK_EQ(keys_hold_revoked(f.k, &hb, &e), 1);
	CHECK(strstr(e.msg, "'goes'") != NULL && strstr(e.msg, "revoked") != NULL);
	CHECK(strstr(e.msg, b.key) == NULL);
	CHECK_EQ(keys_hold_revoked(f.k, &hb, &e), 1); /* and stays so */
	/* the revoked request still ends normally and its use is recorded */
	CHECK_EQ(keys_finish(f.k, &hb, t + 1, 3, 2, &e), DS_OK);
	CHECK_EQ(keys_finish(f.k, &ha, t + 1, 1, 1, &e), DS_OK);
	store_key r;
	CHECK_EQ(store_key_get(f.st, b.info.id, &r, &e), DS_OK);
	CHECK_EQ(r.completion_tokens, 2);
	fx_free(&f);
}

TEST(keys_several_limits_report_the_latest_to_clear)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	ds_err e = {0};
	keys_denial d;
	keys_created a;
	keys_hold h, h2;
	CHECK_EQ(make_key(&f, "all", 2, 0, 1, &a), DS_OK);
	double t0 = rand_base(), s0 = (double)(int64_t)t0;
	CHECK_EQ(admit1(&f, a.info.id, t0, &h, &d, &e), DS_OK);
	CHECK_EQ(keys_finish(f.k, &h, t0, 0, 0, &e), DS_OK);
	CHECK_EQ(admit1(&f, a.info.id, t0 + 5, &h, &d, &e), DS_OK); /* in flight */
	/* both concurrency (1 s) and rpm (until s0 + 60) are exceeded */
	CHECK_EQ(admit1(&f, a.info.id, t0 + 6, &h2, &d, &e), DS_EBUSY);
	CHECK_EQ(d.limit, KEYS_LIMIT_RPM);
	CHECK_EQ(d.retry_after_s, (int)ceil(s0 + 60 - (t0 + 6)));
	CHECK_EQ(keys_finish(f.k, &h, t0 + 7, 0, 0, &e), DS_OK);
	fx_free(&f);
}

/* ---- secret files ----------------------------------------------------------------- */

TEST(keys_secret_file_mode_and_size_checked)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	keys_created a;
	CHECK_EQ(make_key(&f, "s", 0, 0, 0, &a), DS_OK);
	fx_close(&f);
	char sp[600];
	path_in(&f, "keys.secret", sp, sizeof sp);
	ds_err e = {0};
	store *st = store_open(f.dir, &e);
	const int modes[] = {0640, 0604, 0620, 0602, 0644};
	for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
		chmod(sp, (mode_t)modes[i]);
		keys_svc *k = keys_new(st, f.dir, &e);
		CHECK(k == NULL);
		CHECK_EQ(e.code, DS_EPERM);
		CHECK(strstr(e.msg, "chmod 600") != NULL && strstr(e.msg, sp) != NULL);
		keys_free(k);
	}
	chmod(sp, 0600);
	/* a truncated secret is refused, not replaced (that would void every key) */
	size_t n = 0;
	char *old = read_all(sp, &n);
	FILE *fp = fopen(sp, "wb");
	fwrite(old, 1, 16, fp);
	fclose(fp);
	keys_svc *k = keys_new(st, f.dir, &e);
	CHECK(k == NULL);
	CHECK_EQ(e.code, DS_EFORMAT);
	keys_free(k);
	fp = fopen(sp, "wb");
	fwrite(old, 1, 32, fp);
	fclose(fp);
	free(old);
	k = keys_new(st, f.dir, &e);
	CHECK(k != NULL);
	keys_identity who;
	if (k)
		CHECK_EQ(keys_auth(k, a.key, time(NULL), &who, &e), DS_OK);
	keys_free(k);
	store_close(st);
	ut_tmpdir_free(f.dir);
	f.dir = NULL;
}

TEST(keys_admin_token_created_once_0600_and_checked)
{
	char *dir = ut_tmpdir_new("keys");
	char tok[KEYS_TOKEN_SIZE], tok2[KEYS_TOKEN_SIZE], p[600];
	int created = 0;
	ds_err e = {0};
	snprintf(p, sizeof p, "%s/admin.token", dir);
	CHECK_EQ(keys_admin_token_load(dir, tok, &created, &e), DS_OK);
	CHECK_EQ(created, 1);
	CHECK_EQ(mode_of(p), 0600);
	CHECK_EQ(strlen(tok), 43);
	CHECK_EQ(strspn(tok, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"), 43);
	CHECK_EQ(keys_admin_token_load(dir, tok2, &created, &e), DS_OK);
	CHECK_EQ(created, 0);
	CHECK_STR(tok, tok2);

	char h[400];
	snprintf(h, sizeof h, "Bearer %s", tok);
	CHECK_EQ(keys_admin_check(tok, h), 1);
	snprintf(h, sizeof h, "bearer  %s ", tok);
	CHECK_EQ(keys_admin_check(tok, h), 1);
	CHECK_EQ(keys_admin_check(tok, tok), 1);
	snprintf(h, sizeof h, "Bearer %.42s", tok);
	CHECK_EQ(keys_admin_check(tok, h), 0);
	snprintf(h, sizeof h, "Bearer %sx", tok);
	CHECK_EQ(keys_admin_check(tok, h), 0);
	CHECK_EQ(keys_admin_check(tok, NULL), 0);
	CHECK_EQ(keys_admin_check(tok, "Bearer "), 0);
	CHECK_EQ(keys_admin_check("", "Bearer "), 0);
	CHECK_EQ(keys_admin_check(NULL, h), 0);

	chmod(p, 0640);
	CHECK_EQ(keys_admin_token_load(dir, tok2, NULL, &e), DS_EPERM);
	CHECK(strstr(e.msg, "admin.token") != NULL);
	CHECK_EQ(tok2[0], '\0');
	chmod(p, 0600);
	/* An operator's own strong token is accepted; junk is not. */
	FILE *fp = fopen(p, "w");
	fputs("  Zq7-vT2mXw9_LpR4sNc8eHb1KdJ6yUf3\n\n", fp);
	fclose(fp);
	CHECK_EQ(keys_admin_token_load(dir, tok2, NULL, &e), DS_OK);
	CHECK_STR(tok2, "Zq7-vT2mXw9_LpR4sNc8eHb1KdJ6yUf3");
	fp = fopen(p, "w");
	fputs("two words\n", fp);
	fclose(fp);
	CHECK_EQ(keys_admin_token_load(dir, tok2, NULL, &e), DS_EFORMAT);
	fp = fopen(p, "w");
	fclose(fp);
	CHECK_EQ(keys_admin_token_load(dir, tok2, NULL, &e), DS_EFORMAT);
	ut_tmpdir_free(dir);
}

TEST(keys_admin_token_weak_ones_refused)
{
	/* the estimate: repeats and runs score near 0, random text high */
	CHECK(keys_token_bits("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", 36) < 1);
	CHECK(keys_token_bits("abababababababababababababababab", 32) < 40);
	CHECK(keys_token_bits("abcdefghijklmnopqrstuvwxyz012345", 32) < 10);
	CHECK(keys_token_bits("0123456789abcdef0123456789abcdef", 32) < 20);
	char *dir = ut_tmpdir_new("keys");
	char tok[KEYS_TOKEN_SIZE], p[600];
	ds_err e = {0};
	snprintf(p, sizeof p, "%s/admin.token", dir);
	/* tokens made the way the docs suggest always pass, whatever the draw */
	for (int i = 0; i < 200; i++) {
		unsigned char raw[24];
		char hex[33], b64[sodium_base64_ENCODED_LEN(24, sodium_base64_VARIANT_ORIGINAL)];
		randombytes_buf(raw, sizeof raw);
		sodium_bin2hex(hex, sizeof hex, raw, 16); /* openssl rand -hex 16 */
		sodium_bin2base64(b64, sizeof b64, raw, 24, sodium_base64_VARIANT_ORIGINAL);
		CHECK(keys_token_bits(hex, 32) >= KEYS_TOKEN_MIN_BITS);
		CHECK(keys_token_bits(b64, strlen(b64)) >= KEYS_TOKEN_MIN_BITS);
	}
	CHECK_EQ(keys_admin_token_load(dir, tok, NULL, &e), DS_OK); /* made here: strong */
	CHECK(keys_token_bits(tok, strlen(tok)) >= KEYS_TOKEN_MIN_BITS);
	static const char *const weak[] = {
		"my-own-token_123",                     /* 16 characters */
		"Zq7-vT2mXw9_LpR4sNc8eHb1KdJ6yUf",      /* 31 */
		"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "abababababababababababababababab",
		"0123456789abcdef0123456789abcdef0123", "abcdefghijklmnopqrstuvwxyzABCDEFGH",
	};
	for (size_t i = 0; i < sizeof weak / sizeof *weak; i++) {
		FILE *fp = fopen(p, "w");
		fprintf(fp, "%s\n", weak[i]);
		fclose(fp);
		e = (ds_err){0};
		CHECK_EQ(keys_admin_token_load(dir, tok, NULL, &e), DS_EFORMAT);
		CHECK_EQ(tok[0], '\0');
		CHECK(strstr(e.msg, "weak admin token") != NULL && strstr(e.msg, p) != NULL);
		CHECK(strstr(e.msg, "at least 32 characters") != NULL);
		CHECK(strstr(e.msg, weak[i]) == NULL); /* never the token */
	}
	ut_tmpdir_free(dir);
}

/* ---- durability: a VFS that counts fsyncs of the WAL ----------------------------- */

/* Every file the store opens goes through this VFS, which forwards to the
 * default one and counts xSync calls on write-ahead logs: with
 * synchronous=FULL SQLite syncs the WAL at each COMMIT, with NORMAL it does
 * not (only at checkpoints), so the count tells which writes would survive a
 * power cut. */
typedef struct sync_file {
	sqlite3_file base;
	sqlite3_file *real; /* the default VFS's file, right after this struct */
	int wal;
} sync_file;

static sqlite3_vfs *orig_vfs;
static sqlite3_vfs sync_vfs;
static sqlite3_io_methods sync_methods;
static int wal_syncs;

#define REAL(f) (((sync_file *)(f))->real)
static int sf_close(sqlite3_file *f) { return REAL(f)->pMethods->xClose(REAL(f)); }
static int sf_read(sqlite3_file *f, void *b, int n, sqlite3_int64 o)
{
	return REAL(f)->pMethods->xRead(REAL(f), b, n, o);
}
static int sf_write(sqlite3_file *f, const void *b, int n, sqlite3_int64 o)
{
	return REAL(f)->pMethods->xWrite(REAL(f), b, n, o);
}
static int sf_truncate(sqlite3_file *f, sqlite3_int64 sz)
{
	return REAL(f)->pMethods->xTruncate(REAL(f), sz);
}
static int sf_sync(sqlite3_file *f, int flags)
{
	if (((sync_file *)f)->wal)
		wal_syncs++;
	return REAL(f)->pMethods->xSync(REAL(f), flags);
}
static int sf_size(sqlite3_file *f, sqlite3_int64 *sz)
{
	return REAL(f)->pMethods->xFileSize(REAL(f), sz);
}
static int sf_lock(sqlite3_file *f, int l) { return REAL(f)->pMethods->xLock(REAL(f), l); }
static int sf_unlock(sqlite3_file *f, int l) { return REAL(f)->pMethods->xUnlock(REAL(f), l); }
static int sf_check(sqlite3_file *f, int *out)
{
	return REAL(f)->pMethods->xCheckReservedLock(REAL(f), out);
}
static int sf_fcntl(sqlite3_file *f, int op, void *arg)
{
	return REAL(f)->pMethods->xFileControl(REAL(f), op, arg);
}
static int sf_sector(sqlite3_file *f) { return REAL(f)->pMethods->xSectorSize(REAL(f)); }
static int sf_devchar(sqlite3_file *f)
{
	return REAL(f)->pMethods->xDeviceCharacteristics(REAL(f));
}
static int sf_shm_map(sqlite3_file *f, int pg, int sz, int ext, void volatile **pp)
{
	return REAL(f)->pMethods->xShmMap(REAL(f), pg, sz, ext, pp);
}
static int sf_shm_lock(sqlite3_file *f, int off, int n, int flags)
{
	return REAL(f)->pMethods->xShmLock(REAL(f), off, n, flags);
}
static void sf_shm_barrier(sqlite3_file *f) { REAL(f)->pMethods->xShmBarrier(REAL(f)); }
static int sf_shm_unmap(sqlite3_file *f, int del)
{
	return REAL(f)->pMethods->xShmUnmap(REAL(f), del);
}
static int sf_fetch(sqlite3_file *f, sqlite3_int64 off, int amt, void **pp)
{
	return REAL(f)->pMethods->xFetch(REAL(f), off, amt, pp);
}
static int sf_unfetch(sqlite3_file *f, sqlite3_int64 off, void *p)
{
	return REAL(f)->pMethods->xUnfetch(REAL(f), off, p);
}
#undef REAL

static int sf_open(sqlite3_vfs *v, const char *name, sqlite3_file *f, int flags, int *out_flags)
{
	sync_file *sf = (sync_file *)f;
	sf->real = (sqlite3_file *)(sf + 1);
	sf->wal = (flags & SQLITE_OPEN_WAL) != 0;
	int rc = orig_vfs->xOpen(orig_vfs, name, sf->real, flags, out_flags);
	if (rc != SQLITE_OK || !sf->real->pMethods) {
		f->pMethods = NULL;
		return rc;
	}
	sync_methods = (sqlite3_io_methods){
		.iVersion = sf->real->pMethods->iVersion < 3 ? sf->real->pMethods->iVersion : 3,
		.xClose = sf_close, .xRead = sf_read, .xWrite = sf_write, .xTruncate = sf_truncate,
		.xSync = sf_sync, .xFileSize = sf_size, .xLock = sf_lock, .xUnlock = sf_unlock,
		.xCheckReservedLock = sf_check, .xFileControl = sf_fcntl,
		.xSectorSize = sf_sector, .xDeviceCharacteristics = sf_devchar,
		.xShmMap = sf_shm_map, .xShmLock = sf_shm_lock, .xShmBarrier = sf_shm_barrier,
		.xShmUnmap = sf_shm_unmap, .xFetch = sf_fetch, .xUnfetch = sf_unfetch,
	};
	f->pMethods = &sync_methods;
	return rc;
}

static void sync_vfs_install(void)
{
	orig_vfs = sqlite3_vfs_find(NULL);
	sync_vfs = *orig_vfs;
	sync_vfs.zName = "ds-sync-count";
	sync_vfs.szOsFile = (int)sizeof(sync_file) + orig_vfs->szOsFile;
	sync_vfs.xOpen = sf_open;
	sync_vfs.pNext = NULL;
	sqlite3_vfs_register(&sync_vfs, 1);
}

static void sync_vfs_remove(void)
{
	sqlite3_vfs_register(orig_vfs, 1);
	sqlite3_vfs_unregister(&sync_vfs);
}

TEST(store_security_writes_sync_the_wal)
{
	sync_vfs_install();
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		sync_vfs_remove();
		return;
	}
	ds_err e = {0};
	keys_created a;
	/* an ordinary write (usage) does not sync: the count can tell */
	CHECK_EQ(make_key(&f, "durable", 0, 0, 0, &a), DS_OK);
	int before = wal_syncs;
	CHECK_EQ(store_key_usage_add(f.st, a.info.id, time(NULL), 1, 1, &e), DS_OK);
	CHECK_EQ(wal_syncs, before);
	/* key creation and revocation */
	before = wal_syncs;
	keys_created b;
	CHECK_EQ(make_key(&f, "durable-2", 0, 0, 0, &b), DS_OK);
	CHECK(wal_syncs > before);
	before = wal_syncs;
	CHECK_EQ(keys_revoke(f.k, b.info.id, NULL, &e), DS_OK);
	CHECK(wal_syncs > before);
	/* an election's epoch and head, and a vote */
	char head[STORE_ID_HEX];
	memset(head, 'a', STORE_ID_HEX - 1);
	head[STORE_ID_HEX - 1] = '\0';
	store_election el = {.epoch = 7, .votes = -1, .quorum = -1, .ts = 1000};
	snprintf(el.head, sizeof el.head, "%s", head);
	snprintf(el.outcome, sizeof el.outcome, "won");
	before = wal_syncs;
	CHECK_EQ(store_election_put(f.st, &el, NULL, &e), DS_OK);
	CHECK(wal_syncs > before);
	before = wal_syncs;
	CHECK_EQ(store_vote_put(f.st, 8, head, 1001, NULL, &e), DS_OK);
	CHECK(wal_syncs > before);
	/* and the connection is back to NORMAL afterwards */
	before = wal_syncs;
	CHECK_EQ(store_key_usage_add(f.st, a.info.id, time(NULL), 1, 1, &e), DS_OK);
	CHECK_EQ(wal_syncs, before);
	fx_free(&f);
	sync_vfs_remove();
}

/* ---- threads ------------------------------------------------------------------------ */

typedef struct worker {
	keys_svc *k;
	const char *key;
	int64_t id;
	int iters, ok, limited;
	int64_t conc_id; /* the key with max_concurrency 1 */
} worker;

static void *work(void *arg)
{
	worker *w = arg;
	for (int i = 0; i < w->iters; i++) {
		ds_err e = {0};
		keys_identity who;
		if (keys_auth(w->k, w->key, time(NULL), &who, &e) != DS_OK || who.id != w->id)
			continue;
		keys_denial d;
		keys_hold h;
		/* workers with no concurrency limit alternate 1 and 2 sequences */
		keys_cost c = {.seqs = w->id == w->conc_id ? 1 : 1 + i % 2, .queue_cap = 64};
		int rc = keys_admit(w->k, who.id, &c, 5000.0 + i * 0.001, &h, &d, &e);
		if (rc == DS_EBUSY || rc == DS_ERANGE) {
			w->limited++;
			continue;
		}
		keys_dequeue(w->k, &h, 1);
		if (rc == DS_OK && keys_finish(w->k, &h, 5000.0 + i * 0.001, 2, 3, &e) == DS_OK)
			w->ok++;
	}
	return NULL;
}

TEST(keys_threads_auth_admit_finish_while_creating)
{
	fixture f;
	if (fx_init(&f)) {
		fx_free(&f);
		return;
	}
	enum { NT = 4, ITERS = 60 };
	keys_created ks[NT];
	worker w[NT];
	pthread_t th[NT];
	char name[16];
	for (int i = 0; i < NT; i++) {
		snprintf(name, sizeof name, "t%d", i);
		CHECK_EQ(make_key(&f, name, 0, 0, i == 0 ? 1 : 0, &ks[i]), DS_OK);
		w[i] = (worker){f.k, ks[i].key, ks[i].info.id, ITERS, 0, 0, ks[0].info.id};
	}
	for (int i = 0; i < NT; i++)
		pthread_create(&th[i], NULL, work, &w[i]);
	/* the table grows and changes while the workers read it */
	for (int i = 0; i < 20; i++) {
		keys_created extra;
		snprintf(name, sizeof name, "x%d", i);
		CHECK_EQ(make_key(&f, name, 0, 0, 0, &extra), DS_OK);
		ds_err e = {0};
		if (i % 2)
			CHECK_EQ(keys_revoke(f.k, extra.info.id, NULL, &e), DS_OK);
	}
	for (int i = 0; i < NT; i++)
		pthread_join(th[i], NULL);
	ds_err e = {0};
	for (int i = 0; i < NT; i++) {
		CHECK_EQ(w[i].ok + w[i].limited, ITERS);
		store_key r;
		CHECK_EQ(store_key_get(f.st, ks[i].info.id, &r, &e), DS_OK);
		CHECK_EQ(r.requests, w[i].ok);
		CHECK_EQ(r.prompt_tokens, 2 * w[i].ok);
		CHECK_EQ(r.completion_tokens, 3 * w[i].ok);
	}
	/* each worker finishes before its next admit: one slot was always enough */
	CHECK_EQ(w[0].limited, 0);
	CHECK_EQ(keys_count(f.k), NT + 10);
	fx_free(&f);
}

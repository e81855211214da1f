/*
 * keys.c - the API key service (see keys.h).
 *
 * Callers: agent/api/control.c (create, list, revoke for `dsctl keys`), the
 * OpenAI handlers (agent/api/serve.c, oai.c: auth, admit, reserve, dequeue,
 * hold_revoked, finish, drop, count) and agent/main.c (new/free,
 * admin token).  Calls: libsodium (random bytes, BLAKE2b, constant-time
 * compare, base64) and agent/store/store for persistence.
 *
 * Memory: one `entry` per key ever created (revoked ones too, so a revoked
 * key gets "revoked" rather than "invalid"), in a growing array sorted by id.
 * Each entry has two sliding windows of 60 one-second buckets:
 *
 *   req: requests admitted in the last 60 s   (rpm)
 *   tok: tokens used by requests that finished in the last 60 s (tpm)
 *
 * and three counts of what admitted requests hold now (keys_hold):
 *
 *   in_flight: sequences (prompts x n) of requests not yet finished
 *   queued:    of them, those not yet started by the scheduler
 *   reserved:  tokens reserved against tpm (prompt + max_tokens x n each)
 *
 * A bucket belongs to second s = floor(now_mono) and counts while
 * now_mono < s + 60.  keys_admit checks in_flight + seqs <= max_concurrency,
 * sum(req) < rpm, sum(tok) + reserved < tpm and queued + seqs <= the queue
 * share; keys_reserve then checks sum(tok) + reserved + tokens <= tpm.  A
 * denial's Retry-After is the time until enough of the oldest buckets have
 * left the window (1 s for what only a request's end frees: sequences,
 * queue places, reservations).
 *
 * Revocation reaches running requests through `revs`, a count of
 * revocations: keys_hold_revoked looks the key up only when the count moved
 * since the hold last looked.
 *
 * Invariants:
 *  1. The key text is never stored or logged: only its keyed hash.
 *  2. entries[] is sorted by id (ids grow; create and revoke are serialised by
 *     admin_mu, the table is changed only with mu held).
 *  3. keys_auth compares the presented hash with every entry, no early exit.
 *  4. keys_auth/keys_admit/keys_reserve do no I/O; keys_finish does its
 *     SQLite write without mu held.
 *  5. in_flight, queued and reserved are sums over the live holds of the key:
 *     keys_admit/keys_reserve add exactly what they put in the hold, and
 *     keys_finish/keys_drop/keys_dequeue take exactly that back.  n_queuing
 *     counts the entries with queued > 0.
 *
 * Threading: mu guards entries[] and the windows (held briefly, no I/O);
 * admin_mu serialises create and revoke (which do I/O).
 */
#include "agent/auth/keys.h"
#include "common/fileutil.h"
#include "common/log.h"
#include "common/strutil.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <sodium.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>

#define SECRET_LEN 32
#define KEY_RAW_LEN 32
#define WINDOW_S 60
#define MAX_PRESENTED 512 /* longer Authorization tokens are not hashed */

typedef struct window {
	int64_t sec[WINDOW_S]; /* the second each bucket counts, or INT64_MIN */
	int64_t cnt[WINDOW_S];
} window;

typedef struct entry {
	int64_t id;
	char name[STORE_NAME_MAX + 1];
	char prefix[STORE_PREFIX_LEN + 1];
	uint8_t hash[STORE_HASH_LEN];
	int64_t expires; /* Unix s, 0 = never */
	int revoked;
	int64_t rpm, tpm, max_conc;
	int64_t in_flight; /* sequences */
	int64_t queued;    /* sequences not yet started by the scheduler */
	int64_t reserved;  /* tokens */
	window req, tok;
} entry;

struct keys_svc {
	store *st;
	uint8_t secret[SECRET_LEN];
	pthread_mutex_t mu;       /* entries, windows */
	pthread_mutex_t admin_mu; /* create / revoke */
	entry *e;
	size_t n, cap;
	size_t n_queuing;          /* entries with queued > 0 (mu) */
	_Atomic uint64_t revs;     /* revocations so far */
};

/* ---- files that hold secrets ---- */

static int path_join(char *out, size_t n, const char *dir, const char *file, ds_err *err)
{
	if ((size_t)snprintf(out, n, "%s/%s", dir, file) >= n)
		return ds_err_set(err, DS_EINVAL, "path too long: %s/%s", dir, file);
	return DS_OK;
}

static int load_secret(const char *data_dir, uint8_t secret[SECRET_LEN], ds_err *err)
{
	char path[PATH_MAX];
	int rc = path_join(path, sizeof path, data_dir, "keys.secret", err);
	if (rc)
		return rc;
	for (int attempt = 0; attempt < 2; attempt++) {
		uint8_t buf[SECRET_LEN + 1];
		size_t len = 0;
		rc = ds_file_read_small(path, DS_FILE_PRIVATE | DS_FILE_NOFOLLOW, buf, sizeof buf, &len, err);
		if (rc == DS_OK) {
			if (len != SECRET_LEN) {
				rc = ds_err_set(err, DS_EFORMAT,
						"%s holds %zu bytes, expected %d (restore it from a "
						"backup; a new secret invalidates every key)",
						path, len, SECRET_LEN);
			} else {
				memcpy(secret, buf, SECRET_LEN);
			}
			sodium_memzero(buf, sizeof buf);
			return rc;
		}
		if (rc != DS_ENOTFOUND)
			return rc;
		randombytes_buf(buf, SECRET_LEN);
		rc = ds_file_write_private(path, buf, SECRET_LEN, DS_WRITE_EXCL, err);
		if (rc == DS_OK) {
			memcpy(secret, buf, SECRET_LEN);
			sodium_memzero(buf, sizeof buf);
			log_info("keys", "created the cluster key secret", "path=%s", path);
			return DS_OK;
		}
		sodium_memzero(buf, sizeof buf);
		if (rc != DS_EBUSY)
			return rc;
	}
	return ds_err_set(err, DS_EIO, "%s keeps appearing and disappearing", path);
}

static int token_text_ok(const char *s, size_t n)
{
	if (n == 0 || n > KEYS_TOKEN_SIZE - 1)
		return 0;
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)s[i];
		if (c <= 0x20 || c >= 0x7f)
			return 0;
	}
	return 1;
}

/* Shannon entropy, in bits per symbol, of the counts cnt[0..n) over total. */
static double shannon(const unsigned *cnt, size_t n, size_t total)
{
	double h = 0;
	for (size_t i = 0; i < n; i++)
		if (cnt[i]) {
			double p = (double)cnt[i] / (double)total;
			h -= p * log2(p);
		}
	return h;
}

double keys_token_bits(const char *s, size_t n)
{
	unsigned chars[256] = {0}, deltas[511] = {0};
	if (n < 2)
		return 0;
	for (size_t i = 0; i < n; i++) {
		chars[(unsigned char)s[i]]++;
		if (i)
			deltas[255 + (int)(unsigned char)s[i] - (int)(unsigned char)s[i - 1]]++;
	}
	double hc = shannon(chars, 256, n), hd = shannon(deltas, 511, n - 1);
	return (double)n * (hc < hd ? hc : hd);
}

/* DS_OK, or DS_EFORMAT naming path when the token is weak (never the token). */
static int token_strong(const char *path, const char *tok, size_t n, ds_err *err)
{
	double bits = keys_token_bits(tok, n);
	if (n >= KEYS_TOKEN_MIN_LEN && bits >= KEYS_TOKEN_MIN_BITS)
		return DS_OK;
	return ds_err_set(err, DS_EFORMAT,
			  "%s holds a weak admin token (%zu characters, an estimated %.0f bits): "
			  "a token needs at least %d characters and an estimated %.0f bits "
			  "(no long repeats or runs of characters); write a random one, e.g. "
			  "`openssl rand -base64 32 > %s` (mode 0600), or remove the file and "
			  "dsagent makes one",
			  path, n, bits, KEYS_TOKEN_MIN_LEN, KEYS_TOKEN_MIN_BITS, path);
}

int keys_admin_token_load(const char *data_dir, char out[KEYS_TOKEN_SIZE], int *created,
			  ds_err *err)
{
	char path[PATH_MAX];
	out[0] = '\0';
	if (created)
		*created = 0;
	int rc = path_join(path, sizeof path, data_dir, "admin.token", err);
	if (rc)
		return rc;
	if (sodium_init() < 0)
		return ds_err_set(err, DS_EINTERNAL, "libsodium could not start");
	for (int attempt = 0; attempt < 2; attempt++) {
		char buf[2 * KEYS_TOKEN_SIZE];
		size_t len = 0;
		rc = ds_file_read_small(path, DS_FILE_PRIVATE | DS_FILE_NOFOLLOW, buf, sizeof buf - 1, &len, err);
		if (rc == DS_OK) {
			size_t a = 0;
			while (a < len && (buf[a] == ' ' || buf[a] == '\t' || buf[a] == '\n' ||
					   buf[a] == '\r'))
				a++;
			while (len > a && (buf[len - 1] == ' ' || buf[len - 1] == '\t' ||
					   buf[len - 1] == '\n' || buf[len - 1] == '\r'))
				len--;
			if (!token_text_ok(buf + a, len - a)) {
				rc = ds_err_set(err, DS_EFORMAT,
						"%s must hold one token of %d..%d printable characters "
						"without spaces",
						path, KEYS_TOKEN_MIN_LEN, KEYS_TOKEN_SIZE - 1);
			} else if ((rc = token_strong(path, buf + a, len - a, err)) == DS_OK) {
				memcpy(out, buf + a, len - a);
				out[len - a] = '\0';
			}
			sodium_memzero(buf, sizeof buf);
			return rc;
		}
		if (rc != DS_ENOTFOUND)
			return rc;
		uint8_t raw[32];
		char text[sodium_base64_ENCODED_LEN(32, sodium_base64_VARIANT_URLSAFE_NO_PADDING) + 1];
		randombytes_buf(raw, sizeof raw);
		sodium_bin2base64(text, sizeof text - 1, raw, sizeof raw,
				  sodium_base64_VARIANT_URLSAFE_NO_PADDING);
		size_t tl = strlen(text);
		text[tl] = '\n';
		rc = ds_file_write_private(path, text, tl + 1, DS_WRITE_EXCL, err);
		if (rc == DS_OK) {
			memcpy(out, text, tl);
			out[tl] = '\0';
			if (created)
				*created = 1;
		}
		sodium_memzero(raw, sizeof raw);
		sodium_memzero(text, sizeof text);
		if (rc != DS_EBUSY)
			return rc;
	}
	return ds_err_set(err, DS_EIO, "%s keeps appearing and disappearing", path);
}

/* ---- Authorization header ---- */

static int is_ws(char c)
{
	return c == ' ' || c == '\t';
}

int keys_bearer(const char *header, const char **tok, size_t *len)
{
	if (!header)
		return 0;
	const char *p = header;
	while (is_ws(*p))
		p++;
	const char *e = p + strlen(p);
	while (e > p && (is_ws(e[-1]) || e[-1] == '\r' || e[-1] == '\n'))
		e--;
	if (e == p)
		return 0;
	if ((size_t)(e - p) >= 6 && strncasecmp(p, "bearer", 6) == 0 &&
	    (e - p == 6 || is_ws(p[6]))) {
		p += 6;
		while (p < e && is_ws(*p))
			p++;
		if (p == e)
			return 0; /* "Bearer" and nothing else */
	}
	*tok = p;
	*len = (size_t)(e - p);
	return 1;
}

int keys_admin_check(const char *admin_token, const char *authorization)
{
	const char *tok;
	size_t len;
	if (!admin_token || !admin_token[0] || !keys_bearer(authorization, &tok, &len) ||
	    len > MAX_PRESENTED)
		return 0;
	/* Hash both sides so the comparison takes the same time whatever the
	 * lengths and contents. */
	uint8_t a[32], b[32];
	crypto_generichash(a, sizeof a, (const unsigned char *)tok, len, NULL, 0);
	crypto_generichash(b, sizeof b, (const unsigned char *)admin_token, strlen(admin_token),
			   NULL, 0);
	return sodium_memcmp(a, b, sizeof a) == 0;
}

/* ---- windows ---- */

static void win_init(window *w)
{
	for (int i = 0; i < WINDOW_S; i++) {
		w->sec[i] = INT64_MIN;
		w->cnt[i] = 0;
	}
}

static int64_t sec_of(double now)
{
	double f = floor(now);
	return f < -9e18 ? INT64_MIN / 2 : f > 9e18 ? INT64_MAX / 2 : (int64_t)f;
}

static int in_window(int64_t bucket, int64_t now_s)
{
	return bucket != INT64_MIN && bucket > now_s - WINDOW_S && bucket <= now_s;
}

static int64_t win_sum(const window *w, int64_t now_s)
{
	int64_t sum = 0;
	for (int i = 0; i < WINDOW_S; i++)
		if (in_window(w->sec[i], now_s))
			sum += w->cnt[i];
	return sum;
}

static void win_add(window *w, int64_t now_s, int64_t v)
{
	int i = (int)(((now_s % WINDOW_S) + WINDOW_S) % WINDOW_S);
	if (w->sec[i] != now_s) {
		w->sec[i] = now_s;
		w->cnt[i] = 0;
	}
	w->cnt[i] += v;
}

/* Seconds from now until sum < limit, given sum >= limit now. */
static double win_wait(const window *w, double now, int64_t limit)
{
	int64_t now_s = sec_of(now);
	int64_t sum = win_sum(w, now_s);
	for (int64_t s = now_s - WINDOW_S + 1; s <= now_s; s++) {
		int i = (int)(((s % WINDOW_S) + WINDOW_S) % WINDOW_S);
		if (w->sec[i] == s)
			sum -= w->cnt[i];
		if (sum < limit)
			return (double)(s + WINDOW_S) - now;
	}
	return WINDOW_S; /* a bucket of this very second holds the whole limit */
}

static int whole_seconds(double s)
{
	double c = ceil(s - 1e-9);
	return c < 1 ? 1 : c > 3600 ? 3600 : (int)c;
}

/* ---- the table ---- */

static entry *find_entry(keys_svc *k, int64_t id)
{
	size_t lo = 0, hi = k->n;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		if (k->e[mid].id < id)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo < k->n && k->e[lo].id == id ? &k->e[lo] : NULL;
}

static void entry_from_row(entry *e, const store_key *r)
{
	memset(e, 0, sizeof *e);
	e->id = r->id;
	ds_strlcpy(e->name, r->name, sizeof e->name);
	ds_strlcpy(e->prefix, r->prefix, sizeof e->prefix);
	memcpy(e->hash, r->hash, STORE_HASH_LEN);
	e->expires = r->expires;
	e->revoked = r->revoked_at != 0;
	e->rpm = r->rpm;
	e->tpm = r->tpm;
	e->max_conc = r->max_concurrency;
	win_init(&e->req);
	win_init(&e->tok);
}

/* Appends (ids grow, so the array stays sorted); with mu held. */
static int table_append(keys_svc *k, const store_key *r)
{
	if (k->n == k->cap) {
		size_t nc = k->cap ? k->cap * 2 : 16;
		entry *ne = realloc(k->e, nc * sizeof *ne);
		if (!ne)
			return DS_ENOMEM;
		k->e = ne;
		k->cap = nc;
	}
	if (k->n && k->e[k->n - 1].id >= r->id)
		return DS_EINTERNAL;
	entry_from_row(&k->e[k->n++], r);
	return DS_OK;
}

keys_svc *keys_new(store *st, const char *data_dir, ds_err *err)
{
	store_key *rows = NULL;
	size_t nrows = 0;
	keys_svc *k = calloc(1, sizeof *k);
	if (!k) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	k->st = st;
	pthread_mutex_init(&k->mu, NULL);
	pthread_mutex_init(&k->admin_mu, NULL);
	int rc = DS_OK;
	if (sodium_init() < 0) {
		rc = ds_err_set(err, DS_EINTERNAL, "libsodium could not start");
		goto out;
	}
	rc = load_secret(data_dir, k->secret, err);
	if (rc)
		goto out;
	rc = store_key_list(st, 1, &rows, &nrows, err);
	if (rc)
		goto out;
	for (size_t i = 0; i < nrows; i++) {
		rc = table_append(k, &rows[i]);
		if (rc) {
			ds_err_set(err, rc, "loading key %lld into memory failed",
				   (long long)rows[i].id);
			goto out;
		}
	}
	log_info("keys", "loaded", "keys=%zu active=%zu", k->n, keys_count(k));
out:
	free(rows);
	if (rc) {
		keys_free(k);
		return NULL;
	}
	return k;
}

void keys_free(keys_svc *k)
{
	if (!k)
		return;
	sodium_memzero(k->secret, sizeof k->secret);
	free(k->e);
	pthread_mutex_destroy(&k->mu);
	pthread_mutex_destroy(&k->admin_mu);
	free(k);
}

static void key_hash(const keys_svc *k, const char *text, size_t len, uint8_t out[STORE_HASH_LEN])
{
	crypto_generichash(out, STORE_HASH_LEN, (const unsigned char *)text, len, k->secret,
			   SECRET_LEN);
}

static int name_ok(const char *s)
{
	size_t n = s ? strlen(s) : 0;
	if (n < 1 || n > STORE_NAME_MAX)
		return 0;
	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
		      c == '.' || c == '_' || c == '-'))
			return 0;
	}
	return 1;
}

static int check_bound(const char *field, int64_t v, int64_t max, ds_err *err)
{
	if (v < 0 || v > max)
		return ds_err_set(err, DS_EINVAL, "'%s' must be in [0, %lld] (0 = %s), got %lld",
				  field, (long long)max,
				  strcmp(field, "expires_days") == 0 ? "never" : "unlimited",
				  (long long)v);
	return DS_OK;
}

static void record_event(keys_svc *k, const char *kind, const store_key *r)
{
	json_t *d = json_pack("{s:I,s:s,s:s}", "id", (json_int_t)r->id, "name", r->name, "prefix",
			      r->prefix);
	char *text = d ? json_dumps(d, JSON_COMPACT) : NULL;
	ds_err e = {0};
	if (store_event_add(k->st, (int64_t)time(NULL), kind, text, &e) != DS_OK)
		log_warn("keys", "cannot record an event", "kind=%s err=\"%s\"", kind, e.msg);
	free(text);
	json_decref(d);
}

size_t keys_count(keys_svc *k)
{
	int64_t now = (int64_t)time(NULL);
	size_t n = 0;
	pthread_mutex_lock(&k->mu);
	for (size_t i = 0; i < k->n; i++)
		if (!k->e[i].revoked && (!k->e[i].expires || now < k->e[i].expires))
			n++;
	pthread_mutex_unlock(&k->mu);
	return n;
}

static size_t count_unrevoked(keys_svc *k)
{
	size_t n = 0;
	pthread_mutex_lock(&k->mu);
	for (size_t i = 0; i < k->n; i++)
		n += !k->e[i].revoked;
	pthread_mutex_unlock(&k->mu);
	return n;
}

int keys_create(keys_svc *k, const keys_params *p, keys_created *out, ds_err *err)
{
	uint8_t raw[KEY_RAW_LEN];
	char b64[sodium_base64_ENCODED_LEN(KEY_RAW_LEN, sodium_base64_VARIANT_URLSAFE_NO_PADDING)];
	int rc;
	memset(out, 0, sizeof *out);
	if (!name_ok(p->name))
		return ds_err_set(err, DS_EINVAL,
				  "'name' must be 1 to %d characters of A-Z a-z 0-9 . _ -",
				  STORE_NAME_MAX);
	if ((rc = check_bound("expires_days", p->expires_days, KEYS_MAX_EXPIRES_DAYS, err)) ||
	    (rc = check_bound("rpm", p->rpm, KEYS_MAX_RPM, err)) ||
	    (rc = check_bound("tpm", p->tpm, KEYS_MAX_TPM, err)) ||
	    (rc = check_bound("max_concurrency", p->max_concurrency, KEYS_MAX_CONCURRENCY, err)))
		return rc;

	pthread_mutex_lock(&k->admin_mu);
	if (count_unrevoked(k) >= KEYS_MAX_ACTIVE) {
		rc = ds_err_set(err, DS_ERANGE, "%d keys are active, the most allowed; revoke some",
				KEYS_MAX_ACTIVE);
		goto out;
	}
	randombytes_buf(raw, sizeof raw);
	sodium_bin2base64(b64, sizeof b64, raw, sizeof raw,
			  sodium_base64_VARIANT_URLSAFE_NO_PADDING);
	snprintf(out->key, sizeof out->key, KEYS_PREFIX "%s", b64);

	store_key *r = &out->info;
	ds_strlcpy(r->name, p->name, sizeof r->name);
	memcpy(r->prefix, out->key + strlen(KEYS_PREFIX), STORE_PREFIX_LEN);
	r->prefix[STORE_PREFIX_LEN] = '\0';
	key_hash(k, out->key, strlen(out->key), r->hash);
	r->created = (int64_t)time(NULL);
	r->expires = p->expires_days ? r->created + p->expires_days * 86400 : 0;
	r->rpm = p->rpm;
	r->tpm = p->tpm;
	r->max_concurrency = p->max_concurrency;
	rc = store_key_insert(k->st, r, err);
	if (rc)
		goto out;
	pthread_mutex_lock(&k->mu);
	rc = table_append(k, r);
	pthread_mutex_unlock(&k->mu);
	if (rc) {
		/* The row exists but this process cannot serve it: take it back. */
		store_key_revoke(k->st, r->id, r->created, NULL, NULL);
		rc = ds_err_set(err, rc, "out of memory adding key %lld", (long long)r->id);
		goto out;
	}
	log_info("keys", "key created", "id=%lld name=%s prefix=%s", (long long)r->id, r->name,
		 r->prefix);
	record_event(k, "key.created", r);
out:
	sodium_memzero(raw, sizeof raw);
	sodium_memzero(b64, sizeof b64);
	if (rc)
		sodium_memzero(out, sizeof *out);
	pthread_mutex_unlock(&k->admin_mu);
	return rc;
}

int keys_list(keys_svc *k, store_key **out, size_t *n, ds_err *err)
{
	return store_key_list(k->st, 1, out, n, err);
}

int keys_revoke(keys_svc *k, int64_t id, store_key *out, ds_err *err)
{
	int was = 0;
	store_key row;
	pthread_mutex_lock(&k->admin_mu);
	int rc = store_key_revoke(k->st, id, (int64_t)time(NULL), &was, err);
	if (rc)
		goto out;
	pthread_mutex_lock(&k->mu);
	entry *e = find_entry(k, id);
	if (e)
		e->revoked = 1;
	pthread_mutex_unlock(&k->mu);
	atomic_fetch_add(&k->revs, 1); /* after the flag: a hold that sees the count sees it */
	rc = store_key_get(k->st, id, &row, err);
	if (rc)
		goto out;
	if (!was) {
		log_info("keys", "key revoked", "id=%lld name=%s", (long long)id, row.name);
		record_event(k, "key.revoked", &row);
	}
	if (out)
		*out = row;
out:
	pthread_mutex_unlock(&k->admin_mu);
	return rc;
}

static void fmt_time(int64_t t, char *out, size_t n)
{
	time_t tt = (time_t)t;
	struct tm tm;
	if (!gmtime_r(&tt, &tm) || !strftime(out, n, "%Y-%m-%dT%H:%M:%SZ", &tm))
		snprintf(out, n, "%lld", (long long)t);
}

int keys_auth(keys_svc *k, const char *authorization, int64_t now_unix, keys_identity *who,
	      ds_err *err)
{
	const char *tok;
	size_t len;
	memset(who, 0, sizeof *who);
	if (!keys_bearer(authorization, &tok, &len)) {
		who->fail = KEYS_AUTH_MISSING;
		return ds_err_set(err, DS_EAUTH,
				  "missing API key: send the header 'Authorization: Bearer <key>'");
	}
	if (len > MAX_PRESENTED) {
		who->fail = KEYS_AUTH_INVALID;
		return ds_err_set(err, DS_EAUTH, "invalid API key");
	}
	uint8_t h[STORE_HASH_LEN];
	key_hash(k, tok, len, h);

	pthread_mutex_lock(&k->mu);
	size_t match = SIZE_MAX;
	for (size_t i = 0; i < k->n; i++) {
		/* Every entry is compared; the branch-free select keeps the loop's
		 * time independent of where (or whether) the key matches. */
		size_t eq = (size_t)(sodium_memcmp(k->e[i].hash, h, STORE_HASH_LEN) == 0);
		match = (match & (eq - 1)) | (i & (0 - eq));
	}
	entry snap;
	int found = match != SIZE_MAX;
	if (found) {
		const entry *e = &k->e[match];
		snap.id = e->id;
		snap.revoked = e->revoked;
		snap.expires = e->expires;
		memcpy(snap.name, e->name, sizeof snap.name);
		memcpy(snap.prefix, e->prefix, sizeof snap.prefix);
	}
	pthread_mutex_unlock(&k->mu);
	sodium_memzero(h, sizeof h);

	if (!found) {
		who->fail = KEYS_AUTH_INVALID;
		return ds_err_set(err, DS_EAUTH, "invalid API key");
	}
	who->id = snap.id;
	memcpy(who->name, snap.name, sizeof who->name);
	memcpy(who->prefix, snap.prefix, sizeof who->prefix);
	if (snap.revoked) {
		who->fail = KEYS_AUTH_REVOKED;
		return ds_err_set(err, DS_EAUTH, "API key '%s' (" KEYS_PREFIX "%s...) was revoked",
				  snap.name, snap.prefix);
	}
	if (snap.expires && now_unix >= snap.expires) {
		char when[32];
		fmt_time(snap.expires, when, sizeof when);
		who->fail = KEYS_AUTH_EXPIRED;
		return ds_err_set(err, DS_EAUTH, "API key '%s' (" KEYS_PREFIX "%s...) expired at %s",
				  snap.name, snap.prefix, when);
	}
	who->fail = KEYS_AUTH_OK;
	return DS_OK;
}

int64_t keys_queue_share(int64_t queue_cap, int64_t others)
{
	if (others < 0)
		others = 0;
	int64_t share = queue_cap / (others + 2);
	return share < 1 ? 1 : share;
}

/* Sets e->queued, keeping n_queuing; with mu held. */
static void set_queued(keys_svc *k, entry *e, int64_t v)
{
	if (v < 0)
		v = 0;
	if (e->queued > 0 && v == 0)
		k->n_queuing--;
	else if (e->queued == 0 && v > 0)
		k->n_queuing++;
	e->queued = v;
}

/* Seconds until the tpm window leaves room for `want` more tokens beside the
 * reservations (want >= 1): 1 when the reservations alone leave no room (only
 * a request's end frees them).  With mu held. */
static double tpm_wait(const entry *e, double now, int64_t want)
{
	int64_t room = e->tpm - e->reserved - want; /* the window must drop to <= room */
	if (room < 0)
		return 1;
	return win_wait(&e->tok, now, room + 1);
}

/* Records a denial in d when it clears later than the one there. */
static void deny(keys_denial *d, double *wait, double w, enum keys_limit limit, const char *name,
		 int64_t value)
{
	if (w > *wait) {
		*wait = w;
		d->limit = limit;
		d->name = name;
		d->value = value;
	}
}

int keys_admit(keys_svc *k, int64_t key_id, const keys_cost *c, double now_mono, keys_hold *h,
	       keys_denial *d, ds_err *err)
{
	keys_denial tmp;
	if (!d)
		d = &tmp;
	memset(d, 0, sizeof *d);
	memset(h, 0, sizeof *h);
	int64_t seqs = c->seqs > 0 ? c->seqs : 1;
	int64_t now_s = sec_of(now_mono);
	int rc = DS_OK;
	pthread_mutex_lock(&k->mu);
	entry *e = find_entry(k, key_id);
	if (!e) {
		rc = ds_err_set(err, DS_ENOTFOUND, "no key with id %lld", (long long)key_id);
		goto out;
	}
	if (e->revoked) {
		rc = ds_err_set(err, DS_EAUTH, "API key '%s' was revoked", e->name);
		goto out;
	}
	int64_t others = (int64_t)k->n_queuing - (e->queued > 0);
	int64_t share = keys_queue_share(c->queue_cap, others);
	/* What can never pass: asking again cannot help, so no Retry-After. */
	if (e->max_conc > 0 && seqs > e->max_conc) {
		*d = (keys_denial){KEYS_LIMIT_CONCURRENCY, "max_concurrency", e->max_conc, 0};
		rc = ds_err_set(err, DS_ERANGE,
				"this request runs %lld sequences (prompts x n), more than API key "
				"'%s' may run at once (max_concurrency %lld)",
				(long long)seqs, e->name, (long long)e->max_conc);
		goto out;
	}
	if (c->queue_cap > 0 && seqs > keys_queue_share(c->queue_cap, 0)) {
		*d = (keys_denial){KEYS_LIMIT_QUEUE, "queue_share",
				   keys_queue_share(c->queue_cap, 0), 0};
		rc = ds_err_set(err, DS_ERANGE,
				"this request queues %lld sequences (prompts x n), more than one "
				"key's share of the waiting queue (%lld of its %lld places)",
				(long long)seqs, (long long)d->value, (long long)c->queue_cap);
		goto out;
	}
	double wait = -1;
	if (e->max_conc > 0 && e->in_flight + seqs > e->max_conc)
		deny(d, &wait, 1, KEYS_LIMIT_CONCURRENCY, "max_concurrency", e->max_conc);
	if (e->rpm > 0 && win_sum(&e->req, now_s) >= e->rpm)
		deny(d, &wait, win_wait(&e->req, now_mono, e->rpm), KEYS_LIMIT_RPM, "rpm", e->rpm);
	int64_t used = e->tpm > 0 ? win_sum(&e->tok, now_s) : 0;
	if (e->tpm > 0 && used + e->reserved >= e->tpm)
		deny(d, &wait, tpm_wait(e, now_mono, 1), KEYS_LIMIT_TPM, "tpm", e->tpm);
	if (c->queue_cap > 0 && e->queued + seqs > share)
		deny(d, &wait, 1, KEYS_LIMIT_QUEUE, "queue_share", share);
	if (d->limit != KEYS_LIMIT_NONE) {
		d->retry_after_s = whole_seconds(wait);
		switch (d->limit) {
		case KEYS_LIMIT_CONCURRENCY:
			rc = ds_err_set(err, DS_EBUSY,
					"API key '%s' has %lld sequences in flight and this request "
					"runs %lld more, over its limit of %lld (max_concurrency); "
					"retry in %d s",
					e->name, (long long)e->in_flight, (long long)seqs,
					(long long)e->max_conc, d->retry_after_s);
			break;
		case KEYS_LIMIT_RPM:
			rc = ds_err_set(err, DS_EBUSY,
					"API key '%s' reached its limit of %lld requests per minute "
					"(rpm); retry in %d s",
					e->name, (long long)e->rpm, d->retry_after_s);
			break;
		case KEYS_LIMIT_TPM:
			rc = ds_err_set(err, DS_EBUSY,
					"API key '%s' reached its limit of %lld tokens per minute "
					"(tpm): %lld used in the last minute, %lld reserved by "
					"requests in flight; retry in %d s",
					e->name, (long long)e->tpm, (long long)used,
					(long long)e->reserved, d->retry_after_s);
			break;
		default:
			rc = ds_err_set(err, DS_EBUSY,
					"API key '%s' has %lld sequences in the waiting queue and this "
					"request adds %lld, over its share of the waiting queue (%lld "
					"of %lld places while %lld other keys wait); retry in %d s",
					e->name, (long long)e->queued, (long long)seqs,
					(long long)share, (long long)c->queue_cap, (long long)others,
					d->retry_after_s);
			break;
		}
		goto out;
	}
	e->in_flight += seqs;
	win_add(&e->req, now_s, 1);
	h->key_id = e->id;
	h->seqs = seqs;
	if (c->queue_cap > 0) {
		set_queued(k, e, e->queued + seqs);
		h->queued = seqs;
	}
	h->revs = atomic_load(&k->revs);
out:
	pthread_mutex_unlock(&k->mu);
	return rc;
}

int keys_reserve(keys_svc *k, keys_hold *h, int64_t tokens, double now_mono, keys_denial *d,
		 ds_err *err)
{
	keys_denial tmp;
	if (!d)
		d = &tmp;
	memset(d, 0, sizeof *d);
	if (h->key_id <= 0)
		return DS_OK;
	if (tokens < 0)
		tokens = 0;
	int rc = DS_OK;
	pthread_mutex_lock(&k->mu);
	entry *e = find_entry(k, h->key_id);
	if (!e || e->tpm <= 0)
		goto out; /* nothing to reserve against */
	int64_t used = win_sum(&e->tok, sec_of(now_mono));
	if (tokens > e->tpm) {
		*d = (keys_denial){KEYS_LIMIT_TPM, "tpm", e->tpm, 0};
		rc = ds_err_set(err, DS_ERANGE,
				"this request may use %lld tokens (its prompt tokens plus max_tokens "
				"for each sequence), more than API key '%s' may use in a minute "
				"(tpm %lld)",
				(long long)tokens, e->name, (long long)e->tpm);
		goto out;
	}
	if (used + e->reserved + tokens > e->tpm) {
		*d = (keys_denial){KEYS_LIMIT_TPM, "tpm", e->tpm,
				   whole_seconds(tpm_wait(e, now_mono, tokens))};
		rc = ds_err_set(err, DS_EBUSY,
				"API key '%s' reached its limit of %lld tokens per minute (tpm): "
				"this request may use %lld tokens, %lld were used in the last minute "
				"and %lld are reserved by requests in flight; retry in %d s",
				e->name, (long long)e->tpm, (long long)tokens, (long long)used,
				(long long)e->reserved, d->retry_after_s);
		goto out;
	}
	e->reserved += tokens;
	h->reserved += tokens;
out:
	pthread_mutex_unlock(&k->mu);
	return rc;
}

void keys_dequeue(keys_svc *k, keys_hold *h, int64_t n)
{
	if (h->key_id <= 0 || n <= 0 || h->queued == 0)
		return;
	if (n > h->queued)
		n = h->queued;
	pthread_mutex_lock(&k->mu);
	entry *e = find_entry(k, h->key_id);
	if (e)
		set_queued(k, e, e->queued - n);
	pthread_mutex_unlock(&k->mu);
	h->queued -= n;
}

int keys_hold_revoked(keys_svc *k, keys_hold *h, ds_err *err)
{
	if (h->key_id <= 0)
		return 0;
	if (!h->revoked) {
		uint64_t revs = atomic_load(&k->revs);
		if (revs == h->revs)
			return 0;
		h->revs = revs;
		pthread_mutex_lock(&k->mu);
		const entry *e = find_entry(k, h->key_id);
		h->revoked = e && e->revoked;
		pthread_mutex_unlock(&k->mu);
		if (!h->revoked)
			return 0;
	}
	char name[STORE_NAME_MAX + 1] = "", prefix[STORE_PREFIX_LEN + 1] = "";
	pthread_mutex_lock(&k->mu);
	const entry *e = find_entry(k, h->key_id);
	if (e) {
		memcpy(name, e->name, sizeof name);
		memcpy(prefix, e->prefix, sizeof prefix);
	}
	pthread_mutex_unlock(&k->mu);
	ds_err_set(err, DS_EAUTH,
		   "API key '%s' (" KEYS_PREFIX "%s...) was revoked while this request ran; it "
		   "was stopped",
		   name, prefix);
	return 1;
}

/* Takes back what h holds from its entry (mu held); tokens >= 0 go into the
 * tpm window at now_s.  0 when the key is unknown. */
static int release(keys_svc *k, keys_hold *h, int64_t now_s, int64_t tokens)
{
	entry *e = find_entry(k, h->key_id);
	if (!e)
		return 0;
	e->in_flight -= h->seqs;
	e->reserved -= h->reserved;
	if (e->in_flight < 0 || e->reserved < 0) { /* invariant 5: our own bug */
		log_warn("keys", "a key's counts went below zero", "id=%lld in_flight=%lld "
			 "reserved=%lld", (long long)e->id, (long long)e->in_flight,
			 (long long)e->reserved);
		e->in_flight = e->in_flight < 0 ? 0 : e->in_flight;
		e->reserved = e->reserved < 0 ? 0 : e->reserved;
	}
	set_queued(k, e, e->queued - h->queued);
	if (tokens > 0)
		win_add(&e->tok, now_s, tokens);
	return 1;
}

int keys_finish(keys_svc *k, keys_hold *h, double now_mono, int64_t prompt_tokens,
		int64_t completion_tokens, ds_err *err)
{
	int64_t id = h->key_id;
	if (id <= 0)
		return DS_OK;
	if (prompt_tokens < 0)
		prompt_tokens = 0;
	if (completion_tokens < 0)
		completion_tokens = 0;
	pthread_mutex_lock(&k->mu);
	int found = release(k, h, sec_of(now_mono), prompt_tokens + completion_tokens);
	pthread_mutex_unlock(&k->mu);
	memset(h, 0, sizeof *h);
	if (!found)
		return ds_err_set(err, DS_ENOTFOUND, "no key with id %lld", (long long)id);
	return store_key_usage_add(k->st, id, (int64_t)time(NULL), prompt_tokens,
				   completion_tokens, err);
}

void keys_drop(keys_svc *k, keys_hold *h)
{
	if (h->key_id <= 0)
		return;
	pthread_mutex_lock(&k->mu);
	release(k, h, 0, 0);
	pthread_mutex_unlock(&k->mu);
	memset(h, 0, sizeof *h);
}

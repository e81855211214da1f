/*
 * keys.h - named API keys: creation, authentication, per-key limits, usage.
 *
 * A key is "dsk-" + 32 random bytes in URL-safe base64 without padding (47
 * characters).  It is shown once, at creation; only
 * BLAKE2b-256(key = cluster secret, message = the whole key text) is stored
 * (agent/store/store), with the first 8 characters after "dsk-" as a prefix that
 * lets operators tell keys apart.  The cluster secret is 32 random bytes in
 * DATA_DIR/keys.secret (mode 0600, created on first use).
 *
 * The service keeps every key's hash, state and limit windows in memory, so
 * keys_auth and keys_admit never touch SQLite; keys_create and keys_revoke
 * update memory and the database together and take effect at once.
 *
 * Request flow for an API handler:
 *
 *   keys_auth(header) --DS_EAUTH--> 401 (who.fail says why)
 *        | DS_OK: who.id
 *   keys_admit(who.id) --DS_EBUSY--> 429 + Retry-After: d.retry_after_s
 *        | DS_OK: one slot in flight, one request counted in the rpm window
 *   ... generate ...
 *   keys_finish(who.id, tokens)   exactly once per DS_OK of keys_admit
 *
 * Threading: every function is safe from any thread.  Times: now_unix is wall
 * clock Unix seconds (time(NULL)) for expiry; now_mono is ds_now_s() (a
 * monotonic clock) for the rate windows; tests inject both.
 */
#ifndef DS_AGENT_KEYS_H
#define DS_AGENT_KEYS_H

#include "agent/store/store.h"
#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

#define KEYS_PREFIX "dsk-"
#define KEYS_TEXT_LEN 47  /* strlen of a key */
#define KEYS_TEXT_SIZE 48 /* buffer for a key and its NUL */
#define KEYS_TOKEN_SIZE 257 /* buffer for the admin token (at most 256 characters) */

/* Bounds checked by keys_create (0 = never / unlimited). */
#define KEYS_MAX_EXPIRES_DAYS 36500
#define KEYS_MAX_RPM 1000000000LL
#define KEYS_MAX_TPM 1000000000000LL
#define KEYS_MAX_CONCURRENCY 1000000LL
#define KEYS_MAX_ACTIVE 10000 /* keys that are not revoked */

typedef struct keys_svc keys_svc;

/* Loads (or creates) DATA_DIR/keys.secret and every key of st into memory.
 * st must outlive the service.  NULL with err: DS_EPERM when keys.secret is
 * readable or writable by group or others, DS_EFORMAT when it is not 32
 * bytes, DS_EIO for file errors. */
keys_svc *keys_new(store *st, const char *data_dir, ds_err *err);
/* NULL is a no-op.  No other call may be in progress. */
void keys_free(keys_svc *k);

typedef struct keys_params {
	const char *name;        /* 1..64 of [A-Za-z0-9._-], unique among unrevoked keys */
	int64_t expires_days;    /* 0 = never, else 1..KEYS_MAX_EXPIRES_DAYS */
	int64_t rpm;             /* requests per minute, 0 = unlimited */
	int64_t tpm;             /* prompt + completion tokens per minute, 0 = unlimited */
	int64_t max_concurrency; /* requests in flight, 0 = unlimited */
} keys_params;

typedef struct keys_created {
	store_key info;            /* the row as stored (id, prefix, created, ...) */
	char key[KEYS_TEXT_SIZE];  /* the key text: give it to the user once, then wipe */
} keys_created;

/* Creates a key.  DS_EINVAL (bad name or bound; the message names the field),
 * DS_EBUSY (name in use by an unrevoked key), DS_ERANGE (KEYS_MAX_ACTIVE
 * reached), DS_EIO (database).  On error out->key is empty. */
int keys_create(keys_svc *k, const keys_params *p, keys_created *out, ds_err *err);

/* Every key, revoked ones too, ordered by id, with usage totals (store_key_list). */
int keys_list(keys_svc *k, store_key **out, size_t *n, ds_err *err);

/* Revokes key id at once (memory and database).  Revoking a revoked key is
 * DS_OK and changes nothing; an unknown id is DS_ENOTFOUND.  out (may be
 * NULL) gets the key's row afterwards. */
int keys_revoke(keys_svc *k, int64_t id, store_key *out, ds_err *err);

/* Keys that are neither revoked nor expired now. */
size_t keys_count(keys_svc *k);

enum keys_auth_fail {
	KEYS_AUTH_OK = 0,
	KEYS_AUTH_MISSING, /* no Authorization header, or no token in it */
	KEYS_AUTH_INVALID, /* no key has this hash */
	KEYS_AUTH_REVOKED,
	KEYS_AUTH_EXPIRED,
};

typedef struct keys_identity {
	int64_t id;
	char name[STORE_NAME_MAX + 1];
	char prefix[STORE_PREFIX_LEN + 1];
	enum keys_auth_fail fail; /* KEYS_AUTH_OK when keys_auth returned DS_OK */
} keys_identity;

/* Authenticates an Authorization header value (NULL when absent): "Bearer
 * <key>" with the scheme in any case, or the bare key (as SGLang's benchmark
 * sends).  The key's hash is compared with every known key's hash in constant
 * time (no early exit).  DS_OK and who->id, or DS_EAUTH with who->fail and a
 * message fit for the 401 body (it never contains the presented key). */
int keys_auth(keys_svc *k, const char *authorization, int64_t now_unix, keys_identity *who,
	      ds_err *err);

enum keys_limit { KEYS_LIMIT_NONE = 0, KEYS_LIMIT_CONCURRENCY, KEYS_LIMIT_RPM, KEYS_LIMIT_TPM };

typedef struct keys_denial {
	enum keys_limit limit;
	const char *name;  /* "max_concurrency", "rpm" or "tpm" (static) */
	int64_t value;     /* the key's setting of that limit */
	int retry_after_s; /* >= 1: whole seconds until the request would pass */
} keys_denial;

/* Admits one request of key_id.  DS_OK: it counts as in flight and in the rpm
 * window; call keys_finish once when it ends (whatever its outcome).
 * DS_EBUSY: over a limit; d says which and when to retry (when several are
 * exceeded, the one that clears last).  DS_EAUTH: the key was revoked since
 * keys_auth.  DS_ENOTFOUND: unknown id.  d may be NULL. */
int keys_admit(keys_svc *k, int64_t key_id, double now_mono, keys_denial *d, ds_err *err);

/* Ends a request admitted by keys_admit: frees its slot, adds its tokens to
 * the tpm window at now_mono, and adds one request and the tokens to
 * key_usage (today, UTC) and sets last_used, in SQLite.  The in-memory part
 * always happens; the return value reports the database write. */
int keys_finish(keys_svc *k, int64_t key_id, double now_mono, int64_t prompt_tokens,
		int64_t completion_tokens, ds_err *err);

/* Finds the token of an Authorization value (see keys_auth): 1 and
 * (*tok, *len) pointing into header, or 0 when there is none. */
int keys_bearer(const char *header, const char **tok, size_t *len);

/* An operator's admin token needs at least KEYS_TOKEN_MIN_LEN characters
 * and keys_token_bits >= KEYS_TOKEN_MIN_BITS. */
#define KEYS_TOKEN_MIN_LEN 32
#define KEYS_TOKEN_MIN_BITS 64.0

/* A conservative estimate of the entropy of a token's n characters, in bits:
 * n x the smaller of the Shannon entropy of its characters and that of the
 * differences between neighbours.  Repeats ("aaaa", "abab") and runs
 * ("abcd", "0123...") score near 0; random text of any alphabet scores about
 * n x log2(alphabet) (32 random hex digits: over 90).  It cannot tell a
 * dictionary phrase from random text. */
double keys_token_bits(const char *s, size_t n);

/* Loads DATA_DIR/admin.token into out (NUL-terminated, whitespace trimmed),
 * creating it first when missing: 32 random bytes in URL-safe base64, mode
 * 0600, created exclusively and fsync'd.  DS_EPERM when the file is readable
 * or writable by group or others; DS_EFORMAT when it is empty, longer than
 * 256 characters or holds whitespace or control characters, and when it is
 * weak: shorter than KEYS_TOKEN_MIN_LEN or under KEYS_TOKEN_MIN_BITS (the
 * message says so and how to make a good one, never the token).  *created
 * (may be NULL) says whether it was made now. */
int keys_admin_token_load(const char *data_dir, char out[KEYS_TOKEN_SIZE], int *created,
			  ds_err *err);

/* 1 when the Authorization value carries exactly the admin token (compared
 * in constant time through hashes of both), else 0. */
int keys_admin_check(const char *admin_token, const char *authorization);

#endif

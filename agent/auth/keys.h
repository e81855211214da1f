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
 * Request flow for an API handler (docs/keys.md, "Limits"):
 *
 *   keys_auth(header) --DS_EAUTH--> 401 (who.fail says why)
 *        | DS_OK: who.id
 *   keys_admit(who.id, cost) --DS_EBUSY--> 429 + Retry-After: d.retry_after_s
 *        |                   --DS_ERANGE--> 400: the request can never fit
 *        | DS_OK: h holds cost.seqs sequences (max_concurrency, and the
 *        |        queue share when they queue); one request in the rpm window
 *   ... tokenize the prompts (generation) ...
 *   keys_reserve(h, tokens) --DS_EBUSY / DS_ERANGE--> 429 / 400, keys_drop(h)
 *        | DS_OK: prompt + max_tokens x n reserved against tpm
 *   ... generate: keys_dequeue(h, n) as the scheduler starts sequences,
 *       keys_hold_revoked(h) between reads: stop when the key was revoked ...
 *   keys_finish(h, tokens used)  settles the reservation, records usage
 *
 * keys_admit checks only what is known before tokenizing (auth is done; the
 * rpm window, sequences in flight, the queue share, a tpm window with no room
 * at all), so a key over a cheap limit costs no tokenizer time.
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

enum keys_limit {
	KEYS_LIMIT_NONE = 0,
	KEYS_LIMIT_CONCURRENCY,
	KEYS_LIMIT_RPM,
	KEYS_LIMIT_TPM,
	KEYS_LIMIT_QUEUE,
};

typedef struct keys_denial {
	enum keys_limit limit;
	const char *name;  /* "max_concurrency", "rpm", "tpm" or "queue_share" (static) */
	int64_t value;     /* the key's setting of that limit (queue_share: the share now) */
	int retry_after_s; /* DS_EBUSY: >= 1, whole seconds until it could pass;
			    * DS_ERANGE: 0 (waiting cannot help) */
} keys_denial;

/* What a request costs, as far as it is known before its prompts are
 * tokenized. */
typedef struct keys_cost {
	int64_t seqs;      /* sequences it runs: prompts x n; 1 for /tokenize */
	int64_t queue_cap; /* the scheduler's waiting queue size (max_waiting) when the
			    * sequences queue there, so the key's share applies; 0 = they
			    * do not queue */
} keys_cost;

/* What an admitted request holds against its key until keys_finish or
 * keys_drop.  Zero-initialised it holds nothing, and every call below that
 * takes a hold is then a no-op (requests served without auth). */
typedef struct keys_hold {
	int64_t key_id;   /* 0 = nothing held */
	int64_t seqs;     /* sequences counted against max_concurrency */
	int64_t queued;   /* of them still counted in the key's share of the waiting queue */
	int64_t reserved; /* tokens reserved against tpm */
	uint64_t revs;    /* the service's revocation count when last looked at */
	int revoked;      /* the key was seen revoked */
} keys_hold;

/* The most sequences of one key that may wait in a queue of queue_cap places
 * while `others` other keys have sequences waiting there:
 * max(1, floor(queue_cap / (others + 2))).  Alone a key gets half the queue,
 * and whatever the number of keys some room stays for a key that arrives. */
int64_t keys_queue_share(int64_t queue_cap, int64_t others);

/* Admits a request of key_id costing c; DS_OK fills h (one request counted in
 * the rpm window, c->seqs sequences in flight and, with c->queue_cap, in the
 * key's queue share).  A request is admitted when
 *   in_flight + seqs <= max_concurrency,
 *   requests in the rpm window < rpm,
 *   tokens in the tpm window + tokens reserved by requests in flight < tpm,
 *   sequences of the key waiting + seqs <= keys_queue_share(queue_cap, others).
 * DS_EBUSY: over a limit now; d says which and when to retry (when several are
 * exceeded, the one that clears last).  DS_ERANGE: the request can never pass
 * (more sequences than max_concurrency or than the key's share of the queue
 * when it is alone); d names the limit.  DS_EAUTH: the key was revoked since
 * keys_auth.  DS_ENOTFOUND: unknown id.  Refused requests are not counted.
 * d may be NULL; err's message names the key and the numbers. */
int keys_admit(keys_svc *k, int64_t key_id, const keys_cost *c, double now_mono, keys_hold *h,
	       keys_denial *d, ds_err *err);

/* Reserves tokens (the prompt tokens plus max_tokens for each sequence: the
 * most the request may use) against the key's tpm: DS_OK when
 *   tokens in the tpm window + tokens reserved in flight + tokens <= tpm.
 * DS_EBUSY (d, err: when to retry) or DS_ERANGE (tokens > tpm: it can never
 * fit); the hold is unchanged then and the caller drops it.  A key without tpm
 * reserves nothing. */
int keys_reserve(keys_svc *k, keys_hold *h, int64_t tokens, double now_mono, keys_denial *d,
		 ds_err *err);

/* n of the hold's sequences left the waiting queue (the scheduler started or
 * ended them): they stop counting in the key's queue share. */
void keys_dequeue(keys_svc *k, keys_hold *h, int64_t n);

/* 1 when the hold's key has been revoked (err: a message naming the key),
 * else 0.  Cheap when nothing was revoked since the last call: one atomic
 * load.  Requests call it between reads to stop within a fraction of a second
 * of a revocation. */
int keys_hold_revoked(keys_svc *k, keys_hold *h, ds_err *err);

/* Ends an admitted request: frees its sequences and queue places, replaces
 * its tpm reservation with the tokens it used (added to the window at
 * now_mono), and adds one request and the tokens to key_usage (today, UTC)
 * and sets last_used, in SQLite.  h then holds nothing.  The in-memory part
 * always happens; the return value reports the database write. */
int keys_finish(keys_svc *k, keys_hold *h, double now_mono, int64_t prompt_tokens,
		int64_t completion_tokens, ds_err *err);

/* Ends an admitted request that was refused before it ran (keys_reserve, a
 * bad prompt): frees what h holds and records nothing; its rpm count stays
 * (its prompt was parsed and tokenized). */
void keys_drop(keys_svc *k, keys_hold *h);

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

/*
 * rpc.h - calls from one agent to the control API of others, and the cluster
 * credential they carry (docs/cluster.md, "Control API and dsctl").
 *
 * rpc_run performs several HTTP/1.1 requests at once (non-blocking sockets,
 * one poll loop, "Connection: close") and waits at most timeout_ms for all of
 * them: a vote round or a heartbeat round costs one round trip however many
 * peers there are, and a silent peer costs the timeout once, not per peer.
 *
 * Every call is signed with the cluster key:
 *
 *   Authorization: DSCluster <sender id, 32 hex>.<unix ms>.<nonce, 16 hex>.<mac, 64 hex>
 *   K   = BLAKE2b-256(key = cluster key, message = "dsagent-control v1")
 *   mac = BLAKE2b-256(key = K, message = METHOD "\n" PATH "\n" <unix ms> "\n"
 *                     <nonce> "\n" <sender id hex> "\n" hex(BLAKE2b-256(body)))
 *
 * (the nonce: 8 random bytes, so two identical requests in one millisecond
 * are still two requests)
 *
 * The receiver (rpc_auth_verify) accepts a request when the MAC matches under
 * one of the keys of its keyring (so key rotation works as for gossip), the
 * time is within RPC_SKEW_MS of its own clock, and the MAC was not seen before
 * (a replay cache covering the whole window).  The cluster key itself never
 * crosses the network; a request cannot be altered or replayed.  Responses
 * are not signed: they travel like the rest of the control API, in clear
 * HTTP (see the limitations in docs/cluster.md).
 *
 * Threading: rpc_run is reentrant (no shared state); an rpc_auth may be used
 * from any thread (the replay cache has a mutex).
 */
#ifndef DS_AGENT_RPC_H
#define DS_AGENT_RPC_H

#include "common/buf.h"
#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

#define RPC_KEY_LEN 32
#define RPC_KEYS_MAX 4
#define RPC_AUTH_MAX 192       /* buffer for an Authorization value */
#define RPC_SKEW_MS 30000      /* accepted clock difference */
#define RPC_REPLAY_SLOTS 8192  /* MACs remembered */

typedef struct rpc_auth rpc_auth;

/* Derives the control key of each cluster key (keys[0] signs, all verify).
 * self_id is the sender id this node signs with.  NULL with err on bad
 * arguments or out of memory. */
rpc_auth *rpc_auth_new(const uint8_t keys[][RPC_KEY_LEN], int n_keys,
		       const uint8_t self_id[16], ds_err *err);
/* Wipes the keys.  NULL is a no-op. */
void rpc_auth_free(rpc_auth *a);

/* The Authorization value of a request (see above) into out (at least
 * RPC_AUTH_MAX bytes).  now_ms is wall-clock Unix milliseconds. */
void rpc_auth_sign(rpc_auth *a, const char *method, const char *path, const char *body,
		   size_t body_len, int64_t now_ms, char out[RPC_AUTH_MAX]);

/* Checks an Authorization value.  DS_OK with the sender id (32 hex + NUL);
 * DS_EAUTH with a message naming what failed (format, clock skew, MAC,
 * replay).  A DS_OK remembers the MAC: the same request is refused next
 * time. */
int rpc_auth_verify(rpc_auth *a, const char *method, const char *path, const char *body,
		    size_t body_len, const char *header, int64_t now_ms, char sender[33],
		    ds_err *err);

/* The part of rpc_auth_verify that needs no body and no key: the value's
 * form and its time within RPC_SKEW_MS of now_ms.  The control API runs it
 * on the headers before reading a body (the MAC covers the body, so only
 * rpc_auth_verify, after it, authenticates).  DS_OK or DS_EAUTH with the
 * message rpc_auth_verify would give. */
int rpc_auth_check_header(const char *header, int64_t now_ms, ds_err *err);

/* 1 when an Authorization value uses the DSCluster scheme. */
int rpc_auth_is_cluster(const char *header);

/* Wall-clock Unix milliseconds. */
int64_t rpc_now_ms(void);

/* One request.  Fill the inputs with rpc_call_init; rpc_run sets the outputs;
 * rpc_call_free releases the response body. */
typedef struct rpc_call {
	char host[48];          /* IPv4 literal */
	int port;
	char method[8];         /* "GET", "POST" */
	char path[256];
	const char *body;       /* borrowed until rpc_run returns; NULL = none */
	size_t body_len;
	/* results */
	int rc;                 /* DS_OK (an HTTP answer, any status), DS_EIO (connect, send,
				   receive: the message says which), DS_ETIMEOUT, DS_EFORMAT
				   (not an HTTP response), DS_ERANGE (body over max_body) */
	int status;             /* HTTP status when rc == DS_OK */
	buf resp;               /* the response body (NUL-terminated) */
	char err[192];          /* what went wrong when rc != DS_OK */
} rpc_call;

/* DS_EINVAL when host is not an IPv4 literal, port out of range or the path
 * does not fit. */
int rpc_call_init(rpc_call *c, const char *host, int port, const char *method,
		  const char *path, const char *body, size_t body_len);
void rpc_call_free(rpc_call *c);

/* Runs the n calls concurrently, each signed with auth (NULL: unsigned),
 * and returns when all finished or timeout_ms passed (unfinished ones get
 * DS_ETIMEOUT).  Each call's result is in its rc/status/resp.  Returns the
 * number of calls with rc == DS_OK. */
size_t rpc_run(rpc_call *calls, size_t n, rpc_auth *auth, int timeout_ms, size_t max_body);

#endif

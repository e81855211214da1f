/*
 * comm.h - collectives over a group of ranks, one interface for every
 * transport.
 *
 * A group (comm_group *, opaque) is W ranks numbered 0..W-1 that call the
 * same collectives in the same order.  It is made by a backend's constructor
 * and released by comm_group_free; behind the handle is a table of ops per
 * backend (comm_impl.h).  Backends:
 *
 *   comm_single_new   one rank (W = 1): every collective is a copy     (built)
 *   comm_gloo_new     CPU ranks over TCP, host buffers         (built, -lgloo)
 *   comm_nccl_new     GPU ranks, device buffers on a stream (built with CUDA=1;
 *                     without CUDA it returns DS_EUNSUPPORTED)
 * docs/distributed.md ("Comm backends") has the rendezvous keys, the failure
 * behaviour measured on each backend and Gloo's limitations.
 *
 * Shape of a call (the common ground of Gloo's and NCCL's collectives):
 * buffers are untyped pointers, sizes are element counts (int64_t; negative
 * is DS_EINVAL), the element type is a comm_dtype, reductions take a
 * comm_op.  Counts are the same on every rank unless the call says
 * otherwise (all_to_allv).  Buffers live where comm_group_mem says: host
 * memory for the one-rank and Gloo groups, device memory of the group's
 * device for NCCL.
 *
 * Contract of every call (all backends):
 *   1. returns 0 or a negative DS_E* code and fills err (when not NULL) with
 *      a message naming the call, the group and the problem.
 *   2. arguments are checked once, in comm.c, before any byte moves: a NULL
 *      buffer with a non-zero count, a negative count or displacement, a
 *      peer or root outside 0..W-1, an unknown dtype or op, buffers that
 *      overlap other than in the in-place form the call allows, or a size
 *      in bytes that overflows are DS_EINVAL and leave the group usable.
 *      (On W > 1 the other ranks then wait for a call that never comes and
 *      end with DS_ETIMEOUT: argument errors are bugs of the caller.)
 *   3. a call waits at most the group's timeout (comm_params.timeout_ms,
 *      changed by comm_group_set_timeout, alike on every rank: a Gloo group
 *      whose timeout changed moves its collectives off its fast path) for
 *      its peers; past it the call returns DS_ETIMEOUT.  A dead or unreachable peer is DS_EIO naming the
 *      rank.  Never a hang: a backend that cannot bound a wait (NCCL)
 *      watches it and aborts its communicator.
 *   4. after DS_ETIMEOUT or DS_EIO the group is broken: every later call
 *      returns the same code and message without communicating.  The only
 *      way on is comm_group_free and a new group (the launcher restarts the
 *      ranks).  The one-rank group never breaks.
 *   5. completion: host groups (one-rank, Gloo) return when the receive
 *      buffers hold the result.  Device groups (NCCL) may return once the
 *      work is queued on the group's stream (comm_params.stream); the
 *      result is there when later work on that stream runs, and
 *      comm_group_sync waits for it (and reports asynchronous errors).
 *      Calling comm_group_sync is correct on every backend.
 *   6. send and recv between a pair of ranks match in call order (no tags).
 *      A send may wait until the peer posts the matching recv, so two ranks
 *      must not both send to each other first; all_to_allv is the exchange.
 *
 * In-place forms (the NCCL conventions, so that a backend can pass them on):
 *   all_reduce      send == recv
 *   all_gather      send == recv + rank * count elements
 *   reduce_scatter  recv == send + rank * count elements
 *   broadcast       one buffer: root's contents are the input, every rank's
 *                   the output
 *   all_to_allv     not allowed: with per-peer counts an in-place exchange
 *                   needs a staging copy that neither transport provides
 *
 * Threading: a group is used by one thread at a time (the rank's step
 * loop); different groups may be used from different threads.
 *
 * Rendezvous (how a multi-rank constructor finds its peers).  The launcher
 * serves a key-value store for one job (comm_store below: served over TCP
 * by comm_store_server_start, later possibly by the head agent's control
 * API).  Keys are "<job>/<group>/<key>".
 *   - rank 0 creates what all ranks share (the NCCL unique id) and
 *     publishes it with set; per-rank facts (Gloo: each rank's listening
 *     address) go under "<rank>/<key>", set by that rank;
 *   - every other rank reads it with get, waiting at most the group's
 *     timeout (DS_ETIMEOUT naming the key when it never appears);
 *   - each rank then publishes "<rank>/ready"; the constructor returns when
 *     all W ranks are ready, or fails with DS_ETIMEOUT naming the ranks
 *     that never arrived.
 * Values are opaque bytes (at most COMM_STORE_VALUE_MAX); set of a key that
 * exists replaces it.  A store is never trusted for sizes: a value of the
 * wrong length is DS_EFORMAT.
 */
#ifndef DS_COMM_H
#define DS_COMM_H

#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

/* Element types.  bf16 and f16 travel as their 2-byte patterns; reductions
 * on them accumulate in f32 and round once (backends document their order). */
typedef enum comm_dtype {
	COMM_F32 = 1,
	COMM_BF16 = 2,
	COMM_F16 = 3,
	COMM_I32 = 4,
	COMM_U8 = 5, /* bytes: serialised step metadata */
} comm_dtype;

typedef enum comm_op {
	COMM_SUM = 1,
	COMM_MAX = 2,
	COMM_MIN = 3,
} comm_op;

/* Where a group's buffers live. */
typedef enum comm_mem {
	COMM_MEM_HOST = 0,
	COMM_MEM_DEVICE = 1,
} comm_mem;

typedef struct comm_params {
	int rank;       /* this rank, 0..world_size-1 */
	int world_size; /* ranks in the group */
	int timeout_ms; /* longest wait of one call for its peers (> 0) */
	const char *name; /* for messages and logs ("world", "tp", "ep"); copied */
	void *stream;   /* device groups: the stream work is queued on (NULL = the
			 * device's default stream); host groups ignore it */
	int spin;       /* host groups: wait for peers by polling the socket instead
			 * of sleeping in the kernel (Gloo's sync mesh); only where
			 * every rank of the machine has a core of its own: a polling
			 * rank sharing a core stalls the one computing on it */
} comm_params;

#define COMM_TIMEOUT_MS_DEFAULT 60000
#define COMM_STORE_VALUE_MAX 4096

/* rank 0 of 1, timeout COMM_TIMEOUT_MS_DEFAULT, name "world", no stream, no spin. */
comm_params comm_default_params(void);

/* The rendezvous store a multi-rank constructor takes (contract above).
 * get waits up to timeout_ms for key to appear; *len gets the value's size
 * (DS_ERANGE when it is larger than cap). */
typedef struct comm_store {
	void *ctx;
	int (*set)(void *ctx, const char *key, const void *value, size_t len, ds_err *err);
	int (*get)(void *ctx, const char *key, void *value, size_t cap, size_t *len, int timeout_ms,
		   ds_err *err);
} comm_store;

typedef struct comm_group comm_group;

/* The one-rank group: p->world_size must be 1 and p->rank 0 (DS_EINVAL
 * otherwise, saying that more ranks need a multi-rank backend); p NULL =
 * comm_default_params().  NULL with err filled on failure. */
comm_group *comm_single_new(const comm_params *p, ds_err *err);

/* ---- rendezvous store served over TCP (the launcher: dsrun's driver, later
 * the agent) ---- */
typedef struct comm_store_server comm_store_server;
/* Serves a store on host:port (port 0: any free port) from a thread of this
 * process until comm_store_server_stop.  NULL with err filled. */
comm_store_server *comm_store_server_start(const char *host, int port, ds_err *err);
/* "host:port" that clients connect to (borrowed until stop). */
const char *comm_store_server_addr(const comm_store_server *s);
void comm_store_server_stop(comm_store_server *s); /* NULL is a no-op */
/* A client of a served store at addr ("host:port"): fills *st (its ctx
 * owns the connection); connecting waits at most timeout_ms.  Released by
 * comm_store_tcp_close. */
int comm_store_tcp_open(comm_store *st, const char *addr, int timeout_ms, ds_err *err);
void comm_store_tcp_close(comm_store *st);

/* Gloo (CPU ranks over TCP, host buffers).  key_prefix scopes the
 * rendezvous keys of this group ("<job>/<group>"); host is the address this
 * rank listens on for its peers ("127.0.0.1" for local ranks).  Every rank
 * of the group calls it with the same prefix and world_size.  NULL with
 * err filled (DS_ETIMEOUT naming the ranks that never arrived).  Process-wide
 * effects of the first call: SIGPIPE is ignored when it had the default
 * action (Gloo writes without MSG_NOSIGNAL) and a terminate handler logs an
 * exception on Gloo's transport thread before the process aborts. */
comm_group *comm_gloo_new(const comm_params *p, const comm_store *store, const char *key_prefix,
			  const char *host, ds_err *err);

/* NCCL (GPU ranks, device buffers; built with CUDA=1, else DS_EUNSUPPORTED):
 * rank 0 makes the unique id and publishes it through store under
 * key_prefix; the communicator is created non-blocking and abandoned
 * (ncclCommAbort) past the timeout.  device: the CUDA device index. */
comm_group *comm_nccl_new(const comm_params *p, const comm_store *store, const char *key_prefix,
			  int device, ds_err *err);

/* Releases the group (NULL is a no-op).  No call may be in flight. */
void comm_group_free(comm_group *g);

int comm_group_rank(const comm_group *g);
int comm_group_size(const comm_group *g);
const char *comm_group_name(const comm_group *g);    /* borrowed until free */
const char *comm_group_backend(const comm_group *g); /* "single", "gloo", "nccl" */
comm_mem comm_group_mem(const comm_group *g);
int comm_group_timeout_ms(const comm_group *g);
/* Changes the timeout of later calls; DS_EINVAL unless timeout_ms > 0. */
int comm_group_set_timeout(comm_group *g, int timeout_ms, ds_err *err);

/* Bytes of one element ("f32" = 4); 0 for an unknown dtype. */
size_t comm_dtype_size(comm_dtype dt);
const char *comm_dtype_name(comm_dtype dt); /* "f32", "bf16"...; "?" when unknown */
const char *comm_op_name(comm_op op);       /* "sum", "max", "min"; "?" when unknown */

/* ---- collectives (contract above; counts are elements of dt) ---- */

/* recv[i] = op over ranks of send[i], i < count, on every rank. */
int comm_all_reduce(comm_group *g, const void *send, void *recv, int64_t count, comm_dtype dt,
		    comm_op op, ds_err *err);

/* recv[r * count + i] = send of rank r [i]: recv holds W * count elements. */
int comm_all_gather(comm_group *g, const void *send, void *recv, int64_t count, comm_dtype dt,
		    ds_err *err);

/* send holds W * count elements; rank r gets recv[i] = op over ranks of
 * send[r * count + i]. */
int comm_reduce_scatter(comm_group *g, const void *send, void *recv, int64_t count,
			comm_dtype dt, comm_op op, ds_err *err);

/* Every rank's buf[0..count) becomes root's. */
int comm_broadcast(comm_group *g, void *buf, int64_t count, comm_dtype dt, int root, ds_err *err);

/* Each of the W-entry arrays is indexed by peer: this rank sends
 * send[send_displs[p] .. + send_counts[p]) to p and receives
 * recv[recv_displs[p] .. + recv_counts[p]) from p (displacements in
 * elements).  send_counts[p] on this rank must equal recv_counts[me] on p.
 * The receive ranges must not overlap each other nor the send buffer. */
int comm_all_to_allv(comm_group *g, const void *send, const int64_t *send_counts,
		     const int64_t *send_displs, void *recv, const int64_t *recv_counts,
		     const int64_t *recv_displs, comm_dtype dt, ds_err *err);

/* Point to point (matched in call order per pair).  A rank sending to or
 * receiving from itself is DS_EINVAL: there is no loopback (a copy is the
 * caller's business, and a blocking send to self could never be matched). */
int comm_send(comm_group *g, const void *buf, int64_t count, comm_dtype dt, int peer, ds_err *err);
int comm_recv(comm_group *g, void *buf, int64_t count, comm_dtype dt, int peer, ds_err *err);

/* Returns when every rank has entered it. */
int comm_barrier(comm_group *g, ds_err *err);

/* Waits until the calls issued so far have completed (device groups; host
 * groups return at once) and reports an asynchronous failure among them. */
int comm_group_sync(comm_group *g, ds_err *err);

#endif

/*
 * comm_nccl.c - the NCCL backend of comm.h: GPU ranks, device buffers,
 * work queued on the group's stream.  Built with CUDA=1; otherwise
 * comm_nccl_new says DS_EUNSUPPORTED and nothing else is compiled.
 *
 * Callers: through comm.c only (comm_nccl_new is the constructor).
 * Calls: NCCL (non-blocking communicator) and the CUDA runtime.
 *
 * Threading: a group is used by one thread at a time (comm.h).
 *
 * Rendezvous (keys under "<prefix>/"):
 *   <rank>/arrived  set by each rank before it joins (the keys that are
 *                   missing name the ranks that never came)
 *   nccl_id         set by rank 0: the ncclUniqueId (exactly its size, or
 *                   DS_EFORMAT)
 *   <rank>/ready    set once the communicator is up
 *
 * Never a hang (comm.h, contract 3): the communicator is created with
 * blocking = 0, so NCCL returns at once from every call and we poll
 * ncclCommGetAsyncError until the call has been issued, against the
 * group's timeout; comm_group_sync polls the stream the same way.  Past
 * the timeout the communicator is aborted (ncclCommAbort) and the call
 * returns DS_ETIMEOUT; the group is then broken (comm.c).
 *
 * Reductions are NCCL's: its algorithm and, for bf16/f16, its per-step
 * rounding (not one rounding from f32 as on Gloo).  Results are
 * reproducible when NCCL's choice of algorithm and protocol is pinned
 * (NCCL_ALGO, NCCL_PROTO) and the world does not change.
 *
 * Not run here: the development machine has no GPU (docs/distributed.md).
 */
#include "comm/comm_impl.h"

#ifndef DS_HAVE_CUDA

comm_group *comm_nccl_new(const comm_params *p, const comm_store *store, const char *key_prefix,
			  int device, ds_err *err)
{
	(void)p;
	(void)store;
	(void)key_prefix;
	(void)device;
	ds_err_set(err, DS_EUNSUPPORTED, "comm nccl: this build has no CUDA (rebuild with CUDA=1 "
					 "on a machine with nvcc and NCCL)");
	return NULL;
}

#else

#include "common/log.h"
#include "common/strutil.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct nccl_group {
	comm_group g; /* first: comm.c sees only this */
	ncclComm_t comm; /* NULL once aborted */
	cudaStream_t stream;
	int device;
	int *one; /* device int for the barrier's all-reduce */
} nccl_group;

static nccl_group *ng(comm_group *g)
{
	return (nccl_group *)g;
}

static int64_t now_ms(void)
{
	return (int64_t)(ds_now_ns() / 1000000u);
}

static ncclDataType_t nccl_type(comm_dtype dt)
{
	switch (dt) {
	case COMM_F32:
		return ncclFloat32;
	case COMM_BF16:
		return ncclBfloat16;
	case COMM_F16:
		return ncclFloat16;
	case COMM_I32:
		return ncclInt32;
	default:
		return ncclUint8;
	}
}

static ncclRedOp_t nccl_op(comm_op op)
{
	return op == COMM_MAX ? ncclMax : op == COMM_MIN ? ncclMin : ncclSum;
}

static void abort_comm(nccl_group *x)
{
	if (x->comm) {
		ncclCommAbort(x->comm);
		x->comm = NULL;
	}
}

/* Waits until the communicator has no call in progress (non-blocking
 * mode), at most the group's timeout from start_ms; r is what the NCCL
 * call itself returned. */
static int settle(nccl_group *x, const char *call, ncclResult_t r, int64_t start_ms, ds_err *err)
{
	comm_group *g = &x->g;
	for (;;) {
		ncclResult_t st = r;
		if (r == ncclSuccess || r == ncclInProgress) {
			if (ncclCommGetAsyncError(x->comm, &st) != ncclSuccess)
				st = ncclInternalError;
		}
		if (st == ncclSuccess)
			return DS_OK;
		if (st != ncclInProgress) {
			const char *last = ncclGetLastError(x->comm);
			int rc = ds_err_set(err, DS_EIO, "comm %s (group %s, nccl, rank %d of %d): %s%s%s",
					    call, g->name, g->rank, g->size, ncclGetErrorString(st),
					    last && last[0] ? ": " : "", last ? last : "");
			abort_comm(x);
			return rc;
		}
		if (now_ms() - start_ms >= g->timeout_ms) {
			abort_comm(x);
			return ds_err_set(err, DS_ETIMEOUT, "comm %s (group %s, nccl, rank %d of %d): not "
							    "done within %d ms: the communicator was aborted",
					  call, g->name, g->rank, g->size, g->timeout_ms);
		}
		r = ncclInProgress;
		usleep(200);
	}
}

static int issued(nccl_group *x, const char *call, ncclResult_t r, ds_err *err)
{
	return settle(x, call, r, now_ms(), err);
}

/* Every op runs with the group's device current: the caller's thread may
 * have used another one since (the device index is the rank's, fixed). */
static nccl_group *on_device(comm_group *g)
{
	nccl_group *x = ng(g);
	cudaSetDevice(x->device);
	return x;
}

static int nccl_all_reduce(comm_group *g, const void *send, void *recv, int64_t count,
			   comm_dtype dt, comm_op op, ds_err *err)
{
	nccl_group *x = on_device(g);
	return issued(x, "all_reduce", ncclAllReduce(send, recv, (size_t)count, nccl_type(dt),
						     nccl_op(op), x->comm, x->stream), err);
}

static int nccl_all_gather(comm_group *g, const void *send, void *recv, int64_t count,
			   comm_dtype dt, ds_err *err)
{
	nccl_group *x = on_device(g);
	return issued(x, "all_gather", ncclAllGather(send, recv, (size_t)count, nccl_type(dt),
						     x->comm, x->stream), err);
}

static int nccl_reduce_scatter(comm_group *g, const void *send, void *recv, int64_t count,
			       comm_dtype dt, comm_op op, ds_err *err)
{
	nccl_group *x = on_device(g);
	return issued(x, "reduce_scatter", ncclReduceScatter(send, recv, (size_t)count, nccl_type(dt),
							     nccl_op(op), x->comm, x->stream), err);
}

static int nccl_broadcast(comm_group *g, void *buf, int64_t count, comm_dtype dt, int root,
			  ds_err *err)
{
	nccl_group *x = on_device(g);
	return issued(x, "broadcast", ncclBroadcast(buf, buf, (size_t)count, nccl_type(dt), root,
						    x->comm, x->stream), err);
}

/* One NCCL group of point-to-point calls (bytes as ncclUint8). */
static int nccl_all_to_allv(comm_group *g, const void *send, const int64_t *send_counts,
			    const int64_t *send_displs, void *recv, const int64_t *recv_counts,
			    const int64_t *recv_displs, comm_dtype dt, ds_err *err)
{
	nccl_group *x = on_device(g);
	size_t es = comm_dtype_size(dt);
	int64_t start = now_ms();
	ncclResult_t r = ncclGroupStart();
	for (int p = 0; p < g->size && (r == ncclSuccess || r == ncclInProgress); p++) {
		if (send_counts[p])
			r = ncclSend((const char *)send + (size_t)send_displs[p] * es,
				     (size_t)send_counts[p] * es, ncclUint8, p, x->comm, x->stream);
		if (recv_counts[p] && (r == ncclSuccess || r == ncclInProgress))
			r = ncclRecv((char *)recv + (size_t)recv_displs[p] * es,
				     (size_t)recv_counts[p] * es, ncclUint8, p, x->comm, x->stream);
	}
	ncclResult_t e = ncclGroupEnd();
	return settle(x, "all_to_allv", r == ncclSuccess || r == ncclInProgress ? e : r, start, err);
}

static int nccl_send(comm_group *g, const void *buf, int64_t count, comm_dtype dt, int peer,
		     ds_err *err)
{
	nccl_group *x = on_device(g);
	return issued(x, "send", ncclSend(buf, (size_t)count, nccl_type(dt), peer, x->comm,
					  x->stream), err);
}

static int nccl_recv(comm_group *g, void *buf, int64_t count, comm_dtype dt, int peer,
		     ds_err *err)
{
	nccl_group *x = on_device(g);
	return issued(x, "recv", ncclRecv(buf, (size_t)count, nccl_type(dt), peer, x->comm,
					  x->stream), err);
}

/* Waits for the stream, watching the communicator for errors. */
static int nccl_sync(comm_group *g, ds_err *err)
{
	nccl_group *x = on_device(g);
	int64_t start = now_ms();
	for (;;) {
		cudaError_t ce = cudaStreamQuery(x->stream);
		if (ce == cudaSuccess)
			return settle(x, "sync", ncclSuccess, start, err);
		if (ce != cudaErrorNotReady) {
			abort_comm(x);
			return ds_err_set(err, DS_EIO, "comm sync (group %s, nccl, rank %d of %d): %s",
					  g->name, g->rank, g->size, cudaGetErrorString(ce));
		}
		int rc = settle(x, "sync", ncclSuccess, start, err);
		if (rc)
			return rc;
		if (now_ms() - start >= g->timeout_ms) {
			abort_comm(x);
			return ds_err_set(err, DS_ETIMEOUT, "comm sync (group %s, nccl, rank %d of %d): the "
							    "stream did not drain within %d ms: the "
							    "communicator was aborted",
					  g->name, g->rank, g->size, g->timeout_ms);
		}
		usleep(200);
	}
}

/* NCCL has no barrier: an all-reduce of one int, then waiting for it. */
static int nccl_barrier(comm_group *g, ds_err *err)
{
	nccl_group *x = on_device(g);
	int rc = issued(x, "barrier", ncclAllReduce(x->one, x->one, 1, ncclInt32, ncclMax, x->comm,
						    x->stream), err);
	return rc ? rc : nccl_sync(g, err);
}

static void nccl_free(comm_group *g)
{
	nccl_group *x = on_device(g);
	if (x->comm) {
		if (g->broken.code)
			ncclCommAbort(x->comm);
		else
			ncclCommDestroy(x->comm);
	}
	if (x->one)
		cudaFree(x->one);
	free(x);
}

static const comm_ops nccl_ops = {
	.name = "nccl",
	.mem = COMM_MEM_DEVICE,
	.free = nccl_free,
	.all_reduce = nccl_all_reduce,
	.all_gather = nccl_all_gather,
	.reduce_scatter = nccl_reduce_scatter,
	.broadcast = nccl_broadcast,
	.all_to_allv = nccl_all_to_allv,
	.send = nccl_send,
	.recv = nccl_recv,
	.barrier = nccl_barrier,
	.sync = nccl_sync,
};

/* "2, 5": the ranks whose <rank>/arrived is missing. */
static void missing_ranks(const comm_store *st, const char *prefix, int W, char *out, size_t cap)
{
	size_t n = 0;
	out[0] = '\0';
	for (int r = 0; r < W && n + 16 < cap; r++) {
		char key[192], v[8];
		size_t len;
		snprintf(key, sizeof key, "%s/%d/arrived", prefix, r);
		if (st->get(st->ctx, key, v, sizeof v, &len, 1, NULL) == DS_ETIMEOUT)
			n += (size_t)snprintf(out + n, cap - n, "%s%d", n ? ", " : "", r);
	}
}

comm_group *comm_nccl_new(const comm_params *p, const comm_store *store, const char *key_prefix,
			  int device, ds_err *err)
{
	comm_params def = comm_default_params();
	nccl_group *x = NULL;
	ncclUniqueId id;
	char key[192];
	size_t len = 0;
	int rc;
	if (!p)
		p = &def;
	if (!store || !store->set || !store->get)
		return ds_err_set(err, DS_EINVAL, "comm nccl: a rendezvous store is needed"), NULL;
	if (!key_prefix || !key_prefix[0] || strlen(key_prefix) > 128)
		return ds_err_set(err, DS_EINVAL, "comm nccl: key prefix must be 1..128 bytes"), NULL;
	x = calloc(1, sizeof *x);
	if (!x)
		return ds_err_set(err, DS_ENOMEM, "comm nccl: out of memory"), NULL;
	if ((rc = comm_group_init(&x->g, &nccl_ops, p, err)))
		goto fail;
	comm_group *g = &x->g;
	x->device = device;
	x->stream = (cudaStream_t)p->stream;
	cudaError_t ce = cudaSetDevice(device);
	if (ce == cudaSuccess)
		ce = cudaMalloc((void **)&x->one, sizeof(int));
	if (ce == cudaSuccess)
		ce = cudaMemset(x->one, 0, sizeof(int));
	if (ce != cudaSuccess) {
		rc = ds_err_set(err, DS_ENODEV, "comm nccl (group %s): CUDA device %d: %s", g->name, device,
				cudaGetErrorString(ce));
		goto fail;
	}
	snprintf(key, sizeof key, "%s/%d/arrived", key_prefix, g->rank);
	if ((rc = store->set(store->ctx, key, "1", 1, err)))
		goto fail;
	snprintf(key, sizeof key, "%s/nccl_id", key_prefix);
	if (g->rank == 0) {
		ncclResult_t r = ncclGetUniqueId(&id);
		if (r != ncclSuccess) {
			rc = ds_err_set(err, DS_EIO, "comm nccl (group %s): ncclGetUniqueId: %s", g->name,
					ncclGetErrorString(r));
			goto fail;
		}
		if ((rc = store->set(store->ctx, key, &id, sizeof id, err)))
			goto fail;
	} else {
		rc = store->get(store->ctx, key, &id, sizeof id, &len, g->timeout_ms, err);
		if (rc == DS_ERANGE || (!rc && len != sizeof id))
			rc = ds_err_set(err, DS_EFORMAT, "comm nccl (group %s): %s holds %zu bytes, a "
							 "unique id has %zu", g->name, key, len, sizeof id);
		if (rc)
			goto fail;
	}
	int64_t start = now_ms();
	ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
	cfg.blocking = 0;
	ncclResult_t r = ncclCommInitRankConfig(&x->comm, g->size, id, g->rank, &cfg);
	if (!x->comm) {
		rc = ds_err_set(err, DS_EIO, "comm nccl (group %s): ncclCommInitRankConfig: %s", g->name,
				ncclGetErrorString(r));
		goto fail;
	}
	if ((rc = settle(x, "init", r, start, err))) {
		if (rc == DS_ETIMEOUT) {
			char miss[128];
			missing_ranks(store, key_prefix, g->size, miss, sizeof miss);
			if (miss[0])
				ds_err_wrap(err, "ranks %s never arrived", miss);
		}
		goto fail;
	}
	snprintf(key, sizeof key, "%s/%d/ready", key_prefix, g->rank);
	if ((rc = store->set(store->ctx, key, "1", 1, err)))
		goto fail;
	log_info("comm_nccl", "group connected", "group=%s prefix=%s rank=%d size=%d device=%d",
		 g->name, key_prefix, g->rank, g->size, device);
	return g;
fail:
	if (x->comm)
		ncclCommAbort(x->comm);
	if (x->one)
		cudaFree(x->one);
	free(x);
	return NULL;
}

#endif

/*
 * comm.c - the boundary of comm.h: checks every argument once, refuses calls
 * on a broken group, then calls the backend's op (comm_impl.h).
 *
 * Callers: the worker (worker/worker.c) and, with the distributed engine,
 * the engine's communication points; tests/unit/test_comm.c.
 * Calls: the op table of the group's backend (comm_single.c today).
 *
 * Threading: none of its own; a group is used by one thread at a time
 * (comm.h), so the broken state needs no lock.
 *
 * Invariants:
 *   1. an op is never called with an argument comm_impl.h says it may
 *      assume: every check of that list is made here, for every backend.
 *   2. an argument error changes nothing (the group stays usable); a
 *      DS_ETIMEOUT or DS_EIO from an op is recorded in g->broken and every
 *      later call returns it without reaching the op.
 *   3. byte sizes are computed here once, in size_t, after checking that
 *      count * element size (times the world size where the call needs it)
 *      does not overflow.
 */
#include "comm/comm_impl.h"
#include "common/strutil.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

comm_params comm_default_params(void)
{
	return (comm_params){
		.rank = 0,
		.world_size = 1,
		.timeout_ms = COMM_TIMEOUT_MS_DEFAULT,
		.name = "world",
		.stream = NULL,
		.spin = 0,
	};
}

int comm_group_init(comm_group *g, const comm_ops *ops, const comm_params *p, ds_err *err)
{
	if (p->world_size < 1)
		return ds_err_set(err, DS_EINVAL, "comm: world size %d: a group has at least one rank",
				  p->world_size);
	if (p->rank < 0 || p->rank >= p->world_size)
		return ds_err_set(err, DS_EINVAL, "comm: rank %d is outside 0..%d of a group of %d", p->rank,
				  p->world_size - 1, p->world_size);
	if (p->timeout_ms <= 0)
		return ds_err_set(err, DS_EINVAL, "comm: timeout %d ms: it must be positive", p->timeout_ms);
	g->ops = ops;
	g->rank = p->rank;
	g->size = p->world_size;
	g->timeout_ms = p->timeout_ms;
	g->stream = p->stream;
	ds_strlcpy(g->name, p->name && p->name[0] ? p->name : "world", sizeof g->name);
	ds_err_clear(&g->broken);
	return DS_OK;
}

void comm_group_free(comm_group *g)
{
	if (g)
		g->ops->free(g);
}

int comm_group_rank(const comm_group *g)
{
	return g->rank;
}

int comm_group_size(const comm_group *g)
{
	return g->size;
}

const char *comm_group_name(const comm_group *g)
{
	return g->name;
}

const char *comm_group_backend(const comm_group *g)
{
	return g->ops->name;
}

comm_mem comm_group_mem(const comm_group *g)
{
	return g->ops->mem;
}

int comm_group_timeout_ms(const comm_group *g)
{
	return g->timeout_ms;
}

int comm_group_set_timeout(comm_group *g, int timeout_ms, ds_err *err)
{
	if (timeout_ms <= 0)
		return ds_err_set(err, DS_EINVAL, "comm group %s: timeout %d ms: it must be positive",
				  g->name, timeout_ms);
	g->timeout_ms = timeout_ms;
	return DS_OK;
}

size_t comm_dtype_size(comm_dtype dt)
{
	switch (dt) {
	case COMM_F32:
	case COMM_I32:
		return 4;
	case COMM_BF16:
	case COMM_F16:
		return 2;
	case COMM_U8:
		return 1;
	}
	return 0;
}

const char *comm_dtype_name(comm_dtype dt)
{
	switch (dt) {
	case COMM_F32:
		return "f32";
	case COMM_BF16:
		return "bf16";
	case COMM_F16:
		return "f16";
	case COMM_I32:
		return "i32";
	case COMM_U8:
		return "u8";
	}
	return "?";
}

const char *comm_op_name(comm_op op)
{
	switch (op) {
	case COMM_SUM:
		return "sum";
	case COMM_MAX:
		return "max";
	case COMM_MIN:
		return "min";
	}
	return "?";
}

/* ---- checks shared by the calls ---- */

/* g present and not broken. */
static int check_group(comm_group *g, const char *call, ds_err *err)
{
	if (!g)
		return ds_err_set(err, DS_EINVAL, "comm %s: no group (NULL)", call);
	if (g->broken.code) {
		if (err)
			*err = g->broken;
		return g->broken.code;
	}
	return DS_OK;
}

static int check_dtype(const comm_group *g, const char *call, comm_dtype dt, size_t *esize,
		       ds_err *err)
{
	*esize = comm_dtype_size(dt);
	if (!*esize)
		return ds_err_set(err, DS_EINVAL, "comm %s (group %s): unknown dtype %d", call, g->name,
				  (int)dt);
	return DS_OK;
}

static int check_op(const comm_group *g, const char *call, comm_op op, ds_err *err)
{
	if (op != COMM_SUM && op != COMM_MAX && op != COMM_MIN)
		return ds_err_set(err, DS_EINVAL, "comm %s (group %s): unknown reduce op %d", call,
				  g->name, (int)op);
	return DS_OK;
}

/* *bytes = count * esize * mult, refusing negative counts and overflow.
 * what[idx] names the argument (idx < 0: what alone); the name is formatted
 * only on failure, since all_to_allv checks 2 x W of them per call. */
static int check_bytes(const comm_group *g, const char *call, const char *what, int idx,
		       int64_t count, size_t esize, int64_t mult, size_t *bytes, ds_err *err)
{
	int64_t per = INT64_MAX / (int64_t)esize / mult;
	if (count >= 0 && count <= per && (uint64_t)count * esize * (uint64_t)mult <= SIZE_MAX) {
		*bytes = (size_t)count * esize * (size_t)mult;
		return DS_OK;
	}
	char name[64];
	if (idx >= 0)
		snprintf(name, sizeof name, "%s[%d]", what, idx);
	else
		snprintf(name, sizeof name, "%s", what);
	return ds_err_set(err, DS_EINVAL, "comm %s (group %s): %s %lld is %s", call, g->name, name,
			  (long long)count, count < 0 ? "negative" : "too large");
}

static int check_buf(const comm_group *g, const char *call, const char *what, const void *p,
		     size_t bytes, ds_err *err)
{
	if (bytes && !p)
		return ds_err_set(err, DS_EINVAL, "comm %s (group %s): %s buffer is NULL for %zu bytes", call,
				  g->name, what, bytes);
	return DS_OK;
}

static int ranges_overlap(const void *a, size_t na, const void *b, size_t nb)
{
	uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
	return na && nb && x < y + nb && y < x + na;
}

static int check_peer(const comm_group *g, const char *call, const char *what, int peer,
		      ds_err *err)
{
	if (peer < 0 || peer >= g->size)
		return ds_err_set(err, DS_EINVAL, "comm %s (group %s): %s %d is outside 0..%d", call, g->name,
				  what, peer, g->size - 1);
	return DS_OK;
}

/* Records a transport failure (invariant 2). */
static int finish(comm_group *g, int rc, const ds_err *e, ds_err *err)
{
	if (!rc)
		return DS_OK;
	if (rc == DS_ETIMEOUT || rc == DS_EIO) {
		g->broken = *e;
		g->broken.code = rc;
	}
	if (err)
		*err = *e;
	return rc;
}

/* ---- the calls ---- */

int comm_all_reduce(comm_group *g, const void *send, void *recv, int64_t count, comm_dtype dt,
		    comm_op op, ds_err *err)
{
	const char *call = "all_reduce";
	size_t es, n;
	ds_err e = {0};
	int rc;
	if ((rc = check_group(g, call, err)) || (rc = check_dtype(g, call, dt, &es, err)) ||
	    (rc = check_op(g, call, op, err)) ||
	    (rc = check_bytes(g, call, "count", -1, count, es, 1, &n, err)) ||
	    (rc = check_buf(g, call, "send", send, n, err)) ||
	    (rc = check_buf(g, call, "recv", recv, n, err)))
		return rc;
	if (send != recv && ranges_overlap(send, n, recv, n))
		return ds_err_set(err, DS_EINVAL, "comm %s (group %s): send and recv overlap without being "
						  "the same buffer (in place is send == recv)", call, g->name);
	if (!n)
		return DS_OK;
	return finish(g, g->ops->all_reduce(g, send, recv, count, dt, op, &e), &e, err);
}

int comm_all_gather(comm_group *g, const void *send, void *recv, int64_t count, comm_dtype dt,
		    ds_err *err)
{
	const char *call = "all_gather";
	size_t es, n, total;
	ds_err e = {0};
	int rc;
	if ((rc = check_group(g, call, err)) || (rc = check_dtype(g, call, dt, &es, err)) ||
	    (rc = check_bytes(g, call, "count", -1, count, es, g->size, &total, err)))
		return rc;
	n = total / (size_t)g->size;
	if ((rc = check_buf(g, call, "send", send, n, err)) ||
	    (rc = check_buf(g, call, "recv", recv, total, err)))
		return rc;
	if (n && (const char *)send != (const char *)recv + (size_t)g->rank * n &&
	    ranges_overlap(send, n, recv, total))
		return ds_err_set(err, DS_EINVAL, "comm %s (group %s): send overlaps recv other than in "
						  "place (send == recv + rank * count)", call, g->name);
	if (!n)
		return DS_OK;
	return finish(g, g->ops->all_gather(g, send, recv, count, dt, &e), &e, err);
}

int comm_reduce_scatter(comm_group *g, const void *send, void *recv, int64_t count,
			comm_dtype dt, comm_op op, ds_err *err)
{
	const char *call = "reduce_scatter";
	size_t es, n, total;
	ds_err e = {0};
	int rc;
	if ((rc = check_group(g, call, err)) || (rc = check_dtype(g, call, dt, &es, err)) ||
	    (rc = check_op(g, call, op, err)) ||
	    (rc = check_bytes(g, call, "count", -1, count, es, g->size, &total, err)))
		return rc;
	n = total / (size_t)g->size;
	if ((rc = check_buf(g, call, "send", send, total, err)) ||
	    (rc = check_buf(g, call, "recv", recv, n, err)))
		return rc;
	if (n && (char *)recv != (const char *)send + (size_t)g->rank * n &&
	    ranges_overlap(send, total, recv, n))
		return ds_err_set(err, DS_EINVAL, "comm %s (group %s): recv overlaps send other than in "
						  "place (recv == send + rank * count)", call, g->name);
	if (!n)
		return DS_OK;
	return finish(g, g->ops->reduce_scatter(g, send, recv, count, dt, op, &e), &e, err);
}

int comm_broadcast(comm_group *g, void *buf, int64_t count, comm_dtype dt, int root, ds_err *err)
{
	const char *call = "broadcast";
	size_t es, n;
	ds_err e = {0};
	int rc;
	if ((rc = check_group(g, call, err)) || (rc = check_dtype(g, call, dt, &es, err)) ||
	    (rc = check_peer(g, call, "root", root, err)) ||
	    (rc = check_bytes(g, call, "count", -1, count, es, 1, &n, err)) ||
	    (rc = check_buf(g, call, "data", buf, n, err)))
		return rc;
	if (!n)
		return DS_OK;
	return finish(g, g->ops->broadcast(g, buf, count, dt, root, &e), &e, err);
}

/* One side (send or recv) of all_to_allv: counts and displacements >= 0,
 * extents without overflow, the buffer present when any count is non-zero;
 * [*lo, *hi) gets the bytes the non-empty ranges span (lo = hi = 0 when all
 * are empty). */
static int check_side(const comm_group *g, const char *side, const void *buf,
		      const int64_t *counts, const int64_t *displs, size_t es, size_t *lo, size_t *hi,
		      ds_err *err)
{
	const char *call = "all_to_allv";
	*lo = *hi = 0;
	if (!counts || !displs)
		return ds_err_set(err, DS_EINVAL, "comm %s (group %s): %s counts and displacements are "
						  "needed (%d entries each)", call, g->name, side, g->size);
	int any = 0, sending = strcmp(side, "send") == 0;
	const char *counts_name = sending ? "send_counts" : "recv_counts";
	const char *displs_name = sending ? "send_displs" : "recv_displs";
	for (int p = 0; p < g->size; p++) {
		size_t n = 0, off = 0;
		int rc = check_bytes(g, call, counts_name, p, counts[p], es, 1, &n, err);
		if (!rc)
			rc = check_bytes(g, call, displs_name, p, displs[p], es, 1, &off, err);
		if (rc)
			return rc;
		if (off > SIZE_MAX - n || off + n > (size_t)INT64_MAX)
			return ds_err_set(err, DS_EINVAL, "comm %s (group %s): %s range of peer %d ends past "
							  "the addressable bytes", call, g->name, side, p);
		if (!n)
			continue;
		if (!any || off < *lo)
			*lo = off;
		if (!any || off + n > *hi)
			*hi = off + n;
		any = 1;
	}
	if (any && !buf)
		return ds_err_set(err, DS_EINVAL, "comm %s (group %s): %s buffer is NULL for %zu bytes", call,
				  g->name, side, *hi);
	return DS_OK;
}

int comm_all_to_allv(comm_group *g, const void *send, const int64_t *send_counts,
		     const int64_t *send_displs, void *recv, const int64_t *recv_counts,
		     const int64_t *recv_displs, comm_dtype dt, ds_err *err)
{
	const char *call = "all_to_allv";
	size_t es, slo, shi, rlo, rhi;
	ds_err e = {0};
	int rc;
	if ((rc = check_group(g, call, err)) || (rc = check_dtype(g, call, dt, &es, err)) ||
	    (rc = check_side(g, "send", send, send_counts, send_displs, es, &slo, &shi, err)) ||
	    (rc = check_side(g, "recv", recv, recv_counts, recv_displs, es, &rlo, &rhi, err)))
		return rc;
	if (shi > slo && rhi > rlo &&
	    ranges_overlap((const char *)send + slo, shi - slo, (char *)recv + rlo, rhi - rlo))
		return ds_err_set(err, DS_EINVAL, "comm %s (group %s): the send and recv ranges overlap (no "
						  "in-place form)", call, g->name);
	/* receive ranges pairwise disjoint: W is small (ranks of one group) */
	for (int p = 0; p < g->size; p++) {
		for (int q = p + 1; q < g->size; q++) {
			int64_t a0 = recv_displs[p], a1 = a0 + recv_counts[p];
			int64_t b0 = recv_displs[q], b1 = b0 + recv_counts[q];
			if (a1 > a0 && b1 > b0 && a0 < b1 && b0 < a1)
				return ds_err_set(err, DS_EINVAL, "comm %s (group %s): the recv ranges of peers "
								  "%d and %d overlap", call, g->name, p, q);
		}
	}
	/* no shortcut when this rank moves nothing: its peers may still be
	 * exchanging, and some transports need every rank in the call */
	return finish(g, g->ops->all_to_allv(g, send, send_counts, send_displs, recv, recv_counts,
					     recv_displs, dt, &e), &e, err);
}

static int check_p2p(comm_group *g, const char *call, const void *buf, int64_t count,
		     comm_dtype dt, int peer, size_t *n, ds_err *err)
{
	size_t es;
	int rc;
	if ((rc = check_group(g, call, err)) || (rc = check_dtype(g, call, dt, &es, err)) ||
	    (rc = check_peer(g, call, "peer", peer, err)) ||
	    (rc = check_bytes(g, call, "count", -1, count, es, 1, n, err)) ||
	    (rc = check_buf(g, call, "data", buf, *n, err)))
		return rc;
	if (peer == g->rank)
		return ds_err_set(err, DS_EINVAL, "comm %s (group %s): peer %d is this rank: there is no "
						  "loopback (copy the data instead)", call, g->name, peer);
	return DS_OK;
}

int comm_send(comm_group *g, const void *buf, int64_t count, comm_dtype dt, int peer, ds_err *err)
{
	size_t n;
	ds_err e = {0};
	int rc = check_p2p(g, "send", buf, count, dt, peer, &n, err);
	if (rc || !n)
		return rc;
	return finish(g, g->ops->send(g, buf, count, dt, peer, &e), &e, err);
}

int comm_recv(comm_group *g, void *buf, int64_t count, comm_dtype dt, int peer, ds_err *err)
{
	size_t n;
	ds_err e = {0};
	int rc = check_p2p(g, "recv", buf, count, dt, peer, &n, err);
	if (rc || !n)
		return rc;
	return finish(g, g->ops->recv(g, buf, count, dt, peer, &e), &e, err);
}

int comm_barrier(comm_group *g, ds_err *err)
{
	ds_err e = {0};
	int rc = check_group(g, "barrier", err);
	if (rc)
		return rc;
	return finish(g, g->ops->barrier(g, &e), &e, err);
}

int comm_group_sync(comm_group *g, ds_err *err)
{
	ds_err e = {0};
	int rc = check_group(g, "sync", err);
	if (rc || !g->ops->sync)
		return rc;
	return finish(g, g->ops->sync(g, &e), &e, err);
}

/*
 * comm_single.c - the one-rank group: what a rank does when it is the whole
 * world (today's engine: tp = pp = ep = 1).
 *
 * Callers: through comm.c only (comm_single_new is the constructor).
 * Threading: as comm.h (one thread per group); no state besides the common
 * fields.
 *
 * Every collective over one rank is the identity on its data, so each op is
 * at most one copy (memmove: the in-place forms comm.c lets through are the
 * same buffer):
 *   all_reduce      recv = send (a reduction of one term is exact, for every
 *                   op and dtype: no rounding of bf16/f16 happens)
 *   all_gather      recv[0..count) = send
 *   reduce_scatter  recv = send[0..count)
 *   broadcast       nothing (root is 0, the buffer already holds its data)
 *   all_to_allv     recv[recv_displs[0]..] = send[send_displs[0]..], after
 *                   checking send_counts[0] == recv_counts[0] (the
 *                   cross-rank agreement a multi-rank backend checks on the
 *                   wire)
 *   barrier         nothing
 *   send / recv     unreachable: the only peer would be this rank, which
 *                   comm.c refuses (no loopback)
 * It never times out and never breaks.  It owns no buffers.
 */
#include "comm/comm_impl.h"

#include <stdlib.h>
#include <string.h>

static void single_free(comm_group *g)
{
	free(g);
}

static int single_all_reduce(comm_group *g, const void *send, void *recv, int64_t count,
			     comm_dtype dt, comm_op op, ds_err *err)
{
	if (send != recv)
		memmove(recv, send, (size_t)count * comm_dtype_size(dt));
	return DS_OK;
}

static int single_all_gather(comm_group *g, const void *send, void *recv, int64_t count,
			     comm_dtype dt, ds_err *err)
{
	if (send != recv)
		memmove(recv, send, (size_t)count * comm_dtype_size(dt));
	return DS_OK;
}

static int single_reduce_scatter(comm_group *g, const void *send, void *recv, int64_t count,
				 comm_dtype dt, comm_op op, ds_err *err)
{
	if (send != recv)
		memmove(recv, send, (size_t)count * comm_dtype_size(dt));
	return DS_OK;
}

static int single_broadcast(comm_group *g, void *buf, int64_t count, comm_dtype dt, int root,
			    ds_err *err)
{
	return DS_OK;
}

static int single_all_to_allv(comm_group *g, const void *send, const int64_t *send_counts,
			      const int64_t *send_displs, void *recv, const int64_t *recv_counts,
			      const int64_t *recv_displs, comm_dtype dt, ds_err *err)
{
	size_t es = comm_dtype_size(dt);
	if (send_counts[0] != recv_counts[0])
		return ds_err_set(err, DS_EINVAL, "comm all_to_allv (group %s): rank 0 sends %lld elements "
						  "to itself but its recv_counts[0] is %lld", g->name,
				  (long long)send_counts[0], (long long)recv_counts[0]);
	if (send_counts[0])
		memmove((char *)recv + (size_t)recv_displs[0] * es,
			(const char *)send + (size_t)send_displs[0] * es, (size_t)send_counts[0] * es);
	return DS_OK;
}

static int single_p2p_unreachable(comm_group *g, ds_err *err)
{
	return ds_err_set(err, DS_EINTERNAL, "comm group %s: point-to-point on a one-rank group "
					     "reached the backend", g->name);
}

static int single_send(comm_group *g, const void *buf, int64_t count, comm_dtype dt, int peer,
		       ds_err *err)
{
	return single_p2p_unreachable(g, err);
}

static int single_recv(comm_group *g, void *buf, int64_t count, comm_dtype dt, int peer,
		       ds_err *err)
{
	return single_p2p_unreachable(g, err);
}

static int single_barrier(comm_group *g, ds_err *err)
{
	return DS_OK;
}

static const comm_ops single_ops = {
	.name = "single",
	.mem = COMM_MEM_HOST,
	.free = single_free,
	.all_reduce = single_all_reduce,
	.all_gather = single_all_gather,
	.reduce_scatter = single_reduce_scatter,
	.broadcast = single_broadcast,
	.all_to_allv = single_all_to_allv,
	.send = single_send,
	.recv = single_recv,
	.barrier = single_barrier,
	.sync = NULL,
};

comm_group *comm_single_new(const comm_params *p, ds_err *err)
{
	comm_params def = comm_default_params();
	if (!p)
		p = &def;
	if (p->world_size != 1) {
		ds_err_set(err, DS_EINVAL, "comm: the one-rank group cannot hold %d ranks; more than one "
					   "rank needs a multi-rank backend (gloo, nccl: not built yet)",
			   p->world_size);
		return NULL;
	}
	comm_group *g = calloc(1, sizeof *g);
	if (!g) {
		ds_err_set(err, DS_ENOMEM, "comm: out of memory for a group");
		return NULL;
	}
	if (comm_group_init(g, &single_ops, p, err)) {
		free(g);
		return NULL;
	}
	return g;
}

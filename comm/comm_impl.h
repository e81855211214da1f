/*
 * comm_impl.h - what a comm backend implements (private to comm/).
 *
 * A backend allocates a struct whose first member is a comm_group, fills the
 * group's fields with comm_group_init and points ops at its table (filled
 * with designated initialisers).  comm.c checks every argument and the
 * broken state before it calls an op, so an op may assume: buffers non-NULL
 * where the count is non-zero, counts and displacements >= 0, byte sizes
 * that fit in size_t, peer and root in range and not this rank for send and
 * recv, dt and op known, overlaps only in the allowed in-place form.  An op
 * returns 0 or a negative DS_E* code with err filled; DS_ETIMEOUT and DS_EIO
 * break the group (comm.c records them).
 */
#ifndef DS_COMM_IMPL_H
#define DS_COMM_IMPL_H

#include "comm/comm.h"

typedef struct comm_ops {
	const char *name; /* "single", "gloo", "nccl" */
	comm_mem mem;
	void (*free)(comm_group *g);
	int (*all_reduce)(comm_group *g, const void *send, void *recv, int64_t count,
			  comm_dtype dt, comm_op op, ds_err *err);
	int (*all_gather)(comm_group *g, const void *send, void *recv, int64_t count,
			  comm_dtype dt, ds_err *err);
	int (*reduce_scatter)(comm_group *g, const void *send, void *recv, int64_t count,
			      comm_dtype dt, comm_op op, ds_err *err);
	int (*broadcast)(comm_group *g, void *buf, int64_t count, comm_dtype dt, int root,
			 ds_err *err);
	int (*all_to_allv)(comm_group *g, const void *send, const int64_t *send_counts,
			   const int64_t *send_displs, void *recv, const int64_t *recv_counts,
			   const int64_t *recv_displs, comm_dtype dt, ds_err *err);
	int (*send)(comm_group *g, const void *buf, int64_t count, comm_dtype dt, int peer,
		    ds_err *err);
	int (*recv)(comm_group *g, void *buf, int64_t count, comm_dtype dt, int peer, ds_err *err);
	int (*barrier)(comm_group *g, ds_err *err);
	int (*sync)(comm_group *g, ds_err *err); /* NULL: calls complete on return */
} comm_ops;

#define COMM_NAME_MAX 32

struct comm_group {
	const comm_ops *ops;
	int rank, size, timeout_ms;
	void *stream;
	char name[COMM_NAME_MAX];
	ds_err broken; /* code != 0 once a transport error broke the group */
};

/* Fills g's common fields from p after checking rank, world_size and
 * timeout_ms; DS_EINVAL naming the field otherwise. */
int comm_group_init(comm_group *g, const comm_ops *ops, const comm_params *p, ds_err *err);

#endif

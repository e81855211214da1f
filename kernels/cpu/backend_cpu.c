/*
 * backend_cpu.c - the CPU backend's ops table: host memory, memcpy
 * transfers, and each op dispatched to the best ISA (see cpu.h).
 * Called through kernels/backend.h (kb_backend_open("cpu"), kb_<op>).
 * Every op validates its arguments here (negative sizes, strides shorter than
 * a row, NULL pointers, unknown dtypes -> DS_EINVAL) before any kernel runs;
 * the kc_<op>_isa functions behind it trust their arguments.
 * An instance holds no state of its own: every CPU instance shares the
 * process's thread pool (pool.h), which the kernels reach through
 * kc_parallel_for; open with params.threads > 0 and set_threads resize it.
 * Every op is timed while the per-call profile is on (profile.h).
 * Thread rule: stateless apart from the ISA cache in isa.c, the thread
 * pool and the profile's rows (pool.h: one caller of the ops at a time).
 */
#include "common/strutil.h"
#include "kernels/cpu/attn.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/profile.h"
#include "kernels/cpu/quant.h"

#include <stdlib.h>
#include <string.h>

static const char *cpu_describe(const kb_backend *be)
{
	return kc_isa_name(kc_isa_active());
}

static void *cpu_alloc(const kb_backend *be, size_t bytes)
{
	/* 64-byte alignment: a cache line and one AVX-512 register. */
	size_t n = (bytes + 63) & ~(size_t)63;
	return aligned_alloc(64, n ? n : 64);
}

static void cpu_release(const kb_backend *be, void *p)
{
	free(p);
}

static int cpu_copy(const kb_backend *be, void *dst, const void *src, size_t bytes)
{
	memcpy(dst, src, bytes);
	return DS_OK;
}

static int cpu_sync(const kb_backend *be)
{
	return DS_OK;
}

static int rmsnorm_run(const kb_backend *be, const kb_rmsnorm_args *a)
{
	if (!a || a->rows < 0 || a->dim <= 0)
		return DS_EINVAL;
	if (a->rows == 0)
		return DS_OK;
	if (!a->out || !a->x || !a->w || a->x_stride < a->dim || a->out_stride < a->dim)
		return DS_EINVAL;
	return kc_rmsnorm_isa(kc_isa_active(), a);
}

/* DS_EINVAL for arguments the matmul refuses, 1 when there is nothing to
 * compute (M or N is 0), else DS_OK. */
static int matmul_check(const kb_matmul_args *a)
{
	if (!a || a->M < 0 || a->N < 0 || a->K < 0 ||
	    (unsigned)a->wtype >= (unsigned)KB_DTYPE_COUNT)
		return DS_EINVAL;
	if (a->M == 0 || a->N == 0)
		return 1;
	if (!a->y || !a->x || !a->w || a->x_stride < a->K || a->y_stride < a->N ||
	    a->w_stride < a->K || a->batch < 0)
		return DS_EINVAL;
	if (kb_dtype_is_quant(a->wtype)) {
		/* block-quantized weights (quant.h): whole blocks only */
		const int64_t blk = kb_dtype_block(a->wtype);
		if (a->K % blk || a->w_stride % blk)
			return DS_EINVAL;
		if (a->batch > 1 && (a->x_bstride < 0 || a->y_bstride < 0 || a->w_bstride < 0 ||
				     a->w_bstride % blk))
			return DS_EINVAL;
		return DS_OK;
	}
	if (a->wtype == KB_F8_E4M3 &&
	    (!a->w_scale || a->block < 1 || a->scale_stride < (a->K + a->block - 1) / a->block))
		return DS_EINVAL;
	if (a->batch > 1 && (a->x_bstride < 0 || a->y_bstride < 0 || a->w_bstride < 0 || a->s_bstride < 0))
		return DS_EINVAL;
	return DS_OK;
}

/* A product matmul_check passed.  Block-quantized weights: batched items
 * run one after another, each threaded (quant.c). */
static int matmul_run(const kb_matmul_args *a)
{
	if (kb_dtype_is_quant(a->wtype))
		return kc_qmatmul_isa(kc_isa_active(), a);
	return kc_matmul_batch_isa(kc_isa_active(), a);
}

static int matmul_checked(const kb_backend *be, const kb_matmul_args *a)
{
	int rc = matmul_check(a);
	if (rc)
		return rc > 0 ? DS_OK : rc;
	return matmul_run(a);
}

/* A decode step's products of one x row (q, k, v; gate, up; a MoE layer's
 * experts) meet the threads once when they qualify: block-quantized ones
 * through kc_qmatmul_multi_isa, BF16 and FP8 ones through
 * kc_matmul_multi_isa; otherwise one call each.  Arguments are checked
 * before anything runs. */
static int matmul_multi_checked(const kb_backend *be, const kb_matmul_args *a, int n)
{
	int ok = n > 1, quant = 0;
	for (int i = 0; i < n; i++) {
		int rc = matmul_check(&a[i]);
		if (rc < 0)
			return rc;
		ok = ok && rc == DS_OK && a[i].M == 1 && a[i].batch <= 1;
		quant += kb_dtype_is_quant(a[i].wtype);
	}
	if (ok && (quant == 0 || quant == n)) {
		int rc = quant ? kc_qmatmul_multi_isa(kc_isa_active(), a, n)
			       : kc_matmul_multi_isa(kc_isa_active(), a, n);
		if (rc != DS_EUNSUPPORTED)
			return rc;
	}
	for (int i = 0; i < n; i++) {
		int rc = a[i].M == 0 || a[i].N == 0 ? DS_OK : matmul_run(&a[i]); /* checked above */
		if (rc)
			return rc;
	}
	return DS_OK;
}

static int embed_run(const kb_backend *be, const kb_embed_args *a)
{
	if (!a || a->n < 0 || a->dim < 0)
		return DS_EINVAL;
	if (a->n == 0 || a->dim == 0)
		return DS_OK;
	if (!a->out || !a->table || !a->ids || a->out_stride < a->dim || a->table_stride < a->dim ||
	    (unsigned)a->type >= (unsigned)KB_DTYPE_COUNT || a->type == KB_F8_E4M3)
		return DS_EINVAL;
	if (kb_dtype_is_quant(a->type)) { /* rows dequantized block by block */
		const int64_t blk = kb_dtype_block(a->type);
		if (a->dim % blk || a->table_stride % blk)
			return DS_EINVAL;
		return kc_qembed(a);
	}
	return kc_embed_isa(kc_isa_active(), a);
}

static int rope_run(const kb_backend *be, const kb_rope_args *a)
{
	if (!a || a->n_tok < 0 || a->n_heads < 0 || a->rot_dim < 0 || a->rot_dim % 2)
		return DS_EINVAL;
	if (a->n_tok == 0 || a->n_heads == 0 || a->rot_dim == 0)
		return DS_OK;
	if (!a->x || !a->pos || !a->inv_freq || a->head_stride < a->rot_dim ||
	    a->tok_stride < (a->n_heads - 1) * a->head_stride + a->rot_dim)
		return DS_EINVAL;
	return kc_rope_isa(kc_isa_active(), a);
}

static int silu_mul_run(const kb_backend *be, const kb_silu_mul_args *a)
{
	if (!a || a->rows < 0 || a->dim < 0)
		return DS_EINVAL;
	if (a->rows == 0 || a->dim == 0)
		return DS_OK;
	if (!a->out || !a->gate || !a->up || a->out_stride < a->dim || a->gate_stride < a->dim ||
	    a->up_stride < a->dim)
		return DS_EINVAL;
	return kc_silu_mul_isa(kc_isa_active(), a);
}

static int axpy_run(const kb_backend *be, const kb_axpy_args *a)
{
	if (!a || a->n < 0)
		return DS_EINVAL;
	if (a->n == 0)
		return DS_OK;
	if (!a->y || !a->x)
		return DS_EINVAL;
	return kc_axpy_isa(kc_isa_active(), a);
}

static int softmax_run(const kb_backend *be, const kb_softmax_args *a)
{
	if (!a || a->rows < 0 || a->n < 0)
		return DS_EINVAL;
	if (a->rows == 0 || a->n == 0)
		return DS_OK;
	if (!a->x || a->stride < a->n)
		return DS_EINVAL;
	return kc_softmax_isa(kc_isa_active(), a);
}

static int cpu_set_threads(const kb_backend *be, int n)
{
	return kc_pool_set_threads(n);
}

/* The ops with one implementation (attn.h) take no instance. */
static int dequant_run(const kb_backend *be, const kb_dequant_args *a)
{
	return kc_dequant(a);
}

static int mla_attn_run(const kb_backend *be, const kb_mla_attn_args *a)
{
	return kc_mla_attn(a);
}

static int attn_run(const kb_backend *be, const kb_attn_args *a)
{
	return kc_attn(a);
}

static int paged_attn_run(const kb_backend *be, const kb_paged_attn_args *a)
{
	return kc_paged_attn(a);
}

static int moe_route_run(const kb_backend *be, const kb_moe_route_args *a)
{
	return kc_moe_route(a);
}

/* ---- the ops table: each op timed while kc_profile_enabled (profile.h) ---- */

#define TIMED_OP(name, argt, op)                                          \
	static int cpu_##name(const kb_backend *be, const argt *a)        \
	{                                                                 \
		if (!kc_profile_enabled)                                  \
			return name##_run(be, a);                         \
		const double t0 = ds_now_s();                       \
		const int rc = name##_run(be, a);                         \
		kc_profile_add_op(op, ds_now_s() - t0);             \
		return rc;                                                \
	}

TIMED_OP(rmsnorm, kb_rmsnorm_args, KB_OP_RMSNORM)
TIMED_OP(embed, kb_embed_args, KB_OP_EMBED)
TIMED_OP(rope, kb_rope_args, KB_OP_ROPE)
TIMED_OP(silu_mul, kb_silu_mul_args, KB_OP_SILU_MUL)
TIMED_OP(axpy, kb_axpy_args, KB_OP_AXPY)
TIMED_OP(softmax, kb_softmax_args, KB_OP_SOFTMAX)
TIMED_OP(dequant, kb_dequant_args, KB_OP_DEQUANT)
TIMED_OP(mla_attn, kb_mla_attn_args, KB_OP_MLA_ATTN)
TIMED_OP(attn, kb_attn_args, KB_OP_ATTN)
TIMED_OP(paged_attn, kb_paged_attn_args, KB_OP_PAGED_ATTN)
TIMED_OP(moe_route, kb_moe_route_args, KB_OP_MOE_ROUTE)

static int cpu_matmul(const kb_backend *be, const kb_matmul_args *a)
{
	if (!kc_profile_enabled || !a)
		return matmul_checked(be, a);
	const double t0 = ds_now_s();
	const int rc = matmul_checked(be, a);
	kc_profile_add_matmul(a, 0, ds_now_s() - t0);
	return rc;
}

static int cpu_matmul_multi(const kb_backend *be, const kb_matmul_args *a, int n)
{
	if (!kc_profile_enabled || !a || n < 1)
		return matmul_multi_checked(be, a, n);
	const double t0 = ds_now_s();
	const int rc = matmul_multi_checked(be, a, n);
	kc_profile_add_matmul(a, n, ds_now_s() - t0);
	return rc;
}

static int cpu_open(kb_backend *be, const kb_backend_params *p, ds_err *err)
{
	if (p->threads > KC_POOL_MAX_THREADS)
		return ds_err_set(err, DS_EINVAL, "the cpu backend runs at most %d threads, not %d",
				  KC_POOL_MAX_THREADS, p->threads);
	if (p->threads > 0) {
		int rc = kc_pool_set_threads(p->threads);
		if (rc != DS_OK)
			return ds_err_set(err, rc, "the cpu backend could not start %d threads (%s)",
					  p->threads, ds_status_name(rc));
	}
	be->priv = NULL;
	return DS_OK;
}

/* The pool outlives instances (shared, stopped at exit). */
static void cpu_close(kb_backend *be)
{
}

/* The CPU backend is the reference: every op on every weight type, except
 * an FP8 embedding table (its block scales have no place in kb_embed_args;
 * checkpoints keep the embedding in BF16). */
static int cpu_supports_op(enum kb_op op, enum kb_dtype dtype)
{
	if (op == KB_OP_EMBED && dtype == KB_F8_E4M3)
		return 0;
	return (unsigned)op < KB_OP_COUNT && (unsigned)dtype < KB_DTYPE_COUNT;
}

static const kb_backend_ops cpu_ops = {
	.name = "cpu",
	.supports_op = cpu_supports_op,
	.open = cpu_open,
	.close = cpu_close,
	.describe = cpu_describe,
	.alloc = cpu_alloc,
	.release = cpu_release,
	.upload = cpu_copy,
	.download = cpu_copy,
	.sync = cpu_sync,
	.set_threads = cpu_set_threads,
	.rmsnorm = cpu_rmsnorm,
	.matmul = cpu_matmul,
	.matmul_multi = cpu_matmul_multi,
	.embed = cpu_embed,
	.rope = cpu_rope,
	.silu_mul = cpu_silu_mul,
	.axpy = cpu_axpy,
	.softmax = cpu_softmax,
	.dequant = cpu_dequant,
	.mla_attn = cpu_mla_attn,
	.attn = cpu_attn,
	.paged_attn = cpu_paged_attn,
	.moe_route = cpu_moe_route,
};

const kb_backend_ops *kc_backend_ops(void)
{
	return &cpu_ops;
}

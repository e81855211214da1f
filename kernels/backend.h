/*
 * backend.h - the only place that computes.
 *
 * A backend is a const table of ops (kb_backend_ops) over plain-old-data
 * argument structs (pointers, sizes, strides), run through an instance
 * (kb_backend: device, stream, thread pool) opened with kb_backend_open.
 * Kernels own nothing and allocate nothing: buffers come from the
 * instance's alloc, so the CUDA backend can replace the CPU one without the engine noticing.  Every op has a scalar
 * reference in kernels/cpu; SIMD and CUDA versions are tested against it by
 * tests/conformance on random inputs.
 *
 * Depends on common/ only; includes nothing from engine/ or agent/.
 */
#ifndef DS_KERNELS_BACKEND_H
#define DS_KERNELS_BACKEND_H

#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w[:]   for r < rows.
 * x: [rows][dim] with row stride x_stride (elements); out likewise; w: [dim].
 * out may alias x (in place) when the strides are equal. */
typedef struct kb_rmsnorm_args {
	float *out;
	const float *x;
	const float *w;
	int64_t rows, dim;
	int64_t x_stride, out_stride;
	float eps;
} kb_rmsnorm_args;

/* Element types of weights (activations are always f32 on the CPU backend).
 * KB_F8_E4M3 weights carry a companion f32 block-scale matrix (see kb_matmul_args). */
enum kb_dtype {
	KB_F32 = 0,
	KB_F16 = 1,
	KB_BF16 = 2,
	KB_F8_E4M3 = 3,
	/* GGUF block-quantized types (ggml's layouts; a row of K elements is K /
	 * block blocks, each block_bytes long): */
	KB_Q8_0 = 4, /* 32 x int8 + f16 scale                 (34 bytes) */
	KB_Q4_0 = 5, /* 32 x 4 bit + f16 scale                (18 bytes) */
	KB_Q4_1 = 6, /* 32 x 4 bit + f16 scale + f16 min      (20 bytes) */
	KB_Q4_K = 7, /* 256: 8 sub-blocks, 6-bit scales/mins  (144 bytes) */
	KB_Q5_K = 8, /* 256: Q4_K plus a 5th bit              (176 bytes) */
	KB_Q6_K = 9, /* 256: 16 sub-blocks, 8-bit scales      (210 bytes) */
	KB_DTYPE_COUNT
};

static inline int kb_dtype_is_quant(enum kb_dtype t)
{
	return t >= KB_Q8_0 && t < KB_DTYPE_COUNT;
}

/* Elements per block (1 for the dense types). */
static inline int64_t kb_dtype_block(enum kb_dtype t)
{
	return t == KB_Q8_0 || t == KB_Q4_0 || t == KB_Q4_1 ? 32 : kb_dtype_is_quant(t) ? 256 : 1;
}

/* Bytes of one block (of one element for the dense types). */
static inline size_t kb_dtype_block_bytes(enum kb_dtype t)
{
	static const unsigned char bytes[KB_DTYPE_COUNT] = {4, 2, 2, 1, 34, 18, 20, 144, 176, 210};
	return (unsigned)t < KB_DTYPE_COUNT ? bytes[t] : 0;
}

/* Bytes of n elements (n a multiple of the block). */
static inline size_t kb_dtype_bytes(enum kb_dtype t, int64_t n)
{
	return (size_t)(n / kb_dtype_block(t)) * kb_dtype_block_bytes(t);
}

/* Bytes of one element of a dense dtype (0 for the block-quantized ones:
 * use kb_dtype_bytes). */
static inline size_t kb_dtype_size(enum kb_dtype t)
{
	return kb_dtype_is_quant(t) ? 0 : kb_dtype_block_bytes(t);
}

/* y[m][n] (+)= sum_k x[m][k] * W[n][k]      m < M, n < N, k < K
 * Block-quantized weights (KB_Q*): K and w_stride are multiples of the block;
 * backends may quantize x on the fly (as ggml does), so results match the
 * scalar reference of the same scheme, not an f32 product.
 * W is row-major [N][K] (the PyTorch Linear layout, y = W x), w_stride elements
 * between rows (>= K, so a column slice of a wider matrix works).
 * KB_F8_E4M3: W[n][k] = fp8_e4m3_to_f32(w[n][k]) * w_scale[(n / block) * scale_stride + k / block]
 * (the Hugging Face weight_scale_inv, multiplied); the weight stays FP8 and is
 * dequantized block by block inside the product, never as a whole matrix.
 * Partial edge blocks (N or K not a multiple of block) are allowed.
 * accumulate = 0: y = xW^T; 1: y += xW^T.  x and y never alias. */
typedef struct kb_matmul_args {
	float *y;
	const float *x;
	const void *w;
	const float *w_scale; /* FP8 only */
	enum kb_dtype wtype;
	int64_t M, N, K;
	int64_t x_stride, y_stride, w_stride;
	int64_t scale_stride; /* FP8: scale columns per scale row, ceil(K_full / block) */
	int64_t block;        /* FP8: block edge, 128 for DeepSeek-V3 */
	int accumulate;
	/* Batched form (batch 0 or 1 = one product): `batch` independent products,
	 * the i-th on x + i*x_bstride, y + i*y_bstride (floats), w + i*w_bstride
	 * (elements of wtype) and w_scale + i*s_bstride; e.g. one small matrix per
	 * attention head.  Backends run the items in parallel. */
	int64_t batch, x_bstride, y_bstride, w_bstride, s_bstride;
} kb_matmul_args;

/* out[i][:] = table[ids[i]][:] converted to f32, i < n; table row-major
 * [rows][dim] with table_stride elements between rows.  Ids are validated by
 * the caller. */
typedef struct kb_embed_args {
	float *out;
	const void *table;
	enum kb_dtype type; /* F32, F16 or BF16 */
	const int32_t *ids;
	int64_t n, dim, out_stride, table_stride;
} kb_embed_args;

/* Rotary embedding, in place, on the first rot_dim elements of n_heads vectors
 * per token.  Angle of pair i for token t: theta = (float)pos[t] * inv_freq[i]
 * (f32), then c = cos(theta) * amp, s = sin(theta) * amp.
 * interleaved = 1 (GPT-J / DeepSeek checkpoints): pairs (2i, 2i+1);
 * interleaved = 0 (NeoX / llama HF layout): pairs (i, i + rot_dim/2).
 *   y_a = x_a * c - x_b * s;  y_b = x_a * s + x_b * c */
typedef struct kb_rope_args {
	float *x;
	int64_t n_tok, n_heads;
	int64_t tok_stride, head_stride; /* elements */
	int64_t rot_dim;                 /* even */
	const int32_t *pos;              /* [n_tok] */
	const float *inv_freq;           /* [rot_dim / 2] */
	float amp;
	int interleaved;
} kb_rope_args;

/* out[r][i] = silu(gate[r][i]) * up[r][i], silu(z) = z / (1 + exp(-z)). */
typedef struct kb_silu_mul_args {
	float *out;
	const float *gate, *up;
	int64_t rows, dim;
	int64_t out_stride, gate_stride, up_stride;
} kb_silu_mul_args;

/* y[i] += alpha * x[i], i < n. */
typedef struct kb_axpy_args {
	float *y;
	const float *x;
	int64_t n;
	float alpha;
} kb_axpy_args;

/* In place, per row: x = softmax(scale * x) over n elements; stride elements
 * between rows.  Max-subtracted, f32 with double-free reductions allowed. */
typedef struct kb_softmax_args {
	float *x;
	int64_t rows, n, stride;
	float scale;
} kb_softmax_args;

/* out[r][c] = W[r][c] as f32 for r < rows, c < cols: dequantization of a
 * (slice of a) weight matrix, with the same conventions as kb_matmul_args
 * (FP8: block scales; scale_row0/scale_col0 give the block-grid position of
 * element (0, 0) of the slice in units of elements, so slices need not start
 * on a block edge).  Used at load for small matrices that the engine keeps in
 * f32 (MLA's absorbed kv_b_proj), never for a whole model. */
typedef struct kb_dequant_args {
	float *out;
	const void *w;
	const float *w_scale;
	enum kb_dtype wtype;
	int64_t rows, cols, out_stride, w_stride;
	int64_t scale_stride, block, row0, col0;
} kb_dequant_args;

/* MLA attention, absorbed (latent) form, over a paged cache (spec §3.4).
 * A cache row is one token of one layer: [kv_lora normalised latent C | rope_dim
 * roped k_pe P], row_stride floats apart.  Position pos of sequence s lives in
 * row (block_tables[s * max_blocks + pos / page_size] * page_size + pos % page_size).
 * Token t (sequence tok_seq[t], position tok_pos[t]) attends to positions
 * 0..tok_pos[t] of its sequence:
 *   score[h][j] = scale * (q_lat[t][h] . C[j] + q_pe[t][h] . P[j])
 *   out[t][h]   = sum_j softmax_j(score[h]) * C[j]          (kv_lora values)
 * Heads are contiguous inside a token row (q_lat: kv_lora apart, q_pe:
 * rope_dim apart, out: kv_lora apart). */
typedef struct kb_mla_attn_args {
	float *out;
	const float *q_lat, *q_pe;
	int64_t n_tok, n_heads, kv_lora, rope_dim;
	int64_t out_stride, q_lat_stride, q_pe_stride; /* per token, elements */
	const float *cache;
	int64_t page_size, row_stride;
	const int32_t *block_tables;
	int64_t max_blocks;
	const int32_t *tok_seq, *tok_pos;
	float scale;
} kb_mla_attn_args;

/* Multi-head attention with materialised K/V (naive MLA; GQA when
 * n_kv_heads < n_heads, head h reading kv head h / (n_heads / n_kv_heads)).
 * Keys/values are positions 0..n_kv-1; query t (position q_pos[t]) sees keys
 * j <= q_pos[t].  q: [n_tok][n_heads][dk], k: [n_kv][n_kv_heads][dk],
 * v: [n_kv][n_kv_heads][dv], out: [n_tok][n_heads][dv]; strides per token row. */
typedef struct kb_attn_args {
	float *out;
	const float *q, *k, *v;
	int64_t n_tok, n_kv, n_heads, n_kv_heads, dk, dv;
	int64_t q_stride, k_stride, v_stride, out_stride;
	const int32_t *q_pos;
	float scale;
} kb_attn_args;

/* Grouped-query attention over a paged cache (llama-family decode and
 * prefill).  A cache row is one token of one layer, row_stride elements of
 * cache_type (KB_F32, or KB_F16: IEEE half, read as its exact f32 value): K
 * of every kv head at k_off ([n_kv_heads][head_dim]) and V at v_off.  Rows
 * are found through block tables as for kb_mla_attn_args; token t attends
 * to positions 0..tok_pos[t] of sequence tok_seq[t]; query head h reads kv
 * head h / (n_heads / n_kv_heads).  The arithmetic is f32 either way. */
typedef struct kb_paged_attn_args {
	float *out;       /* [n_tok][n_heads][head_dim], out_stride per token */
	const float *q;   /* [n_tok][n_heads][head_dim], q_stride per token */
	int64_t n_tok, n_heads, n_kv_heads, head_dim, q_stride, out_stride;
	const void *cache;
	enum kb_dtype cache_type; /* KB_F32 (0, the default) or KB_F16 */
	int64_t page_size, row_stride, k_off, v_off;
	const int32_t *block_tables;
	int64_t max_blocks;
	const int32_t *tok_seq, *tok_pos;
	float scale;
} kb_paged_attn_args;

enum kb_moe_scoring { KB_SCORE_SOFTMAX = 0, KB_SCORE_SIGMOID = 1 };
enum kb_moe_topk { KB_TOPK_GREEDY = 0, KB_TOPK_GROUP_LIMITED_GREEDY = 1, KB_TOPK_NOAUX_TC = 2 };

/* MoE routing for n_tok tokens from router logits (spec §4):
 *   s = sigmoid(logits) or softmax(logits) (f32)
 *   selection score b = s (+ bias[e] when bias != NULL; bias is for selection only)
 *   group-limited methods keep the topk_group groups (n_group equal groups of
 *   consecutive experts) with the highest group score (noaux_tc: sum of the
 *   two largest b; group_limited_greedy: max b) and mask the others with -inf
 *   idx = the top_k experts by b; w = s[idx]
 *   sigmoid: w /= sum(w) + 1e-20 when norm_topk_prob; then w *= scaling
 *   softmax: w /= sum(w) + 1e-20 when top_k > 1 and norm_topk_prob, else w *= scaling
 * Ties are broken towards the lower expert id. */
typedef struct kb_moe_route_args {
	int32_t *idx;       /* [n_tok][top_k] */
	float *weight;      /* [n_tok][top_k] */
	const float *logits;
	const float *bias;  /* [n_experts] or NULL */
	int64_t n_tok, n_experts, top_k, n_group, topk_group, logits_stride;
	enum kb_moe_scoring scoring;
	enum kb_moe_topk method;
	int norm_topk_prob;
	float scaling;
} kb_moe_route_args;

/* The ops, for support queries and error messages. */
enum kb_op {
	KB_OP_RMSNORM = 0,
	KB_OP_MATMUL,
	KB_OP_EMBED,
	KB_OP_ROPE,
	KB_OP_SILU_MUL,
	KB_OP_AXPY,
	KB_OP_SOFTMAX,
	KB_OP_DEQUANT,
	KB_OP_MLA_ATTN,
	KB_OP_ATTN,
	KB_OP_PAGED_ATTN,
	KB_OP_MOE_ROUTE,
	KB_OP_COUNT
};

/* "matmul", "mla_attn", ...; "?" past the end. */
const char *kb_op_name(enum kb_op op);
/* "f32", "bf16", "f8_e4m3", "q4_k", ...; "?" past the end. */
const char *kb_dtype_name(enum kb_dtype t);

/* One op a graph needs: op over weights or tables of dtype (matmul, embed,
 * dequant), or KB_F32 for the ops whose inputs are activations only. */
typedef struct kb_op_need {
	enum kb_op op;
	enum kb_dtype dtype;
} kb_op_need;

typedef struct kb_backend kb_backend;

/* What kb_backend_open needs; start from kb_backend_default_params(). */
typedef struct kb_backend_params {
	int device;  /* CUDA: device index, 0 = the first; CPU: ignored */
	/* CPU: threads a job uses, the caller included (kc_pool_set_threads);
	 * 0 = leave the process's pool as it is (one per core unless set).
	 * CUDA: ignored. */
	int threads;
} kb_backend_params;

/* device 0, threads 0. */
kb_backend_params kb_backend_default_params(void);

/* One backend's ops: a const, static table per backend.  Every function but
 * supports_op takes the instance first; ops return 0 or a negative DS_E*
 * code.  An op that supports_op denies may be NULL. */
typedef struct kb_backend_ops {
	const char *name; /* "cpu", "cuda" */
	/* 1 when this backend runs op on dtype.  Answers from the backend's own
	 * table, so it needs no device (and no instance). */
	int (*supports_op)(enum kb_op op, enum kb_dtype dtype);
	/* Sets be->priv up from p (everything else in be is filled); DS_ENODEV
	 * with err when there is no such device.  close undoes open. */
	int (*open)(kb_backend *be, const kb_backend_params *p, ds_err *err);
	void (*close)(kb_backend *be);
	const char *(*describe)(const kb_backend *be); /* "avx512", "NVIDIA H100 (sm_90)" */
	/* Device memory (host memory for the CPU backend), ordered with the
	 * instance's ops; upload and download return once the copy is done. */
	void *(*alloc)(const kb_backend *be, size_t bytes);
	void (*release)(const kb_backend *be, void *p);
	int (*upload)(const kb_backend *be, void *dst, const void *src, size_t bytes);
	int (*download)(const kb_backend *be, void *dst, const void *src, size_t bytes);
	/* Waits for every op queued on this instance. */
	int (*sync)(const kb_backend *be);
	/* Worker threads the backend may use (CPU); 0 = one per core.  NULL for
	 * backends without threads. */
	int (*set_threads)(const kb_backend *be, int n);
	int (*rmsnorm)(const kb_backend *be, const kb_rmsnorm_args *a);
	int (*matmul)(const kb_backend *be, const kb_matmul_args *a);
	/* n independent products run as one job where the backend can (NULL:
	 * kb_matmul_multi calls matmul n times); the same results as n calls. */
	int (*matmul_multi)(const kb_backend *be, const kb_matmul_args *a, int n);
	int (*embed)(const kb_backend *be, const kb_embed_args *a);
	int (*rope)(const kb_backend *be, const kb_rope_args *a);
	int (*silu_mul)(const kb_backend *be, const kb_silu_mul_args *a);
	int (*axpy)(const kb_backend *be, const kb_axpy_args *a);
	int (*softmax)(const kb_backend *be, const kb_softmax_args *a);
	int (*dequant)(const kb_backend *be, const kb_dequant_args *a);
	int (*mla_attn)(const kb_backend *be, const kb_mla_attn_args *a);
	int (*attn)(const kb_backend *be, const kb_attn_args *a);
	int (*paged_attn)(const kb_backend *be, const kb_paged_attn_args *a);
	int (*moe_route)(const kb_backend *be, const kb_moe_route_args *a);
} kb_backend_ops;

/* An open backend: its ops and what they need at run time (CUDA: the device
 * and its stream; CPU: the process's thread pool, which every CPU instance
 * shares because the kernels reach it through kc_parallel_for).
 * name and supports_op are copies of the ops table's, so that callers read
 * be->name and call be->supports_op(op, dtype) without knowing about ops;
 * a test may build a fake
 * backend by copying an instance (*kb_backend_get("cpu", err)) and
 * replacing supports_op: the calls below go through that copy, which is
 * never closed (a copy of kb_backend_get's instance ignores close).
 * One caller of the ops at a time per instance. */
struct kb_backend {
	const char *name;
	int (*supports_op)(enum kb_op op, enum kb_dtype dtype);
	const kb_backend_ops *ops;
	kb_backend_params params; /* as opened */
	void *priv;               /* the backend's own state (CUDA: device, stream) */
	int borrowed;             /* 1: kb_backend_get's instance, which close leaves */
};

/* Backends compiled into this binary (available or not). */
int kb_backend_count(void);
const char *kb_backend_name_at(int i);

/* Opens an instance of the backend called name ("cpu", "cuda") with p (NULL:
 * the defaults); the caller closes it with kb_backend_close.  NULL with err:
 * DS_ENOTFOUND for an unknown name (err lists the known ones), DS_ENODEV when
 * the backend is not compiled in or has no such device, DS_ENOMEM. */
kb_backend *kb_backend_open(const char *name, const kb_backend_params *p, ds_err *err);
/* Waits for the instance's work, then frees what open made (not the memory
 * it allocated: release that first).  NULL and kb_backend_get's instances are
 * left alone. */
void kb_backend_close(kb_backend *be);

/* The process-wide default instance of the backend called name (default
 * params), opened at the first call; NULL with err as for kb_backend_open
 * (a failed open is remembered, not retried).  Thread-safe.  Borrowed for the
 * process lifetime. */
const kb_backend *kb_backend_get(const char *name, ds_err *err);

/* 1 when the backend called name is compiled in and runs op on dtype; asks
 * the backend's table, so it needs no device.  0 for unknown names. */
int kb_backend_supports(const char *name, enum kb_op op, enum kb_dtype dtype);

/* DS_OK when the backend called name runs every need; else DS_EUNSUPPORTED
 * with err naming the first op it lacks ("the cuda backend has no matmul
 * for q4_k weights"). */
int kb_backend_check(const char *name, const kb_op_need *needs, int n_needs, ds_err *err);

/* The same two questions asked of an instance, through be->supports_op (so a
 * test's fake backend answers them). */
int kb_supports_op(const kb_backend *be, enum kb_op op, enum kb_dtype dtype);
int kb_check(const kb_backend *be, const kb_op_need *needs, int n_needs, ds_err *err);
/* 1 when the instance's ops table has a function for op (whatever
 * supports_op says): for tests that hold a table to its supports_op. */
int kb_backend_has_op(const kb_backend *be, enum kb_op op);

/* The calls the engine makes: one per op, so call sites do not depend on
 * how a backend holds its ops. */
static inline const char *kb_describe(const kb_backend *be) { return be->ops->describe(be); }
static inline void *kb_alloc(const kb_backend *be, size_t bytes) { return be->ops->alloc(be, bytes); }
static inline void kb_release(const kb_backend *be, void *p) { be->ops->release(be, p); }
static inline int kb_upload(const kb_backend *be, void *dst, const void *src, size_t n) { return be->ops->upload(be, dst, src, n); }
static inline int kb_download(const kb_backend *be, void *dst, const void *src, size_t n) { return be->ops->download(be, dst, src, n); }
static inline int kb_sync(const kb_backend *be) { return be->ops->sync(be); }
/* DS_EUNSUPPORTED for a backend without threads. */
static inline int kb_set_threads(const kb_backend *be, int n) { return be->ops->set_threads ? be->ops->set_threads(be, n) : DS_EUNSUPPORTED; }
static inline int kb_rmsnorm(const kb_backend *be, const kb_rmsnorm_args *a) { return be->ops->rmsnorm(be, a); }
static inline int kb_matmul(const kb_backend *be, const kb_matmul_args *a) { return be->ops->matmul(be, a); }
static inline int kb_matmul_multi(const kb_backend *be, const kb_matmul_args *a, int n)
{
	if (be->ops->matmul_multi)
		return be->ops->matmul_multi(be, a, n);
	for (int i = 0; i < n; i++) {
		int rc = be->ops->matmul(be, &a[i]);
		if (rc)
			return rc;
	}
	return DS_OK;
}
static inline int kb_embed(const kb_backend *be, const kb_embed_args *a) { return be->ops->embed(be, a); }
static inline int kb_rope(const kb_backend *be, const kb_rope_args *a) { return be->ops->rope(be, a); }
static inline int kb_silu_mul(const kb_backend *be, const kb_silu_mul_args *a) { return be->ops->silu_mul(be, a); }
static inline int kb_axpy(const kb_backend *be, const kb_axpy_args *a) { return be->ops->axpy(be, a); }
static inline int kb_softmax(const kb_backend *be, const kb_softmax_args *a) { return be->ops->softmax(be, a); }
static inline int kb_dequant(const kb_backend *be, const kb_dequant_args *a) { return be->ops->dequant(be, a); }
static inline int kb_mla_attn(const kb_backend *be, const kb_mla_attn_args *a) { return be->ops->mla_attn(be, a); }
static inline int kb_attn(const kb_backend *be, const kb_attn_args *a) { return be->ops->attn(be, a); }
static inline int kb_paged_attn(const kb_backend *be, const kb_paged_attn_args *a) { return be->ops->paged_attn(be, a); }
static inline int kb_moe_route(const kb_backend *be, const kb_moe_route_args *a) { return be->ops->moe_route(be, a); }

#ifdef __cplusplus
}
#endif

#endif

/*
 * deepseek.c - the DeepSeek-V3 / R1 / V2 / V2-Lite graph: MLA attention
 * (naive and absorbed forms), dense MLP and DeepSeekMoE, over a paged KV cache.
 *
 * Called through engine/model.h (model_load, model_forward) with the model
 * source model_load opened (config and tensors come from it; the path is
 * never reopened).  Computes only through the kb_backend chosen at load
 * against the ops it lists (deepseek_needs); plain C here does bookkeeping
 * and copies (gathers, cache writes).  Follows deepseek_v3_spec.md §3-§5:
 *
 *   x = embed[token]
 *   per layer L < num_hidden_layers (the MTP layer is never loaded):
 *     h = rmsnorm(x, input_layernorm)
 *     q = q_b(rmsnorm(q_a h)) | q_proj h            [tok][H][nope | rope]
 *     kva = kv_a h = [c | k_pe];  c = rmsnorm(c);  rope(q_pe), rope(k_pe)
 *     cache row (tok) = [c | k_pe]                  (kv_lora + rope floats)
 *     naive:    K/V = kv_b c (per position), softmax(scale q.K) V
 *     absorbed: q_lat = W_UK^T q_nope, u = softmax(scale (q_lat.C + q_pe.P)) C,
 *               o = W_UV u
 *     x += o_proj o
 *     h = rmsnorm(x, post_attention_layernorm)
 *     x += dense MLP(h)  |  sum_k w_k expert_k(h) + shared(h)
 *   logits = lm_head rmsnorm(x, model.norm)
 *
 * Checkpoints: a Hugging Face directory (config.json + safetensors, names
 * "model.layers.L.self_attn.q_a_proj.weight" ...) or a GGUF file of llama.cpp's
 * "deepseek2" architecture (mcfg_from_gguf; names "blk.L.attn_q_a.weight" ...,
 * routed experts stacked in one 3-D tensor per kind, kv_b_proj either whole
 * as attn_kv_b or split per head as attn_k_b / attn_v_b; see
 * docs/engine.md "DeepSeek from GGUF").  The loader maps both onto the same
 * deepseek_layer, so the graph below does not know the source.  llama.cpp's
 * converter copies the q/k rope rows unchanged (no permutation, unlike its
 * llama path), so GGUF rope pairs are the interleaved pairs of the HF files.
 *
 * Weights stay in their checkpoint dtype in the mmap (FP8 with block scales
 * included).  The engine keeps f32 copies only of the norm vectors and the
 * router bias, plus the absorbed form's W_UK^T per head (a transposed copy of
 * part of kv_b_proj, in the checkpoint's dtype; for FP8 with its own block
 * grid, for GGUF block types in f32, see load_absorbed) or, for a GGUF with
 * split attn_k_b / attn_v_b, the naive form's kv_b rebuilt from them
 * (load_split_kv_b); those bytes are reported by model_extra_bytes.
 *
 * Buffers: allocated once in model_load from max_batch_tokens (bt) and
 * max_ctx; model_forward never allocates.  Thread rule: one step at a time.
 *
 * Under a plan (model_params.rank; docs/distributed.md "DeepSeek under a
 * plan") model.c runs the three ops below on every rank: embed on the first
 * stage, layers [first_layer, end_layer) on each stage's x rows (a whole
 * step or one of its micro-batches), head on the last.  Invariants:
 *   1. a rank holds its share only, each weight an owned window copied out
 *      of the mapping (take): heads [h0, h0 + H) of attention, rows [i0,
 *      i0 + ic) / [s0, s0 + sc) of the dense and shared MLPs (those three
 *      split over all tp*ep ranks of the stage), experts [e0, e0 + ec)
 *      (over ep) and of each its rows [j0, j0 + jc) of the intermediate
 *      size (over tp), lm_head rows [v0, v0 + vc) (over the stage);
 *      everything else whole.  On one rank those ranges are everything and
 *      the weights stay the mapping.
 *   2. after every layer x is the same on every rank of a stage: each split
 *      block ends in one all-reduce over the stage group (after o_proj,
 *      after the dense MLP, after the MoE: routed and shared partials in
 *      one), which adds the partial sums (part) to x.
 *   3. the KV cache holds this stage's layers (cache index L - first_layer)
 *      and the pages of the whole model, so block tables agree everywhere.
 *   4. nothing depends on where b's tokens sit in the step: a micro-batch is
 *      a step of its own with the same block tables.
 */
#include "engine/gguf.h"
#include "engine/mconfig.h"
#include "engine/model_impl.h"
#include "engine/safetensors.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef model_weight wmat; /* a Linear weight as stored (model_impl.h) */

typedef struct deepseek_layer {
	float *attn_norm, *ffn_norm, *q_a_norm, *kv_a_norm; /* f32 copies */
	wmat q_a, q_b, q_proj, kv_a, kv_b, o;
	/* absorbed-form weights (load_absorbed, load_split_kv_b) */
	const void *ukt_w;      /* [H][kv_lora][nope]: W_UK[h]^T: ukt_owned or GGUF attn_k_b */
	void *ukt_owned;
	enum kb_dtype ukt_type; /* kv_b's dtype; f32 for GGUF block types; attn_k_b's */
	float *ukt_s;           /* FP8: its scale grid, block absorbed_block */
	const void *uv_w;       /* W_UV[h] [vd][kv_lora]: into kv_b, uv_owned (FP8) or attn_v_b */
	void *uv_owned;         /* FP8: [H][vd][kv_lora] codes */
	enum kb_dtype uv_type;
	int64_t uv_row_step;    /* rows from W_UV[h] to W_UV[h+1]: nope + vd in kv_b, else vd */
	float *uv_s;            /* FP8: its scale grid */
	int64_t absorbed_block; /* 0 unless FP8 */
	void *kv_b_owned;       /* GGUF attn_k_b/attn_v_b: kv_b rebuilt (load_split_kv_b) */
	int moe;
	wmat gate, up, down;   /* dense MLP */
	wmat router;           /* [E][D] */
	float *bias;           /* [E] e_score_correction_bias (f32 copy) or NULL */
	wmat *eg, *eu, *ed;    /* routed experts [E] */
	wmat sg, su, sd;       /* shared experts (one MLP of n_shared * moe_inter) */
} deepseek_layer;

typedef struct deepseek_model {
	struct model base; /* must stay first: model.c sees this part */
	mcfg cfg;
	st_model *st;      /* Hugging Face checkpoint, or (both borrowed from base.src) */
	gguf_file *gg;     /* GGUF file */
	const kb_backend *be;
	kv_cache *kv;
	deepseek_layer *layers;
	wmat embed;        /* [vocab][D] */
	wmat lm_head;
	float *final_norm;
	float *inv_freq;
	float attn_scale, rope_amp;
	enum model_attn attn;
	int64_t bt, ctx;
	int64_t H, nope, rope, qk, vd, lora, D; /* H: the heads this rank computes */
	size_t extra_bytes;
	/* This rank's share of the plan (model.h; all of it on one rank):
	 * heads [h0, h0 + H) of H_all, dense MLP rows [i0, i0 + ic), shared
	 * expert rows [s0, s0 + sc) (those three over the sn ranks of the
	 * stage), routed experts [e0, e0 + ec) (over ep) and of each of them the
	 * intermediate rows [j0, j0 + jc) (over tp), lm_head rows [v0, v0 + vc)
	 * (vpad: the largest part, all_gather's count per rank). */
	int planned;           /* model_params.rank != NULL: every weight is an owned window */
	int sn, sl;            /* ranks of the stage (tp * ep) and this one's index */
	int64_t H_all, h0, i0, ic, s0, sc, e0, ec, j0, jc, v0, vc, vpad;
	void **owned;          /* the windows' copies (free()) */
	int n_owned, cap_owned;
	size_t copied;         /* their bytes: base.weight_bytes under a plan */
	/* Activations: from the backend's allocator (model_act_alloc, released
	 * with kb_release); [bt] rows unless noted.  The graph's C code still
	 * gathers rows of some of them with memcpy (the cpu backend's memory is
	 * the host's; a device backend needs those gathers as ops first). */
	float *x, *h, *cq, *q, *kva, *o, *lg;
	float *qa, *qlat, *qpe, *u, *oa;    /* absorbed subset */
	float *nlat, *nkv, *nk, *nv;        /* naive: [ctx] rows */
	float *nq, *no;                     /* naive: [bt] rows */
	float *g, *up, *act;                /* [max(bt, K + 1)][islot] */
	int64_t islot;                      /* the largest intermediate size here */
	float *rlog;                        /* [bt][E] router logits */
	float *xe, *ye;                     /* one expert's tokens, gathered ([bt][D]);
					     * ye [max(bt, K)][D] */
	float *part;                        /* [bt][D] partial sums before an all-reduce (plan) */
	float *lgp, *lgg;                   /* last stage under a plan: [bt][vpad] this rank's
					     * vocab slice, [sn][bt][vpad] gathered */
	/* Host bookkeeping (model_calloc, freed with free): index arrays and
	 * routing results that C loops here write or read element by element
	 * (which tokens take which attention form, the counting sort of tokens
	 * by expert, each token's expert weight as an axpy alpha). */
	int32_t *a_idx, *a_seq, *a_pos;     /* absorbed tokens, their sequences, positions */
	int32_t *n_idx, *n_pos;             /* naive tokens of one sequence, positions */
	float *rw;                          /* [bt][K] routing weights (moe_route output) */
	int32_t *ridx, *ecount, *eoff, *etok;
	float *ew;
	int32_t *seq_ntok;                 /* [bt]: tokens of each sequence in the step */
} deepseek_model;

/* ---- small helpers ---- */

static void *xalloc(deepseek_model *m, size_t n, size_t size)
{
	return model_calloc(&m->extra_bytes, n, size);
}

static int bad_alloc(ds_err *err)
{
	return ds_err_set(err, DS_ENOMEM, "out of memory while loading the model");
}

static int linear(deepseek_model *m, const wmat *w, const float *x, int64_t x_stride, float *y,
		  int64_t y_stride, int64_t M, int accumulate)
{
	return model_linear(m->be, w, x, x_stride, y, y_stride, M, accumulate);
}

/* One product per head: head h uses the weight h steps of (w1 - w0) past w0
 * (per-head views of one packed array), x + h * x_head, y + h * y_head. */
static int linear_heads(deepseek_model *m, const wmat *w0, const wmat *w1, const float *x, int64_t x_head,
			int64_t x_stride, float *y, int64_t y_head, int64_t y_stride, int64_t M)
{
	const ptrdiff_t wbytes = (const char *)w1->w - (const char *)w0->w;
	kb_matmul_args a = {.y = y, .x = x, .w = w0->w, .w_scale = w0->scale, .wtype = w0->type,
				.M = M, .N = w0->n, .K = w0->k, .x_stride = x_stride,
				.y_stride = y_stride, .w_stride = w0->k,
				.scale_stride = w0->scale_stride, .block = w0->block};
	a.batch = m->H;
	a.x_bstride = x_head;
	a.y_bstride = y_head;
	a.w_bstride = (int64_t)(wbytes / (ptrdiff_t)kb_dtype_block_bytes(w0->type)) * kb_dtype_block(w0->type);
	a.s_bstride = w0->scale ? (int64_t)(w1->scale - w0->scale) : 0;
	return M ? kb_matmul(m->be, &a) : DS_OK;
}

static int rmsnorm(deepseek_model *m, float *out, const float *x, const float *w, int64_t rows,
		   int64_t dim, int64_t x_stride, int64_t out_stride)
{
	kb_rmsnorm_args a = {.out = out, .x = x, .w = w, .rows = rows, .dim = dim,
				.x_stride = x_stride, .out_stride = out_stride,
				.eps = (float)m->cfg.rms_norm_eps};
	return rows ? kb_rmsnorm(m->be, &a) : DS_OK;
}

/* ---- loading ---- */

static int load_linear(deepseek_model *m, const char *name, int64_t n, int64_t k, wmat *out, ds_err *err)
{
	memset(out, 0, sizeof *out);
	out->n = n;
	out->k = k;
	if (m->gg) { /* row-major shape [n][k] = ggml ne {k, n} */
		int64_t shape[2] = {n, k};
		const gguf_tensor *g = gguf_get_tensor(m->gg, name, GGUF_DTYPE_ANY, 2, shape, err);
		if (!g)
			return err->code;
		out->w = g->data;
		out->type = g->dtype;
		return DS_OK;
	}
	const st_tensor *t = st_find(m->st, name);
	if (t && t->dtype == KB_F8_E4M3) {
		if (!m->cfg.fp8)
			return ds_err_set(err, DS_EFORMAT,
					  "tensor %s is F8_E4M3 but config.json has no fp8 quantization_config",
					  name);
		const st_tensor *s = NULL;
		t = st_get_fp8(m->st, name, n, k, m->cfg.fp8_block_n, &s, err);
		if (!t)
			return err->code;
		out->w = t->data;
		out->scale = s->data;
		out->type = KB_F8_E4M3;
		out->block = m->cfg.fp8_block_n;
		out->scale_stride = s->shape[1];
		return DS_OK;
	}
	int64_t shape[2] = {n, k};
	t = st_get(m->st, name, ST_DTYPE_ANY, 2, shape, err);
	if (!t)
		return err->code;
	if (t->dtype == KB_F8_E4M3)
		return ds_err_set(err, DS_EINTERNAL, "tensor %s: unexpected FP8", name);
	out->w = t->data;
	out->type = t->dtype;
	return DS_OK;
}

/* Keeps an owned copy for deepseek_free. */
static int keep_owned(deepseek_model *m, void *p, ds_err *err)
{
	if (m->n_owned == m->cap_owned) {
		int cap = m->cap_owned ? 2 * m->cap_owned : 64;
		void **v = realloc(m->owned, (size_t)cap * sizeof *v);
		if (!v) {
			free(p);
			return bad_alloc(err);
		}
		m->owned = v;
		m->cap_owned = cap;
	}
	m->owned[m->n_owned++] = p;
	return DS_OK;
}

/* A column window of a GGUF block-quantized weight that does not fall on
 * the type's blocks (o_proj's head columns, say 40 of Q8_0's 32): the rows
 * are copied whole, dequantized (exact values) and cut to the columns in
 * f32.  Costs rows x k floats at load and f32 products at run time. */
static int window_quant_cols(deepseek_model *m, wmat *w, int64_t r0, int64_t rn, int64_t c0, int64_t cn,
			     ds_err *err)
{
	wmat rows;
	void *own = NULL;
	size_t scratch = 0;
	int rc = model_weight_window(m->be, w, r0, rn, 0, w->k, &rows, &own, &scratch, err);
	if (rc)
		return rc;
	float *f = malloc((size_t)(rn * w->k) * sizeof(float));
	if (!f) {
		free(own);
		return bad_alloc(err);
	}
	kb_dequant_args a = {.out = f, .w = rows.w, .wtype = rows.type, .rows = rn, .cols = w->k,
				.out_stride = w->k, .w_stride = w->k, .block = 1};
	rc = kb_dequant(m->be, &a);
	free(own);
	if (rc) {
		free(f);
		return ds_err_set(err, rc, "cannot dequantize a %s weight window", st_dtype_name(w->type));
	}
	for (int64_t r = 0; r < rn; r++) /* forward: a row's destination never passes its source */
		memmove(f + r * cn, f + r * w->k + c0, (size_t)cn * sizeof(float));
	float *shrunk = realloc(f, (size_t)(rn * cn) * sizeof(float));
	f = shrunk ? shrunk : f;
	m->copied += (size_t)(rn * cn) * sizeof(float);
	*w = (wmat){.w = f, .type = KB_F32, .n = rn, .k = cn};
	return keep_owned(m, f, err);
}

/* The part of w this rank holds: rows [r0, r0 + rn), columns [c0, c0 + cn).
 * One rank: the caller asks for the whole weight, which stays the view into
 * the mapping.  Under a plan: an owned copy (model_weight_window), even of a
 * whole (replicated) weight, so that the mapping is never read afterwards. */
static int take(deepseek_model *m, wmat *w, int64_t r0, int64_t rn, int64_t c0, int64_t cn, ds_err *err)
{
	if (!m->planned)
		return DS_OK;
	const int64_t blk = kb_dtype_block(w->type);
	/* an empty window (a rank past the heads or rows) needs no fallback */
	if (kb_dtype_is_quant(w->type) && blk > 1 && rn && cn && (c0 % blk || cn % blk))
		return window_quant_cols(m, w, r0, rn, c0, cn, err);
	wmat out;
	void *own = NULL;
	int rc = model_weight_window(m->be, w, r0, rn, c0, cn, &out, &own, &m->copied, err);
	if (rc)
		return rc;
	*w = out;
	return own ? keep_owned(m, own, err) : DS_OK;
}

/* f32 copy of a vector (norm weights, router bias) of any supported dtype. */
static int load_vec(deepseek_model *m, const char *name, int64_t n, float **out, ds_err *err)
{
	int64_t shape[1] = {n};
	const void *data;
	enum kb_dtype type;
	if (m->gg) {
		const gguf_tensor *g = gguf_get_tensor(m->gg, name, GGUF_DTYPE_ANY, 1, shape, err);
		if (!g)
			return err->code;
		data = g->data;
		type = g->dtype;
	} else {
		const st_tensor *t = st_get(m->st, name, ST_DTYPE_ANY, 1, shape, err);
		if (!t)
			return err->code;
		data = t->data;
		type = t->dtype;
	}
	if (type == KB_F8_E4M3 || kb_dtype_is_quant(type))
		return ds_err_set(err, DS_EUNSUPPORTED, "tensor %s: %s vectors are not supported", name,
				  st_dtype_name(type));
	*out = xalloc(m, (size_t)n, sizeof(float));
	if (!*out)
		return bad_alloc(err);
	kb_dequant_args a = {.out = *out, .w = data, .wtype = type, .rows = 1, .cols = n,
				.out_stride = n, .w_stride = n, .block = 1};
	return kb_dequant(m->be, &a);
}

/* Routed experts of a GGUF: one 3-D tensor [E][n][k] (ggml ne {k, n, E}) per
 * kind; expert e is the row range [e*n, (e+1)*n) of it seen as [E*n][k] (k
 * is a multiple of the type's block, so every expert starts on a block).
 * This rank's experts [e0, e0 + ec), each cut to rows [r0, r0 + rn) and
 * columns [c0, c0 + cn) (its tp slice of the intermediate size) by take:
 * views into the mapping on one rank, owned copies under a plan. */
static int load_experts(deepseek_model *m, const char *name, int64_t E, int64_t n, int64_t k, int64_t r0,
			int64_t rn, int64_t c0, int64_t cn, wmat *out, ds_err *err)
{
	int64_t shape[3] = {E, n, k};
	const gguf_tensor *g = gguf_get_tensor(m->gg, name, GGUF_DTYPE_ANY, 3, shape, err);
	if (!g)
		return err->code;
	int rc = DS_OK;
	for (int64_t e = m->e0; !rc && e < m->e0 + m->ec; e++) {
		out[e] = (wmat){.w = (const uint8_t *)g->data + kb_dtype_bytes(g->dtype, e * n * k),
				.type = g->dtype, .n = n, .k = k};
		rc = take(m, &out[e], r0, rn, c0, cn, err);
	}
	return rc;
}

static int64_t gcd64(int64_t a, int64_t b)
{
	while (b) {
		int64_t t = a % b;
		a = b;
		b = t;
	}
	return a;
}

/* out[c][r] = in[r][c] for a rows x cols block of f32. */
static void transpose_f32(float *out, const float *in, int64_t rows, int64_t cols)
{
	for (int64_t r = 0; r < rows; r++)
		for (int64_t c = 0; c < cols; c++)
			out[c * rows + r] = in[r * cols + c];
}

/* f32 values of rows x cols of a block-quantized (or dense) matrix that
 * starts at element `first` of w (a whole number of blocks). */
static int dequant_rows(deepseek_model *m, float *out, const void *w, enum kb_dtype type, int64_t first,
			int64_t rows, int64_t cols)
{
	kb_dequant_args a = {.out = out, .w = (const uint8_t *)w + kb_dtype_bytes(type, first),
				.wtype = type, .rows = rows, .cols = cols, .out_stride = cols,
				.w_stride = cols, .block = 1};
	return kb_dequant(m->be, &a);
}

/* The absorbed form needs, per head h, W_UK[h]^T = (kv_b rows h*per .. +nope)^T
 * ([kv_lora][nope]) and W_UV[h] = kv_b rows h*per+nope .. +vd ([vd][kv_lora]),
 * with per = nope + vd.  They are kept in the checkpoint's dtype, exactly:
 *  - F32/F16/BF16: W_UK^T is a transposed copy; W_UV points into kv_b.
 *  - GGUF block types (Q8_0, Q4_K ...): a block type cannot be transposed, so
 *    W_UK^T is an f32 transposed copy of the dequantized rows (exact values);
 *    W_UV points into kv_b (its rows are whole rows of kv_b).
 *  - FP8: both are copies of the FP8 codes (W_UK^T transposed) with their own
 *    scale grids of block g = gcd(per, nope, block).  g divides the checkpoint's
 *    block and both head offsets, so every g x g block of a copy lies inside
 *    one original block and takes its scale: the values are unchanged.  (For
 *    DeepSeek-V3, g = 128.) */
static int load_absorbed(deepseek_model *m, deepseek_layer *ly, ds_err *err)
{
	const int64_t H = m->H, nope = m->nope, vd = m->vd, lora = m->lora, per = nope + vd;
	const wmat *w = &ly->kv_b;
	ly->uv_type = w->type;
	ly->uv_row_step = per;
	ly->uv_w = (const uint8_t *)w->w + kb_dtype_bytes(w->type, nope * lora); /* head 0's rows */
	ly->absorbed_block = 0;
	if (kb_dtype_is_quant(w->type)) {
		float *ukt = xalloc(m, (size_t)(H * lora * nope), sizeof(float));
		float *tmp = malloc((size_t)(nope * lora) * sizeof(float));
		int rc = ukt && tmp ? DS_OK : bad_alloc(err);
		for (int64_t h = 0; !rc && h < H; h++) {
			if ((rc = dequant_rows(m, tmp, w->w, w->type, h * per * lora, nope, lora)))
				rc = ds_err_set(err, rc, "kv_b: cannot dequantize %s", st_dtype_name(w->type));
			else
				transpose_f32(ukt + h * lora * nope, tmp, nope, lora);
		}
		free(tmp);
		ly->ukt_owned = ukt;
		ly->ukt_w = ukt;
		ly->ukt_type = KB_F32;
		return rc;
	}
	const size_t esz = kb_dtype_size(w->type);
	uint8_t *ukt = xalloc(m, (size_t)(H * lora * nope), esz);
	if (!ukt)
		return bad_alloc(err);
	ly->ukt_owned = ukt;
	ly->ukt_w = ukt;
	ly->ukt_type = w->type;
	const uint8_t *src = w->w;
	for (int64_t h = 0; h < H; h++)
		for (int64_t c = 0; c < lora; c++)
			for (int64_t d = 0; d < nope; d++)
				memcpy(ukt + ((h * lora + c) * nope + d) * esz,
				       src + ((h * per + d) * lora + c) * esz, esz);
	if (w->type != KB_F8_E4M3)
		return DS_OK;
	const int64_t B = w->block, g = gcd64(gcd64(per, nope), B);
	const int64_t ur = (lora + g - 1) / g, uc = (nope + g - 1) / g; /* W_UK^T grid */
	const int64_t vr = (vd + g - 1) / g, vc = (lora + g - 1) / g;   /* W_UV grid */
	uint8_t *uv = xalloc(m, (size_t)(H * vd * lora), 1);
	ly->ukt_s = xalloc(m, (size_t)(H * ur * uc), sizeof(float));
	ly->uv_s = xalloc(m, (size_t)(H * vr * vc), sizeof(float));
	if (!uv || !ly->ukt_s || !ly->uv_s) {
		free(uv);
		return bad_alloc(err);
	}
	for (int64_t h = 0; h < H; h++) {
		memcpy(uv + h * vd * lora, src + (h * per + nope) * lora, (size_t)(vd * lora));
		for (int64_t i = 0; i < ur; i++)     /* rows: latent c = i*g, cols: d = j*g */
			for (int64_t j = 0; j < uc; j++)
				ly->ukt_s[(h * ur + i) * uc + j] =
					w->scale[((h * per + j * g) / B) * w->scale_stride + (i * g) / B];
		for (int64_t i = 0; i < vr; i++)     /* rows: v row i*g, cols: latent j*g */
			for (int64_t j = 0; j < vc; j++)
				ly->uv_s[(h * vr + i) * vc + j] =
					w->scale[((h * per + nope + i * g) / B) * w->scale_stride + (j * g) / B];
	}
	ly->uv_w = uv;
	ly->uv_owned = uv;
	ly->uv_row_step = vd; /* the FP8 copy is packed per head */
	ly->absorbed_block = g;
	return DS_OK;
}

/* Newer llama.cpp converters split kv_b_proj per head (view [H][nope + vd]
 * [kv_lora], split after nope rows, the first part transposed):
 *   attn_k_b  [H][kv_lora][nope] = W_UK[h]^T    (ggml ne {nope, kv_lora, H})
 *   attn_v_b  [H][vd][kv_lora]   = W_UV[h]      (ggml ne {kv_lora, vd, H})
 * These are exactly the absorbed form's per-head matrices and are used in
 * place.  The naive form needs kv_b [H * (nope + vd)][kv_lora] (head h: W_UK[h]
 * then W_UV[h] rows); it is rebuilt once, exactly: in the files' dtype when
 * both are the same dense type (a transposed copy), else in f32 from the
 * dequantized values (block types cannot be transposed). */
static int load_split_kv_b(deepseek_model *m, deepseek_layer *ly, const char *kb_name, const char *vb_name,
			   ds_err *err)
{
	const int64_t H = m->H, nope = m->nope, vd = m->vd, lora = m->lora, per = nope + vd;
	const int64_t ks[3] = {m->H_all, lora, nope}, vs[3] = {m->H_all, vd, lora};
	const gguf_tensor *gk = gguf_get_tensor(m->gg, kb_name, GGUF_DTYPE_ANY, 3, ks, err);
	const gguf_tensor *gv = gk ? gguf_get_tensor(m->gg, vb_name, GGUF_DTYPE_ANY, 3, vs, err) : NULL;
	if (!gv)
		return err->code;
	/* this rank's heads: rows [h0 * lora, ...) of attn_k_b seen as [H_all * lora][nope],
	 * rows [h0 * vd, ...) of attn_v_b seen as [H_all * vd][lora] */
	wmat kw = {.w = gk->data, .type = gk->dtype, .n = m->H_all * lora, .k = nope};
	wmat vw = {.w = gv->data, .type = gv->dtype, .n = m->H_all * vd, .k = lora};
	int rc;
	if ((rc = take(m, &kw, m->h0 * lora, H * lora, 0, nope, err)) ||
	    (rc = take(m, &vw, m->h0 * vd, H * vd, 0, lora, err)))
		return rc;
	ly->ukt_w = kw.w;
	ly->ukt_type = kw.type;
	ly->uv_w = vw.w;
	ly->uv_type = vw.type;
	ly->uv_row_step = vd;
	ly->absorbed_block = 0;
	const int same = kw.type == vw.type && !kb_dtype_is_quant(kw.type);
	const enum kb_dtype t = same ? kw.type : KB_F32;
	const size_t esz = kb_dtype_size(t);
	uint8_t *kv = xalloc(m, (size_t)(H * per * lora), esz);
	float *tmp = same ? NULL : malloc((size_t)(lora * nope) * sizeof(float));
	rc = kv && (same || tmp) ? DS_OK : bad_alloc(err);
	ly->kv_b_owned = kv;
	ly->kv_b = (wmat){.w = kv, .type = t, .n = H * per, .k = lora};
	for (int64_t h = 0; !rc && h < H; h++) {
		uint8_t *dst = kv + (size_t)(h * per * lora) * esz;
		if (same) {
			const uint8_t *k = (const uint8_t *)kw.w + (size_t)(h * lora * nope) * esz;
			for (int64_t d = 0; d < nope; d++)
				for (int64_t c = 0; c < lora; c++)
					memcpy(dst + (size_t)(d * lora + c) * esz, k + (size_t)(c * nope + d) * esz, esz);
			memcpy(dst + (size_t)(nope * lora) * esz,
			       (const uint8_t *)vw.w + (size_t)(h * vd * lora) * esz, (size_t)(vd * lora) * esz);
			continue;
		}
		if ((rc = dequant_rows(m, tmp, kw.w, kw.type, h * lora * nope, lora, nope)) ||
		    (rc = dequant_rows(m, (float *)dst + nope * lora, vw.w, vw.type, h * vd * lora, vd, lora))) {
			rc = ds_err_set(err, rc, "%s / %s: cannot dequantize %s / %s", kb_name, vb_name,
					gk->type_name, gv->type_name);
			break;
		}
		transpose_f32((float *)dst, tmp, lora, nope);
	}
	free(tmp);
	return rc;
}

/* Per-head views of the absorbed weights (see load_absorbed). */
static wmat head_ukt(const deepseek_model *m, const deepseek_layer *ly, int64_t h)
{
	const int64_t lora = m->lora, nope = m->nope, g = ly->absorbed_block;
	wmat w = {.w = (const uint8_t *)ly->ukt_w + kb_dtype_bytes(ly->ukt_type, h * lora * nope),
		  .type = ly->ukt_type, .n = lora, .k = nope};
	if (g) {
		int64_t ur = (lora + g - 1) / g, uc = (nope + g - 1) / g;
		w.scale = ly->ukt_s + h * ur * uc;
		w.scale_stride = uc;
		w.block = g;
	}
	return w;
}

static wmat head_uv(const deepseek_model *m, const deepseek_layer *ly, int64_t h)
{
	const int64_t lora = m->lora, vd = m->vd, g = ly->absorbed_block;
	wmat w = {.w = (const uint8_t *)ly->uv_w + kb_dtype_bytes(ly->uv_type, h * ly->uv_row_step * lora),
		  .type = ly->uv_type, .n = vd, .k = lora};
	if (g) {
		int64_t vr = (vd + g - 1) / g, vc = (lora + g - 1) / g;
		w.scale = ly->uv_s + h * vr * vc;
		w.scale_stride = vc;
		w.block = g;
	}
	return w;
}

/* kv_b of a GGUF layer: attn_kv_b (older converters) or attn_k_b + attn_v_b
 * (newer ones); both when present: attn_kv_b is used. */
static int load_gguf_kv_b(deepseek_model *m, deepseek_layer *ly, int L, ds_err *err)
{
	char kv[64], kb[64], vb[64];
	snprintf(kv, sizeof kv, "blk.%d.attn_kv_b.weight", L);
	snprintf(kb, sizeof kb, "blk.%d.attn_k_b.weight", L);
	snprintf(vb, sizeof vb, "blk.%d.attn_v_b.weight", L);
	if (gguf_find_tensor(m->gg, kv) || !gguf_find_tensor(m->gg, kb)) {
		const int64_t per = m->nope + m->vd;
		int rc = load_linear(m, kv, m->H_all * per, m->lora, &ly->kv_b, err);
		if (rc == DS_ENOTFOUND)
			return ds_err_set(err, rc, "%s: tensor %s not found (nor the split %s and %s)",
					  gguf_path(m->gg), kv, kb, vb);
		if (!rc)
			rc = take(m, &ly->kv_b, m->h0 * per, m->H * per, 0, m->lora, err);
		return rc ? rc : load_absorbed(m, ly, err);
	}
	return load_split_kv_b(m, ly, kb, vb, err);
}

/* One decoder layer.  Names: N(hf, gguf) picks the Hugging Face or the GGUF
 * (llama.cpp) name of the same tensor; shapes are the same row-major shapes. */
static int load_layer(deepseek_model *m, int L, ds_err *err)
{
	const mcfg *c = &m->cfg;
	deepseek_layer *ly = &m->layers[L];
	char name[256];
	const int64_t D = m->D, H = m->H, Ha = m->H_all, h0 = m->h0;
	const int64_t ql = c->q_lora_rank, kvw = m->lora + m->rope, per = m->nope + m->vd;
	const int gg = m->gg != NULL;
	int rc;
#define N(hf, gguf) (snprintf(name, sizeof name, gg ? "blk.%d." gguf : "model.layers.%d." hf, L), name)
#define TRY(expr)                                                                       \
	do {                                                                            \
		if ((rc = (expr)) != DS_OK)                                             \
			return rc;                                                      \
	} while (0)
	TRY(load_vec(m, N("input_layernorm.weight", "attn_norm.weight"), D, &ly->attn_norm, err));
	TRY(load_vec(m, N("post_attention_layernorm.weight", "ffn_norm.weight"), D, &ly->ffn_norm, err));
	/* attention: q_a, kv_a and the norms whole (replicated over the stage); q_b /
	 * q_proj and kv_b the rows of this rank's heads, o_proj their columns */
	if (ql > 0) {
		TRY(load_linear(m, N("self_attn.q_a_proj.weight", "attn_q_a.weight"), ql, D, &ly->q_a, err));
		TRY(take(m, &ly->q_a, 0, ql, 0, D, err));
		TRY(load_vec(m, N("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"), ql,
			     &ly->q_a_norm, err));
		TRY(load_linear(m, N("self_attn.q_b_proj.weight", "attn_q_b.weight"), Ha * m->qk, ql,
				&ly->q_b, err));
		TRY(take(m, &ly->q_b, h0 * m->qk, H * m->qk, 0, ql, err));
	} else {
		TRY(load_linear(m, N("self_attn.q_proj.weight", "attn_q.weight"), Ha * m->qk, D, &ly->q_proj,
				err));
		TRY(take(m, &ly->q_proj, h0 * m->qk, H * m->qk, 0, D, err));
	}
	TRY(load_linear(m, N("self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"), kvw, D,
			&ly->kv_a, err));
	TRY(take(m, &ly->kv_a, 0, kvw, 0, D, err));
	TRY(load_vec(m, N("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"), m->lora,
		     &ly->kv_a_norm, err));
	if (gg) {
		TRY(load_gguf_kv_b(m, ly, L, err));
	} else {
		TRY(load_linear(m, N("self_attn.kv_b_proj.weight", ""), Ha * per, m->lora, &ly->kv_b, err));
		TRY(take(m, &ly->kv_b, h0 * per, H * per, 0, m->lora, err));
		TRY(load_absorbed(m, ly, err));
	}
	TRY(load_linear(m, N("self_attn.o_proj.weight", "attn_output.weight"), D, Ha * m->vd, &ly->o, err));
	TRY(take(m, &ly->o, 0, D, h0 * m->vd, H * m->vd, err));

	ly->moe = mcfg_is_moe_layer(c, L);
	if (!ly->moe) { /* gate / up: rows [i0, i0 + ic); down: those columns */
		const int64_t I = c->intermediate_size;
		TRY(load_linear(m, N("mlp.gate_proj.weight", "ffn_gate.weight"), I, D, &ly->gate, err));
		TRY(take(m, &ly->gate, m->i0, m->ic, 0, D, err));
		TRY(load_linear(m, N("mlp.up_proj.weight", "ffn_up.weight"), I, D, &ly->up, err));
		TRY(take(m, &ly->up, m->i0, m->ic, 0, D, err));
		TRY(load_linear(m, N("mlp.down_proj.weight", "ffn_down.weight"), D, I, &ly->down, err));
		TRY(take(m, &ly->down, 0, D, m->i0, m->ic, err));
		return DS_OK;
	}
	const int64_t E = c->n_routed_experts, I = c->moe_intermediate_size, e0 = m->e0, ec = m->ec;
	const int64_t j0 = m->j0, jc = m->jc; /* each expert's rows of I here (gate/up rows, down columns) */
	TRY(load_linear(m, N("mlp.gate.weight", "ffn_gate_inp.weight"), E, D, &ly->router, err));
	TRY(take(m, &ly->router, 0, E, 0, D, err));
	/* the GGUF bias is optional, as in llama.cpp (absent: selection without it) */
	if (c->topk_method == MCFG_TOPK_NOAUX_TC &&
	    (!gg || gguf_find_tensor(m->gg, N("", "exp_probs_b.bias"))))
		TRY(load_vec(m, N("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"), E, &ly->bias, err));
	ly->eg = xalloc(m, (size_t)E, sizeof(wmat));
	ly->eu = xalloc(m, (size_t)E, sizeof(wmat));
	ly->ed = xalloc(m, (size_t)E, sizeof(wmat));
	if (!ly->eg || !ly->eu || !ly->ed)
		return bad_alloc(err);
	if (gg) {
		if (!gguf_find_tensor(m->gg, N("", "ffn_gate_exps.weight")) &&
		    gguf_find_tensor(m->gg, N("", "ffn_gate_up_exps.weight")))
			return ds_err_set(err, DS_EUNSUPPORTED, "%s: tensor %s (gate and up experts fused) is "
					  "not supported; separate ffn_gate_exps / ffn_up_exps are",
					  gguf_path(m->gg), name);
		TRY(load_experts(m, N("", "ffn_gate_exps.weight"), E, I, D, j0, jc, 0, D, ly->eg, err));
		TRY(load_experts(m, N("", "ffn_up_exps.weight"), E, I, D, j0, jc, 0, D, ly->eu, err));
		TRY(load_experts(m, N("", "ffn_down_exps.weight"), E, D, I, 0, D, j0, jc, ly->ed, err));
	} else { /* this rank's experts only (its tp slice of each), each its own copy under a plan */
		for (int64_t e = e0; e < e0 + ec; e++) {
			char sub[128];
			snprintf(sub, sizeof sub, "model.layers.%d.mlp.experts.%lld.", L, (long long)e);
			snprintf(name, sizeof name, "%sgate_proj.weight", sub);
			TRY(load_linear(m, name, I, D, &ly->eg[e], err));
			TRY(take(m, &ly->eg[e], j0, jc, 0, D, err));
			snprintf(name, sizeof name, "%sup_proj.weight", sub);
			TRY(load_linear(m, name, I, D, &ly->eu[e], err));
			TRY(take(m, &ly->eu[e], j0, jc, 0, D, err));
			snprintf(name, sizeof name, "%sdown_proj.weight", sub);
			TRY(load_linear(m, name, D, I, &ly->ed[e], err));
			TRY(take(m, &ly->ed[e], 0, D, j0, jc, err));
		}
	}
	if (c->n_shared_experts > 0) { /* split over the stage as the dense MLP: rows [s0, s0 + sc) */
		const int64_t S = I * c->n_shared_experts;
		TRY(load_linear(m, N("mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"), S, D,
				&ly->sg, err));
		TRY(take(m, &ly->sg, m->s0, m->sc, 0, D, err));
		TRY(load_linear(m, N("mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"), S, D,
				&ly->su, err));
		TRY(take(m, &ly->su, m->s0, m->sc, 0, D, err));
		TRY(load_linear(m, N("mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"), D, S,
				&ly->sd, err));
		TRY(take(m, &ly->sd, 0, D, m->s0, m->sc, err));
	}
	return DS_OK;
#undef N
#undef TRY
}

static int alloc_buffers(deepseek_model *m, ds_err *err)
{
	const mcfg *c = &m->cfg;
	const size_t bt = (size_t)m->bt, ctx = (size_t)m->ctx, H = (size_t)m->H;
	const size_t D = (size_t)m->D, lora = (size_t)m->lora, rope = (size_t)m->rope;
	const size_t qk = (size_t)m->qk, vd = (size_t)m->vd, E = (size_t)c->n_routed_experts;
	const size_t K = (size_t)(c->num_experts_per_tok > 0 ? c->num_experts_per_tok : 1);
	size_t inter = (size_t)c->intermediate_size;
	size_t moe_i = (size_t)c->moe_intermediate_size * (size_t)(c->n_shared_experts > 1 ? c->n_shared_experts : 1);
	if (moe_i > inter)
		inter = moe_i;
	const kb_backend *be = m->be;
	size_t *xb = &m->extra_bytes;
	m->x = model_act_alloc(be, xb, bt * D, 4);
	m->h = model_act_alloc(be, xb, bt * D, 4);
	m->cq = model_act_alloc(be, xb, bt * (size_t)(c->q_lora_rank > 0 ? c->q_lora_rank : 1), 4);
	m->q = model_act_alloc(be, xb, bt * H * qk, 4);
	m->kva = model_act_alloc(be, xb, bt * (lora + rope), 4);
	m->o = model_act_alloc(be, xb, bt * H * vd, 4);
	m->lg = model_act_alloc(be, xb, bt * D, 4);
	m->qa = model_act_alloc(be, xb, bt * H * qk, 4);
	m->qlat = model_act_alloc(be, xb, bt * H * lora, 4);
	m->qpe = model_act_alloc(be, xb, bt * H * rope, 4);
	m->u = model_act_alloc(be, xb, bt * H * lora, 4);
	m->oa = model_act_alloc(be, xb, bt * H * vd, 4);
	m->nlat = model_act_alloc(be, xb, ctx * lora, 4);
	m->nkv = model_act_alloc(be, xb, ctx * H * (size_t)(m->nope + m->vd), 4);
	m->nk = model_act_alloc(be, xb, ctx * H * qk, 4);
	m->nv = model_act_alloc(be, xb, ctx * H * vd, 4);
	m->nq = model_act_alloc(be, xb, bt * H * qk, 4);
	m->no = model_act_alloc(be, xb, bt * H * vd, 4);
	/* one token's MoE (moe_token) keeps the shared expert and each chosen
	 * expert in its own row */
	const size_t grows = bt > K + 1 ? bt : K + 1;
	m->islot = (int64_t)inter;
	m->g = model_act_alloc(be, xb, grows * inter, 4);
	m->up = model_act_alloc(be, xb, grows * inter, 4);
	m->act = model_act_alloc(be, xb, grows * inter, 4);
	m->rlog = model_act_alloc(be, xb, bt * (E ? E : 1), 4);
	m->xe = model_act_alloc(be, xb, bt * D, 4);
	m->ye = model_act_alloc(be, xb, (bt > K ? bt : K) * D, 4);
	int split = m->sn > 1, last = m->base.end_layer == m->base.n_layers;
	if (split && !(m->part = model_act_alloc(be, xb, bt * D, 4)))
		return bad_alloc(err);
	if (m->sn > 1 && last && (!(m->lgp = model_act_alloc(be, xb, bt * (size_t)m->vpad, 4)) ||
				  !(m->lgg = model_act_alloc(be, xb, (size_t)m->sn * bt * (size_t)m->vpad, 4))))
		return bad_alloc(err);
	m->a_idx = xalloc(m, bt, 4);
	m->a_seq = xalloc(m, bt, 4);
	m->a_pos = xalloc(m, bt, 4);
	m->n_idx = xalloc(m, bt, 4);
	m->n_pos = xalloc(m, bt, 4);
	m->rw = xalloc(m, bt * K, 4);
	m->ridx = xalloc(m, bt * K, 4);
	m->ecount = xalloc(m, E + 1, 4);
	m->eoff = xalloc(m, E + 1, 4);
	m->etok = xalloc(m, bt * K, 4);
	m->ew = xalloc(m, bt * K, 4);
	m->seq_ntok = xalloc(m, bt, 4);
	if (!m->x || !m->h || !m->cq || !m->q || !m->kva || !m->o || !m->lg || !m->qa ||
	    !m->qlat || !m->qpe || !m->u || !m->oa || !m->a_idx || !m->a_seq || !m->a_pos ||
	    !m->nlat || !m->nkv || !m->nk || !m->nv || !m->nq || !m->no || !m->n_idx ||
	    !m->n_pos || !m->g || !m->up || !m->act || !m->rlog || !m->rw || !m->ridx ||
	    !m->ecount || !m->eoff || !m->etok || !m->ew || !m->xe || !m->ye ||
	    !m->seq_ntok)
		return bad_alloc(err);
	return DS_OK;
}

static const model_ops deepseek_ops;
static void deepseek_free(model *base);

/* kv_b kept in f32 (see load_absorbed, load_split_kv_b): a block-quantized
 * kv_b, or split halves of different dense dtypes, is rebuilt in f32 at load
 * (a dequantization) and multiplied in f32. */
static void kv_b_needs(msrc *src, const msrc_tensor *t, model_needs *nd)
{
	const char *kb = strstr(t->name, "attn_k_b."), *vb = strstr(t->name, "attn_v_b.");
	int f32 = (strstr(t->name, "kv_b") || kb || vb) && kb_dtype_is_quant(t->dtype);
	if ((kb || vb) && !f32) {
		char other[256];
		snprintf(other, sizeof other, "%.*s%s", (int)((kb ? kb : vb) - t->name), t->name,
			 kb ? "attn_v_b.weight" : "attn_k_b.weight");
		enum kb_dtype od = msrc_tensor_dtype(src, other);
		f32 = od != KB_DTYPE_COUNT && od != t->dtype;
	}
	if (f32) {
		model_needs_add(nd, KB_OP_MATMUL, KB_F32);
		model_needs_add(nd, KB_OP_DEQUANT, t->dtype);
	}
}

/* The ops embed / layers / head (and the load-time conversions) call, with the
 * dtypes this checkpoint holds: a product on every weight dtype of the
 * decoder layers used (the MTP layers past num_hidden_layers are never
 * loaded), f32 products and a dequantization where kv_b is rebuilt in f32,
 * the embedding table's lookup, the activation ops of MLA (both forms:
 * model_set_attn switches between steps) and MoE, and the conversion of
 * every vector (norms, router bias) to f32. */
static int deepseek_needs(const deepseek_model *m, msrc *src, model_needs *nd, ds_err *err)
{
	const mcfg *c = &m->cfg;
	const char *embed = m->gg ? "token_embd.weight" : "model.embed_tokens.weight";
	model_needs conv = {0};
	int rc = model_needs_scan(src, c->num_hidden_layers, embed, nd, &conv, kv_b_needs, err);
	if (rc)
		return rc;
	enum kb_dtype et = msrc_tensor_dtype(src, embed);
	if (et != KB_DTYPE_COUNT)
		model_needs_add(nd, KB_OP_EMBED, et);
	static const enum kb_op acts[] = {KB_OP_RMSNORM, KB_OP_ROPE, KB_OP_SILU_MUL, KB_OP_ATTN,
					   KB_OP_MLA_ATTN};
	for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++)
		model_needs_add(nd, acts[i], KB_F32);
	for (int L = 0; L < c->num_hidden_layers; L++) {
		if (mcfg_is_moe_layer(c, L)) {
			model_needs_add(nd, KB_OP_MOE_ROUTE, KB_F32);
			model_needs_add(nd, KB_OP_AXPY, KB_F32);
			break;
		}
	}
	/* under a plan a window can come out in f32 (an FP8 window off its
	 * scale grid, a GGUF block type cut off its blocks: take), through a
	 * dequantization of the stored type */
	for (int i = 0; m->planned && i < nd->n; i++)
		if (nd->v[i].op == KB_OP_MATMUL &&
		    (nd->v[i].dtype == KB_F8_E4M3 || kb_dtype_is_quant(nd->v[i].dtype)))
			model_needs_add(&conv, KB_OP_DEQUANT, nd->v[i].dtype);
	if (m->planned)
		model_needs_add(nd, KB_OP_MATMUL, KB_F32);
	model_needs_append(nd, &conv);
	return DS_OK;
}

/* This rank's share of the plan (model.h): the base's rank and layer range,
 * then the heads, MLP rows, experts and vocab rows it holds (all of them on
 * one rank).  Runs once the config is read. */
static int plan_shares(deepseek_model *m, const model_params *p, ds_err *err)
{
	const mcfg *c = &m->cfg;
	int rc = model_base_plan(&m->base, p, c->num_hidden_layers, c->hidden_size, err);
	if (rc)
		return rc;
	const model_rank *r = &m->base.rank;
	const int tp = r->plan.tp, ep = r->plan.ep, S = tp * ep;
	const int64_t shared_i = (int64_t)c->moe_intermediate_size * c->n_shared_experts;
	/* A stage of more ranks than heads (tp*ep > heads, e.g. ep for the
	 * experts' sake) is fine: the ranks past the heads (or past the rows of
	 * an MLP) hold none and add zeros to the all-reduce, as ranks without
	 * experts do.  tp alone beyond the heads has no use and is refused. */
	if (tp > c->num_attention_heads)
		return ds_err_set(err, DS_EINVAL, "tp %d is more than the model's %d attention heads: "
				  "tensor parallelism splits the heads", tp, c->num_attention_heads);
	m->planned = p->rank != NULL;
	m->sn = S;
	m->sl = r->ep_rank * tp + r->tp_rank;
	int64_t unused;
	m->H_all = c->num_attention_heads;
	model_split_range(m->H_all, S, m->sl, &m->h0, &m->H);
	model_split_range(c->intermediate_size, S, m->sl, &m->i0, &m->ic);
	model_split_range(shared_i, S, m->sl, &m->s0, &m->sc);
	model_split_range(c->n_routed_experts, ep, r->ep_rank, &m->e0, &m->ec);
	model_split_range(c->moe_intermediate_size, tp, r->tp_rank, &m->j0, &m->jc);
	model_split_range(c->vocab_size, m->sn, m->sl, &m->v0, &m->vc);
	model_split_range(c->vocab_size, m->sn, 0, &unused, &m->vpad);
	return DS_OK;
}

model *deepseek_model_load(const model_params *p, msrc *src, ds_err *err)
{
	deepseek_model *m = calloc(1, sizeof *m);
	if (!m) {
		bad_alloc(err);
		return NULL;
	}
	m->base.src = msrc_ref(src);
	const int gg = msrc_kind(src) == MSRC_GGUF;
	int rc = DS_OK;
	if (gg) {
		m->gg = msrc_gguf(src);
		rc = mcfg_from_gguf(m->gg, &m->cfg, err);
	} else {
		const json_t *root = NULL;
		const char *what = NULL;
		if (!(rc = msrc_config(src, &root, &what, err)))
			rc = mcfg_from_json(root, what, &m->cfg, err);
		if (!rc && !(m->st = msrc_tensors(src, err)))
			rc = err && err->code ? err->code : DS_EIO;
	}
	if (rc)
		goto fail;
	const mcfg *c = &m->cfg;
	if ((rc = plan_shares(m, p, err)))
		goto fail;
	const int first = m->base.first_layer, end = m->base.end_layer;
	model_needs nd = {0};
	if ((rc = deepseek_needs(m, src, &nd, err)))
		goto fail;
	if (!(m->be = model_backend_choose(p, src, &nd, err)))
		goto fail;
	/* under a plan the shards stay the page cache's mapping, read only
	 * through this rank's windows (take): never a copy of a whole shard */
	if ((rc = msrc_hold_weights(src, m->planned ? DS_MAP_FILE : model_weights_mode(p, m->be), err)))
		goto fail;
	m->nope = c->qk_nope_head_dim;
	m->rope = c->qk_rope_head_dim;
	m->qk = m->nope + m->rope;
	m->vd = c->v_head_dim;
	m->lora = c->kv_lora_rank;
	m->D = c->hidden_size;
	m->attn = p->attn;
	m->bt = p->max_batch_tokens > 0 ? p->max_batch_tokens : 512;
	m->ctx = p->max_ctx > 0 ? p->max_ctx : (c->max_position_embeddings < 4096 ? c->max_position_embeddings : 4096);
	if (m->ctx > c->max_position_embeddings) {
		rc = ds_err_set(err, DS_EINVAL, "context %lld is longer than the model's max_position_embeddings %d",
				(long long)m->ctx, c->max_position_embeddings);
		goto fail;
	}
	m->attn_scale = (float)c->softmax_scale;
	m->rope_amp = (float)c->rope_amp;
	m->inv_freq = xalloc(m, (size_t)m->rope / 2 + 1, sizeof(float));
	m->layers = xalloc(m, (size_t)c->num_hidden_layers, sizeof(deepseek_layer));
	if (!m->inv_freq || !m->layers) {
		rc = bad_alloc(err);
		goto fail;
	}
	mcfg_rope_inv_freq(c, m->inv_freq);

	int64_t eshape[2] = {c->vocab_size, m->D};
	if (first > 0) {
		/* the embedding lives on the first stage */
	} else if (gg) {
		const gguf_tensor *t = gguf_get_tensor(m->gg, "token_embd.weight", GGUF_DTYPE_ANY, 2, eshape, err);
		if (!t)
			goto fail;
		m->embed = (wmat){.w = t->data, .type = t->dtype, .n = c->vocab_size, .k = m->D};
	} else {
		const st_tensor *t = st_get(m->st, "model.embed_tokens.weight", ST_DTYPE_ANY, 2, eshape, err);
		if (!t)
			goto fail;
		if (t->dtype == KB_F8_E4M3) {
			rc = ds_err_set(err, DS_EUNSUPPORTED, "model.embed_tokens.weight: FP8 embeddings are not supported");
			goto fail;
		}
		m->embed = (wmat){.w = t->data, .type = t->dtype, .n = c->vocab_size, .k = m->D};
	}
	if (first == 0 && (rc = take(m, &m->embed, 0, c->vocab_size, 0, m->D, err)))
		goto fail;
	/* the final norm and lm_head (its rows [v0, v0 + vc)) on the last stage;
	 * mcfg rejects tie_word_embeddings = true and a GGUF must carry
	 * output.weight: DeepSeek always has its own lm_head */
	if (end == c->num_hidden_layers &&
	    ((rc = load_vec(m, gg ? "output_norm.weight" : "model.norm.weight", m->D, &m->final_norm, err)) ||
	     (rc = load_linear(m, gg ? "output.weight" : "lm_head.weight", c->vocab_size, m->D, &m->lm_head,
			       err)) ||
	     (rc = take(m, &m->lm_head, m->v0, m->vc, 0, m->D, err))))
		goto fail;
	for (int L = first; L < end; L++)
		if ((rc = load_layer(m, L, err)))
			goto fail;
	if ((rc = alloc_buffers(m, err)))
		goto fail;

	/* the pages are counted for the whole model (so every rank of a plan
	 * has the same pages, whatever its layers), then hold this stage's
	 * layers only (cache_layer) */
	kv_params kp = {.n_layers = c->num_hidden_layers, .row_elems = m->lora + m->rope,
			.page_size = p->page_size > 0 ? p->page_size : 64};
	if ((rc = model_kv_elem_bytes(p, "the MLA latent cache", 0, &kp.elem_bytes, err)))
		goto fail;
	kp.n_pages = model_kv_pages(p, &kp, m->ctx);
	kp.n_layers = end - first;
	if (!(m->kv = kv_cache_new(&kp, err)))
		goto fail;
	model *base = &m->base;
	base->ops = &deepseek_ops;
	base->arch = mcfg_arch_name(c->arch);
	base->be = m->be;
	base->kv = m->kv;
	base->vocab_size = c->vocab_size;
	base->ctx = m->ctx;
	base->bt = m->bt;
	base->n_eos = c->n_eos < MODEL_MAX_EOS ? c->n_eos : MODEL_MAX_EOS;
	for (int i = 0; i < base->n_eos; i++)
		base->eos_ids[i] = c->eos_token_ids[i];
	base->weight_bytes = m->planned ? m->copied : msrc_tensor_bytes(src);
	base->extra_bytes = m->extra_bytes;
	base->D = m->D;
	base->x = m->x;
	return base;
fail:
	if (err && err->code == DS_OK)
		ds_err_set(err, rc ? rc : DS_EINTERNAL, "model load failed");
	deepseek_free(&m->base);
	return NULL;
}

static void deepseek_free(model *base)
{
	deepseek_model *m = (deepseek_model *)base;
	if (!m)
		return;
	kv_cache_free(m->kv);
	for (int L = 0; m->layers && L < m->cfg.num_hidden_layers; L++) {
		deepseek_layer *ly = &m->layers[L];
		free(ly->attn_norm);
		free(ly->ffn_norm);
		free(ly->q_a_norm);
		free(ly->kv_a_norm);
		free(ly->ukt_owned);
		free(ly->ukt_s);
		free(ly->uv_owned);
		free(ly->uv_s);
		free(ly->kv_b_owned);
		free(ly->bias);
		free(ly->eg);
		free(ly->eu);
		free(ly->ed);
	}
	free(m->layers);
	for (int i = 0; i < m->n_owned; i++)
		free(m->owned[i]);
	free(m->owned);
	void *acts[] = {m->x, m->h, m->cq, m->q, m->kva, m->o, m->lg, m->qa, m->qlat, m->qpe,
			m->u, m->oa, m->nlat, m->nkv, m->nk, m->nv, m->nq, m->no, m->g, m->up,
			m->act, m->rlog, m->xe, m->ye, m->part, m->lgp, m->lgg};
	for (size_t i = 0; m->be && i < sizeof acts / sizeof acts[0]; i++)
		if (acts[i])
			kb_release(m->be, acts[i]);
	void *bufs[] = {m->final_norm, m->inv_freq, m->a_idx, m->a_seq, m->a_pos, m->n_idx,
			m->n_pos, m->rw, m->ridx, m->ecount, m->eoff, m->etok, m->ew, m->seq_ntok};
	for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
		free(bufs[i]);
	msrc_unref(m->base.src); /* m->st, m->gg were borrowed from it */
	free(m);
}

/* ---- forward ---- */

static float *cache_row(deepseek_model *m, const eng_batch *b, int L, int32_t seq, int32_t pos)
{
	const kv_params *kp = kv_cache_params(m->kv);
	int32_t page = b->block_tables[(int64_t)seq * b->max_blocks + pos / kp->page_size];
	int64_t slot = (int64_t)page * kp->page_size + pos % kp->page_size;
	return (float *)kv_cache_layer(m->kv, L - m->base.first_layer) + slot * kp->row_elems;
}

/* Absorbed form for the tokens listed in a_idx[0..n). Writes o rows. */
static int attn_absorbed(deepseek_model *m, const eng_batch *b, int L, int n)
{
	deepseek_layer *ly = &m->layers[L];
	const int64_t H = m->H, qk = m->qk, nope = m->nope, rope = m->rope, lora = m->lora, vd = m->vd;
	int rc;
	for (int i = 0; i < n; i++) {
		int t = m->a_idx[i];
		memcpy(m->qa + i * H * qk, m->q + t * H * qk, (size_t)(H * qk) * 4);
		for (int64_t h = 0; h < H; h++)
			memcpy(m->qpe + (i * H + h) * rope, m->q + t * H * qk + h * qk + nope, (size_t)rope * 4);
		m->a_seq[i] = b->seq[t];
		m->a_pos[i] = b->pos[t];
	}
	/* q_lat[h] = W_UK[h]^T q_nope[h], all heads in one batched product */
	wmat u0 = head_ukt(m, ly, 0), u1 = head_ukt(m, ly, 1 % H);
	if ((rc = linear_heads(m, &u0, &u1, m->qa, qk, H * qk, m->qlat, lora, H * lora, n)))
		return rc;
	const kv_params *kp = kv_cache_params(m->kv);
	kb_mla_attn_args a = {.out = m->u, .q_lat = m->qlat, .q_pe = m->qpe, .n_tok = n,
				.n_heads = H, .kv_lora = lora, .rope_dim = rope,
				.out_stride = H * lora, .q_lat_stride = H * lora,
				.q_pe_stride = H * rope,
				.cache = kv_cache_layer(m->kv, L - m->base.first_layer),
				.page_size = kp->page_size, .row_stride = kp->row_elems,
				.block_tables = b->block_tables, .max_blocks = b->max_blocks,
				.tok_seq = m->a_seq, .tok_pos = m->a_pos, .scale = m->attn_scale};
	if ((rc = kb_mla_attn(m->be, &a)))
		return rc;
	/* o[h] = W_UV[h] u[h] */
	wmat v0 = head_uv(m, ly, 0), v1 = head_uv(m, ly, 1 % H);
	if ((rc = linear_heads(m, &v0, &v1, m->u, lora, H * lora, m->oa, vd, H * vd, n)))
		return rc;
	for (int i = 0; i < n; i++)
		memcpy(m->o + m->a_idx[i] * H * vd, m->oa + i * H * vd, (size_t)(H * vd) * 4);
	return DS_OK;
}

/* Naive form for the tokens of sequence s listed in n_idx[0..n). */
static int attn_naive(deepseek_model *m, const eng_batch *b, int L, int32_t s, int n)
{
	deepseek_layer *ly = &m->layers[L];
	const int64_t H = m->H, qk = m->qk, nope = m->nope, rope = m->rope, lora = m->lora, vd = m->vd;
	const int64_t per = nope + vd;
	int32_t len = 0;
	int rc;
	for (int i = 0; i < n; i++) {
		int t = m->n_idx[i];
		m->n_pos[i] = b->pos[t];
		if (b->pos[t] + 1 > len)
			len = b->pos[t] + 1;
		memcpy(m->nq + i * H * qk, m->q + t * H * qk, (size_t)(H * qk) * 4);
	}
	for (int32_t j = 0; j < len; j++) {
		const float *row = cache_row(m, b, L, s, j);
		memcpy(m->nlat + j * lora, row, (size_t)lora * 4);
		for (int64_t h = 0; h < H; h++)
			memcpy(m->nk + (j * H + h) * qk + nope, row + lora, (size_t)rope * 4);
	}
	if ((rc = linear(m, &ly->kv_b, m->nlat, lora, m->nkv, H * per, len, 0)))
		return rc;
	for (int32_t j = 0; j < len; j++) {
		for (int64_t h = 0; h < H; h++) {
			const float *kv = m->nkv + (j * H + h) * per;
			memcpy(m->nk + (j * H + h) * qk, kv, (size_t)nope * 4);
			memcpy(m->nv + (j * H + h) * vd, kv + nope, (size_t)vd * 4);
		}
	}
	kb_attn_args a = {.out = m->no, .q = m->nq, .k = m->nk, .v = m->nv, .n_tok = n, .n_kv = len,
				.n_heads = H, .n_kv_heads = H, .dk = qk, .dv = vd,
				.q_stride = H * qk, .k_stride = H * qk, .v_stride = H * vd,
				.out_stride = H * vd, .q_pos = m->n_pos, .scale = m->attn_scale};
	if ((rc = kb_attn(m->be, &a)))
		return rc;
	for (int i = 0; i < n; i++)
		memcpy(m->o + m->n_idx[i] * H * vd, m->no + i * H * vd, (size_t)(H * vd) * 4);
	return DS_OK;
}

/* x[n][D] += the sum over group g of part[n][D] (this rank's partial
 * output): the one communication point of a split block. */
static int reduce_add(deepseek_model *m, struct comm_group *g, float *x, int64_t n, ds_err *err)
{
	int rc = model_all_reduce(&m->base, g, m->part, n * m->D, err);
	if (rc)
		return rc;
	kb_axpy_args a = {.y = x, .x = m->part, .n = n * m->D, .alpha = 1.0f};
	return kb_axpy(m->be, &a);
}

/* Attention of layer L (this rank's heads) on the tokens of b, from h (the
 * normed x); adds its output to x [n][D]. */
static int attention(deepseek_model *m, const eng_batch *b, int L, float *x, ds_err *err)
{
	deepseek_layer *ly = &m->layers[L];
	const mcfg *c = &m->cfg;
	const int64_t n = b->n_tok, H = m->H, qk = m->qk, lora = m->lora, rope = m->rope;
	const int64_t kvw = lora + rope;
	int rc;
	/* kv_a and q_a read the same h: one job (kb_matmul_multi) */
	const int q_with_kv = H > 0 && c->q_lora_rank > 0;
	if (q_with_kv) {
		kb_matmul_args a[2] = {model_matmul_args(&ly->kv_a, m->h, m->D, m->kva, kvw, n, 0),
				       model_matmul_args(&ly->q_a, m->h, m->D, m->cq, c->q_lora_rank, n, 0)};
		rc = kb_matmul_multi(m->be, a, 2);
	} else {
		rc = linear(m, &ly->kv_a, m->h, m->D, m->kva, kvw, n, 0);
	}
	if (rc || (rc = rmsnorm(m, m->kva, m->kva, ly->kv_a_norm, n, lora, kvw, kvw)))
		return rc;
	kb_rope_args rk = {.x = m->kva + lora, .n_tok = n, .n_heads = 1, .tok_stride = kvw,
				.head_stride = kvw, .rot_dim = rope, .pos = b->pos,
				.inv_freq = m->inv_freq, .amp = m->rope_amp, .interleaved = 1};
	if ((rc = kb_rope(m->be, &rk)))
		return rc;
	for (int64_t t = 0; t < n; t++)
		memcpy(cache_row(m, b, L, b->seq[t], b->pos[t]), m->kva + t * kvw, (size_t)kvw * 4);
	if (H == 0) { /* a rank past the heads of its stage: its cache rows, and zeros to the sum */
		memset(m->part, 0, (size_t)(n * m->D) * sizeof(float));
		return reduce_add(m, m->base.rank.stage_grp, x, n, err);
	}
	if (c->q_lora_rank > 0) {
		if ((rc = rmsnorm(m, m->cq, m->cq, ly->q_a_norm, n, c->q_lora_rank, c->q_lora_rank,
				  c->q_lora_rank)) ||
		    (rc = linear(m, &ly->q_b, m->cq, c->q_lora_rank, m->q, H * qk, n, 0)))
			return rc;
	} else if ((rc = linear(m, &ly->q_proj, m->h, m->D, m->q, H * qk, n, 0))) {
		return rc;
	}
	kb_rope_args rq = {.x = m->q + m->nope, .n_tok = n, .n_heads = H, .tok_stride = H * qk,
				.head_stride = qk, .rot_dim = rope, .pos = b->pos,
				.inv_freq = m->inv_freq, .amp = m->rope_amp, .interleaved = 1};
	if ((rc = kb_rope(m->be, &rq)))
		return rc;

	/* which tokens take which form */
	memset(m->seq_ntok, 0, (size_t)b->n_seq * sizeof *m->seq_ntok);
	for (int64_t t = 0; t < n; t++)
		m->seq_ntok[b->seq[t]]++;
	int na = 0;
	for (int64_t t = 0; t < n; t++) {
		int naive = m->attn == MODEL_ATTN_NAIVE ||
			    (m->attn == MODEL_ATTN_AUTO && m->seq_ntok[b->seq[t]] > 1);
		if (!naive)
			m->a_idx[na++] = (int32_t)t;
	}
	if (na && (rc = attn_absorbed(m, b, L, na)))
		return rc;
	if (na < n) {
		for (int32_t s = 0; s < b->n_seq; s++) {
			int nn = 0;
			for (int64_t t = 0; t < n; t++) {
				int naive = m->attn == MODEL_ATTN_NAIVE ||
					    (m->attn == MODEL_ATTN_AUTO && m->seq_ntok[s] > 1);
				if (b->seq[t] == s && naive)
					m->n_idx[nn++] = (int32_t)t;
			}
			if (nn && (rc = attn_naive(m, b, L, s, nn)))
				return rc;
		}
	}
	if (m->sn == 1) /* one rank: x += o_proj o */
		return linear(m, &ly->o, m->o, H * m->vd, x, m->D, n, 1);
	/* o_proj over this rank's heads' columns is a partial sum over the stage */
	if ((rc = linear(m, &ly->o, m->o, H * m->vd, m->part, m->D, n, 0)))
		return rc;
	return reduce_add(m, m->base.rank.stage_grp, x, n, err);
}

static int mlp(deepseek_model *m, const wmat *g, const wmat *u, const wmat *d, const float *x, float *y,
	       int64_t rows, int accumulate)
{
	int rc;
	const int64_t I = g->n;
	if (I == 0) { /* a rank past the rows of a split MLP adds zeros */
		if (!accumulate)
			memset(y, 0, (size_t)(rows * m->D) * sizeof(float));
		return DS_OK;
	}
	kb_matmul_args gu[2] = {model_matmul_args(g, x, m->D, m->g, I, rows, 0),
				model_matmul_args(u, x, m->D, m->up, I, rows, 0)};
	if ((rc = kb_matmul_multi(m->be, gu, 2)))
		return rc;
	kb_silu_mul_args s = {.out = m->act, .gate = m->g, .up = m->up, .rows = rows, .dim = I,
				.out_stride = I, .gate_stride = I, .up_stride = I};
	if ((rc = kb_silu_mul(m->be, &s)))
		return rc;
	return linear(m, d, m->act, I, y, m->D, rows, accumulate);
}

/* The dense MLP of layer L (this rank's rows of the intermediate size) on
 * h; adds its output to x [n][D]. */
static int dense(deepseek_model *m, const deepseek_layer *ly, int64_t n, float *x, ds_err *err)
{
	if (m->sn == 1)
		return mlp(m, &ly->gate, &ly->up, &ly->down, m->h, x, n, 1);
	int rc = mlp(m, &ly->gate, &ly->up, &ly->down, m->h, m->part, n, 0);
	return rc ? rc : reduce_add(m, m->base.rank.stage_grp, x, n, err);
}

/* DeepSeekMoE of layer L on h; adds its output to x [n][D].  Every rank of
 * the stage routes every token (the router is replicated) and runs its tp
 * slice (rows [j0, j0 + jc)) of its ep group's experts [e0, e0 + ec) on the
 * tokens that chose them, and its 1/sn slice of the shared experts.  Under
 * a plan these partial sums go to part, and one all-reduce over the stage
 * adds them all: the dispatch needs no communication (the tokens are on
 * every rank already) and the all-reduce is the combine
 * (docs/distributed.md). */
/* The routed experts of one token (a decode step of one sequence) after
 * routing, the shared expert's gate and up already in slot 0 of g/up: the
 * chosen experts' gates and ups as one job, then every down as one job
 * (kb_matmul_multi), instead of three jobs per expert.  Slot s of g, up and
 * act is m->islot floats from the last; ye holds one row per expert.  The
 * same products, additions and order as the general path of moe. */
#define MOE_TOKEN_PRODUCTS 32 /* the CPU backend fuses up to 32 (kc_matmul_multi_isa) */

static int moe_token(deepseek_model *m, const deepseek_layer *ly, float *y, int split)
{
	const mcfg *c = &m->cfg;
	const int64_t D = m->D, S = m->islot;
	kb_matmul_args a[MOE_TOKEN_PRODUCTS];
	int32_t ex[MOE_TOKEN_PRODUCTS / 2];
	int np = 0, ne = 0, rc;
	for (int64_t e = m->e0; e < m->e0 + m->ec; e++) {
		if (m->eoff[e + 1] == m->eoff[e] || ly->eg[e].n == 0)
			continue;
		const int64_t s = 1 + ne;
		a[np++] = model_matmul_args(&ly->eg[e], m->h, D, m->g + s * S, ly->eg[e].n, 1, 0);
		a[np++] = model_matmul_args(&ly->eu[e], m->h, D, m->up + s * S, ly->eu[e].n, 1, 0);
		ex[ne++] = (int32_t)e;
	}
	if (np && (rc = kb_matmul_multi(m->be, a, np)))
		return rc;
	const int shared = c->n_shared_experts > 0 && ly->sg.n > 0;
	np = 0;
	for (int i = shared ? 0 : 1; i <= ne; i++) {
		const wmat *dn = i == 0 ? &ly->sd : &ly->ed[ex[i - 1]];
		const int64_t I = i == 0 ? ly->sg.n : ly->eg[ex[i - 1]].n;
		kb_silu_mul_args sm = {.out = m->act + i * S, .gate = m->g + i * S, .up = m->up + i * S,
				       .rows = 1, .dim = I, .out_stride = I, .gate_stride = I, .up_stride = I};
		if ((rc = kb_silu_mul(m->be, &sm)))
			return rc;
		a[np++] = i == 0 ? model_matmul_args(dn, m->act, I, y, D, 1, !split)
				 : model_matmul_args(dn, m->act + i * S, I, m->ye + (i - 1) * D, D, 1, 0);
	}
	if (!shared && split) /* as moe: the partial sum starts at 0 */
		memset(y, 0, (size_t)D * sizeof(float));
	if (np && (rc = kb_matmul_multi(m->be, a, np)))
		return rc;
	for (int i = 0; i < ne; i++) {
		kb_axpy_args ax = {.y = y, .x = m->ye + i * D, .n = D, .alpha = m->ew[m->eoff[ex[i]]]};
		if ((rc = kb_axpy(m->be, &ax)))
			return rc;
	}
	return DS_OK;
}

/* DeepSeekMoE of layer L on h; adds its output to x [n][D].  Every rank of
 * the stage routes every token (the router is replicated) and runs its tp
 * slice (rows [j0, j0 + jc)) of its ep group's experts [e0, e0 + ec) on the
 * tokens that chose them, and its 1/sn slice of the shared experts.  Under
 * a plan these partial sums go to part, and one all-reduce over the stage
 * adds them all: the dispatch needs no communication (the tokens are on
 * every rank already) and the all-reduce is the combine
 * (docs/distributed.md).  One token goes through moe_token, its router
 * and shared gate and up one job. */
static int moe(deepseek_model *m, const eng_batch *b, int L, float *x, ds_err *err)
{
	deepseek_layer *ly = &m->layers[L];
	const mcfg *c = &m->cfg;
	const int64_t n = b->n_tok, E = c->n_routed_experts, K = c->num_experts_per_tok, D = m->D;
	const int split = m->sn > 1;
	const int one = n == 1 && 2 * (K + 1) <= MOE_TOKEN_PRODUCTS;
	const int shared = c->n_shared_experts > 0;
	float *y = split ? m->part : x; /* where the outputs add up */
	int rc;
	if (one && shared && ly->sg.n > 0) {
		kb_matmul_args a[3] = {model_matmul_args(&ly->router, m->h, D, m->rlog, E, 1, 0),
				       model_matmul_args(&ly->sg, m->h, D, m->g, ly->sg.n, 1, 0),
				       model_matmul_args(&ly->su, m->h, D, m->up, ly->su.n, 1, 0)};
		rc = kb_matmul_multi(m->be, a, 3);
	} else {
		rc = linear(m, &ly->router, m->h, D, m->rlog, E, n, 0);
	}
	if (rc)
		return rc;
	kb_moe_route_args r = {.idx = m->ridx, .weight = m->rw, .logits = m->rlog, .bias = ly->bias,
				.n_tok = n, .n_experts = E, .top_k = K, .n_group = c->n_group,
				.topk_group = c->topk_group, .logits_stride = E,
				.scoring = c->scoring == MCFG_SCORING_SIGMOID ? KB_SCORE_SIGMOID : KB_SCORE_SOFTMAX,
				.method = c->topk_method == MCFG_TOPK_NOAUX_TC ? KB_TOPK_NOAUX_TC : c->topk_method == MCFG_TOPK_GROUP_LIMITED_GREEDY ? KB_TOPK_GROUP_LIMITED_GREEDY : KB_TOPK_GREEDY,
				.norm_topk_prob = c->norm_topk_prob,
				.scaling = (float)c->routed_scaling_factor};
	if ((rc = kb_moe_route(m->be, &r)))
		return rc;
	/* counting sort of (token, weight) pairs by expert */
	memset(m->ecount, 0, (size_t)(E + 1) * 4);
	for (int64_t i = 0; i < n * K; i++)
		m->ecount[m->ridx[i]]++;
	m->eoff[0] = 0;
	for (int64_t e = 0; e < E; e++)
		m->eoff[e + 1] = m->eoff[e] + m->ecount[e];
	memset(m->ecount, 0, (size_t)(E + 1) * 4);
	for (int64_t i = 0; i < n * K; i++) {
		int32_t e = m->ridx[i];
		int32_t at = m->eoff[e] + m->ecount[e]++;
		m->etok[at] = (int32_t)(i / K);
		m->ew[at] = m->rw[i];
	}
	if (one) {
		if ((rc = moe_token(m, ly, y, split)))
			return rc;
		return split ? reduce_add(m, m->base.rank.stage_grp, x, n, err) : DS_OK;
	}
	if (shared) {
		if ((rc = mlp(m, &ly->sg, &ly->su, &ly->sd, m->h, y, n, !split)))
			return rc;
	} else if (split) {
		memset(y, 0, (size_t)(n * D) * sizeof(float));
	}
	for (int64_t e = m->e0; e < m->e0 + m->ec; e++) {
		int32_t cnt = m->eoff[e + 1] - m->eoff[e];
		if (!cnt)
			continue;
		const int32_t *toks = m->etok + m->eoff[e];
		const float *ws = m->ew + m->eoff[e];
		for (int32_t i = 0; i < cnt; i++)
			memcpy(m->xe + i * D, m->h + (int64_t)toks[i] * D, (size_t)D * 4);
		if ((rc = mlp(m, &ly->eg[e], &ly->eu[e], &ly->ed[e], m->xe, m->ye, cnt, 0)))
			return rc;
		for (int32_t i = 0; i < cnt; i++) {
			kb_axpy_args a = {.y = y + (int64_t)toks[i] * D, .x = m->ye + i * D,
						.n = D, .alpha = ws[i]};
			if ((rc = kb_axpy(m->be, &a)))
				return rc;
		}
	}
	return split ? reduce_add(m, m->base.rank.stage_grp, x, n, err) : DS_OK;
}

static int step_failed(deepseek_model *m, int rc, ds_err *err)
{
	if (rc && err && err->code == DS_OK)
		ds_err_set(err, rc, "forward step failed in the %s backend (%s)", m->be->name,
			   ds_status_name(rc));
	return rc;
}

/* First stage: x[t] = embed[tokens[t]]. */
static int deepseek_embed(model *base, const eng_batch *b, float *x, ds_err *err)
{
	deepseek_model *m = (deepseek_model *)base;
	kb_embed_args e = {.out = x, .table = m->embed.w, .type = m->embed.type, .ids = b->tokens,
				.n = b->n_tok, .dim = m->D, .out_stride = m->D, .table_stride = m->D};
	return step_failed(m, kb_embed(m->be, &e), err);
}

/* This stage's layers on x [n_tok][D] in place.  b may be a part of a step
 * (model.c's micro-batches: a range of whole sequences with the step's
 * block tables), so nothing here assumes that its tokens start the step. */
static int deepseek_layers(model *base, const eng_batch *b, float *x, ds_err *err)
{
	deepseek_model *m = (deepseek_model *)base;
	const int64_t n = b->n_tok, D = m->D;
	int rc = DS_OK;
	for (int L = base->first_layer; !rc && L < base->end_layer; L++) {
		deepseek_layer *ly = &m->layers[L];
		if ((rc = rmsnorm(m, m->h, x, ly->attn_norm, n, D, D, D)) ||
		    (rc = attention(m, b, L, x, err)) ||
		    (rc = rmsnorm(m, m->h, x, ly->ffn_norm, n, D, D, D)))
			break;
		rc = ly->moe ? moe(m, b, L, x, err) : dense(m, ly, n, x, err);
	}
	return step_failed(m, rc, err);
}

/* Last stage: logits [tokens that want them][vocab] = lm_head rmsnorm(x).
 * Under a plan each rank of the stage computes its vocab rows [v0, v0 + vc)
 * into lgp [nl][vpad] (the pad columns are never read); all_gather puts
 * rank r's at lgg + r * nl * vpad, and the rows are reassembled in vocab
 * order into logits (when the caller passed it). */
static int deepseek_head(model *base, const eng_batch *b, float *x, float *logits, ds_err *err)
{
	deepseek_model *m = (deepseek_model *)base;
	const int64_t n = b->n_tok, D = m->D, V = m->cfg.vocab_size;
	int64_t nl = 0;
	int rc;
	for (int64_t t = 0; t < n; t++)
		if (!b->want_logits || b->want_logits[t])
			memcpy(m->lg + (nl++) * D, x + t * D, (size_t)D * 4);
	if ((rc = rmsnorm(m, m->lg, m->lg, m->final_norm, nl, D, D, D)))
		return step_failed(m, rc, err);
	if (m->sn == 1)
		return step_failed(m, linear(m, &m->lm_head, m->lg, D, logits, V, nl, 0), err);
	const int64_t vp = m->vpad;
	if ((rc = linear(m, &m->lm_head, m->lg, D, m->lgp, vp, nl, 0)) ||
	    (rc = model_all_gather(base, base->rank.stage_grp, m->lgp, m->lgg, nl * vp, err)))
		return step_failed(m, rc, err);
	for (int r = 0; logits && r < m->sn; r++) {
		int64_t v0, vc;
		model_split_range(V, m->sn, r, &v0, &vc);
		const float *src = m->lgg + (int64_t)r * nl * vp;
		for (int64_t t = 0; t < nl; t++)
			memcpy(logits + t * V + v0, src + t * vp, (size_t)vc * sizeof(float));
	}
	return DS_OK;
}

static void deepseek_set_attn(model *base, enum model_attn attn)
{
	((deepseek_model *)base)->attn = attn;
}

static const model_ops deepseek_ops = {
	.embed = deepseek_embed,
	.layers = deepseek_layers,
	.head = deepseek_head,
	.set_attn = deepseek_set_attn,
	.free = deepseek_free,
};

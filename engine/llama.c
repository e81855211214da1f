/*
 * llama.c - the llama-family dense graph (Llama 2/3, Mistral, SmolLM2):
 * GQA attention over the paged cache, SwiGLU MLP, RMSNorm, RoPE, optionally
 * tied embeddings.  Loaded from a Hugging Face directory (config.json +
 * safetensors) or from a GGUF file (general.architecture "llama").
 *
 *   x = embed[token]
 *   per layer:  h = rmsnorm(x);  q = Wq h;  k = Wk h;  v = Wv h
 *               rope(q), rope(k);  cache row = [k | v]
 *               x += Wo attn(q, K, V)          (head h reads kv head h / group)
 *               h = rmsnorm(x);  x += Wd (silu(Wg h) * Wu h)
 *   logits = lm_head rmsnorm(x)                (lm_head = embed when tied)
 *
 * RoPE pairs: Hugging Face checkpoints store q/k rows in the half-split
 * (NeoX) layout; llama.cpp's converter permutes them into adjacent pairs, so
 * GGUF files use interleaved pairs.  Frequencies: theta^(-2i/d), with the
 * "llama3" or "linear" rope_scaling of the config applied.
 *
 * Under a plan (model_params.rank; docs/distributed.md, "Llama-family models
 * under a plan"): the stage's layers only, the embedding on the first stage,
 * the final norm and head on the last; inside a stage every output element
 * is computed by one tp rank and the parts are all-gathered (lsplit below),
 * so that the logits are the one-rank logits bit for bit.  Every weight a
 * planned rank uses is its own copy of its window (model_weight_window).
 *
 * Called through engine/model.h with the model source model_load opened
 * (config and tensors come from it; the path is never reopened); lists the
 * ops it needs (llama_needs) so that model_backend_choose picks a backend
 * that has them all; computes only through that kb_backend.  model.c runs
 * the step as embed, layers, head (a pipeline stage runs layers on
 * micro-batches of the step).  Buffers are sized at load; a step never
 * allocates.  One step at a time.
 */
#include "common/jsonx.h"
#include "engine/gguf.h"
#include "engine/model_impl.h"
#include "engine/safetensors.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LLAMA_MAX_HEAD_DIM 1024

typedef struct lcfg {
	int vocab, dim, n_layers, n_heads, n_kv, head_dim, ffn, max_pos;
	double rope_theta, eps;
	int tied, interleaved;
	/* rope_scaling */
	int scale_kind; /* 0 none, 1 linear, 2 llama3 */
	double factor, low_freq_factor, high_freq_factor;
	int orig_max_pos;
	int bos, n_eos, eos[MODEL_MAX_EOS];
} lcfg;

typedef model_weight lw; /* a Linear weight as stored (model_impl.h) */

typedef struct llayer {
	float *attn_norm, *ffn_norm;
	lw q, k, v, o, gate, up, down;
} llayer;

/*
 * This rank's share of the model (the whole model on one rank).  Under a plan
 * (docs/distributed.md, "Llama-family models under a plan"), inside a stage:
 *   - attention by kv-head groups: kv heads [g0, g0 + gc) (model_split_range
 *     over n_kv and tp) and their query heads [g0 * grp, (g0 + gc) * grp),
 *     grp = n_heads / n_kv: the q, k, v rows of those heads.  A rank may get
 *     gc = 0 (tp > n_kv): it runs no attention.
 *   - MLP: gate and up rows [f0, f0 + fc) (model_split_range over ffn).
 *   - o and down: output rows [d0, d0 + dc) (model_split_range over dim),
 *     every column.
 *   - head: vocab rows [v0, v0 + vc) over the stage's tp * ep ranks, sent as
 *     vmax (the largest part) rows each.
 *   - the ep index only replicates (a dense model has no experts).
 * Every output element is computed by exactly one rank, by the same kernel
 * call over the same whole input row as on one rank, and the parts are
 * all-gathered (attention outputs, gate*up, x after o and after down,
 * logits).  No partial sums: the plan's logits are the one-rank logits bit
 * for bit.  The usual split (o and down by columns, all-reduce of partial
 * sums) changes the order of the f32 sums, and the CPU backend's quantized
 * products turn such last-bit changes into 8-bit activation steps: 3e-4 off
 * one rank on the default Q4_1 model after 30 layers.
 */
typedef struct lsplit {
	int64_t g0, gc;       /* kv heads */
	int64_t f0, fc;       /* ffn rows of gate and up */
	int64_t d0, dc;       /* dim rows of o and down (x columns this rank computes) */
	int64_t v0, vc, vmax; /* vocab rows; rows each rank sends */
	int64_t part_max;     /* widest part of a tp gather (attention, ffn or dim) */
	int stage_ranks;      /* tp * ep: the vocab parts */
	int tp;               /* > 1: the parts are gathered over tp_grp */
} lsplit;

typedef struct llama_model {
	struct model base; /* first */
	lcfg c;
	st_model *st;      /* borrowed from base.src (Hugging Face), or */
	gguf_file *gg;     /* borrowed from base.src (GGUF) */
	const kb_backend *be;
	lsplit sp;
	int planned;       /* model_params.rank given: every weight an owned copy */
	llayer *layers;    /* [n_layers]; filled for [first_layer, end_layer) */
	lw embed, head;    /* embed on the first stage, head on the last */
	float *final_norm, *inv_freq; /* host f32 copies */
	void **owned;      /* the weight windows' copies (planned), n_owned of them */
	int n_owned, cap_owned;
	size_t extra, wbytes;
	int64_t bt, ctx, qd, kvd;  /* this rank's q and k (or v) widths */
	int64_t qd_full, kvd_full; /* the model's */
	/* activations [bt] rows, from the backend's allocator (model_act_alloc,
	 * kb_release); the cache-row copies and the logits staging below are C
	 * memcpy, as for deepseek.c */
	float *x, *h, *q, *kvb, *o, *g, *u, *lg;
	float *ts, *tr; /* tp gathers: [bt][<= part_max] sent, [tp][bt][<= part_max] gathered */
	float *hs, *hr; /* head under a vocab split: [bt][vmax] sent, [parts][bt][vmax] gathered */
} llama_model;

static void *xalloc(llama_model *m, size_t n, size_t size)
{
	return model_calloc(&m->extra, n, size);
}

/* ---- configuration ---- */

static int cfg_int(const json_t *j, const char *key, int required, int64_t lo, int64_t hi, int *out,
		   const char *path, ds_err *err)
{
	int64_t v = *out;
	if (jsonx_get_i64(j, key, required, lo, hi, &v, err) != DS_OK)
		return ds_err_wrap(err, "%s", path);
	*out = (int)v;
	return DS_OK;
}

/* config.json of a Hugging Face llama-family checkpoint (read whole by the
 * model source; path names it in errors). */
static int cfg_from_hf(const json_t *j, const char *path, lcfg *c, ds_err *err)
{
	int rc = DS_OK;
	const char *act = "silu";
	int bias = 0;
	double d;
	memset(c, 0, sizeof *c);
	c->bos = -1;
	if ((rc = cfg_int(j, "vocab_size", 1, 1, 1 << 24, &c->vocab, path, err)) ||
	    (rc = cfg_int(j, "hidden_size", 1, 1, 1 << 20, &c->dim, path, err)) ||
	    (rc = cfg_int(j, "intermediate_size", 1, 1, 1 << 22, &c->ffn, path, err)) ||
	    (rc = cfg_int(j, "num_hidden_layers", 1, 1, 4096, &c->n_layers, path, err)) ||
	    (rc = cfg_int(j, "num_attention_heads", 1, 1, 4096, &c->n_heads, path, err)))
		goto out;
	c->n_kv = c->n_heads;
	c->head_dim = c->dim / c->n_heads;
	c->max_pos = 4096;
	if ((rc = cfg_int(j, "num_key_value_heads", 0, 1, 4096, &c->n_kv, path, err)) ||
	    (rc = cfg_int(j, "head_dim", 0, 1, LLAMA_MAX_HEAD_DIM, &c->head_dim, path, err)) ||
	    (rc = cfg_int(j, "max_position_embeddings", 0, 1, 1 << 24, &c->max_pos, path, err)) ||
	    (rc = cfg_int(j, "bos_token_id", 0, -1, 1 << 24, &c->bos, path, err)))
		goto out;
	c->rope_theta = 10000.0;
	c->eps = 1e-6;
	if ((rc = jsonx_get_double(j, "rope_theta", 0, 1, 1e12, &c->rope_theta, err)) ||
	    (rc = jsonx_get_double(j, "rms_norm_eps", 0, 0, 1, &c->eps, err)) ||
	    (rc = jsonx_get_str(j, "hidden_act", 0, &act, err)) ||
	    (rc = jsonx_get_bool(j, "tie_word_embeddings", 0, &c->tied, err)) ||
	    (rc = jsonx_get_bool(j, "attention_bias", 0, &bias, err))) {
		ds_err_wrap(err, "%s", path);
		goto out;
	}
	if (strcmp(act, "silu") != 0) {
		rc = ds_err_set(err, DS_EUNSUPPORTED, "%s: hidden_act \"%s\" is not supported (only \"silu\")", path, act);
		goto out;
	}
	if (bias) {
		rc = ds_err_set(err, DS_EUNSUPPORTED, "%s: attention_bias true is not supported", path);
		goto out;
	}
	json_t *eos = json_object_get(j, "eos_token_id");
	if (json_is_integer(eos)) {
		c->eos[c->n_eos++] = (int)json_integer_value(eos);
	} else if (json_is_array(eos)) {
		for (size_t i = 0; i < json_array_size(eos) && c->n_eos < MODEL_MAX_EOS; i++)
			if (json_is_integer(json_array_get(eos, i)))
				c->eos[c->n_eos++] = (int)json_integer_value(json_array_get(eos, i));
	}
	json_t *rs = json_object_get(j, "rope_scaling");
	if (json_is_object(rs)) {
		const char *type = NULL;
		if (jsonx_get_str(rs, "rope_type", 0, &type, err) || (!type && jsonx_get_str(rs, "type", 0, &type, err))) {
			rc = ds_err_wrap(err, "%s: rope_scaling", path);
			goto out;
		}
		d = 1.0;
		if ((rc = jsonx_get_double(rs, "factor", 1, 1, 1e6, &d, err))) {
			ds_err_wrap(err, "%s: rope_scaling", path);
			goto out;
		}
		c->factor = d;
		if (type && strcmp(type, "linear") == 0) {
			c->scale_kind = 1;
		} else if (type && strcmp(type, "llama3") == 0) {
			c->scale_kind = 2;
			c->low_freq_factor = 1.0;
			c->high_freq_factor = 4.0;
			c->orig_max_pos = 8192;
			if ((rc = jsonx_get_double(rs, "low_freq_factor", 0, 1e-6, 1e6, &c->low_freq_factor, err)) ||
			    (rc = jsonx_get_double(rs, "high_freq_factor", 0, 1e-6, 1e6, &c->high_freq_factor, err)) ||
			    (rc = cfg_int(rs, "original_max_position_embeddings", 0, 1, 1 << 24, &c->orig_max_pos, path, err))) {
				ds_err_wrap(err, "%s: rope_scaling", path);
				goto out;
			}
		} else {
			rc = ds_err_set(err, DS_EUNSUPPORTED, "%s: rope_scaling type \"%s\" is not supported (linear, llama3)",
					path, type ? type : "(none)");
			goto out;
		}
	}
out:
	return rc;
}

static int gg_int(const gguf_file *g, const char *key, int required, int64_t lo, int64_t hi, int *out,
		  ds_err *err)
{
	int64_t v;
	if (gguf_find_key(g, key) < 0) {
		if (!required)
			return DS_OK;
		return ds_err_set(err, DS_EFORMAT, "%s: metadata key %s is missing", gguf_path(g), key);
	}
	int rc = gguf_get_int(g, key, lo, hi, &v, err);
	if (rc)
		return rc;
	*out = (int)v;
	return DS_OK;
}

/* llama.* metadata of a GGUF (llama.cpp's key names). */
static int cfg_from_gguf(const gguf_file *g, lcfg *c, ds_err *err)
{
	const char *arch = NULL;
	size_t len = 0;
	int rc;
	memset(c, 0, sizeof *c);
	c->bos = -1;
	if ((rc = gguf_get_str(g, "general.architecture", &arch, &len, err)))
		return rc;
	if (strcmp(arch, "llama") != 0)
		return ds_err_set(err, DS_EUNSUPPORTED,
				  "%s: general.architecture \"%s\" is not supported here (llama)", gguf_path(g), arch);
	int rope_dim = 0;
	if ((rc = gg_int(g, "llama.embedding_length", 1, 1, 1 << 20, &c->dim, err)) ||
	    (rc = gg_int(g, "llama.block_count", 1, 1, 4096, &c->n_layers, err)) ||
	    (rc = gg_int(g, "llama.feed_forward_length", 1, 1, 1 << 22, &c->ffn, err)) ||
	    (rc = gg_int(g, "llama.attention.head_count", 1, 1, 4096, &c->n_heads, err)))
		return rc;
	c->n_kv = c->n_heads;
	c->head_dim = c->dim / c->n_heads;
	c->max_pos = 4096;
	if ((rc = gg_int(g, "llama.attention.head_count_kv", 0, 1, 4096, &c->n_kv, err)) ||
	    (rc = gg_int(g, "llama.attention.key_length", 0, 1, LLAMA_MAX_HEAD_DIM, &c->head_dim, err)) ||
	    (rc = gg_int(g, "llama.context_length", 0, 1, 1 << 24, &c->max_pos, err)) ||
	    (rc = gg_int(g, "tokenizer.ggml.bos_token_id", 0, 0, 1 << 24, &c->bos, err)))
		return rc;
	rope_dim = c->head_dim;
	if ((rc = gg_int(g, "llama.rope.dimension_count", 0, 1, LLAMA_MAX_HEAD_DIM, &rope_dim, err)))
		return rc;
	if (rope_dim != c->head_dim)
		return ds_err_set(err, DS_EUNSUPPORTED, "%s: llama.rope.dimension_count %d differs from the head size %d",
				  gguf_path(g), rope_dim, c->head_dim);
	/* generation stops at EOS and at the end-of-turn / end-of-message tokens
	 * that Llama 3 style GGUFs declare beside it */
	static const char *stop_keys[] = {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
					  "tokenizer.ggml.eom_token_id"};
	for (size_t i = 0; i < sizeof stop_keys / sizeof stop_keys[0]; i++) {
		int id = -1;
		if ((rc = gg_int(g, stop_keys[i], 0, 0, 1 << 24, &id, err)))
			return rc;
		int dup = 0;
		for (int j = 0; j < c->n_eos; j++)
			dup |= c->eos[j] == id;
		if (id >= 0 && !dup && c->n_eos < MODEL_MAX_EOS)
			c->eos[c->n_eos++] = id;
	}
	c->rope_theta = 10000.0;
	c->eps = 1e-5;
	if ((gguf_find_key(g, "llama.rope.freq_base") >= 0 && (rc = gguf_get_float(g, "llama.rope.freq_base", &c->rope_theta, err))) ||
	    (gguf_find_key(g, "llama.attention.layer_norm_rms_epsilon") >= 0 &&
	     (rc = gguf_get_float(g, "llama.attention.layer_norm_rms_epsilon", &c->eps, err))))
		return rc;
	if (gguf_find_key(g, "llama.rope.scaling.type") >= 0) {
		const char *type = NULL;
		if ((rc = gguf_get_str(g, "llama.rope.scaling.type", &type, &len, err)))
			return rc;
		if (strcmp(type, "none") != 0) {
			if (strcmp(type, "linear") != 0)
				return ds_err_set(err, DS_EUNSUPPORTED, "%s: llama.rope.scaling.type \"%s\" is not supported (linear)",
						  gguf_path(g), type);
			c->scale_kind = 1;
			if ((rc = gguf_get_float(g, "llama.rope.scaling.factor", &c->factor, err)))
				return rc;
		}
	}
	if (gguf_find_tensor(g, "rope_freqs.weight"))
		return ds_err_set(err, DS_EUNSUPPORTED, "%s: per-frequency rope factors (rope_freqs.weight) are not supported",
				  gguf_path(g));
	const gguf_tensor *emb = gguf_find_tensor(g, "token_embd.weight");
	if (!emb || emb->n_dims != 2)
		return ds_err_set(err, DS_EFORMAT, "%s: token_embd.weight is missing or not 2-D", gguf_path(g));
	c->vocab = (int)emb->shape[0];
	c->tied = gguf_find_tensor(g, "output.weight") == NULL;
	return DS_OK;
}

static void rope_freqs(const lcfg *c, float *out)
{
	const int half = c->head_dim / 2;
	for (int i = 0; i < half; i++) {
		double f = pow(c->rope_theta, -2.0 * i / c->head_dim);
		if (c->scale_kind == 1) {
			f /= c->factor;
		} else if (c->scale_kind == 2) { /* Llama 3.1: blend by wavelength */
			double wl = 2.0 * M_PI / f;
			double low_wl = c->orig_max_pos / c->low_freq_factor;
			double high_wl = c->orig_max_pos / c->high_freq_factor;
			if (wl > low_wl) {
				f /= c->factor;
			} else if (wl >= high_wl) {
				double s = (c->orig_max_pos / wl - c->low_freq_factor) /
					   (c->high_freq_factor - c->low_freq_factor);
				f = (1.0 - s) * f / c->factor + s * f;
			}
		}
		out[i] = (float)f;
	}
}

/* ---- tensors from either source ---- */

static int get_w(llama_model *m, const char *name, int64_t n, int64_t k, lw *out, ds_err *err)
{
	int64_t shape[2] = {n, k};
	if (m->st) {
		const st_tensor *t = st_get(m->st, name, ST_DTYPE_ANY, 2, shape, err);
		if (!t)
			return err->code;
		if (t->dtype == KB_F8_E4M3)
			return ds_err_set(err, DS_EUNSUPPORTED, "tensor %s: FP8 llama weights are not supported", name);
		*out = (lw){.w = t->data, .type = t->dtype, .n = n, .k = k};
		return DS_OK;
	}
	const gguf_tensor *t = gguf_get_tensor(m->gg, name, GGUF_DTYPE_ANY, 2, shape, err);
	if (!t)
		return err->code;
	*out = (lw){.w = t->data, .type = t->dtype, .n = n, .k = k};
	return DS_OK;
}

static int get_vec(llama_model *m, const char *name, int64_t n, float **out, ds_err *err)
{
	int64_t shape[1] = {n};
	const void *data;
	enum kb_dtype type;
	if (m->st) {
		const st_tensor *t = st_get(m->st, name, ST_DTYPE_ANY, 1, shape, err);
		if (!t)
			return err->code;
		data = t->data;
		type = t->dtype;
	} else {
		const gguf_tensor *t = gguf_get_tensor(m->gg, name, GGUF_DTYPE_ANY, 1, shape, err);
		if (!t)
			return err->code;
		data = t->data;
		type = t->dtype;
	}
	if (!(*out = xalloc(m, (size_t)n, sizeof(float))))
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	if (m->planned) /* a replicated tensor, copied (to f32) like the windows */
		m->wbytes += kb_dtype_bytes(type, n);
	kb_dequant_args a = {.out = *out, .w = data, .wtype = type, .rows = 1, .cols = n,
				.out_stride = n, .w_stride = n, .block = 1};
	int rc = kb_dequant(m->be, &a);
	return rc ? ds_err_set(err, rc, "tensor %s: cannot convert %s to f32", name, st_dtype_name(type)) : DS_OK;
}

/* Rows [row0, row0 + rows) and columns [col0, col0 + cols) of the weight
 * `name` [n][k]: on one rank the whole weight as mapped (the windows are
 * always whole then); under a plan an owned copy of the window
 * (model_weight_window), empty (w = NULL, n or k = 0) when the rank holds
 * none of it. */
static int get_part(llama_model *m, const char *name, int64_t n, int64_t k, int64_t row0, int64_t rows,
		    int64_t col0, int64_t cols, lw *out, ds_err *err)
{
	lw whole;
	int rc = get_w(m, name, n, k, &whole, err);
	if (rc || !m->planned) {
		*out = whole;
		return rc;
	}
	if (rows == 0 || cols == 0) {
		*out = (lw){.type = whole.type, .n = rows, .k = cols};
		return DS_OK;
	}
	if (m->n_owned == m->cap_owned)
		return ds_err_set(err, DS_EINTERNAL, "tensor %s: more weight windows than counted", name);
	void *own = NULL;
	if ((rc = model_weight_window(m->be, &whole, row0, rows, col0, cols, out, &own, &m->wbytes, err)))
		return ds_err_wrap(err, "tensor %s", name);
	m->owned[m->n_owned++] = own;
	return DS_OK;
}

/* The columns tp rank i computes of a [rows][n] activation that the tp
 * ranks gather: attention outputs (query heads of its kv groups), gate*up
 * (ffn) or x (dim). */
enum lpart { PART_ATTN, PART_FFN, PART_DIM };

static void part_cols(const llama_model *m, enum lpart what, int i, int64_t *c0, int64_t *cn)
{
	const lcfg *c = &m->c;
	const int tp = m->sp.tp;
	if (what == PART_ATTN) {
		const int64_t w = (int64_t)(c->n_heads / c->n_kv) * c->head_dim;
		model_split_range(c->n_kv, tp, i, c0, cn);
		*c0 *= w;
		*cn *= w;
	} else {
		model_split_range(what == PART_FFN ? c->ffn : c->dim, tp, i, c0, cn);
	}
}

/* This rank's share (lsplit above) from the plan; the whole model when
 * rank is NULL. */
static void plan_split(llama_model *m, const model_rank *r)
{
	const lcfg *c = &m->c;
	lsplit *sp = &m->sp;
	*sp = (lsplit){.gc = c->n_kv, .fc = c->ffn, .dc = c->dim, .vc = c->vocab, .vmax = c->vocab,
		       .stage_ranks = 1, .tp = 1};
	if (!r)
		return;
	const int tp = r->plan.tp;
	sp->tp = tp;
	model_split_range(c->n_kv, tp, r->tp_rank, &sp->g0, &sp->gc);
	model_split_range(c->ffn, tp, r->tp_rank, &sp->f0, &sp->fc);
	model_split_range(c->dim, tp, r->tp_rank, &sp->d0, &sp->dc);
	for (int what = PART_ATTN; what <= PART_DIM; what++) {
		int64_t c0, cn;
		part_cols(m, (enum lpart)what, 0, &c0, &cn); /* part 0 is the widest */
		sp->part_max = cn > sp->part_max ? cn : sp->part_max;
	}
	sp->stage_ranks = r->plan.tp * r->plan.ep;
	model_split_range(c->vocab, sp->stage_ranks, r->ep_rank * tp + r->tp_rank, &sp->v0, &sp->vc);
	int64_t v0_first;
	model_split_range(c->vocab, sp->stage_ranks, 0, &v0_first, &sp->vmax);
}

/* The weights this rank uses: the embedding on the first stage, the layers
 * [first_layer, end_layer) in this rank's windows (lsplit), the final norm
 * and the head's vocab rows on the last stage.  A tied head is the
 * embedding table: rows of the stage-0 copy when the stage holds it, else
 * its own window of the table. */
static int load_weights(llama_model *m, int gguf, ds_err *err)
{
	const lcfg *c = &m->c;
	const model *b = &m->base;
	const lsplit *sp = &m->sp;
	const int first_stage = b->rank.stage == 0, last_stage = b->rank.stage == b->rank.plan.pp - 1;
	const int64_t hd = c->head_dim, grp = c->n_heads / c->n_kv, D = c->dim;
	const int64_t h0 = sp->g0 * grp * hd, nq = sp->gc * grp * hd; /* q rows */
	const int64_t k0 = sp->g0 * hd, nk = sp->gc * hd;
	const char *embed_name = gguf ? "token_embd.weight" : "model.embed_tokens.weight";
	char n1[256];
	int rc;
#define NM(hf, gg) (snprintf(n1, sizeof n1, gguf ? gg : hf, L), n1)
	int L = 0;
	if (first_stage && (rc = get_part(m, embed_name, c->vocab, D, 0, c->vocab, 0, D, &m->embed, err)))
		return rc;
	if (last_stage) {
		if ((rc = get_vec(m, gguf ? "output_norm.weight" : "model.norm.weight", c->dim, &m->final_norm, err)))
			return rc;
		if (c->tied && first_stage) {
			m->head = m->embed; /* the whole table, or rows [v0, v0 + vc) of its copy */
			m->head.n = sp->vc;
			m->head.w = (const char *)m->embed.w + kb_dtype_bytes(m->embed.type, sp->v0 * D);
		} else if ((rc = get_part(m, c->tied ? embed_name : gguf ? "output.weight" : "lm_head.weight",
					  c->vocab, D, sp->v0, sp->vc, 0, D, &m->head, err))) {
			return rc;
		}
	}
	for (L = b->first_layer; L < b->end_layer; L++) {
		llayer *ly = &m->layers[L];
		if ((rc = get_vec(m, NM("model.layers.%d.input_layernorm.weight", "blk.%d.attn_norm.weight"), c->dim, &ly->attn_norm, err)) ||
		    (rc = get_vec(m, NM("model.layers.%d.post_attention_layernorm.weight", "blk.%d.ffn_norm.weight"), c->dim, &ly->ffn_norm, err)) ||
		    (rc = get_part(m, NM("model.layers.%d.self_attn.q_proj.weight", "blk.%d.attn_q.weight"), m->qd_full, D, h0, nq, 0, D, &ly->q, err)) ||
		    (rc = get_part(m, NM("model.layers.%d.self_attn.k_proj.weight", "blk.%d.attn_k.weight"), m->kvd_full, D, k0, nk, 0, D, &ly->k, err)) ||
		    (rc = get_part(m, NM("model.layers.%d.self_attn.v_proj.weight", "blk.%d.attn_v.weight"), m->kvd_full, D, k0, nk, 0, D, &ly->v, err)) ||
		    (rc = get_part(m, NM("model.layers.%d.self_attn.o_proj.weight", "blk.%d.attn_output.weight"), D, m->qd_full, sp->d0, sp->dc, 0, m->qd_full, &ly->o, err)) ||
		    (rc = get_part(m, NM("model.layers.%d.mlp.gate_proj.weight", "blk.%d.ffn_gate.weight"), c->ffn, D, sp->f0, sp->fc, 0, D, &ly->gate, err)) ||
		    (rc = get_part(m, NM("model.layers.%d.mlp.up_proj.weight", "blk.%d.ffn_up.weight"), c->ffn, D, sp->f0, sp->fc, 0, D, &ly->up, err)) ||
		    (rc = get_part(m, NM("model.layers.%d.mlp.down_proj.weight", "blk.%d.ffn_down.weight"), D, c->ffn, sp->d0, sp->dc, 0, c->ffn, &ly->down, err)))
			return rc;
	}
#undef NM
	return DS_OK;
}

/* ---- forward ---- */

static int linear(llama_model *m, const lw *w, const float *x, int64_t x_stride, float *y,
		  int64_t y_stride, int64_t M, int accumulate)
{
	return model_linear(m->be, w, x, x_stride, y, y_stride, M, accumulate);
}

static int rmsnorm(llama_model *m, float *out, const float *x, const float *w, int64_t rows)
{
	kb_rmsnorm_args a = {.out = out, .x = x, .w = w, .rows = rows, .dim = m->c.dim,
				.x_stride = m->c.dim, .out_stride = m->c.dim,
				.eps = (float)m->c.eps};
	return rows ? kb_rmsnorm(m->be, &a) : DS_OK;
}

static int step_failed(llama_model *m, int rc, ds_err *err)
{
	if (rc && err && err->code == DS_OK)
		ds_err_set(err, rc, "forward step failed in the %s backend (%s)", m->be->name, ds_status_name(rc));
	return rc;
}

/* First stage: x[t] = embed[tokens[t]]. */
static int llama_embed(model *base, const eng_batch *b, float *x, ds_err *err)
{
	llama_model *m = (llama_model *)base;
	kb_embed_args e = {.out = x, .table = m->embed.w, .type = m->embed.type,
				.ids = b->tokens, .n = b->n_tok, .dim = m->c.dim, .out_stride = m->c.dim,
				.table_stride = m->c.dim};
	return step_failed(m, kb_embed(m->be, &e), err);
}

/* Under tp: every rank's columns of buf [n][stride] (part_cols of what) to
 * every rank: this rank's go out packed as pm columns per row (pm: part 0's,
 * the widest of this kind; the tail unused), are gathered over tp_grp into
 * [part][n][pm] and unpacked into buf.  One rank: nothing to do. */
static int gather_cols(llama_model *m, enum lpart what, float *buf, int64_t stride, int64_t n, ds_err *err)
{
	int64_t c0, cn, pm;
	if (m->sp.tp == 1)
		return DS_OK;
	part_cols(m, what, 0, &c0, &pm);
	part_cols(m, what, m->base.rank.tp_rank, &c0, &cn);
	for (int64_t t = 0; t < n; t++)
		memcpy(m->ts + t * pm, buf + t * stride + c0, (size_t)cn * sizeof(float));
	int rc = model_all_gather(&m->base, m->base.rank.tp_grp, m->ts, m->tr, n * pm, err);
	for (int i = 0; !rc && i < m->sp.tp; i++) {
		part_cols(m, what, i, &c0, &cn);
		const float *part = m->tr + (int64_t)i * n * pm;
		for (int64_t t = 0; t < n; t++)
			memcpy(buf + t * stride + c0, part + t * pm, (size_t)cn * sizeof(float));
	}
	return rc;
}

/* x[:, d0:d0+dc] += in W^T (W: this rank's output rows of o or down, every
 * column of in [n][k]), then the x columns of every rank gathered.  On one
 * rank the product of today's whole weight into x. */
static int add_rows(llama_model *m, const lw *w, const float *in, int64_t k, float *x, int64_t n,
		    ds_err *err)
{
	const int64_t D = m->c.dim;
	int rc = w->n ? linear(m, w, in, k, x + m->sp.d0, D, n, 1) : DS_OK;
	return rc ? rc : gather_cols(m, PART_DIM, x, D, n, err);
}

/* The attention of layer L for the b->n_tok tokens of the step (or of a
 * micro-batch of it) on x: x += Wo attn(...).  This rank's heads write their
 * columns of o [n][qd_full]; o is gathered, then add_rows. */
static int attention(llama_model *m, const llayer *ly, int layer, const eng_batch *b, float *x, ds_err *err)
{
	const lcfg *c = &m->c;
	const kv_params *kp = kv_cache_params(m->base.kv);
	const int64_t n = b->n_tok, D = c->dim, qd = m->qd, kvd = m->kvd, qdf = m->qd_full;
	const int64_t n_heads = m->sp.gc * (c->n_heads / c->n_kv), n_kv = m->sp.gc;
	int64_t oc0, ocn;
	int rc;
	part_cols(m, PART_ATTN, m->base.rank.tp_rank, &oc0, &ocn);
	if (n_kv == 0) /* a tp rank past the kv heads: only its rows of o */
		goto project;
	const lw *qkv[3] = {&ly->q, &ly->k, &ly->v};
	float *qkv_y[3] = {m->q, m->kvb, m->kvb + kvd};
	const int64_t qkv_stride[3] = {qd, 2 * kvd, 2 * kvd};
	if ((rc = rmsnorm(m, m->h, x, ly->attn_norm, n)) ||
	    (rc = model_linear_multi(m->be, qkv, 3, m->h, D, qkv_y, qkv_stride, n)))
		return rc;
	kb_rope_args rq = {.x = m->q, .n_tok = n, .n_heads = n_heads, .tok_stride = qd,
				.head_stride = c->head_dim, .rot_dim = c->head_dim,
				.pos = b->pos, .inv_freq = m->inv_freq, .amp = 1.0f,
				.interleaved = c->interleaved};
	kb_rope_args rk = {.x = m->kvb, .n_tok = n, .n_heads = n_kv,
				.tok_stride = 2 * kvd, .head_stride = c->head_dim,
				.rot_dim = c->head_dim, .pos = b->pos,
				.inv_freq = m->inv_freq, .amp = 1.0f,
				.interleaved = c->interleaved};
	if ((rc = kb_rope(m->be, &rq)) || (rc = kb_rope(m->be, &rk)))
		return rc;
	for (int64_t t = 0; t < n; t++) {
		int32_t page = b->block_tables[(int64_t)b->seq[t] * b->max_blocks + b->pos[t] / kp->page_size];
		int64_t slot = (int64_t)page * kp->page_size + b->pos[t] % kp->page_size;
		kv_cache_write_row(m->base.kv, layer, slot, m->kvb + t * 2 * kvd);
	}
	kb_paged_attn_args pa = {.out = m->o + oc0, .q = m->q, .n_tok = n, .n_heads = n_heads,
				.n_kv_heads = n_kv, .head_dim = c->head_dim,
				.q_stride = qd, .out_stride = qdf, .cache = kv_cache_layer(m->base.kv, layer),
				.cache_type = kp->elem_bytes == 2 ? KB_F16 : KB_F32,
				.page_size = kp->page_size, .row_stride = kp->row_elems,
				.v_off = kvd, .block_tables = b->block_tables,
				.max_blocks = b->max_blocks, .tok_seq = b->seq,
				.tok_pos = b->pos,
				.scale = (float)(1.0 / sqrt((double)c->head_dim))};
	if ((rc = kb_paged_attn(m->be, &pa)))
		return rc;
project:
	if ((rc = gather_cols(m, PART_ATTN, m->o, qdf, n, err)))
		return rc;
	return add_rows(m, &ly->o, m->o, qdf, x, n, err);
}

/* x += Wd (silu(Wg h) * Wu h), h = rmsnorm(x): this rank's ffn columns of
 * g [n][ffn] (u holds only them), g gathered, then add_rows. */
static int mlp(llama_model *m, const llayer *ly, int64_t n, float *x, ds_err *err)
{
	const int64_t D = m->c.dim, F = m->c.ffn, f0 = m->sp.f0, fc = m->sp.fc;
	int rc;
	if (fc > 0) {
		const lw *gu[2] = {&ly->gate, &ly->up};
		float *gu_y[2] = {m->g + f0, m->u};
		const int64_t gu_stride[2] = {F, fc};
		if ((rc = rmsnorm(m, m->h, x, ly->ffn_norm, n)) ||
		    (rc = model_linear_multi(m->be, gu, 2, m->h, D, gu_y, gu_stride, n)))
			return rc;
		kb_silu_mul_args sm = {.out = m->g + f0, .gate = m->g + f0, .up = m->u, .rows = n, .dim = fc,
					.out_stride = F, .gate_stride = F, .up_stride = fc};
		if ((rc = kb_silu_mul(m->be, &sm)))
			return rc;
	}
	if ((rc = gather_cols(m, PART_FFN, m->g, F, n, err)))
		return rc;
	return add_rows(m, &ly->down, m->g, F, x, n, err);
}

/* This stage's layers on x [n_tok][D] in place.  b may be a micro-batch of
 * the step (its tokens, positions and sequences offset; the step's block
 * tables): only scratch rows [0, n_tok) are used. */
static int llama_layers(model *base, const eng_batch *b, float *x, ds_err *err)
{
	llama_model *m = (llama_model *)base;
	int rc = DS_OK;
	for (int L = base->first_layer; L < base->end_layer && !rc; L++) {
		const llayer *ly = &m->layers[L];
		rc = attention(m, ly, L - base->first_layer, b, x, err);
		if (!rc)
			rc = mlp(m, ly, b->n_tok, x, err);
	}
	return step_failed(m, rc, err);
}

/* Last stage: logits = head rmsnorm(x) of the tokens that want them.  Under
 * a vocab split each rank's rows [v0, v0 + vc) go out as vmax columns per
 * token (the tail unused), are gathered over the stage group into
 * [part][token][vmax] and reordered into whole rows [token][vocab]. */
static int llama_head(model *base, const eng_batch *b, float *x, float *logits, ds_err *err)
{
	llama_model *m = (llama_model *)base;
	const lcfg *c = &m->c;
	const lsplit *sp = &m->sp;
	const int64_t D = c->dim;
	int64_t nl = 0;
	int rc;
	for (int64_t t = 0; t < b->n_tok; t++)
		if (!b->want_logits || b->want_logits[t])
			memcpy(m->lg + (nl++) * D, x + t * D, (size_t)D * sizeof(float));
	if ((rc = rmsnorm(m, m->lg, m->lg, m->final_norm, nl)))
		return step_failed(m, rc, err);
	if (sp->stage_ranks == 1)
		return step_failed(m, linear(m, &m->head, m->lg, D, logits, c->vocab, nl, 0), err);
	if (nl == 0) /* every rank of the stage sees the same batch: none gathers */
		return DS_OK;
	if (sp->vc && (rc = linear(m, &m->head, m->lg, D, m->hs, sp->vmax, nl, 0)))
		return step_failed(m, rc, err);
	if ((rc = model_all_gather(base, base->rank.stage_grp, m->hs, m->hr, nl * sp->vmax, err)))
		return rc;
	for (int i = 0; logits && i < sp->stage_ranks; i++) {
		int64_t v0, vc;
		model_split_range(c->vocab, sp->stage_ranks, i, &v0, &vc);
		const float *part = m->hr + (int64_t)i * nl * sp->vmax;
		for (int64_t t = 0; t < nl; t++)
			memcpy(logits + t * c->vocab + v0, part + t * sp->vmax, (size_t)vc * sizeof(float));
	}
	return DS_OK;
}

static void llama_free(model *base)
{
	llama_model *m = (llama_model *)base;
	if (!m)
		return;
	kv_cache_free(base->kv);
	for (int L = 0; m->layers && L < m->c.n_layers; L++) {
		free(m->layers[L].attn_norm);
		free(m->layers[L].ffn_norm);
	}
	free(m->layers);
	free(m->final_norm);
	free(m->inv_freq);
	for (int i = 0; i < m->n_owned; i++)
		free(m->owned[i]);
	free(m->owned);
	void *acts[] = {m->x, m->h, m->q, m->kvb, m->o, m->g, m->u, m->lg, m->ts, m->tr, m->hs, m->hr};
	for (size_t i = 0; m->be && i < sizeof acts / sizeof acts[0]; i++)
		if (acts[i])
			kb_release(m->be, acts[i]);
	msrc_unref(base->src); /* m->st, m->gg were borrowed from it */
	free(m);
}

static const model_ops llama_ops = {
	.embed = llama_embed,
	.layers = llama_layers,
	.head = llama_head,
	.free = llama_free, /* one attention form: no set_attn */
};

static int check_cfg(const lcfg *c, const char *what, ds_err *err)
{
	if (c->n_heads % c->n_kv != 0)
		return ds_err_set(err, DS_EINVAL, "%s: %d attention heads do not divide into %d kv heads",
				  what, c->n_heads, c->n_kv);
	if (c->head_dim % 2 || c->head_dim > LLAMA_MAX_HEAD_DIM)
		return ds_err_set(err, DS_EINVAL, "%s: head size %d must be even and <= %d", what,
				  c->head_dim, LLAMA_MAX_HEAD_DIM);
	return DS_OK;
}

/* The ops the step calls, with the dtypes this checkpoint holds: a
 * product on every 2-D weight dtype (the embedding table's too when the
 * head is tied to it), the table's lookup, the activation ops, and the
 * conversion of the norm vectors to f32 at load. */
static int llama_needs(const llama_model *m, msrc *src, int gguf, model_needs *nd, ds_err *err)
{
	const char *embed = gguf ? "token_embd.weight" : "model.embed_tokens.weight";
	model_needs conv = {0};
	int rc = model_needs_scan(src, m->c.n_layers, embed, nd, &conv, NULL, err);
	if (rc)
		return rc;
	enum kb_dtype et = msrc_tensor_dtype(src, embed);
	if (et != KB_DTYPE_COUNT) {
		if (m->c.tied)
			model_needs_add(nd, KB_OP_MATMUL, et);
		model_needs_add(nd, KB_OP_EMBED, et);
	}
	static const enum kb_op acts[] = {KB_OP_RMSNORM, KB_OP_ROPE, KB_OP_PAGED_ATTN, KB_OP_SILU_MUL};
	for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++)
		model_needs_add(nd, acts[i], KB_F32);
	model_needs_append(nd, &conv);
	return DS_OK;
}

/*
 * Load, one rank or under a plan:
 *   config --model_base_plan, plan_split--> this rank's layers and windows
 *   --llama_needs, model_backend_choose--> backend
 *   --msrc_hold_weights (one rank only; a planned rank copies windows out of
 *     the mapping instead)--> load_weights (get_part: the mapped weight, or
 *     model_weight_window) --> activation buffers, KV cache of the stage's
 *     layers and this rank's kv heads (the page count of the whole model, so
 *     that every rank of the plan holds the same pages)
 */
model *llama_model_load(const model_params *p, msrc *src, ds_err *err)
{
	llama_model *m = calloc(1, sizeof *m);
	int rc = DS_OK;
	const int gguf = msrc_kind(src) == MSRC_GGUF;
	const char *what = msrc_path(src);
	model *base = m ? &m->base : NULL;
	if (!m) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	m->base.src = msrc_ref(src);
	if (gguf) {
		m->gg = msrc_gguf(src);
		if ((rc = cfg_from_gguf(m->gg, &m->c, err)))
			goto fail;
	} else {
		const json_t *root = NULL;
		const char *cpath = NULL;
		if ((rc = msrc_config(src, &root, &cpath, err)) || (rc = cfg_from_hf(root, cpath, &m->c, err)))
			goto fail;
		if (!(m->st = msrc_tensors(src, err))) {
			rc = err && err->code ? err->code : DS_EIO;
			goto fail;
		}
	}
	lcfg *c = &m->c;
	c->interleaved = gguf; /* see the file comment */
	if ((rc = check_cfg(c, what, err)) || (rc = model_base_plan(base, p, c->n_layers, c->dim, err)))
		goto fail;
	plan_split(m, p->rank);
	m->planned = p->rank != NULL;
	model_needs nd = {0};
	if ((rc = llama_needs(m, src, gguf, &nd, err)))
		goto fail;
	if (!(m->be = model_backend_choose(p, src, &nd, err)))
		goto fail;
	if (!m->planned && (rc = msrc_hold_weights(src, model_weights_mode(p, m->be), err)))
		goto fail;
	const int64_t grp = c->n_heads / c->n_kv;
	m->qd_full = (int64_t)c->n_heads * c->head_dim;
	m->kvd_full = (int64_t)c->n_kv * c->head_dim;
	m->qd = m->sp.gc * grp * c->head_dim;
	m->kvd = m->sp.gc * c->head_dim;
	m->bt = p->max_batch_tokens > 0 ? p->max_batch_tokens : 512;
	m->ctx = p->max_ctx > 0 ? p->max_ctx : (c->max_pos < 4096 ? c->max_pos : 4096);
	if (m->ctx > c->max_pos) {
		rc = ds_err_set(err, DS_EINVAL, "context %lld is longer than the model's %d positions",
				(long long)m->ctx, c->max_pos);
		goto fail;
	}
	m->cap_owned = 2 + 7 * (base->end_layer - base->first_layer);
	m->layers = xalloc(m, (size_t)c->n_layers, sizeof(llayer));
	m->inv_freq = xalloc(m, (size_t)c->head_dim / 2, sizeof(float));
	m->owned = xalloc(m, (size_t)m->cap_owned, sizeof(void *));
	if (!m->layers || !m->inv_freq || !m->owned) {
		rc = ds_err_set(err, DS_ENOMEM, "out of memory");
		goto fail;
	}
	rope_freqs(c, m->inv_freq);
	if ((rc = load_weights(m, gguf, err)))
		goto fail;
	const size_t bt = (size_t)m->bt;
	const kb_backend *be = m->be;
	m->x = model_act_alloc(be, &m->extra, bt * (size_t)c->dim, 4);
	m->h = model_act_alloc(be, &m->extra, bt * (size_t)c->dim, 4);
	m->lg = model_act_alloc(be, &m->extra, bt * (size_t)c->dim, 4);
	m->q = model_act_alloc(be, &m->extra, bt * (size_t)m->qd, 4);
	m->o = model_act_alloc(be, &m->extra, bt * (size_t)m->qd_full, 4);
	m->kvb = model_act_alloc(be, &m->extra, bt * 2 * (size_t)m->kvd, 4);
	m->g = model_act_alloc(be, &m->extra, bt * (size_t)c->ffn, 4);
	m->u = model_act_alloc(be, &m->extra, bt * (size_t)m->sp.fc, 4);
	if (!m->x || !m->h || !m->lg || !m->q || !m->o || !m->kvb || !m->g || !m->u) {
		rc = ds_err_set(err, DS_ENOMEM, "out of memory for the activation buffers");
		goto fail;
	}
	if (m->sp.tp > 1) {
		size_t part = bt * (size_t)m->sp.part_max;
		m->ts = model_act_alloc(be, &m->extra, part, 4);
		m->tr = model_act_alloc(be, &m->extra, part * (size_t)m->sp.tp, 4);
		if (!m->ts || !m->tr) {
			rc = ds_err_set(err, DS_ENOMEM, "out of memory for the tp gather buffers");
			goto fail;
		}
	}
	if (m->sp.stage_ranks > 1 && base->rank.stage == base->rank.plan.pp - 1) {
		size_t part = bt * (size_t)m->sp.vmax;
		m->hs = model_act_alloc(be, &m->extra, part, 4);
		m->hr = model_act_alloc(be, &m->extra, part * (size_t)m->sp.stage_ranks, 4);
		if (!m->hs || !m->hr) {
			rc = ds_err_set(err, DS_ENOMEM, "out of memory for the vocab-split head buffers");
			goto fail;
		}
		memset(m->hs, 0, part * sizeof(float)); /* the columns past vc are sent unused */
	}
	/* pages as for the whole model on one rank; rows of this stage's layers
	 * and this rank's kv heads (one unused float for a rank without heads,
	 * as the cache needs a row) */
	kv_params kp = {.n_layers = c->n_layers, .row_elems = 2 * m->kvd_full,
			.page_size = p->page_size > 0 ? p->page_size : 64};
	if ((rc = model_kv_elem_bytes(p, "the llama K/V cache", 1, &kp.elem_bytes, err)))
		goto fail;
	kp.n_pages = model_kv_pages(p, &kp, m->ctx);
	kp.n_layers = base->end_layer - base->first_layer;
	kp.row_elems = m->kvd ? 2 * m->kvd : 1;
	if (!(base->kv = kv_cache_new(&kp, err)))
		goto fail;
	base->ops = &llama_ops;
	base->arch = "llama";
	base->be = m->be;
	base->vocab_size = c->vocab;
	base->ctx = m->ctx;
	base->bt = m->bt;
	base->n_eos = c->n_eos;
	memcpy(base->eos_ids, c->eos, sizeof base->eos_ids);
	base->weight_bytes = m->planned ? m->wbytes : msrc_tensor_bytes(src);
	base->extra_bytes = m->extra;
	base->x = m->x;
	return base;
fail:
	if (err && err->code == DS_OK)
		ds_err_set(err, rc ? rc : DS_EINTERNAL, "model load failed");
	llama_free(&m->base);
	return NULL;
}

/*
 * model.c - opens the model source, picks the architecture of a checkpoint,
 * and answers engine/model.h from the shared base (model_impl.h).
 *
 *   DIR with config.json, model_type deepseek_v3 | deepseek_v2  -> deepseek.c
 *   DIR with config.json, model_type llama | mistral | qwen2     -> llama.c
 *   FILE.gguf, general.architecture deepseek2                    -> deepseek.c
 *   FILE.gguf, any other general.architecture                    -> llama.c
 *
 * Model load (every edge names the function that takes it):
 *
 *   path | p->source --msrc_open / msrc_ref--> source (opened once)
 *     --msrc_arch--> graph loader (deepseek_model_load | llama_model_load):
 *        config (mcfg_from_json | mcfg_from_gguf | llama's own)
 *        --needs: the ops its forward calls x the dtypes the source holds
 *        --model_backend_choose (eng_backend_pick: cuda then cpu for auto,
 *          support check before kb_backend_get; or backend_override)
 *        --msrc_hold_weights(mode for that backend) --> tensors, buffers
 *        (model_act_alloc: the backend's allocator), KV cache
 *   model_free --ops->free--> kb_release, msrc_unref
 *
 * Callers: dsrun, the agent's serve module, tests/tools.  Thread rule: as
 * model.h (one step at a time per model).
 */
#include "engine/engine.h"
#include "engine/model_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

model_params model_default_params(void)
{
	model_params p = {0};
	p.backend = "auto";
	p.max_batch_tokens = 512;
	p.max_seqs = 16;
	p.page_size = 64;
	return p;
}

int model_kv_pages(const model_params *p, const kv_params *kp, int64_t ctx)
{
	if (p->n_pages > 0)
		return p->n_pages;
	int64_t per_seq = (ctx + kp->page_size - 1) / kp->page_size;
	int64_t pages = per_seq * (p->max_seqs > 0 ? p->max_seqs : 1);
	if (p->kv_bytes > 0) {
		int64_t page_bytes = (int64_t)kp->n_layers * kp->page_size * kp->row_floats *
				     (int64_t)sizeof(float);
		int64_t cap = (int64_t)(p->kv_bytes / (size_t)page_bytes);
		if (cap < per_seq)
			cap = per_seq;
		if (pages > cap)
			pages = cap;
	}
	return pages > INT32_MAX ? INT32_MAX : (int)pages;
}

/* The graph of an architecture name (GGUF general.architecture or HF
 * model_type); anything else goes to deepseek.c, whose config check names
 * what it supports. */
static int arch_is_llama(const char *arch)
{
	static const char *const names[] = {"llama", "mistral", "qwen2"};
	for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
		if (strcmp(arch, names[i]) == 0)
			return 1;
	return 0;
}

model *model_load(const model_params *p, ds_err *err)
{
	msrc *src = p->source ? msrc_ref(p->source) : msrc_open(p->path, err);
	if (!src)
		return NULL;
	const char *arch = msrc_arch(src);
	/* a GGUF of another architecture reaches llama.c, which names it */
	int llama = msrc_kind(src) == MSRC_GGUF ? strcmp(arch, "deepseek2") != 0 : arch_is_llama(arch);
	model *m = llama ? llama_model_load(p, src, err) : deepseek_model_load(p, src, err);
	msrc_unref(src); /* the model holds its own reference */
	return m;
}

int model_attn_parse(const char *s, enum model_attn *out)
{
	static const struct {
		const char *name;
		enum model_attn attn;
	} forms[] = {
		{.name = "auto", .attn = MODEL_ATTN_AUTO},
		{.name = "naive", .attn = MODEL_ATTN_NAIVE},
		{.name = "absorbed", .attn = MODEL_ATTN_ABSORBED},
	};
	for (size_t i = 0; s && i < sizeof forms / sizeof forms[0]; i++)
		if (strcmp(s, forms[i].name) == 0) {
			*out = forms[i].attn;
			return DS_OK;
		}
	return DS_EINVAL;
}

void model_free(model *m)
{
	if (m)
		m->ops->free(m);
}

void model_needs_add(model_needs *nd, enum kb_op op, enum kb_dtype dtype)
{
	for (int i = 0; i < nd->n; i++)
		if (nd->v[i].op == op && nd->v[i].dtype == dtype)
			return;
	if (nd->n < (int)(sizeof nd->v / sizeof nd->v[0]))
		nd->v[nd->n++] = (kb_op_need){.op = op, .dtype = dtype};
}

void model_needs_append(model_needs *nd, const model_needs *more)
{
	for (int i = 0; i < more->n; i++)
		model_needs_add(nd, more->v[i].op, more->v[i].dtype);
}

int model_needs_scan(msrc *src, int n_layers, const char *embed, model_needs *nd,
		     model_needs *conv,
		     void (*extra)(msrc *src, const msrc_tensor *t, model_needs *nd), ds_err *err)
{
	size_t n = msrc_tensor_count(src, err);
	if (!n && err && err->code)
		return err->code;
	for (size_t i = 0; i < n; i++) {
		msrc_tensor t = msrc_tensor_at(src, i);
		size_t len = strlen(t.name);
		if (t.dtype == KB_DTYPE_COUNT || model_tensor_layer(t.name) >= n_layers ||
		    strcmp(t.name, embed) == 0 || (len > 10 && strcmp(t.name + len - 10, "_scale_inv") == 0))
			continue;
		if (t.n_dims == 1) {
			model_needs_add(conv, KB_OP_DEQUANT, t.dtype);
		} else if (t.n_dims >= 2) {
			model_needs_add(nd, KB_OP_MATMUL, t.dtype);
			if (extra)
				extra(src, &t, nd);
		}
	}
	return DS_OK;
}

enum ds_map_mode model_weights_mode(const model_params *p, const kb_backend *be)
{
	if (p->weights == MODEL_WEIGHTS_HUGE)
		return DS_MAP_HUGE_COPY;
	if (p->weights == MODEL_WEIGHTS_AUTO && strcmp(be->name, "cpu") == 0 && ds_thp_usable())
		return DS_MAP_HUGE_COPY;
	return DS_MAP_FILE;
}

int model_tensor_layer(const char *name)
{
	static const char *const prefixes[] = {"blk.", "model.layers."};
	for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++) {
		size_t n = strlen(prefixes[i]);
		if (strncmp(name, prefixes[i], n) != 0 || name[n] < '0' || name[n] > '9')
			continue;
		long v = 0;
		for (const char *c = name + n; *c >= '0' && *c <= '9' && v < INT32_MAX; c++)
			v = v * 10 + (*c - '0');
		return (int)v;
	}
	return -1;
}

const kb_backend *model_backend_choose(const model_params *p, const msrc *src, const model_needs *nd,
				       ds_err *err)
{
	const kb_backend *be;
	if (p->backend_override) {
		be = p->backend_override;
		if (kb_check(be, nd->v, nd->n, err)) {
			ds_err_wrap(err, "model %s", msrc_path(src));
			return NULL;
		}
	} else if (!(be = eng_backend_pick(p->backend, nd->v, nd->n, msrc_path(src), err))) {
		return NULL;
	}
	(void)kb_set_threads(be, p->threads); /* DS_EUNSUPPORTED: a backend without threads */
	return be;
}

int model_forward(model *m, const eng_batch *b, float *logits, ds_err *err)
{
	return m->ops->forward(m, b, logits, err);
}

void model_set_attn(model *m, enum model_attn attn)
{
	if (m->ops->set_attn)
		m->ops->set_attn(m, attn);
}

int model_check_batch(const model *m, const eng_batch *b, ds_err *err)
{
	const kv_params *kp = kv_cache_params(m->kv);
	if (b->n_tok <= 0 || b->n_tok > m->bt)
		return ds_err_set(err, DS_EINVAL, "a step holds 1..%lld tokens, got %d", (long long)m->bt,
				  b->n_tok);
	if (b->n_seq <= 0 || b->n_seq > m->bt || b->max_blocks <= 0)
		return ds_err_set(err, DS_EINVAL, "a step needs 1..%lld sequences and block tables",
				  (long long)m->bt);
	for (int i = 0; i < b->n_tok; i++) {
		int32_t t = b->tokens[i], pos = b->pos[i], s = b->seq[i];
		if (t < 0 || t >= m->vocab_size)
			return ds_err_set(err, DS_EINVAL, "token id %d is out of range: the vocabulary has %d ids (0..%d)",
					  t, m->vocab_size, m->vocab_size - 1);
		if (pos < 0 || pos >= m->ctx)
			return ds_err_set(err, DS_ERANGE, "position %d is outside the context of %lld tokens",
					  pos, (long long)m->ctx);
		if (s < 0 || s >= b->n_seq)
			return ds_err_set(err, DS_EINVAL, "token %d names sequence %d of %d", i, s, b->n_seq);
		int64_t blk = pos / kp->page_size;
		if (blk >= b->max_blocks)
			return ds_err_set(err, DS_EINVAL, "position %d needs block %lld; the table has %d",
					  pos, (long long)blk, b->max_blocks);
		for (int64_t j = 0; j <= blk; j++) {
			int32_t page = b->block_tables[(int64_t)s * b->max_blocks + j];
			if (page < 0 || page >= kp->n_pages)
				return ds_err_set(err, DS_EINVAL, "sequence %d: block %lld holds page %d (pages 0..%d)",
						  s, (long long)j, page, kp->n_pages - 1);
		}
	}
	return DS_OK;
}

int model_linear(const kb_backend *be, const model_weight *w, const float *x, int64_t x_stride,
		 float *y, int64_t y_stride, int64_t M, int accumulate)
{
	kb_matmul_args a = {.y = y, .x = x, .w = w->w, .w_scale = w->scale, .wtype = w->type,
				.M = M, .N = w->n, .K = w->k, .x_stride = x_stride,
				.y_stride = y_stride, .w_stride = w->k,
				.scale_stride = w->scale_stride, .block = w->block,
				.accumulate = accumulate};
	return M ? kb_matmul(be, &a) : DS_OK;
}

void *model_act_alloc(const kb_backend *be, size_t *counter, size_t n, size_t size)
{
	size_t bytes = (n ? n : 1) * size;
	void *p = kb_alloc(be, bytes);
	if (p)
		*counter += bytes;
	return p;
}

void *model_calloc(size_t *counter, size_t n, size_t size)
{
	void *p = calloc(n ? n : 1, size);
	if (p)
		*counter += n * size;
	return p;
}

kv_cache *model_kv(model *m)
{
	return m->kv;
}

int model_vocab_size(const model *m)
{
	return m->vocab_size;
}

int model_max_ctx(const model *m)
{
	return (int)m->ctx;
}

int model_max_batch_tokens(const model *m)
{
	return (int)m->bt;
}

int model_eos_ids(const model *m, const int **ids)
{
	*ids = m->eos_ids;
	return m->n_eos;
}

const char *model_arch_name(const model *m)
{
	return m->arch;
}

const char *model_backend_name(const model *m)
{
	return m->be->name;
}

size_t model_weight_bytes(const model *m)
{
	return m->weight_bytes;
}

size_t model_extra_bytes(const model *m)
{
	return m->extra_bytes;
}

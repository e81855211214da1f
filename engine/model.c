/*
 * model.c - picks the architecture of a checkpoint and answers engine/model.h
 * from the shared base (model_impl.h).
 *
 *   DIR with config.json, model_type deepseek_v3 | deepseek_v2  -> deepseek.c
 *   DIR with config.json, model_type llama | mistral | qwen2     -> llama.c
 *   FILE.gguf, general.architecture llama                        -> llama.c
 *   FILE.gguf, general.architecture deepseek2                    -> deepseek.c
 * Thread rule: as model.h (one step at a time per model).
 */
#include "common/jsonx.h"
#include "engine/gguf.h"
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

static int ends_with(const char *s, const char *suffix)
{
	size_t n = strlen(s), k = strlen(suffix);
	return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* model_type of DIR/config.json into out ("" when unreadable: the DeepSeek
 * loader then reports the precise problem). */
static void read_model_type(const char *dir, char *out, size_t size)
{
	char path[4096];
	out[0] = '\0';
	snprintf(path, sizeof path, "%s/config.json", dir);
	FILE *f = fopen(path, "rb");
	if (!f)
		return;
	char buf[1 << 16];
	size_t n = fread(buf, 1, sizeof buf - 1, f);
	fclose(f);
	buf[n] = '\0';
	json_t *v = jsonx_parse(buf, n, 64, NULL);
	const char *t = json_string_value(json_object_get(v, "model_type"));
	if (t)
		snprintf(out, size, "%s", t);
	json_decref(v);
}

model *model_load(const model_params *p, ds_err *err)
{
	if (!p->path) {
		ds_err_set(err, DS_EINVAL, "no model path given");
		return NULL;
	}
	if (ends_with(p->path, ".gguf")) {
		/* general.architecture decides; the loader reopens the file (the
		 * mapping is shared by the page cache, the metadata is parsed twice) */
		gguf_file *g = gguf_open(p->path, err);
		const char *arch = NULL;
		if (!g)
			return NULL;
		int ds = gguf_get_str(g, "general.architecture", &arch, NULL, NULL) == DS_OK &&
			 strcmp(arch, "deepseek2") == 0;
		gguf_close(g);
		return ds ? deepseek_model_load(p, err) : llama_model_load(p, err);
	}
	char type[64];
	read_model_type(p->path, type, sizeof type);
	if (strcmp(type, "llama") == 0 || strcmp(type, "mistral") == 0 || strcmp(type, "qwen2") == 0)
		return llama_model_load(p, err);
	return deepseek_model_load(p, err);
}

void model_free(model *m)
{
	if (m)
		m->ops->free(m);
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

int model_bos_id(const model *m)
{
	return m->bos_id;
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

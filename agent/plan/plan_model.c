/*
 * plan_model.c - what the planner knows of a model: the DeepSeek config
 * values it needs and a list of weight tensors, each with its bytes and the
 * rule that says which ranks hold which part of it (docs/distributed.md
 * "How every weight is split").
 *
 * Called by plan.c.  Calls jansson and the file system only.
 *
 * Two sources, one accounting:
 *   - *.safetensors files in the directory: every tensor's bytes come from
 *     its header (data_offsets), its rule from its name;
 *   - no weight files: the same tensor list is built from config.json (names
 *     and shapes of the DeepSeek checkpoints; FP8 linears carry a f32
 *     weight_scale_inv per 128x128 block) and the plan says so.
 * Invariants: layers >= num_hidden_layers (the MTP module) are listed as
 * PLAN_T_SKIP, as the engine never loads them; a tensor's part on a rank is
 * floor(bytes * count / n) with count this rank's model_split_range part of
 * the split size n.
 */
#include "agent/plan/plan_impl.h"
#include "common/strutil.h"

#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define HEADER_MAX ((uint64_t)256 << 20) /* a safetensors JSON header; larger = malformed */
#define FP8_BLOCK 128
#define TENSOR_MAX ((json_int_t)1 << 42) /* 4 TiB: keeps bytes * split count in int64 */

static int add_tensor(plan_model *m, const plan_tensor *t)
{
	if (m->n == m->cap) {
		size_t cap = m->cap ? m->cap * 2 : 1024;
		plan_tensor *nt = realloc(m->t, cap * sizeof *nt);
		if (!nt)
			return DS_ENOMEM;
		m->t = nt;
		m->cap = cap;
	}
	m->t[m->n++] = *t;
	if (t->where != PLAN_T_SKIP)
		m->total_bytes += t->bytes;
	return DS_OK;
}

/* The rule of a tensor from its checkpoint name (HF DeepSeek names). */
static void classify(const plan_mcfg *c, const char *name, plan_tensor *t)
{
	t->where = PLAN_T_ALL;
	t->split = PLAN_S_WHOLE;
	t->layer = -1;
	t->expert = -1;
	t->n = 0;
	if (strncmp(name, "model.embed_tokens.", 19) == 0) {
		t->where = PLAN_T_FIRST;
		return;
	}
	if (strncmp(name, "model.norm.", 11) == 0) {
		t->where = PLAN_T_LAST;
		return;
	}
	if (strncmp(name, "lm_head.", 8) == 0) {
		t->where = PLAN_T_LAST;
		t->split = PLAN_S_STAGE;
		t->n = c->vocab;
		return;
	}
	if (strncmp(name, "model.layers.", 13) != 0)
		return; /* anything else: on every rank (conservative) */
	char *end = NULL;
	long L = strtol(name + 13, &end, 10);
	if (end == name + 13 || *end != '.' || L < 0)
		return;
	if (L >= c->layers) {
		t->where = PLAN_T_SKIP;
		return;
	}
	const char *rest = end + 1;
	t->where = PLAN_T_LAYER;
	t->layer = (int)L;
	if (strncmp(rest, "mlp.experts.", 12) == 0) {
		long e = strtol(rest + 12, &end, 10);
		if (end != rest + 12 && *end == '.' && e >= 0) {
			t->split = PLAN_S_EXPERT;
			t->expert = (int)e;
			t->n = c->moe_inter;
		}
		return;
	}
	if (strncmp(rest, "mlp.shared_experts.", 19) == 0) {
		t->split = PLAN_S_STAGE;
		t->n = (int64_t)c->n_shared * c->moe_inter;
		return;
	}
	static const char *const heads[] = {"self_attn.q_b_proj.", "self_attn.q_proj.",
					    "self_attn.kv_b_proj.", "self_attn.o_proj."};
	for (size_t i = 0; i < sizeof heads / sizeof heads[0]; i++) {
		if (strncmp(rest, heads[i], strlen(heads[i])) == 0) {
			t->split = PLAN_S_STAGE;
			t->n = c->heads;
			return;
		}
	}
	if (strncmp(rest, "mlp.gate_proj.", 14) == 0 || strncmp(rest, "mlp.up_proj.", 12) == 0 ||
	    strncmp(rest, "mlp.down_proj.", 14) == 0) {
		t->split = PLAN_S_STAGE;
		t->n = c->inter;
	}
	/* norms, q_a_proj, kv_a_proj_with_mqa, the router: whole on every rank of the stage */
}

/* ---- config.json ---------------------------------------------------------- */

static int get_int(json_t *cfg, const char *key, int required, int dflt, int *out, ds_err *err)
{
	json_t *v = json_object_get(cfg, key);
	if (!v || json_is_null(v)) {
		if (required)
			return ds_err_set(err, DS_EFORMAT, "config.json: \"%s\" is missing", key);
		*out = dflt;
		return DS_OK;
	}
	if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > (1 << 30))
		return ds_err_set(err, DS_EFORMAT, "config.json: \"%s\" is not a count", key);
	*out = (int)json_integer_value(v);
	return DS_OK;
}

static int read_config(const char *dir, plan_mcfg *c, ds_err *err)
{
	char path[4096];
	json_error_t je;
	int rc = DS_OK;
	snprintf(path, sizeof path, "%s/config.json", dir);
	json_t *cfg = json_load_file(path, 0, &je);
	if (!cfg) {
		FILE *f = fopen(path, "r");
		if (!f)
			return ds_err_set(err, DS_ENOTFOUND, "%s: %s", path, strerror(errno));
		fclose(f);
		return ds_err_set(err, DS_EFORMAT, "%s: line %d: %s", path, je.line, je.text);
	}
	if (!json_is_object(cfg)) {
		rc = ds_err_set(err, DS_EFORMAT, "%s: not a JSON object", path);
		goto out;
	}
	const char *mt = json_string_value(json_object_get(cfg, "model_type"));
	if (!mt || (strcmp(mt, "deepseek_v3") != 0 && strcmp(mt, "deepseek_v2") != 0)) {
		rc = ds_err_set(err, DS_EUNSUPPORTED,
				"%s: model_type \"%s\": the planner knows the DeepSeek MLA family "
				"(deepseek_v2, deepseek_v3) only",
				path, mt ? mt : "(missing)");
		goto out;
	}
	ds_strlcpy(c->model_type, mt, sizeof c->model_type);
	if ((rc = get_int(cfg, "hidden_size", 1, 0, &c->hidden, err)) ||
	    (rc = get_int(cfg, "num_hidden_layers", 1, 0, &c->layers, err)) ||
	    (rc = get_int(cfg, "num_attention_heads", 1, 0, &c->heads, err)) ||
	    (rc = get_int(cfg, "vocab_size", 1, 0, &c->vocab, err)) ||
	    (rc = get_int(cfg, "intermediate_size", 1, 0, &c->inter, err)) ||
	    (rc = get_int(cfg, "kv_lora_rank", 1, 0, &c->kv_lora, err)) ||
	    (rc = get_int(cfg, "qk_rope_head_dim", 1, 0, &c->rope, err)) ||
	    (rc = get_int(cfg, "qk_nope_head_dim", 1, 0, &c->nope, err)) ||
	    (rc = get_int(cfg, "v_head_dim", 1, 0, &c->v_dim, err)) ||
	    (rc = get_int(cfg, "q_lora_rank", 0, 0, &c->q_lora, err)) ||
	    (rc = get_int(cfg, "n_routed_experts", 0, 0, &c->experts, err)) ||
	    (rc = get_int(cfg, "moe_intermediate_size", 0, 0, &c->moe_inter, err)) ||
	    (rc = get_int(cfg, "n_shared_experts", 0, 0, &c->n_shared, err)) ||
	    (rc = get_int(cfg, "num_experts_per_tok", 0, 0, &c->top_k, err)) ||
	    (rc = get_int(cfg, "first_k_dense_replace", 0, 0, &c->first_dense, err)) ||
	    (rc = get_int(cfg, "moe_layer_freq", 0, 1, &c->moe_freq, err)) ||
	    (rc = get_int(cfg, "max_position_embeddings", 0, 4096, &c->max_pos, err)))
		goto out;
	if (c->hidden < 1 || c->layers < 1 || c->heads < 1 || c->vocab < 1 || c->moe_freq < 1) {
		rc = ds_err_set(err, DS_EFORMAT, "%s: hidden_size, num_hidden_layers, "
				"num_attention_heads, vocab_size and moe_layer_freq must be >= 1", path);
		goto out;
	}
	if (c->experts > 0 && (c->moe_inter < 1 || c->top_k < 1 || c->top_k > c->experts)) {
		rc = ds_err_set(err, DS_EFORMAT, "%s: n_routed_experts %d needs moe_intermediate_size "
				">= 1 and 1 <= num_experts_per_tok <= n_routed_experts", path, c->experts);
		goto out;
	}
	const char *tm = json_string_value(json_object_get(cfg, "topk_method"));
	c->score_bias = tm && strcmp(tm, "noaux_tc") == 0;
	json_t *q = json_object_get(cfg, "quantization_config");
	const char *qm = json_string_value(json_object_get(q, "quant_method"));
	c->fp8 = qm && strcmp(qm, "fp8") == 0;
	if (qm && !c->fp8) {
		rc = ds_err_set(err, DS_EUNSUPPORTED, "%s: quantization_config.quant_method \"%s\": "
				"the planner sizes fp8 and unquantized checkpoints only", path, qm);
		goto out;
	}
	const char *td = json_string_value(json_object_get(cfg, "torch_dtype"));
	c->elem_bytes = td && strcmp(td, "float32") == 0 ? 4 : 2;
out:
	json_decref(cfg);
	return rc;
}

/* ---- tensors from config arithmetic --------------------------------------- */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* One weight [rows][cols] named prefix+"weight" (+ its FP8 block scales). */
static int linear(plan_model *m, const char *name, int64_t rows, int64_t cols, int quant)
{
	plan_tensor t;
	int rc;
	classify(&m->c, name, &t);
	t.bytes = rows * cols * (quant ? 1 : m->c.elem_bytes);
	if ((rc = add_tensor(m, &t)) != DS_OK || !quant)
		return rc;
	t.bytes = ceil_div(rows, FP8_BLOCK) * ceil_div(cols, FP8_BLOCK) * 4;
	return add_tensor(m, &t);
}

static int vec(plan_model *m, const char *name, int64_t n, int elem)
{
	plan_tensor t;
	classify(&m->c, name, &t);
	t.bytes = n * elem;
	return add_tensor(m, &t);
}

static int tensors_from_config(plan_model *m)
{
	const plan_mcfg *c = &m->c;
	const int q = c->fp8, eb = c->elem_bytes;
	const int64_t D = c->hidden, H = c->heads, qk = c->nope + c->rope;
	char n[160];
	int rc;
#define T(call)                                                                                \
	do {                                                                                   \
		if ((rc = (call)) != DS_OK)                                                    \
			return rc;                                                             \
	} while (0)
	T(linear(m, "model.embed_tokens.weight", c->vocab, D, 0));
	for (int L = 0; L < c->layers; L++) {
#define NAME(s) (snprintf(n, sizeof n, "model.layers.%d.%s", L, s), n)
		T(vec(m, NAME("input_layernorm.weight"), D, eb));
		T(vec(m, NAME("post_attention_layernorm.weight"), D, eb));
		if (c->q_lora > 0) {
			T(linear(m, NAME("self_attn.q_a_proj.weight"), c->q_lora, D, q));
			T(vec(m, NAME("self_attn.q_a_layernorm.weight"), c->q_lora, eb));
			T(linear(m, NAME("self_attn.q_b_proj.weight"), H * qk, c->q_lora, q));
		} else {
			T(linear(m, NAME("self_attn.q_proj.weight"), H * qk, D, q));
		}
		T(linear(m, NAME("self_attn.kv_a_proj_with_mqa.weight"), c->kv_lora + c->rope, D, q));
		T(vec(m, NAME("self_attn.kv_a_layernorm.weight"), c->kv_lora, eb));
		T(linear(m, NAME("self_attn.kv_b_proj.weight"), H * (c->nope + c->v_dim), c->kv_lora, q));
		T(linear(m, NAME("self_attn.o_proj.weight"), D, H * c->v_dim, q));
		if (!plan_layer_is_moe(c, L)) {
			T(linear(m, NAME("mlp.gate_proj.weight"), c->inter, D, q));
			T(linear(m, NAME("mlp.up_proj.weight"), c->inter, D, q));
			T(linear(m, NAME("mlp.down_proj.weight"), D, c->inter, q));
			continue;
		}
		T(linear(m, NAME("mlp.gate.weight"), c->experts, D, 0));
		if (c->score_bias)
			T(vec(m, NAME("mlp.gate.e_score_correction_bias"), c->experts, 4));
		for (int e = 0; e < c->experts; e++) {
			static const char *const p[] = {"gate_proj", "up_proj", "down_proj"};
			for (int k = 0; k < 3; k++) {
				snprintf(n, sizeof n, "model.layers.%d.mlp.experts.%d.%s.weight", L, e, p[k]);
				T(k < 2 ? linear(m, n, c->moe_inter, D, q) : linear(m, n, D, c->moe_inter, q));
			}
		}
		if (c->n_shared > 0) {
			int64_t si = (int64_t)c->n_shared * c->moe_inter;
			T(linear(m, NAME("mlp.shared_experts.gate_proj.weight"), si, D, q));
			T(linear(m, NAME("mlp.shared_experts.up_proj.weight"), si, D, q));
			T(linear(m, NAME("mlp.shared_experts.down_proj.weight"), D, si, q));
		}
#undef NAME
	}
	T(vec(m, "model.norm.weight", D, eb));
	T(linear(m, "lm_head.weight", c->vocab, D, 0));
#undef T
	return DS_OK;
}

/* ---- tensors from safetensors headers ------------------------------------- */

static int read_header(plan_model *m, const char *path, ds_err *err)
{
	uint8_t lb[8];
	char *text = NULL;
	json_t *h = NULL;
	int rc = DS_OK;
	FILE *f = fopen(path, "rb");
	if (!f)
		return ds_err_set(err, DS_EIO, "%s: %s", path, strerror(errno));
	if (fread(lb, 1, 8, f) != 8) {
		rc = ds_err_set(err, DS_EFORMAT, "%s: shorter than a safetensors header", path);
		goto out;
	}
	uint64_t len = 0;
	for (int i = 7; i >= 0; i--)
		len = len << 8 | lb[i];
	if (len == 0 || len > HEADER_MAX) {
		rc = ds_err_set(err, DS_EFORMAT, "%s: header length %llu out of range", path,
				(unsigned long long)len);
		goto out;
	}
	if (!(text = malloc(len))) {
		rc = DS_ENOMEM;
		goto out;
	}
	if (fread(text, 1, len, f) != len) {
		rc = ds_err_set(err, DS_EFORMAT, "%s: header truncated", path);
		goto out;
	}
	json_error_t je;
	h = json_loadb(text, len, 0, &je);
	if (!json_is_object(h)) {
		rc = ds_err_set(err, DS_EFORMAT, "%s: header is not a JSON object: %s", path, je.text);
		goto out;
	}
	const char *key;
	json_t *v;
	json_object_foreach(h, key, v) {
		if (strcmp(key, "__metadata__") == 0)
			continue;
		json_t *off = json_object_get(v, "data_offsets");
		json_t *a = json_array_get(off, 0), *b = json_array_get(off, 1);
		if (!json_is_integer(a) || !json_is_integer(b) ||
		    json_integer_value(b) < json_integer_value(a) || json_integer_value(a) < 0 ||
		    json_integer_value(b) - json_integer_value(a) > TENSOR_MAX) {
			rc = ds_err_set(err, DS_EFORMAT, "%s: tensor %s: bad data_offsets", path, key);
			goto out;
		}
		const char *dt = json_string_value(json_object_get(v, "dtype"));
		if (dt && strncmp(dt, "F8_", 3) == 0)
			m->files_fp8 = 1;
		plan_tensor t;
		classify(&m->c, key, &t);
		t.bytes = json_integer_value(b) - json_integer_value(a);
		if ((rc = add_tensor(m, &t)) != DS_OK)
			goto out;
	}
out:
	json_decref(h);
	free(text);
	fclose(f);
	return rc;
}

static int tensors_from_files(plan_model *m, const char *dir, ds_err *err)
{
	DIR *d = opendir(dir);
	struct dirent *de;
	int rc = DS_OK;
	char path[4096];
	if (!d)
		return ds_err_set(err, DS_EIO, "%s: %s", dir, strerror(errno));
	while ((de = readdir(d)) != NULL) {
		size_t l = strlen(de->d_name);
		if (l < 12 || strcmp(de->d_name + l - 12, ".safetensors") != 0)
			continue;
		snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
		if ((rc = read_header(m, path, err)) != DS_OK)
			break;
		m->n_files++;
	}
	closedir(d);
	return rc;
}

int plan_model_from_config(const plan_mcfg *c, plan_model *m, ds_err *err)
{
	int rc;
	memset(m, 0, sizeof *m);
	m->c = *c;
	if ((rc = tensors_from_config(m)) != DS_OK) {
		plan_model_free(m);
		return ds_err_set(err, rc, "out of memory listing the model's tensors");
	}
	return DS_OK;
}

int plan_layer_is_moe(const plan_mcfg *c, int L)
{
	return c->experts > 0 && L >= c->first_dense && L % c->moe_freq == 0;
}

int plan_model_load(const char *path, plan_model *m, ds_err *err)
{
	int rc;
	memset(m, 0, sizeof *m);
	size_t l = strlen(path);
	FILE *f = fopen(path, "rb");
	if (f) {
		char magic[4] = {0};
		size_t got = fread(magic, 1, 4, f);
		fclose(f);
		if ((got == 4 && memcmp(magic, "GGUF", 4) == 0) ||
		    (l > 5 && strcmp(path + l - 5, ".gguf") == 0))
			return ds_err_set(err, DS_EUNSUPPORTED,
					  "%s: planning from GGUF metadata is not built; give a "
					  "checkpoint directory with config.json (the weights may be absent)",
					  path);
	}
	DIR *d = opendir(path);
	if (!d)
		return ds_err_set(err, DS_ENOTFOUND, "model %s: not a directory: %s", path,
				  strerror(errno));
	closedir(d);
	if ((rc = read_config(path, &m->c, err)) != DS_OK)
		return rc;
	if ((rc = tensors_from_files(m, path, err)) != DS_OK)
		goto fail;
	if (m->n_files > 0) {
		m->from_files = 1;
		if (m->files_fp8)
			m->c.fp8 = 1;
		return DS_OK;
	}
	m->n = 0;
	m->total_bytes = 0;
	if ((rc = tensors_from_config(m)) != DS_OK)
		goto fail;
	return DS_OK;
fail:
	if (rc == DS_ENOMEM)
		ds_err_set(err, DS_ENOMEM, "model %s: out of memory", path);
	plan_model_free(m);
	return rc;
}

void plan_model_free(plan_model *m)
{
	free(m->t);
	m->t = NULL;
	m->n = m->cap = 0;
}

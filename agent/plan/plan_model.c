/*
 * plan_model.c - what the planner knows of a model: the config values it
 * needs and a list of weight tensors, each with its bytes and the rule that
 * says which ranks hold which part of it (docs/distributed.md "How every
 * weight is split", "Llama-family models under a plan").
 *
 * Called by plan.c.  Calls jansson, the file system, engine/gguf.h (GGUF
 * metadata and tensor infos) and engine/mconfig.h (a DeepSeek GGUF's
 * metadata, read as the engine reads it).
 *
 * Three sources, one accounting:
 *   - *.safetensors files in the directory: every tensor's bytes come from
 *     its header (data_offsets), its rule from its name;
 *   - no weight files: the same tensor list is built from config.json (names
 *     and shapes of the DeepSeek checkpoints; FP8 linears carry a f32
 *     weight_scale_inv per 128x128 block) and the plan says so;
 *   - a .gguf file (llama or deepseek2): the sizes from its metadata, every
 *     tensor's bytes from its tensor info, its rule from its llama.cpp name
 *     (the tables below follow llama.c load_weights and deepseek.c
 *     load_layer); a tensor the engine needs that is missing, misshapen or of
 *     a type the kernels lack is an error, as at load.
 * Invariants: layers >= num_hidden_layers (the MTP module) are listed as
 * PLAN_T_SKIP, as the engine never loads them; a tensor's part on a rank is
 * floor(bytes * count / n) with count this rank's model_split_range part of
 * the split size n (plan_impl.h: the f32 column windows of a DeepSeek GGUF).
 */
#include "agent/plan/plan_impl.h"
#include "common/strutil.h"
#include "engine/gguf.h"
#include "engine/mconfig.h"

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
	if (t->where != PLAN_T_SKIP && t->where != PLAN_T_LAST_OWN)
		m->total_bytes += t->bytes;
	return DS_OK;
}

/* The rule of a tensor from its checkpoint name (HF DeepSeek names). */
static void classify(const plan_mcfg *c, const char *name, plan_tensor *t)
{
	memset(t, 0, sizeof *t);
	t->where = PLAN_T_ALL;
	t->split = PLAN_S_WHOLE;
	t->layer = -1;
	t->expert = -1;
	t->block = 1;
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
	c->arch = PLAN_ARCH_MLA;
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

/* ---- tensors from a GGUF file --------------------------------------------- */

/* Sizes the rule tables name (Z_0: none, ends a shape). */
enum {
	Z_0 = 0, Z_1, Z_D, Z_V, Z_F, Z_H, Z_KVH, Z_Q, Z_KV, Z_QK, Z_QL, Z_KVA, Z_L, Z_KVB, Z_O,
	Z_E, Z_MI, Z_S, Z_NOPE, Z_VD,
};

static int64_t zsize(const plan_mcfg *c, int z)
{
	switch (z) {
	case Z_1: return 1;
	case Z_D: return c->hidden;
	case Z_V: return c->vocab;
	case Z_F: return c->inter;
	case Z_H: return c->heads;
	case Z_KVH: return c->kv_heads;
	case Z_Q: return (int64_t)c->heads * c->head_dim;
	case Z_KV: return (int64_t)c->kv_heads * c->head_dim;
	case Z_QK: return (int64_t)c->heads * (c->nope + c->rope);
	case Z_QL: return c->q_lora;
	case Z_KVA: return (int64_t)c->kv_lora + c->rope;
	case Z_L: return c->kv_lora;
	case Z_KVB: return (int64_t)c->heads * (c->nope + c->v_dim);
	case Z_O: return (int64_t)c->heads * c->v_dim;
	case Z_E: return c->experts;
	case Z_MI: return c->moe_inter;
	case Z_S: return (int64_t)c->n_shared * c->moe_inter;
	case Z_NOPE: return c->nope;
	case Z_VD: return c->v_dim;
	default: return 0;
	}
}

/* When a layer tensor is used (G_NEVER: listed as PLAN_T_SKIP if present). */
enum {
	G_ALWAYS = 0, G_QLORA, G_NO_QLORA, G_KV_WHOLE, G_KV_SPLIT, G_DENSE, G_MOE, G_BIAS, G_SHARED,
	G_NEVER,
};

/* One tensor of a GGUF layer "blk.L.<name>": when the engine loads it, its
 * split and split size, the columns per item of a column split (Z_0: rows),
 * and its row-major shape.  EXPERT rows are the stacked [E][n][k] tensors. */
typedef struct gg_rule {
	const char *name;
	unsigned char when, split, by, col;
	unsigned char dims[3];
} gg_rule;

/* llama.c load_weights: kv-head groups of q, k, v; output rows of o and
 * down (dim); ffn rows of gate and up; all over the tp ranks. */
static const gg_rule llama_layer[] = {
	{"attn_norm.weight", G_ALWAYS, PLAN_S_WHOLE, Z_0, Z_0, {Z_D}},
	{"ffn_norm.weight", G_ALWAYS, PLAN_S_WHOLE, Z_0, Z_0, {Z_D}},
	{"attn_q.weight", G_ALWAYS, PLAN_S_TP, Z_KVH, Z_0, {Z_Q, Z_D}},
	{"attn_k.weight", G_ALWAYS, PLAN_S_TP, Z_KVH, Z_0, {Z_KV, Z_D}},
	{"attn_v.weight", G_ALWAYS, PLAN_S_TP, Z_KVH, Z_0, {Z_KV, Z_D}},
	{"attn_output.weight", G_ALWAYS, PLAN_S_TP, Z_D, Z_0, {Z_D, Z_Q}},
	{"ffn_gate.weight", G_ALWAYS, PLAN_S_TP, Z_F, Z_0, {Z_F, Z_D}},
	{"ffn_up.weight", G_ALWAYS, PLAN_S_TP, Z_F, Z_0, {Z_F, Z_D}},
	{"ffn_down.weight", G_ALWAYS, PLAN_S_TP, Z_D, Z_0, {Z_D, Z_F}},
};

/* deepseek.c load_layer: heads of q_b / q, kv_b (or its split halves) and
 * o's columns, rows of the dense and shared MLPs (down: columns) over the
 * stage; experts over ep, each one's moe_intermediate rows (down: columns)
 * over tp; the rest whole. */
static const gg_rule mla_layer[] = {
	{"attn_norm.weight", G_ALWAYS, PLAN_S_WHOLE, Z_0, Z_0, {Z_D}},
	{"ffn_norm.weight", G_ALWAYS, PLAN_S_WHOLE, Z_0, Z_0, {Z_D}},
	{"attn_q_a.weight", G_QLORA, PLAN_S_WHOLE, Z_0, Z_0, {Z_QL, Z_D}},
	{"attn_q_a_norm.weight", G_QLORA, PLAN_S_WHOLE, Z_0, Z_0, {Z_QL}},
	{"attn_q_b.weight", G_QLORA, PLAN_S_STAGE, Z_H, Z_0, {Z_QK, Z_QL}},
	{"attn_q.weight", G_NO_QLORA, PLAN_S_STAGE, Z_H, Z_0, {Z_QK, Z_D}},
	{"attn_kv_a_mqa.weight", G_ALWAYS, PLAN_S_WHOLE, Z_0, Z_0, {Z_KVA, Z_D}},
	{"attn_kv_a_norm.weight", G_ALWAYS, PLAN_S_WHOLE, Z_0, Z_0, {Z_L}},
	{"attn_kv_b.weight", G_KV_WHOLE, PLAN_S_STAGE, Z_H, Z_0, {Z_KVB, Z_L}},
	{"attn_k_b.weight", G_KV_SPLIT, PLAN_S_STAGE, Z_H, Z_0, {Z_H, Z_L, Z_NOPE}},
	{"attn_v_b.weight", G_KV_SPLIT, PLAN_S_STAGE, Z_H, Z_0, {Z_H, Z_VD, Z_L}},
	{"attn_output.weight", G_ALWAYS, PLAN_S_STAGE, Z_H, Z_VD, {Z_D, Z_O}},
	{"ffn_gate.weight", G_DENSE, PLAN_S_STAGE, Z_F, Z_0, {Z_F, Z_D}},
	{"ffn_up.weight", G_DENSE, PLAN_S_STAGE, Z_F, Z_0, {Z_F, Z_D}},
	{"ffn_down.weight", G_DENSE, PLAN_S_STAGE, Z_F, Z_1, {Z_D, Z_F}},
	{"ffn_gate_inp.weight", G_MOE, PLAN_S_WHOLE, Z_0, Z_0, {Z_E, Z_D}},
	{"exp_probs_b.bias", G_BIAS, PLAN_S_WHOLE, Z_0, Z_0, {Z_E}},
	{"ffn_gate_exps.weight", G_MOE, PLAN_S_EXPERT, Z_MI, Z_0, {Z_E, Z_MI, Z_D}},
	{"ffn_up_exps.weight", G_MOE, PLAN_S_EXPERT, Z_MI, Z_0, {Z_E, Z_MI, Z_D}},
	{"ffn_down_exps.weight", G_MOE, PLAN_S_EXPERT, Z_MI, Z_1, {Z_E, Z_D, Z_MI}},
	{"ffn_gate_shexp.weight", G_SHARED, PLAN_S_STAGE, Z_S, Z_0, {Z_S, Z_D}},
	{"ffn_up_shexp.weight", G_SHARED, PLAN_S_STAGE, Z_S, Z_0, {Z_S, Z_D}},
	{"ffn_down_shexp.weight", G_SHARED, PLAN_S_STAGE, Z_S, Z_1, {Z_D, Z_S}},
};

typedef struct gg_ctx {
	plan_model *m;
	const gguf_file *g;
	const gg_rule *rules;
	size_t n_rules;
	int64_t by_type[KB_DTYPE_COUNT]; /* bytes loaded per dtype */
	ds_err *err;
} gg_ctx;

/* 1 when layer L loads rule r, 0 when it does not; -1 when it may (used
 * if present). */
static int rule_used(const gg_ctx *x, const gg_rule *r, int L)
{
	const plan_mcfg *c = &x->m->c;
	const int moe = plan_layer_is_moe(c, L);
	char kv[64], kb[64];
	switch (r->when) {
	case G_ALWAYS: return 1;
	case G_QLORA: return c->q_lora > 0;
	case G_NO_QLORA: return c->q_lora == 0;
	case G_DENSE: return !moe;
	case G_MOE: return moe;
	case G_BIAS: return moe && c->score_bias ? -1 : 0; /* optional, as in llama.cpp */
	case G_SHARED: return moe && c->n_shared > 0;
	case G_KV_WHOLE:
	case G_KV_SPLIT: /* deepseek.c load_gguf_kv_b: attn_kv_b when present or when the split is absent */
		snprintf(kv, sizeof kv, "blk.%d.attn_kv_b.weight", L);
		snprintf(kb, sizeof kb, "blk.%d.attn_k_b.weight", L);
		return (gguf_find_tensor(x->g, kv) || !gguf_find_tensor(x->g, kb)) == (r->when == G_KV_WHOLE);
	default: return 0;
	}
}

/* Tensor `name` as the engine loads it: present, of the shape dims (Z_*),
 * of a type the kernels have. */
static int gg_check(gg_ctx *x, const char *name, const unsigned char *dims, int nd,
		    const gguf_tensor **out)
{
	const gguf_tensor *t = gguf_find_tensor(x->g, name);
	const char *path = gguf_path(x->g);
	*out = t;
	if (!t)
		return ds_err_set(x->err, DS_EFORMAT, "%s: tensor %s is missing", path, name);
	int same = t->n_dims == nd;
	for (int i = 0; same && i < nd; i++)
		same = t->shape[i] == zsize(&x->m->c, dims[i]);
	if (!same) {
		char want[96] = "", have[96] = "";
		size_t a = 0, b = 0;
		for (int i = 0; i < nd && a < sizeof want; i++)
			a += (size_t)snprintf(want + a, sizeof want - a, "%s%lld", i ? " x " : "",
					      (long long)zsize(&x->m->c, dims[i]));
		for (int i = 0; i < t->n_dims && b < sizeof have; i++)
			b += (size_t)snprintf(have + b, sizeof have - b, "%s%lld", i ? " x " : "",
					      (long long)t->shape[i]);
		return ds_err_set(x->err, DS_EFORMAT, "%s: tensor %s is [%s], the model's sizes "
				  "make it [%s]", path, name, have, want);
	}
	if (t->dtype == GGUF_DTYPE_NONE)
		return ds_err_set(x->err, DS_EUNSUPPORTED, "%s: tensor %s is %s, a type the "
				  "engine's kernels do not have", path, name, t->type_name);
	return DS_OK;
}

/* Adds t (rule fields filled) with the bytes of gguf tensor g; a stacked
 * expert tensor becomes one entry per expert. */
static int gg_add(gg_ctx *x, plan_tensor *t, const gguf_tensor *g)
{
	t->block = kb_dtype_block(g->dtype);
	if (t->where != PLAN_T_SKIP && t->where != PLAN_T_LAST_OWN && g->dtype < KB_DTYPE_COUNT)
		x->by_type[g->dtype] += (int64_t)g->nbytes;
	if (t->split != PLAN_S_EXPERT || t->where == PLAN_T_SKIP) {
		t->bytes = (int64_t)g->nbytes;
		return add_tensor(x->m, t);
	}
	const int64_t E = g->shape[0];
	t->bytes = (int64_t)g->nbytes / E; /* whole rows of whole blocks: exact */
	for (int64_t e = 0; e < E; e++) {
		t->expert = (int)e;
		int rc = add_tensor(x->m, t);
		if (rc)
			return rc;
	}
	return DS_OK;
}

/* Every tensor of the file, in file order: checked and listed with its rule. */
static int gg_tensors(gg_ctx *x)
{
	const plan_mcfg *c = &x->m->c;
	const char *path = gguf_path(x->g);
	const unsigned char dv[2] = {Z_V, Z_D}, dd[1] = {Z_D};
	const gguf_tensor *g;
	char name[160];
	int rc;
	/* what the engine requires, with the messages it would give */
	if ((rc = gg_check(x, "token_embd.weight", dv, 2, &g)) ||
	    (rc = gg_check(x, "output_norm.weight", dd, 1, &g)))
		return rc;
	if (gguf_find_tensor(x->g, "output.weight") || !c->tied)
		if ((rc = gg_check(x, "output.weight", dv, 2, &g)))
			return rc;
	for (int L = 0; L < c->layers; L++) {
		for (size_t i = 0; i < x->n_rules; i++) {
			const gg_rule *r = &x->rules[i];
			int nd = r->dims[2] ? 3 : r->dims[1] ? 2 : 1;
			snprintf(name, sizeof name, "blk.%d.%s", L, r->name);
			int use = rule_used(x, r, L);
			if (use == 0 || (use < 0 && !gguf_find_tensor(x->g, name)))
				continue;
			if (r->split == PLAN_S_EXPERT && !gguf_find_tensor(x->g, name) &&
			    strcmp(r->name, "ffn_gate_exps.weight") == 0) {
				snprintf(name, sizeof name, "blk.%d.ffn_gate_up_exps.weight", L);
				if (gguf_find_tensor(x->g, name))
					return ds_err_set(x->err, DS_EUNSUPPORTED, "%s: tensor %s (gate and up "
							  "experts fused) is not supported; separate "
							  "ffn_gate_exps / ffn_up_exps are", path, name);
				snprintf(name, sizeof name, "blk.%d.%s", L, r->name);
			}
			if ((rc = gg_check(x, name, r->dims, nd, &g)))
				return rc;
		}
	}
	for (size_t i = 0; i < gguf_tensor_count(x->g); i++) {
		g = gguf_tensor_at(x->g, i);
		plan_tensor t;
		memset(&t, 0, sizeof t);
		t.where = PLAN_T_ALL; /* a name of neither table: whole on every rank (conservative) */
		t.layer = t.expert = -1;
		if (strcmp(g->name, "token_embd.weight") == 0) {
			t.where = PLAN_T_FIRST;
		} else if (strcmp(g->name, "output_norm.weight") == 0) {
			t.where = PLAN_T_LAST;
		} else if (strcmp(g->name, "output.weight") == 0) {
			t.where = PLAN_T_LAST;
			t.split = PLAN_S_STAGE;
			t.n = c->vocab;
		} else if (strncmp(g->name, "blk.", 4) == 0) {
			char *end = NULL;
			long L = strtol(g->name + 4, &end, 10);
			if (end != g->name + 4 && *end == '.' && L >= 0) {
				const gg_rule *r = NULL;
				for (size_t k = 0; k < x->n_rules && !r; k++)
					if (strcmp(end + 1, x->rules[k].name) == 0)
						r = &x->rules[k];
				t.where = PLAN_T_LAYER;
				t.layer = (int)(L < c->layers ? L : -1);
				if (L >= c->layers || (r && rule_used(x, r, (int)L) == 0)) {
					t.where = PLAN_T_SKIP; /* MTP layers, the kv_b form not used */
				} else if (r) {
					t.split = r->split;
					t.n = zsize(c, r->by);
					t.col_unit = zsize(c, r->col);
					t.rows = zsize(c, r->dims[r->dims[2] ? 1 : 0]);
				}
			}
		}
		if (t.where != PLAN_T_SKIP && g->dtype == GGUF_DTYPE_NONE)
			return ds_err_set(x->err, DS_EUNSUPPORTED, "%s: tensor %s is %s, a type the "
					  "engine's kernels do not have", path, g->name, g->type_name);
		if ((rc = gg_add(x, &t, g)))
			return rc;
	}
	if (c->tied) { /* llama.c: the last stage's own rows of the embedding, unless it is stage 0 */
		plan_tensor t = {.where = PLAN_T_LAST_OWN, .split = PLAN_S_STAGE, .n = c->vocab,
				 .layer = -1, .expert = -1};
		if ((rc = gg_add(x, &t, gguf_find_tensor(x->g, "token_embd.weight"))))
			return rc;
	}
	return DS_OK;
}

static int gg_count(const gguf_file *g, const char *key, int required, int64_t lo, int64_t hi,
		    int *out, ds_err *err)
{
	int64_t v;
	if (gguf_find_key(g, key) < 0)
		return required ? ds_err_set(err, DS_EFORMAT, "%s: metadata key %s is missing",
					     gguf_path(g), key) : DS_OK;
	int rc = gguf_get_int(g, key, lo, hi, &v, err);
	if (rc)
		return rc;
	*out = (int)v;
	return DS_OK;
}

/* llama.* metadata, read as llama.c cfg_from_gguf reads it. */
static int llama_config(const gguf_file *g, plan_mcfg *c, ds_err *err)
{
	const char *path = gguf_path(g);
	int rc, rope_dim;
	c->arch = PLAN_ARCH_LLAMA;
	if ((rc = gg_count(g, "llama.embedding_length", 1, 1, 1 << 20, &c->hidden, err)) ||
	    (rc = gg_count(g, "llama.block_count", 1, 1, 4096, &c->layers, err)) ||
	    (rc = gg_count(g, "llama.feed_forward_length", 1, 1, 1 << 22, &c->inter, err)) ||
	    (rc = gg_count(g, "llama.attention.head_count", 1, 1, 4096, &c->heads, err)))
		return rc;
	c->kv_heads = c->heads;
	c->head_dim = c->hidden / c->heads;
	c->max_pos = 4096;
	if ((rc = gg_count(g, "llama.attention.head_count_kv", 0, 1, 4096, &c->kv_heads, err)) ||
	    (rc = gg_count(g, "llama.attention.key_length", 0, 1, 1024, &c->head_dim, err)) ||
	    (rc = gg_count(g, "llama.context_length", 0, 1, 1 << 24, &c->max_pos, err)))
		return rc;
	rope_dim = c->head_dim;
	if ((rc = gg_count(g, "llama.rope.dimension_count", 0, 1, 1024, &rope_dim, err)))
		return rc;
	if (c->head_dim < 1 || c->head_dim % 2)
		return ds_err_set(err, DS_EFORMAT, "%s: head size %d (llama.attention.key_length, "
				  "else embedding_length / head_count) must be even and >= 2",
				  path, c->head_dim);
	if (rope_dim != c->head_dim)
		return ds_err_set(err, DS_EUNSUPPORTED, "%s: llama.rope.dimension_count %d differs "
				  "from the head size %d", path, rope_dim, c->head_dim);
	if (c->heads % c->kv_heads)
		return ds_err_set(err, DS_EFORMAT, "%s: %d attention heads do not divide into %d kv "
				  "heads", path, c->heads, c->kv_heads);
	if (gguf_find_tensor(g, "rope_freqs.weight"))
		return ds_err_set(err, DS_EUNSUPPORTED, "%s: per-frequency rope factors "
				  "(rope_freqs.weight) are not supported", path);
	const gguf_tensor *emb = gguf_find_tensor(g, "token_embd.weight");
	if (!emb || emb->n_dims != 2 || emb->shape[0] < 1 || emb->shape[0] > (1 << 24))
		return ds_err_set(err, DS_EFORMAT, "%s: token_embd.weight is missing or not 2-D",
				  path);
	c->vocab = (int)emb->shape[0];
	c->tied = gguf_find_tensor(g, "output.weight") == NULL;
	return DS_OK;
}

/* deepseek2.* metadata through the engine's own reader (mcfg_from_gguf). */
static int mla_config(const gguf_file *g, plan_mcfg *c, ds_err *err)
{
	mcfg mc;
	int rc = mcfg_from_gguf(g, &mc, err);
	if (rc)
		return rc;
	c->arch = PLAN_ARCH_MLA;
	c->hidden = mc.hidden_size;
	c->layers = mc.num_hidden_layers;
	c->heads = mc.num_attention_heads;
	c->vocab = mc.vocab_size;
	c->inter = mc.intermediate_size;
	c->kv_lora = mc.kv_lora_rank;
	c->rope = mc.qk_rope_head_dim;
	c->nope = mc.qk_nope_head_dim;
	c->v_dim = mc.v_head_dim;
	c->q_lora = mc.q_lora_rank;
	c->experts = mc.n_routed_experts;
	c->moe_inter = mc.moe_intermediate_size;
	c->n_shared = mc.n_shared_experts;
	c->top_k = mc.num_experts_per_tok;
	c->first_dense = mc.first_k_dense_replace;
	c->moe_freq = mc.moe_layer_freq;
	c->max_pos = mc.max_position_embeddings;
	c->score_bias = mc.topk_method == MCFG_TOPK_NOAUX_TC;
	return DS_OK;
}

/* A GGUF file: the engine's graph from general.architecture (engine/model.c:
 * deepseek2 -> deepseek.c, llama -> llama.c, which refuses the rest). */
static int load_gguf(const char *path, plan_model *m, ds_err *err)
{
	gg_ctx x = {.m = m, .err = err};
	const char *arch = NULL;
	int rc, top = 0;
	gguf_file *g = gguf_open(path, err);
	if (!g)
		return err && err->code ? err->code : DS_EIO;
	x.g = g;
	if ((rc = gguf_get_str(x.g, "general.architecture", &arch, NULL, err)))
		goto out;
	if (strcmp(arch, "deepseek2") == 0) {
		rc = mla_config(x.g, &m->c, err);
		x.rules = mla_layer;
		x.n_rules = sizeof mla_layer / sizeof mla_layer[0];
	} else if (strcmp(arch, "llama") == 0) {
		rc = llama_config(x.g, &m->c, err);
		x.rules = llama_layer;
		x.n_rules = sizeof llama_layer / sizeof llama_layer[0];
	} else {
		rc = ds_err_set(err, DS_EUNSUPPORTED, "%s: general.architecture \"%.64s\": the engine "
				"runs GGUF files of llama and deepseek2 only", path, arch);
	}
	if (rc)
		goto out;
	ds_strlcpy(m->c.model_type, arch, sizeof m->c.model_type);
	m->source = PLAN_SRC_GGUF;
	if ((rc = gg_tensors(&x)))
		goto out;
	for (int i = 1; i < KB_DTYPE_COUNT; i++)
		if (x.by_type[i] > x.by_type[top])
			top = i;
	ds_strlcpy(m->dtype, gguf_ggml_type_name((uint32_t)gguf_dtype_to_ggml((enum kb_dtype)top)),
		   sizeof m->dtype);
out:
	if (rc == DS_ENOMEM)
		ds_err_set(err, DS_ENOMEM, "model %s: out of memory", path);
	gguf_close(g);
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

const char *plan_source_name(int source)
{
	return source == PLAN_SRC_GGUF ? "GGUF tensor infos"
	       : source == PLAN_SRC_SAFETENSORS ? "safetensors headers"
						: "config.json arithmetic (no weight files)";
}

int plan_model_load(const char *path, plan_model *m, ds_err *err)
{
	int rc;
	memset(m, 0, sizeof *m);
	size_t l = strlen(path);
	if (l > 5 && strcmp(path + l - 5, ".gguf") == 0) { /* as engine/source.c tells them */
		if ((rc = load_gguf(path, m, err)) != DS_OK)
			plan_model_free(m);
		return rc;
	}
	FILE *f = fopen(path, "rb");
	if (f) {
		char magic[4] = {0};
		size_t got = fread(magic, 1, 4, f);
		fclose(f);
		if (got == 4 && memcmp(magic, "GGUF", 4) == 0)
			return ds_err_set(err, DS_EINVAL, "%s: a GGUF file without the .gguf suffix, "
					  "by which the engine tells a GGUF file from a checkpoint "
					  "directory", path);
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
		m->source = PLAN_SRC_SAFETENSORS;
		if (m->files_fp8)
			m->c.fp8 = 1;
	} else {
		m->n = 0;
		m->total_bytes = 0;
		if ((rc = tensors_from_config(m)) != DS_OK)
			goto fail;
	}
	ds_strlcpy(m->dtype, m->c.fp8 ? "fp8" : m->c.elem_bytes == 4 ? "f32" : "bf16", sizeof m->dtype);
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

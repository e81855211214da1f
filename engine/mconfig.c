/*
 * mconfig.c - parse and validate a DeepSeek config.json (see mconfig.h).
 *
 * Called by the model loader, dsrun and tests; calls jansson and common/.
 * Pure functions, no state: thread-safe.
 *
 * Fields (REQ = must be present and not null; OPT = default when absent or
 * null; NUL = must be present, null means the default).  Integers may be
 * written as JSON reals with an integral value, reals as integers.
 *
 *   model_type             REQ  "deepseek_v3" | "deepseek_v2"; others rejected
 *   vocab_size hidden_size intermediate_size moe_intermediate_size
 *   num_hidden_layers num_attention_heads kv_lora_rank qk_nope_head_dim
 *   v_head_dim max_position_embeddings n_routed_experts num_experts_per_tok
 *   first_k_dense_replace  REQ  positive integers (first_k_dense_replace >= 0)
 *   qk_rope_head_dim       REQ  even, 2 .. MCFG_MAX_ROPE_DIM
 *   num_key_value_heads    OPT  = num_attention_heads; nominal (MLA), not used
 *   q_lora_rank            NUL  null or 0 = plain q_proj
 *   n_shared_experts       OPT  0
 *   n_group / topk_group   OPT  1 / 1; n_group | n_routed_experts, topk_group <= n_group
 *   moe_layer_freq         OPT  1
 *   num_nextn_predict_layers OPT 0
 *   routed_scaling_factor  REQ  > 0
 *   norm_topk_prob         REQ  bool
 *   scoring_func           REQ  "softmax" | "sigmoid"
 *   topk_method            REQ  "greedy" ("gready") | "group_limited_greedy" | "noaux_tc";
 *                               noaux_tc needs sigmoid, the others softmax
 *   hidden_act             OPT  "silu" only
 *   attention_bias         OPT  false only
 *   tie_word_embeddings    OPT  false only
 *   rope_theta             OPT  10000
 *   rms_norm_eps           OPT  1e-6
 *   rope_scaling           OPT  null = plain RoPE; object with type (or rope_type)
 *                               "yarn" ("default" = plain), factor >= 1 REQ,
 *                               original_max_position_embeddings REQ,
 *                               beta_fast 32 > beta_slow 1, mscale 1,
 *                               mscale_all_dim 0 (the remote-code defaults);
 *                               attention_factor and truncate false rejected
 *   quantization_config    OPT  null = no quantization; quant_method "fp8" REQ,
 *                               fmt "e4m3", activation_scheme "dynamic",
 *                               weight_block_size REQ [b, b], scale_fmt null|"ue8m0"
 *   bos_token_id           OPT  int or null
 *   eos_token_id           OPT  int, array of 1..MCFG_MAX_EOS ints, or null
 *   anything else          ignored (training-only and bookkeeping keys)
 *
 * GGUF (mcfg_from_gguf; llama.cpp's "deepseek2" keys, A = "deepseek2."):
 *   A.block_count - A.nextn_predict_layers (0)  num_hidden_layers (MTP layers
 *                                    are counted in block_count when the key is set)
 *   A.context_length                 max_position_embeddings          REQ
 *   A.embedding_length               hidden_size                      REQ
 *   A.feed_forward_length            intermediate_size                REQ
 *   A.attention.head_count           num_attention_heads              REQ
 *   A.attention.head_count_kv        num_key_value_heads (nominal; 1 in MLA files)
 *   A.attention.q_lora_rank          q_lora_rank (absent or 0: attn_q)
 *   A.attention.kv_lora_rank         kv_lora_rank                     REQ
 *   A.rope.dimension_count           qk_rope_head_dim                 REQ
 *   A.attention.key_length_mla       qk_nope_head_dim + qk_rope_head_dim; when
 *   A.attention.value_length_mla     v_head_dim      absent (files without the
 *                                    split attn_k_b/attn_v_b): key_length and
 *                                    value_length, which then hold the same;
 *                                    with them key_length = kv_lora + rope (MQA
 *                                    view of the latent cache) and is not used
 *   A.expert_feed_forward_length     moe_intermediate_size            REQ
 *   A.expert_count / expert_used_count  n_routed_experts / num_experts_per_tok REQ
 *   A.expert_shared_count            n_shared_experts (0)
 *   A.expert_group_count / _used_count  n_group / topk_group (1 / 1)
 *   A.leading_dense_block_count      first_k_dense_replace (0)
 *   A.expert_weights_scale           routed_scaling_factor (1)
 *   A.expert_weights_norm            norm_topk_prob (false)
 *   A.expert_gating_func             1 softmax (also when absent, as llama.cpp
 *                                    reads old V2 files), 2 sigmoid; scoring
 *                                    sigmoid -> topk_method noaux_tc, softmax
 *                                    -> greedy, or group_limited_greedy when
 *                                    topk_group < n_group
 *   A.rope.freq_base                 rope_theta (10000)
 *   A.attention.layer_norm_rms_epsilon  rms_norm_eps (1e-6)
 *   A.rope.scaling.type              absent/"none" plain, "yarn"; with yarn:
 *     .factor, .original_context_length REQ; .yarn_beta_fast/_slow (32 / 1);
 *     .yarn_log_multiplier = 0.1 * mscale_all_dim (the converter's factor,
 *     which llama.cpp divides out again): mscale_all_dim = value / 0.1 and
 *     mscale = mscale_all_dim (the file has no mscale; llama.cpp's cos/sin
 *     amplitude is 1, which is m(F, mscale) / m(F, mscale_all_dim) with the
 *     two equal, as in every released DeepSeek config).  Absent: the remote
 *     code's defaults mscale 1, mscale_all_dim 0.  .yarn_attn_factor (any
 *     value) and .yarn_ext_factor other than 1 are rejected.
 *   A.vocab_size                     vocab_size (else the length of
 *                                    tokenizer.ggml.tokens, else token_embd rows)
 *   tokenizer.ggml.bos_token_id      bos_token_id
 *   tokenizer.ggml.eos/eot/eom_token_id  eos_token_id list (duplicates once)
 * No FP8 (GGUF has none), moe_layer_freq 1, silu, no biases, untied head.
 *
 * Derived (§1.2/§5 of the DeepSeek spec): m(F, mu) = 1 if F <= 1 else
 * 0.1 mu ln F + 1; softmax_scale = qk_head_dim^-0.5 m(F, mscale_all_dim)^2;
 * rope_amp = m(F, mscale) / m(F, mscale_all_dim); YaRN ramp bounds from
 * original_max_position_embeddings (never max_position_embeddings).
 */
#include "engine/mconfig.h"

#include "common/fileutil.h"
#include "common/jsonx.h"
#include "engine/gguf.h"
#include "common/strutil.h"

#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define LABEL_MAX 96

enum need { OPT, REQ, NUL };

/* Parsing context: the source name for messages and the error slot. */
typedef struct pctx {
	const char *what;
	ds_err *err;
} pctx;

/* Fails with "<what>: <field> <rule>, got <value>". */
static int fail_value(pctx *p, int code, const char *field, const json_t *v, const char *rule)
{
	char *s = v ? jsonx_dumps(v) : NULL;
	int rc = ds_err_set(p->err, code, "%s: %s %s, got %.64s", p->what, field, rule,
			    s ? s : "nothing");
	free(s);
	return rc;
}

static void label(char *buf, const char *prefix, const char *key)
{
	snprintf(buf, LABEL_MAX, "%s%s", prefix, key);
}

/* Looks key up; returns 1 when absent or null (after checking `need`), 0 when
 * *v holds a value, or a negative error. */
static int lookup(pctx *p, const json_t *obj, const char *field, const char *key, enum need need,
		  json_t **v)
{
	*v = json_object_get(obj, key);
	if (*v && !json_is_null(*v))
		return 0;
	if (need == REQ || (need == NUL && !*v))
		return ds_err_set(p->err, DS_EINVAL, "%s: %s is required", p->what, field);
	return 1;
}

static int get_int(pctx *p, const json_t *obj, const char *prefix, const char *key, enum need need,
		   int64_t min, int64_t max, int def, int *out)
{
	char field[LABEL_MAX], rule[96];
	json_t *v;
	label(field, prefix, key);
	int rc = lookup(p, obj, field, key, need, &v);
	if (rc) {
		*out = def;
		return rc < 0 ? rc : DS_OK;
	}
	double d = json_is_integer(v) ? (double)json_integer_value(v)
		   : json_is_real(v)  ? json_real_value(v) : NAN;
	snprintf(rule, sizeof rule, "must be an integer in [%lld, %lld]", (long long)min,
		 (long long)max);
	if (!json_is_number(v))
		return fail_value(p, DS_EFORMAT, field, v, rule);
	if (!(d >= (double)min && d <= (double)max && floor(d) == d))
		return fail_value(p, DS_EINVAL, field, v, rule);
	*out = (int)d;
	return DS_OK;
}

/* A finite number in (min, max] (or [min, max] when min_incl). */
static int get_num(pctx *p, const json_t *obj, const char *prefix, const char *key, enum need need,
		   double min, int min_incl, double max, double def, double *out)
{
	char field[LABEL_MAX], rule[96];
	json_t *v;
	label(field, prefix, key);
	int rc = lookup(p, obj, field, key, need, &v);
	if (rc) {
		*out = def;
		return rc < 0 ? rc : DS_OK;
	}
	snprintf(rule, sizeof rule, "must be a number in %c%g, %g]", min_incl ? '[' : '(', min,
		 max);
	if (!json_is_number(v))
		return fail_value(p, DS_EFORMAT, field, v, rule);
	double d = json_number_value(v);
	if (!((d > min || (min_incl && d == min)) && d <= max))
		return fail_value(p, DS_EINVAL, field, v, rule);
	*out = d;
	return DS_OK;
}

static int get_bool(pctx *p, const json_t *obj, const char *key, enum need need, int def, int *out)
{
	json_t *v;
	int rc = lookup(p, obj, key, key, need, &v);
	if (rc) {
		*out = def;
		return rc < 0 ? rc : DS_OK;
	}
	if (!json_is_boolean(v))
		return fail_value(p, DS_EFORMAT, key, v, "must be true or false");
	*out = json_is_true(v);
	return DS_OK;
}

typedef struct name_val {
	const char *name;
	int val;
} name_val;

/* A string from a fixed set; `choices` is the text shown when it is not. */
static int get_enum(pctx *p, const json_t *obj, const char *prefix, const char *key, enum need need,
		    const name_val *tab, int def, const char *choices, int *out)
{
	char field[LABEL_MAX];
	json_t *v;
	label(field, prefix, key);
	int rc = lookup(p, obj, field, key, need, &v);
	if (rc) {
		*out = def;
		return rc < 0 ? rc : DS_OK;
	}
	if (!json_is_string(v))
		return fail_value(p, DS_EFORMAT, field, v, "must be a string");
	for (; tab->name; tab++) {
		if (strcmp(tab->name, json_string_value(v)) == 0) {
			*out = tab->val;
			return DS_OK;
		}
	}
	return ds_err_set(p->err, DS_EUNSUPPORTED, "%s: %s \"%.64s\" is not supported (%s)",
			  p->what, field, json_string_value(v), choices);
}

/* ---- field tables ---- */

typedef struct int_field {
	const char *key;
	size_t off;
	enum need need;
	int64_t min, max;
	int def;
} int_field;

#define IF(k, n, lo, hi, d) {#k, offsetof(mcfg, k), n, lo, hi, d}
static const int_field int_fields[] = {
	IF(vocab_size, REQ, 1, 1 << 24, 0),
	IF(hidden_size, REQ, 1, 1 << 20, 0),
	IF(intermediate_size, REQ, 1, 1 << 22, 0),
	IF(moe_intermediate_size, REQ, 1, 1 << 22, 0),
	IF(num_hidden_layers, REQ, 1, 4096, 0),
	IF(num_attention_heads, REQ, 1, 4096, 0),
	IF(num_key_value_heads, OPT, 1, 4096, 0),
	IF(q_lora_rank, NUL, 0, 1 << 20, 0),
	IF(kv_lora_rank, REQ, 1, 1 << 20, 0),
	IF(qk_nope_head_dim, REQ, 1, 4096, 0),
	IF(qk_rope_head_dim, REQ, 2, MCFG_MAX_ROPE_DIM, 0),
	IF(v_head_dim, REQ, 1, 4096, 0),
	IF(n_routed_experts, REQ, 1, 1 << 16, 0),
	IF(n_shared_experts, OPT, 0, 1 << 16, 0),
	IF(num_experts_per_tok, REQ, 1, 1 << 16, 0),
	IF(n_group, OPT, 1, 1 << 16, 1),
	IF(topk_group, OPT, 1, 1 << 16, 1),
	IF(first_k_dense_replace, REQ, 0, 4096, 0),
	IF(moe_layer_freq, OPT, 1, 4096, 1),
	IF(max_position_embeddings, REQ, 1, 1 << 30, 0),
	IF(num_nextn_predict_layers, OPT, 0, 64, 0),
	IF(bos_token_id, OPT, 0, INT32_MAX, -1),
};
#undef IF

typedef struct num_field {
	const char *key;
	size_t off;
	enum need need;
	double min_excl, max, def; /* range (min_excl, max] */
} num_field;

static const num_field num_fields[] = {
	{"routed_scaling_factor", offsetof(mcfg, routed_scaling_factor), REQ, 0, 1e6, 1},
	{"rope_theta", offsetof(mcfg, rope_theta), OPT, 0, 1e12, 10000},
	{"rms_norm_eps", offsetof(mcfg, rms_norm_eps), OPT, 0, 1, 1e-6},
};

static const name_val arch_names[] = {
	{"deepseek_v3", MCFG_ARCH_DEEPSEEK_V3}, {"deepseek_v2", MCFG_ARCH_DEEPSEEK_V2}, {NULL, 0}};
static const name_val scoring_names[] = {
	{"softmax", MCFG_SCORING_SOFTMAX}, {"sigmoid", MCFG_SCORING_SIGMOID}, {NULL, 0}};
static const name_val topk_names[] = {
	{"greedy", MCFG_TOPK_GREEDY},
	{"gready", MCFG_TOPK_GREEDY}, /* spelling of some V2 remote-code revisions */
	{"group_limited_greedy", MCFG_TOPK_GROUP_LIMITED_GREEDY},
	{"noaux_tc", MCFG_TOPK_NOAUX_TC},
	{NULL, 0}};
static const name_val act_names[] = {{"silu", 1}, {NULL, 0}};

/* ---- sections ---- */

static int parse_scalars(pctx *p, const json_t *root, mcfg *c)
{
	int rc = DS_OK;
	for (size_t i = 0; !rc && i < sizeof int_fields / sizeof int_fields[0]; i++) {
		const int_field *f = &int_fields[i];
		rc = get_int(p, root, "", f->key, f->need, f->min, f->max, f->def,
			     (int *)((char *)c + f->off));
	}
	for (size_t i = 0; !rc && i < sizeof num_fields / sizeof num_fields[0]; i++) {
		const num_field *f = &num_fields[i];
		rc = get_num(p, root, "", f->key, f->need, f->min_excl, 0, f->max, f->def,
			     (double *)((char *)c + f->off));
	}
	if (!rc && c->num_key_value_heads == 0)
		c->num_key_value_heads = c->num_attention_heads;
	return rc;
}

static int parse_choices(pctx *p, const json_t *root, mcfg *c)
{
	int act, scoring, topk, bias, tie;
	int rc = get_enum(p, root, "", "hidden_act", OPT, act_names, 1, "only \"silu\"", &act);
	if (!rc)
		rc = get_enum(p, root, "", "scoring_func", REQ, scoring_names, 0,
			      "one of \"softmax\", \"sigmoid\"", &scoring);
	if (!rc)
		rc = get_enum(p, root, "", "topk_method", REQ, topk_names, 0,
			      "one of \"greedy\", \"group_limited_greedy\", \"noaux_tc\"", &topk);
	if (!rc)
		rc = get_bool(p, root, "norm_topk_prob", REQ, 0, &c->norm_topk_prob);
	if (!rc)
		rc = get_bool(p, root, "attention_bias", OPT, 0, &bias);
	if (!rc)
		rc = get_bool(p, root, "tie_word_embeddings", OPT, 0, &tie);
	if (rc)
		return rc;
	if (bias)
		return ds_err_set(p->err, DS_EUNSUPPORTED,
				  "%s: attention_bias true is not supported (DeepSeek attention "
				  "projections have no bias)", p->what);
	if (tie)
		return ds_err_set(p->err, DS_EUNSUPPORTED,
				  "%s: tie_word_embeddings true is not supported (DeepSeek "
				  "checkpoints carry a separate lm_head.weight)", p->what);
	c->scoring = (enum mcfg_scoring)scoring;
	c->topk_method = (enum mcfg_topk)topk;
	return DS_OK;
}

/* Rejects a key this parser cannot honour when it holds a non-default value. */
static int refuse_key(pctx *p, const json_t *obj, const char *field, const char *key,
		      const char *why)
{
	json_t *v = json_object_get(obj, key);
	if (!v || json_is_null(v))
		return DS_OK;
	return fail_value(p, DS_EUNSUPPORTED, field, v, why);
}

static int parse_yarn(pctx *p, const json_t *rs, mcfg *c)
{
	const char *pre = "rope_scaling.";
	int rc = get_num(p, rs, pre, "factor", REQ, 1, 1, 1e6, 1, &c->rope_factor);
	if (!rc)
		rc = get_int(p, rs, pre, "original_max_position_embeddings", REQ, 1, 1 << 30, 0,
			     &c->rope_original_max_position);
	if (!rc)
		rc = get_num(p, rs, pre, "beta_fast", OPT, 0, 0, 1e6, 32, &c->rope_beta_fast);
	if (!rc)
		rc = get_num(p, rs, pre, "beta_slow", OPT, 0, 0, 1e6, 1, &c->rope_beta_slow);
	if (!rc)
		rc = get_num(p, rs, pre, "mscale", OPT, 0, 1, 1e6, 1, &c->rope_mscale);
	if (!rc)
		rc = get_num(p, rs, pre, "mscale_all_dim", OPT, 0, 1, 1e6, 0,
			     &c->rope_mscale_all_dim);
	if (!rc)
		rc = refuse_key(p, rs, "rope_scaling.attention_factor", "attention_factor",
				"is not supported (DeepSeek uses mscale / mscale_all_dim)");
	if (!rc && json_is_false(json_object_get(rs, "truncate")))
		rc = fail_value(p, DS_EUNSUPPORTED, "rope_scaling.truncate",
				json_object_get(rs, "truncate"), "must be true (DeepSeek rounds "
				"the ramp bounds)");
	if (!rc && !(c->rope_beta_fast > c->rope_beta_slow))
		rc = ds_err_set(p->err, DS_EINVAL, "%s: rope_scaling.beta_fast (%g) must be "
				"greater than beta_slow (%g)", p->what, c->rope_beta_fast,
				c->rope_beta_slow);
	return rc;
}

static int parse_rope(pctx *p, const json_t *root, mcfg *c)
{
	static const name_val types[] = {{"yarn", MCFG_ROPE_YARN}, {"default", MCFG_ROPE_PLAIN},
					 {NULL, 0}};
	const json_t *rs = json_object_get(root, "rope_scaling");
	c->rope_type = MCFG_ROPE_PLAIN;
	c->rope_factor = 1;
	if (!rs || json_is_null(rs))
		return DS_OK;
	if (!json_is_object(rs))
		return fail_value(p, DS_EFORMAT, "rope_scaling", rs, "must be an object or null");
	/* "type" in the DeepSeek configs, "rope_type" in newer transformers */
	const char *key = !json_object_get(rs, "type") && json_object_get(rs, "rope_type")
				  ? "rope_type" : "type";
	int type;
	int rc = get_enum(p, rs, "rope_scaling.", key, REQ, types, 0, "only \"yarn\"", &type);
	if (rc || type == MCFG_ROPE_PLAIN)
		return rc;
	c->rope_type = MCFG_ROPE_YARN;
	return parse_yarn(p, rs, c);
}

static int parse_block_size(pctx *p, const json_t *q, mcfg *c)
{
	const char *field = "quantization_config.weight_block_size";
	const char *rule = "must be 2 equal positive integers";
	json_t *v = json_object_get(q, "weight_block_size");
	if (!v || json_is_null(v))
		return ds_err_set(p->err, DS_EINVAL, "%s: %s is required", p->what, field);
	const json_t *a = json_array_get(v, 0), *b = json_array_get(v, 1);
	if (!json_is_array(v) || json_array_size(v) != 2 || !json_is_integer(a) ||
	    !json_is_integer(b))
		return fail_value(p, DS_EFORMAT, field, v, rule);
	json_int_t n = json_integer_value(a), k = json_integer_value(b);
	if (n != k || n <= 0 || n > (1 << 20))
		return fail_value(p, DS_EINVAL, field, v, rule);
	c->fp8_block_n = c->fp8_block_k = (int)n;
	return DS_OK;
}

static int parse_quant(pctx *p, const json_t *root, mcfg *c)
{
	static const name_val method[] = {{"fp8", 1}, {NULL, 0}};
	static const name_val fmt[] = {{"e4m3", 1}, {NULL, 0}};
	static const name_val scheme[] = {{"dynamic", 1}, {NULL, 0}};
	static const name_val scale_fmt[] = {{"ue8m0", 1}, {NULL, 0}};
	const char *pre = "quantization_config.";
	const json_t *q = json_object_get(root, "quantization_config");
	if (!q || json_is_null(q))
		return DS_OK;
	if (!json_is_object(q))
		return fail_value(p, DS_EFORMAT, "quantization_config", q,
				  "must be an object or null");
	int x;
	int rc = get_enum(p, q, pre, "quant_method", REQ, method, 0, "only \"fp8\"", &x);
	if (!rc)
		rc = get_enum(p, q, pre, "fmt", OPT, fmt, 1, "only \"e4m3\"", &x);
	if (!rc)
		rc = get_enum(p, q, pre, "activation_scheme", OPT, scheme, 1, "only \"dynamic\"",
			      &x);
	if (!rc)
		rc = get_enum(p, q, pre, "scale_fmt", OPT, scale_fmt, 0, "only \"ue8m0\" or null",
			      &c->fp8_scale_ue8m0);
	if (!rc)
		rc = parse_block_size(p, q, c);
	c->fp8 = rc == DS_OK;
	return rc;
}

static int parse_eos(pctx *p, const json_t *root, mcfg *c)
{
	const char *rule = "must be a token id or an array of 1 to 8 token ids";
	json_t *v = json_object_get(root, "eos_token_id");
	c->n_eos = 0;
	if (!v || json_is_null(v))
		return DS_OK;
	if (json_is_number(v)) {
		c->n_eos = 1;
		return get_int(p, root, "", "eos_token_id", OPT, 0, INT32_MAX, 0,
			       &c->eos_token_ids[0]);
	}
	if (!json_is_array(v) || json_array_size(v) < 1 || json_array_size(v) > MCFG_MAX_EOS)
		return fail_value(p, DS_EFORMAT, "eos_token_id", v, rule);
	for (size_t i = 0; i < json_array_size(v); i++) {
		const json_t *e = json_array_get(v, i);
		if (!json_is_integer(e) || json_integer_value(e) < 0 ||
		    json_integer_value(e) > INT32_MAX)
			return fail_value(p, DS_EINVAL, "eos_token_id", v, rule);
		c->eos_token_ids[c->n_eos++] = (int)json_integer_value(e);
	}
	return DS_OK;
}

/* ---- consistency ---- */

static int check_moe(pctx *p, const mcfg *c)
{
	int per_group = c->n_routed_experts / c->n_group;
	int grouped = c->topk_method != MCFG_TOPK_GREEDY;
	if (c->num_experts_per_tok > c->n_routed_experts)
		return ds_err_set(p->err, DS_EINVAL,
				  "%s: num_experts_per_tok %d exceeds n_routed_experts %d", p->what,
				  c->num_experts_per_tok, c->n_routed_experts);
	if (c->n_routed_experts % c->n_group != 0)
		return ds_err_set(p->err, DS_EINVAL,
				  "%s: n_group %d must divide n_routed_experts %d", p->what,
				  c->n_group, c->n_routed_experts);
	if (c->topk_group > c->n_group)
		return ds_err_set(p->err, DS_EINVAL, "%s: topk_group %d exceeds n_group %d",
				  p->what, c->topk_group, c->n_group);
	if (c->topk_method == MCFG_TOPK_NOAUX_TC && per_group < 2)
		return ds_err_set(p->err, DS_EINVAL,
				  "%s: topk_method \"noaux_tc\" scores a group by its top 2 "
				  "experts; n_routed_experts / n_group = %d", p->what, per_group);
	if (grouped && c->num_experts_per_tok > c->topk_group * per_group)
		return ds_err_set(p->err, DS_EINVAL,
				  "%s: num_experts_per_tok %d exceeds the %d experts of topk_group "
				  "%d groups", p->what, c->num_experts_per_tok,
				  c->topk_group * per_group, c->topk_group);
	if ((c->topk_method == MCFG_TOPK_NOAUX_TC) != (c->scoring == MCFG_SCORING_SIGMOID))
		return ds_err_set(p->err, DS_EUNSUPPORTED,
				  "%s: topk_method \"%s\" with scoring_func \"%s\" is not "
				  "supported (noaux_tc goes with sigmoid, greedy and "
				  "group_limited_greedy with softmax)", p->what,
				  mcfg_topk_name(c->topk_method),
				  mcfg_scoring_name(c->scoring));
	return DS_OK;
}

static int check_layers(pctx *p, const mcfg *c)
{
	if (c->first_k_dense_replace > c->num_hidden_layers)
		return ds_err_set(p->err, DS_EINVAL,
				  "%s: first_k_dense_replace %d exceeds num_hidden_layers %d",
				  p->what, c->first_k_dense_replace, c->num_hidden_layers);
	if (c->qk_rope_head_dim % 2 != 0)
		return ds_err_set(p->err, DS_EINVAL, "%s: qk_rope_head_dim %d must be even",
				  p->what, c->qk_rope_head_dim);
	if (c->bos_token_id >= c->vocab_size)
		return ds_err_set(p->err, DS_EINVAL, "%s: bos_token_id %d is outside vocab_size %d",
				  p->what, c->bos_token_id, c->vocab_size);
	for (int i = 0; i < c->n_eos; i++)
		if (c->eos_token_ids[i] >= c->vocab_size)
			return ds_err_set(p->err, DS_EINVAL,
					  "%s: eos_token_id %d is outside vocab_size %d", p->what,
					  c->eos_token_ids[i], c->vocab_size);
	return DS_OK;
}

/* ---- derived values ---- */

static double yarn_m(double factor, double mscale)
{
	return factor <= 1 ? 1.0 : 0.1 * mscale * log(factor) + 1.0;
}

/* Rotary dimension index whose wavelength spans `rotations` turns over the
 * original context. */
static double yarn_corr_dim(const mcfg *c, double rotations)
{
	double d = c->qk_rope_head_dim;
	return d * log(c->rope_original_max_position / (rotations * 2 * M_PI)) /
	       (2 * log(c->rope_theta));
}

static void derive(mcfg *c)
{
	c->qk_head_dim = c->qk_nope_head_dim + c->qk_rope_head_dim;
	c->shared_intermediate = c->n_shared_experts * c->moe_intermediate_size;
	c->softmax_scale = 1.0 / sqrt((double)c->qk_head_dim);
	c->rope_amp = 1.0;
	c->yarn_low = c->yarn_high = 0;
	if (c->rope_type != MCFG_ROPE_YARN)
		return;
	double m_all = yarn_m(c->rope_factor, c->rope_mscale_all_dim);
	c->softmax_scale *= m_all * m_all;
	c->rope_amp = yarn_m(c->rope_factor, c->rope_mscale) / m_all;
	c->yarn_low = fmax(floor(yarn_corr_dim(c, c->rope_beta_fast)), 0);
	c->yarn_high = fmin(ceil(yarn_corr_dim(c, c->rope_beta_slow)), c->qk_rope_head_dim - 1);
	if (c->yarn_low == c->yarn_high)
		c->yarn_high += 0.001; /* keeps the ramp's division finite */
}

/* ---- public ---- */

int mcfg_from_json(const json_t *root, const char *what, mcfg *out, ds_err *err)
{
	ds_err local = {0};
	if (!err)
		err = &local;
	pctx p = {what, err};
	memset(out, 0, sizeof *out);
	int arch = 0, rc = DS_OK;
	if (!json_is_object(root))
		rc = ds_err_set(err, DS_EFORMAT, "%s: must be a JSON object", what);
	if (!rc)
		rc = get_enum(&p, root, "", "model_type", REQ, arch_names, 0,
			      "supported: deepseek_v3, deepseek_v2", &arch);
	out->arch = (enum mcfg_arch)arch;
	if (!rc)
		rc = parse_scalars(&p, root, out);
	if (!rc)
		rc = parse_choices(&p, root, out);
	if (!rc)
		rc = parse_rope(&p, root, out);
	if (!rc)
		rc = parse_quant(&p, root, out);
	if (!rc)
		rc = parse_eos(&p, root, out);
	if (!rc)
		rc = check_moe(&p, out);
	if (!rc)
		rc = check_layers(&p, out);
	if (!rc)
		derive(out);
	return rc;
}

int mcfg_parse(const char *text, size_t len, const char *what, mcfg *out, ds_err *err)
{
	ds_err local = {0};
	if (!err)
		err = &local;
	memset(out, 0, sizeof *out);
	json_t *root = jsonx_parse(text, len, MCFG_JSON_MAX_DEPTH, err);
	if (!root)
		return ds_err_wrap(err, "%s", what);
	int rc = mcfg_from_json(root, what, out, err);
	json_decref(root);
	return rc;
}

int mcfg_load(const char *path, mcfg *out, ds_err *err)
{
	struct stat st;
	char file[4096];
	int is_dir = stat(path, &st) == 0 && S_ISDIR(st.st_mode);
	if ((size_t)snprintf(file, sizeof file, is_dir ? "%s/config.json" : "%s", path) >=
	    sizeof file)
		return ds_err_set(err, DS_EINVAL, "path too long: %.200s", path);
	char *text = NULL;
	size_t len = 0;
	int rc = ds_file_read_all(file, MCFG_MAX_FILE_BYTES, &text, &len, err);
	if (!rc)
		rc = mcfg_parse(text, len, file, out, err);
	free(text);
	return rc;
}

/* ---- GGUF (llama.cpp's deepseek2 metadata) ---- */

#define GG_KEY_MAX 160

/* An integer key; absent: def (or an error when need == REQ). */
static int gg_int(pctx *p, const gguf_file *g, const char *key, enum need need, int64_t min,
		  int64_t max, int def, int *out)
{
	int64_t v;
	if (gguf_find_key(g, key) < 0) {
		*out = def;
		return need == REQ ? ds_err_set(p->err, DS_EINVAL, "%s: metadata key %s is required",
						p->what, key) : DS_OK;
	}
	int rc = gguf_get_int(g, key, min, max, &v, p->err);
	if (!rc)
		*out = (int)v;
	return rc;
}

/* A number key in (min, max]; absent: def. */
static int gg_num(pctx *p, const gguf_file *g, const char *key, double min, double max, double def,
		  double *out)
{
	double v;
	*out = def;
	if (gguf_find_key(g, key) < 0)
		return DS_OK;
	int rc = gguf_get_float(g, key, &v, p->err);
	if (rc)
		return rc;
	if (!(v > min && v <= max))
		return ds_err_set(p->err, DS_EINVAL, "%s: metadata key %s must be in (%g, %g], got %g",
				  p->what, key, min, max, v);
	*out = v;
	return DS_OK;
}

typedef struct gg_field {
	const char *key; /* after "deepseek2." */
	size_t off;
	enum need need;
	int64_t min, max;
	int def;
} gg_field;

#define GF(k, f, n, lo, hi, d) {k, offsetof(mcfg, f), n, lo, hi, d}
static const gg_field gg_fields[] = {
	GF("block_count", num_hidden_layers, REQ, 1, 4096, 0),
	GF("nextn_predict_layers", num_nextn_predict_layers, OPT, 0, 64, 0),
	GF("context_length", max_position_embeddings, REQ, 1, 1 << 30, 0),
	GF("embedding_length", hidden_size, REQ, 1, 1 << 20, 0),
	GF("feed_forward_length", intermediate_size, REQ, 1, 1 << 22, 0),
	GF("attention.head_count", num_attention_heads, REQ, 1, 4096, 0),
	GF("attention.head_count_kv", num_key_value_heads, OPT, 1, 4096, 0),
	GF("attention.q_lora_rank", q_lora_rank, OPT, 0, 1 << 20, 0),
	GF("attention.kv_lora_rank", kv_lora_rank, REQ, 1, 1 << 20, 0),
	GF("rope.dimension_count", qk_rope_head_dim, REQ, 2, MCFG_MAX_ROPE_DIM, 0),
	GF("expert_feed_forward_length", moe_intermediate_size, REQ, 1, 1 << 22, 0),
	GF("expert_count", n_routed_experts, REQ, 1, 1 << 16, 0),
	GF("expert_used_count", num_experts_per_tok, REQ, 1, 1 << 16, 0),
	GF("expert_shared_count", n_shared_experts, OPT, 0, 1 << 16, 0),
	GF("expert_group_count", n_group, OPT, 1, 1 << 16, 1),
	GF("expert_group_used_count", topk_group, OPT, 1, 1 << 16, 1),
	GF("leading_dense_block_count", first_k_dense_replace, OPT, 0, 4096, 0),
	GF("vocab_size", vocab_size, OPT, 0, 1 << 24, 0),
};
#undef GF

static const char *gkey(char *buf, const char *arch, const char *suffix)
{
	snprintf(buf, GG_KEY_MAX, "%s.%s", arch, suffix);
	return buf;
}

/* Head sizes: the *_mla keys of files with split attn_k_b/attn_v_b, else
 * key_length/value_length (then the per-head sizes themselves). */
static int gg_heads(pctx *p, const gguf_file *g, const char *arch, mcfg *c)
{
	char k1[GG_KEY_MAX], k2[GG_KEY_MAX];
	int qk = 0, vd = 0, rc;
	int mla = gguf_find_key(g, gkey(k1, arch, "attention.key_length_mla")) >= 0 ||
		  gguf_find_key(g, gkey(k2, arch, "attention.value_length_mla")) >= 0;
	gkey(k1, arch, mla ? "attention.key_length_mla" : "attention.key_length");
	gkey(k2, arch, mla ? "attention.value_length_mla" : "attention.value_length");
	if ((rc = gg_int(p, g, k1, REQ, 2, 8192, 0, &qk)) || (rc = gg_int(p, g, k2, REQ, 1, 4096, 0, &vd)))
		return rc;
	if (qk <= c->qk_rope_head_dim)
		return ds_err_set(p->err, DS_EINVAL,
				  "%s: %s %d leaves no non-rotary part beside %s.rope.dimension_count %d",
				  p->what, k1, qk, arch, c->qk_rope_head_dim);
	c->qk_nope_head_dim = qk - c->qk_rope_head_dim;
	c->v_head_dim = vd;
	return DS_OK;
}

static int gg_rope(pctx *p, const gguf_file *g, const char *arch, mcfg *c)
{
	char k[GG_KEY_MAX];
	const char *type = "none";
	int rc;
	c->rope_type = MCFG_ROPE_PLAIN;
	c->rope_factor = 1;
	if ((rc = gg_num(p, g, gkey(k, arch, "rope.freq_base"), 0, 1e12, 10000, &c->rope_theta)))
		return rc;
	if (gguf_find_key(g, gkey(k, arch, "rope.scaling.type")) >= 0 &&
	    (rc = gguf_get_str(g, k, &type, NULL, p->err)))
		return rc;
	if (strcmp(type, "none") == 0)
		return DS_OK;
	if (strcmp(type, "yarn") != 0)
		return ds_err_set(p->err, DS_EUNSUPPORTED, "%s: %s \"%.64s\" is not supported (only "
				  "\"yarn\" or \"none\")", p->what, k, type);
	c->rope_type = MCFG_ROPE_YARN;
	double log_mul = 0, ext = 1;
	if (gguf_find_key(g, gkey(k, arch, "rope.scaling.factor")) < 0)
		return ds_err_set(p->err, DS_EINVAL, "%s: metadata key %s is required with yarn", p->what, k);
	if ((rc = gg_num(p, g, k, 0, 1e6, 1, &c->rope_factor)) ||
	    (rc = gg_int(p, g, gkey(k, arch, "rope.scaling.original_context_length"), REQ, 1, 1 << 30, 0,
			 &c->rope_original_max_position)) ||
	    (rc = gg_num(p, g, gkey(k, arch, "rope.scaling.yarn_beta_fast"), 0, 1e6, 32, &c->rope_beta_fast)) ||
	    (rc = gg_num(p, g, gkey(k, arch, "rope.scaling.yarn_beta_slow"), 0, 1e6, 1, &c->rope_beta_slow)) ||
	    (rc = gg_num(p, g, gkey(k, arch, "rope.scaling.yarn_ext_factor"), -1e6, 1e6, 1, &ext)))
		return rc;
	if (c->rope_factor < 1)
		return ds_err_set(p->err, DS_EINVAL, "%s: %s.rope.scaling.factor must be >= 1, got %g",
				  p->what, arch, c->rope_factor);
	if (ext != 1)
		return ds_err_set(p->err, DS_EUNSUPPORTED, "%s: %s.rope.scaling.yarn_ext_factor %g is not "
				  "supported (DeepSeek's YaRN blends with 1)", p->what, arch, ext);
	if (gguf_find_key(g, gkey(k, arch, "rope.scaling.yarn_attn_factor")) >= 0)
		return ds_err_set(p->err, DS_EUNSUPPORTED, "%s: %s is not supported (DeepSeek scales "
				  "through yarn_log_multiplier)", p->what, k);
	if (!(c->rope_beta_fast > c->rope_beta_slow))
		return ds_err_set(p->err, DS_EINVAL, "%s: yarn_beta_fast (%g) must be greater than "
				  "yarn_beta_slow (%g)", p->what, c->rope_beta_fast, c->rope_beta_slow);
	c->rope_mscale = 1;
	c->rope_mscale_all_dim = 0;
	if (gguf_find_key(g, gkey(k, arch, "rope.scaling.yarn_log_multiplier")) >= 0) {
		if ((rc = gg_num(p, g, k, -1e-300, 1e5, 0, &log_mul)))
			return rc;
		/* the converter stores 0.1 * mscale_all_dim; no mscale is stored and
		 * llama.cpp takes mscale = mscale_all_dim (amplitude 1) */
		c->rope_mscale_all_dim = log_mul / 0.1;
		c->rope_mscale = c->rope_mscale_all_dim;
	}
	return DS_OK;
}

static int gg_routing(pctx *p, const gguf_file *g, const char *arch, mcfg *c)
{
	char k[GG_KEY_MAX];
	int gating = 1, rc;
	if ((rc = gg_num(p, g, gkey(k, arch, "expert_weights_scale"), 0, 1e6, 1, &c->routed_scaling_factor)))
		return rc;
	c->norm_topk_prob = 0;
	if (gguf_find_key(g, gkey(k, arch, "expert_weights_norm")) >= 0 &&
	    (rc = gguf_get_bool(g, k, &c->norm_topk_prob, p->err)))
		return rc;
	if ((rc = gg_int(p, g, gkey(k, arch, "expert_gating_func"), OPT, 0, INT32_MAX, 1, &gating)))
		return rc;
	if (gating != 1 && gating != 2)
		return ds_err_set(p->err, DS_EUNSUPPORTED, "%s: %s %d is not supported (1 softmax, "
				  "2 sigmoid)", p->what, k, gating);
	c->scoring = gating == 2 ? MCFG_SCORING_SIGMOID : MCFG_SCORING_SOFTMAX;
	c->topk_method = gating == 2 ? MCFG_TOPK_NOAUX_TC
			 : c->topk_group < c->n_group ? MCFG_TOPK_GROUP_LIMITED_GREEDY : MCFG_TOPK_GREEDY;
	c->arch = gating == 2 ? MCFG_ARCH_DEEPSEEK_V3 : MCFG_ARCH_DEEPSEEK_V2;
	return DS_OK;
}

static int gg_tokens(pctx *p, const gguf_file *g, mcfg *c)
{
	static const char *const eos_keys[] = {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
					       "tokenizer.ggml.eom_token_id"};
	int rc = gg_int(p, g, "tokenizer.ggml.bos_token_id", OPT, 0, INT32_MAX, -1, &c->bos_token_id);
	for (size_t i = 0; !rc && i < sizeof eos_keys / sizeof eos_keys[0]; i++) {
		int id = -1, dup = 0;
		if ((rc = gg_int(p, g, eos_keys[i], OPT, 0, INT32_MAX, -1, &id)) || id < 0)
			continue;
		for (int j = 0; j < c->n_eos; j++)
			dup |= c->eos_token_ids[j] == id;
		if (!dup && c->n_eos < MCFG_MAX_EOS)
			c->eos_token_ids[c->n_eos++] = id;
	}
	if (rc || c->vocab_size > 0)
		return rc;
	gguf_arr a;
	const gguf_tensor *t = gguf_find_tensor(g, "token_embd.weight");
	if (gguf_get_arr(g, "tokenizer.ggml.tokens", GGUF_TYPE_COUNT, &a, NULL) == DS_OK && a.n > 0 &&
	    a.n <= (1u << 24))
		c->vocab_size = (int)a.n;
	else if (t && t->n_dims == 2 && t->shape[0] > 0 && t->shape[0] <= (1 << 24))
		c->vocab_size = (int)t->shape[0];
	else
		return ds_err_set(p->err, DS_EINVAL, "%s: the vocabulary size is unknown (no "
				  "deepseek2.vocab_size, tokenizer.ggml.tokens or 2-D token_embd.weight)",
				  p->what);
	return DS_OK;
}

int mcfg_from_gguf(const gguf_file *g, mcfg *out, ds_err *err)
{
	ds_err local = {0};
	if (!err)
		err = &local;
	pctx p = {gguf_path(g), err};
	memset(out, 0, sizeof *out);
	const char *arch = NULL;
	char k[GG_KEY_MAX];
	int rc = gguf_get_str(g, "general.architecture", &arch, NULL, err);
	if (rc)
		return rc;
	if (strcmp(arch, "deepseek2") != 0)
		return ds_err_set(err, DS_EUNSUPPORTED, "%s: general.architecture \"%.64s\" is not a "
				  "DeepSeek GGUF (deepseek2)", p.what, arch);
	for (size_t i = 0; !rc && i < sizeof gg_fields / sizeof gg_fields[0]; i++) {
		const gg_field *f = &gg_fields[i];
		rc = gg_int(&p, g, gkey(k, arch, f->key), f->need, f->min, f->max, f->def,
			    (int *)((char *)out + f->off));
	}
	if (rc)
		return rc;
	if (out->num_nextn_predict_layers >= out->num_hidden_layers)
		return ds_err_set(err, DS_EINVAL, "%s: %s.nextn_predict_layers %d leaves no decoder layer "
				  "of %s.block_count %d", p.what, arch, out->num_nextn_predict_layers, arch,
				  out->num_hidden_layers);
	out->num_hidden_layers -= out->num_nextn_predict_layers;
	if (out->num_key_value_heads == 0)
		out->num_key_value_heads = out->num_attention_heads;
	out->moe_layer_freq = 1;
	if ((rc = gg_heads(&p, g, arch, out)) || (rc = gg_rope(&p, g, arch, out)) ||
	    (rc = gg_num(&p, g, gkey(k, arch, "attention.layer_norm_rms_epsilon"), 0, 1, 1e-6,
			 &out->rms_norm_eps)) ||
	    (rc = gg_routing(&p, g, arch, out)) || (rc = gg_tokens(&p, g, out)) ||
	    (rc = check_moe(&p, out)) || (rc = check_layers(&p, out)))
		return rc;
	derive(out);
	return DS_OK;
}

int mcfg_is_moe_layer(const mcfg *c, int layer)
{
	if (layer < 0 || layer >= c->num_hidden_layers + c->num_nextn_predict_layers)
		return 0;
	return layer >= c->first_k_dense_replace && layer % c->moe_layer_freq == 0;
}

void mcfg_rope_inv_freq(const mcfg *c, float *out)
{
	int half = c->qk_rope_head_dim / 2;
	for (int i = 0; i < half; i++) {
		double f = pow(c->rope_theta, -2.0 * i / c->qk_rope_head_dim);
		if (c->rope_type == MCFG_ROPE_YARN) {
			double ramp = (i - c->yarn_low) / (c->yarn_high - c->yarn_low);
			ramp = fmin(fmax(ramp, 0.0), 1.0);
			f = f * (1 - ramp) + f / c->rope_factor * ramp;
		}
		out[i] = (float)f;
	}
}

const char *mcfg_arch_name(enum mcfg_arch a)
{
	return a == MCFG_ARCH_DEEPSEEK_V3 ? "deepseek_v3" : "deepseek_v2";
}

const char *mcfg_scoring_name(enum mcfg_scoring s)
{
	return s == MCFG_SCORING_SIGMOID ? "sigmoid" : "softmax";
}

const char *mcfg_topk_name(enum mcfg_topk t)
{
	return t == MCFG_TOPK_NOAUX_TC		     ? "noaux_tc"
	       : t == MCFG_TOPK_GROUP_LIMITED_GREEDY ? "group_limited_greedy"
						     : "greedy";
}

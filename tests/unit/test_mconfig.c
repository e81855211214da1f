/*
 * test_mconfig.c - unit tests of engine/mconfig: the published DeepSeek-V3 and
 * DeepSeek-V2-Lite config.json files (written to a mkdtemp directory at run
 * time), the derived YaRN values against the check values of the DeepSeek
 * spec (§1.2, §5), and many invalid variants whose errors must name the field
 * and the value.
 */
#include "engine/mconfig.h"
#include "tests/unit/unit.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* deepseek-ai/DeepSeek-V3 config.json (the published values, same key order). */
static const char v3_json[] =
	"{\n"
	"  \"architectures\": [\"DeepseekV3ForCausalLM\"],\n"
	"  \"attention_bias\": false,\n"
	"  \"attention_dropout\": 0.0,\n"
	"  \"auto_map\": {\n"
	"    \"AutoConfig\": \"configuration_deepseek.DeepseekV3Config\",\n"
	"    \"AutoModel\": \"modeling_deepseek.DeepseekV3Model\",\n"
	"    \"AutoModelForCausalLM\": \"modeling_deepseek.DeepseekV3ForCausalLM\"\n"
	"  },\n"
	"  \"bos_token_id\": 0,\n"
	"  \"eos_token_id\": 1,\n"
	"  \"ep_size\": 1,\n"
	"  \"first_k_dense_replace\": 3,\n"
	"  \"hidden_act\": \"silu\",\n"
	"  \"hidden_size\": 7168,\n"
	"  \"initializer_range\": 0.02,\n"
	"  \"intermediate_size\": 18432,\n"
	"  \"kv_lora_rank\": 512,\n"
	"  \"max_position_embeddings\": 163840,\n"
	"  \"model_type\": \"deepseek_v3\",\n"
	"  \"moe_intermediate_size\": 2048,\n"
	"  \"moe_layer_freq\": 1,\n"
	"  \"n_group\": 8,\n"
	"  \"n_routed_experts\": 256,\n"
	"  \"n_shared_experts\": 1,\n"
	"  \"norm_topk_prob\": true,\n"
	"  \"num_attention_heads\": 128,\n"
	"  \"num_experts_per_tok\": 8,\n"
	"  \"num_hidden_layers\": 61,\n"
	"  \"num_key_value_heads\": 128,\n"
	"  \"num_nextn_predict_layers\": 1,\n"
	"  \"q_lora_rank\": 1536,\n"
	"  \"qk_nope_head_dim\": 128,\n"
	"  \"qk_rope_head_dim\": 64,\n"
	"  \"quantization_config\": {\n"
	"    \"activation_scheme\": \"dynamic\",\n"
	"    \"fmt\": \"e4m3\",\n"
	"    \"quant_method\": \"fp8\",\n"
	"    \"weight_block_size\": [128, 128]\n"
	"  },\n"
	"  \"rms_norm_eps\": 1e-06,\n"
	"  \"rope_scaling\": {\n"
	"    \"beta_fast\": 32,\n"
	"    \"beta_slow\": 1,\n"
	"    \"factor\": 40,\n"
	"    \"mscale\": 1.0,\n"
	"    \"mscale_all_dim\": 1.0,\n"
	"    \"original_max_position_embeddings\": 4096,\n"
	"    \"type\": \"yarn\"\n"
	"  },\n"
	"  \"rope_theta\": 10000,\n"
	"  \"routed_scaling_factor\": 2.5,\n"
	"  \"scoring_func\": \"sigmoid\",\n"
	"  \"tie_word_embeddings\": false,\n"
	"  \"topk_group\": 4,\n"
	"  \"topk_method\": \"noaux_tc\",\n"
	"  \"torch_dtype\": \"bfloat16\",\n"
	"  \"transformers_version\": \"4.46.3\",\n"
	"  \"use_cache\": true,\n"
	"  \"v_head_dim\": 128,\n"
	"  \"vocab_size\": 129280\n"
	"}\n";

/* deepseek-ai/DeepSeek-V2-Lite(-Chat) config.json values. */
static const char v2lite_json[] =
	"{\n"
	"  \"architectures\": [\"DeepseekV2ForCausalLM\"],\n"
	"  \"attention_bias\": false,\n"
	"  \"attention_dropout\": 0.0,\n"
	"  \"aux_loss_alpha\": 0.001,\n"
	"  \"bos_token_id\": 100000,\n"
	"  \"eos_token_id\": 100001,\n"
	"  \"ep_size\": 1,\n"
	"  \"first_k_dense_replace\": 1,\n"
	"  \"hidden_act\": \"silu\",\n"
	"  \"hidden_size\": 2048,\n"
	"  \"initializer_range\": 0.02,\n"
	"  \"intermediate_size\": 10944,\n"
	"  \"kv_lora_rank\": 512,\n"
	"  \"max_position_embeddings\": 163840,\n"
	"  \"model_type\": \"deepseek_v2\",\n"
	"  \"moe_intermediate_size\": 1408,\n"
	"  \"moe_layer_freq\": 1,\n"
	"  \"n_group\": 1,\n"
	"  \"n_routed_experts\": 64,\n"
	"  \"n_shared_experts\": 2,\n"
	"  \"norm_topk_prob\": false,\n"
	"  \"num_attention_heads\": 16,\n"
	"  \"num_experts_per_tok\": 6,\n"
	"  \"num_hidden_layers\": 27,\n"
	"  \"num_key_value_heads\": 16,\n"
	"  \"pretraining_tp\": 1,\n"
	"  \"q_lora_rank\": null,\n"
	"  \"qk_nope_head_dim\": 128,\n"
	"  \"qk_rope_head_dim\": 64,\n"
	"  \"rms_norm_eps\": 1e-06,\n"
	"  \"rope_scaling\": {\n"
	"    \"beta_fast\": 32,\n"
	"    \"beta_slow\": 1,\n"
	"    \"factor\": 40,\n"
	"    \"mscale\": 0.707,\n"
	"    \"mscale_all_dim\": 0.707,\n"
	"    \"original_max_position_embeddings\": 4096,\n"
	"    \"type\": \"yarn\"\n"
	"  },\n"
	"  \"rope_theta\": 10000,\n"
	"  \"routed_scaling_factor\": 1.0,\n"
	"  \"scoring_func\": \"softmax\",\n"
	"  \"seq_aux\": true,\n"
	"  \"tie_word_embeddings\": false,\n"
	"  \"topk_group\": 1,\n"
	"  \"topk_method\": \"greedy\",\n"
	"  \"torch_dtype\": \"bfloat16\",\n"
	"  \"use_cache\": true,\n"
	"  \"v_head_dim\": 128,\n"
	"  \"vocab_size\": 102400\n"
	"}\n";

/* ---- helpers ---- */

typedef struct tmpcfg {
	char *dir; /* ut_tmpdir_new */
	char file[600];
} tmpcfg;

static int tmpcfg_write(tmpcfg *t, const char *text)
{
	t->dir = ut_tmpdir_new("mcfg");
	if (!t->dir)
		return -1;
	snprintf(t->file, sizeof t->file, "%s/config.json", t->dir);
	FILE *f = fopen(t->file, "wb");
	if (!f)
		return -1;
	fputs(text, f);
	fclose(f);
	return 0;
}

static void tmpcfg_remove(tmpcfg *t)
{
	ut_tmpdir_free(t->dir);
	t->dir = NULL;
}

/* Parses `base`, sets the dotted path ("rope_scaling.type") to the JSON text
 * `value` (NULL deletes the key), and runs mcfg_parse on the result. */
static int parse_variant(const char *base, const char *path, const char *value, mcfg *c,
			 ds_err *err)
{
	json_t *root = json_loads(base, 0, NULL), *obj = root;
	char key[128];
	const char *dot;
	while ((dot = strchr(path, '.')) != NULL) {
		snprintf(key, sizeof key, "%.*s", (int)(dot - path), path);
		obj = json_object_get(obj, key);
		path = dot + 1;
	}
	if (value)
		json_object_set_new(obj, path, json_loads(value, JSON_DECODE_ANY, NULL));
	else
		json_object_del(obj, path);
	char *text = json_dumps(root, JSON_INDENT(1));
	int rc = mcfg_parse(text, strlen(text), "config.json", c, err);
	free(text);
	json_decref(root);
	return rc;
}

static double rel_tol(double v)
{
	return 2e-7 * fabs(v) + 1e-12;
}

/* ---- the published configs ---- */

TEST(mcfg_v3_published_config)
{
	tmpcfg t;
	mcfg c;
	ds_err err = {0};
	CHECK_EQ(tmpcfg_write(&t, v3_json), 0);
	CHECK_EQ(mcfg_load(t.dir, &c, &err), DS_OK); /* a directory holding config.json */
	if (err.code)
		printf("  %s\n", err.msg);
	CHECK_EQ(c.arch, MCFG_ARCH_DEEPSEEK_V3);
	CHECK_EQ(c.vocab_size, 129280);
	CHECK_EQ(c.hidden_size, 7168);
	CHECK_EQ(c.intermediate_size, 18432);
	CHECK_EQ(c.moe_intermediate_size, 2048);
	CHECK_EQ(c.num_hidden_layers, 61);
	CHECK_EQ(c.num_attention_heads, 128);
	CHECK_EQ(c.num_key_value_heads, 128);
	CHECK_EQ(c.q_lora_rank, 1536);
	CHECK_EQ(c.kv_lora_rank, 512);
	CHECK_EQ(c.qk_nope_head_dim, 128);
	CHECK_EQ(c.qk_rope_head_dim, 64);
	CHECK_EQ(c.v_head_dim, 128);
	CHECK_EQ(c.qk_head_dim, 192);
	CHECK_EQ(c.n_routed_experts, 256);
	CHECK_EQ(c.n_shared_experts, 1);
	CHECK_EQ(c.shared_intermediate, 2048);
	CHECK_EQ(c.num_experts_per_tok, 8);
	CHECK_EQ(c.n_group, 8);
	CHECK_EQ(c.topk_group, 4);
	CHECK_NEAR(c.routed_scaling_factor, 2.5, 0);
	CHECK_EQ(c.scoring, MCFG_SCORING_SIGMOID);
	CHECK_EQ(c.topk_method, MCFG_TOPK_NOAUX_TC);
	CHECK_EQ(c.norm_topk_prob, 1);
	CHECK_EQ(c.first_k_dense_replace, 3);
	CHECK_EQ(c.moe_layer_freq, 1);
	CHECK_EQ(c.max_position_embeddings, 163840);
	CHECK_NEAR(c.rope_theta, 10000, 0);
	CHECK_EQ(c.rope_type, MCFG_ROPE_YARN);
	CHECK_NEAR(c.rope_factor, 40, 0);
	CHECK_EQ(c.rope_original_max_position, 4096);
	CHECK_NEAR(c.rope_beta_fast, 32, 0);
	CHECK_NEAR(c.rope_beta_slow, 1, 0);
	CHECK_NEAR(c.rope_mscale, 1.0, 0);
	CHECK_NEAR(c.rope_mscale_all_dim, 1.0, 0);
	CHECK_NEAR(c.rms_norm_eps, 1e-6, 0);
	CHECK_EQ(c.bos_token_id, 0);
	CHECK_EQ(c.n_eos, 1);
	CHECK_EQ(c.eos_token_ids[0], 1);
	CHECK_EQ(c.num_nextn_predict_layers, 1);
	CHECK_EQ(c.fp8, 1);
	CHECK_EQ(c.fp8_block_n, 128);
	CHECK_EQ(c.fp8_block_k, 128);
	CHECK_EQ(c.fp8_scale_ue8m0, 0);
	/* spec §1.2: 192^-0.5 * (1 + 0.1 ln 40)^2 */
	CHECK_NEAR(c.softmax_scale, 0.13523378, 5e-9);
	CHECK_NEAR(c.rope_amp, 1.0, 1e-12);
	CHECK_NEAR(c.yarn_low, 10, 0);
	CHECK_NEAR(c.yarn_high, 23, 0);
	/* spec §4.3: dense 0..2, MoE 3..60 and the MTP layer 61 */
	CHECK_EQ(mcfg_is_moe_layer(&c, 0), 0);
	CHECK_EQ(mcfg_is_moe_layer(&c, 2), 0);
	CHECK_EQ(mcfg_is_moe_layer(&c, 3), 1);
	CHECK_EQ(mcfg_is_moe_layer(&c, 60), 1);
	CHECK_EQ(mcfg_is_moe_layer(&c, 61), 1);
	CHECK_EQ(mcfg_is_moe_layer(&c, 62), 0);
	CHECK_EQ(mcfg_is_moe_layer(&c, -1), 0);
	tmpcfg_remove(&t);
}

TEST(mcfg_v3_rope_inv_freq_matches_spec_check_values)
{
	mcfg c;
	ds_err err = {0};
	CHECK_EQ(mcfg_parse(v3_json, strlen(v3_json), "v3", &c, &err), DS_OK);
	float f[32];
	mcfg_rope_inv_freq(&c, f);
	static const struct {
		int i;
		double v;
	} spec[] = {
		{0, 1.0},        {1, 0.7498942},  {2, 0.5623413},  {3, 0.4216965},
		{10, 0.0562341}, {11, 0.0390069}, {12, 0.0268794},
	};
	for (size_t k = 0; k < sizeof spec / sizeof spec[0]; k++)
		CHECK_NEAR(f[spec[k].i], spec[k].v, 6e-8 + 1e-7 * spec[k].v);
	CHECK_NEAR(f[31], 3.3338e-6, 1e-10);
	/* regimes: i <= low keeps base^(-2i/d), i >= high is divided by the factor */
	for (int i = 0; i < 32; i++) {
		double base = pow(10000.0, -2.0 * i / 64);
		if (i <= 10)
			CHECK_NEAR(f[i], base, rel_tol(base));
		if (i >= 23)
			CHECK_NEAR(f[i], base / 40, rel_tol(base / 40));
		if (i > 10 && i < 23)
			CHECK(f[i] < base && f[i] > base / 40);
	}
}

TEST(mcfg_v2lite_published_config)
{
	tmpcfg t;
	mcfg c;
	ds_err err = {0};
	CHECK_EQ(tmpcfg_write(&t, v2lite_json), 0);
	CHECK_EQ(mcfg_load(t.file, &c, &err), DS_OK); /* the file itself */
	if (err.code)
		printf("  %s\n", err.msg);
	CHECK_EQ(c.arch, MCFG_ARCH_DEEPSEEK_V2);
	CHECK_EQ(c.vocab_size, 102400);
	CHECK_EQ(c.hidden_size, 2048);
	CHECK_EQ(c.intermediate_size, 10944);
	CHECK_EQ(c.moe_intermediate_size, 1408);
	CHECK_EQ(c.num_hidden_layers, 27);
	CHECK_EQ(c.num_attention_heads, 16);
	CHECK_EQ(c.q_lora_rank, 0);
	CHECK_EQ(c.kv_lora_rank, 512);
	CHECK_EQ(c.qk_head_dim, 192);
	CHECK_EQ(c.n_routed_experts, 64);
	CHECK_EQ(c.n_shared_experts, 2);
	CHECK_EQ(c.shared_intermediate, 2816);
	CHECK_EQ(c.num_experts_per_tok, 6);
	CHECK_EQ(c.n_group, 1);
	CHECK_EQ(c.topk_group, 1);
	CHECK_NEAR(c.routed_scaling_factor, 1.0, 0);
	CHECK_EQ(c.scoring, MCFG_SCORING_SOFTMAX);
	CHECK_EQ(c.topk_method, MCFG_TOPK_GREEDY);
	CHECK_EQ(c.norm_topk_prob, 0);
	CHECK_EQ(c.first_k_dense_replace, 1);
	CHECK_NEAR(c.rope_mscale, 0.707, 0);
	CHECK_NEAR(c.rope_mscale_all_dim, 0.707, 0);
	CHECK_EQ(c.bos_token_id, 100000);
	CHECK_EQ(c.n_eos, 1);
	CHECK_EQ(c.eos_token_ids[0], 100001);
	CHECK_EQ(c.num_nextn_predict_layers, 0);
	CHECK_EQ(c.fp8, 0);
	/* spec §1.2: 192^-0.5 * (1 + 0.1 * 0.707 ln 40)^2 */
	CHECK_NEAR(c.softmax_scale, 0.11472139, 5e-9);
	CHECK_NEAR(c.rope_amp, 1.0, 1e-12);
	CHECK_NEAR(c.yarn_low, 10, 0);
	CHECK_NEAR(c.yarn_high, 23, 0);
	CHECK_EQ(mcfg_is_moe_layer(&c, 0), 0);
	CHECK_EQ(mcfg_is_moe_layer(&c, 1), 1);
	CHECK_EQ(mcfg_is_moe_layer(&c, 26), 1);
	CHECK_EQ(mcfg_is_moe_layer(&c, 27), 0); /* no MTP layer */
	float f[32];
	mcfg_rope_inv_freq(&c, f);
	CHECK_NEAR(f[11], 0.0390069, 1e-7);
	CHECK_NEAR(f[31], 3.3338e-6, 1e-10);
	tmpcfg_remove(&t);
}

/* ---- accepted variants ---- */

TEST(mcfg_plain_rope_when_scaling_is_null)
{
	mcfg c;
	ds_err err = {0};
	float f[32];
	CHECK_EQ(parse_variant(v3_json, "rope_scaling", "null", &c, &err), DS_OK);
	CHECK_EQ(c.rope_type, MCFG_ROPE_PLAIN);
	CHECK_NEAR(c.softmax_scale, 1.0 / sqrt(192.0), 1e-12);
	CHECK_NEAR(c.rope_amp, 1.0, 0);
	mcfg_rope_inv_freq(&c, f);
	for (int i = 0; i < 32; i++) {
		double want = pow(10000.0, -2.0 * i / 64);
		CHECK_NEAR(f[i], want, rel_tol(want));
	}
	CHECK_EQ(parse_variant(v3_json, "rope_scaling", "{\"type\": \"default\"}", &c, &err),
		 DS_OK);
	CHECK_EQ(c.rope_type, MCFG_ROPE_PLAIN);
	CHECK_EQ(parse_variant(v3_json, "rope_scaling", NULL, &c, &err), DS_OK);
	CHECK_EQ(c.rope_type, MCFG_ROPE_PLAIN);
}

TEST(mcfg_yarn_details_follow_the_remote_code)
{
	mcfg c;
	ds_err err = {0};
	/* mscale_all_dim absent = 0: no softmax correction, cos/sin amplitude m(40, 1) */
	CHECK_EQ(parse_variant(v3_json, "rope_scaling.mscale_all_dim", NULL, &c, &err), DS_OK);
	CHECK_NEAR(c.softmax_scale, 1.0 / sqrt(192.0), 1e-12);
	CHECK_NEAR(c.rope_amp, 1.0 + 0.1 * log(40.0), 1e-12);
	/* mscale != mscale_all_dim: the ratio */
	CHECK_EQ(parse_variant(v2lite_json, "rope_scaling.mscale", "1.0", &c, &err), DS_OK);
	CHECK_NEAR(c.rope_amp, (1 + 0.1 * log(40.0)) / (1 + 0.0707 * log(40.0)), 1e-12);
	/* "rope_type" spelling of newer transformers */
	CHECK_EQ(parse_variant(v3_json, "rope_scaling",
			       "{\"rope_type\": \"yarn\", \"factor\": 40, "
			       "\"original_max_position_embeddings\": 4096, \"mscale\": 1, "
			       "\"mscale_all_dim\": 1}", &c, &err), DS_OK);
	CHECK_EQ(c.rope_type, MCFG_ROPE_YARN);
	CHECK_NEAR(c.softmax_scale, 0.13523378, 5e-9);
	/* a short original context moves the ramp (low 0 .. high 8 for L0 = 64) */
	CHECK_EQ(parse_variant(v3_json, "rope_scaling.original_max_position_embeddings", "64", &c,
			       &err), DS_OK);
	double lo = floor(64 * log(64 / (2 * M_PI * 32)) / (2 * log(10000.0)));
	double hi = ceil(64 * log(64 / (2 * M_PI * 1)) / (2 * log(10000.0)));
	CHECK_NEAR(c.yarn_low, fmax(lo, 0), 0);
	CHECK_NEAR(c.yarn_high, hi, 0);
	/* factor 1: YaRN is the identity on frequencies, no scale change */
	CHECK_EQ(parse_variant(v3_json, "rope_scaling.factor", "1", &c, &err), DS_OK);
	CHECK_NEAR(c.softmax_scale, 1.0 / sqrt(192.0), 1e-12);
	float f[32];
	mcfg_rope_inv_freq(&c, f);
	CHECK_NEAR(f[20], pow(10000.0, -40.0 / 64), rel_tol(pow(10000.0, -40.0 / 64)));
}

TEST(mcfg_accepts_hf_spellings_and_ignores_unknown_keys)
{
	mcfg c;
	ds_err err = {0};
	CHECK_EQ(parse_variant(v2lite_json, "topk_method", "\"gready\"", &c, &err), DS_OK);
	CHECK_EQ(c.topk_method, MCFG_TOPK_GREEDY);
	CHECK_EQ(parse_variant(v3_json, "hidden_size", "7168.0", &c, &err), DS_OK);
	CHECK_EQ(c.hidden_size, 7168);
	CHECK_EQ(parse_variant(v3_json, "routed_scaling_factor", "3", &c, &err), DS_OK);
	CHECK_NEAR(c.routed_scaling_factor, 3.0, 0);
	CHECK_EQ(parse_variant(v3_json, "q_lora_rank", "0", &c, &err), DS_OK);
	CHECK_EQ(c.q_lora_rank, 0);
	CHECK_EQ(parse_variant(v3_json, "eos_token_id", "[1, 128805]", &c, &err), DS_OK);
	CHECK_EQ(c.n_eos, 2);
	CHECK_EQ(c.eos_token_ids[1], 128805);
	CHECK_EQ(parse_variant(v3_json, "eos_token_id", "null", &c, &err), DS_OK);
	CHECK_EQ(c.n_eos, 0);
	CHECK_EQ(parse_variant(v3_json, "bos_token_id", NULL, &c, &err), DS_OK);
	CHECK_EQ(c.bos_token_id, -1);
	CHECK_EQ(parse_variant(v3_json, "num_key_value_heads", "1", &c, &err), DS_OK);
	CHECK_EQ(c.num_key_value_heads, 1);
	CHECK_EQ(parse_variant(v3_json, "num_key_value_heads", NULL, &c, &err), DS_OK);
	CHECK_EQ(c.num_key_value_heads, 128);
	CHECK_EQ(parse_variant(v3_json, "some_future_key", "{\"x\": [1, 2, {\"y\": null}]}", &c,
			       &err), DS_OK);
	CHECK_EQ(parse_variant(v3_json, "quantization_config", "null", &c, &err), DS_OK);
	CHECK_EQ(c.fp8, 0);
	CHECK_EQ(parse_variant(v3_json, "quantization_config.scale_fmt", "\"ue8m0\"", &c, &err),
		 DS_OK);
	CHECK_EQ(c.fp8_scale_ue8m0, 1);
	CHECK_EQ(parse_variant(v3_json, "moe_layer_freq", "2", &c, &err), DS_OK);
	CHECK_EQ(mcfg_is_moe_layer(&c, 3), 0);
	CHECK_EQ(mcfg_is_moe_layer(&c, 4), 1);
	CHECK_EQ(parse_variant(v2lite_json, "topk_method", "\"group_limited_greedy\"", &c, &err),
		 DS_OK);
	CHECK_EQ(c.topk_method, MCFG_TOPK_GROUP_LIMITED_GREEDY);
	CHECK_EQ(parse_variant(v3_json, "n_shared_experts", "null", &c, &err), DS_OK);
	CHECK_EQ(c.n_shared_experts, 0);
	CHECK_STR(mcfg_arch_name(MCFG_ARCH_DEEPSEEK_V2), "deepseek_v2");
	CHECK_STR(mcfg_topk_name(MCFG_TOPK_NOAUX_TC), "noaux_tc");
	CHECK_STR(mcfg_scoring_name(MCFG_SCORING_SOFTMAX), "softmax");
}

/* ---- rejected variants: each error names the field and the value ---- */

typedef struct bad_case {
	const char *base; /* "v3" or "v2" */
	const char *path, *value;
	int code;
	const char *want;
} bad_case;

static const bad_case bad_cases[] = {
	{"v3", "hidden_act", "\"gelu\"", DS_EUNSUPPORTED,
	 "config.json: hidden_act \"gelu\" is not supported (only \"silu\")"},
	{"v3", "scoring_func", "\"foo\"", DS_EUNSUPPORTED,
	 "config.json: scoring_func \"foo\" is not supported (one of \"softmax\", \"sigmoid\")"},
	{"v3", "topk_method", "\"topk\"", DS_EUNSUPPORTED, "topk_method \"topk\" is not supported"},
	{"v3", "rope_scaling.type", "\"dynamic\"", DS_EUNSUPPORTED,
	 "config.json: rope_scaling.type \"dynamic\" is not supported (only \"yarn\")"},
	{"v3", "rope_scaling.type", NULL, DS_EINVAL, "rope_scaling.type is required"},
	{"v3", "attention_bias", "true", DS_EUNSUPPORTED, "config.json: attention_bias true"},
	{"v3", "attention_bias", "1", DS_EFORMAT, "attention_bias must be true or false, got 1"},
	{"v3", "tie_word_embeddings", "true", DS_EUNSUPPORTED, "tie_word_embeddings true"},
	{"v3", "quantization_config.fmt", "\"e5m2\"", DS_EUNSUPPORTED,
	 "quantization_config.fmt \"e5m2\" is not supported (only \"e4m3\")"},
	{"v3", "quantization_config.activation_scheme", "\"static\"", DS_EUNSUPPORTED,
	 "quantization_config.activation_scheme \"static\" is not supported"},
	{"v3", "quantization_config.quant_method", "\"awq\"", DS_EUNSUPPORTED,
	 "quantization_config.quant_method \"awq\" is not supported (only \"fp8\")"},
	{"v3", "quantization_config.scale_fmt", "\"e8m0\"", DS_EUNSUPPORTED,
	 "quantization_config.scale_fmt \"e8m0\""},
	{"v3", "quantization_config.weight_block_size", "[128, 64]", DS_EINVAL,
	 "config.json: quantization_config.weight_block_size must be 2 equal positive integers, "
	 "got [128,64]"},
	{"v3", "quantization_config.weight_block_size", "[128]", DS_EFORMAT,
	 "weight_block_size must be 2 equal positive integers, got [128]"},
	{"v3", "quantization_config.weight_block_size", "[0, 0]", DS_EINVAL,
	 "weight_block_size must be 2 equal positive integers, got [0,0]"},
	{"v3", "quantization_config.weight_block_size", "[128.5, 128.5]", DS_EFORMAT,
	 "weight_block_size must be 2 equal positive integers"},
	{"v3", "quantization_config.weight_block_size", NULL, DS_EINVAL,
	 "quantization_config.weight_block_size is required"},
	{"v3", "quantization_config", "\"fp8\"", DS_EFORMAT,
	 "quantization_config must be an object or null, got \"fp8\""},
	{"v3", "n_group", "7", DS_EINVAL, "n_group 7 must divide n_routed_experts 256"},
	{"v3", "topk_group", "9", DS_EINVAL, "topk_group 9 exceeds n_group 8"},
	{"v3", "num_experts_per_tok", "300", DS_EINVAL,
	 "num_experts_per_tok 300 exceeds n_routed_experts 256"},
	{"v3", "num_experts_per_tok", "129", DS_EINVAL,
	 "num_experts_per_tok 129 exceeds the 128 experts of topk_group 4 groups"},
	{"v3", "n_group", "256", DS_EINVAL, "\"noaux_tc\" scores a group by its top 2 experts"},
	{"v3", "scoring_func", "\"softmax\"", DS_EUNSUPPORTED,
	 "topk_method \"noaux_tc\" with scoring_func \"softmax\" is not supported"},
	{"v2", "scoring_func", "\"sigmoid\"", DS_EUNSUPPORTED,
	 "topk_method \"greedy\" with scoring_func \"sigmoid\" is not supported"},
	{"v3", "n_routed_experts", "0", DS_EINVAL,
	 "n_routed_experts must be an integer in [1, 65536], got 0"},
	{"v3", "qk_nope_head_dim", "0", DS_EINVAL,
	 "config.json: qk_nope_head_dim must be an integer in [1, 4096], got 0"},
	{"v3", "v_head_dim", "-128", DS_EINVAL,
	 "v_head_dim must be an integer in [1, 4096], got -128"},
	{"v3", "qk_rope_head_dim", "63", DS_EINVAL, "qk_rope_head_dim 63 must be even"},
	{"v3", "kv_lora_rank", NULL, DS_EINVAL, "config.json: kv_lora_rank is required"},
	{"v3", "moe_layer_freq", "0", DS_EINVAL,
	 "moe_layer_freq must be an integer in [1, 4096], got 0"},
	{"v3", "first_k_dense_replace", "62", DS_EINVAL,
	 "first_k_dense_replace 62 exceeds num_hidden_layers 61"},
	{"v3", "model_type", "\"llama\"", DS_EUNSUPPORTED,
	 "config.json: model_type \"llama\" is not supported "
	 "(supported: deepseek_v3, deepseek_v2)"},
	{"v3", "model_type", NULL, DS_EINVAL, "config.json: model_type is required"},
	{"v3", "hidden_size", "7168.5", DS_EINVAL,
	 "hidden_size must be an integer in [1, 1048576], got 7168.5"},
	{"v3", "hidden_size", "\"7168\"", DS_EFORMAT,
	 "hidden_size must be an integer in [1, 1048576], got \"7168\""},
	{"v3", "vocab_size", NULL, DS_EINVAL, "vocab_size is required"},
	{"v3", "vocab_size", "null", DS_EINVAL, "vocab_size is required"},
	{"v3", "q_lora_rank", NULL, DS_EINVAL, "q_lora_rank is required"},
	{"v3", "norm_topk_prob", "\"yes\"", DS_EFORMAT,
	 "norm_topk_prob must be true or false, got \"yes\""},
	{"v3", "routed_scaling_factor", NULL, DS_EINVAL, "routed_scaling_factor is required"},
	{"v3", "routed_scaling_factor", "0", DS_EINVAL,
	 "routed_scaling_factor must be a number in (0, 1e+06], got 0"},
	{"v3", "rms_norm_eps", "0", DS_EINVAL, "rms_norm_eps must be a number in (0, 1], got 0"},
	{"v3", "rope_theta", "-1", DS_EINVAL, "rope_theta must be a number in (0, 1e+12], got -1"},
	{"v3", "rope_scaling.factor", NULL, DS_EINVAL, "rope_scaling.factor is required"},
	{"v3", "rope_scaling.factor", "0.5", DS_EINVAL,
	 "rope_scaling.factor must be a number in [1, 1e+06], got 0.5"},
	{"v3", "rope_scaling.original_max_position_embeddings", NULL, DS_EINVAL,
	 "rope_scaling.original_max_position_embeddings is required"},
	{"v3", "rope_scaling.beta_fast", "1", DS_EINVAL,
	 "rope_scaling.beta_fast (1) must be greater than beta_slow (1)"},
	{"v3", "rope_scaling.mscale", "-1", DS_EINVAL,
	 "rope_scaling.mscale must be a number in [0, 1e+06], got -1"},
	{"v3", "rope_scaling.mscale_all_dim", "\"1\"", DS_EFORMAT,
	 "rope_scaling.mscale_all_dim must be a number"},
	{"v3", "rope_scaling.attention_factor", "1.0", DS_EUNSUPPORTED,
	 "rope_scaling.attention_factor is not supported"},
	{"v3", "rope_scaling.truncate", "false", DS_EUNSUPPORTED,
	 "rope_scaling.truncate must be true"},
	{"v3", "rope_scaling", "5", DS_EFORMAT, "rope_scaling must be an object or null, got 5"},
	{"v3", "eos_token_id", "\"x\"", DS_EFORMAT,
	 "eos_token_id must be a token id or an array of 1 to 8 token ids, got \"x\""},
	{"v3", "eos_token_id", "[1, -2]", DS_EINVAL, "eos_token_id must be a token id"},
	{"v3", "eos_token_id", "[]", DS_EFORMAT, "eos_token_id must be a token id"},
	{"v3", "eos_token_id", "200000", DS_EINVAL,
	 "eos_token_id 200000 is outside vocab_size 129280"},
	{"v3", "bos_token_id", "-5", DS_EINVAL, "bos_token_id must be an integer"},
	{"v3", "num_nextn_predict_layers", "-1", DS_EINVAL, "num_nextn_predict_layers must be"},
	{"v3", "num_attention_heads", "[128]", DS_EFORMAT,
	 "num_attention_heads must be an integer"},
	{"v2", "hidden_act", "\"gelu_pytorch_tanh\"", DS_EUNSUPPORTED,
	 "hidden_act \"gelu_pytorch_tanh\" is not supported"},
};

TEST(mcfg_invalid_variants_name_field_and_value)
{
	for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
		const bad_case *b = &bad_cases[i];
		mcfg c;
		ds_err err = {0};
		const char *base = strcmp(b->base, "v3") == 0 ? v3_json : v2lite_json;
		int rc = parse_variant(base, b->path, b->value, &c, &err);
		if (rc != b->code || !strstr(err.msg, b->want))
			ut_fail(__FILE__, __LINE__, "%s=%s: rc %d (want %d), \"%s\" lacks \"%s\"",
				b->path, b->value ? b->value : "(deleted)", rc, b->code, err.msg,
				b->want);
	}
}

TEST(mcfg_file_errors)
{
	tmpcfg t;
	mcfg c;
	ds_err err = {0};
	char p[700];
	CHECK_EQ(tmpcfg_write(&t, "{\n \"model_type\": \"deepseek_v3\",\n \"hidden_size\": ]\n}"),
		 0);
	CHECK_EQ(mcfg_load(t.file, &c, &err), DS_EFORMAT);
	CHECK(strstr(err.msg, t.file) != NULL);
	CHECK(strstr(err.msg, "invalid JSON at line 3 column") != NULL);
	tmpcfg_remove(&t);

	CHECK_EQ(tmpcfg_write(&t, v3_json), 0); /* grown past the cap (sparse) */
	CHECK_EQ(truncate(t.file, (off_t)MCFG_MAX_FILE_BYTES + 1), 0);
	CHECK_EQ(mcfg_load(t.file, &c, &err), DS_ERANGE);
	CHECK(strstr(err.msg, t.file) != NULL);
	CHECK(strstr(err.msg, "at most 4194304 are accepted") != NULL);
	tmpcfg_remove(&t);

	CHECK_EQ(tmpcfg_write(&t, "[1, 2]"), 0);
	CHECK_EQ(mcfg_load(t.dir, &c, &err), DS_EFORMAT);
	CHECK(strstr(err.msg, "config.json: must be a JSON object") != NULL);
	snprintf(p, sizeof p, "%s/nothing", t.dir);
	CHECK_EQ(mcfg_load(p, &c, &err), DS_ENOTFOUND);
	CHECK(strstr(err.msg, p) != NULL);
	snprintf(p, sizeof p, "%s", t.dir);
	tmpcfg_remove(&t);
	CHECK_EQ(mcfg_load(p, &c, &err), DS_ENOTFOUND); /* the directory is gone */
	CHECK_EQ(mcfg_parse(v3_json, strlen(v3_json), "x", &c, NULL), DS_OK);
	CHECK_EQ(mcfg_parse("{", 1, "x", &c, NULL), DS_EFORMAT);
}

TEST(mcfg_random_corruption_fails_cleanly)
{
	size_t n = strlen(v3_json);
	char *buf = malloc(n + 1);
	int ok = 0, failed = 0;
	for (int it = 0; it < 3000; it++) {
		memcpy(buf, v3_json, n + 1);
		int flips = 1 + (int)(ut_rand_u64() % 3);
		for (int k = 0; k < flips; k++)
			buf[ut_rand_u64() % n] = (char)(32 + ut_rand_u64() % 95);
		mcfg c;
		ds_err err = {0};
		if (mcfg_parse(buf, n, "cfg", &c, &err) == DS_OK) {
			ok++;
			/* whatever was accepted is self-consistent */
			CHECK_EQ(c.qk_head_dim, c.qk_nope_head_dim + c.qk_rope_head_dim);
			CHECK(c.n_routed_experts % c.n_group == 0);
			CHECK(c.topk_group <= c.n_group);
			CHECK(c.num_experts_per_tok <= c.n_routed_experts);
			CHECK(c.qk_rope_head_dim % 2 == 0);
			CHECK(c.softmax_scale > 0 && isfinite(c.softmax_scale));
		} else {
			failed++;
			CHECK(strncmp(err.msg, "cfg: ", 5) == 0);
		}
	}
	CHECK(ok > 0 && failed > 0);
	free(buf);
}

/*
 * mconfig.h - a model's config.json as a plain struct, validated.
 *
 *     mcfg c;
 *     ds_err err = {0};
 *     if (mcfg_load("models/DeepSeek-V3", &c, &err) != DS_OK)   // dir or config.json
 *         die(err.msg); // ".../config.json: hidden_act \"gelu\" is not supported (only \"silu\")"
 *     float inv_freq[MCFG_MAX_ROPE_DIM / 2];
 *     mcfg_rope_inv_freq(&c, inv_freq);
 *
 * Supported: model_type deepseek_v3 (DeepSeek-V3, -V3-Base, -V3-0324, -R1,
 * -R1-0528) and deepseek_v2 (DeepSeek-V2, -V2-Lite).  Every field of their
 * published config.json is either honoured here or rejected with an error
 * naming the field and its value; keys that only matter for training or for
 * Python (aux_loss_alpha, seq_aux, ep_size, pretraining_tp, use_cache,
 * torch_dtype, initializer_range, attention_dropout, auto_map, architectures,
 * transformers_version ...) and unknown keys are ignored.  The file comment of
 * mconfig.c lists each field, its default and its bounds.
 *
 * Pure data: no allocation survives a call; thread-safe.
 */
#ifndef DS_ENGINE_MCONFIG_H
#define DS_ENGINE_MCONFIG_H

#include "common/status.h"

#include <stddef.h>

#define MCFG_MAX_EOS 8
#define MCFG_MAX_ROPE_DIM 4096
/* config.json is read whole (ds_file_read_all) under this cap: published
 * configs are a few KiB, a few MiB leaves room for long comments or padding;
 * a larger file is refused with its name and the cap, never truncated. */
#define MCFG_MAX_FILE_BYTES (4u << 20)
#define MCFG_JSON_MAX_DEPTH 32

/* A later issue adds more architectures here.  A GGUF ("deepseek2" for both)
 * counts as V3 with sigmoid routing and as V2 with softmax routing. */
enum mcfg_arch {
	MCFG_ARCH_DEEPSEEK_V3 = 0, /* "deepseek_v3" */
	MCFG_ARCH_DEEPSEEK_V2 = 1, /* "deepseek_v2" */
};

enum mcfg_scoring {
	MCFG_SCORING_SOFTMAX = 0, /* V2: router probabilities = softmax(logits) */
	MCFG_SCORING_SIGMOID = 1, /* V3: sigmoid(logits), bias only for selection */
};

enum mcfg_topk {
	MCFG_TOPK_GREEDY = 0,               /* "greedy" (also the "gready" spelling) */
	MCFG_TOPK_GROUP_LIMITED_GREEDY = 1, /* group score = max prob in group */
	MCFG_TOPK_NOAUX_TC = 2,             /* group score = sum of top-2 biased scores */
};

enum mcfg_rope {
	MCFG_ROPE_PLAIN = 0, /* rope_scaling null (or type "default") */
	MCFG_ROPE_YARN = 1,
};

typedef struct mcfg {
	enum mcfg_arch arch;

	/* sizes */
	int vocab_size;
	int hidden_size;
	int intermediate_size;     /* dense MLP layers */
	int moe_intermediate_size; /* one routed expert */
	int num_hidden_layers;     /* decoder layers; MTP layers come after */
	int num_attention_heads;
	int num_key_value_heads;   /* nominal only: MLA gives every head its own K/V
				    * from the shared latent; any value is accepted
				    * (default num_attention_heads) and not used */

	/* MLA */
	int q_lora_rank;           /* 0 = no q LoRA: plain q_proj (V2-Lite: null) */
	int kv_lora_rank;
	int qk_nope_head_dim;
	int qk_rope_head_dim;      /* even, <= MCFG_MAX_ROPE_DIM */
	int v_head_dim;

	/* MoE */
	int n_routed_experts;
	int n_shared_experts;      /* 0 = none; else ONE MLP of width n_shared * moe_inter */
	int num_experts_per_tok;
	int n_group, topk_group;   /* 1 / 1 when absent or null */
	double routed_scaling_factor;
	enum mcfg_scoring scoring;
	enum mcfg_topk topk_method;
	int norm_topk_prob;
	int first_k_dense_replace; /* layers [0, k) are dense */
	int moe_layer_freq;

	/* positions */
	int max_position_embeddings;
	double rope_theta;
	enum mcfg_rope rope_type;
	double rope_factor;               /* YaRN only (else 1) */
	int rope_original_max_position;   /* YaRN: original_max_position_embeddings */
	double rope_beta_fast, rope_beta_slow; /* YaRN: defaults 32 / 1 */
	double rope_mscale, rope_mscale_all_dim; /* YaRN: defaults 1 / 0 */

	double rms_norm_eps;
	int bos_token_id;          /* -1 = not given */
	int n_eos;                 /* 0 = not given */
	int eos_token_ids[MCFG_MAX_EOS];
	int num_nextn_predict_layers; /* MTP layers (V3: 1), 0 when absent */

	/* quantization_config (quant_method fp8, fmt e4m3, dynamic activations) */
	int fp8;                   /* 1: Linear weights are F8_E4M3 + <name>_scale_inv */
	int fp8_block_n, fp8_block_k; /* weight_block_size, equal */
	int fp8_scale_ue8m0;       /* scale_fmt "ue8m0" (V3.1): activation scales are
				    * powers of two; weights unaffected */

	/* derived at load */
	int qk_head_dim;           /* qk_nope_head_dim + qk_rope_head_dim */
	int shared_intermediate;   /* n_shared_experts * moe_intermediate_size */
	double softmax_scale;      /* qk_head_dim^-0.5 * m(F, mscale_all_dim)^2 */
	double rope_amp;           /* cos/sin multiplier m(F, mscale) / m(F, mscale_all_dim) */
	double yarn_low, yarn_high; /* YaRN ramp bounds (V3, V2-Lite: 10 / 23) */
} mcfg;

/* path: a config.json file, or a directory holding one.  On error *out is
 * unspecified and err names the file, field and value:
 * DS_ENOTFOUND / DS_EIO (file), DS_EFORMAT (JSON syntax, wrong type),
 * DS_EINVAL (value out of range or inconsistent), DS_EUNSUPPORTED (valid
 * value this engine does not implement). */
int mcfg_load(const char *path, mcfg *out, ds_err *err);

/* The same from memory; `what` names the source in errors. */
int mcfg_parse(const char *text, size_t len, const char *what, mcfg *out, ds_err *err);
/* The same from a parsed config.json (a model source holds one). */
struct json_t;
int mcfg_from_json(const struct json_t *root, const char *what, mcfg *out, ds_err *err);

/* The same from the metadata of a GGUF file written by llama.cpp's converter
 * for general.architecture "deepseek2" (DeepSeek-V2 / V2-Lite / V3 / R1);
 * the key-by-key mapping is in the file comment of mconfig.c and in
 * docs/engine.md.  Errors name the file and the key, with the codes of
 * mcfg_parse (DS_EUNSUPPORTED also for another architecture).  Tensors are
 * not looked at, except token_embd.weight's row count when neither
 * deepseek2.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size. */
struct gguf_file;
int mcfg_from_gguf(const struct gguf_file *g, mcfg *out, ds_err *err);

/* 1 if decoder layer L (0 <= L < num_hidden_layers + num_nextn_predict_layers)
 * has a MoE block: L >= first_k_dense_replace and L % moe_layer_freq == 0. */
int mcfg_is_moe_layer(const mcfg *c, int layer);

/* Fills out[0 .. qk_rope_head_dim/2) with the rotary inverse frequencies:
 * base^(-2i/d), blended toward base^(-2i/d)/factor over the YaRN ramp. */
void mcfg_rope_inv_freq(const mcfg *c, float *out);

const char *mcfg_arch_name(enum mcfg_arch a);      /* "deepseek_v3" */
const char *mcfg_scoring_name(enum mcfg_scoring s); /* "sigmoid" */
const char *mcfg_topk_name(enum mcfg_topk t);       /* "noaux_tc" */

#endif

/*
 * plan_impl.h - shared by the planner's files (plan.c, plan_model.c,
 * plan_cli.c); not a public interface.
 */
#ifndef DS_AGENT_PLAN_IMPL_H
#define DS_AGENT_PLAN_IMPL_H

#include "agent/plan/plan.h"

#include <stddef.h>
#include <stdint.h>

/* The config.json values the planner uses (DeepSeek V2/V3 names). */
typedef struct plan_mcfg {
	char model_type[32];
	int hidden, layers, heads, vocab, inter;
	int kv_lora, rope, nope, v_dim, q_lora;
	int experts, moe_inter, n_shared, top_k, first_dense, moe_freq;
	int max_pos;
	int score_bias; /* topk_method noaux_tc: a f32 e_score_correction_bias per MoE layer */
	int fp8;        /* quantization_config fp8, or F8_* tensors in the files */
	int elem_bytes; /* torch_dtype: 2 (bf16/f16) or 4 */
} plan_mcfg;

enum plan_where {
	PLAN_T_ALL = 0, /* every rank */
	PLAN_T_FIRST,   /* every rank of stage 0 */
	PLAN_T_LAST,    /* every rank of the last stage */
	PLAN_T_LAYER,   /* the ranks of the stage holding `layer` */
	PLAN_T_SKIP,    /* not loaded (MTP layers) */
};

enum plan_split {
	PLAN_S_WHOLE = 0, /* each holder has all of it */
	PLAN_S_STAGE,     /* part l (local index) of n over the stage's tp*ep ranks */
	PLAN_S_EXPERT,    /* held by the ep rank owning `expert`; part tp_rank of n over tp */
};

typedef struct plan_tensor {
	int64_t bytes;
	int64_t n;      /* the split size (heads, rows, moe_intermediate_size, vocab) */
	int layer, expert;
	unsigned char where, split;
} plan_tensor;

typedef struct plan_model {
	plan_mcfg c;
	plan_tensor *t;
	size_t n, cap;
	int64_t total_bytes; /* of the tensors the engine loads */
	int from_files;      /* 1 = safetensors headers, 0 = config.json arithmetic */
	int n_files, files_fp8;
} plan_model;

int plan_model_load(const char *path, plan_model *m, ds_err *err);
/* The tensor list of config c alone (no files): what-if sizing. */
int plan_model_from_config(const plan_mcfg *c, plan_model *m, ds_err *err);
void plan_model_free(plan_model *m);
int plan_layer_is_moe(const plan_mcfg *c, int L);

#endif

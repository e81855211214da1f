/*
 * plan_impl.h - shared by the planner's files (plan.c, plan_model.c,
 * plan_cli.c); not a public interface.
 */
#ifndef DS_AGENT_PLAN_IMPL_H
#define DS_AGENT_PLAN_IMPL_H

#include "agent/plan/plan.h"

#include <stddef.h>
#include <stdint.h>

/* The engine's graph a model runs on. */
enum plan_arch {
	PLAN_ARCH_MLA = 0, /* deepseek.c: DeepSeek V2/V3 (config.json, or GGUF deepseek2) */
	PLAN_ARCH_LLAMA,   /* llama.c: GQA attention, dense MLP (GGUF llama) */
};

/* The model values the planner uses (DeepSeek V2/V3 config.json names; a
 * GGUF's metadata mapped onto them). */
typedef struct plan_mcfg {
	char model_type[32]; /* config.json model_type, or the GGUF's general.architecture */
	int arch;            /* enum plan_arch */
	int hidden, layers, heads, vocab, inter;
	int kv_lora, rope, nope, v_dim, q_lora;   /* MLA */
	int kv_heads, head_dim, tied;             /* Llama: KV heads, head size, head = embedding */
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
	PLAN_T_SKIP,    /* not loaded (MTP layers, a kv_b form the engine does not use) */
	/* every rank of the last stage unless it is stage 0 too: a tied head's
	 * own copy of embedding rows (stage 0 reads the rows it holds); a copy,
	 * so not in total_bytes */
	PLAN_T_LAST_OWN,
};

enum plan_split {
	PLAN_S_WHOLE = 0, /* each holder has all of it */
	PLAN_S_STAGE,     /* part l (local index) of n over the stage's tp*ep ranks */
	PLAN_S_EXPERT,    /* held by the ep rank owning `expert`; part tp_rank of n over tp */
	PLAN_S_TP,        /* part tp_rank of n over tp; the ep index replicates (Llama) */
};

/* A part is floor(bytes * count / n) (whole rows of the weight), except a
 * column window (col_unit > 0) of a block-quantized weight that does not
 * fall on its blocks: deepseek.c holds that one in f32 (window_quant_cols),
 * rows * count * col_unit * 4 bytes. */
typedef struct plan_tensor {
	int64_t bytes;
	int64_t n;        /* the split size (heads, rows, moe_intermediate_size, vocab) */
	int64_t rows;     /* a column split: the weight's rows */
	int64_t col_unit; /* a column split: columns per item of n (0 = split by rows) */
	int64_t block;    /* elements per block of its dtype (1 = not block-quantized) */
	int layer, expert;
	unsigned char where, split;
} plan_tensor;

enum plan_source {
	PLAN_SRC_CONFIG = 0,   /* config.json arithmetic (no weight files) */
	PLAN_SRC_SAFETENSORS,  /* safetensors headers */
	PLAN_SRC_GGUF,         /* a GGUF file's metadata and tensor infos */
};

typedef struct plan_model {
	plan_mcfg c;
	plan_tensor *t;
	size_t n, cap;
	int64_t total_bytes; /* of the tensors the engine loads */
	int source;          /* enum plan_source */
	char dtype[16];      /* "bf16", "fp8", "f32"; a GGUF: the type of most bytes ("Q4_1") */
	int n_files, files_fp8;
} plan_model;

/* "safetensors headers" ... (the JSON's weights_source). */
const char *plan_source_name(int source);

int plan_model_load(const char *path, plan_model *m, ds_err *err);
/* The tensor list of config c alone (no files): what-if sizing. */
int plan_model_from_config(const plan_mcfg *c, plan_model *m, ds_err *err);
void plan_model_free(plan_model *m);
int plan_layer_is_moe(const plan_mcfg *c, int L);

/* ---- plan_topo.c: the NCCL topology file of a node NCCL cannot see into ---- */

#define PLAN_TOPO_XML_MAX ((size_t)1 << 20) /* as the launcher's cap on one file */

/* 1 when NCCL's own detection would misplace the GPUs or RDMA devices of GPU
 * node inv (a GPU not on the PCI bus sysfs shows; a GPU or usable RDMA
 * device with a PCI address but no NUMA node on a host with several), with
 * the first reason in why; else 0. */
int plan_topo_hidden(const json_t *inv, char *why, size_t size);

/* The NCCL topology XML of GPU node inv: its GPUs (NVML index, compute
 * capability, NVLinks) and RDMA devices with a usable port, under the CPU of
 * their NUMA node, devices discovery finds at PIX or PXB under a shared
 * bridge.  *out is a new string (free).  Notes (RDMA devices it leaves to
 * NCCL) go to notes.  who names the inventory in messages.  DS_EFORMAT (a
 * bus id or cpulist that does not parse), DS_ERANGE (past
 * PLAN_TOPO_XML_MAX), DS_ENOMEM; *out stays NULL on error. */
int plan_topo_xml(const json_t *inv, const char *who, json_t *notes, char **out, ds_err *err);

#endif

/*
 * plan.h - the shard planner: which rank runs where, holding what, with
 * which NCCL environment (docs/cluster.md "The shard planner").
 *
 *     plan_params p = plan_default_params();
 *     p.inventories = invs;   (json_t * of what `dsagent --discover` prints)
 *     p.addresses = addrs;    (each node's gossip address, or NULL)
 *     p.n_nodes = 2;
 *     p.model_path = "/models/DeepSeek-V3";
 *     plan *pl = NULL;
 *     if (plan_make(&p, &pl, &err) == DS_OK) { json_t *j = plan_to_json(pl); ... }
 *     plan_free(pl);
 *
 * A plan that does not fit the memory is still a plan (plan_fits() == 0): it
 * carries the shortfall in bytes and what would fit.  Errors are for inputs
 * the planner cannot use: a malformed inventory, config or GGUF file (a
 * tensor the engine needs missing or misshapen: DS_EFORMAT), a missing file
 * (DS_ENOTFOUND), an architecture the engine does not run (config.json:
 * DeepSeek V2/V3 only; GGUF: llama and deepseek2) or a tensor type its
 * kernels lack (DS_EUNSUPPORTED), overrides that do not describe the devices
 * or break the engine's limits (DS_EINVAL), DS_ENOMEM.  Layer and expert
 * ranges come from engine/model.h (model_stage_layers, model_split_range) so
 * they agree with what each rank loads.
 *
 * Threading: no global state; one plan per call.
 */
#ifndef DS_AGENT_PLAN_H
#define DS_AGENT_PLAN_H

#include "common/status.h"

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>

#define PLAN_SCHEMA 1
#define PLAN_NODES_MAX 256
#define PLAN_RESERVE_GPU ((int64_t)4 << 30) /* per GPU: CUDA context, activations, NCCL */
#define PLAN_RESERVE_CPU ((int64_t)1 << 30) /* per CPU rank: activations, buffers */
/* Bytes of a KV-cache element as the engine keeps it by default
 * (--kv-cache-dtype auto, docs/engine.md): MLA latent rows in f32, llama
 * K/V in IEEE halves */
#define PLAN_KV_ELEM_BYTES_MLA 4
#define PLAN_KV_ELEM_BYTES_LLAMA 2

typedef struct plan_params {
	json_t *const *inventories; /* [n_nodes] borrowed; node i = inventories[i] */
	const char *const *addresses; /* [n_nodes] or NULL; NULL entry = unknown */
	int n_nodes;
	const char *model_path;  /* directory with config.json (+ *.safetensors), or a .gguf file */
	double mem_fraction;     /* of each device's memory the plan may use; 0.9 */
	int tp, pp, ep;          /* 0 = the planner chooses */
	int max_ctx;             /* 0 = min(max_position_embeddings, 4096), as the engine */
	int64_t reserve_gpu, reserve_cpu; /* workspace kept per device */
} plan_params;

plan_params plan_default_params(void);

typedef struct plan plan;

/* Builds the plan (see the top comment for the errors); *out is freed with
 * plan_free.  On error *out stays NULL. */
int plan_make(const plan_params *p, plan **out, ds_err *err);
void plan_free(plan *pl);

/* 1 when every device holds its weights, reserve and max_ctx of KV. */
int plan_fits(const plan *pl);

/* The plan as JSON (docs/cluster.md "The shard planner"); new reference,
 * NULL on ENOMEM. */
json_t *plan_to_json(const plan *pl);

/* A human-readable summary. */
void plan_print(const plan *pl, FILE *f);

/* `dsagent plan ...` (argv[0] = "plan"): 0 = a plan that fits, 1 = a plan
 * that does not fit (printed with its shortfall), 2 = bad flags or files. */
int plan_main(int argc, char **argv);

#endif

/*
 * model.h - a loaded model and its forward step, whatever the architecture.
 *
 * One step runs a batch of tokens from several sequences, prefill and decode
 * mixed: token i belongs to sequence seq[i] (a row of block_tables) at
 * position pos[i].  The step writes every token's KV rows into the paged
 * cache (the caller reserved the pages: kv_seq_reserve), then each token
 * attends to positions 0..pos[i] of its sequence.  Logits come out for the
 * tokens with want_logits[i] != 0 (all tokens when want_logits is NULL), in
 * batch order, vocab_size floats each.
 *
 * The step struct is plain data so it can be serialised and broadcast to
 * other ranks unchanged (DESIGN.md §5).  model_forward never allocates: every
 * activation buffer is sized at load from max_batch_tokens and max_ctx.
 * Thread rule: one step at a time per model.
 */
#ifndef DS_ENGINE_MODEL_H
#define DS_ENGINE_MODEL_H

#include "common/status.h"
#include "engine/kv.h"

#include <stddef.h>
#include <stdint.h>

typedef struct eng_batch {
	int32_t n_tok;
	const int32_t *tokens;       /* [n_tok] */
	const int32_t *pos;          /* [n_tok] */
	const int32_t *seq;          /* [n_tok] row of block_tables */
	const uint8_t *want_logits;  /* [n_tok] or NULL (= all) */
	int32_t n_seq;
	const int32_t *block_tables; /* [n_seq][max_blocks] page ids */
	int32_t max_blocks;
} eng_batch;

enum model_attn {
	MODEL_ATTN_AUTO = 0,     /* naive for prefill chunks, absorbed for decode */
	MODEL_ATTN_NAIVE = 1,    /* materialised K/V (MLA) */
	MODEL_ATTN_ABSORBED = 2, /* latent form (MLA) */
};

enum model_weights {
	/* the cpu backend copies safetensors weights into huge pages when the
	 * kernel offers transparent huge pages; other backends map the files */
	MODEL_WEIGHTS_AUTO = 0,
	MODEL_WEIGHTS_MMAP = 1, /* always the file mapping (page cache) */
	MODEL_WEIGHTS_HUGE = 2, /* always the huge-page copy */
};

struct msrc;
struct kb_backend;
struct comm_group;

/*
 * A parallel plan (docs/distributed.md).  world = tp * pp * ep ranks; world
 * rank r sits at stage r / (tp*ep), and inside its stage at local index
 * l = r % (tp*ep) = ep_rank * tp + tp_rank.
 *   - pp stages hold contiguous layer ranges (model_stage_layers); the first
 *     holds the embedding, the last the final norm and lm_head (its vocab
 *     split over the stage's tp*ep ranks, gathered).
 *   - inside a stage (vLLM's meaning of TP and EP for the MoE), DeepSeek's
 *     attention and dense / shared-expert MLPs are split over all tp*ep
 *     ranks of the stage (heads; gate/up rows, down columns), each ending in
 *     an all-reduce over the stage group; the routed experts are split as
 *     whole experts over the ep index and each expert's intermediate size
 *     over the tp ranks (model_split_range), and their partial sums with the
 *     shared expert's go through one all-reduce over the stage group.  The
 *     Llama-family graph (no experts) splits over the tp ranks only.
 *   - every rank of a stage holds every token of the step (hidden states
 *     are replicated after each all-reduce).
 */
typedef struct model_plan {
	int tp, pp, ep; /* each >= 1 */
} model_plan;

/* This rank's place in a plan, with the groups it communicates over (made
 * by the rank process; borrowed by the model, which never frees them). */
typedef struct model_rank {
	model_plan plan;
	int rank;                     /* world rank */
	int stage, tp_rank, ep_rank;  /* model_rank_coords(plan, rank) */
	struct comm_group *world;     /* all ranks, world rank order */
	struct comm_group *stage_grp; /* the tp*ep ranks of this stage, local index order */
	struct comm_group *tp_grp;    /* the tp ranks of this stage with this ep_rank */
} model_rank;

/* How model_forward cuts a step into micro-batches for pp stages: at most
 * min(pp, max_parts) parts, cut only where the sequence changes (a
 * sequence's tokens of one step attend to each other, so they stay in one
 * part), about equal in tokens; a step whose sequences are not contiguous
 * stays whole.  Returns the count; cut[i] is the first token of part i and
 * cut[count] = n_tok (cut holds max_parts + 1 entries). */
#define MODEL_MAX_MICRO 64
int model_micro_batches(const eng_batch *b, int pp, int *cut, int max_parts);

/* DS_EINVAL naming the field unless tp, pp, ep >= 1 and the world fits an int. */
int model_plan_check(const model_plan *p, ds_err *err);
int model_plan_world(const model_plan *p);
/* Stage, tp_rank, ep_rank of world rank r (layout above). */
void model_rank_coords(const model_plan *p, int r, int *stage, int *tp_rank, int *ep_rank);
/* Layers [*first, *end) of stage s of pp over n_layers: floor split, the
 * remainder one each to the stages before the last (vLLM's rule: 61 over 2
 * = 31 + 30; 5 over 3 = 2 + 2 + 1). */
void model_stage_layers(int n_layers, int pp, int s, int *first, int *end);
/* Part i of n items over `parts`: floor split, the remainder one each to the
 * first parts.  Used for heads, rows, experts and vocab. */
void model_split_range(int64_t n, int parts, int i, int64_t *first, int64_t *count);

typedef struct model_params {
	const char *path;     /* checkpoint directory or .gguf file (when source is NULL) */
	/* An open model source (engine/source.h), e.g. the one the caller loaded
	 * the tokenizer from: model_load takes its own reference and ignores
	 * path.  NULL: model_load opens path. */
	struct msrc *source;
	/* "auto": the first of cuda, cpu that runs every op the checkpoint needs
	 * (a compiled-in cuda that lacks one is skipped with a log line); "cpu"
	 * or "cuda": that one, or an error naming the op it lacks. */
	const char *backend;
	/* For tests and for callers that already hold a backend instance: used
	 * instead of `backend` after the same support check (against its own
	 * supports_op).  NULL normally. */
	const struct kb_backend *backend_override;
	int threads;          /* 0 = one per core */
	int max_batch_tokens; /* tokens per step */
	int max_ctx;          /* longest sequence; 0 = min(model's, 4096) */
	int max_seqs;         /* sequences with pages at once */
	int page_size;        /* positions per KV page */
	int n_pages;          /* 0 = enough for max_seqs sequences of max_ctx ... */
	size_t kv_bytes;      /* ... but at most this many bytes of KV cache (0 = no cap) */
	/* "auto" (NULL too): llama-family K/V in IEEE halves (llama.cpp's f16
	 * cache), DeepSeek's MLA latent rows in f32; "f32": f32 for both; "f16":
	 * halves, which only the llama-family cache takes. */
	const char *kv_cache_dtype;
	enum model_attn attn;
	enum model_weights weights; /* how safetensors shards are held */
	/* NULL: the whole model on one rank.  Else this rank's slice of the
	 * plan: only its weights are copied out of the checkpoint (never the
	 * rest), and model_forward must be called by every rank of the plan
	 * with the same step; the logits come out on world rank 0 only (other
	 * ranks may pass logits = NULL). */
	const model_rank *rank;
} model_params;

typedef struct model model;

model_params model_default_params(void);
/* Opens the source once (or takes p->source), picks the graph from the
 * architecture it names, lists the ops that graph needs for the dtypes the
 * checkpoint holds, chooses the backend that runs them all (see backend
 * above), then maps the weights and allocates the buffers.  NULL with err
 * filled: the source's errors, DS_EUNSUPPORTED naming the op (and dtype) the
 * requested backend lacks, the loaders' config and tensor errors, DS_ENOMEM. */
model *model_load(const model_params *p, ds_err *err);
void model_free(model *m);

int model_forward(model *m, const eng_batch *b, float *logits, ds_err *err);

/* The checks of a step against the model (token ids, positions, block
 * tables; DS_EINVAL / DS_ERANGE naming the first bad entry) that every
 * forward makes first, before any work or communication: under a plan every
 * rank gives the same answer for the same step, so a step it refuses is
 * refused everywhere and the ranks stay in step. */
int model_check_batch(const model *m, const eng_batch *b, ds_err *err);

/* "auto", "naive" or "absorbed" into *out; DS_EINVAL for anything else
 * (the --attn flag of dsrun and dsagent worker). */
int model_attn_parse(const char *s, enum model_attn *out);

/* Switches the MLA attention form between steps (tests compare them). */
void model_set_attn(model *m, enum model_attn attn);

kv_cache *model_kv(model *m);
int model_vocab_size(const model *m);
int model_max_ctx(const model *m);
int model_max_batch_tokens(const model *m);
int model_eos_ids(const model *m, const int **ids); /* count; ids borrowed */
const char *model_arch_name(const model *m);
/* "cpu" or "cuda": the backend the model runs on. */
const char *model_backend_name(const model *m);
/* Weight bytes copied so far by every model load of this process: a rank
 * reports it while it loads (worker/worker.c).  Any thread. */
uint64_t model_load_bytes(void);
size_t model_weight_bytes(const model *m);  /* bytes of the checkpoint's tensors used */
size_t model_extra_bytes(const model *m);   /* bytes the engine allocated beside them */
/* Seconds this rank spent inside collectives and stage transfers since
 * load (0 on one rank): the comm_seconds of dsrun --bench --json. */
double model_comm_seconds(const model *m);

#endif

/*
 * model_impl.h - what every architecture shares behind engine/model.h.
 *
 * An architecture's model struct starts with `struct model base` and fills its
 * fields and ops at load; model.c answers the getters from the base and calls
 * the ops.  Private to engine/ (model.c, deepseek.c, llama.c).
 */
#ifndef DS_ENGINE_MODEL_IMPL_H
#define DS_ENGINE_MODEL_IMPL_H

#include "engine/model.h"
#include "engine/source.h"
#include "kernels/backend.h"

#define MODEL_MAX_EOS 8

/* A graph gives embed, layers and head; model.c runs them as one step, or
 * under a plan as a pipeline of micro-batches (model_forward).  A model that
 * is not a local graph (the distributed driver) gives forward instead and
 * leaves the three parts NULL. */
typedef struct model_ops {
	int (*forward)(model *m, const eng_batch *b, float *logits, ds_err *err);
	/* first stage: x[t] = embedding of b->tokens[t] */
	int (*embed)(model *m, const eng_batch *b, float *x, ds_err *err);
	/* this rank's layers [first_layer, end_layer) on x [n_tok][D] in place
	 * (the tp / stage all-reduces inside) */
	int (*layers)(model *m, const eng_batch *b, float *x, ds_err *err);
	/* last stage: logits of the tokens that want them, in batch order,
	 * from x (which it may overwrite); under a plan the vocab slices are
	 * gathered so that every rank of the last stage gets whole rows */
	int (*head)(model *m, const eng_batch *b, float *x, float *logits, ds_err *err);
	void (*set_attn)(model *m, enum model_attn attn); /* NULL: one attention form */
	void (*free)(model *m);
} model_ops;

struct model {
	const model_ops *ops;
	const char *arch;          /* "deepseek_v3", "llama", ... (static string) */
	const kb_backend *be;
	msrc *src;                 /* one reference, released by model_free */
	kv_cache *kv;
	int vocab_size;
	int64_t ctx, bt;           /* max context, max tokens per step */
	int n_eos;
	int eos_ids[MODEL_MAX_EOS];
	size_t weight_bytes;       /* checkpoint tensor bytes */
	size_t extra_bytes;        /* engine allocations beside them */
	/* the plan (a one-rank plan, tp = pp = ep = 1 and NULL groups, when
	 * model_params.rank is NULL) and what this rank holds of it */
	model_rank rank;
	int n_layers;              /* the model's decoder layers */
	int first_layer, end_layer; /* this stage's [first, end) */
	int64_t D;                 /* hidden size: rows of x passed between stages */
	float *x;                  /* [bt][D] the graph's hidden states (stage transfers) */
	float *mb_logits;          /* [bt][vocab] last stage under pp > 1 (model.c) */
	double comm_seconds;       /* model_comm_time adds to it */
};

/* A Linear weight W [n][k] as the checkpoint stores it (borrowed from the
 * mapping); scale/scale_stride/block only for FP8 block scales. */
typedef struct model_weight {
	const void *w;
	const float *scale;
	enum kb_dtype type;
	int64_t n, k, scale_stride, block;
} model_weight;

/* The kb_matmul_args of y[M][n] (+)= x[M][k] W^T (for kb_matmul_multi
 * with products of other x). */
kb_matmul_args model_matmul_args(const model_weight *w, const float *x, int64_t x_stride, float *y,
				 int64_t y_stride, int64_t M, int accumulate);
/* y[M][n] (+)= x[M][k] W^T through be->matmul; M = 0 is a no-op. */
int model_linear(const kb_backend *be, const model_weight *w, const float *x, int64_t x_stride,
		 float *y, int64_t y_stride, int64_t M, int accumulate);
/* n products of the same x (each y[i], y_stride[i], w[i]) through
 * kb_matmul_multi: one job on the CPU for a decode row, else n model_linear. */
int model_linear_multi(const kb_backend *be, const model_weight *const *w, int n, const float *x,
		       int64_t x_stride, float *const *y, const int64_t *y_stride, int64_t M);

/* calloc that adds the bytes to *counter (a model's extra_bytes): host
 * memory the graph's C code reads (f32 copies of norms, bookkeeping). */
void *model_calloc(size_t *counter, size_t n, size_t size);
/* n * size bytes of activation memory from the backend's allocator
 * (kb_alloc: device memory on a device backend), added to *counter; freed
 * with kb_release.  Not zeroed: every activation is written before it is
 * read within a step. */
void *model_act_alloc(const kb_backend *be, size_t *counter, size_t n, size_t size);

/* The ops a graph needs for one checkpoint, deduplicated, in the order added
 * (the support check names the first one a backend lacks, so the graphs add
 * the products first). */
typedef struct model_needs {
	int n;
	kb_op_need v[KB_OP_COUNT * KB_DTYPE_COUNT];
} model_needs;
void model_needs_add(model_needs *nd, enum kb_op op, enum kb_dtype dtype);
/* The weights' part of a graph's needs: for every tensor of src in the
 * decoder layers below n_layers, other than the embedding table `embed` and
 * FP8 scale grids (*_scale_inv), a product on each 2-D weight's dtype (then
 * whatever extra(src, t, nd) adds for that weight, when extra is not NULL)
 * into nd, and a conversion (dequant) of each vector into conv.  The caller
 * adds its other ops to nd, then conv's (model_needs_append), so that
 * products come first. */
int model_needs_scan(msrc *src, int n_layers, const char *embed, model_needs *nd,
		     model_needs *conv,
		     void (*extra)(msrc *src, const msrc_tensor *t, model_needs *nd), ds_err *err);
void model_needs_append(model_needs *nd, const model_needs *more);
/* How to hold safetensors shards on backend be: p->weights, with AUTO meaning
 * huge-page copies on the cpu backend when the kernel offers them, else the
 * file mapping. */
enum ds_map_mode model_weights_mode(const model_params *p, const kb_backend *be);
/* Layer index of a tensor name "blk.L." (GGUF) or "model.layers.L." (HF);
 * -1 for a tensor outside the layers. */
int model_tensor_layer(const char *name);
/* The backend that runs every need: p->backend_override (checked against its
 * own supports_op), else eng_backend_pick(p->backend); sets its thread
 * count.  NULL with err naming the missing op. */
const kb_backend *model_backend_choose(const model_params *p, const msrc *src, const model_needs *nd,
				       ds_err *err);
/* KV pages to allocate: p->n_pages when set; else enough for max_seqs
 * sequences of ctx positions, capped by p->kv_bytes when that is set (at
 * least one sequence's worth). kp gives the layer count, row and page size. */
int model_kv_pages(const model_params *p, const kv_params *kp, int64_t ctx);
/* The bytes of a KV-cache element from p->kv_cache_dtype: "auto" (or NULL)
 * is f16 (2) for a cache the graph can hold in halves (f16_ok), else f32
 * (4); "f16" where the graph cannot (what names the cache) and any other
 * word are DS_EINVAL naming it. */
int model_kv_elem_bytes(const model_params *p, const char *what, int f16_ok, int *bytes, ds_err *err);

/* Architecture loaders (model.c picks one from the source's architecture).
 * They read everything through src (never the path again), choose the
 * backend with model_backend_choose before weights are held, and keep a
 * reference to src in base.src. */
model *deepseek_model_load(const model_params *p, msrc *src, ds_err *err);
model *llama_model_load(const model_params *p, msrc *src, ds_err *err);

/* Fills m's plan fields from p (p->rank, or the one-rank plan when NULL):
 * rank, n_layers, first_layer / end_layer of this stage, D.  DS_EINVAL when
 * the rank's coordinates or its groups' sizes disagree with the plan, or
 * when the plan has more stages than layers. */
int model_base_plan(model *m, const model_params *p, int n_layers, int64_t D, ds_err *err);

/* Under a plan: 1 when this rank has a part of the plan, so the graph
 * communicates (tp > 1 or ep > 1 inside a stage). */
int model_is_split(const model *m);
/* The collectives a graph calls under a plan, timed into comm_seconds; a
 * NULL group or a group of one rank is a no-op.  f32 sum in place. */
int model_all_reduce(model *m, struct comm_group *g, float *buf, int64_t count, ds_err *err);
int model_all_gather(model *m, struct comm_group *g, const float *send, float *recv, int64_t count,
		     ds_err *err);

/* An owned copy of a window of a weight as stored: rows [row0, row0+rows)
 * and columns [col0, col0+cols) of w [n][k] (a graph's view into the
 * checkpoint, which stays untouched outside the window: the copy reads the
 * mapping in chunks and drops each chunk's pages from the process after it,
 * and all of w's pages at the end, so peak memory is the copy plus one
 * chunk).  Block dtypes (GGUF) need col0
 * and cols on the block; FP8 block-scaled weights copy their scale grid's
 * matching window, and a window that does not start on a scale block is
 * dequantized to f32 (exact: an e4m3 code times its f32 scale).  *out gets
 * the copy, *owned what to free (free()), and *counter the bytes. */
int model_weight_window(const kb_backend *be, const model_weight *w, int64_t row0, int64_t rows,
			int64_t col0, int64_t cols, model_weight *out, void **owned,
			size_t *counter, ds_err *err);
/* An owned copy of n bytes at p (a replicated tensor under a plan), read the
 * same way; NULL on allocation failure. */
void *model_copy_bytes(const void *p, size_t n, size_t *counter);


#endif

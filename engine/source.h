/*
 * source.h - a model source: the checkpoint opened once, for everything that
 * reads it (the architecture choice, the graph's loader, the tokenizer).
 *
 *     ds_err err = {0};
 *     msrc *s = msrc_open("models/default.gguf", &err);   // or a checkpoint directory
 *     tok *t = eng_tok_load_source(s, &err);                // engine.h
 *     model_params p = model_default_params();
 *     p.source = s;                                         // model_load takes a reference
 *     model *m = model_load(&p, &err);
 *     msrc_unref(s);                                        // the model keeps its own
 *
 * Two kinds:
 *   MSRC_GGUF  a .gguf file: metadata, tensors and tokenizer in one mapping
 *              (gguf_open, at msrc_open).
 *   MSRC_HF    a Hugging Face directory: config.json read whole under
 *              MCFG_MAX_FILE_BYTES and parsed at msrc_open (absent or
 *              unusable: msrc_config reports it to the loaders; a
 *              tokenizer-only directory still opens),
 *              the safetensors index and shard headers opened on first use
 *              (msrc_tensors) with the shards mapped from the page cache;
 *              msrc_hold_weights switches them to huge-page copies once the
 *              backend is known (the cpu backend's choice).
 *
 * Per-rank slice loading belongs here (the distributed-engine issue): tensor
 * parallelism's column/row slices of a Linear weight, expert parallelism's
 * subset of routed experts, pipeline parallelism's layer range.  A rank's
 * loader will ask the source for the rows/columns/experts/layers it holds,
 * and the source will map or copy only those bytes; the graphs keep asking
 * by tensor name and shape as they do now.
 *
 * Lifetime: reference counted.  msrc_open returns one reference; a model
 * holds its own from model_load to model_free.  Every pointer a getter
 * returns is borrowed from the source and valid while a reference is held.
 * Thread rule: open, msrc_tensors and msrc_hold_weights on one thread (model
 * load); afterwards the source is read-only and any thread may read it;
 * msrc_ref / msrc_unref are atomic.
 */
#ifndef DS_ENGINE_SOURCE_H
#define DS_ENGINE_SOURCE_H

#include "common/fileutil.h"
#include "common/status.h"
#include "kernels/backend.h"

#include <stddef.h>

struct gguf_file;
struct st_model;
struct json_t;

enum msrc_kind {
	MSRC_GGUF = 0,
	MSRC_HF = 1,
};

typedef struct msrc msrc;

/* path: a .gguf file or a checkpoint directory.  NULL with err filled:
 * gguf_open's errors for a file; DS_ENOTFOUND / DS_EINVAL when path is
 * neither a directory nor a .gguf file; DS_ENOMEM.  config.json's own
 * errors (missing, over the cap, bad JSON; naming the file) come from
 * msrc_config. */
msrc *msrc_open(const char *path, ds_err *err);
msrc *msrc_ref(msrc *s);   /* returns s */
void msrc_unref(msrc *s);  /* NULL is a no-op; the last one closes */

enum msrc_kind msrc_kind(const msrc *s);
const char *msrc_path(const msrc *s);
/* The architecture named by the checkpoint: GGUF general.architecture
 * ("llama", "deepseek2"), HF config.json model_type ("llama",
 * "deepseek_v3"...); "" when it names none. */
const char *msrc_arch(const msrc *s);

/* GGUF only (NULL for MSRC_HF). */
struct gguf_file *msrc_gguf(const msrc *s);

/* MSRC_HF: the parsed config.json (a JSON object) and its path; else the
 * error kept from msrc_open (DS_ENOTFOUND, DS_ERANGE over the cap,
 * DS_EFORMAT...), naming the file. */
int msrc_config(const msrc *s, const struct json_t **root, const char **path, ds_err *err);

/* MSRC_HF: the safetensors checkpoint, opened on the first call (index and
 * headers validated, shards mapped from the page cache); NULL with err filled
 * as st_open.  NULL with DS_EINVAL for a GGUF source. */
struct st_model *msrc_tensors(msrc *s, ds_err *err);

/* MSRC_HF: hold the shards as mode says (st_remap) before any tensor data is
 * used; a no-op for GGUF (its mapping is the page cache's). */
int msrc_hold_weights(msrc *s, enum ds_map_mode mode, ds_err *err);

/* One tensor of the checkpoint, whatever the kind, for the graphs' lists of
 * needed ops: name, dtype (KB_DTYPE_COUNT when the kernels lack it) and
 * dimension count.  MSRC_HF opens the tensors (msrc_tensors) first. */
typedef struct msrc_tensor {
	const char *name;
	enum kb_dtype dtype;
	int n_dims;
} msrc_tensor;

/* Count of tensors (0 with err filled when the tensors cannot be opened). */
size_t msrc_tensor_count(msrc *s, ds_err *err);
/* Tensor i < msrc_tensor_count, in file order. */
msrc_tensor msrc_tensor_at(const msrc *s, size_t i);
/* The dtype of the named tensor, or KB_DTYPE_COUNT when absent. */
enum kb_dtype msrc_tensor_dtype(const msrc *s, const char *name);

/* Bytes of the tensors (model_weight_bytes). */
size_t msrc_tensor_bytes(const msrc *s);

#endif

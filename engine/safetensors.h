/*
 * safetensors.h - read-only access to a Hugging Face safetensors checkpoint.
 *
 *     ds_err err = {0};
 *     st_model *m = st_open("models/DeepSeek-V3", &err);   // dir with the shards
 *     int64_t shape[2] = {1536, 7168};
 *     const st_tensor *w = st_get(m, "model.layers.0.self_attn.q_a_proj.weight",
 *                                 KB_F8_E4M3, 2, shape, &err);
 *     ... w->data points into its shard's bytes ...
 *     st_close(m);
 *
 * A checkpoint directory holds either `model.safetensors` or
 * `model.safetensors.index.json` ({"weight_map": {tensor: shard file}}) plus
 * the shards it names.  Every shard is held read-only once: mapped
 * (st_open, DS_MAP_FILE), or read into huge pages (st_open_mode with
 * DS_MAP_HUGE_COPY; the model loader's choice on the cpu backend, see
 * common/fileutil.h).  Tensor data is row-major, PyTorch
 * Linear weights are [out_features][in_features].
 *
 * Everything read from the files is validated at st_open (header bounds, JSON,
 * dtype/shape/offsets of every tensor, index against shards) and reported with
 * the file's path; a corrupt file is an error, never a crash.
 *
 * Lifetime: every pointer returned (tensors, names, data) is borrowed from the
 * st_model and valid until st_close.  Thread rule: st_open/st_close by one
 * thread; after st_open every other function is read-only and may be called
 * from any number of threads at once.
 */
#ifndef DS_ENGINE_SAFETENSORS_H
#define DS_ENGINE_SAFETENSORS_H

#include "common/fileutil.h"
#include "common/status.h"
#include "kernels/backend.h"

#include <stddef.h>
#include <stdint.h>

#define ST_MAX_DIMS 8
#define ST_MAX_HEADER_BYTES (100u << 20) /* per shard header */
/* model.safetensors.index.json, read whole (ds_file_read_all): DeepSeek-V3's
 * lists ~92k tensors in ~9 MiB; a larger file is refused (DS_ERANGE, naming
 * the file and this cap), never truncated */
#define ST_MAX_INDEX_BYTES (100u << 20)

/* st_tensor.dtype of a tensor whose dtype the kernels do not support (I64,
 * U8, BOOL, F64, F8_E5M2, unknown strings...; dtype_name says which).  Such
 * tensors are listed and iterable; st_get refuses them. */
#define ST_DTYPE_NONE KB_DTYPE_COUNT
/* st_get's dtype argument: accept any supported dtype. */
#define ST_DTYPE_ANY KB_DTYPE_COUNT

typedef struct st_tensor {
	const char *name;
	enum kb_dtype dtype;    /* ST_DTYPE_NONE when unsupported */
	const char *dtype_name; /* as written in the header: "BF16", "F8_E4M3", "I64"... */
	int n_dims;             /* 0 (scalar) .. ST_MAX_DIMS */
	int64_t shape[ST_MAX_DIMS];
	const void *data;       /* into the shard's mmap; alignment is whatever the file gives */
	size_t nbytes;          /* data_offsets end - begin */
	int shard;              /* index of the shard file (0 .. st_shard_count - 1) */
} st_tensor;

typedef struct st_model st_model;

/* Opens the checkpoint in directory dir (the index is preferred when both
 * files exist).  NULL with err filled: DS_ENOTFOUND (directory, index, shard
 * missing), DS_EIO, DS_EFORMAT (corrupt header/index, tensor listed in the
 * index but absent from its shard, duplicate tensor), DS_ENOMEM. */
st_model *st_open(const char *dir, ds_err *err);
/* The same with the shards held as mode says (st_open: DS_MAP_FILE). */
st_model *st_open_mode(const char *dir, enum ds_map_mode mode, ds_err *err);
void st_close(st_model *m); /* NULL is a no-op */

/* Holds the shards as mode says from now on (e.g. the file mapping st_open
 * made, copied into huge pages once the backend is known); every st_tensor's
 * data moves with them.  Call it before any data pointer is taken.  DS_OK
 * when already so; else the errors of ds_file_map, with the shard already
 * switched kept switched (each tensor stays valid). */
int st_remap(st_model *m, enum ds_map_mode mode, ds_err *err);

/* O(1) lookup; NULL when absent.  May return an ST_DTYPE_NONE tensor. */
const st_tensor *st_find(const st_model *m, const char *name);

/* Lookup plus validation.  dtype: the required dtype or ST_DTYPE_ANY (any
 * supported one).  n_dims < 0 skips the shape check; otherwise the tensor must
 * have n_dims dimensions and shape[i] unless shape[i] < 0 (any size).
 * NULL with err filled: DS_ENOTFOUND, DS_EUNSUPPORTED (dtype the kernels lack),
 * DS_EFORMAT (dtype or shape differs), e.g.
 *   "tensor model.norm.weight: expected shape [7168], found [7167]". */
const st_tensor *st_get(const st_model *m, const char *name, enum kb_dtype dtype, int n_dims,
			const int64_t *shape, ds_err *err);

/* An FP8 block-quantized Linear weight and its scale: `name` must be
 * F8_E4M3 [n][k] and `name` + "_scale_inv" F32 [ceil(n/block)][ceil(k/block)]
 * (W[i][j] = fp8(w[i][j]) * scale[i/block][j/block]; the scale may live in
 * another shard).  Returns the weight and sets *scale; NULL with err filled
 * as st_get. */
const st_tensor *st_get_fp8(const st_model *m, const char *name, int64_t n, int64_t k,
			    int64_t block, const st_tensor **scale, ds_err *err);

/* Iteration in header order, shard by shard: i < st_count. */
size_t st_count(const st_model *m);
const st_tensor *st_at(const st_model *m, size_t i);

size_t st_total_bytes(const st_model *m); /* sum of tensor nbytes */
size_t st_file_bytes(const st_model *m);  /* sum of shard file sizes */
int st_shard_count(const st_model *m);
/* "dir/model-00001-of-000163.safetensors"; NULL when out of range. */
const char *st_shard_path(const st_model *m, int shard);

/* "F32", "F16", "BF16", "F8_E4M3" ("?" otherwise). */
const char *st_dtype_name(enum kb_dtype t);

#endif

/*
 * gguf.h - read-only access to a GGUF file (llama.cpp's single-file model format).
 *
 *     ds_err err = {0};
 *     gguf_file *g = gguf_open("SmolLM2-135M-Instruct.Q4_1.gguf", &err);
 *     uint32_t n_layer;
 *     gguf_get_u32(g, "llama.block_count", &n_layer, &err);
 *     int64_t shape[2] = {49152, 576};                   // row-major, like PyTorch
 *     const gguf_tensor *e = gguf_get_tensor(g, "token_embd.weight", KB_Q8_0, 2, shape, &err);
 *     ... e->data points into the mmap of the file ...
 *     gguf_close(g);
 *
 * File layout (versions 2 and 3; all little-endian):
 *   "GGUF"  u32 version  u64 n_tensors  u64 n_kv
 *   n_kv x      { string key, u32 value type, value }
 *   n_tensors x { string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset }
 *   padding to `general.alignment` (u32, a power of two; default 32)
 *   data section: tensor i at data start + offset (a multiple of the alignment)
 * A string is u64 length + bytes (no NUL); an array is u32 element type + u64
 * count + elements (arrays of arrays are allowed, nested at most
 * GGUF_MAX_ARRAY_DEPTH deep).  ne[0] is the innermost (contiguous) dimension;
 * gguf_tensor.shape lists the dimensions the other way round (row-major), so a
 * Linear weight of ne = {in, out} has shape {out, in}.
 *
 * Everything is validated at gguf_open (counts and lengths against the file
 * size, value types, duplicate keys and tensor names, dimensions and byte
 * sizes of every tensor against its type's block, alignment, data inside the
 * file) and reported with the file's path; a corrupt file is an error, never
 * a crash.  Tensors of a ggml type the kernels lack (Q5_0, IQ*, I32 ...) are
 * listed with dtype GGUF_DTYPE_NONE; gguf_get_tensor refuses them.
 *
 * Lifetime: every pointer returned (keys, strings, array elements, tensors,
 * data) is borrowed from the gguf_file and valid until gguf_close.  Scalar
 * string values and keys are NUL-terminated copies; strings inside arrays
 * point into the mapping and are NOT NUL-terminated (use the length).
 * Thread rule: gguf_open/gguf_close by one thread; in between every function
 * is read-only and may be called from any number of threads at once.
 */
#ifndef DS_ENGINE_GGUF_H
#define DS_ENGINE_GGUF_H

#include "common/status.h"
#include "kernels/backend.h"

#include <stddef.h>
#include <stdint.h>

#define GGUF_MAX_DIMS 4          /* ggml's GGML_MAX_DIMS */
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_ARRAY_DEPTH 8   /* arrays of arrays of ... */

/* gguf_tensor.dtype of a ggml type the kernels do not support; and
 * gguf_get_tensor's "any supported dtype". */
#define GGUF_DTYPE_NONE KB_DTYPE_COUNT
#define GGUF_DTYPE_ANY KB_DTYPE_COUNT

/* Metadata value types, numbered as in the file. */
enum gguf_type {
	GGUF_TYPE_U8 = 0,
	GGUF_TYPE_I8 = 1,
	GGUF_TYPE_U16 = 2,
	GGUF_TYPE_I16 = 3,
	GGUF_TYPE_U32 = 4,
	GGUF_TYPE_I32 = 5,
	GGUF_TYPE_F32 = 6,
	GGUF_TYPE_BOOL = 7,
	GGUF_TYPE_STRING = 8,
	GGUF_TYPE_ARRAY = 9,
	GGUF_TYPE_U64 = 10,
	GGUF_TYPE_I64 = 11,
	GGUF_TYPE_F64 = 12,
	GGUF_TYPE_COUNT
};

/* "u8", "i32", "string", "array" ... ("?" otherwise). */
const char *gguf_type_name(enum gguf_type t);

typedef struct gguf_tensor {
	const char *name;
	enum kb_dtype dtype;      /* GGUF_DTYPE_NONE when the kernels lack the type */
	uint32_t ggml_type;       /* as in the file: 0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 8 Q8_0,
				   * 12 Q4_K, 13 Q5_K, 14 Q6_K, 30 BF16 ... */
	const char *type_name;    /* "Q4_1", "IQ2_XXS", or "unknown-N" for an id unknown here */
	int n_dims;               /* 0 .. GGUF_MAX_DIMS */
	int64_t shape[GGUF_MAX_DIMS]; /* row-major: shape[n_dims - 1] = ne[0] */
	int64_t ne[GGUF_MAX_DIMS];    /* ggml order (ne[0] innermost); unused dims are 1 */
	const void *data;         /* into the mapping, aligned to gguf_alignment from its start */
	size_t nbytes;            /* rows x row bytes; 0 for a type id unknown here */
	uint64_t offset;          /* from the start of the data section */
} gguf_tensor;

typedef struct gguf_file gguf_file;

/* Opens and validates path.  NULL with err filled: DS_ENOTFOUND, DS_EIO,
 * DS_EFORMAT (bad magic, truncated, a count, length, type, offset or size
 * that does not fit the file; the message names the file and what was being
 * read), DS_EUNSUPPORTED (GGUF version 1, a version above 3, a big-endian
 * file), DS_ENOMEM. */
gguf_file *gguf_open(const char *path, ds_err *err);
void gguf_close(gguf_file *g); /* NULL is a no-op */

const char *gguf_path(const gguf_file *g);
uint32_t gguf_version(const gguf_file *g);
uint32_t gguf_alignment(const gguf_file *g);
size_t gguf_data_offset(const gguf_file *g); /* file offset of the data section */
/* The whole read-only mapping (for madvise, uploads, bounds checks). */
const void *gguf_mapping(const gguf_file *g, size_t *size);

/* ---- metadata ---------------------------------------------------------------- */

size_t gguf_kv_count(const gguf_file *g);
/* Key and value type of entry i (file order); NULL / GGUF_TYPE_COUNT when out of range. */
const char *gguf_kv_key(const gguf_file *g, size_t i);
enum gguf_type gguf_kv_type(const gguf_file *g, size_t i);
/* Index of key, or -1. */
int64_t gguf_find_key(const gguf_file *g, const char *key);

/* Typed getters: 0 and *out set, or DS_ENOTFOUND (key absent: callers with a
 * default test for it) / DS_EFORMAT (another type; the message names both),
 * *out untouched. */
int gguf_get_u8(const gguf_file *g, const char *key, uint8_t *out, ds_err *err);
int gguf_get_i8(const gguf_file *g, const char *key, int8_t *out, ds_err *err);
int gguf_get_u16(const gguf_file *g, const char *key, uint16_t *out, ds_err *err);
int gguf_get_i16(const gguf_file *g, const char *key, int16_t *out, ds_err *err);
int gguf_get_u32(const gguf_file *g, const char *key, uint32_t *out, ds_err *err);
int gguf_get_i32(const gguf_file *g, const char *key, int32_t *out, ds_err *err);
int gguf_get_u64(const gguf_file *g, const char *key, uint64_t *out, ds_err *err);
int gguf_get_i64(const gguf_file *g, const char *key, int64_t *out, ds_err *err);
int gguf_get_f32(const gguf_file *g, const char *key, float *out, ds_err *err);
int gguf_get_f64(const gguf_file *g, const char *key, double *out, ds_err *err);
int gguf_get_bool(const gguf_file *g, const char *key, int *out, ds_err *err);
/* *out is NUL-terminated; *len (when not NULL) counts the bytes (the value
 * may hold NULs). */
int gguf_get_str(const gguf_file *g, const char *key, const char **out, size_t *len, ds_err *err);

/* Lenient getters for values that converters write with different types:
 * any integer type (or bool) inside [min, max]; any of f32/f64 (or an integer).
 * DS_ERANGE when the value is outside [min, max]. */
int gguf_get_int(const gguf_file *g, const char *key, int64_t min, int64_t max, int64_t *out,
		 ds_err *err);
int gguf_get_float(const gguf_file *g, const char *key, double *out, ds_err *err);

/* An array value.  The fields are read-only for callers. */
typedef struct gguf_arr {
	const gguf_file *g;
	enum gguf_type type; /* element type */
	uint64_t n;          /* elements */
	const void *data;    /* fixed-size elements: n packed little-endian values (unaligned) */
	size_t first;        /* private: strings and arrays, index of element 0's record */
} gguf_arr;

/* The array at key; elem is the required element type or GGUF_TYPE_COUNT (any).
 * DS_ENOTFOUND, DS_EFORMAT (not an array, or another element type). */
int gguf_get_arr(const gguf_file *g, const char *key, enum gguf_type elem, gguf_arr *out,
		 ds_err *err);

/* Element accessors.  An index out of range or an accessor that does not fit
 * the element type is the caller's bug: they return 0 / NULL. */
/* Integer and bool elements (u64 above INT64_MAX wraps: use gguf_arr_u64). */
int64_t gguf_arr_i64(const gguf_arr *a, uint64_t i);
uint64_t gguf_arr_u64(const gguf_arr *a, uint64_t i);
/* f32 / f64 elements (and integers, converted). */
double gguf_arr_f64(const gguf_arr *a, uint64_t i);
/* String element: into the mapping, NOT NUL-terminated; *len its bytes. */
const char *gguf_arr_str(const gguf_arr *a, uint64_t i, size_t *len);
/* Nested array element; 0 or DS_EINVAL (not an array of arrays / out of range). */
int gguf_arr_arr(const gguf_arr *a, uint64_t i, gguf_arr *out);

/* ---- tensors ------------------------------------------------------------------- */

size_t gguf_tensor_count(const gguf_file *g);
const gguf_tensor *gguf_tensor_at(const gguf_file *g, size_t i); /* file order; NULL past the end */
/* O(1) lookup; NULL when absent.  May return a GGUF_DTYPE_NONE tensor. */
const gguf_tensor *gguf_find_tensor(const gguf_file *g, const char *name);
/* Lookup plus validation, as st_get: dtype required (or GGUF_DTYPE_ANY: any
 * supported one); n_dims < 0 skips the shape check, else the row-major shape
 * must match where shape[i] >= 0.  NULL with err filled: DS_ENOTFOUND,
 * DS_EUNSUPPORTED (a type the kernels lack, named), DS_EFORMAT (other dtype
 * or shape, both named). */
const gguf_tensor *gguf_get_tensor(const gguf_file *g, const char *name, enum kb_dtype dtype,
				   int n_dims, const int64_t *shape, ds_err *err);

size_t gguf_total_bytes(const gguf_file *g); /* sum of tensor nbytes */
size_t gguf_file_bytes(const gguf_file *g);

/* ggml type ids: the kernel dtype of one (GGUF_DTYPE_NONE if unsupported or
 * unknown), its name ("?" if unknown), and the ggml id of a kernel dtype (-1
 * for F8_E4M3, which GGUF does not have). */
enum kb_dtype gguf_ggml_to_dtype(uint32_t ggml_type);
const char *gguf_ggml_type_name(uint32_t ggml_type);
int gguf_dtype_to_ggml(enum kb_dtype t);

#endif

/*
 * backend.h - the only place that computes.
 *
 * A backend is a struct of function pointers over plain-old-data argument
 * structs (pointers, sizes, strides).  Kernels own nothing and allocate
 * nothing: buffers come from the backend's own alloc, so the CUDA backend can
 * replace the CPU one without the engine noticing.  Every op has a scalar
 * reference in kernels/cpu; SIMD and CUDA versions are tested against it by
 * tests/conformance on random inputs.
 *
 * Depends on common/ only; includes nothing from engine/ or agent/.
 */
#ifndef DS_KERNELS_BACKEND_H
#define DS_KERNELS_BACKEND_H

#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w[:]   for r < rows.
 * x: [rows][dim] with row stride x_stride (elements); out likewise; w: [dim].
 * out may alias x (in place) when the strides are equal. */
typedef struct kb_rmsnorm_args {
	float *out;
	const float *x;
	const float *w;
	int64_t rows, dim;
	int64_t x_stride, out_stride;
	float eps;
} kb_rmsnorm_args;

typedef struct kb_backend {
	const char *name;                 /* "cpu", "cuda" */
	const char *(*describe)(void);    /* e.g. "avx512" or "NVIDIA H100 (sm_90)" */
	/* Device memory (host memory for the CPU backend). */
	void *(*alloc)(size_t bytes);
	void (*release)(void *p);
	int (*upload)(void *dst, const void *src, size_t bytes);
	int (*download)(void *dst, const void *src, size_t bytes);
	int (*sync)(void);
	/* Ops; each returns 0 or a negative DS_E* code. */
	int (*rmsnorm)(const kb_rmsnorm_args *a);
} kb_backend;

/* Backends compiled into this binary (available or not). */
int kb_backend_count(void);
const char *kb_backend_name_at(int i);

/* The backend by name ("cpu", "cuda"), or NULL with err saying why it is
 * absent (not compiled in, no device).  Borrowed for the process lifetime. */
const kb_backend *kb_backend_get(const char *name, ds_err *err);

#ifdef __cplusplus
}
#endif

#endif

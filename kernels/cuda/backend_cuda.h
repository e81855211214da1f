/*
 * backend_cuda.h - the CUDA backend's entry point (C linkage).
 *
 * kcu_backend probes the driver once; with no GPU or no driver it returns NULL
 * and says why in err (DS_ENODEV), which callers treat as "skip", not failure.
 */
#ifndef DS_KERNELS_CUDA_BACKEND_H
#define DS_KERNELS_CUDA_BACKEND_H

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

const kb_backend *kcu_backend(ds_err *err);
/* The op table, answered without a device (kb_backend_supports). */
int kcu_supports_op(enum kb_op op, enum kb_dtype dtype);

#ifdef __cplusplus
}
#endif

#endif

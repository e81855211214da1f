/*
 * backend_cuda.h - the CUDA backend's ops table (C linkage).
 *
 * kb_backend_open("cuda", p) runs its open: with no GPU, no driver or no
 * device p->device it fails with DS_ENODEV and says why, which callers treat
 * as "skip", not failure.  supports_op answers without a device.
 */
#ifndef DS_KERNELS_CUDA_BACKEND_H
#define DS_KERNELS_CUDA_BACKEND_H

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

const kb_backend_ops *kcu_backend_ops(void);

#ifdef __cplusplus
}
#endif

#endif

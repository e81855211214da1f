/*
 * rmsnorm.cuh - RMSNorm on CUDA: one host launcher over kb_rmsnorm_args
 * (device pointers).  One block per row; float accumulation; warp-shuffle
 * reduction.  Matches kc_rmsnorm_ref to relative 1e-5.
 */
#ifndef DS_KERNELS_CUDA_RMSNORM_CUH
#define DS_KERNELS_CUDA_RMSNORM_CUH

#include "kernels/backend.h"

#include <cuda_runtime.h>

int kcu_rmsnorm(const kb_rmsnorm_args *a, cudaStream_t stream);

#endif

/*
 * rmsnorm.cu - RMSNorm kernel and its host launcher (see rmsnorm.cuh).
 * Grid: one block of RMS_THREADS per row.  Each thread strides over the row,
 * squares are summed in float, reduced by warp shuffles then through shared
 * memory; the scale is computed once per row.
 */
#include "kernels/cuda/rmsnorm.cuh"

#define RMS_THREADS 256

__device__ static float warp_sum(float v)
{
	for (int off = 16; off > 0; off >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, off);
	return v;
}

__global__ static void rmsnorm_kernel(float *out, const float *x, const float *w, int64_t dim,
				      int64_t x_stride, int64_t out_stride, float eps)
{
	__shared__ float partial[RMS_THREADS / 32];
	__shared__ float scale;
	const float *xr = x + (int64_t)blockIdx.x * x_stride;
	float *yr = out + (int64_t)blockIdx.x * out_stride;
	float ss = 0.0f;
	for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
		ss += xr[i] * xr[i];
	ss = warp_sum(ss);
	if ((threadIdx.x & 31) == 0)
		partial[threadIdx.x >> 5] = ss;
	__syncthreads();
	if (threadIdx.x < 32) {
		float v = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.0f;
		v = warp_sum(v);
		if (threadIdx.x == 0)
			scale = rsqrtf(v / (float)dim + eps);
	}
	__syncthreads();
	for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
		yr[i] = xr[i] * scale * w[i];
}

int kcu_rmsnorm(const kb_rmsnorm_args *a, cudaStream_t stream)
{
	if (a->rows < 0 || a->dim <= 0)
		return DS_EINVAL;
	if (a->rows == 0)
		return DS_OK;
	if (a->rows > 0x7fffffff)
		return DS_ERANGE;
	rmsnorm_kernel<<<(unsigned)a->rows, RMS_THREADS, 0, stream>>>(
		a->out, a->x, a->w, a->dim, a->x_stride, a->out_stride, a->eps);
	return cudaGetLastError() == cudaSuccess ? DS_OK : DS_EINTERNAL;
}

/*
 * backend_cuda.cu - the CUDA backend's struct of ops (see backend_cuda.h).
 *
 * Probe once: cudaGetDeviceCount; no device = NULL with DS_ENODEV.  All ops
 * run on the default stream of device 0 for now; `sync` waits for it.
 * Thread rule: the probe runs once (pthread_once); ops may be called
 * from one engine thread at a time.
 */
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/rmsnorm.cuh"

#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>

static char g_desc[320];

static const char *cuda_describe(void)
{
	return g_desc;
}

static void *cuda_alloc(size_t bytes)
{
	void *p = NULL;
	return cudaMalloc(&p, bytes ? bytes : 1) == cudaSuccess ? p : NULL;
}

static void cuda_release(void *p)
{
	if (p)
		cudaFree(p);
}

static int cuda_upload(void *dst, const void *src, size_t bytes)
{
	return cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice) == cudaSuccess ? DS_OK : DS_EIO;
}

static int cuda_download(void *dst, const void *src, size_t bytes)
{
	return cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost) == cudaSuccess ? DS_OK : DS_EIO;
}

static int cuda_sync(void)
{
	return cudaDeviceSynchronize() == cudaSuccess ? DS_OK : DS_EINTERNAL;
}

static int cuda_rmsnorm(const kb_rmsnorm_args *a)
{
	return kcu_rmsnorm(a, 0);
}

/* What this backend implements today: rmsnorm only.  Each op added here
 * gets its entry. */
extern "C" int kcu_supports_op(enum kb_op op, enum kb_dtype dtype)
{
	return op == KB_OP_RMSNORM && dtype == KB_F32;
}

static kb_backend g_backend;
static int g_status = DS_OK;
static char g_why[256];

static void probe(void)
{
	int n = 0;
	cudaError_t e = cudaGetDeviceCount(&n);
	if (e != cudaSuccess || n == 0) {
		g_status = DS_ENODEV;
		snprintf(g_why, sizeof g_why, "no CUDA device: %s",
			 e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
		return;
	}
	cudaDeviceProp prop;
	if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
		snprintf(g_desc, sizeof g_desc, "%s (sm_%d%d)", prop.name, prop.major, prop.minor);
	g_backend.name = "cuda";
	g_backend.describe = cuda_describe;
	g_backend.supports_op = kcu_supports_op;
	g_backend.alloc = cuda_alloc;
	g_backend.release = cuda_release;
	g_backend.upload = cuda_upload;
	g_backend.download = cuda_download;
	g_backend.sync = cuda_sync;
	g_backend.rmsnorm = cuda_rmsnorm;
}

extern "C" const kb_backend *kcu_backend(ds_err *err)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;
	pthread_once(&once, probe);
	if (g_status != DS_OK) {
		ds_err_set(err, g_status, "%s", g_why);
		return NULL;
	}
	return &g_backend;
}

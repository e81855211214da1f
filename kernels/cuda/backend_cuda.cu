/*
 * backend_cuda.cu - the CUDA backend's ops table (see backend_cuda.h).
 * Called through kernels/backend.h (kb_backend_open("cuda"), kb_<op>).
 *
 * An instance is one device and one stream of its own, created at open and
 * destroyed at close (priv: struct cuda_inst).  Invariants:
 *  1. Everything an instance does is queued on its stream: kernels, copies
 *     (cudaMemcpyAsync) and, where the device has memory pools,
 *     allocations (cudaMallocAsync / cudaFreeAsync from the device's default
 *     pool, kept cached: release threshold at its maximum).  So a buffer is
 *     usable by every later op of the same instance without a sync.
 *  2. upload and download return once the copy is done (they wait for the
 *     stream), so the host buffer may be reused or read at once; sync waits
 *     for the stream only, never for the whole device.
 *  3. Each call first makes the instance's device current on the calling
 *     thread (cudaSetDevice is cheap), so instances on different devices can
 *     be driven from one thread.
 * Thread rule: one caller at a time per instance (the engine's compute
 * thread); different instances are independent.
 */
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/rmsnorm.cuh"

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

struct cuda_inst {
	int device;
	int async_alloc; /* 1: the device has memory pools (invariant 1) */
	cudaStream_t stream;
	char desc[320];
};

static struct cuda_inst *inst_of(const kb_backend *be)
{
	return (struct cuda_inst *)be->priv;
}

/* Makes the instance's device current (invariant 3). */
static int use_device(const struct cuda_inst *c)
{
	return cudaSetDevice(c->device) == cudaSuccess ? DS_OK : DS_EINTERNAL;
}

static const char *cuda_describe(const kb_backend *be)
{
	return inst_of(be)->desc;
}

static void *cuda_alloc(const kb_backend *be, size_t bytes)
{
	struct cuda_inst *c = inst_of(be);
	void *p = NULL;
	if (use_device(c) != DS_OK)
		return NULL;
	cudaError_t e = c->async_alloc ? cudaMallocAsync(&p, bytes ? bytes : 1, c->stream)
				       : cudaMalloc(&p, bytes ? bytes : 1);
	return e == cudaSuccess ? p : NULL;
}

static void cuda_release(const kb_backend *be, void *p)
{
	struct cuda_inst *c = inst_of(be);
	if (!p || use_device(c) != DS_OK)
		return;
	if (c->async_alloc)
		cudaFreeAsync(p, c->stream);
	else
		cudaFree(p);
}

static int copy(const kb_backend *be, void *dst, const void *src, size_t bytes,
		cudaMemcpyKind kind)
{
	struct cuda_inst *c = inst_of(be);
	if (use_device(c) != DS_OK)
		return DS_EINTERNAL;
	if (cudaMemcpyAsync(dst, src, bytes, kind, c->stream) != cudaSuccess)
		return DS_EIO;
	return cudaStreamSynchronize(c->stream) == cudaSuccess ? DS_OK : DS_EIO;
}

static int cuda_upload(const kb_backend *be, void *dst, const void *src, size_t bytes)
{
	return copy(be, dst, src, bytes, cudaMemcpyHostToDevice);
}

static int cuda_download(const kb_backend *be, void *dst, const void *src, size_t bytes)
{
	return copy(be, dst, src, bytes, cudaMemcpyDeviceToHost);
}

static int cuda_sync(const kb_backend *be)
{
	return cudaStreamSynchronize(inst_of(be)->stream) == cudaSuccess ? DS_OK : DS_EINTERNAL;
}

static int cuda_rmsnorm(const kb_backend *be, const kb_rmsnorm_args *a)
{
	struct cuda_inst *c = inst_of(be);
	if (!a || a->rows < 0 || a->dim <= 0)
		return DS_EINVAL;
	if (a->rows == 0)
		return DS_OK;
	if (!a->out || !a->x || !a->w || a->x_stride < a->dim || a->out_stride < a->dim)
		return DS_EINVAL;
	if (use_device(c) != DS_OK)
		return DS_EINTERNAL;
	return kcu_rmsnorm(a, c->stream);
}

/* What this backend implements today: rmsnorm only.  Each op added here
 * gets its entry. */
static int cuda_supports_op(enum kb_op op, enum kb_dtype dtype)
{
	return op == KB_OP_RMSNORM && dtype == KB_F32;
}

static int cuda_open(kb_backend *be, const kb_backend_params *p, ds_err *err)
{
	int n = 0, pools = 0, rc = DS_OK;
	struct cuda_inst *c = NULL;
	cudaDeviceProp prop;
	cudaError_t e = cudaGetDeviceCount(&n);
	if (e != cudaSuccess || n == 0) {
		rc = ds_err_set(err, DS_ENODEV, "no CUDA device: %s",
				e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
		goto out;
	}
	if (p->device >= n) {
		rc = ds_err_set(err, DS_ENODEV, "no CUDA device %d (this machine has %d)", p->device, n);
		goto out;
	}
	c = (struct cuda_inst *)calloc(1, sizeof *c);
	if (!c) {
		rc = ds_err_set(err, DS_ENOMEM, "the cuda backend: out of memory");
		goto out;
	}
	c->device = p->device;
	if ((e = cudaSetDevice(c->device)) != cudaSuccess ||
	    (e = cudaGetDeviceProperties(&prop, c->device)) != cudaSuccess) {
		rc = ds_err_set(err, DS_ENODEV, "CUDA device %d: %s", c->device, cudaGetErrorString(e));
		goto out;
	}
	snprintf(c->desc, sizeof c->desc, "%s (sm_%d%d)", prop.name, prop.major, prop.minor);
	/* A stream of our own that does not wait for the legacy default stream. */
	if ((e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
		rc = ds_err_set(err, DS_EINTERNAL, "CUDA device %d: no stream: %s", c->device,
				cudaGetErrorString(e));
		goto out;
	}
	if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, c->device) == cudaSuccess &&
	    pools) {
		cudaMemPool_t pool;
		uint64_t keep = UINT64_MAX; /* freed blocks stay cached in the pool */
		if (cudaDeviceGetDefaultMemPool(&pool, c->device) == cudaSuccess &&
		    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) == cudaSuccess)
			c->async_alloc = 1;
	}
	be->priv = c;
	c = NULL;
out:
	free(c);
	return rc;
}

static void cuda_close(kb_backend *be)
{
	struct cuda_inst *c = inst_of(be);
	if (!c)
		return;
	if (use_device(c) == DS_OK) {
		cudaStreamSynchronize(c->stream);
		cudaStreamDestroy(c->stream);
	}
	free(c);
	be->priv = NULL;
}

/* In declaration order (C++ designated initialisers); the ops that
 * cuda_supports_op denies are NULL, spelled out for -Wmissing-field-initializers. */
static const kb_backend_ops cuda_ops = {
	.name = "cuda",
	.supports_op = cuda_supports_op,
	.open = cuda_open,
	.close = cuda_close,
	.describe = cuda_describe,
	.alloc = cuda_alloc,
	.release = cuda_release,
	.upload = cuda_upload,
	.download = cuda_download,
	.sync = cuda_sync,
	.set_threads = NULL,
	.rmsnorm = cuda_rmsnorm,
	.matmul = NULL,
	.matmul_multi = NULL,
	.embed = NULL,
	.rope = NULL,
	.silu_mul = NULL,
	.axpy = NULL,
	.softmax = NULL,
	.dequant = NULL,
	.mla_attn = NULL,
	.attn = NULL,
	.paged_attn = NULL,
	.moe_route = NULL,
};

extern "C" const kb_backend_ops *kcu_backend_ops(void)
{
	return &cuda_ops;
}

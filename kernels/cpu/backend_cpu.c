/*
 * backend_cpu.c - the CPU backend's struct of ops: host memory, memcpy
 * transfers, and each op dispatched to the best ISA (see cpu.h).
 * Thread rule: stateless apart from the ISA cache in isa.c.
 */
#include "kernels/cpu/cpu.h"

#include <stdlib.h>
#include <string.h>

static const char *cpu_describe(void)
{
	return kc_isa_name(kc_isa_active());
}

static void *cpu_alloc(size_t bytes)
{
	/* 64-byte alignment: a cache line and one AVX-512 register. */
	size_t n = (bytes + 63) & ~(size_t)63;
	return aligned_alloc(64, n ? n : 64);
}

static void cpu_release(void *p)
{
	free(p);
}

static int cpu_copy(void *dst, const void *src, size_t bytes)
{
	memcpy(dst, src, bytes);
	return DS_OK;
}

static int cpu_sync(void)
{
	return DS_OK;
}

static int cpu_rmsnorm(const kb_rmsnorm_args *a)
{
	if (a->rows < 0 || a->dim <= 0)
		return DS_EINVAL;
	return kc_rmsnorm_isa(kc_isa_active(), a);
}

static const kb_backend cpu_backend = {
	.name = "cpu",
	.describe = cpu_describe,
	.alloc = cpu_alloc,
	.release = cpu_release,
	.upload = cpu_copy,
	.download = cpu_copy,
	.sync = cpu_sync,
	.rmsnorm = cpu_rmsnorm,
};

const kb_backend *kc_backend(void)
{
	return &cpu_backend;
}

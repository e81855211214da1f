/*
 * backend.c - registry of compiled-in backends.
 * Called by the engine (backend selection, the op-support check at model
 * load), conformance and bench programs.
 * Thread rule: lookups are read-only after the first call of each backend's
 * probe, which the backends make idempotent.
 */
#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"
#ifdef DS_HAVE_CUDA
#include "kernels/cuda/backend_cuda.h"
#endif

#include <string.h>

static const char *names[] = {
	"cpu",
#ifdef DS_HAVE_CUDA
	"cuda",
#endif
};

int kb_backend_count(void)
{
	return (int)(sizeof names / sizeof names[0]);
}

const char *kb_backend_name_at(int i)
{
	return i >= 0 && i < kb_backend_count() ? names[i] : NULL;
}

const kb_backend *kb_backend_get(const char *name, ds_err *err)
{
	if (strcmp(name, "cpu") == 0)
		return kc_backend();
	if (strcmp(name, "cuda") == 0) {
#ifdef DS_HAVE_CUDA
		return kcu_backend(err);
#else
		ds_err_set(err, DS_ENODEV, "the cuda backend is not compiled in (build with CUDA=1)");
		return NULL;
#endif
	}
	ds_err_set(err, DS_ENOTFOUND, "unknown backend '%s' (known: cpu, cuda)", name);
	return NULL;
}

const char *kb_op_name(enum kb_op op)
{
	static const char *const op_names[KB_OP_COUNT] = {
		[KB_OP_RMSNORM] = "rmsnorm",     [KB_OP_MATMUL] = "matmul",
		[KB_OP_EMBED] = "embed",         [KB_OP_ROPE] = "rope",
		[KB_OP_SILU_MUL] = "silu_mul",   [KB_OP_AXPY] = "axpy",
		[KB_OP_SOFTMAX] = "softmax",     [KB_OP_DEQUANT] = "dequant",
		[KB_OP_MLA_ATTN] = "mla_attn",   [KB_OP_ATTN] = "attn",
		[KB_OP_PAGED_ATTN] = "paged_attn", [KB_OP_MOE_ROUTE] = "moe_route",
	};
	return (unsigned)op < KB_OP_COUNT ? op_names[op] : "?";
}

const char *kb_dtype_name(enum kb_dtype t)
{
	static const char *const dtype_names[KB_DTYPE_COUNT] = {
		[KB_F32] = "f32",   [KB_F16] = "f16",   [KB_BF16] = "bf16", [KB_F8_E4M3] = "f8_e4m3",
		[KB_Q8_0] = "q8_0", [KB_Q4_0] = "q4_0", [KB_Q4_1] = "q4_1", [KB_Q4_K] = "q4_k",
		[KB_Q5_K] = "q5_k", [KB_Q6_K] = "q6_k",
	};
	return (unsigned)t < KB_DTYPE_COUNT ? dtype_names[t] : "?";
}

/* Ops whose dtype names the weights (the others run on f32 activations). */
static int op_has_dtype(enum kb_op op)
{
	return op == KB_OP_MATMUL || op == KB_OP_EMBED || op == KB_OP_DEQUANT;
}

int kb_backend_supports(const char *name, enum kb_op op, enum kb_dtype dtype)
{
	if ((unsigned)op >= KB_OP_COUNT || (unsigned)dtype >= KB_DTYPE_COUNT)
		return 0;
	if (strcmp(name, "cpu") == 0)
		return kc_backend()->supports_op(op, dtype);
#ifdef DS_HAVE_CUDA
	if (strcmp(name, "cuda") == 0)
		return kcu_supports_op(op, dtype);
#endif
	return 0;
}

int kb_backend_check(const char *name, const kb_op_need *needs, int n_needs, ds_err *err)
{
	for (int i = 0; i < n_needs; i++) {
		if (kb_backend_supports(name, needs[i].op, needs[i].dtype))
			continue;
		if (op_has_dtype(needs[i].op))
			return ds_err_set(err, DS_EUNSUPPORTED, "the %s backend has no %s for %s weights",
					  name, kb_op_name(needs[i].op), kb_dtype_name(needs[i].dtype));
		return ds_err_set(err, DS_EUNSUPPORTED, "the %s backend has no %s", name,
				  kb_op_name(needs[i].op));
	}
	return DS_OK;
}

/*
 * backend.c - registry of compiled-in backends.
 * Called by the engine (backend selection), conformance and bench programs.
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

/*
 * backend.c - registry of compiled-in backends, their instances and the
 * op-support queries.
 * Called by the engine (backend selection, the op-support check at model
 * load), conformance and bench programs.
 *
 * Each backend exports one const ops table (kc_backend_ops, kcu_backend_ops);
 * kb_backend_open fills an instance from it and lets the backend's open set
 * up its own state (priv).  kb_backend_get keeps one default instance per
 * backend, opened at the first call.
 *
 * Thread rule: the tables are read-only; the default instances are opened
 * under default_mu, once each (a failure is remembered with its message), so
 * kb_backend_get may be called from any thread.  Instances from
 * kb_backend_open belong to their caller.
 */
#include "kernels/backend.h"

#include "common/strutil.h"
#include "kernels/cpu/cpu.h"
#ifdef DS_HAVE_CUDA
#include "kernels/cuda/backend_cuda.h"
#endif

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct known_backend {
	const char *name;
	const kb_backend_ops *(*ops)(void);
} known_backend;

static const known_backend compiled[] = {
	{.name = "cpu", .ops = kc_backend_ops},
#ifdef DS_HAVE_CUDA
	{.name = "cuda", .ops = kcu_backend_ops},
#endif
};
#define N_COMPILED ((int)(sizeof compiled / sizeof compiled[0]))

/* Every backend this source knows of, compiled in or not. */
#define KNOWN_NAMES "cpu, cuda"

/* kb_backend_get's instances: opened once each under default_mu. */
static struct {
	kb_backend be;
	int tried, rc;
	char why[DS_ERR_MSG_MAX];
} defaults[N_COMPILED];
static pthread_mutex_t default_mu = PTHREAD_MUTEX_INITIALIZER;

int kb_backend_count(void)
{
	return N_COMPILED;
}

const char *kb_backend_name_at(int i)
{
	return i >= 0 && i < N_COMPILED ? compiled[i].name : NULL;
}

kb_backend_params kb_backend_default_params(void)
{
	return (kb_backend_params){.device = 0, .threads = 0};
}

/* Index in compiled[] of the backend called name, or a negative DS_E* code
 * with err saying why there is none. */
static int find(const char *name, ds_err *err)
{
	for (int i = 0; i < N_COMPILED; i++)
		if (strcmp(compiled[i].name, name) == 0)
			return i;
	if (strcmp(name, "cuda") == 0)
		return ds_err_set(err, DS_ENODEV, "the cuda backend is not compiled in (build with CUDA=1)");
	return ds_err_set(err, DS_ENOTFOUND, "unknown backend '%s' (known: %s)", name, KNOWN_NAMES);
}

/* Fills be from ops and p, then lets the backend open its state. */
static int open_into(kb_backend *be, const kb_backend_ops *ops, const kb_backend_params *p,
		     ds_err *err)
{
	if (p->device < 0 || p->threads < 0)
		return ds_err_set(err, DS_EINVAL, "the %s backend: device %d, threads %d (want >= 0)",
				  ops->name, p->device, p->threads);
	*be = (kb_backend){
		.name = ops->name,
		.supports_op = ops->supports_op,
		.ops = ops,
		.params = *p,
	};
	return ops->open(be, p, err);
}

kb_backend *kb_backend_open(const char *name, const kb_backend_params *p, ds_err *err)
{
	kb_backend_params def = kb_backend_default_params();
	int i = find(name, err);
	if (i < 0)
		return NULL;
	kb_backend *be = calloc(1, sizeof *be);
	if (!be) {
		ds_err_set(err, DS_ENOMEM, "the %s backend: out of memory", name);
		return NULL;
	}
	if (open_into(be, compiled[i].ops(), p ? p : &def, err) != DS_OK) {
		free(be);
		return NULL;
	}
	return be;
}

void kb_backend_close(kb_backend *be)
{
	if (!be || be->borrowed)
		return;
	be->ops->close(be);
	free(be);
}

const kb_backend *kb_backend_get(const char *name, ds_err *err)
{
	int i = find(name, err);
	if (i < 0)
		return NULL;
	pthread_mutex_lock(&default_mu);
	if (!defaults[i].tried) {
		kb_backend_params p = kb_backend_default_params();
		ds_err e = {0};
		defaults[i].tried = 1;
		defaults[i].rc = open_into(&defaults[i].be, compiled[i].ops(), &p, &e);
		defaults[i].be.borrowed = 1;
		ds_strlcpy(defaults[i].why, e.msg, sizeof defaults[i].why);
	}
	int rc = defaults[i].rc;
	pthread_mutex_unlock(&default_mu);
	if (rc != DS_OK) {
		ds_err_set(err, rc, "%s", defaults[i].why);
		return NULL;
	}
	return &defaults[i].be;
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

/* supports guarded against out-of-range values (0 for them). */
static int ask(int (*supports)(enum kb_op, enum kb_dtype), enum kb_op op, enum kb_dtype dtype)
{
	if (!supports || (unsigned)op >= KB_OP_COUNT || (unsigned)dtype >= KB_DTYPE_COUNT)
		return 0;
	return supports(op, dtype);
}

/* kb_backend_check and kb_check: the first need supports denies, named. */
static int check_needs(const char *name, int (*supports)(enum kb_op, enum kb_dtype),
		       const kb_op_need *needs, int n_needs, ds_err *err)
{
	for (int i = 0; i < n_needs; i++) {
		if (ask(supports, needs[i].op, needs[i].dtype))
			continue;
		if (op_has_dtype(needs[i].op))
			return ds_err_set(err, DS_EUNSUPPORTED, "the %s backend has no %s for %s weights",
					  name, kb_op_name(needs[i].op), kb_dtype_name(needs[i].dtype));
		return ds_err_set(err, DS_EUNSUPPORTED, "the %s backend has no %s", name,
				  kb_op_name(needs[i].op));
	}
	return DS_OK;
}

/* The compiled-in backend's supports_op, or NULL for unknown names. */
static int (*supports_of(const char *name))(enum kb_op, enum kb_dtype)
{
	int i = find(name, NULL);
	return i < 0 ? NULL : compiled[i].ops()->supports_op;
}

int kb_backend_supports(const char *name, enum kb_op op, enum kb_dtype dtype)
{
	return ask(supports_of(name), op, dtype);
}

int kb_backend_check(const char *name, const kb_op_need *needs, int n_needs, ds_err *err)
{
	return check_needs(name, supports_of(name), needs, n_needs, err);
}

int kb_supports_op(const kb_backend *be, enum kb_op op, enum kb_dtype dtype)
{
	return ask(be->supports_op, op, dtype);
}

int kb_check(const kb_backend *be, const kb_op_need *needs, int n_needs, ds_err *err)
{
	return check_needs(be->name, be->supports_op, needs, n_needs, err);
}

int kb_backend_has_op(const kb_backend *be, enum kb_op op)
{
	const kb_backend_ops *o = be->ops;
	switch (op) {
	case KB_OP_RMSNORM: return o->rmsnorm != NULL;
	case KB_OP_MATMUL: return o->matmul != NULL;
	case KB_OP_EMBED: return o->embed != NULL;
	case KB_OP_ROPE: return o->rope != NULL;
	case KB_OP_SILU_MUL: return o->silu_mul != NULL;
	case KB_OP_AXPY: return o->axpy != NULL;
	case KB_OP_SOFTMAX: return o->softmax != NULL;
	case KB_OP_DEQUANT: return o->dequant != NULL;
	case KB_OP_MLA_ATTN: return o->mla_attn != NULL;
	case KB_OP_ATTN: return o->attn != NULL;
	case KB_OP_PAGED_ATTN: return o->paged_attn != NULL;
	case KB_OP_MOE_ROUTE: return o->moe_route != NULL;
	case KB_OP_COUNT: break;
	}
	return 0;
}

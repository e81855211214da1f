/*
 * conformance.c - every op on every available implementation against the
 * scalar reference, on random inputs.
 *
 * Targets: each CPU ISA this machine supports (scalar, avx2, avx512, ...),
 * called directly through kc_<op>_isa, and the CUDA backend when it is
 * compiled in and a device is present (otherwise reported as skipped).
 * Closing line: "conformance: N passed, N failed, N skipped" (one per op x
 * target).  Usage: conformance [OP]
 */
#include "common/strutil.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 0x243F6A8885A308D3ull;

static float frand(float lo, float hi)
{
	rng ^= rng >> 12;
	rng ^= rng << 25;
	rng ^= rng >> 27;
	uint64_t r = rng * 0x2545F4914F6CDD1Dull;
	return lo + (hi - lo) * (float)((r >> 40) * (1.0 / 16777216.0));
}

/* A target runs one op: either a CPU ISA directly or a device backend. */
typedef struct target {
	char name[32];
	enum kc_isa isa;        /* for cpu targets */
	const kb_backend *dev;  /* non-NULL for device targets (buffers live there) */
} target;

typedef struct result {
	double max_err; /* worst |got - ref| / (|ref| + atol) */
	int checked;
	int rc;
} result;

/* --- rmsnorm --- */

static const int64_t rms_shapes[][2] = {
	{1, 1}, {3, 7}, {4, 15}, {2, 16}, {5, 33}, {8, 64}, {3, 100}, {2, 1000},
	{16, 129}, {4, 4096}, {2, 7168}, {1, 1536}, {64, 512},
};

static int run_rmsnorm_on(const target *t, kb_rmsnorm_args *a)
{
	if (!t->dev)
		return kc_rmsnorm_isa(t->isa, a);
	const kb_backend *b = t->dev;
	size_t xb = (size_t)(a->rows * a->x_stride) * sizeof(float);
	size_t yb = (size_t)(a->rows * a->out_stride) * sizeof(float);
	size_t wb = (size_t)a->dim * sizeof(float);
	float *dx = b->alloc(xb), *dy = b->alloc(yb), *dw = b->alloc(wb);
	int rc = DS_ENOMEM;
	if (dx && dy && dw && b->upload(dx, a->x, xb) == 0 && b->upload(dw, a->w, wb) == 0 &&
	    b->upload(dy, a->out, yb) == 0) {
		kb_rmsnorm_args d = *a;
		d.x = dx;
		d.w = dw;
		d.out = dy;
		rc = b->rmsnorm(&d);
		if (rc == 0)
			rc = b->sync();
		if (rc == 0)
			rc = b->download(a->out, dy, yb);
	}
	b->release(dx);
	b->release(dy);
	b->release(dw);
	return rc;
}

static result test_rmsnorm(const target *t)
{
	result res = {0, 0, 0};
	for (size_t s = 0; s < sizeof rms_shapes / sizeof rms_shapes[0]; s++) {
		int64_t rows = rms_shapes[s][0], dim = rms_shapes[s][1];
		int64_t stride = dim + (s % 3); /* some shapes use padded rows */
		size_t n = (size_t)(rows * stride);
		float *x = malloc(n * sizeof *x), *w = malloc((size_t)dim * sizeof *w);
		float *ref = malloc(n * sizeof *ref), *got = malloc(n * sizeof *got);
		for (int64_t r = 0; r < rows; r++) {
			float scale = powf(10.0f, frand(-3.0f, 3.0f)); /* rows of very different size */
			for (int64_t i = 0; i < stride; i++)
				x[r * stride + i] = frand(-1.0f, 1.0f) * scale;
		}
		for (int64_t i = 0; i < dim; i++)
			w[i] = frand(-2.0f, 2.0f);
		for (size_t i = 0; i < n; i++)
			ref[i] = got[i] = -12345.0f; /* sentinel: padding must stay untouched */
		float eps = 1e-6f;
		kb_rmsnorm_args a = {ref, x, w, rows, dim, stride, stride, eps};
		kc_rmsnorm_ref(&a);
		a.out = got;
		int rc = run_rmsnorm_on(t, &a);
		if (rc) {
			res.rc = rc;
		} else {
			for (size_t i = 0; i < n; i++) {
				double d = fabs((double)got[i] - (double)ref[i]);
				double e = d / (fabs((double)ref[i]) + 1e-6);
				if (!(e <= res.max_err))
					res.max_err = isnan(e) ? INFINITY : fmax(res.max_err, e);
				res.checked++;
			}
		}
		free(x);
		free(w);
		free(ref);
		free(got);
	}
	return res;
}

static const struct {
	const char *name;
	result (*fn)(const target *);
	double tol; /* relative */
} ops[] = {
	{"rmsnorm", test_rmsnorm, 1e-5},
};

int main(int argc, char **argv)
{
	const char *only = argc > 1 ? argv[1] : NULL;
	target targets[KC_ISA_COUNT + 4];
	int nt = 0, passed = 0, failed = 0, skipped = 0;
	for (int i = 0; i <= (int)kc_isa_detect(); i++) {
		snprintf(targets[nt].name, sizeof targets[nt].name, "cpu/%s", kc_isa_name(i));
		targets[nt].isa = (enum kc_isa)i;
		targets[nt].dev = NULL;
		nt++;
	}
	for (int i = (int)kc_isa_detect() + 1; i < KC_ISA_COUNT; i++) {
		printf("skip %-10s cpu/%s: this CPU does not support it\n", "*", kc_isa_name(i));
		skipped++;
	}
	for (int i = 0; i < kb_backend_count(); i++) {
		const char *name = kb_backend_name_at(i);
		if (strcmp(name, "cpu") == 0)
			continue;
		ds_err err = {0};
		const kb_backend *b = kb_backend_get(name, &err);
		if (!b) {
			printf("skip %-10s %s: %s\n", "*", name, err.msg);
			skipped++;
			continue;
		}
		ds_strlcpy(targets[nt].name, name, sizeof targets[nt].name);
		targets[nt].isa = KC_ISA_SCALAR;
		targets[nt].dev = b;
		nt++;
	}
	for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++) {
		if (only && strcmp(only, ops[o].name) != 0)
			continue;
		for (int t = 0; t < nt; t++) {
			double t0 = ds_now_s();
			result r = ops[o].fn(&targets[t]);
			int ok = r.rc == 0 && r.max_err <= ops[o].tol && r.checked > 0;
			printf("%s %-10s %-16s %d values, max rel err %.3g (tol %g), %.1f ms%s%s\n",
			       ok ? "ok  " : "FAIL", ops[o].name, targets[t].name, r.checked,
			       r.max_err, ops[o].tol, (ds_now_s() - t0) * 1e3,
			       r.rc ? ", error " : "", r.rc ? ds_status_name(r.rc) : "");
			if (ok)
				passed++;
			else
				failed++;
		}
	}
	printf("conformance: %d passed, %d failed, %d skipped\n", passed, failed, skipped);
	return failed ? 1 : 0;
}

/*
 * bench_kernels.c - kernel timings, each reported as a ratio against the
 * scalar reference measured in the same run (never a timed test).
 * Usage: bench_kernels [--json]
 */
#include "common/strutil.h"
#include "kernels/cpu/cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double time_rmsnorm(enum kc_isa isa, kb_rmsnorm_args *a, int iters)
{
	kc_rmsnorm_isa(isa, a); /* warm caches */
	double best = 1e30;
	for (int rep = 0; rep < 5; rep++) {
		double t0 = ds_now_s();
		for (int i = 0; i < iters; i++)
			kc_rmsnorm_isa(isa, a);
		double dt = (ds_now_s() - t0) / iters;
		if (dt < best)
			best = dt;
	}
	return best;
}

int main(int argc, char **argv)
{
	int json = argc > 1 && strcmp(argv[1], "--json") == 0;
	const int64_t rows = 16, dim = 7168; /* 16 tokens of DeepSeek-V3's hidden size */
	size_t n = (size_t)(rows * dim);
	float *x = malloc(n * 4), *y = malloc(n * 4), *w = malloc((size_t)dim * 4);
	for (size_t i = 0; i < n; i++)
		x[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
	for (int64_t i = 0; i < dim; i++)
		w[i] = 1.0f + (float)(i % 7) * 0.01f;
	kb_rmsnorm_args a = {y, x, w, rows, dim, dim, dim, 1e-6f};
	double base = time_rmsnorm(KC_ISA_SCALAR, &a, 200);
	if (!json)
		printf("rmsnorm rows=%lld dim=%lld (f32)\n", (long long)rows, (long long)dim);
	else
		printf("{\"rmsnorm\":{\"rows\":%lld,\"dim\":%lld,\"scalar_us\":%.3f", (long long)rows,
		       (long long)dim, base * 1e6);
	for (int i = 1; i <= (int)kc_isa_detect(); i++) {
		double t = time_rmsnorm((enum kc_isa)i, &a, 200);
		double gbs = (double)(2 * n + (size_t)dim) * 4 / t / 1e9;
		if (json)
			printf(",\"%s_us\":%.3f,\"%s_speedup\":%.2f", kc_isa_name(i), t * 1e6,
			       kc_isa_name(i), base / t);
		else
			printf("  %-11s %9.2f us  %6.1f GB/s  %5.2fx vs scalar (%.2f us)\n",
			       kc_isa_name(i), t * 1e6, gbs, base / t, base * 1e6);
	}
	if (json)
		printf("}}\n");
	free(x);
	free(y);
	free(w);
	return 0;
}

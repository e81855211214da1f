/*
 * bench_kernels.c - kernel timings, each reported as a ratio against a
 * baseline measured in the same run (never a timed test).
 *
 *   rmsnorm   vs the scalar reference (single thread); then the best ISA
 *             called directly against the same call through the cpu backend
 *             instance (kb_rmsnorm: the instance's ops table and argument
 *             checks), at 16 rows and at one row (where that cost shows).
 *   membw     the machine's read bandwidth (kc_measure_read_bandwidth), all
 *             threads and one thread, probed before each dtype and at the end
 *             (best probe kept: the machine may be shared, and the matmul
 *             timings are best-of-N too): the bound for the decode matmuls.
 *   matmul    per weight dtype, shapes N x K = 2048 x 7168 and 7168 x 2048
 *             (DeepSeek-V3's expert / dense projections), M = 1, 16, 128, on
 *             every SIMD ISA with all pool threads: time per call, GB/s of
 *             weight bytes read (W + FP8 scales, once per call), the fraction
 *             of the measured read bandwidth, GFLOP/s, and the speedup over
 *             the scalar reference (all threads) for M = 1 and 16; for
 *             M = 128 the reference would take seconds per call, so the
 *             ratio is against the avx2 path instead.
 * Weights are cycled through enough copies (>= 4x a 64 MiB last-level cache)
 * that decode timings come from memory, not cache.
 *   decode    (--decode, alone) the decode shapes of the v3shape bench model,
 *             the absorbed MLA's per-head products (W_UK^T, W_UV; "x16": the
 *             16 heads' matrices in one batched call) among them,
 *             M = 1..4, 8, 16: us per call and fraction of the read bandwidth;
 *             --decode-hot: the same with N cut down until two copies fit
 *             in L2 (the kernels' compute bound).
 *   attn      (--attn, alone) paged GQA attention: decode at depth 512 /
 *             2048 / 8192 against the read probe, prefill chunks in GFLOP/s;
 *             then absorbed MLA decode (DeepSeek-V3's 128 heads, the bench
 *             model's 16) at depth 4096 / 16384 against the same heads
 *             called 16 at a time.
 *   quant     GGUF block-quantized weights (kernels/cpu/quant.h) at the
 *             default model's shapes, M = 1 and 512, and Q4_K / Q6_K at
 *             2048 x 7168, M = 1 (end of the default run; --quant alone).
 * Usage: bench_kernels [--json] [--quick] [--decode|--decode-hot|--quant|--attn] [--threads N] [--only DTYPE]
 *   --quick: one shape, fewer repetitions; --threads: pool size (the cpu
 *   backend instance is opened with it; default one per CPU); --only
 *   bf16|fp8|f16|f32|q4_1|q8_0|q4_k|q6_k: one weight dtype.
 */
#include "common/fileutil.h"
#include "common/strutil.h"
#include "kernels/cpu/attn.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/membw.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/quant.h"

#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

/* Best of 5 of iters calls: through be when non-NULL, else kc_rmsnorm_isa. */
static double time_rmsnorm(const kb_backend *be, enum kc_isa isa, kb_rmsnorm_args *a, int iters)
{
	double best = 1e30;
	if (be)
		kb_rmsnorm(be, a); /* warm caches */
	else
		kc_rmsnorm_isa(isa, a);
	for (int rep = 0; rep < 5; rep++) {
		double t0 = ds_now_s();
		if (be)
			for (int i = 0; i < iters; i++)
				kb_rmsnorm(be, a);
		else
			for (int i = 0; i < iters; i++)
				kc_rmsnorm_isa(isa, a);
		double dt = (ds_now_s() - t0) / iters;
		if (dt < best)
			best = dt;
	}
	return best;
}

/* The best ISA called directly vs the same call through the instance, at
 * rows rows and at one row, alternated so that both see the same machine. */
static void bench_rmsnorm_backend(const kb_backend *be, kb_rmsnorm_args *a, int json)
{
	const enum kc_isa isa = kc_isa_active();
	const int64_t rows_at[2] = {a->rows, 1};
	for (int r = 0; r < 2; r++) {
		kb_rmsnorm_args b = *a;
		b.rows = rows_at[r];
		double direct = 1e30, inst = 1e30;
		for (int round = 0; round < 3; round++) {
			double t = time_rmsnorm(NULL, isa, &b, 2000);
			direct = t < direct ? t : direct;
			t = time_rmsnorm(be, isa, &b, 2000);
			inst = t < inst ? t : inst;
		}
		if (json)
			printf(",\"rows%lld_direct_us\":%.3f,\"rows%lld_backend_us\":%.3f",
			       (long long)b.rows, direct * 1e6, (long long)b.rows, inst * 1e6);
		else
			printf("  rows=%-3lld %-10s %9.3f us direct, %9.3f us through the %s backend "
			       "instance (%+.1f%%)\n",
			       (long long)b.rows, kc_isa_name(isa), direct * 1e6, inst * 1e6, be->name,
			       (inst / direct - 1) * 100);
	}
}

static void bench_rmsnorm(const kb_backend *be, int json)
{
	const int64_t rows = 16, dim = 7168; /* 16 tokens of DeepSeek-V3's hidden size */
	size_t n = (size_t)(rows * dim);
	float *x = malloc(n * 4), *y = malloc(n * 4), *w = malloc((size_t)dim * 4);
	for (size_t i = 0; i < n; i++)
		x[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
	for (int64_t i = 0; i < dim; i++)
		w[i] = 1.0f + (float)(i % 7) * 0.01f;
	kb_rmsnorm_args a = {.out = y, .x = x, .w = w, .rows = rows, .dim = dim, .x_stride = dim,
				.out_stride = dim, .eps = 1e-6f};
	double base = time_rmsnorm(NULL, KC_ISA_SCALAR, &a, 200);
	if (!json)
		printf("rmsnorm rows=%lld dim=%lld (f32)\n", (long long)rows, (long long)dim);
	else
		printf("\"rmsnorm\":{\"rows\":%lld,\"dim\":%lld,\"scalar_us\":%.3f", (long long)rows,
		       (long long)dim, base * 1e6);
	for (int i = 1; i <= (int)kc_isa_detect(); i++) {
		double t = time_rmsnorm(NULL, (enum kc_isa)i, &a, 200);
		double gbs = (double)(2 * n + (size_t)dim) * 4 / t / 1e9;
		if (json)
			printf(",\"%s_us\":%.3f,\"%s_speedup\":%.2f", kc_isa_name(i), t * 1e6,
			       kc_isa_name(i), base / t);
		else
			printf("  %-11s %9.2f us  %6.1f GB/s  %5.2fx vs scalar (%.2f us)\n",
			       kc_isa_name(i), t * 1e6, gbs, base / t, base * 1e6);
	}
	bench_rmsnorm_backend(be, &a, json);
	if (json)
		printf("}");
	free(x);
	free(y);
	free(w);
}

/* ---- matmul ---- */

static uint64_t fill_state = 0x9E3779B97F4A7C15ull;

static uint64_t fill_next(void)
{
	fill_state ^= fill_state >> 12;
	fill_state ^= fill_state << 25;
	fill_state ^= fill_state >> 27;
	return fill_state * 0x2545F4914F6CDD1Dull;
}

/* Plausible weights (no NaN/Inf, no subnormal-heavy data). */
/* Weight copies as the engine holds them on the cpu backend: in 2 MiB
 * transparent huge pages where the kernel offers them (malloc'ed, the
 * aligned 2 MiB stretches inside advised). */
static void *weights_alloc(size_t n)
{
	char *p = malloc(n);
	const uintptr_t H = (uintptr_t)2 << 20;
	uintptr_t a = ((uintptr_t)p + H - 1) & ~(H - 1), e = ((uintptr_t)p + n) & ~(H - 1);
	if (p && e > a)
		(void)madvise((void *)a, (size_t)(e - a), MADV_HUGEPAGE);
	return p;
}

static void fill_weights(enum kb_dtype t, void *w, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint64_t r = fill_next();
		switch (t) {
		case KB_F32: ((float *)w)[i] = (float)((int64_t)(r >> 40) - (1 << 23)) * 0x1p-30f; break;
		case KB_BF16: ((uint16_t *)w)[i] = (uint16_t)(0x3C00u | (r & 0x807Fu) | ((r >> 20) & 0x0380u)); break;
		case KB_F16: ((uint16_t *)w)[i] = (uint16_t)(0x2C00u | (r & 0x83FFu)); break;
		default: {
			uint8_t b = (uint8_t)r;
			((uint8_t *)w)[i] = (b & 0x7F) == 0x7F ? (uint8_t)(b ^ 1) : b;
			break;
		}
		}
	}
}

typedef struct mm_bench {
	enum kb_dtype dt;
	int64_t N, K;
	int copies;
	void **w;
	float *scale;   /* shared by the copies (FP8) */
	float *x, *y;   /* [128][K], [128][N] */
	size_t w_bytes; /* one copy, scales included */
} mm_bench;

/* One timing line, printed at the end against the best bandwidth seen. */
typedef struct mm_result {
	enum kb_dtype dt;
	int64_t M, N, K;
	enum kc_isa isa;
	double t, base;
	const char *base_name;
	size_t w_bytes;
} mm_result;

#define MAX_RESULTS 128
static mm_result results[MAX_RESULTS];
static int n_results;
static double bw_best, bw1_best; /* bytes/s, all threads and one thread */

static double time_matmul(mm_bench *b, enum kc_isa isa, int64_t M, int reps, int use_ref)
{
	kb_matmul_args a = {
		.y = b->y, .x = b->x, .w_scale = b->scale, .wtype = b->dt, .M = M, .N = b->N,
		.K = b->K, .x_stride = b->K, .y_stride = b->N, .w_stride = b->K,
		.scale_stride = (b->K + 127) / 128, .block = 128, .accumulate = 0,
	};
	double best = 1e30;
	int c = 0;
	for (int rep = 0; rep < reps + 1; rep++) {
		a.w = b->w[c];
		c = (c + 1) % b->copies;
		double t0 = ds_now_s();
		if (use_ref)
			kc_matmul_isa(KC_ISA_SCALAR, &a);
		else
			kc_matmul_isa(isa, &a);
		double dt = ds_now_s() - t0;
		if (rep > 0 && dt < best) /* rep 0 warms up (page faults, pool start) */
			best = dt;
	}
	return best;
}

static const char *dt_name(enum kb_dtype t)
{
	return t == KB_F32 ? "f32" : t == KB_F16 ? "f16" : t == KB_BF16 ? "bf16" : "fp8";
}

/* The read bandwidth bound, probed again before each dtype: the machine may
 * be shared, so the best probe is the fairest bound for best-of-N timings. */
static void probe_bandwidth(void)
{
	double bw = 0, bw1 = 0;
	if (kc_measure_read_bandwidth((size_t)256 << 20, 0, &bw) != DS_OK ||
	    kc_measure_read_bandwidth((size_t)256 << 20, 1, &bw1) != DS_OK) {
		fprintf(stderr, "bench: the bandwidth probe failed\n");
		return;
	}
	if (bw > bw_best)
		bw_best = bw;
	if (bw1 > bw1_best)
		bw1_best = bw1;
}

static void bench_matmul(int quick, const char *only)
{
	static const enum kb_dtype dts[] = {KB_BF16, KB_F8_E4M3, KB_F16, KB_F32};
	static const int64_t shapes[][2] = {{2048, 7168}, {7168, 2048}};
	static const int64_t ms[] = {1, 16, 128};
	const int n_shapes = quick ? 1 : 2;
	for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++) {
		if (only && strcmp(only, dt_name(dts[d])) != 0)
			continue;
		probe_bandwidth();
		for (int s = 0; s < n_shapes; s++) {
			mm_bench b = {.dt = dts[d], .N = shapes[s][0], .K = shapes[s][1]};
			size_t es = kb_dtype_size(b.dt), nel = (size_t)(b.N * b.K);
			size_t n_sc = (size_t)(((b.N + 127) / 128) * ((b.K + 127) / 128));
			b.w_bytes = nel * es + (b.dt == KB_F8_E4M3 ? n_sc * 4 : 0);
			b.copies = (int)((((size_t)256 << 20) + b.w_bytes - 1) / b.w_bytes);
			if (b.copies < 2)
				b.copies = 2;
			b.w = calloc((size_t)b.copies, sizeof *b.w);
			for (int c = 0; c < b.copies; c++) {
				b.w[c] = weights_alloc(nel * es);
				fill_weights(b.dt, b.w[c], nel);
			}
			b.scale = malloc(n_sc * 4);
			for (size_t i = 0; i < n_sc; i++)
				b.scale[i] = 1e-3f * (float)(1 + i % 7);
			b.x = malloc((size_t)(128 * b.K) * 4);
			b.y = malloc((size_t)(128 * b.N) * 4);
			for (int64_t i = 0; i < 128 * b.K; i++)
				b.x[i] = (float)((int64_t)(fill_next() >> 41) - (1 << 22)) * 0x1p-22f;
			for (size_t mi = 0; mi < sizeof ms / sizeof ms[0]; mi++) {
				int64_t M = ms[mi];
				int reps = quick ? 3 : M == 1 ? 30 : M == 16 ? 10 : 4;
				double base = 0;
				const char *base_name = "scalar";
				if (M <= 16 && !quick) {
					base = time_matmul(&b, KC_ISA_SCALAR, M, M == 1 ? 2 : 1, 1);
				} else if (kc_isa_detect() >= KC_ISA_AVX2) {
					base = time_matmul(&b, KC_ISA_AVX2, M, reps, 0);
					base_name = "avx2";
				}
				for (int i = 1; i <= (int)kc_isa_detect() && n_results < MAX_RESULTS; i++) {
					if (i == KC_ISA_AVX512BF16)
						continue; /* same kernels as avx512 (no opt-in bf16 path) */
					results[n_results++] = (mm_result){
						b.dt, M, b.N, b.K, (enum kc_isa)i,
						time_matmul(&b, (enum kc_isa)i, M, reps, 0), base, base_name, b.w_bytes,
					};
				}
			}
			for (int c = 0; c < b.copies; c++)
				free(b.w[c]);
			free(b.w);
			free(b.scale);
			free(b.x);
			free(b.y);
		}
	}
	probe_bandwidth();
}

/* --decode: the decode shapes of the v3shape bench model (FP8 attention,
 * the absorbed MLA's per-head W_UK^T and W_UV as the engine calls them,
 * dense MLP and expert projections, the BF16 lm_head), M = 1..4, 8 and 16
 * (batched decode), on the active ISA (DS_CPU_ISA=avx2 caps it; avx512bf16
 * runs the avx512 kernels).  Each figure is the mean over a run of back-to-back
 * calls, each on a different copy of the weights (as the engine calls one
 * expert after another), best of 5 runs: per-call overheads count. */
static void bench_decode(int hot, const char *only)
{
	/* B > 1: the absorbed MLA's per-head products (W_UK^T, W_UV), B heads'
	 * matrices back to back in one batched call, x and y per head */
	static const struct { enum kb_dtype dt; int64_t N, K, B; } shp[] = {
		{KB_F8_E4M3, 512, 2048, 1},  {KB_F8_E4M3, 2048, 512, 1},  {KB_F8_E4M3, 768, 2048, 1},
		{KB_F8_E4M3, 3072, 768, 1},  {KB_F8_E4M3, 576, 2048, 1},  {KB_F8_E4M3, 2048, 2048, 1},
		{KB_F8_E4M3, 5632, 2048, 1}, {KB_F8_E4M3, 2048, 5632, 1}, {KB_F8_E4M3, 2048, 7168, 1},
		{KB_F8_E4M3, 7168, 2048, 1}, {KB_F8_E4M3, 512, 128, 16}, {KB_F8_E4M3, 128, 512, 16},
		{KB_BF16, 32000, 2048, 1},
	};
	enum kc_isa isa = kc_isa_active();
	if (isa == KC_ISA_AVX512BF16)
		isa = KC_ISA_AVX512;
	probe_bandwidth();
	probe_bandwidth();
	printf("decode shapes, %s, %d threads, read bw %.1f GB/s\n", kc_isa_name(isa), kc_pool_threads(),
	       bw_best / 1e9);
	for (size_t s = 0; s < sizeof shp / sizeof shp[0]; s++) {
		if (only && strcmp(only, dt_name(shp[s].dt)) != 0)
			continue;
		mm_bench b = {.dt = shp[s].dt, .N = shp[s].N, .K = shp[s].K};
		int64_t B = shp[s].B;
		while (hot && b.N * B > 64 && (size_t)(b.N * B * b.K) * kb_dtype_size(b.dt) > ((size_t)192 << 10)) {
			if (B > 1)
				B /= 2; /* two copies in a 1 MiB L2 */
			else
				b.N /= 2;
		}
		const int64_t s_item = ((b.N + 127) / 128) * ((b.K + 127) / 128); /* scales per matrix */
		size_t es = kb_dtype_size(b.dt), nel = (size_t)(b.N * b.K * B);
		size_t n_sc = (size_t)(s_item * B);
		b.w_bytes = nel * es + (b.dt == KB_F8_E4M3 ? n_sc * 4 : 0);
		b.copies = hot ? 1 : (int)((((size_t)256 << 20) + b.w_bytes - 1) / b.w_bytes);
		if (b.copies < 2)
			b.copies = 2;
		b.w = calloc((size_t)b.copies, sizeof *b.w);
		for (int c = 0; c < b.copies; c++) {
			b.w[c] = weights_alloc(nel * es);
			fill_weights(b.dt, b.w[c], nel);
		}
		b.scale = malloc(n_sc * 4);
		for (size_t i = 0; i < n_sc; i++)
			b.scale[i] = 1e-3f * (float)(1 + i % 7);
		b.x = malloc((size_t)(16 * b.K * B) * 4);
		b.y = malloc((size_t)(16 * b.N * B) * 4);
		for (int64_t i = 0; i < 16 * b.K * B; i++)
			b.x[i] = (float)((int64_t)(fill_next() >> 41) - (1 << 22)) * 0x1p-22f;
		char heads[16] = "";
		if (B > 1)
			snprintf(heads, sizeof heads, " x%lld", (long long)B);
		printf("%-4s N=%-5lld K=%-5lld%-4s(%6.2f MB)", dt_name(b.dt), (long long)b.N, (long long)b.K, heads,
		       (double)b.w_bytes / 1e6);
		static const int64_t Ms[] = {1, 2, 3, 4, 8, 16};
		for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++) {
			const int64_t M = Ms[mi];
			kb_matmul_args a = {
				.y = b.y, .x = b.x, .w_scale = b.scale, .wtype = b.dt, .M = M, .N = b.N,
				.K = b.K, .x_stride = b.K * B, .y_stride = b.N * B, .w_stride = b.K,
				.scale_stride = (b.K + 127) / 128, .block = 128, .accumulate = 0,
				.batch = B, .x_bstride = b.K, .y_bstride = b.N, .w_bstride = b.N * b.K,
				.s_bstride = s_item,
			};
			double best = 1e30;
			for (int rep = 0; rep < 6; rep++) {
				double t0 = ds_now_s();
				for (int c = 0; c < b.copies; c++) {
					a.w = b.w[c];
					kc_matmul_batch_isa(isa, &a);
				}
				double dt = (ds_now_s() - t0) / b.copies;
				if (rep > 0 && dt < best)
					best = dt;
			}
			printf("  M=%lld %7.1f us %4.2f", (long long)M, best * 1e6,
			       (double)b.w_bytes / best / bw_best);
		}
		printf("\n");
		for (int c = 0; c < b.copies; c++)
			free(b.w[c]);
		free(b.w);
		free(b.scale);
		free(b.x);
		free(b.y);
	}
}

static void print_matmul(int json)
{
	for (int i = 0; i < n_results; i++) {
		const mm_result *r = &results[i];
		double gbs = (double)r->w_bytes / r->t / 1e9;
		double frac = bw_best > 0 ? gbs * 1e9 / bw_best : 0.0;
		double gflops = 2.0 * (double)r->M * (double)r->N * (double)r->K / r->t / 1e9;
		if (json) {
			printf("%s{\"dtype\":\"%s\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"isa\":\"%s\","
			       "\"ms\":%.4f,\"weight_gbs\":%.2f,\"bw_fraction\":%.3f,\"gflops\":%.2f,"
			       "\"baseline\":\"%s\",\"baseline_ms\":%.4f,\"speedup\":%.2f}",
			       i ? "," : "", dt_name(r->dt), (long long)r->M, (long long)r->N, (long long)r->K,
			       kc_isa_name(r->isa), r->t * 1e3, gbs, frac, gflops, r->base_name,
			       r->base * 1e3, r->base / r->t);
			continue;
		}
		if (i == 0 || r->dt != results[i - 1].dt || r->M != results[i - 1].M ||
		    r->N != results[i - 1].N)
			printf("matmul %-4s M=%-3lld N=%lld K=%lld  (%.1f MB of weights; baseline %s %.2f ms)\n",
			       dt_name(r->dt), (long long)r->M, (long long)r->N, (long long)r->K,
			       (double)r->w_bytes / 1e6, r->base_name, r->base * 1e3);
		printf("  %-8s %9.3f ms  %6.1f GB/s weights (%4.2f of read bw)  %7.1f GFLOP/s  %6.1fx vs %s\n",
		       kc_isa_name(r->isa), r->t * 1e3, gbs, frac, gflops, r->base / r->t, r->base_name);
	}
}

/* ---- block-quantized (GGUF) weights: --quant, and a section of the default run ----
 * The default model's shapes (SmolLM2-135M: Q4_1 projections 1536x576 and
 * 576x1536, the Q8_0 tied embedding 49152x576 as the output matrix) at M = 1
 * (decode: weights from memory, cycled through >= 256 MiB of copies; against
 * the scalar kernels) and M = 512 (prefill; against the avx2 path), and
 * DeepSeek's 2048x7168 in Q4_K and Q6_K at M = 1.  Activations are quantized
 * inside each call (part of the time). */

static const char *qt_name(enum kb_dtype t)
{
	return t == KB_Q8_0 ? "q8_0" : t == KB_Q4_0 ? "q4_0" : t == KB_Q4_1 ? "q4_1" : t == KB_Q4_K ? "q4_k"
	       : t == KB_Q5_K ? "q5_k" : "q6_k";
}

/* Random blocks with plausible f16 scales (2^-9 .. 2^-8). */
static void fill_qblocks(enum kb_dtype t, uint8_t *w, size_t bytes)
{
	const size_t bb = kb_dtype_block_bytes(t);
	for (size_t i = 0; i + 8 <= bytes; i += 8) {
		uint64_t r = fill_next();
		memcpy(w + i, &r, 8);
	}
	for (size_t o = 0; o + bb <= bytes; o += bb) {
		uint16_t h = (uint16_t)(0x1800 | (fill_next() & 0x03FF));
		uint8_t hb[2] = {(uint8_t)h, (uint8_t)(h >> 8)};
		memcpy(w + o + (t == KB_Q6_K ? 208 : 0), hb, 2);
		if (t == KB_Q4_1 || t == KB_Q4_K || t == KB_Q5_K)
			memcpy(w + o + 2, hb, 2);
	}
}

static double time_qmatmul(enum kc_isa isa, kb_matmul_args *a, uint8_t **w, int copies, int reps)
{
	double best = 1e30;
	for (int rep = 0; rep < reps + 1; rep++) {
		double t0 = ds_now_s();
		for (int c = 0; c < copies; c++) {
			a->w = w[c];
			kc_qmatmul_isa(isa, a);
		}
		double dt = (ds_now_s() - t0) / copies;
		if (rep > 0 && dt < best) /* rep 0 warms up */
			best = dt;
	}
	return best;
}

static void bench_quant(int quick, int json, const char *only)
{
	static const struct { enum kb_dtype t; int64_t N, K, M; } cases[] = {
		{KB_Q4_1, 1536, 576, 1},  {KB_Q4_1, 576, 1536, 1},  {KB_Q4_1, 49152, 576, 1},
		{KB_Q8_0, 1536, 576, 1},  {KB_Q8_0, 576, 1536, 1},  {KB_Q8_0, 49152, 576, 1},
		{KB_Q4_1, 1536, 576, 512}, {KB_Q4_1, 576, 1536, 512}, {KB_Q4_1, 49152, 576, 512},
		{KB_Q8_0, 1536, 576, 512}, {KB_Q8_0, 576, 1536, 512}, {KB_Q8_0, 49152, 576, 512},
		{KB_Q4_K, 2048, 7168, 1},  {KB_Q6_K, 2048, 7168, 1},
	};
	probe_bandwidth();
	if (json)
		printf(",\"quant\":[");
	else
		printf("quantized matmul (GGUF blocks), %d threads, read bw %.1f GB/s, activations "
		       "quantized in the call%s\n",
		       kc_pool_threads(), bw_best / 1e9, kc_quant_uses_vnni() ? ", avx512 with VNNI" : "");
	int first = 1;
	for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
		const enum kb_dtype t = cases[ci].t;
		const int64_t N = cases[ci].N, K = cases[ci].K, M = cases[ci].M;
		if (only && strcmp(only, qt_name(t)) != 0)
			continue;
		if (quick && M > 1 && N > 4096)
			continue;
		const size_t wb = (size_t)N * kb_dtype_bytes(t, K);
		int copies = M == 1 ? (int)((((size_t)256 << 20) + wb - 1) / wb) : 1;
		if (copies < 1)
			copies = 1;
		uint8_t **w = calloc((size_t)copies, sizeof *w);
		float *x = malloc((size_t)(M * K) * sizeof(float)), *y = malloc((size_t)(M * N) * sizeof(float));
		for (int c = 0; c < copies; c++) {
			w[c] = weights_alloc(wb);
			fill_qblocks(t, w[c], wb);
		}
		for (int64_t i = 0; i < M * K; i++)
			x[i] = (float)((int64_t)(fill_next() >> 41) - (1 << 22)) * 0x1p-22f;
		kb_matmul_args a = {.y = y, .x = x, .wtype = t, .M = M, .N = N, .K = K, .x_stride = K,
				    .y_stride = N, .w_stride = K};
		const int reps = quick ? 2 : M == 1 ? 8 : N > 4096 ? 3 : 6;
		const enum kc_isa base_isa = M == 1 || kc_isa_detect() < KC_ISA_AVX2 ? KC_ISA_SCALAR : KC_ISA_AVX2;
		/* the scalar baseline on fewer copies (it is slow); still from memory */
		const int base_copies = base_isa == KC_ISA_SCALAR ? (copies < 4 ? copies : 4) : copies;
		const double base = time_qmatmul(base_isa, &a, w, base_copies, 1);
		for (int i = 1; i <= (int)kc_isa_detect(); i++) {
			if (i == KC_ISA_AVX512BF16)
				continue; /* same kernels as avx512 */
			const double tt = time_qmatmul((enum kc_isa)i, &a, w, copies, reps);
			const double gbs = (double)wb / tt / 1e9, frac = bw_best > 0 ? gbs * 1e9 / bw_best : 0.0;
			const double gflops = 2.0 * (double)(M * N) * (double)K / tt / 1e9;
			if (json) {
				printf("%s{\"dtype\":\"%s\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"isa\":\"%s\",\"us\":%.2f,"
				       "\"weight_gbs\":%.2f,\"bw_fraction\":%.3f,\"gflops\":%.2f,\"baseline\":\"%s\","
				       "\"speedup\":%.2f}",
				       first ? "" : ",", qt_name(t), (long long)M, (long long)N, (long long)K,
				       kc_isa_name(i), tt * 1e6, gbs, frac, gflops, kc_isa_name(base_isa), base / tt);
				first = 0;
			} else {
				printf("  %s M=%-3lld N=%-5lld K=%-5lld %-7s %10.1f us  %6.1f GB/s (%4.2f of bw)  "
				       "%7.1f GFLOP/s  %6.1fx vs %s\n",
				       qt_name(t), (long long)M, (long long)N, (long long)K, kc_isa_name(i), tt * 1e6,
				       gbs, frac, gflops, base / tt, kc_isa_name(base_isa));
			}
		}
		for (int c = 0; c < copies; c++)
			free(w[c]);
		free(w);
		free(x);
		free(y);
	}
	if (json)
		printf("]");
}

/* L layer caches of `floats` floats each in huge pages (as kv.c holds
 * them), filled with a fixed pattern, and a block table of `pages` pages in
 * scattered order; *clen the length of each for ds_huge_free. */
static float **attn_caches(int L, int64_t floats, int64_t pages, int32_t **table, size_t *clen)
{
	float **cache = calloc((size_t)L, sizeof *cache);
	*table = malloc(sizeof(int32_t) * (size_t)pages);
	for (int64_t i = 0; i < pages; i++)
		(*table)[i] = (int32_t)((i * 7) % pages);
	for (int l = 0; l < L; l++) {
		cache[l] = ds_huge_alloc(sizeof(float) * (size_t)floats, clen);
		for (int64_t i = 0; i < floats; i++)
			cache[l][i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
	}
	return cache;
}

static void attn_caches_free(float **cache, int L, int32_t *table, size_t clen)
{
	for (int l = 0; l < L; l++)
		ds_huge_free(cache[l], clen);
	free(cache);
	free(table);
}

/* Paged attention (kc_paged_attn) at decode and prefill.  Decode: one token
 * at depth D over L distinct layer caches (L x D rows, larger than the
 * last-level cache, so rows come from memory as in a model's step; the
 * "in L2/L3" shape has one layer, so its rows stay in cache and the figure
 * is the kernel's compute rate): us per token and layer, GB/s of K/V rows read, and that over the read probe taken
 * just before.  Prefill: one chunk of C tokens at positions 0..C-1 (causal),
 * GFLOP/s counting 4 x head_dim flops per (query, visible key, head). */
static void bench_attn(void)
{
	static const struct {
		const char *name;
		int H, KV, hd, layers;
	} shapes[] = {{"smollm2-135m", 9, 3, 64, 30}, {"smollm2 in L2/L3", 9, 3, 64, 1}, {"llama-8b", 32, 8, 128, 8}};
	static const int depths[] = {512, 2048, 8192};
	static const int chunks[] = {512, 2048};
	const int ps = 64;
	probe_bandwidth();
	for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
		const int H = shapes[si].H, KV = shapes[si].KV, hd = shapes[si].hd, L = shapes[si].layers;
		const int64_t row = 2 * KV * hd, maxd = 8192, pages = maxd / ps;
		size_t clen = 0;
		int32_t *table = NULL;
		float **cache = attn_caches(L, pages * ps * row, pages, &table, &clen);
		float *q = malloc(sizeof(float) * (size_t)(2048 * H * hd));
		float *out = malloc(sizeof(float) * (size_t)(2048 * H * hd));
		int32_t *seq = calloc(2048, sizeof(int32_t)), *pos = malloc(sizeof(int32_t) * 2048);
		for (int64_t i = 0; i < 2048 * H * hd; i++)
			q[i] = (float)((i * 40503u) % 1000) / 500.0f - 1.0f;
		kb_paged_attn_args a = {.out = out, .q = q, .n_tok = 1, .n_heads = H, .n_kv_heads = KV,
					.head_dim = hd, .q_stride = H * hd, .out_stride = H * hd,
					.page_size = ps, .row_stride = row, .k_off = 0, .v_off = KV * hd,
					.block_tables = table, .max_blocks = pages, .tok_seq = seq, .tok_pos = pos,
					.scale = 0.125f};
		/* the same rows as IEEE halves (magnitudes 2^-5 .. 2^-1), in another set of layers */
		uint16_t **c16 = malloc(sizeof *c16 * (size_t)L);
		size_t c16len = 0;
		for (int l = 0; l < L; l++) {
			c16[l] = ds_huge_alloc(sizeof(uint16_t) * (size_t)(pages * ps * row), &c16len);
			for (int64_t i = 0; i < pages * ps * row; i++) {
				const uint32_t r = (uint32_t)((uint64_t)(i + l) * 2654435761u >> 7);
				c16[l][i] = (uint16_t)((r & 1) << 15 | (10 + r % 5) << 10 | (r >> 4 & 0x3ff));
			}
		}
		for (int f16 = 0; f16 <= 1; f16++)
			for (size_t di = 0; di < sizeof depths / sizeof depths[0]; di++) {
				const int D = depths[di];
				pos[0] = D - 1;
				a.cache_type = f16 ? KB_F16 : KB_F32;
				double best = 1e30;
				probe_bandwidth();
				for (int rep = 0; rep < 5; rep++) {
					double t0 = ds_now_s();
					for (int l = 0; l < L; l++) {
						a.cache = f16 ? (const void *)c16[l] : cache[l];
						kc_paged_attn(&a);
					}
					double dt = (ds_now_s() - t0) / L;
					best = dt < best ? dt : best;
				}
				double gbs = (double)D * (double)row * (f16 ? 2.0 : 4.0) / best / 1e9;
				printf("paged attn decode %-16s (%d heads on %d x %d) %s depth %5d: %8.1f us per layer, %5.1f "
				       "GB/s of K/V, %.2f of the read probe (%.1f GB/s)\n",
				       shapes[si].name, H, KV, hd, f16 ? "f16" : "f32", D, best * 1e6, gbs,
				       gbs * 1e9 / bw_best, bw_best / 1e9);
			}
		a.cache_type = KB_F32;
		for (int f16 = 0; f16 <= 1; f16++)
			for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
				const int C = chunks[ci];
				for (int i = 0; i < C; i++)
					pos[i] = i;
				a.n_tok = C;
				a.cache = f16 ? (const void *)c16[0] : cache[0];
				a.cache_type = f16 ? KB_F16 : KB_F32;
				double best = 1e30;
				for (int rep = 0; rep < 3; rep++) {
					double t0 = ds_now_s();
					kc_paged_attn(&a);
					double dt = ds_now_s() - t0;
					best = dt < best ? dt : best;
				}
				double flops = 4.0 * hd * H * ((double)C * (C + 1) / 2);
				printf("paged attn prefill %-16s %s chunk %5d: %8.2f ms, %6.1f GFLOP/s\n", shapes[si].name,
				       f16 ? "f16" : "f32", C, best * 1e3, flops / best / 1e9);
				a.n_tok = 1;
			}
		a.cache_type = KB_F32;
		for (int l = 0; l < L; l++)
			ds_huge_free(c16[l], c16len);
		free(c16);
		attn_caches_free(cache, L, table, clen);
		free(q);
		free(out);
		free(seq);
		free(pos);
	}
}

/* Absorbed MLA (kc_mla_attn) at decode: one token at depth D over the
 * latent cache (kv_lora + rope floats a row), L distinct layer caches so
 * that rows come from memory.  Baseline in the same run: the same heads
 * 16 at a time (one call per 16, so one group of 8 per item, each reading
 * the whole cache: the form before items held several groups).  Reports us
 * per layer, GFLOP/s (2 x (2 kv_lora + rope) flops per head and row) and
 * the speedup over the baseline. */
static void bench_mla(void)
{
	static const struct {
		const char *name;
		int H, layers;
	} shapes[] = {{"deepseek-v3", 128, 3}, {"v3shape bench", 16, 3}};
	static const int depths[] = {4096, 16384};
	const int64_t lora = 512, rope = 64, row = lora + rope, ps = 64, maxd = 16384, pages = maxd / ps;
	for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
		const int H = shapes[si].H, L = shapes[si].layers;
		size_t clen = 0;
		int32_t *table = NULL, seq = 0, pos = 0;
		float **cache = attn_caches(L, pages * ps * row, pages, &table, &clen);
		float *ql = malloc(sizeof(float) * (size_t)(H * lora)), *qp = malloc(sizeof(float) * (size_t)(H * rope));
		float *out = malloc(sizeof(float) * (size_t)(H * lora));
		for (int64_t i = 0; i < H * lora; i++)
			ql[i] = (float)((i * 40503u) % 1000) / 500.0f - 1.0f;
		for (int64_t i = 0; i < H * rope; i++)
			qp[i] = (float)((i * 69069u) % 1000) / 500.0f - 1.0f;
		kb_mla_attn_args a = {.out = out, .q_lat = ql, .q_pe = qp, .n_tok = 1, .n_heads = H,
				      .kv_lora = lora, .rope_dim = rope, .out_stride = H * lora,
				      .q_lat_stride = H * lora, .q_pe_stride = H * rope, .page_size = ps,
				      .row_stride = row, .block_tables = table, .max_blocks = pages,
				      .tok_seq = &seq, .tok_pos = &pos, .scale = 0.07f};
		for (size_t di = 0; di < sizeof depths / sizeof depths[0]; di++) {
			const int D = depths[di];
			pos = D - 1;
			double best[2] = {1e30, 1e30};
			for (int rep = 0; rep < 8; rep++)
				for (int form = 0; form < 2; form++) { /* alternating: 0 as built, 1 the baseline */
					double t0 = ds_now_s();
					for (int l = 0; l < L; l++) {
						kb_mla_attn_args b = a;
						b.cache = cache[l];
						if (form == 0) {
							kc_mla_attn(&b);
							continue;
						}
						for (int h = 0; h < H; h += 16) {
							b.n_heads = H - h < 16 ? H - h : 16;
							b.q_lat = ql + h * lora, b.q_pe = qp + h * rope, b.out = out + h * lora;
							kc_mla_attn(&b);
						}
					}
					double dt = (ds_now_s() - t0) / L;
					best[form] = dt < best[form] ? dt : best[form];
				}
			const double flops = 2.0 * H * (2.0 * lora + rope) * D;
			printf("mla decode %-14s (%3d heads, %lld + %lld) depth %5d: %8.1f us per layer, %6.1f GFLOP/s; "
			       "heads 16 at a time %8.1f us: %.2fx\n",
			       shapes[si].name, H, (long long)lora, (long long)rope, D, best[0] * 1e6, flops / best[0] / 1e9,
			       best[1] * 1e6, best[1] / best[0]);
		}
		attn_caches_free(cache, L, table, clen);
		free(ql);
		free(qp);
		free(out);
	}
}

int main(int argc, char **argv)
{
	int json = 0, quick = 0, nthreads = 0, membw_only = 0, decode = 0, quant_only = 0, attn_only = 0, rc = 0;
	const char *only = NULL;
	kb_backend *cpu = NULL;
	ds_err err = {0};
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--json") == 0) {
			json = 1;
		} else if (strcmp(argv[i], "--quick") == 0) {
			quick = 1;
		} else if (strcmp(argv[i], "--membw") == 0) {
			membw_only = 1;
		} else if (strcmp(argv[i], "--decode") == 0) {
			decode = 1;
		} else if (strcmp(argv[i], "--decode-hot") == 0) {
			decode = 2;
		} else if (strcmp(argv[i], "--attn") == 0) {
			attn_only = 1;
		} else if (strcmp(argv[i], "--quant") == 0) {
			quant_only = 1;
		} else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
			only = argv[++i];
		} else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
			if (ds_parse_int(argv[++i], 0, KC_POOL_MAX_THREADS, &nthreads) != DS_OK) {
				fprintf(stderr, "bench_kernels: --threads wants 0..%d\n", KC_POOL_MAX_THREADS);
				return 2;
			}
		} else {
			fprintf(stderr, "usage: bench_kernels [--json] [--quick] [--membw] [--decode] [--decode-hot] [--quant] [--attn] [--threads N] [--only DTYPE]\n");
			return 2;
		}
	}
	/* The pool the kernels share is sized through the instance. */
	kb_backend_params bp = kb_backend_default_params();
	bp.threads = nthreads;
	if (!(cpu = kb_backend_open("cpu", &bp, &err))) {
		fprintf(stderr, "bench_kernels: %s\n", err.msg);
		return 1;
	}
	if (membw_only) { /* the read bandwidth alone, best of 3 probes (the engine bench's bound) */
		for (int i = 0; i < 3; i++)
			probe_bandwidth();
		printf("read bandwidth (%d threads): %.2f GB/s\n", kc_pool_threads(), bw_best / 1e9);
		double triad = 0, t;
		for (int i = 0; i < 3; i++) {
			if (kc_measure_triad_bandwidth((size_t)32 << 20, 0, &t) != DS_OK) {
				fprintf(stderr, "bench_kernels: the triad probe failed\n");
				rc = 1;
				goto out;
			}
			triad = t > triad ? t : triad;
		}
		printf("stream triad (%d threads): %.2f GB/s\n", kc_pool_threads(), triad / 1e9);
		goto out;
	}
	if (decode) {
		bench_decode(decode == 2, only);
		goto out;
	}
	if (quant_only) {
		bench_quant(quick, json, only);
		goto out;
	}
	if (attn_only) {
		bench_attn();
		bench_mla();
		goto out;
	}
	if (json)
		printf("{");
	bench_rmsnorm(cpu, json);
	bench_matmul(quick, only);
	int threads = kc_pool_threads();
	if (json)
		printf(",\"membw\":{\"threads\":%d,\"read_gbs\":%.2f,\"read_gbs_1thread\":%.2f},"
		       "\"matmul\":[",
		       threads, bw_best / 1e9, bw1_best / 1e9);
	else
		printf("membw read (best probe of the run, 256 MiB, 2 streams per thread, huge pages): %.1f GB/s with "
		       "%d threads, %.1f GB/s with 1\n",
		       bw_best / 1e9, threads, bw1_best / 1e9);
	print_matmul(json);
	if (json)
		printf("]");
	bench_quant(quick, json, only);
	if (json)
		printf("}\n");
out:
	kb_backend_close(cpu);
	return rc;
}

/*
 * test_quant.c - GGUF block-quantized weights on the CPU (kernels/cpu/quant.h).
 *
 *  - dequantization of one hand-built block per type against values computed
 *    here from the documented layout (scales powers of two, so every expected
 *    value is exact and compared with ==);
 *  - the quantized matmul (every ISA this CPU has, VNNI on and off, decode
 *    and GEMM paths) against an f32 product of the dequantized weights, with
 *    the worst-case bound of the two-level activations (quant.h):
 *        |y - y_f32| <= sum_k |W_k| * amax(x block of k) / 32000 + 2e-6 sum_k |x_k W_k|
 *    (level 2 leaves at most one step d2 = d1 / 256 = amax / 32512 per
 *    element: half a step from rounding, up to a whole one where the clamp to
 *    127 trims a residual of d1 / 2; the slack and the second term cover the
 *    f32 residual, scales and sums).  The 8-bit scheme's bound was amax / 254,
 *    127 times looser: it would fail here;
 *  - results independent of the thread count, batched products, the
 *    backend's argument checks, embedding rows and the dequant op on slices.
 */
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/quant.h"
#include "tests/unit/unit.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static void put16(uint8_t *p, uint16_t v)
{
	p[0] = (uint8_t)v;
	p[1] = (uint8_t)(v >> 8);
}

TEST(quant_dequant_q8_0_block)
{
	uint8_t b[34];
	put16(b, 0x3800); /* d = 0.5 */
	for (int i = 0; i < 32; i++)
		b[2 + i] = (uint8_t)(int8_t)(i * 7 - 100);
	float o[32];
	kc_dequant_row_ref(KB_Q8_0, b, o, 32);
	for (int i = 0; i < 32; i++)
		CHECK(o[i] == 0.5f * (float)(i * 7 - 100));
}

TEST(quant_dequant_q4_0_block)
{
	uint8_t b[18];
	put16(b, 0x3400); /* d = 0.25 */
	for (int i = 0; i < 16; i++)
		b[2 + i] = (uint8_t)(i | (15 - i) << 4);
	float o[32];
	kc_dequant_row_ref(KB_Q4_0, b, o, 32);
	for (int i = 0; i < 16; i++) {
		CHECK(o[i] == 0.25f * (float)(i - 8));            /* low nibbles: elements 0..15 */
		CHECK(o[i + 16] == 0.25f * (float)(15 - i - 8)); /* high nibbles: 16..31 */
	}
	CHECK(o[0] == -2.0f && o[16] == 1.75f);
}

TEST(quant_dequant_q4_1_block)
{
	uint8_t b[20];
	put16(b, 0x4000);     /* d = 2 */
	put16(b + 2, 0xBE00); /* m = -1.5 */
	for (int i = 0; i < 16; i++)
		b[4 + i] = (uint8_t)((i * 3) % 16 | ((i * 5 + 1) % 16) << 4);
	float o[32];
	kc_dequant_row_ref(KB_Q4_1, b, o, 32);
	for (int i = 0; i < 16; i++) {
		CHECK(o[i] == 2.0f * (float)((i * 3) % 16) - 1.5f);
		CHECK(o[i + 16] == 2.0f * (float)((i * 5 + 1) % 16) - 1.5f);
	}
}

/* The 12 packed bytes of 8 six-bit scales s[] and mins m[] (layout in quant.h). */
static void pack_k4_scales(uint8_t *sc, const int *s, const int *m)
{
	for (int j = 0; j < 4; j++) {
		sc[j] = (uint8_t)(s[j] | (s[j + 4] >> 4) << 6);
		sc[j + 4] = (uint8_t)(m[j] | (m[j + 4] >> 4) << 6);
		sc[j + 8] = (uint8_t)((s[j + 4] & 15) | (m[j + 4] & 15) << 4);
	}
}

/* Q4_K (five = 0) and Q5_K blocks with d = 1, dmin = 0.5 and scales / mins
 * that use the high bits of the packing. */
static void check_k45_block(int five)
{
	static const int s[8] = {1, 2, 3, 4, 17, 33, 50, 63}, m[8] = {5, 6, 7, 8, 20, 40, 60, 1};
	uint8_t b[176];
	memset(b, 0, sizeof b);
	put16(b, 0x3C00);     /* d = 1 */
	put16(b + 2, 0x3800); /* dmin = 0.5 */
	pack_k4_scales(b + 4, s, m);
	uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
	for (int i = 0; i < 32; i++) {
		if (five)
			qh[i] = (uint8_t)(i * 37 + 11);
		for (int c = 0; c < 4; c++)
			qs[32 * c + i] = (uint8_t)((i + c) % 16 | (15 - (i + 2 * c) % 16) << 4);
	}
	float o[256];
	kc_dequant_row_ref(five ? KB_Q5_K : KB_Q4_K, b, o, 256);
	int bad = 0;
	for (int c = 0; c < 4; c++) {
		for (int i = 0; i < 32; i++) {
			int lo = (i + c) % 16, hi = 15 - (i + 2 * c) % 16;
			if (five) {
				lo += 16 * ((qh[i] >> (2 * c)) & 1);
				hi += 16 * ((qh[i] >> (2 * c + 1)) & 1);
			}
			int j0 = 2 * c, j1 = 2 * c + 1;
			bad += o[64 * c + i] != (float)(s[j0] * lo) - 0.5f * (float)m[j0];
			bad += o[64 * c + 32 + i] != (float)(s[j1] * hi) - 0.5f * (float)m[j1];
		}
	}
	CHECK_EQ(bad, 0);
	/* two values by hand: element 0 (sub-block 0, q = 0 + high bit),
	 * element 255 (sub-block 7: s = 63, m = 1, q = 15 - (31 + 6) % 16 = 10 + high bit) */
	CHECK(o[0] == (five ? 1.0f * 16 - 2.5f : -2.5f));
	CHECK(o[255] == 63.0f * (float)(10 + (five ? 16 * ((qh[31] >> 7) & 1) : 0)) - 0.5f);
}

TEST(quant_dequant_q4_k_block)
{
	check_k45_block(0);
}

TEST(quant_dequant_q5_k_block)
{
	check_k45_block(1);
}

TEST(quant_dequant_q6_k_block)
{
	uint8_t b[210];
	memset(b, 0, sizeof b);
	int v[256];
	for (int e = 0; e < 256; e++) {
		v[e] = (e * 5 + 3) % 64;
		/* the documented placement of element e's low 4 and high 2 bits */
		int h = e / 128, quad = (e % 128) / 32, i = e % 32;
		uint8_t *L = b + 64 * h + (quad & 1 ? 32 : 0), *H = b + 128 + 32 * h;
		L[i] |= (uint8_t)(quad & 2 ? (v[e] & 15) << 4 : v[e] & 15);
		H[i] |= (uint8_t)((v[e] >> 4) << (2 * quad));
	}
	for (int g = 0; g < 16; g++)
		b[192 + g] = (uint8_t)(int8_t)(g * 9 - 70);
	put16(b + 208, 0x3000); /* d = 0.125 */
	float o[256];
	kc_dequant_row_ref(KB_Q6_K, b, o, 256);
	int bad = 0;
	for (int e = 0; e < 256; e++)
		bad += o[e] != 0.125f * (float)((e / 16) * 9 - 70) * (float)(v[e] - 32);
	CHECK_EQ(bad, 0);
	CHECK(o[0] == 0.125f * -70.0f * (3 - 32));
}

/* ---- random blocks ---- */

/* Random blocks; with `full` every quant byte 0xFF instead (each value the
 * type's largest), only the f16 scales random. */
static void rand_blocks_as(enum kb_dtype t, uint8_t *w, size_t bytes, int full)
{
	const size_t bb = kb_dtype_block_bytes(t);
	for (size_t i = 0; i < bytes; i++)
		w[i] = full ? 0xFF : (uint8_t)ut_rand_u64();
	for (size_t o = 0; o < bytes; o += bb) {
		/* f16 scales 2^-9 .. 2^-3 of either sign */
		uint16_t h = (uint16_t)((ut_rand_u64() & 1) << 15 | (6 + ut_rand_u64() % 7) << 10 |
					(ut_rand_u64() & 1023));
		uint16_t h2 = (uint16_t)(h ^ (ut_rand_u64() & 0x83FF));
		if (t == KB_Q6_K) {
			put16(w + o + 208, h);
		} else {
			put16(w + o, h);
			if (t == KB_Q4_1 || t == KB_Q4_K || t == KB_Q5_K)
				put16(w + o + 2, h2);
		}
	}
}

static void rand_blocks(enum kb_dtype t, uint8_t *w, size_t bytes)
{
	rand_blocks_as(t, w, bytes, 0);
}

static const enum kb_dtype qtypes[] = {KB_Q8_0, KB_Q4_0, KB_Q4_1, KB_Q4_K, KB_Q5_K, KB_Q6_K};

/* y (M x N) against the f32 product of the dequantized weights, with the
 * bound of the top comment; returns the number of violations. */
static int check_vs_f32(enum kb_dtype t, const float *x, int64_t M, int64_t K, const float *wf, int64_t N,
			const float *y, double *worst)
{
	const int64_t blk = kb_dtype_block(t);
	int bad = 0;
	for (int64_t m = 0; m < M; m++) {
		for (int64_t n = 0; n < N; n++) {
			double exact = 0, bound = 0, mag = 0;
			for (int64_t b = 0; b < K / blk; b++) {
				double amax = 0;
				for (int64_t k = b * blk; k < (b + 1) * blk; k++)
					amax = fmax(amax, fabs(x[m * K + k]));
				for (int64_t k = b * blk; k < (b + 1) * blk; k++) {
					double wk = wf[n * K + k];
					exact += (double)x[m * K + k] * wk;
					bound += fabs(wk) * amax / 32000.0;
					mag += fabs((double)x[m * K + k] * wk);
				}
			}
			double e = fabs((double)y[m * N + n] - exact);
			if (e > bound + 2e-6 * mag)
				bad++;
			if (e / (mag + 1e-30) > *worst)
				*worst = e / (mag + 1e-30);
		}
	}
	return bad;
}

/* Random blocks and x, then (full = 1) every weight the type's largest value
 * and each x row one constant of either sign: every integer dot is as large
 * as it gets, which catches an overflow of the AVX2 tile's i16 sums. */
TEST(quant_matmul_matches_f32_product_within_two_level_bound)
{
	static const int64_t ms[] = {1, 2, 5, 33};
	for (size_t tf = 0; tf < 2 * sizeof qtypes / sizeof qtypes[0]; tf++) {
		const enum kb_dtype t = qtypes[tf / 2];
		const int full = (int)(tf % 2);
		const int64_t K = kb_dtype_block(t) == 32 ? 160 : 512, N = 37;
		const size_t wbytes = (size_t)N * kb_dtype_bytes(t, K);
		uint8_t *w = malloc(wbytes);
		float *wf = malloc((size_t)(N * K) * sizeof(float));
		float *x = malloc((size_t)(33 * K) * sizeof(float));
		float *y = malloc((size_t)(33 * N) * sizeof(float));
		rand_blocks_as(t, w, wbytes, full);
		kc_dequant_row_ref(t, w, wf, N * K); /* rows are consecutive blocks */
		for (int64_t i = 0; i < 33 * K; i++)
			x[i] = full ? ((i / K) % 2 ? -1.0f : 1.0f) * (float)(1 + (i / K) % 3)
				    : ut_rand_float(-1.0f, 1.0f) * (i % 7 == 0 ? 4.0f : 1.0f);
		for (int isa = 0; isa <= (int)kc_isa_detect(); isa++) {
			for (int vnni = 0; vnni < (isa >= KC_ISA_AVX512 ? 2 : 1); vnni++) {
				int prev = kc_quant_allow_vnni(vnni);
				for (size_t mi = 0; mi < sizeof ms / sizeof ms[0]; mi++) {
					kb_matmul_args a = {.y = y, .x = x, .w = w, .wtype = t, .M = ms[mi], .N = N,
							    .K = K, .x_stride = K, .y_stride = N, .w_stride = K};
					CHECK_EQ(kc_qmatmul_isa((enum kc_isa)isa, &a), DS_OK);
					double worst = 0;
					int bad = check_vs_f32(t, x, ms[mi], K, wf, N, y, &worst);
					if (bad)
						ut_fail(__FILE__, __LINE__, "type %d%s isa %d vnni %d M %lld: %d outside the bound",
							(int)t, full ? " full" : "", isa, vnni, (long long)ms[mi], bad);
					/* and the bound is not vacuous: the worst error relative
					 * to sum |x W| stays under 1e-4 (8-bit activations: ~1e-2) */
					if (!(worst < 1e-4))
						ut_fail(__FILE__, __LINE__, "type %d%s isa %d vnni %d M %lld: worst %.3g",
							(int)t, full ? " full" : "", isa, vnni, (long long)ms[mi], worst);
				}
				kc_quant_allow_vnni(prev);
			}
		}
		free(w);
		free(wf);
		free(x);
		free(y);
	}
}

/* The same y bits whatever the thread count (decode and GEMM paths). */
TEST(quant_matmul_thread_count_independent)
{
	const enum kb_dtype t = KB_Q4_1;
	const int64_t K = 4096 + 64, N = 70; /* two GEMM K chunks */
	const size_t wbytes = (size_t)N * kb_dtype_bytes(t, K);
	uint8_t *w = malloc(wbytes);
	float *x = malloc((size_t)(20 * K) * sizeof(float));
	float *y1 = malloc((size_t)(20 * N) * sizeof(float)), *y3 = malloc((size_t)(20 * N) * sizeof(float));
	rand_blocks(t, w, wbytes);
	for (int64_t i = 0; i < 20 * K; i++)
		x[i] = ut_rand_float(-2.0f, 2.0f);
	static const int64_t ms[] = {1, 3, 20};
	for (size_t mi = 0; mi < 3; mi++) {
		kb_matmul_args a = {.y = y1, .x = x, .w = w, .wtype = t, .M = ms[mi], .N = N, .K = K,
				    .x_stride = K, .y_stride = N, .w_stride = K};
		CHECK_EQ(kc_pool_set_threads(1), DS_OK);
		CHECK_EQ(kc_qmatmul_isa(kc_isa_active(), &a), DS_OK);
		CHECK_EQ(kc_pool_set_threads(3), DS_OK);
		a.y = y3;
		CHECK_EQ(kc_qmatmul_isa(kc_isa_active(), &a), DS_OK);
		CHECK(memcmp(y1, y3, (size_t)(ms[mi] * N) * sizeof(float)) == 0);
	}
	CHECK_EQ(kc_pool_set_threads(0), DS_OK);
	free(w);
	free(x);
	free(y1);
	free(y3);
}

TEST(quant_matmul_batched_and_backend_checks)
{
	const kb_backend *be = kb_backend_get("cpu", NULL);
	const enum kb_dtype t = KB_Q6_K;
	const int64_t K = 512, N = 9, M = 3, B = 3;
	const size_t item = (size_t)N * kb_dtype_bytes(t, K);
	uint8_t *w = malloc(item * B);
	float *x = malloc((size_t)(B * M * K) * sizeof(float));
	float *y = malloc((size_t)(B * M * N) * sizeof(float)), *r = malloc((size_t)(M * N) * sizeof(float));
	rand_blocks(t, w, item * B);
	for (int64_t i = 0; i < B * M * K; i++)
		x[i] = ut_rand_float(-1.0f, 1.0f);
	kb_matmul_args a = {.y = y, .x = x, .w = w, .wtype = t, .M = M, .N = N, .K = K, .x_stride = K,
			    .y_stride = N, .w_stride = K, .batch = B, .x_bstride = M * K, .y_bstride = M * N,
			    .w_bstride = N * K};
	CHECK_EQ(kb_matmul(be, &a), DS_OK);
	for (int64_t i = 0; i < B; i++) {
		kb_matmul_args one = {.y = r, .x = x + i * M * K, .w = w + i * item, .wtype = t, .M = M,
				      .N = N, .K = K, .x_stride = K, .y_stride = N, .w_stride = K};
		kc_qmatmul_ref(&one);
		for (int64_t j = 0; j < M * N; j++)
			CHECK_NEAR(y[i * M * N + j], r[j], 1e-4 * (fabs(r[j]) + 1.0));
	}
	/* whole blocks only */
	kb_matmul_args bad = a;
	bad.batch = 0;
	bad.K = 300;
	CHECK_EQ(kb_matmul(be, &bad), DS_EINVAL);
	bad.K = 256;
	bad.w_stride = 300;
	CHECK_EQ(kb_matmul(be, &bad), DS_EINVAL);
	bad = a;
	bad.w_bstride = N * K + 16;
	CHECK_EQ(kb_matmul(be, &bad), DS_EINVAL);
	bad = a;
	bad.M = 0;
	CHECK_EQ(kb_matmul(be, &bad), DS_OK);
	free(w);
	free(x);
	free(y);
	free(r);
}

TEST(quant_embed_rows)
{
	const kb_backend *be = kb_backend_get("cpu", NULL);
	const enum kb_dtype t = KB_Q8_0;
	const int64_t rows = 40, dim = 96, ts = 128; /* table rows 128 wide, 96 used */
	const size_t rb = kb_dtype_bytes(t, ts);
	uint8_t *table = malloc(rb * rows);
	rand_blocks(t, table, rb * rows);
	int32_t ids[5] = {3, 39, 0, 3, 17};
	float out[5 * 100], want[96];
	for (int i = 0; i < 5 * 100; i++)
		out[i] = -7.0f;
	kb_embed_args a = {.out = out, .table = table, .type = t, .ids = ids, .n = 5, .dim = dim,
			   .out_stride = 100, .table_stride = ts};
	CHECK_EQ(kb_embed(be, &a), DS_OK);
	for (int i = 0; i < 5; i++) {
		kc_dequant_row_ref(t, table + (size_t)ids[i] * rb, want, dim);
		CHECK(memcmp(out + i * 100, want, sizeof want) == 0);
		CHECK(out[i * 100 + 96] == -7.0f); /* padding untouched */
	}
	a.dim = 90;
	CHECK_EQ(kb_embed(be, &a), DS_EINVAL);
	a.dim = 96;
	a.table_stride = 100;
	CHECK_EQ(kb_embed(be, &a), DS_EINVAL);
	free(table);
}

TEST(quant_dequant_op_slices)
{
	const kb_backend *be = kb_backend_get("cpu", NULL);
	const enum kb_dtype t = KB_Q4_K;
	const int64_t rows = 3, full = 1024;
	const size_t rb = kb_dtype_bytes(t, full);
	uint8_t *w = malloc(rb * rows);
	rand_blocks(t, w, rb * rows);
	float out[3 * 520], want[1024];
	/* columns 256..767 of rows 0..2 */
	kb_dequant_args a = {.out = out, .w = w + kb_dtype_bytes(t, 256), .wtype = t, .rows = rows,
			     .cols = 512, .out_stride = 520, .w_stride = full};
	CHECK_EQ(kb_dequant(be, &a), DS_OK);
	for (int64_t r = 0; r < rows; r++) {
		kc_dequant_row_ref(t, w + r * rb, want, full);
		CHECK(memcmp(out + r * 520, want + 256, 512 * sizeof(float)) == 0);
	}
	a.cols = 500;
	CHECK_EQ(kb_dequant(be, &a), DS_EINVAL);
	free(w);
}

TEST(quant_matmul_multi_equals_each_product)
{
	/* q, k and v of a decode row (Q8_0, Q4_1 and Q8_0: the same activation
	 * blocks), then gate and up in Q4_K / Q6_K (256-blocks): through the
	 * backend's matmul_multi, on every ISA and 1-3 threads, the bits of
	 * one call per product; one product accumulating into y */
	const kb_backend *be = kb_backend_get("cpu", NULL);
	CHECK(be != NULL && be->ops->matmul_multi != NULL);
	static const struct {
		enum kb_dtype t[3];
		int64_t N[3], K;
		int n;
	} sets[] = {{{KB_Q8_0, KB_Q4_1, KB_Q8_0}, {576, 192, 200}, 576, 3},
		    {{KB_Q4_K, KB_Q6_K, KB_Q4_K}, {300, 160, 0}, 512, 2}};
	const int prev_threads = kc_pool_threads();
	for (size_t si = 0; si < sizeof sets / sizeof sets[0]; si++) {
		const int n = sets[si].n;
		const int64_t K = sets[si].K;
		uint8_t *w[3];
		float *y[3], *ref[3];
		kb_matmul_args a[3];
		float *x = malloc((size_t)K * sizeof(float));
		for (int64_t i = 0; i < K; i++)
			x[i] = ut_rand_float(-2.0f, 2.0f);
		for (int i = 0; i < n; i++) {
			const int64_t N = sets[si].N[i];
			size_t wb = (size_t)N * kb_dtype_bytes(sets[si].t[i], K);
			w[i] = malloc(wb);
			rand_blocks(sets[si].t[i], w[i], wb);
			y[i] = malloc((size_t)N * sizeof(float));
			ref[i] = malloc((size_t)N * sizeof(float));
			a[i] = (kb_matmul_args){.y = y[i], .x = x, .w = w[i], .wtype = sets[si].t[i], .M = 1,
						.N = N, .K = K, .x_stride = K, .y_stride = N, .w_stride = K,
						.accumulate = i == 1};
		}
		for (int isa = (int)KC_ISA_AVX2; isa <= (int)kc_isa_detect(); isa++) {
			enum kc_isa prev = kc_isa_force((enum kc_isa)isa);
			for (int th = 1; th <= 3; th++) {
				CHECK_EQ(kc_pool_set_threads(th), DS_OK);
				for (int i = 0; i < n; i++) {
					for (int64_t r = 0; r < sets[si].N[i]; r++)
						ref[i][r] = y[i][r] = (float)r * 0.25f; /* what accumulate adds to */
					a[i].y = ref[i];
					CHECK_EQ(kb_matmul(be, &a[i]), DS_OK);
					a[i].y = y[i];
				}
				CHECK_EQ(kb_matmul_multi(be, a, n), DS_OK);
				for (int i = 0; i < n; i++)
					if (memcmp(y[i], ref[i], (size_t)sets[si].N[i] * sizeof(float)) != 0)
						ut_fail(__FILE__, __LINE__, "set %zu product %d, isa %s, %d threads: "
							"other bits than one call", si, i, kc_isa_name((enum kc_isa)isa), th);
			}
			kc_isa_force(prev);
		}
		for (int i = 0; i < n; i++) {
			free(w[i]);
			free(y[i]);
			free(ref[i]);
		}
		free(x);
	}
	kc_pool_set_threads(prev_threads);
}

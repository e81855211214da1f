/*
 * test_kernels_fp8.c - FP8 E4M3FN weights: the decoding table against
 * hand-computed values and against an independent decoder written here from
 * the bit fields with ldexp, and the block dequantization inside the matmul
 * (every CPU ISA, decode and prefill paths, partial edge blocks, a column
 * slice) against that decoder, EXACTLY: with x = unit vectors e_k, y is
 * column k of the dequantized W, which must equal (float)fp8 * scale.
 */
#include "kernels/cpu/cpu.h"
#include "tests/unit/unit.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Independent of kernels/cpu/convert.c: sign, exponent, mantissa by hand. */
static double fp8_decode(uint8_t b)
{
	int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
	if (e == 15 && m == 7)
		return NAN;
	double v = e == 0 ? ldexp((double)m / 8.0, -6) : ldexp(1.0 + (double)m / 8.0, e - 7);
	return s ? -v : v;
}

TEST(fp8_lut_hand_values)
{
	const float *lut = kc_fp8_e4m3_lut();
	CHECK(lut[0x00] == 0.0f && !signbit(lut[0x00]));
	CHECK(lut[0x80] == 0.0f && signbit(lut[0x80]));
	CHECK(lut[0x01] == 0x1p-9f);  /* smallest subnormal */
	CHECK(lut[0x07] == 0x1.cp-7f); /* largest subnormal: 7/8 * 2^-6 */
	CHECK(lut[0x08] == 0x1p-6f);  /* smallest normal */
	CHECK(lut[0x38] == 1.0f);
	CHECK(lut[0x3C] == 1.5f);
	CHECK(lut[0x40] == 2.0f);
	CHECK(lut[0x7E] == 448.0f);
	CHECK(lut[0xFE] == -448.0f);
	CHECK(lut[0xB8] == -1.0f);
	CHECK(isnan(lut[0x7F]));
	CHECK(isnan(lut[0xFF]));
	CHECK(kc_fp8_e4m3_to_f32(0x38) == 1.0f);
}

TEST(fp8_lut_matches_bit_fields)
{
	const float *lut = kc_fp8_e4m3_lut();
	int bad = 0;
	for (int b = 0; b < 256; b++) {
		double d = fp8_decode((uint8_t)b);
		if (isnan(d) ? !isnan(lut[b]) : (double)lut[b] != d || !signbit(lut[b]) != !signbit(d))
			bad++;
	}
	CHECK_EQ(bad, 0);
}

TEST(f16_bf16_hand_values)
{
	CHECK(kc_f16_to_f32(0x3C00) == 1.0f);
	CHECK(kc_f16_to_f32(0xC000) == -2.0f);
	CHECK(kc_f16_to_f32(0x0001) == 0x1p-24f);
	CHECK(kc_f16_to_f32(0x03FF) == 0x1.ff8p-15f);
	CHECK(kc_f16_to_f32(0x7BFF) == 65504.0f);
	CHECK(isinf(kc_f16_to_f32(0x7C00)) && kc_f16_to_f32(0x7C00) > 0);
	CHECK(isnan(kc_f16_to_f32(0x7E00)));
	CHECK(signbit(kc_f16_to_f32(0x8000)));
	CHECK(kc_bf16_to_f32(0x3F80) == 1.0f);
	CHECK(kc_bf16_to_f32(0xC040) == -3.0f);
}

typedef struct fp8_mat {
	int64_t rows, cols, block, srows, scols;
	uint8_t *w;   /* [rows][cols] */
	float *scale; /* [srows][scols] */
} fp8_mat;

static void fp8_mat_init(fp8_mat *f, int64_t rows, int64_t cols, int64_t block)
{
	f->rows = rows;
	f->cols = cols;
	f->block = block;
	f->srows = (rows + block - 1) / block;
	f->scols = (cols + block - 1) / block;
	f->w = malloc((size_t)(rows * cols));
	f->scale = malloc((size_t)(f->srows * f->scols) * sizeof(float));
	for (int64_t i = 0; i < rows * cols; i++) {
		uint8_t b;
		do
			b = (uint8_t)ut_rand_u64();
		while ((b & 0x7F) == 0x7F); /* no NaN patterns */
		f->w[i] = b;
	}
	for (int64_t i = 0; i < f->srows * f->scols; i++)
		f->scale[i] = ut_rand_float(0.5f, 2.0f) * powf(2.0f, (float)(int)(ut_rand_u64() % 20) - 16.0f);
}

static void fp8_mat_free(fp8_mat *f)
{
	free(f->w);
	free(f->scale);
}

/* The expected dequantized W[n][k] of the slice starting at column col0. */
static float expect_w(const fp8_mat *f, int64_t n, int64_t k)
{
	float v = (float)fp8_decode(f->w[n * f->cols + k]);
	return v * f->scale[(n / f->block) * f->scols + k / f->block];
}

/* Runs y = x W^T for the slice [0, N) x [col0, col0 + K) with x = rows of
 * the identity picked by ks[0..M), and counts mismatches. */
static int check_columns(enum kc_isa isa, const fp8_mat *f, int64_t col0, int64_t N, int64_t K,
			 const int64_t *ks, int64_t M)
{
	float *x = calloc((size_t)(M * K), sizeof(float));
	float *y = malloc((size_t)(M * N) * sizeof(float));
	for (int64_t m = 0; m < M; m++)
		x[m * K + ks[m]] = 1.0f;
	kb_matmul_args a = {
		.y = y, .x = x, .w = f->w + col0, .w_scale = f->scale + col0 / f->block,
		.wtype = KB_F8_E4M3, .M = M, .N = N, .K = K, .x_stride = K, .y_stride = N,
		.w_stride = f->cols, .scale_stride = f->scols, .block = f->block, .accumulate = 0,
	};
	int bad = 0;
	if (kc_matmul_isa(isa, &a) != DS_OK)
		bad = 1;
	for (int64_t m = 0; m < M && !bad; m++) {
		for (int64_t n = 0; n < N; n++) {
			float want = expect_w(f, n, col0 + ks[m]);
			if (!(y[m * N + n] == want)) {
				if (bad++ < 3)
					ut_fail(__FILE__, __LINE__, "isa %s M=%lld: W[%lld][%lld] = %.9g, want %.9g",
						kc_isa_name(isa), (long long)M, (long long)n,
						(long long)(col0 + ks[m]), y[m * N + n], want);
			}
		}
	}
	free(x);
	free(y);
	return bad;
}

TEST(fp8_block_dequant_through_matmul_is_exact)
{
	/* 50: panels of 4 and 8 rows straddle scale-block rows */
	static const int64_t blocks[] = {128, 48, 50};
	for (size_t bi = 0; bi < 3; bi++) {
		const int64_t block = blocks[bi];
		fp8_mat f;
		/* 300 = 2 * 128 + 44 rows: a partial edge block; columns likewise */
		fp8_mat_init(&f, 300, 2 * block + 60, block);
		for (int isa = 0; isa <= (int)kc_isa_detect(); isa++) {
			/* the whole slice of width K = cols - block starting at column
			 * block (a column slice): identity x, prefill path */
			const int64_t col0 = block, K = f.cols - block;
			int64_t *all = malloc((size_t)K * sizeof *all);
			for (int64_t k = 0; k < K; k++)
				all[k] = k;
			CHECK_EQ(check_columns((enum kc_isa)isa, &f, col0, f.rows, K, all, K), 0);
			free(all);
			/* decode paths (M = 1 and M = 3) on the full width, columns
			 * at block edges and in the partial last block */
			const int64_t edge[] = {0, 1, block - 1, block, 2 * block - 1, 2 * block, f.cols - 1};
			for (size_t e = 0; e < sizeof edge / sizeof edge[0]; e++)
				CHECK_EQ(check_columns((enum kc_isa)isa, &f, 0, f.rows, f.cols, &edge[e], 1), 0);
			CHECK_EQ(check_columns((enum kc_isa)isa, &f, 0, f.rows, f.cols, edge, 3), 0);
			/* N not a multiple of any panel height */
			CHECK_EQ(check_columns((enum kc_isa)isa, &f, 0, 131, f.cols, edge + 2, 3), 0);
		}
		fp8_mat_free(&f);
	}
}

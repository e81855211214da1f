/*
 * matmul_avx2.c - AVX2 + FMA + F16C micro-kernels of the matmul (see
 * matmul_impl.h and matmul_avx512.c, which this mirrors with 8 lanes).
 *
 * Conversions in registers: BF16 zero-extend and shift, F16 vcvtph2ps, FP8 the
 * E4M3 byte mapped onto the F16 pattern ((b & 0x7F) << 7) | ((b & 0x80) << 8)
 * (value fp8 * 2^-8, exact, subnormals included) then vcvtph2ps and one
 * multiply by block_scale * 256 (of W, or of x when the tile's rows share a
 * scale block).  0x7F/0xFF decode as +-480 rather than NaN;
 * they never occur in real weights.  K tails: x through vmaskmovps, weights
 * through a zero-padded copy of the last < 8 elements (never read past a row).
 * At most 16 ymm registers: tiles are up to 3 x-rows by 4 W-rows (12
 * accumulators), or 1 x-row by 8 W-rows.  FP8 with one x row widens 16
 * bytes at a time (one sign-extension for two vectors).
 *
 * Called through kc_mm_kernels_avx2() by matmul.c only; stateless.
 */
#include "kernels/cpu/matmul_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL TGT __attribute__((always_inline)) static inline

INL size_t esize(int dt)
{
	return dt == KB_F32 ? 4 : dt == KB_F8_E4M3 ? 1 : 2;
}

/* 8 weights from element k of row w, converted (not scaled). */
INL __m256 w_load(const int dt, const void *w, int64_t k)
{
	switch (dt) {
	case KB_BF16: {
		__m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
		return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
	}
	case KB_F16:
		return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k)));
	case KB_F8_E4M3: {
		__m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)w + k));
		__m128i h = _mm_cvtepi8_epi16(b);
		h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16((short)0xBF80));
		return _mm256_cvtph_ps(h);
	}
	default:
		return _mm256_loadu_ps((const float *)w + k);
	}
}

/* The first n (< 8) weights from element k, the other lanes 0. */
INL __m256 w_load_part(const int dt, const void *w, int64_t k, int n)
{
	_Alignas(32) unsigned char tmp[32] = {0};
	memcpy(tmp, (const char *)w + (size_t)k * esize(dt), (size_t)n * esize(dt));
	return w_load(dt, tmp, 0);
}

INL __m256i lane_mask(int n)
{
	return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

INL float hsum(__m256 v)
{
	__m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
	s = _mm_add_ps(s, _mm_movehl_ps(s, s));
	s = _mm_add_ss(s, _mm_movehdup_ps(s));
	return _mm_cvtss_f32(s);
}

/* [sum a, sum b, sum c, sum d] with three horizontal adds. */
INL __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d)
{
	__m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
	return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

#define MR_CAP 3

/* acc[m][r] += x[m][k] * W[r][k] for k in [k0, k1) (one FP8 block at most);
 * FP8 scaling as in matmul_avx512.c (of W, or with UNI of the x vectors). */
INL void steps(const int MR, const int NR, const int DT, const int UNI,
	       __m256 acc[MR_CAP][KC_MM_NR_MAX], const float *const *xp,
	       const char *const *wp, int64_t k, int64_t k1, const float *sc)
{
	if (DT == KB_F8_E4M3 && MR == 1) {
		/* 16 bytes per load and one widening for two vectors; each lane still
		 * sees its k values in the same order as the 8-wide loop below */
		for (; k + 16 <= k1; k += 16) {
			__m256 x0 = _mm256_loadu_ps(xp[0] + k), x1 = _mm256_loadu_ps(xp[0] + k + 8);
			if (UNI) {
				x0 = _mm256_mul_ps(x0, _mm256_set1_ps(sc[0]));
				x1 = _mm256_mul_ps(x1, _mm256_set1_ps(sc[0]));
			}
#pragma GCC unroll 8
			for (int r = 0; r < NR; r++) {
				__m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wp[r] + k)));
				h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBF80));
				__m256 w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
				__m256 w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
				if (!UNI) {
					w0 = _mm256_mul_ps(w0, _mm256_set1_ps(sc[r]));
					w1 = _mm256_mul_ps(w1, _mm256_set1_ps(sc[r]));
				}
				acc[0][r] = _mm256_fmadd_ps(x0, w0, acc[0][r]);
				acc[0][r] = _mm256_fmadd_ps(x1, w1, acc[0][r]);
			}
		}
	}
	for (; k + 8 <= k1; k += 8) {
		__m256 xv[MR_CAP];
#pragma GCC unroll 8
		for (int m = 0; m < MR; m++) {
			xv[m] = _mm256_loadu_ps(xp[m] + k);
			if (DT == KB_F8_E4M3 && UNI)
				xv[m] = _mm256_mul_ps(xv[m], _mm256_set1_ps(sc[0]));
		}
#pragma GCC unroll 8
		for (int r = 0; r < NR; r++) {
			__m256 w = w_load(DT, wp[r], k);
			if (DT == KB_F8_E4M3 && !UNI)
				w = _mm256_mul_ps(w, _mm256_set1_ps(sc[r]));
#pragma GCC unroll 8
			for (int m = 0; m < MR; m++)
				acc[m][r] = _mm256_fmadd_ps(xv[m], w, acc[m][r]);
		}
	}
	if (k < k1) {
		int n = (int)(k1 - k);
		__m256i lm = lane_mask(n);
		__m256 xv[MR_CAP];
#pragma GCC unroll 8
		for (int m = 0; m < MR; m++) {
			xv[m] = _mm256_maskload_ps(xp[m] + k, lm);
			if (DT == KB_F8_E4M3 && UNI)
				xv[m] = _mm256_mul_ps(xv[m], _mm256_set1_ps(sc[0]));
		}
#pragma GCC unroll 8
		for (int r = 0; r < NR; r++) {
			__m256 w = DT == KB_F32 ? _mm256_maskload_ps((const float *)wp[r] + k, lm)
						: w_load_part(DT, wp[r], k, n);
			if (DT == KB_F8_E4M3 && !UNI)
				w = _mm256_mul_ps(w, _mm256_set1_ps(sc[r]));
#pragma GCC unroll 8
			for (int m = 0; m < MR; m++)
				acc[m][r] = _mm256_fmadd_ps(xv[m], w, acc[m][r]);
		}
	}
}

INL void tile_fixed(const int MR, const int NR, const int DT, const kc_mm_tile *t)
{
	__m256 acc[MR_CAP][KC_MM_NR_MAX];
	const float *xp[MR_CAP];
	const char *wp[KC_MM_NR_MAX];
	const int64_t nk = t->nk;
#pragma GCC unroll 8
	for (int m = 0; m < MR; m++) {
		xp[m] = t->x + m * t->x_stride;
#pragma GCC unroll 8
		for (int r = 0; r < NR; r++)
			acc[m][r] = t->acc_load ? _mm256_loadu_ps(t->acc + m * KC_MM_ACC_M + r * KC_MM_ACC_R)
						: _mm256_setzero_ps();
	}
#pragma GCC unroll 8
	for (int r = 0; r < NR; r++)
		wp[r] = (const char *)t->w + (size_t)r * (size_t)t->w_stride * esize(DT);

	if (DT != KB_F8_E4M3) {
		/* stretches of 128 elements, each asking for its share of t->pf */
		for (int64_t s0 = 0; s0 < nk; s0 += 128) {
			int64_t s1 = s0 + 128 < nk ? s0 + 128 : nk;
			kc_mm_prefetch(t, esize(DT), s0, s1);
			steps(MR, NR, DT, 0, acc, xp, wp, s0, s1, NULL);
		}
	} else {
		int uni = 1;
		for (int r = 1; r < NR; r++)
			uni &= t->scale[r] == t->scale[0];
		for (int64_t s0 = 0, kb = t->kabs / t->block; s0 < nk; kb++) {
			int64_t end = (kb + 1) * t->block - t->kabs, s1 = end < nk ? end : nk;
			kc_mm_prefetch(t, 1, s0, s1);
			float sc[KC_MM_NR_MAX];
			if (uni) {
				sc[0] = t->scale[0][kb] * 256.0f;
				steps(MR, NR, DT, 1, acc, xp, wp, s0, s1, sc);
			} else {
#pragma GCC unroll 8
				for (int r = 0; r < NR; r++)
					sc[r] = t->scale[r][kb] * 256.0f;
				steps(MR, NR, DT, 0, acc, xp, wp, s0, s1, sc);
			}
			s0 = s1;
		}
	}
	if (t->acc_keep) {
#pragma GCC unroll 8
		for (int m = 0; m < MR; m++)
#pragma GCC unroll 8
			for (int r = 0; r < NR; r++)
				_mm256_storeu_ps(t->acc + m * KC_MM_ACC_M + r * KC_MM_ACC_R, acc[m][r]);
		return;
	}
#pragma GCC unroll 8
	for (int m = 0; m < MR; m++) {
		float *y = t->y + m * t->y_stride;
		if (NR % 4 == 0) {
#pragma GCC unroll 2
			for (int r = 0; r < NR; r += 4) {
				__m128 s = sum4(acc[m][r], acc[m][r + 1], acc[m][r + 2], acc[m][r + 3]);
				if (!t->store)
					s = _mm_add_ps(s, _mm_loadu_ps(y + r));
				_mm_storeu_ps(y + r, s);
			}
		} else {
#pragma GCC unroll 8
			for (int r = 0; r < NR; r++) {
				float s = hsum(acc[m][r]);
				y[r] = t->store ? s : y[r] + s;
			}
		}
	}
}

#define TILE_CASES(DT)                                                           \
	switch (t->mr * 16 + t->nr) {                                            \
	case 1 * 16 + 1: tile_fixed(1, 1, DT, t); break;                         \
	case 1 * 16 + 4: tile_fixed(1, 4, DT, t); break;                         \
	case 1 * 16 + 8: tile_fixed(1, 8, DT, t); break;                         \
	case 2 * 16 + 1: tile_fixed(2, 1, DT, t); break;                         \
	case 2 * 16 + 4: tile_fixed(2, 4, DT, t); break;                         \
	case 3 * 16 + 1: tile_fixed(3, 1, DT, t); break;                         \
	case 3 * 16 + 4: tile_fixed(3, 4, DT, t); break;                         \
	default: break;                                                          \
	}

TGT static void tile_shape(const kc_mm_tile *t)
{
	switch (t->dt) {
	case KB_BF16: TILE_CASES(KB_BF16); break;
	case KB_F16: TILE_CASES(KB_F16); break;
	case KB_F8_E4M3: TILE_CASES(KB_F8_E4M3); break;
	default: TILE_CASES(KB_F32); break;
	}
}

TGT static void tile(const kc_mm_tile *t)
{
	kc_mm_tile s = *t;
	int r0 = 0;
	while (r0 < t->nr) {
		int left = t->nr - r0;
		int nr = t->mr == 1 && left >= 8 ? 8 : left >= 4 ? 4 : 1;
		s.nr = nr;
		s.w = (const char *)t->w + (size_t)r0 * (size_t)t->w_stride * esize(t->dt);
		for (int r = 0; r < nr; r++)
			s.scale[r] = t->scale[r0 + r];
		s.y = t->y + r0;
		s.acc = t->acc ? t->acc + r0 * KC_MM_ACC_R : NULL;
		s.pf_nr = t->pf_nr - r0 < nr ? t->pf_nr - r0 : nr;
		s.pf = t->pf && s.pf_nr > 0 ? t->pf + (size_t)r0 * (size_t)t->w_stride * esize(t->dt) : NULL;
		tile_shape(&s);
		r0 += nr;
	}
}

INL void pack_fixed(const int DT, float *dst, int64_t ld, const kc_mm_tile *t)
{
	for (int r = 0; r < t->nr; r++) {
		const char *w = (const char *)t->w + (size_t)r * (size_t)t->w_stride * esize(DT);
		float *d = dst + r * ld;
		int64_t s0 = 0;
		while (s0 < t->nk) {
			int64_t s1 = t->nk;
			__m256 sc = _mm256_set1_ps(1.0f);
			if (DT == KB_F8_E4M3) {
				int64_t kb = (t->kabs + s0) / t->block;
				int64_t end = (kb + 1) * t->block - t->kabs;
				s1 = end < t->nk ? end : t->nk;
				sc = _mm256_set1_ps(t->scale[r][kb] * 256.0f);
			}
			int64_t k = s0;
			for (; k + 8 <= s1; k += 8) {
				__m256 v = w_load(DT, w, k);
				if (DT == KB_F8_E4M3)
					v = _mm256_mul_ps(v, sc);
				_mm256_storeu_ps(d + k, v);
			}
			if (k < s1) {
				int n = (int)(s1 - k);
				__m256 v = DT == KB_F32 ? _mm256_maskload_ps((const float *)w + k, lane_mask(n))
							: w_load_part(DT, w, k, n);
				if (DT == KB_F8_E4M3)
					v = _mm256_mul_ps(v, sc);
				_mm256_maskstore_ps(d + k, lane_mask(n), v);
			}
			s0 = s1;
		}
	}
}

TGT static void pack(float *dst, int64_t ld, const kc_mm_tile *t)
{
	switch (t->dt) {
	case KB_BF16: pack_fixed(KB_BF16, dst, ld, t); break;
	case KB_F16: pack_fixed(KB_F16, dst, ld, t); break;
	case KB_F8_E4M3: pack_fixed(KB_F8_E4M3, dst, ld, t); break;
	default: pack_fixed(KB_F32, dst, ld, t); break;
	}
}

static const kc_mm_kernels kernels = {
	.mr_max = MR_CAP,
	.nr = 4,
	.nr_m1 = 8,
	.m_wide = 1,
	.tile = tile,
	.pack = pack,
};

const kc_mm_kernels *kc_mm_kernels_avx2(void)
{
	return &kernels;
}

#else

const kc_mm_kernels *kc_mm_kernels_avx2(void)
{
	return NULL;
}

#endif

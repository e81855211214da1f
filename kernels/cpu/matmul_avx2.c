/*
 * matmul_avx2.c - AVX2 + FMA + F16C micro-kernels of the matmul (see
 * matmul_impl.h and matmul_avx512.c, which this mirrors with 8 lanes).
 *
 * Conversions in registers: BF16 zero-extend and shift, F16 vcvtph2ps, FP8
 * the E4M3 byte b as the F32 pattern of fp8(b) * 2^-120,
 * (sign-extend(b) << 20) & 0x87F00000 (subnormals included), times
 * block_scale * FP8_SC (of W, or of x when the tile's rows share a scale
 * block), the sums times FP8_UNDO once when y is written: bit for bit
 * fp8 * scale * x (matmul_avx512.c's header says why).  0x7F/0xFF decode as
 * +-480 rather than NaN; they never occur in real weights.  K tails: x
 * through vmaskmovps, weights through a zero-padded copy of the last < 8
 * elements (never read past a row).  At most 16 ymm registers: tiles are up
 * to 3 x-rows by 4 W-rows (12 accumulators), or 1 x-row by 8 W-rows.
 *
 * Decode with one x row takes x permuted as the AVX-512 kernels do
 * (kc_mm_permute_x with its 16-lane groups): a 32-byte load of weights
 * holds lanes 0-7 or 8-15 of a group, so the x vectors of its phases are
 * the low or high halves of the AVX-512 ones.  BF16 then splits evens and
 * odds inside the 32-bit lanes (a shift, a mask) and FP8 takes its four
 * bytes per lane with two 16-bit shifts, two 32-bit shifts and four masks
 * (matmul_avx512.c, steps_fp8_perm), with no lane-crossing widening.
 * Whole contiguous rows of at most KC_MM_ROWS_MAXK go through rows
 * (matmul_rows_impl.h), the others through the tiles.
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

#define FP8_SC 0x1p60f   /* block scales are multiplied by this ... */
#define FP8_UNDO 0x1p60f /* ... and the sums by this: 2^120 in all */

/* The low 8 E4M3 bytes of b -> fp8 * 2^-120 as F32. */
INL __m256 fp8_bits_to_f32(__m128i b)
{
	__m256i d = _mm256_slli_epi32(_mm256_cvtepi8_epi32(b), 20);
	return _mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32((int)0x87F00000)));
}

/* 32 E4M3 bytes (8 lanes of 4) -> w[j] = byte j of each lane as above:
 * an arithmetic shift of the 16-bit lanes by 4 puts the high byte of each
 * half where the pattern wants it, junk below that the mask clears. */
INL void fp8_lanes_to_f32(__m256i b, __m256 w[4])
{
	const __m256i f8m = _mm256_set1_epi32((int)0x87F00000);
	__m256i hi = _mm256_srai_epi16(b, 4), lo = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 4);
	w[3] = _mm256_castsi256_ps(_mm256_and_si256(hi, f8m));
	w[1] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(hi, 16), f8m));
	w[2] = _mm256_castsi256_ps(_mm256_and_si256(lo, f8m));
	w[0] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(lo, 16), f8m));
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
	case KB_F8_E4M3:
		return fp8_bits_to_f32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)w + k)));
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
 * FP8: sc[r] = block scale * FP8_SC of row r, or with UNI sc[0] for all the
 * rows, multiplying the x vectors (as in matmul_avx512.c). */
INL void steps(const int MR, const int NR, const int DT, const int UNI,
	       __m256 acc[MR_CAP][KC_MM_NR_MAX], const float *const *xp,
	       const char *const *wp, int64_t k, int64_t k1, const float *sc)
{
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

/* The permuted-x forms with one x row (t->xperm), for the whole groups in
 * [k, k1): BF16 groups of 32, a 32-byte load holding lanes 8h .. 8h + 7 of
 * the group (h = 0, 1), its evens w << 16 meeting x[16 * 0 + 8h ..] and
 * its odds w & 0xFFFF0000 meeting x[16 * 1 + 8h ..]; FP8 groups of 64, byte
 * j of the lanes meeting x[16 j + 8h ..], scaled as in steps. */
INL void steps_bf16_perm(const int NR, __m256 acc[MR_CAP][KC_MM_NR_MAX], const float *x,
			 const char *const *wp, int64_t k, int64_t k1)
{
	const __m256i hi16 = _mm256_set1_epi32((int)0xFFFF0000);
	for (; k + 32 <= k1; k += 32) {
#pragma GCC unroll 2
		for (int h = 0; h < 2; h++) {
			__m256 x0 = _mm256_loadu_ps(x + k + 8 * h), x1 = _mm256_loadu_ps(x + k + 16 + 8 * h);
#pragma GCC unroll 8
			for (int r = 0; r < NR; r++) {
				__m256i b = _mm256_loadu_si256((const __m256i *)(wp[r] + (k + 16 * h) * 2));
				acc[0][r] = _mm256_fmadd_ps(x0, _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), acc[0][r]);
				acc[0][r] = _mm256_fmadd_ps(x1, _mm256_castsi256_ps(_mm256_and_si256(b, hi16)), acc[0][r]);
			}
		}
	}
}

INL void steps_fp8_perm(const int NR, const int UNI, __m256 acc[MR_CAP][KC_MM_NR_MAX], const float *x,
			const char *const *wp, int64_t k, int64_t k1, const float *sc)
{
	for (; k + 64 <= k1; k += 64) {
#pragma GCC unroll 2
		for (int h = 0; h < 2; h++) {
			__m256 xv[4];
#pragma GCC unroll 4
			for (int j = 0; j < 4; j++) {
				xv[j] = _mm256_loadu_ps(x + k + 16 * j + 8 * h);
				if (UNI)
					xv[j] = _mm256_mul_ps(xv[j], _mm256_set1_ps(sc[0]));
			}
#pragma GCC unroll 8
			for (int r = 0; r < NR; r++) {
				__m256 w[4];
				fp8_lanes_to_f32(_mm256_loadu_si256((const __m256i *)(wp[r] + k + 32 * h)), w);
#pragma GCC unroll 4
				for (int j = 0; j < 4; j++) {
					if (!UNI)
						w[j] = _mm256_mul_ps(w[j], _mm256_set1_ps(sc[r]));
					acc[0][r] = _mm256_fmadd_ps(xv[j], w[j], acc[0][r]);
				}
			}
		}
	}
}

/* FP8 steps over [s0, s1): whole groups of 64 permuted when the tile has
 * them (one x row), the rest as it is. */
INL void steps_fp8(const int MR, const int NR, const int UNI, int perm, __m256 acc[MR_CAP][KC_MM_NR_MAX],
		   const float *const *xp, const char *const *wp, int64_t s0, int64_t s1, const float *sc)
{
	if (MR == 1 && perm) {
		int64_t sp = s0 + (s1 - s0) / 64 * 64;
		steps_fp8_perm(NR, UNI, acc, xp[0], wp, s0, sp, sc);
		s0 = sp;
	}
	steps(MR, NR, KB_F8_E4M3, UNI, acc, xp, wp, s0, s1, sc);
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
			int64_t sp = s0;
			if (DT == KB_BF16 && MR == 1 && t->xperm) { /* whole groups permuted, the tail as it is */
				sp = s0 + (s1 - s0) / 32 * 32;
				steps_bf16_perm(NR, acc, xp[0], wp, s0, sp);
			}
			steps(MR, NR, DT, 0, acc, xp, wp, sp, s1, NULL);
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
				sc[0] = t->scale[0][kb] * FP8_SC;
				steps_fp8(MR, NR, 1, t->xperm, acc, xp, wp, s0, s1, sc);
			} else {
#pragma GCC unroll 8
				for (int r = 0; r < NR; r++)
					sc[r] = t->scale[r][kb] * FP8_SC;
				steps_fp8(MR, NR, 0, t->xperm, acc, xp, wp, s0, s1, sc);
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
				if (DT == KB_F8_E4M3)
					s = _mm_mul_ps(s, _mm_set1_ps(FP8_UNDO));
				if (!t->store)
					s = _mm_add_ps(s, _mm_loadu_ps(y + r));
				_mm_storeu_ps(y + r, s);
			}
		} else {
#pragma GCC unroll 8
			for (int r = 0; r < NR; r++) {
				float s = hsum(acc[m][r]);
				if (DT == KB_F8_E4M3)
					s *= FP8_UNDO;
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
				sc = _mm256_set1_ps(t->scale[r][kb] * FP8_SC);
			}
			int64_t k = s0;
			for (; k + 8 <= s1; k += 8) {
				__m256 v = w_load(DT, w, k);
				if (DT == KB_F8_E4M3)
					v = _mm256_mul_ps(_mm256_mul_ps(v, sc), _mm256_set1_ps(FP8_UNDO));
				_mm256_storeu_ps(d + k, v);
			}
			if (k < s1) {
				int n = (int)(s1 - k);
				__m256 v = DT == KB_F32 ? _mm256_maskload_ps((const float *)w + k, lane_mask(n))
							: w_load_part(DT, w, k, n);
				if (DT == KB_F8_E4M3)
					v = _mm256_mul_ps(_mm256_mul_ps(v, sc), _mm256_set1_ps(FP8_UNDO));
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

/* ---- decode with one x row, whole rows in memory order (kc_mm_rows) ---- */

/* The sum of eight accumulators by one fixed tree. */
INL __m256 sum8v(const __m256 a[8])
{
	return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])),
			     _mm256_add_ps(_mm256_add_ps(a[4], a[5]), _mm256_add_ps(a[6], a[7])));
}

/* Half q (0 or 1) of the BF16 group of 32 at element g against permuted x:
 * its evens into *ev, its odds into *od. */
INL void bf16_half(const uint16_t *w, const float *x, int64_t g, int q, __m256 *ev, __m256 *od)
{
	const int64_t h = 8 * q;
	__m256i b = _mm256_loadu_si256((const __m256i *)(w + g + 2 * h));
	*ev = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), _mm256_loadu_ps(x + g + h), *ev);
	*od = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xFFFF0000))),
			      _mm256_loadu_ps(x + g + 16 + h), *od);
}

/* The elements [k, K) of a row in natural order (the tail after its whole
 * groups): the 8-element steps into *a8, the last < 8 into *ap. */
INL void row_tail(const int DT, const void *w, const float *x, int64_t k, int64_t K, __m256 *a8, __m256 *ap)
{
	for (; k + 8 <= K; k += 8)
		*a8 = _mm256_fmadd_ps(w_load(DT, w, k), _mm256_loadu_ps(x + k), *a8);
	if (k < K) {
		const int n = (int)(K - k);
		*ap = _mm256_fmadd_ps(w_load_part(DT, w, k, n), _mm256_maskload_ps(x + k, lane_mask(n)), *ap);
	}
}

/* One BF16 row against permuted x: 128 bytes a step in four loads (group
 * q / 2, half q % 2), eight accumulators (load and phase: an FMA's latency
 * is longer than a step); the tail (K % 32, x in natural order) 8 at a
 * time. */
INL __m256 row_bf16(const kc_mm_rows *t, const char *pf_end, const float *x, const uint16_t *w)
{
	__m256 a[8];
#pragma GCC unroll 8
	for (int i = 0; i < 8; i++)
		a[i] = _mm256_setzero_ps();
	int64_t k = 0;
	for (; k + 64 <= t->K; k += 64) {
		kc_mm_rows_prefetch(t, pf_end, (const char *)(w + k));
		kc_mm_rows_prefetch(t, pf_end, (const char *)(w + k + 32));
#pragma GCC unroll 4
		for (int q = 0; q < 4; q++)
			bf16_half(w, x, k + 32 * (q >> 1), q & 1, &a[2 * q], &a[2 * q + 1]);
	}
	if (k + 32 <= t->K) {
		kc_mm_rows_prefetch(t, pf_end, (const char *)(w + k));
#pragma GCC unroll 2
		for (int q = 0; q < 2; q++)
			bf16_half(w, x, k, q, &a[2 * q], &a[2 * q + 1]);
		k += 32;
	}
	row_tail(KB_BF16, w, x, k, t->K, &a[4], &a[5]);
	return sum8v(a);
}

/* One FP8 row against xs (x permuted in groups of 64, times the block row's
 * scales * FP8_SC): 64 bytes a step in two loads, each widened by
 * fp8_lanes_to_f32 into its four phases, one accumulator per (half, phase);
 * the tail (K % 64, natural order) 8 at a time. */
INL __m256 row_fp8_k(const kc_mm_rows *t, const char *pf_end, const uint8_t *w, const int64_t K)
{
	const float *x = t->xs;
	__m256 a[8];
#pragma GCC unroll 8
	for (int i = 0; i < 8; i++)
		a[i] = _mm256_setzero_ps();
	int64_t k = 0;
#pragma GCC unroll 2
	for (; k + 64 <= K; k += 64) {
		kc_mm_rows_prefetch(t, pf_end, (const char *)(w + k));
#pragma GCC unroll 2
		for (int h = 0; h < 2; h++) {
			__m256 wv[4];
			fp8_lanes_to_f32(_mm256_loadu_si256((const __m256i *)(w + k + 32 * h)), wv);
#pragma GCC unroll 4
			for (int j = 0; j < 4; j++)
				a[4 * h + j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + k + 16 * j + 8 * h), a[4 * h + j]);
		}
	}
	row_tail(KB_F8_E4M3, w, x, k, K, &a[0], &a[1]);
	return sum8v(a);
}

/* K = 128 (DeepSeek's W_UK^T, 512 rows of 128 per head) with its two steps
 * known: no loop or tail tests between them.  Same arithmetic, same bits;
 * W_UK^T's batched product 1.16x (AVX2) and 1.11x (AVX-512) faster from
 * memory with the vector store of rows_write (docs/benchmarks.md). */
INL __m256 row_fp8(const kc_mm_rows *t, const char *pf_end, const uint8_t *w)
{
	if (t->K == 128)
		return row_fp8_k(t, pf_end, w, 128);
	return row_fp8_k(t, pf_end, w, t->K);
}

/* xs = x * (scale row s) * FP8_SC, element by element. */
INL void rows_fp8_scale_x(const kc_mm_rows *t, const float *x, const float *s)
{
	for (int64_t k0 = 0, kb = 0; k0 < t->K; k0 += t->block, kb++) {
		const float f = s[kb] * FP8_SC;
		const int64_t k1 = k0 + t->block < t->K ? k0 + t->block : t->K;
		int64_t k = k0;
		for (; k + 8 <= k1; k += 8)
			_mm256_storeu_ps(t->xs + k, _mm256_mul_ps(_mm256_loadu_ps(x + k), _mm256_set1_ps(f)));
		for (; k < k1; k++)
			t->xs[k] = x[k] * f;
	}
}

#define RV __m256
#define RZERO _mm256_setzero_ps
#include "kernels/cpu/matmul_rows_impl.h"

/* BF16: groups of 32, FP8: groups of 64 when scale blocks hold whole groups,
 * both for one x row only (the tiles of more x rows read x as it is). */
static int xperm(enum kb_dtype dt, int64_t block, int64_t M)
{
	if (M != 1)
		return 0;
	return dt == KB_BF16 ? 32 : dt == KB_F8_E4M3 && block % 64 == 0 ? 64 : 0;
}

/* kc_mm_permute_x in registers: g = 32 takes the evens and odds of each
 * pair of vectors (in-lane shuffles, then a 64-bit lane permute); g = 64
 * first orders each vector as (i, phase) pairs [i0 j0, i1 j0, i0 j1, ...],
 * then transposes the pairs of four vectors as 4 x 4 doubles. */
TGT static void permute_x(float *dst, const float *x, int64_t n, int g)
{
	int64_t k = 0;
	if (g == 32) {
		for (; k + 32 <= n; k += 32)
			for (int h = 0; h < 2; h++) {
				__m256 a = _mm256_loadu_ps(x + k + 16 * h), b = _mm256_loadu_ps(x + k + 16 * h + 8);
				__m256 ev = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
				__m256 od = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
				_mm256_storeu_ps(dst + k + 8 * h, _mm256_castpd_ps(_mm256_permute4x64_pd(
									 _mm256_castps_pd(ev), _MM_SHUFFLE(3, 1, 2, 0))));
				_mm256_storeu_ps(dst + k + 16 + 8 * h, _mm256_castpd_ps(_mm256_permute4x64_pd(
									      _mm256_castps_pd(od), _MM_SHUFFLE(3, 1, 2, 0))));
			}
	} else if (g == 64) {
		const __m256i pairs = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
		for (; k + 64 <= n; k += 64)
			for (int h = 0; h < 2; h++) { /* elements i = 8h .. 8h + 7 of the group */
				__m256d d[4];
				for (int m = 0; m < 4; m++)
					d[m] = _mm256_castps_pd(_mm256_permutevar8x32_ps(
						_mm256_loadu_ps(x + k + 32 * h + 8 * m), pairs));
				__m256d t0 = _mm256_unpacklo_pd(d[0], d[1]), t1 = _mm256_unpackhi_pd(d[0], d[1]);
				__m256d t2 = _mm256_unpacklo_pd(d[2], d[3]), t3 = _mm256_unpackhi_pd(d[2], d[3]);
				float *o = dst + k + 8 * h;
				_mm256_storeu_ps(o, _mm256_castpd_ps(_mm256_permute2f128_pd(t0, t2, 0x20)));
				_mm256_storeu_ps(o + 16, _mm256_castpd_ps(_mm256_permute2f128_pd(t1, t3, 0x20)));
				_mm256_storeu_ps(o + 32, _mm256_castpd_ps(_mm256_permute2f128_pd(t0, t2, 0x31)));
				_mm256_storeu_ps(o + 48, _mm256_castpd_ps(_mm256_permute2f128_pd(t1, t3, 0x31)));
			}
	}
	kc_mm_permute_x(dst + k, x + k, n - k, g); /* the tail (and any other g) */
}

static const kc_mm_kernels kernels = {
	.mr_max = MR_CAP,
	.nr = 4,
	.nr_m1 = 8,
	.m_wide = 1,
	.tile = tile,
	.pack = pack,
	.xperm = xperm,
	.permute_x = permute_x,
	.rows = rows,
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

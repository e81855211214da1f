/*
 * matmul_avx512.c - AVX-512 micro-kernels of the matmul (see matmul_impl.h).
 *
 * A tile is mr x-rows by nr W-rows over one K chunk: mr*nr accumulators of 16
 * f32 lanes, each W vector loaded once per step, converted in registers and
 * used by every x row of the tile:
 *   F32  plain load;  BF16  zero-extend 16 -> 32 bits, shift left 16;
 *   F16  vcvtph2ps;
 *   FP8  the E4M3 byte b becomes the F32 pattern of fp8(b) * 2^-120 in three
 *        integer operations, (sign-extend(b) to 32 bits << 20) & 0x87F00000:
 *        sign to bit 31, the 4 exponent bits to the bottom of the F32
 *        exponent, the 3 mantissa bits to the top of the F32 mantissa (E4M3
 *        subnormals become F32 subnormals of the same scaled value; Zen 4
 *        multiplies them at full speed).  This is a third faster than the
 *        F16 pattern plus vcvtph2ps (bench_kernels --decode-hot).  Then one
 *        multiply by block_scale * 2^60 (FP8_SC): of the W vector, or, when
 *        all the tile's rows share a scale block (always when nr divides the
 *        block), of the x vectors; the tile sums are therefore fp8 * scale *
 *        x * 2^-60 and are multiplied by 2^60 (FP8_UNDO) once, when y is
 *        written.  Splitting 2^120 this way keeps every intermediate far
 *        from overflow (|x * scale| < 2^68) and from the subnormal range
 *        (products above 2^-66); powers of two commute with rounding there,
 *        so the sums are bit for bit those of fp8 * scale * x, and a unit x
 *        yields RN(fp8 * scale), exactly an element-by-element
 *        dequantization.  0x7F/0xFF (NaN in E4M3FN) decode as +-480 here;
 *        they never occur in real weights.
 * K tails (chunk or FP8 block not a multiple of 16) use masked loads, so no
 * byte past a row's end is read.  Lanes are summed four accumulators at a
 * time (three horizontal adds) when the tile writes y; between the K chunks
 * of a decode tile the accumulators are parked instead (matmul_impl.h).
 *
 * Called through kc_mm_kernels_avx512() by matmul.c only; stateless and
 * thread-safe (each call touches only its own tile of y).
 */
#include "kernels/cpu/matmul_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define INL TGT __attribute__((always_inline)) static inline

INL size_t esize(int dt)
{
	return dt == KB_F32 ? 4 : dt == KB_F8_E4M3 ? 1 : 2;
}

#define FP8_SC 0x1p60f   /* block scales are multiplied by this ... */
#define FP8_UNDO 0x1p60f /* ... and the sums by this: 2^120 in all */

/* 16 E4M3 bytes -> fp8 * 2^-120 as F32 (see the header). */
INL __m512 fp8_bits_to_f32(__m128i b)
{
	__m512i d = _mm512_slli_epi32(_mm512_cvtepi8_epi32(b), 20);
	return _mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32((int)0x87F00000)));
}

/* [sum a, sum b, sum c, sum d] with three horizontal adds. */
INL __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d)
{
	__m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
	__m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
	__m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
	__m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
	__m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
	return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* 16 weights from element k of row w, converted (not scaled). */
INL __m512 w_load(const int dt, const void *w, int64_t k)
{
	switch (dt) {
	case KB_BF16: {
		__m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k));
		return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
	}
	case KB_F16:
		return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k)));
	case KB_F8_E4M3:
		return fp8_bits_to_f32(_mm_loadu_si128((const __m128i *)((const uint8_t *)w + k)));
	default:
		return _mm512_loadu_ps((const float *)w + k);
	}
}

/* The same for the lanes in m; the others are 0 and not read. */
INL __m512 w_load_mask(const int dt, const void *w, int64_t k, __mmask16 m)
{
	switch (dt) {
	case KB_BF16: {
		__m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k);
		return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
	}
	case KB_F16:
		return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k));
	case KB_F8_E4M3:
		return fp8_bits_to_f32(_mm_maskz_loadu_epi8(m, (const uint8_t *)w + k));
	default:
		return _mm512_maskz_loadu_ps(m, (const float *)w + k);
	}
}

/* acc[m][r] += x[m][k] * W[r][k] for k in [k0, k1) (one FP8 block at most).
 * FP8: sc[r] = block scale * FP8_SC of row r; with UNI every row has the same
 * scale and it multiplies the x vectors instead (MR multiplies per step
 * instead of NR): x * (s * w) and (x * s) * w round differently but equally
 * well, and a unit x still gives RN(fp8 * s) exactly. */
INL void steps(const int MR, const int NR, const int DT, const int UNI,
	       __m512 acc[KC_MM_MR_MAX][KC_MM_NR_MAX], const float *const *xp,
	       const char *const *wp, int64_t k, int64_t k1, const __m512 *sc)
{
	for (; k + 16 <= k1; k += 16) {
		__m512 xv[KC_MM_MR_MAX];
#pragma GCC unroll 8
		for (int m = 0; m < MR; m++) {
			xv[m] = _mm512_loadu_ps(xp[m] + k);
			if (DT == KB_F8_E4M3 && UNI)
				xv[m] = _mm512_mul_ps(xv[m], sc[0]);
		}
#pragma GCC unroll 8
		for (int r = 0; r < NR; r++) {
			__m512 w = w_load(DT, wp[r], k);
			if (DT == KB_F8_E4M3 && !UNI)
				w = _mm512_mul_ps(w, sc[r]);
#pragma GCC unroll 8
			for (int m = 0; m < MR; m++)
				acc[m][r] = _mm512_fmadd_ps(xv[m], w, acc[m][r]);
		}
	}
	if (k < k1) {
		__mmask16 msk = (__mmask16)((1u << (unsigned)(k1 - k)) - 1u);
		__m512 xv[KC_MM_MR_MAX];
#pragma GCC unroll 8
		for (int m = 0; m < MR; m++) {
			xv[m] = _mm512_maskz_loadu_ps(msk, xp[m] + k);
			if (DT == KB_F8_E4M3 && UNI)
				xv[m] = _mm512_mul_ps(xv[m], sc[0]);
		}
#pragma GCC unroll 8
		for (int r = 0; r < NR; r++) {
			__m512 w = w_load_mask(DT, wp[r], k, msk);
			if (DT == KB_F8_E4M3 && !UNI)
				w = _mm512_mul_ps(w, sc[r]);
#pragma GCC unroll 8
			for (int m = 0; m < MR; m++)
				acc[m][r] = _mm512_fmadd_ps(xv[m], w, acc[m][r]);
		}
	}
}

/* The permuted-x form of steps for BF16 (t->xperm, see kc_mm_permute_x),
 * for the whole groups of 32 in [k, k1): one 64-byte load of a W row holds
 * the group; its even elements (low halves of the 32-bit lanes) are
 * w << 16, its odd ones w & 0xFFFF0000, met by phases 0 and 1 of x.  No
 * lane-crossing widening: about 1.4x the rate of the plain form when W is
 * in memory (bench_kernels --decode, the lm_head).  Phase by phase (the W
 * row is reloaded from L1 for the second) so that only MR x vectors are
 * live with the MR * NR accumulators.  Each accumulator sees its products
 * in the same order whatever MR and NR are. */
INL void steps_bf16_perm(const int MR, const int NR, __m512 acc[KC_MM_MR_MAX][KC_MM_NR_MAX],
			 const float *const *xp, const char *const *wp, int64_t k, int64_t k1)
{
	const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000);
	for (; k + 32 <= k1; k += 32) {
#pragma GCC unroll 2
		for (int j = 0; j < 2; j++) {
			__m512 xv[KC_MM_MR_MAX];
#pragma GCC unroll 8
			for (int m = 0; m < MR; m++)
				xv[m] = _mm512_loadu_ps(xp[m] + k + 16 * j);
#pragma GCC unroll 8
			for (int r = 0; r < NR; r++) {
				__m512i b = _mm512_loadu_si512((const void *)(wp[r] + k * 2));
				__m512 w = _mm512_castsi512_ps(j == 0 ? _mm512_slli_epi32(b, 16)
								      : _mm512_and_si512(b, hi16));
#pragma GCC unroll 8
				for (int m = 0; m < MR; m++)
					acc[m][r] = _mm512_fmadd_ps(xv[m], w, acc[m][r]);
			}
		}
	}
}

/* The permuted-x form for FP8 with one x row (t->xperm, groups of 64): one
 * 64-byte load holds 64 weights, byte j of each 32-bit lane meeting phase
 * j of x.  An arithmetic shift of the 16-bit lanes by 4 turns the high byte
 * of each half into sign, exponent and mantissa at the places the F32
 * pattern of fp8 * 2^-120 wants them (fp8_bits_to_f32) with junk below, so
 *   byte 3: (w >>16 4) & 0x87F00000       byte 1: ((w >>16 4) << 16) & ...
 *   byte 2: ((w <<16 8) >>16 4) & ...     byte 0: (((w <<16 8) >>16 4) << 16) & ...
 * nine integer operations for 64 weights where vpmovsxbd, shift and mask
 * take twelve (about 1.2x the rate in cache).  FP8 scaling as in steps. */
INL void steps_fp8_perm(const int NR, const int UNI, __m512 acc[KC_MM_MR_MAX][KC_MM_NR_MAX],
			const float *x, const char *const *wp, int64_t k, int64_t k1, const __m512 *sc)
{
	const __m512i f8m = _mm512_set1_epi32((int)0x87F00000);
	for (; k + 64 <= k1; k += 64) {
		__m512 xv[4];
#pragma GCC unroll 4
		for (int j = 0; j < 4; j++) {
			xv[j] = _mm512_loadu_ps(x + k + 16 * j);
			if (UNI)
				xv[j] = _mm512_mul_ps(xv[j], sc[0]);
		}
#pragma GCC unroll 8
		for (int r = 0; r < NR; r++) {
			__m512i b = _mm512_loadu_si512((const void *)(wp[r] + k));
			__m512i hi = _mm512_srai_epi16(b, 4), lo = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 4);
			__m512 w[4];
			w[3] = _mm512_castsi512_ps(_mm512_and_si512(hi, f8m));
			w[1] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(hi, 16), f8m));
			w[2] = _mm512_castsi512_ps(_mm512_and_si512(lo, f8m));
			w[0] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(lo, 16), f8m));
#pragma GCC unroll 4
			for (int j = 0; j < 4; j++) {
				if (!UNI)
					w[j] = _mm512_mul_ps(w[j], sc[r]);
				acc[0][r] = _mm512_fmadd_ps(xv[j], w[j], acc[0][r]);
			}
		}
	}
}

/* FP8 steps over [s0, s1): whole groups of 64 permuted when the tile has
 * them (one x row), the rest as it is. */
INL void steps_fp8(const int MR, const int NR, const int UNI, int perm,
		   __m512 acc[KC_MM_MR_MAX][KC_MM_NR_MAX], const float *const *xp,
		   const char *const *wp, int64_t s0, int64_t s1, const __m512 *sc)
{
	if (MR == 1 && perm) {
		int64_t sp = s0 + (s1 - s0) / 64 * 64;
		steps_fp8_perm(NR, UNI, acc, xp[0], wp, s0, sp, sc);
		s0 = sp;
	}
	steps(MR, NR, KB_F8_E4M3, UNI, acc, xp, wp, s0, s1, sc);
}

/* One tile with compile-time MR, NR, DT (after inlining). */
INL void tile_fixed(const int MR, const int NR, const int DT, const kc_mm_tile *t)
{
	__m512 acc[KC_MM_MR_MAX][KC_MM_NR_MAX];
	const float *xp[KC_MM_MR_MAX];
	const char *wp[KC_MM_NR_MAX];
	const int64_t nk = t->nk;
#pragma GCC unroll 8
	for (int m = 0; m < MR; m++) {
		xp[m] = t->x + m * t->x_stride;
#pragma GCC unroll 8
		for (int r = 0; r < NR; r++)
			acc[m][r] = t->acc_load ? _mm512_loadu_ps(t->acc + m * KC_MM_ACC_M + r * KC_MM_ACC_R)
						: _mm512_setzero_ps();
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
			if (DT == KB_BF16 && t->xperm) { /* whole groups permuted, the tail as it is */
				sp = s0 + (s1 - s0) / 32 * 32;
				steps_bf16_perm(MR, NR, acc, xp, wp, s0, sp);
			}
			steps(MR, NR, DT, 0, acc, xp, wp, sp, s1, NULL);
		}
	} else {
		int uni = 1; /* all rows in one scale block row (always when nr divides block) */
		for (int r = 1; r < NR; r++)
			uni &= t->scale[r] == t->scale[0];
		for (int64_t s0 = 0, kb = t->kabs / t->block; s0 < nk; kb++) {
			int64_t end = (kb + 1) * t->block - t->kabs, s1 = end < nk ? end : nk;
			kc_mm_prefetch(t, 1, s0, s1);
			__m512 sc[KC_MM_NR_MAX];
			if (uni) {
				sc[0] = _mm512_set1_ps(t->scale[0][kb] * FP8_SC);
				steps_fp8(MR, NR, 1, t->xperm, acc, xp, wp, s0, s1, sc);
			} else {
#pragma GCC unroll 8
				for (int r = 0; r < NR; r++)
					sc[r] = _mm512_set1_ps(t->scale[r][kb] * FP8_SC);
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
				_mm512_storeu_ps(t->acc + m * KC_MM_ACC_M + r * KC_MM_ACC_R, acc[m][r]);
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
				float s = _mm512_reduce_add_ps(acc[m][r]);
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
	case 2 * 16 + 8: tile_fixed(2, 8, DT, t); break;                         \
	case 3 * 16 + 1: tile_fixed(3, 1, DT, t); break;                         \
	case 3 * 16 + 4: tile_fixed(3, 4, DT, t); break;                         \
	case 3 * 16 + 8: tile_fixed(3, 8, DT, t); break;                         \
	case 4 * 16 + 1: tile_fixed(4, 1, DT, t); break;                         \
	case 4 * 16 + 4: tile_fixed(4, 4, DT, t); break;                         \
	default: break;                                                          \
	}

/* t->nr is 1, 4 or (mr <= 3 only) 8 here. */
TGT static void tile_shape(const kc_mm_tile *t)
{
	switch (t->dt) {
	case KB_BF16: TILE_CASES(KB_BF16); break;
	case KB_F16: TILE_CASES(KB_F16); break;
	case KB_F8_E4M3: TILE_CASES(KB_F8_E4M3); break;
	default: TILE_CASES(KB_F32); break;
	}
}

/* Any nr: split into instantiated widths (8 for up to three x rows (24
 * accumulators of the 32 registers), else 4, then 1s). */
TGT static void tile(const kc_mm_tile *t)
{
	kc_mm_tile s = *t;
	int r0 = 0;
	while (r0 < t->nr) {
		int left = t->nr - r0;
		int nr = t->mr <= 3 && left >= 8 ? 8 : left >= 4 ? 4 : 1;
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
			__m512 sc = _mm512_set1_ps(1.0f);
			if (DT == KB_F8_E4M3) {
				int64_t kb = (t->kabs + s0) / t->block;
				int64_t end = (kb + 1) * t->block - t->kabs;
				s1 = end < t->nk ? end : t->nk;
				sc = _mm512_set1_ps(t->scale[r][kb] * FP8_SC);
			}
			int64_t k = s0;
			for (; k + 16 <= s1; k += 16) {
				__m512 v = w_load(DT, w, k);
				if (DT == KB_F8_E4M3)
					v = _mm512_mul_ps(_mm512_mul_ps(v, sc), _mm512_set1_ps(FP8_UNDO));
				_mm512_storeu_ps(d + k, v);
			}
			if (k < s1) {
				__mmask16 msk = (__mmask16)((1u << (unsigned)(s1 - k)) - 1u);
				__m512 v = w_load_mask(DT, w, k, msk);
				if (DT == KB_F8_E4M3)
					v = _mm512_mul_ps(_mm512_mul_ps(v, sc), _mm512_set1_ps(FP8_UNDO));
				_mm512_mask_storeu_ps(d + k, msk, v);
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

/* The first min(left, 16) lanes. */
INL __mmask16 mask_upto(int64_t left)
{
	return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (unsigned)left) - 1u);
}

/* One BF16 row against permuted x: 128 bytes a step, four accumulators (one
 * per phase and half, so that the FMA latency is hidden), the tail (K % 32
 * elements, x in natural order) widened the plain way. */
INL __m512 row_bf16(const kc_mm_rows *t, const char *pf_end, const float *x, const uint16_t *w)
{
	const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000);
	__m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
	int64_t k = 0;
	for (; k + 64 <= t->K; k += 64) {
		kc_mm_rows_prefetch(t, pf_end, (const char *)(w + k));
		kc_mm_rows_prefetch(t, pf_end, (const char *)(w + k + 32));
		__m512i v0 = _mm512_loadu_si512((const void *)(w + k));
		__m512i v1 = _mm512_loadu_si512((const void *)(w + k + 32));
		a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), _mm512_loadu_ps(x + k), a0);
		a1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v0, hi16)), _mm512_loadu_ps(x + k + 16), a1);
		a2 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), _mm512_loadu_ps(x + k + 32), a2);
		a3 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v1, hi16)), _mm512_loadu_ps(x + k + 48), a3);
	}
	if (k + 32 <= t->K) {
		kc_mm_rows_prefetch(t, pf_end, (const char *)(w + k));
		__m512i v0 = _mm512_loadu_si512((const void *)(w + k));
		a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), _mm512_loadu_ps(x + k), a0);
		a1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v0, hi16)), _mm512_loadu_ps(x + k + 16), a1);
		k += 32;
	}
	for (; k < t->K; k += 16) {
		const __mmask16 m = mask_upto(t->K - k);
		a2 = _mm512_fmadd_ps(w_load_mask(KB_BF16, w, k, m), _mm512_maskz_loadu_ps(m, x + k), a2);
	}
	return _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
}

/* One FP8 row against xs (x permuted in groups of 64, times the block row's
 * scales * FP8_SC): the widening of steps_fp8_perm, one accumulator per
 * phase; the tail (K % 64, natural order) 16 bytes at a time. */
INL __m512 row_fp8_k(const kc_mm_rows *t, const char *pf_end, const uint8_t *w, const int64_t K)
{
	const __m512i f8m = _mm512_set1_epi32((int)0x87F00000);
	const float *x = t->xs;
	__m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
	int64_t k = 0;
#pragma GCC unroll 2
	for (; k + 64 <= K; k += 64) {
		kc_mm_rows_prefetch(t, pf_end, (const char *)(w + k));
		__m512i b = _mm512_loadu_si512((const void *)(w + k));
		__m512i hi = _mm512_srai_epi16(b, 4), lo = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 4);
		a3 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(hi, f8m)), _mm512_loadu_ps(x + k + 48), a3);
		a1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(hi, 16), f8m)),
				     _mm512_loadu_ps(x + k + 16), a1);
		a2 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(lo, f8m)), _mm512_loadu_ps(x + k + 32), a2);
		a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(lo, 16), f8m)),
				     _mm512_loadu_ps(x + k), a0);
	}
	for (; k < K; k += 16) {
		const __mmask16 m = mask_upto(K - k);
		a0 = _mm512_fmadd_ps(w_load_mask(KB_F8_E4M3, w, k, m), _mm512_maskz_loadu_ps(m, x + k), a0);
	}
	return _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
}

/* K = 128 (DeepSeek's W_UK^T, 512 rows of 128 per head) with its two steps
 * known: no loop or tail tests between them.  Same arithmetic, same bits;
 * W_UK^T's batched product 1.16x (AVX2) and 1.11x (AVX-512) faster from
 * memory with the vector store of rows_write (docs/benchmarks.md). */
INL __m512 row_fp8(const kc_mm_rows *t, const char *pf_end, const uint8_t *w)
{
	if (t->K == 128)
		return row_fp8_k(t, pf_end, w, 128);
	return row_fp8_k(t, pf_end, w, t->K);
}

/* xs = x * (scale row s) * FP8_SC, element by element. */
INL void rows_fp8_scale_x(const kc_mm_rows *t, const float *x, const float *s)
{
	for (int64_t k0 = 0, kb = 0; k0 < t->K; k0 += t->block, kb++) {
		const __m512 sc = _mm512_set1_ps(s[kb] * FP8_SC);
		int64_t k1 = k0 + t->block < t->K ? k0 + t->block : t->K;
		for (int64_t k = k0; k < k1; k += 16) {
			const __mmask16 m = mask_upto(k1 - k);
			_mm512_mask_storeu_ps(t->xs + k, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), sc));
		}
	}
}

#define RV __m512
#define RZERO _mm512_setzero_ps
#include "kernels/cpu/matmul_rows_impl.h"

/* BF16: groups of 32 for any decode M.  FP8: groups of 64 for one x row
 * (the form's 4 x vectors and 8 accumulators would not fit with more) when
 * scale blocks hold whole groups (a block edge inside a group would need
 * two scales in one vector). */
static int xperm(enum kb_dtype dt, int64_t block, int64_t M)
{
	if (dt == KB_BF16)
		return 32;
	return dt == KB_F8_E4M3 && M == 1 && block % 64 == 0 ? 64 : 0;
}

/* kc_mm_permute_x with two-source lane permutes: g = 32 splits 32 floats
 * into evens and odds; g = 64 takes elements j, j + 4, ... of each pair of
 * vectors, then joins the two halves. */
TGT static void permute_x(float *dst, const float *x, int64_t n, int g)
{
	int64_t k = 0;
	if (g == 32) {
		const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
		const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
		for (; k + 32 <= n; k += 32) {
			__m512 a = _mm512_loadu_ps(x + k), b = _mm512_loadu_ps(x + k + 16);
			_mm512_storeu_ps(dst + k, _mm512_permutex2var_ps(a, ev, b));
			_mm512_storeu_ps(dst + k + 16, _mm512_permutex2var_ps(a, od, b));
		}
	} else if (g == 64) {
		/* lanes 0..7 of q0 + j: elements 4i + j of the pair (a, b), i < 8 */
		const __m512i q0 = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 28, 24, 20, 16, 12, 8, 4, 0);
		for (; k + 64 <= n; k += 64) {
			__m512 v0 = _mm512_loadu_ps(x + k), v1 = _mm512_loadu_ps(x + k + 16);
			__m512 v2 = _mm512_loadu_ps(x + k + 32), v3 = _mm512_loadu_ps(x + k + 48);
			for (int j = 0; j < 4; j++) {
				__m512i q = _mm512_add_epi32(q0, _mm512_set1_epi32(j));
				__m512 lo = _mm512_permutex2var_ps(v0, q, v1), hi = _mm512_permutex2var_ps(v2, q, v3);
				_mm512_storeu_ps(dst + k + 16 * j, _mm512_shuffle_f32x4(lo, hi, 0x44));
			}
		}
	}
	kc_mm_permute_x(dst + k, x + k, n - k, g); /* the tail (and any other g) */
}

static const kc_mm_kernels kernels = {
	.mr_max = 4,
	.nr = 4,
	.nr_m1 = 8,
	.m_wide = 3,
	.tile = tile,
	.pack = pack,
	.xperm = xperm,
	.permute_x = permute_x,
	.rows = rows,
};

const kc_mm_kernels *kc_mm_kernels_avx512(void)
{
	return &kernels;
}

#else

const kc_mm_kernels *kc_mm_kernels_avx512(void)
{
	return NULL;
}

#endif

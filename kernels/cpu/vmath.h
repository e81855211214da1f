/*
 * vmath.h - vector exp for the CPU kernels (AVX2 and AVX-512), private to
 * kernels/cpu.
 *
 * exp(x) = p(r) * 2^n with n = round(x / ln 2), r = x - n ln 2 (ln 2 split in
 * two for an exact product) and p the degree-7 polynomial of the Cephes expf
 * (about 1 ulp on [-ln2/2, ln2/2]).  2^n is applied in two halves so that
 * results between FLT_MAX and the smallest subnormal come out right: x >
 * 88.73 gives +inf, x < -103.9 gives 0, subnormal results are kept.
 * Used by silu_mul.c and softmax.c; kc_hsum8 (the sum of 8 lanes) by the
 * attention kernels.
 */
#ifndef DS_KERNELS_CPU_VMATH_H
#define DS_KERNELS_CPU_VMATH_H

#if defined(__x86_64__)
#include <immintrin.h>

#define KC_EXP_LO -104.0f
#define KC_EXP_HI 89.0f
#define KC_LOG2E 1.44269504088896341f
#define KC_LN2_HI 0.693359375f
#define KC_LN2_LO -2.12194440e-4f
#define KC_EXP_P0 1.9875691500e-4f
#define KC_EXP_P1 1.3981999507e-3f
#define KC_EXP_P2 8.3334519073e-3f
#define KC_EXP_P3 4.1665795894e-2f
#define KC_EXP_P4 1.6666665459e-1f
#define KC_EXP_P5 5.0000001201e-1f

__attribute__((target("avx2,fma"), always_inline)) static inline __m256 kc_exp8(__m256 x)
{
	x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(KC_EXP_LO)), _mm256_set1_ps(KC_EXP_HI));
	__m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(KC_LOG2E)),
				   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	__m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(KC_LN2_HI), x);
	r = _mm256_fnmadd_ps(n, _mm256_set1_ps(KC_LN2_LO), r);
	__m256 p = _mm256_set1_ps(KC_EXP_P0);
	p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KC_EXP_P1));
	p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KC_EXP_P2));
	p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KC_EXP_P3));
	p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KC_EXP_P4));
	p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KC_EXP_P5));
	p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
	__m256i ni = _mm256_cvtps_epi32(n);
	__m256i n1 = _mm256_srai_epi32(ni, 1);
	__m256i n2 = _mm256_sub_epi32(ni, n1);
	__m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
	__m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
	return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

__attribute__((target("avx2,fma"), always_inline)) static inline float kc_hsum8(__m256 v)
{
	__m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
	h = _mm_add_ps(h, _mm_movehl_ps(h, h));
	h = _mm_add_ss(h, _mm_movehdup_ps(h));
	return _mm_cvtss_f32(h);
}

__attribute__((target("avx512f,avx512dq"), always_inline)) static inline __m512 kc_exp16(__m512 x)
{
	x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(KC_EXP_LO)), _mm512_set1_ps(KC_EXP_HI));
	__m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(KC_LOG2E)),
					_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	__m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KC_LN2_HI), x);
	r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KC_LN2_LO), r);
	__m512 p = _mm512_set1_ps(KC_EXP_P0);
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KC_EXP_P1));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KC_EXP_P2));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KC_EXP_P3));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KC_EXP_P4));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KC_EXP_P5));
	p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
	__m512i ni = _mm512_cvtps_epi32(n);
	__m512i n1 = _mm512_srai_epi32(ni, 1);
	__m512i n2 = _mm512_sub_epi32(ni, n1);
	__m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, _mm512_set1_epi32(127)), 23));
	__m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, _mm512_set1_epi32(127)), 23));
	return _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
}
#endif

#endif

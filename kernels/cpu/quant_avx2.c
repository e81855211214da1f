/*
 * quant_avx2.c - AVX2 kernels of the quantized matmul (quant_impl.h): the
 * 256-bit template of quant_simd.h with pmaddubsw + pmaddwd as the integer
 * dot, and a GEMM tile of up to 4 act rows (2 x rows, two levels each) by an
 * 8-column panel.
 *
 * Integer dots: pmaddubsw multiplies unsigned weight bytes by signed
 * activation bytes and adds pairs into i16 without overflow here (|pair| <=
 * 2 * 63 * 127 for the 6-bit Q6_K values; Q8_0 uses |w| * sign(x, w) <= 2 *
 * 128 * 127 < 32768), then pmaddwd by ones (or by the K-quant sub-block
 * scales) adds pairs into i32: exact.
 *
 * Called through kc_qkernels_avx2() by quant.c only; stateless and
 * thread-safe (each call writes only its own y rows or tile).
 */
#include "kernels/cpu/quant_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define QS_TGT __attribute__((target("avx2,fma,f16c")))
#define QS_FN(name) qa2_##name
#define QS_DOT(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#define QS_DOTW(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#define QS_Q8_XOR 0
#include "kernels/cpu/quant_simd.h"

#define NR 8
#define MR 4
#define INL QS_TGT __attribute__((always_inline)) static inline

/* One tile: MR_ act rows (MR_ / 2 x rows) by the 8-column panel over one K chunk.
 * S: sub-block, XB: x block, has_min: Q4_1/Q4_K/Q5_K, sgn: Q8_0 (signed).
 * GA: pmaddubsw results added in i16, GA at a time (kc_q_i16_sums), before
 * one pmaddwd widens them; exact, so the bits of widening each; the tile
 * alone ran 1.2-1.3x faster in cache (Q4_1, K = 576, one core). */
INL void tile_impl(const kc_qtile *t, const int MR_, const int S, const int XB, const int has_min,
		   const int sgn, const int GA)
{
	const int nsub = XB / S, RX = MR_ / 2; /* x rows: act rows 2r (level 1), 2r + 1 */
	const __m256i ones = _mm256_set1_epi16(1);
	__m256 facc[MR / 2], sub[MR / 2];
	_Pragma("GCC unroll 8")
	for (int r = 0; r < RX; r++)
		facc[r] = sub[r] = _mm256_setzero_ps();
	for (int64_t xb = 0; xb < t->nxb; xb++) {
		_Pragma("GCC unroll 8")
		for (int j = 0; j < nsub; j++) {
			const int64_t s = xb * nsub + j;
			__m256i ia[MR];
			_Pragma("GCC unroll 8")
			for (int r = 0; r < MR_; r++)
				ia[r] = _mm256_set1_epi32(t->ioff[r * t->ldsub + s]);
			const uint8_t *wq = t->wp + s * S * NR;
			const int8_t *xq = t->xq + xb * XB + j * S;
			__m256i h[MR];
			_Pragma("GCC unroll 8")
			for (int g = 0; g < S / 4; g++) {
				const __m256i w = _mm256_load_si256((const __m256i *)(wq + 32 * g));
				const __m256i aw = sgn ? _mm256_abs_epi8(w) : w;
				_Pragma("GCC unroll 8")
				for (int r = 0; r < MR_; r++) {
					int32_t x4;
					memcpy(&x4, xq + r * t->ldq + 4 * g, 4);
					__m256i xv = _mm256_set1_epi32(x4);
					if (sgn)
						xv = _mm256_sign_epi8(xv, w);
					const __m256i p = _mm256_maddubs_epi16(aw, xv);
					h[r] = g % GA == 0 ? p : _mm256_add_epi16(h[r], p);
					KC_Q_RUNNING_SUM(h[r]);
					if (g % GA == GA - 1)
						ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(h[r], ones));
				}
			}
			const __m256 scv = _mm256_load_ps(t->sc + s * NR);
			const __m256 mnv = has_min ? _mm256_load_ps(t->mn + s * NR) : _mm256_setzero_ps();
			_Pragma("GCC unroll 8")
			for (int r = 0; r < RX; r++) {
				/* 256 dot(w, q1) + dot(w, q2), exact (|.| < 2^28) */
				const __m256i c = _mm256_add_epi32(_mm256_slli_epi32(ia[2 * r], 8), ia[2 * r + 1]);
				const __m256 v = _mm256_cvtepi32_ps(c);
				sub[r] = j == 0 ? _mm256_mul_ps(v, scv) : _mm256_fmadd_ps(v, scv, sub[r]);
				if (has_min) /* level 2's fsum: 256 sum(q1) + sum(q2) */
					sub[r] = _mm256_fmadd_ps(mnv, _mm256_set1_ps(t->fsum[(2 * r + 1) * t->ldsub + s]), sub[r]);
			}
		}
		_Pragma("GCC unroll 8")
		for (int r = 0; r < RX; r++) /* scaled by d2 = d1 / 256 */
			facc[r] = _mm256_fmadd_ps(sub[r], _mm256_set1_ps(t->dx[(2 * r + 1) * t->ldb + xb]), facc[r]);
	}
	const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
	const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(t->nr), lane);
	_Pragma("GCC unroll 8")
	for (int r = 0; r < RX; r++) {
		float *y = t->y + r * t->y_stride;
		__m256 v = facc[r];
		if (!t->store)
			v = _mm256_add_ps(_mm256_maskload_ps(y, mask), v);
		_mm256_maskstore_ps(y, mask, v);
	}
}

#define TILE_ROWS(WT, S, XB, MIN, SGN)                                      \
	switch (t->mr) {                                                    \
	case 2: tile_impl(t, 2, S, XB, MIN, SGN, kc_q_i16_sums(WT)); break;  \
	default: tile_impl(t, 4, S, XB, MIN, SGN, kc_q_i16_sums(WT)); break; \
	}

static QS_TGT void tile(const kc_qtile *t)
{
	switch (t->wt) {
	case KB_Q4_0: TILE_ROWS(KB_Q4_0, 32, 32, 0, 0) break;
	case KB_Q4_1: TILE_ROWS(KB_Q4_1, 32, 32, 1, 0) break;
	case KB_Q8_0: TILE_ROWS(KB_Q8_0, 32, 32, 0, 1) break;
	case KB_Q4_K: TILE_ROWS(KB_Q4_K, 32, 256, 1, 0) break;
	case KB_Q5_K: TILE_ROWS(KB_Q5_K, 32, 256, 1, 0) break;
	case KB_Q6_K: TILE_ROWS(KB_Q6_K, 16, 256, 0, 0) break;
	default: break;
	}
}

static void pack(enum kb_dtype t, const uint8_t *w, size_t w_row_bytes, int nr, int64_t nblk,
		 uint8_t *wp, float *sc, float *mn)
{
	qa2_pack(t, w, w_row_bytes, nr, nblk, wp, sc, mn, NR);
}

static const kc_qkernels kernels = {
	.name = "avx2",
	.quantize = qa2_quantize,
	.quantize2 = qa2_quantize2,
	.gemv = qa2_gemv,
	.nr = NR,
	.mr_max = MR,
	.gemm_min_m = 12,
	.q8_off = 0,
	.pack = pack,
	.tile = tile,
};

const kc_qkernels *kc_qkernels_avx2(void)
{
	return &kernels;
}

#else
const kc_qkernels *kc_qkernels_avx2(void)
{
	return NULL;
}
#endif

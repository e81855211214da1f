/*
 * quant_tile512.h - the AVX-512 GEMM tile of the quantized matmul: up to 8 act
 * rows (4 x rows, two levels each) by a 16-column packed panel
 * (quant_impl.h), one zmm of 16 i32 (one per column) per act row, the two
 * levels joined as 256 i1 + i2 per sub-block; compiled twice by quant_avx512.c:
 *   QT_VNNI 1: vpdpbusd (u8 panel bytes x the row's 4 broadcast s8 values);
 *   QT_VNNI 0: vpmaddubsw + vpmaddwd by ones (Q8_0: |w| x sign(x, w)).
 * The includer defines QT_TGT (function attribute), QT_FN(name) and QT_VNNI.
 * Private to the quant module.
 */
#ifndef QT_TGT
#error "quant_tile512.h is a template: define QT_TGT, QT_FN, QT_VNNI"
#endif

#include "kernels/cpu/quant_impl.h"

#include <immintrin.h>

#define QT_NR 16
#define QT_MR 8
#define QT_INL QT_TGT __attribute__((always_inline)) static inline

/* S: sub-block, XB: x block, has_min: Q4_1/Q4_K/Q5_K, sgn: Q8_0 without VNNI.
 * GA (without VNNI): vpmaddubsw results added in i16, GA at a time
 * (kc_q_i16_sums), before one vpmaddwd widens them: exact. */
QT_INL void QT_FN(tile_impl)(const kc_qtile *t, const int MR_, const int S, const int XB, const int has_min,
			     const int sgn, const int GA)
{
	const int nsub = XB / S, RX = MR_ / 2; /* x rows: act rows 2r (level 1), 2r + 1 */
	__m512 facc[QT_MR / 2], sub[QT_MR / 2];
	_Pragma("GCC unroll 8")
	for (int r = 0; r < RX; r++)
		facc[r] = sub[r] = _mm512_setzero_ps();
	for (int64_t xb = 0; xb < t->nxb; xb++) {
		_Pragma("GCC unroll 8")
		for (int j = 0; j < nsub; j++) {
			const int64_t s = xb * nsub + j;
			__m512i ia[QT_MR];
			_Pragma("GCC unroll 8")
			for (int r = 0; r < MR_; r++)
				ia[r] = _mm512_set1_epi32(t->ioff[r * t->ldsub + s]);
			const uint8_t *wq = t->wp + s * S * QT_NR;
			const int8_t *xq = t->xq + xb * XB + j * S;
#if !QT_VNNI
			__m512i h[QT_MR];
#endif
			_Pragma("GCC unroll 8")
			for (int g = 0; g < S / 4; g++) {
				const __m512i w = _mm512_load_si512((const void *)(wq + 64 * g));
#if QT_VNNI
				_Pragma("GCC unroll 8")
				for (int r = 0; r < MR_; r++) {
					int32_t x4;
					memcpy(&x4, xq + r * t->ldq + 4 * g, 4);
					ia[r] = _mm512_dpbusd_epi32(ia[r], w, _mm512_set1_epi32(x4));
				}
#else
				const __m512i aw = sgn ? _mm512_abs_epi8(w) : w;
				const __mmask64 neg = sgn ? _mm512_movepi8_mask(w) : 0;
				_Pragma("GCC unroll 8")
				for (int r = 0; r < MR_; r++) {
					int32_t x4;
					memcpy(&x4, xq + r * t->ldq + 4 * g, 4);
					__m512i xv = _mm512_set1_epi32(x4);
					if (sgn)
						xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
					const __m512i p = _mm512_maddubs_epi16(aw, xv);
					h[r] = g % GA == 0 ? p : _mm512_add_epi16(h[r], p);
					KC_Q_RUNNING_SUM(h[r]);
					if (g % GA == GA - 1)
						ia[r] = _mm512_add_epi32(ia[r], _mm512_madd_epi16(h[r], _mm512_set1_epi16(1)));
				}
#endif
			}
			const __m512 scv = _mm512_load_ps(t->sc + s * QT_NR);
			const __m512 mnv = has_min ? _mm512_load_ps(t->mn + s * QT_NR) : _mm512_setzero_ps();
			_Pragma("GCC unroll 8")
			for (int r = 0; r < RX; r++) {
				/* 256 dot(w, q1) + dot(w, q2), exact (|.| < 2^28) */
				const __m512i c = _mm512_add_epi32(_mm512_slli_epi32(ia[2 * r], 8), ia[2 * r + 1]);
				const __m512 v = _mm512_cvtepi32_ps(c);
				sub[r] = j == 0 ? _mm512_mul_ps(v, scv) : _mm512_fmadd_ps(v, scv, sub[r]);
				if (has_min) /* level 2's fsum: 256 sum(q1) + sum(q2) */
					sub[r] = _mm512_fmadd_ps(mnv, _mm512_set1_ps(t->fsum[(2 * r + 1) * t->ldsub + s]), sub[r]);
			}
		}
		_Pragma("GCC unroll 8")
		for (int r = 0; r < RX; r++) /* scaled by d2 = d1 / 256 */
			facc[r] = _mm512_fmadd_ps(sub[r], _mm512_set1_ps(t->dx[(2 * r + 1) * t->ldb + xb]), facc[r]);
	}
	const __mmask16 mask = (__mmask16)((1u << t->nr) - 1u);
	_Pragma("GCC unroll 8")
	for (int r = 0; r < RX; r++) {
		float *y = t->y + r * t->y_stride;
		__m512 v = facc[r];
		if (!t->store)
			v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), v);
		_mm512_mask_storeu_ps(y, mask, v);
	}
}

#define QT_ROWS(WT, S, XB, MIN, SGN)                                                 \
	switch (t->mr) {                                                             \
	case 2: QT_FN(tile_impl)(t, 2, S, XB, MIN, SGN, kc_q_i16_sums(WT)); break;    \
	case 4: QT_FN(tile_impl)(t, 4, S, XB, MIN, SGN, kc_q_i16_sums(WT)); break;    \
	case 6: QT_FN(tile_impl)(t, 6, S, XB, MIN, SGN, kc_q_i16_sums(WT)); break;    \
	default: QT_FN(tile_impl)(t, 8, S, XB, MIN, SGN, kc_q_i16_sums(WT)); break;   \
	}

static QT_TGT void QT_FN(tile)(const kc_qtile *t)
{
	switch (t->wt) {
	case KB_Q4_0: QT_ROWS(KB_Q4_0, 32, 32, 0, 0) break;
	case KB_Q4_1: QT_ROWS(KB_Q4_1, 32, 32, 1, 0) break;
	case KB_Q8_0: QT_ROWS(KB_Q8_0, 32, 32, 0, !QT_VNNI) break;
	case KB_Q4_K: QT_ROWS(KB_Q4_K, 32, 256, 1, 0) break;
	case KB_Q5_K: QT_ROWS(KB_Q5_K, 32, 256, 1, 0) break;
	case KB_Q6_K: QT_ROWS(KB_Q6_K, 16, 256, 0, 0) break;
	default: break;
	}
}

#undef QT_NR
#undef QT_MR
#undef QT_INL
#undef QT_ROWS

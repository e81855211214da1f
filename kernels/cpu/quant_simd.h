/*
 * quant_simd.h - 256-bit kernels of the quantized matmul, written once and
 * compiled by quant_avx2.c (pmaddubsw + pmaddwd) and quant_avx512.c (VNNI
 * vpdpbusd / vpdpwssd on ymm): the activation quantizer (both levels), the
 * GEMV kernels (one weight row at a time, decoded straight from its blocks,
 * against up to KC_QGEMV_M act rows) and the panel packing of the GEMM.
 *
 * The includer defines before including:
 *   QS_TGT             function attribute selecting the ISA
 *   QS_FN(name)        the ISA's name for a function
 *   QS_DOT(acc, u, s)  acc (8 x i32) += sums of 4 products u8 x s8 (exact)
 *   QS_DOTW(acc, a, b) acc (8 x i32) += sums of 2 products i16 x i16 (exact)
 *   QS_Q8_XOR          1: pack Q8_0 as q ^ 0x80 (offset -128), 0: keep signed
 * Private to the quant module (see quant_impl.h for the data layouts).
 */
#ifndef QS_TGT
#error "quant_simd.h is a template: define QS_TGT, QS_FN, QS_DOT, QS_DOTW, QS_Q8_XOR"
#endif

#include "kernels/cpu/quant_impl.h"

#include <immintrin.h>

#define QS_INL QS_TGT __attribute__((always_inline)) static inline

QS_INL float QS_FN(hsum8)(__m256 v)
{
	__m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
	s = _mm_add_ps(s, _mm_movehl_ps(s, s));
	s = _mm_add_ss(s, _mm_movehdup_ps(s));
	return _mm_cvtss_f32(s);
}

QS_INL float QS_FN(half)(const uint8_t *p)
{
	uint16_t h;
	memcpy(&h, p, 2);
	return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

QS_INL __m256i QS_FN(load32)(const void *p)
{
	return _mm256_loadu_si256((const __m256i *)p);
}

/* 32 floats -> 32 int8 (x * id rounded to nearest even), in order. */
QS_INL __m256i QS_FN(quant32)(const float *x, __m256 id)
{
	__m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), id));
	__m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), id));
	__m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), id));
	__m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), id));
	__m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
	__m256i q = _mm256_packs_epi16(ab, cd);
	return _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Sums of q[0..15] and q[16..31] (signed bytes). */
QS_INL void QS_FN(sums16)(__m256i q, int16_t *bs)
{
	__m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
	/* s: 8 sums of 4 bytes; lanes 0-3 -> bytes 0..15, lanes 4-7 -> 16..31 */
	__m128i lo = _mm256_castsi256_si128(s), hi = _mm256_extracti128_si256(s, 1);
	__m128i t = _mm_hadd_epi32(lo, hi); /* [l0+l1, l2+l3, h0+h1, h2+h3] */
	t = _mm_hadd_epi32(t, t);           /* [lo sum, hi sum, ...] */
	bs[0] = (int16_t)_mm_cvtsi128_si32(t);
	bs[1] = (int16_t)_mm_extract_epi32(t, 1);
}

static QS_TGT void QS_FN(quantize)(const float *x, int64_t K, int a256, const kc_qact *act)
{
	const int blk = a256 ? 256 : 32;
	const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
	for (int64_t b = 0; b < K / blk; b++) {
		const float *xb = x + b * blk;
		__m256 mx = _mm256_setzero_ps();
		for (int i = 0; i < blk; i += 8)
			mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + i), nosign));
		__m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
		m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
		m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
		const float amax = _mm_cvtss_f32(m4);
		const float idf = amax > 0.0f ? 127.0f / amax : 0.0f;
		const __m256 id = _mm256_set1_ps(idf);
		int8_t *q = act->q + b * blk;
		int16_t *bs = act->bs + b * (blk / 16);
		for (int i = 0; i < blk; i += 32) {
			__m256i v = QS_FN(quant32)(xb + i, id);
			_mm256_storeu_si256((__m256i *)(q + i), v);
			QS_FN(sums16)(v, bs + i / 16);
		}
		act->d[b] = amax / 127.0f;
		if (!a256) {
			act->ds[2 * b] = act->d[b];
			act->ds[2 * b + 1] = act->d[b] * (float)(bs[0] + bs[1]);
		}
	}
}

/* 32 residuals (x - d1 q1) * id as int8, clamped to [-127, 127], in order. */
QS_INL __m256i QS_FN(quant32r)(const float *x, const int8_t *q1, __m256 d1, __m256 id)
{
	__m256i v[4];
	_Pragma("GCC unroll 4")
	for (int i = 0; i < 4; i++) {
		const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q1 + 8 * i))));
		const __m256 p = _mm256_mul_ps(d1, q); /* no contraction: as the scalar */
		const __m256 r = _mm256_sub_ps(_mm256_loadu_ps(x + 8 * i), p);
		v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(r, id));
	}
	__m256i ab = _mm256_packs_epi32(v[0], v[1]), cd = _mm256_packs_epi32(v[2], v[3]);
	__m256i q = _mm256_max_epi8(_mm256_packs_epi16(ab, cd), _mm256_set1_epi8(-127));
	return _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Level 2 of one x row (quant.c's quant_level2, bit for bit): q, d, bs of l2. */
static QS_TGT void QS_FN(quantize2)(const float *x, int64_t K, int a256, const kc_qact *l1, const kc_qact *l2)
{
	const int blk = a256 ? 256 : 32;
	for (int64_t b = 0; b < K / blk; b++) {
		const float d1 = l1->d[b];
		float idf = d1 > 0.0f ? 256.0f / d1 : 0.0f;
		if (!(idf <= 3.40282347e38f))
			idf = 0.0f;
		const __m256 dv = _mm256_set1_ps(d1), id = _mm256_set1_ps(idf);
		for (int i = 0; i < blk; i += 32) {
			const int64_t e = b * blk + i;
			__m256i v = QS_FN(quant32r)(x + e, l1->q + e, dv, id);
			_mm256_storeu_si256((__m256i *)(l2->q + e), v);
			QS_FN(sums16)(v, l2->bs + e / 16);
		}
		l2->d[b] = d1 * (1.0f / 256.0f);
	}
}

/* ---- GEMV: one weight row at a time against M activation rows ----
 * Blocks are walked in address order, so each thread reads one ascending
 * stream that the hardware prefetchers follow (interleaving several rows
 * measured up to 2x slower from DRAM).  Independent accumulator chains
 * (U blocks in flight for the 32-blocks, two per super-block for the
 * K-quants, times M) keep the f32 sums off the FMA latency. */

/* The 32 values of a Q4_0 / Q4_1 block: low nibbles then high nibbles (the
 * 16 bytes in both halves, the upper half shifted right by 4, masked). */
QS_INL __m256i QS_FN(nibbles32)(const uint8_t *qs)
{
	__m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
	v = _mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4));
	return _mm256_and_si256(v, _mm256_set1_epi8(15));
}

/* f16 scale(s) at p as f32 lanes: [d] or, with two, [d, m]. */
QS_INL __m128 QS_FN(halves)(const uint8_t *p, const int two)
{
	if (two) {
		uint32_t v;
		memcpy(&v, p, 4);
		return _mm_cvtph_ps(_mm_cvtsi32_si128((int)v));
	}
	uint16_t h;
	memcpy(&h, p, 2);
	return _mm_cvtph_ps(_mm_cvtsi32_si128(h));
}

/* y element (x row m / 2, column n) from act rows m (level 1, value v0) and
 * m + 1 (level 2, v1); m even. */
QS_INL void QS_FN(put)(const kc_qgemv *g, int m, int64_t n, float v0, float v1)
{
	float *y = g->y + (m / 2) * g->y_stride + n;
	const float v = v0 + v1;
	*y = g->accumulate ? *y + v : v;
}

#define QS_RMAX 4 /* accumulator sets per x row, at most */

/* Q4_0, Q4_1, Q8_0: weight row n, blocks walked in order (one ascending
 * stream, which the hardware prefetchers follow), U blocks per step into U
 * accumulators per x row.  M act rows = M / 2 x rows; per x row and block the
 * two levels share one integer accumulator, 256 * dot(w, q1) + dot(w, q2)
 * (exact: |.| < 2^28, and < 2^24 for Q4_0 / Q4_1, so its f32 conversion is
 * exact there), scaled by dw * d2 (quant_impl.h). */
QS_INL void QS_FN(a32_row)(const kc_qgemv *g, int64_t n, const int U, const int M, const enum kb_dtype t)
{
	const int P = M / 2;
	const int64_t nb = g->K / 32;
	const size_t bb = kb_dtype_block_bytes(t);
	const uint8_t *w = g->w + (size_t)n * g->w_row_bytes;
	__m256 acc[QS_RMAX][KC_QGEMV_M / 2];
	__m128 accm[QS_RMAX][KC_QGEMV_M / 2]; /* Q4_1: lane 1 sums mw * sx */
	_Pragma("GCC unroll 8")
	for (int u = 0; u < U; u++) {
		_Pragma("GCC unroll 8")
		for (int p = 0; p < P; p++) {
			acc[u][p] = _mm256_setzero_ps();
			accm[u][p] = _mm_setzero_ps();
		}
	}
	for (int64_t b0 = 0; b0 < nb; b0 += U) {
		_Pragma("GCC unroll 8")
		for (int u = 0; u < U; u++) {
			const int64_t b = b0 + u;
			if (U > 1 && b >= nb)
				break;
			const uint8_t *wb = w + (size_t)b * bb;
			const __m128 dm = QS_FN(halves)(wb, t == KB_Q4_1); /* [dw, mw] */
			__m256i uq, sgn = _mm256_setzero_si256();
			if (t == KB_Q8_0) {
				sgn = QS_FN(load32)(wb + 2);
				uq = _mm256_abs_epi8(sgn);
			} else {
				uq = QS_FN(nibbles32)(wb + (t == KB_Q4_1 ? 4 : 2));
			}
			_Pragma("GCC unroll 8")
			for (int p = 0; p < P; p++) {
				const int8_t *x1 = g->act.q + 2 * p * g->act.ldq + 32 * b;
				const __m256i xv1 = QS_FN(load32)(x1), xv2 = QS_FN(load32)(x1 + g->act.ldq);
				/* level 2's pair [d2, sx of both levels] */
				const __m128 ds = _mm_castpd_ps(
					_mm_load_sd((const double *)(g->act.ds + 2 * ((2 * p + 1) * g->act.ldb + b))));
				__m256i i1, i2;
				if (t == KB_Q8_0) {
					i1 = QS_DOT(_mm256_setzero_si256(), uq, _mm256_sign_epi8(xv1, sgn));
					i2 = QS_DOT(_mm256_slli_epi32(i1, 8), uq, _mm256_sign_epi8(xv2, sgn));
				} else if (t == KB_Q4_0) {
					const int16_t *bs1 = g->act.bs + 2 * p * g->act.lds + 2 * b, *bs2 = bs1 + g->act.lds;
					const int off = -8 * (256 * (bs1[0] + bs1[1]) + bs2[0] + bs2[1]);
					i1 = QS_DOT(_mm256_setzero_si256(), uq, xv1);
					i2 = QS_DOT(_mm256_add_epi32(_mm256_slli_epi32(i1, 8), _mm256_setr_epi32(off, 0, 0, 0, 0, 0, 0, 0)),
						    uq, xv2);
				} else {
					i1 = QS_DOT(_mm256_setzero_si256(), uq, xv1);
					i2 = QS_DOT(_mm256_slli_epi32(i1, 8), uq, xv2);
				}
				const __m128 prod = _mm_mul_ps(dm, ds); /* [dw d2, mw sx] */
				if (t == KB_Q4_1)
					accm[u][p] = _mm_add_ps(accm[u][p], prod);
				acc[u][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i2), _mm256_broadcastss_ps(prod), acc[u][p]);
			}
		}
	}
	_Pragma("GCC unroll 8")
	for (int p = 0; p < P; p++) {
		__m256 a = acc[0][p];
		__m128 am = accm[0][p];
		_Pragma("GCC unroll 8")
		for (int u = 1; u < U; u++) {
			a = _mm256_add_ps(a, acc[u][p]);
			am = _mm_add_ps(am, accm[u][p]);
		}
		const float mins = t == KB_Q4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(am)) : 0.0f;
		QS_FN(put)(g, 2 * p, n, QS_FN(hsum8)(a) + mins, 0.0f);
	}
}

/* Scale of sub-block j (of the 8 i16 in the low 128 bits of s, copied to
 * both halves) broadcast to 16 i16 lanes. */
QS_INL __m256i QS_FN(scale16)(__m256i s, int j)
{
	const char lo = (char)(2 * j), hi = (char)(2 * j + 1);
	return _mm256_shuffle_epi8(s, _mm256_setr_epi8(lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi,
						       lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi,
						       lo, hi, lo, hi));
}

/* Q4_K, Q5_K: weight rows n .. n + R - 1 against M act rows (each level on
 * its own scale, the pair added at the end); two integer accumulators per
 * (row, act row): even and odd sub-blocks. */
QS_INL void QS_FN(k45_rows)(const kc_qgemv *g, int64_t n, const int R, const int M, const int five)
{
	const int64_t nb = g->K / 256;
	const size_t bb = five ? 176 : 144;
	const __m256i m4 = _mm256_set1_epi8(15), b4 = _mm256_set1_epi8(16);
	const uint8_t *w[QS_RMAX];
	__m256 acc[QS_RMAX][KC_QGEMV_M];
	__m128 accm[QS_RMAX][KC_QGEMV_M];
	_Pragma("GCC unroll 8")
	for (int r = 0; r < R; r++) {
		w[r] = g->w + (size_t)(n + r) * g->w_row_bytes;
		_Pragma("GCC unroll 8")
		for (int m = 0; m < M; m++) {
			acc[r][m] = _mm256_setzero_ps();
			accm[r][m] = _mm_setzero_ps();
		}
	}
	for (int64_t b = 0; b < nb; b++) {
		__m128i b32[KC_QGEMV_M];
		float dx[KC_QGEMV_M];
		_Pragma("GCC unroll 8")
		for (int m = 0; m < M; m++) {
			const int16_t *bs = g->act.bs + m * g->act.lds + 16 * b;
			b32[m] = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bs),
						_mm_loadu_si128((const __m128i *)(bs + 8)));
			dx[m] = g->act.d[m * g->act.ldb + b];
		}
		_Pragma("GCC unroll 8")
		for (int r = 0; r < R; r++) {
			const uint8_t *wb = w[r] + (size_t)b * bb;
			const float d = QS_FN(half)(wb), dmin = QS_FN(half)(wb + 2);
			uint32_t u0, u1, u2;
			memcpy(&u0, wb + 4, 4);
			memcpy(&u1, wb + 8, 4);
			memcpy(&u2, wb + 12, 4);
			/* the 8 scales and the 8 mins as bytes, sub-block order */
			const uint64_t scl = (uint64_t)(u0 & 0x3f3f3f3fu) |
					     (uint64_t)((u2 & 0x0f0f0f0fu) | ((u0 >> 6) & 0x03030303u) << 4) << 32;
			const uint64_t mns = (uint64_t)(u1 & 0x3f3f3f3fu) |
					     (uint64_t)(((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 6) & 0x03030303u) << 4) << 32;
			const __m256i s16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scl)));
			const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mns));
			const uint8_t *qs = wb + (five ? 48 : 16);
			__m256i qh = five ? QS_FN(load32)(wb + 16) : _mm256_setzero_si256();
			__m256i ia[KC_QGEMV_M], ib[KC_QGEMV_M];
			_Pragma("GCC unroll 8")
			for (int m = 0; m < M; m++)
				ia[m] = ib[m] = _mm256_setzero_si256();
			_Pragma("GCC unroll 8")
			for (int c = 0; c < 4; c++) {
				__m256i v = QS_FN(load32)(qs + 32 * c);
				__m256i lo = _mm256_and_si256(v, m4);
				__m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
				if (five) {
					lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), b4));
					hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), b4));
					qh = _mm256_srli_epi16(qh, 2);
				}
				const __m256i sa = QS_FN(scale16)(s16, 2 * c), sb = QS_FN(scale16)(s16, 2 * c + 1);
				_Pragma("GCC unroll 8")
				for (int m = 0; m < M; m++) {
					const int8_t *xq = g->act.q + m * g->act.ldq + 256 * b + 64 * c;
					ia[m] = QS_DOTW(ia[m], _mm256_maddubs_epi16(lo, QS_FN(load32)(xq)), sa);
					ib[m] = QS_DOTW(ib[m], _mm256_maddubs_epi16(hi, QS_FN(load32)(xq + 32)), sb);
				}
			}
			_Pragma("GCC unroll 8")
			for (int m = 0; m < M; m++) {
				acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(ia[m], ib[m])),
							    _mm256_set1_ps(d * dx[m]), acc[r][m]);
				accm[r][m] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mn16, b32[m])),
							  _mm_set1_ps(-dmin * dx[m]), accm[r][m]);
			}
		}
	}
	_Pragma("GCC unroll 8")
	for (int r = 0; r < R; r++) {
		float v[KC_QGEMV_M];
		_Pragma("GCC unroll 8")
		for (int m = 0; m < M; m++) {
			__m128 s = accm[r][m];
			s = _mm_add_ps(s, _mm_movehl_ps(s, s));
			s = _mm_add_ss(s, _mm_movehdup_ps(s));
			v[m] = QS_FN(hsum8)(acc[r][m]) + _mm_cvtss_f32(s);
		}
		_Pragma("GCC unroll 8")
		for (int m = 0; m < M; m += 2)
			QS_FN(put)(g, m, n + r, v[m], v[m + 1]);
	}
}

/* Q6_K: weight rows n .. n + R - 1 against M act rows (levels as Q4_K); two
 * integer accumulators per (row, act row). */
QS_INL void QS_FN(q6k_rows)(const kc_qgemv *g, int64_t n, const int R, const int M)
{
	const int64_t nb = g->K / 256;
	const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
	const uint8_t *w[QS_RMAX];
	__m256 acc[QS_RMAX][KC_QGEMV_M];
	_Pragma("GCC unroll 8")
	for (int r = 0; r < R; r++) {
		w[r] = g->w + (size_t)(n + r) * g->w_row_bytes;
		_Pragma("GCC unroll 8")
		for (int m = 0; m < M; m++)
			acc[r][m] = _mm256_setzero_ps();
	}
	for (int64_t b = 0; b < nb; b++) {
		_Pragma("GCC unroll 8")
		for (int r = 0; r < R; r++) {
			const uint8_t *wb = w[r] + (size_t)b * 210;
			const float d = QS_FN(half)(wb + 208);
			const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 192)));
			__m256i ia[KC_QGEMV_M], ib[KC_QGEMV_M];
			_Pragma("GCC unroll 8")
			for (int m = 0; m < M; m++) {
				/* -32 * sum_g sc_g * (sum of the group's 16 q's) */
				const __m256i bsv = QS_FN(load32)(g->act.bs + m * g->act.lds + 16 * b);
				ia[m] = _mm256_sub_epi32(_mm256_setzero_si256(),
							 _mm256_slli_epi32(_mm256_madd_epi16(s16, bsv), 5));
				ib[m] = _mm256_setzero_si256();
			}
			_Pragma("GCC unroll 8")
			for (int h = 0; h < 2; h++) {
				const uint8_t *L = wb + 64 * h, *H = wb + 128 + 32 * h;
				const __m256i l0 = QS_FN(load32)(L), l1 = QS_FN(load32)(L + 32), hb = QS_FN(load32)(H);
				__m256i q[4];
				q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
				q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
				q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30));
				q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
						       _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
				/* scales of groups 8h + 2i (low 128 bits) and 8h + 2i + 1 (high) */
				const __m256i sh = h ? _mm256_permute4x64_epi64(s16, 0xEE) : _mm256_permute4x64_epi64(s16, 0x44);
				_Pragma("GCC unroll 8")
				for (int i = 0; i < 4; i++) {
					const char a = (char)(4 * i), a1 = (char)(4 * i + 1), c = (char)(4 * i + 2),
						   c1 = (char)(4 * i + 3);
					const __m256i sp = _mm256_shuffle_epi8(
						sh, _mm256_setr_epi8(a, a1, a, a1, a, a1, a, a1, a, a1, a, a1, a, a1, a, a1,
								     c, c1, c, c1, c, c1, c, c1, c, c1, c, c1, c, c1, c, c1));
					_Pragma("GCC unroll 8")
					for (int m = 0; m < M; m++) {
						const int8_t *xq = g->act.q + m * g->act.ldq + 256 * b + 128 * h + 32 * i;
						const __m256i p = _mm256_maddubs_epi16(q[i], QS_FN(load32)(xq));
						if (i & 1)
							ib[m] = QS_DOTW(ib[m], p, sp);
						else
							ia[m] = QS_DOTW(ia[m], p, sp);
					}
				}
			}
			_Pragma("GCC unroll 8")
			for (int m = 0; m < M; m++) {
				const float dd = d * g->act.d[m * g->act.ldb + b];
				acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(ia[m], ib[m])),
							    _mm256_set1_ps(dd), acc[r][m]);
			}
		}
	}
	_Pragma("GCC unroll 8")
	for (int r = 0; r < R; r++)
		_Pragma("GCC unroll 8")
		for (int m = 0; m < M; m += 2)
			QS_FN(put)(g, m, n + r, QS_FN(hsum8)(acc[r][m]), QS_FN(hsum8)(acc[r][m + 1]));
}

/* g->m is 2 or 4 act rows (one or two x rows, two levels each) */
#define QS_GEMV_CASES(call)                                                   \
	switch (g->m) {                                                       \
	case 2: for (int64_t n = n0; n < n1; n++) call(n, 2); break;          \
	default: for (int64_t n = n0; n < n1; n++) call(n, 4); break;         \
	}

static QS_TGT void QS_FN(gemv)(const kc_qgemv *g, int64_t n0, int64_t n1)
{
	/* U = 4, 2 blocks in flight for M = 2, 4 act rows (accumulator chains) */
	switch (g->wt) {
	case KB_Q4_0:
#define QS_C(n, M) QS_FN(a32_row)(g, n, (M) == 2 ? 4 : 2, M, KB_Q4_0)
		QS_GEMV_CASES(QS_C)
#undef QS_C
		break;
	case KB_Q4_1:
#define QS_C(n, M) QS_FN(a32_row)(g, n, (M) == 2 ? 4 : 2, M, KB_Q4_1)
		QS_GEMV_CASES(QS_C)
#undef QS_C
		break;
	case KB_Q8_0:
#define QS_C(n, M) QS_FN(a32_row)(g, n, (M) == 2 ? 4 : 2, M, KB_Q8_0)
		QS_GEMV_CASES(QS_C)
#undef QS_C
		break;
	case KB_Q4_K:
#define QS_C(n, M) QS_FN(k45_rows)(g, n, 1, M, 0)
		QS_GEMV_CASES(QS_C)
#undef QS_C
		break;
	case KB_Q5_K:
#define QS_C(n, M) QS_FN(k45_rows)(g, n, 1, M, 1)
		QS_GEMV_CASES(QS_C)
#undef QS_C
		break;
	case KB_Q6_K:
#define QS_C(n, M) QS_FN(q6k_rows)(g, n, 1, M)
		QS_GEMV_CASES(QS_C)
#undef QS_C
		break;
	default:
		break;
	}
}

/* ---- GEMM panel packing (layout in quant_impl.h) ----
 * Each column (weight row) is unpacked to bytes in element order (u), then
 * each 32-element stretch of 8 columns is transposed as an 8 x 8 matrix of
 * 4-byte groups (three shuffle stages) and stored as 8 group rows of the
 * panel (a Q6_K stretch holds two 16-element sub-blocks). */

/* The unsigned values of one block (blk bytes to v) and its per-sub-block
 * scales / min coefficients (at sc[s * nrp], mn[s * nrp]). */
QS_INL void QS_FN(unpack_block)(enum kb_dtype t, const uint8_t *b, uint8_t *v, float *sc, float *mn, int nrp)
{
	switch (t) {
	case KB_Q4_0:
	case KB_Q4_1:
		_mm256_store_si256((__m256i *)v, QS_FN(nibbles32)(b + (t == KB_Q4_1 ? 4 : 2)));
		sc[0] = QS_FN(half)(b);
		mn[0] = t == KB_Q4_1 ? QS_FN(half)(b + 2) : 0.0f;
		break;
	case KB_Q8_0: {
		__m256i q = QS_FN(load32)(b + 2);
		if (QS_Q8_XOR)
			q = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
		_mm256_store_si256((__m256i *)v, q);
		sc[0] = QS_FN(half)(b);
		mn[0] = 0.0f;
		break;
	}
	case KB_Q4_K:
	case KB_Q5_K: {
		const int five = t == KB_Q5_K;
		const uint8_t *qs = b + (five ? 48 : 16);
		const __m256i m4 = _mm256_set1_epi8(15), b4 = _mm256_set1_epi8(16);
		__m256i qh = five ? QS_FN(load32)(b + 16) : _mm256_setzero_si256();
		_Pragma("GCC unroll 4")
		for (int cc = 0; cc < 4; cc++) {
			__m256i x = QS_FN(load32)(qs + 32 * cc);
			__m256i lo = _mm256_and_si256(x, m4);
			__m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
			if (five) {
				lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), b4));
				hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), b4));
				qh = _mm256_srli_epi16(qh, 2);
			}
			_mm256_store_si256((__m256i *)(v + 64 * cc), lo);
			_mm256_store_si256((__m256i *)(v + 64 * cc + 32), hi);
		}
		const float d = QS_FN(half)(b), dmin = QS_FN(half)(b + 2);
		for (int j = 0; j < 8; j++) {
			int s6, m6;
			kc_q_scale_min_k4(b + 4, j, &s6, &m6);
			sc[j * nrp] = d * (float)s6;
			mn[j * nrp] = -(dmin * (float)m6);
		}
		break;
	}
	case KB_Q6_K: {
		const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
		_Pragma("GCC unroll 2")
		for (int h = 0; h < 2; h++) {
			const uint8_t *L = b + 64 * h, *H = b + 128 + 32 * h;
			const __m256i l0 = QS_FN(load32)(L), l1 = QS_FN(load32)(L + 32), hb = QS_FN(load32)(H);
			uint8_t *o = v + 128 * h;
			_mm256_store_si256((__m256i *)o, _mm256_or_si256(_mm256_and_si256(l0, m4),
					   _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)));
			_mm256_store_si256((__m256i *)(o + 32), _mm256_or_si256(_mm256_and_si256(l1, m4),
					   _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)));
			_mm256_store_si256((__m256i *)(o + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
					   _mm256_and_si256(hb, m30)));
			_mm256_store_si256((__m256i *)(o + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
					   _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30)));
		}
		const float d = QS_FN(half)(b + 208);
		for (int j = 0; j < 16; j++) {
			sc[j * nrp] = d * (float)(int8_t)b[192 + j];
			mn[j * nrp] = 0.0f;
		}
		break;
	}
	default:
		break;
	}
}

/* Transposes 8 rows of 8 dwords (r) in place: r[g] = dword g of each row. */
QS_INL void QS_FN(transpose8)(__m256i *r)
{
	__m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
	__m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
	__m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
	__m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
	__m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
	__m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
	__m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
	__m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
	r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
	r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
	r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
	r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
	r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
	r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
	r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
	r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

#define QS_PF 4

static QS_TGT void QS_FN(pack)(enum kb_dtype t, const uint8_t *w, size_t w_row_bytes, int nr,
			       int64_t nblk, uint8_t *wp, float *sc, float *mn, int nrp)
{
	const int S = kc_q_sub(t), blk = (int)kb_dtype_block(t), nsub = blk / S;
	const size_t bb = kb_dtype_block_bytes(t);
	const int64_t nk = nblk * blk, nstretch = nk / 32;
	/* unpacked values, one column per row of the buffer: each weight row
	 * is read as one ascending stream */
	_Alignas(32) uint8_t u[KC_Q_NR_MAX * KC_Q_KC];
	/* the rows of a chunk are short streams (360 bytes for a Q4_1 row of
	 * 576): prefetch QS_PF rows ahead so their misses overlap */
	const size_t cb = (size_t)nblk * bb;
	for (int c = 0; c < nr && c < QS_PF; c++)
		for (size_t o = 0; o < cb; o += 64)
			_mm_prefetch((const char *)(w + (size_t)c * w_row_bytes + o), _MM_HINT_T0);
	for (int c = 0; c < nrp; c++) {
		if (c + QS_PF < nr)
			for (size_t o = 0; o < cb; o += 64)
				_mm_prefetch((const char *)(w + (size_t)(c + QS_PF) * w_row_bytes + o), _MM_HINT_T0);
		uint8_t *uc = u + (size_t)c * KC_Q_KC;
		if (c >= nr) { /* past the matrix edge: zeros */
			memset(uc, 0, (size_t)nk);
			for (int64_t s = 0; s < nblk * nsub; s++)
				sc[s * nrp + c] = mn[s * nrp + c] = 0.0f;
			continue;
		}
		const uint8_t *b = w + (size_t)c * w_row_bytes;
		/* one loop per type, so the per-block work is straight-line */
#define QS_UNPACK_ROW(T)                                                                            \
	for (int64_t i = 0; i < nblk; i++)                                                          \
		QS_FN(unpack_block)(T, b + (size_t)i * bb, uc + i * blk, sc + i * nsub * nrp + c, \
				    mn + i * nsub * nrp + c, nrp)
		switch (t) {
		case KB_Q4_0: QS_UNPACK_ROW(KB_Q4_0); break;
		case KB_Q4_1: QS_UNPACK_ROW(KB_Q4_1); break;
		case KB_Q8_0: QS_UNPACK_ROW(KB_Q8_0); break;
		case KB_Q4_K: QS_UNPACK_ROW(KB_Q4_K); break;
		case KB_Q5_K: QS_UNPACK_ROW(KB_Q5_K); break;
		case KB_Q6_K: QS_UNPACK_ROW(KB_Q6_K); break;
		default: break;
		}
#undef QS_UNPACK_ROW
	}
	for (int64_t k = 0; k < nstretch; k++) { /* 32-element stretches */
		for (int cg = 0; cg < nrp; cg += 8) {
			__m256i r[8];
			_Pragma("GCC unroll 8")
			for (int c = 0; c < 8; c++)
				r[c] = _mm256_load_si256((const __m256i *)(u + (size_t)(cg + c) * KC_Q_KC + 32 * k));
			QS_FN(transpose8)(r);
			_Pragma("GCC unroll 8")
			for (int g = 0; g < 8; g++) {
				/* group g of the stretch: its sub-block and group there */
				const int64_t sb = S == 32 ? k : 2 * k + g / 4;
				const int gs = S == 32 ? g : g % 4;
				_mm256_storeu_si256((__m256i *)(wp + (size_t)sb * (size_t)(S * nrp) + (size_t)(gs * nrp + cg) * 4),
						    r[g]);
			}
		}
	}
}

#undef QS_INL
#undef QS_PF
#undef QS_GEMV_CASES
#undef QS_RMAX

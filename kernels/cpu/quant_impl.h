/*
 * quant_impl.h - private interface between the quantized-matmul driver
 * (quant.c) and its per-ISA kernels (quant_avx2.c, quant_avx512.c).
 *
 * The driver quantizes the activations once per call into a kc_qact (per
 * calling thread scratch), each x row r as two activation ("act") rows:
 * 2r = level 1 (q1, d1) and 2r + 1 = level 2 (q2, d2 = d1 / 256), see
 * quant.h; then either
 *   GEMV (M below the ISA's gemm_min_m): each weight row is decoded straight
 *     from its blocks and dotted with up to KC_QGEMV_M act rows (KC_QGEMV_M / 2
 *     x rows) at a time; work is split over weight rows;
 *   GEMM: the weights are repacked, KC_Q_KC elements at a time, into a panel
 *     of nr weight rows (columns of y) whose quantized values are interleaved
 *     four bytes per column, so one 4-byte dot instruction lane is one y
 *     column (vpdpbusd, or pmaddubsw + pmaddwd), and the panel is reused by
 *     tiles of up to mr act rows (mr / 2 x rows); work is split over panels
 *     (and over rows when there are few panels).
 *
 * Packed panel of one K chunk (the weight block structure made uniform):
 *   sub-blocks of S elements (S = 16 for Q6_K, else 32), for each sub-block s
 *     wp[s * S * nr + (g * nr + c) * 4 + e] = unsigned value of element 4g + e
 *                                             of column c   (g < S / 4)
 *     sc[s * nr + c]  f32 scale of the sub-block   (Q4_0/Q4_1/Q8_0: d,
 *                     Q4_K/Q5_K: d * s_j, Q6_K: d * sc_g; exact in f32)
 *     mn[s * nr + c]  f32 min coefficient          (Q4_1: m, Q4_K/Q5_K:
 *                     -dmin * m_j; others unused)
 *   the stored value is q for Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K and q ^ 0x80
 *   (= q + 128 as unsigned) for Q8_0 on VNNI; the signed offset is undone
 *   through the activation side: the integer accumulator of (row r,
 *   sub-block s) starts at ioff[r][s] = off * sum(qx over s), off = -8 (Q4_0),
 *   -128 (Q8_0 on VNNI), -32 (Q6_K), 0 otherwise.  The maddubs kernels keep
 *   Q8_0 signed (off 0) and use |w| with sign(x, w).
 *   Columns past the matrix edge are packed as zeros.
 * A tile then computes, per x row, x block (32 or 256 elements) and
 * sub-block s, from the integer accumulators i1_s, i2_s of its two act rows:
 *   t = sum_s (float)(256 i1_s + i2_s) * sc_s + mn_s * fsum2_s;   y += d2 * t
 * (256 i1 + i2 is exact: |i| < 2^28), fsum2 being level 2's fsum below.
 *
 * Thread rule: kernels touch only their own y tile / rows and read shared
 * inputs; no state.
 */
#ifndef DS_KERNELS_CPU_QUANT_IMPL_H
#define DS_KERNELS_CPU_QUANT_IMPL_H

#include "kernels/backend.h"

#include <stdint.h>
#include <string.h>

#define KC_Q_KC 2048      /* GEMM K chunk (elements): a multiple of 256 */
#define KC_Q_NR_MAX 16    /* panel width, at most */
#define KC_Q_MR_MAX 8     /* act rows per GEMM tile, at most */
#define KC_QGEMV_M 4      /* act rows per GEMV pass, at most (even) */

/* Quantized activations of a chunk of x rows: act rows 2r (level 1) and
 * 2r + 1 (level 2) of x row r.  Per act row: */
typedef struct kc_qact {
	int8_t *q;       /* [rows][ldq] quantized values (ldq >= K, multiple of 64) */
	float *d;        /* [rows][ldb] scale per x block (32 or 256 elements): d1, d2 */
	float *ds;       /* [rows][2 * ldb] Q8 32 only, per block a pair: level 1 (d1, 0),
			  * level 2 (d2, sx of the block, both levels: quant.h) */
	int16_t *bs;     /* [rows][lds] sum of each 16 q's */
	int32_t *ioff;   /* GEMM only: [rows][ldsub] off * (sum of the sub-block's q) */
	float *fsum;     /* GEMM only: [rows][ldsub] level 1: (float)sum(q1), level 2:
			  * (float)(256 sum(q1) + sum(q2)) over the sub-block (exact) */
	int64_t ldq, ldb, lds, ldsub;
} kc_qact;

/* One GEMV pass: weight rows [n0, n1) against act rows [0, m) (m = 2 or 4 <=
 * KC_QGEMV_M: one or two x rows); y row i / 2 gets both levels of act rows i, i + 1. */
typedef struct kc_qgemv {
	enum kb_dtype wt;
	const uint8_t *w;   /* row n starts at w + n * w_row_bytes */
	size_t w_row_bytes;
	int64_t K;
	int m;
	kc_qact act;        /* pointing at the pass's first row */
	float *y;           /* y[0][0] of the pass; row i at y + i * y_stride */
	int64_t y_stride;
	int accumulate;
} kc_qgemv;

/* One GEMM tile over one K chunk. */
typedef struct kc_qtile {
	enum kb_dtype wt;
	const uint8_t *wp;  /* packed panel (see the top comment) */
	const float *sc, *mn;
	int64_t nxb;        /* x blocks in the chunk */
	const int8_t *xq;   /* row 0 of the tile at the chunk's first element */
	const float *dx;    /* row 0, the chunk's first x block */
	const int32_t *ioff;
	const float *fsum;  /* row 0, the chunk's first sub-block */
	int64_t ldq, ldb, ldsub;
	float *y;           /* y[0][0] of the tile */
	int64_t y_stride;
	int mr, nr;         /* act rows (even, <= mr_max; x rows mr / 2), valid columns (<= panel width) */
	int store;          /* 1: y = result, 0: y += result */
} kc_qtile;

typedef struct kc_qkernels {
	const char *name;
	/* Quantizes one x row (K elements) into act row 0 (q, d, s, bs), bit for
	 * bit as the scalar quantizer; a256: Q8 256 (K-quant weights) else Q8 32. */
	void (*quantize)(const float *x, int64_t K, int a256, const kc_qact *act);
	/* The level 2 of the same row (the residual, see quant.c quant_level2),
	 * bit for bit as the scalar: q, d, bs of l2 from x and l1's q, d. */
	void (*quantize2)(const float *x, int64_t K, int a256, const kc_qact *l1, const kc_qact *l2);
	void (*gemv)(const kc_qgemv *g, int64_t n0, int64_t n1);
	/* GEMM (nr == 0: none): panel width, act rows per tile (even), smallest M worth it. */
	int nr, mr_max;
	int64_t gemm_min_m;
	int q8_off;        /* ioff multiplier of Q8_0 (-128 or 0, see the top comment) */
	/* Packs nblk weight blocks of nr rows (row c at w + c * w_row_bytes) into a panel. */
	void (*pack)(enum kb_dtype wt, const uint8_t *w, size_t w_row_bytes, int nr, int64_t nblk,
		     uint8_t *wp, float *sc, float *mn);
	void (*tile)(const kc_qtile *t);
} kc_qkernels;

const kc_qkernels *kc_qkernels_avx2(void);
const kc_qkernels *kc_qkernels_avx512(int vnni);

/* Shared scalar helpers for the kernels' edges. */
/* Q4_K / Q5_K 6-bit scale and min of sub-block j from the 12 packed bytes. */
static inline void kc_q_scale_min_k4(const uint8_t *sc, int j, int *s, int *m)
{
	if (j < 4) {
		*s = sc[j] & 63;
		*m = sc[j + 4] & 63;
	} else {
		*s = (sc[j + 4] & 15) | (sc[j - 4] >> 6) << 4;
		*m = (sc[j + 4] >> 4) | (sc[j] >> 6) << 4;
	}
}
/* Sub-block size (elements) of the packed panel for wt. */
static inline int kc_q_sub(enum kb_dtype wt)
{
	return wt == KB_Q6_K ? 16 : 32;
}
/* Activation block size for wt: the weight block's (Q8 32 or Q8 256). */
static inline int kc_q_xblock(enum kb_dtype wt)
{
	return (int)kb_dtype_block(wt);
}
/* pmaddubsw tiles (no VNNI): how many pair sums of one act row may be added
 * in i16 before pmaddwd widens them.  |x| <= 127 and a pair is at most
 * 2 * 127 * wmax (the largest packed weight value), so 8 for 4-bit weights
 * (30480), 4 for 5-bit (31496), 2 for 6-bit (32004), 1 for Q8_0 (|w| up to
 * 128).  Exact: the i16 sums never wrap. */
static inline int kc_q_i16_sums(enum kb_dtype wt)
{
	switch (wt) {
	case KB_Q4_0:
	case KB_Q4_1:
	case KB_Q4_K: return 8;
	case KB_Q5_K: return 4;
	case KB_Q6_K: return 2;
	default: return 1;
	}
}

/* After each i16 addition of a tile's act row: one running sum per row.
 * Left free, GCC summed a fully unrolled group's products as a tree with all
 * of them live and spilled them to the stack (603 stack accesses in the AVX2
 * tile, 128 with this; Q4_1 at M = 512 1.4-1.9x faster, same bits: integer
 * sums).  An empty asm with the register as operand; "v" is any vector
 * register the target has. */
#define KC_Q_RUNNING_SUM(v) __asm__("" : "+v"(v))

#endif

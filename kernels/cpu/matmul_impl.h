/*
 * matmul_impl.h - private interface between the matmul driver (matmul.c) and
 * its per-ISA micro-kernels (matmul_avx2.c, matmul_avx512.c).
 *
 * The driver splits y into tiles of mr x-rows by nr W-rows and the K axis into
 * chunks of KC_MM_KC; a kernel computes one tile over one K chunk.  Between
 * chunks the tile's vector accumulators are parked in a per-thread buffer
 * (acc, acc_load / acc_keep), so lanes are summed once, after the last chunk,
 * and y is written (store = 1) or added to (store = 0) once.  Each y element
 * is computed by the same sequence of operations whatever the tile shape or
 * the thread split, so results do not depend on the number of threads.
 */
#ifndef DS_KERNELS_CPU_MATMUL_IMPL_H
#define DS_KERNELS_CPU_MATMUL_IMPL_H

#include "kernels/backend.h"

#define KC_MM_KC 1024    /* K chunk: a packed panel of 8 rows is 32 KiB */
#define KC_MM_NR_MAX 8   /* W rows per tile, at most */
#define KC_MM_MR_MAX 4   /* x rows per tile, at most */

typedef struct kc_mm_tile {
	int mr, nr;          /* x rows, W rows (1..KC_MM_MR_MAX, 1..KC_MM_NR_MAX) */
	enum kb_dtype dt;    /* of w: KB_F32 for a packed panel */
	const float *x;      /* element k0 of the tile's first x row */
	int64_t x_stride;
	const void *w;       /* element k0 of the tile's first W row (dtype dt) */
	int64_t w_stride;    /* elements */
	int64_t nk;          /* K chunk length */
	/* FP8 only: kabs = absolute k of element 0 (for block boundaries),
	 * scale[r] = the scale row of W row r (index by k / block). */
	int64_t kabs, block;
	const float *scale[KC_MM_NR_MAX];
	float *y;            /* y[0][0] of the tile */
	int64_t y_stride;
	int store;           /* 1: y = sum, 0: y += sum */
	/* Accumulators between K chunks: acc[m * KC_MM_ACC_M + r * KC_MM_ACC_R]
	 * holds the lanes of (x row m, W row r).  acc_load: start from them
	 * (else from 0); acc_keep: park them there (else sum and write y). */
	float *acc;
	int acc_load, acc_keep;
	/* Decode order only (else NULL): the W rows the driver hands over next,
	 * pf_nr rows of pf_nk elements from pf (dtype dt, w_stride apart).  The
	 * kernel asks for them piece by piece while it streams its own rows, so
	 * that the next panel is on its way before the hardware prefetchers could
	 * have found its short row streams. */
	const char *pf;
	int pf_nr;
	int64_t pf_nk;
	/* Decode order only: x holds each whole group of kc_mm_kernels.xperm
	 * elements (counted from k = 0 of the matmul) permuted, phase by phase
	 * (kc_mm_permute_x); a tail shorter than a group is in natural order. */
	int xperm;
} kc_mm_tile;

/* Prefetches elements [k0, k1) of the rows t->pf (clipped to pf_nk); the
 * kernels call it once per stretch of at most one FP8 block.  Locality 1
 * (prefetcht2) measured clearly better on Zen 4 than 3 (t0) or 0 (nta) for
 * the 1 MB expert matrices: the lines need not hold an L1 miss buffer. */
static inline void kc_mm_prefetch(const kc_mm_tile *t, size_t es, int64_t k0, int64_t k1)
{
	if (!t->pf)
		return;
	if (k1 > t->pf_nk)
		k1 = t->pf_nk;
	const size_t rs = (size_t)t->w_stride * es;
	for (int r = 0; r < t->pf_nr; r++)
		for (int64_t b = k0 * (int64_t)es; b < k1 * (int64_t)es; b += 64)
			__builtin_prefetch(t->pf + (size_t)r * rs + (size_t)b, 0, 1);
}

/* Decode with one x row over whole rows (kc_mm_kernels.rows): W is
 * [N][K] with rows K elements apart (contiguous), and rows [n0, n1) are read
 * start to end in memory order, one at a time.  A thread's share of W is then
 * one sequential stream, which the hardware prefetchers follow and a software
 * prefetch pf_bytes ahead keeps deep; the tile order's 8 rows side by side
 * are 8 streams a row apart that leave the prefetchers behind (the lm_head
 * 1.1-1.2x, FP8 expert matrices up to 1.45x faster, docs/benchmarks.md). */
typedef struct kc_mm_rows {
	enum kb_dtype dt;    /* KB_BF16 or KB_F8_E4M3 */
	const float *x;      /* [K] per product, permuted as kc_mm_kernels.xperm(dt, block, 1) says */
	const void *w;       /* W[0][0]; row n at w + n * K elements */
	int64_t K;
	/* FP8: scale [ceil(per_item / block)][scale_stride] per product, block
	 * edge (a multiple of the x group), and xs, K floats of scratch: x times
	 * one scale block row's scales, rebuilt whenever n enters another block
	 * row or product */
	const float *scale;
	int64_t scale_stride, block;
	float *xs;
	float *y;            /* y[0] of the first product; y[n] is written */
	int store;           /* 1: y = sum, 0: y += sum */
	/* Several products back to back (kb_matmul_args.batch with the W
	 * matrices contiguous): row n belongs to product i = n / per_item, which
	 * takes its x at x + i * K, its y at y + i * y_bstride and its scales at
	 * scale + i * s_bstride.  One product: per_item = its N. */
	int64_t per_item, y_bstride, s_bstride;
	int64_t n0, n1;      /* the rows of this call, counted over all products */
	int64_t pf_bytes;    /* software prefetch distance ... */
	const char *pf_end;  /* ... never at or past this byte (end of the share) */
} kc_mm_rows;

/* Bytes ahead of the read position that kc_mm_rows_prefetch asks to move
 * from L2 into L1. */
#define KC_MM_ROWS_PF_NEAR 4096

/* The row kernels call it once per 64 bytes they read, at p.  Two requests
 * while the line pf_bytes on is inside the share (before pf_end): that line
 * into L2 (prefetcht2), and the one KC_MM_ROWS_PF_NEAR on, which the first
 * request brought into L2 a while ago, into L1 (prefetcht0).  On the Zen 5
 * host of 2026-12-04 the hardware prefetchers alone streamed a row at less
 * than half the rate; with the L2 request only, every row load still waited
 * on an L1 miss.  V3-shaped FP8 decode, one process alternating the two
 * forms step by step: 1.06-1.13x native, 1.02-1.04x on AVX2
 * (docs/benchmarks.md, "2026-12-04"). */
static inline void kc_mm_rows_prefetch(const kc_mm_rows *t, const char *pf_end, const char *p)
{
	if (p + t->pf_bytes < pf_end) {
		__builtin_prefetch(p + t->pf_bytes, 0, 1);
		__builtin_prefetch(p + KC_MM_ROWS_PF_NEAR, 0, 3);
	}
}

/* The longest rows that take kc_mm_kernels.rows (and the floats of xs a
 * thread keeps on its stack): x, up to 24 KiB, stays in the 32 KiB L1 beside
 * the streamed rows.  With K = 7168 (DeepSeek-V3's hidden size) x is
 * re-read from L2 for every row and the tile order, which holds a 4 KiB
 * chunk of x, was 1.2-1.7x faster (2048 x 7168 FP8, 2 threads, this
 * session: tiles 28-30 GB/s, rows 19-22 on AVX-512; even on AVX2); at
 * K = 5632 (the benchmark model's dense down projection) the rows were
 * 14% faster on AVX-512 and 25% on AVX2 (same process, alternating). */
#define KC_MM_ROWS_MAXK 6144

#define KC_MM_ACC_R 16                          /* floats per (m, r) slot */
#define KC_MM_ACC_M (KC_MM_NR_MAX * KC_MM_ACC_R) /* floats per x row */
#define KC_MM_ACC_TILE (KC_MM_MR_MAX * KC_MM_ACC_M)

typedef struct kc_mm_kernels {
	int mr_max;  /* x rows per tile (<= KC_MM_MR_MAX) */
	int nr;      /* W rows per panel when M > 1 */
	int nr_m1;   /* W rows per panel when M <= m_wide */
	int m_wide;  /* largest M whose tiles take nr_m1 rows (registers allowing) */
	/* One tile over one K chunk; any mr <= mr_max, any nr <= KC_MM_NR_MAX. */
	void (*tile)(const kc_mm_tile *t);
	/* Dequantizes t->nr rows x t->nk of t->w (dtype t->dt, FP8 scaled) into
	 * dst, row r at dst + r * ld. */
	void (*pack)(float *dst, int64_t ld, const kc_mm_tile *t);
	/* Decode only: elements per x group the tile wants permuted for dtype
	 * dt, FP8 block and M x rows (kc_mm_permute_x), or 0 for x in natural
	 * order.
	 * The permutation lets a kernel widen 16-bit and 8-bit weights inside
	 * 32-bit lanes (shifts and masks) instead of with lane-crossing widening
	 * moves, which cost the AVX-512 decode a quarter to a third of its
	 * rate. */
	int (*xperm)(enum kb_dtype dt, int64_t block, int64_t M);
	/* kc_mm_permute_x's result, with the kernel's instruction set */
	void (*permute_x)(float *dst, const float *x, int64_t n, int g);
	/* Decode with one x row, whole contiguous rows (kc_mm_rows), for every
	 * dtype and block xperm gives a group for when M = 1; NULL: not offered. */
	void (*rows)(const kc_mm_rows *t);
} kc_mm_kernels;

/* dst = x with every whole group of g elements (g = 16 * P) reordered so
 * that phase j (0 <= j < P) of the group is dst[16 j + i] = x[P i + j],
 * i < 16: the x values that meet element j of each P-element lane slot of
 * the weights.  The tail (n % g elements) is copied as it is. */
static inline void kc_mm_permute_x(float *dst, const float *x, int64_t n, int g)
{
	const int P = g / 16;
	int64_t k = 0;
	for (; k + g <= n; k += g)
		for (int j = 0; j < P; j++)
			for (int i = 0; i < 16; i++)
				dst[k + 16 * j + i] = x[k + P * i + j];
	for (; k < n; k++)
		dst[k] = x[k];
}

const kc_mm_kernels *kc_mm_kernels_avx2(void);
const kc_mm_kernels *kc_mm_kernels_avx512(void);

#endif

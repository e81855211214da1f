/*
 * attn_paged.c - grouped-query attention over the paged KV cache on AVX2 and
 * AVX-512 (kc_paged_attn's vector path; attn.c keeps the scalar one).
 *
 * One call attends every token of an engine step.  Tokens are read as runs:
 * consecutive tokens of one sequence at consecutive positions (a prefill
 * chunk) and single tokens (decode).  Work items, claimed by the pool's
 * threads in this order:
 *  - prefill tiles: VW consecutive tokens x the heads of one KV head
 *    (attn_paged_impl.h "tile"): each block of K/V rows is read once for
 *    all of them; the last tiles of a run see the most keys and go first;
 *  - decode groups: one token x the heads of one KV head (up to DEC_GMAX) x a
 *    stretch of SPLIT keys.  Each block of rows is first touched in address
 *    order (one sequential stream), then every head of the item reads it.
 *    Each stretch gives its unnormalised sum, max and normaliser, and a
 *    token's stretches are merged afterwards by log-sum-exp:
 *        M = max m_s,  L = sum l_s e^(m_s - M),  out = sum acc_s e^(m_s - M) / L.
 *    The stretches are fixed by position, not by the thread count or the
 *    batch, so a token's result does not depend on either.
 * So deep-context decode streams the cache on every thread, and the work per
 * key does not depend on depth (no per-page bookkeeping beyond a block
 * pointer per page).
 *
 * Rounding differs from the scalar path (another summation order), not the
 * arithmetic: tests/unit/test_paged_attn.c compares both with a double
 * precision reference on random inputs.
 */
#include "kernels/cpu/attn.h"
#include "kernels/cpu/attn_paged.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/vmath.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The same fold, in stretch order, whether one item ran every stretch or
 * each stretch was its own item: the bits do not depend on the split.  The
 * rows go 8 floats at a time (a fixed count the compiler vectorises: MLA
 * folds 512 floats a head; a multiply and an add per float, the same bits
 * as one at a time). */
void kc_attn_fold(float *restrict O, float *M, float *L, const float *restrict acc, const float *m, const float *l,
		  int64_t nh, int64_t hd)
{
	for (int64_t g = 0; g < nh; g++) {
		float mn = m[g] > M[g] ? m[g] : M[g];
		float c1 = expf(M[g] - mn), c2 = expf(m[g] - mn);
		float *restrict o = O + g * hd;
		const float *restrict x = acc + g * hd;
		int64_t d = 0;
		for (; d + 8 <= hd; d += 8)
			for (int i = 0; i < 8; i++)
				o[d + i] = o[d + i] * c1 + x[d + i] * c2;
		for (; d < hd; d++)
			o[d] = o[d] * c1 + x[d] * c2;
		L[g] = L[g] * c1 + l[g] * c2;
		M[g] = mn;
	}
}

static void fold_start(float *O, float *M, float *L, int64_t nh, int64_t hd)
{
	memset(O, 0, (size_t)(nh * hd) * sizeof *O);
	for (int64_t g = 0; g < nh; g++)
		M[g] = -INFINITY, L[g] = 0.0f;
}

#if defined(__x86_64__)
#include <immintrin.h>

#define DEC_GMAX 8      /* heads per call of the decode block kernel */
#define DEC_HDMAX 256   /* head_dim the vector path takes */
#define ITEM_FMAX 4096  /* head state floats (heads x head_dim) a decode item keeps on its stack */
#define TILE_FMAX 8192  /* tile: heads x head_dim x 16 lanes kept on the stack, per array */
#define TILE_HMAX 16
#define BLK 64          /* keys scored at a time (within one page) */
#define SPLIT 256       /* decode: keys per stretch (a multiple of BLK) */

typedef struct pitem {
	int64_t t;      /* decode: the token; tile: its first token */
	int64_t h;      /* tile: the first head (of one KV head) */
	int64_t kh0, kh1; /* decode: KV heads [kh0, kh1) */
	int64_t s0, s1; /* decode: stretches [s0, s1) */
	int64_t slot;   /* decode, split: the (token, stretch) slot it writes; -1: writes out */
	int32_t kind;   /* 0 decode, 1 tile */
	int32_t n;      /* tile: tokens */
	int32_t nh;     /* tile: heads */
} pitem;

typedef struct paged_ctx {
	const kb_paged_attn_args *a;
	const pitem *items;
	float *part; /* split decode: per (token, stretch) slot: acc [H][hd], m [H], l [H] */
	int64_t slot_floats;
	int wide;    /* 1: the AVX-512 bodies */
} paged_ctx;

/* Bytes of a cache element */
static int64_t cache_esize(const kb_paged_attn_args *a)
{
	return a->cache_type == KB_F16 ? 2 : 4;
}

/* Row of key j of token t's sequence (its first element, whatever the type) */
static const void *key_row(const kb_paged_attn_args *a, const int32_t *bt, int64_t j)
{
	const int64_t slot = (int64_t)bt[j / a->page_size] * a->page_size + j % a->page_size;
	return (const char *)a->cache + slot * a->row_stride * cache_esize(a);
}

/* ---- AVX-512 ---- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
/* out[0..3] = the sums of a, b, c, d: pairs interleaved, then quads, then
 * the four 128-bit lanes added (13 instructions for 4 sums instead of 4 x 8) */
__attribute__((always_inline)) static inline void hsum4_16(__m512 a, __m512 b, __m512 c, __m512 d, float *out)
{
	__m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
	__m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
	__m512 t = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
				 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
	/* t: each 128-bit lane holds a partial [a, b, c, d] */
	t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0x4E));
	t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0xB1));
	_mm_storeu_ps(out, _mm512_castps512_ps128(t));
}
#define VW 16
#define VNREG 32
#define VHSUM4(a, b, c, d, out) hsum4_16((a), (b), (c), (d), (out))
#define VF __m512
#define SFX(n) n##_avx512
#define VLOAD(p) _mm512_loadu_ps(p)
#define VLOADH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VSTORE(p, v) _mm512_storeu_ps((p), (v))
#define VSET1(x) _mm512_set1_ps(x)
#define VZERO() _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VSUB(a, b) _mm512_sub_ps((a), (b))
#define VMAX(a, b) _mm512_max_ps((a), (b))
#define VEXP(v) kc_exp16(v)
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define VHMAX(v) _mm512_reduce_max_ps(v)
/* a where pos >= j, b where pos < j */
#define VBLEND_LT(pos, j, a, b) \
	_mm512_mask_blend_ps(_mm512_cmp_ps_mask((pos), _mm512_set1_ps(j), _CMP_LT_OQ), (a), (b))
#include "kernels/cpu/attn_paged_impl.h" /* undefines the parameters */
#pragma GCC pop_options

/* ---- AVX2 ---- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
__attribute__((always_inline)) static inline float hmax8(__m256 v)
{
	__m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
	h = _mm_max_ps(h, _mm_movehl_ps(h, h));
	h = _mm_max_ss(h, _mm_movehdup_ps(h));
	return _mm_cvtss_f32(h);
}
__attribute__((always_inline)) static inline void hsum4_8(__m256 a, __m256 b, __m256 c, __m256 d, float *out)
{
	__m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
	_mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
#define VW 8
#define VNREG 16
#define VHSUM4(a, b, c, d, out) hsum4_8((a), (b), (c), (d), (out))
#define VF __m256
#define SFX(n) n##_avx2
#define VLOAD(p) _mm256_loadu_ps(p)
#define VLOADH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VSTORE(p, v) _mm256_storeu_ps((p), (v))
#define VSET1(x) _mm256_set1_ps(x)
#define VZERO() _mm256_setzero_ps()
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VSUB(a, b) _mm256_sub_ps((a), (b))
#define VMAX(a, b) _mm256_max_ps((a), (b))
#define VEXP(v) kc_exp8(v)
#define VHSUM(v) kc_hsum8(v)
#define VHMAX(v) hmax8(v)
#define VBLEND_LT(pos, j, a, b) \
	_mm256_blendv_ps((a), (b), _mm256_cmp_ps((pos), _mm256_set1_ps(j), _CMP_LT_OQ))
#include "kernels/cpu/attn_paged_impl.h" /* undefines the parameters */
#pragma GCC pop_options

static void fold_out(const kb_paged_attn_args *a, int64_t t, int64_t h0, const float *O, const float *L,
		     int64_t nh)
{
	const int64_t hd = a->head_dim;
	for (int64_t g = 0; g < nh; g++) {
		float *o = a->out + t * a->out_stride + (h0 + g) * hd, inv = 1.0f / L[g];
		for (int64_t d = 0; d < hd; d++)
			o[d] = O[g * hd + d] * inv;
	}
}

/* Keys of the block from jb: up to the next multiple of BLK, before j1.
 * Blocks follow positions, not pages, so the rescale points of the online
 * softmax (hence the rounding) do not depend on the page size. */
static int64_t block_keys(int64_t jb, int64_t j1)
{
	int64_t n = BLK - jb % BLK;
	return n < j1 - jb ? n : j1 - jb;
}

/* Reads one float of every cache line of the item's bytes [lo, hi) of n
 * rows, in address order: the rows of a block come in as one sequential
 * stream.  The kernels then read each row slice once per KV head (K, then
 * V), six strided passes over the block for SmolLM2; straight from memory
 * those kept few lines in flight, and software prefetches of the next block
 * (24 lines per row) did no better: measured single-threaded at depth 2048,
 * 0.30 of the read probe without this pass and 0.60 with it. */
static float touch_rows(const void *const *rows, int64_t n, int64_t lo, int64_t hi)
{
	/* four sums, so the adds do not chain the loads */
	float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
	for (int64_t i = 0; i < n; i++) {
		const char *r = rows[i];
		int64_t b = lo;
		for (; b + 192 < hi; b += 256) {
			s[0] += *(const float *)(r + b);
			s[1] += *(const float *)(r + b + 64);
			s[2] += *(const float *)(r + b + 128);
			s[3] += *(const float *)(r + b + 192);
		}
		for (; b < hi; b += 64)
			s[0] += *(const float *)(r + b);
	}
	return s[0] + s[1] + s[2] + s[3];
}

/* A decode item: token t, KV heads [kh0, kh1), stretches [s0, s1) in order.
 * Block by block the block's rows are touched in address order, then every
 * head of the range reads them. */
static void dec_item(const paged_ctx *x, const pitem *p)
{
	const kb_paged_attn_args *a = x->a;
	const int64_t hd = a->head_dim, G = a->n_heads / a->n_kv_heads, t = p->t;
	const int64_t h0 = p->kh0 * G, nh = (p->kh1 - p->kh0) * G, keys = a->tok_pos[t] + 1;
	const int32_t *bt = a->block_tables + (int64_t)a->tok_seq[t] * a->max_blocks;
	_Alignas(64) float q[ITEM_FMAX], acc[ITEM_FMAX], O[ITEM_FMAX];
	float m[ITEM_FMAX / 8], l[ITEM_FMAX / 8], M[ITEM_FMAX / 8], L[ITEM_FMAX / 8];
	volatile float sink = 0.0f;
	for (int64_t g = 0; g < nh; g++) {
		const float *qs = a->q + t * a->q_stride + (h0 + g) * hd;
		for (int64_t d = 0; d < hd; d++)
			q[g * hd + d] = qs[d] * a->scale;
	}
	/* the floats of a row this item reads: its heads' K and V slices and what lies between */
	const int64_t klo = a->k_off + p->kh0 * hd, khi = a->k_off + p->kh1 * hd;
	const int64_t vlo = a->v_off + p->kh0 * hd, vhi = a->v_off + p->kh1 * hd;
	const int64_t lo = klo < vlo ? klo : vlo, hi = khi > vhi ? khi : vhi;
	/* an F16 cache's rows are read as halves by the kernels */
	const int f16 = a->cache_type == KB_F16;
	const int64_t es = cache_esize(a);
	fold_start(O, M, L, nh, hd);
	for (int64_t s = p->s0; s < p->s1; s++) {
		const int64_t j0 = s * SPLIT, j1 = (s + 1) * SPLIT < keys ? (s + 1) * SPLIT : keys;
		fold_start(acc, m, l, nh, hd);
		for (int64_t jb = j0; jb < j1;) {
			const int64_t n = block_keys(jb, j1);
			const void *rows[BLK];
			for (int64_t i = 0; i < n; i++)
				rows[i] = key_row(a, bt, jb + i);
			sink += touch_rows(rows, n, es * lo, es * hi);
			for (int64_t kh = p->kh0; kh < p->kh1; kh++)
				for (int64_t g0 = 0; g0 < G; g0 += DEC_GMAX) {
					const int64_t gi = (kh - p->kh0) * G + g0;
					const int g = (int)(G - g0 < DEC_GMAX ? G - g0 : DEC_GMAX);
					if (x->wide)
						dec_block_avx512(g, f16, a, kh, q + gi * hd, rows, n, acc + gi * hd,
								 m + gi, l + gi);
					else
						dec_block_avx2(g, f16, a, kh, q + gi * hd, rows, n, acc + gi * hd,
							       m + gi, l + gi);
				}
			jb += n;
		}
		if (p->slot < 0) {
			kc_attn_fold(O, M, L, acc, m, l, nh, hd);
			continue;
		}
		float *sl = x->part + p->slot * x->slot_floats;
		const int64_t H = a->n_heads;
		memcpy(sl + h0 * hd, acc, (size_t)(nh * hd) * sizeof *acc);
		memcpy(sl + H * hd + h0, m, (size_t)nh * sizeof *m);
		memcpy(sl + H * hd + H + h0, l, (size_t)nh * sizeof *l);
	}
	if (p->slot < 0)
		fold_out(a, t, h0, O, L, nh);
}

static void run_items(void *vctx, int64_t begin, int64_t end)
{
	const paged_ctx *x = vctx;
	for (int64_t it = begin; it < end; it++) {
		const pitem *p = &x->items[it];
		if (p->kind == 0)
			dec_item(x, p);
		else if (x->wide)
			tile_avx512(x, p->t, p->n, p->h, p->nh);
		else
			tile_avx2(x, p->t, p->n, p->h, p->nh);
	}
}

/* Split decode: token t's stretches, slots base .. base + ns - 1, folded in order */
static void fold_slots(const paged_ctx *x, int64_t t, int64_t base, int64_t ns)
{
	const kb_paged_attn_args *a = x->a;
	const int64_t hd = a->head_dim, H = a->n_heads;
	const int64_t per = ITEM_FMAX / hd < H ? ITEM_FMAX / hd : H; /* heads per pass */
	_Alignas(64) float O[ITEM_FMAX];
	float M[ITEM_FMAX / 8], L[ITEM_FMAX / 8];
	for (int64_t h0 = 0; h0 < H; h0 += per) {
		const int64_t nh = H - h0 < per ? H - h0 : per;
		fold_start(O, M, L, nh, hd);
		for (int64_t s = 0; s < ns; s++) {
			const float *sl = x->part + (base + s) * x->slot_floats;
			kc_attn_fold(O, M, L, sl + h0 * hd, sl + H * hd + h0, sl + H * hd + H + h0, nh, hd);
		}
		fold_out(a, t, h0, O, L, nh);
	}
}

static int64_t run_end(const kb_paged_attn_args *a, int64_t t)
{
	int64_t e = t + 1;
	while (e < a->n_tok && a->tok_seq[e] == a->tok_seq[t] && a->tok_pos[e] == a->tok_pos[e - 1] + 1)
		e++;
	return e;
}

int kc_paged_attn_simd(const kb_paged_attn_args *a, enum kc_isa isa)
{
	const int64_t hd = a->head_dim, H = a->n_heads, KV = a->n_kv_heads, G = H / KV;
	const int wide = isa >= KC_ISA_AVX512 && hd % 16 == 0;
	const int64_t vw = wide ? 16 : 8;
	if (isa < KC_ISA_AVX2 || hd % 8 != 0 || hd > DEC_HDMAX || G * hd > ITEM_FMAX)
		return DS_EUNSUPPORTED;
	const int64_t threads = kc_pool_threads() > 0 ? kc_pool_threads() : 1;
	const int64_t kv_per = ITEM_FMAX / (G * hd) < KV ? ITEM_FMAX / (G * hd) : KV; /* KV heads an item can hold */
	int64_t n_dec = 0, n_tiles = 0, n_stretch = 0;
	for (int64_t t = 0, e; t < a->n_tok; t = e) {
		e = run_end(a, t);
		if (e - t == 1) {
			n_dec++;
			n_stretch += (a->tok_pos[t] + SPLIT) / SPLIT;
		} else {
			n_tiles += (e - t + vw - 1) / vw;
		}
	}
	/* decode: one item per token (every stretch, as many KV heads as fit)
	 * when that gives each thread two; else one per stretch, and per KV
	 * head too when even that is short; the result is the same */
	const int split = n_dec > 0 && n_dec * ((KV + kv_per - 1) / kv_per) < 2 * threads;
	const int64_t kv_item = split && n_stretch * ((KV + kv_per - 1) / kv_per) < 2 * threads ? 1 : kv_per;
	const int64_t kv_items = (KV + kv_item - 1) / kv_item;
	/* tile: heads of one KV head per item, as many as the stack arrays hold */
	int64_t tile_h = TILE_FMAX / (hd * 16) < TILE_HMAX ? TILE_FMAX / (hd * 16) : TILE_HMAX;
	tile_h = tile_h < G ? tile_h : G;
	const int64_t max_items = n_tiles * KV * ((G + tile_h - 1) / tile_h) + (split ? n_stretch : n_dec) * kv_items;
	const int64_t slot_floats = H * (hd + 2);
	pitem *items = malloc((size_t)(max_items > 0 ? max_items : 1) * sizeof *items);
	float *part = split ? malloc((size_t)n_stretch * (size_t)slot_floats * sizeof *part) : NULL;
	if (!items || (split && !part)) {
		free(items);
		free(part);
		return DS_ENOMEM;
	}
	int64_t ni = 0, slots = 0;
	/* tiles first, the last tile of each run (most keys) first */
	for (int64_t t = 0, e; t < a->n_tok; t = e) {
		e = run_end(a, t);
		if (e - t > 1)
			for (int64_t t0 = t + (e - t - 1) / vw * vw; t0 >= t; t0 -= vw)
				for (int64_t kh = 0; kh < KV; kh++)
					for (int64_t h = kh * G; h < (kh + 1) * G; h += tile_h)
						items[ni++] = (pitem){
							.t = t0, .h = h, .kind = 1,
							.n = (int32_t)(e - t0 < vw ? e - t0 : vw),
							.nh = (int32_t)((kh + 1) * G - h < tile_h ? (kh + 1) * G - h : tile_h)};
	}
	for (int64_t t = 0, e; t < a->n_tok; t = e) {
		e = run_end(a, t);
		if (e - t > 1)
			continue;
		const int64_t ns = (a->tok_pos[t] + SPLIT) / SPLIT;
		for (int64_t s = 0; s < (split ? ns : 1); s++)
			for (int64_t kh = 0; kh < KV; kh += kv_item)
				items[ni++] = (pitem){.t = t, .kh0 = kh, .kh1 = kh + kv_item < KV ? kh + kv_item : KV,
						      .s0 = split ? s : 0, .s1 = split ? s + 1 : ns,
						      .slot = split ? slots + s : -1, .kind = 0};
		slots += split ? ns : 0;
	}
	paged_ctx x = {.a = a, .items = items, .part = part, .slot_floats = slot_floats, .wide = wide};
	kc_parallel_for(ni, 1, run_items, &x);
	if (split)
		for (int64_t t = 0, e, base = 0; t < a->n_tok; t = e) {
			e = run_end(a, t);
			if (e - t > 1)
				continue;
			const int64_t ns = (a->tok_pos[t] + SPLIT) / SPLIT;
			fold_slots(&x, t, base, ns);
			base += ns;
		}
	free(items);
	free(part);
	return DS_OK;
}
#else
int kc_paged_attn_simd(const kb_paged_attn_args *a, enum kc_isa isa)
{
	(void)a, (void)isa;
	return DS_EUNSUPPORTED;
}
#endif

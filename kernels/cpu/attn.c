/*
 * attn.c - attention kernels on the CPU: MLA absorbed over a paged cache, and
 * plain multi-head / grouped-query attention over materialised K/V.
 *
 * Both use an online (running max) softmax, so they need no scratch memory
 * beyond a chunk of scores on the stack: with running max m, normaliser l
 * and accumulator acc, for each key j
 *     m' = max(m, s_j); acc = acc * e^(m - m') + e^(s_j - m') * V_j; l likewise
 * and out = acc / l at the end (the paged kernels take the max over a chunk
 * of keys at once).  The scalar paths split work over (token, head) pairs
 * with the CPU thread pool; each pair writes only its own output row.  The
 * SIMD MLA paths split it over (token, stretch of MLA_SPLIT keys, heads):
 * items that read the cache rows once for all their heads, and a token's
 * stretches merged by log-sum-exp afterwards (attn_mla.h).  The dot
 * products and accumulations use AVX2 or AVX-512 when kc_isa_active() allows
 * (f32 throughout; the scalar loops are the same arithmetic in another order).
 * Called through the CPU backend (backend_cpu.c).
 */
#include "kernels/cpu/attn.h"
#include "kernels/cpu/attn_mla.h"
#include "kernels/cpu/attn_paged.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/vmath.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* The two inner loops, per instruction set: dot products and acc = acc*c + w*v.
 * Chosen once per op call from kc_isa_active(). */
typedef struct vec_ops {
	float (*dot)(const float *a, const float *b, int64_t n);
	void (*scale_add)(float *acc, float c, float w, const float *v, int64_t n);
	/* x[i] = exp(x[i] - m) for i < n; returns the sum of the results */
	float (*exp_sub)(float *x, float m, int64_t n);
	/* sc[i] (+)= scale * q . (rows[i] + off)[0..dim), i < n */
	void (*scores)(float *sc, const float *q, const float *const *rows, int64_t off, int64_t n,
		       int64_t dim, float scale, int accumulate);
	/* out[0..dim) += sum_i w[i] * (rows[i] + off)[0..dim) */
	void (*wsum)(float *out, const float *w, const float *const *rows, int64_t off, int64_t n,
		     int64_t dim);
} vec_ops;

static void scores_scalar(float *sc, const float *q, const float *const *rows, int64_t off, int64_t n,
			  int64_t dim, float scale, int accumulate)
{
	for (int64_t i = 0; i < n; i++) {
		float d = 0.0f;
		for (int64_t k = 0; k < dim; k++)
			d += q[k] * rows[i][off + k];
		sc[i] = (accumulate ? sc[i] : 0.0f) + scale * d;
	}
}

static void wsum_scalar(float *out, const float *w, const float *const *rows, int64_t off, int64_t n,
			int64_t dim)
{
	for (int64_t i = 0; i < n; i++)
		for (int64_t k = 0; k < dim; k++)
			out[k] += w[i] * rows[i][off + k];
}

static float exp_sub_scalar(float *x, float m, int64_t n)
{
	float s = 0.0f;
	for (int64_t i = 0; i < n; i++)
		s += (x[i] = expf(x[i] - m));
	return s;
}

static float dot_scalar(const float *a, const float *b, int64_t n)
{
	float s = 0.0f;
	for (int64_t i = 0; i < n; i++)
		s += a[i] * b[i];
	return s;
}

static void scale_add_scalar(float *acc, float c, float w, const float *v, int64_t n)
{
	for (int64_t i = 0; i < n; i++)
		acc[i] = acc[i] * c + w * v[i];
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static float dot_avx2(const float *a, const float *b, int64_t n)
{
	__m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
	int64_t i = 0;
	for (; i + 16 <= n; i += 16) {
		s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
		s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
	}
	for (; i + 8 <= n; i += 8)
		s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
	s0 = _mm256_add_ps(s0, s1);
	__m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
	h = _mm_add_ps(h, _mm_movehl_ps(h, h));
	h = _mm_add_ss(h, _mm_movehdup_ps(h));
	float s = _mm_cvtss_f32(h);
	for (; i < n; i++)
		s += a[i] * b[i];
	return s;
}

__attribute__((target("avx2,fma"))) static void scale_add_avx2(float *acc, float c, float w,
							       const float *v, int64_t n)
{
	const __m256 vc = _mm256_set1_ps(c), vw = _mm256_set1_ps(w);
	int64_t i = 0;
	for (; i + 8 <= n; i += 8)
		_mm256_storeu_ps(acc + i, _mm256_fmadd_ps(_mm256_loadu_ps(acc + i), vc,
							  _mm256_mul_ps(vw, _mm256_loadu_ps(v + i))));
	for (; i < n; i++)
		acc[i] = acc[i] * c + w * v[i];
}

__attribute__((target("avx2,fma"))) static float exp_sub_avx2(float *x, float m, int64_t n)
{
	const __m256 vm = _mm256_set1_ps(m);
	__m256 acc = _mm256_setzero_ps();
	int64_t i = 0;
	for (; i + 8 <= n; i += 8) {
		__m256 e = kc_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
		_mm256_storeu_ps(x + i, e);
		acc = _mm256_add_ps(acc, e);
	}
	__m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
	h = _mm_add_ps(h, _mm_movehl_ps(h, h));
	h = _mm_add_ss(h, _mm_movehdup_ps(h));
	float s = _mm_cvtss_f32(h);
	for (; i < n; i++)
		s += (x[i] = expf(x[i] - m));
	return s;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static float
exp_sub_avx512(float *x, float m, int64_t n)
{
	const __m512 vm = _mm512_set1_ps(m);
	__m512 acc = _mm512_setzero_ps();
	for (int64_t i = 0; i < n; i += 16) {
		__mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (unsigned)(n - i)) - 1u);
		__m512 e = kc_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm));
		_mm512_mask_storeu_ps(x + i, k, e);
		acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
	}
	return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static float
dot_avx512(const float *a, const float *b, int64_t n)
{
	__m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
	int64_t i = 0;
	for (; i + 32 <= n; i += 32) {
		s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
		s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
	}
	for (; i < n; i += 16) {
		__mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (unsigned)(n - i)) - 1u);
		s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s0);
	}
	return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void
scale_add_avx512(float *acc, float c, float w, const float *v, int64_t n)
{
	const __m512 vc = _mm512_set1_ps(c), vw = _mm512_set1_ps(w);
	for (int64_t i = 0; i < n; i += 16) {
		__mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (unsigned)(n - i)) - 1u);
		__m512 r = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, acc + i), vc,
					   _mm512_mul_ps(vw, _mm512_maskz_loadu_ps(m, v + i)));
		_mm512_mask_storeu_ps(acc + i, m, r);
	}
}
#endif

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void scores_avx2(float *sc, const float *q,
							    const float *const *rows, int64_t off,
							    int64_t n, int64_t dim, float scale,
							    int accumulate)
{
	for (int64_t i = 0; i < n; i++) {
		float d = dot_avx2(q, rows[i] + off, dim);
		sc[i] = (accumulate ? sc[i] : 0.0f) + scale * d;
	}
}

__attribute__((target("avx2,fma"))) static void wsum_avx2(float *out, const float *w,
							  const float *const *rows, int64_t off,
							  int64_t n, int64_t dim)
{
	int64_t d = 0;
	for (; d + 32 <= dim; d += 32) {
		__m256 a0 = _mm256_loadu_ps(out + d), a1 = _mm256_loadu_ps(out + d + 8);
		__m256 a2 = _mm256_loadu_ps(out + d + 16), a3 = _mm256_loadu_ps(out + d + 24);
		for (int64_t i = 0; i < n; i++) {
			const float *r = rows[i] + off + d;
			__m256 wi = _mm256_set1_ps(w[i]);
			a0 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(r), a0);
			a1 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(r + 8), a1);
			a2 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(r + 16), a2);
			a3 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(r + 24), a3);
		}
		_mm256_storeu_ps(out + d, a0);
		_mm256_storeu_ps(out + d + 8, a1);
		_mm256_storeu_ps(out + d + 16, a2);
		_mm256_storeu_ps(out + d + 24, a3);
	}
	for (; d < dim; d++)
		for (int64_t i = 0; i < n; i++)
			out[d] += w[i] * rows[i][off + d];
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void
scores_avx512(float *sc, const float *q, const float *const *rows, int64_t off, int64_t n, int64_t dim,
	      float scale, int accumulate)
{
	for (int64_t i = 0; i < n; i++) {
		float d = dot_avx512(q, rows[i] + off, dim);
		sc[i] = (accumulate ? sc[i] : 0.0f) + scale * d;
	}
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void
wsum_avx512(float *out, const float *w, const float *const *rows, int64_t off, int64_t n, int64_t dim)
{
	for (int64_t d = 0; d < dim; d += 64) { /* 4 accumulators stay in registers over the keys */
		__mmask16 k[4];
		__m512 a[4];
		for (int j = 0; j < 4; j++) {
			int64_t left = dim - d - 16 * j;
			k[j] = left >= 16 ? (__mmask16)0xffff
			       : left > 0  ? (__mmask16)((1u << (unsigned)left) - 1u)
					   : (__mmask16)0;
			a[j] = _mm512_maskz_loadu_ps(k[j], out + d + 16 * j);
		}
		for (int64_t i = 0; i < n; i++) {
			const float *r = rows[i] + off + d;
			__m512 wi = _mm512_set1_ps(w[i]);
			for (int j = 0; j < 4; j++)
				a[j] = _mm512_fmadd_ps(wi, _mm512_maskz_loadu_ps(k[j], r + 16 * j), a[j]);
		}
		for (int j = 0; j < 4; j++)
			_mm512_mask_storeu_ps(out + d + 16 * j, k[j], a[j]);
	}
}
#endif

static vec_ops pick_ops(void)
{
	vec_ops o = {dot_scalar, scale_add_scalar, exp_sub_scalar, scores_scalar, wsum_scalar};
#if defined(__x86_64__)
	enum kc_isa isa = kc_isa_active();
	if (isa >= KC_ISA_AVX512)
		o = (vec_ops){dot_avx512, scale_add_avx512, exp_sub_avx512, scores_avx512, wsum_avx512};
	else if (isa >= KC_ISA_AVX2)
		o = (vec_ops){dot_avx2, scale_add_avx2, exp_sub_avx2, scores_avx2, wsum_avx2};
#endif
	return o;
}

/* Keys are scored ATT_CHUNK at a time: one exp per key, and the running max
 * (and the sum under it) is rescaled once per chunk instead of once per key. */
#define ATT_CHUNK 128

typedef struct mla_job {
	const kb_mla_attn_args *a;
	vec_ops v;
} mla_job;

typedef struct paged_job {
	const kb_paged_attn_args *a;
	vec_ops v;
	int oom; /* an F16 chunk buffer could not be allocated */
} paged_job;

typedef struct attn_job {
	const kb_attn_args *a;
	vec_ops v;
} attn_job;

/* Cache row pointers of positions j0 .. j0 + n - 1 of token t. */
static void mla_rows(const kb_mla_attn_args *a, int64_t t, int64_t j0, int64_t n, const float **rows)
{
	const int32_t *bt = a->block_tables + (int64_t)a->tok_seq[t] * a->max_blocks;
	for (int64_t i = 0; i < n; i++) {
		int64_t j = j0 + i;
		int64_t slot = (int64_t)bt[j / a->page_size] * a->page_size + j % a->page_size;
		rows[i] = a->cache + slot * a->row_stride;
	}
}

#if defined(__x86_64__)
/* ---- AVX-512: MLA for a group of up to MLA_G heads of one token ----
 * Every head reads the same latent rows, so a group's heads share each row
 * load: while a chunk of MLA_CHUNK rows (MLA_CHUNK * row_stride floats, in
 * L2) is scored and summed, each row comes from memory once for the group
 * instead of once per head.  Per head the arithmetic does not depend on the
 * group size (one lane accumulator per (head, row) over the row's 16-float
 * slices, lora part then rope part; the weighted sum in row order), so the
 * result does not depend on how heads are grouped, hence not on the thread
 * count or the batch either. */
#define MLA_G MLA_GROUP_MAX
/* Rows ahead that mla_scores_rows asks for, into L2 (prefetcht2): when the
 * cache rows come from memory, 8 rows (18 KiB) ahead into L2 scored a cold
 * layer up to a quarter faster than 4 rows into L1, whose miss buffers the
 * 36 lines of each row fill up (docs/benchmarks.md). */
#define MLA_PF 8
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define MLA_INL AVX512 __attribute__((always_inline)) static inline

MLA_INL __mmask16 tail_mask(int64_t left)
{
	return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (unsigned)left) - 1u);
}

/* acc[r][g] += lanes of q[g][0..len) * rows[i + r][off..off+len), prefetching
 * the same stretch of the rows pf0 and pf1 (NULL: none). */
MLA_INL void mla_dot_part(const int G, const int R, __m512 acc[2][MLA_G], const float *const *q,
			  const float *const *rows, int64_t i, int64_t off, int64_t len, const char *pf0,
			  const char *pf1)
{
	for (int64_t k = 0; k < len; k += 16) {
		__mmask16 m = tail_mask(len - k);
		__m512 c[2];
		if (pf0)
			_mm_prefetch(pf0 + (off + k) * 4, _MM_HINT_T2);
		if (pf1)
			_mm_prefetch(pf1 + (off + k) * 4, _MM_HINT_T2);
#pragma GCC unroll 2
		for (int r = 0; r < R; r++)
			c[r] = _mm512_maskz_loadu_ps(m, rows[i + r] + off + k);
#pragma GCC unroll 8
		for (int g = 0; g < G; g++) {
			__m512 qv = _mm512_maskz_loadu_ps(m, q[g] + k);
#pragma GCC unroll 2
			for (int r = 0; r < R; r++)
				acc[r][g] = _mm512_fmadd_ps(qv, c[r], acc[r][g]);
		}
	}
}

/* sc[g][i] = scale * (ql[g] . rows[i][0..lora) + qp[g] . rows[i][lora..lora+rope)),
 * R rows at a time; rows[0..npf) are known (the chunk's and a few of the
 * next chunk's, for the prefetch). */
MLA_INL void mla_scores_rows(const int G, const int R, float sc[][MLA_CHUNK], const float *const *ql,
			     const float *const *qp, const float *const *rows, int64_t i, int64_t npf,
			     int64_t lora, int64_t rope, float scale)
{
	/* the cache rows come from memory (the weights of a whole step passed
	 * through the caches since they were written): the rows MLA_PF on are
	 * asked for line by line while these are scored */
	const char *pf0 = i + MLA_PF < npf ? (const char *)rows[i + MLA_PF] : NULL;
	const char *pf1 = i + MLA_PF + 1 < npf ? (const char *)rows[i + MLA_PF + 1] : NULL;
	__m512 acc[2][MLA_G];
#pragma GCC unroll 8
	for (int g = 0; g < G; g++)
#pragma GCC unroll 2
		for (int r = 0; r < R; r++)
			acc[r][g] = _mm512_setzero_ps();
	mla_dot_part(G, R, acc, ql, rows, i, 0, lora, pf0, pf1);
	mla_dot_part(G, R, acc, qp, rows, i, lora, rope, pf0, pf1);
#pragma GCC unroll 8
	for (int g = 0; g < G; g++)
#pragma GCC unroll 2
		for (int r = 0; r < R; r++)
			sc[g][i + r] = scale * _mm512_reduce_add_ps(acc[r][g]);
}

/* out[g][0..lora) += sum_i w[g][i] * rows[i][0..lora), 32 floats of every
 * head's output in registers over the chunk's rows. */
MLA_INL void mla_wsum(const int G, float *const *out, float w[][MLA_CHUNK], const float *const *rows,
		      int64_t n, int64_t lora)
{
	for (int64_t d = 0; d < lora; d += 32) {
		const __mmask16 m0 = tail_mask(lora - d), m1 = lora - d > 16 ? tail_mask(lora - d - 16) : 0;
		__m512 a0[MLA_G], a1[MLA_G];
#pragma GCC unroll 8
		for (int g = 0; g < G; g++) {
			a0[g] = _mm512_maskz_loadu_ps(m0, out[g] + d);
			a1[g] = _mm512_maskz_loadu_ps(m1, out[g] + d + 16);
		}
		for (int64_t i = 0; i < n; i++) {
			__m512 c0 = _mm512_maskz_loadu_ps(m0, rows[i] + d);
			__m512 c1 = _mm512_maskz_loadu_ps(m1, rows[i] + d + 16);
#pragma GCC unroll 8
			for (int g = 0; g < G; g++) {
				__m512 wi = _mm512_set1_ps(w[g][i]);
				a0[g] = _mm512_fmadd_ps(wi, c0, a0[g]);
				a1[g] = _mm512_fmadd_ps(wi, c1, a1[g]);
			}
		}
#pragma GCC unroll 8
		for (int g = 0; g < G; g++) {
			_mm512_mask_storeu_ps(out[g] + d, m0, a0[g]);
			_mm512_mask_storeu_ps(out[g] + d + 16, m1, a1[g]);
		}
	}
}

/* One chunk of n rows for the group: scores, the online softmax, the
 * weighted sum.  Rows MLA_PF ahead, up to rows[npf - 1] (the next chunk's
 * first ones too), are asked for into L2 while the chunk is scored; npf = 0
 * for the groups after an item's first, which find the rows in L2. */
MLA_INL void mla_chunk_fixed(const int G, kc_mla_group *s, const kb_mla_attn_args *a, const float *const *rows,
			     int64_t n, int64_t npf)
{
	const int64_t lora = a->kv_lora, rope = a->rope_dim;
	_Alignas(64) float sc[MLA_G][MLA_CHUNK];
	int64_t i = 0;
	for (; i + 2 <= n; i += 2)
		mla_scores_rows(G, 2, sc, s->ql, s->qp, rows, i, npf, lora, rope, a->scale);
	if (i < n)
		mla_scores_rows(G, 1, sc, s->ql, s->qp, rows, i, npf, lora, rope, a->scale);
	for (int g = 0; g < G; g++) {
		float cmax = -INFINITY;
		for (i = 0; i < n; i++)
			cmax = sc[g][i] > cmax ? sc[g][i] : cmax;
		if (cmax > s->m[g]) { /* the running max grows: rescale what is summed */
			float c = expf(s->m[g] - cmax);
			scale_add_avx512(s->out[g], c, 0.0f, s->out[g], lora);
			s->l[g] *= c;
			s->m[g] = cmax;
		}
		s->l[g] += exp_sub_avx512(sc[g], s->m[g], n);
	}
	mla_wsum(G, s->out, sc, rows, n, lora);
}

/* kc_mla_chunk_fn on AVX-512 */
AVX512 static void mla_chunk_avx512(kc_mla_group *s, const kb_mla_attn_args *a, const float *const *rows, int64_t n,
				    int64_t npf)
{
	switch (s->G) {
	case 1: mla_chunk_fixed(1, s, a, rows, n, npf); break;
	case 2: mla_chunk_fixed(2, s, a, rows, n, npf); break;
	case 3: mla_chunk_fixed(3, s, a, rows, n, npf); break;
	case 4: mla_chunk_fixed(4, s, a, rows, n, npf); break;
	case 5: mla_chunk_fixed(5, s, a, rows, n, npf); break;
	case 6: mla_chunk_fixed(6, s, a, rows, n, npf); break;
	case 7: mla_chunk_fixed(7, s, a, rows, n, npf); break;
	default: mla_chunk_fixed(8, s, a, rows, n, npf); break;
	}
}

#endif

static void mla_range(void *ctx, int64_t begin, int64_t end)
{
	const kb_mla_attn_args *a = ((const mla_job *)ctx)->a;
	const vec_ops v = ((const mla_job *)ctx)->v;
	for (int64_t th = begin; th < end; th++) {
		int64_t t = th / a->n_heads, h = th % a->n_heads;
		const float *ql = a->q_lat + t * a->q_lat_stride + h * a->kv_lora;
		const float *qp = a->q_pe + t * a->q_pe_stride + h * a->rope_dim;
		float *out = a->out + t * a->out_stride + h * a->kv_lora;
		float m = -INFINITY, l = 0.0f, sc[ATT_CHUNK];
		const float *rows[ATT_CHUNK];
		memset(out, 0, (size_t)a->kv_lora * sizeof *out);
		for (int64_t j0 = 0; j0 <= a->tok_pos[t]; j0 += ATT_CHUNK) {
			int64_t n = a->tok_pos[t] + 1 - j0 < ATT_CHUNK ? a->tok_pos[t] + 1 - j0 : ATT_CHUNK;
			float cmax = -INFINITY;
			mla_rows(a, t, j0, n, rows);
			v.scores(sc, ql, rows, 0, n, a->kv_lora, a->scale, 0);
			v.scores(sc, qp, rows, a->kv_lora, n, a->rope_dim, a->scale, 1);
			for (int64_t i = 0; i < n; i++)
				cmax = sc[i] > cmax ? sc[i] : cmax;
			if (cmax > m) { /* the running max grows: rescale what is summed */
				float c = expf(m - cmax);
				v.scale_add(out, c, 0.0f, out, a->kv_lora);
				l *= c;
				m = cmax;
			}
			l += v.exp_sub(sc, m, n);
			v.wsum(out, sc, rows, 0, n, a->kv_lora);
		}
		float inv = 1.0f / l;
		for (int64_t i = 0; i < a->kv_lora; i++)
			out[i] *= inv;
	}
}

/* What an item runs: token t, heads [h0, h1), keys [j0, j1).  Head h0 + i
 * sums into out + i * kv_lora; when ml is not NULL (one stretch of a deep
 * token) the item leaves those sums unnormalised and writes the head's max
 * and normaliser to ml[2i], ml[2i + 1]. */
typedef struct mla_span {
	int64_t t, h0, h1, j0, j1;
	float *out, *ml;
} mla_span;

/* Points s at heads [h0, h0 + G) of sp's token, their output rows where sp
 * puts them, zeroed; max -inf, normaliser 0. */
static void group_start(kc_mla_group *s, const kb_mla_attn_args *a, const mla_span *sp, int64_t h0, int G)
{
	s->G = G;
	for (int g = 0; g < G; g++) {
		s->ql[g] = a->q_lat + sp->t * a->q_lat_stride + (h0 + g) * a->kv_lora;
		s->qp[g] = a->q_pe + sp->t * a->q_pe_stride + (h0 + g) * a->rope_dim;
		s->out[g] = sp->out + (h0 + g - sp->h0) * a->kv_lora;
		memset(s->out[g], 0, (size_t)a->kv_lora * sizeof(float));
		s->m[g] = -INFINITY;
		s->l[g] = 0.0f;
	}
}

/* out[0..lora) /= L */
static void mla_normalise(float *out, float L, int64_t lora)
{
	const float inv = 1.0f / L;
	for (int64_t d = 0; d < lora; d++)
		out[d] *= inv;
}

/* The end of sp's item, whose heads are the ng groups st: each head's
 * output divided by its normaliser, or its max and normaliser kept for the
 * fold. */
static void span_end(const mla_span *sp, const kc_mla_group *st, int ng, int64_t lora)
{
	for (int k = 0, i = 0; k < ng; k++)
		for (int g = 0; g < st[k].G; g++, i++) {
			if (sp->ml) {
				sp->ml[2 * i] = st[k].m[g];
				sp->ml[2 * i + 1] = st[k].l[g];
				continue;
			}
			mla_normalise(st[k].out[g], st[k].l[g], lora);
		}
}

/* How items cut heads, for n_units token-stretches (or tokens) and want
 * items in all.  *group: the heads that share each cache row load in
 * registers, the largest power-of-two fraction of gmax that still gives
 * want items.  *per_item: the heads of one item (whole groups, at most
 * MLA_ITEM_GROUPS of them), the fewest items per unit that still give
 * want. */
static void mla_items(int64_t n_units, int64_t n_heads, int64_t gmax, int64_t want, int64_t *group, int64_t *per_item)
{
	int64_t g = gmax;
	while (g > 1 && n_units * ((n_heads + g - 1) / g) < want)
		g /= 2;
	const int64_t groups = (n_heads + g - 1) / g;
	int64_t items = (want + n_units - 1) / n_units; /* per unit, so that there are want */
	items = items < groups ? items : groups;
	int64_t gpi = (groups + items - 1) / items;
	gpi = gpi < MLA_ITEM_GROUPS ? gpi : MLA_ITEM_GROUPS;
	*group = g;
	*per_item = gpi * g;
}

/* ---- the SIMD MLA paths' items (kc_mla_work_run, attn_mla.h) ----
 * Stretches of MLA_SPLIT keys are fixed by position.  When a step has
 * fewer tokens than threads and one of them is deeper than a stretch,
 * items are (token, stretch, heads) ("split"): the first stretch of a deep
 * token sums into out, the others into slots of part, with every
 * stretch's max and normaliser in ml, and a second pool pass folds them in
 * stretch order.  Otherwise items are (token, heads) and an item runs a
 * deep token's stretches in turn, the first into out, each later one into
 * the token's slot of part, folded into out at once: the same folds in
 * the same order, so the bits do not depend on which it was. */
typedef struct mla_work {
	const kb_mla_attn_args *a;
	kc_mla_chunk_fn fn;
	int64_t ahead;    /* rows past a chunk its first group is given */
	int split;
	int64_t group;    /* heads that share each row load */
	int64_t per_item; /* heads of an item (whole groups) */
	int64_t per_unit; /* items of a unit: a token-stretch when split, else a token */
	int64_t n_units, n_items;
	int64_t *u_tok, *u_j0, *u_slot; /* [n_units]: token, first key, slot (-1: none) */
	int64_t n_fold, *fold_tok, *fold_slot, *fold_ns; /* split: the deep tokens */
	float *part, *ml; /* [slot][n_heads][kv_lora] sums; split: [slot][n_heads][2] max, normaliser */
} mla_work;

static void work_free(mla_work *w)
{
	free(w->u_tok);
	free(w->fold_tok);
	free(w->part);
	free(w->ml);
}

static int64_t stretches(const kb_mla_attn_args *a, int64_t t)
{
	return (a->tok_pos[t] + MLA_SPLIT) / MLA_SPLIT;
}

/* DS_ENOMEM when the lists cannot be allocated. */
static int work_plan(mla_work *w, const kb_mla_attn_args *a, int64_t gmax)
{
	const int64_t threads = kc_pool_threads() > 0 ? kc_pool_threads() : 1;
	int64_t deep = 0, n_ts = 0;
	for (int64_t t = 0; t < a->n_tok; t++) {
		const int64_t ns = stretches(a, t);
		n_ts += ns;
		deep += ns > 1;
	}
	w->split = deep > 0 && a->n_tok < threads;
	w->n_units = w->split ? n_ts : a->n_tok;
	/* split: a deep token's last stretch is short, so two items a thread */
	mla_items(w->n_units, a->n_heads, gmax, w->split ? 2 * threads : threads, &w->group, &w->per_item);
	w->per_unit = (a->n_heads + w->per_item - 1) / w->per_item;
	w->n_items = w->n_units * w->per_unit;
	w->n_fold = w->split ? deep : 0;
	const int64_t slots = w->split ? n_ts - (a->n_tok - deep) : deep;
	const size_t nu = (size_t)w->n_units, nf = (size_t)(w->n_fold > 0 ? w->n_fold : 1);
	w->u_tok = malloc(3 * nu * sizeof(int64_t));
	w->fold_tok = malloc(3 * nf * sizeof(int64_t));
	if (slots)
		w->part = malloc((size_t)(slots * a->n_heads * a->kv_lora) * sizeof(float));
	if (slots && w->split)
		w->ml = malloc((size_t)(slots * a->n_heads * 2) * sizeof(float));
	if (!w->u_tok || !w->fold_tok || (slots && !w->part) || (slots && w->split && !w->ml)) {
		work_free(w);
		return DS_ENOMEM;
	}
	w->u_j0 = w->u_tok + nu;
	w->u_slot = w->u_j0 + nu;
	w->fold_slot = w->fold_tok + nf;
	w->fold_ns = w->fold_slot + nf;
	for (int64_t t = 0, u = 0, f = 0, slot = 0; t < a->n_tok; t++) {
		const int64_t ns = stretches(a, t);
		if (!w->split) {
			w->u_tok[u] = t;
			w->u_j0[u] = 0;
			w->u_slot[u++] = ns > 1 ? slot++ : -1;
			continue;
		}
		if (ns > 1) {
			w->fold_tok[f] = t;
			w->fold_slot[f] = slot;
			w->fold_ns[f++] = ns;
		}
		for (int64_t s = 0; s < ns; s++, u++) {
			w->u_tok[u] = t;
			w->u_j0[u] = s * MLA_SPLIT;
			w->u_slot[u] = ns > 1 ? slot++ : -1;
		}
	}
	return DS_OK;
}

/* sp's heads in groups of w->group, over its keys chunk by chunk: every
 * group works on a chunk before the next, so its rows come from memory for
 * the first group and from L2 for the others (with 128 heads, DeepSeek-V3's,
 * one pass over the cache per item instead of one per 8 heads).  Each
 * group's arithmetic is what it would be alone. */
static void mla_item(const mla_work *w, const mla_span *sp)
{
	const kb_mla_attn_args *a = w->a;
	kc_mla_group st[MLA_ITEM_GROUPS];
	int ng = 0;
	for (int64_t h = sp->h0; h < sp->h1; h += w->group)
		group_start(&st[ng++], a, sp, h, (int)(sp->h1 - h < w->group ? sp->h1 - h : w->group));
	const float *rows[MLA_CHUNK + 16];
	const int64_t keys = a->tok_pos[sp->t] + 1; /* the prefetch runs on into the next stretch */
	for (int64_t j0 = sp->j0; j0 < sp->j1; j0 += MLA_CHUNK) {
		const int64_t n = sp->j1 - j0 < MLA_CHUNK ? sp->j1 - j0 : MLA_CHUNK;
		const int64_t npf = keys - j0 < n + w->ahead ? keys - j0 : n + w->ahead;
		mla_rows(a, sp->t, j0, npf, rows);
		for (int k = 0; k < ng; k++)
			w->fn(&st[k], a, rows, n, k == 0 ? npf : 0);
	}
	span_end(sp, st, ng, a->kv_lora);
}

/* Item it: its span, and when it is a deep token's whole (not split), its
 * stretches in turn with the folds the split pass would make. */
static void work_item(const mla_work *w, int64_t it)
{
	const kb_mla_attn_args *a = w->a;
	const int64_t u = it / w->per_unit, H = a->n_heads, lora = a->kv_lora, slot = w->u_slot[u];
	const int64_t t = w->u_tok[u], keys = a->tok_pos[t] + 1;
	mla_span sp = {.t = t, .h0 = it % w->per_unit * w->per_item, .j0 = w->u_j0[u]};
	sp.h1 = H - sp.h0 < w->per_item ? H : sp.h0 + w->per_item;
	sp.j1 = keys - sp.j0 < MLA_SPLIT || !w->split ? keys : sp.j0 + MLA_SPLIT;
	/* a deep token's first stretch sums into out, the others into part */
	sp.out = slot < 0 || sp.j0 == 0 || !w->split ? a->out + t * a->out_stride + sp.h0 * lora
						      : w->part + (slot * H + sp.h0) * lora;
	sp.ml = slot < 0 || !w->split ? NULL : w->ml + (slot * H + sp.h0) * 2;
	if (w->split || slot < 0) {
		mla_item(w, &sp);
		return;
	}
	float ml[2 * MLA_ITEM_GROUPS * MLA_GROUP_MAX], M[MLA_ITEM_GROUPS * MLA_GROUP_MAX],
		L[MLA_ITEM_GROUPS * MLA_GROUP_MAX];
	const int64_t nh = sp.h1 - sp.h0;
	mla_span s = sp;
	s.j1 = MLA_SPLIT;
	s.ml = ml;
	mla_item(w, &s);
	for (int64_t i = 0; i < nh; i++)
		M[i] = ml[2 * i], L[i] = ml[2 * i + 1];
	s.out = w->part + (slot * H + sp.h0) * lora;
	for (s.j0 = MLA_SPLIT; s.j0 < keys; s.j0 += MLA_SPLIT) {
		s.j1 = keys - s.j0 < MLA_SPLIT ? keys : s.j0 + MLA_SPLIT;
		mla_item(w, &s);
		for (int64_t i = 0; i < nh; i++)
			kc_attn_fold(sp.out + i * lora, &M[i], &L[i], s.out + i * lora, &ml[2 * i], &ml[2 * i + 1], 1,
				     lora);
	}
	for (int64_t i = 0; i < nh; i++)
		mla_normalise(sp.out + i * lora, L[i], lora);
}

static void work_items(void *ctx, int64_t begin, int64_t end)
{
	for (int64_t it = begin; it < end; it++)
		work_item(ctx, it);
}

/* split: items = (deep token, head), the token's stretches folded in order
 * into the first one's sums (what folding that one into nothing gives,
 * exactly: its sums times e^0 = 1, plus 0 times e^-inf = 0) */
static void work_fold(void *ctx, int64_t begin, int64_t end)
{
	const mla_work *w = ctx;
	const kb_mla_attn_args *a = w->a;
	const int64_t H = a->n_heads, lora = a->kv_lora;
	for (int64_t it = begin; it < end; it++) {
		const int64_t f = it / H, h = it % H, s0 = w->fold_slot[f];
		float *out = a->out + w->fold_tok[f] * a->out_stride + h * lora;
		float M = w->ml[(s0 * H + h) * 2], L = w->ml[(s0 * H + h) * 2 + 1];
		for (int64_t s = s0 + 1; s < s0 + w->fold_ns[f]; s++) {
			const float *ml = w->ml + (s * H + h) * 2;
			kc_attn_fold(out, &M, &L, w->part + (s * H + h) * lora, ml, ml + 1, 1, lora);
		}
		mla_normalise(out, L, lora);
	}
}

int kc_mla_work_run(const kb_mla_attn_args *a, int64_t gmax, int64_t ahead, kc_mla_chunk_fn fn)
{
	mla_work w = {.a = a, .fn = fn, .ahead = ahead < 16 ? ahead : 16};
	int rc = work_plan(&w, a, gmax);
	if (rc)
		return rc;
	kc_parallel_for(w.n_items, 1, work_items, &w);
	if (w.n_fold)
		kc_parallel_for(w.n_fold * a->n_heads, 4, work_fold, &w);
	work_free(&w);
	return DS_OK;
}

int kc_mla_attn(const kb_mla_attn_args *a)
{
	if (a->n_tok < 0 || a->n_heads <= 0 || a->kv_lora <= 0 || a->rope_dim < 0 ||
	    a->page_size <= 0 || a->row_stride < a->kv_lora + a->rope_dim)
		return DS_EINVAL;
	if (a->n_tok == 0)
		return DS_OK;
#if defined(__x86_64__)
	if (kc_isa_active() >= KC_ISA_AVX512)
		return kc_mla_work_run(a, MLA_G, MLA_PF + 1, mla_chunk_avx512);
	if (kc_isa_active() >= KC_ISA_AVX2) {
		int rc = kc_mla_attn_avx2(a);
		if (rc != DS_EUNSUPPORTED)
			return rc;
	}
#endif
	mla_job job = {a, pick_ops()};
	kc_parallel_for(a->n_tok * a->n_heads, 1, mla_range, &job);
	return DS_OK;
}

static void attn_range(void *ctx, int64_t begin, int64_t end)
{
	const kb_attn_args *a = ((const attn_job *)ctx)->a;
	const vec_ops v = ((const attn_job *)ctx)->v;
	int64_t group = a->n_heads / a->n_kv_heads;
	for (int64_t th = begin; th < end; th++) {
		int64_t t = th / a->n_heads, h = th % a->n_heads, kh = h / group;
		const float *q = a->q + t * a->q_stride + h * a->dk;
		float *out = a->out + t * a->out_stride + h * a->dv;
		float m = -INFINITY, l = 0.0f;
		int64_t last = a->q_pos[t] < a->n_kv - 1 ? a->q_pos[t] : a->n_kv - 1;
		memset(out, 0, (size_t)a->dv * sizeof *out);
		for (int64_t j = 0; j <= last; j++) {
			float s = a->scale * v.dot(q, a->k + j * a->k_stride + kh * a->dk, a->dk);
			float mn = s > m ? s : m;
			float c = expf(m - mn), w = expf(s - mn);
			v.scale_add(out, c, w, a->v + j * a->v_stride + kh * a->dv, a->dv);
			l = l * c + w;
			m = mn;
		}
		float inv = l > 0.0f ? 1.0f / l : 0.0f;
		for (int64_t i = 0; i < a->dv; i++)
			out[i] *= inv;
	}
}

int kc_attn(const kb_attn_args *a)
{
	if (a->n_tok < 0 || a->n_kv < 0 || a->n_heads <= 0 || a->n_kv_heads <= 0 ||
	    a->n_heads % a->n_kv_heads != 0 || a->dk <= 0 || a->dv <= 0)
		return DS_EINVAL;
	attn_job job = {a, pick_ops()};
	kc_parallel_for(a->n_tok * a->n_heads, 1, attn_range, &job);
	return DS_OK;
}

/* An F16 cache row's K and V of KV head kh as f32: K at cvt, V at cvt + hd. */
static void paged_cvt(float *cvt, const kb_paged_attn_args *a, const uint16_t *r, int64_t kh)
{
	const int64_t hd = a->head_dim;
	for (int64_t d = 0; d < hd; d++) {
		cvt[d] = kc_f16_to_f32(r[a->k_off + kh * hd + d]);
		cvt[hd + d] = kc_f16_to_f32(r[a->v_off + kh * hd + d]);
	}
}

static void paged_range(void *ctx, int64_t begin, int64_t end)
{
	paged_job *job = ctx;
	const kb_paged_attn_args *a = job->a;
	const vec_ops v = job->v;
	const int64_t group = a->n_heads / a->n_kv_heads, hd = a->head_dim;
	const int f16 = a->cache_type == KB_F16;
	float *cvt = f16 ? malloc((size_t)(ATT_CHUNK * 2 * hd) * sizeof *cvt) : NULL;
	if (f16 && !cvt) {
		__atomic_store_n(&job->oom, 1, __ATOMIC_RELAXED);
		return;
	}
	for (int64_t th = begin; th < end; th++) {
		int64_t t = th / a->n_heads, h = th % a->n_heads, kh = h / group;
		const float *q = a->q + t * a->q_stride + h * hd;
		float *out = a->out + t * a->out_stride + h * hd;
		const int32_t *bt = a->block_tables + (int64_t)a->tok_seq[t] * a->max_blocks;
		float m = -INFINITY, l = 0.0f, sc[ATT_CHUNK];
		const float *rows[ATT_CHUNK];
		const int64_t koff = f16 ? 0 : a->k_off + kh * hd, voff = f16 ? hd : a->v_off + kh * hd;
		memset(out, 0, (size_t)hd * sizeof *out);
		for (int64_t j0 = 0; j0 <= a->tok_pos[t]; j0 += ATT_CHUNK) {
			int64_t n = a->tok_pos[t] + 1 - j0 < ATT_CHUNK ? a->tok_pos[t] + 1 - j0 : ATT_CHUNK;
			float cmax = -INFINITY;
			for (int64_t i = 0; i < n; i++) {
				int64_t j = j0 + i;
				int64_t slot = (int64_t)bt[j / a->page_size] * a->page_size + j % a->page_size;
				if (f16) { /* the chunk's rows converted, row i at cvt + 2 hd i */
					paged_cvt(cvt + i * 2 * hd, a, (const uint16_t *)a->cache + slot * a->row_stride, kh);
					rows[i] = cvt + i * 2 * hd;
				} else {
					rows[i] = (const float *)a->cache + slot * a->row_stride;
				}
			}
			v.scores(sc, q, rows, koff, n, hd, a->scale, 0);
			for (int64_t i = 0; i < n; i++)
				cmax = sc[i] > cmax ? sc[i] : cmax;
			if (cmax > m) {
				float c = expf(m - cmax);
				v.scale_add(out, c, 0.0f, out, hd);
				l *= c;
				m = cmax;
			}
			l += v.exp_sub(sc, m, n);
			v.wsum(out, sc, rows, voff, n, hd);
		}
		float inv = 1.0f / l;
		for (int64_t i = 0; i < hd; i++)
			out[i] *= inv;
	}
	free(cvt);
}

int kc_paged_attn(const kb_paged_attn_args *a)
{
	if (a->n_tok < 0 || a->n_heads <= 0 || a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads ||
	    a->head_dim <= 0 || a->page_size <= 0 || a->k_off < 0 || a->v_off < 0 ||
	    a->row_stride < a->k_off + a->n_kv_heads * a->head_dim ||
	    a->row_stride < a->v_off + a->n_kv_heads * a->head_dim ||
	    (a->cache_type != KB_F32 && a->cache_type != KB_F16))
		return DS_EINVAL;
	int rc = kc_paged_attn_simd(a, kc_isa_active());
	if (rc != DS_EUNSUPPORTED)
		return rc;
	paged_job job = {a, pick_ops(), 0};
	kc_parallel_for(a->n_tok * a->n_heads, 1, paged_range, &job);
	return job.oom ? DS_ENOMEM : DS_OK;
}

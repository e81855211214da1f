/*
 * attn_mla_avx2.c - absorbed MLA over the paged latent cache on AVX2: the
 * heads of a token in groups of up to 8 share each load of a cache row
 * (kc_mla_attn's AVX2 path; attn.c keeps the AVX-512 and scalar ones).
 *
 * Every head of MLA reads the same latent rows (kv_lora + rope floats per
 * position), so a per-head loop reads the whole cache once per head: 16
 * times per layer on the benchmark model, 128 on DeepSeek-V3.  Here a chunk
 * of MLA_CHUNK rows (in L2) is scored and summed for a group of heads at a
 * time, with the online softmax of attn.c (running max per head, rescaled
 * once per chunk).  AVX2 has 16 vector registers: the chunk is worked in
 * passes of 4 heads, 3 rows scored at a time and 3 vectors of every head's
 * output kept over the chunk's rows in the weighted sum, 12 FMA chains in
 * flight in both (see scores_fixed).
 * Items and their stretches of keys are kc_mla_work_run's (attn.c), as
 * on AVX-512.  Per head the arithmetic does not depend on the group size, and
 * the stretches are fixed by position, so the result does not depend on the
 * thread count.
 */
#include "kernels/cpu/attn_mla.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/vmath.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>

#define MLA_GMAX MLA_GROUP_MAX /* heads per group */
#define MLA_SUB 4  /* heads per pass over a chunk (two passes for 8) */
#define MLA_PF 8   /* rows ahead asked for into L2 */

#pragma GCC push_options
#pragma GCC target("avx2,fma")

/* acc[r][g] += lanes of q[g][0..len) * rows[i + r][off..off+len), each q
 * slice loaded once for the R rows; the same stretch of the rows pf[r]
 * (NULL: none) asked for into L2 one line per 16 floats, spread over the
 * loop.  Asked for all at once before the rows were scored, the 108 lines
 * of three rows waited in the miss buffers: a layer from memory took 30-40
 * us more than from cache, now 16-28 (docs/benchmarks.md). */
__attribute__((always_inline)) static inline void dot_part(const int G, const int R, __m256 acc[3][MLA_SUB],
							  const float *const *q, const float *const *rows, int64_t i,
							  int64_t off, int64_t len, const float *const *pf)
{
	for (int64_t d = 0; d < len; d += 8) {
		if ((d & 15) == 0)
#pragma GCC unroll 3
			for (int r = 0; r < R; r++)
				if (pf[r])
					_mm_prefetch((const char *)(pf[r] + off + d), _MM_HINT_T1);
		__m256 c[3];
#pragma GCC unroll 3
		for (int r = 0; r < R; r++)
			c[r] = _mm256_loadu_ps(rows[i + r] + off + d);
#pragma GCC unroll 4
		for (int g = 0; g < G; g++) {
			const __m256 qv = _mm256_loadu_ps(q[g] + d);
#pragma GCC unroll 3
			for (int r = 0; r < R; r++)
				acc[r][g] = _mm256_fmadd_ps(qv, c[r], acc[r][g]);
		}
	}
}

/* sc[g][i + r] = scale * (ql[g] . row_{i+r}[0..lora) + qp[g] . row_{i+r}[lora..lora+rope))
 * for R <= 3 rows and G <= MLA_SUB heads: one lane accumulator per head and
 * row (over the row's 8-float slices, lora part then rope part), each q
 * slice loaded once for the R rows.  4 heads x 3 rows keep 12 FMA chains in
 * flight; one row against 8 heads kept 8, exactly what hides the FMA
 * latency on paper, and ran at 2/3 of the AVX-512 path.  pf: rows MLA_PF on
 * (or NULL), asked for line by line as dot_part goes. */
__attribute__((always_inline)) static inline void scores_fixed(const int G, const int R, float sc[][MLA_CHUNK],
							      const float *const *ql, const float *const *qp,
							      const float *const *rows, int64_t i, const float *const *pf,
							      int64_t lora, int64_t rope, float scale)
{
	__m256 acc[3][MLA_SUB];
#pragma GCC unroll 4
	for (int g = 0; g < G; g++)
#pragma GCC unroll 3
		for (int r = 0; r < R; r++)
			acc[r][g] = _mm256_setzero_ps();
	dot_part(G, R, acc, ql, rows, i, 0, lora, pf);
	dot_part(G, R, acc, qp, rows, i, lora, rope, pf);
#pragma GCC unroll 4
	for (int g = 0; g < G; g++)
#pragma GCC unroll 3
		for (int r = 0; r < R; r++)
			sc[g][i + r] = scale * kc_hsum8(acc[r][g]);
}

/* The chunk's n rows scored for G heads, three rows at a time, asking for
 * the rows MLA_PF on, of npf known (0: none, the rows are in L2). */
__attribute__((always_inline)) static inline void chunk_scores(const int G, float sc[][MLA_CHUNK],
							      const float *const *ql, const float *const *qp,
							      const float *const *rows, int64_t n, int64_t npf,
							      int64_t lora, int64_t rope, float scale)
{
	int64_t i = 0;
	const float *pf[3];
	for (; i < n; i += 3) {
		for (int r = 0; r < 3; r++)
			pf[r] = i + r + MLA_PF < npf ? rows[i + r + MLA_PF] : NULL;
		if (i + 3 <= n)
			scores_fixed(G, 3, sc, ql, qp, rows, i, pf, lora, rope, scale);
		else if (i + 2 == n)
			scores_fixed(G, 2, sc, ql, qp, rows, i, pf, lora, rope, scale);
		else
			scores_fixed(G, 1, sc, ql, qp, rows, i, pf, lora, rope, scale);
	}
}

/* out[g][d..d+8CB) += sum_i w[g][i] * rows[i][d..d+8CB): CB vectors of every
 * head's output in registers over the chunk's rows (4 heads x 3 vectors: 12
 * FMA chains) */
__attribute__((always_inline)) static inline void wsum_fixed(const int G, const int CB, float *const *out,
							    float w[][MLA_CHUNK], const float *const *rows,
							    int64_t n, int64_t d)
{
	__m256 a[MLA_SUB][3];
#pragma GCC unroll 4
	for (int g = 0; g < G; g++)
#pragma GCC unroll 3
		for (int c = 0; c < CB; c++)
			a[g][c] = _mm256_loadu_ps(out[g] + d + 8 * c);
	for (int64_t i = 0; i < n; i++) {
		__m256 x[3];
#pragma GCC unroll 3
		for (int c = 0; c < CB; c++)
			x[c] = _mm256_loadu_ps(rows[i] + d + 8 * c);
#pragma GCC unroll 4
		for (int g = 0; g < G; g++) {
			__m256 wi = _mm256_set1_ps(w[g][i]);
#pragma GCC unroll 3
			for (int c = 0; c < CB; c++)
				a[g][c] = _mm256_fmadd_ps(wi, x[c], a[g][c]);
		}
	}
#pragma GCC unroll 4
	for (int g = 0; g < G; g++)
#pragma GCC unroll 3
		for (int c = 0; c < CB; c++)
			_mm256_storeu_ps(out[g] + d + 8 * c, a[g][c]);
}

__attribute__((always_inline)) static inline void chunk_wsum(const int G, float *const *out, float w[][MLA_CHUNK],
							    const float *const *rows, int64_t n, int64_t lora)
{
	int64_t d = 0;
	for (; d + 24 <= lora; d += 24)
		wsum_fixed(G, 3, out, w, rows, n, d);
	for (; d < lora; d += 8)
		wsum_fixed(G, 1, out, w, rows, n, d);
}

/* One pass of g <= MLA_SUB heads over a chunk: scores, or the weighted sum. */
static void sub_scores(int g, float sc[][MLA_CHUNK], const float *const *ql, const float *const *qp,
		       const float *const *rows, int64_t n, int64_t npf, int64_t lora, int64_t rope,
		       float scale)
{
	switch (g) {
	case 1: chunk_scores(1, sc, ql, qp, rows, n, npf, lora, rope, scale); break;
	case 2: chunk_scores(2, sc, ql, qp, rows, n, npf, lora, rope, scale); break;
	case 3: chunk_scores(3, sc, ql, qp, rows, n, npf, lora, rope, scale); break;
	default: chunk_scores(4, sc, ql, qp, rows, n, npf, lora, rope, scale); break;
	}
}

static void sub_wsum(int g, float *const *out, float w[][MLA_CHUNK], const float *const *rows, int64_t n,
		     int64_t lora)
{
	switch (g) {
	case 1: chunk_wsum(1, out, w, rows, n, lora); break;
	case 2: chunk_wsum(2, out, w, rows, n, lora); break;
	case 3: chunk_wsum(3, out, w, rows, n, lora); break;
	default: chunk_wsum(4, out, w, rows, n, lora); break;
	}
}

/* kc_mla_chunk_fn: one chunk of n rows for a group with the online
 * softmax, in passes of MLA_SUB heads, the later passes reading its rows
 * from L2; the first pass asks for the rows MLA_PF ahead, up to
 * rows[npf - 1] (npf = 0 for an item's later groups). */
static void group_chunk(kc_mla_group *st, const kb_mla_attn_args *a, const float *const *rows, int64_t n,
			int64_t npf)
{
	const int64_t lora = a->kv_lora, rope = a->rope_dim;
	const int G = st->G;
	_Alignas(32) float sc[MLA_GMAX][MLA_CHUNK];
	for (int s = 0; s < G; s += MLA_SUB)
		sub_scores(G - s < MLA_SUB ? G - s : MLA_SUB, sc + s, st->ql + s, st->qp + s, rows, n,
			   s == 0 ? npf : 0, lora, rope, a->scale);
	for (int g = 0; g < G; g++) {
		float cmax = -INFINITY;
		for (int64_t i = 0; i < n; i++)
			cmax = sc[g][i] > cmax ? sc[g][i] : cmax;
		if (cmax > st->m[g]) { /* the running max grows: rescale what is summed */
			const float c = expf(st->m[g] - cmax);
			const __m256 vc = _mm256_set1_ps(c);
			for (int64_t d = 0; d < lora; d += 8)
				_mm256_storeu_ps(st->out[g] + d, _mm256_mul_ps(_mm256_loadu_ps(st->out[g] + d), vc));
			st->l[g] *= c;
			st->m[g] = cmax;
		}
		const __m256 vm = _mm256_set1_ps(st->m[g]);
		__m256 sum = _mm256_setzero_ps();
		int64_t i = 0;
		for (; i + 8 <= n; i += 8) {
			__m256 e = kc_exp8(_mm256_sub_ps(_mm256_loadu_ps(sc[g] + i), vm));
			_mm256_storeu_ps(sc[g] + i, e);
			sum = _mm256_add_ps(sum, e);
		}
		float sm = kc_hsum8(sum);
		for (; i < n; i++)
			sm += (sc[g][i] = expf(sc[g][i] - st->m[g]));
		st->l[g] += sm;
	}
	for (int s = 0; s < G; s += MLA_SUB)
		sub_wsum(G - s < MLA_SUB ? G - s : MLA_SUB, st->out + s, sc + s, rows, n, lora);
}

#pragma GCC pop_options

int kc_mla_attn_avx2(const kb_mla_attn_args *a)
{
	if (a->kv_lora % 8 || a->rope_dim % 8)
		return DS_EUNSUPPORTED;
	return kc_mla_work_run(a, MLA_GMAX, MLA_PF, group_chunk);
}
#else
int kc_mla_attn_avx2(const kb_mla_attn_args *a)
{
	(void)a;
	return DS_EUNSUPPORTED;
}
#endif

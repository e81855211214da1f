/*
 * softmax.c - in-place row softmax of scale * x on the CPU.
 *
 * Reference: double throughout (v = scale x, m = max v, e = exp(v - m),
 * x = e / sum e).  SIMD (AVX2, AVX-512): m = max of RN(scale x), then
 * exp(fma(scale, x, -m)) with the vector exp of vmath.h, an f32 sum over
 * lanes, one multiply by 1/sum.  m is a common shift that cancels in the
 * ratio, so only the rounding of each exponent's argument and the exp (about
 * 1 ulp) and the f32 sum remain: conformance tolerance 1e-5 relative per
 * element (absolute floor 1e-20; outputs are probabilities).  A row that is
 * all -inf gives NaN in every version.  Rows are spread over the thread pool.
 *
 * Called by backend_cpu.c (after argument checks) and tests/conformance.
 */
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/vmath.h"

#include <math.h>

static void row_ref(const kb_softmax_args *a, int64_t r)
{
	float *x = a->x + r * a->stride;
	const double sc = a->scale;
	double m = -INFINITY, sum = 0.0;
	for (int64_t i = 0; i < a->n; i++)
		m = fmax(m, sc * (double)x[i]);
	for (int64_t i = 0; i < a->n; i++)
		sum += exp(sc * (double)x[i] - m);
	for (int64_t i = 0; i < a->n; i++)
		x[i] = (float)(exp(sc * (double)x[i] - m) / sum);
}

void kc_softmax_ref(const kb_softmax_args *a)
{
	for (int64_t r = 0; r < a->rows; r++)
		row_ref(a, r);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void row_avx2(const kb_softmax_args *a, int64_t r)
{
	float *x = a->x + r * a->stride;
	const int64_t n = a->n;
	const __m256 sc = _mm256_set1_ps(a->scale);
	__m256 vm = _mm256_set1_ps(-INFINITY);
	int64_t i = 0;
	for (; i + 8 <= n; i += 8)
		vm = _mm256_max_ps(vm, _mm256_mul_ps(sc, _mm256_loadu_ps(x + i)));
	__m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
	h = _mm_max_ps(h, _mm_movehl_ps(h, h));
	h = _mm_max_ss(h, _mm_movehdup_ps(h));
	float m = _mm_cvtss_f32(h);
	for (; i < n; i++)
		m = fmaxf(m, a->scale * x[i]);
	const __m256 nm = _mm256_set1_ps(-m);
	__m256 vs = _mm256_setzero_ps();
	for (i = 0; i + 8 <= n; i += 8) {
		__m256 e = kc_exp8(_mm256_fmadd_ps(sc, _mm256_loadu_ps(x + i), nm));
		_mm256_storeu_ps(x + i, e);
		vs = _mm256_add_ps(vs, e);
	}
	__m128 s4 = _mm_add_ps(_mm256_castps256_ps128(vs), _mm256_extractf128_ps(vs, 1));
	s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
	s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
	float sum = _mm_cvtss_f32(s4);
	if (i < n) {
		__m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i)),
						_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
		__m256 e = kc_exp8(_mm256_fmadd_ps(sc, _mm256_maskload_ps(x + i, mk), nm));
		_mm256_maskstore_ps(x + i, mk, e);
		float t[8];
		_mm256_storeu_ps(t, e);
		for (int64_t k = 0; k < n - i; k++)
			sum += t[k];
	}
	const __m256 inv = _mm256_set1_ps(1.0f / sum);
	for (i = 0; i + 8 <= n; i += 8)
		_mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
	for (; i < n; i++)
		x[i] *= 1.0f / sum;
}

__attribute__((target("avx512f,avx512dq"))) static void row_avx512(const kb_softmax_args *a, int64_t r)
{
	float *x = a->x + r * a->stride;
	const int64_t n = a->n;
	const __m512 sc = _mm512_set1_ps(a->scale);
	__m512 vm = _mm512_set1_ps(-INFINITY);
	for (int64_t i = 0; i < n; i += 16) {
		__mmask16 mk = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (unsigned)(n - i)) - 1u);
		vm = _mm512_mask_max_ps(vm, mk, vm, _mm512_mul_ps(sc, _mm512_maskz_loadu_ps(mk, x + i)));
	}
	const __m512 nm = _mm512_set1_ps(-_mm512_reduce_max_ps(vm));
	__m512 vs = _mm512_setzero_ps();
	for (int64_t i = 0; i < n; i += 16) {
		__mmask16 mk = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (unsigned)(n - i)) - 1u);
		__m512 e = kc_exp16(_mm512_fmadd_ps(sc, _mm512_maskz_loadu_ps(mk, x + i), nm));
		_mm512_mask_storeu_ps(x + i, mk, e);
		vs = _mm512_mask_add_ps(vs, mk, vs, e);
	}
	const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vs));
	for (int64_t i = 0; i < n; i += 16) {
		__mmask16 mk = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (unsigned)(n - i)) - 1u);
		_mm512_mask_storeu_ps(x + i, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, x + i), inv));
	}
}
#endif

typedef struct softmax_job {
	const kb_softmax_args *a;
	enum kc_isa isa;
} softmax_job;

static void softmax_item(void *ctx, int64_t b, int64_t e)
{
	const softmax_job *j = ctx;
	for (int64_t r = b; r < e; r++) {
		switch (j->isa) {
#if defined(__x86_64__)
		case KC_ISA_AVX512BF16:
		case KC_ISA_AVX512: row_avx512(j->a, r); break;
		case KC_ISA_AVX2: row_avx2(j->a, r); break;
#endif
		default: row_ref(j->a, r); break;
		}
	}
}

int kc_softmax_isa(enum kc_isa isa, const kb_softmax_args *a)
{
	if (isa > kc_isa_detect())
		return DS_EUNSUPPORTED;
	softmax_job j = {a, isa};
	int64_t grain = a->n > 0 ? (int64_t)(1 << 14) / a->n + 1 : a->rows;
	kc_parallel_for(a->rows, grain, softmax_item, &j);
	return DS_OK;
}

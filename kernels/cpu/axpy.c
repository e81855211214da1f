/*
 * axpy.c - y[i] += alpha * x[i] on the CPU: reference in double, AVX2 and
 * AVX-512 versions with one FMA per element (one rounding, so within one
 * ulp of the exactly rounded result; conformance tolerance 2.5e-7 relative to
 * |y| + |alpha x|).  Long vectors are split over the thread pool.
 *
 * Called by backend_cpu.c (after argument checks) and tests/conformance.
 */
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

void kc_axpy_ref(const kb_axpy_args *a)
{
	for (int64_t i = 0; i < a->n; i++)
		a->y[i] = (float)((double)a->y[i] + (double)a->alpha * (double)a->x[i]);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void axpy_avx2(const kb_axpy_args *a, int64_t b, int64_t e)
{
	const __m256 al = _mm256_set1_ps(a->alpha);
	int64_t i = b;
	for (; i + 8 <= e; i += 8)
		_mm256_storeu_ps(a->y + i, _mm256_fmadd_ps(al, _mm256_loadu_ps(a->x + i),
							   _mm256_loadu_ps(a->y + i)));
	for (; i < e; i++)
		a->y[i] = __builtin_fmaf(a->alpha, a->x[i], a->y[i]);
}

__attribute__((target("avx512f"))) static void axpy_avx512(const kb_axpy_args *a, int64_t b, int64_t e)
{
	const __m512 al = _mm512_set1_ps(a->alpha);
	for (int64_t i = b; i < e; i += 16) {
		__mmask16 m = e - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (unsigned)(e - i)) - 1u);
		__m512 v = _mm512_fmadd_ps(al, _mm512_maskz_loadu_ps(m, a->x + i),
					   _mm512_maskz_loadu_ps(m, a->y + i));
		_mm512_mask_storeu_ps(a->y + i, m, v);
	}
}
#endif

typedef struct axpy_job {
	const kb_axpy_args *a;
	enum kc_isa isa;
} axpy_job;

static void axpy_item(void *ctx, int64_t b, int64_t e)
{
	const axpy_job *j = ctx;
	switch (j->isa) {
#if defined(__x86_64__)
	case KC_ISA_AVX512BF16:
	case KC_ISA_AVX512: axpy_avx512(j->a, b, e); break;
	case KC_ISA_AVX2: axpy_avx2(j->a, b, e); break;
#endif
	default: {
		kb_axpy_args s = *j->a;
		s.y += b;
		s.x += b;
		s.n = e - b;
		kc_axpy_ref(&s);
		break;
	}
	}
}

int kc_axpy_isa(enum kc_isa isa, const kb_axpy_args *a)
{
	if (isa > kc_isa_detect())
		return DS_EUNSUPPORTED;
	axpy_job j = {a, isa};
	kc_parallel_for(a->n, 1 << 17, axpy_item, &j);
	return DS_OK;
}

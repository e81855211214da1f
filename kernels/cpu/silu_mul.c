/*
 * silu_mul.c - out = silu(gate) * up, silu(z) = z / (1 + exp(-z)), on the
 * CPU: reference in double, AVX2 and AVX-512 versions with the vector exp of
 * vmath.h (about 1 ulp) and one division (conformance tolerance 1e-6
 * relative).  z < -89 gives exp(-z) = inf and so -0 (the true value is below
 * 1e-36); z > 104 gives z.  Rows are spread over the thread pool when there
 * are many elements.
 *
 * Called by backend_cpu.c (after argument checks) and tests/conformance.
 */
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/vmath.h"

#include <math.h>

static void row_ref(const kb_silu_mul_args *a, int64_t r)
{
	const float *g = a->gate + r * a->gate_stride, *u = a->up + r * a->up_stride;
	float *o = a->out + r * a->out_stride;
	for (int64_t i = 0; i < a->dim; i++) {
		double z = g[i];
		o[i] = (float)(z / (1.0 + exp(-z)) * (double)u[i]);
	}
}

void kc_silu_mul_ref(const kb_silu_mul_args *a)
{
	for (int64_t r = 0; r < a->rows; r++)
		row_ref(a, r);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void row_avx2(const kb_silu_mul_args *a, int64_t r)
{
	const float *g = a->gate + r * a->gate_stride, *u = a->up + r * a->up_stride;
	float *o = a->out + r * a->out_stride;
	const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
	int64_t i = 0;
	for (; i + 8 <= a->dim; i += 8) {
		__m256 z = _mm256_loadu_ps(g + i);
		__m256 s = _mm256_div_ps(z, _mm256_add_ps(one, kc_exp8(_mm256_sub_ps(zero, z))));
		_mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
	}
	if (i < a->dim) {
		__m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(a->dim - i)),
					       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
		__m256 z = _mm256_maskload_ps(g + i, m);
		__m256 s = _mm256_div_ps(z, _mm256_add_ps(one, kc_exp8(_mm256_sub_ps(zero, z))));
		_mm256_maskstore_ps(o + i, m, _mm256_mul_ps(s, _mm256_maskload_ps(u + i, m)));
	}
}

__attribute__((target("avx512f,avx512dq"))) static void row_avx512(const kb_silu_mul_args *a, int64_t r)
{
	const float *g = a->gate + r * a->gate_stride, *u = a->up + r * a->up_stride;
	float *o = a->out + r * a->out_stride;
	const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
	for (int64_t i = 0; i < a->dim; i += 16) {
		__mmask16 m = a->dim - i >= 16 ? (__mmask16)0xffff
					       : (__mmask16)((1u << (unsigned)(a->dim - i)) - 1u);
		__m512 z = _mm512_maskz_loadu_ps(m, g + i);
		__m512 s = _mm512_div_ps(z, _mm512_add_ps(one, kc_exp16(_mm512_sub_ps(zero, z))));
		_mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
	}
}
#endif

typedef struct silu_job {
	const kb_silu_mul_args *a;
	enum kc_isa isa;
} silu_job;

static void silu_item(void *ctx, int64_t b, int64_t e)
{
	const silu_job *j = ctx;
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

int kc_silu_mul_isa(enum kc_isa isa, const kb_silu_mul_args *a)
{
	if (isa > kc_isa_detect())
		return DS_EUNSUPPORTED;
	silu_job j = {a, isa};
	int64_t grain = a->dim > 0 ? (int64_t)(1 << 15) / a->dim + 1 : a->rows;
	kc_parallel_for(a->rows, grain, silu_item, &j);
	return DS_OK;
}

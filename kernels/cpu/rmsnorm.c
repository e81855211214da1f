/*
 * rmsnorm.c - RMSNorm on the CPU: scalar reference, AVX2 and AVX-512 versions.
 *
 * The reference accumulates the sum of squares in double; the SIMD versions
 * accumulate in float lanes (16 or 8 wide, two accumulators) and finish the
 * tail with a masked load (AVX-512) or scalar code (AVX2).  Conformance
 * tolerance: relative 1e-5 per element.
 * Called by backend_cpu.c (dispatch) and tests/conformance.
 */
#include "kernels/cpu/cpu.h"

#include <math.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

void kc_rmsnorm_ref(const kb_rmsnorm_args *a)
{
	for (int64_t r = 0; r < a->rows; r++) {
		const float *x = a->x + r * a->x_stride;
		float *y = a->out + r * a->out_stride;
		double ss = 0.0;
		for (int64_t i = 0; i < a->dim; i++)
			ss += (double)x[i] * (double)x[i];
		double scale = 1.0 / sqrt(ss / (double)a->dim + (double)a->eps);
		for (int64_t i = 0; i < a->dim; i++)
			y[i] = (float)((double)x[i] * scale * (double)a->w[i]);
	}
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void rmsnorm_avx2(const kb_rmsnorm_args *a)
{
	const int64_t n = a->dim;
	for (int64_t r = 0; r < a->rows; r++) {
		const float *x = a->x + r * a->x_stride;
		float *y = a->out + r * a->out_stride;
		__m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
		int64_t i = 0;
		for (; i + 16 <= n; i += 16) {
			__m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
			acc0 = _mm256_fmadd_ps(v0, v0, acc0);
			acc1 = _mm256_fmadd_ps(v1, v1, acc1);
		}
		for (; i + 8 <= n; i += 8) {
			__m256 v = _mm256_loadu_ps(x + i);
			acc0 = _mm256_fmadd_ps(v, v, acc0);
		}
		acc0 = _mm256_add_ps(acc0, acc1);
		__m128 s = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));
		s = _mm_add_ps(s, _mm_movehl_ps(s, s));
		s = _mm_add_ss(s, _mm_movehdup_ps(s));
		float ss = _mm_cvtss_f32(s);
		for (; i < n; i++)
			ss += x[i] * x[i];
		const float scale = 1.0f / sqrtf(ss / (float)n + a->eps);
		const __m256 vs = _mm256_set1_ps(scale);
		for (i = 0; i + 8 <= n; i += 8) {
			__m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vs);
			_mm256_storeu_ps(y + i, _mm256_mul_ps(v, _mm256_loadu_ps(a->w + i)));
		}
		for (; i < n; i++)
			y[i] = x[i] * scale * a->w[i];
	}
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void
rmsnorm_avx512(const kb_rmsnorm_args *a)
{
	const int64_t n = a->dim;
	for (int64_t r = 0; r < a->rows; r++) {
		const float *x = a->x + r * a->x_stride;
		float *y = a->out + r * a->out_stride;
		__m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
		int64_t i = 0;
		for (; i + 32 <= n; i += 32) {
			__m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
			acc0 = _mm512_fmadd_ps(v0, v0, acc0);
			acc1 = _mm512_fmadd_ps(v1, v1, acc1);
		}
		for (; i < n; i += 16) {
			__mmask16 m = n - i >= 16 ? (__mmask16)0xffff
						  : (__mmask16)((1u << (unsigned)(n - i)) - 1u);
			__m512 v = _mm512_maskz_loadu_ps(m, x + i);
			acc0 = _mm512_fmadd_ps(v, v, acc0);
		}
		const float ss = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
		const __m512 vs = _mm512_set1_ps(1.0f / sqrtf(ss / (float)n + a->eps));
		for (i = 0; i < n; i += 16) {
			__mmask16 m = n - i >= 16 ? (__mmask16)0xffff
						  : (__mmask16)((1u << (unsigned)(n - i)) - 1u);
			__m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs);
			_mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, a->w + i)));
		}
	}
}
#endif

int kc_rmsnorm_isa(enum kc_isa isa, const kb_rmsnorm_args *a)
{
	if (isa > kc_isa_detect())
		return DS_EUNSUPPORTED;
	switch (isa) {
#if defined(__x86_64__)
	case KC_ISA_AVX512BF16:
	case KC_ISA_AVX512: rmsnorm_avx512(a); return DS_OK;
	case KC_ISA_AVX2: rmsnorm_avx2(a); return DS_OK;
#endif
	default: kc_rmsnorm_ref(a); return DS_OK;
	}
}

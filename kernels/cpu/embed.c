/*
 * embed.c - token embedding lookup on the CPU: out[i][:] = table[ids[i]][:]
 * converted to f32 (F32 copy, F16 through F16C, BF16 by a 16-bit shift).
 * Every conversion is exact, so every version must match the reference bit
 * for bit (conformance tolerance 0).
 *
 * Called by backend_cpu.c (after argument checks; ids are the caller's to
 * validate) and tests/conformance.  Rows are spread over the thread pool when
 * there are many; each output row is written by one thread.
 */
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"

#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

static void row_ref(const kb_embed_args *a, int64_t i)
{
	float *o = a->out + i * a->out_stride;
	const int64_t r = a->ids[i];
	switch (a->type) {
	case KB_F32:
		memcpy(o, (const float *)a->table + r * a->table_stride, (size_t)a->dim * sizeof(float));
		break;
	case KB_F16: {
		const uint16_t *t = (const uint16_t *)a->table + r * a->table_stride;
		for (int64_t k = 0; k < a->dim; k++)
			o[k] = kc_f16_to_f32(t[k]);
		break;
	}
	case KB_BF16: {
		const uint16_t *t = (const uint16_t *)a->table + r * a->table_stride;
		for (int64_t k = 0; k < a->dim; k++)
			o[k] = kc_bf16_to_f32(t[k]);
		break;
	}
	default:
		break;
	}
}

void kc_embed_ref(const kb_embed_args *a)
{
	for (int64_t i = 0; i < a->n; i++)
		row_ref(a, i);
}

#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) static void row_avx2(const kb_embed_args *a, int64_t i)
{
	if (a->type == KB_F32) {
		row_ref(a, i);
		return;
	}
	float *o = a->out + i * a->out_stride;
	const uint16_t *t = (const uint16_t *)a->table + (int64_t)a->ids[i] * a->table_stride;
	int64_t k = 0;
	if (a->type == KB_F16) {
		for (; k + 8 <= a->dim; k += 8)
			_mm256_storeu_ps(o + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + k))));
		for (; k < a->dim; k++)
			o[k] = kc_f16_to_f32(t[k]);
	} else {
		for (; k + 8 <= a->dim; k += 8) {
			__m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(t + k)));
			_mm256_storeu_ps(o + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
		}
		for (; k < a->dim; k++)
			o[k] = kc_bf16_to_f32(t[k]);
	}
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) static void row_avx512(const kb_embed_args *a,
									    int64_t i)
{
	if (a->type == KB_F32) {
		row_ref(a, i);
		return;
	}
	float *o = a->out + i * a->out_stride;
	const uint16_t *t = (const uint16_t *)a->table + (int64_t)a->ids[i] * a->table_stride;
	for (int64_t k = 0; k < a->dim; k += 16) {
		__mmask16 m = a->dim - k >= 16 ? (__mmask16)0xffff
					       : (__mmask16)((1u << (unsigned)(a->dim - k)) - 1u);
		__m256i h = _mm256_maskz_loadu_epi16(m, t + k);
		__m512 v = a->type == KB_F16
				   ? _mm512_cvtph_ps(h)
				   : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
		_mm512_mask_storeu_ps(o + k, m, v);
	}
}
#endif

typedef struct embed_job {
	const kb_embed_args *a;
	enum kc_isa isa;
} embed_job;

static void embed_item(void *ctx, int64_t b, int64_t e)
{
	const embed_job *j = ctx;
	for (int64_t i = b; i < e; i++) {
		switch (j->isa) {
#if defined(__x86_64__)
		case KC_ISA_AVX512BF16:
		case KC_ISA_AVX512: row_avx512(j->a, i); break;
		case KC_ISA_AVX2: row_avx2(j->a, i); break;
#endif
		default: row_ref(j->a, i); break;
		}
	}
}

int kc_embed_isa(enum kc_isa isa, const kb_embed_args *a)
{
	if (isa > kc_isa_detect())
		return DS_EUNSUPPORTED;
	embed_job j = {a, isa};
	int64_t grain = a->dim > 0 ? (int64_t)(1 << 16) / a->dim + 1 : a->n;
	kc_parallel_for(a->n, grain, embed_item, &j);
	return DS_OK;
}

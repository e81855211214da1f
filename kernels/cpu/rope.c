/*
 * rope.c - rotary position embedding, in place, on the CPU.
 *
 * One implementation for every ISA (the op is small next to the matmuls):
 * theta = (float)pos * inv_freq[i] in f32 as kb_rope_args specifies, then
 * cos/sin in double, scaled by amp, computed once per (token, pair) and
 * applied to every head; the rotation itself in double, rounded once.
 * Interleaved pairs (2i, 2i+1) or NeoX pairs (i, i + rot_dim/2).  Tested
 * against hand-computed rotations in tests/unit/test_kernels_ops.c.
 * Tokens are spread over the thread pool when there are many.
 *
 * Called by backend_cpu.c (after argument checks) and tests/conformance.
 */
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"

#include <math.h>

static void rope_tokens(const kb_rope_args *a, int64_t t0, int64_t t1)
{
	const int64_t half = a->rot_dim / 2;
	for (int64_t t = t0; t < t1; t++) {
		float *xt = a->x + t * a->tok_stride;
		for (int64_t i = 0; i < half; i++) {
			float theta = (float)a->pos[t] * a->inv_freq[i];
			double c = cos((double)theta) * (double)a->amp;
			double s = sin((double)theta) * (double)a->amp;
			int64_t ia = a->interleaved ? 2 * i : i;
			int64_t ib = a->interleaved ? 2 * i + 1 : i + half;
			for (int64_t h = 0; h < a->n_heads; h++) {
				float *x = xt + h * a->head_stride;
				double xa = x[ia], xb = x[ib];
				x[ia] = (float)(xa * c - xb * s);
				x[ib] = (float)(xa * s + xb * c);
			}
		}
	}
}

void kc_rope_ref(const kb_rope_args *a)
{
	rope_tokens(a, 0, a->n_tok);
}

static void rope_item(void *ctx, int64_t b, int64_t e)
{
	rope_tokens(ctx, b, e);
}

int kc_rope_isa(enum kc_isa isa, const kb_rope_args *a)
{
	if (isa > kc_isa_detect())
		return DS_EUNSUPPORTED;
	int64_t per_tok = a->n_heads * a->rot_dim + 1;
	kc_parallel_for(a->n_tok, (int64_t)(1 << 15) / per_tok + 1, rope_item, (void *)a);
	return DS_OK;
}

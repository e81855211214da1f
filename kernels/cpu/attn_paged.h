/*
 * attn_paged.h - the AVX2 / AVX-512 path of the paged GQA attention
 * (attn_paged.c), private to kernels/cpu; kc_paged_attn (attn.c) calls it.
 */
#ifndef DS_KERNELS_CPU_ATTN_PAGED_H
#define DS_KERNELS_CPU_ATTN_PAGED_H

#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"

/* kc_paged_attn on the vector units of isa (AVX2 or better); the arguments
 * are already checked.  DS_EUNSUPPORTED when this isa or head_dim (a multiple
 * of 8, at most 256) is not covered (the caller then runs the scalar path),
 * DS_ENOMEM when its work list cannot be allocated. */
int kc_paged_attn_simd(const kb_paged_attn_args *a, enum kc_isa isa);

/* Attention over keys split into stretches, merged by log-sum-exp: (O, M,
 * L) of nh heads of hd takes in one stretch's unnormalised sums acc, maxima
 * m and normalisers l: M' = max(M, m), O = O e^(M - M') + acc e^(m - M'),
 * L likewise (paged decode, absorbed MLA). */
void kc_attn_fold(float *restrict O, float *M, float *L, const float *restrict acc, const float *m, const float *l,
		  int64_t nh, int64_t hd);

#endif

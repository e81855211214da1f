/*
 * attn_mla.h - the AVX2 path of absorbed MLA (attn_mla_avx2.c), private to
 * kernels/cpu; kc_mla_attn (attn.c) calls it.
 */
#ifndef DS_KERNELS_CPU_ATTN_MLA_H
#define DS_KERNELS_CPU_ATTN_MLA_H

#include "kernels/backend.h"

/* kc_mla_attn on AVX2 (arguments already checked): heads in groups of up to
 * 8 share each cache row load.  DS_EUNSUPPORTED when kv_lora or rope_dim is
 * not a multiple of 8 (the caller then runs the per-head path). */
int kc_mla_attn_avx2(const kb_mla_attn_args *a);

#endif

/*
 * attn.h - attention, MoE routing and weight dequantization on the CPU
 * (kernels/cpu): the ops the engine needs beyond the dense kernels of cpu.h.
 *
 * These ops have one implementation each (f32, online softmax); their tests
 * are hand-computed cases in tests/unit/test_attn.c and the whole-model
 * comparison against an independent numpy forward pass.
 */
#ifndef DS_KERNELS_CPU_ATTN_H
#define DS_KERNELS_CPU_ATTN_H

#include "kernels/backend.h"

int kc_mla_attn(const kb_mla_attn_args *a);
int kc_attn(const kb_attn_args *a);
int kc_paged_attn(const kb_paged_attn_args *a);
int kc_moe_route(const kb_moe_route_args *a);
/* Dequantization of a weight slice to f32 (kb_dequant_args). */
int kc_dequant(const kb_dequant_args *a);

#endif

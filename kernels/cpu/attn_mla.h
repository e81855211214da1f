/*
 * attn_mla.h - the AVX2 path of absorbed MLA (attn_mla_avx2.c), private to
 * kernels/cpu; kc_mla_attn (attn.c) calls it.
 */
#ifndef DS_KERNELS_CPU_ATTN_MLA_H
#define DS_KERNELS_CPU_ATTN_MLA_H

#include "kernels/backend.h"

#include <stdint.h>

/* Groups of heads an item of the SIMD paths holds, at most (256 heads of
 * 8; DeepSeek-V3 has 128). */
#define MLA_ITEM_GROUPS 32
/* Heads of a group, at most: they share each cache row load in registers. */
#define MLA_GROUP_MAX 8

/* The running state of a group of G <= MLA_GROUP_MAX heads [h0, h0 + G) of
 * one token: their queries, their output rows (the unnormalised sums until
 * the item ends), running max and normaliser. */
typedef struct kc_mla_group {
	const float *ql[MLA_GROUP_MAX], *qp[MLA_GROUP_MAX];
	float *out[MLA_GROUP_MAX];
	float m[MLA_GROUP_MAX], l[MLA_GROUP_MAX];
	int G;
} kc_mla_group;

/* rows[i] = the cache row of position j0 + i of token t's sequence, i < n
 * (through its block table). */
void kc_mla_rows(const kb_mla_attn_args *a, int64_t t, int64_t j0, int64_t n, const float **rows);

/* Points s at heads [h0, h0 + G) of token t, zeroes their output rows,
 * max -inf, normaliser 0. */
void kc_mla_group_start(kc_mla_group *s, const kb_mla_attn_args *a, int64_t t, int64_t h0, int G);

/* How the SIMD paths cut a step's heads into pool items.  *group: the heads
 * that share each cache row load in registers, the largest power-of-two
 * fraction of gmax that still gives every pool thread an item.  *per_item:
 * the heads of one item (whole groups, at most MLA_ITEM_GROUPS of them),
 * the fewest items per token that still give every thread one.  An item
 * works chunk by chunk, all its groups on a chunk before the next, so its
 * rows come from memory once for all its heads. */
void kc_mla_items(int64_t n_tok, int64_t n_heads, int64_t gmax, int64_t *group, int64_t *per_item);

/* kc_mla_attn on AVX2 (arguments already checked): heads in groups of up to
 * 8 share each cache row load.  DS_EUNSUPPORTED when kv_lora or rope_dim is
 * not a multiple of 8 (the caller then runs the per-head path). */
int kc_mla_attn_avx2(const kb_mla_attn_args *a);

#endif

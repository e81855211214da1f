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

/* Keys per stretch: the keys of a token are attended stretch by stretch,
 * the stretches fixed by position, and a deep token's stretches folded in
 * order by log-sum-exp:
 *     M = max m_s,  L = sum l_s e^(m_s - M),  out = sum acc_s e^(m_s - M) / L,
 * as their own pool items when a step has fewer tokens than threads,
 * within one item otherwise (attn.c, "the SIMD MLA paths' items"); the same
 * folds in the same order, so the result does not depend on the thread
 * count.  A token of up to MLA_SPLIT keys is one stretch. */
#define MLA_SPLIT 1024

/* What a SIMD path's item runs: token t, heads [h0, h1), keys [j0, j1).
 * Head h0 + i sums into out + i * kv_lora; when ml is not NULL (one
 * stretch of a deep token) the item leaves those sums unnormalised and
 * writes the head's max and normaliser to ml[2i], ml[2i + 1]. */
typedef struct kc_mla_span {
	int64_t t, h0, h1, j0, j1;
	float *out, *ml;
} kc_mla_span;

/* A SIMD path's item body: sp's heads in groups of `group` over sp's keys
 * (kc_mla_group_start ... kc_mla_span_end). */
typedef void (*kc_mla_span_fn)(const kb_mla_attn_args *a, const kc_mla_span *sp, int64_t group);

/* A whole kc_mla_attn on a SIMD path: cuts a's work into items (groups of
 * at most gmax heads; the fewest items per token, or per token-stretch,
 * that give every pool thread one, two when tokens are split: a last
 * stretch is short), runs fn over them on the pool, and folds the deep
 * tokens' stretches into a->out.  DS_ENOMEM when the plan cannot be
 * allocated. */
int kc_mla_work_run(const kb_mla_attn_args *a, int64_t gmax, kc_mla_span_fn fn);

/* Points s at heads [h0, h0 + G) of sp's token, their output rows where sp
 * puts them, zeroed; max -inf, normaliser 0. */
void kc_mla_group_start(kc_mla_group *s, const kb_mla_attn_args *a, const kc_mla_span *sp, int64_t h0, int G);
/* The end of sp's item, whose heads are the ng groups st: each head's
 * output divided by its normaliser, or its max and normaliser kept for the
 * fold. */
void kc_mla_span_end(const kc_mla_span *sp, const kc_mla_group *st, int ng, int64_t lora);

/* How the SIMD paths cut heads into items, for n_units token-stretches and
 * want items in all.  *group: the heads that share each cache row load in
 * registers, the largest power-of-two fraction of gmax that still gives
 * want items.  *per_item: the heads of one item (whole groups, at most
 * MLA_ITEM_GROUPS of them), the fewest items per unit that still give want.
 * An item works chunk by chunk, all its groups on a chunk before the next,
 * so its rows come from memory once for all its heads. */
void kc_mla_items(int64_t n_units, int64_t n_heads, int64_t gmax, int64_t want, int64_t *group, int64_t *per_item);

/* kc_mla_attn on AVX2 (arguments already checked): heads in groups of up to
 * 8 share each cache row load.  DS_EUNSUPPORTED when kv_lora or rope_dim is
 * not a multiple of 8 (the caller then runs the per-head path), DS_ENOMEM
 * when the plan cannot be allocated. */
int kc_mla_attn_avx2(const kb_mla_attn_args *a);

#endif

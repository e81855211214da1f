/*
 * attn_mla.h - what the SIMD paths of absorbed MLA share, private to
 * kernels/cpu: the items and stretches (kc_mla_work_run, attn.c), which
 * call each path's chunk body (AVX-512 in attn.c, AVX2 in
 * attn_mla_avx2.c); kc_mla_attn (attn.c) calls the AVX2 path.
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

/* Keys per stretch: the keys of a token are attended stretch by stretch,
 * the stretches fixed by position, and a deep token's stretches folded in
 * order by log-sum-exp:
 *     M = max m_s,  L = sum l_s e^(m_s - M),  out = sum acc_s e^(m_s - M) / L,
 * as their own pool items when a step has fewer tokens than threads,
 * within one item otherwise (attn.c, "the SIMD MLA paths' items"); the same
 * folds in the same order, so the result does not depend on the thread
 * count.  A token of up to MLA_SPLIT keys is one stretch. */
#define MLA_SPLIT 1024

/* Rows of the cache a group works on at a time (in L2: 288 KiB for
 * DeepSeek's 576 floats a row). */
#define MLA_CHUNK 128

/* A SIMD path's body: n <= MLA_CHUNK rows for group s, the online softmax
 * over them; rows[0..npf) are known, and the path asks for the ones beyond
 * the chunk (npf = 0 for an item's later groups, which find the rows in
 * L2). */
typedef void (*kc_mla_chunk_fn)(kc_mla_group *s, const kb_mla_attn_args *a, const float *const *rows, int64_t n,
				int64_t npf);

/* A whole kc_mla_attn on a SIMD path: cuts a's work into items (groups of
 * at most gmax heads; the fewest items per token, or per token-stretch,
 * that give every pool thread one, two when tokens are split: a last
 * stretch is short) and runs them on the pool.  An item works chunk by
 * chunk, all its groups on a chunk before the next, so a chunk comes from
 * memory once for all its heads; its first group's fn is given the rows up
 * to `ahead` past the chunk (at most 16).  Then the deep tokens'
 * stretches are folded into a->out.  DS_ENOMEM when the plan cannot be
 * allocated. */
int kc_mla_work_run(const kb_mla_attn_args *a, int64_t gmax, int64_t ahead, kc_mla_chunk_fn fn);

/* kc_mla_attn on AVX2 (arguments already checked): heads in groups of up to
 * 8 share each cache row load.  DS_EUNSUPPORTED when kv_lora or rope_dim is
 * not a multiple of 8 (the caller then runs the per-head path), DS_ENOMEM
 * when the plan cannot be allocated. */
int kc_mla_attn_avx2(const kb_mla_attn_args *a);

#endif

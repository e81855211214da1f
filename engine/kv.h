/*
 * kv.h - the KV cache in fixed-size pages, with per-sequence block tables.
 *
 * A page holds page_size consecutive positions of one sequence in every layer
 * (one page id indexes the same slot range in each layer's array).  A row is
 * row_floats f32 values per position per layer (DeepSeek MLA: kv_lora_rank +
 * qk_rope_head_dim; llama: 2 * n_kv_heads * head_dim).  Pages are reference
 * counted so a scheduler can share a prefix between sequences; a page returns
 * to the free list when its last reference is dropped.
 *
 * A kv_seq is a sequence's block table: blocks[i] is the page holding
 * positions [i * page_size, (i + 1) * page_size).
 * Thread rule: one owner (the engine step loop); no internal locking.
 */
#ifndef DS_ENGINE_KV_H
#define DS_ENGINE_KV_H

#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kv_params {
	int n_layers;
	int64_t row_floats;
	int page_size; /* positions per page */
	int n_pages;
} kv_params;

typedef struct kv_cache kv_cache;

typedef struct kv_seq {
	int32_t *blocks; /* page ids, n_blocks used, cap allocated */
	int n_blocks, cap;
} kv_seq;

kv_cache *kv_cache_new(const kv_params *p, ds_err *err);
void kv_cache_free(kv_cache *kv);

const kv_params *kv_cache_params(const kv_cache *kv);
/* Base of a layer's rows: [n_pages][page_size][row_floats]. */
float *kv_cache_layer(kv_cache *kv, int layer);
int kv_cache_pages_free(const kv_cache *kv);
size_t kv_cache_bytes(const kv_cache *kv);

/* Makes seq cover positions [0, n_positions): allocates the missing pages.
 * DS_EBUSY (and no change) when the free pages do not suffice. */
int kv_seq_reserve(kv_cache *kv, kv_seq *seq, int64_t n_positions, ds_err *err);
/* Drops the pages past n_positions (n_positions = 0 releases all). */
void kv_seq_truncate(kv_cache *kv, kv_seq *seq, int64_t n_positions);
/* dst shares src's pages (dst must be empty). */
int kv_seq_share(kv_cache *kv, kv_seq *dst, const kv_seq *src, ds_err *err);
void kv_seq_free(kv_cache *kv, kv_seq *seq);

#endif

/*
 * kv.h - the KV cache in fixed-size pages, with per-sequence block tables.
 *
 * A page holds page_size consecutive positions of one sequence in every layer
 * (one page id indexes the same slot range in each layer's array).  A row is
 * row_elems values per position per layer (DeepSeek MLA: kv_lora_rank +
 * qk_rope_head_dim; llama: 2 * n_kv_heads * head_dim), f32 or IEEE half
 * (elem_bytes 4 or 2; llama's K/V default to halves, as llama.cpp's f16
 * cache: half the bytes to stream at depth and twice the positions in the
 * same memory).  Pages are reference
 * counted so a scheduler can share a prefix between sequences; a page returns
 * to the free list when its last reference is dropped, unless it is cached.
 *
 * Prefix caching (automatic, as vLLM's): a full page whose rows a sequence
 * has computed can be published with the page_size token ids it holds
 * (kv_seq_publish).  A published page keeps its rows after its last reference
 * is dropped: it waits on an LRU list, still counted as free, until an
 * allocation finds the free list empty and evicts it (least recently
 * released first).  kv_seq_match gives a new sequence the longest chain of
 * published pages that holds the first positions of its ids.
 *
 * A page's key is a chain hash: that of its parent page's key and its ids,
 * so equal keys mean equal prefixes.  The hash only finds candidates; a
 * match is exact: the candidate's ids must equal the request's, and its
 * parent must be the very page matched before it, in the same life (a page
 * gets a new generation each time it is allocated), so a page evicted and
 * refilled never passes for its old contents and a hash collision can never
 * hand out wrong rows.  Published pages are read only: kv_seq_publish takes
 * only full pages, whose rows are all written, and a sequence writes only
 * past the positions it holds.
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
	int64_t row_elems;
	int elem_bytes; /* 4: f32 (also when 0), 2: IEEE half */
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
/* Base of a layer's rows: [n_pages][page_size][row_elems] elements. */
void *kv_cache_layer(kv_cache *kv, int layer);
/* Row `slot` of a layer = src[0 .. row_elems), rounded to the nearest half
 * (ties to even; beyond 65504 infinity, as IEEE conversion does) when the
 * cache holds halves. */
void kv_cache_write_row(kv_cache *kv, int layer, int64_t slot, const float *src);
/* f32 -> IEEE half bits, round to nearest even (exposed for its tests). */
uint16_t kv_f32_to_f16(float f);
/* Pages an allocation can take: unreferenced ones, cached (evictable) included. */
int kv_cache_pages_free(const kv_cache *kv);
/* Published pages, referenced or not; and of them the unreferenced ones. */
int kv_cache_pages_cached(const kv_cache *kv);
int kv_cache_pages_evictable(const kv_cache *kv);
size_t kv_cache_bytes(const kv_cache *kv);

/* Makes seq cover positions [0, n_positions): allocates the missing pages.
 * DS_EBUSY (and no change) when the free pages do not suffice. */
int kv_seq_reserve(kv_cache *kv, kv_seq *seq, int64_t n_positions, ds_err *err);
/* Drops the pages past n_positions (n_positions = 0 releases all). */
void kv_seq_truncate(kv_cache *kv, kv_seq *seq, int64_t n_positions);
/* dst shares src's pages (dst must be empty). */
int kv_seq_share(kv_cache *kv, kv_seq *dst, const kv_seq *src, ds_err *err);
void kv_seq_free(kv_cache *kv, kv_seq *seq);

/* ---- prefix caching ---- */

/* The key of a page holding ids[0, page_size) after a page of key parent
 * (KV_ROOT_KEY for the first page of a sequence). */
#define KV_ROOT_KEY 0
uint64_t kv_page_key(uint64_t parent, const int32_t *ids, int page_size);

/* seq (empty) takes a reference on the longest chain of published pages
 * that holds ids[0, k * page_size) for k * page_size <= n_ids.  Returns the
 * positions it holds (k * page_size), or DS_ENOMEM / DS_EINVAL (seq not
 * empty) with err filled. */
int64_t kv_seq_match(kv_cache *kv, kv_seq *seq, const int32_t *ids, int64_t n_ids, ds_err *err);

/* Publishes blocks [from, to) of seq, whose rows are computed, as holding
 * ids[from * page_size, to * page_size) (ids are the sequence's from
 * position 0).  Blocks [0, from) must be published already (by an earlier
 * call or by kv_seq_match); to <= seq->n_blocks.  A block already
 * published is left as it is. */
void kv_seq_publish(kv_cache *kv, const kv_seq *seq, int from, int to, const int32_t *ids);

#endif

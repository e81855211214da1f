/*
 * kv.c - paged KV cache and its prefix cache (see kv.h).  Called by the
 * scheduler (engine/sched.c), dsrun and the models' tests; one owner thread.
 *
 * A page's states (each edge names the function that takes it):
 *
 *   FREE ──kv_page_alloc──> IN USE ──kv_page_unref (last, unpublished)──> FREE
 *                             │  ^
 *              kv_seq_publish │  │ kv_seq_match (takes a reference)
 *                             v  │
 *                     IN USE, PUBLISHED ──kv_page_unref (last)──> EVICTABLE
 *   EVICTABLE ──kv_seq_match──> IN USE, PUBLISHED
 *   EVICTABLE ──kv_page_alloc (free stack empty; LRU head)──> IN USE (unpublished)
 *
 * Invariants:
 *   1. refs[p] == 0  <=>  p is on the free stack (free_top entries) or on the
 *      LRU list (n_lru entries); on the LRU list  <=>  refs[p] == 0 and p is
 *      published.
 *   2. a kv_seq holds exactly one reference on each page in blocks[0..n_blocks).
 *   3. layer arrays are allocated once at creation (anonymous mmap, so untouched
 *      pages cost no resident memory) and never move.
 *   4. p is published  <=>  p is in the hash table (bucket chain of
 *      key[p]); its ids[p] and parent link (parent[p], parent_gen[p]) do not
 *      change until it is evicted.  gen[p] grows at every allocation.
 *   5. the LRU list runs from the least recently released page (head, evicted
 *      first) to the most recent (tail); a sequence's pages are released last
 *      block first, so the end of a prefix goes before its start.
 */
#include "engine/kv.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

struct kv_cache {
	kv_params p;
	float **layers;
	size_t layer_bytes;
	int32_t *refs;
	int32_t *free_stack;
	int free_top;

	/* prefix cache, per page */
	uint64_t *key;        /* [n_pages] chain hash (published pages) */
	int32_t *ids;         /* [n_pages][page_size] token ids (published pages) */
	int32_t *parent;      /* [n_pages] page before it in its sequence, -1 = first */
	uint32_t *parent_gen; /* [n_pages] gen[parent] when it was published */
	uint32_t *gen;        /* [n_pages] allocations so far */
	uint8_t *published;   /* [n_pages] */
	int32_t *hnext;       /* [n_pages] next page in the same bucket, -1 = end */
	int32_t *bucket;      /* [n_buckets] first page, -1 = none */
	uint64_t bucket_mask; /* n_buckets - 1 (a power of two >= n_pages) */
	int32_t *lru_prev, *lru_next; /* [n_pages] links of the LRU list, -1 = end */
	int32_t lru_head, lru_tail;
	int n_lru, n_published;
};

kv_cache *kv_cache_new(const kv_params *p, ds_err *err)
{
	if (p->n_layers <= 0 || p->row_elems <= 0 || p->page_size <= 0 || p->n_pages <= 0) {
		ds_err_set(err, DS_EINVAL, "kv cache: layers, row size, page size and pages must be > 0");
		return NULL;
	}
	if (p->elem_bytes != 0 && p->elem_bytes != 4 && p->elem_bytes != 2) {
		ds_err_set(err, DS_EINVAL, "kv cache: elements of %d bytes (4: f32, 2: f16)", p->elem_bytes);
		return NULL;
	}
	kv_cache *kv = calloc(1, sizeof *kv);
	if (!kv)
		goto oom;
	kv->p = *p;
	kv->p.elem_bytes = p->elem_bytes ? p->elem_bytes : 4;
	kv->layer_bytes = (size_t)p->n_pages * (size_t)p->page_size * (size_t)p->row_elems * (size_t)kv->p.elem_bytes;
	kv->layers = calloc((size_t)p->n_layers, sizeof *kv->layers);
	const size_t np = (size_t)p->n_pages;
	size_t nb = 1;
	while (nb < np)
		nb *= 2;
	kv->refs = calloc(np, sizeof *kv->refs);
	kv->free_stack = malloc(np * sizeof *kv->free_stack);
	kv->key = calloc(np, sizeof *kv->key);
	kv->ids = malloc(np * (size_t)p->page_size * sizeof *kv->ids);
	kv->parent = malloc(np * sizeof *kv->parent);
	kv->parent_gen = calloc(np, sizeof *kv->parent_gen);
	kv->gen = calloc(np, sizeof *kv->gen);
	kv->published = calloc(np, sizeof *kv->published);
	kv->hnext = malloc(np * sizeof *kv->hnext);
	kv->bucket = malloc(nb * sizeof *kv->bucket);
	kv->lru_prev = malloc(np * sizeof *kv->lru_prev);
	kv->lru_next = malloc(np * sizeof *kv->lru_next);
	if (!kv->layers || !kv->refs || !kv->free_stack || !kv->key || !kv->ids || !kv->parent ||
	    !kv->parent_gen || !kv->gen || !kv->published || !kv->hnext || !kv->bucket ||
	    !kv->lru_prev || !kv->lru_next)
		goto oom;
	kv->bucket_mask = nb - 1;
	for (size_t i = 0; i < nb; i++)
		kv->bucket[i] = -1;
	for (size_t i = 0; i < np; i++)
		kv->parent[i] = kv->hnext[i] = kv->lru_prev[i] = kv->lru_next[i] = -1;
	kv->lru_head = kv->lru_tail = -1;
	for (int l = 0; l < p->n_layers; l++) {
		void *m = mmap(NULL, kv->layer_bytes, PROT_READ | PROT_WRITE,
			       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
		if (m == MAP_FAILED)
			goto oom;
		/* transparent huge pages where the kernel allows them: attention
		 * streams these rows every step, and 4 KiB pages cost a TLB miss
		 * every few rows (a hint; pages are still touched only when used) */
		(void)madvise(m, kv->layer_bytes, MADV_HUGEPAGE);
		kv->layers[l] = m;
	}
	for (int i = 0; i < p->n_pages; i++)
		kv->free_stack[i] = p->n_pages - 1 - i; /* page 0 is handed out first */
	kv->free_top = p->n_pages;
	return kv;
oom:
	ds_err_set(err, DS_ENOMEM, "kv cache: cannot allocate %d pages of %d positions x %lld %s x %d layers",
		   p->n_pages, p->page_size, (long long)p->row_elems, p->elem_bytes == 2 ? "halves" : "floats",
		   p->n_layers);
	kv_cache_free(kv);
	return NULL;
}

void kv_cache_free(kv_cache *kv)
{
	if (!kv)
		return;
	for (int l = 0; kv->layers && l < kv->p.n_layers; l++)
		if (kv->layers[l])
			munmap(kv->layers[l], kv->layer_bytes);
	free(kv->layers);
	free(kv->refs);
	free(kv->free_stack);
	free(kv->key);
	free(kv->ids);
	free(kv->parent);
	free(kv->parent_gen);
	free(kv->gen);
	free(kv->published);
	free(kv->hnext);
	free(kv->bucket);
	free(kv->lru_prev);
	free(kv->lru_next);
	free(kv);
}

const kv_params *kv_cache_params(const kv_cache *kv)
{
	return &kv->p;
}

void *kv_cache_layer(kv_cache *kv, int layer)
{
	return kv->layers[layer];
}

uint16_t kv_f32_to_f16(float f)
{
	uint32_t x;
	memcpy(&x, &f, sizeof x);
	const uint16_t sign = (uint16_t)(x >> 16 & 0x8000);
	const uint32_t ax = x & 0x7fffffffu;
	if (ax >= 0x7f800000u) /* inf stays inf, NaN stays a quiet NaN */
		return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 | (ax >> 13 & 0x3ff) : 0));
	if (ax >= 0x477ff000u) /* rounds to 65520 or more: beyond the largest half */
		return (uint16_t)(sign | 0x7c00);
	if (ax < 0x38800000u) { /* below 2^-14: a subnormal half (or zero) */
		if (ax < 0x33000000u) /* below 2^-25, half the smallest subnormal: zero (2^-25 itself is a tie, below: even 0) */
			return sign;
		const uint32_t e = ax >> 23, mant = (ax & 0x7fffff) | 0x800000;
		const uint32_t shift = 126 - e; /* the half's unit is 2^-24: mant * 2^(e - 150) / 2^-24 */
		uint32_t h = mant >> shift;
		const uint32_t rest = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
		if (rest > halfway || (rest == halfway && (h & 1)))
			h++;
		return (uint16_t)(sign | h);
	}
	/* normal: rebias the exponent (127 -> 15), round the 13 dropped bits to even */
	uint32_t h = ((ax >> 13) - ((127 - 15) << 10));
	const uint32_t rest = ax & 0x1fff;
	if (rest > 0x1000 || (rest == 0x1000 && (h & 1)))
		h++; /* a carry into the exponent is the right result, up to 0x7bff + 1 = inf excluded above */
	return (uint16_t)(sign | h);
}

void kv_cache_write_row(kv_cache *kv, int layer, int64_t slot, const float *src)
{
	const int64_t n = kv->p.row_elems;
	if (kv->p.elem_bytes == 2) {
		uint16_t *dst = (uint16_t *)kv->layers[layer] + slot * n;
		for (int64_t i = 0; i < n; i++)
			dst[i] = kv_f32_to_f16(src[i]);
		return;
	}
	memcpy((float *)kv->layers[layer] + slot * n, src, (size_t)n * sizeof(float));
}

int kv_cache_pages_free(const kv_cache *kv)
{
	return kv->free_top + kv->n_lru;
}

int kv_cache_pages_cached(const kv_cache *kv)
{
	return kv->n_published;
}

int kv_cache_pages_evictable(const kv_cache *kv)
{
	return kv->n_lru;
}

size_t kv_cache_bytes(const kv_cache *kv)
{
	return kv->layer_bytes * (size_t)kv->p.n_layers;
}

/* ---- the LRU list and the hash table (invariants 1, 4, 5) ---- */

static void lru_remove(kv_cache *kv, int page)
{
	int32_t pv = kv->lru_prev[page], nx = kv->lru_next[page];
	if (pv >= 0)
		kv->lru_next[pv] = nx;
	else
		kv->lru_head = nx;
	if (nx >= 0)
		kv->lru_prev[nx] = pv;
	else
		kv->lru_tail = pv;
	kv->lru_prev[page] = kv->lru_next[page] = -1;
	kv->n_lru--;
}

static void lru_push_back(kv_cache *kv, int page)
{
	kv->lru_prev[page] = kv->lru_tail;
	kv->lru_next[page] = -1;
	if (kv->lru_tail >= 0)
		kv->lru_next[kv->lru_tail] = page;
	else
		kv->lru_head = page;
	kv->lru_tail = page;
	kv->n_lru++;
}

static int32_t *bucket_of(kv_cache *kv, uint64_t key)
{
	return &kv->bucket[key & kv->bucket_mask];
}

static void hash_remove(kv_cache *kv, int page)
{
	int32_t *at = bucket_of(kv, kv->key[page]);
	while (*at != page)
		at = &kv->hnext[*at];
	*at = kv->hnext[page];
	kv->hnext[page] = -1;
	kv->published[page] = 0;
	kv->n_published--;
}

/* Page management: alloc returns a page id with one reference, or -1.  The
 * free stack first; then the least recently released cached page, which
 * stops being published. */
static int kv_page_alloc(kv_cache *kv)
{
	int page;
	if (kv->free_top > 0) {
		page = kv->free_stack[--kv->free_top];
	} else if (kv->lru_head >= 0) {
		page = kv->lru_head;
		lru_remove(kv, page);
		hash_remove(kv, page);
	} else {
		return -1;
	}
	kv->refs[page] = 1;
	kv->gen[page]++;
	return page;
}

static void kv_page_ref(kv_cache *kv, int page)
{
	if (kv->refs[page]++ == 0)
		lru_remove(kv, page); /* invariant 1: only published pages wait there */
}

static void kv_page_unref(kv_cache *kv, int page)
{
	assert(kv->refs[page] > 0);
	if (--kv->refs[page] > 0)
		return;
	if (kv->published[page])
		lru_push_back(kv, page);
	else
		kv->free_stack[kv->free_top++] = page;
}

static int grow(kv_seq *seq, int need, ds_err *err)
{
	if (need <= seq->cap)
		return DS_OK;
	int cap = seq->cap ? seq->cap : 8;
	while (cap < need)
		cap *= 2;
	int32_t *b = realloc(seq->blocks, (size_t)cap * sizeof *b);
	if (!b)
		return ds_err_set(err, DS_ENOMEM, "kv cache: cannot grow a block table");
	seq->blocks = b;
	seq->cap = cap;
	return DS_OK;
}

int kv_seq_reserve(kv_cache *kv, kv_seq *seq, int64_t n_positions, ds_err *err)
{
	int64_t need64 = (n_positions + kv->p.page_size - 1) / kv->p.page_size;
	if (need64 > kv->p.n_pages)
		return ds_err_set(err, DS_ERANGE, "kv cache: %lld positions need %lld pages; the cache has %d",
				  (long long)n_positions, (long long)need64, kv->p.n_pages);
	int need = (int)need64;
	if (need <= seq->n_blocks)
		return DS_OK;
	if (need - seq->n_blocks > kv_cache_pages_free(kv))
		return ds_err_set(err, DS_EBUSY, "kv cache: %d more pages needed, %d free",
				  need - seq->n_blocks, kv_cache_pages_free(kv));
	int rc = grow(seq, need, err);
	if (rc)
		return rc;
	while (seq->n_blocks < need)
		seq->blocks[seq->n_blocks++] = kv_page_alloc(kv);
	return DS_OK;
}

void kv_seq_truncate(kv_cache *kv, kv_seq *seq, int64_t n_positions)
{
	int keep = (int)((n_positions + kv->p.page_size - 1) / kv->p.page_size);
	while (seq->n_blocks > keep)
		kv_page_unref(kv, seq->blocks[--seq->n_blocks]);
}

int kv_seq_share(kv_cache *kv, kv_seq *dst, const kv_seq *src, ds_err *err)
{
	if (dst->n_blocks != 0)
		return ds_err_set(err, DS_EINVAL, "kv cache: sharing into a non-empty sequence");
	int rc = grow(dst, src->n_blocks, err);
	if (rc)
		return rc;
	for (int i = 0; i < src->n_blocks; i++) {
		kv_page_ref(kv, src->blocks[i]);
		dst->blocks[i] = src->blocks[i];
	}
	dst->n_blocks = src->n_blocks;
	return DS_OK;
}

void kv_seq_free(kv_cache *kv, kv_seq *seq)
{
	if (!seq)
		return;
	kv_seq_truncate(kv, seq, 0);
	free(seq->blocks);
	seq->blocks = NULL;
	seq->cap = 0;
}

/* ---- prefix caching ---- */

static uint64_t mix64(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdULL;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ULL;
	x ^= x >> 33;
	return x;
}

uint64_t kv_page_key(uint64_t parent, const int32_t *ids, int page_size)
{
	uint64_t h = mix64(parent ^ 0x9e3779b97f4a7c15ULL);
	for (int i = 0; i < page_size; i++)
		h = mix64(h ^ ((uint64_t)(uint32_t)ids[i] + 0x632be59bd9b4e019ULL * (uint64_t)(i + 1)));
	return h;
}

/* The published page with this key, ids and parent link, or -1 (kv.h: the
 * hash finds candidates, the ids and the link decide). */
static int find_page(kv_cache *kv, uint64_t key, const int32_t *ids, int32_t parent)
{
	const int ps = kv->p.page_size;
	uint32_t pgen = parent >= 0 ? kv->gen[parent] : 0;
	for (int32_t p = *bucket_of(kv, key); p >= 0; p = kv->hnext[p])
		if (kv->key[p] == key && kv->parent[p] == parent && kv->parent_gen[p] == pgen &&
		    memcmp(kv->ids + (int64_t)p * ps, ids, (size_t)ps * sizeof *ids) == 0)
			return p;
	return -1;
}

int64_t kv_seq_match(kv_cache *kv, kv_seq *seq, const int32_t *ids, int64_t n_ids, ds_err *err)
{
	if (seq->n_blocks != 0)
		return ds_err_set(err, DS_EINVAL, "kv cache: matching into a non-empty sequence");
	const int ps = kv->p.page_size;
	int64_t max = n_ids / ps;
	if (max > kv->p.n_pages)
		max = kv->p.n_pages;
	uint64_t key = KV_ROOT_KEY;
	int32_t parent = -1;
	int n = 0;
	while (n < max) {
		const int32_t *page_ids = ids + (int64_t)n * ps;
		key = kv_page_key(key, page_ids, ps);
		int p = find_page(kv, key, page_ids, parent);
		if (p < 0)
			break;
		int rc = grow(seq, n + 1, err);
		if (rc) {
			kv_seq_truncate(kv, seq, 0);
			return rc;
		}
		kv_page_ref(kv, p);
		seq->blocks[seq->n_blocks++] = p;
		parent = p;
		n++;
	}
	return (int64_t)n * ps;
}

void kv_seq_publish(kv_cache *kv, const kv_seq *seq, int from, int to, const int32_t *ids)
{
	const int ps = kv->p.page_size;
	assert(to <= seq->n_blocks);
	for (int i = from; i < to; i++) {
		int p = seq->blocks[i];
		if (kv->published[p])
			continue;
		int32_t parent = i > 0 ? seq->blocks[i - 1] : -1;
		assert(parent < 0 || kv->published[parent]);
		if (parent >= 0 && !kv->published[parent])
			return; /* its key is unknown: the chain stops here */
		const int32_t *page_ids = ids + (int64_t)i * ps;
		kv->key[p] = kv_page_key(parent >= 0 ? kv->key[parent] : KV_ROOT_KEY, page_ids, ps);
		memcpy(kv->ids + (int64_t)p * ps, page_ids, (size_t)ps * sizeof *page_ids);
		kv->parent[p] = parent;
		kv->parent_gen[p] = parent >= 0 ? kv->gen[parent] : 0;
		int32_t *b = bucket_of(kv, kv->key[p]);
		kv->hnext[p] = *b;
		*b = p;
		kv->published[p] = 1;
		kv->n_published++;
	}
}

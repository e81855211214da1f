/*
 * kv.c - paged KV cache (see kv.h).
 *
 * Invariants:
 *   1. refs[p] == 0  <=>  p is on the free stack (free_top entries).
 *   2. a kv_seq holds exactly one reference on each page in blocks[0..n_blocks).
 *   3. layer arrays are allocated once at creation (anonymous mmap, so untouched
 *      pages cost no resident memory) and never move.
 */
#include "engine/kv.h"

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
};

kv_cache *kv_cache_new(const kv_params *p, ds_err *err)
{
	if (p->n_layers <= 0 || p->row_floats <= 0 || p->page_size <= 0 || p->n_pages <= 0) {
		ds_err_set(err, DS_EINVAL, "kv cache: layers, row size, page size and pages must be > 0");
		return NULL;
	}
	kv_cache *kv = calloc(1, sizeof *kv);
	if (!kv)
		goto oom;
	kv->p = *p;
	kv->layer_bytes = (size_t)p->n_pages * (size_t)p->page_size * (size_t)p->row_floats * sizeof(float);
	kv->layers = calloc((size_t)p->n_layers, sizeof *kv->layers);
	kv->refs = calloc((size_t)p->n_pages, sizeof *kv->refs);
	kv->free_stack = malloc((size_t)p->n_pages * sizeof *kv->free_stack);
	if (!kv->layers || !kv->refs || !kv->free_stack)
		goto oom;
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
	ds_err_set(err, DS_ENOMEM, "kv cache: cannot allocate %d pages of %d positions x %lld floats x %d layers",
		   p->n_pages, p->page_size, (long long)p->row_floats, p->n_layers);
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
	free(kv);
}

const kv_params *kv_cache_params(const kv_cache *kv)
{
	return &kv->p;
}

float *kv_cache_layer(kv_cache *kv, int layer)
{
	return kv->layers[layer];
}

int kv_cache_pages_free(const kv_cache *kv)
{
	return kv->free_top;
}

size_t kv_cache_bytes(const kv_cache *kv)
{
	return kv->layer_bytes * (size_t)kv->p.n_layers;
}

/* Page management: alloc returns a page id with one reference, or -1. */
static int kv_page_alloc(kv_cache *kv)
{
	if (kv->free_top == 0)
		return -1;
	int page = kv->free_stack[--kv->free_top];
	kv->refs[page] = 1;
	return page;
}

static void kv_page_ref(kv_cache *kv, int page)
{
	kv->refs[page]++;
}

static void kv_page_unref(kv_cache *kv, int page)
{
	if (--kv->refs[page] == 0)
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
	if (need - seq->n_blocks > kv->free_top)
		return ds_err_set(err, DS_EBUSY, "kv cache: %d more pages needed, %d free",
				  need - seq->n_blocks, kv->free_top);
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

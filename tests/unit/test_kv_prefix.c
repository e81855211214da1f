/*
 * test_kv_prefix.c - unit tests of engine/kv's prefix cache: publishing full
 * pages, matching a chain of them, references and the LRU list of evictable
 * pages, eviction order, and that a page evicted and refilled never matches
 * for its old contents.
 */
#include "engine/kv.h"
#include "tests/unit/unit.h"

#include <string.h>

#define PS 4 /* positions per page in these tests */

static kv_cache *cache_new(int n_pages)
{
	kv_params p = {.n_layers = 1, .row_elems = 2, .page_size = PS, .n_pages = n_pages};
	ds_err e = {0};
	kv_cache *kv = kv_cache_new(&p, &e);
	CHECK(kv != NULL);
	return kv;
}

/* A sequence that computed ids[0, n) and published its full pages. */
static void fill(kv_cache *kv, kv_seq *s, const int32_t *ids, int n)
{
	ds_err e = {0};
	CHECK_EQ(kv_seq_reserve(kv, s, n, &e), DS_OK);
	kv_seq_publish(kv, s, 0, n / PS, ids);
}

static void ids_seq(int32_t *ids, int n, int32_t base)
{
	for (int i = 0; i < n; i++)
		ids[i] = base + i;
}

TEST(kv_prefix_publish_match_release)
{
	kv_cache *kv = cache_new(8);
	ds_err e = {0};
	int32_t ids[16];
	ids_seq(ids, 16, 100);
	kv_seq a = {0}, b = {0}, c = {0};
	fill(kv, &a, ids, 10); /* 3 pages; 2 full ones published */
	CHECK_EQ(kv_cache_pages_cached(kv), 2);
	CHECK_EQ(kv_cache_pages_evictable(kv), 0);
	CHECK_EQ(kv_cache_pages_free(kv), 5);

	/* b shares a's two full pages while a runs: read only, referenced twice */
	CHECK_EQ(kv_seq_match(kv, &b, ids, 15, &e), 8);
	CHECK_EQ(b.n_blocks, 2);
	CHECK_EQ(b.blocks[0], a.blocks[0]);
	CHECK_EQ(b.blocks[1], a.blocks[1]);
	CHECK_EQ(kv_cache_pages_free(kv), 5);
	/* n_ids limits the match to whole pages inside it */
	CHECK_EQ(kv_seq_match(kv, &c, ids, 7, &e), 4);
	kv_seq_free(kv, &c);
	c = (kv_seq){0};
	/* a different first page matches nothing, even with the same second page */
	int32_t other[16];
	memcpy(other, ids, sizeof other);
	other[2] = 7;
	CHECK_EQ(kv_seq_match(kv, &c, other, 16, &e), 0);
	CHECK_EQ(c.n_blocks, 0);
	/* matching into a sequence that holds pages is refused */
	CHECK_EQ(kv_seq_match(kv, &b, ids, 16, &e), DS_EINVAL);

	kv_seq_free(kv, &a); /* its partial page is free, its full ones still held by b */
	CHECK_EQ(kv_cache_pages_free(kv), 6);
	CHECK_EQ(kv_cache_pages_evictable(kv), 0);
	kv_seq_free(kv, &b); /* now unreferenced: cached, evictable, counted free */
	CHECK_EQ(kv_cache_pages_free(kv), 8);
	CHECK_EQ(kv_cache_pages_evictable(kv), 2);
	CHECK_EQ(kv_cache_pages_cached(kv), 2);

	/* a later sequence with the same start takes them back off the LRU list */
	b = (kv_seq){0};
	CHECK_EQ(kv_seq_match(kv, &b, ids, 16, &e), 8);
	CHECK_EQ(kv_cache_pages_evictable(kv), 0);
	CHECK_EQ(kv_cache_pages_free(kv), 6);
	kv_seq_free(kv, &b);
	kv_seq_free(kv, &c);
	kv_cache_free(kv);
}

TEST(kv_prefix_free_pages_first_then_lru_order)
{
	kv_cache *kv = cache_new(6);
	ds_err e = {0};
	int32_t x[8], y[8];
	ids_seq(x, 8, 1000);
	ids_seq(y, 8, 2000);
	kv_seq a = {0}, b = {0}, c = {0}, d = {0};
	fill(kv, &a, x, 8); /* pages for x: 2 */
	fill(kv, &b, y, 8); /* pages for y: 2 */
	int32_t x0 = a.blocks[0], x1 = a.blocks[1], y0 = b.blocks[0], y1 = b.blocks[1];
	kv_seq_free(kv, &a); /* LRU: x1, x0 (last block first) */
	kv_seq_free(kv, &b); /* LRU: x1, x0, y1, y0 */
	CHECK_EQ(kv_cache_pages_evictable(kv), 4);
	CHECK_EQ(kv_cache_pages_free(kv), 6);

	/* two truly free pages go first: nothing cached is lost */
	CHECK_EQ(kv_seq_reserve(kv, &c, 8, &e), DS_OK);
	CHECK_EQ(kv_cache_pages_cached(kv), 4);
	CHECK(c.blocks[0] != x0 && c.blocks[0] != x1 && c.blocks[0] != y0 && c.blocks[0] != y1);
	/* then the least recently released: x's last page, then x's first */
	CHECK_EQ(kv_seq_reserve(kv, &c, 12, &e), DS_OK);
	CHECK_EQ(c.blocks[2], x1);
	CHECK_EQ(kv_cache_pages_cached(kv), 3);
	/* x lost its second page: only its first still matches */
	CHECK_EQ(kv_seq_match(kv, &d, x, 8, &e), 4);
	CHECK_EQ(d.blocks[0], x0);
	kv_seq_free(kv, &d); /* x0 goes to the LRU tail: y1 is now the oldest */
	CHECK_EQ(kv_seq_reserve(kv, &c, 16, &e), DS_OK);
	CHECK_EQ(c.blocks[3], y1);
	CHECK_EQ(kv_seq_reserve(kv, &c, 20, &e), DS_OK);
	CHECK_EQ(c.blocks[4], y0);
	CHECK_EQ(kv_cache_pages_cached(kv), 1);
	d = (kv_seq){0};
	CHECK_EQ(kv_seq_match(kv, &d, y, 8, &e), 0);
	/* every page referenced or cached-evictable: 1 left, then none */
	CHECK_EQ(kv_cache_pages_free(kv), 1);
	CHECK_EQ(kv_seq_reserve(kv, &d, 8, &e), DS_EBUSY); /* 2 pages */
	CHECK_EQ(kv_seq_reserve(kv, &c, 24, &e), DS_OK);
	CHECK_EQ(c.blocks[5], x0);
	CHECK_EQ(kv_cache_pages_free(kv), 0);
	CHECK_EQ(kv_cache_pages_cached(kv), 0);
	kv_seq_free(kv, &c);
	CHECK_EQ(kv_cache_pages_free(kv), 6);
	CHECK_EQ(kv_cache_pages_evictable(kv), 0);
	kv_seq_free(kv, &d);
	kv_cache_free(kv);
}

/* A child page whose parent was evicted and refilled must not match under
 * the refilled parent, even when the request's ids equal the parent's new
 * ids followed by the child's: the child's rows were computed after the
 * parent's old contents. */
TEST(kv_prefix_refilled_parent_never_matches_old_child)
{
	kv_cache *kv = cache_new(4);
	ds_err e = {0};
	int32_t ab[8], cb[8];
	ids_seq(ab, 8, 10); /* pages A, B */
	memcpy(cb, ab, sizeof cb);
	for (int i = 0; i < PS; i++)
		cb[i] = 50 + i; /* C then B's ids */
	kv_seq s = {0}, hold_b = {0}, w = {0}, m = {0};
	fill(kv, &s, ab, 8);
	int32_t pa = s.blocks[0], pb = s.blocks[1];
	CHECK_EQ(kv_seq_match(kv, &m, ab, 8, &e), 8);
	kv_seq_free(kv, &m);
	m = (kv_seq){0};
	/* hold B alone (a view of one block), release A */
	kv_seq view_b = {.blocks = &pb, .n_blocks = 1, .cap = 1};
	CHECK_EQ(kv_seq_share(kv, &hold_b, &view_b, &e), DS_OK);
	kv_seq_free(kv, &s);
	CHECK_EQ(kv_cache_pages_evictable(kv), 1); /* A only */
	/* three pages: the two free ones, then A's, evicted */
	CHECK_EQ(kv_seq_reserve(kv, &w, 12, &e), DS_OK);
	CHECK_EQ(w.blocks[2], pa);
	CHECK_EQ(kv_cache_pages_cached(kv), 1); /* B */
	/* A's page now holds C, published as a first page */
	kv_seq view_c = {.blocks = &pa, .n_blocks = 1, .cap = 1};
	kv_seq_publish(kv, &view_c, 0, 1, cb);
	CHECK_EQ(kv_cache_pages_cached(kv), 2);
	/* C matches; B (parent page id == C's page) must not follow it */
	CHECK_EQ(kv_seq_match(kv, &m, cb, 8, &e), 4);
	CHECK_EQ(m.blocks[0], pa);
	kv_seq_free(kv, &m);
	/* nor does A-B match any more */
	m = (kv_seq){0};
	CHECK_EQ(kv_seq_match(kv, &m, ab, 8, &e), 0);
	kv_seq_free(kv, &m);
	kv_seq_free(kv, &w);
	kv_seq_free(kv, &hold_b);
	CHECK_EQ(kv_cache_pages_free(kv), 4);
	CHECK_EQ(kv_cache_pages_evictable(kv), 2);
	kv_cache_free(kv);
}

TEST(kv_prefix_key_is_a_chain)
{
	int32_t a[PS] = {1, 2, 3, 4}, b[PS] = {1, 2, 3, 5};
	uint64_t ka = kv_page_key(KV_ROOT_KEY, a, PS), kb = kv_page_key(KV_ROOT_KEY, b, PS);
	CHECK(ka != kb);
	CHECK(kv_page_key(ka, a, PS) != kv_page_key(kb, a, PS)); /* the parent counts */
	CHECK(kv_page_key(ka, a, PS) == kv_page_key(ka, a, PS));
}

/*
 * tok.c - byte-level BPE core: build from arrays, encode, decode, stream decode.
 *
 * Callers: tok_hf.c (tokenizer.json), later a GGUF loader, the engine and the
 * agent (prompt encoding, streamed output), tests/tools/tok_tool.c.
 * Calls: tok_pretok.c (split patterns), unicode.c (UTF-8, categories).
 *
 * Encoding pipeline (mirrors HF tokenizers for a BPE model with a ByteLevel
 * pre-tokenizer and decoder):
 *
 *   text --added-token split, pass 1 (tokens with normalized=false, raw text)
 *        --pass 2 on the gaps (normalized=true; the normalizer is the identity)
 *        --Split cascade on the remaining gaps (tok_pretok_run)
 *        --bytes -> initial symbols (byte_id[]) -> merges by (rank, position)
 *        --> ids
 *
 * Added-token matching is leftmost-longest over a byte trie; a rejected match
 * (single_word) is skipped as a whole, as the reference's aho-corasick
 * iterator does.  BPE: a binary heap of candidate merges keyed (rank, left
 * symbol index); a popped candidate is applied only if its two symbols are
 * still adjacent and still form the same pair, so the result equals "merge the
 * lowest-rank pair, leftmost first, until none is left".
 *
 * Thread rule: a built tok is read-only; each tok_encode call owns its scratch
 * (struct enc), so concurrent calls are safe.  Invariants: every id in
 * [0, n_ids) has an entry (present or not); byte_id[b] names the model token of
 * the single byte b or is -1; the merge table maps (left, right) to the rank
 * and id of the concatenation, which is a vocab entry.
 */
#include "engine/tok_impl.h"
#include "engine/unicode.h"

#include <stdlib.h>
#include <string.h>

#define TOK_IDS_DEFAULT_MAX ((size_t)64 << 20)
#define TOK_MAX_IDS ((size_t)1 << 30)
#define TOK_MAX_TEXT ((size_t)1 << 30) /* symbol indices are int32 */

/* ---- GPT-2 byte <-> unicode alphabet ----------------------------------------- */

/* Bytes that are printable Latin-1 (! .. ~, ¡ .. ¬, ® .. ÿ) stand for
 * themselves; the other 68 bytes, in increasing order, get U+0100, U+0101 ... */
static int byte_is_self(unsigned b)
{
	return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

uint32_t tok_byte_to_cp(unsigned char b)
{
	if (byte_is_self(b))
		return b;
	uint32_t n = 0;
	for (unsigned x = 0; x < b; x++)
		if (!byte_is_self(x))
			n++;
	return 0x100 + n;
}

int tok_cp_to_byte(uint32_t cp)
{
	if (cp < 0x100)
		return byte_is_self(cp) ? (int)cp : -1;
	if (cp >= 0x100 + 68)
		return -1;
	uint32_t n = 0;
	for (unsigned x = 0; x < 256; x++) {
		if (!byte_is_self(x)) {
			if (0x100 + n == cp)
				return (int)x;
			n++;
		}
	}
	return -1;
}

/* ---- the tokenizer -------------------------------------------------------------- */

struct entry {
	uint32_t raw_off, raw_len; /* model token in the byte-level alphabet (blob) */
	uint32_t txt_off, txt_len; /* what it decodes to (blob, NUL-terminated) */
	uint8_t present;           /* names a token */
	uint8_t model;             /* is a model (vocab) token */
	uint8_t special;           /* added token flagged special */
};

struct merge_slot {
	uint64_t key; /* (left << 32) | right */
	uint32_t rank;
	int32_t id; /* -1 = empty slot */
};

struct trie_node {
	int32_t child;   /* first child, -1 none */
	int32_t sibling; /* next sibling, -1 none */
	int32_t added;   /* index into tok.added, -1 when no token ends here */
	unsigned char byte;
};

struct trie {
	struct trie_node *node; /* node[0] is the root */
	size_t n, cap;
	unsigned char first[32]; /* bitset of first bytes */
};

struct tok {
	size_t n_ids;
	struct entry *ent;
	char *blob;
	size_t blob_len, blob_cap;

	int32_t *vhash; /* model tokens by raw form; -1 empty */
	size_t vmask;

	struct merge_slot *mtab;
	size_t mmask;

	int32_t byte_id[256];

	tok_added_token *added; /* content points into blob */
	size_t n_added;
	struct trie trie[2]; /* [0]: normalized=false (raw text), [1]: normalized=true */

	tok_match_fn *splits;
	size_t n_splits;

	int ignore_merges;
	int32_t unk_id, bos_id, eos_id;
	int add_bos;
	char *chat_template;
};

static uint64_t hash_bytes(const void *p, size_t n)
{
	const unsigned char *s = p;
	uint64_t h = 1469598103934665603ull;
	for (size_t i = 0; i < n; i++) {
		h ^= s[i];
		h *= 1099511628211ull;
	}
	return h ^ (h >> 29);
}

static uint64_t hash_pair(uint64_t key)
{
	key *= 0x9E3779B97F4A7C15ull;
	return key ^ (key >> 31);
}

static size_t pow2_at_least(size_t n)
{
	size_t p = 16;
	while (p < n)
		p <<= 1;
	return p;
}

/* Copies s into the blob (NUL-terminated); returns its offset. */
static uint32_t blob_put(tok *t, const char *s, size_t n)
{
	uint32_t off = (uint32_t)t->blob_len;
	if (n)
		memcpy(t->blob + t->blob_len, s, n);
	t->blob[t->blob_len + n] = '\0';
	t->blob_len += n + 1;
	return off;
}

static int32_t vocab_find_raw(const tok *t, const char *s, size_t n)
{
	if (!t->vhash)
		return -1;
	for (size_t h = hash_bytes(s, n) & t->vmask;; h = (h + 1) & t->vmask) {
		int32_t id = t->vhash[h];
		if (id < 0)
			return -1;
		const struct entry *e = &t->ent[id];
		if (e->raw_len == n && memcmp(t->blob + e->raw_off, s, n) == 0)
			return id;
	}
}

static const struct merge_slot *merge_find(const tok *t, int32_t a, int32_t b)
{
	uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
	for (size_t h = hash_pair(key) & t->mmask;; h = (h + 1) & t->mmask) {
		const struct merge_slot *s = &t->mtab[h];
		if (s->id < 0)
			return NULL;
		if (s->key == key)
			return s;
	}
}

/* Decodes a byte-level token to bytes; *ok = 0 when some character is outside
 * the alphabet (then the caller keeps the raw UTF-8, as the reference does). */
static size_t bytelevel_decode(const char *s, size_t n, char *out, int *ok)
{
	const unsigned char *u = (const unsigned char *)s;
	size_t i = 0, o = 0;
	*ok = 1;
	while (i < n) {
		uint32_t cp;
		i += utf8_decode(u + i, n - i, &cp);
		int b = tok_cp_to_byte(cp);
		if (b < 0) {
			*ok = 0;
			return 0;
		}
		out[o++] = (char)b;
	}
	return o;
}

static int trie_add(struct trie *tr, const char *s, size_t n, int32_t added)
{
	if (!tr->node) {
		tr->cap = 64;
		tr->node = malloc(tr->cap * sizeof *tr->node);
		if (!tr->node)
			return DS_ENOMEM;
		tr->node[0] = (struct trie_node){ -1, -1, -1, 0 };
		tr->n = 1;
	}
	int32_t cur = 0;
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)s[i];
		int32_t k = tr->node[cur].child;
		while (k >= 0 && tr->node[k].byte != c)
			k = tr->node[k].sibling;
		if (k < 0) {
			if (tr->n == tr->cap) {
				struct trie_node *nn = realloc(tr->node, tr->cap * 2 * sizeof *nn);
				if (!nn)
					return DS_ENOMEM;
				tr->node = nn;
				tr->cap *= 2;
			}
			k = (int32_t)tr->n++;
			tr->node[k] = (struct trie_node){ -1, tr->node[cur].child, -1, c };
			tr->node[cur].child = k;
		}
		cur = k;
	}
	if (tr->node[cur].added < 0) /* a repeated content keeps its first id */
		tr->node[cur].added = added;
	tr->first[(unsigned char)s[0] >> 3] |= (unsigned char)(1u << ((unsigned char)s[0] & 7));
	return 0;
}

/* Longest token of tr starting at s[i] (within s[..end)); its added index and
 * length, or -1. */
static int32_t trie_longest(const struct trie *tr, const char *s, size_t i, size_t end,
			    size_t *len)
{
	if (!tr->node)
		return -1;
	unsigned char c0 = (unsigned char)s[i];
	if (!(tr->first[c0 >> 3] & (1u << (c0 & 7))))
		return -1;
	int32_t cur = 0, best = -1;
	for (size_t j = i; j < end; j++) {
		unsigned char c = (unsigned char)s[j];
		int32_t k = tr->node[cur].child;
		while (k >= 0 && tr->node[k].byte != c)
			k = tr->node[k].sibling;
		if (k < 0)
			break;
		cur = k;
		if (tr->node[cur].added >= 0) {
			best = tr->node[cur].added;
			*len = j + 1 - i;
		}
	}
	return best;
}

void tok_build_default_params(tok_build_params *p)
{
	memset(p, 0, sizeof *p);
	p->unk_id = -1;
	p->bos_id = -1;
	p->eos_id = -1;
}

void tok_free(tok *t)
{
	if (!t)
		return;
	free(t->chat_template);
	free(t->splits);
	free(t->trie[1].node);
	free(t->trie[0].node);
	free(t->added);
	free(t->mtab);
	free(t->vhash);
	free(t->blob);
	free(t->ent);
	free(t);
}

static int check_id(int64_t id, size_t n_ids, const char *what, ds_err *err)
{
	if (id < -1 || id >= (int64_t)n_ids)
		return ds_err_set(err, DS_EINVAL, "%s id %lld is outside [0, %zu)", what, (long long)id,
				  n_ids);
	return 0;
}

static int build(const tok_build_params *p, tok **out, ds_err *err)
{
	int rc = 0;
	char *tmp = NULL;
	tok *t = calloc(1, sizeof *t);
	*out = NULL;
	if (!t)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	t->unk_id = p->unk_id;
	t->bos_id = p->bos_id;
	t->eos_id = p->eos_id;
	t->add_bos = p->add_bos;
	t->ignore_merges = p->ignore_merges;

	/* id space */
	size_t n_ids = p->n_vocab;
	size_t blob = 0, max_tok = 0;
	for (size_t i = 0; i < p->n_vocab; i++) {
		blob += 2 * (p->vocab[i].len + 1);
		if (p->vocab[i].len > max_tok)
			max_tok = p->vocab[i].len;
	}
	for (size_t i = 0; i < p->n_added; i++) {
		const tok_added_token *a = &p->added[i];
		if (a->id < 0 || (size_t)a->id >= TOK_MAX_IDS) {
			rc = ds_err_set(err, DS_EINVAL, "added token %zu: id %d is out of range", i,
					(int)a->id);
			goto out;
		}
		if (a->content.len == 0) {
			rc = ds_err_set(err, DS_EINVAL, "added token id %d has empty content", (int)a->id);
			goto out;
		}
		if ((size_t)a->id + 1 > n_ids)
			n_ids = (size_t)a->id + 1;
		blob += a->content.len + 1;
	}
	if (n_ids == 0 || n_ids > TOK_MAX_IDS) {
		rc = ds_err_set(err, DS_EINVAL, "vocabulary of %zu ids (must be 1..%zu)", n_ids,
				TOK_MAX_IDS);
		goto out;
	}
	if (blob >= UINT32_MAX) {
		rc = ds_err_set(err, DS_EINVAL, "vocabulary text of %zu bytes is too large", blob);
		goto out;
	}
	t->n_ids = n_ids;
	if ((rc = check_id(p->unk_id, n_ids, "unk", err)) || (rc = check_id(p->bos_id, n_ids, "bos", err)) ||
	    (rc = check_id(p->eos_id, n_ids, "eos", err)))
		goto out;

	t->ent = calloc(n_ids, sizeof *t->ent);
	t->blob = malloc(blob + 1);
	t->blob_cap = blob + 1;
	t->vmask = pow2_at_least(p->n_vocab * 2) - 1;
	t->vhash = malloc((t->vmask + 1) * sizeof *t->vhash);
	t->mmask = pow2_at_least(p->n_merges * 2) - 1;
	t->mtab = malloc((t->mmask + 1) * sizeof *t->mtab);
	t->added = calloc(p->n_added ? p->n_added : 1, sizeof *t->added);
	tmp = malloc(2 * max_tok + 16);
	if (!t->ent || !t->blob || !t->vhash || !t->mtab || !t->added || !tmp) {
		rc = ds_err_set(err, DS_ENOMEM, "out of memory for a vocabulary of %zu ids", n_ids);
		goto out;
	}
	memset(t->vhash, 0xff, (t->vmask + 1) * sizeof *t->vhash);
	for (size_t i = 0; i <= t->mmask; i++)
		t->mtab[i].id = -1;

	/* model tokens */
	for (size_t i = 0; i < p->n_vocab; i++) {
		const tok_str *v = &p->vocab[i];
		if (v->len == 0)
			continue;
		struct entry *e = &t->ent[i];
		if (vocab_find_raw(t, v->s, v->len) >= 0) {
			rc = ds_err_set(err, DS_EINVAL, "vocab: token \"%.*s\" appears twice (id %zu)",
					(int)(v->len > 64 ? 64 : v->len), v->s, i);
			goto out;
		}
		e->raw_off = blob_put(t, v->s, v->len);
		e->raw_len = (uint32_t)v->len;
		int ok;
		size_t n = bytelevel_decode(v->s, v->len, tmp, &ok);
		if (!ok) { /* not in the byte alphabet: decodes to its own UTF-8 */
			memcpy(tmp, v->s, v->len);
			n = v->len;
		}
		e->txt_off = blob_put(t, tmp, n);
		e->txt_len = (uint32_t)n;
		e->present = 1;
		e->model = 1;
		for (size_t h = hash_bytes(v->s, v->len) & t->vmask;; h = (h + 1) & t->vmask) {
			if (t->vhash[h] < 0) {
				t->vhash[h] = (int32_t)i;
				break;
			}
		}
	}
	for (unsigned b = 0; b < 256; b++) {
		unsigned char u[4];
		size_t n = utf8_encode(tok_byte_to_cp((unsigned char)b), u);
		t->byte_id[b] = vocab_find_raw(t, (const char *)u, n);
	}

	/* merges */
	for (size_t k = 0; k < p->n_merges; k++) {
		const tok_str *l = &p->merges[2 * k], *r = &p->merges[2 * k + 1];
		int32_t a = vocab_find_raw(t, l->s, l->len), b = vocab_find_raw(t, r->s, r->len);
		if (a < 0 || b < 0) {
			const tok_str *bad = a < 0 ? l : r;
			rc = ds_err_set(err, DS_EINVAL, "merge %zu: token \"%.*s\" is not in the vocab", k,
					(int)(bad->len > 64 ? 64 : bad->len), bad->s);
			goto out;
		}
		memcpy(tmp, l->s, l->len);
		memcpy(tmp + l->len, r->s, r->len);
		int32_t c = vocab_find_raw(t, tmp, l->len + r->len);
		if (c < 0) {
			rc = ds_err_set(err, DS_EINVAL, "merge %zu: \"%.*s\" + \"%.*s\" is not in the vocab",
					k, (int)(l->len > 64 ? 64 : l->len), l->s,
					(int)(r->len > 64 ? 64 : r->len), r->s);
			goto out;
		}
		uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
		for (size_t h = hash_pair(key) & t->mmask;; h = (h + 1) & t->mmask) {
			struct merge_slot *s = &t->mtab[h];
			if (s->id < 0 || s->key == key) { /* a repeated pair: the later rank wins */
				s->key = key;
				s->rank = (uint32_t)k;
				s->id = c;
				break;
			}
		}
	}

	/* added tokens: they take over their id for decoding */
	for (size_t i = 0; i < p->n_added; i++) {
		const tok_added_token *a = &p->added[i];
		tok_added_token *d = &t->added[t->n_added];
		d->id = a->id;
		d->flags = a->flags;
		uint32_t off = blob_put(t, a->content.s, a->content.len);
		d->content.s = t->blob + off;
		d->content.len = a->content.len;
		struct entry *e = &t->ent[a->id];
		e->txt_off = off;
		e->txt_len = (uint32_t)a->content.len;
		e->present = 1;
		e->special = (a->flags & TOK_ADDED_SPECIAL) != 0;
		if ((rc = trie_add(&t->trie[(a->flags & TOK_ADDED_NORMALIZED) ? 1 : 0], a->content.s,
				   a->content.len, (int32_t)t->n_added)) != 0) {
			ds_err_set(err, rc, "out of memory for the added tokens");
			goto out;
		}
		t->n_added++;
	}

	/* pre-tokenizer */
	if (p->n_splits) {
		t->splits = calloc(p->n_splits, sizeof *t->splits);
		if (!t->splits) {
			rc = ds_err_set(err, DS_ENOMEM, "out of memory");
			goto out;
		}
		for (size_t i = 0; i < p->n_splits; i++) {
			t->splits[i] = tok_pretok_lookup(p->splits[i]);
			if (!t->splits[i]) {
				rc = ds_err_set(err, DS_EUNSUPPORTED,
						"pre-tokenizer pattern not supported: \"%s\"", p->splits[i]);
				goto out;
			}
		}
		t->n_splits = p->n_splits;
	}
	if (p->chat_template && !(t->chat_template = strdup(p->chat_template))) {
		rc = ds_err_set(err, DS_ENOMEM, "out of memory");
		goto out;
	}
	*out = t;
	t = NULL;
out:
	free(tmp);
	tok_free(t);
	return rc;
}

tok *tok_new(const tok_build_params *p, ds_err *err)
{
	tok *t;
	return build(p, &t, err) == 0 ? t : NULL;
}

/* ---- ids ----------------------------------------------------------------------- */

void tok_ids_init(tok_ids *ids, size_t max)
{
	memset(ids, 0, sizeof *ids);
	ids->max = max ? max : TOK_IDS_DEFAULT_MAX;
}

void tok_ids_free(tok_ids *ids)
{
	if (!ids)
		return;
	free(ids->v);
	ids->v = NULL;
	ids->n = ids->alloc = 0;
}

/* 0, DS_ERANGE past max, DS_ENOMEM. */
static int tok_ids_push(tok_ids *ids, int32_t id)
{
	if (ids->n >= ids->max)
		return DS_ERANGE;
	if (ids->n == ids->alloc) {
		size_t na = ids->alloc ? ids->alloc * 2 : 64;
		if (na > ids->max)
			na = ids->max;
		int32_t *v = realloc(ids->v, na * sizeof *v);
		if (!v)
			return DS_ENOMEM;
		ids->v = v;
		ids->alloc = na;
	}
	ids->v[ids->n++] = id;
	return 0;
}

/* ---- encode -------------------------------------------------------------------- */

struct sym {
	int32_t id;
	int32_t prev, next;
	uint32_t len; /* bytes; 0 = merged into its left neighbour */
};

struct cand {
	uint32_t rank;
	int32_t pos; /* left symbol */
	int32_t id;  /* result of the merge */
};

struct enc {
	const tok *t;
	tok_ids *out;
	const char *text;
	tok_cpbuf cpb;
	struct sym *sym;
	size_t sym_cap;
	struct cand *heap;
	size_t heap_n, heap_cap;
	char *raw; /* byte-level form of a piece (ignore_merges) */
	size_t raw_cap;
};

static int cand_less(const struct cand *a, const struct cand *b)
{
	return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(struct enc *e, struct cand c)
{
	size_t i = e->heap_n++;
	e->heap[i] = c;
	while (i > 0) {
		size_t p = (i - 1) / 2;
		if (!cand_less(&e->heap[i], &e->heap[p]))
			break;
		struct cand x = e->heap[p];
		e->heap[p] = e->heap[i];
		e->heap[i] = x;
		i = p;
	}
}

static struct cand heap_pop(struct enc *e)
{
	struct cand top = e->heap[0];
	e->heap[0] = e->heap[--e->heap_n];
	size_t i = 0;
	for (;;) {
		size_t l = 2 * i + 1, r = l + 1, m = i;
		if (l < e->heap_n && cand_less(&e->heap[l], &e->heap[m]))
			m = l;
		if (r < e->heap_n && cand_less(&e->heap[r], &e->heap[m]))
			m = r;
		if (m == i)
			break;
		struct cand x = e->heap[m];
		e->heap[m] = e->heap[i];
		e->heap[i] = x;
		i = m;
	}
	return top;
}

static void try_pair(struct enc *e, int32_t left)
{
	if (left < 0)
		return;
	int32_t right = e->sym[left].next;
	if (right < 0)
		return;
	const struct merge_slot *m = merge_find(e->t, e->sym[left].id, e->sym[right].id);
	if (m)
		heap_push(e, (struct cand){ m->rank, left, m->id });
}

static int emit(struct enc *e, int32_t id)
{
	return tok_ids_push(e->out, id);
}

/* BPE over the bytes text[start..end). */
static int bpe_piece(void *ctx, size_t start, size_t end)
{
	struct enc *e = ctx;
	const tok *t = e->t;
	const unsigned char *s = (const unsigned char *)e->text + start;
	size_t n = end - start;
	int rc;

	if (n == 1) {
		int32_t id = t->byte_id[s[0]];
		if (id < 0)
			id = t->unk_id;
		return id < 0 ? 0 : emit(e, id);
	}
	if (t->ignore_merges) {
		if (n * 2 > e->raw_cap) {
			char *r = realloc(e->raw, n * 2);
			if (!r)
				return DS_ENOMEM;
			e->raw = r;
			e->raw_cap = n * 2;
		}
		size_t k = 0;
		for (size_t i = 0; i < n; i++)
			k += utf8_encode(tok_byte_to_cp(s[i]), (unsigned char *)e->raw + k);
		int32_t id = vocab_find_raw(t, e->raw, k);
		if (id >= 0)
			return emit(e, id);
	}
	if (n > e->sym_cap) {
		size_t cap = e->sym_cap ? e->sym_cap : 64;
		while (cap < n)
			cap *= 2;
		struct sym *sy = realloc(e->sym, cap * sizeof *sy);
		if (!sy)
			return DS_ENOMEM;
		e->sym = sy;
		struct cand *h = realloc(e->heap, cap * 2 * sizeof *h);
		if (!h)
			return DS_ENOMEM;
		e->heap = h;
		e->sym_cap = cap;
		e->heap_cap = cap * 2;
	}
	/* initial symbols: one per byte; a byte missing from the vocab becomes unk
	 * or is dropped (its neighbours then touch, as in the reference) */
	int32_t ns = 0, first = -1, last = -1;
	for (size_t i = 0; i < n; i++) {
		int32_t id = t->byte_id[s[i]];
		if (id < 0)
			id = t->unk_id;
		if (id < 0)
			continue;
		e->sym[ns] = (struct sym){ id, last, -1, 1 };
		if (last >= 0)
			e->sym[last].next = ns;
		else
			first = ns;
		last = ns++;
	}
	e->heap_n = 0;
	for (int32_t i = 0; i + 1 < ns; i++)
		try_pair(e, i);
	/* each merge pushes at most 2 candidates and removes a symbol, so the heap
	 * never holds more than 3n entries; it was sized 2n: grow when needed */
	while (e->heap_n) {
		struct cand c = heap_pop(e);
		struct sym *l = &e->sym[c.pos];
		if (l->len == 0 || l->next < 0)
			continue;
		struct sym *r = &e->sym[l->next];
		const struct merge_slot *m = merge_find(t, l->id, r->id);
		if (!m || m->id != c.id)
			continue;
		l->id = c.id;
		l->len += r->len;
		r->len = 0;
		l->next = r->next;
		if (r->next >= 0)
			e->sym[r->next].prev = c.pos;
		if (e->heap_n + 2 > e->heap_cap) {
			struct cand *h = realloc(e->heap, e->heap_cap * 2 * sizeof *h);
			if (!h)
				return DS_ENOMEM;
			e->heap = h;
			e->heap_cap *= 2;
		}
		try_pair(e, l->prev);
		try_pair(e, c.pos);
	}
	for (int32_t i = first; i >= 0; i = e->sym[i].next)
		if ((rc = emit(e, e->sym[i].id)) != 0)
			return rc;
	return 0;
}

/* A gap between added tokens: pre-tokenize and BPE. */
static int encode_plain(struct enc *e, size_t start, size_t end)
{
	const tok *t = e->t;
	if (start >= end)
		return 0;
	if (t->n_splits == 0)
		return bpe_piece(e, start, end);
	int rc = tok_cpbuf_fill(&e->cpb, e->text + start, end - start);
	if (rc)
		return rc;
	/* piece offsets come back relative to start: shift the text view */
	const char *saved = e->text;
	e->text = saved + start;
	rc = tok_pretok_run(t->splits, t->n_splits, &e->cpb, bpe_piece, e);
	e->text = saved;
	return rc;
}

/* Code point ending at s[pos] (exclusive), scanning back; UNI_INVALID_BASE+byte
 * when the bytes there are not a well-formed sequence.  *len = its bytes. */
static uint32_t cp_before(const char *s, size_t lo, size_t pos, size_t *len)
{
	const unsigned char *u = (const unsigned char *)s;
	size_t k = 1;
	while (k < 4 && pos - k > lo && (u[pos - k] & 0xC0) == 0x80)
		k++;
	uint32_t cp;
	if (utf8_decode(u + pos - k, k, &cp) == k && cp <= UNI_MAX) {
		*len = k;
		return cp;
	}
	*len = 1;
	return UNI_INVALID_BASE + u[pos - 1];
}

static int is_word_cp(uint32_t cp)
{
	/* stands in for Rust's char::is_alphanumeric (Alphabetic or Numeric) */
	return (uni_class(cp) & (UNI_L | UNI_N)) != 0;
}

/* One added-token pass over text[start..end); gaps go to the next pass. */
static int encode_added(struct enc *e, int pass, size_t start, size_t end)
{
	const tok *t = e->t;
	const struct trie *tr = &t->trie[pass];
	const char *s = e->text;
	size_t gap = start, i = start;
	int rc;
	if (!tr->node)
		return pass == 0 ? encode_added(e, 1, start, end) : encode_plain(e, start, end);
	while (i < end) {
		size_t mlen = 0;
		int32_t ai = trie_longest(tr, s, i, end, &mlen);
		if (ai < 0) {
			i++;
			continue;
		}
		const tok_added_token *a = &t->added[ai];
		size_t ms = i, me = i + mlen;
		if (a->flags & TOK_ADDED_SINGLE_WORD) {
			size_t k;
			uint32_t c;
			int left_word = 0, right_word = 0;
			if (ms > start) {
				c = cp_before(s, start, ms, &k);
				left_word = is_word_cp(c);
			}
			if (me < end) {
				utf8_decode((const unsigned char *)s + me, end - me, &c);
				right_word = is_word_cp(c);
			}
			if (left_word || right_word) {
				i = me; /* the match is skipped whole */
				continue;
			}
		}
		if (a->flags & TOK_ADDED_LSTRIP) {
			while (ms > gap) {
				size_t k;
				uint32_t c = cp_before(s, start, ms, &k);
				if (!(uni_class(c) & UNI_WS))
					break;
				ms -= k;
			}
		}
		if (a->flags & TOK_ADDED_RSTRIP) {
			while (me < end) {
				uint32_t c;
				size_t k = utf8_decode((const unsigned char *)s + me, end - me, &c);
				if (!(uni_class(c) & UNI_WS))
					break;
				me += k;
			}
		}
		if (gap < ms) {
			rc = pass == 0 ? encode_added(e, 1, gap, ms) : encode_plain(e, gap, ms);
			if (rc)
				return rc;
		}
		if ((rc = emit(e, a->id)) != 0)
			return rc;
		i = gap = me;
	}
	if (gap < end)
		return pass == 0 ? encode_added(e, 1, gap, end) : encode_plain(e, gap, end);
	return 0;
}

int tok_encode(const tok *t, const char *text, size_t len, unsigned flags, tok_ids *out,
	       ds_err *err)
{
	struct enc e = { .t = t, .out = out, .text = text };
	size_t n0 = out->n;
	int rc = 0;
	if (len > TOK_MAX_TEXT)
		return ds_err_set(err, DS_ERANGE, "text of %zu bytes: at most %zu can be encoded at once",
				  len, TOK_MAX_TEXT);
	if ((flags & TOK_ADD_BOS) && t->bos_id >= 0 && (rc = emit(&e, t->bos_id)) != 0)
		goto out;
	if (flags & TOK_PARSE_SPECIAL)
		rc = encode_added(&e, 0, 0, len);
	else
		rc = encode_plain(&e, 0, len);
out:
	if (rc == DS_ERANGE)
		ds_err_set(err, rc, "encoding %zu bytes: more than %zu ids", len, out->max);
	else if (rc)
		ds_err_set(err, rc, "encoding %zu bytes: out of memory", len);
	if (rc)
		out->n = n0;
	tok_cpbuf_free(&e.cpb);
	free(e.sym);
	free(e.heap);
	free(e.raw);
	return rc;
}

int tok_encode_alloc(const tok *t, const char *text, size_t len, unsigned flags, int32_t **ids,
		     size_t *n, ds_err *err)
{
	tok_ids v;
	tok_ids_init(&v, 0);
	*ids = NULL;
	*n = 0;
	int rc = tok_encode(t, text, len, flags, &v, err);
	if (rc) {
		tok_ids_free(&v);
		return rc;
	}
	if (!v.v && !(v.v = malloc(sizeof *v.v))) /* a valid pointer even for no ids */
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	*ids = v.v;
	*n = v.n;
	return 0;
}

/* ---- decode -------------------------------------------------------------------- */

static const struct entry *entry_of(const tok *t, int32_t id)
{
	if (id < 0 || (size_t)id >= t->n_ids || !t->ent[id].present)
		return NULL;
	return &t->ent[id];
}

int tok_decode(const tok *t, const int32_t *ids, size_t n, unsigned flags, buf *out, ds_err *err)
{
	size_t len0 = out->len;
	for (size_t i = 0; i < n; i++) {
		const struct entry *e = entry_of(t, ids[i]);
		if (!e) {
			out->len = len0;
			if (out->data)
				out->data[len0] = '\0';
			return ds_err_set(err, DS_EINVAL, "token id %d (at %zu) is not in the vocabulary",
					  (int)ids[i], i);
		}
		if ((flags & TOK_SKIP_SPECIAL) && e->special)
			continue;
		int rc = buf_append(out, t->blob + e->txt_off, e->txt_len);
		if (rc) {
			out->len = len0;
			if (out->data)
				out->data[len0] = '\0';
			return ds_err_set(err, rc, "decoding %zu ids: output over %zu bytes", n, out->max);
		}
	}
	return 0;
}

int tok_decode_alloc(const tok *t, const int32_t *ids, size_t n, char **text, size_t *len,
		     ds_err *err)
{
	buf b;
	buf_init(&b, 0);
	*text = NULL;
	*len = 0;
	int rc = tok_decode(t, ids, n, 0, &b, err);
	if (rc) {
		buf_free(&b);
		return rc;
	}
	*len = b.len;
	*text = buf_take(&b);
	if (!*text)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	return 0;
}

tok_stream *tok_stream_new(const tok *t)
{
	tok_stream *s = malloc(sizeof *s);
	if (s)
		tok_stream_init(s, t, 0);
	return s;
}

void tok_stream_free(tok_stream *s)
{
	free(s);
}

void tok_stream_init(tok_stream *s, const tok *t, unsigned flags)
{
	memset(s, 0, sizeof *s);
	s->t = t;
	s->flags = flags;
}

static const char replacement[3] = { (char)0xEF, (char)0xBF, (char)0xBD }; /* U+FFFD */

/* Appends the complete characters of p[0..n) to out, each ill-formed subpart
 * as U+FFFD; *tail gets the length of an incomplete sequence left at the end. */
static int stream_emit(buf *out, const unsigned char *p, size_t n, size_t *tail)
{
	size_t i = 0;
	int rc;
	*tail = 0;
	while (i < n) {
		size_t ok = utf8_valid_prefix(p + i, n - i);
		if (ok && (rc = buf_append(out, p + i, ok)) != 0)
			return rc;
		i += ok;
		if (i == n)
			break;
		size_t len;
		if (utf8_check(p + i, n - i, &len) == UTF8_INCOMPLETE) {
			*tail = n - i;
			return 0;
		}
		if ((rc = buf_append(out, replacement, sizeof replacement)) != 0)
			return rc;
		i += len;
	}
	return 0;
}

int tok_stream_feed(tok_stream *s, int32_t id, buf *out, ds_err *err)
{
	const struct entry *e = entry_of(s->t, id);
	if (!e)
		return ds_err_set(err, DS_EINVAL, "token id %d is not in the vocabulary", (int)id);
	if ((s->flags & TOK_SKIP_SPECIAL) && e->special)
		return 0;
	const unsigned char *txt = (const unsigned char *)s->t->blob + e->txt_off;
	size_t n = e->txt_len, used = 0, len0 = out->len, tail;
	int rc = 0;
	if (n == 0)
		return 0;
	if (s->ntail) {
		/* The held bytes are a proper prefix of a character: look at them
		 * with the first bytes of this token. */
		unsigned char tmp[8];
		size_t take = n < 4 ? n : 4, len;
		memcpy(tmp, s->tail, s->ntail);
		memcpy(tmp + s->ntail, txt, take);
		switch (utf8_check(tmp, s->ntail + take, &len)) {
		case UTF8_INCOMPLETE: /* still short: the whole token is held */
			memcpy(s->tail + s->ntail, txt, n);
			s->ntail += n;
			return 0;
		case UTF8_OK: /* completed by the first len - ntail bytes */
			rc = buf_append(out, tmp, len);
			used = len - s->ntail;
			break;
		default: /* ill-formed: the subpart is the held bytes plus the
			  * token bytes that still fitted before the one that broke it */
			rc = buf_append(out, replacement, sizeof replacement);
			used = len - s->ntail;
			break;
		}
		if (rc)
			goto fail;
	}
	if ((rc = stream_emit(out, txt + used, n - used, &tail)) != 0)
		goto fail;
	memcpy(s->tail, txt + n - tail, tail);
	s->ntail = tail;
	return 0;
fail:
	out->len = len0;
	if (out->data)
		out->data[len0] = '\0';
	return ds_err_set(err, rc, "streamed text over %zu bytes", out->max);
}

int tok_stream_flush(tok_stream *s, buf *out, ds_err *err)
{
	if (!s->ntail)
		return 0;
	s->ntail = 0;
	int rc = buf_append(out, replacement, sizeof replacement);
	if (rc)
		return ds_err_set(err, rc, "streamed text over %zu bytes", out->max);
	return 0;
}

/* ---- queries ----------------------------------------------------------------------- */

int32_t tok_vocab_size(const tok *t)
{
	return (int32_t)t->n_ids;
}

int32_t tok_bos_id(const tok *t)
{
	return t->bos_id;
}

int32_t tok_eos_id(const tok *t)
{
	return t->eos_id;
}

void tok_set_special_ids(tok *t, int32_t bos, int32_t eos)
{
	t->bos_id = bos;
	t->eos_id = eos;
}

int tok_add_bos_default(const tok *t)
{
	return t->add_bos;
}

const char *tok_chat_template(const tok *t)
{
	return t->chat_template;
}

const char *tok_token_text(const tok *t, int32_t id, size_t *len)
{
	const struct entry *e = entry_of(t, id);
	if (!e)
		return NULL;
	if (len)
		*len = e->txt_len;
	return t->blob + e->txt_off;
}

int tok_token_is_special(const tok *t, int32_t id)
{
	const struct entry *e = entry_of(t, id);
	return e && e->special;
}

int32_t tok_find_token(const tok *t, const char *text, size_t len)
{
	if (len == 0)
		return -1;
	for (int pass = 0; pass < 2; pass++) {
		size_t mlen = 0;
		int32_t ai = trie_longest(&t->trie[pass], text, 0, len, &mlen);
		if (ai >= 0 && mlen == len)
			return t->added[ai].id;
	}
	if (len > 4096)
		return -1;
	char raw[4096 * 2];
	size_t k = 0;
	for (size_t i = 0; i < len; i++)
		k += utf8_encode(tok_byte_to_cp((unsigned char)text[i]), (unsigned char *)raw + k);
	int32_t id = vocab_find_raw(t, raw, k);
	size_t tl;
	const char *tt = id >= 0 ? tok_token_text(t, id, &tl) : NULL;
	if (tt && tl == len && memcmp(tt, text, len) == 0)
		return id;
	return -1;
}

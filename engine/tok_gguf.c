/*
 * tok_gguf.c - tok_load_gguf / tok_gguf_meta_read: a tokenizer from a GGUF
 * file's tokenizer.ggml.* metadata, turned into tok_build_params for tok_new.
 *
 * Callers: the model loader (dsrun -m FILE.gguf), tests/tools/gguf_tool.c.
 * Calls gguf.h (metadata getters), tok_pretok_preset, tok_new.  Thread rule:
 * no shared state; the gguf_file is only read.
 *
 * Keys read (as llama.cpp's converter writes them):
 *   tokenizer.ggml.model        "gpt2" (byte-level BPE); "llama" and others are
 *                               refused with the model named
 *   tokenizer.ggml.pre          pre-tokenizer family -> tok_pretok_preset
 *   tokenizer.ggml.tokens       string[n]: token i's text; normal tokens in the
 *                               GPT-2 byte alphabet, control / user-defined
 *                               tokens as their plain text
 *   tokenizer.ggml.token_type   int[n] (optional; all normal when absent)
 *   tokenizer.ggml.merges       string[m]: "left right", rank = index
 *   tokenizer.ggml.{bos,eos,unknown,padding,eot,eom}_token_id, add_bos_token,
 *   add_eos_token, tokenizer.chat_template
 * Integer keys are accepted in any integer type (converters differ).
 *
 * Invariants of the params handed to tok_new: vocab[] has one entry per token
 * id (len 0 for unused, empty or repeated texts); every added token is a
 * control or user-defined id with non-empty content; merges point into the
 * mapping of g (tok_new copies them).
 */
#include "engine/gguf.h"
#include "engine/tok_impl.h"

#include <stdlib.h>
#include <string.h>

#define K_MODEL "tokenizer.ggml.model"
#define K_PRE "tokenizer.ggml.pre"
#define K_TOKENS "tokenizer.ggml.tokens"
#define K_TYPES "tokenizer.ggml.token_type"
#define K_MERGES "tokenizer.ggml.merges"
#define K_TEMPLATE "tokenizer.chat_template"
#define MAX_TOKENS ((size_t)1 << 30)

/* tokenizer.ggml.token_type values (llama.cpp's llama_token_type). */
enum {
	TT_UNDEFINED = 0,
	TT_NORMAL = 1,
	TT_UNKNOWN = 2,
	TT_CONTROL = 3,
	TT_USER_DEFINED = 4,
	TT_UNUSED = 5,
	TT_BYTE = 6,
};

static int is_llama3_pre(const char *pre)
{
	return pre && (strcmp(pre, "llama-bpe") == 0 || strcmp(pre, "llama3") == 0);
}

/* An optional id key: -1 when absent.  strict: out of [0, n) is an error,
 * else it counts as absent. */
static int read_id(const gguf_file *g, const char *key, size_t n, int strict, int32_t *out,
		   ds_err *err)
{
	int64_t v;
	ds_err e = { 0 };
	*out = -1;
	int rc = gguf_get_int(g, key, INT64_MIN, INT64_MAX, &v, &e);
	if (rc == DS_ENOTFOUND)
		return DS_OK;
	if (rc == DS_ERANGE && !strict) /* a u64 above INT64_MAX */
		return DS_OK;
	if (rc) {
		*err = e;
		return rc;
	}
	if (v < 0 || (uint64_t)v >= n) {
		if (!strict)
			return DS_OK;
		return ds_err_set(err, DS_EFORMAT, "%s: %s = %lld is not a token id (the vocabulary "
				  "has %zu)", gguf_path(g), key, (long long)v, n);
	}
	*out = (int32_t)v;
	return DS_OK;
}

/* An optional bool key; *out untouched when absent. */
static int read_flag(const gguf_file *g, const char *key, int *out, ds_err *err)
{
	int rc = gguf_get_bool(g, key, out, err);
	if (rc == DS_ENOTFOUND) {
		ds_err_clear(err);
		return DS_OK;
	}
	return rc;
}

int tok_gguf_meta_read(const gguf_file *g, tok_gguf_meta *m, ds_err *err)
{
	ds_err local = { 0 };
	gguf_arr toks;
	int rc;
	if (!err)
		err = &local;
	memset(m, 0, sizeof *m);
	if ((rc = gguf_get_str(g, K_MODEL, &m->model, NULL, err)) != 0)
		return rc;
	rc = gguf_get_str(g, K_PRE, &m->pre, NULL, err);
	if (rc == DS_ENOTFOUND)
		m->pre = NULL;
	else if (rc)
		return rc;
	rc = gguf_get_str(g, K_TEMPLATE, &m->chat_template, NULL, err);
	if (rc == DS_ENOTFOUND)
		m->chat_template = NULL;
	else if (rc)
		return rc;
	ds_err_clear(err);
	if ((rc = gguf_get_arr(g, K_TOKENS, GGUF_TYPE_STRING, &toks, err)) != 0)
		return rc;
	m->n_tokens = (size_t)toks.n;
	static const struct {
		const char *key;
		size_t off;
		int strict;
	} ids[] = {
		{ "tokenizer.ggml.bos_token_id", offsetof(tok_gguf_meta, bos), 1 },
		{ "tokenizer.ggml.eos_token_id", offsetof(tok_gguf_meta, eos), 1 },
		{ "tokenizer.ggml.eot_token_id", offsetof(tok_gguf_meta, eot), 1 },
		{ "tokenizer.ggml.eom_token_id", offsetof(tok_gguf_meta, eom), 1 },
		{ "tokenizer.ggml.unknown_token_id", offsetof(tok_gguf_meta, unk), 0 },
		{ "tokenizer.ggml.padding_token_id", offsetof(tok_gguf_meta, pad), 0 },
	};
	for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
		int32_t *slot = (int32_t *)(void *)((char *)m + ids[i].off);
		if ((rc = read_id(g, ids[i].key, m->n_tokens, ids[i].strict, slot, err)) != 0)
			return rc;
	}
	m->add_bos = is_llama3_pre(m->pre);
	if ((rc = read_flag(g, "tokenizer.ggml.add_bos_token", &m->add_bos, err)) != 0 ||
	    (rc = read_flag(g, "tokenizer.ggml.add_eos_token", &m->add_eos, err)) != 0)
		return rc;
	return DS_OK;
}

/* ---- duplicate texts: a set of token ids keyed by their text ---------------------- */

static uint64_t hash_bytes(const char *s, size_t n)
{
	uint64_t h = 1469598103934665603ull;
	for (size_t i = 0; i < n; i++) {
		h ^= (unsigned char)s[i];
		h *= 1099511628211ull;
	}
	return h ^ (h >> 29);
}

/* 1 when vocab already holds s (as an earlier id), else inserts id and returns 0. */
static int seen_before(int32_t *set, size_t mask, const tok_str *vocab, const char *s, size_t n,
		       int32_t id)
{
	for (size_t h = hash_bytes(s, n) & mask;; h = (h + 1) & mask) {
		int32_t k = set[h];
		if (k < 0) {
			set[h] = id;
			return 0;
		}
		if (vocab[k].len == n && memcmp(vocab[k].s, s, n) == 0)
			return 1;
	}
}

/* ---- the loader ----------------------------------------------------------------------- */

struct scratch {
	tok_str *vocab, *merges;
	tok_added_token *added;
	int32_t *set;
};

static int fill_vocab(const gguf_file *g, const gguf_arr *toks, const gguf_arr *types,
		      tok_build_params *p, struct scratch *s, ds_err *err)
{
	size_t n = (size_t)toks->n, mask = 16;
	while (mask < 2 * n)
		mask <<= 1;
	s->vocab = calloc(n, sizeof *s->vocab);
	s->added = calloc(n, sizeof *s->added);
	s->set = malloc(mask * sizeof *s->set);
	if (!s->vocab || !s->added || !s->set)
		return ds_err_set(err, DS_ENOMEM, "%s: out of memory for %zu tokens", gguf_path(g), n);
	memset(s->set, 0xff, mask * sizeof *s->set);
	mask--;
	size_t n_added = 0;
	for (size_t i = 0; i < n; i++) {
		size_t len;
		const char *text = gguf_arr_str(toks, i, &len);
		int64_t type = types ? gguf_arr_i64(types, i) : TT_NORMAL;
		if (type < TT_UNDEFINED || type > TT_BYTE)
			return ds_err_set(err, DS_EFORMAT, "%s: %s[%zu] = %lld is not a token type "
					  "(0..6)", gguf_path(g), K_TYPES, i, (long long)type);
		if (type == TT_UNUSED || len == 0)
			continue;
		if (!seen_before(s->set, mask, s->vocab, text, len, (int32_t)i))
			s->vocab[i] = (tok_str){ text, len };
		if (type == TT_CONTROL || type == TT_USER_DEFINED)
			s->added[n_added++] = (tok_added_token){
				(int32_t)i, { text, len }, type == TT_CONTROL ? TOK_ADDED_SPECIAL : 0u
			};
	}
	p->vocab = s->vocab;
	p->n_vocab = n;
	p->added = s->added;
	p->n_added = n_added;
	return DS_OK;
}

static int fill_merges(const gguf_file *g, const gguf_arr *merges, tok_build_params *p,
		       struct scratch *s, ds_err *err)
{
	size_t n = (size_t)merges->n;
	s->merges = calloc(n ? 2 * n : 1, sizeof *s->merges);
	if (!s->merges)
		return ds_err_set(err, DS_ENOMEM, "%s: out of memory for %zu merges", gguf_path(g), n);
	for (size_t k = 0; k < n; k++) {
		size_t len;
		const char *m = gguf_arr_str(merges, k, &len);
		const char *sp = memchr(m, ' ', len);
		size_t left = sp ? (size_t)(sp - m) : 0;
		if (!sp || left == 0 || left + 1 == len || memchr(sp + 1, ' ', len - left - 1))
			return ds_err_set(err, DS_EFORMAT, "%s: %s[%zu] \"%.*s\" is not \"left right\"",
					  gguf_path(g), K_MERGES, k, (int)(len > 64 ? 64 : len), m);
		s->merges[2 * k] = (tok_str){ m, left };
		s->merges[2 * k + 1] = (tok_str){ sp + 1, len - left - 1 };
	}
	p->merges = s->merges;
	p->n_merges = n;
	return DS_OK;
}

static int load(const gguf_file *g, tok **out, ds_err *err)
{
	tok_gguf_meta m;
	tok_build_params p;
	struct scratch s = { 0 };
	gguf_arr toks, types, merges;
	int has_types, rc;
	*out = NULL;
	tok_build_default_params(&p);
	if ((rc = tok_gguf_meta_read(g, &m, err)) != 0)
		return rc;
	if (strcmp(m.model, "gpt2") != 0) {
		if (strcmp(m.model, "llama") == 0)
			return ds_err_set(err, DS_EUNSUPPORTED,
					  "%s: %s \"llama\" (SentencePiece) is not supported; only "
					  "byte-level BPE (\"gpt2\") is", gguf_path(g), K_MODEL);
		return ds_err_set(err, DS_EUNSUPPORTED,
				  "%s: %s \"%s\" is not supported; only byte-level BPE (\"gpt2\") is",
				  gguf_path(g), K_MODEL, m.model);
	}
	if (!m.pre)
		return ds_err_set(err, DS_EUNSUPPORTED, "%s: %s is missing, so the pre-tokenizer is "
				  "not known (known: %s)", gguf_path(g), K_PRE, tok_pretok_preset_names);
	if ((rc = tok_pretok_preset(m.pre, &p.splits, &p.n_splits, err)) != 0) {
		err->code = DS_EUNSUPPORTED;
		return ds_err_wrap(err, "%s: %s", gguf_path(g), K_PRE);
	}
	if (m.n_tokens == 0 || m.n_tokens > MAX_TOKENS)
		return ds_err_set(err, DS_EFORMAT, "%s: %s has %zu entries (1 .. %zu expected)",
				  gguf_path(g), K_TOKENS, m.n_tokens, MAX_TOKENS);
	if ((rc = gguf_get_arr(g, K_TOKENS, GGUF_TYPE_STRING, &toks, err)) != 0 ||
	    (rc = gguf_get_arr(g, K_MERGES, GGUF_TYPE_STRING, &merges, err)) != 0)
		return rc;
	rc = gguf_get_arr(g, K_TYPES, GGUF_TYPE_COUNT, &types, err);
	has_types = rc == 0;
	if (rc == DS_ENOTFOUND)
		ds_err_clear(err);
	else if (rc)
		return rc;
	if (has_types && (types.n != toks.n || !(types.type <= GGUF_TYPE_I32 ||
						  types.type == GGUF_TYPE_U64 ||
						  types.type == GGUF_TYPE_I64)))
		return ds_err_set(err, DS_EFORMAT, "%s: %s must be %zu integers, found %llu %s",
				  gguf_path(g), K_TYPES, m.n_tokens, (unsigned long long)types.n,
				  gguf_type_name(types.type));
	if ((rc = fill_vocab(g, &toks, has_types ? &types : NULL, &p, &s, err)) != 0 ||
	    (rc = fill_merges(g, &merges, &p, &s, err)) != 0)
		goto out;
	p.ignore_merges = is_llama3_pre(m.pre);
	p.unk_id = -1; /* byte-level: every byte has a token; a missing one is dropped */
	p.bos_id = m.bos;
	p.eos_id = m.eos;
	p.add_bos = m.add_bos;
	p.chat_template = m.chat_template;
	if (!(*out = tok_new(&p, err))) {
		rc = ds_err_wrap(err, "%s", gguf_path(g));
		goto out;
	}
out:
	free(s.set);
	free(s.merges);
	free(s.added);
	free(s.vocab);
	return rc;
}

tok *tok_load_gguf(const gguf_file *g, ds_err *err)
{
	ds_err local = { 0 };
	tok *t;
	if (load(g, &t, err ? err : &local) != 0)
		return NULL;
	return t;
}

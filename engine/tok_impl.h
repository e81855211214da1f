/*
 * tok_impl.h - private to the tokenizer module (tok.c, tok_pretok.c, tok_hf.c).
 */
#ifndef DS_ENGINE_TOK_IMPL_H
#define DS_ENGINE_TOK_IMPL_H

#include "engine/tok.h"

#include <stddef.h>
#include <stdint.h>

/* A split-pattern matcher: the length in code points of the match that the
 * pattern's regex finds when tried at position i of the piece cp[0..end)
 * (lookahead sees only the piece), 0 when it does not match at i.  cls[] holds
 * uni_class() of each cp.  None of the supported patterns can match empty. */
typedef size_t (*tok_match_fn)(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end);

/* The matcher of a known pattern string, or NULL. */
tok_match_fn tok_pretok_lookup(const char *pattern);

/* Text decoded to code points, with class bits and byte offsets
 * (off[i] = byte offset of cp[i]; off[n] = length).  Owned by one encoder. */
typedef struct tok_cpbuf {
	uint32_t *cp;
	uint8_t *cls;
	size_t *off;
	size_t n;
	size_t cap;
} tok_cpbuf;

void tok_cpbuf_free(tok_cpbuf *b);
/* Fills b from text[0..len); 0 or DS_ENOMEM. */
int tok_cpbuf_fill(tok_cpbuf *b, const char *text, size_t len);

/* Runs the Split (Isolated) cascade over b: fns[0] splits the whole text,
 * each later fns[k] re-splits every piece of fns[k-1]; calls fn with the byte
 * offsets of each final piece, in order.  Returns fn's first nonzero value. */
int tok_pretok_run(const tok_match_fn *fns, size_t nfns, const tok_cpbuf *b, tok_piece_fn fn,
		   void *ctx);

/* Sets BOS / EOS after construction (ids looked up by text; -1 = none).
 * Only for loaders, before the tok is shared. */
void tok_set_special_ids(tok *t, int32_t bos, int32_t eos);

#endif

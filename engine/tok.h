/*
 * tok.h - byte-level BPE tokenizer (DeepSeek-V3 / GPT-2 family).
 *
 * Three ways to make one:
 *   tok_load_hf()   parses a Hugging Face tokenizer.json (+ optional
 *                   tokenizer_config.json for BOS/EOS and the chat template);
 *   tok_load_gguf() reads a GGUF file's tokenizer.ggml.* metadata (tok_gguf.c);
 *   tok_new()       builds from plain arrays (vocab, merges, added tokens,
 *                   pre-tokenizer patterns): the core both loaders share.
 *
 * Encoding follows the HF `tokenizers` library: added tokens are split out
 * first (leftmost-longest), the rest is pre-tokenized by the Split patterns
 * (behavior Isolated, each pattern re-splitting the pieces of the one before),
 * bytes are mapped to the GPT-2 byte alphabet and merged by rank inside each
 * piece.  The split patterns are not run by a regex engine: each known pattern
 * string has a hand-written matcher (tok_pretok.c); an unknown pattern is
 * rejected with its text in the error.
 *
 * Thread rule: a tok is immutable after construction; encode/decode on one tok
 * may run from many threads at once.  A tok_stream belongs to one caller.
 * Ids are int32_t; every id in [0, tok_vocab_size) may or may not name a token
 * (holes are allowed and rejected by tok_decode).
 */
#ifndef DS_ENGINE_TOK_H
#define DS_ENGINE_TOK_H

#include "common/buf.h"
#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

typedef struct tok tok;

/* ---- construction ---------------------------------------------------------- */

typedef struct tok_str {
	const char *s; /* not NUL-terminated necessarily */
	size_t len;
} tok_str;

/* Flags of an added token (tokenizer.json added_tokens[]). */
enum {
	TOK_ADDED_SPECIAL = 1u << 0,     /* "special": skipped by TOK_SKIP_SPECIAL */
	TOK_ADDED_LSTRIP = 1u << 1,      /* swallows White_Space on its left when matched */
	TOK_ADDED_RSTRIP = 1u << 2,      /* ... and on its right */
	TOK_ADDED_NORMALIZED = 1u << 3,  /* matched after normalization (second pass) */
	TOK_ADDED_SINGLE_WORD = 1u << 4, /* matched only when neither neighbour is a
					  * letter or number (L/N; the reference uses
					  * Rust's is_alphanumeric, which also counts
					  * the few Other_Alphabetic marks) */
};

typedef struct tok_added_token {
	int32_t id;
	tok_str content; /* the exact text; also what decoding yields */
	unsigned flags;  /* TOK_ADDED_* */
} tok_added_token;

typedef struct tok_build_params {
	/* vocab[i] is token i in the byte-level alphabet (GPT-2 byte<->unicode map,
	 * UTF-8 encoded); len 0 = no model token with id i. */
	const tok_str *vocab;
	size_t n_vocab;
	/* merge k (rank k): merges[2k] + merges[2k+1]; their concatenation must be
	 * in vocab.  A repeated pair takes the rank of its last occurrence. */
	const tok_str *merges;
	size_t n_merges;
	const tok_added_token *added;
	size_t n_added;
	/* Split patterns (behavior Isolated), applied in order; each must be known
	 * to tok_pretok_known().  n_splits 0 = each added-token gap is one piece. */
	const char *const *splits;
	size_t n_splits;
	int ignore_merges;  /* a piece that is itself a vocab entry skips the merges */
	int32_t unk_id;     /* emitted for a byte missing from vocab; -1 = drop it */
	int32_t bos_id;     /* -1 = none */
	int32_t eos_id;     /* -1 = none */
	int add_bos;        /* tokenizer_config add_bos_token (informational) */
	const char *chat_template; /* copied; NULL = none */
} tok_build_params;

/* unk/bos/eos -1, everything else 0.  tok_new copies what it needs, so the
 * arrays of p may be freed once it returns. */
void tok_build_default_params(tok_build_params *p);

/* Builds a tokenizer (free with tok_free), or NULL with err filled: DS_EINVAL
 * (bad id, merge of unknown tokens), DS_EUNSUPPORTED (unknown pattern: the
 * message quotes it), DS_ENOMEM. */
tok *tok_new(const tok_build_params *p, ds_err *err);

/* Loads a HF tokenizer.json; config_path (may be NULL) is a
 * tokenizer_config.json giving bos_token / eos_token / add_bos_token /
 * chat_template.  NULL on failure with err filled: unsupported model or
 * normalizer / pre-tokenizer / decoder types are DS_EUNSUPPORTED with the type
 * named; unreadable file DS_EIO or DS_ENOTFOUND; malformed JSON DS_EFORMAT. */
tok *tok_load_hf(const char *path, const char *config_path, ds_err *err);

struct gguf_file;

/* What a GGUF file says about its tokenizer (tokenizer.ggml.*), read without
 * building it.  Strings are borrowed from the gguf_file.  Ids are -1 when the
 * key is absent; bos/eos/eot/eom outside [0, n_tokens) are an error,
 * unk/pad outside it count as absent (converters write -1 as u32 there). */
typedef struct tok_gguf_meta {
	const char *model;         /* tokenizer.ggml.model: "gpt2", "llama" ... */
	const char *pre;           /* tokenizer.ggml.pre, or NULL */
	size_t n_tokens;           /* tokenizer.ggml.tokens entries */
	int32_t bos, eos, unk, pad, eot, eom;
	int add_bos;               /* tokenizer.ggml.add_bos_token; absent: 1 for the
				    * llama-bpe (Llama 3) family, else 0 (as llama.cpp) */
	int add_eos;               /* 0 when absent */
	const char *chat_template; /* tokenizer.chat_template, or NULL */
} tok_gguf_meta;

/* 0, or DS_ENOTFOUND (no tokenizer.ggml.model / tokens), DS_EFORMAT (a key of
 * the wrong type, an id out of range); messages name the file and the key. */
int tok_gguf_meta_read(const struct gguf_file *g, tok_gguf_meta *m, ds_err *err);

/* Builds the tokenizer of a GGUF file (g may be closed afterwards: the tok
 * copies what it needs).  Supported: tokenizer.ggml.model "gpt2" (byte-level
 * BPE) with a tokenizer.ggml.pre that tok_pretok_preset knows.  Token types:
 * 1 normal, 2 unknown, 6 byte -> model tokens; 3 control -> model token plus
 * an added token flagged special; 4 user-defined -> model token plus an added
 * token not flagged special (both matched in text with TOK_PARSE_SPECIAL,
 * skipped by TOK_SKIP_SPECIAL only when control); 5 unused -> no token.  A
 * token text repeated later in the list keeps its first id.  BOS/EOS from
 * tokenizer.ggml.bos/eos_token_id, add_bos as tok_gguf_meta, the chat
 * template from tokenizer.chat_template; the llama-bpe family also sets
 * ignore_merges (as Llama 3's tokenizer.json does).
 * NULL with err filled: DS_EUNSUPPORTED (model "llama" = SentencePiece and
 * other models, unknown pre names: the message lists the known ones),
 * DS_EFORMAT (missing or mistyped keys, a merge that is not "a b" or names
 * unknown tokens), DS_ENOMEM. */
tok *tok_load_gguf(const struct gguf_file *g, ds_err *err);

void tok_free(tok *t);

/* Pre-tokenizer pattern registry.  Known patterns: GPT-2 (ByteLevel
 * use_regex), DeepSeek-V3's three, DeepSeek LLM's six (V2 / V2-Lite), Llama-3,
 * Qwen2, single digits (\p{N}).
 * tok_pretok_preset gives the Split list of a named family as GGUF
 * `tokenizer.ggml.pre` names them ("deepseek-llm", "deepseek-v3", "gpt-2" (alias "gpt2"),
 * "llama-bpe" (alias "llama3"), "qwen2", "smollm" = single digits then
 * GPT-2); DS_ENOTFOUND for others, with the known names in the message.  The
 * arrays are static. */
int tok_pretok_known(const char *pattern);
int tok_pretok_preset(const char *name, const char *const **patterns, size_t *n, ds_err *err);
extern const char tok_pretok_preset_names[]; /* "deepseek-v3, gpt2, ..." for messages */
extern const char tok_pattern_gpt2[];

/* Pre-tokenizes text (no added-token splitting) and calls fn for each piece
 * (byte offsets); for tests and tools.  Returns fn's first nonzero value. */
typedef int (*tok_piece_fn)(void *ctx, size_t start, size_t end);
int tok_pretokenize(const char *const *patterns, size_t n_patterns, const char *text, size_t len,
		    tok_piece_fn fn, void *ctx, ds_err *err);

/* ---- ids ---------------------------------------------------------------- */

/* A growable id array with a hard cap (like buf). */
typedef struct tok_ids {
	int32_t *v;
	size_t n;
	size_t alloc;
	size_t max; /* hard cap on n */
} tok_ids;

/* max 0 = 64 Mi ids. */
void tok_ids_init(tok_ids *ids, size_t max);
void tok_ids_free(tok_ids *ids);

/* ---- encode / decode ----------------------------------------------------- */

enum {
	TOK_ADD_BOS = 1u << 0,       /* prepend bos_id (ignored when there is none) */
	TOK_PARSE_SPECIAL = 1u << 1, /* match added tokens in the text (HF default);
				      * without it all text is ordinary text */
};

/* Appends the ids of text[0..len) to out.  Any bytes are accepted: invalid
 * UTF-8 bytes are tokenized as single bytes (category Cn), so decoding gives
 * them back.  DS_ERANGE when out would pass its cap (or text is over 1 GiB),
 * DS_ENOMEM; on failure out->n is back to its value at entry. */
int tok_encode(const tok *t, const char *text, size_t len, unsigned flags, tok_ids *out,
	       ds_err *err);
/* The same into a new array (*ids, caller frees with free(); *n ids). */
int tok_encode_alloc(const tok *t, const char *text, size_t len, unsigned flags, int32_t **ids,
		     size_t *n, ds_err *err);

enum {
	TOK_SKIP_SPECIAL = 1u << 0, /* leave out added tokens flagged special */
};

/* Appends the bytes of ids to out: model tokens through the byte-level map,
 * added tokens as their content.  The output may be invalid UTF-8 (a character
 * cut across ids, or ids that never form one): it is passed through as bytes.
 * DS_EINVAL for an id that names no token (out unchanged), DS_ERANGE past the
 * buf's cap. */
int tok_decode(const tok *t, const int32_t *ids, size_t n, unsigned flags, buf *out, ds_err *err);
/* The same (flags 0) into a new NUL-terminated string (*text, caller frees
 * with free(); *len bytes, may hold NULs from the ids). */
int tok_decode_alloc(const tok *t, const int32_t *ids, size_t n, char **text, size_t *len,
		     ds_err *err);

/* ---- streaming decode ----------------------------------------------------- */

/* Feeds ids one at a time and appends only complete UTF-8 characters; an
 * incomplete tail (a proper prefix of a well-formed sequence, <= 3 bytes) is
 * held until the next id.  A byte sequence that can never become well-formed
 * is emitted as U+FFFD, one per maximal ill-formed subpart (the Unicode
 * "best practice", as Python's errors="replace"); tok_stream_flush emits a
 * held incomplete tail as one U+FFFD.  So the output is always valid UTF-8. */
typedef struct tok_stream {
	const tok *t;
	unsigned flags;         /* TOK_SKIP_SPECIAL or 0 */
	unsigned char tail[4];  /* held incomplete sequence */
	size_t ntail;
} tok_stream;

void tok_stream_init(tok_stream *s, const tok *t, unsigned flags);
/* Heap versions of init (flags 0) for callers that keep a pointer; NULL on ENOMEM. */
tok_stream *tok_stream_new(const tok *t);
void tok_stream_free(tok_stream *s);
/* DS_EINVAL for an unknown id (state unchanged), DS_ERANGE past out's cap. */
int tok_stream_feed(tok_stream *s, int32_t id, buf *out, ds_err *err);
int tok_stream_flush(tok_stream *s, buf *out, ds_err *err);

/* ---- queries ---------------------------------------------------------------- */

/* 1 + the largest id of any token. */
int32_t tok_vocab_size(const tok *t);
int32_t tok_bos_id(const tok *t); /* -1 when unknown */
int32_t tok_eos_id(const tok *t); /* -1 when unknown */
int tok_add_bos_default(const tok *t);
/* tokenizer_config's chat_template (borrowed, lives as long as t), or NULL. */
const char *tok_chat_template(const tok *t);

/* The bytes id decodes to (borrowed, NUL-terminated, may be partial UTF-8),
 * with *len set when not NULL; NULL for an id that names no token. */
const char *tok_token_text(const tok *t, int32_t id, size_t *len);
/* 1 for an added token flagged special, else 0. */
int tok_token_is_special(const tok *t, int32_t id);
/* The id whose text (as tok_token_text gives it) is exactly text[0..len):
 * added tokens first, then model tokens; -1 when none. */
int32_t tok_find_token(const tok *t, const char *text, size_t len);

/* The GPT-2 byte<->unicode map: the code point byte b is written as, and the
 * byte of code point cp (-1 when cp is not in the alphabet). */
uint32_t tok_byte_to_cp(unsigned char b);
int tok_cp_to_byte(uint32_t cp);

#endif

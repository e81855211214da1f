/*
 * test_tok.c - unit tests of engine/unicode.c and the tokenizer (engine/tok*.c):
 * the GPT-2 byte table, category tables, strict UTF-8, every split pattern on
 * hand-made strings (expected pieces were taken from HF tokenizers once), BPE
 * merge order on a tiny hand-made vocab, added-token matching, invalid-byte
 * round trips, streaming decode, tokenizer.json parsing and its errors.
 * The comparison with HF on the real DeepSeek-V3 file is in
 * tests/integration/test_tokenizer.py.
 */
#include "common/buf.h"
#include "common/status.h"
#include "engine/chat.h"
#include "engine/tok.h"
#include "engine/unicode.h"
#include "tests/unit/unit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- unicode ----------------------------------------------------------------- */

TEST(uni_general_category_spot_checks)
{
	static const struct {
		uint32_t cp;
		enum uni_gc gc;
		int ws;
	} c[] = {
		{ 'A', UNI_GC_LU, 0 },     { 'z', UNI_GC_LL, 0 },     { '7', UNI_GC_ND, 0 },
		{ 0x0663, UNI_GC_ND, 0 },  { 0x216B, UNI_GC_NL, 0 },  { 0x00BD, UNI_GC_NO, 0 },
		{ 0x4E2D, UNI_GC_LO, 0 },  { 0x30FC, UNI_GC_LM, 0 },  { 0x01C5, UNI_GC_LT, 0 },
		{ 0x0301, UNI_GC_MN, 0 },  { 0x0903, UNI_GC_MC, 0 },  { 0x20DD, UNI_GC_ME, 0 },
		{ '!', UNI_GC_PO, 0 },     { '(', UNI_GC_PS, 0 },     { ')', UNI_GC_PE, 0 },
		{ '-', UNI_GC_PD, 0 },     { '_', UNI_GC_PC, 0 },     { 0x00AB, UNI_GC_PI, 0 },
		{ 0x00BB, UNI_GC_PF, 0 },  { '$', UNI_GC_SC, 0 },     { '+', UNI_GC_SM, 0 },
		{ '^', UNI_GC_SK, 0 },     { 0x1F600, UNI_GC_SO, 0 }, { ' ', UNI_GC_ZS, 1 },
		{ 0x00A0, UNI_GC_ZS, 1 },  { 0x3000, UNI_GC_ZS, 1 },  { 0x2028, UNI_GC_ZL, 1 },
		{ 0x2029, UNI_GC_ZP, 1 },  { '\t', UNI_GC_CC, 1 },    { '\n', UNI_GC_CC, 1 },
		{ 0x0085, UNI_GC_CC, 1 },  { 0x001C, UNI_GC_CC, 0 },  { 0x200B, UNI_GC_CF, 0 },
		{ 0x180E, UNI_GC_CF, 0 },  { 0xFEFF, UNI_GC_CF, 0 },  { 0xE000, UNI_GC_CO, 0 },
		{ 0x10FFFD, UNI_GC_CO, 0 }, { 0x10FFFF, UNI_GC_CN, 0 }, { 0x50000, UNI_GC_CN, 0 },
		{ 0xD800, UNI_GC_CS, 0 },  { 0x10D4A, UNI_GC_LO, 0 }, /* Garay: Unicode 16.0 */
		{ 0x20000, UNI_GC_LO, 0 }, { 0x0378, UNI_GC_CN, 0 },  { UNI_INVALID_BASE + 0x80, UNI_GC_CN, 0 },
	};
	for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
		if (uni_gc_of(c[i].cp) != c[i].gc)
			ut_fail(__FILE__, __LINE__, "U+%04X: %s, want %s", c[i].cp,
				uni_gc_name(uni_gc_of(c[i].cp)), uni_gc_name(c[i].gc));
		CHECK_EQ((uni_class(c[i].cp) & UNI_WS) != 0, c[i].ws);
	}
	CHECK_EQ(uni_class('A'), UNI_L);
	CHECK_EQ(uni_class(0x0301), UNI_M);
	CHECK_EQ(uni_class(' '), UNI_Z | UNI_WS);
	CHECK_EQ(uni_class('\r'), UNI_C | UNI_WS);
	CHECK_EQ(uni_class(0x00BD), UNI_N);
	CHECK_EQ(uni_class('~'), UNI_S);
	CHECK_STR(uni_version(), "16.0.0");
	CHECK_STR(uni_gc_name(UNI_GC_SO), "So");
}

TEST(utf8_strict_decoding)
{
	/* random code points round trip through encode/decode */
	for (int i = 0; i < 20000; i++) {
		uint32_t cp = (uint32_t)(ut_rand_u64() % (UNI_MAX + 1));
		if (cp >= 0xD800 && cp <= 0xDFFF)
			continue;
		unsigned char b[4];
		size_t n = utf8_encode(cp, b);
		uint32_t back;
		CHECK_EQ(utf8_decode(b, n, &back), n);
		CHECK_EQ(back, cp);
		size_t len;
		CHECK_EQ(utf8_check(b, n, &len), UTF8_OK);
		CHECK_EQ(len, n);
		if (n > 1) {
			CHECK_EQ(utf8_check(b, n - 1, &len), UTF8_INCOMPLETE);
		}
	}
	/* ill-formed input: one pseudo code point per byte, and the maximal
	 * ill-formed subpart lengths of Unicode's best practice */
	static const struct {
		const char *s;
		size_t n;
		int status;
		size_t len;
	} c[] = {
		{ "\xC0\x80", 2, UTF8_INVALID, 1 },         /* overlong */
		{ "\xE0\x80\x80", 3, UTF8_INVALID, 1 },     /* overlong */
		{ "\xED\xA0\x80", 3, UTF8_INVALID, 1 },     /* surrogate */
		{ "\xF4\x90\x80\x80", 4, UTF8_INVALID, 1 }, /* > U+10FFFF */
		{ "\xF5\x80", 2, UTF8_INVALID, 1 },
		{ "\x80", 1, UTF8_INVALID, 1 },             /* lone continuation */
		{ "\xE4\xB8\x41", 3, UTF8_INVALID, 2 },     /* cut by 'A' */
		{ "\xF0\x9F\x98\x41", 4, UTF8_INVALID, 3 },
		{ "\xE4\xB8", 2, UTF8_INCOMPLETE, 2 },
		{ "\xF0\x9F\x98", 3, UTF8_INCOMPLETE, 3 },
		{ "\xE4\xB8\xAD", 3, UTF8_OK, 3 },
	};
	for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
		size_t len = 0;
		const unsigned char *s = (const unsigned char *)c[i].s;
		CHECK_EQ(utf8_check(s, c[i].n, &len), c[i].status);
		CHECK_EQ(len, c[i].len);
		uint32_t cp;
		size_t k = utf8_decode(s, c[i].n, &cp);
		if (c[i].status == UTF8_OK) {
			CHECK_EQ(cp, 0x4E2D);
		} else {
			CHECK_EQ(k, 1);
			CHECK_EQ(cp, UNI_INVALID_BASE + s[0]);
		}
	}
	CHECK_EQ(utf8_valid_prefix((const unsigned char *)"ab\xE4\xB8\xAD\xE4\xB8", 7), 5);
}

/* ---- GPT-2 byte table ----------------------------------------------------------- */

TEST(tok_gpt2_byte_table)
{
	CHECK_EQ(tok_byte_to_cp('!'), '!');
	CHECK_EQ(tok_byte_to_cp('~'), '~');
	CHECK_EQ(tok_byte_to_cp(' '), 0x120);  /* Ġ */
	CHECK_EQ(tok_byte_to_cp('\n'), 0x10A); /* Ċ */
	CHECK_EQ(tok_byte_to_cp('\t'), 0x109); /* ĉ */
	CHECK_EQ(tok_byte_to_cp(0x00), 0x100);
	CHECK_EQ(tok_byte_to_cp(0x7F), 0x121);
	CHECK_EQ(tok_byte_to_cp(0xA0), 0x142);
	CHECK_EQ(tok_byte_to_cp(0xAD), 0x143);
	CHECK_EQ(tok_byte_to_cp(0xA1), 0xA1);
	CHECK_EQ(tok_byte_to_cp(0xFF), 0xFF);
	int seen[0x200] = { 0 };
	for (int b = 0; b < 256; b++) {
		uint32_t cp = tok_byte_to_cp((unsigned char)b);
		CHECK(cp < 0x144);
		CHECK_EQ(seen[cp]++, 0);
		CHECK_EQ(tok_cp_to_byte(cp), b);
	}
	CHECK_EQ(tok_cp_to_byte(' '), -1);
	CHECK_EQ(tok_cp_to_byte(0xAD), -1);
	CHECK_EQ(tok_cp_to_byte(0x144), -1);
	CHECK_EQ(tok_cp_to_byte(0x4E2D), -1);
}

/* ---- split patterns ---------------------------------------------------------------- */

struct pieces {
	const char *text;
	char out[512];
};

/* joins the pieces with '|' */
static int collect(void *ctx, size_t start, size_t end)
{
	struct pieces *p = ctx;
	size_t n = strlen(p->out);
	snprintf(p->out + n, sizeof p->out - n, "%s%.*s", n ? "|" : "", (int)(end - start),
		 p->text + start);
	return 0;
}

static void check_split(const char *preset, const char *text, const char *want, int line)
{
	const char *const *pats;
	size_t np;
	ds_err err = { 0 };
	struct pieces p = { text, "" };
	if (tok_pretok_preset(preset, &pats, &np, &err) != 0 ||
	    tok_pretokenize(pats, np, text, strlen(text), collect, &p, &err) != 0) {
		ut_fail(__FILE__, line, "%s", err.msg);
		return;
	}
	if (strcmp(p.out, want) != 0)
		ut_fail(__FILE__, line, "%s split of \"%s\": \"%s\", want \"%s\"", preset, text, p.out, want);
}

TEST(tok_split_deepseek_v3_patterns)
{
	check_split("deepseek-v3", "Hello world", "Hello| world", __LINE__);
	check_split("deepseek-v3", "12345", "123|45", __LINE__);
	check_split("deepseek-v3", "a  b", "a| | b", __LINE__);
	check_split("deepseek-v3", "x\n\n  y", "x|\n\n| | y", __LINE__);
	check_split("deepseek-v3", "don't", "don|'t", __LINE__);
	check_split("deepseek-v3", "你好abc", "你好|abc", __LINE__);
	check_split("deepseek-v3", "...\n\nx", "...\n\n|x", __LINE__);
	check_split("deepseek-v3", "a+b", "a|+b", __LINE__);
	check_split("deepseek-v3", "e\xCC\x81t\xC3\xA9", "e\xCC\x81t\xC3\xA9", __LINE__);
	check_split("deepseek-v3", " ?!\r\nz", " ?!\r\n|z", __LINE__);
	check_split("deepseek-v3", "tab\t\tend  ", "tab|\t|\tend|  ", __LINE__);
	check_split("deepseek-v3", "ｶﾀｶﾅ123ー", "ｶﾀｶﾅ|123|ー", __LINE__);
	check_split("deepseek-v3", "(foo) [bar]", "(foo|)| [|bar|]", __LINE__);
	check_split("deepseek-v3", "\xC2\xA0x", "\xC2\xA0x", __LINE__);
	check_split("deepseek-v3", "  \r\n\r\n y", "  \r\n\r\n| y", __LINE__);
	check_split("deepseek-v3", "", "", __LINE__);
}

TEST(tok_split_gpt2_and_llama3_patterns)
{
	check_split("gpt2", "I'm here  now\n", "I|'m| here| | now|\n", __LINE__);
	check_split("gpt2", "x'S 1234 !!", "x|'|S| 1234| !!", __LINE__);
	check_split("gpt2", "  a", " | a", __LINE__);
	check_split("llama3", "x'S 12345", "x|'S| |123|45", __LINE__);
	check_split("qwen2", "x'S 123", "x|'S| |1|2|3", __LINE__);
	check_split("llama3", "'\xC5\xBF" "a", "'\xC5\xBF|a", __LINE__); /* (?i) folds U+017F with s */
}

TEST(tok_unknown_pattern_is_quoted)
{
	const char *pats[] = { "\\p{N}{1,4}" };
	ds_err err = { 0 };
	struct pieces p = { "x", "" };
	CHECK_EQ(tok_pretokenize(pats, 1, "x", 1, collect, &p, &err), DS_EUNSUPPORTED);
	CHECK(strstr(err.msg, "\"\\p{N}{1,4}\"") != NULL);
	CHECK(tok_pretok_known(tok_pattern_gpt2));
	CHECK(!tok_pretok_known("\\s+"));
	const char *const *pp;
	size_t n;
	CHECK_EQ(tok_pretok_preset("bloom", &pp, &n, &err), DS_ENOTFOUND);
	/* DeepSeek's file writes CR/LF raw inside the pattern: both spellings match */
	CHECK_EQ(tok_pretok_preset("deepseek-v3", &pp, &n, &err), 0);
	char raw[512];
	size_t k = 0;
	for (const char *s = pp[2]; *s && k + 1 < sizeof raw; s++) {
		if (s[0] == '\\' && (s[1] == 'r' || s[1] == 'n')) {
			raw[k++] = s[1] == 'r' ? '\r' : '\n';
			s++;
		} else {
			raw[k++] = *s;
		}
	}
	raw[k] = '\0';
	CHECK(strchr(raw, '\r') != NULL);
	CHECK(tok_pretok_known(raw));
}

/* ---- a tiny hand-made BPE ------------------------------------------------------------ */

/* Byte-level form of a plain string (GPT-2 alphabet, UTF-8). */
static tok_str bl(const char *s)
{
	static char pool[64][64];
	static int next;
	char *o = pool[next++ % 64];
	size_t k = 0;
	for (; *s; s++)
		k += utf8_encode(tok_byte_to_cp((unsigned char)*s), (unsigned char *)o + k);
	o[k] = '\0';
	return (tok_str){ o, k };
}

/* vocab: every byte (ids 0..255 in byte order) + extra tokens from 256 on */
static tok *tiny(const char *const *extra, size_t nextra, const char *const *merges, size_t nm,
		 const tok_added_token *added, size_t nadded, int all_bytes)
{
	static char bytes[256][4];
	tok_str vocab[256 + 16];
	tok_str mg[32];
	size_t nv = 0;
	for (int b = 0; b < 256; b++) {
		size_t n = utf8_encode(tok_byte_to_cp((unsigned char)b), (unsigned char *)bytes[b]);
		int keep = all_bytes || (b >= 'a' && b <= 'e') || b == ' ';
		vocab[nv++] = keep ? (tok_str){ bytes[b], n } : (tok_str){ NULL, 0 };
	}
	for (size_t i = 0; i < nextra; i++)
		vocab[nv++] = bl(extra[i]);
	for (size_t i = 0; i < nm; i++) {
		char l[16], r[16];
		const char *sp = strchr(merges[i], ' ');
		snprintf(l, sizeof l, "%.*s", (int)(sp - merges[i]), merges[i]);
		snprintf(r, sizeof r, "%s", sp + 1);
		mg[2 * i] = bl(l);
		mg[2 * i + 1] = bl(r);
	}
	tok_build_params p;
	tok_build_default_params(&p);
	p.vocab = vocab;
	p.n_vocab = nv;
	p.merges = mg;
	p.n_merges = nm;
	p.added = added;
	p.n_added = nadded;
	const char *const *pats;
	tok_pretok_preset("deepseek-v3", &pats, &p.n_splits, NULL);
	p.splits = pats;
	ds_err err = { 0 };
	tok *t = tok_new(&p, &err);
	if (!t)
		ut_fail(__FILE__, __LINE__, "tok_new: %s", err.msg);
	return t;
}

static void check_enc(const tok *t, const char *text, unsigned flags, const int32_t *want, size_t n,
		      int line)
{
	tok_ids ids;
	tok_ids_init(&ids, 0);
	ds_err err = { 0 };
	if (tok_encode(t, text, strlen(text), flags, &ids, &err) != 0) {
		ut_fail(__FILE__, line, "encode: %s", err.msg);
	} else if (ids.n != n || memcmp(ids.v, want, n * sizeof *want) != 0) {
		char got[256] = "";
		for (size_t i = 0; i < ids.n && strlen(got) < 200; i++)
			snprintf(got + strlen(got), sizeof got - strlen(got), " %d", (int)ids.v[i]);
		ut_fail(__FILE__, line, "encode \"%s\": got%s", text, got);
	}
	tok_ids_free(&ids);
}

#define ENC(t, text, flags, ...)                                                        \
	do {                                                                            \
		const int32_t w_[] = { __VA_ARGS__ };                                   \
		check_enc(t, text, flags, w_, sizeof w_ / sizeof w_[0], __LINE__);      \
	} while (0)

TEST(tok_bpe_merges_by_rank_then_leftmost)
{
	/* ids: 256 "ab", 257 "bc", 258 "abc", 259 "aa", 260 "aaaa" */
	const char *extra[] = { "ab", "bc", "abc", "aa", "aaaa" };
	const char *m1[] = { "b c", "a b", "a bc", "a a", "aa aa" };
	tok *t = tiny(extra, 5, m1, 5, NULL, 0, 1);
	ENC(t, "abc", 0, 258);        /* b+c first (rank 0), then a+bc */
	ENC(t, "aaa", 0, 259, 'a');   /* leftmost pair first */
	ENC(t, "aaaa", 0, 260);       /* aa aa, then aaaa */
	ENC(t, "aaaaa", 0, 260, 'a');
	ENC(t, "ab abc", 0, 256, ' ', 258); /* " abc" is one piece; no merge with the space */
	tok_free(t);
	/* the other order: a+b wins, and "ab"+"c" is no merge */
	const char *m2[] = { "a b", "b c", "a bc" };
	t = tiny(extra, 5, m2, 3, NULL, 0, 1);
	ENC(t, "abc", 0, 256, 'c');
	ENC(t, "bc", 0, 257);
	tok_free(t);
}

TEST(tok_missing_bytes_are_dropped_or_unk)
{
	const char *extra[] = { "ab" };
	const char *m[] = { "a b" };
	tok *t = tiny(extra, 1, m, 1, NULL, 0, 0); /* only a..e and space */
	ENC(t, "axb", 0, 256);  /* 'x' is dropped, so a and b touch and merge (as HF does) */
	ENC(t, "a b", 0, 'a', ' ', 'b');
	tok_free(t);
}

TEST(tok_added_tokens_longest_first_and_parse_special)
{
	const char *extra[] = { "ab" };
	const char *m[] = { "a b" };
	tok_added_token add[] = {
		{ 300, { "<a>", 3 }, TOK_ADDED_SPECIAL },
		{ 301, { "<a>b", 4 }, TOK_ADDED_SPECIAL },
		{ 302, { "[x]", 3 }, TOK_ADDED_NORMALIZED },
		{ 303, { "[L]", 3 }, TOK_ADDED_LSTRIP | TOK_ADDED_RSTRIP },
	};
	tok *t = tiny(extra, 1, m, 1, add, 4, 1);
	CHECK_EQ(tok_vocab_size(t), 304);
	ENC(t, "<a>bc", TOK_PARSE_SPECIAL, 301, 'c');
	ENC(t, "ab<a>", TOK_PARSE_SPECIAL, 256, 300);
	ENC(t, "<a>", 0, '<', 'a', '>');               /* parse_special off: plain text */
	ENC(t, "a[x]b", TOK_PARSE_SPECIAL, 'a', 302, 'b');
	ENC(t, "a  [L]  b", TOK_PARSE_SPECIAL, 'a', 303, 'b'); /* whitespace swallowed */
	ENC(t, "<<a>>", TOK_PARSE_SPECIAL, '<', 300, '>');
	/* decode: added tokens by content, skipped when special and asked */
	int32_t ids[] = { 300, 'c', 302 };
	buf b;
	buf_init(&b, 0);
	CHECK_EQ(tok_decode(t, ids, 3, 0, &b, NULL), 0);
	CHECK_STR(b.data, "<a>c[x]");
	buf_clear(&b);
	CHECK_EQ(tok_decode(t, ids, 3, TOK_SKIP_SPECIAL, &b, NULL), 0);
	CHECK_STR(b.data, "c[x]");
	buf_free(&b);
	CHECK_EQ(tok_find_token(t, "<a>b", 4), 301);
	CHECK_EQ(tok_find_token(t, "ab", 2), 256);
	CHECK_EQ(tok_find_token(t, " ", 1), ' ');
	CHECK_EQ(tok_find_token(t, "abc", 3), -1);
	size_t len;
	CHECK_STR(tok_token_text(t, 301, &len), "<a>b");
	CHECK_EQ(len, 4);
	CHECK(tok_token_text(t, 299, NULL) == NULL); /* a hole */
	CHECK(tok_token_is_special(t, 300));
	CHECK(!tok_token_is_special(t, 302));
	CHECK_EQ(tok_bos_id(t), -1);
	tok_free(t);
}

TEST(tok_bos_flag_and_id_cap)
{
	const char *extra[] = { "ab" };
	const char *m[] = { "a b" };
	tok *t = tiny(extra, 1, m, 1, NULL, 0, 1);
	tok_ids ids;
	tok_ids_init(&ids, 3);
	ds_err err = { 0 };
	CHECK_EQ(tok_encode(t, "ab", 2, 0, &ids, &err), 0);
	CHECK_EQ(ids.n, 1);
	CHECK_EQ(tok_encode(t, "a c d e", 7, 0, &ids, &err), DS_ERANGE);
	CHECK_EQ(ids.n, 1); /* back to its length at entry */
	CHECK(strstr(err.msg, "more than 3 ids") != NULL);
	tok_ids_free(&ids);
	/* TOK_ADD_BOS without a BOS id adds nothing */
	ENC(t, "ab", TOK_ADD_BOS, 256);
	tok_free(t);
}

/* ---- round trips of arbitrary bytes -------------------------------------------------- */

static void roundtrip_random_bytes(const tok *t, int rounds)
{
	static const unsigned char alphabet[] = { 'a', 'b', ' ', '\n', '1', '!', 0x80, 0xBF, 0xC3,
						  0xA9, 0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x98, 0x80,
						  0xFF, 0xC0, 0xED, 0xA0, 0x00, '<', 0xEF, 0xBD, 0x9C };
	for (int r = 0; r < rounds; r++) {
		unsigned char s[64];
		size_t n = 1 + ut_rand_u64() % sizeof s;
		for (size_t i = 0; i < n; i++)
			s[i] = (ut_rand_u64() & 3) ? alphabet[ut_rand_u64() % sizeof alphabet]
						   : (unsigned char)ut_rand_u64();
		tok_ids ids;
		tok_ids_init(&ids, 0);
		buf b;
		buf_init(&b, 0);
		ds_err err = { 0 };
		CHECK_EQ(tok_encode(t, (const char *)s, n, TOK_PARSE_SPECIAL, &ids, &err), 0);
		CHECK_EQ(tok_decode(t, ids.v, ids.n, 0, &b, &err), 0);
		CHECK_EQ(b.len, n);
		if (b.len == n)
			CHECK(memcmp(b.data, s, n) == 0);
		tok_ids_free(&ids);
		buf_free(&b);
	}
}

TEST(tok_invalid_utf8_round_trips_tiny)
{
	const char *extra[] = { "ab", "aa" };
	const char *m[] = { "a b", "a a" };
	tok *t = tiny(extra, 2, m, 2, NULL, 0, 1);
	roundtrip_random_bytes(t, 3000);
	tok_free(t);
}

#define REAL_TOK "../shared/data/deepseek-v3/tokenizer.json"
#define REAL_CFG "../shared/data/deepseek-v3/tokenizer_config.json"

TEST(tok_invalid_utf8_round_trips_real_deepseek_v3)
{
	if (access(REAL_TOK, R_OK) != 0)
		UT_SKIP("needs ../shared/data/deepseek-v3 (the real DeepSeek-V3 tokenizer files "
			"beside the checkout)");
	ds_err err = { 0 };
	tok *t = tok_load_hf(REAL_TOK, REAL_CFG, &err);
	if (!t) {
		ut_fail(__FILE__, __LINE__, "%s", err.msg);
		return;
	}
	CHECK_EQ(tok_vocab_size(t), 128815);
	CHECK_EQ(tok_bos_id(t), 0);
	CHECK_EQ(tok_eos_id(t), 1);
	CHECK(tok_add_bos_default(t));
	CHECK(tok_chat_template(t) != NULL);
	CHECK_EQ(tok_find_token(t, "<｜User｜>", strlen("<｜User｜>")), 128803);
	CHECK(tok_find_token(t, " the", 4) >= 0);
	/* the special-token round trip example of spec §6.2 */
	ENC(t, "<｜User｜>Hello!<｜Assistant｜>", TOK_PARSE_SPECIAL, 128803, 19923, 3, 128804);
	ENC(t, "Hi", TOK_PARSE_SPECIAL | TOK_ADD_BOS, 0, 23166);
	roundtrip_random_bytes(t, 2000);
	/* a rendered chat starts with the BOS text: encoding it must not add another */
	chat_params cp;
	CHECK_EQ(chat_params_for_tok(t, NULL, &cp, &err), 0);
	CHECK_EQ(cp.tmpl, CHAT_TMPL_DEEPSEEK_V3);
	CHECK_STR(cp.bos, "<｜begin▁of▁sentence｜>");
	const chat_msg m[] = { { CHAT_ROLE_SYSTEM, "S", NULL, 0 }, { CHAT_ROLE_USER, "Hello!", NULL, 0 } };
	buf b;
	buf_init(&b, 0);
	CHECK_EQ(chat_render(&cp, m, 2, &b, &err), 0);
	ENC(t, b.data, TOK_PARSE_SPECIAL, 0, 53, 128803, 19923, 3, 128804);
	buf_free(&b);
	tok_free(t);
}

/* ---- streaming decode -------------------------------------------------------------- */

static void stream_all(const tok *t, const int32_t *ids, size_t n, buf *out)
{
	tok_stream s;
	tok_stream_init(&s, t, 0);
	for (size_t i = 0; i < n; i++)
		CHECK_EQ(tok_stream_feed(&s, ids[i], out, NULL), 0);
	CHECK_EQ(tok_stream_flush(&s, out, NULL), 0);
}

TEST(tok_stream_never_emits_half_a_character)
{
	const char *extra[] = { "\xF0\x9F", "\x98\x80" "a" };
	tok *t = tiny(extra, 2, NULL, 0, NULL, 0, 1);
	/* 😀 = F0 9F 98 80, one byte per token */
	tok_stream s;
	buf out;
	buf_init(&out, 0);
	tok_stream_init(&s, t, 0);
	const int32_t emoji[] = { 0xF0, 0x9F, 0x98, 0x80 };
	for (int i = 0; i < 4; i++) {
		CHECK_EQ(tok_stream_feed(&s, emoji[i], &out, NULL), 0);
		CHECK_EQ(out.len, i < 3 ? 0 : 4);
	}
	CHECK(out.data && memcmp(out.data, "\xF0\x9F\x98\x80", 4) == 0);
	/* split across multi-byte tokens: F0 9F | 98 80 'a' */
	buf_clear(&out);
	CHECK_EQ(tok_stream_feed(&s, 256, &out, NULL), 0);
	CHECK_EQ(out.len, 0);
	CHECK_EQ(tok_stream_feed(&s, 257, &out, NULL), 0);
	CHECK_STR(out.data, "\xF0\x9F\x98\x80" "a");
	/* a sequence cut by ASCII: U+FFFD for the held bytes, then the ASCII */
	buf_clear(&out);
	CHECK_EQ(tok_stream_feed(&s, 0xE4, &out, NULL), 0);
	CHECK_EQ(tok_stream_feed(&s, 0xB8, &out, NULL), 0);
	CHECK_EQ(out.len, 0);
	CHECK_EQ(tok_stream_feed(&s, 'A', &out, NULL), 0);
	CHECK_STR(out.data, "\xEF\xBF\xBD" "A");
	/* held tail at the end: one U+FFFD on flush */
	buf_clear(&out);
	CHECK_EQ(tok_stream_feed(&s, 0xF0, &out, NULL), 0);
	CHECK_EQ(tok_stream_flush(&s, &out, NULL), 0);
	CHECK_STR(out.data, "\xEF\xBF\xBD");
	/* bytes that can never start a character: one U+FFFD each */
	buf_clear(&out);
	const int32_t bad[] = { 0x80, 0xFF, 'x', 0xC0, 0xAF };
	stream_all(t, bad, 5, &out);
	CHECK_STR(out.data, "\xEF\xBF\xBD\xEF\xBF\xBDx\xEF\xBF\xBD\xEF\xBF\xBD");
	/* unknown id: error, nothing emitted */
	buf_clear(&out);
	ds_err err = { 0 };
	CHECK_EQ(tok_stream_feed(&s, 99999, &out, &err), DS_EINVAL);
	CHECK(strstr(err.msg, "99999") != NULL);
	buf_free(&out);
	tok_free(t);
}

TEST(tok_stream_output_does_not_depend_on_token_boundaries)
{
	/* vocab: the 256 bytes, then every 2- and 3-byte string over a small
	 * alphabet of lead, continuation and bad bytes */
	static const unsigned char al[] = { 'a', 0x80, 0xBF, 0xE4, 0xF0, 0xFF };
	enum { NA = sizeof al, NV = 256 + NA * NA + NA * NA * NA };
	static char store[NV][8];
	static tok_str vocab[NV];
	size_t nv = 0;
	for (int b = 0; b < 256; b++) {
		size_t k = utf8_encode(tok_byte_to_cp((unsigned char)b), (unsigned char *)store[nv]);
		vocab[nv] = (tok_str){ store[nv], k };
		nv++;
	}
	for (int len = 2; len <= 3; len++) {
		for (int c = 0; c < (len == 2 ? NA * NA : NA * NA * NA); c++) {
			size_t k = 0;
			for (int j = 0, x = c; j < len; j++, x /= NA)
				k += utf8_encode(tok_byte_to_cp(al[x % NA]), (unsigned char *)store[nv] + k);
			vocab[nv] = (tok_str){ store[nv], k };
			nv++;
		}
	}
	tok_build_params p;
	tok_build_default_params(&p);
	p.vocab = vocab;
	p.n_vocab = nv;
	ds_err err = { 0 };
	tok *t = tok_new(&p, &err);
	CHECK(t != NULL);
	if (!t)
		return;
	for (int r = 0; r < 3000; r++) {
		unsigned char bytes[24];
		int32_t one[24], grouped[24];
		size_t n = 1 + ut_rand_u64() % 24, ng = 0;
		for (size_t i = 0; i < n; i++) {
			bytes[i] = al[ut_rand_u64() % NA];
			one[i] = bytes[i];
		}
		for (size_t i = 0; i < n;) {
			size_t k = 1 + ut_rand_u64() % 3;
			if (k > n - i)
				k = n - i;
			grouped[ng] = tok_find_token(t, (const char *)bytes + i, k);
			CHECK(grouped[ng] >= 0);
			ng++;
			i += k;
		}
		buf a, g;
		buf_init(&a, 0);
		buf_init(&g, 0);
		stream_all(t, one, n, &a);
		stream_all(t, grouped, ng, &g);
		CHECK(a.len == g.len && (a.len == 0 || memcmp(a.data, g.data, a.len) == 0));
		/* always valid UTF-8, and the input itself when that was valid */
		CHECK_EQ(utf8_valid_prefix((const unsigned char *)a.data, a.len), a.len);
		if (utf8_valid_prefix(bytes, n) == n)
			CHECK(a.len == n && memcmp(a.data, bytes, n) == 0);
		buf_free(&a);
		buf_free(&g);
	}
	tok_free(t);
}

/* ---- tokenizer.json parsing ------------------------------------------------------------ */

static int write_tmp(char *path, size_t cap, const char *text)
{
	snprintf(path, cap, "/tmp/ds_tok_test_XXXXXX");
	int fd = mkstemp(path);
	if (fd < 0)
		return -1;
	size_t n = strlen(text);
	int ok = write(fd, text, n) == (ssize_t)n;
	close(fd);
	return ok ? 0 : -1;
}

static int load_text(const char *json, tok **t, ds_err *err)
{
	char path[64];
	if (write_tmp(path, sizeof path, json) != 0)
		return ds_err_set(err, DS_EIO, "cannot write a temp file");
	*t = tok_load_hf(path, NULL, err);
	unlink(path);
	return *t ? 0 : err->code;
}

#define MINI_HEAD                                                                        \
	"{\"version\":\"1.0\",\"normalizer\":null,\"decoder\":{\"type\":\"ByteLevel\"},"  \
	"\"added_tokens\":[{\"id\":5,\"content\":\"<s>\",\"special\":true,\"lstrip\":false," \
	"\"rstrip\":false,\"normalized\":false,\"single_word\":false}],"

TEST(tok_load_hf_small_files)
{
	tok *t = NULL;
	ds_err err = { 0 };
	/* GPT-2 style ByteLevel pre-tokenizer, merges as pairs */
	const char *ok =
		MINI_HEAD "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true},"
		"\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,\"vocab\":"
		"{\"a\":0,\"b\":1,\"\xC4\xA0\":2,\"ab\":3,\"\xC4\xA0" "ab\":4},"
		"\"merges\":[[\"a\",\"b\"],[\"\xC4\xA0\",\"ab\"]]}}";
	CHECK_EQ(load_text(ok, &t, &err), 0);
	if (t) {
		ENC(t, "ab ab<s>", TOK_PARSE_SPECIAL, 3, 4, 5);
		ENC(t, "ab ab<s>", 0, 3, 4); /* '<' 's' '>' are not in this vocab: dropped */
		CHECK_EQ(tok_vocab_size(t), 6);
		tok_free(t);
		t = NULL;
	}
	/* the same with "a b" string merges and a Sequence pre-tokenizer */
	const char *seq =
		MINI_HEAD "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":["
		"{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\p{N}{1,3}\"},\"behavior\":\"Isolated\",\"invert\":false},"
		"{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":false}]},"
		"\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"\xC4\xA0\":2,\"ab\":3,\"\xC4\xA0" "ab\":4},"
		"\"merges\":[\"a b\",\"\xC4\xA0 ab\"]}}";
	CHECK_EQ(load_text(seq, &t, &err), 0);
	if (t) {
		ENC(t, "ab ab", 0, 3, 4);
		tok_free(t);
		t = NULL;
	}
	static const struct {
		const char *json;
		int code;
		const char *msg;
	} bad[] = {
		{ MINI_HEAD "\"pre_tokenizer\":{\"type\":\"Whitespace\"},\"model\":{}}", DS_EUNSUPPORTED,
		  "pre_tokenizer type 'Whitespace' is not supported" },
		{ MINI_HEAD "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":true},\"model\":{}}",
		  DS_EUNSUPPORTED, "add_prefix_space = true is not supported" },
		{ MINI_HEAD "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\","
			    "\"pattern\":{\"Regex\":\"[a-z]+\"},\"behavior\":\"Isolated\"},{\"type\":\"ByteLevel\","
			    "\"use_regex\":false}]},\"model\":{}}",
		  DS_EUNSUPPORTED, "Split pattern not supported: \"[a-z]+\"" },
		{ MINI_HEAD "\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"WordPiece\"}}",
		  DS_EUNSUPPORTED, "model type 'WordPiece'" },
		{ MINI_HEAD "\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":"
			    "{\"a\":0},\"merges\":[\"a b\"]}}",
		  DS_EINVAL, "merge 0: token \"b\" is not in the vocab" },
		{ MINI_HEAD "\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":"
			    "{\"a\":0},\"merges\":[\"ab\"]}}",
		  DS_EFORMAT, "is not \"a b\"" },
		{ MINI_HEAD "\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":"
			    "{\"a\":0,\"b\":0},\"merges\":[]}}",
		  DS_EFORMAT, "id 0 is used twice" },
		{ "{\"normalizer\":{\"type\":\"Lowercase\"}}", DS_EUNSUPPORTED, "normalizer 'Lowercase'" },
		{ "{\"model\": [1, 2", DS_EFORMAT, "" },
	};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		ds_err_clear(&err);
		int rc = load_text(bad[i].json, &t, &err);
		CHECK(t == NULL);
		if (rc != bad[i].code || !strstr(err.msg, bad[i].msg))
			ut_fail(__FILE__, __LINE__, "case %zu: %d \"%s\"", i, rc, err.msg);
	}
	CHECK(tok_load_hf("/nonexistent/tokenizer.json", NULL, &err) == NULL);
	CHECK_EQ(err.code, DS_ENOTFOUND);
	tok_free(NULL);
}

TEST(tok_alloc_conveniences_and_heap_stream)
{
	const char *extra[] = { "ab" };
	const char *m[] = { "a b" };
	tok *t = tiny(extra, 1, m, 1, NULL, 0, 1);
	int32_t *ids = NULL;
	size_t n = 0;
	ds_err err = { 0 };
	CHECK_EQ(tok_encode_alloc(t, "ab\xC3", 3, 0, &ids, &n, &err), 0);
	CHECK_EQ(n, 2);
	CHECK(ids && ids[0] == 256 && ids[1] == 0xC3);
	char *text = NULL;
	size_t len = 0;
	CHECK_EQ(tok_decode_alloc(t, ids, n, &text, &len, &err), 0);
	CHECK_EQ(len, 3);
	CHECK(text && memcmp(text, "ab\xC3", 4) == 0); /* NUL-terminated, bytes passed through */
	free(text);
	free(ids);
	CHECK_EQ(tok_encode_alloc(t, "", 0, 0, &ids, &n, &err), 0);
	CHECK(ids != NULL && n == 0);
	free(ids);
	int32_t bad = 9999;
	CHECK_EQ(tok_decode_alloc(t, &bad, 1, &text, &len, &err), DS_EINVAL);
	CHECK(text == NULL);
	tok_stream *s = tok_stream_new(t);
	buf out;
	buf_init(&out, 0);
	CHECK(s != NULL);
	if (s) {
		CHECK_EQ(tok_stream_feed(s, 0xC3, &out, NULL), 0);
		CHECK_EQ(tok_stream_feed(s, 0xA9, &out, NULL), 0);
		CHECK_EQ(tok_stream_flush(s, &out, NULL), 0);
		CHECK_STR(out.data, "\xC3\xA9");
	}
	tok_stream_free(s);
	tok_stream_free(NULL);
	buf_free(&out);
	tok_free(t);
}

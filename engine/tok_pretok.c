/*
 * tok_pretok.c - the pre-tokenizer: Split patterns as hand-written matchers.
 *
 * Called by tok.c (encoding) and tok_hf.c (pattern validation at load).
 * There is no regex engine: each supported pattern string maps, through the
 * table `patterns[]`, to a function that answers "how long is the match at
 * position i" exactly as the backtracking engine of the reference (Oniguruma,
 * used by HF tokenizers) would: alternatives tried left to right, greedy
 * quantifiers giving back one character at a time, `(?!\S)` looking at the
 * piece only.  Every run a matcher scans is consumed by its match or bounded
 * by the quantifier, so splitting stays linear in the text length; the one
 * exception, "\s+$" (deepseek-llm), can fail at every position of a long run,
 * so split_level() runs it as split_ws_eol(), run by run.  A pattern not in
 * the table is rejected by its caller with the pattern quoted.  To support a
 * new family (Llama-3, Qwen2, DeepSeek LLM are here already), write its
 * matcher from its alternatives and add a row (and a presets[] row).
 *
 * Split semantics (HF `Split`, behavior Isolated, invert false): scanning from
 * the left, the first position where the pattern matches starts a match; the
 * text between matches (gaps) and the matches both become pieces; scanning
 * resumes at the match end.  Patterns are applied as a cascade: pattern k
 * re-splits every piece of pattern k-1 separately.
 *
 * Thread rule: no state; everything is const.  Invariant: a matcher never
 * returns more than end - i and never matches empty.
 */
#include "engine/tok_impl.h"
#include "engine/unicode.h"

#include <stdlib.h>
#include <string.h>

/* ---- character tests ------------------------------------------------------ */

static int is_nl(uint32_t c)
{
	return c == '\r' || c == '\n';
}

static int is_ascii_letter(uint32_t c)
{
	return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
}

/* !"#$%&'()*+,-./:;<=>?@[\]^_`{|}~ : every ASCII punctuation or symbol */
static int is_ascii_punct(uint32_t c)
{
	return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) ||
	       (c >= 0x7B && c <= 0x7E);
}

/* Length of the run starting at i of code points whose class has a bit of mask. */
static size_t run_cls(const uint8_t *cls, size_t i, size_t end, unsigned mask)
{
	size_t j = i;
	while (j < end && (cls[j] & mask))
		j++;
	return j - i;
}

/* The same, stopping at max (a bounded quantifier must not scan the whole run:
 * that would make a long run quadratic). */
static size_t run_cls_max(const uint8_t *cls, size_t i, size_t end, unsigned mask, size_t max)
{
	if (end - i > max)
		end = i + max;
	return run_cls(cls, i, end, mask);
}

/* Run of code points whose class has no bit of mask (and are not CR/LF when nonl). */
static size_t run_not_cls(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end,
			  unsigned mask, int nonl)
{
	size_t j = i;
	while (j < end && !(cls[j] & mask) && !(nonl && is_nl(cp[j])))
		j++;
	return j - i;
}

static size_t run_nl(const uint32_t *cp, size_t i, size_t end)
{
	size_t j = i;
	while (j < end && is_nl(cp[j]))
		j++;
	return j - i;
}

/* ---- shared alternatives ---------------------------------------------------- */

/* \s*[\r\n]+ : greedy \s* gives back until a CR/LF follows, so the match ends
 * just after the last CR/LF of the whitespace run at i. */
static size_t alt_ws_then_nl(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	size_t r = run_cls(cls, i, end, UNI_WS);
	for (size_t k = r; k > 0; k--)
		if (is_nl(cp[i + k - 1]))
			return k;
	return 0;
}

/* \s+(?!\S)|\s+ : the whole whitespace run when it reaches the end of the piece
 * or has length 1 (then the second alternative takes it); otherwise all but its
 * last character (which then begins the next piece, e.g. " " before a word). */
static size_t alt_ws_tail(const uint8_t *cls, size_t i, size_t end)
{
	size_t r = run_cls(cls, i, end, UNI_WS);
	if (r == 0)
		return 0;
	if (i + r == end || r == 1)
		return r;
	return r - 1;
}

/* ---- single digits (llama.cpp's SMOLLM / StarCoder family, HF Digits with
 * individual_digits) ------------------------------------------------------------ */

/* \p{N} : one number character */
static size_t m_digit1(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	return (cls[i] & UNI_N) ? 1 : 0;
}

/* ---- DeepSeek-V3 -------------------------------------------------------------- */

/* \p{N}{1,3} */
static size_t m_digits3(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	return run_cls_max(cls, i, end, UNI_N, 3);
}

static int is_cjk_kana(uint32_t c)
{
	return (c >= 0x4E00 && c <= 0x9FA5) || (c >= 0x3040 && c <= 0x309F) ||
	       (c >= 0x30A0 && c <= 0x30FF);
}

/* [一-龥぀-ゟ゠-ヿ]+ : U+4E00..U+9FA5, U+3040..U+309F, U+30A0..U+30FF */
static size_t m_cjk_kana(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	size_t j = i;
	while (j < end && is_cjk_kana(cp[j]))
		j++;
	return j - i;
}

/* [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+
 * |[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
 * | ?[\p{P}\p{S}]+[\r\n]*
 * |\s*[\r\n]+
 * |\s+(?!\S)
 * |\s+                                                                   */
static size_t m_ds3_main(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	/* 1: one ASCII punctuation, then ASCII letters */
	if (is_ascii_punct(cp[i]) && i + 1 < end && is_ascii_letter(cp[i + 1])) {
		size_t j = i + 1;
		while (j < end && is_ascii_letter(cp[j]))
			j++;
		return j - i;
	}
	/* 2: optional char that is not CR/LF/L/P/S, then letters and marks */
	if (!is_nl(cp[i]) && !(cls[i] & (UNI_L | UNI_P | UNI_S)) && i + 1 < end &&
	    (cls[i + 1] & (UNI_L | UNI_M)))
		return 1 + run_cls(cls, i + 1, end, UNI_L | UNI_M);
	if (cls[i] & (UNI_L | UNI_M))
		return run_cls(cls, i, end, UNI_L | UNI_M);
	/* 3: optional space, punctuation/symbols, then CR/LF */
	{
		size_t j = i;
		if (cp[j] == ' ' && j + 1 < end && (cls[j + 1] & (UNI_P | UNI_S)))
			j++;
		if (cls[j] & (UNI_P | UNI_S)) {
			j += run_cls(cls, j, end, UNI_P | UNI_S);
			j += run_nl(cp, j, end);
			return j - i;
		}
	}
	/* 4 */
	size_t m = alt_ws_then_nl(cp, cls, i, end);
	if (m)
		return m;
	/* 5, 6 */
	return alt_ws_tail(cls, i, end);
}

/* ---- GPT-2 (ByteLevel use_regex) ---------------------------------------------- */

/* 's|'t|'re|'ve|'m|'ll|'d, case-sensitive or, for (?i:...), with simple case
 * folding (Oniguruma folds s with S and U+017F LONG S). */
static size_t contraction(const uint32_t *cp, size_t i, size_t end, int icase)
{
	if (cp[i] != '\'' || i + 1 >= end)
		return 0;
	uint32_t a = cp[i + 1], b = i + 2 < end ? cp[i + 2] : 0;
	if (icase) {
		if (a == 0x17F)
			a = 's';
		if (a < 0x80 && a >= 'A' && a <= 'Z')
			a += 32;
		if (b < 0x80 && b >= 'A' && b <= 'Z')
			b += 32;
	}
	if (a == 's' || a == 't' || a == 'm' || a == 'd')
		return 2;
	if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
		return 3;
	return 0;
}

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t m_gpt2(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	size_t m = contraction(cp, i, end, 0);
	if (m)
		return m;
	size_t j = i + (cp[i] == ' ' && i + 1 < end ? 1 : 0);
	if (cls[j] & UNI_L)
		return j - i + run_cls(cls, j, end, UNI_L);
	if (cls[j] & UNI_N)
		return j - i + run_cls(cls, j, end, UNI_N);
	if (!(cls[j] & (UNI_WS | UNI_L | UNI_N)))
		return j - i + run_not_cls(cp, cls, j, end, UNI_WS | UNI_L | UNI_N, 0);
	/* j > i and cp[j] is whitespace, L or N handled: the space alone */
	return alt_ws_tail(cls, i, end);
}

/* ---- Llama-3 / Qwen2 ------------------------------------------------------------- */

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}
 * | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+                    */
static size_t llama3_like(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end,
			  size_t max_digits)
{
	size_t m = contraction(cp, i, end, 1);
	if (m)
		return m;
	if (!is_nl(cp[i]) && !(cls[i] & (UNI_L | UNI_N)) && i + 1 < end && (cls[i + 1] & UNI_L))
		return 1 + run_cls(cls, i + 1, end, UNI_L);
	if (cls[i] & UNI_L)
		return run_cls(cls, i, end, UNI_L);
	if (cls[i] & UNI_N)
		return run_cls_max(cls, i, end, UNI_N, max_digits);
	{
		size_t j = i + (cp[i] == ' ' && i + 1 < end ? 1 : 0);
		if (!(cls[j] & (UNI_WS | UNI_L | UNI_N))) {
			j += run_not_cls(cp, cls, j, end, UNI_WS | UNI_L | UNI_N, 0);
			j += run_nl(cp, j, end);
			return j - i;
		}
	}
	m = alt_ws_then_nl(cp, cls, i, end);
	if (m)
		return m;
	return alt_ws_tail(cls, i, end);
}

static size_t m_llama3(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	return llama3_like(cp, cls, i, end, 3);
}

static size_t m_qwen2(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	return llama3_like(cp, cls, i, end, 1);
}

/* ---- DeepSeek LLM (V2 / V2-Lite, GGUF pre "deepseek-llm") ------------------------ *
 * Six patterns, each its own Split:
 *   [\r\n]   \s?[letters]+   \s?[punct]+   \s+$   [cjk]+   \p{N}+
 * The character classes are explicit code point lists (not properties); the
 * tables below copy them range by range from the pattern text.  */

/* [\r\n] */
static size_t m_nl1(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	(void)cls;
	(void)end;
	return is_nl(cp[i]) ? 1 : 0;
}

struct cp_range {
	uint32_t lo, hi;
};

/* The letter class of pattern 2 (cased letters of selected scripts), sorted,
 * adjacent singles merged (U+0376 U+0377, U+2183 U+2184, U+2CF2 U+2CF3). */
static const struct cp_range dsllm_letters[] = {
	{ 0x0041, 0x005A }, { 0x0061, 0x007A }, { 0x00B5, 0x00B5 }, { 0x00C0, 0x00D6 },
	{ 0x00D8, 0x00F6 }, { 0x00F8, 0x01BA }, { 0x01BC, 0x01BF }, { 0x01C4, 0x0293 },
	{ 0x0295, 0x02AF }, { 0x0370, 0x0373 }, { 0x0376, 0x0377 }, { 0x037B, 0x037D },
	{ 0x037F, 0x037F }, { 0x0386, 0x0386 }, { 0x0388, 0x038A }, { 0x038C, 0x038C },
	{ 0x038E, 0x03A1 }, { 0x03A3, 0x03F5 }, { 0x03F7, 0x0481 }, { 0x048A, 0x052F },
	{ 0x0531, 0x0556 }, { 0x10A0, 0x10C5 }, { 0x13A0, 0x13F5 }, { 0x13F8, 0x13FD },
	{ 0x1C90, 0x1CBA }, { 0x1CBD, 0x1CBF }, { 0x1D00, 0x1D2B }, { 0x1D6B, 0x1D77 },
	{ 0x1D79, 0x1D9A }, { 0x1E00, 0x1F15 }, { 0x1F18, 0x1F1D }, { 0x1F20, 0x1F45 },
	{ 0x1F48, 0x1F4D }, { 0x1F50, 0x1F57 }, { 0x1F59, 0x1F59 }, { 0x1F5B, 0x1F5B },
	{ 0x1F5D, 0x1F5D }, { 0x1F5F, 0x1F7D }, { 0x1F80, 0x1FB4 }, { 0x1FB6, 0x1FBC },
	{ 0x1FBE, 0x1FBE }, { 0x1FC2, 0x1FC4 }, { 0x1FC6, 0x1FCC }, { 0x1FD0, 0x1FD3 },
	{ 0x1FD6, 0x1FDB }, { 0x1FE0, 0x1FEC }, { 0x1FF2, 0x1FF4 }, { 0x1FF6, 0x1FFC },
	{ 0x2102, 0x2102 }, { 0x2107, 0x2107 }, { 0x210A, 0x2113 }, { 0x2115, 0x2115 },
	{ 0x2119, 0x211D }, { 0x2124, 0x2124 }, { 0x2126, 0x2126 }, { 0x2128, 0x2128 },
	{ 0x212A, 0x212D }, { 0x212F, 0x2134 }, { 0x2139, 0x2139 }, { 0x213C, 0x213F },
	{ 0x2145, 0x2149 }, { 0x214E, 0x214E }, { 0x2183, 0x2184 }, { 0x2C00, 0x2C7B },
	{ 0x2C7E, 0x2CE4 }, { 0x2CEB, 0x2CEE }, { 0x2CF2, 0x2CF3 }, { 0xA640, 0xA66D },
	{ 0xA680, 0xA69B }, { 0xA722, 0xA76F }, { 0xA771, 0xA787 }, { 0xA78B, 0xA78E },
	{ 0xAB70, 0xABBF }, { 0xFB00, 0xFB06 }, { 0xFB13, 0xFB17 }, { 0xFF21, 0xFF3A },
	{ 0xFF41, 0xFF5A }, { 0x10400, 0x1044F }, { 0x104B0, 0x104D3 }, { 0x104D8, 0x104FB },
	{ 0x10C80, 0x10CB2 }, { 0x10CC0, 0x10CF2 }, { 0x118A0, 0x118DF }, { 0x1E900, 0x1E943 },
};

static int in_ranges(const struct cp_range *r, size_t n, uint32_t c)
{
	size_t lo = 0, hi = n;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		if (c < r[mid].lo)
			hi = mid;
		else if (c > r[mid].hi)
			lo = mid + 1;
		else
			return 1;
	}
	return 0;
}

static int is_dsllm_letter(uint32_t c)
{
	return in_ranges(dsllm_letters, sizeof dsllm_letters / sizeof dsllm_letters[0], c);
}

/* [!-/:-~！-／：-～‘-‟　-。]: ASCII 21-2F and 3A-7E (letters included),
 * fullwidth FF01-FF0F and FF1A-FF5E, quotes 2018-201F, 3000-3002 (the
 * ideographic space is in it, and is also \s). */
static int is_dsllm_punct(uint32_t c)
{
	return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x7E) || (c >= 0xFF01 && c <= 0xFF0F) ||
	       (c >= 0xFF1A && c <= 0xFF5E) || (c >= 0x2018 && c <= 0x201F) ||
	       (c >= 0x3000 && c <= 0x3002);
}

/* [一-龥ࠀ-一가-퟿]: U+4E00-9FA5, U+0800-4E00, U+AC00-D7FF (the first two overlap
 * into U+0800-9FA5, which holds much more than CJK: General Punctuation's
 * spaces, arrows, kana ...). */
static int is_dsllm_cjk(uint32_t c)
{
	return (c >= 0x0800 && c <= 0x9FA5) || (c >= 0xAC00 && c <= 0xD7FF);
}

/* \s?[X]+ : the optional whitespace is taken when X follows it, else given
 * back (then X must match at i itself). */
static size_t ws_opt_run(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end,
			 int (*in)(uint32_t))
{
	size_t j = i;
	if ((cls[i] & UNI_WS) && i + 1 < end && in(cp[i + 1]))
		j++;
	while (j < end && in(cp[j]))
		j++;
	return j - i;
}

static size_t m_dsllm_letters(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	return ws_opt_run(cp, cls, i, end, is_dsllm_letter);
}

static size_t m_dsllm_punct(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	return ws_opt_run(cp, cls, i, end, is_dsllm_punct);
}

/* \s+$ : "$" as the reference reads it (Oniguruma, Ruby syntax) is the end of
 * the piece or a position before "\n".  Greedy \s+ gives back until one of
 * those follows: the whole run when it reaches the end, else up to the last
 * "\n" inside the run after i.  split_level() does not call this per position
 * (a long run that fails would be rescanned from each of its positions): it
 * uses split_ws_eol(), the same rule run by run. */
static size_t m_ws_eol(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	size_t r = run_cls(cls, i, end, UNI_WS);
	if (r == 0)
		return 0;
	if (i + r == end)
		return r;
	for (size_t k = r - 1; k > 0; k--)
		if (cp[i + k] == '\n')
			return k;
	return 0;
}

static size_t m_dsllm_cjk(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	(void)cls;
	size_t j = i;
	while (j < end && is_dsllm_cjk(cp[j]))
		j++;
	return j - i;
}

/* \p{N}+ */
static size_t m_digits(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
	(void)cp;
	return run_cls(cls, i, end, UNI_N);
}

/* ---- the table ------------------------------------------------------------------ */

/* Patterns as they appear in tokenizer.json once JSON-unescaped.  CR and LF may
 * be written raw (as DeepSeek's file does) or as \r \n escapes: both spellings
 * are compared in the escaped form (see canon()). */
const char tok_pattern_gpt2[] =
	"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static const char pat_digit1[] = "\\p{N}";
static const char pat_ds3_digits[] = "\\p{N}{1,3}";
static const char pat_ds3_cjk[] = "[一-龥぀-ゟ゠-ヿ]+"; /* U+4E00-9FA5 3040-309F 30A0-30FF */
static const char pat_ds3_main[] =
	"[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
	"|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
	"| ?[\\p{P}\\p{S}]+[\\r\\n]*"
	"|\\s*[\\r\\n]+"
	"|\\s+(?!\\S)"
	"|\\s+";
static const char pat_llama3[] =
	"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
	"| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char pat_qwen2[] =
	"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
	"| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* deepseek-llm (llama.cpp's DEEPSEEK_LLM regex list; non-ASCII written as
 * universal character names so that no editor can normalize them: e.g. U+1F7D,
 * U+1FBE, U+2126, U+212A have NFC forms outside the class) */
static const char pat_dsllm_nl[] = "[\\r\\n]";
static const char pat_dsllm_letters[] =
	"\\s?[A-Za-z\u00B5\u00C0-\u00D6\u00D8-\u00F6\u00F8-\u01BA\u01BC-\u01BF\u01C4-\u0293"
	"\u0295-\u02AF\u0370-\u0373\u0376\u0377\u037B-\u037D\u037F\u0386\u0388-\u038A\u038C"
	"\u038E-\u03A1\u03A3-\u03F5\u03F7-\u0481\u048A-\u052F\u0531-\u0556\u10A0-\u10C5\u13A0"
	"-\u13F5\u13F8-\u13FD\u1C90-\u1CBA\u1CBD-\u1CBF\u1D00-\u1D2B\u1D6B-\u1D77\u1D79-"
	"\u1D9A\u1E00-\u1F15\u1F18-\u1F1D\u1F20-\u1F45\u1F48-\u1F4D\u1F50-\u1F57\u1F59\u1F5B"
	"\u1F5D\u1F5F-\u1F7D\u1F80-\u1FB4\u1FB6-\u1FBC\u1FBE\u1FC2-\u1FC4\u1FC6-\u1FCC\u1FD0-"
	"\u1FD3\u1FD6-\u1FDB\u1FE0-\u1FEC\u1FF2-\u1FF4\u1FF6-\u1FFC\u2102\u2107\u210A-\u2113"
	"\u2115\u2119-\u211D\u2124\u2126\u2128\u212A-\u212D\u212F-\u2134\u2139\u213C-\u213F"
	"\u2145-\u2149\u214E\u2183\u2184\u2C00-\u2C7B\u2C7E-\u2CE4\u2CEB-\u2CEE\u2CF2\u2CF3"
	"\uA640-\uA66D\uA680-\uA69B\uA722-\uA76F\uA771-\uA787\uA78B-\uA78E\uAB70-\uABBF\uFB00"
	"-\uFB06\uFB13-\uFB17\uFF21-\uFF3A\uFF41-\uFF5A\U00010400-\U0001044F\U000104B0-"
	"\U000104D3\U000104D8-\U000104FB\U00010C80-\U00010CB2\U00010CC0-\U00010CF2\U000118A0-"
	"\U000118DF\U0001E900-\U0001E943]+";
static const char pat_dsllm_punct[] =
	"\\s?[!-/:-~\uFF01-\uFF0F\uFF1A-\uFF5E\u2018-\u201F\u3000-\u3002]+";
static const char pat_dsllm_ws_eol[] = "\\s+$";
static const char pat_dsllm_cjk[] = "[\u4E00-\u9FA5\u0800-\u4E00\uAC00-\uD7FF]+";
static const char pat_digits[] = "\\p{N}+";

static const struct {
	const char *pattern;
	tok_match_fn fn;
} patterns[] = {
	{ tok_pattern_gpt2, m_gpt2 },
	{ pat_digit1, m_digit1 },
	{ pat_ds3_digits, m_digits3 },
	{ pat_ds3_cjk, m_cjk_kana },
	{ pat_ds3_main, m_ds3_main },
	{ pat_llama3, m_llama3 },
	{ pat_qwen2, m_qwen2 },
	{ pat_dsllm_nl, m_nl1 },
	{ pat_dsllm_letters, m_dsllm_letters },
	{ pat_dsllm_punct, m_dsllm_punct },
	{ pat_dsllm_ws_eol, m_ws_eol },
	{ pat_dsllm_cjk, m_dsllm_cjk },
	{ pat_digits, m_digits },
};

static const char *const preset_ds3[] = { pat_ds3_digits, pat_ds3_cjk, pat_ds3_main };
static const char *const preset_gpt2[] = { tok_pattern_gpt2 };
static const char *const preset_llama3[] = { pat_llama3 };
static const char *const preset_qwen2[] = { pat_qwen2 };
static const char *const preset_smollm[] = { pat_digit1, tok_pattern_gpt2 };
static const char *const preset_dsllm[] = { pat_dsllm_nl,     pat_dsllm_letters, pat_dsllm_punct,
					    pat_dsllm_ws_eol, pat_dsllm_cjk,     pat_digits };

static const struct {
	const char *name;
	const char *const *patterns;
	size_t n;
} presets[] = {
	/* names as GGUF tokenizer.ggml.pre writes them (llama.cpp's converter);
	 * "gpt2" and "llama3" are this project's names of "gpt-2" and "llama-bpe" */
	{ "deepseek-llm", preset_dsllm, 6 },
	{ "deepseek-v3", preset_ds3, 3 },
	{ "gpt-2", preset_gpt2, 1 },
	{ "gpt2", preset_gpt2, 1 },
	{ "llama-bpe", preset_llama3, 1 },
	{ "llama3", preset_llama3, 1 },
	{ "qwen2", preset_qwen2, 1 },
	{ "smollm", preset_smollm, 2 },
};

const char tok_pretok_preset_names[] =
	"deepseek-llm, deepseek-v3, gpt-2, gpt2, llama-bpe, llama3, qwen2, smollm";

/* Compares pattern a (raw CR/LF allowed) with table entry b (escaped form). */
static int same_pattern(const char *a, const char *b)
{
	while (*a && *b) {
		if (*a == '\r' || *a == '\n') {
			if (b[0] != '\\' || b[1] != (*a == '\r' ? 'r' : 'n'))
				return 0;
			a++;
			b += 2;
			continue;
		}
		if (*a != *b)
			return 0;
		a++;
		b++;
	}
	return *a == *b;
}

tok_match_fn tok_pretok_lookup(const char *pattern)
{
	for (size_t i = 0; i < sizeof patterns / sizeof patterns[0]; i++)
		if (same_pattern(pattern, patterns[i].pattern))
			return patterns[i].fn;
	return NULL;
}

int tok_pretok_known(const char *pattern)
{
	return pattern && tok_pretok_lookup(pattern) != NULL;
}

int tok_pretok_preset(const char *name, const char *const **pats, size_t *n, ds_err *err)
{
	for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
		if (strcmp(presets[i].name, name) == 0) {
			*pats = presets[i].patterns;
			*n = presets[i].n;
			return 0;
		}
	}
	return ds_err_set(err, DS_ENOTFOUND, "pre-tokenizer '%s' is not supported (known: %s)", name,
			  tok_pretok_preset_names);
}

/* ---- code point buffer and the cascade -------------------------------------------- */

void tok_cpbuf_free(tok_cpbuf *b)
{
	if (!b)
		return;
	free(b->cp);
	free(b->cls);
	free(b->off);
	memset(b, 0, sizeof *b);
}

int tok_cpbuf_fill(tok_cpbuf *b, const char *text, size_t len)
{
	/* at most len code points, plus the end offset */
	if (len + 1 > b->cap) {
		size_t cap = b->cap ? b->cap : 256;
		while (cap < len + 1)
			cap *= 2;
		uint32_t *cp = realloc(b->cp, cap * sizeof *cp);
		if (cp)
			b->cp = cp;
		uint8_t *cls = realloc(b->cls, cap);
		if (cls)
			b->cls = cls;
		size_t *off = realloc(b->off, cap * sizeof *off);
		if (off)
			b->off = off;
		if (!cp || !cls || !off)
			return DS_ENOMEM;
		b->cap = cap;
	}
	const unsigned char *s = (const unsigned char *)text;
	size_t i = 0, n = 0;
	while (i < len) {
		uint32_t c;
		size_t k;
		if (s[i] < 0x80) {
			c = s[i];
			k = 1;
		} else {
			k = utf8_decode(s + i, len - i, &c);
		}
		b->cp[n] = c;
		b->cls[n] = (uint8_t)uni_class(c);
		b->off[n] = i;
		n++;
		i += k;
	}
	b->off[n] = len;
	b->n = n;
	return 0;
}

struct cascade {
	const tok_match_fn *fns;
	size_t nfns;
	const tok_cpbuf *b;
	tok_piece_fn fn;
	void *ctx;
};

static int split_level(const struct cascade *c, size_t level, size_t start, size_t end);

/* Split by \s+$ (m_ws_eol's rule) in one pass over the whitespace runs: in a
 * run [a, b) the match starts at a when b is the piece end (length b - a) or a
 * "\n" lies in (a, b) (length up to the last one); after that match, or when
 * neither holds, no position left in the run can match. */
static int split_ws_eol(const struct cascade *c, size_t level, size_t start, size_t end)
{
	const uint32_t *cp = c->b->cp;
	const uint8_t *cls = c->b->cls;
	size_t gap = start, a = start;
	int rc;
	while (a < end) {
		if (!(cls[a] & UNI_WS)) {
			a++;
			continue;
		}
		size_t b = a + run_cls(cls, a, end, UNI_WS), len = 0;
		if (b == end) {
			len = b - a;
		} else {
			for (size_t k = b - a - 1; k > 0 && !len; k--)
				if (cp[a + k] == '\n')
					len = k;
		}
		if (len) {
			if (gap < a && (rc = split_level(c, level + 1, gap, a)) != 0)
				return rc;
			if ((rc = split_level(c, level + 1, a, a + len)) != 0)
				return rc;
			gap = a + len;
		}
		a = b;
	}
	if (gap < end)
		return split_level(c, level + 1, gap, end);
	return 0;
}

static int split_level(const struct cascade *c, size_t level, size_t start, size_t end)
{
	if (level == c->nfns)
		return c->fn(c->ctx, c->b->off[start], c->b->off[end]);
	tok_match_fn m = c->fns[level];
	if (m == m_ws_eol)
		return split_ws_eol(c, level, start, end);
	const uint32_t *cp = c->b->cp;
	const uint8_t *cls = c->b->cls;
	size_t gap = start, i = start;
	int rc;
	while (i < end) {
		size_t len = m(cp, cls, i, end);
		if (len == 0) {
			i++;
			continue;
		}
		if (gap < i && (rc = split_level(c, level + 1, gap, i)) != 0)
			return rc;
		if ((rc = split_level(c, level + 1, i, i + len)) != 0)
			return rc;
		i += len;
		gap = i;
	}
	if (gap < end)
		return split_level(c, level + 1, gap, end);
	return 0;
}

int tok_pretok_run(const tok_match_fn *fns, size_t nfns, const tok_cpbuf *b, tok_piece_fn fn,
		   void *ctx)
{
	if (b->n == 0)
		return 0;
	struct cascade c = { fns, nfns, b, fn, ctx };
	return split_level(&c, 0, 0, b->n);
}

int tok_pretokenize(const char *const *pats, size_t npats, const char *text, size_t len,
		    tok_piece_fn fn, void *ctx, ds_err *err)
{
	tok_match_fn fns[16];
	tok_cpbuf b = { 0 };
	int rc = 0;
	if (npats > sizeof fns / sizeof fns[0]) {
		rc = ds_err_set(err, DS_EINVAL, "%zu split patterns: at most %zu", npats,
				sizeof fns / sizeof fns[0]);
		goto out;
	}
	for (size_t i = 0; i < npats; i++) {
		fns[i] = tok_pretok_lookup(pats[i]);
		if (!fns[i]) {
			rc = ds_err_set(err, DS_EUNSUPPORTED, "pre-tokenizer pattern not supported: \"%s\"",
					pats[i]);
			goto out;
		}
	}
	if ((rc = tok_cpbuf_fill(&b, text, len)) != 0) {
		ds_err_set(err, rc, "out of memory decoding %zu bytes", len);
		goto out;
	}
	rc = tok_pretok_run(fns, npats, &b, fn, ctx);
out:
	tok_cpbuf_free(&b);
	return rc;
}

/*
 * unicode.c - General Category / White_Space lookups and strict UTF-8 (see unicode.h).
 *
 * Called by the tokenizer's pre-tokenizer (tok_pretok.c) and byte-level
 * decoding (tok.c).  Pure functions over const tables: thread-safe.
 * Invariants: the generated run table partitions U+0000..U+10FFFF (so a binary
 * search always finds a run); well-formedness follows Unicode Table 3-7, which
 * is also the rule of Rust's str and Python's decoder.
 */
#include "engine/unicode_impl.h"

static const char *const gc_names[UNI_GC_COUNT] = {
	"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No",
	"Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So",
	"Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co",
};

static const unsigned char gc_class[UNI_GC_COUNT] = {
	[UNI_GC_CN] = UNI_C,
	[UNI_GC_LU] = UNI_L, [UNI_GC_LL] = UNI_L, [UNI_GC_LT] = UNI_L,
	[UNI_GC_LM] = UNI_L, [UNI_GC_LO] = UNI_L,
	[UNI_GC_MN] = UNI_M, [UNI_GC_MC] = UNI_M, [UNI_GC_ME] = UNI_M,
	[UNI_GC_ND] = UNI_N, [UNI_GC_NL] = UNI_N, [UNI_GC_NO] = UNI_N,
	[UNI_GC_PC] = UNI_P, [UNI_GC_PD] = UNI_P, [UNI_GC_PS] = UNI_P, [UNI_GC_PE] = UNI_P,
	[UNI_GC_PI] = UNI_P, [UNI_GC_PF] = UNI_P, [UNI_GC_PO] = UNI_P,
	[UNI_GC_SM] = UNI_S, [UNI_GC_SC] = UNI_S, [UNI_GC_SK] = UNI_S, [UNI_GC_SO] = UNI_S,
	[UNI_GC_ZS] = UNI_Z, [UNI_GC_ZL] = UNI_Z, [UNI_GC_ZP] = UNI_Z,
	[UNI_GC_CC] = UNI_C, [UNI_GC_CF] = UNI_C, [UNI_GC_CS] = UNI_C, [UNI_GC_CO] = UNI_C,
};

const char *uni_version(void)
{
	return uni_tables_version;
}

const char *uni_gc_name(enum uni_gc gc)
{
	return (unsigned)gc < UNI_GC_COUNT ? gc_names[gc] : "??";
}

enum uni_gc uni_gc_of(uint32_t cp)
{
	if (cp > UNI_MAX)
		return UNI_GC_CN;
	/* last run whose start <= cp */
	size_t lo = 0, hi = uni_gc_nruns; /* answer in [lo, hi) */
	while (hi - lo > 1) {
		size_t mid = lo + (hi - lo) / 2;
		if ((uni_gc_runs[mid] >> UNI_RUN_SHIFT) <= cp)
			lo = mid;
		else
			hi = mid;
	}
	return (enum uni_gc)(uni_gc_runs[lo] & ((1u << UNI_RUN_SHIFT) - 1));
}

static int is_white_space(uint32_t cp)
{
	for (size_t i = 0; i < uni_ws_nranges; i++) {
		if (cp < uni_ws_ranges[i][0])
			return 0;
		if (cp <= uni_ws_ranges[i][1])
			return 1;
	}
	return 0;
}

unsigned uni_class(uint32_t cp)
{
	unsigned c = gc_class[uni_gc_of(cp)];
	if (is_white_space(cp))
		c |= UNI_WS;
	return c;
}

/* Bytes of the sequence that starts with lead byte b, and the allowed range of
 * its second byte (Unicode Table 3-7); 0 when b cannot start a sequence. */
static int seq_shape(unsigned char b, unsigned char *lo2, unsigned char *hi2)
{
	*lo2 = 0x80;
	*hi2 = 0xBF;
	if (b < 0x80)
		return 1;
	if (b >= 0xC2 && b <= 0xDF)
		return 2;
	if (b >= 0xE0 && b <= 0xEF) {
		if (b == 0xE0)
			*lo2 = 0xA0;
		if (b == 0xED)
			*hi2 = 0x9F;
		return 3;
	}
	if (b >= 0xF0 && b <= 0xF4) {
		if (b == 0xF0)
			*lo2 = 0x90;
		if (b == 0xF4)
			*hi2 = 0x8F;
		return 4;
	}
	return 0;
}

/* Number of bytes of s[0..n) that fit the sequence begun by s[0] (1 for a
 * lone bad byte); *len gets the full length the sequence needs (0 = invalid). */
static size_t seq_check(const unsigned char *s, size_t n, size_t *len)
{
	unsigned char lo2, hi2;
	int need = seq_shape(s[0], &lo2, &hi2);
	*len = (size_t)need;
	if (need <= 1) {
		if (need == 0)
			*len = 0;
		return 1;
	}
	size_t i = 1;
	for (; i < (size_t)need && i < n; i++) {
		unsigned char lo = i == 1 ? lo2 : 0x80, hi = i == 1 ? hi2 : 0xBF;
		if (s[i] < lo || s[i] > hi) {
			*len = 0; /* invalid: the prefix s[0..i) is a maximal bad subpart */
			return i;
		}
	}
	return i;
}

size_t uni_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp)
{
	size_t len;
	size_t got = seq_check(s, n, &len);
	if (len == 0 || got < len) {
		*cp = UNI_INVALID_BASE + s[0];
		return 1;
	}
	uint32_t c;
	switch (len) {
	case 1: c = s[0]; break;
	case 2: c = ((uint32_t)(s[0] & 0x1F) << 6) | (s[1] & 0x3F); break;
	case 3: c = ((uint32_t)(s[0] & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F); break;
	default:
		c = ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
		    ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
		break;
	}
	*cp = c;
	return len;
}

size_t uni_utf8_encode(uint32_t cp, unsigned char out[4])
{
	if (cp >= UNI_INVALID_BASE && cp < UNI_INVALID_BASE + 256) {
		out[0] = (unsigned char)(cp - UNI_INVALID_BASE);
		return 1;
	}
	if (cp < 0x80) {
		out[0] = (unsigned char)cp;
		return 1;
	}
	if (cp < 0x800) {
		out[0] = (unsigned char)(0xC0 | (cp >> 6));
		out[1] = (unsigned char)(0x80 | (cp & 0x3F));
		return 2;
	}
	if (cp < 0x10000) {
		out[0] = (unsigned char)(0xE0 | (cp >> 12));
		out[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
		out[2] = (unsigned char)(0x80 | (cp & 0x3F));
		return 3;
	}
	out[0] = (unsigned char)(0xF0 | ((cp >> 18) & 0x07));
	out[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
	out[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
	out[3] = (unsigned char)(0x80 | (cp & 0x3F));
	return 4;
}

int uni_utf8_check(const unsigned char *s, size_t n, size_t *len)
{
	size_t need;
	size_t got = seq_check(s, n, &need);
	if (need == 0) {
		*len = got;
		return UNI_UTF8_INVALID;
	}
	if (got < need) {
		*len = got;
		return UNI_UTF8_INCOMPLETE;
	}
	*len = need;
	return UNI_UTF8_OK;
}

size_t uni_utf8_valid_prefix(const unsigned char *s, size_t n)
{
	size_t i = 0, len;
	while (i < n) {
		if (s[i] < 0x80) {
			i++;
			continue;
		}
		if (uni_utf8_check(s + i, n - i, &len) != UNI_UTF8_OK)
			break;
		i += len;
	}
	return i;
}

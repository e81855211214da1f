/*
 * utf8.c - strict UTF-8: decode, encode, check, the longest valid prefix
 * (see utf8.h).
 *
 * Callers: the tokenizer (engine/tok*.c, byte-level decoding and the
 * pre-tokenizer), the HTTP layer (agent/api/http.c: request bodies must be
 * UTF-8) and the OpenAI routes (streamed text ends on a whole character).
 * Pure functions: thread-safe.
 * Invariant: well-formedness follows Unicode Table 3-7, which is also the rule
 * of Rust's str and Python's decoder.
 */
#include "common/utf8.h"

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

size_t utf8_decode(const unsigned char *s, size_t n, uint32_t *cp)
{
	size_t len;
	size_t got = seq_check(s, n, &len);
	if (len == 0 || got < len) {
		*cp = UTF8_INVALID_BASE + s[0];
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

size_t utf8_encode(uint32_t cp, unsigned char out[4])
{
	if (cp >= UTF8_INVALID_BASE && cp < UTF8_INVALID_BASE + 256) {
		out[0] = (unsigned char)(cp - UTF8_INVALID_BASE);
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

int utf8_check(const unsigned char *s, size_t n, size_t *len)
{
	size_t need;
	size_t got = seq_check(s, n, &need);
	if (need == 0) {
		*len = got;
		return UTF8_INVALID;
	}
	if (got < need) {
		*len = got;
		return UTF8_INCOMPLETE;
	}
	*len = need;
	return UTF8_OK;
}

size_t utf8_valid_prefix(const unsigned char *s, size_t n)
{
	size_t i = 0, len;
	while (i < n) {
		if (s[i] < 0x80) {
			i++;
			continue;
		}
		if (utf8_check(s + i, n - i, &len) != UTF8_OK)
			break;
		i += len;
	}
	return i;
}

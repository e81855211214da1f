/*
 * utf8.h - strict UTF-8 (Unicode Table 3-7: no overlongs, no surrogates,
 * nothing above U+10FFFF), for the tokenizer and the HTTP layer alike.
 */
#ifndef DS_COMMON_UTF8_H
#define DS_COMMON_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* Pseudo code points for bytes that are not well-formed UTF-8: 0x110000 + byte
 * (byte-level tokenizers keep such bytes as symbols of their own). */
#define UTF8_INVALID_BASE 0x110000u

/* Decodes one code point from s[0..n) (n >= 1).  Returns the bytes consumed
 * (1..4).  Well-formed UTF-8 only (no overlongs, no surrogates, <= U+10FFFF);
 * anything else consumes one byte and yields UTF8_INVALID_BASE + s[0]. */
size_t utf8_decode(const unsigned char *s, size_t n, uint32_t *cp);

/* Encodes cp (<= U+10FFFF; pseudo code points give back their byte) into out;
 * returns the byte count (1..4). */
size_t utf8_encode(uint32_t cp, unsigned char out[4]);

/* What the bytes at s[0] (n >= 1) start:
 *   UTF8_OK          a well-formed character, *len = its bytes (1..4);
 *   UTF8_INCOMPLETE  s[0..n) is a proper prefix of a well-formed character;
 *   UTF8_INVALID     ill-formed: *len = the maximal ill-formed subpart
 *                        (the bytes that could still have begun a character,
 *                        >= 1), which is what one U+FFFD replaces under the
 *                        Unicode "best practice" (and Python's errors="replace"). */
enum { UTF8_OK = 0, UTF8_INCOMPLETE = 1, UTF8_INVALID = 2 };
int utf8_check(const unsigned char *s, size_t n, size_t *len);

/* Length of the longest prefix of s[0..n) that is well-formed UTF-8. */
size_t utf8_valid_prefix(const unsigned char *s, size_t n);

#endif

/*
 * hex.h - lower-case hexadecimal for ids, digests and signatures (node ids,
 * election ids, inventory digests, rpc signatures).
 */
#ifndef DS_COMMON_HEX_H
#define DS_COMMON_HEX_H

#include <stddef.h>
#include <stdint.h>

/* Writes 2n lower-case hex digits and a NUL into out (2n + 1 bytes). */
void ds_hex_encode(const uint8_t *in, size_t n, char *out);

/* Reads exactly 2n hex digits (either case) of s into out[n].  0, or -1 when
 * one of them is not a hex digit (out is then undefined).  The caller checks
 * that s holds 2n characters. */
int ds_hex_decode(const char *s, size_t n, uint8_t *out);

/* The value of one hex digit, or -1. */
int ds_hex_digit(char c);

#endif

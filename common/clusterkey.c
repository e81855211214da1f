/*
 * clusterkey.c - the cluster key file format (see clusterkey.h).
 *
 * Callers: ctl/main.c (`dsctl cluster init` formats a new key) and
 * agent/auth/clusterkey_file.c (the agent parses the file it read).  Calls
 * nothing but libc: dsctl links no libsodium, so the base64 of the format is
 * here, strict both ways.
 *
 * Invariants:
 *  1. A key line holds exactly the canonical padded base64 of 32 bytes: 43
 *     alphabet characters, the last with its two unused bits zero, then one
 *     '='.  Anything else is refused, so a key has one spelling.
 *  2. Every error path wipes the ring and the bytes decoded so far; messages
 *     name lines, never key bytes.
 *
 * Threading: pure functions on caller storage.
 */
#include "common/clusterkey.h"
#include "common/hex.h"

#include <stdio.h>
#include <string.h>

#define PREFIX "dsck1:"
#define PREFIX_LEN 6
#define B64_LEN 44 /* base64 of 32 bytes with its one '=' */

static const char b64_tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static int b64_value(char c)
{
	if (c >= 'A' && c <= 'Z')
		return c - 'A';
	if (c >= 'a' && c <= 'z')
		return c - 'a' + 26;
	if (c >= '0' && c <= '9')
		return c - '0' + 52;
	if (c == '+')
		return 62;
	if (c == '/')
		return 63;
	return -1;
}

/* Canonical padded base64 of exactly CLUSTERKEY_LEN bytes (invariant 1).
 * 0, or -1 with out wiped. */
static int b64_decode_key(const char *s, size_t n, uint8_t out[CLUSTERKEY_LEN])
{
	uint32_t acc = 0;
	int bits = 0;
	size_t o = 0;
	if (n != B64_LEN || s[B64_LEN - 1] != '=')
		return -1;
	for (size_t i = 0; i < B64_LEN - 1; i++) {
		int v = b64_value(s[i]);
		if (v < 0)
			goto bad;
		acc = acc << 6 | (uint32_t)v;
		bits += 6;
		if (bits >= 8) {
			bits -= 8;
			out[o++] = (uint8_t)(acc >> bits);
		}
	}
	if (o != CLUSTERKEY_LEN || bits != 2 || (acc & 3u) != 0)
		goto bad;
	explicit_bzero(&acc, sizeof acc);
	return 0;
bad:
	explicit_bzero(out, CLUSTERKEY_LEN);
	explicit_bzero(&acc, sizeof acc);
	return -1;
}

static void b64_encode(const uint8_t *in, size_t n, char *out)
{
	size_t o = 0;
	for (size_t i = 0; i < n; i += 3) {
		uint32_t v = (uint32_t)in[i] << 16;
		if (i + 1 < n)
			v |= (uint32_t)in[i + 1] << 8;
		if (i + 2 < n)
			v |= in[i + 2];
		out[o++] = b64_tab[v >> 18 & 63];
		out[o++] = b64_tab[v >> 12 & 63];
		out[o++] = i + 1 < n ? b64_tab[v >> 6 & 63] : '=';
		out[o++] = i + 2 < n ? b64_tab[v & 63] : '=';
	}
	out[o] = '\0';
}

void clusterkey_wipe(clusterkey_ring *k)
{
	explicit_bzero(k, sizeof *k);
}

static int space(char c)
{
	return c == ' ' || c == '\t' || c == '\r';
}

/* One key line s[0..n) (trimmed, not a comment) into the ring. */
static int parse_line(const char *s, size_t n, int line, clusterkey_ring *out, ds_err *err)
{
	uint8_t key[CLUSTERKEY_LEN];
	if (n < 10 || memcmp(s, PREFIX, PREFIX_LEN) != 0 || s[8] != ':' ||
	    ds_hex_digit(s[6]) < 0 || ds_hex_digit(s[7]) < 0)
		return ds_err_set(err, DS_EFORMAT,
				  "line %d is not a cluster key (expected "
				  "dsck1:<key id, 2 hex digits>:<base64 of 32 bytes>; make "
				  "one with `dsctl cluster init`)",
				  line);
	uint8_t kid = (uint8_t)(ds_hex_digit(s[6]) << 4 | ds_hex_digit(s[7]));
	if (b64_decode_key(s + 9, n - 9, key) != 0)
		return ds_err_set(err, DS_EFORMAT,
				  "line %d: the key is not 32 bytes in standard base64", line);
	int rc = DS_OK;
	for (int i = 0; i < out->n; i++)
		if (out->id[i] == kid)
			rc = ds_err_set(err, DS_EFORMAT, "line %d: key id %02x appears twice", line,
					kid);
	if (rc == DS_OK && out->n == CLUSTERKEY_MAX)
		rc = ds_err_set(err, DS_EFORMAT, "more than %d keys", CLUSTERKEY_MAX);
	if (rc == DS_OK) {
		out->id[out->n] = kid;
		memcpy(out->key[out->n], key, CLUSTERKEY_LEN);
		out->n++;
	}
	explicit_bzero(key, sizeof key);
	return rc;
}

int clusterkey_parse(const char *text, size_t len, clusterkey_ring *out, ds_err *err)
{
	memset(out, 0, sizeof *out);
	if (len == CLUSTERKEY_LEN) { /* a raw key: text lines are always longer */
		out->n = 1;
		out->id[0] = 0;
		memcpy(out->key[0], text, CLUSTERKEY_LEN);
		return DS_OK;
	}
	size_t o = 0;
	int line = 0;
	while (o < len) {
		size_t e = o;
		while (e < len && text[e] != '\n')
			e++;
		line++;
		size_t a = o, b = e;
		o = e + 1;
		while (a < b && space(text[a]))
			a++;
		while (b > a && space(text[b - 1]))
			b--;
		if (a == b || text[a] == '#')
			continue;
		int rc = parse_line(text + a, b - a, line, out, err);
		if (rc) {
			clusterkey_wipe(out);
			return rc;
		}
	}
	if (out->n == 0)
		return ds_err_set(err, DS_EFORMAT,
				  "no key in it (expected 32 raw bytes or lines "
				  "dsck1:<key id>:<base64 key>; make one with `dsctl cluster init`)");
	return DS_OK;
}

int clusterkey_format(uint8_t id, const uint8_t key[CLUSTERKEY_LEN], char *out, size_t cap,
		      ds_err *err)
{
	char b64[B64_LEN + 1];
	if (cap < CLUSTERKEY_LINE_MAX)
		return ds_err_set(err, DS_EINVAL, "cluster key line: buffer of %zu bytes, need %d",
				  cap, CLUSTERKEY_LINE_MAX);
	b64_encode(key, CLUSTERKEY_LEN, b64);
	snprintf(out, cap, PREFIX "%02x:%s\n", id, b64);
	explicit_bzero(b64, sizeof b64);
	return DS_OK;
}

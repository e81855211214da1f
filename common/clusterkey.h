/*
 * clusterkey.h - the text format of a cluster key file, in one place: dsctl
 * writes it (`dsctl cluster init`), dsagent parses it (agent/auth/
 * clusterkey_file.c reads the file), docs/cluster.md "Cluster key" documents it.
 *
 *     dsck1:<key id, 2 hex digits>:<the 32 key bytes in standard base64, padded>
 *
 * one line per key (the first seals, all open; up to CLUSTERKEY_MAX lines,
 * ids distinct; blank lines and '#' comments skipped, spaces, tabs and CRs
 * around a line ignored), or a file of exactly 32 raw bytes (key id 00).
 * Messages never show key material.  No allocation, no libsodium (dsctl
 * links neither): pure functions, thread-safe.
 */
#ifndef DS_COMMON_CLUSTERKEY_H
#define DS_COMMON_CLUSTERKEY_H

#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

#define CLUSTERKEY_LEN 32     /* key bytes */
#define CLUSTERKEY_MAX 4      /* keys in one file (the first one seals) */
#define CLUSTERKEY_LINE_MAX 64 /* one formatted line with its newline and NUL */

/* The keys a node seals with (key[0]) and accepts (all), each with its id
 * byte.  Wipe with clusterkey_wipe when done. */
typedef struct clusterkey_ring {
	int n;
	uint8_t id[CLUSTERKEY_MAX];
	uint8_t key[CLUSTERKEY_MAX][CLUSTERKEY_LEN];
} clusterkey_ring;

/* Parses the text of a key file (len bytes; no NUL needed) into *out.
 * DS_EFORMAT with a message saying what is wrong (the line number, never
 * the key); *out is wiped on error. */
int clusterkey_parse(const char *text, size_t len, clusterkey_ring *out, ds_err *err);

/* Writes the line "dsck1:<id>:<base64 of key>\n" into out (cap bytes, at
 * least CLUSTERKEY_LINE_MAX) with a NUL.  DS_EINVAL for a short buffer. */
int clusterkey_format(uint8_t id, const uint8_t key[CLUSTERKEY_LEN], char *out, size_t cap,
		      ds_err *err);

/* Zeroes the ring (and compilers may not drop it). */
void clusterkey_wipe(clusterkey_ring *k);

#endif

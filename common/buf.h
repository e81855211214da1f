/*
 * buf.h - a growable byte buffer with a hard maximum.
 *
 * Every buffer that grows from outside input (HTTP bodies, JSON output, log
 * fields, gossip frames) is a buf with a cap: appending past the cap fails with
 * DS_ERANGE and leaves the buffer as it was.  The data is always NUL-terminated
 * (the terminator is not counted in len), so text can be used as a C string.
 */
#ifndef DS_BUF_H
#define DS_BUF_H

#include <stddef.h>

typedef struct buf {
	char *data;   /* NULL until the first append */
	size_t len;   /* bytes stored, excluding the NUL */
	size_t alloc; /* bytes allocated */
	size_t max;   /* hard cap on len */
} buf;

/* Works on caller storage; max 0 = 1 GiB. */
void buf_init(buf *b, size_t max);
void buf_free(buf *b);
void buf_clear(buf *b);

/* 0, DS_ERANGE (would pass max) or DS_ENOMEM; on failure b is unchanged. */
int buf_append(buf *b, const void *data, size_t n);
int buf_puts(buf *b, const char *s);
int buf_printf(buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Hands the data to the caller (who frees it with free) and empties b. */
char *buf_take(buf *b);

#endif

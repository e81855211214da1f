/*
 * buf.c - capped growable buffer (see buf.h).
 * Invariant: data == NULL or data[len] == '\0' and len < alloc, len <= max.
 */
#include "common/buf.h"
#include "common/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void buf_init(buf *b, size_t max)
{
	b->data = NULL;
	b->len = 0;
	b->alloc = 0;
	b->max = max ? max : (size_t)1 << 30;
}

void buf_free(buf *b)
{
	if (!b)
		return;
	free(b->data);
	b->data = NULL;
	b->len = b->alloc = 0;
}

void buf_clear(buf *b)
{
	b->len = 0;
	if (b->data)
		b->data[0] = '\0';
}

static int reserve(buf *b, size_t extra)
{
	if (extra > b->max || b->len > b->max - extra)
		return DS_ERANGE;
	size_t need = b->len + extra + 1;
	if (need <= b->alloc)
		return DS_OK;
	size_t n = b->alloc ? b->alloc : 256;
	while (n < need)
		n *= 2;
	if (n > b->max + 1)
		n = b->max + 1;
	char *p = realloc(b->data, n);
	if (!p)
		return DS_ENOMEM;
	b->data = p;
	b->alloc = n;
	return DS_OK;
}

int buf_append(buf *b, const void *data, size_t n)
{
	int rc = reserve(b, n);
	if (rc)
		return rc;
	if (n)
		memcpy(b->data + b->len, data, n);
	b->len += n;
	b->data[b->len] = '\0';
	return DS_OK;
}

int buf_puts(buf *b, const char *s)
{
	return buf_append(b, s, strlen(s));
}

int buf_printf(buf *b, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(NULL, 0, fmt, ap);
	va_end(ap);
	if (n < 0)
		return DS_EINVAL;
	int rc = reserve(b, (size_t)n);
	if (rc)
		return rc;
	va_start(ap, fmt);
	vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
	va_end(ap);
	b->len += (size_t)n;
	return DS_OK;
}

char *buf_take(buf *b)
{
	char *p = b->data;
	if (!p)
		p = calloc(1, 1);
	b->data = NULL;
	b->len = b->alloc = 0;
	return p;
}

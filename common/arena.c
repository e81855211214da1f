/*
 * arena.c - chunked bump allocator (see arena.h).
 *
 * Invariants:
 *   1. chunks form a singly linked list, newest first; `used` of a chunk never
 *      exceeds its `size`.
 *   2. reserved == sum of chunk sizes <= cap (when cap != 0).
 *   3. arena_reset frees every chunk but the oldest, so a reused arena settles
 *      at one malloc per lifetime for the common small request.
 */
#include "common/arena.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct chunk {
	struct chunk *next;
	size_t size;
	size_t used;
	max_align_t data[]; /* size bytes */
};

struct arena {
	struct chunk *head;
	size_t chunk_size;
	size_t cap;
	size_t reserved;
	size_t handed;
};

arena *arena_new(size_t chunk_size, size_t cap)
{
	arena *a = calloc(1, sizeof *a);
	if (!a)
		return NULL;
	a->chunk_size = chunk_size ? chunk_size : 64 * 1024;
	a->cap = cap;
	return a;
}

void arena_free(arena *a)
{
	if (!a)
		return;
	struct chunk *c = a->head;
	while (c) {
		struct chunk *next = c->next;
		free(c);
		c = next;
	}
	free(a);
}

void *arena_alloc(arena *a, size_t size, size_t align)
{
	if (align == 0)
		align = 16;
	if ((align & (align - 1)) != 0 || size > SIZE_MAX / 2)
		return NULL;
	struct chunk *c = a->head;
	if (c) {
		uintptr_t base = (uintptr_t)c->data;
		uintptr_t p = (base + c->used + align - 1) & ~(uintptr_t)(align - 1);
		if (p + size <= base + c->size) {
			c->used = (size_t)(p - base) + size;
			a->handed += size;
			memset((void *)p, 0, size);
			return (void *)p;
		}
	}
	size_t need = size + align;
	size_t csize = need > a->chunk_size ? need : a->chunk_size;
	if (a->cap && (a->reserved + csize > a->cap)) {
		if (a->reserved + need > a->cap)
			return NULL;
		csize = need; /* a smaller final chunk still fits under the cap */
	}
	c = malloc(sizeof *c + csize);
	if (!c)
		return NULL;
	c->next = a->head;
	c->size = csize;
	c->used = 0;
	a->head = c;
	a->reserved += csize;
	uintptr_t base = (uintptr_t)c->data;
	uintptr_t p = (base + align - 1) & ~(uintptr_t)(align - 1);
	c->used = (size_t)(p - base) + size;
	a->handed += size;
	memset((void *)p, 0, size);
	return (void *)p;
}

char *arena_strdup(arena *a, const char *s)
{
	size_t n = strlen(s) + 1;
	char *d = arena_alloc(a, n, 1);
	if (d)
		memcpy(d, s, n);
	return d;
}

void arena_reset(arena *a)
{
	struct chunk *c = a->head;
	while (c && c->next) {
		struct chunk *next = c->next;
		a->reserved -= c->size;
		free(c);
		c = next;
	}
	a->head = c;
	if (c)
		c->used = 0;
	a->handed = 0;
}

size_t arena_used(const arena *a)
{
	return a->handed;
}

size_t arena_reserved(const arena *a)
{
	return a->reserved;
}

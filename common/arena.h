/*
 * arena.h - a bump allocator with a hard cap, for per-request and per-load
 * memory that is freed all at once.
 *
 * Memory comes in chunks (at least chunk_size bytes each); arena_alloc never
 * moves earlier allocations; the total never exceeds cap bytes, and a request
 * past the cap returns NULL (the caller turns that into DS_ERANGE).
 * Not thread-safe: one arena belongs to one owner.
 */
#ifndef DS_ARENA_H
#define DS_ARENA_H

#include <stddef.h>

typedef struct arena arena;

/* chunk_size 0 = 64 KiB; cap 0 = no cap. */
arena *arena_new(size_t chunk_size, size_t cap);
void arena_free(arena *a);

/* align must be a power of two (0 = 16).  Memory is zeroed.  NULL past cap. */
void *arena_alloc(arena *a, size_t size, size_t align);

/* Owned copy of s inside the arena (NULL past cap). */
char *arena_strdup(arena *a, const char *s);

/* Keeps the first chunk, forgets every allocation. */
void arena_reset(arena *a);

/* Bytes handed out since the last reset, and bytes reserved from malloc. */
size_t arena_used(const arena *a);
size_t arena_reserved(const arena *a);

#endif

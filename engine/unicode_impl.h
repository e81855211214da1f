/*
 * unicode_impl.h - private to unicode.c and the generated unicode_tables.c.
 */
#ifndef DS_ENGINE_UNICODE_IMPL_H
#define DS_ENGINE_UNICODE_IMPL_H

#include "engine/unicode.h"

/* Each entry: (start code point << UNI_RUN_SHIFT) | enum uni_gc; sorted by start,
 * the first starts at U+0000, each holds until the next entry's start. */
#define UNI_RUN_SHIFT 5
extern const uint32_t uni_gc_runs[];
extern const size_t uni_gc_nruns;

/* White_Space: inclusive ranges, sorted. */
extern const uint32_t uni_ws_ranges[][2];
extern const size_t uni_ws_nranges;

extern const char uni_tables_version[];

#endif

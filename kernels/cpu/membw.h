/*
 * membw.h - the machine's memory read bandwidth, measured the way the
 * decode matmuls read weights: a STREAM-like pass over a large buffer split
 * over the thread pool, best of a few repetitions.  The engine's benchmark
 * reports matmul throughput as a fraction of this bound.
 */
#ifndef DS_KERNELS_CPU_MEMBW_H
#define DS_KERNELS_CPU_MEMBW_H

#include <stddef.h>

/* Reads a buffer of `bytes` (rounded up to 4 KiB; use several times the
 * last-level cache) with `threads` threads (0 = the pool's current count; the
 * pool's count is restored afterwards) and sets *bytes_per_s to the best of 5
 * passes.  DS_EINVAL for bytes < 1 MiB or threads < 0, DS_ENOMEM when the
 * buffer cannot be allocated.  Uses the pool: one caller at a time. */
int kc_measure_read_bandwidth(size_t bytes, int threads, double *bytes_per_s);

/* STREAM's Triad, a[i] = b[i] + s * c[i] over three arrays of `elements`
 * doubles (use several times the last-level cache), counted as STREAM counts
 * it (24 bytes per element: two reads, one write); best of 5 passes, with the
 * same thread and error rules as above (DS_EINVAL below 128 Ki elements). */
int kc_measure_triad_bandwidth(size_t elements, int threads, double *bytes_per_s);

#endif

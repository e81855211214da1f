/*
 * membw.h - the machine's memory bandwidth, measured the way the decode
 * matmuls read weights (a pass over a large buffer split over the thread
 * pool) and as STREAM's Triad.  Two forms: a best-of-5 measurement, and a
 * probe kept open whose single passes a benchmark can interleave with the
 * work it measures (dsrun --bench --membw), so that both rates come from the
 * same stretch of time on a machine whose bandwidth moves from second to
 * second.
 */
#ifndef DS_KERNELS_CPU_MEMBW_H
#define DS_KERNELS_CPU_MEMBW_H

#include "kernels/backend.h"

#include <stddef.h>
#include <stdint.h>

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

/* An open probe: a read buffer and/or three Triad arrays, allocated and
 * first-touched by the pool at its current thread count. */
typedef struct kc_membw kc_membw;

/* read_bytes (>= 1 MiB, rounded up to 4 KiB) or 0 for no read buffer;
 * triad_elements (>= 128 Ki) or 0 for no Triad arrays.  DS_EINVAL for sizes
 * below those minimums, DS_ENOMEM when the buffers cannot be allocated. */
int kc_membw_open(kc_membw **out, size_t read_bytes, size_t triad_elements);
/* One pass: returns its seconds and sets *bytes to the bytes it counts
 * (Triad: 24 per element, as STREAM counts).  0 when the probe has no such
 * buffer.  Uses the pool: one caller at a time. */
double kc_membw_read_pass(kc_membw *p, double *bytes);
double kc_membw_triad_pass(kc_membw *p, double *bytes);
/* DS_EINTERNAL when the Triad result is not what the loop must compute. */
int kc_membw_triad_check(const kc_membw *p);
void kc_membw_close(kc_membw *p);

/* The decode kernels' own ceiling, for the same interleaving: one-row
 * products (M = 1, K = 2048) through kc_matmul_isa at the active ISA, over
 * HOTMM_BYTES_PER_THREAD of weights per pool thread, few enough to stay in
 * each core's L2.  A pass makes one untimed call to bring the weights in,
 * then HOTMM_CALLS timed ones, so it measures how fast the kernel consumes
 * weights when memory is not the limit (with the pool's dispatch, as the
 * engine calls it).  dt: KB_F8_E4M3 (128 x 128 block scales, random bytes
 * but the NaN codes) or KB_BF16, both random; x random.  DS_EINVAL for other
 * types, DS_ENOMEM when the buffers cannot be allocated.  Uses the pool at
 * its count when opened: one caller at a time. */
#define HOTMM_K 2048
#define HOTMM_BYTES_PER_THREAD ((size_t)512 << 10)
#define HOTMM_CALLS 8
typedef struct kc_hotmm kc_hotmm;
int kc_hotmm_open(kc_hotmm **out, enum kb_dtype dt);
/* One pass: its timed seconds, and *bytes = the weight bytes those calls read. */
double kc_hotmm_pass(kc_hotmm *h, double *bytes);
/* DS_EINTERNAL when the last pass's y is not the scalar reference's product
 * (within 1e-4 of the largest |y|): the probe timed the real product. */
int kc_hotmm_check(const kc_hotmm *h);
/* The product's output (*n floats), which a pass overwrites; for the tests. */
float *kc_hotmm_y(kc_hotmm *h, int64_t *n);
void kc_hotmm_close(kc_hotmm *h);

#endif

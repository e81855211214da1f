/*
 * profile.h - per-call timing of the CPU backend's ops: where a decode step
 * goes, measured in the engine itself (dsrun --bench --profile).
 *
 * While on, every op the cpu backend's ops table runs (backend_cpu.c) is
 * timed on the calling thread and added to one row per kind of call: the
 * op, and for products the weight dtype, N x K and the batch (or, for
 * matmul_multi, the number of products and the first one's dtype and
 * shape).  Off (the default), an op pays one load and a branch.
 * Thread rule: as for the pool (pool.h), one caller of the ops at a time;
 * start, stop and rows are called from that thread, between ops.
 */
#ifndef DS_KERNELS_CPU_PROFILE_H
#define DS_KERNELS_CPU_PROFILE_H

#include "kernels/backend.h"

#include <stdint.h>

/* Kinds of call kept; calls of further kinds are counted in
 * kc_profile_dropped, not timed. */
#define KC_PROF_MAX_ROWS 128

typedef struct kc_prof_row {
	/* "matmul f8_e4m3 2048x7168" (N x K), "matmul 16 x f8_e4m3 512x128"
	 * (batched), "matmul_multi of 16, first f8_e4m3 512x2048", "mla_attn" */
	char call[80];
	int64_t calls;
	double seconds;      /* wall time inside the op, summed */
	double weight_bytes; /* products: weight bytes read (FP8 block scales included), summed */
} kc_prof_row;

/* Clears the rows and turns timing on. */
void kc_profile_start(void);
/* Turns timing off; the rows stay until the next start. */
void kc_profile_stop(void);
/* Copies up to max rows, largest seconds first; returns how many. */
int kc_profile_rows(kc_prof_row *out, int max);
/* Calls since the last start that found the table full. */
int64_t kc_profile_dropped(void);

/* backend_cpu.c's side: on or off, and one call's time (ds_now_s). */
extern int kc_profile_enabled;
void kc_profile_add_op(enum kb_op op, double seconds);
void kc_profile_add_matmul(const kb_matmul_args *a, int n, double seconds);

#endif

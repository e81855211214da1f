/*
 * profile.c - per-call timing of the CPU backend's ops (see profile.h).
 * A row per kind of call, found by a linear search of its key: a decode
 * step has a few dozen kinds, and the search costs less than the clock.
 */
#include "kernels/cpu/profile.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct prof_key {
	int op;      /* enum kb_op; matmul_multi is KB_OP_MATMUL with n > 0 */
	int dt;      /* products: the (first) weight dtype */
	int64_t n;   /* matmul: batch (0 or 1: one); matmul_multi: products */
	int64_t N, K;
} prof_key;

typedef struct prof_row {
	prof_key k;
	int64_t calls;
	double seconds, bytes;
} prof_row;

int kc_profile_enabled;
static prof_row rows[KC_PROF_MAX_ROWS];
static int n_rows;
static int64_t dropped;

void kc_profile_start(void)
{
	memset(rows, 0, sizeof rows);
	n_rows = 0;
	dropped = 0;
	kc_profile_enabled = 1;
}

void kc_profile_stop(void)
{
	kc_profile_enabled = 0;
}

int64_t kc_profile_dropped(void)
{
	return dropped;
}

static void add(const prof_key *k, double seconds, double bytes)
{
	int i = 0;
	while (i < n_rows && memcmp(&rows[i].k, k, sizeof *k) != 0)
		i++;
	if (i == n_rows) {
		if (n_rows == KC_PROF_MAX_ROWS) {
			dropped++;
			return;
		}
		rows[n_rows++].k = *k;
	}
	rows[i].calls++;
	rows[i].seconds += seconds;
	rows[i].bytes += bytes;
}

void kc_profile_add_op(enum kb_op op, double seconds)
{
	prof_key k;
	memset(&k, 0, sizeof k); /* the key is compared as bytes: padding too */
	k.op = (int)op;
	add(&k, seconds, 0.0);
}

/* Weight bytes one product reads: W, and for FP8 its block scales. */
static double weight_bytes(const kb_matmul_args *a)
{
	const double items = a->batch > 1 ? (double)a->batch : 1.0;
	double b = (double)kb_dtype_bytes(a->wtype, a->K) * (double)a->N;
	if (a->wtype == KB_F8_E4M3 && a->block > 0)
		b += 4.0 * (double)((a->N + a->block - 1) / a->block) * (double)((a->K + a->block - 1) / a->block);
	return b * items;
}

void kc_profile_add_matmul(const kb_matmul_args *a, int n, double seconds)
{
	prof_key k;
	memset(&k, 0, sizeof k);
	k.op = KB_OP_MATMUL;
	k.dt = (int)a[0].wtype;
	k.n = n > 0 ? n : -(a[0].batch > 1 ? a[0].batch : 1); /* < 0: one matmul of that batch */
	k.N = a[0].N;
	k.K = a[0].K;
	double bytes = 0.0;
	for (int i = 0; i < (n > 0 ? n : 1); i++)
		bytes += weight_bytes(&a[i]);
	add(&k, seconds, bytes);
}

static int by_seconds(const void *pa, const void *pb)
{
	const prof_row *a = pa, *b = pb;
	return a->seconds < b->seconds ? 1 : a->seconds > b->seconds ? -1 : 0;
}

int kc_profile_rows(kc_prof_row *out, int max)
{
	prof_row sorted[KC_PROF_MAX_ROWS];
	memcpy(sorted, rows, (size_t)n_rows * sizeof *rows);
	qsort(sorted, (size_t)n_rows, sizeof *sorted, by_seconds);
	int n = n_rows < max ? n_rows : max;
	for (int i = 0; i < n; i++) {
		const prof_key *k = &sorted[i].k;
		kc_prof_row *r = &out[i];
		if (k->op != KB_OP_MATMUL)
			snprintf(r->call, sizeof r->call, "%s", kb_op_name((enum kb_op)k->op));
		else if (k->n > 0)
			snprintf(r->call, sizeof r->call, "matmul_multi of %lld, first %s %lldx%lld", (long long)k->n,
				 kb_dtype_name((enum kb_dtype)k->dt), (long long)k->N, (long long)k->K);
		else if (k->n < -1)
			snprintf(r->call, sizeof r->call, "matmul %lld x %s %lldx%lld", (long long)-k->n,
				 kb_dtype_name((enum kb_dtype)k->dt), (long long)k->N, (long long)k->K);
		else
			snprintf(r->call, sizeof r->call, "matmul %s %lldx%lld", kb_dtype_name((enum kb_dtype)k->dt),
				 (long long)k->N, (long long)k->K);
		r->calls = sorted[i].calls;
		r->seconds = sorted[i].seconds;
		r->weight_bytes = sorted[i].bytes;
	}
	return n;
}

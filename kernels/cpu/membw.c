/*
 * membw.c - memory read bandwidth probe (see membw.h).
 *
 * The buffer is first touched by the same pool split that reads it (so pages
 * land near the threads that read them), then each pass reads every byte of
 * each thread's slice as 2 interleaved sequential streams, with the widest
 * loads this CPU has, into
 * accumulators whose combination is published to a global, so the loads
 * cannot be elided.
 * The hot-product probe (kc_hotmm) times the decode matmul on weights that
 * stay in L2, for the ceiling the kernels put on a decode step whatever the
 * memory does.
 * Called by the benchmarks; not used on any serving path.  Thread rule: one
 * caller at a time (the pool's rule).
 */
#include "kernels/cpu/membw.h"

#include "common/fileutil.h"
#include "common/status.h"
#include "common/strutil.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define PAGE 4096
/* Streams per thread: on the Zen 4 machines measured, 1 or 2 long streams
 * read 5-15% faster than 8 (the layout of a matmul panel), so the bound is
 * the higher figure. */
#define STREAMS 2

typedef struct bw_job {
	unsigned char *buf;
	enum kc_isa isa;
	uint64_t sink[KC_POOL_MAX_THREADS]; /* one slot per chunk index modulo the size */
} bw_job;

static uint64_t bw_sink; /* read by nobody; keeps the passes alive */

static uint64_t read_scalar(const unsigned char *p, size_t n)
{
	const uint64_t *q = (const uint64_t *)p;
	uint64_t a = 0, b = 0, c = 0, d = 0;
	for (size_t i = 0; i + 4 <= n / 8; i += 4) {
		a ^= q[i];
		b ^= q[i + 1];
		c ^= q[i + 2];
		d ^= q[i + 3];
	}
	return a ^ b ^ c ^ d;
}

#if defined(__x86_64__)
/* STREAMS interleaved streams per thread. */
__attribute__((target("avx2"))) static uint64_t read_avx2(const unsigned char *p, size_t n)
{
	const size_t len = n / STREAMS;
	__m256i a = _mm256_setzero_si256(), b = a;
	for (size_t i = 0; i < len; i += 64) {
		for (int s = 0; s < STREAMS; s++) {
			const unsigned char *q = p + (size_t)s * len + i;
			a = _mm256_xor_si256(a, _mm256_load_si256((const __m256i *)q));
			b = _mm256_xor_si256(b, _mm256_load_si256((const __m256i *)(q + 32)));
		}
	}
	a = _mm256_xor_si256(a, b);
	return (uint64_t)_mm256_extract_epi64(a, 0) ^ (uint64_t)_mm256_extract_epi64(a, 3);
}

__attribute__((target("avx512f"))) static uint64_t read_avx512(const unsigned char *p, size_t n)
{
	const size_t len = n / STREAMS; /* a multiple of 128: n is whole pages */
	__m512i a = _mm512_setzero_si512(), b = a;
	for (size_t i = 0; i < len; i += 128) {
		for (int s = 0; s < STREAMS; s++) {
			const unsigned char *q = p + (size_t)s * len + i;
			a = _mm512_xor_si512(a, _mm512_load_si512((const void *)q));
			b = _mm512_xor_si512(b, _mm512_load_si512((const void *)(q + 64)));
		}
	}
	a = _mm512_xor_si512(a, b);
	return (uint64_t)_mm512_reduce_add_epi64(a);
}
#endif

static void touch_item(void *ctx, int64_t b, int64_t e)
{
	bw_job *j = ctx;
	for (int64_t i = b; i < e; i++)
		memset(j->buf + (size_t)i * PAGE, (int)(i & 0x7f), PAGE);
}

static void read_item(void *ctx, int64_t b, int64_t e)
{
	bw_job *j = ctx;
	const unsigned char *p = j->buf + (size_t)b * PAGE;
	size_t n = (size_t)(e - b) * PAGE;
	uint64_t v;
	switch (j->isa) {
#if defined(__x86_64__)
	case KC_ISA_AVX512BF16:
	case KC_ISA_AVX512: v = read_avx512(p, n); break;
	case KC_ISA_AVX2: v = read_avx2(p, n); break;
#endif
	default: v = read_scalar(p, n); break;
	}
	/* chunks may share a slot; the value is irrelevant, only its dependence */
	__atomic_fetch_xor(&j->sink[(size_t)b % KC_POOL_MAX_THREADS], v, __ATOMIC_RELAXED);
}

/* ---- STREAM Triad: a[i] = b[i] + s * c[i] ---- */

struct triad_job {
	double *a, *b, *c;
	double s;
};

static void triad_init(void *ctx, int64_t b, int64_t e)
{
	struct triad_job *j = ctx;
	for (int64_t i = b; i < e; i++) {
		j->a[i] = 1.0;
		j->b[i] = 2.0;
		j->c[i] = 0.5 + (double)(i & 7);
	}
}

static void triad_item(void *ctx, int64_t b, int64_t e)
{
	struct triad_job *j = ctx;
	double *restrict a = j->a;
	const double *restrict bb = j->b, *restrict c = j->c;
	const double s = j->s;
	for (int64_t i = b; i < e; i++)
		a[i] = bb[i] + s * c[i];
}

/* Buffers come from ds_huge_alloc, in 2 MiB transparent huge pages where
 * the kernel offers them (as the engine holds its weights on the cpu
 * backend): with 4 KiB pages every 4 KiB read costs a TLB miss, and the
 * probe read about a third less at the machine's best moments. */

/* ---- the probe kept open (kc_membw_*) ---- */

struct kc_membw {
	bw_job *rd;        /* read buffer, `pages` pages */
	int64_t pages, rd_grain;
	struct triad_job *tr; /* Triad arrays, `elements` doubles each */
	size_t rd_len, tr_len; /* ds_huge_alloc lengths of the read buffer, each Triad array */
	int64_t elements, tr_grain;
};

int kc_membw_open(kc_membw **out, size_t read_bytes, size_t triad_elements)
{
	if (!out || (read_bytes && read_bytes < ((size_t)1 << 20)) ||
	    (triad_elements && triad_elements < ((size_t)1 << 17)))
		return DS_EINVAL;
	*out = NULL;
	kc_membw *p = calloc(1, sizeof *p);
	if (!p)
		return DS_ENOMEM;
	int nt = kc_pool_threads();
	if (read_bytes) {
		p->pages = (int64_t)((read_bytes + PAGE - 1) / PAGE);
		p->rd = calloc(1, sizeof *p->rd);
		if (!p->rd || !(p->rd->buf = ds_huge_alloc((size_t)p->pages * PAGE, &p->rd_len))) {
			kc_membw_close(p);
			return DS_ENOMEM;
		}
		p->rd->isa = kc_isa_active();
		p->rd_grain = (p->pages + nt - 1) / nt; /* one contiguous slice per thread */
		kc_parallel_for(p->pages, p->rd_grain, touch_item, p->rd);
	}
	if (triad_elements) {
		size_t bytes = (triad_elements * sizeof(double) + PAGE - 1) / PAGE * PAGE;
		p->elements = (int64_t)triad_elements;
		p->tr = calloc(1, sizeof *p->tr);
		if (!p->tr || !(p->tr->a = ds_huge_alloc(bytes, &p->tr_len)) ||
		    !(p->tr->b = ds_huge_alloc(bytes, &p->tr_len)) ||
		    !(p->tr->c = ds_huge_alloc(bytes, &p->tr_len))) {
			kc_membw_close(p);
			return DS_ENOMEM;
		}
		p->tr->s = 3.0;
		p->tr_grain = (p->elements + nt - 1) / nt;
		kc_parallel_for(p->elements, p->tr_grain, triad_init, p->tr); /* first touch by the same split */
	}
	*out = p;
	return DS_OK;
}

/* Seconds one pass of fn over n items takes, split as the probe was touched. */
static double timed_pass(int64_t n, int64_t grain, void (*fn)(void *, int64_t, int64_t), void *ctx)
{
	double t0 = ds_now_s();
	kc_parallel_for(n, grain, fn, ctx);
	return ds_now_s() - t0;
}

double kc_membw_read_pass(kc_membw *p, double *bytes)
{
	if (!p || !p->rd)
		return 0.0;
	double dt = timed_pass(p->pages, p->rd_grain, read_item, p->rd);
	uint64_t s = 0;
	for (int i = 0; i < KC_POOL_MAX_THREADS; i++)
		s ^= p->rd->sink[i];
	__atomic_store_n(&bw_sink, s, __ATOMIC_RELAXED);
	if (bytes)
		*bytes = (double)p->pages * PAGE;
	return dt;
}

double kc_membw_triad_pass(kc_membw *p, double *bytes)
{
	if (!p || !p->tr)
		return 0.0;
	double dt = timed_pass(p->elements, p->tr_grain, triad_item, p->tr);
	if (bytes)
		*bytes = 3.0 * sizeof(double) * (double)p->elements;
	return dt;
}

int kc_membw_triad_check(const kc_membw *p)
{
	/* a[] = 2 + 3 * c[] must hold after a pass, or the loop was not run as written */
	if (!p || !p->tr)
		return DS_OK;
	for (int64_t i = 0; i < p->elements; i += 4099)
		if (p->tr->a[i] != 2.0 + 3.0 * (0.5 + (double)(i & 7)))
			return DS_EINTERNAL;
	return DS_OK;
}

void kc_membw_close(kc_membw *p)
{
	if (!p)
		return;
	if (p->rd)
		ds_huge_free(p->rd->buf, p->rd_len);
	free(p->rd);
	if (p->tr) {
		ds_huge_free(p->tr->a, p->tr_len);
		ds_huge_free(p->tr->b, p->tr_len);
		ds_huge_free(p->tr->c, p->tr_len);
	}
	free(p->tr);
	free(p);
}

/* Best of 5 passes of one kind on a probe opened with `threads` threads. */
static int measure_best(size_t read_bytes, size_t triad_elements, int threads, double *bytes_per_s)
{
	if (threads < 0 || threads > KC_POOL_MAX_THREADS || !bytes_per_s)
		return DS_EINVAL;
	int prev = kc_pool_threads(), rc = DS_OK;
	kc_membw *p = NULL;
	if (threads > 0 && threads != prev && (rc = kc_pool_set_threads(threads)) != DS_OK)
		return rc;
	if ((rc = kc_membw_open(&p, read_bytes, triad_elements)) == DS_OK) {
		double best = 1e30, bytes = 0.0;
		for (int rep = 0; rep < 5; rep++) {
			double dt = read_bytes ? kc_membw_read_pass(p, &bytes) : kc_membw_triad_pass(p, &bytes);
			if (dt < best)
				best = dt;
		}
		rc = kc_membw_triad_check(p);
		if (rc == DS_OK)
			*bytes_per_s = bytes / best;
		kc_membw_close(p);
	}
	if (threads > 0 && threads != prev)
		kc_pool_set_threads(prev);
	return rc;
}

int kc_measure_read_bandwidth(size_t bytes, int threads, double *bytes_per_s)
{
	if (bytes < ((size_t)1 << 20))
		return DS_EINVAL;
	return measure_best(bytes, 0, threads, bytes_per_s);
}

int kc_measure_triad_bandwidth(size_t elements, int threads, double *bytes_per_s)
{
	if (elements < ((size_t)1 << 17))
		return DS_EINVAL;
	return measure_best(0, elements, threads, bytes_per_s);
}

/* ---- the hot-product probe ---- */

struct kc_hotmm {
	kb_matmul_args a;
	void *w;
	float *scale, *x, *y;
	size_t w_bytes;
};

static uint64_t hot_rand(uint64_t *s)
{
	*s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
	return *s;
}

/* Uniform in [-1, 1). */
static float hot_unit(uint64_t *s)
{
	return (float)((double)(hot_rand(s) >> 11) * 0x1p-52 - 1.0);
}

int kc_hotmm_open(kc_hotmm **out, enum kb_dtype dt)
{
	if (!out || (dt != KB_F8_E4M3 && dt != KB_BF16))
		return DS_EINVAL;
	*out = NULL;
	kc_hotmm *h = calloc(1, sizeof *h);
	if (!h)
		return DS_ENOMEM;
	const int64_t K = HOTMM_K, esz = dt == KB_BF16 ? 2 : 1;
	/* FP8: 256 rows a thread, whole 128-row scale blocks */
	const int64_t N = (int64_t)(HOTMM_BYTES_PER_THREAD / (size_t)(K * esz)) * kc_pool_threads();
	const int64_t sb = K / 128, n_scales = (N + 127) / 128 * sb;
	h->w_bytes = (size_t)(N * K * esz);
	h->w = aligned_alloc(64, h->w_bytes);
	h->x = aligned_alloc(64, (size_t)K * sizeof(float));
	h->y = aligned_alloc(64, (size_t)N * sizeof(float));
	h->scale = malloc((size_t)n_scales * sizeof(float));
	if (!h->w || !h->x || !h->y || !h->scale) {
		kc_hotmm_close(h);
		return DS_ENOMEM;
	}
	uint64_t s = 0x9E3779B97F4A7C15ull;
	for (int64_t k = 0; k < K; k++)
		h->x[k] = hot_unit(&s);
	if (dt == KB_F8_E4M3) {
		uint8_t *w = h->w;
		for (size_t i = 0; i < h->w_bytes; i++) {
			uint8_t b = (uint8_t)hot_rand(&s);
			w[i] = (b & 0x7F) == 0x7F ? (uint8_t)(b - 1) : b; /* no NaN codes */
		}
		for (int64_t i = 0; i < n_scales; i++)
			h->scale[i] = 0.01f * (1.5f + hot_unit(&s));
	} else {
		uint16_t *w = h->w;
		for (int64_t i = 0; i < N * K; i++) {
			float f = hot_unit(&s);
			uint32_t u;
			memcpy(&u, &f, sizeof u);
			w[i] = (uint16_t)(u >> 16);
		}
	}
	h->a = (kb_matmul_args){.y = h->y, .x = h->x, .w = h->w, .wtype = dt, .M = 1, .N = N, .K = K,
				.x_stride = K, .y_stride = N, .w_stride = K};
	if (dt == KB_F8_E4M3) {
		h->a.w_scale = h->scale;
		h->a.scale_stride = sb;
		h->a.block = 128;
	}
	*out = h;
	return DS_OK;
}

double kc_hotmm_pass(kc_hotmm *h, double *bytes)
{
	if (!h)
		return 0.0;
	const enum kc_isa isa = kc_isa_active();
	kc_matmul_isa(isa, &h->a); /* the weights into L2 */
	double t0 = ds_now_s();
	for (int i = 0; i < HOTMM_CALLS; i++)
		kc_matmul_isa(isa, &h->a);
	double dt = ds_now_s() - t0;
	if (bytes)
		*bytes = (double)h->w_bytes * HOTMM_CALLS;
	return dt;
}

int kc_hotmm_check(const kc_hotmm *h)
{
	if (!h)
		return DS_OK;
	float *ref = malloc((size_t)h->a.N * sizeof *ref);
	if (!ref)
		return DS_ENOMEM;
	kb_matmul_args r = h->a;
	r.y = ref;
	kc_matmul_ref(&r);
	float big = 0.0f;
	for (int64_t n = 0; n < h->a.N; n++)
		big = fabsf(ref[n]) > big ? fabsf(ref[n]) : big;
	int rc = big > 0.0f ? DS_OK : DS_EINTERNAL;
	for (int64_t n = 0; n < h->a.N && !rc; n++)
		if (!(fabsf(h->y[n] - ref[n]) <= 1e-4f * big))
			rc = DS_EINTERNAL;
	free(ref);
	return rc;
}

float *kc_hotmm_y(kc_hotmm *h, int64_t *n)
{
	*n = h ? h->a.N : 0;
	return h ? h->y : NULL;
}

void kc_hotmm_close(kc_hotmm *h)
{
	if (!h)
		return;
	free(h->w);
	free(h->scale);
	free(h->x);
	free(h->y);
	free(h);
}

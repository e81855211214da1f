/*
 * quant.c - GGUF block-quantized weights on the CPU (see quant.h): scalar
 * dequantization, the scalar activation quantizer and block dot products
 * (the reference), and the driver of the quantized matmul that runs the
 * per-ISA kernels of quant_avx2.c / quant_avx512.c (quant_impl.h).
 *
 * Called by backend_cpu.c (matmul, embed), dequant.c (dequant op),
 * tests/conformance and tests/unit.  Calls the thread pool (pool.h).
 *
 * Threading rule: one caller at a time per pool (pool.h); the activation
 * scratch is per calling thread (thread-local, freed by a pthread key
 * destructor at thread exit), so two threads may call concurrently (the second
 * runs serially, pool rule) without sharing it.
 *
 * Invariants:
 *  1. Every quantizer (scalar here, SIMD in the ISA files) produces the same
 *     bits: level 1 with amax exact, d1 = amax / 127 and 127 / amax in f32,
 *     q1 by round-to-nearest-even of x * (127 / amax); level 2 as
 *     quant_level2 (f32 operations in the same order, no FMA); sums exact
 *     integers.  Each x row becomes act rows 2r, 2r + 1 (quant_impl.h).
 *  2. The reference quantizes each block on the fly and never allocates; the
 *     scalar ISA runs the same block dot products (level 1 then level 2 per
 *     block) through the driver, so it matches the reference bit for bit.
 *  3. The driver allocates only when the thread's scratch is too small
 *     (capped at KC_QUANT_SCRATCH_MAX; larger M runs in row chunks).  A GEMM
 *     work item keeps its packed panel on its thread's stack (about 80 KiB
 *     with the unpack buffer of the ISA's pack function).
 *  4. Each y element is computed by one thread through a fixed sequence of
 *     operations (K chunks in order), so results do not depend on the
 *     thread count.
 */
#include "kernels/cpu/quant.h"

#include "kernels/cpu/pool.h"
#include "kernels/cpu/quant_impl.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* The little-endian f16 at p. */
static float q_f16(const uint8_t *p)
{
	return kc_f16_to_f32((uint16_t)(p[0] | p[1] << 8));
}

/* ---- dequantization ---- */

static void deq_q8_0(const uint8_t *b, float *o)
{
	const float d = q_f16(b);
	for (int i = 0; i < 32; i++)
		o[i] = d * (float)(int8_t)b[2 + i];
}

static void deq_q4_0(const uint8_t *b, float *o)
{
	const float d = q_f16(b);
	for (int i = 0; i < 16; i++) {
		o[i] = d * (float)((b[2 + i] & 15) - 8);
		o[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
	}
}

static void deq_q4_1(const uint8_t *b, float *o)
{
	const float d = q_f16(b), m = q_f16(b + 2);
	for (int i = 0; i < 16; i++) {
		o[i] = d * (float)(b[4 + i] & 15) + m;
		o[i + 16] = d * (float)(b[4 + i] >> 4) + m;
	}
}

/* Q4_K (qh == NULL) and Q5_K. */
static void deq_k45(const uint8_t *b, const uint8_t *qh, const uint8_t *qs, float *o)
{
	const float d = q_f16(b), dmin = q_f16(b + 2);
	for (int c = 0; c < 4; c++) {
		int s0, m0, s1, m1;
		kc_q_scale_min_k4(b + 4, 2 * c, &s0, &m0);
		kc_q_scale_min_k4(b + 4, 2 * c + 1, &s1, &m1);
		const float d0 = d * (float)s0, n0 = dmin * (float)m0;
		const float d1 = d * (float)s1, n1 = dmin * (float)m1;
		for (int i = 0; i < 32; i++) {
			int lo = qs[32 * c + i] & 15, hi = qs[32 * c + i] >> 4;
			if (qh) {
				lo |= ((qh[i] >> (2 * c)) & 1) << 4;
				hi |= ((qh[i] >> (2 * c + 1)) & 1) << 4;
			}
			o[64 * c + i] = d0 * (float)lo - n0;
			o[64 * c + 32 + i] = d1 * (float)hi - n1;
		}
	}
}

/* The unsigned 6-bit value of element e (< 256) of a Q6_K block. */
static int q6_value(const uint8_t *b, int e)
{
	const uint8_t *L = b + 64 * (e / 128), *H = b + 128 + 32 * (e / 128);
	const int quad = (e % 128) / 32, i = e % 32;
	const int low = quad & 1 ? L[i + 32] : L[i];
	return ((quad & 2 ? low >> 4 : low & 15) | ((H[i] >> (2 * quad)) & 3) << 4);
}

static void deq_q6_k(const uint8_t *b, float *o)
{
	const float d = q_f16(b + 208);
	for (int e = 0; e < 256; e++)
		o[e] = d * (float)(int8_t)b[192 + e / 16] * (float)(q6_value(b, e) - 32);
}

void kc_dequant_row_ref(enum kb_dtype t, const void *src, float *dst, int64_t n)
{
	if (!kb_dtype_is_quant(t))
		return;
	const uint8_t *b = src;
	const int64_t blk = kb_dtype_block(t);
	const size_t bb = kb_dtype_block_bytes(t);
	for (int64_t i = 0; i + blk <= n; i += blk, b += bb) {
		float *o = dst + i;
		switch (t) {
		case KB_Q8_0: deq_q8_0(b, o); break;
		case KB_Q4_0: deq_q4_0(b, o); break;
		case KB_Q4_1: deq_q4_1(b, o); break;
		case KB_Q4_K: deq_k45(b, NULL, b + 16, o); break;
		case KB_Q5_K: deq_k45(b, b + 16, b + 48, o); break;
		case KB_Q6_K: deq_q6_k(b, o); break;
		default: break;
		}
	}
}

/* ---- activation quantization (invariant 1) ---- */

/* n values -> q, returns dx. */
static float quant_run(const float *x, int n, int8_t *q)
{
	float amax = 0.0f;
	for (int i = 0; i < n; i++) {
		float a = fabsf(x[i]);
		if (a > amax)
			amax = a;
	}
	const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
	for (int i = 0; i < n; i++)
		q[i] = (int8_t)lrintf(x[i] * id);
	return amax / 127.0f;
}

static int16_t sum16(const int8_t *q)
{
	int s = 0;
	for (int i = 0; i < 16; i++)
		s += q[i];
	return (int16_t)s;
}

/* One block of the activation format (32 or 256 values): q, d, bs[blk / 16],
 * and for 32-blocks s = d * (float)sum. */
static void quant_block(const float *x, int blk, int8_t *q, float *d, float *s, int16_t *bs)
{
	*d = quant_run(x, blk, q);
	int sum = 0;
	for (int i = 0; i < blk / 16; i++) {
		bs[i] = sum16(q + 16 * i);
		sum += bs[i];
	}
	if (s)
		*s = *d * (float)sum;
}

static void quantize_scalar(const float *x, int64_t K, int a256, const kc_qact *act)
{
	const int blk = a256 ? 256 : 32;
	for (int64_t b = 0; b < K / blk; b++) {
		float s = 0.0f;
		quant_block(x + b * blk, blk, act->q + b * blk, act->d + b, a256 ? NULL : &s,
			    act->bs + b * (blk / 16));
		if (!a256) {
			act->ds[2 * b] = act->d[b];
			act->ds[2 * b + 1] = s;
		}
	}
}

/* Level 2 of one activation block (n = 32 or 256 values, level 1 q1 with
 * scale d1): the residual x - d1 q1 (f32) on the fixed scale d2 = d1 / 256,
 *   q2 = clamp(round-to-nearest-even((x - d1 q1) * (256 / d1)), -127, 127)
 * (|x - d1 q1| <= d1 / 2 up to f32 rounding, so the clamp only trims that;
 * d1 = 0 or 256 / d1 not finite gives q2 = 0), and its 16-sums.  Returns d2.
 * Shared by the reference and the driver, so both produce the same bits. */
static float quant_level2(const float *x, const int8_t *q1, float d1, int n, int8_t *q2, int16_t *bs)
{
	float id = d1 > 0.0f ? 256.0f / d1 : 0.0f;
	if (!isfinite(id))
		id = 0.0f;
	for (int i = 0; i < n; i++) {
		const float p = d1 * (float)q1[i];
		const float r = (x[i] - p) * id;
		const long v = lrintf(r);
		q2[i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
	}
	for (int i = 0; i < n / 16; i++)
		bs[i] = sum16(q2 + 16 * i);
	return d1 * (1.0f / 256.0f);
}

static int32_t sum_bs(const int16_t *bs, int n16)
{
	int32_t s = 0;
	for (int i = 0; i < n16; i++)
		s += bs[i];
	return s;
}

/* ---- block dot products (exact integers, combined in double) ---- */

/* Contribution of weight block wb against the activation block (q: the
 * block's values, dx/sx: its scale and scaled sum, bs: its 16-sums). */
static double blk_dot(enum kb_dtype t, const uint8_t *wb, const int8_t *q, float dx, float sx,
		      const int16_t *bs)
{
	switch (t) {
	case KB_Q8_0: {
		int32_t s = 0;
		for (int i = 0; i < 32; i++)
			s += (int8_t)wb[2 + i] * q[i];
		return (double)q_f16(wb) * dx * s;
	}
	case KB_Q4_0: {
		int32_t s = 0;
		for (int i = 0; i < 16; i++)
			s += ((wb[2 + i] & 15) - 8) * q[i] + ((wb[2 + i] >> 4) - 8) * q[i + 16];
		return (double)q_f16(wb) * dx * s;
	}
	case KB_Q4_1: {
		int32_t s = 0;
		for (int i = 0; i < 16; i++)
			s += (wb[4 + i] & 15) * q[i] + (wb[4 + i] >> 4) * q[i + 16];
		return (double)q_f16(wb) * dx * s + (double)q_f16(wb + 2) * sx;
	}
	case KB_Q4_K:
	case KB_Q5_K: {
		const uint8_t *qh = t == KB_Q5_K ? wb + 16 : NULL, *qs = wb + (t == KB_Q5_K ? 48 : 16);
		int32_t sd = 0, sm = 0;
		for (int c = 0; c < 4; c++) {
			int s0, m0, s1, m1;
			kc_q_scale_min_k4(wb + 4, 2 * c, &s0, &m0);
			kc_q_scale_min_k4(wb + 4, 2 * c + 1, &s1, &m1);
			int32_t i0 = 0, i1 = 0;
			for (int i = 0; i < 32; i++) {
				int lo = qs[32 * c + i] & 15, hi = qs[32 * c + i] >> 4;
				if (qh) {
					lo |= ((qh[i] >> (2 * c)) & 1) << 4;
					hi |= ((qh[i] >> (2 * c + 1)) & 1) << 4;
				}
				i0 += lo * q[64 * c + i];
				i1 += hi * q[64 * c + 32 + i];
			}
			sd += s0 * i0 + s1 * i1;
			sm += m0 * (bs[4 * c] + bs[4 * c + 1]) + m1 * (bs[4 * c + 2] + bs[4 * c + 3]);
		}
		return (double)dx * ((double)q_f16(wb) * sd - (double)q_f16(wb + 2) * sm);
	}
	case KB_Q6_K: {
		int32_t s = 0;
		for (int g = 0; g < 16; g++) {
			int32_t sg = 0;
			for (int i = 0; i < 16; i++)
				sg += (q6_value(wb, 16 * g + i) - 32) * q[16 * g + i];
			s += (int8_t)wb[192 + g] * sg;
		}
		return (double)q_f16(wb + 208) * dx * s;
	}
	default:
		return 0.0;
	}
}

static void ref_one(const kb_matmul_args *a)
{
	const enum kb_dtype t = a->wtype;
	const int blk = kc_q_xblock(t); /* = the weight block */
	const size_t row_bytes = kb_dtype_bytes(t, a->w_stride), bb = kb_dtype_block_bytes(t);
	int8_t q[2][256];
	int16_t bs[2][16];
	float dx[2] = {0.0f, 0.0f}, sx[2] = {0.0f, 0.0f};
	for (int64_t m = 0; m < a->M; m++) {
		const float *x = a->x + m * a->x_stride;
		for (int64_t n = 0; n < a->N; n++) {
			const uint8_t *w = (const uint8_t *)a->w + (size_t)n * row_bytes;
			double acc = 0.0;
			for (int64_t b = 0; b < a->K / blk; b++) {
				const float *xb = x + b * blk;
				quant_block(xb, blk, q[0], &dx[0], blk == 32 ? &sx[0] : NULL, bs[0]);
				dx[1] = quant_level2(xb, q[0], dx[0], blk, q[1], bs[1]);
				/* the whole sum (both levels) rides on level 2 */
				sx[1] = sx[0] + dx[1] * (float)sum_bs(bs[1], blk / 16);
				sx[0] = 0.0f;
				for (int lv = 0; lv < 2; lv++)
					acc += blk_dot(t, w + (size_t)b * bb, q[lv], dx[lv], sx[lv], bs[lv]);
			}
			float *y = a->y + m * a->y_stride + n;
			*y = a->accumulate ? (float)((double)*y + acc) : (float)acc;
		}
	}
}

void kc_qmatmul_ref(const kb_matmul_args *a)
{
	if (a->batch <= 1) {
		ref_one(a);
		return;
	}
	for (int64_t i = 0; i < a->batch; i++) {
		kb_matmul_args one = *a;
		one.batch = 0;
		one.x = a->x + i * a->x_bstride;
		one.y = a->y + i * a->y_bstride;
		one.w = (const char *)a->w + kb_dtype_bytes(a->wtype, i * a->w_bstride);
		ref_one(&one);
	}
}

/* ---- the scalar ISA: the reference's block dots over the quantized rows ---- */

static void gemv_scalar(const kc_qgemv *g, int64_t n0, int64_t n1)
{
	const int blk = (int)kb_dtype_block(g->wt);
	const size_t bb = kb_dtype_block_bytes(g->wt);
	const int64_t nb = g->K / blk;
	for (int64_t n = n0; n < n1; n++) {
		const uint8_t *w = g->w + (size_t)n * g->w_row_bytes;
		for (int m = 0; m < g->m / 2; m++) {
			double acc = 0.0;
			for (int64_t b = 0; b < nb; b++) {
				for (int lv = 0; lv < 2; lv++) { /* act rows 2m, 2m + 1 */
					const int ar = 2 * m + lv;
					const int8_t *q = g->act.q + ar * g->act.ldq;
					const float *d = g->act.d + ar * g->act.ldb;
					const float *ds = g->act.ds ? g->act.ds + 2 * ar * g->act.ldb : NULL;
					const int16_t *bs = g->act.bs + ar * g->act.lds;
					acc += blk_dot(g->wt, w + (size_t)b * bb, q + b * blk, d[b],
						       blk == 32 ? ds[2 * b + 1] : 0.0f, bs + b * (blk / 16));
				}
			}
			float *y = g->y + m * g->y_stride + n;
			*y = g->accumulate ? (float)((double)*y + acc) : (float)acc;
		}
	}
}

static void quantize2_scalar(const float *x, int64_t K, int a256, const kc_qact *l1, const kc_qact *l2)
{
	const int blk = a256 ? 256 : 32;
	for (int64_t b = 0; b < K / blk; b++)
		l2->d[b] = quant_level2(x + b * blk, l1->q + b * blk, l1->d[b], blk, l2->q + b * blk,
					l2->bs + b * (blk / 16));
}

static const kc_qkernels scalar_kernels = {
	.name = "scalar",
	.quantize = quantize_scalar,
	.quantize2 = quantize2_scalar,
	.gemv = gemv_scalar,
};

/* ---- VNNI choice ---- */

static int g_allow_vnni = 1;

int kc_quant_allow_vnni(int allow)
{
	int prev = __atomic_load_n(&g_allow_vnni, __ATOMIC_RELAXED);
	__atomic_store_n(&g_allow_vnni, allow ? 1 : 0, __ATOMIC_RELAXED);
	return prev;
}

int kc_quant_uses_vnni(void)
{
#if defined(__x86_64__)
	if (!__atomic_load_n(&g_allow_vnni, __ATOMIC_RELAXED))
		return 0;
	__builtin_cpu_init();
	return __builtin_cpu_supports("avx512vnni") ? 1 : 0;
#else
	return 0;
#endif
}

static const kc_qkernels *kernels_for(enum kc_isa isa)
{
#if defined(__x86_64__)
	if (isa >= KC_ISA_AVX512)
		return kc_qkernels_avx512(kc_quant_uses_vnni());
	if (isa == KC_ISA_AVX2)
		return kc_qkernels_avx2();
#endif
	(void)isa;
	return &scalar_kernels;
}

/* ---- per-thread scratch (invariant 3) ---- */

typedef struct scratch {
	void *p;
	size_t cap;
} scratch;

static __thread scratch tls_scratch;
static pthread_key_t scratch_key;
static int scratch_key_ok;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p)
{
	free(p);
}

static void scratch_key_init(void)
{
	/* without a key the buffer is simply never freed (one per thread) */
	scratch_key_ok = pthread_key_create(&scratch_key, scratch_free) == 0;
}

static void *scratch_get(size_t bytes)
{
	scratch *s = &tls_scratch;
	if (s->cap >= bytes)
		return s->p;
	pthread_once(&scratch_once, scratch_key_init);
	size_t cap = bytes + bytes / 4;
	if (cap > KC_QUANT_SCRATCH_MAX)
		cap = bytes;
	cap = (cap + 63) & ~(size_t)63;
	void *p = aligned_alloc(64, cap);
	if (!p)
		return NULL;
	free(s->p);
	s->p = p;
	s->cap = cap;
	if (scratch_key_ok)
		pthread_setspecific(scratch_key, p);
	return p;
}

/* ---- the driver ---- */

#define ALIGN64(n) (((n) + 63) & ~(int64_t)63)

typedef struct layout {
	int64_t ldq, ldb, lds, ldsub;
	size_t off_d, off_ds, off_bs, off_ioff, off_fsum, row_bytes;
} layout;

/* Byte layout of `rows` quantized rows: one region per array. */
static void layout_for(enum kb_dtype t, int64_t K, int gemm, int64_t rows, layout *l)
{
	const int xb = kc_q_xblock(t);
	l->ldq = ALIGN64(K);
	l->ldb = K / xb;
	l->lds = K / 16;
	l->ldsub = gemm ? K / kc_q_sub(t) : 0;
	size_t o = (size_t)ALIGN64(rows * l->ldq);
	l->off_d = o;
	o += (size_t)ALIGN64(rows * l->ldb * 4);
	l->off_ds = o;
	o += xb == 32 ? (size_t)ALIGN64(rows * l->ldb * 8) : 0;
	l->off_bs = o;
	o += (size_t)ALIGN64(rows * l->lds * 2);
	l->off_ioff = o;
	o += (size_t)ALIGN64(rows * l->ldsub * 4);
	l->off_fsum = o;
	o += (size_t)ALIGN64(rows * l->ldsub * 4);
	l->row_bytes = o;
}

static kc_qact act_at(const layout *l, char *base, int64_t row, int a32)
{
	kc_qact a = {
		.q = (int8_t *)base + row * l->ldq,
		.d = (float *)(base + l->off_d) + row * l->ldb,
		.ds = a32 ? (float *)(base + l->off_ds) + 2 * row * l->ldb : NULL,
		.bs = (int16_t *)(base + l->off_bs) + row * l->lds,
		.ioff = l->ldsub ? (int32_t *)(base + l->off_ioff) + row * l->ldsub : NULL,
		.fsum = l->ldsub ? (float *)(base + l->off_fsum) + row * l->ldsub : NULL,
		.ldq = l->ldq, .ldb = l->ldb, .lds = l->lds, .ldsub = l->ldsub,
	};
	return a;
}

typedef struct job {
	const kb_matmul_args *a;
	const kc_qkernels *k;
	const layout *l;
	char *base;
	int64_t m0, rows;   /* x rows of this chunk */
	int off;            /* ioff multiplier */
	size_t w_row_bytes;
	int64_t mparts, mpart_rows;
} job;

/* x rows [b, e) of the chunk -> act rows 2r (level 1) and 2r + 1 (level 2),
 * with the pair sums of quant_impl.h. */
static void quant_rows(void *ctx, int64_t b, int64_t e)
{
	const job *j = ctx;
	const kb_matmul_args *a = j->a;
	const int xb = kc_q_xblock(a->wtype), a256 = xb == 256;
	for (int64_t r = b; r < e; r++) {
		const float *x = a->x + (j->m0 + r) * a->x_stride;
		kc_qact act[2] = {act_at(j->l, j->base, 2 * r, !a256), act_at(j->l, j->base, 2 * r + 1, !a256)};
		j->k->quantize(x, a->K, a256, &act[0]);
		j->k->quantize2(x, a->K, a256, &act[0], &act[1]);
		/* Q8 32: the whole sum (both levels) rides on level 2's pair */
		for (int64_t i = 0; i < a->K / xb && !a256; i++) {
			act[1].ds[2 * i] = act[1].d[i];
			act[1].ds[2 * i + 1] = act[0].ds[2 * i + 1] + act[1].d[i] * (float)sum_bs(act[1].bs + 2 * i, 2);
			act[0].ds[2 * i + 1] = 0.0f;
		}
		if (act[0].ioff) { /* GEMM: per sub-block sums and offsets */
			const int per = kc_q_sub(a->wtype) / 16;
			for (int64_t s = 0; s < act[0].ldsub; s++) {
				const int32_t s1 = sum_bs(act[0].bs + per * s, per), s2 = sum_bs(act[1].bs + per * s, per);
				act[0].ioff[s] = j->off * s1;
				act[1].ioff[s] = j->off * s2;
				act[0].fsum[s] = (float)s1;
				act[1].fsum[s] = (float)(256 * s1 + s2); /* exact: |.| < 2^24 */
			}
		}
	}
}

static void gemv_rows(void *ctx, int64_t n0, int64_t n1)
{
	const job *j = ctx;
	const kb_matmul_args *a = j->a;
	const int a32 = kc_q_xblock(a->wtype) == 32, per = KC_QGEMV_M / 2;
	for (int64_t m = 0; m < j->rows; m += per) { /* x rows, two act rows each */
		kc_qgemv g = {
			.wt = a->wtype, .w = a->w, .w_row_bytes = j->w_row_bytes, .K = a->K,
			.m = 2 * (int)(j->rows - m < per ? j->rows - m : per),
			.act = act_at(j->l, j->base, 2 * m, a32),
			.y = a->y + (j->m0 + m) * a->y_stride, .y_stride = a->y_stride,
			.accumulate = a->accumulate,
		};
		j->k->gemv(&g, n0, n1);
	}
}

static void gemm_items(void *ctx, int64_t b, int64_t e)
{
	const job *j = ctx;
	const kb_matmul_args *a = j->a;
	const kc_qkernels *k = j->k;
	const enum kb_dtype t = a->wtype;
	const int nrp = k->nr, sub = kc_q_sub(t), xb = kc_q_xblock(t), a32 = xb == 32;
	const int tr = k->mr_max / 2; /* x rows per tile (two act rows each) */
	const int64_t blk = kb_dtype_block(t);
	_Alignas(64) uint8_t wp[KC_Q_KC * KC_Q_NR_MAX];
	_Alignas(64) float sc[KC_Q_KC / 16 * KC_Q_NR_MAX];
	_Alignas(64) float mn[KC_Q_KC / 16 * KC_Q_NR_MAX];
	for (int64_t it = b; it < e; it++) {
		const int64_t p = it / j->mparts, part = it % j->mparts;
		const int64_t n0 = p * nrp;
		const int nr = (int)(a->N - n0 < nrp ? a->N - n0 : nrp);
		const int64_t r0 = part * j->mpart_rows;
		const int64_t r1 = r0 + j->mpart_rows < j->rows ? r0 + j->mpart_rows : j->rows;
		const uint8_t *w = (const uint8_t *)a->w + (size_t)n0 * j->w_row_bytes;
		for (int64_t k0 = 0; k0 < a->K; k0 += KC_Q_KC) {
			const int64_t nk = a->K - k0 < KC_Q_KC ? a->K - k0 : KC_Q_KC;
			k->pack(t, w + kb_dtype_bytes(t, k0), j->w_row_bytes, nr, nk / blk, wp, sc, mn);
			for (int64_t r = r0; r < r1; r += tr) {
				kc_qact act = act_at(j->l, j->base, 2 * r, a32);
				kc_qtile tl = {
					.wt = t, .wp = wp, .sc = sc, .mn = mn, .nxb = nk / xb,
					.xq = act.q + k0, .dx = act.d + k0 / xb, .ioff = act.ioff + k0 / sub,
					.fsum = act.fsum + k0 / sub, .ldq = act.ldq, .ldb = act.ldb,
					.ldsub = act.ldsub,
					.y = a->y + (j->m0 + r) * a->y_stride + n0, .y_stride = a->y_stride,
					.mr = 2 * (int)(r1 - r < tr ? r1 - r : tr), .nr = nr,
					.store = k0 == 0 && !a->accumulate,
				};
				k->tile(&tl);
			}
		}
	}
}

static int qmatmul_one(const kc_qkernels *k, const kb_matmul_args *a)
{
	const enum kb_dtype t = a->wtype;
	const int gemm = k->nr > 0 && a->M >= k->gemm_min_m;
	layout l1; /* one x row: two act rows */
	layout_for(t, a->K, gemm, 2, &l1);
	int64_t chunk = (int64_t)(KC_QUANT_SCRATCH_MAX / (l1.row_bytes + 64 * 6));
	if (chunk < 1)
		chunk = 1;
	if (chunk > a->M)
		chunk = a->M;
	layout l;
	layout_for(t, a->K, gemm, 2 * chunk, &l);
	char *base = scratch_get(l.row_bytes);
	if (!base)
		return DS_ENOMEM;
	const int threads = kc_pool_threads();
	for (int64_t m0 = 0; m0 < a->M; m0 += chunk) {
		const int64_t rows = a->M - m0 < chunk ? a->M - m0 : chunk;
		job j = {
			.a = a, .k = k, .l = &l, .base = base, .m0 = m0, .rows = rows,
			.off = t == KB_Q4_0 ? -8 : t == KB_Q8_0 ? k->q8_off : t == KB_Q6_K ? -32 : 0,
			.w_row_bytes = kb_dtype_bytes(t, a->w_stride),
		};
		/* quantize: in parallel when there is enough of it */
		int64_t qgrain = (int64_t)(1 << 15) / a->K + 1;
		if (rows * a->K < ((int64_t)1 << 15))
			quant_rows(&j, 0, rows);
		else
			kc_parallel_for(rows, qgrain, quant_rows, &j);
		if (!gemm) {
			/* one contiguous range of rows per thread: one long
			 * ascending stream each keeps the hardware prefetchers
			 * ahead (measured 1.5-2x faster from DRAM than 16 KiB
			 * chunks claimed in turn) */
			const int64_t grain = (a->N + threads - 1) / threads;
			kc_parallel_for(a->N, grain, gemv_rows, &j);
			continue;
		}
		const int64_t panels = (a->N + k->nr - 1) / k->nr;
		/* few panels: split the rows too, in parts of whole tiles */
		const int64_t tr = k->mr_max / 2; /* x rows per tile */
		j.mparts = 1;
		if (panels < 4 * threads) {
			int64_t want = (4 * threads + panels - 1) / panels;
			int64_t max_parts = (rows + 4 * tr - 1) / (4 * tr);
			j.mparts = want < max_parts ? want : max_parts;
			if (j.mparts < 1)
				j.mparts = 1;
		}
		j.mpart_rows = (rows + j.mparts - 1) / j.mparts;
		j.mpart_rows = (j.mpart_rows + tr - 1) / tr * tr;
		j.mparts = (rows + j.mpart_rows - 1) / j.mpart_rows;
		kc_parallel_for(panels * j.mparts, 1, gemm_items, &j);
	}
	return DS_OK;
}

int kc_qmatmul_isa(enum kc_isa isa, const kb_matmul_args *a)
{
	if (isa > kc_isa_detect())
		return DS_EUNSUPPORTED;
	if (!kb_dtype_is_quant(a->wtype))
		return DS_EINVAL;
	const kc_qkernels *k = kernels_for(isa);
	if (a->batch <= 1)
		return a->M > 0 && a->N > 0 ? qmatmul_one(k, a) : DS_OK;
	for (int64_t i = 0; i < a->batch; i++) {
		kb_matmul_args one = *a;
		one.batch = 0;
		one.x = a->x + i * a->x_bstride;
		one.y = a->y + i * a->y_bstride;
		one.w = (const char *)a->w + kb_dtype_bytes(a->wtype, i * a->w_bstride);
		int rc = one.M > 0 && one.N > 0 ? qmatmul_one(k, &one) : DS_OK;
		if (rc)
			return rc;
	}
	return DS_OK;
}

/* ---- several products of one x row ---- */

#define MULTI_MAX 8

typedef struct multi_job {
	job jobs[MULTI_MAX];          /* one per product; they share the act rows */
	int64_t first[MULTI_MAX + 1]; /* first row of each product in the joint range */
	int n;
} multi_job;

static void multi_rows(void *ctx, int64_t r0, int64_t r1)
{
	const multi_job *mj = ctx;
	for (int i = 0; i < mj->n; i++) {
		int64_t b = r0 > mj->first[i] ? r0 : mj->first[i];
		int64_t e = r1 < mj->first[i + 1] ? r1 : mj->first[i + 1];
		if (b < e)
			gemv_rows((void *)&mj->jobs[i], b - mj->first[i], e - mj->first[i]);
	}
}

int kc_qmatmul_multi_isa(enum kc_isa isa, const kb_matmul_args *a, int n)
{
	if (isa > kc_isa_detect() || n < 1 || n > MULTI_MAX)
		return DS_EUNSUPPORTED;
	const kc_qkernels *k = kernels_for(isa);
	const int xb = kb_dtype_is_quant(a[0].wtype) ? kc_q_xblock(a[0].wtype) : 0;
	for (int i = 0; i < n; i++)
		if (!kb_dtype_is_quant(a[i].wtype) || kc_q_xblock(a[i].wtype) != xb || a[i].M != 1 ||
		    a[i].N < 1 || a[i].K != a[0].K || a[i].x != a[0].x || a[i].batch > 1 ||
		    (k->nr > 0 && a[i].M >= k->gemm_min_m))
			return DS_EUNSUPPORTED;
	layout l;
	layout_for(a[0].wtype, a[0].K, 0, 2, &l);
	char *base = scratch_get(l.row_bytes);
	if (!base)
		return DS_ENOMEM;
	multi_job mj = {.n = n};
	for (int i = 0; i < n; i++) {
		mj.jobs[i] = (job){.a = &a[i], .k = k, .l = &l, .base = base, .m0 = 0, .rows = 1,
				   .w_row_bytes = kb_dtype_bytes(a[i].wtype, a[i].w_stride)};
		mj.first[i + 1] = mj.first[i] + a[i].N;
	}
	quant_rows(&mj.jobs[0], 0, 1);
	/* one contiguous range of rows per thread, as for one product */
	const int threads = kc_pool_threads();
	kc_parallel_for(mj.first[n], (mj.first[n] + threads - 1) / threads, multi_rows, &mj);
	return DS_OK;
}

/* ---- embedding rows from a quantized table ---- */

static void qembed_rows(void *ctx, int64_t b, int64_t e)
{
	const kb_embed_args *a = ctx;
	const size_t row_bytes = kb_dtype_bytes(a->type, a->table_stride);
	for (int64_t i = b; i < e; i++)
		kc_dequant_row_ref(a->type, (const uint8_t *)a->table + (size_t)a->ids[i] * row_bytes,
				   a->out + i * a->out_stride, a->dim);
}

int kc_qembed(const kb_embed_args *a)
{
	if (!kb_dtype_is_quant(a->type))
		return DS_EINVAL;
	kc_parallel_for(a->n, (int64_t)(1 << 14) / (a->dim + 1) + 1, qembed_rows, (void *)a);
	return DS_OK;
}

/*
 * conformance.c - every op on every available implementation against the
 * scalar reference, on random inputs.
 *
 * Targets: each CPU ISA this machine supports (scalar, avx2, avx512, ...),
 * called directly through kc_<op>_isa; an instance of the CPU backend
 * (cpu/backend: dispatch and argument checks, buffers staged like a
 * device's); and an instance of each device backend that is compiled in and
 * has a device (otherwise reported as skipped).  On a backend target an op
 * its supports_op denies is reported as skipped; first each opened backend's
 * supports_op is held to its ops table ("support" line: a supported op has a
 * function; the CPU supports every op on every dtype but embed on f8_e4m3).
 *
 * Inputs: random values with rows of very different magnitude, odd shapes,
 * padded strides, column slices of wider matrices, partial FP8 scale blocks
 * (block 128 and odd blocks), accumulate = 0/1, M in {1,2,3,5,8,17,64}.
 * Padding past a row must stay untouched (checked with sentinels).
 *
 * Tolerances (error measure in parentheses):
 *   rmsnorm        1e-5     (|d| / (|ref| + 1e-6))
 *   matmul_*       1e-5     (|d| / (sum_k |x||W| + |y_before|)): f32 lanes
 *                           accumulate K/16 or K/8 terms each; random-sign
 *                           rounding errors grow like sqrt(K) u ~ 1e-6 here
 *   matmul_q*      2e-6     (|d| / (sum_k |x||W| + |y_before|), |W| without
 *                           scale/min cancellation): GGUF block types against
 *                           kc_qmatmul_ref, the same activation quantization
 *                           and exact integer block dots; only the f32 (vs
 *                           double) sums of block results differ
 *   embed          0        (exact conversions)
 *   rope           1e-6     (|d| / (amp (|x_a| + |x_b|)) per pair)
 *   silu_mul       1e-6     (|d| / (|ref| + 1e-30)): exp ~1 ulp + 3 roundings
 *   axpy           2.5e-7   (|d| / (|y| + |alpha x|)): one FMA rounding vs
 *                           double, at most 1 ulp apart
 *   softmax        1e-5     (|d| / (|ref| + 1e-20))
 * Closing line: "conformance: N passed, N failed, N skipped" (one per op x
 * target).  Usage: conformance [OP]
 */
#include "common/strutil.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/quant.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SENTINEL -12345.0f

static uint64_t rng = 0x243F6A8885A308D3ull;

static uint64_t rand_u64(void)
{
	rng ^= rng >> 12;
	rng ^= rng << 25;
	rng ^= rng >> 27;
	return rng * 0x2545F4914F6CDD1Dull;
}

static float frand(float lo, float hi)
{
	return lo + (hi - lo) * (float)((rand_u64() >> 40) * (1.0 / 16777216.0));
}

/* A value of random sign and magnitude 10^[lo, hi]. */
static float frand_mag(float lo, float hi)
{
	return frand(-1.0f, 1.0f) * powf(10.0f, frand(lo, hi));
}

/* A target runs one op: either a CPU ISA directly or a device backend. */
typedef struct target {
	char name[32];
	enum kc_isa isa;        /* for cpu targets */
	const kb_backend *dev;  /* non-NULL for device targets (buffers live there) */
} target;

typedef struct result {
	double max_err; /* worst error in the op's measure (see the top comment) */
	int checked;
	int rc;
} result;

static void note(result *res, double e)
{
	if (!(e <= res->max_err))
		res->max_err = isnan(e) ? INFINITY : fmax(res->max_err, e);
	res->checked++;
}

/* ---- device staging: host arrays mirrored in a backend's memory ---- */

#define STAGE_MAX 8
typedef struct stage {
	const kb_backend *b;
	const void *host[STAGE_MAX];
	void *dev[STAGE_MAX];
	size_t bytes[STAGE_MAX];
	int n, rc;
} stage;

/* Mirrors the host array [base, base + bytes) on the device (uploaded) and
 * returns the device address of host pointer p inside it. */
static void *stage_put(stage *s, const void *base, size_t bytes, const void *p)
{
	if (!base || s->rc)
		return NULL;
	if (s->n == STAGE_MAX) {
		s->rc = DS_EINTERNAL;
		return NULL;
	}
	void *d = kb_alloc(s->b, bytes);
	if (!d) {
		s->rc = DS_ENOMEM;
		return NULL;
	}
	s->host[s->n] = base;
	s->dev[s->n] = d;
	s->bytes[s->n] = bytes;
	s->n++;
	if ((s->rc = kb_upload(s->b, d, base, bytes)) != 0)
		return NULL;
	return (char *)d + ((const char *)p - (const char *)base);
}

/* Runs the backend op, then copies the device array of host base back. */
static int stage_finish(stage *s, int rc, void *base)
{
	if (!s->rc)
		s->rc = rc;
	if (!s->rc)
		s->rc = kb_sync(s->b);
	for (int i = 0; i < s->n; i++) {
		if (!s->rc && s->host[i] == base)
			s->rc = kb_download(s->b, base, s->dev[i], s->bytes[i]);
		kb_release(s->b, s->dev[i]);
	}
	return s->rc;
}

/* --- rmsnorm --- */

static const int64_t rms_shapes[][2] = {
	{1, 1}, {3, 7}, {4, 15}, {2, 16}, {5, 33}, {8, 64}, {3, 100}, {2, 1000},
	{16, 129}, {4, 4096}, {2, 7168}, {1, 1536}, {64, 512},
};

static int run_rmsnorm_on(const target *t, kb_rmsnorm_args *a)
{
	if (!t->dev)
		return kc_rmsnorm_isa(t->isa, a);
	stage s = {.b = t->dev};
	size_t xb = (size_t)(a->rows * a->x_stride) * sizeof(float);
	size_t yb = (size_t)(a->rows * a->out_stride) * sizeof(float);
	kb_rmsnorm_args d = *a;
	d.x = stage_put(&s, a->x, xb, a->x);
	d.w = stage_put(&s, a->w, (size_t)a->dim * sizeof(float), a->w);
	d.out = stage_put(&s, a->out, yb, a->out);
	return stage_finish(&s, s.rc ? s.rc : kb_rmsnorm(t->dev, &d), a->out);
}

static result test_rmsnorm(const target *t)
{
	result res = {0, 0, 0};
	for (size_t s = 0; s < sizeof rms_shapes / sizeof rms_shapes[0]; s++) {
		int64_t rows = rms_shapes[s][0], dim = rms_shapes[s][1];
		int64_t stride = dim + (s % 3); /* some shapes use padded rows */
		size_t n = (size_t)(rows * stride);
		float *x = malloc(n * sizeof *x), *w = malloc((size_t)dim * sizeof *w);
		float *ref = malloc(n * sizeof *ref), *got = malloc(n * sizeof *got);
		for (int64_t r = 0; r < rows; r++) {
			float scale = powf(10.0f, frand(-3.0f, 3.0f)); /* rows of very different size */
			for (int64_t i = 0; i < stride; i++)
				x[r * stride + i] = frand(-1.0f, 1.0f) * scale;
		}
		for (int64_t i = 0; i < dim; i++)
			w[i] = frand(-2.0f, 2.0f);
		for (size_t i = 0; i < n; i++)
			ref[i] = got[i] = SENTINEL; /* padding must stay untouched */
		float eps = 1e-6f;
		kb_rmsnorm_args a = {.out = ref, .x = x, .w = w, .rows = rows, .dim = dim,
					.x_stride = stride, .out_stride = stride, .eps = eps};
		kc_rmsnorm_ref(&a);
		a.out = got;
		int rc = run_rmsnorm_on(t, &a);
		if (rc) {
			res.rc = rc;
		} else {
			for (size_t i = 0; i < n; i++)
				note(&res, fabs((double)got[i] - (double)ref[i]) /
						   (fabs((double)ref[i]) + 1e-6));
		}
		free(x);
		free(w);
		free(ref);
		free(got);
	}
	return res;
}

/* --- matmul --- */

/* Random weight element of dtype t (bits), finite, magnitude about 10^[lo, hi]. */
static void rand_weight(enum kb_dtype t, void *dst, size_t i, float lo, float hi)
{
	switch (t) {
	case KB_F32:
		((float *)dst)[i] = frand_mag(lo, hi);
		break;
	case KB_BF16: {
		union {
			float f;
			uint32_t u;
		} v = {.f = frand_mag(lo, hi)};
		((uint16_t *)dst)[i] = (uint16_t)(v.u >> 16); /* truncation: any bf16 will do */
		break;
	}
	case KB_F16: {
		/* exponent field 1..30 (some subnormals with field 0), random mantissa */
		uint16_t e = (uint16_t)(rand_u64() % 8 == 0 ? 0 : 8 + rand_u64() % 14);
		uint16_t h = (uint16_t)((rand_u64() & 1) << 15 | e << 10 | (rand_u64() & 1023));
		((uint16_t *)dst)[i] = h;
		break;
	}
	case KB_F8_E4M3: {
		uint8_t b;
		do
			b = (uint8_t)rand_u64();
		while ((b & 0x7F) == 0x7F); /* no NaN patterns: real weights have none */
		((uint8_t *)dst)[i] = b;
		break;
	}
	default:
		break;
	}
}

/* Clears the sign bit of every weight (for the sum |x||W| bound). */
static void abs_weights(enum kb_dtype t, void *w, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		switch (t) {
		case KB_F32: ((float *)w)[i] = fabsf(((float *)w)[i]); break;
		case KB_F8_E4M3: ((uint8_t *)w)[i] &= 0x7F; break;
		default: ((uint16_t *)w)[i] &= 0x7FFF; break;
		}
	}
}

static const int64_t mm_ms[] = {1, 2, 3, 4, 5, 8, 17, 64};
static const int64_t mm_nk[][2] = {
	{1, 1}, {3, 5}, {8, 16}, {9, 17}, {33, 100}, {130, 257}, {67, 1030}, {256, 1100}, {19, 2049},
};
/* 128 is DeepSeek's, 64 another power of two; 48 and 32 cut 16-wide
 * vectors; 50 makes panels of 4
 * and 8 rows straddle two scale-block rows (per-row scaling path) */
static const int64_t mm_blocks[] = {128, 48, 64, 50, 32};

typedef struct mm_case {
	kb_matmul_args a;
	void *w_base;       /* whole wider matrix; a.w points into it */
	size_t w_bytes;
	float *s_base;      /* whole scale matrix; a.w_scale points into it */
	size_t s_bytes;
	size_t x_bytes, y_bytes;
} mm_case;

static int run_matmul_on(const target *t, mm_case *c)
{
	if (!t->dev)
		return kc_matmul_isa(t->isa, &c->a);
	stage s = {.b = t->dev};
	kb_matmul_args d = c->a;
	d.x = stage_put(&s, c->a.x, c->x_bytes, c->a.x);
	d.w = stage_put(&s, c->w_base, c->w_bytes, c->a.w);
	if (c->s_base)
		d.w_scale = stage_put(&s, c->s_base, c->s_bytes, c->a.w_scale);
	d.y = stage_put(&s, c->a.y, c->y_bytes, c->a.y);
	return stage_finish(&s, s.rc ? s.rc : kb_matmul(t->dev, &d), c->a.y);
}

static result test_matmul_dtype(const target *t, enum kb_dtype dt)
{
	result res = {0, 0, 0};
	int idx = 0;
	for (size_t mi = 0; mi < sizeof mm_ms / sizeof mm_ms[0]; mi++) {
		for (size_t si = 0; si < sizeof mm_nk / sizeof mm_nk[0]; si++, idx++) {
			const int64_t M = mm_ms[mi], N = mm_nk[si][0], K = mm_nk[si][1];
			if (M == 64 && N * K > 100000)
				continue; /* keeps the run short; M = 64 is covered by smaller shapes */
			const int64_t block = mm_blocks[idx % 5];
			const int slice = idx % 3 == 1;   /* W is a column slice of a wider matrix */
			const int64_t col0 = slice ? (dt == KB_F8_E4M3 ? block : 3) : 0;
			const int64_t k_full = K + col0 + (slice ? 5 : 0);
			const int64_t x_stride = K + (idx % 3) * 5, y_stride = N + (idx % 2) * 3;
			const size_t es = kb_dtype_size(dt);
			mm_case c;
			memset(&c, 0, sizeof c);
			c.w_bytes = (size_t)(N * k_full) * es;
			c.w_base = malloc(c.w_bytes);
			c.x_bytes = (size_t)(M * x_stride) * sizeof(float);
			c.y_bytes = (size_t)(M * y_stride) * sizeof(float);
			float *x = malloc(c.x_bytes), *xa = malloc(c.x_bytes);
			float *y0 = malloc(c.y_bytes), *ref = malloc(c.y_bytes), *got = malloc(c.y_bytes);
			float *bound = malloc(c.y_bytes);
			void *wabs = malloc(c.w_bytes);
			int64_t srows = (N + block - 1) / block, scols = (k_full + block - 1) / block;
			if (dt == KB_F8_E4M3) {
				c.s_bytes = (size_t)(srows * scols) * sizeof(float);
				c.s_base = malloc(c.s_bytes);
				for (int64_t i = 0; i < srows * scols; i++)
					c.s_base[i] = powf(10.0f, frand(-4.0f, -1.0f));
			}
			for (int64_t n = 0; n < N; n++) {
				float lo = frand(-2.0f, 1.0f); /* rows of different size */
				for (int64_t k = 0; k < k_full; k++)
					rand_weight(dt, c.w_base, (size_t)(n * k_full + k), lo, lo + 1.0f);
			}
			for (int64_t m = 0; m < M; m++) {
				float lo = frand(-3.0f, 2.0f);
				for (int64_t k = 0; k < x_stride; k++) {
					x[m * x_stride + k] = k < K ? frand_mag(lo, lo + 1.0f) : NAN; /* padding unread */
					xa[m * x_stride + k] = fabsf(x[m * x_stride + k]);
				}
			}
			const int acc = idx % 2;
			for (int64_t i = 0; i < M * y_stride; i++)
				y0[i] = (i % y_stride) < N ? frand_mag(-2.0f, 1.0f) : SENTINEL;
			c.a = (kb_matmul_args){
				.y = ref, .x = x, .w = (const char *)c.w_base + (size_t)col0 * es,
				.w_scale = c.s_base ? c.s_base + col0 / block : NULL, .wtype = dt,
				.M = M, .N = N, .K = K, .x_stride = x_stride, .y_stride = y_stride,
				.w_stride = k_full, .scale_stride = scols, .block = block, .accumulate = acc,
			};
			/* bound: sum_k |x||W| (+ |y| when accumulating), by the reference */
			memcpy(wabs, c.w_base, c.w_bytes);
			abs_weights(dt, wabs, (size_t)(N * k_full));
			kb_matmul_args ab = c.a;
			ab.x = xa;
			ab.w = (const char *)wabs + (size_t)col0 * es;
			ab.y = bound;
			for (int64_t i = 0; i < M * y_stride; i++)
				bound[i] = fabsf(y0[i]);
			kc_matmul_ref(&ab);
			memcpy(ref, y0, c.y_bytes);
			kc_matmul_ref(&c.a);
			memcpy(got, y0, c.y_bytes);
			c.a.y = got;
			int rc = run_matmul_on(t, &c);
			if (rc) {
				res.rc = rc;
			} else {
				for (int64_t m = 0; m < M; m++) {
					for (int64_t n = 0; n < y_stride; n++) {
						int64_t i = m * y_stride + n;
						if (n >= N) { /* padding: untouched */
							note(&res, got[i] == SENTINEL ? 0.0 : INFINITY);
							continue;
						}
						double e = fabs((double)got[i] - (double)ref[i]) /
							   ((double)bound[i] + 1e-30);
						if (e > 1e-5 && getenv("DS_CONF_VERBOSE"))
							printf("  matmul dt=%d M=%lld N=%lld K=%lld block=%lld acc=%d"
							       " y[%lld][%lld] got %.9g ref %.9g\n",
							       (int)dt, (long long)M, (long long)N, (long long)K,
							       (long long)block, acc, (long long)m, (long long)n,
							       got[i], ref[i]);
						note(&res, e);
					}
				}
			}
			free(c.w_base);
			free(c.s_base);
			free(x);
			free(xa);
			free(y0);
			free(ref);
			free(got);
			free(bound);
			free(wabs);
		}
	}
	return res;
}

static result test_matmul_f32(const target *t)
{
	return test_matmul_dtype(t, KB_F32);
}

static result test_matmul_f16(const target *t)
{
	return test_matmul_dtype(t, KB_F16);
}

static result test_matmul_bf16(const target *t)
{
	return test_matmul_dtype(t, KB_BF16);
}

static result test_matmul_fp8(const target *t)
{
	return test_matmul_dtype(t, KB_F8_E4M3);
}

/* --- block-quantized matmul (GGUF types) ---
 * Random blocks: f16 scales per row class (normal 2^-10..2^-2, tiny: f16
 * subnormals and 2^-14.., huge 2^7..65504, with some blocks of another class),
 * random quant bytes, all 12 / 16 packed scale bytes random.  x: rows of
 * different magnitude, some all-zero blocks.  W is a column slice of a wider
 * matrix (w_stride > K) in some cases; K spans one and two K chunks of the
 * GEMM (2080, 2304 > 2048).  The reference is kc_qmatmul_ref (same activation
 * quantization, exact integer block dots, double sums); the error measure is
 * |d| / (sum_k |x_k| |W|_k + |y_before|), where |W| is the dequantized
 * magnitude without cancellation between the scale and min terms (d and
 * dmin/m taken with signs that add).  AVX-512 targets run with and without
 * VNNI (kc_quant_allow_vnni). */

static uint16_t rand_f16_class(int cls)
{
	uint16_t e, m = (uint16_t)(rand_u64() & 1023);
	switch (cls) {
	case 0: e = (uint16_t)(5 + rand_u64() % 9); break;                /* 2^-10 .. 2^-2 */
	case 1: e = (uint16_t)(rand_u64() % 2 ? 0 : 1 + rand_u64() % 3); break; /* tiny, subnormals */
	default: e = (uint16_t)(22 + rand_u64() % 9); break;              /* 2^7 .. 65504 */
	}
	if (e == 0 && m == 0)
		m = 1;
	return (uint16_t)((rand_u64() & 1) << 15 | e << 10 | m);
}

static void put_u16(uint8_t *p, uint16_t v)
{
	p[0] = (uint8_t)v;
	p[1] = (uint8_t)(v >> 8);
}

static void rand_qblock(enum kb_dtype t, uint8_t *b, int cls)
{
	const size_t bb = kb_dtype_block_bytes(t);
	for (size_t i = 0; i < bb; i++)
		b[i] = (uint8_t)rand_u64();
	if (rand_u64() % 5 == 0)
		cls = (int)(rand_u64() % 3);
	if (t == KB_Q6_K) {
		put_u16(b + 208, rand_f16_class(cls));
		return;
	}
	put_u16(b, rand_f16_class(cls));
	if (t == KB_Q4_1 || t == KB_Q4_K || t == KB_Q5_K)
		put_u16(b + 2, rand_f16_class(cls));
}

/* The block with the signs that make |W| free of scale/min cancellation. */
static void abs_qblock(enum kb_dtype t, uint8_t *b)
{
	if (t == KB_Q4_1) {
		b[1] &= 0x7F;
		b[3] &= 0x7F;
	} else if (t == KB_Q4_K || t == KB_Q5_K) {
		b[1] &= 0x7F;
		b[3] |= 0x80;
	}
}

static int run_qmatmul_on(const target *t, mm_case *c)
{
	if (!t->dev)
		return kc_qmatmul_isa(t->isa, &c->a);
	return run_matmul_on(t, c);
}

static const int64_t qm_ms[] = {1, 3, 17, 64};
/* N, K in blocks */
static const int64_t qm_nk32[][2] = {{1, 1}, {5, 3}, {16, 18}, {17, 65}, {40, 7}};
static const int64_t qm_nk256[][2] = {{1, 1}, {5, 3}, {16, 2}, {17, 9}, {40, 1}};

static void qmatmul_case(const target *t, enum kb_dtype dt, int64_t M, int64_t N, int64_t K, int idx,
			 result *res)
{
	const int64_t blk = kb_dtype_block(dt);
	const int slice = idx % 3 == 1;
	const int64_t col0 = slice ? blk : 0;
	const int64_t k_full = K + col0 + (slice ? blk : 0);
	const int64_t x_stride = K + (idx % 3) * 5, y_stride = N + (idx % 2) * 3;
	const size_t row_bytes = kb_dtype_bytes(dt, k_full), bb = kb_dtype_block_bytes(dt);
	mm_case c;
	memset(&c, 0, sizeof c);
	c.w_bytes = (size_t)N * row_bytes;
	c.w_base = malloc(c.w_bytes);
	c.x_bytes = (size_t)(M * x_stride) * sizeof(float);
	c.y_bytes = (size_t)(M * y_stride) * sizeof(float);
	float *x = malloc(c.x_bytes), *y0 = malloc(c.y_bytes), *ref = malloc(c.y_bytes);
	float *got = malloc(c.y_bytes), *wrow = malloc((size_t)k_full * sizeof(float));
	double *bound = malloc((size_t)(M * N) * sizeof(double));
	uint8_t *wabs = malloc(c.w_bytes);
	for (int64_t n = 0; n < N; n++) {
		int cls = (int)(rand_u64() % 4 == 0 ? 1 + rand_u64() % 2 : 0);
		for (int64_t b = 0; b < k_full / blk; b++)
			rand_qblock(dt, (uint8_t *)c.w_base + (size_t)n * row_bytes + (size_t)b * bb, cls);
	}
	memcpy(wabs, c.w_base, c.w_bytes);
	for (size_t o = 0; o < c.w_bytes; o += bb)
		abs_qblock(dt, wabs + o);
	for (int64_t m = 0; m < M; m++) {
		float lo = frand(-3.0f, 2.0f);
		for (int64_t k = 0; k < x_stride; k++)
			x[m * x_stride + k] = k < K ? frand_mag(lo, lo + 1.0f) : NAN; /* padding unread */
		if (K > blk && rand_u64() % 3 == 0) { /* an all-zero block */
			int64_t b = (int64_t)(rand_u64() % (uint64_t)(K / blk));
			for (int64_t k = 0; k < blk; k++)
				x[m * x_stride + b * blk + k] = 0.0f;
		}
	}
	const int acc = idx % 2;
	for (int64_t i = 0; i < M * y_stride; i++)
		y0[i] = (i % y_stride) < N ? frand_mag(-2.0f, 1.0f) : SENTINEL;
	for (int64_t n = 0; n < N; n++) {
		kc_dequant_row_ref(dt, wabs + (size_t)n * row_bytes, wrow, k_full);
		for (int64_t m = 0; m < M; m++) {
			double s = acc ? fabs((double)y0[m * y_stride + n]) : 0.0;
			for (int64_t k = 0; k < K; k++)
				s += fabs((double)x[m * x_stride + k]) * fabs((double)wrow[col0 + k]);
			bound[m * N + n] = s;
		}
	}
	c.a = (kb_matmul_args){
		.y = ref, .x = x, .w = (const char *)c.w_base + kb_dtype_bytes(dt, col0), .wtype = dt,
		.M = M, .N = N, .K = K, .x_stride = x_stride, .y_stride = y_stride, .w_stride = k_full,
		.accumulate = acc,
	};
	memcpy(ref, y0, c.y_bytes);
	kc_qmatmul_ref(&c.a);
	const int passes = !t->dev && t->isa >= KC_ISA_AVX512 ? 2 : 1; /* VNNI on and off */
	for (int pass = 0; pass < passes; pass++) {
		int prev = kc_quant_allow_vnni(pass == 0);
		memcpy(got, y0, c.y_bytes);
		c.a.y = got;
		int rc = run_qmatmul_on(t, &c);
		kc_quant_allow_vnni(prev);
		if (rc) {
			res->rc = rc;
			continue;
		}
		for (int64_t m = 0; m < M; m++) {
			for (int64_t n = 0; n < y_stride; n++) {
				int64_t i = m * y_stride + n;
				if (n >= N) {
					note(res, got[i] == SENTINEL ? 0.0 : INFINITY);
					continue;
				}
				double e = fabs((double)got[i] - (double)ref[i]) / (bound[m * N + n] + 1e-30);
				if (e > 1e-6 && getenv("DS_CONF_VERBOSE"))
					printf("  qmatmul dt=%d M=%lld N=%lld K=%lld acc=%d vnni=%d y[%lld][%lld]"
					       " got %.9g ref %.9g\n",
					       (int)dt, (long long)M, (long long)N, (long long)K, acc, pass == 0,
					       (long long)m, (long long)n, got[i], ref[i]);
				note(res, e);
			}
		}
	}
	free(c.w_base);
	free(x);
	free(y0);
	free(ref);
	free(got);
	free(wrow);
	free(bound);
	free(wabs);
}

static result test_qmatmul_dtype(const target *t, enum kb_dtype dt)
{
	result res = {0, 0, 0};
	const int64_t blk = kb_dtype_block(dt);
	const int64_t(*nk)[2] = blk == 32 ? qm_nk32 : qm_nk256;
	int idx = 0;
	for (size_t mi = 0; mi < sizeof qm_ms / sizeof qm_ms[0]; mi++)
		for (size_t si = 0; si < 5; si++, idx++)
			qmatmul_case(t, dt, qm_ms[mi], nk[si][0], nk[si][1] * blk, idx, &res);
	return res;
}

static result test_matmul_q8_0(const target *t)
{
	return test_qmatmul_dtype(t, KB_Q8_0);
}

static result test_matmul_q4_0(const target *t)
{
	return test_qmatmul_dtype(t, KB_Q4_0);
}

static result test_matmul_q4_1(const target *t)
{
	return test_qmatmul_dtype(t, KB_Q4_1);
}

static result test_matmul_q4_k(const target *t)
{
	return test_qmatmul_dtype(t, KB_Q4_K);
}

static result test_matmul_q5_k(const target *t)
{
	return test_qmatmul_dtype(t, KB_Q5_K);
}

static result test_matmul_q6_k(const target *t)
{
	return test_qmatmul_dtype(t, KB_Q6_K);
}

/* --- embed --- */

static const int64_t emb_shapes[][2] = {{1, 1}, {3, 7}, {17, 16}, {5, 33}, {64, 100}, {4, 7168}, {9, 129}};

static int run_embed_on(const target *t, kb_embed_args *a, int64_t rows, size_t out_bytes)
{
	if (!t->dev)
		return kc_embed_isa(t->isa, a);
	stage s = {.b = t->dev};
	kb_embed_args d = *a;
	d.table = stage_put(&s, a->table, (size_t)(rows * a->table_stride) * kb_dtype_size(a->type),
			    a->table);
	d.ids = stage_put(&s, a->ids, (size_t)a->n * sizeof(int32_t), a->ids);
	d.out = stage_put(&s, a->out, out_bytes, a->out);
	return stage_finish(&s, s.rc ? s.rc : kb_embed(t->dev, &d), a->out);
}

static result test_embed(const target *t)
{
	result res = {0, 0, 0};
	static const enum kb_dtype types[] = {KB_F32, KB_F16, KB_BF16};
	for (size_t ti = 0; ti < 3; ti++) {
		for (size_t s = 0; s < sizeof emb_shapes / sizeof emb_shapes[0]; s++) {
			int64_t n = emb_shapes[s][0], dim = emb_shapes[s][1], rows = 50;
			int64_t ts = dim + (int64_t)(s % 2) * 3, os = dim + (int64_t)(s % 3);
			size_t es = kb_dtype_size(types[ti]);
			void *table = malloc((size_t)(rows * ts) * es);
			int32_t *ids = malloc((size_t)n * sizeof *ids);
			size_t ob = (size_t)(n * os) * sizeof(float);
			float *ref = malloc(ob), *got = malloc(ob);
			for (int64_t r = 0; r < rows; r++) {
				float lo = frand(-3.0f, 2.0f);
				for (int64_t k = 0; k < ts; k++)
					rand_weight(types[ti], table, (size_t)(r * ts + k), lo, lo + 1.0f);
			}
			for (int64_t i = 0; i < n; i++)
				ids[i] = (int32_t)(rand_u64() % (uint64_t)rows);
			for (int64_t i = 0; i < n * os; i++)
				ref[i] = got[i] = SENTINEL;
			kb_embed_args a = {.out = ref, .table = table, .type = types[ti],
						.ids = ids, .n = n, .dim = dim, .out_stride = os,
						.table_stride = ts};
			kc_embed_ref(&a);
			a.out = got;
			int rc = run_embed_on(t, &a, rows, ob);
			if (rc)
				res.rc = rc;
			else
				for (int64_t i = 0; i < n * os; i++)
					note(&res, memcmp(&got[i], &ref[i], sizeof(float)) == 0 ? 0.0 : INFINITY);
			free(table);
			free(ids);
			free(ref);
			free(got);
		}
	}
	return res;
}

/* --- rope --- */

static int run_rope_on(const target *t, kb_rope_args *a, size_t x_bytes)
{
	if (!t->dev)
		return kc_rope_isa(t->isa, a);
	stage s = {.b = t->dev};
	kb_rope_args d = *a;
	d.x = stage_put(&s, a->x, x_bytes, a->x);
	d.pos = stage_put(&s, a->pos, (size_t)a->n_tok * sizeof(int32_t), a->pos);
	d.inv_freq = stage_put(&s, a->inv_freq, (size_t)(a->rot_dim / 2) * sizeof(float), a->inv_freq);
	return stage_finish(&s, s.rc ? s.rc : kb_rope(t->dev, &d), a->x);
}

static result test_rope(const target *t)
{
	result res = {0, 0, 0};
	static const int64_t shapes[][3] = {/* n_tok, n_heads, rot_dim */
		{1, 1, 2}, {3, 2, 8}, {5, 3, 64}, {17, 4, 64}, {2, 128, 64}, {64, 1, 64}, {7, 5, 16},
	};
	for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
		for (int inter = 0; inter < 2; inter++) {
			int64_t nt = shapes[s][0], nh = shapes[s][1], rd = shapes[s][2];
			int64_t hs = rd + (int64_t)(s % 3) * 64;  /* rope slice inside a wider head */
			int64_t ts = nh * hs + (int64_t)(s % 2) * 5;
			size_t xb = (size_t)(nt * ts) * sizeof(float);
			float *x = malloc(xb), *ref = malloc(xb), *got = malloc(xb);
			int32_t *pos = malloc((size_t)nt * sizeof *pos);
			float *inv = malloc((size_t)(rd / 2) * sizeof *inv);
			for (int64_t i = 0; i < nt * ts; i++)
				x[i] = frand_mag(-2.0f, 2.0f);
			for (int64_t i = 0; i < nt; i++)
				pos[i] = (int32_t)(rand_u64() % 5000);
			for (int64_t i = 0; i < rd / 2; i++)
				inv[i] = (float)pow(10000.0, -2.0 * (double)i / (double)rd);
			float amp = s % 2 ? 1.0f : 1.3f;
			memcpy(ref, x, xb);
			memcpy(got, x, xb);
			kb_rope_args a = {.x = ref, .n_tok = nt, .n_heads = nh, .tok_stride = ts,
						.head_stride = hs, .rot_dim = rd, .pos = pos,
						.inv_freq = inv, .amp = amp, .interleaved = inter};
			kc_rope_ref(&a);
			a.x = got;
			int rc = run_rope_on(t, &a, xb);
			if (rc) {
				res.rc = rc;
			} else {
				for (int64_t tk = 0; tk < nt; tk++) {
					for (int64_t i = 0; i < ts; i++) {
						int64_t h = i / hs, j = i % hs, o = tk * ts + i;
						if (h >= nh || j >= rd) { /* outside the rope slices: untouched */
							note(&res, got[o] == x[o] ? 0.0 : INFINITY);
							continue;
						}
						int64_t pj = inter ? (j ^ 1) : (j < rd / 2 ? j + rd / 2 : j - rd / 2);
						double den = amp * (fabs(x[o]) + fabs(x[tk * ts + h * hs + pj]));
						note(&res, fabs((double)got[o] - (double)ref[o]) / (den + 1e-30));
					}
				}
			}
			free(x);
			free(ref);
			free(got);
			free(pos);
			free(inv);
		}
	}
	return res;
}

/* --- silu_mul --- */

static const int64_t ew_shapes[][2] = {
	{1, 1}, {3, 7}, {4, 15}, {2, 16}, {5, 33}, {8, 64}, {3, 100}, {2, 1000}, {16, 129}, {4, 18432}, {64, 513},
};

static int run_silu_on(const target *t, kb_silu_mul_args *a, size_t gb, size_t ub, size_t ob)
{
	if (!t->dev)
		return kc_silu_mul_isa(t->isa, a);
	stage s = {.b = t->dev};
	kb_silu_mul_args d = *a;
	d.gate = stage_put(&s, a->gate, gb, a->gate);
	d.up = stage_put(&s, a->up, ub, a->up);
	d.out = stage_put(&s, a->out, ob, a->out);
	return stage_finish(&s, s.rc ? s.rc : kb_silu_mul(t->dev, &d), a->out);
}

static result test_silu_mul(const target *t)
{
	result res = {0, 0, 0};
	for (size_t s = 0; s < sizeof ew_shapes / sizeof ew_shapes[0]; s++) {
		int64_t rows = ew_shapes[s][0], dim = ew_shapes[s][1];
		int64_t gs = dim + (int64_t)(s % 3), us = dim + (int64_t)(s % 2) * 7, os = dim + (int64_t)(s % 4);
		size_t gb = (size_t)(rows * gs) * 4, ub = (size_t)(rows * us) * 4, ob = (size_t)(rows * os) * 4;
		float *g = malloc(gb), *u = malloc(ub), *ref = malloc(ob), *got = malloc(ob);
		for (int64_t r = 0; r < rows; r++) {
			float hi = frand(-1.0f, 1.9f); /* |gate| up to about 80 */
			for (int64_t i = 0; i < gs; i++)
				g[r * gs + i] = frand_mag(-3.0f, hi);
			for (int64_t i = 0; i < us; i++)
				u[r * us + i] = frand_mag(-2.0f, 2.0f);
		}
		for (int64_t i = 0; i < rows * os; i++)
			ref[i] = got[i] = SENTINEL;
		kb_silu_mul_args a = {.out = ref, .gate = g, .up = u, .rows = rows, .dim = dim,
					.out_stride = os, .gate_stride = gs, .up_stride = us};
		kc_silu_mul_ref(&a);
		a.out = got;
		int rc = run_silu_on(t, &a, gb, ub, ob);
		if (rc) {
			res.rc = rc;
		} else {
			for (int64_t i = 0; i < rows * os; i++) {
				if (i % os >= dim)
					note(&res, got[i] == SENTINEL ? 0.0 : INFINITY);
				else
					note(&res, fabs((double)got[i] - (double)ref[i]) / (fabs((double)ref[i]) + 1e-30));
			}
		}
		free(g);
		free(u);
		free(ref);
		free(got);
	}
	return res;
}

/* --- axpy --- */

static int run_axpy_on(const target *t, kb_axpy_args *a)
{
	if (!t->dev)
		return kc_axpy_isa(t->isa, a);
	stage s = {.b = t->dev};
	kb_axpy_args d = *a;
	size_t b = (size_t)a->n * sizeof(float);
	d.x = stage_put(&s, a->x, b, a->x);
	d.y = stage_put(&s, a->y, b, a->y);
	return stage_finish(&s, s.rc ? s.rc : kb_axpy(t->dev, &d), a->y);
}

static result test_axpy(const target *t)
{
	result res = {0, 0, 0};
	static const int64_t ns[] = {1, 7, 16, 33, 1000, 7168, 100003, 300001};
	for (size_t s = 0; s < sizeof ns / sizeof ns[0]; s++) {
		int64_t n = ns[s];
		size_t b = (size_t)n * sizeof(float);
		float *x = malloc(b), *y0 = malloc(b), *ref = malloc(b), *got = malloc(b);
		for (int64_t i = 0; i < n; i++) {
			x[i] = frand_mag(-3.0f, 2.0f);
			y0[i] = frand_mag(-3.0f, 2.0f);
		}
		float alpha = frand_mag(-1.0f, 1.0f);
		memcpy(ref, y0, b);
		memcpy(got, y0, b);
		kb_axpy_args a = {.y = ref, .x = x, .n = n, .alpha = alpha};
		kc_axpy_ref(&a);
		a.y = got;
		int rc = run_axpy_on(t, &a);
		if (rc)
			res.rc = rc;
		else
			for (int64_t i = 0; i < n; i++)
				note(&res, fabs((double)got[i] - (double)ref[i]) /
						   (fabs((double)y0[i]) + fabs((double)alpha * x[i]) + 1e-30));
		free(x);
		free(y0);
		free(ref);
		free(got);
	}
	return res;
}

/* --- softmax --- */

static int run_softmax_on(const target *t, kb_softmax_args *a, size_t bytes)
{
	if (!t->dev)
		return kc_softmax_isa(t->isa, a);
	stage s = {.b = t->dev};
	kb_softmax_args d = *a;
	d.x = stage_put(&s, a->x, bytes, a->x);
	return stage_finish(&s, s.rc ? s.rc : kb_softmax(t->dev, &d), a->x);
}

static result test_softmax(const target *t)
{
	result res = {0, 0, 0};
	static const int64_t shapes[][2] = {
		{1, 1}, {3, 7}, {2, 16}, {5, 33}, {4, 100}, {2, 1000}, {3, 4097}, {64, 130}, {16, 17},
	};
	static const float scales[] = {1.0f, 0.13523378f, 3.0f};
	for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
		int64_t rows = shapes[s][0], n = shapes[s][1], st = n + (int64_t)(s % 3) * 2;
		size_t b = (size_t)(rows * st) * sizeof(float);
		float *x = malloc(b), *ref = malloc(b), *got = malloc(b);
		for (int64_t r = 0; r < rows; r++) {
			float hi = frand(-1.0f, 1.3f);
			for (int64_t i = 0; i < st; i++) {
				float v = frand_mag(-2.0f, hi);
				if (i >= n)
					v = SENTINEL;
				else if (i > 0 && rand_u64() % 10 == 0)
					v = -INFINITY; /* masked positions (never the whole row) */
				x[r * st + i] = v;
			}
		}
		memcpy(ref, x, b);
		memcpy(got, x, b);
		kb_softmax_args a = {.x = ref, .rows = rows, .n = n, .stride = st,
					.scale = scales[s % 3]};
		kc_softmax_ref(&a);
		a.x = got;
		int rc = run_softmax_on(t, &a, b);
		if (rc) {
			res.rc = rc;
		} else {
			for (int64_t i = 0; i < rows * st; i++) {
				if (i % st >= n)
					note(&res, got[i] == SENTINEL ? 0.0 : INFINITY);
				else
					note(&res, fabs((double)got[i] - (double)ref[i]) / (fabs((double)ref[i]) + 1e-20));
			}
		}
		free(x);
		free(ref);
		free(got);
	}
	return res;
}

/* ---- the table ---- */

/* Each test with the op and weight dtype it exercises: a backend target runs
 * it when its supports_op says so, and is skipped otherwise. */
static const struct {
	const char *name;
	result (*fn)(const target *);
	enum kb_op op;
	enum kb_dtype dtype;
	double tol; /* in the op's error measure (top comment) */
} ops[] = {
	{"rmsnorm", test_rmsnorm, KB_OP_RMSNORM, KB_F32, 1e-5},
	{"matmul_f32", test_matmul_f32, KB_OP_MATMUL, KB_F32, 1e-5},
	{"matmul_f16", test_matmul_f16, KB_OP_MATMUL, KB_F16, 1e-5},
	{"matmul_bf16", test_matmul_bf16, KB_OP_MATMUL, KB_BF16, 1e-5},
	{"matmul_fp8", test_matmul_fp8, KB_OP_MATMUL, KB_F8_E4M3, 1e-5},
	{"matmul_q8_0", test_matmul_q8_0, KB_OP_MATMUL, KB_Q8_0, 2e-6},
	{"matmul_q4_0", test_matmul_q4_0, KB_OP_MATMUL, KB_Q4_0, 2e-6},
	{"matmul_q4_1", test_matmul_q4_1, KB_OP_MATMUL, KB_Q4_1, 2e-6},
	{"matmul_q4_k", test_matmul_q4_k, KB_OP_MATMUL, KB_Q4_K, 2e-6},
	{"matmul_q5_k", test_matmul_q5_k, KB_OP_MATMUL, KB_Q5_K, 2e-6},
	{"matmul_q6_k", test_matmul_q6_k, KB_OP_MATMUL, KB_Q6_K, 2e-6},
	{"embed", test_embed, KB_OP_EMBED, KB_BF16, 0},
	{"rope", test_rope, KB_OP_ROPE, KB_F32, 1e-6},
	{"silu_mul", test_silu_mul, KB_OP_SILU_MUL, KB_F32, 1e-6},
	{"axpy", test_axpy, KB_OP_AXPY, KB_F32, 2.5e-7},
	{"softmax", test_softmax, KB_OP_SOFTMAX, KB_F32, 1e-5},
};

/* Each backend's supports_op against its ops table, every op x dtype: a
 * supported op must have a function (the tests above then run it); the CPU
 * backend, the reference, supports everything but embed on f8_e4m3.
 * Returns the number of disagreements, each printed. */
static int check_support_table(const kb_backend *b)
{
	int bad = 0;
	for (int op = 0; op < KB_OP_COUNT; op++) {
		for (int t = 0; t < KB_DTYPE_COUNT; t++) {
			int yes = kb_supports_op(b, (enum kb_op)op, (enum kb_dtype)t);
			int want = strcmp(b->name, "cpu") != 0 || !(op == KB_OP_EMBED && t == KB_F8_E4M3);
			if ((yes && !kb_backend_has_op(b, (enum kb_op)op)) ||
			    (strcmp(b->name, "cpu") == 0 && yes != want)) {
				printf("FAIL %-12s %-16s: supports_op(%s) says %d, table has %s\n", "support",
				       b->name, kb_dtype_name((enum kb_dtype)t), yes,
				       kb_backend_has_op(b, (enum kb_op)op) ? "a function" : "NULL");
				bad++;
			}
		}
	}
	return bad;
}

int main(int argc, char **argv)
{
	const char *only = argc > 1 ? argv[1] : NULL;
	target targets[KC_ISA_COUNT + 5];
	kb_backend *opened[4];
	int nt = 0, passed = 0, failed = 0, skipped = 0, n_opened = 0;
	ds_err cpu_err = {0};
	double t_all = ds_now_s();
	for (int i = 0; i <= (int)kc_isa_detect(); i++) {
		snprintf(targets[nt].name, sizeof targets[nt].name, "cpu/%s", kc_isa_name(i));
		targets[nt].isa = (enum kc_isa)i;
		targets[nt].dev = NULL;
		nt++;
	}
	/* An instance of the CPU backend, with buffers staged like a
	 * device's: checks the dispatch and the argument checks (a valid case
	 * must never be refused) and the staging code the device targets use. */
	kb_backend *cpu = kb_backend_open("cpu", NULL, &cpu_err);
	if (!cpu) {
		fprintf(stderr, "conformance: %s\n", cpu_err.msg);
		return 1;
	}
	ds_strlcpy(targets[nt].name, "cpu/backend", sizeof targets[nt].name);
	targets[nt].isa = KC_ISA_SCALAR;
	targets[nt].dev = cpu;
	opened[n_opened++] = cpu;
	nt++;
	for (int i = (int)kc_isa_detect() + 1; i < KC_ISA_COUNT; i++) {
		printf("skip %-12s cpu/%s: this CPU does not support it\n", "*", kc_isa_name(i));
		skipped++;
	}
	for (int i = 0; i < kb_backend_count(); i++) {
		const char *name = kb_backend_name_at(i);
		if (strcmp(name, "cpu") == 0)
			continue;
		ds_err err = {0};
		kb_backend *b = kb_backend_open(name, NULL, &err);
		if (!b) {
			printf("skip %-12s %s: %s\n", "*", name, err.msg);
			skipped++;
			continue;
		}
		ds_strlcpy(targets[nt].name, name, sizeof targets[nt].name);
		targets[nt].isa = KC_ISA_SCALAR;
		targets[nt].dev = b;
		opened[n_opened++] = b;
		nt++;
	}
	/* The support table of each opened backend: one line each. */
	for (int i = 0; i < n_opened && !only; i++) {
		int bad = check_support_table(opened[i]);
		printf("%s %-12s %-16s %d ops x %d dtypes\n", bad ? "FAIL" : "ok  ", "support",
		       opened[i]->name, KB_OP_COUNT, KB_DTYPE_COUNT);
		if (bad)
			failed++;
		else
			passed++;
	}
	for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++) {
		if (only && strncmp(only, ops[o].name, strlen(only)) != 0)
			continue;
		for (int t = 0; t < nt; t++) {
			if (targets[t].dev &&
			    !kb_supports_op(targets[t].dev, ops[o].op, ops[o].dtype)) {
				printf("skip %-12s %-16s: the backend does not support it\n", ops[o].name,
				       targets[t].name);
				skipped++;
				continue;
			}
			double t0 = ds_now_s();
			result r = ops[o].fn(&targets[t]);
			int ok = r.rc == 0 && r.max_err <= ops[o].tol && r.checked > 0;
			printf("%s %-12s %-16s %8d values, max err %.3g (tol %g), %.1f ms%s%s\n",
			       ok ? "ok  " : "FAIL", ops[o].name, targets[t].name, r.checked,
			       r.max_err, ops[o].tol, (ds_now_s() - t0) * 1e3,
			       r.rc ? ", error " : "", r.rc ? ds_status_name(r.rc) : "");
			if (ok)
				passed++;
			else
				failed++;
		}
	}
	for (int i = n_opened - 1; i >= 0; i--)
		kb_backend_close(opened[i]);
	printf("conformance: %d passed, %d failed, %d skipped (%.1f s)\n", passed, failed, skipped,
	       ds_now_s() - t_all);
	return failed ? 1 : 0;
}

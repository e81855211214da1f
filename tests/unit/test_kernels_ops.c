/*
 * test_kernels_ops.c - unit tests of kernels/cpu that conformance does not
 * cover: the thread pool (coverage, nesting, concurrent callers, resizing),
 * thread-count independence of the matmul, its one-row decode path against
 * the reference, several one-row products as one job, rope / silu_mul / softmax / axpy
 * against hand-computed values, the backend's argument checks, matmul with
 * K = 0, and the bandwidth probe's contract.
 */
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/membw.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/profile.h"
#include "tests/unit/unit.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct cover {
	int *hits; /* atomic counters, one per item */
	int64_t n;
	int nested; /* call kc_parallel_for again from inside */
} cover;

static void cover_fn(void *ctx, int64_t b, int64_t e)
{
	cover *c = ctx;
	for (int64_t i = b; i < e; i++)
		__atomic_add_fetch(&c->hits[i], 1, __ATOMIC_RELAXED);
	if (c->nested) {
		int local[5] = {0};
		cover in2 = {local, 5, 0};
		kc_parallel_for(5, 1, cover_fn, &in2); /* runs serially, must not deadlock */
		for (int i = 0; i < 5; i++)
			if (local[i] != 1)
				__atomic_add_fetch(&c->hits[b], 1000, __ATOMIC_RELAXED);
	}
}

static int run_cover(int64_t n, int64_t grain, int nested)
{
	cover c = {calloc((size_t)(n > 0 ? n : 1), sizeof(int)), n, nested};
	kc_parallel_for(n, grain, cover_fn, &c);
	int bad = 0;
	for (int64_t i = 0; i < n; i++)
		bad += c.hits[i] != 1;
	free(c.hits);
	return bad;
}

TEST(pool_covers_every_item_once)
{
	static const int threads[] = {1, 2, 3, 5};
	for (size_t t = 0; t < 4; t++) {
		CHECK_EQ(kc_pool_set_threads(threads[t]), DS_OK);
		CHECK_EQ(kc_pool_threads(), threads[t]);
		CHECK_EQ(run_cover(0, 1, 0), 0);
		CHECK_EQ(run_cover(1, 1, 0), 0);
		CHECK_EQ(run_cover(7, 100, 0), 0);
		CHECK_EQ(run_cover(10007, 1, 0), 0);
		CHECK_EQ(run_cover(10007, 333, 0), 0);
		CHECK_EQ(run_cover(64, 0, 0), 0); /* grain < 1 counts as 1 */
		CHECK_EQ(run_cover(40, 3, 1), 0); /* nested calls run serially */
		for (int rep = 0; rep < 200; rep++) /* many back-to-back jobs */
			if (run_cover(17, 2, 0))
				CHECK(!"coverage failed");
	}
	CHECK_EQ(kc_pool_set_threads(-1), DS_EINVAL);
	CHECK_EQ(kc_pool_set_threads(KC_POOL_MAX_THREADS + 1), DS_EINVAL);
	CHECK_EQ(kc_pool_set_threads(0), DS_OK);
	CHECK(kc_pool_threads() >= 1);
}

typedef struct nested_mm {
	int bad;
	float y[64 * 8];
} nested_mm;

/* A job whose chunks run a (threaded) matmul and try to resize the pool. */
static void nested_mm_fn(void *ctx, int64_t b, int64_t e)
{
	nested_mm *n = ctx;
	static float x[8 * 300], w[64 * 300];
	for (int i = 0; i < 8 * 300; i++)
		x[i] = 1.0f;
	for (int i = 0; i < 64 * 300; i++)
		w[i] = 0.5f;
	for (int64_t i = b; i < e; i++) {
		float *y = n->y + i * 64;
		kb_matmul_args a = {.y = y, .x = x, .w = w, .wtype = KB_F32, .M = 1, .N = 64,
					.K = 300, .x_stride = 300, .y_stride = 64, .w_stride = 300};
		if (kc_matmul_isa(kc_isa_detect(), &a) != DS_OK || y[0] != 150.0f || y[63] != 150.0f)
			__atomic_add_fetch(&n->bad, 1, __ATOMIC_RELAXED);
		if (kc_pool_set_threads(1) != DS_EBUSY)
			__atomic_add_fetch(&n->bad, 1, __ATOMIC_RELAXED);
		if (kc_pool_threads() < 1)
			__atomic_add_fetch(&n->bad, 1, __ATOMIC_RELAXED);
	}
}

TEST(pool_nested_ops_do_not_deadlock)
{
	CHECK_EQ(kc_pool_set_threads(3), DS_OK);
	static nested_mm n;
	n.bad = 0;
	kc_parallel_for(8, 1, nested_mm_fn, &n);
	CHECK_EQ(n.bad, 0);
	CHECK_EQ(kc_pool_threads(), 3);
	CHECK_EQ(kc_pool_set_threads(0), DS_OK);
}

static void *second_caller(void *arg)
{
	int *bad = arg;
	for (int rep = 0; rep < 100; rep++)
		*bad += run_cover(1000, 7, 0);
	return NULL;
}

TEST(pool_two_callers_do_not_race)
{
	CHECK_EQ(kc_pool_set_threads(3), DS_OK);
	pthread_t th;
	int bad2 = 0, bad1 = 0;
	CHECK_EQ(pthread_create(&th, NULL, second_caller, &bad2), 0);
	for (int rep = 0; rep < 100; rep++)
		bad1 += run_cover(1000, 7, 0);
	pthread_join(th, NULL);
	CHECK_EQ(bad1, 0);
	CHECK_EQ(bad2, 0);
	kc_pool_shutdown(); /* the next job starts the workers again */
	CHECK_EQ(run_cover(100, 1, 0), 0);
	CHECK_EQ(kc_pool_set_threads(0), DS_OK);
}

TEST(matmul_same_bits_for_any_thread_count)
{
	static const int64_t shapes[][3] = {{1, 77, 1500}, {3, 64, 1100}, {9, 37, 2100}};
	static const enum kb_dtype dts[] = {KB_BF16, KB_F8_E4M3, KB_F32};
	for (size_t s = 0; s < 3; s++) {
		int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
		enum kb_dtype dt = dts[s];
		size_t es = kb_dtype_size(dt);
		unsigned char *w = malloc((size_t)(N * K) * es);
		for (size_t i = 0; i < (size_t)(N * K) * es; i++)
			w[i] = (unsigned char)(ut_rand_u64() & (dt == KB_F8_E4M3 ? 0x7E : 0xFF));
		if (dt == KB_F32) /* finite floats */
			for (int64_t i = 0; i < N * K; i++)
				((float *)w)[i] = ut_rand_float(-1, 1);
		if (dt == KB_BF16)
			for (int64_t i = 0; i < N * K; i++)
				((uint16_t *)w)[i] &= 0xBFFF; /* exponent < 128: finite */
		float sc[64];
		for (int i = 0; i < 64; i++)
			sc[i] = ut_rand_float(1e-3f, 1e-2f);
		float *x = malloc((size_t)(M * K) * sizeof(float));
		float *y1 = malloc((size_t)(M * N) * sizeof(float)), *y2 = malloc((size_t)(M * N) * sizeof(float));
		for (int64_t i = 0; i < M * K; i++)
			x[i] = ut_rand_float(-1, 1);
		kb_matmul_args a = {.y = y1, .x = x, .w = w, .w_scale = sc, .wtype = dt, .M = M,
					.N = N, .K = K, .x_stride = K, .y_stride = N, .w_stride = K,
					.scale_stride = (K + 127) / 128, .block = 128};
		for (int isa = 1; isa <= (int)kc_isa_detect(); isa++) {
			CHECK_EQ(kc_pool_set_threads(1), DS_OK);
			a.y = y1;
			CHECK_EQ(kc_matmul_isa((enum kc_isa)isa, &a), DS_OK);
			for (int t = 2; t <= 4; t++) {
				CHECK_EQ(kc_pool_set_threads(t), DS_OK);
				a.y = y2;
				CHECK_EQ(kc_matmul_isa((enum kc_isa)isa, &a), DS_OK);
				CHECK(memcmp(y1, y2, (size_t)(M * N) * sizeof(float)) == 0);
			}
		}
		free(w);
		free(x);
		free(y1);
		free(y2);
	}
	CHECK_EQ(kc_pool_set_threads(0), DS_OK);
}

/* n random finite BF16 or FP8 weights in w and their magnitudes in wa. */
static void rand_finite_weights(enum kb_dtype dt, unsigned char *w, unsigned char *wa, int64_t n)
{
	for (size_t i = 0; i < (size_t)n * kb_dtype_size(dt); i++)
		w[i] = (unsigned char)(ut_rand_u64() & 0xFF);
	for (int64_t i = 0; i < n; i++) {
		if (dt == KB_BF16) {
			((uint16_t *)w)[i] &= 0xBFFF; /* exponent < 128: finite */
			((uint16_t *)wa)[i] = ((uint16_t *)w)[i] & 0x7FFF;
		} else {
			if ((w[i] & 0x7F) == 0x7F)
				w[i] = 0x30; /* no E4M3 NaN */
			wa[i] = w[i] & 0x7F;
		}
	}
}

/* Decode with one x row over whole contiguous rows (kc_mm_rows, AVX2 and
 * AVX-512), and over rows longer than KC_MM_ROWS_MAXK (the tiles with x
 * permuted): K with tails after the 64- and 32-element groups, N that
 * crosses FP8 scale-block rows inside a thread's share, y written and added
 * to.  Each result within 1e-5 of sum |x| |W| of the scalar reference, and
 * the same bits for 1 to 4 threads. */
TEST(matmul_decode_rows_match_reference_and_thread_count)
{
	static const int64_t shapes[][3] = {{300, 1000, 128}, {131, 2085, 64}, {77, 64, 128}, {1030, 520, 128},
					    {45, 4500, 128}, {45, 6500, 128}};
	static const enum kb_dtype dts[] = {KB_BF16, KB_F8_E4M3};
	for (size_t s = 0; s < 6; s++) {
		for (size_t d = 0; d < 2; d++) {
			const int64_t N = shapes[s][0], K = shapes[s][1], block = shapes[s][2];
			const enum kb_dtype dt = dts[d];
			const size_t es = kb_dtype_size(dt);
			const int64_t scols = (K + block - 1) / block, srows = (N + block - 1) / block;
			unsigned char *w = malloc((size_t)(N * K) * es), *wa = malloc((size_t)(N * K) * es);
			float *sc = malloc((size_t)(srows * scols) * sizeof(float));
			float *x = malloc((size_t)K * sizeof(float)), *xa = malloc((size_t)K * sizeof(float));
			float *y0 = malloc((size_t)N * sizeof(float)), *ref = malloc((size_t)N * sizeof(float));
			float *bound = malloc((size_t)N * sizeof(float)), *y1 = malloc((size_t)N * sizeof(float));
			float *y2 = malloc((size_t)N * sizeof(float));
			rand_finite_weights(dt, w, wa, N * K);
			for (int64_t i = 0; i < srows * scols; i++)
				sc[i] = ut_rand_float(1e-3f, 1e-1f);
			for (int64_t k = 0; k < K; k++) {
				x[k] = ut_rand_float(-1, 1);
				xa[k] = x[k] < 0 ? -x[k] : x[k];
			}
			for (int64_t n = 0; n < N; n++)
				y0[n] = ut_rand_float(-1, 1);
			for (int acc = 0; acc <= 1; acc++) {
				kb_matmul_args a = {.y = ref, .x = x, .w = w, .w_scale = sc,
							.wtype = dt, .M = 1, .N = N, .K = K,
							.x_stride = K, .y_stride = N, .w_stride = K,
							.scale_stride = scols, .block = block,
							.accumulate = acc};
				kb_matmul_args ab = a;
				ab.x = xa;
				ab.w = wa;
				ab.y = bound;
				ab.accumulate = 0;
				kc_matmul_ref(&ab);
				memcpy(ref, y0, (size_t)N * sizeof(float));
				kc_matmul_ref(&a);
				for (int isa = 1; isa <= (int)kc_isa_detect(); isa++) {
					for (int t = 1; t <= 4; t++) {
						float *y = t == 1 ? y1 : y2;
						CHECK_EQ(kc_pool_set_threads(t), DS_OK);
						memcpy(y, y0, (size_t)N * sizeof(float));
						a.y = y;
						CHECK_EQ(kc_matmul_isa((enum kc_isa)isa, &a), DS_OK);
						if (t > 1)
							CHECK(memcmp(y1, y2, (size_t)N * sizeof(float)) == 0);
					}
					int bad = 0;
					for (int64_t n = 0; n < N; n++) {
						float tol = 1e-5f * (bound[n] + (acc ? (y0[n] < 0 ? -y0[n] : y0[n]) : 0.0f)) + 1e-30f;
						float e = y1[n] - ref[n];
						bad += !(e <= tol && -e <= tol);
					}
					CHECK_EQ(bad, 0);
				}
			}
			free(w);
			free(wa);
			free(sc);
			free(x);
			free(xa);
			free(y0);
			free(ref);
			free(bound);
			free(y1);
			free(y2);
		}
	}
	CHECK_EQ(kc_pool_set_threads(0), DS_OK);
}

/* The batched form with one x row per product and the W matrices back to
 * back (the absorbed-MLA per-head matrices): products of 37 rows (groups of
 * four and thread shares straddle them), of 150 rows in FP8 blocks of 64
 * (a share starting inside a product puts groups of four across a scale
 * block row), K with tails, FP8 scale grids per product; the same bits as each product alone, for 1 to 4 threads, and
 * within 1e-5 of sum |x| |W| of the scalar reference. */
TEST(matmul_batched_one_row_equals_each_product_alone)
{
	static const int64_t shapes[][3] = {{37, 130, 128}, {512, 128, 128}, {128, 512, 64}, {150, 128, 64}};
	static const enum kb_dtype dts[] = {KB_BF16, KB_F8_E4M3};
	enum { B = 16 };
	for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
		for (size_t d = 0; d < 2; d++) {
			const int64_t N = shapes[si][0], K = shapes[si][1], block = shapes[si][2];
			const enum kb_dtype dt = dts[d];
			const size_t es = kb_dtype_size(dt);
			const int64_t scols = (K + block - 1) / block, srows = (N + block - 1) / block;
			const int64_t xs = K + 3, ys = N + 5, ss = srows * scols + 2; /* padded strides */
			unsigned char *w = malloc((size_t)(B * N * K) * es), *wa = malloc((size_t)(B * N * K) * es);
			float *sc = malloc((size_t)(B * ss) * sizeof(float));
			float *x = malloc((size_t)(B * xs) * sizeof(float)), *xa = malloc((size_t)(B * xs) * sizeof(float));
			float *y0 = malloc((size_t)(B * ys) * sizeof(float)), *yb = malloc((size_t)(B * ys) * sizeof(float));
			float *y1 = malloc((size_t)(B * ys) * sizeof(float)), *ref = malloc((size_t)(B * ys) * sizeof(float));
			float *bound = malloc((size_t)(B * ys) * sizeof(float));
			rand_finite_weights(dt, w, wa, B * N * K);
			for (int64_t i = 0; i < B * ss; i++)
				sc[i] = ut_rand_float(1e-3f, 1e-1f);
			for (int64_t i = 0; i < B * xs; i++) {
				x[i] = ut_rand_float(-1, 1);
				xa[i] = x[i] < 0 ? -x[i] : x[i];
			}
			for (int64_t i = 0; i < B * ys; i++)
				y0[i] = ut_rand_float(-1, 1);
			for (int acc = 0; acc <= 1; acc++) {
				kb_matmul_args a = {.y = yb, .x = x, .w = w,
							.w_scale = dt == KB_F8_E4M3 ? sc : NULL,
							.wtype = dt, .M = 1, .N = N, .K = K,
							.x_stride = K, .y_stride = N, .w_stride = K,
							.scale_stride = scols, .block = block,
							.accumulate = acc};
				a.batch = B;
				a.x_bstride = xs;
				a.y_bstride = ys;
				a.w_bstride = N * K;
				a.s_bstride = dt == KB_F8_E4M3 ? ss : 0;
				int bad_ref = 0;
				for (int64_t b = 0; b < B; b++) {
					kb_matmul_args one = a, ab;
					one.batch = 0;
					one.x = x + b * xs;
					one.w = w + (size_t)(b * N * K) * es;
					one.w_scale = a.w_scale ? sc + b * ss : NULL;
					one.y = ref + b * ys;
					ab = one;
					ab.x = xa + b * xs;
					ab.w = wa + (size_t)(b * N * K) * es;
					ab.y = bound + b * ys;
					ab.accumulate = 0;
					kc_matmul_ref(&ab);
					memcpy(ref + b * ys, y0 + b * ys, (size_t)ys * sizeof(float));
					kc_matmul_ref(&one);
				}
				for (int isa = 1; isa <= (int)kc_isa_detect(); isa++) {
					for (int t = 1; t <= 4; t++) {
						CHECK_EQ(kc_pool_set_threads(t), DS_OK);
						memcpy(yb, y0, (size_t)(B * ys) * sizeof(float));
						memcpy(y1, y0, (size_t)(B * ys) * sizeof(float));
						a.y = yb;
						CHECK_EQ(kc_matmul_batch_isa((enum kc_isa)isa, &a), DS_OK);
						for (int64_t b = 0; b < B; b++) {
							kb_matmul_args one = a;
							one.batch = 0;
							one.x = x + b * xs;
							one.w = w + (size_t)(b * N * K) * es;
							one.w_scale = a.w_scale ? sc + b * ss : NULL;
							one.y = y1 + b * ys;
							CHECK_EQ(kc_matmul_isa((enum kc_isa)isa, &one), DS_OK);
						}
						CHECK(memcmp(yb, y1, (size_t)(B * ys) * sizeof(float)) == 0);
					}
					for (int64_t b = 0; b < B; b++)
						for (int64_t n = 0; n < ys; n++) {
							int64_t i = b * ys + n;
							float y0a = y0[i] < 0 ? -y0[i] : y0[i];
							float tol = n < N ? 1e-5f * (bound[i] + (acc ? y0a : 0.0f)) + 1e-30f : 0.0f;
							float e = yb[i] - (n < N ? ref[i] : y0[i]); /* padding untouched */
							bad_ref += !(e <= tol && -e <= tol);
						}
				}
				CHECK_EQ(bad_ref, 0);
			}
			free(w);
			free(wa);
			free(sc);
			free(x);
			free(xa);
			free(y0);
			free(yb);
			free(y1);
			free(ref);
			free(bound);
		}
	}
	CHECK_EQ(kc_pool_set_threads(0), DS_OK);
}

/* Several BF16 and FP8 products of one x row each (a MoE layer's gate and
 * up with one x, downs each with its own x; row counts not multiples of 16;
 * K with tails; products adding into y; two with rows longer than the
 * one-row kernels take, which run the decode tiles inside the same job) as
 * one job: on every ISA and 1-3 threads, the bits of one call per product,
 * directly and through the backend.  A set with a product of two x rows is
 * refused by the fused form (nothing written), and a bad argument anywhere
 * is refused before anything runs. */
TEST(matmul_multi_one_row_equals_each_product_alone)
{
	enum { P = 7 };
	static const struct {
		enum kb_dtype dt;
		int64_t N, K;
		int xi, acc; /* which x, y += */
	} prod[P] = {{KB_F8_E4M3, 300, 640, 0, 0}, {KB_F8_E4M3, 512, 640, 0, 0}, {KB_BF16, 77, 640, 0, 1},
		     {KB_F8_E4M3, 130, 300, 1, 0}, {KB_F8_E4M3, 130, 300, 2, 1}, {KB_BF16, 45, 6500, 3, 0},
		     {KB_F8_E4M3, 70, 6500, 3, 1}};
	const kb_backend *be = kb_backend_get("cpu", NULL);
	CHECK(be != NULL && be->ops->matmul_multi != NULL);
	float *x[4];
	static const int64_t xk[4] = {640, 300, 300, 6500};
	for (int i = 0; i < 4; i++) {
		x[i] = malloc((size_t)(2 * xk[i]) * sizeof(float)); /* room for two rows (the refused set) */
		for (int64_t k = 0; k < 2 * xk[i]; k++)
			x[i][k] = ut_rand_float(-1, 1);
	}
	kb_matmul_args a[P];
	unsigned char *w[P], *wa[P];
	float *sc[P], *y[P], *ref[P], *y0[P];
	for (int i = 0; i < P; i++) {
		const int64_t N = prod[i].N, K = prod[i].K, cols = (K + 127) / 128, srows = (N + 127) / 128;
		w[i] = malloc((size_t)(N * K) * kb_dtype_size(prod[i].dt));
		wa[i] = malloc((size_t)(N * K) * kb_dtype_size(prod[i].dt));
		rand_finite_weights(prod[i].dt, w[i], wa[i], N * K);
		sc[i] = malloc((size_t)(srows * cols) * sizeof(float));
		for (int64_t q = 0; q < srows * cols; q++)
			sc[i][q] = ut_rand_float(1e-3f, 1e-1f);
		y[i] = malloc((size_t)(2 * N) * sizeof(float));
		ref[i] = malloc((size_t)(2 * N) * sizeof(float));
		y0[i] = malloc((size_t)(2 * N) * sizeof(float));
		for (int64_t n = 0; n < 2 * N; n++)
			y0[i][n] = ut_rand_float(-1, 1);
		a[i] = (kb_matmul_args){.y = y[i], .x = x[prod[i].xi], .w = w[i],
					.w_scale = prod[i].dt == KB_F8_E4M3 ? sc[i] : NULL, .wtype = prod[i].dt,
					.M = 1, .N = N, .K = K, .x_stride = K, .y_stride = N, .w_stride = K,
					.scale_stride = cols, .block = 128, .accumulate = prod[i].acc};
	}
	const enum kc_isa prev = kc_isa_active();
	for (int isa = (int)KC_ISA_AVX2; isa <= (int)kc_isa_detect(); isa++) {
		kc_isa_force((enum kc_isa)isa);
		for (int th = 1; th <= 3; th++) {
			CHECK_EQ(kc_pool_set_threads(th), DS_OK);
			for (int i = 0; i < P; i++) {
				memcpy(ref[i], y0[i], (size_t)prod[i].N * sizeof(float));
				memcpy(y[i], y0[i], (size_t)prod[i].N * sizeof(float));
				a[i].y = ref[i];
				CHECK_EQ(kc_matmul_isa((enum kc_isa)isa, &a[i]), DS_OK);
				a[i].y = y[i];
			}
			/* with two x rows in the last product the fused form refuses */
			kb_matmul_args m2[P];
			memcpy(m2, a, sizeof m2);
			m2[P - 1].M = 2;
			CHECK_EQ(kc_matmul_multi_isa((enum kc_isa)isa, m2, P), DS_EUNSUPPORTED);
			for (int i = 0; i < P; i++)
				CHECK(memcmp(y[i], y0[i], (size_t)prod[i].N * sizeof(float)) == 0);
			CHECK_EQ(kc_matmul_multi_isa((enum kc_isa)isa, a, P), DS_OK);
			for (int i = 0; i < P; i++)
				if (memcmp(y[i], ref[i], (size_t)prod[i].N * sizeof(float)) != 0)
					ut_fail(__FILE__, __LINE__, "product %d, isa %s, %d threads: other bits than one call",
						i, kc_isa_name((enum kc_isa)isa), th);
			for (int i = 0; i < P; i++)
				memcpy(y[i], y0[i], (size_t)prod[i].N * sizeof(float));
			CHECK_EQ(kb_matmul_multi(be, a, P), DS_OK);
			for (int i = 0; i < P; i++)
				CHECK(memcmp(y[i], ref[i], (size_t)prod[i].N * sizeof(float)) == 0);
		}
	}
	kc_isa_force(prev);
	/* 16 products of one x (a MoE layer's gates and ups): x is permuted
	 * once, so they fuse although 16 copies would not fit the stack */
	{
		enum { Q = 16, QN = 20, QK = 1100 };
		kb_matmul_args q[Q];
		float *xq = malloc(QK * sizeof(float)), *yq = malloc(Q * QN * sizeof(float));
		float *rq = malloc(Q * QN * sizeof(float));
		unsigned char *wq = malloc(Q * QN * QK), *wqa = malloc(Q * QN * QK);
		rand_finite_weights(KB_F8_E4M3, wq, wqa, Q * QN * QK);
		for (int64_t k = 0; k < QK; k++)
			xq[k] = ut_rand_float(-1, 1);
		for (int i = 0; i < Q; i++) {
			q[i] = a[0];
			q[i].x = xq;
			q[i].K = QK;
			q[i].x_stride = q[i].w_stride = QK;
			q[i].N = q[i].y_stride = QN;
			q[i].w = wq + (size_t)i * QN * QK;
			q[i].scale_stride = (QK + 127) / 128;
			q[i].y = rq + i * QN;
			CHECK_EQ(kc_matmul_isa(kc_isa_active(), &q[i]), DS_OK);
			q[i].y = yq + i * QN;
		}
		CHECK_EQ(kc_matmul_multi_isa(kc_isa_active(), q, Q), DS_OK);
		CHECK(memcmp(yq, rq, Q * QN * sizeof(float)) == 0);
		free(xq);
		free(yq);
		free(rq);
		free(wq);
		free(wqa);
	}
	/* a bad argument in the last product: refused, the first y untouched */
	for (int i = 0; i < P; i++)
		memcpy(y[i], y0[i], (size_t)prod[i].N * sizeof(float));
	a[P - 1].w_scale = NULL; /* FP8 without scales */
	CHECK_EQ(kb_matmul_multi(be, a, P), DS_EINVAL);
	CHECK(memcmp(y[0], y0[0], (size_t)prod[0].N * sizeof(float)) == 0);
	CHECK_EQ(kc_pool_set_threads(0), DS_OK);
	for (int i = 0; i < P; i++) {
		free(w[i]);
		free(wa[i]);
		free(sc[i]);
		free(y[i]);
		free(ref[i]);
		free(y0[i]);
	}
	for (int i = 0; i < 4; i++)
		free(x[i]);
}

TEST(matmul_k0_and_empty)
{
	float y[4] = {1, 2, 3, 4}, x[2] = {1, 1}, w[2] = {1, 1};
	kb_matmul_args a = {.y = y, .x = x, .w = w, .wtype = KB_F32, .M = 2, .N = 2, .x_stride = 1,
				.y_stride = 2, .w_stride = 1, .accumulate = 1};
	CHECK_EQ(kb_matmul(kb_backend_get("cpu", NULL), &a), DS_OK); /* accumulate: unchanged */
	CHECK(y[0] == 1 && y[3] == 4);
	a.accumulate = 0;
	CHECK_EQ(kb_matmul(kb_backend_get("cpu", NULL), &a), DS_OK); /* y = empty sum = 0 */
	CHECK(y[0] == 0 && y[1] == 0 && y[2] == 0 && y[3] == 0);
	a.M = 0;
	CHECK_EQ(kb_matmul(kb_backend_get("cpu", NULL), &a), DS_OK);
}

TEST(matmul_backend_rejects_bad_args)
{
	float y[4], x[4] = {1, 2, 3, 4}, sc[1] = {1};
	uint8_t w8[4] = {0x38, 0x38, 0x38, 0x38};
	const kb_backend *b = kb_backend_get("cpu", NULL);
	kb_matmul_args ok = {.y = y, .x = x, .w = w8, .w_scale = sc, .wtype = KB_F8_E4M3, .M = 2,
				.N = 2, .K = 2, .x_stride = 2, .y_stride = 2, .w_stride = 2,
				.scale_stride = 1, .block = 128};
	CHECK_EQ(kb_matmul(b, &ok), DS_OK);
	CHECK(y[0] == 3.0f && y[1] == 3.0f && y[2] == 7.0f); /* x . [1, 1] */
	kb_matmul_args a = ok;
	a.M = -1;
	CHECK_EQ(kb_matmul(b, &a), DS_EINVAL);
	a = ok;
	a.x_stride = 1;
	CHECK_EQ(kb_matmul(b, &a), DS_EINVAL);
	a = ok;
	a.y_stride = 1;
	CHECK_EQ(kb_matmul(b, &a), DS_EINVAL);
	a = ok;
	a.w_stride = 1;
	CHECK_EQ(kb_matmul(b, &a), DS_EINVAL);
	a = ok;
	a.w = NULL;
	CHECK_EQ(kb_matmul(b, &a), DS_EINVAL);
	a = ok;
	a.w_scale = NULL;
	CHECK_EQ(kb_matmul(b, &a), DS_EINVAL);
	a = ok;
	a.block = 0;
	CHECK_EQ(kb_matmul(b, &a), DS_EINVAL);
	a = ok;
	a.block = 1;
	a.scale_stride = 1; /* needs ceil(2 / 1) = 2 */
	CHECK_EQ(kb_matmul(b, &a), DS_EINVAL);
	a = ok;
	a.wtype = (enum kb_dtype)99;
	CHECK_EQ(kb_matmul(b, &a), DS_EINVAL);
	CHECK_EQ(kb_matmul(b, NULL), DS_EINVAL);
}

TEST(ops_backend_reject_bad_args)
{
	const kb_backend *b = kb_backend_get("cpu", NULL);
	float buf[16] = {0};
	int32_t ids[2] = {0, 1}, pos[2] = {0, 1};
	kb_embed_args e = {.out = buf, .table = buf, .type = KB_F32, .ids = ids, .n = 2, .dim = 4,
				.out_stride = 4, .table_stride = 4};
	CHECK_EQ(kb_embed(b, &e), DS_OK);
	e.type = KB_F8_E4M3;
	CHECK_EQ(kb_embed(b, &e), DS_EINVAL);
	e.type = KB_F32;
	e.table_stride = 3;
	CHECK_EQ(kb_embed(b, &e), DS_EINVAL);
	e.table_stride = 4;
	e.ids = NULL;
	CHECK_EQ(kb_embed(b, &e), DS_EINVAL);
	kb_rope_args r = {.x = buf, .n_tok = 2, .n_heads = 1, .tok_stride = 4, .head_stride = 4,
				.rot_dim = 4, .pos = pos, .inv_freq = buf, .amp = 1.0f,
				.interleaved = 1};
	CHECK_EQ(kb_rope(b, &r), DS_OK);
	r.rot_dim = 3;
	CHECK_EQ(kb_rope(b, &r), DS_EINVAL);
	r.rot_dim = 4;
	r.head_stride = 2;
	CHECK_EQ(kb_rope(b, &r), DS_EINVAL);
	kb_silu_mul_args s = {.out = buf, .gate = buf, .up = buf, .rows = 2, .dim = 4,
				.out_stride = 4, .gate_stride = 4, .up_stride = 4};
	CHECK_EQ(kb_silu_mul(b, &s), DS_OK);
	s.up = NULL;
	CHECK_EQ(kb_silu_mul(b, &s), DS_EINVAL);
	s.up = buf;
	s.rows = -2;
	CHECK_EQ(kb_silu_mul(b, &s), DS_EINVAL);
	kb_axpy_args x = {.y = buf, .x = buf, .n = -1, .alpha = 1.0f};
	CHECK_EQ(kb_axpy(b, &x), DS_EINVAL);
	kb_softmax_args sm = {.x = buf, .rows = 2, .n = 4, .stride = 3, .scale = 1.0f};
	CHECK_EQ(kb_softmax(b, &sm), DS_EINVAL);
	CHECK_EQ(kb_set_threads(b, -1), DS_EINVAL);
	CHECK_EQ(kb_set_threads(b, 0), DS_OK);
}

TEST(rope_hand_computed)
{
	/* theta = 1 * 1.0 = 1 rad for pair 0, 1 * 0.5 for pair 1; amp 2 */
	const double c1 = 0.54030230586813977, s1 = 0.84147098480789651;
	const double c5 = 0.87758256189037276, s5 = 0.47942553860420301;
	float inv[2] = {1.0f, 0.5f};
	int32_t pos[1] = {1};
	for (int inter = 0; inter < 2; inter++) {
		/* one token, two heads of 6 (rope on the first 4), 2 floats past them */
		float x[14] = {3, 4, 5, 6, 70, 80, -1, 2, 0.5f, 1, 90, 91, 99, 98};
		kb_rope_args a = {.x = x, .n_tok = 1, .n_heads = 2, .tok_stride = 14,
					.head_stride = 6, .rot_dim = 4, .pos = pos, .inv_freq = inv,
					.amp = 2.0f, .interleaved = inter};
		CHECK_EQ(kb_rope(kb_backend_get("cpu", NULL), &a), DS_OK);
		/* head 0 pairs: interleaved (3,4) (5,6); NeoX (3,5) (4,6) */
		double xa0 = 3, xb0 = inter ? 4 : 5, xa1 = inter ? 5 : 4, xb1 = 6;
		int ia0 = 0, ib0 = inter ? 1 : 2, ia1 = inter ? 2 : 1, ib1 = 3;
		CHECK_NEAR(x[ia0], 2 * (xa0 * c1 - xb0 * s1), 1e-5);
		CHECK_NEAR(x[ib0], 2 * (xa0 * s1 + xb0 * c1), 1e-5);
		CHECK_NEAR(x[ia1], 2 * (xa1 * c5 - xb1 * s5), 1e-5);
		CHECK_NEAR(x[ib1], 2 * (xa1 * s5 + xb1 * c5), 1e-5);
		if (inter) { /* head 1: (-1, 2) by 1 rad: [-1*c - 2*s, -1*s + 2*c] * 2 */
			CHECK_NEAR(x[6], 2 * (-c1 - 2 * s1), 1e-5);
			CHECK_NEAR(x[7], 2 * (-s1 + 2 * c1), 1e-5);
		}
		CHECK(x[4] == 70 && x[5] == 80 && x[10] == 90 && x[11] == 91 && x[12] == 99 && x[13] == 98);
	}
	/* pos 0: identity times amp */
	float y[2] = {1.5f, -2.5f};
	int32_t p0[1] = {0};
	kb_rope_args z = {.x = y, .n_tok = 1, .n_heads = 1, .tok_stride = 2, .head_stride = 2,
				.rot_dim = 2, .pos = p0, .inv_freq = inv, .amp = 1.0f,
				.interleaved = 1};
	CHECK_EQ(kc_rope_isa(KC_ISA_SCALAR, &z), DS_OK);
	CHECK(y[0] == 1.5f && y[1] == -2.5f);
}

TEST(eltwise_hand_computed)
{
	const kb_backend *b = kb_backend_get("cpu", NULL);
	float g[3] = {0.0f, 1.0f, -1.0f}, u[3] = {5.0f, 2.0f, 1.0f}, o[3];
	kb_silu_mul_args s = {.out = o, .gate = g, .up = u, .rows = 1, .dim = 3, .out_stride = 3,
				.gate_stride = 3, .up_stride = 3};
	CHECK_EQ(kb_silu_mul(b, &s), DS_OK);
	CHECK_NEAR(o[0], 0.0, 0);
	CHECK_NEAR(o[1], 1.4621171572600098, 1e-6);   /* 2 / (1 + e^-1) */
	CHECK_NEAR(o[2], -0.2689414213699951, 1e-7);  /* -1 / (1 + e) */
	float sm[4] = {0.0f, 1.0986122886681098f, 7.0f, 7.0f}; /* ln 3 */
	kb_softmax_args a = {.x = sm, .rows = 2, .n = 2, .stride = 2, .scale = 1.0f};
	CHECK_EQ(kb_softmax(b, &a), DS_OK);
	CHECK_NEAR(sm[0], 0.25, 1e-7);
	CHECK_NEAR(sm[1], 0.75, 1e-7);
	CHECK_NEAR(sm[2], 0.5, 1e-7);
	float yy[2] = {1, 2}, xx[2] = {3, 4};
	kb_axpy_args ax = {.y = yy, .x = xx, .n = 2, .alpha = 2.0f};
	CHECK_EQ(kb_axpy(b, &ax), DS_OK);
	CHECK(yy[0] == 7.0f && yy[1] == 10.0f);
	uint16_t tab[4] = {0x3C00, 0xC000, 0x0001, 0x7C00}; /* f16: 1, -2, 2^-24, inf */
	int32_t ids[2] = {1, 0};
	float out[4];
	kb_embed_args e = {.out = out, .table = tab, .type = KB_F16, .ids = ids, .n = 2, .dim = 2,
				.out_stride = 2, .table_stride = 2};
	CHECK_EQ(kb_embed(b, &e), DS_OK);
	CHECK(out[0] == 0x1p-24f && isinf(out[1]) && out[2] == 1.0f && out[3] == -2.0f);
}

TEST(membw_probe_contract)
{
	double bw = 0;
	CHECK_EQ(kc_measure_read_bandwidth(1000, 1, &bw), DS_EINVAL);
	CHECK_EQ(kc_measure_read_bandwidth((size_t)8 << 20, -1, &bw), DS_EINVAL);
	int before = kc_pool_threads();
	CHECK_EQ(kc_measure_read_bandwidth((size_t)8 << 20, 1, &bw), DS_OK);
	CHECK(bw > 1e8); /* any machine reads more than 100 MB/s */
	CHECK_EQ(kc_pool_threads(), before);
	/* STREAM Triad: the same rules; it checks its own output */
	bw = 0;
	CHECK_EQ(kc_measure_triad_bandwidth(1000, 1, &bw), DS_EINVAL);
	CHECK_EQ(kc_measure_triad_bandwidth((size_t)1 << 20, -1, &bw), DS_EINVAL);
	CHECK_EQ(kc_measure_triad_bandwidth((size_t)1 << 20, 1, &bw), DS_OK);
	CHECK(bw > 1e8);
	CHECK_EQ(kc_pool_threads(), before);
	/* the probe kept open: sizes below the minimums, then single passes
	 * that count what they move */
	kc_membw *p = NULL;
	CHECK_EQ(kc_membw_open(&p, 1000, 0), DS_EINVAL);
	CHECK_EQ(kc_membw_open(&p, 0, 1000), DS_EINVAL);
	CHECK(p == NULL);
	CHECK_EQ(kc_membw_open(&p, (size_t)4 << 20, 0), DS_OK);
	double bytes = 0;
	CHECK(kc_membw_read_pass(p, &bytes) > 0.0);
	CHECK(bytes == (double)((size_t)4 << 20));
	CHECK(kc_membw_triad_pass(p, &bytes) == 0.0); /* no Triad arrays in this one */
	kc_membw_close(p);
	CHECK_EQ(kc_membw_open(&p, (size_t)3 << 20, (size_t)1 << 17), DS_OK);
	CHECK(kc_membw_read_pass(p, &bytes) > 0.0 && bytes == (double)((size_t)3 << 20));
	CHECK(kc_membw_triad_pass(p, &bytes) > 0.0 && bytes == 24.0 * (double)((size_t)1 << 17));
	CHECK_EQ(kc_membw_triad_check(p), DS_OK);
	kc_membw_close(p);
	/* the hot-product probe: FP8 and BF16 only; a pass times HOTMM_CALLS
	 * products of a few hundred KiB per thread and computes the reference's
	 * product, and the check sees a y that is not */
	kc_hotmm *h = NULL;
	CHECK_EQ(kc_hotmm_open(&h, KB_F32), DS_EINVAL);
	CHECK(h == NULL);
	const enum kb_dtype dts[2] = {KB_F8_E4M3, KB_BF16};
	for (int i = 0; i < 2; i++) {
		CHECK_EQ(kc_hotmm_open(&h, dts[i]), DS_OK);
		bytes = 0;
		CHECK(kc_hotmm_pass(h, &bytes) > 0.0);
		const double per_call = bytes / HOTMM_CALLS;
		CHECK(per_call >= 0.5 * (double)HOTMM_BYTES_PER_THREAD * kc_pool_threads() &&
		      per_call <= (double)HOTMM_BYTES_PER_THREAD * kc_pool_threads());
		CHECK_EQ(kc_hotmm_check(h), DS_OK);
		int64_t n = 0;
		float *y = kc_hotmm_y(h, &n);
		CHECK(n >= 64);
		y[n / 2] += 1.0f;
		CHECK_EQ(kc_hotmm_check(h), DS_EINTERNAL);
		kc_hotmm_close(h);
		h = NULL;
	}
}

/* The row of a call named what, or NULL. */
static const kc_prof_row *prof_find(const kc_prof_row *rows, int n, const char *what)
{
	for (int i = 0; i < n; i++)
		if (strcmp(rows[i].call, what) == 0)
			return &rows[i];
	return NULL;
}

TEST(profile_times_each_kind_of_call_through_the_backend)
{
	enum { N = 64, K = 256, N2 = 32 };
	const kb_backend *b = kb_backend_get("cpu", NULL);
	uint8_t *w = malloc(N * K);
	float x[K], y[N], y0[N], y2[N2], sc[2] = {0.5f, 0.25f}, nw[K], nout[K];
	for (int i = 0; i < N * K; i++)
		w[i] = (uint8_t)(ut_rand_u64() % 0x7f); /* positive E4M3, no NaN pattern */
	for (int i = 0; i < K; i++) {
		x[i] = ut_rand_float(-1, 1);
		nw[i] = ut_rand_float(0.5f, 1.5f);
	}
	kb_matmul_args a = {.y = y, .x = x, .w = w, .w_scale = sc, .wtype = KB_F8_E4M3, .M = 1, .N = N,
				.K = K, .x_stride = K, .y_stride = N, .w_stride = K, .scale_stride = 2,
				.block = 128};
	kb_matmul_args a0 = a;
	a0.y = y0;
	CHECK_EQ(kb_matmul(b, &a0), DS_OK); /* before the profile: not counted */
	kc_profile_start();
	CHECK_EQ(kb_matmul(b, &a), DS_OK);
	CHECK(memcmp(y, y0, sizeof y) == 0); /* timing changes nothing */
	CHECK_EQ(kb_matmul(b, &a), DS_OK);
	kb_matmul_args m[2] = {a, a};
	m[1].y = y2;
	m[1].N = N2;
	m[1].y_stride = N2;
	CHECK_EQ(kb_matmul_multi(b, m, 2), DS_OK);
	kb_rmsnorm_args r = {.out = nout, .x = x, .w = nw, .rows = 1, .dim = K, .x_stride = K,
				 .out_stride = K, .eps = 1e-6f};
	CHECK_EQ(kb_rmsnorm(b, &r), DS_OK);
	kc_profile_stop();
	CHECK_EQ(kb_matmul(b, &a), DS_OK); /* after: not counted */
	kc_prof_row rows[KC_PROF_MAX_ROWS];
	int n = kc_profile_rows(rows, KC_PROF_MAX_ROWS);
	CHECK_EQ(n, 3);
	const kc_prof_row *mm = prof_find(rows, n, "matmul f8_e4m3 64x256");
	const kc_prof_row *mu = prof_find(rows, n, "matmul_multi of 2, first f8_e4m3 64x256");
	const kc_prof_row *rn = prof_find(rows, n, "rmsnorm");
	CHECK(mm && mu && rn);
	if (!mm || !mu || !rn)
		return;
	CHECK_EQ(mm->calls, 2);
	CHECK_EQ(mu->calls, 1);
	CHECK_EQ(rn->calls, 1);
	/* W bytes and the FP8 block scales (1 x 2 blocks of 128) */
	CHECK(mm->weight_bytes == 2.0 * (N * K + 4 * 2));
	CHECK(mu->weight_bytes == (double)(N * K + 4 * 2) + (double)(N2 * K + 4 * 2));
	CHECK(rn->weight_bytes == 0.0);
	CHECK(mm->seconds > 0 && mu->seconds > 0 && rn->seconds > 0);
	for (int i = 1; i < n; i++) /* largest first */
		CHECK(rows[i - 1].seconds >= rows[i].seconds);
	/* a start clears; kinds past the table's size are counted, not kept */
	kc_profile_start();
	float xs[8] = {1, 2, 3, 4, 5, 6, 7, 8}, ws[8 * (KC_PROF_MAX_ROWS + 2)], ys[KC_PROF_MAX_ROWS + 2];
	for (int i = 0; i < 8 * (KC_PROF_MAX_ROWS + 2); i++)
		ws[i] = 1.0f;
	for (int nn = 1; nn <= KC_PROF_MAX_ROWS + 2; nn++) {
		kb_matmul_args f = {.y = ys, .x = xs, .w = ws, .wtype = KB_F32, .M = 1, .N = nn, .K = 8,
				    .x_stride = 8, .y_stride = nn, .w_stride = 8};
		CHECK_EQ(kb_matmul(b, &f), DS_OK);
		CHECK(ys[nn - 1] == 36.0f);
	}
	kc_profile_stop();
	CHECK_EQ(kc_profile_rows(rows, KC_PROF_MAX_ROWS), KC_PROF_MAX_ROWS);
	CHECK_EQ(kc_profile_dropped(), 2);
	CHECK(prof_find(rows, KC_PROF_MAX_ROWS, "matmul f32 1x8") != NULL);
	CHECK(prof_find(rows, KC_PROF_MAX_ROWS, "rmsnorm") == NULL);
	CHECK_EQ(kc_profile_rows(rows, 5), 5);
	free(w);
}

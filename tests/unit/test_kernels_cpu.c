/*
 * test_kernels_cpu.c - unit tests of kernels/cpu that the conformance program
 * does not cover: the reference itself against hand-computed values, ISA
 * naming and forcing, the backend's argument checks, and backend instances
 * (open/close, the default instance, supports_op against the ops table).
 */
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"
#ifdef DS_HAVE_CUDA
#include "kernels/cuda/backend_cuda.h"
#endif
#include "tests/unit/unit.h"

#include <pthread.h>
#include <string.h>

TEST(rmsnorm_ref_matches_hand_computed)
{
	/* x = [3, 4]: mean square = 12.5, eps 0.5 -> 1/sqrt(13) */
	float x[2] = {3.0f, 4.0f}, w[2] = {1.0f, 2.0f}, y[2];
	kb_rmsnorm_args a = {.out = y, .x = x, .w = w, .rows = 1, .dim = 2, .x_stride = 2,
				.out_stride = 2, .eps = 0.5f};
	kc_rmsnorm_ref(&a);
	CHECK_NEAR(y[0], 3.0 / sqrt(13.0), 1e-7);
	CHECK_NEAR(y[1], 8.0 / sqrt(13.0), 1e-7);
}

TEST(rmsnorm_in_place_with_strides)
{
	float buf[2][8];
	float w[5] = {1, 1, 1, 1, 1};
	for (int r = 0; r < 2; r++)
		for (int i = 0; i < 8; i++)
			buf[r][i] = (float)(r + 1);
	kb_rmsnorm_args a = {.out = &buf[0][0], .x = &buf[0][0], .w = w, .rows = 2, .dim = 5,
				.x_stride = 8, .out_stride = 8, .eps = 0.0f};
	CHECK_EQ(kb_rmsnorm(kb_backend_get("cpu", NULL), &a), DS_OK);
	for (int r = 0; r < 2; r++) {
		for (int i = 0; i < 5; i++)
			CHECK_NEAR(buf[r][i], 1.0, 1e-6); /* constant rows normalise to 1 */
		for (int i = 5; i < 8; i++)
			CHECK_NEAR(buf[r][i], (double)(r + 1), 0); /* past dim: untouched */
	}
}

TEST(cpu_isa_names_and_force)
{
	enum kc_isa isa;
	CHECK_EQ(kc_isa_parse("avx2", &isa), DS_OK);
	CHECK_EQ(isa, KC_ISA_AVX2);
	CHECK_EQ(kc_isa_parse("sse9", &isa), DS_EINVAL);
	CHECK_STR(kc_isa_name(KC_ISA_AVX512BF16), "avx512bf16");
	enum kc_isa prev = kc_isa_force(KC_ISA_SCALAR);
	CHECK_EQ(kc_isa_active(), KC_ISA_SCALAR);
	kc_isa_force(prev);
	CHECK(kc_isa_active() <= kc_isa_detect());
}

TEST(cpu_backend_rejects_bad_shapes)
{
	float x[1] = {1}, w[1] = {1}, y[1];
	kb_rmsnorm_args a = {.out = y, .x = x, .w = w, .rows = 1, .x_stride = 1, .out_stride = 1,
				.eps = 1e-6f};
	CHECK_EQ(kb_rmsnorm(kb_backend_get("cpu", NULL), &a), DS_EINVAL);
	a.dim = 1;
	a.rows = -1;
	CHECK_EQ(kb_rmsnorm(kb_backend_get("cpu", NULL), &a), DS_EINVAL);
	ds_err e = {0};
	CHECK(kb_backend_get("tpu", &e) == NULL);
	CHECK_EQ(e.code, DS_ENOTFOUND);
	CHECK(kb_backend_get("cpu", &e) == kb_backend_get("cpu", NULL));
}

TEST(backend_cpu_instances_open_and_close)
{
	ds_err e = {0};
	kb_backend_close(NULL); /* a no-op */
	static const int threads[2] = {3, 1};
	for (int i = 0; i < 2; i++) {
		kb_backend_params p = kb_backend_default_params();
		p.threads = threads[i];
		kb_backend *be = kb_backend_open("cpu", &p, &e);
		CHECK(be != NULL);
		if (!be)
			return;
		CHECK_STR(be->name, "cpu");
		CHECK_EQ(be->params.threads, threads[i]);
		CHECK_EQ(kc_pool_threads(), threads[i]); /* the shared pool, resized */
		CHECK(be != kb_backend_get("cpu", NULL));
		CHECK(strlen(kb_describe(be)) > 0);
		/* memory and one op through the instance */
		float h[4] = {3, 4, 3, 4}, w[2] = {1, 1}, back[4] = {0};
		float *d = kb_alloc(be, sizeof h);
		CHECK(d != NULL);
		CHECK_EQ(kb_upload(be, d, h, sizeof h), DS_OK);
		kb_rmsnorm_args a = {.out = d, .x = d, .w = w, .rows = 2, .dim = 2, .x_stride = 2,
					.out_stride = 2, .eps = 0.0f};
		CHECK_EQ(kb_rmsnorm(be, &a), DS_OK);
		CHECK_EQ(kb_sync(be), DS_OK);
		CHECK_EQ(kb_download(be, back, d, sizeof back), DS_OK);
		CHECK_NEAR(back[3], 4.0 / sqrt(12.5), 1e-6);
		CHECK_EQ(kb_set_threads(be, 2), DS_OK);
		CHECK_EQ(kc_pool_threads(), 2);
		kb_release(be, d);
		kb_backend_close(be);
	}
	/* threads 0 leaves the pool as it is */
	kb_backend *be = kb_backend_open("cpu", NULL, &e);
	CHECK(be != NULL);
	CHECK_EQ(kc_pool_threads(), 2);
	kb_backend_close(be);
	CHECK_EQ(kc_pool_set_threads(0), DS_OK); /* back to one per core */
	/* the default instance is borrowed: close leaves it usable */
	const kb_backend *def = kb_backend_get("cpu", &e);
	kb_backend_close((kb_backend *)def);
	CHECK(kb_backend_get("cpu", NULL) == def);
	CHECK_STR(def->name, "cpu");
}

TEST(backend_open_rejects_bad_params)
{
	ds_err e = {0};
	kb_backend_params p = kb_backend_default_params();
	p.threads = -1;
	CHECK(kb_backend_open("cpu", &p, &e) == NULL);
	CHECK_EQ(e.code, DS_EINVAL);
	p.threads = KC_POOL_MAX_THREADS + 1;
	CHECK(kb_backend_open("cpu", &p, &e) == NULL);
	CHECK_EQ(e.code, DS_EINVAL);
	CHECK(strstr(e.msg, "at most") != NULL);
	p = kb_backend_default_params();
	p.device = -2;
	CHECK(kb_backend_open("cpu", &p, &e) == NULL);
	CHECK_EQ(e.code, DS_EINVAL);
}

TEST(backend_unknown_and_absent)
{
	ds_err e = {0};
	CHECK(kb_backend_open("tpu", NULL, &e) == NULL);
	CHECK_EQ(e.code, DS_ENOTFOUND);
	CHECK(strstr(e.msg, "tpu") != NULL);
	CHECK(strstr(e.msg, "cpu") != NULL && strstr(e.msg, "cuda") != NULL);
	/* cuda: not compiled in, or compiled in on a machine without a device
	 * (DS_ENODEV either way, with the reason), or a real device */
	memset(&e, 0, sizeof e);
	kb_backend *cu = kb_backend_open("cuda", NULL, &e);
	if (cu) {
		CHECK_STR(cu->name, "cuda");
		CHECK(strlen(kb_describe(cu)) > 0);
		kb_backend_close(cu);
		return;
	}
	CHECK_EQ(e.code, DS_ENODEV);
	CHECK(strlen(e.msg) > 0);
#ifdef DS_HAVE_CUDA
	CHECK(strstr(e.msg, "not compiled in") == NULL);
	CHECK(kb_backend_get("cuda", &e) == NULL); /* the default: same answer */
	CHECK_EQ(e.code, DS_ENODEV);
#else
	CHECK(strstr(e.msg, "not compiled in") != NULL);
#endif
}

/* Every op against every dtype: supports_op matches the ops table (a
 * supported op has a function) and, for the CPU, the documented table. */
static void check_table(const kb_backend *be, int is_cpu)
{
	for (int op = 0; op < KB_OP_COUNT; op++) {
		int any = 0;
		for (int t = 0; t < KB_DTYPE_COUNT; t++) {
			int yes = kb_supports_op(be, (enum kb_op)op, (enum kb_dtype)t);
			CHECK_EQ(yes, kb_backend_supports(be->name, (enum kb_op)op, (enum kb_dtype)t));
			if (is_cpu)
				CHECK_EQ(yes, !(op == KB_OP_EMBED && t == KB_F8_E4M3));
			any |= yes;
		}
		if (any && !kb_backend_has_op(be, (enum kb_op)op))
			ut_fail(__FILE__, __LINE__, "%s backend: %s supported but NULL", be->name,
				kb_op_name((enum kb_op)op));
	}
	CHECK_EQ(kb_supports_op(be, KB_OP_COUNT, KB_F32), 0);
	CHECK_EQ(kb_supports_op(be, KB_OP_MATMUL, KB_DTYPE_COUNT), 0);
}

TEST(backend_supports_op_matches_table)
{
	check_table(kb_backend_get("cpu", NULL), 1);
	CHECK_EQ(kb_backend_supports("tpu", KB_OP_RMSNORM, KB_F32), 0);
#ifdef DS_HAVE_CUDA
	/* the cuda table, without a device: an instance that is never opened */
	const kb_backend_ops *o = kcu_backend_ops();
	kb_backend cu = {.name = o->name, .supports_op = o->supports_op, .ops = o, .borrowed = 1};
	check_table(&cu, 0);
	CHECK_EQ(kb_backend_supports("cuda", KB_OP_RMSNORM, KB_F32), 1);
	CHECK_EQ(kb_backend_supports("cuda", KB_OP_MATMUL, KB_BF16), 0);
#else
	CHECK_EQ(kb_backend_supports("cuda", KB_OP_RMSNORM, KB_F32), 0);
#endif
}

/* The recipe for a test's fake backend: copy the default cpu instance and
 * replace supports_op; the ops still run, the checks see the fake table. */
static int no_q4_k(enum kb_op op, enum kb_dtype dtype)
{
	return dtype != KB_Q4_K && !(op == KB_OP_EMBED && dtype == KB_F8_E4M3);
}

TEST(backend_fake_copy_answers_its_own_table)
{
	kb_backend fake = *kb_backend_get("cpu", NULL);
	fake.supports_op = no_q4_k;
	const kb_op_need needs[] = {
		{.op = KB_OP_RMSNORM, .dtype = KB_F32},
		{.op = KB_OP_MATMUL, .dtype = KB_Q4_K},
	};
	ds_err e = {0};
	CHECK_EQ(kb_check(kb_backend_get("cpu", NULL), needs, 2, &e), DS_OK);
	CHECK_EQ(kb_check(&fake, needs, 2, &e), DS_EUNSUPPORTED);
	CHECK_STR(e.msg, "the cpu backend has no matmul for q4_k weights");
	CHECK_EQ(kb_backend_check("cpu", needs, 2, &e), DS_OK); /* by name: the real table */
	float x[2] = {3, 4}, w[2] = {1, 1}, y[2];
	kb_rmsnorm_args a = {.out = y, .x = x, .w = w, .rows = 1, .dim = 2, .x_stride = 2,
				.out_stride = 2, .eps = 0.0f};
	CHECK_EQ(kb_rmsnorm(&fake, &a), DS_OK);
	kb_backend_close(&fake); /* a copy of the borrowed instance: ignored */
}

static void *get_cpu(void *arg)
{
	*(const kb_backend **)arg = kb_backend_get("cpu", NULL);
	return NULL;
}

TEST(backend_get_is_one_instance_across_threads)
{
	pthread_t t[4];
	const kb_backend *got[4] = {0};
	for (int i = 0; i < 4; i++)
		CHECK_EQ(pthread_create(&t[i], NULL, get_cpu, &got[i]), 0);
	for (int i = 0; i < 4; i++)
		pthread_join(t[i], NULL);
	for (int i = 0; i < 4; i++)
		CHECK(got[i] != NULL && got[i] == kb_backend_get("cpu", NULL));
}

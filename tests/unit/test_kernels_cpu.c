/*
 * test_kernels_cpu.c - unit tests of kernels/cpu that the conformance program
 * does not cover: the reference itself against hand-computed values, ISA
 * naming and forcing, and the backend's argument checks.
 */
#include "kernels/cpu/cpu.h"
#include "tests/unit/unit.h"

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
	CHECK_EQ(kc_backend()->rmsnorm(&a), DS_OK);
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
	CHECK_EQ(kc_backend()->rmsnorm(&a), DS_EINVAL);
	a.dim = 1;
	a.rows = -1;
	CHECK_EQ(kc_backend()->rmsnorm(&a), DS_EINVAL);
	ds_err e = {0};
	CHECK(kb_backend_get("tpu", &e) == NULL);
	CHECK_EQ(e.code, DS_ENOTFOUND);
	CHECK(kb_backend_get("cpu", &e) == kc_backend());
}

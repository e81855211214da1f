/*
 * test_plan_layout.c - the plan arithmetic of engine/model.c (stage layer
 * ranges, splits, rank coordinates, the base's plan check) and the owned
 * weight windows a rank copies out of a file mapping (model_weight_window),
 * checked value by value against the full weight read independently.
 */
#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"
#include "engine/model_impl.h"
#include "tests/unit/unit.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

TEST(plan_stage_layers_cover_every_layer_once)
{
	/* vLLM's rule: 61 over 2 = 31 + 30; 5 over 3 = 2 + 2 + 1 */
	int f, e;
	model_stage_layers(61, 2, 0, &f, &e);
	CHECK(f == 0 && e == 31);
	model_stage_layers(61, 2, 1, &f, &e);
	CHECK(f == 31 && e == 61);
	int want5[3][2] = {{0, 2}, {2, 4}, {4, 5}};
	for (int s = 0; s < 3; s++) {
		model_stage_layers(5, 3, s, &f, &e);
		CHECK(f == want5[s][0] && e == want5[s][1]);
	}
	for (int n = 1; n <= 40; n++)
		for (int pp = 1; pp <= n && pp <= 9; pp++) {
			int next = 0;
			for (int s = 0; s < pp; s++) {
				model_stage_layers(n, pp, s, &f, &e);
				CHECK(f == next && e > f);
				next = e;
			}
			CHECK(next == n);
		}
}

TEST(plan_split_range_and_coords)
{
	for (int64_t n = 0; n <= 50; n++)
		for (int parts = 1; parts <= 9; parts++) {
			int64_t next = 0, lo = n, hi = 0;
			for (int i = 0; i < parts; i++) {
				int64_t first, count;
				model_split_range(n, parts, i, &first, &count);
				CHECK(first == next);
				next = first + count;
				lo = count < lo ? count : lo;
				hi = count > hi ? count : hi;
			}
			CHECK(next == n);
			CHECK(hi - lo <= 1);
		}
	model_plan p = {.tp = 2, .pp = 3, .ep = 2};
	CHECK(model_plan_world(&p) == 12);
	int seen[3][2][2] = {{{0}}};
	for (int r = 0; r < 12; r++) {
		int s, t, e;
		model_rank_coords(&p, r, &s, &t, &e);
		CHECK(s >= 0 && s < 3 && t >= 0 && t < 2 && e >= 0 && e < 2);
		CHECK(r == s * 4 + e * 2 + t);
		seen[s][t][e]++;
	}
	for (int s = 0; s < 3; s++)
		for (int t = 0; t < 2; t++)
			for (int e = 0; e < 2; e++)
				CHECK(seen[s][t][e] == 1);
	ds_err err = {0};
	model_plan bad = {.tp = 0, .pp = 1, .ep = 1};
	CHECK(model_plan_check(&bad, &err) == DS_EINVAL);
	CHECK(strstr(err.msg, "tp=0") != NULL);
}

TEST(plan_base_refuses_a_rank_that_disagrees)
{
	struct model m = {0};
	model_params p = model_default_params();
	ds_err err = {0};
	CHECK(model_base_plan(&m, &p, 7, 32, &err) == DS_OK);
	CHECK(m.first_layer == 0 && m.end_layer == 7 && m.rank.plan.tp == 1);
	model_rank r = {.plan = {.tp = 1, .pp = 1, .ep = 1}, .rank = 0};
	p.rank = &r;
	CHECK(model_base_plan(&m, &p, 7, 32, &err) == DS_OK);
	CHECK(m.first_layer == 0 && m.end_layer == 7);
	r = (model_rank){.plan = {.tp = 1, .pp = 2, .ep = 1}, .rank = 1, .stage = 1};
	/* two ranks need a world group of two */
	CHECK(model_base_plan(&m, &p, 7, 32, &err) == DS_EINVAL);
	CHECK(strstr(err.msg, "world group has 1 ranks") != NULL);
	r.stage = 0; /* does not match rank 1 of pp = 2 */
	CHECK(model_base_plan(&m, &p, 7, 32, &err) == DS_EINVAL);
	r = (model_rank){.plan = {.tp = 1, .pp = 8, .ep = 1}, .rank = 0};
	CHECK(model_base_plan(&m, &p, 7, 32, &err) == DS_EINVAL);
	CHECK(strstr(err.msg, "8 pipeline stages for 7 layers") != NULL);
}

/* bytes written to a file of dir and mapped read-only (a checkpoint's
 * mapping: the windows drop their pages from it) */
static void *map_bytes(const char *dir, const void *data, size_t n, size_t *len)
{
	char path[512];
	snprintf(path, sizeof path, "%s/w.bin", dir);
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(data, 1, n, f) != n || fclose(f) != 0)
		return NULL;
	int fd = open(path, O_RDONLY);
	if (fd < 0)
		return NULL;
	void *p = mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
	close(fd);
	*len = n;
	return p == MAP_FAILED ? NULL : p;
}

/* W[r][c] of an FP8 block-scaled weight, read from the definition */
static float fp8_at(const uint8_t *codes, const float *scale, int64_t k, int64_t ss, int64_t B,
		    int64_t r, int64_t c)
{
	return kc_fp8_e4m3_to_f32(codes[r * k + c]) * scale[(r / B) * ss + c / B];
}

TEST(plan_fp8_window_keeps_every_value)
{
	const int64_t n = 300, k = 330, B = 128, sr = (n + B - 1) / B, sc = (k + B - 1) / B;
	const size_t code_bytes = (size_t)(n * k), scale_bytes = (size_t)(sr * sc) * sizeof(float);
	uint8_t *raw = malloc(code_bytes + scale_bytes);
	CHECK(raw != NULL);
	if (!raw)
		return;
	for (size_t i = 0; i < code_bytes; i++) {
		uint8_t c = (uint8_t)ut_rand_u64();
		raw[i] = (c & 0x7f) == 0x7f ? 0x3c : c; /* no NaN codes */
	}
	float *s = (float *)(raw + code_bytes);
	for (int64_t i = 0; i < sr * sc; i++)
		s[i] = ut_rand_float(0.001f, 0.1f);
	char *dir = ut_tmpdir_new("window");
	size_t len = 0;
	uint8_t *map = dir ? map_bytes(dir, raw, code_bytes + scale_bytes, &len) : NULL;
	CHECK(map != NULL);
	const kb_backend *be = kb_backend_get("cpu", NULL);
	/* windows on the block (scale grid copied), on a 64/32 boundary (finer
	 * grid) and on 3 (dequantized to f32) */
	const int64_t wins[][4] = {{128, 172, 0, 330}, {64, 100, 192, 138}, {32, 200, 96, 64},
				   {3, 150, 6, 200}, {0, 300, 0, 330}};
	for (size_t wi = 0; map && be && wi < sizeof wins / sizeof wins[0]; wi++) {
		model_weight w = {.w = map, .scale = (const float *)(map + code_bytes),
				  .type = KB_F8_E4M3, .n = n, .k = k, .scale_stride = sc, .block = B};
		model_weight out;
		void *owned = NULL;
		size_t counter = 0;
		ds_err err = {0};
		const int64_t r0 = wins[wi][0], rows = wins[wi][1], c0 = wins[wi][2], cols = wins[wi][3];
		CHECK(model_weight_window(be, &w, r0, rows, c0, cols, &out, &owned, &counter, &err) == DS_OK);
		CHECK(out.n == rows && out.k == cols && counter > 0);
		float *got = malloc((size_t)(rows * cols) * sizeof(float));
		kb_dequant_args a = {.out = got, .w = out.w, .w_scale = out.scale, .wtype = out.type,
					.rows = rows, .cols = cols, .out_stride = cols, .w_stride = cols,
					.scale_stride = out.scale_stride, .block = out.type == KB_F32 ? 1 : out.block};
		CHECK(kb_dequant(be, &a) == DS_OK);
		int64_t bad = 0;
		for (int64_t r = 0; r < rows; r++)
			for (int64_t c = 0; c < cols; c++)
				bad += got[r * cols + c] != fp8_at(raw, s, k, sc, B, r0 + r, c0 + c);
		CHECK_EQ(bad, 0);
		if (wi == 3)
			CHECK(out.type == KB_F32);
		else
			CHECK(out.type == KB_F8_E4M3);
		free(got);
		free(owned);
	}
	/* a block type splits only on its blocks, with a message saying so */
	model_weight q = {.w = map, .type = KB_Q8_0, .n = 4, .k = 64};
	model_weight out;
	void *owned = NULL;
	size_t counter = 0;
	ds_err err = {0};
	CHECK(model_weight_window(be, &q, 0, 4, 16, 32, &out, &owned, &counter, &err) == DS_EINVAL);
	CHECK(strstr(err.msg, "blocks") != NULL);
	CHECK(model_weight_window(be, &q, 1, 4, 0, 64, &out, &owned, &counter, &err) == DS_EINVAL);
	if (map)
		munmap(map, len);
	ut_tmpdir_free(dir);
	free(raw);
}

TEST(plan_bf16_window_is_the_rows_and_columns)
{
	const int64_t n = 37, k = 53;
	uint16_t *raw = malloc((size_t)(n * k) * 2);
	CHECK(raw != NULL);
	if (!raw)
		return;
	for (int64_t i = 0; i < n * k; i++)
		raw[i] = (uint16_t)ut_rand_u64();
	char *dir = ut_tmpdir_new("window16");
	size_t len = 0;
	uint16_t *map = dir ? map_bytes(dir, raw, (size_t)(n * k) * 2, &len) : NULL;
	CHECK(map != NULL);
	if (map) {
		model_weight w = {.w = map, .type = KB_BF16, .n = n, .k = k}, out;
		void *owned = NULL;
		size_t counter = 0;
		ds_err err = {0};
		CHECK(model_weight_window(kb_backend_get("cpu", NULL), &w, 5, 20, 11, 30, &out, &owned, &counter,
					  &err) == DS_OK);
		CHECK_EQ(counter, (size_t)(20 * 30 * 2));
		int64_t bad = 0;
		for (int64_t r = 0; r < 20; r++)
			for (int64_t c = 0; c < 30; c++)
				bad += ((const uint16_t *)out.w)[r * 30 + c] != raw[(5 + r) * k + 11 + c];
		CHECK_EQ(bad, 0);
		free(owned);
		munmap(map, len);
	}
	ut_tmpdir_free(dir);
	free(raw);
}

/*
 * test_engine_kv_sampler.c - unit tests of engine/kv (page allocation,
 * sharing, exhaustion) and engine/sampler (greedy, temperature, top-k/p,
 * min-p, seeds, penalties) against independent expectations.
 */
#include "engine/kv.h"
#include "engine/sampler.h"
#include "tests/unit/unit.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

TEST(kv_pages_reserve_share_free)
{
	kv_params p = {.n_layers = 2, .row_elems = 8, .page_size = 4, .n_pages = 5};
	ds_err e = {0};
	kv_cache *kv = kv_cache_new(&p, &e);
	CHECK(kv != NULL);
	CHECK_EQ(kv_cache_pages_free(kv), 5);
	kv_seq a = {0}, b = {0}, c = {0};
	CHECK_EQ(kv_seq_reserve(kv, &a, 9, &e), DS_OK); /* 9 positions -> 3 pages */
	CHECK_EQ(a.n_blocks, 3);
	CHECK_EQ(kv_cache_pages_free(kv), 2);
	CHECK_EQ(kv_seq_reserve(kv, &a, 12, &e), DS_OK); /* still 3 pages */
	CHECK_EQ(a.n_blocks, 3);
	CHECK(a.blocks[0] != a.blocks[1] && a.blocks[1] != a.blocks[2]);
	CHECK_EQ(kv_seq_share(kv, &b, &a, &e), DS_OK); /* b shares a's 3 pages */
	CHECK_EQ(kv_cache_pages_free(kv), 2);
	CHECK_EQ(kv_seq_reserve(kv, &c, 13, &e), DS_EBUSY); /* needs 4, 2 free */
	CHECK(strstr(e.msg, "4 more pages") != NULL);
	CHECK_EQ(c.n_blocks, 0);
	CHECK_EQ(kv_seq_reserve(kv, &c, 100, &e), DS_ERANGE); /* more than the cache */
	kv_seq_free(kv, &a);
	CHECK_EQ(kv_cache_pages_free(kv), 2); /* still referenced by b */
	kv_seq_truncate(kv, &b, 5);           /* keep 2 pages */
	CHECK_EQ(kv_cache_pages_free(kv), 3);
	kv_seq_free(kv, &b);
	CHECK_EQ(kv_cache_pages_free(kv), 5);
	/* rows of different layers and pages do not overlap */
	float *l0 = kv_cache_layer(kv, 0), *l1 = kv_cache_layer(kv, 1);
	l0[4 * 4 * 8 + 3] = 1.5f; /* page 4, slot 0, float 3 */
	CHECK_NEAR(l1[4 * 4 * 8 + 3], 0.0, 0);
	CHECK_EQ(kv_cache_bytes(kv), 2 * 5 * 4 * 8 * 4);
	kv_seq_free(kv, &c);
	kv_cache_free(kv);
	kv_cache_free(NULL);
}

static float bits_f32(uint32_t u)
{
	float f;
	memcpy(&f, &u, sizeof f);
	return f;
}

TEST(kv_f32_to_f16_hand_values)
{
	static const struct {
		float f;
		uint16_t h;
	} v[] = {
		{0.0f, 0x0000}, {-0.0f, 0x8000}, {1.0f, 0x3c00}, {-2.0f, 0xc000}, {65504.0f, 0x7bff},
		{65519.0f, 0x7bff}, {65520.0f, 0x7c00} /* the tie above the largest half: even is inf */,
		{1e10f, 0x7c00}, {-INFINITY, 0xfc00}, {0x1p-24f, 0x0001}, {0x1p-25f, 0x0000} /* tie: even 0 */,
		{0x1.8p-25f, 0x0001}, {0x3p-25f, 0x0002} /* 1.5 units: even 2 */, {0x1p-14f, 0x0400},
		{0x1p-14f - 0x1p-25f, 0x0400} /* tie 0x3ff / 0x400: even */, {1.0f + 0x1p-11f, 0x3c00},
		{1.0f + 0x3p-11f, 0x3c02}, {1.0f + 0x1p-10f, 0x3c01}, {0.1f, 0x2e66}, {-3.14159265f, 0xc248},
	};
	for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
		if (kv_f32_to_f16(v[i].f) != v[i].h)
			ut_fail(__FILE__, __LINE__, "%a -> 0x%04x, want 0x%04x", (double)v[i].f, kv_f32_to_f16(v[i].f),
				v[i].h);
	const uint16_t n = kv_f32_to_f16(NAN);
	CHECK((n & 0x7c00) == 0x7c00 && (n & 0x3ff) != 0);
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) static uint16_t f16c_convert(float f)
{
	return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

/* Against the CPU's own IEEE conversion (F16C vcvtps2ph, round to nearest
 * even), an independent implementation: every float whose 13 dropped bits
 * are at or next to the rounding boundary, over every exponent, and random
 * bit patterns; NaNs only need to stay NaNs. */
TEST(kv_f32_to_f16_matches_the_cpu_conversion)
{
	if (!__builtin_cpu_supports("f16c")) {
		ut_skip("no F16C on this CPU");
		return;
	}
	static const uint32_t low[] = {0, 1, 0xfff, 0x1000, 0x1001, 0x1fff};
	int bad = 0;
	for (uint32_t e = 0; e < 256; e++)
		for (uint32_t m = 0; m < 1024; m++)
			for (size_t i = 0; i < sizeof low / sizeof low[0]; i++)
				for (uint32_t sgn = 0; sgn < 2; sgn++) {
					const uint32_t u = sgn << 31 | e << 23 | m << 13 | low[i];
					const float f = bits_f32(u);
					const uint16_t got = kv_f32_to_f16(f), want = f16c_convert(f);
					if (isnan(f) ? (got & 0x7c00) != 0x7c00 || !(got & 0x3ff) : got != want)
						if (bad++ < 5)
							ut_fail(__FILE__, __LINE__, "bits 0x%08x: 0x%04x, the CPU 0x%04x", u, got,
								want);
				}
	for (int i = 0; i < 1000000; i++) {
		const uint32_t u = (uint32_t)ut_rand_u64();
		const float f = bits_f32(u);
		if (!isnan(f) && kv_f32_to_f16(f) != f16c_convert(f) && bad++ < 5)
			ut_fail(__FILE__, __LINE__, "bits 0x%08x: 0x%04x, the CPU 0x%04x", u, kv_f32_to_f16(f),
				f16c_convert(f));
	}
	CHECK_EQ(bad, 0);
}
#endif

TEST(kv_cache_in_halves_writes_rounded_rows)
{
	kv_params p = {.n_layers = 2, .row_elems = 6, .elem_bytes = 2, .page_size = 4, .n_pages = 3};
	ds_err e = {0};
	kv_cache *kv = kv_cache_new(&p, &e);
	CHECK(kv != NULL);
	CHECK_EQ(kv_cache_bytes(kv), 2 * 3 * 4 * 6 * 2); /* half the f32 cache's */
	const float row[6] = {1.0f, -0.1f, 65504.0f, 1e6f, 0x1p-24f, 1.0f + 0x3p-11f};
	kv_cache_write_row(kv, 1, 9, row); /* page 2, slot 1 of layer 1 */
	const uint16_t *l1 = kv_cache_layer(kv, 1), *l0 = kv_cache_layer(kv, 0);
	static const uint16_t want[6] = {0x3c00, 0xae66, 0x7bff, 0x7c00, 0x0001, 0x3c02};
	for (int i = 0; i < 6; i++) {
		CHECK_EQ(l1[9 * 6 + i], want[i]);
		CHECK_EQ(l0[9 * 6 + i], 0); /* the other layer untouched */
	}
	kv_cache_free(kv);
	/* f32 rows are copied as they are */
	p.elem_bytes = 4;
	kv = kv_cache_new(&p, &e);
	CHECK(kv != NULL);
	kv_cache_write_row(kv, 0, 2, row);
	CHECK(memcmp((const float *)kv_cache_layer(kv, 0) + 2 * 6, row, sizeof row) == 0);
	kv_cache_free(kv);
	p.elem_bytes = 3;
	CHECK(kv_cache_new(&p, &e) == NULL);
	CHECK_EQ(e.code, DS_EINVAL);
	CHECK(strstr(e.msg, "3 bytes") != NULL);
}

static void fill_logits(float *l, int n)
{
	for (int i = 0; i < n; i++)
		l[i] = ut_rand_float(-4.0f, 4.0f);
}

TEST(sampler_greedy_picks_argmax_lowest_on_ties)
{
	smp_params p = smp_default_params();
	p.temperature = 0.0f;
	ds_err e = {0};
	smp_state *s = smp_new(&p, 50, &e);
	float l[50];
	fill_logits(l, 50);
	l[17] = 9.0f;
	l[33] = 9.0f;
	CHECK_EQ(smp_sample(s, l), 17);
	smp_free(s);
}

/* Empirical distribution of many draws vs the exact softmax. */
TEST(sampler_temperature_matches_softmax)
{
	enum { V = 6, N = 60000 };
	float base[V] = {1.0f, 0.5f, 0.0f, -0.5f, 2.0f, 0.25f};
	smp_params p = smp_default_params();
	p.temperature = 0.7f;
	p.has_seed = 1;
	p.seed = 42;
	ds_err e = {0};
	smp_state *s = smp_new(&p, V, &e);
	int count[V] = {0};
	for (int i = 0; i < N; i++) {
		float l[V];
		memcpy(l, base, sizeof l);
		count[smp_sample(s, l)]++;
	}
	double z = 0;
	for (int v = 0; v < V; v++)
		z += exp(base[v] / 0.7);
	for (int v = 0; v < V; v++) {
		double want = exp(base[v] / 0.7) / z;
		CHECK_NEAR((double)count[v] / N, want, 0.01);
	}
	smp_free(s);
}

TEST(sampler_top_k_top_p_min_p_restrict_support)
{
	enum { V = 10 };
	float base[V] = {3, 2.9f, 2.8f, 0, 0, 0, 0, 0, 0, -1};
	ds_err e = {0};
	smp_params p = smp_default_params();
	p.has_seed = 1;
	p.top_k = 2;
	smp_state *s = smp_new(&p, V, &e);
	for (int i = 0; i < 2000; i++) {
		float l[V];
		memcpy(l, base, sizeof l);
		int id = smp_sample(s, l);
		CHECK(id == 0 || id == 1);
	}
	smp_free(s);
	/* p = softmax(base): 0.300, 0.271, 0.246, then 0.0149 each...; top_p 0.55 keeps {0,1} */
	p = smp_default_params();
	p.has_seed = 1;
	p.top_p = 0.55f;
	s = smp_new(&p, V, &e);
	int seen[V] = {0};
	for (int i = 0; i < 2000; i++) {
		float l[V];
		memcpy(l, base, sizeof l);
		seen[smp_sample(s, l)] = 1;
	}
	CHECK(seen[0] && seen[1] && !seen[2] && !seen[3]);
	smp_free(s);
	/* min_p 0.5: keep p >= 0.5 * p_max -> {0,1,2} */
	p = smp_default_params();
	p.has_seed = 1;
	p.min_p = 0.5f;
	s = smp_new(&p, V, &e);
	memset(seen, 0, sizeof seen);
	for (int i = 0; i < 3000; i++) {
		float l[V];
		memcpy(l, base, sizeof l);
		seen[smp_sample(s, l)] = 1;
	}
	CHECK(seen[0] && seen[1] && seen[2] && !seen[3] && !seen[9]);
	smp_free(s);
}

TEST(sampler_seed_reproduces_sequence)
{
	enum { V = 300 };
	smp_params p = smp_default_params();
	p.has_seed = 1;
	p.seed = 1234;
	p.top_p = 0.9f;
	ds_err e = {0};
	smp_state *a = smp_new(&p, V, &e), *b = smp_new(&p, V, &e);
	p.seed = 1235;
	smp_state *c = smp_new(&p, V, &e);
	int same = 1, differ = 0;
	for (int i = 0; i < 200; i++) {
		float l[V], l2[V], l3[V];
		fill_logits(l, V);
		memcpy(l2, l, sizeof l);
		memcpy(l3, l, sizeof l);
		int x = smp_sample(a, l), y = smp_sample(b, l2), z = smp_sample(c, l3);
		same &= x == y;
		differ |= x != z;
	}
	CHECK(same);
	CHECK(differ);
	smp_free(a);
	smp_free(b);
	smp_free(c);
}

TEST(sampler_penalties_follow_hf_and_openai_rules)
{
	enum { V = 8 };
	smp_params p = smp_default_params();
	p.temperature = 0.0f;
	p.repetition_penalty = 2.0f;
	ds_err e = {0};
	smp_state *s = smp_new(&p, V, &e);
	int32_t prompt[2] = {1, 2};
	smp_add_prompt(s, prompt, 2);
	/* token 1: 3.0 -> 1.5; token 2: -1 -> -2; token 3 (unseen) 2.0 wins */
	float l[V] = {0, 3.0f, -1.0f, 2.0f, 0, 0, 0, 0};
	CHECK_EQ(smp_sample(s, l), 3);
	CHECK_NEAR(l[1], 1.5, 1e-6);
	CHECK_NEAR(l[2], -2.0, 1e-6);
	smp_free(s);

	p = smp_default_params();
	p.temperature = 0.0f;
	p.presence_penalty = 0.5f;
	p.frequency_penalty = 0.25f;
	s = smp_new(&p, V, &e);
	smp_add_prompt(s, prompt, 2); /* prompt tokens are not penalised by these */
	float l1[V] = {0, 0, 0, 0, 5.0f, 4.9f, 0, 0};
	CHECK_EQ(smp_sample(s, l1), 4); /* first draw: 4 (count 1) */
	float l2[V] = {0, 0, 0, 0, 5.0f, 4.9f, 0, 0};
	CHECK_EQ(smp_sample(s, l2), 5); /* 4: 5 - 0.5 - 0.25 = 4.25 < 4.9 */
	CHECK_NEAR(l2[4], 4.25, 1e-6);
	float l3[V] = {0, 3.0f, 0, 0, 5.0f, 4.9f, 0, 0};
	smp_sample(s, l3);
	CHECK_NEAR(l3[1], 3.0, 0); /* prompt token untouched */
	smp_free(s);
}

TEST(sampler_rejects_bad_params)
{
	ds_err e = {0};
	smp_params p = smp_default_params();
	p.top_p = 0.0f;
	CHECK(smp_new(&p, 10, &e) == NULL);
	CHECK(strstr(e.msg, "top_p") != NULL);
	p = smp_default_params();
	p.temperature = -1.0f;
	CHECK_EQ(smp_params_check(&p, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "temperature") != NULL);
	p = smp_default_params();
	p.min_p = 2.0f;
	CHECK_EQ(smp_params_check(&p, &e), DS_EINVAL);
}

/*
 * test_attn_moe.c - unit tests of the CPU ops with a single implementation:
 * MoE routing (V3 sigmoid/noaux_tc with bias and group mask, V2 softmax
 * greedy and group-limited), attention over materialised K/V and MLA over a
 * paged cache (each against a straightforward double-precision computation
 * written here), dequantization, and the batched matmul form.
 */
#include "kernels/cpu/attn.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"
#include "tests/unit/unit.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

TEST(moe_route_v3_bias_selects_weights_from_unbiased_scores)
{
	/* 8 experts, 4 groups of 2, keep 2 groups, top 2 */
	float logits[8] = {0.5f, 0.4f, -1.0f, 2.0f, 1.5f, 1.4f, -2.0f, -2.0f};
	float bias[8] = {0, 0, 0, -5.0f, 0, 0, 3.0f, 0};
	int32_t idx[2];
	float w[2];
	kb_moe_route_args a = {.idx = idx, .weight = w, .logits = logits, .bias = bias, .n_tok = 1,
				.n_experts = 8, .top_k = 2, .n_group = 4, .topk_group = 2,
				.logits_stride = 8, .scoring = KB_SCORE_SIGMOID,
				.method = KB_TOPK_NOAUX_TC, .norm_topk_prob = 1, .scaling = 2.5f};
	CHECK_EQ(kc_moe_route(&a), DS_OK);
	/* biased: e3 = s(2)-5 < 0, e6 = s(-2)+3 = 3.12 -> group 3 (e6,e7) scores 3.12+0.12,
	 * group 2 (e4,e5) 0.82+0.80; chosen experts e6 then e4 */
	CHECK_EQ(idx[0], 6);
	CHECK_EQ(idx[1], 4);
	double s6 = 1 / (1 + exp(2.0)), s4 = 1 / (1 + exp(-1.5));
	CHECK_NEAR(w[0], 2.5 * s6 / (s6 + s4), 1e-6);
	CHECK_NEAR(w[1], 2.5 * s4 / (s6 + s4), 1e-6);
}

TEST(moe_route_masks_groups_with_minus_infinity)
{
	/* every biased score negative: a 0 mask would let masked experts win */
	float logits[4] = {0.0f, 0.0f, 5.0f, 4.0f};
	float bias[4] = {-3.0f, -3.0f, -10.0f, -10.0f};
	int32_t idx[2];
	float w[2];
	kb_moe_route_args a = {.idx = idx, .weight = w, .logits = logits, .bias = bias, .n_tok = 1,
				.n_experts = 4, .top_k = 2, .n_group = 2, .topk_group = 1,
				.logits_stride = 4, .scoring = KB_SCORE_SIGMOID,
				.method = KB_TOPK_NOAUX_TC, .norm_topk_prob = 1, .scaling = 1.0f};
	CHECK_EQ(kc_moe_route(&a), DS_OK);
	CHECK((idx[0] == 0 && idx[1] == 1) || (idx[0] == 1 && idx[1] == 0));
}

TEST(moe_route_v2_softmax_greedy_and_group_limited)
{
	float logits[6] = {1.0f, 3.0f, 2.0f, 0.0f, 2.5f, -1.0f};
	int32_t idx[2];
	float w[2];
	kb_moe_route_args a = {.idx = idx, .weight = w, .logits = logits, .n_tok = 1,
				.n_experts = 6, .top_k = 2, .n_group = 1, .topk_group = 1,
				.logits_stride = 6, .scoring = KB_SCORE_SOFTMAX,
				.method = KB_TOPK_GREEDY, .scaling = 1.0f};
	CHECK_EQ(kc_moe_route(&a), DS_OK);
	double z = 0;
	for (int i = 0; i < 6; i++)
		z += exp(logits[i]);
	CHECK_EQ(idx[0], 1);
	CHECK_EQ(idx[1], 4);
	CHECK_NEAR(w[0], exp(3.0) / z, 1e-6); /* no renormalisation, factor 1 */
	CHECK_NEAR(w[1], exp(2.5) / z, 1e-6);
	/* group_limited_greedy, 3 groups of 2, keep 1: group 0 {1,3} max 3.0 wins */
	a.method = KB_TOPK_GROUP_LIMITED_GREEDY;
	a.n_group = 3;
	a.topk_group = 1;
	a.scaling = 16.0f;
	CHECK_EQ(kc_moe_route(&a), DS_OK);
	CHECK_EQ(idx[0], 1);
	CHECK_EQ(idx[1], 0);
	CHECK_NEAR(w[1], 16.0 * exp(1.0) / z, 1e-5);
	a.top_k = 7;
	CHECK_EQ(kc_moe_route(&a), DS_EINVAL);
}

static void ref_attn(const float *q, const float *k, const float *v, int nkv, int dk, int dv,
		     int last, double scale, double *out)
{
	double mx = -1e300, s[64], z = 0;
	for (int j = 0; j <= last; j++) {
		s[j] = 0;
		for (int i = 0; i < dk; i++)
			s[j] += (double)q[i] * k[j * dk + i];
		s[j] *= scale;
		mx = s[j] > mx ? s[j] : mx;
	}
	for (int j = 0; j <= last; j++)
		z += (s[j] = exp(s[j] - mx));
	for (int i = 0; i < dv; i++) {
		out[i] = 0;
		for (int j = 0; j <= last; j++)
			out[i] += s[j] / z * v[j * dv + i];
	}
	(void)nkv;
}

TEST(attn_matches_direct_softmax_with_causal_positions)
{
	enum { T = 3, NKV = 9, H = 2, DK = 19, DV = 13 };
	float q[T][H][DK], k[NKV][DK], v[NKV][DV], out[T][H][DV];
	int32_t pos[T] = {0, 4, 8};
	for (int i = 0; i < T * H * DK; i++)
		(&q[0][0][0])[i] = ut_rand_float(-1, 1);
	for (int i = 0; i < NKV * DK; i++)
		(&k[0][0])[i] = ut_rand_float(-1, 1);
	for (int i = 0; i < NKV * DV; i++)
		(&v[0][0])[i] = ut_rand_float(-1, 1);
	/* GQA: 2 query heads share one kv head */
	kb_attn_args a = {.out = &out[0][0][0], .q = &q[0][0][0], .k = &k[0][0], .v = &v[0][0],
				.n_tok = T, .n_kv = NKV, .n_heads = H, .n_kv_heads = 1, .dk = DK,
				.dv = DV, .q_stride = H * DK, .k_stride = DK, .v_stride = DV,
				.out_stride = H * DV, .q_pos = pos, .scale = 0.3f};
	CHECK_EQ(kc_attn(&a), DS_OK);
	for (int t = 0; t < T; t++)
		for (int h = 0; h < H; h++) {
			double ref[DV];
			ref_attn(q[t][h], &k[0][0], &v[0][0], NKV, DK, DV, pos[t], 0.3, ref);
			for (int i = 0; i < DV; i++)
				CHECK_NEAR(out[t][h][i], ref[i], 1e-5);
		}
}

TEST(mla_attn_reads_pages_through_block_tables)
{
	enum { H = 2, LORA = 24, ROPE = 8, ROW = LORA + ROPE, PS = 4, POS = 9 };
	/* 3 pages for positions 0..9 placed out of order: table {2, 0, 1} */
	float cache[3 * PS * ROW];
	for (int i = 0; i < 3 * PS * ROW; i++)
		cache[i] = ut_rand_float(-1, 1);
	int32_t table[3] = {2, 0, 1}, seq = 0, pos = POS;
	float ql[H * LORA], qp[H * ROPE], out[H * LORA];
	for (int i = 0; i < H * LORA; i++)
		ql[i] = ut_rand_float(-1, 1);
	for (int i = 0; i < H * ROPE; i++)
		qp[i] = ut_rand_float(-1, 1);
	kb_mla_attn_args a = {.out = out, .q_lat = ql, .q_pe = qp, .n_tok = 1, .n_heads = H,
				.kv_lora = LORA, .rope_dim = ROPE, .out_stride = H * LORA,
				.q_lat_stride = H * LORA, .q_pe_stride = H * ROPE, .cache = cache,
				.page_size = PS, .row_stride = ROW, .block_tables = table,
				.max_blocks = 3, .tok_seq = &seq, .tok_pos = &pos, .scale = 0.25f};
	CHECK_EQ(kc_mla_attn(&a), DS_OK);
	for (int h = 0; h < H; h++) {
		float k[POS + 1][ROW], v[POS + 1][LORA], q[ROW];
		for (int j = 0; j <= POS; j++) {
			const float *row = cache + (table[j / PS] * PS + j % PS) * ROW;
			memcpy(k[j], row, sizeof k[j]);
			memcpy(v[j], row, sizeof v[j]);
		}
		memcpy(q, ql + h * LORA, LORA * sizeof(float));
		memcpy(q + LORA, qp + h * ROPE, ROPE * sizeof(float));
		double ref[LORA];
		ref_attn(q, &k[0][0], &v[0][0], POS + 1, ROW, LORA, POS, 0.25, ref);
		for (int i = 0; i < LORA; i++)
			CHECK_NEAR(out[h * LORA + i], ref[i], 1e-5);
	}
}

/* Softmax attention of one MLA head straight from the definition, in
 * double: keys are whole cache rows [lora | rope], values their lora part. */
static void ref_mla_head(const float *ql, const float *qp, const float *const *rows, int n, int lora,
			 int rope, double scale, double *out)
{
	double *s = malloc((size_t)n * sizeof *s), mx = -1e300, z = 0;
	for (int j = 0; j < n; j++) {
		double d = 0;
		for (int i = 0; i < lora; i++)
			d += (double)ql[i] * rows[j][i];
		for (int i = 0; i < rope; i++)
			d += (double)qp[i] * rows[j][lora + i];
		s[j] = d * scale;
		mx = s[j] > mx ? s[j] : mx;
	}
	for (int j = 0; j < n; j++)
		z += (s[j] = exp(s[j] - mx));
	for (int i = 0; i < lora; i++) {
		out[i] = 0;
		for (int j = 0; j < n; j++)
			out[i] += s[j] / z * rows[j][i];
	}
	free(s);
}

/* H heads of lora + rope, 2 tokens: token 0 sees DEPTH + 1 positions (301:
 * three 128-key chunks; 2501: three stretches of MLA_SPLIT keys or fewer,
 * merged by log-sum-exp), token 1 six; pages of 16 in shuffled order, the
 * two sequences interleaved; every ISA and 1-7 threads against the double
 * reference, and the same bits whatever the thread count (and so the head
 * grouping: AVX-512 groups of 8, 4, 2, 1; AVX2 likewise, lanes of 8; how
 * many groups an item holds; whether a token's stretches are one item's or
 * several). */
static void check_mla_groups(int H, int LORA, int ROPE, int DEPTH)
{
	enum { PS = 16, NT = 2 };
	const int ROW = LORA + ROPE, P0 = (DEPTH + PS) / PS, PAGES = P0 + 1;
	const int32_t pos[NT] = {DEPTH, 5}, seq[NT] = {0, 1};
	int32_t *table = calloc(2 * (size_t)PAGES, sizeof(int32_t)), *perm = malloc(sizeof(int32_t) * (size_t)PAGES);
	for (int i = 0; i < PAGES; i++)
		perm[i] = i;
	for (int i = PAGES - 1; i > 0; i--) {
		int j = (int)(ut_rand_u64() % (uint64_t)(i + 1)), t = perm[i];
		perm[i] = perm[j];
		perm[j] = t;
	}
	for (int i = 0; i < P0; i++)
		table[i] = perm[i];
	table[PAGES] = perm[P0];
	const size_t nq = (size_t)(NT * H * LORA), np = (size_t)(NT * H * ROPE);
	float *cache = malloc(sizeof(float) * PAGES * PS * (size_t)ROW);
	float *ql = malloc(sizeof(float) * nq), *qp = malloc(sizeof(float) * np);
	float *out = malloc(sizeof(float) * nq), *first = malloc(sizeof(float) * nq);
	double *ref = malloc(sizeof(double) * nq);
	for (int i = 0; i < PAGES * PS * ROW; i++)
		cache[i] = ut_rand_float(-1, 1);
	for (size_t i = 0; i < nq; i++)
		ql[i] = ut_rand_float(-1, 1);
	for (size_t i = 0; i < np; i++)
		qp[i] = ut_rand_float(-1, 1);
	kb_mla_attn_args a = {.out = out, .q_lat = ql, .q_pe = qp, .n_tok = NT, .n_heads = H,
				.kv_lora = LORA, .rope_dim = ROPE, .out_stride = H * LORA,
				.q_lat_stride = H * LORA, .q_pe_stride = H * ROPE, .cache = cache,
				.page_size = PS, .row_stride = ROW, .block_tables = table,
				.max_blocks = PAGES, .tok_seq = seq, .tok_pos = pos, .scale = 0.2f};
	const float **rows = malloc(sizeof *rows * (size_t)(DEPTH + 1));
	for (int t = 0; t < NT; t++) {
		for (int j = 0; j <= pos[t]; j++)
			rows[j] = cache + (table[seq[t] * PAGES + j / PS] * PS + j % PS) * ROW;
		for (int h = 0; h < H; h++)
			ref_mla_head(ql + (t * H + h) * LORA, qp + (t * H + h) * ROPE, rows, pos[t] + 1, LORA,
				     ROPE, 0.2, ref + (t * H + h) * LORA);
	}
	static const int threads[] = {1, 2, 3, 4, 7};
	int prev_threads = kc_pool_threads();
	for (int isa = 0; isa <= (int)kc_isa_detect(); isa++) {
		enum kc_isa prev = kc_isa_force((enum kc_isa)isa);
		for (size_t ti = 0; ti < sizeof threads / sizeof threads[0]; ti++) {
			CHECK_EQ(kc_pool_set_threads(threads[ti]), DS_OK);
			memset(out, 0xff, sizeof(float) * nq);
			CHECK_EQ(kc_mla_attn(&a), DS_OK);
			double worst = 0;
			for (size_t i = 0; i < nq; i++) {
				double e = fabs(out[i] - ref[i]);
				worst = e > worst || e != e ? e : worst;
			}
			if (!(worst <= 1e-5))
				ut_fail(__FILE__, __LINE__, "%d heads of %d + %d, isa %s, %d threads: max error %.3g", H,
					LORA, ROPE, kc_isa_name((enum kc_isa)isa), threads[ti], worst);
			/* the same bits whatever the thread count (and so the grouping) */
			if (ti == 0)
				memcpy(first, out, sizeof(float) * nq);
			else
				CHECK(memcmp(first, out, sizeof(float) * nq) == 0);
		}
		kc_isa_force(prev);
	}
	a.n_tok = 0; /* an empty step: nothing attended, nothing written */
	memcpy(first, out, sizeof(float) * nq);
	CHECK_EQ(kc_mla_attn(&a), DS_OK);
	CHECK(memcmp(first, out, sizeof(float) * nq) == 0);
	kc_pool_set_threads(prev_threads);
	free(rows);
	free(table);
	free(perm);
	free(cache);
	free(ql);
	free(qp);
	free(out);
	free(first);
	free(ref);
}

TEST(mla_attn_head_groups_match_reference_on_every_isa_and_thread_count)
{
	check_mla_groups(12, 40, 8, 300); /* lora 40 cuts a 16-wide vector; AVX2: one vector per head */
	check_mla_groups(6, 64, 16, 300); /* AVX2: two vectors per head for groups up to 4 */
	check_mla_groups(3, 36, 4, 300);  /* not a multiple of 8: the per-head path on AVX2 */
	/* 5 groups of 8: items of several groups (all 5 with 1-2 threads, 3 + 2
	 * with 3, 2 + 2 + 1 with 7), each chunk of rows worked by all of an
	 * item's groups before the next */
	check_mla_groups(40, 64, 16, 300);
}

TEST(mla_attn_deep_token_stretches_match_reference_on_every_isa_and_thread_count)
{
	/* 2501 keys: stretches of 1024, 1024 and 453, as items of their own
	 * (their heads split further with 4-7 threads), folded afterwards */
	check_mla_groups(16, 64, 16, 2500);
	check_mla_groups(3, 36, 4, 2500); /* lora 36: masked tails on AVX-512; AVX2 the per-head path */
}

TEST(dequant_fp8_slice_uses_block_offsets)
{
	/* 6x5 FP8 matrix, block 2: scale grid 3x3; take the slice rows 1..4, cols 3..4 */
	uint8_t w[6][5];
	float scale[3][3];
	for (int i = 0; i < 30; i++)
		(&w[0][0])[i] = (uint8_t)(ut_rand_u64() % 126); /* positive finite codes */
	for (int i = 0; i < 9; i++)
		(&scale[0][0])[i] = ut_rand_float(0.5f, 2.0f);
	float out[4][2];
	kb_dequant_args a = {.out = &out[0][0], .w = &w[1][3], .w_scale = &scale[0][0],
				.wtype = KB_F8_E4M3, .rows = 4, .cols = 2, .out_stride = 2,
				.w_stride = 5, .scale_stride = 3, .block = 2, .row0 = 1, .col0 = 3};
	CHECK_EQ(kc_dequant(&a), DS_OK);
	for (int r = 0; r < 4; r++)
		for (int c = 0; c < 2; c++) {
			int R = r + 1, C = c + 3, b = w[R][C];
			int e = (b >> 3) & 15, mnt = b & 7;
			double val = e ? ldexp(1.0 + mnt / 8.0, e - 7) : ldexp(mnt / 8.0, -6);
			CHECK_NEAR(out[r][c], (float)val * scale[R / 2][C / 2], 0); /* f32 product */
		}
}

TEST(matmul_batched_equals_each_product)
{
	enum { B = 5, M = 3, N = 7, K = 33 };
	float x[B][M][K], y[B][M][N], ref[M][N];
	uint16_t w[B][N][K];
	for (int i = 0; i < B * M * K; i++)
		(&x[0][0][0])[i] = ut_rand_float(-1, 1);
	for (int i = 0; i < B * N * K; i++) {
		float f = ut_rand_float(-1, 1);
		uint32_t u;
		memcpy(&u, &f, 4);
		(&w[0][0][0])[i] = (uint16_t)(u >> 16); /* bf16 by truncation */
	}
	kb_matmul_args a = {.y = &y[0][0][0], .x = &x[0][0][0], .w = &w[0][0][0], .wtype = KB_BF16,
				.M = M, .N = N, .K = K, .x_stride = K, .y_stride = N, .w_stride = K};
	a.batch = B;
	a.x_bstride = M * K;
	a.y_bstride = M * N;
	a.w_bstride = N * K;
	CHECK_EQ(kb_matmul(kb_backend_get("cpu", NULL), &a), DS_OK);
	for (int b = 0; b < B; b++) {
		kb_matmul_args one = {.y = &ref[0][0], .x = &x[b][0][0], .w = &w[b][0][0],
					.wtype = KB_BF16, .M = M, .N = N, .K = K, .x_stride = K,
					.y_stride = N, .w_stride = K};
		kc_matmul_ref(&one);
		for (int i = 0; i < M * N; i++)
			CHECK_NEAR((&y[b][0][0])[i], (&ref[0][0])[i], 1e-5);
	}
	a.w_bstride = -1;
	CHECK_EQ(kb_matmul(kb_backend_get("cpu", NULL), &a), DS_EINVAL);
}

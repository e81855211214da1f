/*
 * test_paged_attn.c - unit tests of grouped-query attention over the paged
 * KV cache (kc_paged_attn): prefill runs (tiles, causal within the run) and
 * decode tokens (key stretches merged by log-sum-exp) in one batch, against a
 * direct double-precision softmax written here, on random inputs, on every
 * instruction set this machine has and several thread counts; the result of
 * a token must not depend on the thread count or on the rest of the batch.
 */
#include "kernels/cpu/attn.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"
#include "tests/unit/unit.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct pa_case {
	int H, KV, hd, ps, pages;
	int n_seq;
	const int *seq_len; /* positions cached per sequence (all tokens' keys are in the cache) */
	int n_tok;
	const int32_t *seq, *pos;
	int f16; /* the cache in IEEE halves (KB_F16) */
} pa_case;

/* A random half of magnitude 2^-3 .. 2^1 (exponent 12 .. 16), or one of the
 * subnormals (exponent 0), either sign. */
static uint16_t rand_half(void)
{
	const uint64_t r = ut_rand_u64();
	const unsigned e = r % 8 == 0 ? 0 : 12 + (unsigned)(r >> 8) % 5;
	return (uint16_t)((r >> 16 & 1) << 15 | e << 10 | (r >> 20 & 0x3ff));
}

/* out[h][d] = softmax_j(scale q_h . K_j) V_j over j <= pos, in double */
static void ref_token(const pa_case *c, const float *cache, const int32_t *table, int row, const float *q,
		      int32_t pos, double scale, double *out)
{
	const int G = c->H / c->KV;
	double *s = malloc(sizeof(double) * (size_t)(pos + 1));
	for (int h = 0; h < c->H; h++) {
		int kh = h / G;
		double mx = -INFINITY, z = 0;
		for (int j = 0; j <= pos; j++) {
			const float *r = cache + ((int64_t)table[j / c->ps] * c->ps + j % c->ps) * row;
			double d = 0;
			for (int k = 0; k < c->hd; k++)
				d += (double)q[h * c->hd + k] * r[kh * c->hd + k];
			s[j] = d * scale;
			mx = s[j] > mx ? s[j] : mx;
		}
		for (int j = 0; j <= pos; j++)
			z += (s[j] = exp(s[j] - mx));
		for (int k = 0; k < c->hd; k++) {
			double o = 0;
			for (int j = 0; j <= pos; j++) {
				const float *r = cache + ((int64_t)table[j / c->ps] * c->ps + j % c->ps) * row;
				o += s[j] * r[c->KV * c->hd + kh * c->hd + k];
			}
			out[h * c->hd + k] = o / z;
		}
	}
	free(s);
}

static void run_case(const pa_case *c)
{
	const int row = 2 * c->KV * c->hd, qd = c->H * c->hd;
	int max_blocks = 0;
	for (int i = 0; i < c->n_seq; i++)
		max_blocks = (c->seq_len[i] + c->ps - 1) / c->ps > max_blocks ? (c->seq_len[i] + c->ps - 1) / c->ps
									   : max_blocks;
	/* pages in shuffled order, the sequences' tables interleaved */
	int32_t *perm = malloc(sizeof(int32_t) * (size_t)c->pages);
	int32_t *table = calloc((size_t)(c->n_seq * max_blocks), sizeof(int32_t));
	for (int i = 0; i < c->pages; i++)
		perm[i] = i;
	for (int i = c->pages - 1; i > 0; i--) {
		int j = (int)(ut_rand_u64() % (uint64_t)(i + 1));
		int32_t t = perm[i];
		perm[i] = perm[j];
		perm[j] = t;
	}
	int used = 0;
	for (int b = 0; b < max_blocks; b++)
		for (int i = 0; i < c->n_seq; i++)
			if (b * c->ps < c->seq_len[i])
				table[i * max_blocks + b] = perm[used++];
	CHECK(used <= c->pages);
	float *cache = malloc(sizeof(float) * (size_t)c->pages * (size_t)c->ps * (size_t)row);
	uint16_t *cache16 = malloc(sizeof(uint16_t) * (size_t)c->pages * (size_t)c->ps * (size_t)row);
	float *q = malloc(sizeof(float) * (size_t)(c->n_tok * qd));
	float *out = malloc(sizeof(float) * (size_t)(c->n_tok * qd));
	float *first = malloc(sizeof(float) * (size_t)(c->n_tok * qd));
	float *alone = malloc(sizeof(float) * (size_t)qd);
	double *ref = malloc(sizeof(double) * (size_t)(c->n_tok * qd));
	for (int64_t i = 0; i < (int64_t)c->pages * c->ps * row; i++) {
		/* F16: the reference reads the halves' exact values */
		cache16[i] = rand_half();
		cache[i] = c->f16 ? kc_f16_to_f32(cache16[i]) : ut_rand_float(-1, 1);
	}
	for (int i = 0; i < c->n_tok * qd; i++)
		q[i] = ut_rand_float(-2, 2);
	const double scale = 1.0 / sqrt((double)c->hd);
	for (int t = 0; t < c->n_tok; t++)
		ref_token(c, cache, table + c->seq[t] * max_blocks, row, q + t * qd, c->pos[t], scale,
			  ref + t * qd);
	kb_paged_attn_args a = {.out = out, .q = q, .n_tok = c->n_tok, .n_heads = c->H, .n_kv_heads = c->KV,
				.head_dim = c->hd, .q_stride = qd, .out_stride = qd,
				.cache = c->f16 ? (const void *)cache16 : cache, .cache_type = c->f16 ? KB_F16 : KB_F32,
				.page_size = c->ps, .row_stride = row, .k_off = 0, .v_off = c->KV * c->hd,
				.block_tables = table, .max_blocks = max_blocks, .tok_seq = c->seq,
				.tok_pos = c->pos, .scale = (float)scale};
	static const int threads[] = {1, 2, 3};
	const int prev_threads = kc_pool_threads();
	for (int isa = 0; isa <= (int)kc_isa_detect(); isa++) {
		enum kc_isa prev = kc_isa_force((enum kc_isa)isa);
		for (size_t ti = 0; ti < sizeof threads / sizeof threads[0]; ti++) {
			CHECK_EQ(kc_pool_set_threads(threads[ti]), DS_OK);
			memset(out, 0xff, sizeof(float) * (size_t)(c->n_tok * qd));
			a.out = out;
			a.q = q;
			a.n_tok = c->n_tok;
			a.tok_seq = c->seq;
			a.tok_pos = c->pos;
			CHECK_EQ(kc_paged_attn(&a), DS_OK);
			double worst = 0;
			for (int i = 0; i < c->n_tok * qd; i++) {
				double e = fabs(out[i] - ref[i]);
				worst = e > worst || e != e ? e : worst;
			}
			if (!(worst <= 2e-5))
				ut_fail(__FILE__, __LINE__, "H %d KV %d hd %d%s, isa %s, %d threads: max error %.3g",
					c->H, c->KV, c->hd, c->f16 ? " f16" : "", kc_isa_name((enum kc_isa)isa),
					threads[ti], worst);
			if (ti == 0)
				memcpy(first, out, sizeof(float) * (size_t)(c->n_tok * qd));
			else if (memcmp(first, out, sizeof(float) * (size_t)(c->n_tok * qd)) != 0)
				ut_fail(__FILE__, __LINE__, "isa %s: %d threads give other bits than 1",
					kc_isa_name((enum kc_isa)isa), threads[ti]);
			/* a decode token (its neighbours of other sequences) alone: the same bits */
			for (int t = 0; t < c->n_tok; t++) {
				int run = (t > 0 && c->seq[t - 1] == c->seq[t] && c->pos[t - 1] + 1 == c->pos[t]) ||
					  (t + 1 < c->n_tok && c->seq[t + 1] == c->seq[t] &&
					   c->pos[t + 1] == c->pos[t] + 1);
				if (run)
					continue;
				a.out = alone;
				a.q = q + t * qd;
				a.n_tok = 1;
				a.tok_seq = c->seq + t;
				a.tok_pos = c->pos + t;
				CHECK_EQ(kc_paged_attn(&a), DS_OK);
				if (memcmp(alone, first + t * qd, sizeof(float) * (size_t)qd) != 0)
					ut_fail(__FILE__, __LINE__, "isa %s: token %d alone differs from it in the batch",
						kc_isa_name((enum kc_isa)isa), t);
				a.out = out;
				a.q = q;
				a.n_tok = c->n_tok;
				a.tok_seq = c->seq;
				a.tok_pos = c->pos;
			}
		}
		kc_isa_force(prev);
	}
	kc_pool_set_threads(prev_threads);
	free(perm);
	free(table);
	free(cache);
	free(cache16);
	free(q);
	free(out);
	free(first);
	free(alone);
	free(ref);
}

TEST(paged_attn_prefill_runs_and_decode_match_reference)
{
	/* SmolLM2's shape (9 heads over 3 KV heads of 64), pages of 64:
	 * sequence 0 prefills 37 tokens at 500..536 (tiles crossing a page, the
	 * causal mask inside the run); sequence 1 decodes at 1100 (5 stretches);
	 * sequence 2 decodes at 3; sequence 3 prefills its first 2 tokens;
	 * sequence 4 decodes exactly at a stretch end (255) */
	static const int len[] = {537, 1101, 4, 2, 256};
	int32_t seq[45], pos[45];
	int n = 0;
	for (int i = 0; i < 37; i++)
		seq[n] = 0, pos[n++] = 500 + i;
	seq[n] = 1, pos[n++] = 1100;
	seq[n] = 2, pos[n++] = 3;
	seq[n] = 3, pos[n++] = 0;
	seq[n] = 3, pos[n++] = 1;
	seq[n] = 4, pos[n++] = 255;
	pa_case c = {.H = 9, .KV = 3, .hd = 64, .ps = 64, .pages = 40, .n_seq = 5, .seq_len = len,
		     .n_tok = n, .seq = seq, .pos = pos};
	run_case(&c);
	c.f16 = 1;
	run_case(&c);
}

TEST(paged_attn_other_shapes_match_reference)
{
	/* 12 heads on one KV head (two decode groups of 8 + 4), head_dim 128,
	 * pages of 16 (blocks cut by pages), a run of 20 tokens after a decode */
	static const int len1[] = {300, 40};
	int32_t seq1[21], pos1[21];
	seq1[0] = 0, pos1[0] = 299;
	for (int i = 0; i < 20; i++)
		seq1[1 + i] = 1, pos1[1 + i] = 20 + i;
	pa_case c1 = {.H = 12, .KV = 1, .hd = 128, .ps = 16, .pages = 24, .n_seq = 2, .seq_len = len1,
		      .n_tok = 21, .seq = seq1, .pos = pos1};
	run_case(&c1);
	/* head_dim 24 (the AVX2 bodies on an AVX-512 machine), 4 heads on 2 */
	static const int len2[] = {70, 9};
	int32_t seq2[] = {0, 1, 1, 1}, pos2[] = {69, 6, 7, 8};
	pa_case c2 = {.H = 4, .KV = 2, .hd = 24, .ps = 8, .pages = 12, .n_seq = 2, .seq_len = len2,
		      .n_tok = 4, .seq = seq2, .pos = pos2};
	run_case(&c2);
	/* head_dim 20: the scalar path on every ISA */
	pa_case c3 = c2;
	c3.hd = 20;
	run_case(&c3);
	/* the same with the cache in halves */
	c1.f16 = c2.f16 = c3.f16 = 1;
	run_case(&c1);
	run_case(&c2);
	run_case(&c3);
}

/* The F16 cache with head_dim 256 (one KV head's K and V fill a converted
 * row: an item holds one KV head) and 2 KV heads of 8 query heads. */
TEST(paged_attn_f16_cache_wide_heads_match_reference)
{
	static const int len[] = {200, 30};
	int32_t seq[9], pos[9];
	seq[0] = 0, pos[0] = 199;
	for (int i = 0; i < 8; i++)
		seq[1 + i] = 1, pos[1 + i] = 22 + i;
	pa_case c = {.H = 16, .KV = 2, .hd = 256, .ps = 32, .pages = 10, .n_seq = 2, .seq_len = len,
		     .n_tok = 9, .seq = seq, .pos = pos, .f16 = 1};
	run_case(&c);
}

TEST(paged_attn_rejects_other_cache_types)
{
	float out[4], q[4], cache[8];
	int32_t table[1] = {0}, seq[1] = {0}, pos[1] = {0};
	kb_paged_attn_args a = {.out = out, .q = q, .n_tok = 1, .n_heads = 1, .n_kv_heads = 1, .head_dim = 4,
				.q_stride = 4, .out_stride = 4, .cache = cache, .cache_type = KB_BF16,
				.page_size = 1, .row_stride = 8, .v_off = 4, .block_tables = table,
				.max_blocks = 1, .tok_seq = seq, .tok_pos = pos, .scale = 0.5f};
	CHECK_EQ(kc_paged_attn(&a), DS_EINVAL);
	a.cache_type = KB_F32;
	for (int i = 0; i < 8; i++)
		cache[i] = (float)i;
	for (int i = 0; i < 4; i++)
		q[i] = 1.0f;
	CHECK_EQ(kc_paged_attn(&a), DS_OK);
	for (int i = 0; i < 4; i++)
		CHECK(out[i] == cache[4 + i]); /* one key: its V */
}

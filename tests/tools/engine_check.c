/*
 * engine_check.c - engine invariants on a real checkpoint, run by
 * tests/integration/test_engine_invariants.py on each tiny model:
 *
 *   attn-forms    naive and absorbed MLA give the same logits (every position)
 *   incremental   64 decode steps through the paged cache, each step's logits
 *                 equal a full recompute of the whole sequence from scratch
 *   batch         4 prompts of different lengths in one step equal each alone,
 *                 a step mixing decodes with a prefill equals them alone, and
 *                 so does a step of 4 decodes
 *   pages         every page returns to the free list when sequences end
 *
 * Usage: engine_check MODEL_DIR [--page-size N] [--tol T]
 * Prints one line per check and "engine_check: N passed, N failed".
 * Errors are max |a - b| / max |b| over each logits row (the metric the
 * acceptance criteria state), reported as the worst row.
 */
#include "common/strutil.h"
#include "engine/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CTX 128
#define MAXSEQ 8

static int V;
static int passed, failed;
static int page_size = 16;

typedef struct seq {
	kv_seq kv;
	int len;
} seq;

static int32_t tables[MAXSEQ][CTX];

static double row_err(const float *a, const float *b)
{
	double num = 0, den = 0;
	for (int v = 0; v < V; v++) {
		double d = fabs((double)a[v] - (double)b[v]);
		num = d > num ? d : num;
		den = fabs((double)b[v]) > den ? fabs((double)b[v]) : den;
	}
	return den > 0 ? num / den : num;
}

static void report(const char *name, double err, double tol)
{
	int ok = err <= tol;
	printf("%s %-12s max rel err %.3g (tol %g)\n", ok ? "ok  " : "FAIL", name, err, tol);
	if (ok)
		passed++;
	else
		failed++;
}

static void die(const char *what, const ds_err *err)
{
	fprintf(stderr, "engine_check: %s: %s\n", what, err->msg);
	exit(2);
}

/* One step: n tokens for sequences ss (by index sidx), logits of all tokens. */
static void step(model *m, seq *ss, int n, const int32_t *toks, const int32_t *sidx, float *out)
{
	int32_t pos[CTX];
	ds_err err = {0};
	int grow[MAXSEQ] = {0};
	for (int i = 0; i < n; i++)
		grow[sidx[i]]++;
	for (int s = 0; s < MAXSEQ; s++) {
		if (!grow[s])
			continue;
		if (kv_seq_reserve(model_kv(m), &ss[s].kv, ss[s].len + grow[s], &err))
			die("reserve", &err);
		for (int b = 0; b < ss[s].kv.n_blocks; b++)
			tables[s][b] = ss[s].kv.blocks[b];
	}
	int filled[MAXSEQ] = {0};
	for (int i = 0; i < n; i++)
		pos[i] = ss[sidx[i]].len + filled[sidx[i]]++;
	eng_batch b = {.n_tok = n, .tokens = toks, .pos = pos, .seq = sidx, .n_seq = MAXSEQ,
		       .block_tables = &tables[0][0], .max_blocks = CTX};
	if (model_forward(m, &b, out, &err))
		die("forward", &err);
	for (int s = 0; s < MAXSEQ; s++)
		ss[s].len += grow[s];
}

static void release(model *m, seq *ss)
{
	for (int s = 0; s < MAXSEQ; s++) {
		kv_seq_free(model_kv(m), &ss[s].kv);
		ss[s].len = 0;
	}
}

/* Logits of every position of toks[0..n) as one prefill of one fresh sequence. */
static void prefill(model *m, const int32_t *toks, int n, float *out)
{
	seq ss[MAXSEQ] = {0};
	int32_t sidx[CTX] = {0};
	step(m, ss, n, toks, sidx, out);
	release(m, ss);
}

static void random_tokens(int32_t *t, int n, uint64_t *x)
{
	for (int i = 0; i < n; i++) {
		*x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
		t[i] = (int32_t)(*x % (uint64_t)V);
	}
}

static void check_attn_forms(model *m, double tol)
{
	int32_t toks[40];
	uint64_t x = 0x1234567;
	random_tokens(toks, 40, &x);
	float *a = malloc(sizeof(float) * 40 * (size_t)V), *b = malloc(sizeof(float) * 40 * (size_t)V);
	model_set_attn(m, MODEL_ATTN_NAIVE);
	prefill(m, toks, 40, a);
	model_set_attn(m, MODEL_ATTN_ABSORBED);
	prefill(m, toks, 40, b);
	model_set_attn(m, MODEL_ATTN_AUTO);
	double worst = 0;
	for (int t = 0; t < 40; t++) {
		double e = row_err(b + (size_t)t * V, a + (size_t)t * V);
		worst = e > worst ? e : worst;
	}
	report("attn-forms", worst, tol);
	free(a);
	free(b);
}

static int argmax(const float *l)
{
	int best = 0;
	for (int v = 1; v < V; v++)
		best = l[v] > l[best] ? v : best;
	return best;
}

static void check_incremental(model *m, double tol)
{
	enum { P = 37, STEPS = 64 };
	int32_t toks[P + STEPS];
	uint64_t x = 0xABCDEF;
	random_tokens(toks, P, &x);
	float *all = malloc(sizeof(float) * (P + STEPS) * (size_t)V);
	float *full = malloc(sizeof(float) * (P + STEPS) * (size_t)V);
	seq ss[MAXSEQ] = {0};
	int32_t sidx[CTX] = {0};
	step(m, ss, P, toks, sidx, all); /* prefill: logits of the last row drive step 0 */
	float *last = all + (size_t)(P - 1) * V;
	double worst = 0;
	for (int k = 0; k < STEPS; k++) {
		toks[P + k] = argmax(last);
		float *row = all + (size_t)(P + k) * V;
		step(m, ss, 1, &toks[P + k], sidx, row); /* decode one token */
		prefill(m, toks, P + k + 1, full);       /* recompute everything */
		double e = row_err(row, full + (size_t)(P + k) * V);
		worst = e > worst ? e : worst;
		last = row;
	}
	release(m, ss);
	report("incremental", worst, tol);
	free(all);
	free(full);
}

static void check_batch(model *m, double tol)
{
	static const int lens[4] = {5, 23, 1, 17};
	int32_t toks[4][32];
	uint64_t x = 0x77;
	for (int s = 0; s < 4; s++)
		random_tokens(toks[s], lens[s], &x);
	int total = 0;
	for (int s = 0; s < 4; s++)
		total += lens[s];
	float *alone = malloc(sizeof(float) * (size_t)total * V);
	float *batched = malloc(sizeof(float) * (size_t)total * V);
	int at = 0;
	for (int s = 0; s < 4; s++) {
		prefill(m, toks[s], lens[s], alone + (size_t)at * V);
		at += lens[s];
	}
	/* interleave the four prompts token by token in one step */
	int32_t bt[CTX], bs[CTX], where[CTX];
	int n = 0, off[4] = {0, 5, 28, 29}, used[4] = {0};
	while (n < total) {
		for (int s = 0; s < 4; s++) {
			if (used[s] < lens[s]) {
				bt[n] = toks[s][used[s]];
				bs[n] = s;
				where[n] = off[s] + used[s];
				used[s]++;
				n++;
			}
		}
	}
	seq ss[MAXSEQ] = {0};
	step(m, ss, n, bt, bs, batched);
	double worst = 0;
	for (int i = 0; i < n; i++) {
		double e = row_err(batched + (size_t)i * V, alone + (size_t)where[i] * V);
		worst = e > worst ? e : worst;
	}
	/* mixed: sequences 0..2 decode one token each while sequence 3 is prefilled */
	int32_t mt[CTX], ms[CTX];
	int mn = 0;
	for (int s = 0; s < 3; s++) {
		mt[mn] = (int32_t)((toks[s][0] + 7) % V);
		ms[mn++] = s;
	}
	int32_t fresh[9];
	random_tokens(fresh, 9, &x);
	for (int i = 0; i < 9; i++) {
		mt[mn] = fresh[i];
		ms[mn++] = 4;
	}
	float *mixed = malloc(sizeof(float) * (size_t)mn * V);
	step(m, ss, mn, mt, ms, mixed);
	/* decodes only: sequences 0..3 one token each in one step (a decode
	 * batch, where the tokens share experts: DeepSeek's grouped MoE path) */
	int32_t dt[4], ds_[4] = {0, 1, 2, 3};
	for (int s = 0; s < 4; s++)
		dt[s] = (int32_t)((toks[s][lens[s] - 1] + 11 + s) % V);
	float *dec = malloc(sizeof(float) * 4 * (size_t)V);
	step(m, ss, 4, dt, ds_, dec);
	release(m, ss);
	float *ref = malloc(sizeof(float) * 40 * (size_t)V);
	for (int s = 0; s < 4; s++) {
		int32_t seqt[34];
		int len = lens[s];
		memcpy(seqt, toks[s], sizeof(int32_t) * (size_t)len);
		if (s < 3)
			seqt[len++] = mt[s];
		seqt[len++] = dt[s];
		prefill(m, seqt, len, ref);
		double e = row_err(dec + (size_t)s * V, ref + (size_t)(len - 1) * V);
		worst = e > worst ? e : worst;
	}
	free(dec);
	for (int s = 0; s < 3; s++) {
		int32_t seqt[32];
		memcpy(seqt, toks[s], sizeof(int32_t) * (size_t)lens[s]);
		seqt[lens[s]] = mt[s];
		prefill(m, seqt, lens[s] + 1, ref);
		double e = row_err(mixed + (size_t)s * V, ref + (size_t)lens[s] * V);
		worst = e > worst ? e : worst;
	}
	prefill(m, fresh, 9, ref);
	for (int i = 0; i < 9; i++) {
		double e = row_err(mixed + (size_t)(3 + i) * V, ref + (size_t)i * V);
		worst = e > worst ? e : worst;
	}
	report("batch", worst, tol);
	free(alone);
	free(batched);
	free(mixed);
	free(ref);
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: engine_check MODEL_DIR [--page-size N] [--tol T]\n");
		return 2;
	}
	double tol = 1e-5;
	for (int i = 2; i + 1 < argc; i += 2) {
		if (strcmp(argv[i], "--page-size") == 0 && ds_parse_int(argv[i + 1], 1, 4096, &page_size) == 0)
			continue;
		if (strcmp(argv[i], "--tol") == 0 && ds_parse_double(argv[i + 1], 0, 1, &tol) == 0)
			continue;
		fprintf(stderr, "engine_check: bad argument %s\n", argv[i]);
		return 2;
	}
	model_params p = model_default_params();
	p.path = argv[1];
	p.backend = "cpu";
	p.max_ctx = CTX;
	p.max_batch_tokens = CTX;
	p.max_seqs = MAXSEQ;
	p.page_size = page_size;
	ds_err err = {0};
	model *m = model_load(&p, &err);
	if (!m)
		die("load", &err);
	V = model_vocab_size(m);
	int free0 = kv_cache_pages_free(model_kv(m));
	check_attn_forms(m, tol);
	check_incremental(m, tol);
	check_batch(m, tol);
	int free1 = kv_cache_pages_free(model_kv(m));
	report("pages", free0 == free1 ? 0.0 : 1.0, 0.0);
	model_free(m);
	printf("engine_check: %d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}

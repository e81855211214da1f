/*
 * sampler.c - penalties, greedy, temperature / top-k / top-p / min-p sampling
 * (see sampler.h for the exact order and rules).
 *
 * Invariant: seen[] lists each token id with prompt_seen[id] || out_count[id]
 * exactly once, so penalties cost O(distinct seen tokens), not O(vocab).
 */
#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

struct smp_state {
	smp_params p;
	int vocab;
	uint64_t rng[4];
	uint8_t *prompt_seen;
	int32_t *out_count;
	int32_t *seen;
	int n_seen;
	float *prob;   /* scratch [vocab] */
	int32_t *order; /* scratch [vocab] */
};

smp_params smp_default_params(void)
{
	smp_params p = {0};
	p.temperature = 1.0f;
	p.top_p = 1.0f;
	p.repetition_penalty = 1.0f;
	return p;
}

int smp_params_check(const smp_params *p, ds_err *err)
{
	if (!(p->temperature >= 0.0f && p->temperature <= 100.0f))
		return ds_err_set(err, DS_EINVAL, "temperature must be in [0, 100], got %g", p->temperature);
	if (p->top_k < 0)
		return ds_err_set(err, DS_EINVAL, "top_k must be >= 0 (0 = off), got %d", p->top_k);
	if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
		return ds_err_set(err, DS_EINVAL, "top_p must be in (0, 1], got %g", p->top_p);
	if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
		return ds_err_set(err, DS_EINVAL, "min_p must be in [0, 1], got %g", p->min_p);
	if (!(p->repetition_penalty > 0.0f && p->repetition_penalty <= 10.0f))
		return ds_err_set(err, DS_EINVAL, "repetition_penalty must be in (0, 10], got %g",
				  p->repetition_penalty);
	if (!(fabsf(p->presence_penalty) <= 2.0f))
		return ds_err_set(err, DS_EINVAL, "presence_penalty must be in [-2, 2], got %g",
				  p->presence_penalty);
	if (!(fabsf(p->frequency_penalty) <= 2.0f))
		return ds_err_set(err, DS_EINVAL, "frequency_penalty must be in [-2, 2], got %g",
				  p->frequency_penalty);
	return DS_OK;
}

static uint64_t rotl(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

static uint64_t next_u64(uint64_t *s)
{
	uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl(s[3], 45);
	return r;
}

static void seed_rng(uint64_t *s, uint64_t seed)
{
	for (int i = 0; i < 4; i++) { /* splitmix64 expands the seed */
		seed += 0x9E3779B97F4A7C15ull;
		uint64_t z = seed;
		z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
		z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
		s[i] = z ^ (z >> 31);
	}
}

smp_state *smp_new(const smp_params *p, int vocab_size, ds_err *err)
{
	if (smp_params_check(p, err) != DS_OK)
		return NULL;
	smp_state *s = calloc(1, sizeof *s);
	if (!s)
		goto oom;
	s->p = *p;
	s->vocab = vocab_size;
	s->prompt_seen = calloc((size_t)vocab_size, 1);
	s->out_count = calloc((size_t)vocab_size, sizeof *s->out_count);
	s->seen = malloc((size_t)vocab_size * sizeof *s->seen);
	s->prob = malloc((size_t)vocab_size * sizeof *s->prob);
	s->order = malloc((size_t)vocab_size * sizeof *s->order);
	if (!s->prompt_seen || !s->out_count || !s->seen || !s->prob || !s->order)
		goto oom;
	uint64_t seed = p->seed;
	if (!p->has_seed && getrandom(&seed, sizeof seed, 0) != (ssize_t)sizeof seed)
		seed = (uint64_t)(uintptr_t)s ^ 0x5DEECE66Dull;
	seed_rng(s->rng, seed);
	return s;
oom:
	ds_err_set(err, DS_ENOMEM, "sampler: out of memory for a vocabulary of %d", vocab_size);
	smp_free(s);
	return NULL;
}

void smp_free(smp_state *s)
{
	if (!s)
		return;
	free(s->prompt_seen);
	free(s->out_count);
	free(s->seen);
	free(s->prob);
	free(s->order);
	free(s);
}

static void mark_seen(smp_state *s, int32_t id)
{
	if (!s->prompt_seen[id] && !s->out_count[id])
		s->seen[s->n_seen++] = id;
}

void smp_add_prompt(smp_state *s, const int32_t *ids, int64_t n)
{
	for (int64_t i = 0; i < n; i++) {
		if (ids[i] < 0 || ids[i] >= s->vocab)
			continue;
		mark_seen(s, ids[i]);
		s->prompt_seen[ids[i]] = 1;
	}
}

static void apply_penalties(smp_state *s, float *logits)
{
	const smp_params *p = &s->p;
	if (p->repetition_penalty == 1.0f && p->presence_penalty == 0.0f &&
	    p->frequency_penalty == 0.0f)
		return;
	for (int i = 0; i < s->n_seen; i++) {
		int32_t id = s->seen[i];
		float l = logits[id];
		if (p->repetition_penalty != 1.0f)
			l = l > 0.0f ? l / p->repetition_penalty : l * p->repetition_penalty;
		int32_t c = s->out_count[id];
		if (c > 0)
			l -= p->presence_penalty + p->frequency_penalty * (float)c;
		logits[id] = l;
	}
}

static int32_t argmax(const float *x, int n)
{
	int32_t best = 0;
	for (int i = 1; i < n; i++)
		if (x[i] > x[best])
			best = i;
	return best;
}

static __thread const float *t_sort_prob;

static int by_prob_desc(const void *a, const void *b)
{
	float pa = t_sort_prob[*(const int32_t *)a], pb = t_sort_prob[*(const int32_t *)b];
	if (pa != pb)
		return pa < pb ? 1 : -1;
	return *(const int32_t *)a - *(const int32_t *)b;
}

static int32_t draw(smp_state *s, const float *logits)
{
	const smp_params *p = &s->p;
	const int n = s->vocab;
	float mx = logits[argmax(logits, n)];
	double sum = 0.0;
	for (int i = 0; i < n; i++) {
		s->prob[i] = expf((logits[i] - mx) / p->temperature);
		sum += s->prob[i];
	}
	int m = 0;
	for (int i = 0; i < n; i++) {
		s->prob[i] = (float)(s->prob[i] / sum);
		if (s->prob[i] > 0.0f)
			s->order[m++] = i;
	}
	t_sort_prob = s->prob;
	qsort(s->order, (size_t)m, sizeof *s->order, by_prob_desc);
	if (p->top_k > 0 && p->top_k < m)
		m = p->top_k;
	if (p->top_p < 1.0f) {
		double c = 0.0;
		for (int i = 0; i < m; i++) {
			c += s->prob[s->order[i]];
			if (c >= p->top_p) {
				m = i + 1;
				break;
			}
		}
	}
	if (p->min_p > 0.0f) {
		float floor_p = p->min_p * s->prob[s->order[0]];
		int keep = 1;
		while (keep < m && s->prob[s->order[keep]] >= floor_p)
			keep++;
		m = keep;
	}
	double total = 0.0;
	for (int i = 0; i < m; i++)
		total += s->prob[s->order[i]];
	double u = (double)(next_u64(s->rng) >> 11) * (1.0 / 9007199254740992.0) * total;
	double c = 0.0;
	for (int i = 0; i < m; i++) {
		c += s->prob[s->order[i]];
		if (u < c)
			return s->order[i];
	}
	return s->order[m - 1];
}

int32_t smp_sample(smp_state *s, float *logits)
{
	apply_penalties(s, logits);
	int32_t id = s->p.temperature == 0.0f ? argmax(logits, s->vocab) : draw(s, logits);
	mark_seen(s, id);
	s->out_count[id]++;
	return id;
}

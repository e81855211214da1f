/*
 * moe.c - MoE routing on the CPU (see kb_moe_route_args in backend.h for the
 * exact rule; spec §4).  Scores in f32; selection by repeated arg-max, which
 * breaks ties towards the lower expert id.  Tiny work per token, so it runs on
 * the caller's thread.
 */
#include "kernels/cpu/attn.h"

#include <math.h>
#include <stdlib.h>

#define MOE_MAX_EXPERTS 1024

static int64_t argmax_excluding(const float *b, int64_t n, const unsigned char *taken)
{
	int64_t best = -1;
	for (int64_t e = 0; e < n; e++)
		if (!taken[e] && (best < 0 || b[e] > b[best]))
			best = e;
	return best;
}

static void route_one(const kb_moe_route_args *a, int64_t t)
{
	const float *lg = a->logits + t * a->logits_stride;
	const int64_t E = a->n_experts;
	float s[MOE_MAX_EXPERTS], b[MOE_MAX_EXPERTS];
	unsigned char taken[MOE_MAX_EXPERTS] = {0};

	if (a->scoring == KB_SCORE_SIGMOID) {
		for (int64_t e = 0; e < E; e++)
			s[e] = 1.0f / (1.0f + expf(-lg[e]));
	} else {
		float mx = lg[0], sum = 0.0f;
		for (int64_t e = 1; e < E; e++)
			mx = lg[e] > mx ? lg[e] : mx;
		for (int64_t e = 0; e < E; e++)
			sum += (s[e] = expf(lg[e] - mx));
		for (int64_t e = 0; e < E; e++)
			s[e] /= sum;
	}
	for (int64_t e = 0; e < E; e++)
		b[e] = s[e] + (a->bias ? a->bias[e] : 0.0f);

	if (a->method != KB_TOPK_GREEDY && a->n_group > 1) {
		int64_t per = E / a->n_group;
		float gscore[MOE_MAX_EXPERTS];
		unsigned char gtaken[MOE_MAX_EXPERTS] = {0};
		for (int64_t g = 0; g < a->n_group; g++) {
			const float *bg = b + g * per;
			if (a->method == KB_TOPK_NOAUX_TC) { /* sum of the two largest */
				float m1 = -INFINITY, m2 = -INFINITY;
				for (int64_t i = 0; i < per; i++) {
					if (bg[i] > m1) {
						m2 = m1;
						m1 = bg[i];
					} else if (bg[i] > m2) {
						m2 = bg[i];
					}
				}
				gscore[g] = per > 1 ? m1 + m2 : m1;
			} else { /* group_limited_greedy: the largest */
				float m1 = -INFINITY;
				for (int64_t i = 0; i < per; i++)
					m1 = bg[i] > m1 ? bg[i] : m1;
				gscore[g] = m1;
			}
		}
		for (int64_t k = 0; k < a->topk_group; k++)
			gtaken[argmax_excluding(gscore, a->n_group, gtaken)] = 1;
		for (int64_t e = 0; e < E; e++)
			if (!gtaken[e / per])
				b[e] = -INFINITY;
	}

	int32_t *idx = a->idx + t * a->top_k;
	float *w = a->weight + t * a->top_k;
	float sum = 0.0f;
	for (int64_t k = 0; k < a->top_k; k++) {
		int64_t e = argmax_excluding(b, E, taken);
		taken[e] = 1;
		idx[k] = (int32_t)e;
		w[k] = s[e];
		sum += s[e];
	}
	int renorm = a->scoring == KB_SCORE_SIGMOID ? a->norm_topk_prob
						   : (a->top_k > 1 && a->norm_topk_prob);
	for (int64_t k = 0; k < a->top_k; k++) {
		if (renorm)
			w[k] /= sum + 1e-20f;
		if (a->scoring == KB_SCORE_SIGMOID || !renorm)
			w[k] *= a->scaling;
	}
}

int kc_moe_route(const kb_moe_route_args *a)
{
	if (a->n_experts <= 0 || a->n_experts > MOE_MAX_EXPERTS || a->top_k <= 0 ||
	    a->top_k > a->n_experts || a->n_tok < 0)
		return DS_EINVAL;
	if (a->method != KB_TOPK_GREEDY && a->n_group > 1 &&
	    (a->n_experts % a->n_group != 0 || a->topk_group <= 0 || a->topk_group > a->n_group ||
	     a->n_group > MOE_MAX_EXPERTS || a->topk_group * (a->n_experts / a->n_group) < a->top_k))
		return DS_EINVAL;
	for (int64_t t = 0; t < a->n_tok; t++)
		route_one(a, t);
	return DS_OK;
}

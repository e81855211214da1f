/*
 * attn.c - attention kernels on the CPU: MLA absorbed over a paged cache, and
 * plain multi-head / grouped-query attention over materialised K/V.
 *
 * Both use an online (running max) softmax, so they need no scratch memory:
 * for each key j, with running max m, normaliser l and accumulator acc:
 *     m' = max(m, s_j); acc = acc * e^(m - m') + e^(s_j - m') * V_j; l likewise
 * and out = acc / l at the end.  Work is split over (token, head) pairs with
 * the CPU thread pool; each pair writes only its own output row.
 * Called through the CPU backend (backend_cpu.c).
 */
#include "kernels/cpu/attn.h"
#include "kernels/cpu/pool.h"

#include <math.h>
#include <string.h>

static float dot(const float *a, const float *b, int64_t n)
{
	float s = 0.0f;
	for (int64_t i = 0; i < n; i++)
		s += a[i] * b[i];
	return s;
}

/* acc = acc * c + w * v */
static void scale_add(float *acc, float c, float w, const float *v, int64_t n)
{
	for (int64_t i = 0; i < n; i++)
		acc[i] = acc[i] * c + w * v[i];
}

static void mla_range(void *ctx, int64_t begin, int64_t end)
{
	const kb_mla_attn_args *a = ctx;
	for (int64_t th = begin; th < end; th++) {
		int64_t t = th / a->n_heads, h = th % a->n_heads;
		const float *ql = a->q_lat + t * a->q_lat_stride + h * a->kv_lora;
		const float *qp = a->q_pe + t * a->q_pe_stride + h * a->rope_dim;
		float *out = a->out + t * a->out_stride + h * a->kv_lora;
		const int32_t *bt = a->block_tables + (int64_t)a->tok_seq[t] * a->max_blocks;
		float m = -INFINITY, l = 0.0f;
		memset(out, 0, (size_t)a->kv_lora * sizeof *out);
		for (int64_t j = 0; j <= a->tok_pos[t]; j++) {
			int64_t slot = (int64_t)bt[j / a->page_size] * a->page_size + j % a->page_size;
			const float *row = a->cache + slot * a->row_stride;
			float s = a->scale * (dot(ql, row, a->kv_lora) +
					      dot(qp, row + a->kv_lora, a->rope_dim));
			float mn = s > m ? s : m;
			float c = expf(m - mn), w = expf(s - mn);
			scale_add(out, c, w, row, a->kv_lora);
			l = l * c + w;
			m = mn;
		}
		float inv = 1.0f / l;
		for (int64_t i = 0; i < a->kv_lora; i++)
			out[i] *= inv;
	}
}

int kc_mla_attn(const kb_mla_attn_args *a)
{
	if (a->n_tok < 0 || a->n_heads <= 0 || a->kv_lora <= 0 || a->rope_dim < 0 ||
	    a->page_size <= 0 || a->row_stride < a->kv_lora + a->rope_dim)
		return DS_EINVAL;
	kc_parallel_for(a->n_tok * a->n_heads, 1, mla_range, (void *)a);
	return DS_OK;
}

static void attn_range(void *ctx, int64_t begin, int64_t end)
{
	const kb_attn_args *a = ctx;
	int64_t group = a->n_heads / a->n_kv_heads;
	for (int64_t th = begin; th < end; th++) {
		int64_t t = th / a->n_heads, h = th % a->n_heads, kh = h / group;
		const float *q = a->q + t * a->q_stride + h * a->dk;
		float *out = a->out + t * a->out_stride + h * a->dv;
		float m = -INFINITY, l = 0.0f;
		int64_t last = a->q_pos[t] < a->n_kv - 1 ? a->q_pos[t] : a->n_kv - 1;
		memset(out, 0, (size_t)a->dv * sizeof *out);
		for (int64_t j = 0; j <= last; j++) {
			float s = a->scale * dot(q, a->k + j * a->k_stride + kh * a->dk, a->dk);
			float mn = s > m ? s : m;
			float c = expf(m - mn), w = expf(s - mn);
			scale_add(out, c, w, a->v + j * a->v_stride + kh * a->dv, a->dv);
			l = l * c + w;
			m = mn;
		}
		float inv = l > 0.0f ? 1.0f / l : 0.0f;
		for (int64_t i = 0; i < a->dv; i++)
			out[i] *= inv;
	}
}

int kc_attn(const kb_attn_args *a)
{
	if (a->n_tok < 0 || a->n_kv < 0 || a->n_heads <= 0 || a->n_kv_heads <= 0 ||
	    a->n_heads % a->n_kv_heads != 0 || a->dk <= 0 || a->dv <= 0)
		return DS_EINVAL;
	kc_parallel_for(a->n_tok * a->n_heads, 1, attn_range, (void *)a);
	return DS_OK;
}

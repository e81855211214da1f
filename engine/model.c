/*
 * model.c - opens the model source, picks the architecture of a checkpoint,
 * and answers engine/model.h from the shared base (model_impl.h).
 *
 *   DIR with config.json, model_type deepseek_v3 | deepseek_v2  -> deepseek.c
 *   DIR with config.json, model_type llama | mistral | qwen2     -> llama.c
 *   FILE.gguf, general.architecture deepseek2                    -> deepseek.c
 *   FILE.gguf, any other general.architecture                    -> llama.c
 *
 * Model load (every edge names the function that takes it):
 *
 *   path | p->source --msrc_open / msrc_ref--> source (opened once)
 *     --msrc_arch--> graph loader (deepseek_model_load | llama_model_load):
 *        config (mcfg_from_json | mcfg_from_gguf | llama's own)
 *        --needs: the ops its forward calls x the dtypes the source holds
 *        --model_backend_choose (eng_backend_pick: cuda then cpu for auto,
 *          support check before kb_backend_get; or backend_override)
 *        --msrc_hold_weights(mode for that backend) --> tensors, buffers
 *        (model_act_alloc: the backend's allocator), KV cache
 *   model_free --ops->free--> kb_release, msrc_unref
 *
 * Callers: dsrun, the agent's serve module, tests/tools.  Thread rule: as
 * model.h (one step at a time per model).
 */
#include "comm/comm.h"
#include "common/strutil.h"
#include "engine/engine.h"
#include "engine/model_impl.h"

#include <stdio.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

model_params model_default_params(void)
{
	model_params p = {0};
	p.backend = "auto";
	p.max_batch_tokens = 512;
	p.max_seqs = 16;
	p.page_size = 64;
	return p;
}

int model_kv_pages(const model_params *p, const kv_params *kp, int64_t ctx)
{
	if (p->n_pages > 0)
		return p->n_pages;
	int64_t per_seq = (ctx + kp->page_size - 1) / kp->page_size;
	int64_t pages = per_seq * (p->max_seqs > 0 ? p->max_seqs : 1);
	if (p->kv_bytes > 0) {
		int64_t page_bytes = (int64_t)kp->n_layers * kp->page_size * kp->row_elems *
				     (int64_t)(kp->elem_bytes ? kp->elem_bytes : 4);
		int64_t cap = (int64_t)(p->kv_bytes / (size_t)page_bytes);
		if (cap < per_seq)
			cap = per_seq;
		if (pages > cap)
			pages = cap;
	}
	return pages > INT32_MAX ? INT32_MAX : (int)pages;
}

int model_kv_elem_bytes(const model_params *p, const char *what, int f16_ok, int *bytes, ds_err *err)
{
	const char *d = p->kv_cache_dtype ? p->kv_cache_dtype : "auto";
	if (strcmp(d, "f32") == 0 || (strcmp(d, "auto") == 0 && !f16_ok)) {
		*bytes = 4;
		return DS_OK;
	}
	if (strcmp(d, "f16") == 0 || strcmp(d, "auto") == 0) {
		if (!f16_ok)
			return ds_err_set(err, DS_EINVAL, "kv cache dtype f16: %s is f32 only (use auto or f32)", what);
		*bytes = 2;
		return DS_OK;
	}
	return ds_err_set(err, DS_EINVAL, "kv cache dtype must be auto, f16 or f32, got '%s'", d);
}

/* The graph of an architecture name (GGUF general.architecture or HF
 * model_type); anything else goes to deepseek.c, whose config check names
 * what it supports. */
static int arch_is_llama(const char *arch)
{
	static const char *const names[] = {"llama", "mistral", "qwen2"};
	for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
		if (strcmp(arch, names[i]) == 0)
			return 1;
	return 0;
}

model *model_load(const model_params *p, ds_err *err)
{
	msrc *src = p->source ? msrc_ref(p->source) : msrc_open(p->path, err);
	if (!src)
		return NULL;
	const char *arch = msrc_arch(src);
	/* a GGUF of another architecture reaches llama.c, which names it */
	int llama = msrc_kind(src) == MSRC_GGUF ? strcmp(arch, "deepseek2") != 0 : arch_is_llama(arch);
	model *m = llama ? llama_model_load(p, src, err) : deepseek_model_load(p, src, err);
	msrc_unref(src); /* the model holds its own reference */
	/* logit rows of a rank that is not world rank 0 but runs the head: the
	 * last stage of a pipeline, or any rank of a one-stage plan */
	if (m && p->rank && m->rank.stage == m->rank.plan.pp - 1 && m->rank.rank != 0) {
		m->mb_logits = malloc((size_t)m->bt * (size_t)m->vocab_size * sizeof(float));
		if (!m->mb_logits) {
			ds_err_set(err, DS_ENOMEM, "out of memory for the logit rows of rank %d", m->rank.rank);
			model_free(m);
			return NULL;
		}
		m->extra_bytes += (size_t)m->bt * (size_t)m->vocab_size * sizeof(float);
	}
	return m;
}

int model_attn_parse(const char *s, enum model_attn *out)
{
	static const struct {
		const char *name;
		enum model_attn attn;
	} forms[] = {
		{.name = "auto", .attn = MODEL_ATTN_AUTO},
		{.name = "naive", .attn = MODEL_ATTN_NAIVE},
		{.name = "absorbed", .attn = MODEL_ATTN_ABSORBED},
	};
	for (size_t i = 0; s && i < sizeof forms / sizeof forms[0]; i++)
		if (strcmp(s, forms[i].name) == 0) {
			*out = forms[i].attn;
			return DS_OK;
		}
	return DS_EINVAL;
}

void model_free(model *m)
{
	if (!m)
		return;
	free(m->mb_logits);
	m->mb_logits = NULL;
	m->ops->free(m);
}

void model_needs_add(model_needs *nd, enum kb_op op, enum kb_dtype dtype)
{
	for (int i = 0; i < nd->n; i++)
		if (nd->v[i].op == op && nd->v[i].dtype == dtype)
			return;
	if (nd->n < (int)(sizeof nd->v / sizeof nd->v[0]))
		nd->v[nd->n++] = (kb_op_need){.op = op, .dtype = dtype};
}

void model_needs_append(model_needs *nd, const model_needs *more)
{
	for (int i = 0; i < more->n; i++)
		model_needs_add(nd, more->v[i].op, more->v[i].dtype);
}

int model_needs_scan(msrc *src, int n_layers, const char *embed, model_needs *nd,
		     model_needs *conv,
		     void (*extra)(msrc *src, const msrc_tensor *t, model_needs *nd), ds_err *err)
{
	size_t n = msrc_tensor_count(src, err);
	if (!n && err && err->code)
		return err->code;
	for (size_t i = 0; i < n; i++) {
		msrc_tensor t = msrc_tensor_at(src, i);
		size_t len = strlen(t.name);
		if (t.dtype == KB_DTYPE_COUNT || model_tensor_layer(t.name) >= n_layers ||
		    strcmp(t.name, embed) == 0 || (len > 10 && strcmp(t.name + len - 10, "_scale_inv") == 0))
			continue;
		if (t.n_dims == 1) {
			model_needs_add(conv, KB_OP_DEQUANT, t.dtype);
		} else if (t.n_dims >= 2) {
			model_needs_add(nd, KB_OP_MATMUL, t.dtype);
			if (extra)
				extra(src, &t, nd);
		}
	}
	return DS_OK;
}

enum ds_map_mode model_weights_mode(const model_params *p, const kb_backend *be)
{
	/* under a plan the graph copies its windows out of the file mapping
	 * (model_weight_window), which must stay the page cache's */
	if (p->rank)
		return DS_MAP_FILE;
	if (p->weights == MODEL_WEIGHTS_HUGE)
		return DS_MAP_HUGE_COPY;
	if (p->weights == MODEL_WEIGHTS_AUTO && strcmp(be->name, "cpu") == 0 && ds_thp_usable())
		return DS_MAP_HUGE_COPY;
	return DS_MAP_FILE;
}

int model_tensor_layer(const char *name)
{
	static const char *const prefixes[] = {"blk.", "model.layers."};
	for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++) {
		size_t n = strlen(prefixes[i]);
		if (strncmp(name, prefixes[i], n) != 0 || name[n] < '0' || name[n] > '9')
			continue;
		long v = 0;
		for (const char *c = name + n; *c >= '0' && *c <= '9' && v < INT32_MAX; c++)
			v = v * 10 + (*c - '0');
		return (int)v;
	}
	return -1;
}

const kb_backend *model_backend_choose(const model_params *p, const msrc *src, const model_needs *nd,
				       ds_err *err)
{
	const kb_backend *be;
	if (p->backend_override) {
		be = p->backend_override;
		if (kb_check(be, nd->v, nd->n, err)) {
			ds_err_wrap(err, "model %s", msrc_path(src));
			return NULL;
		}
	} else if (!(be = eng_backend_pick(p->backend, nd->v, nd->n, msrc_path(src), err))) {
		return NULL;
	}
	(void)kb_set_threads(be, p->threads); /* DS_EUNSUPPORTED: a backend without threads */
	return be;
}

/* ---- plans ---- */

int model_plan_check(const model_plan *p, ds_err *err)
{
	if (p->tp < 1 || p->pp < 1 || p->ep < 1)
		return ds_err_set(err, DS_EINVAL, "plan tp=%d pp=%d ep=%d: every size must be at least 1",
				  p->tp, p->pp, p->ep);
	if ((int64_t)p->tp * p->pp * p->ep > 65536)
		return ds_err_set(err, DS_EINVAL, "plan tp=%d pp=%d ep=%d: more than 65536 ranks", p->tp,
				  p->pp, p->ep);
	return DS_OK;
}

int model_plan_world(const model_plan *p)
{
	return p->tp * p->pp * p->ep;
}

void model_rank_coords(const model_plan *p, int r, int *stage, int *tp_rank, int *ep_rank)
{
	const int S = p->tp * p->ep;
	*stage = r / S;
	*tp_rank = (r % S) % p->tp;
	*ep_rank = (r % S) / p->tp;
}

void model_split_range(int64_t n, int parts, int i, int64_t *first, int64_t *count)
{
	const int64_t q = n / parts, rem = n % parts;
	*count = q + (i < rem ? 1 : 0);
	*first = i * q + (i < rem ? i : rem);
}

void model_stage_layers(int n_layers, int pp, int s, int *first, int *end)
{
	/* floor split; the remainder one each to the stages before the last */
	const int q = n_layers / pp, rem = n_layers % pp;
	int f = 0;
	for (int i = 0; i < s; i++)
		f += q + (i < rem && i < pp - 1 ? 1 : 0);
	*first = f;
	*end = f + q + (s < rem && s < pp - 1 ? 1 : 0);
	if (s == pp - 1)
		*end = n_layers;
}

int model_base_plan(model *m, const model_params *p, int n_layers, int64_t D, ds_err *err)
{
	m->n_layers = n_layers;
	m->D = D;
	if (!p->rank) {
		m->rank = (model_rank){.plan = {.tp = 1, .pp = 1, .ep = 1}};
		m->first_layer = 0;
		m->end_layer = n_layers;
		return DS_OK;
	}
	const model_rank *r = p->rank;
	int rc = model_plan_check(&r->plan, err);
	if (rc)
		return rc;
	const int W = model_plan_world(&r->plan);
	int stage, tp_rank, ep_rank;
	if (r->rank < 0 || r->rank >= W)
		return ds_err_set(err, DS_EINVAL, "rank %d is outside the plan's %d ranks", r->rank, W);
	model_rank_coords(&r->plan, r->rank, &stage, &tp_rank, &ep_rank);
	if (stage != r->stage || tp_rank != r->tp_rank || ep_rank != r->ep_rank)
		return ds_err_set(err, DS_EINVAL, "rank %d: stage %d, tp rank %d, ep rank %d do not match "
				  "the plan's layout (%d, %d, %d)", r->rank, r->stage, r->tp_rank,
				  r->ep_rank, stage, tp_rank, ep_rank);
	if (r->plan.pp > n_layers)
		return ds_err_set(err, DS_EINVAL, "%d pipeline stages for %d layers: each stage needs a layer",
				  r->plan.pp, n_layers);
	struct {
		comm_group *g;
		int size, rank;
		const char *what;
	} groups[] = {
		{r->world, W, r->rank, "world"},
		{r->stage_grp, r->plan.tp * r->plan.ep, r->rank % (r->plan.tp * r->plan.ep), "stage"},
		{r->tp_grp, r->plan.tp, tp_rank, "tp"},
	};
	for (size_t i = 0; i < sizeof groups / sizeof groups[0]; i++) {
		int have = groups[i].g ? comm_group_size(groups[i].g) : 1;
		int me = groups[i].g ? comm_group_rank(groups[i].g) : 0;
		if (have != groups[i].size || (groups[i].size > 1 && me != groups[i].rank))
			return ds_err_set(err, DS_EINVAL, "the %s group has %d ranks (this one %d); the plan "
					  "needs %d (this one %d)", groups[i].what, have, me,
					  groups[i].size, groups[i].rank);
	}
	m->rank = *r;
	model_stage_layers(n_layers, r->plan.pp, stage, &m->first_layer, &m->end_layer);
	return DS_OK;
}

int model_is_split(const model *m)
{
	return m->rank.plan.tp * m->rank.plan.ep > 1;
}

static int is_first_stage(const model *m)
{
	return m->rank.stage == 0;
}

static int is_last_stage(const model *m)
{
	return m->rank.stage == m->rank.plan.pp - 1;
}

int model_all_reduce(model *m, comm_group *g, float *buf, int64_t count, ds_err *err)
{
	if (!g || comm_group_size(g) == 1 || count == 0)
		return DS_OK;
	double t0 = ds_now_s();
	int rc = comm_all_reduce(g, buf, buf, count, COMM_F32, COMM_SUM, err);
	m->comm_seconds += ds_now_s() - t0;
	return rc;
}

int model_all_gather(model *m, comm_group *g, const float *send, float *recv, int64_t count,
		     ds_err *err)
{
	if (!g || comm_group_size(g) == 1) {
		if (recv != send && count)
			memmove(recv, send, (size_t)count * sizeof(float));
		return DS_OK;
	}
	double t0 = ds_now_s();
	int rc = comm_all_gather(g, send, recv, count, COMM_F32, err);
	m->comm_seconds += ds_now_s() - t0;
	return rc;
}

static int stage_xfer(model *m, int send, float *buf, int64_t count, int peer, ds_err *err)
{
	if (count == 0)
		return DS_OK;
	double t0 = ds_now_s();
	int rc = send ? comm_send(m->rank.world, buf, count, COMM_F32, peer, err)
		      : comm_recv(m->rank.world, buf, count, COMM_F32, peer, err);
	m->comm_seconds += ds_now_s() - t0;
	return rc;
}

double model_comm_seconds(const model *m)
{
	return m->comm_seconds;
}

/* One part of a step: tokens [t0, t0 + n) as a step of its own (same
 * sequences and block tables). */
static eng_batch sub_batch(const eng_batch *b, int t0, int n)
{
	eng_batch s = *b;
	s.n_tok = n;
	s.tokens = b->tokens + t0;
	s.pos = b->pos + t0;
	s.seq = b->seq + t0;
	s.want_logits = b->want_logits ? b->want_logits + t0 : NULL;
	return s;
}

static int want_count(const eng_batch *b)
{
	int n = 0;
	for (int t = 0; t < b->n_tok; t++)
		n += !b->want_logits || b->want_logits[t];
	return n;
}

int model_micro_batches(const eng_batch *b, int pp, int *cut, int max_parts)
{
	int parts = pp < max_parts ? pp : max_parts;
	cut[0] = 0;
	/* contiguity: a sequence seen again after another one keeps it whole */
	for (int t = 1; t < b->n_tok; t++)
		for (int u = 0; u < t - 1 && b->seq[t] != b->seq[t - 1]; u++)
			if (b->seq[u] == b->seq[t]) {
				cut[1] = b->n_tok;
				return 1;
			}
	int n = 1;
	for (int i = 1; i < parts; i++) {
		int target = (int)((int64_t)b->n_tok * i / parts), t = target;
		while (t > cut[n - 1] && t < b->n_tok && b->seq[t] == b->seq[t - 1])
			t++; /* move the cut forward to the next sequence edge */
		if (t <= cut[n - 1] || t >= b->n_tok)
			continue;
		cut[n++] = t;
	}
	cut[n] = b->n_tok;
	return n;
}

/* The pipeline (pp > 1): every stage runs the micro-batches in order:
 * receive x rows from the same local rank of the stage before (or embed on
 * the first), its layers, send them on (or, on the last stage, the head into
 * mb_logits).  A stage works on part i + 1 while the next one works on part
 * i.  The last stage's local rank 0 sends all logit rows to world rank 0 in
 * one transfer at the end (a transfer per part would hold the last stage
 * until world rank 0 had finished its own parts). */
static int forward_pipeline(model *m, const eng_batch *b, float *logits, ds_err *err)
{
	const int S = m->rank.plan.tp * m->rank.plan.ep, local = m->rank.rank % S;
	const int prev = m->rank.rank - S, next = m->rank.rank + S;
	int cut[MODEL_MAX_MICRO + 1];
	const int parts = model_micro_batches(b, m->rank.plan.pp, cut, MODEL_MAX_MICRO);
	int rows = 0, rc = DS_OK;
	for (int i = 0; i < parts && !rc; i++) {
		eng_batch s = sub_batch(b, cut[i], cut[i + 1] - cut[i]);
		float *x = m->x + (int64_t)cut[i] * m->D;
		if (is_first_stage(m))
			rc = m->ops->embed(m, &s, x, err);
		else
			rc = stage_xfer(m, 0, x, (int64_t)s.n_tok * m->D, prev, err);
		if (!rc)
			rc = m->ops->layers(m, &s, x, err);
		if (rc)
			break;
		if (!is_last_stage(m)) {
			rc = stage_xfer(m, 1, x, (int64_t)s.n_tok * m->D, next, err);
		} else {
			rc = m->ops->head(m, &s, x, m->mb_logits + (int64_t)rows * m->vocab_size, err);
			rows += want_count(&s);
		}
	}
	if (rc)
		return rc;
	const int64_t count = (int64_t)want_count(b) * m->vocab_size;
	const int last0 = (m->rank.plan.pp - 1) * S;
	if (is_last_stage(m) && local == 0)
		return stage_xfer(m, 1, m->mb_logits, count, 0, err);
	if (m->rank.rank == 0 && logits)
		return stage_xfer(m, 0, logits, count, last0, err);
	return DS_OK;
}

int model_forward(model *m, const eng_batch *b, float *logits, ds_err *err)
{
	if (m->ops->forward)
		return m->ops->forward(m, b, logits, err);
	int rc = model_check_batch(m, b, err);
	if (rc)
		return rc;
	if (m->rank.plan.pp > 1) {
		rc = forward_pipeline(m, b, logits, err);
	} else {
		/* one stage: a rank other than world rank 0 may pass logits = NULL */
		float *out = logits ? logits : m->mb_logits;
		if (!(rc = m->ops->embed(m, b, m->x, err)) && !(rc = m->ops->layers(m, b, m->x, err)))
			rc = m->ops->head(m, b, m->x, out, err);
	}
	if (rc && err && err->code == DS_OK)
		ds_err_set(err, rc, "forward step failed in the %s backend (%s)", m->be->name,
			   ds_status_name(rc));
	return rc;
}

/* ---- owned copies of weight windows (under a plan) ---- */

#define COPY_CHUNK ((size_t)8 << 20)

/* Drops the pages of [p, p + n) of a read-only file mapping from the process
 * (they stay in the page cache); a later read faults them in again. */
static void drop_pages(const void *p, size_t n)
{
	const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
	uintptr_t a = (uintptr_t)p & ~(pg - 1), e = ((uintptr_t)p + n + pg - 1) & ~(pg - 1);
	if (e > a)
		(void)madvise((void *)a, e - a, MADV_DONTNEED);
}

/* rows x row_bytes at src (rows src_stride bytes apart) into dst (packed),
 * dropping the source pages every COPY_CHUNK bytes of source span. */
static void copy_rows(void *dst, const uint8_t *src, int64_t rows, size_t row_bytes, size_t src_stride)
{
	const uint8_t *span = src;
	for (int64_t r = 0; r < rows; r++) {
		memcpy((uint8_t *)dst + (size_t)r * row_bytes, src + (size_t)r * src_stride, row_bytes);
		const uint8_t *end = src + (size_t)r * src_stride + row_bytes;
		if ((size_t)(end - span) >= COPY_CHUNK || r == rows - 1) {
			drop_pages(span, (size_t)(end - span));
			span = end;
		}
	}
}

static void *owned_alloc(size_t bytes)
{
	void *p = NULL;
	if (posix_memalign(&p, 64, bytes ? bytes : 1))
		return NULL;
	return p;
}

/* Weight bytes copied by every load of this process (model_load_bytes). */
static _Atomic uint64_t load_bytes;

uint64_t model_load_bytes(void)
{
	return atomic_load_explicit(&load_bytes, memory_order_relaxed);
}

/* A weight copy of n bytes: the model's counter and the load progress. */
static void copied(size_t *counter, size_t n)
{
	*counter += n;
	atomic_fetch_add_explicit(&load_bytes, n, memory_order_relaxed);
}

void *model_copy_bytes(const void *p, size_t n, size_t *counter)
{
	void *q = owned_alloc(n);
	if (!q)
		return NULL;
	copy_rows(q, p, 1, n, n);
	copied(counter, n);
	return q;
}

static int64_t gcd_i64(int64_t a, int64_t b)
{
	while (b) {
		int64_t t = a % b;
		a = b;
		b = t;
	}
	return a;
}

/* FP8 window: the codes, and a scale grid of block g = gcd(block, row0,
 * col0) in which every g x g block lies inside one block of the original
 * grid and takes its scale (the values are unchanged).  A g below 16 would
 * blow the grid up: then the window is dequantized to f32 instead. */
static int fp8_window(const kb_backend *be, const model_weight *w, int64_t row0, int64_t rows,
		      int64_t col0, int64_t cols, model_weight *out, void **owned, size_t *counter,
		      ds_err *err)
{
	const int64_t B = w->block, g = gcd_i64(gcd_i64(B, row0), col0);
	if (g < 16) {
		float *f = owned_alloc((size_t)rows * (size_t)cols * sizeof(float));
		if (!f)
			return ds_err_set(err, DS_ENOMEM, "out of memory copying a weight window");
		kb_dequant_args a = {.out = f, .w = (const uint8_t *)w->w + (size_t)row0 * (size_t)w->k + (size_t)col0,
					.w_scale = w->scale, .wtype = KB_F8_E4M3, .rows = rows,
					.cols = cols, .out_stride = cols, .w_stride = w->k,
					.scale_stride = w->scale_stride, .block = B, .row0 = row0,
					.col0 = col0};
		int rc = kb_dequant(be, &a);
		drop_pages((const uint8_t *)w->w + (size_t)row0 * (size_t)w->k, (size_t)rows * (size_t)w->k);
		if (rc) {
			free(f);
			return ds_err_set(err, rc, "dequantizing an FP8 weight window failed");
		}
		*out = (model_weight){.w = f, .type = KB_F32, .n = rows, .k = cols};
		*owned = f;
		copied(counter, (size_t)rows * (size_t)cols * sizeof(float));
		return DS_OK;
	}
	const int64_t gr = (rows + g - 1) / g, gc = (cols + g - 1) / g;
	const size_t code_bytes = (size_t)rows * (size_t)cols, scale_bytes = (size_t)(gr * gc) * sizeof(float);
	const size_t scale_off = (code_bytes + 63) & ~(size_t)63;
	uint8_t *mem = owned_alloc(scale_off + scale_bytes);
	if (!mem)
		return ds_err_set(err, DS_ENOMEM, "out of memory copying a weight window");
	copy_rows(mem, (const uint8_t *)w->w + (size_t)row0 * (size_t)w->k + (size_t)col0, rows,
		  (size_t)cols, (size_t)w->k);
	float *sc = (float *)(mem + scale_off);
	for (int64_t i = 0; i < gr; i++)
		for (int64_t j = 0; j < gc; j++)
			sc[i * gc + j] = w->scale[((row0 + i * g) / B) * w->scale_stride + (col0 + j * g) / B];
	*out = (model_weight){.w = mem, .scale = sc, .type = KB_F8_E4M3, .n = rows, .k = cols,
			      .scale_stride = gc, .block = g};
	*owned = mem;
	copied(counter, scale_off + scale_bytes);
	return DS_OK;
}

int model_weight_window(const kb_backend *be, const model_weight *w, int64_t row0, int64_t rows,
			int64_t col0, int64_t cols, model_weight *out, void **owned,
			size_t *counter, ds_err *err)
{
	*owned = NULL;
	if (row0 < 0 || rows < 0 || col0 < 0 || cols < 0 || row0 + rows > w->n || col0 + cols > w->k)
		return ds_err_set(err, DS_EINVAL, "window rows %lld+%lld, columns %lld+%lld is outside a "
				  "[%lld][%lld] weight", (long long)row0, (long long)rows,
				  (long long)col0, (long long)cols, (long long)w->n, (long long)w->k);
	if (rows == 0 || cols == 0) {
		*out = (model_weight){.type = w->type, .n = rows, .k = cols};
		return DS_OK;
	}
	/* After the copy all of w's pages leave the process, not only the
	 * window's: the kernel's fault-around maps pages next to the ones read
	 * (up to 64 KiB), and for a window that is part of a weight (a tp slice
	 * of an expert) those are the other ranks' rows, which would stay. */
	const size_t w_bytes = kb_dtype_bytes(w->type, w->n * w->k);
	if (w->type == KB_F8_E4M3 && w->scale) {
		int rc = fp8_window(be, w, row0, rows, col0, cols, out, owned, counter, err);
		if (!rc)
			drop_pages(w->w, w_bytes);
		return rc;
	}
	const int64_t blk = kb_dtype_block(w->type);
	if (col0 % blk || cols % blk)
		return ds_err_set(err, DS_EINVAL, "a %s weight splits only on its %lld-element blocks: "
				  "columns %lld+%lld", kb_dtype_name(w->type), (long long)blk,
				  (long long)col0, (long long)cols);
	const size_t row_bytes = kb_dtype_bytes(w->type, w->k), win_bytes = kb_dtype_bytes(w->type, cols);
	void *mem = owned_alloc((size_t)rows * win_bytes);
	if (!mem)
		return ds_err_set(err, DS_ENOMEM, "out of memory copying a weight window");
	copy_rows(mem, (const uint8_t *)w->w + (size_t)row0 * row_bytes + kb_dtype_bytes(w->type, col0),
		  rows, win_bytes, row_bytes);
	*out = (model_weight){.w = mem, .type = w->type, .n = rows, .k = cols};
	*owned = mem;
	copied(counter, (size_t)rows * win_bytes);
	drop_pages(w->w, w_bytes);
	return DS_OK;
}

void model_set_attn(model *m, enum model_attn attn)
{
	if (m->ops->set_attn)
		m->ops->set_attn(m, attn);
}

int model_check_batch(const model *m, const eng_batch *b, ds_err *err)
{
	const kv_params *kp = kv_cache_params(m->kv);
	if (b->n_tok <= 0 || b->n_tok > m->bt)
		return ds_err_set(err, DS_EINVAL, "a step holds 1..%lld tokens, got %d", (long long)m->bt,
				  b->n_tok);
	if (b->n_seq <= 0 || b->n_seq > m->bt || b->max_blocks <= 0)
		return ds_err_set(err, DS_EINVAL, "a step needs 1..%lld sequences and block tables",
				  (long long)m->bt);
	for (int i = 0; i < b->n_tok; i++) {
		int32_t t = b->tokens[i], pos = b->pos[i], s = b->seq[i];
		if (t < 0 || t >= m->vocab_size)
			return ds_err_set(err, DS_EINVAL, "token id %d is out of range: the vocabulary has %d ids (0..%d)",
					  t, m->vocab_size, m->vocab_size - 1);
		if (pos < 0 || pos >= m->ctx)
			return ds_err_set(err, DS_ERANGE, "position %d is outside the context of %lld tokens",
					  pos, (long long)m->ctx);
		if (s < 0 || s >= b->n_seq)
			return ds_err_set(err, DS_EINVAL, "token %d names sequence %d of %d", i, s, b->n_seq);
		int64_t blk = pos / kp->page_size;
		if (blk >= b->max_blocks)
			return ds_err_set(err, DS_EINVAL, "position %d needs block %lld; the table has %d",
					  pos, (long long)blk, b->max_blocks);
		for (int64_t j = 0; j <= blk; j++) {
			int32_t page = b->block_tables[(int64_t)s * b->max_blocks + j];
			if (page < 0 || page >= kp->n_pages)
				return ds_err_set(err, DS_EINVAL, "sequence %d: block %lld holds page %d (pages 0..%d)",
						  s, (long long)j, page, kp->n_pages - 1);
		}
	}
	return DS_OK;
}

kb_matmul_args model_matmul_args(const model_weight *w, const float *x, int64_t x_stride, float *y,
				 int64_t y_stride, int64_t M, int accumulate)
{
	return (kb_matmul_args){.y = y, .x = x, .w = w->w, .w_scale = w->scale, .wtype = w->type,
				.M = M, .N = w->n, .K = w->k, .x_stride = x_stride,
				.y_stride = y_stride, .w_stride = w->k,
				.scale_stride = w->scale_stride, .block = w->block,
				.accumulate = accumulate};
}

int model_linear(const kb_backend *be, const model_weight *w, const float *x, int64_t x_stride,
		 float *y, int64_t y_stride, int64_t M, int accumulate)
{
	kb_matmul_args a = model_matmul_args(w, x, x_stride, y, y_stride, M, accumulate);
	return M ? kb_matmul(be, &a) : DS_OK;
}

int model_linear_multi(const kb_backend *be, const model_weight *const *w, int n, const float *x,
		       int64_t x_stride, float *const *y, const int64_t *y_stride, int64_t M)
{
	kb_matmul_args a[8];
	if (n > 8)
		return DS_EINVAL;
	for (int i = 0; i < n; i++)
		a[i] = model_matmul_args(w[i], x, x_stride, y[i], y_stride[i], M, 0);
	return M ? kb_matmul_multi(be, a, n) : DS_OK;
}

void *model_act_alloc(const kb_backend *be, size_t *counter, size_t n, size_t size)
{
	size_t bytes = (n ? n : 1) * size;
	void *p = kb_alloc(be, bytes);
	if (p)
		*counter += bytes;
	return p;
}

void *model_calloc(size_t *counter, size_t n, size_t size)
{
	void *p = calloc(n ? n : 1, size);
	if (p)
		*counter += n * size;
	return p;
}

kv_cache *model_kv(model *m)
{
	return m->kv;
}

int model_vocab_size(const model *m)
{
	return m->vocab_size;
}

int model_max_ctx(const model *m)
{
	return (int)m->ctx;
}

int model_max_batch_tokens(const model *m)
{
	return (int)m->bt;
}

int model_eos_ids(const model *m, const int **ids)
{
	*ids = m->eos_ids;
	return m->n_eos;
}

const char *model_arch_name(const model *m)
{
	return m->arch;
}

const char *model_backend_name(const model *m)
{
	return m->be->name;
}

size_t model_weight_bytes(const model *m)
{
	return m->weight_bytes;
}

size_t model_extra_bytes(const model *m)
{
	return m->extra_bytes;
}

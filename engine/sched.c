/*
 * sched.c - the continuous-batching scheduler (contract in sched.h).
 *
 * Callers: the agent's HTTP handlers (submit, next, cancel, release, stats)
 * and tests/tools/sched_check.c.  Calls model_forward, kv_seq_* and smp_*.
 *
 * Threads: one step thread (step_main) owns the model, the KV cache, the
 * running list and each sequence's compute state (kv, n_done, n_gen, smp,
 * plan).  The mutex s->mu guards the waiting queue, the published state of
 * every sequence (n_pub, n_taken, fin, cancel, times, refs) and the stats.
 * The step thread holds it while it reaps, composes a step and publishes the
 * results, never during model_forward, sampling or the trace callback.
 *
 * A sequence's ids live in one array: toks[0, n_prompt) is the prompt and
 * toks[n_prompt, n_prompt + n_gen) the generated ids; the KV cache holds
 * positions [0, n_done).  A step feeds toks[n_done, n_done + k) and samples
 * only when n_done + k reaches n_known = n_prompt + n_gen.  A decode
 * (n_known - n_done == 1), a prefill chunk and the recompute after a
 * preemption (n_done back to 0, prompt and generated ids fed again) are all
 * this one rule, so a preempted sequence continues exactly where it was: its
 * sampler (penalty counts, RNG) and its generated ids are untouched.
 *
 * Lifecycle (each edge names the function that takes it):
 *
 *   sched_submit ─> WAITING ──compose (admit)──> RUNNING ──publish──> DONE
 *                     ^  │                         │        (stop / length)
 *                     │  └─reap (cancel)─> DONE    ├─reap (cancel)──> DONE
 *                     └──compose (preempt)─────────┤
 *                                                  └─fail (forward error)─> DONE
 *   sched_free: every WAITING / RUNNING sequence ─> DONE (abort)
 *
 * Step composition (compose), under token_budget tokens:
 *   1. one decode token for every running sequence past its prefill, oldest
 *      first;
 *   2. prefill chunks (<= prefill_chunk tokens each) of running sequences in
 *      admission order;
 *   3. admissions from the head of the waiting queue (FIFO: never skipped)
 *      while max_running, the budget and free pages for the first chunk last;
 *      none in a step that preempted.  With prefix caching the sequence first
 *      takes its cached pages (kv_seq_match on all its known ids but the
 *      last) and starts at the first position past them; when the pages of
 *      its first chunk do not fit, it gives them back and waits.
 * A sequence that needs a page when none is free takes one from the most
 * recently admitted running sequence (preempt: pages freed, back to the front
 * of the waiting queue); a prefill chunk first shrinks to the free pages and
 * never preempts an older sequence; a decode that finds itself the newest
 * preempts itself.
 *
 * Invariants:
 *   1. a RUNNING sequence owns one block-table row (slot) and exactly the
 *      pages of positions [0, n_done + plan); WAITING and DONE own no pages.
 *   2. running is in admission order (tail = most recently admitted).  The
 *      oldest running sequence can always progress: a request longer than the
 *      whole pool is refused at submit, and it may take pages from every
 *      newer one.  So a step with a running sequence is never empty and the
 *      step thread sleeps only when nothing is running or waiting.
 *   3. references: one for the consumer until sched_seq_release, one for the
 *      scheduler until the sequence is DONE and unlinked; freed at zero.  The
 *      sched struct is counted by its owner and by each live sequence, so a
 *      consumer may read and release after sched_free.
 *   4. the step loop never allocates: batch arrays, block tables and logits
 *      are sized at sched_new, each sequence's ids, log-probabilities and
 *      block list (max_blocks entries) at sched_submit.
 *   5. events: n_taken <= n_pub <= n_gen; fin is set once, after the last
 *      token is published, and a consumer sees it only when n_taken == n_pub.
 *   6. prefix caching: a running sequence's pages [0, n_pub_pages) are
 *      published (matched at admission, or published by sample_all once the
 *      step that filled them succeeded); they lie below n_done, so no step
 *      writes into them.  Steps that fail publish nothing.
 */
#include "engine/sched.h"

#include "common/log.h"
#include "common/strutil.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DEFAULT_MAX_WAITING 256

enum { ST_WAITING, ST_RUNNING, ST_DONE };

typedef struct seq_list {
	sched_seq *head, *tail;
	int n;
} seq_list;

struct sched_seq {
	sched *s;
	sched_seq *prev, *next;  /* links in s->waiting or s->running */
	int state;               /* ST_*; changed by the step thread under mu */

	/* the request, fixed at submit */
	int32_t *toks;           /* [n_prompt + max_tokens] */
	int32_t n_prompt, max_tokens;
	int32_t *eos;            /* [n_eos] request eos ids (empty with ignore_eos) */
	int32_t *stop;           /* [n_stop] */
	int n_eos, n_stop, ignore_eos;
	int logprobs, top_logprobs;
	float *lp;               /* [max_tokens] when logprobs */
	int32_t *top_id;         /* [max_tokens][top_logprobs] */
	float *top_lp;           /* [max_tokens][top_logprobs] */

	/* step thread only */
	smp_state *smp;
	kv_seq kv;               /* blocks preallocated to max_blocks entries */
	int32_t n_done;          /* positions in the cache */
	int32_t n_gen;           /* generated ids in toks */
	int slot;                /* block-table row; -1 unless running */
	int plan;                /* tokens in the step being composed */
	int plan_decode;         /* planned in phase 1 (its last known token alone) */
	int logit_row;           /* row of s->logits, -1 = nothing sampled */
	int admitted_once;
	int n_pub_pages;         /* kv.blocks[0, n_pub_pages) are published (prefix cache) */
	sched_finish pending;    /* finish decided by this step's sample */

	/* published: under s->mu */
	int refs;
	int32_t n_pub, n_taken;
	sched_finish fin;
	int cancel;
	sched_times times;
	char errmsg[DS_ERR_MSG_MAX];
	pthread_cond_t cv;       /* consumers wait here (CLOCK_MONOTONIC) */
};

struct sched {
	pthread_mutex_t mu;
	pthread_cond_t work;     /* the step thread sleeps here */
	int refs;                /* owner + live sequences; freed at zero */
	int stop, started;
	pthread_t thread;

	model *m;
	kv_cache *kv;
	int V, max_ctx, page_size, n_pages, max_blocks;
	int max_running, max_waiting, budget, chunk;
	int prefix;              /* prefix caching on */
	int32_t *model_eos;      /* [n_model_eos] */
	int n_model_eos;

	seq_list waiting, running;
	int *free_slots;         /* [max_running] stack of unused block-table rows */
	int n_free_slots;

	/* the step being built (step thread) */
	int32_t *tables;         /* [max_running][max_blocks] */
	int32_t *b_tok, *b_pos, *b_seq; /* [budget] */
	uint8_t *b_want;         /* [budget] */
	sched_seq **b_seqs;      /* [max_running] sequences with tokens in the step */
	int n_bseq;
	float *logits;           /* [max_running][V] */
	float *scratch;          /* [V] logits copy for sampling beside logprobs */
	sched_step_seq *t_seqs;  /* [max_running] */
	sched_trace_fn trace;
	void *trace_ctx;
	int test_fail; /* steps still to fail (sched_test_fail_steps) */

	sched_stats stats;       /* under mu */
};

/* ---- lists (intrusive, doubly linked) ---- */

static void list_push_back(seq_list *l, sched_seq *q)
{
	q->prev = l->tail;
	q->next = NULL;
	if (l->tail)
		l->tail->next = q;
	else
		l->head = q;
	l->tail = q;
	l->n++;
}

static void list_push_front(seq_list *l, sched_seq *q)
{
	q->prev = NULL;
	q->next = l->head;
	if (l->head)
		l->head->prev = q;
	else
		l->tail = q;
	l->head = q;
	l->n++;
}

static void list_remove(seq_list *l, sched_seq *q)
{
	if (q->prev)
		q->prev->next = q->next;
	else
		l->head = q->next;
	if (q->next)
		q->next->prev = q->prev;
	else
		l->tail = q->prev;
	q->prev = q->next = NULL;
	l->n--;
}

/* ---- sequence objects ---- */

static void seq_destroy(sched_seq *q)
{
	if (!q)
		return;
	smp_free(q->smp);
	free(q->kv.blocks); /* no pages left: every path to DONE truncated them */
	free(q->toks);
	free(q->eos);
	free(q->stop);
	free(q->lp);
	free(q->top_id);
	free(q->top_lp);
	pthread_cond_destroy(&q->cv);
	free(q);
}

static void sched_destroy(sched *s)
{
	pthread_cond_destroy(&s->work);
	pthread_mutex_destroy(&s->mu);
	free(s);
}

/* Drops one reference to q with s->mu held and frees q at zero.  Returns 1
 * when that also dropped the last reference to s: the caller frees s
 * (sched_destroy) after unlocking. */
static int seq_unref(sched *s, sched_seq *q)
{
	if (--q->refs > 0)
		return 0;
	seq_destroy(q);
	return --s->refs == 0;
}

static int32_t n_known(const sched_seq *q)
{
	return q->n_prompt + q->n_gen;
}

static void sync_stats(sched *s)
{
	s->stats.running = s->running.n;
	s->stats.waiting = s->waiting.n;
	s->stats.kv_pages_used = s->n_pages - kv_cache_pages_free(s->kv);
	s->stats.kv_pages_cached = kv_cache_pages_cached(s->kv);
}

/* Ends q (running or waiting) with fin: pages and row freed, unlinked, the
 * finish posted, the scheduler's reference dropped.  Holds s->mu; the
 * owner's reference keeps s alive. */
static void finish(sched *s, sched_seq *q, sched_finish fin, const char *msg)
{
	kv_seq_truncate(s->kv, &q->kv, 0);
	if (q->state == ST_RUNNING) {
		s->free_slots[s->n_free_slots++] = q->slot;
		q->slot = -1;
		list_remove(&s->running, q);
	} else {
		list_remove(&s->waiting, q);
	}
	q->state = ST_DONE;
	q->n_pub = q->n_gen;
	q->fin = fin;
	if (msg)
		ds_strlcpy(q->errmsg, msg, sizeof q->errmsg);
	q->times.finished = ds_now_s();
	pthread_cond_broadcast(&q->cv);
	seq_unref(s, q);
}

/* Recompute preemption: q's pages and row go back, q goes to the front of
 * the waiting queue with n_done = 0 (its ids and sampler stay). */
static void preempt(sched *s, sched_seq *q)
{
	kv_seq_truncate(s->kv, &q->kv, 0);
	s->free_slots[s->n_free_slots++] = q->slot;
	q->slot = -1;
	q->n_done = 0;
	q->n_pub_pages = 0;
	q->plan = q->plan_decode = 0;
	list_remove(&s->running, q);
	list_push_front(&s->waiting, q);
	q->state = ST_WAITING;
	s->stats.preemptions++;
}

/* ---- the step ---- */

/* Sequences whose consumer cancelled or released leave at the start of a step. */
static void reap(sched *s)
{
	seq_list *lists[2] = {&s->running, &s->waiting};
	for (int i = 0; i < 2; i++) {
		for (sched_seq *q = lists[i]->head, *next; q; q = next) {
			next = q->next;
			if (q->cancel)
				finish(s, q, SCHED_FIN_ABORT, NULL);
		}
	}
}

static int32_t imin(int32_t a, int32_t b)
{
	return a < b ? a : b;
}

/* Positions q could hold with its pages plus every free page. */
static int32_t fit_positions(sched *s, const sched_seq *q)
{
	int64_t cap = (int64_t)(q->kv.n_blocks + kv_cache_pages_free(s->kv)) * s->page_size;
	return (int32_t)(cap < INT32_MAX ? cap : INT32_MAX);
}

/* Tokens of a prefill chunk: at most the chunk size and the budget, and
 * never leaving exactly one prompt token for a later step.  A token alone in
 * a step is attended as a decode, the others as a prefill run, and the two
 * kernels round differently (kernels/cpu/attn_paged.c); so every prompt
 * token longer than one is computed the same way whatever the chunking (a
 * prefix cache hit, the budget other requests leave), and so is the text. */
static int32_t chunk_len(const sched *s, int32_t rem, int budget)
{
	int32_t k = imin(imin(rem, s->chunk), budget);
	if (rem - k == 1 && k >= 3)
		k--;
	return k;
}

/* Phases 1-3 of the header comment: sets each running sequence's plan;
 * returns the tokens planned.  Holds s->mu. */
static int plan_step(sched *s, int *admitted, int *preempted)
{
	int budget = s->budget;
	*admitted = *preempted = 0;
	for (sched_seq *q = s->running.head; q; q = q->next)
		q->plan = q->plan_decode = 0;

	/* 1. decodes, oldest first; the victim is always the tail, never a
	 * sequence already planned (they are older than q) */
	for (sched_seq *q = s->running.head; q && budget > 0; q = q->next) {
		if (n_known(q) - q->n_done != 1)
			continue;
		int self = 0;
		while (kv_seq_reserve(s->kv, &q->kv, q->n_done + 1, NULL) != DS_OK) {
			sched_seq *v = s->running.tail;
			preempt(s, v);
			(*preempted)++;
			if ((self = v == q))
				break;
		}
		if (self)
			break; /* q was the tail: nothing follows it */
		q->plan = 1;
		q->plan_decode = 1;
		budget--;
	}

	/* 2. prefill chunks in admission order */
	for (sched_seq *q = s->running.head; q && budget > 0; q = q->next) {
		int32_t rem = n_known(q) - q->n_done;
		if (rem <= 1)
			continue;
		int32_t k = chunk_len(s, rem, budget);
		while (kv_seq_reserve(s->kv, &q->kv, q->n_done + k, NULL) != DS_OK) {
			int32_t fit = fit_positions(s, q) - q->n_done;
			if (fit >= 1) {
				k = imin(k, fit); /* shrink to the free pages: always fits */
				continue;
			}
			sched_seq *v = s->running.tail;
			if (v == q) {
				k = 0; /* the newest waits for pages; older ones progress */
				break;
			}
			budget += v->plan;
			preempt(s, v);
			(*preempted)++;
		}
		q->plan = k;
		budget -= k;
	}

	/* 3. admissions, FIFO, page-aware; none after a preemption (the pages
	 * just freed belong to older sequences) */
	while (!*preempted && budget > 0 && s->waiting.head && s->running.n < s->max_running) {
		sched_seq *q = s->waiting.head;
		/* the cached full pages of all but the last two known ids: at
		 * least two are computed, so they form a prefill run (chunk_len) */
		const int64_t look = n_known(q) - 2 > 0 ? n_known(q) - 2 : 0;
		int64_t hit = s->prefix ? kv_seq_match(s->kv, &q->kv, q->toks, look, NULL) : 0;
		if (hit < 0)
			hit = 0; /* cannot happen: the block list holds max_blocks */
		q->n_done = (int32_t)hit;
		int32_t k = chunk_len(s, n_known(q) - q->n_done, budget);
		if (kv_seq_reserve(s->kv, &q->kv, q->n_done + k, NULL) != DS_OK) {
			kv_seq_truncate(s->kv, &q->kv, 0); /* the matched pages go back */
			q->n_done = 0;
			break;
		}
		q->n_pub_pages = (int)(hit / s->page_size);
		if (s->prefix) {
			s->stats.prefix_queries += (uint64_t)n_known(q);
			s->stats.prefix_hits += (uint64_t)hit;
		}
		list_remove(&s->waiting, q);
		list_push_back(&s->running, q);
		q->state = ST_RUNNING;
		q->slot = s->free_slots[--s->n_free_slots];
		q->plan = k;
		q->plan_decode = 0;
		budget -= k;
		(*admitted)++;
		if (!q->admitted_once) {
			q->admitted_once = 1;
			q->times.admitted = ds_now_s();
			s->stats.prompt_tokens += (uint64_t)q->n_prompt;
		}
	}
	return s->budget - budget;
}

static void add_seq(sched *s, sched_seq *q, int *n, int *rows)
{
	int32_t *row = s->tables + (int64_t)q->slot * s->max_blocks;
	memcpy(row, q->kv.blocks, (size_t)q->kv.n_blocks * sizeof *row);
	int sample = q->n_done + q->plan == n_known(q);
	for (int i = 0; i < q->plan; i++) {
		s->b_tok[*n] = q->toks[q->n_done + i];
		s->b_pos[*n] = q->n_done + i;
		s->b_seq[*n] = q->slot;
		s->b_want[*n] = sample && i == q->plan - 1;
		(*n)++;
	}
	q->logit_row = sample ? (*rows)++ : -1;
	s->t_seqs[s->n_bseq] = (sched_step_seq){q, q->plan, q->n_done, q->plan_decode, sample};
	s->b_seqs[s->n_bseq++] = q;
}

/* Fills the batch arrays from the plans: decodes first, then chunks. */
static int build_batch(sched *s)
{
	int n = 0, rows = 0;
	s->n_bseq = 0;
	for (sched_seq *q = s->running.head; q; q = q->next)
		if (q->plan > 0 && q->plan_decode)
			add_seq(s, q, &n, &rows);
	for (sched_seq *q = s->running.head; q; q = q->next)
		if (q->plan > 0 && !q->plan_decode)
			add_seq(s, q, &n, &rows);
	return n;
}

static int id_in(int32_t id, const int32_t *ids, int n)
{
	for (int i = 0; i < n; i++)
		if (ids[i] == id)
			return 1;
	return 0;
}

/* Log-softmax of the raw row at the sampled id and the top alternatives
 * (insertion into a k-long sorted list: one pass, no sort of the vocabulary;
 * ties keep the lower id first). */
static void logprobs_of(sched *s, sched_seq *q, const float *row, int32_t id, int at)
{
	const int V = s->V, k = q->top_logprobs;
	float mx = row[0];
	for (int v = 1; v < V; v++)
		mx = row[v] > mx ? row[v] : mx;
	double sum = 0.0;
	for (int v = 0; v < V; v++)
		sum += exp((double)row[v] - (double)mx);
	double lse = (double)mx + log(sum);
	q->lp[at] = (float)((double)row[id] - lse);
	if (!k)
		return;
	int32_t *ti = q->top_id + (int64_t)at * k;
	float *tl = q->top_lp + (int64_t)at * k;
	int n = 0;
	for (int v = 0; v < V; v++) {
		float x = row[v];
		if (n == k && !(x > tl[k - 1]))
			continue;
		int j = n < k ? n++ : k - 1;
		while (j > 0 && x > tl[j - 1]) {
			tl[j] = tl[j - 1];
			ti[j] = ti[j - 1];
			j--;
		}
		tl[j] = x;
		ti[j] = v;
	}
	for (int i = 0; i < n; i++)
		tl[i] = (float)((double)tl[i] - lse);
}

/* Samples every sequence whose last token was in the step and decides its
 * finish.  Step thread, without the lock: writes only unpublished slots. */
static void sample_all(sched *s)
{
	for (int b = 0; b < s->n_bseq; b++) {
		sched_seq *q = s->b_seqs[b];
		q->n_done += q->plan;
		q->pending = SCHED_RUNNING;
		int full = q->n_done / s->page_size; /* pages whose rows are all computed */
		if (s->prefix && full > q->n_pub_pages) {
			kv_seq_publish(s->kv, &q->kv, q->n_pub_pages, full, q->toks);
			q->n_pub_pages = full;
		}
		if (q->logit_row < 0)
			continue;
		float *row = s->logits + (int64_t)q->logit_row * s->V;
		float *l = row;
		if (q->logprobs) { /* smp_sample changes its input: keep the raw row */
			memcpy(s->scratch, row, (size_t)s->V * sizeof *row);
			l = s->scratch;
		}
		int32_t id = smp_sample(q->smp, l);
		if (q->logprobs)
			logprobs_of(s, q, row, id, q->n_gen);
		q->toks[q->n_prompt + q->n_gen++] = id;
		if (id_in(id, q->stop, q->n_stop) ||
		    (!q->ignore_eos && (id_in(id, s->model_eos, s->n_model_eos) || id_in(id, q->eos, q->n_eos))))
			q->pending = SCHED_FIN_STOP;
		else if (q->n_gen >= q->max_tokens || n_known(q) >= s->max_ctx)
			q->pending = SCHED_FIN_LENGTH;
	}
}

/* Posts the step's tokens and finishes.  Holds s->mu. */
static void publish(sched *s)
{
	double now = ds_now_s();
	for (int b = 0; b < s->n_bseq; b++) {
		sched_seq *q = s->b_seqs[b];
		if (q->logit_row < 0)
			continue;
		s->stats.generation_tokens++;
		if (q->times.first_token == 0.0)
			q->times.first_token = now;
		if (q->pending != SCHED_RUNNING) {
			finish(s, q, q->pending, NULL);
			continue;
		}
		q->n_pub = q->n_gen;
		pthread_cond_broadcast(&q->cv);
	}
}

static void *step_main(void *arg)
{
	sched *s = arg;
	ds_err err = {0};
	eng_batch b = {0, s->b_tok, s->b_pos, s->b_seq, s->b_want, s->max_running, s->tables,
		       s->max_blocks};
	pthread_mutex_lock(&s->mu);
	while (!s->stop) {
		reap(s);
		int admitted, preempted;
		b.n_tok = plan_step(s, &admitted, &preempted) ? build_batch(s) : 0;
		sync_stats(s);
		if (b.n_tok == 0) {
			/* invariant 2: only reachable with nothing running or waiting */
			pthread_cond_wait(&s->work, &s->mu);
			continue;
		}
		s->stats.steps++;
		sched_trace_fn trace = s->trace;
		void *trace_ctx = s->trace_ctx;
		int fail = s->test_fail > 0;
		if (fail)
			s->test_fail--;
		sched_step_info info = {s->stats.steps, b.n_tok, s->n_bseq, s->t_seqs, admitted, preempted,
					s->stats.kv_pages_used};
		pthread_mutex_unlock(&s->mu);

		ds_err_clear(&err);
		int rc = trace ? trace(trace_ctx, &info) : DS_OK;
		if (rc)
			ds_err_set(&err, rc, "step %llu failed by the trace hook (fault injection)",
				   (unsigned long long)info.step);
		else if (fail)
			rc = ds_err_set(&err, DS_EINTERNAL,
					"step %llu failed by test fault injection",
					(unsigned long long)info.step);
		else
			rc = model_forward(s->m, &b, s->logits, &err);
		if (rc == DS_OK)
			sample_all(s);

		pthread_mutex_lock(&s->mu);
		if (rc == DS_OK) {
			publish(s);
		} else {
			log_warn("sched", "forward step failed", "tokens=%d seqs=%d err=\"%s\"", b.n_tok,
				 s->n_bseq, err.msg);
			for (int i = 0; i < s->n_bseq; i++)
				finish(s, s->b_seqs[i], SCHED_FIN_ERROR, err.msg[0] ? err.msg : ds_status_name(rc));
		}
		sync_stats(s);
	}
	s->stats.alive = 0;
	pthread_mutex_unlock(&s->mu);
	return NULL;
}

/* ---- public API ---- */

static int init_cond_monotonic(pthread_cond_t *cv)
{
	pthread_condattr_t a;
	if (pthread_condattr_init(&a))
		return -1;
	int rc = pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
	if (!rc)
		rc = pthread_cond_init(cv, &a);
	pthread_condattr_destroy(&a);
	return rc ? -1 : 0;
}

static void free_buffers(sched *s)
{
	free(s->model_eos);
	free(s->free_slots);
	free(s->tables);
	free(s->b_tok);
	free(s->b_pos);
	free(s->b_seq);
	free(s->b_want);
	free(s->b_seqs);
	free(s->logits);
	free(s->scratch);
	free(s->t_seqs);
	s->model_eos = NULL;
	s->free_slots = NULL;
	s->tables = s->b_tok = s->b_pos = s->b_seq = NULL;
	s->b_want = NULL;
	s->b_seqs = NULL;
	s->logits = s->scratch = NULL;
	s->t_seqs = NULL;
}

sched *sched_new(model *m, const sched_params *p, ds_err *err)
{
	const int bt = model_max_batch_tokens(m);
	const kv_params *kp = kv_cache_params(model_kv(m));
	if (p->max_running < 0 || p->max_waiting < 0 || p->token_budget < 0 || p->prefill_chunk < 0) {
		ds_err_set(err, DS_EINVAL, "scheduler: max_running, max_waiting, token_budget and "
					   "prefill_chunk must be >= 0 (0 = default)");
		return NULL;
	}
	if (p->token_budget > bt) {
		ds_err_set(err, DS_EINVAL, "scheduler: token_budget %d exceeds the model's max_batch_tokens %d",
			   p->token_budget, bt);
		return NULL;
	}
	sched *s = calloc(1, sizeof *s);
	if (!s) {
		ds_err_set(err, DS_ENOMEM, "scheduler: out of memory");
		return NULL;
	}
	if (pthread_mutex_init(&s->mu, NULL)) {
		free(s);
		ds_err_set(err, DS_EINTERNAL, "scheduler: cannot create a mutex");
		return NULL;
	}
	if (pthread_cond_init(&s->work, NULL)) {
		pthread_mutex_destroy(&s->mu);
		free(s);
		ds_err_set(err, DS_EINTERNAL, "scheduler: cannot create a condition variable");
		return NULL;
	}
	s->refs = 1;
	s->m = m;
	s->kv = model_kv(m);
	s->V = model_vocab_size(m);
	s->max_ctx = model_max_ctx(m);
	s->page_size = kp->page_size;
	s->n_pages = kp->n_pages;
	s->max_blocks = (s->max_ctx + s->page_size - 1) / s->page_size;
	s->budget = p->token_budget ? p->token_budget : bt;
	s->chunk = p->prefill_chunk && p->prefill_chunk < s->budget ? p->prefill_chunk : s->budget;
	s->max_running = p->max_running ? p->max_running : s->n_pages / s->max_blocks;
	if (s->max_running < 1)
		s->max_running = 1;
	if (s->max_running > s->budget)
		s->max_running = s->budget;
	s->max_waiting = p->max_waiting ? p->max_waiting : DEFAULT_MAX_WAITING;
	s->prefix = p->prefix_caching != 0;

	const int *eos;
	s->n_model_eos = model_eos_ids(m, &eos);
	const size_t R = (size_t)s->max_running, B = (size_t)s->budget;
	s->model_eos = malloc((size_t)(s->n_model_eos + 1) * sizeof *s->model_eos);
	s->free_slots = malloc(R * sizeof *s->free_slots);
	s->tables = calloc(R * (size_t)s->max_blocks, sizeof *s->tables);
	s->b_tok = malloc(B * sizeof *s->b_tok);
	s->b_pos = malloc(B * sizeof *s->b_pos);
	s->b_seq = malloc(B * sizeof *s->b_seq);
	s->b_want = malloc(B);
	s->b_seqs = malloc(R * sizeof *s->b_seqs);
	s->logits = malloc(R * (size_t)s->V * sizeof *s->logits);
	s->scratch = malloc((size_t)s->V * sizeof *s->scratch);
	s->t_seqs = malloc(R * sizeof *s->t_seqs);
	if (!s->model_eos || !s->free_slots || !s->tables || !s->b_tok || !s->b_pos || !s->b_seq ||
	    !s->b_want || !s->b_seqs || !s->logits || !s->scratch || !s->t_seqs) {
		ds_err_set(err, DS_ENOMEM, "scheduler: out of memory for %d sequences x %d logits",
			   s->max_running, s->V);
		goto fail;
	}
	for (int i = 0; i < s->n_model_eos; i++)
		s->model_eos[i] = eos[i];
	for (int i = 0; i < s->max_running; i++)
		s->free_slots[i] = s->max_running - 1 - i;
	s->n_free_slots = s->max_running;
	s->stats.kv_pages_total = s->n_pages;
	s->stats.alive = 1;
	sync_stats(s);
	if (pthread_create(&s->thread, NULL, step_main, s)) {
		ds_err_set(err, DS_EINTERNAL, "scheduler: cannot start the step thread");
		goto fail;
	}
	s->started = 1;
	log_info("sched", "scheduler started", "max_running=%d max_waiting=%d token_budget=%d "
		 "prefill_chunk=%d pages=%d page_size=%d prefix_caching=%s", s->max_running,
		 s->max_waiting, s->budget, s->chunk, s->n_pages, s->page_size,
		 s->prefix ? "on" : "off");
	return s;
fail:
	free_buffers(s);
	sched_destroy(s);
	return NULL;
}

void sched_free(sched *s)
{
	if (!s)
		return;
	pthread_mutex_lock(&s->mu);
	s->stop = 1;
	pthread_cond_signal(&s->work);
	pthread_mutex_unlock(&s->mu);
	if (s->started)
		pthread_join(s->thread, NULL);

	pthread_mutex_lock(&s->mu);
	while (s->running.head)
		finish(s, s->running.head, SCHED_FIN_ABORT, NULL);
	while (s->waiting.head)
		finish(s, s->waiting.head, SCHED_FIN_ABORT, NULL);
	sync_stats(s);
	free_buffers(s);
	s->m = NULL;
	s->kv = NULL;
	int last = --s->refs == 0;
	pthread_mutex_unlock(&s->mu);
	if (last)
		sched_destroy(s);
}

/* Checks r against the model and the pool (sched.h lists the refusals). */
static int check_req(const sched *s, const sched_req *r, ds_err *err)
{
	if (r->n_prompt < 1 || !r->prompt)
		return ds_err_set(err, DS_EINVAL, "the prompt is empty");
	if (r->max_tokens < 1)
		return ds_err_set(err, DS_EINVAL, "max_tokens must be >= 1, got %d", r->max_tokens);
	if ((int64_t)r->n_prompt + r->max_tokens > s->max_ctx)
		return ds_err_set(err, DS_EINVAL, "prompt (%d tokens) + max_tokens (%d) exceed the context of %d",
				  r->n_prompt, r->max_tokens, s->max_ctx);
	/* the last sampled id is never fed, so n_prompt + max_tokens - 1 positions */
	int64_t pages = ((int64_t)r->n_prompt + r->max_tokens - 1 + s->page_size - 1) / s->page_size;
	if (pages > s->n_pages)
		return ds_err_set(err, DS_EINVAL, "prompt (%d tokens) + max_tokens (%d) need %lld KV pages; "
						  "the cache has %d of %d positions",
				  r->n_prompt, r->max_tokens, (long long)pages, s->n_pages, s->page_size);
	for (int32_t i = 0; i < r->n_prompt; i++)
		if (r->prompt[i] < 0 || r->prompt[i] >= s->V)
			return ds_err_set(err, DS_EINVAL, "prompt token %d is id %d: the vocabulary has ids 0..%d",
					  i, r->prompt[i], s->V - 1);
	if (r->n_eos_ids < 0 || (r->n_eos_ids && !r->eos_ids) || r->n_stop_ids < 0 ||
	    (r->n_stop_ids && !r->stop_ids))
		return ds_err_set(err, DS_EINVAL, "eos_ids / stop_ids: a count without ids");
	if (r->top_logprobs < 0 || r->top_logprobs > SCHED_MAX_TOP_LOGPROBS)
		return ds_err_set(err, DS_EINVAL, "top_logprobs must be in [0, %d], got %d",
				  SCHED_MAX_TOP_LOGPROBS, r->top_logprobs);
	if (r->top_logprobs && !r->logprobs)
		return ds_err_set(err, DS_EINVAL, "top_logprobs (%d) needs logprobs", r->top_logprobs);
	int rc = smp_params_check(&r->sampling, err);
	return rc ? rc : DS_OK;
}

static int32_t *dup_ids(const int32_t *ids, int n)
{
	int32_t *d = malloc((size_t)(n > 0 ? n : 1) * sizeof *d);
	if (d && n > 0)
		memcpy(d, ids, (size_t)n * sizeof *d);
	return d;
}

sched_seq *sched_submit(sched *s, const sched_req *r, ds_err *err)
{
	if (check_req(s, r, err) != DS_OK)
		return NULL;
	sched_seq *q = calloc(1, sizeof *q);
	if (!q || init_cond_monotonic(&q->cv)) {
		free(q);
		ds_err_set(err, DS_ENOMEM, "scheduler: out of memory for a request");
		return NULL;
	}
	const size_t total = (size_t)r->n_prompt + (size_t)r->max_tokens;
	q->s = s;
	q->slot = -1;
	q->n_prompt = r->n_prompt;
	q->max_tokens = r->max_tokens;
	q->ignore_eos = r->ignore_eos != 0;
	q->n_eos = q->ignore_eos ? 0 : r->n_eos_ids;
	q->n_stop = r->n_stop_ids;
	q->logprobs = r->logprobs != 0;
	q->top_logprobs = q->logprobs ? r->top_logprobs : 0;
	q->toks = malloc(total * sizeof *q->toks);
	q->eos = dup_ids(r->eos_ids, q->n_eos);
	q->stop = dup_ids(r->stop_ids, q->n_stop);
	q->kv.blocks = malloc((size_t)s->max_blocks * sizeof *q->kv.blocks);
	q->kv.cap = s->max_blocks;
	int ok = q->toks && q->eos && q->stop && q->kv.blocks;
	if (q->logprobs) {
		size_t nt = (size_t)r->max_tokens * (size_t)(q->top_logprobs ? q->top_logprobs : 1);
		q->lp = malloc((size_t)r->max_tokens * sizeof *q->lp);
		q->top_id = malloc(nt * sizeof *q->top_id);
		q->top_lp = malloc(nt * sizeof *q->top_lp);
		ok = ok && q->lp && q->top_id && q->top_lp;
	}
	if (ok && !(q->smp = smp_new(&r->sampling, s->V, err))) {
		seq_destroy(q);
		return NULL;
	}
	if (!ok) {
		seq_destroy(q);
		ds_err_set(err, DS_ENOMEM, "scheduler: out of memory for a request of %zu tokens", total);
		return NULL;
	}
	memcpy(q->toks, r->prompt, (size_t)r->n_prompt * sizeof *q->toks);
	smp_add_prompt(q->smp, r->prompt, r->n_prompt);
	q->refs = 2; /* the consumer and the scheduler */

	pthread_mutex_lock(&s->mu);
	if (s->stop || s->waiting.n >= s->max_waiting) {
		int stopping = s->stop, n = s->waiting.n;
		pthread_mutex_unlock(&s->mu);
		seq_destroy(q);
		if (stopping)
			ds_err_set(err, DS_EBUSY, "scheduler: shutting down");
		else
			ds_err_set(err, DS_EBUSY, "scheduler: %d requests are waiting already (max_waiting %d)",
				   n, s->max_waiting);
		return NULL;
	}
	s->refs++;
	q->times.submitted = ds_now_s();
	q->state = ST_WAITING;
	list_push_back(&s->waiting, q);
	s->stats.waiting = s->waiting.n;
	pthread_cond_signal(&s->work);
	pthread_mutex_unlock(&s->mu);
	return q;
}

static void copy_tok(const sched_seq *q, int32_t i, sched_tok *t)
{
	t->id = q->toks[q->n_prompt + i];
	t->logprob = q->logprobs ? q->lp[i] : 0.0f;
	t->n_top = q->top_logprobs;
	for (int j = 0; j < q->top_logprobs; j++) {
		t->top_id[j] = q->top_id[(int64_t)i * q->top_logprobs + j];
		t->top_logprob[j] = q->top_lp[(int64_t)i * q->top_logprobs + j];
	}
}

int sched_seq_next(sched_seq *q, sched_tok *out, int max, int timeout_ms, sched_finish *finish_out)
{
	sched *s = q->s;
	struct timespec dl;
	if (timeout_ms > 0) {
		clock_gettime(CLOCK_MONOTONIC, &dl);
		dl.tv_sec += timeout_ms / 1000;
		dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
		if (dl.tv_nsec >= 1000000000L) {
			dl.tv_sec++;
			dl.tv_nsec -= 1000000000L;
		}
	}
	pthread_mutex_lock(&s->mu);
	while (q->n_taken == q->n_pub && q->fin == SCHED_RUNNING && timeout_ms != 0) {
		if (timeout_ms < 0)
			pthread_cond_wait(&q->cv, &s->mu);
		else if (pthread_cond_timedwait(&q->cv, &s->mu, &dl) == ETIMEDOUT)
			break;
	}
	int n = 0;
	while (n < max && q->n_taken < q->n_pub)
		copy_tok(q, q->n_taken++, &out[n++]);
	*finish_out = q->n_taken == q->n_pub ? q->fin : SCHED_RUNNING;
	pthread_mutex_unlock(&s->mu);
	return n;
}

void sched_seq_cancel(sched_seq *q)
{
	sched *s = q->s;
	pthread_mutex_lock(&s->mu);
	if (q->state != ST_DONE && !q->cancel) {
		q->cancel = 1;
		pthread_cond_signal(&s->work);
	}
	pthread_mutex_unlock(&s->mu);
}

void sched_seq_release(sched_seq *q)
{
	if (!q)
		return;
	sched *s = q->s;
	pthread_mutex_lock(&s->mu);
	if (q->state != ST_DONE && !q->cancel) {
		q->cancel = 1;
		pthread_cond_signal(&s->work);
	}
	int last = seq_unref(s, q);
	pthread_mutex_unlock(&s->mu);
	if (last)
		sched_destroy(s);
}

const char *sched_seq_error(sched_seq *q)
{
	sched *s = q->s;
	pthread_mutex_lock(&s->mu);
	const char *msg = q->fin == SCHED_FIN_ERROR ? q->errmsg : "";
	pthread_mutex_unlock(&s->mu);
	return msg;
}

sched_times sched_seq_times(sched_seq *q)
{
	sched *s = q->s;
	pthread_mutex_lock(&s->mu);
	sched_times t = q->times;
	pthread_mutex_unlock(&s->mu);
	return t;
}

void sched_get_stats(sched *s, sched_stats *out)
{
	pthread_mutex_lock(&s->mu);
	*out = s->stats;
	pthread_mutex_unlock(&s->mu);
}

void sched_test_fail_steps(sched *s, int n)
{
	pthread_mutex_lock(&s->mu);
	s->test_fail = n > 0 ? n : 0;
	pthread_mutex_unlock(&s->mu);
}

void sched_set_trace(sched *s, sched_trace_fn fn, void *ctx)
{
	pthread_mutex_lock(&s->mu);
	s->trace = fn;
	s->trace_ctx = ctx;
	pthread_mutex_unlock(&s->mu);
}

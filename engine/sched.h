/*
 * sched.h - the continuous-batching scheduler: many requests, one model.
 *
 * A request is a prompt (token ids) plus sampling and stopping rules.  The
 * scheduler owns a step thread that repeatedly builds one eng_batch from the
 * running sequences and calls model_forward:
 *
 *   submit ──> waiting (FIFO, bounded: max_waiting) ──admit──> running
 *   running: prefill in chunks (at most prefill_chunk tokens of one sequence
 *            per step), then one decode token per step
 *   finish:  eos (unless ignore_eos) / stop id / max_tokens / context full
 *            / cancel  ──> pages freed, event queued, sequence leaves
 *
 * Step composition, under a token budget (token_budget <= the model's
 * max_batch_tokens): first one decode token for every running sequence that
 * has finished its prefill (so decoding never stalls behind a long prompt),
 * then prefill chunks of running sequences in admission order, then newly
 * admitted waiting requests while budget, max_running and free pages last.
 * Admission is page-aware: a request is admitted only when the pages for its
 * next chunk are free.  When a decoding sequence needs a page and none is
 * free, the most recently admitted running sequence is preempted: its pages
 * are freed and it goes back to the front of the waiting queue with the
 * tokens it generated so far appended to its prompt (recompute); its consumer
 * sees nothing of this except a later token.
 *
 * Prefix caching (prefix_caching = 1; engine/kv.h): every full page a
 * sequence computes is published with its token ids, and stays in the cache
 * after the sequence ends until its page is needed (LRU).  At admission a
 * sequence takes the longest chain of cached pages that holds the start of
 * its ids (prompt, plus the generated ids when it resumes after a
 * preemption) and its prefill starts at the first position past them.  At
 * least its last id is always computed, for its logits: the match looks at
 * the first n - 1 ids only, so a prompt whose every page is cached
 * recomputes its last page.  Admission counts cached unreferenced pages as
 * free and the matched ones as held.
 *
 * Consumers (HTTP threads) read events from their sched_seq: a blocking,
 * bounded-wait queue of generated tokens, then one finish reason.  A consumer
 * that goes away calls sched_seq_cancel / sched_seq_release; the sequence's
 * pages are freed at the start of the next step.
 *
 * Threading: sched_submit, sched_seq_*, sched_get_stats and sched_set_trace
 * are thread-safe (one mutex; the step thread holds it only to move requests
 * and post events, never during model_forward).  The model belongs to the
 * step thread after sched_new until sched_free.
 */
#ifndef DS_ENGINE_SCHED_H
#define DS_ENGINE_SCHED_H

#include "common/status.h"
#include "engine/model.h"
#include "engine/sampler.h"

#include <stdint.h>

#define SCHED_MAX_TOP_LOGPROBS 20

typedef struct sched_params {
	int max_running;   /* sequences with KV pages at once; 0 = as many full-context
			    * sequences as the KV pool holds (n_pages / pages per max_ctx,
			    * at least 1; the model's max_seqs unless n_pages or kv_bytes
			    * was set); never more than token_budget, so that every
			    * running sequence can decode in every step */
	int max_waiting;   /* queued requests; beyond it sched_submit says DS_EBUSY; 0 = 256 */
	int token_budget;  /* tokens per step; 0 = the model's max_batch_tokens (never more) */
	int prefill_chunk; /* prefill tokens of one sequence per step; 0 (or more than
			    * token_budget) = token_budget */
	int prefix_caching; /* 1: automatic prefix caching (below); 0: off */
} sched_params;

typedef struct sched_req {
	const int32_t *prompt; /* copied by sched_submit */
	int32_t n_prompt;      /* >= 1, and n_prompt + max_tokens <= the model's max_ctx */
	smp_params sampling;
	int32_t max_tokens;    /* >= 1 */
	int ignore_eos;        /* generate past the eos ids */
	const int32_t *eos_ids;  /* end-of-turn ids besides the model's (copied; ignored
				  * with ignore_eos), e.g. the chat template's <|im_end|> */
	int n_eos_ids;
	const int32_t *stop_ids; /* always stop on these (copied) */
	int n_stop_ids;
	int logprobs;          /* 1: report each sampled token's log-probability */
	int top_logprobs;      /* 0..SCHED_MAX_TOP_LOGPROBS alternatives (needs logprobs) */
} sched_req;

/* One generated token.  Log-probabilities are of the model's distribution
 * (log-softmax of the raw logits, before penalties and temperature), as
 * vLLM reports them by default. */
typedef struct sched_tok {
	int32_t id;
	float logprob;
	int n_top;
	int32_t top_id[SCHED_MAX_TOP_LOGPROBS]; /* most likely first */
	float top_logprob[SCHED_MAX_TOP_LOGPROBS];
} sched_tok;

typedef enum sched_finish {
	SCHED_RUNNING = 0,
	SCHED_FIN_STOP,   /* an eos or stop id (the id is the last token delivered) */
	SCHED_FIN_LENGTH, /* max_tokens or the context is full */
	SCHED_FIN_ABORT,  /* cancelled, or the scheduler shut down */
	SCHED_FIN_ERROR,  /* the forward step failed (message in sched_seq_error) */
} sched_finish;

typedef struct sched_stats {
	int running, waiting;
	int kv_pages_total, kv_pages_used;
	uint64_t preemptions;  /* since start */
	uint64_t steps;
	uint64_t prompt_tokens, generation_tokens; /* computed, since start */
	/* prefix caching, in tokens since start: ids looked up at each admission
	 * (re-admissions after a preemption too) and of them those found cached */
	uint64_t prefix_queries, prefix_hits;
	int kv_pages_cached;   /* published pages (in use or evictable) */
	int alive;             /* 0 once the step thread died */
} sched_stats;

typedef struct sched_times {
	double submitted, admitted, first_token, finished; /* ds_now_s(); 0 = not yet */
} sched_times;

typedef struct sched sched;
typedef struct sched_seq sched_seq;

/* Starts the step thread.  m stays owned by the caller but must not be used
 * by anyone else until sched_free.  DS_EINVAL for params out of range (the
 * message names the field), DS_ENOMEM, DS_EINTERNAL when no thread starts. */
sched *sched_new(model *m, const sched_params *p, ds_err *err);
/* Stops the step thread; every unfinished sequence ends with SCHED_FIN_ABORT.
 * Sequences not yet released stay valid (their queued tokens, then the
 * finish, can still be read) until sched_seq_release; nothing else may be
 * called on s afterwards. */
void sched_free(sched *s);

/* Queues a request.  NULL with err: DS_EBUSY when the waiting queue is full,
 * DS_EINVAL for a request that can never run (empty prompt, a token id
 * outside the vocabulary, prompt + max_tokens over the context or over the
 * whole KV pool, bad sampling params, top_logprobs without logprobs: the
 * message names the field and the numbers), DS_ENOMEM. */
sched_seq *sched_submit(sched *s, const sched_req *r, ds_err *err);

/* Takes up to max generated tokens, waiting up to timeout_ms for the first
 * (0 = do not wait, < 0 = no limit).  Returns how many it took (>= 0);
 * *finish is SCHED_RUNNING, or the finish reason once every token was taken
 * (the wait ends early at the finish too).  The last token and the finish
 * are posted together, so a SCHED_FIN_STOP comes with the call that returns
 * the stopping id (as its last token). */
int sched_seq_next(sched_seq *q, sched_tok *out, int max, int timeout_ms, sched_finish *finish);
/* Asks the step thread to stop the sequence (finish SCHED_FIN_ABORT unless it
 * already finished).  Idempotent. */
void sched_seq_cancel(sched_seq *q);
/* The consumer is done: cancels if unfinished and drops its reference.  The
 * pointer is invalid afterwards. */
void sched_seq_release(sched_seq *q);
/* Message of a SCHED_FIN_ERROR finish ("" otherwise; valid until release). */
const char *sched_seq_error(sched_seq *q);
sched_times sched_seq_times(sched_seq *q);

void sched_get_stats(sched *s, sched_stats *out);

/* ---- step trace (tests and metrics) ---- */

typedef struct sched_step_seq {
	const sched_seq *seq; /* identity only: compare, never dereference */
	int32_t n_tok;        /* its tokens in the step */
	int32_t pos;          /* position of the first of them */
	int decode;           /* 1: its one last known id, planned with the decodes
			       * (also a prompt's 1-token last chunk) */
	int sample;           /* 1: its last token's logits are sampled this step */
} sched_step_seq;

typedef struct sched_step_info {
	uint64_t step;        /* 1, 2, ... */
	int n_tok;            /* tokens in the step (<= token_budget) */
	int n_seq;            /* entries in seqs: decodes first, then prefill chunks */
	const sched_step_seq *seqs;
	int admitted;         /* sequences admitted (or re-admitted) by this step */
	int preempted;        /* sequences preempted while composing it */
	int kv_pages_used;    /* after composing it */
} sched_step_info;

/* Returns 0, or a DS_E* code to fail the step as a model_forward failure
 * would (fault injection for tests). */
typedef int (*sched_trace_fn)(void *ctx, const sched_step_info *info);

/* fn (NULL = none) is called on the step thread for every step, after the
 * step is composed and before model_forward, without the scheduler's lock;
 * info is valid during the call.  fn must not call into the scheduler (it
 * may block: tests use that to hold the step thread still). */
void sched_set_trace(sched *s, sched_trace_fn fn, void *ctx);

/* TEST ONLY (dsagent --test-fault-injection): the next n steps fail as a
 * model_forward failure would (every sequence in them ends with an error);
 * n <= 0 cancels what is left. */
void sched_test_fail_steps(sched *s, int n);

#endif

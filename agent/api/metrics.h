/*
 * metrics.h - the serving metrics, rendered as Prometheus text on /metrics.
 *
 * Names follow vLLM's (prefix "vllm:", label model_name) so existing
 * dashboards and autoscalers read them unchanged; see docs/serving.md for
 * the list.  Gauges (running, waiting, KV usage) are read from the scheduler
 * when rendering; counters and histograms are recorded here.
 * Thread rule: every function is thread-safe (one mutex).
 */
#ifndef DS_AGENT_METRICS_H
#define DS_AGENT_METRICS_H

#include "common/buf.h"
#include "engine/sched.h"

typedef enum metrics_hist {
	MET_TTFT,           /* time_to_first_token_seconds */
	MET_ITL,            /* inter_token_latency_seconds */
	MET_E2E,            /* e2e_request_latency_seconds */
	MET_QUEUE,          /* request_queue_time_seconds */
	MET_PROMPT_TOKENS,  /* request_prompt_tokens */
	MET_GEN_TOKENS,     /* request_generation_tokens */
	MET_N_HIST
} metrics_hist;

typedef enum metrics_reason { /* request_success_total{finished_reason} */
	MET_FIN_STOP,
	MET_FIN_LENGTH,
	MET_FIN_ABORT,
	MET_FIN_ERROR,
	MET_N_FIN
} metrics_reason;

typedef enum metrics_reject { /* dsagent:rejected_requests_total{reason} */
	MET_REJ_AUTH,
	MET_REJ_RATE_LIMIT,
	MET_REJ_QUEUE_FULL,
	MET_REJ_BAD_REQUEST,
	MET_N_REJ
} metrics_reject;

typedef struct metrics metrics;

metrics *metrics_new(const char *model_name);
void metrics_free(metrics *m);
/* The model label from now on (a deployment changed the served model). */
void metrics_set_model(metrics *m, const char *model_name);

void metrics_observe(metrics *m, metrics_hist h, double v);
void metrics_finished(metrics *m, metrics_reason r, uint64_t prompt_tokens, uint64_t gen_tokens);
void metrics_rejected(metrics *m, metrics_reject r);

/* Appends the exposition text (gauges from st, may be NULL while loading). */
int metrics_render(metrics *m, const sched_stats *st, buf *out);

#endif

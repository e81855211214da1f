/*
 * metrics.c - counters and fixed-bucket histograms in Prometheus text format
 * (see metrics.h).  Called from HTTP threads (recording) and the /metrics
 * handler (rendering); one mutex guards everything.  Buckets are vLLM's so a
 * dashboard's histogram_quantile() gives the same resolution.
 */
#include "agent/api/metrics.h"
#include "common/status.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_BUCKETS 24

typedef struct hist_def {
	const char *name, *help;
	int n;
	double le[MAX_BUCKETS];
} hist_def;

static const hist_def hists[MET_N_HIST] = {
	[MET_TTFT] = {
		.name = "time_to_first_token_seconds",
		.help = "Time to first token in seconds.",
		.n = 19,
		.le = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
		       1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0},
	},
	[MET_ITL] = {
		.name = "inter_token_latency_seconds",
		.help = "Time between output tokens in seconds.",
		.n = 18,
		.le = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
		       2.5, 5.0, 7.5, 10.0, 20.0, 40.0},
	},
	[MET_E2E] = {
		.name = "e2e_request_latency_seconds",
		.help = "End-to-end request latency in seconds.",
		.n = 20,
		.le = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
		       50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0},
	},
	[MET_QUEUE] = {
		.name = "request_queue_time_seconds",
		.help = "Time spent waiting in the queue in seconds.",
		.n = 20,
		.le = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
		       50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0},
	},
	[MET_PROMPT_TOKENS] = {
		.name = "request_prompt_tokens",
		.help = "Prompt tokens per request.",
		.n = 16,
		.le = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
		       50000, 100000},
	},
	[MET_GEN_TOKENS] = {
		.name = "request_generation_tokens",
		.help = "Generated tokens per request.",
		.n = 16,
		.le = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
		       50000, 100000},
	},
};

static const char *const fin_names[MET_N_FIN] = {"stop", "length", "abort", "error"};
static const char *const rej_names[MET_N_REJ] = {"auth", "rate_limit", "queue_full",
						  "bad_request"};

typedef struct hist {
	uint64_t count[MAX_BUCKETS + 1]; /* per bucket; last = +Inf */
	double sum;
	uint64_t n;
} hist;

typedef struct counts {
	hist h[MET_N_HIST];
	uint64_t fin[MET_N_FIN];
	uint64_t rej[MET_N_REJ];
	uint64_t prompt_tokens, gen_tokens;
} counts;

struct metrics {
	pthread_mutex_t mu;
	char model[256];
	counts c;
};

/* a label value: keep it to characters that need no escaping */
static void label_set(char *out, size_t n, const char *name)
{
	size_t j = 0;
	for (const char *p = name; *p && j + 1 < n; p++)
		out[j++] = (*p == '"' || *p == '\\' || *p == '\n') ? '_' : *p;
	out[j] = 0;
}

metrics *metrics_new(const char *model_name)
{
	metrics *m = calloc(1, sizeof *m);
	if (!m)
		return NULL;
	pthread_mutex_init(&m->mu, NULL);
	label_set(m->model, sizeof m->model, model_name);
	return m;
}

void metrics_set_model(metrics *m, const char *model_name)
{
	pthread_mutex_lock(&m->mu);
	label_set(m->model, sizeof m->model, model_name);
	pthread_mutex_unlock(&m->mu);
}

void metrics_free(metrics *m)
{
	if (!m)
		return;
	pthread_mutex_destroy(&m->mu);
	free(m);
}

void metrics_observe(metrics *m, metrics_hist h, double v)
{
	const hist_def *d = &hists[h];
	int b = 0;
	while (b < d->n && v > d->le[b])
		b++;
	pthread_mutex_lock(&m->mu);
	m->c.h[h].count[b]++;
	m->c.h[h].sum += v;
	m->c.h[h].n++;
	pthread_mutex_unlock(&m->mu);
}

void metrics_finished(metrics *m, metrics_reason r, uint64_t prompt_tokens, uint64_t gen_tokens)
{
	pthread_mutex_lock(&m->mu);
	m->c.fin[r]++;
	m->c.prompt_tokens += prompt_tokens;
	m->c.gen_tokens += gen_tokens;
	pthread_mutex_unlock(&m->mu);
}

void metrics_rejected(metrics *m, metrics_reject r)
{
	pthread_mutex_lock(&m->mu);
	m->c.rej[r]++;
	pthread_mutex_unlock(&m->mu);
}

static int gauge(buf *o, const char *mn, const char *name, const char *help, double v)
{
	return buf_printf(o, "# HELP vllm:%s %s\n# TYPE vllm:%s gauge\nvllm:%s{model_name=\"%s\"} %.17g\n",
			  name, help, name, name, mn, v);
}

int metrics_render(metrics *m, const sched_stats *st, buf *o)
{
	int rc = 0;
	sched_stats zero = {0};
	if (!st)
		st = &zero;
	pthread_mutex_lock(&m->mu);
	counts snap = m->c; /* render from a copy: no formatting under the lock */
	char mn[sizeof m->model];
	memcpy(mn, m->model, sizeof mn);
	pthread_mutex_unlock(&m->mu);
	double kv = st->kv_pages_total ? (double)st->kv_pages_used / st->kv_pages_total : 0.0;
	rc |= gauge(o, mn, "num_requests_running", "Requests on the engine (prefill or decode).",
		    st->running);
	rc |= gauge(o, mn, "num_requests_waiting", "Requests waiting to be scheduled.",
		    st->waiting);
	rc |= gauge(o, mn, "kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).",
		    kv);
	rc |= buf_printf(o, "# HELP vllm:num_preemptions_total Preemptions (recompute).\n"
			    "# TYPE vllm:num_preemptions_total counter\n"
			    "vllm:num_preemptions_total{model_name=\"%s\"} %llu\n",
			 mn, (unsigned long long)st->preemptions);
	rc |= buf_printf(o, "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens "
			    "(the prompt tokens looked up at each admission).\n"
			    "# TYPE vllm:prefix_cache_queries_total counter\n"
			    "vllm:prefix_cache_queries_total{model_name=\"%s\"} %llu\n",
			 mn, (unsigned long long)st->prefix_queries);
	rc |= buf_printf(o, "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens "
			    "(prompt tokens found in cached KV pages).\n"
			    "# TYPE vllm:prefix_cache_hits_total counter\n"
			    "vllm:prefix_cache_hits_total{model_name=\"%s\"} %llu\n",
			 mn, (unsigned long long)st->prefix_hits);
	rc |= gauge(o, mn, "gpu_prefix_cache_hit_rate",
		    "Prefix cache hit rate since start: hits / queries, in tokens (0 before any query).",
		    st->prefix_queries ? (double)st->prefix_hits / (double)st->prefix_queries : 0.0);
	rc |= buf_printf(o, "# HELP vllm:prompt_tokens_total Prompt tokens of finished requests.\n"
			    "# TYPE vllm:prompt_tokens_total counter\n"
			    "vllm:prompt_tokens_total{model_name=\"%s\"} %llu\n",
			 mn, (unsigned long long)snap.prompt_tokens);
	rc |= buf_printf(o, "# HELP vllm:generation_tokens_total Generated tokens of finished requests.\n"
			    "# TYPE vllm:generation_tokens_total counter\n"
			    "vllm:generation_tokens_total{model_name=\"%s\"} %llu\n",
			 mn, (unsigned long long)snap.gen_tokens);
	rc |= buf_printf(o, "# HELP vllm:request_success_total Finished requests by reason.\n"
			    "# TYPE vllm:request_success_total counter\n");
	for (int r = 0; r < MET_N_FIN; r++)
		rc |= buf_printf(o,
				 "vllm:request_success_total{finished_reason=\"%s\",model_name=\"%s\"} %llu\n",
				 fin_names[r], mn, (unsigned long long)snap.fin[r]);
	rc |= buf_printf(o, "# HELP dsagent:rejected_requests_total Requests refused before "
			    "generation, by reason.\n# TYPE dsagent:rejected_requests_total counter\n");
	for (int r = 0; r < MET_N_REJ; r++)
		rc |= buf_printf(o,
				 "dsagent:rejected_requests_total{reason=\"%s\",model_name=\"%s\"} %llu\n",
				 rej_names[r], mn, (unsigned long long)snap.rej[r]);
	for (int h = 0; h < MET_N_HIST; h++) {
		const hist_def *d = &hists[h];
		const hist *x = &snap.h[h];
		rc |= buf_printf(o, "# HELP vllm:%s %s\n# TYPE vllm:%s histogram\n", d->name, d->help,
				 d->name);
		uint64_t cum = 0;
		for (int b = 0; b <= d->n; b++) {
			cum += x->count[b];
			if (b < d->n)
				rc |= buf_printf(o, "vllm:%s_bucket{le=\"%g\",model_name=\"%s\"} %llu\n",
						 d->name, d->le[b], mn, (unsigned long long)cum);
			else
				rc |= buf_printf(o, "vllm:%s_bucket{le=\"+Inf\",model_name=\"%s\"} %llu\n",
						 d->name, mn, (unsigned long long)cum);
		}
		rc |= buf_printf(o, "vllm:%s_sum{model_name=\"%s\"} %.17g\nvllm:%s_count{model_name=\"%s\"} %llu\n",
				 d->name, mn, x->sum, d->name, mn, (unsigned long long)x->n);
	}
	return rc ? DS_ERANGE : DS_OK;
}

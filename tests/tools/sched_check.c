/*
 * sched_check.c - drives engine/sched.c on a real checkpoint for
 * tests/integration/test_sched.py and prints one JSON object of results.
 *
 *   sched_check MODEL [engine and scheduler flags] --requests FILE [mode]
 *
 * Engine: --threads N, --ctx N (max_ctx, 0 = the model's, at most 4096), --batch-tokens N
 * (model max_batch_tokens, default 64), --page-size N (default 16),
 * --pages N (0 = enough for --max-seqs full sequences), --max-seqs N (8).
 * Scheduler: --max-running N, --max-waiting N, --budget N, --chunk N (0 =
 * the scheduler's defaults), --prefix-caching (sched_params.prefix_caching;
 * --alone runs get a fresh scheduler, so an empty cache, each).
 *
 * FILE is a JSON array of requests: {"prompt": [ids], "max_tokens": N,
 * "temperature": T (0), "seed": S, "top_k", "top_p", "repetition_penalty",
 * "ignore_eos": bool, "eos_ids": [..], "stop_ids": [..], "logprobs": bool,
 * "top_logprobs": K, "cancel_after": N (the consumer cancels once it holds N
 * tokens), "release_after": N (the consumer releases, unfinished, at N)}.
 *
 * Modes (default: every request at once, one consumer thread each, each
 * thread submitting its own request):
 *   --ordered        the main thread submits all requests in file order
 *                    first (admission order = file order; the step thread
 *                    is held in step 1 until all are queued), then consumers
 *   --alone          also run each request alone through a fresh scheduler
 *                    ("alone" in the output)
 *   --fail-step N    the trace hook fails step N (fault injection)
 *   --free-after N   sched_free once some consumer holds N tokens, while
 *                    the requests are in flight; consumers read on
 *   --step-delay-us N  the trace hook sleeps N us per step (gives consumers
 *                    time to cancel mid-generation on a loaded machine)
 *   --busy           max_waiting check with the step thread held in its
 *                    first step: request 0 is admitted, then 0-based
 *                    submissions 1.. of request 0 until one is refused,
 *                    all cancelled before the step thread goes on;
 *                    "busy": {"codes": each submission's status, stats while
 *                    held before and after, "finish": each one's finish}
 *
 * Environment: DS_SCHED_PLAN="TP,PP,EP" runs the model through the distributed
 * driver (engine/driver.h) with that plan, its ranks `$DS_DSAGENT worker`:
 * the scheduler must run unchanged over it.  DS_SCHED_COMM_TIMEOUT_MS sets
 * the ranks' --comm-timeout-ms (with --step-delay-us beyond it: idle ranks).
 * DS_SCHED_REMOTE=1 starts every rank but 0 "elsewhere" (driver_launch's
 * start_remote): detached from this process by a double fork, as another
 * node's agent would run them, so the driver cannot wait for them.
 *
 * Output: {"results": [{"tokens", "finish" (stop|length|abort|error|
 * released|rejected), "error", "logprobs", "top": [[[id, lp], ..], ..]}],
 * "alone": [...], "remote_ranks" (DS_SCHED_REMOTE), "trace": [[step, n_tok, admitted, preempted, pages_used,
 * [[request, n_tok, pos, decode, sample], ..]], ..], "max_step_tokens",
 * "stats": {...} (after the run), "pages_used_after", "busy"}.
 * Exit 0 when the run completed (the test judges the results), 1 on errors.
 */
#include "common/jsonx.h"
#include "common/strutil.h"
#include "engine/driver.h"
#include "engine/model.h"
#include "engine/sched.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_REQ 64
#define MAX_IDS 4096
#define MAX_TRACE 100000

typedef struct req {
	sched_req r;
	int32_t prompt[MAX_IDS], eos[64], stop[64];
	int cancel_after, release_after;
} req;

typedef struct result {
	int32_t *toks;
	float *lp;
	int32_t (*top_id)[SCHED_MAX_TOP_LOGPROBS];
	float (*top_lp)[SCHED_MAX_TOP_LOGPROBS];
	int n, n_top;
	const char *finish;
	char error[DS_ERR_MSG_MAX];
} result;

/* the run shared with the trace hook and consumer threads */
static struct {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	sched *s;
	req *reqs;
	int n_req;
	sched_seq *seq_of[MAX_REQ]; /* live sequences, for the trace hook */
	result *res;
	json_t *trace;
	int n_trace, max_step_tokens, fail_step;
	int gate_closed, gate_entered; /* --busy */
	int free_after, progress_max;  /* --free-after */
	int step_delay_us;             /* --step-delay-us */
} g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void die(const char *what, const char *msg)
{
	fprintf(stderr, "sched_check: %s: %s\n", what, msg);
	exit(1);
}

static int trace_hook(void *ctx, const sched_step_info *info)
{
	pthread_mutex_lock(&g.mu);
	if (info->n_tok > g.max_step_tokens)
		g.max_step_tokens = info->n_tok;
	if (g.trace && g.n_trace < MAX_TRACE) {
		json_t *seqs = json_array();
		for (int i = 0; i < info->n_seq; i++) {
			const sched_step_seq *e = &info->seqs[i];
			int idx = -1;
			for (int k = 0; k < g.n_req; k++)
				if (g.seq_of[k] == e->seq)
					idx = k;
			json_array_append_new(seqs, json_pack("[iiiii]", idx, e->n_tok, e->pos, e->decode,
							      e->sample));
		}
		json_array_append_new(g.trace, json_pack("[IiiiiO]", (json_int_t)info->step, info->n_tok,
							 info->admitted, info->preempted,
							 info->kv_pages_used, seqs));
		json_decref(seqs);
		g.n_trace++;
	}
	if (g.gate_closed) { /* --busy: hold the step thread until the gate opens */
		g.gate_entered = 1;
		pthread_cond_broadcast(&g.cv);
		while (g.gate_closed)
			pthread_cond_wait(&g.cv, &g.mu);
	}
	int fail = g.fail_step > 0 && (uint64_t)g.fail_step == info->step;
	pthread_mutex_unlock(&g.mu);
	if (g.step_delay_us > 0)
		nanosleep(&(struct timespec){g.step_delay_us / 1000000, (long)(g.step_delay_us % 1000000) * 1000L},
			  NULL);
	return fail ? DS_EINTERNAL : DS_OK;
}

static const char *finish_name(sched_finish f)
{
	switch (f) {
	case SCHED_FIN_STOP: return "stop";
	case SCHED_FIN_LENGTH: return "length";
	case SCHED_FIN_ABORT: return "abort";
	case SCHED_FIN_ERROR: return "error";
	default: return "running";
	}
}

static sched_seq *submit(int i, ds_err *err)
{
	pthread_mutex_lock(&g.mu); /* the hook must see the pointer of every step's sequence */
	sched_seq *q = sched_submit(g.s, &g.reqs[i].r, err);
	g.seq_of[i] = q;
	pthread_mutex_unlock(&g.mu);
	return q;
}

static void forget(int i)
{
	pthread_mutex_lock(&g.mu);
	g.seq_of[i] = NULL;
	pthread_mutex_unlock(&g.mu);
}

/* Reads request i's sequence to its end (or to release_after). */
static void consume(int i, sched_seq *q)
{
	const req *rq = &g.reqs[i];
	result *o = &g.res[i];
	int cancelled = 0;
	sched_tok t[8];
	sched_finish fin = SCHED_RUNNING;
	while (fin == SCHED_RUNNING) {
		int n = sched_seq_next(q, t, 8, -1, &fin);
		for (int k = 0; k < n && o->n < rq->r.max_tokens; k++, o->n++) {
			o->toks[o->n] = t[k].id;
			o->lp[o->n] = t[k].logprob;
			o->n_top = t[k].n_top;
			memcpy(o->top_id[o->n], t[k].top_id, sizeof t[k].top_id);
			memcpy(o->top_lp[o->n], t[k].top_logprob, sizeof t[k].top_logprob);
		}
		pthread_mutex_lock(&g.mu);
		if (o->n > g.progress_max) {
			g.progress_max = o->n;
			pthread_cond_broadcast(&g.cv);
		}
		pthread_mutex_unlock(&g.mu);
		if (rq->release_after > 0 && o->n >= rq->release_after && fin == SCHED_RUNNING) {
			forget(i);
			sched_seq_release(q);
			o->finish = "released";
			return;
		}
		if (rq->cancel_after > 0 && o->n >= rq->cancel_after && !cancelled) {
			sched_seq_cancel(q);
			cancelled = 1;
		}
	}
	o->finish = finish_name(fin);
	ds_strlcpy(o->error, sched_seq_error(q), sizeof o->error);
	forget(i);
	sched_seq_release(q);
}

static sched_seq *pre[MAX_REQ]; /* --ordered: submitted by the main thread */

static void *consumer_main(void *arg)
{
	int i = (int)(intptr_t)arg;
	ds_err err = {0};
	sched_seq *q = pre[i] ? pre[i] : submit(i, &err);
	if (!q) {
		g.res[i].finish = "rejected";
		ds_strlcpy(g.res[i].error, err.msg, sizeof g.res[i].error);
		return NULL;
	}
	consume(i, q);
	return NULL;
}

static void wait_idle(sched *s)
{
	for (int i = 0; i < 20000; i++) { /* up to 20 s */
		sched_stats st;
		sched_get_stats(s, &st);
		if (st.running == 0 && st.waiting == 0)
			return;
		nanosleep(&(struct timespec){0, 1000000}, NULL);
	}
	die("wait", "the scheduler did not become idle in 20 s");
}

static json_t *stats_json(const sched_stats *st)
{
	return json_pack("{s:i,s:i,s:i,s:i,s:I,s:I,s:I,s:I,s:i,s:I,s:I,s:i}", "running",
			 st->running, "waiting", st->waiting, "kv_pages_total", st->kv_pages_total,
			 "kv_pages_used", st->kv_pages_used, "preemptions", (json_int_t)st->preemptions,
			 "steps", (json_int_t)st->steps, "prompt_tokens", (json_int_t)st->prompt_tokens,
			 "generation_tokens", (json_int_t)st->generation_tokens, "alive", st->alive,
			 "prefix_queries", (json_int_t)st->prefix_queries, "prefix_hits",
			 (json_int_t)st->prefix_hits, "kv_pages_cached", st->kv_pages_cached);
}

static json_t *results_json(const result *res, int n)
{
	json_t *a = json_array();
	for (int i = 0; i < n; i++) {
		const result *o = &res[i];
		json_t *toks = json_array(), *lp = json_array(), *top = json_array();
		for (int k = 0; k < o->n; k++) {
			json_array_append_new(toks, json_integer(o->toks[k]));
			json_array_append_new(lp, json_real(o->lp[k]));
			json_t *row = json_array();
			for (int j = 0; j < o->n_top; j++)
				json_array_append_new(row, json_pack("[if]", o->top_id[k][j], (double)o->top_lp[k][j]));
			json_array_append_new(top, row);
		}
		json_array_append_new(a, json_pack("{s:o,s:s,s:s,s:o,s:o}", "tokens", toks, "finish",
						   o->finish ? o->finish : "?", "error", o->error, "logprobs", lp,
						   "top", top));
	}
	return a;
}

static void results_alloc(result *res, int n)
{
	for (int i = 0; i < n; i++) {
		size_t m = (size_t)g.reqs[i].r.max_tokens;
		res[i] = (result){0};
		res[i].toks = calloc(m, sizeof *res[i].toks);
		res[i].lp = calloc(m, sizeof *res[i].lp);
		res[i].top_id = calloc(m, sizeof *res[i].top_id);
		res[i].top_lp = calloc(m, sizeof *res[i].top_lp);
		if (!res[i].toks || !res[i].lp || !res[i].top_id || !res[i].top_lp)
			die("results", "out of memory");
	}
}

static void results_free(result *res, int n)
{
	for (int i = 0; i < n; i++) {
		free(res[i].toks);
		free(res[i].lp);
		free(res[i].top_id);
		free(res[i].top_lp);
	}
}

/* ---- request file ---- */

static int get_ids(const json_t *o, const char *key, int32_t *out, int cap, int *n, int V)
{
	const json_t *a = json_object_get(o, key);
	*n = 0;
	if (!a)
		return 0;
	if (!json_is_array(a) || (int)json_array_size(a) > cap)
		return -1;
	for (size_t i = 0; i < json_array_size(a); i++) {
		const json_t *v = json_array_get(a, i);
		if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= V)
			return -1;
		out[(*n)++] = (int32_t)json_integer_value(v);
	}
	return 0;
}

static int load_requests(const char *path, int V, req *reqs, int *n_req)
{
	json_error_t je;
	json_t *root = json_load_file(path, 0, &je);
	if (!root || !json_is_array(root) || json_array_size(root) == 0 ||
	    json_array_size(root) > MAX_REQ) {
		fprintf(stderr, "sched_check: %s: a JSON array of 1..%d requests expected (%s)\n", path,
			MAX_REQ, root ? "" : je.text);
		json_decref(root);
		return -1;
	}
	ds_err err = {0};
	*n_req = (int)json_array_size(root);
	for (int i = 0; i < *n_req; i++) {
		const json_t *o = json_array_get(root, i);
		req *q = &reqs[i];
		int np = 0, ne = 0, ns = 0, ign = 0, lp = 0;
		int64_t mt = 16, seed = -1, topk = 0, toplp = 0, ca = 0, ra = 0;
		double temp = 0, top_p = 1, rep = 1;
		if (get_ids(o, "prompt", q->prompt, MAX_IDS, &np, V) || get_ids(o, "eos_ids", q->eos, 64, &ne, V) ||
		    get_ids(o, "stop_ids", q->stop, 64, &ns, V) ||
		    jsonx_get_i64(o, "max_tokens", 0, 1, 1 << 20, &mt, &err) ||
		    jsonx_get_i64(o, "seed", 0, -1, INT64_MAX, &seed, &err) ||
		    jsonx_get_i64(o, "top_k", 0, 0, 1 << 20, &topk, &err) ||
		    jsonx_get_i64(o, "top_logprobs", 0, 0, 100, &toplp, &err) ||
		    jsonx_get_i64(o, "cancel_after", 0, 0, 1 << 20, &ca, &err) ||
		    jsonx_get_i64(o, "release_after", 0, 0, 1 << 20, &ra, &err) ||
		    jsonx_get_double(o, "temperature", 0, 0, 100, &temp, &err) ||
		    jsonx_get_double(o, "top_p", 0, 0, 1, &top_p, &err) ||
		    jsonx_get_double(o, "repetition_penalty", 0, 0, 10, &rep, &err) ||
		    jsonx_get_bool(o, "ignore_eos", 0, &ign, &err) || jsonx_get_bool(o, "logprobs", 0, &lp, &err)) {
			fprintf(stderr, "sched_check: request %d: bad field %s\n", i, err.msg);
			json_decref(root);
			return -1;
		}
		smp_params sp = smp_default_params();
		sp.temperature = (float)temp;
		sp.top_k = (int)topk;
		sp.top_p = (float)top_p;
		sp.repetition_penalty = (float)rep;
		sp.has_seed = seed >= 0;
		sp.seed = (uint64_t)(seed >= 0 ? seed : 0);
		q->r = (sched_req){q->prompt, np, sp, (int32_t)mt, ign, q->eos, ne, q->stop, ns, lp, (int)toplp};
		q->cancel_after = (int)ca;
		q->release_after = (int)ra;
	}
	json_decref(root);
	return 0;
}

/* ---- runs ---- */

static void run_concurrent(int ordered)
{
	pthread_t th[MAX_REQ];
	ds_err err = {0};
	memset(pre, 0, sizeof pre);
	if (ordered) { /* the step thread waits in step 1 until all are queued */
		pthread_mutex_lock(&g.mu);
		g.gate_closed = 1;
		pthread_mutex_unlock(&g.mu);
		for (int i = 0; i < g.n_req; i++) {
			if (!(pre[i] = submit(i, &err))) {
				g.res[i].finish = "rejected";
				ds_strlcpy(g.res[i].error, err.msg, sizeof g.res[i].error);
			}
		}
		pthread_mutex_lock(&g.mu);
		g.gate_closed = 0;
		pthread_cond_broadcast(&g.cv);
		pthread_mutex_unlock(&g.mu);
	}
	for (int i = 0; i < g.n_req; i++) {
		if (ordered && !pre[i])
			continue;
		if (pthread_create(&th[i], NULL, consumer_main, (void *)(intptr_t)i))
			die("thread", "cannot start a consumer");
	}
	if (g.free_after > 0) { /* shut down while requests are in flight */
		pthread_mutex_lock(&g.mu);
		while (g.progress_max < g.free_after)
			pthread_cond_wait(&g.cv, &g.mu);
		pthread_mutex_unlock(&g.mu);
		sched_free(g.s);
		g.s = NULL;
	}
	for (int i = 0; i < g.n_req; i++)
		if (!ordered || pre[i])
			pthread_join(th[i], NULL);
}

static void run_alone(model *m, const sched_params *sp, result *res)
{
	ds_err err = {0};
	result *saved = g.res;
	g.res = res;
	for (int i = 0; i < g.n_req; i++) {
		sched *s = sched_new(m, sp, &err);
		if (!s)
			die("sched_new", err.msg);
		g.s = s;
		sched_seq *q = submit(i, &err);
		if (!q) {
			res[i].finish = "rejected";
			ds_strlcpy(res[i].error, err.msg, sizeof res[i].error);
		} else {
			consume(i, q);
		}
		sched_free(s);
		g.s = NULL;
	}
	g.res = saved;
}

/* --busy: hold the step thread in step 1 (request 0 running), then submit
 * request 0 again until a submission is refused. */
static json_t *run_busy(void)
{
	ds_err err = {0};
	json_t *codes = json_array();
	sched_seq *qs[MAX_REQ];
	int n = 0;
	pthread_mutex_lock(&g.mu);
	g.gate_closed = 1;
	pthread_mutex_unlock(&g.mu);
	qs[n++] = submit(0, &err);
	if (!qs[0])
		die("submit", err.msg);
	json_array_append_new(codes, json_integer(0));
	pthread_mutex_lock(&g.mu);
	while (!g.gate_entered)
		pthread_cond_wait(&g.cv, &g.mu);
	pthread_mutex_unlock(&g.mu);
	sched_stats st;
	sched_get_stats(g.s, &st);
	json_t *held = stats_json(&st);
	while (n < MAX_REQ) {
		ds_err e = {0};
		sched_seq *q = sched_submit(g.s, &g.reqs[0].r, &e);
		json_array_append_new(codes, json_integer(q ? 0 : e.code));
		if (!q)
			break;
		qs[n++] = q;
	}
	sched_get_stats(g.s, &st);
	json_t *full = stats_json(&st);
	for (int i = 0; i < n; i++) /* while held: every one ends with abort */
		sched_seq_cancel(qs[i]);
	pthread_mutex_lock(&g.mu);
	g.gate_closed = 0;
	pthread_cond_broadcast(&g.cv);
	pthread_mutex_unlock(&g.mu);
	json_t *fins = json_array();
	for (int i = 0; i < n; i++) {
		sched_tok t[8];
		sched_finish fin = SCHED_RUNNING;
		while (fin == SCHED_RUNNING)
			sched_seq_next(qs[i], t, 8, -1, &fin);
		json_array_append_new(fins, json_string(finish_name(fin)));
		if (i == 0)
			forget(0);
		sched_seq_release(qs[i]);
	}
	return json_pack("{s:o,s:o,s:o,s:o}", "codes", codes, "held_stats", held, "full_stats", full,
			 "finish", fins);
}

static int flag_int(char **argv, int *i, int argc, const char *name, int min, int max, int *out)
{
	if (strcmp(argv[*i], name) != 0)
		return 0;
	if (*i + 1 >= argc || ds_parse_int(argv[*i + 1], min, max, out) != 0) {
		fprintf(stderr, "sched_check: %s needs an integer in [%d, %d]\n", name, min, max);
		exit(2);
	}
	(*i)++;
	return 1;
}

static int n_elsewhere; /* ranks start_elsewhere started ("remote_ranks") */

/* driver_launch.start_remote for DS_SCHED_REMOTE: `EXE worker OPTS...` in a
 * grandchild that is not ours (double fork, new session). */
static int start_elsewhere(void *ctx, int rank, const char *const *opts, ds_err *err)
{
	const char *exe = ctx;
	size_t n = 0;
	while (opts[n])
		n++;
	const char **v = calloc(n + 3, sizeof *v);
	if (!v)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	v[0] = exe;
	v[1] = "worker";
	for (size_t i = 0; i < n; i++)
		v[i + 2] = opts[i];
	fflush(NULL);
	pid_t c = fork();
	if (c == 0) {
		setsid();
		pid_t gc = fork();
		if (gc == 0) {
			int nul = open("/dev/null", O_RDWR);
			if (nul >= 0) {
				dup2(nul, 0);
				dup2(nul, 1);
			}
			execv(exe, (char *const *)v);
			_exit(127);
		}
		_exit(gc < 0 ? 1 : 0);
	}
	int st = 0;
	if (c > 0)
		waitpid(c, &st, 0);
	free(v);
	if (c < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
		return ds_err_set(err, DS_EIO, "rank %d: cannot start it elsewhere", rank);
	n_elsewhere++;
	return DS_OK;
}

int main(int argc, char **argv)
{
	if (argc < 2 || argv[1][0] == '-') {
		fprintf(stderr, "usage: sched_check MODEL [flags] --requests FILE [--ordered] [--alone] "
				"[--busy] [--fail-step N] [--free-after N] (see the file comment)\n");
		return 2;
	}
	model_params mp = model_default_params();
	sched_params sp = {0};
	const char *reqs_path = NULL;
	int alone = 0, ordered = 0, busy = 0;
	mp.path = argv[1];
	mp.backend = "cpu";
	mp.max_ctx = 0;
	mp.max_batch_tokens = 64;
	mp.max_seqs = 8;
	mp.page_size = 16;
	for (int i = 2; i < argc; i++) {
		if (flag_int(argv, &i, argc, "--threads", 0, 1024, &mp.threads) ||
		    flag_int(argv, &i, argc, "--ctx", 0, 1 << 20, &mp.max_ctx) ||
		    flag_int(argv, &i, argc, "--batch-tokens", 1, 1 << 16, &mp.max_batch_tokens) ||
		    flag_int(argv, &i, argc, "--page-size", 1, 4096, &mp.page_size) ||
		    flag_int(argv, &i, argc, "--pages", 0, 1 << 24, &mp.n_pages) ||
		    flag_int(argv, &i, argc, "--max-seqs", 1, 4096, &mp.max_seqs) ||
		    flag_int(argv, &i, argc, "--max-running", 0, 4096, &sp.max_running) ||
		    flag_int(argv, &i, argc, "--max-waiting", 0, 4096, &sp.max_waiting) ||
		    flag_int(argv, &i, argc, "--budget", 0, 1 << 16, &sp.token_budget) ||
		    flag_int(argv, &i, argc, "--chunk", 0, 1 << 16, &sp.prefill_chunk) ||
		    flag_int(argv, &i, argc, "--fail-step", 1, 1 << 30, &g.fail_step) ||
		    flag_int(argv, &i, argc, "--free-after", 1, 1 << 20, &g.free_after) ||
		    flag_int(argv, &i, argc, "--step-delay-us", 0, 10000000, &g.step_delay_us))
			continue;
		if (strcmp(argv[i], "--requests") == 0 && i + 1 < argc)
			reqs_path = argv[++i];
		else if (strcmp(argv[i], "--alone") == 0)
			alone = 1;
		else if (strcmp(argv[i], "--ordered") == 0)
			ordered = 1;
		else if (strcmp(argv[i], "--prefix-caching") == 0)
			sp.prefix_caching = 1;
		else if (strcmp(argv[i], "--busy") == 0)
			busy = 1;
		else {
			fprintf(stderr, "sched_check: unknown argument %s\n", argv[i]);
			return 2;
		}
	}
	if (!reqs_path) {
		fprintf(stderr, "sched_check: --requests FILE is required\n");
		return 2;
	}
	ds_err err = {0};
	const char *plan = getenv("DS_SCHED_PLAN");
	static uint8_t remote[256];
	model *m;
	if (plan && *plan) {
		const char *argvr[] = {getenv("DS_DSAGENT"), "worker", NULL};
		driver_launch l = driver_default_launch();
		l.argv = argvr;
		const char *ct = getenv("DS_SCHED_COMM_TIMEOUT_MS");
		if (ct && ds_parse_int(ct, 1, 1 << 30, &l.comm_timeout_ms) != DS_OK) {
			fprintf(stderr, "sched_check: DS_SCHED_COMM_TIMEOUT_MS must be 1..2^30 ms, got '%s'\n",
				ct);
			return 2;
		}
		if (!argvr[0] || sscanf(plan, "%d,%d,%d", &l.plan.tp, &l.plan.pp, &l.plan.ep) != 3) {
			fprintf(stderr, "sched_check: DS_SCHED_PLAN=TP,PP,EP needs DS_DSAGENT too\n");
			return 2;
		}
		const char *rem = getenv("DS_SCHED_REMOTE");
		if (rem && strcmp(rem, "1") == 0) {
			memset(remote, 1, sizeof remote);
			remote[0] = 0;
			l.remote = remote;
			l.start_remote = start_elsewhere;
			l.remote_ctx = (void *)argvr[0];
		}
		m = driver_model_load(&mp, &l, &err);
	} else {
		m = model_load(&mp, &err);
	}
	if (!m)
		die("load", err.msg);
	static req reqs[MAX_REQ];
	static result res[MAX_REQ], res_alone[MAX_REQ];
	g.reqs = reqs;
	if (load_requests(reqs_path, model_vocab_size(m), reqs, &g.n_req))
		return 1;
	results_alloc(res, g.n_req);
	results_alloc(res_alone, g.n_req);
	g.res = res;

	if (!(g.s = sched_new(m, &sp, &err)))
		die("sched_new", err.msg);
	sched_set_trace(g.s, trace_hook, NULL);
	json_t *out = json_object();
	pthread_mutex_lock(&g.mu);
	g.trace = json_array();
	pthread_mutex_unlock(&g.mu);
	if (busy)
		json_object_set_new(out, "busy", run_busy());
	else
		run_concurrent(ordered);
	sched_stats st = {0};
	if (g.s) {
		wait_idle(g.s);
		sched_get_stats(g.s, &st);
		sched_free(g.s);
		g.s = NULL;
	}
	pthread_mutex_lock(&g.mu);
	json_t *trace = g.trace;
	g.trace = NULL;
	pthread_mutex_unlock(&g.mu);
	json_object_set_new(out, "trace", trace);
	json_object_set_new(out, "max_step_tokens", json_integer(g.max_step_tokens));
	json_object_set_new(out, "remote_ranks", json_integer(n_elsewhere));
	json_object_set_new(out, "stats", stats_json(&st));
	json_object_set_new(out, "pages_used_after",
			    json_integer(kv_cache_params(model_kv(m))->n_pages - kv_cache_pages_free(model_kv(m))));
	if (!busy)
		json_object_set_new(out, "results", results_json(res, g.n_req));
	if (alone && !busy) {
		run_alone(m, &sp, res_alone);
		json_object_set_new(out, "alone", results_json(res_alone, g.n_req));
	}
	char *text = json_dumps(out, JSON_COMPACT);
	printf("%s\n", text ? text : "{}");
	free(text);
	json_decref(out);
	results_free(res, g.n_req);
	results_free(res_alone, g.n_req);
	model_free(m);
	return 0;
}

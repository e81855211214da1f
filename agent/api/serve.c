/*
 * serve.c - the serving context and the small routes of the OpenAI API:
 * /, /version, /health, /v1/models, /v1/models/{id}, /metrics, /tokenize,
 * /detokenize (see serve.h), plus what every handler shares: readiness,
 * auth, body parsing, model names, request ids.  The generation routes live
 * in oai.c.
 *
 * Called from main (serve_new / serve_load / serve_drain / serve_stop /
 * serve_free) and from HTTP connection threads (handlers).  Invariants:
 *  1. s->ready is set only after every member used by handlers is in place,
 *     and never cleared before serve_free stops the HTTP server's use of it
 *     (main frees the server first).
 *  2. Once serve_drain ran, every route that checks readiness answers 503
 *     "shutting_down", whatever a deployment does meanwhile.
 *  3. s->sc changes only under s->mu: the stats thread (stats_main), which
 *     is no user of the guard, reads it under s->mu.
 */
#include "agent/api/serve.h"
#include "agent/auth/keys.h"
#include "common/fileutil.h"
#include "common/jsonx.h"
#include "common/log.h"
#include "common/strutil.h"
#include "engine/driver.h"
#include "engine/engine.h"
#include "engine/source.h"

#include <errno.h>
#include <limits.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define MAX_JSON_DEPTH 64

static const char *base_name(const char *path, char *out, size_t n)
{
	const char *b = strrchr(path, '/');
	b = b ? b + 1 : path;
	size_t len = strlen(b);
	while (len > 1 && b[len - 1] == '/')
		len--;
	if (len > 5 && strncmp(b + len - 5, ".gguf", 5) == 0)
		len -= 5;
	if (len >= n)
		len = n - 1;
	memcpy(out, b, len);
	out[len] = 0;
	return out;
}

/* names (NAME[,ALIAS...]) or the base name of path into s->names. */
static int names_set(serve *s, const char *names, const char *path, ds_err *err)
{
	char base[256];
	char *nb = strdup(names ? names : base_name(path, base, sizeof base));
	const char *v[SERVE_MAX_NAMES];
	int n = 0;
	if (!nb)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	for (char *t = nb, *next; t; t = next) {
		next = strchr(t, ',');
		if (next)
			*next++ = 0;
		if (!*t || n == SERVE_MAX_NAMES) {
			free(nb);
			return *t ? ds_err_set(err, DS_EINVAL, "--served-model-name: at most %d names",
					       SERVE_MAX_NAMES)
				  : ds_err_set(err, DS_EINVAL,
					       "--served-model-name '%s' has an empty name", names);
		}
		v[n++] = t;
	}
	free(s->names_buf);
	s->names_buf = nb;
	memcpy(s->names, v, sizeof v);
	s->n_names = n;
	return DS_OK;
}

static void *stats_main(void *arg);

serve *serve_new(const serve_params *p, ds_err *err)
{
	serve *s = calloc(1, sizeof *s);
	if (!s) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	s->p = *p;
	pthread_mutex_init(&s->mu, NULL);
	pthread_cond_init(&s->cv, NULL);
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&s->stats_cv, &ca);
	pthread_condattr_destroy(&ca);
	if (!p->model_path)
		serve_refuse(s, "no_model", "no model is deployed: run `dsctl cluster up --model PATH`");
	s->started_s = ds_now_s();
	s->started_unix = (int64_t)time(NULL);
	if (p->auth && !p->keys) {
		ds_err_set(err, DS_EINVAL, "serving with auth needs the key service");
		goto fail;
	}
	if (names_set(s, p->names, p->model_path ? p->model_path : "none", err))
		goto fail;
	if (!(s->met = metrics_new(s->names[0]))) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		goto fail;
	}
	if (p->stats_log_ms > 0) {
		int e = pthread_create(&s->stats, NULL, stats_main, s);
		if (e) {
			ds_err_set(err, DS_EINTERNAL, "cannot start the stats thread: %s", strerror(e));
			goto fail;
		}
		s->has_stats = 1;
	}
	return s;
fail:
	serve_free(s);
	return NULL;
}

/* End-of-turn markers of the chat templates: generation stops there. */
static void find_eot(serve *s)
{
	static const char *const marks[] = {"<|im_end|>", "<|eot_id|>", "<|eom_id|>",
					    "<｜end▁of▁sentence｜>"};
	for (size_t i = 0; i < sizeof marks / sizeof *marks && s->n_eot < SERVE_MAX_EOT; i++) {
		int32_t id = tok_find_token(s->tk, marks[i], strlen(marks[i]));
		if (id >= 0 && id < s->vocab)
			s->eot[s->n_eot++] = id;
	}
}

static int plan_world(const serve *s)
{
	model_plan pl = {.tp = s->p.tp > 0 ? s->p.tp : 1, .pp = s->p.pp > 0 ? s->p.pp : 1,
			 .ep = s->p.ep > 0 ? s->p.ep : 1};
	return model_plan_world(&pl);
}

/* --tp/--pp/--ep: the model as rank processes of this binary (`dsagent
 * worker`) under the distributed driver.  The ranks size their KV cache
 * for max_running sequences of the context (--kv-cache-mb does not apply:
 * the driver takes pages, not bytes); threads per rank default to the cores
 * shared out.  Called from a thread that lives as long as the model (the
 * ranks' death signal follows the thread that forked them). */
static model *plan_model_load(serve *s, model_params *mp, ds_err *err)
{
	char exe[PATH_MAX];
	if (ds_self_exe(exe, sizeof exe, err) != DS_OK)
		return NULL;
	const char *argv[] = {exe, "worker", NULL};
	driver_launch l = driver_default_launch();
	l.argv = argv;
	l.plan = (model_plan){.tp = s->p.tp, .pp = s->p.pp, .ep = s->p.ep};
	if (model_plan_check(&l.plan, err))
		return NULL;
	if (mp->threads == 0) {
		long per = sysconf(_SC_NPROCESSORS_ONLN) / model_plan_world(&l.plan);
		mp->threads = per < 1 ? 1 : (int)per;
	}
	mp->kv_bytes = 0;
	mp->source = NULL;
	log_info("serve", "starting rank processes", "tp=%d pp=%d ep=%d threads_per_rank=%d",
		 l.plan.tp, l.plan.pp, l.plan.ep, mp->threads);
	return driver_model_load(mp, &l, err);
}

/* The tokenizer of a driver's model, parsed while the ranks load. */
typedef struct tok_job {
	msrc *src;
	tok *tk;
	ds_err err;
} tok_job;

static void *tok_main(void *arg)
{
	tok_job *j = arg;
	j->tk = eng_tok_load_source(j->src, &j->err);
	return NULL;
}

/* Model, tokenizer, chat template and scheduler of sp into s (which holds
 * none); ready is set on success.  On failure what was made is freed. */
static int load_spec(serve *s, const serve_spec *sp, int set_names, ds_err *err)
{
	int rc;
	double t0 = ds_now_s();
	if (set_names) {
		if ((rc = names_set(s, sp->names, sp->model_path, err)))
			return rc;
		metrics_set_model(s->met, s->names[0]);
	}
	/* one open of the checkpoint for the tokenizer and the model */
	msrc *src = msrc_open(sp->model_path, err);
	if (!src)
		return err->code ? err->code : DS_EIO;
	/* a driver's ranks load in their own processes: the tokenizer is
	 * parsed meanwhile, on a thread of its own */
	tok_job tj = {.src = src};
	pthread_t tt;
	int tok_thread = sp->launch && pthread_create(&tt, NULL, tok_main, &tj) == 0;
	if (!tok_thread && !(s->tk = eng_tok_load_source(src, err))) {
		msrc_unref(src);
		return err->code ? err->code : DS_EIO;
	}
	model_params mp = model_default_params();
	mp.path = sp->model_path;
	mp.source = src;
	mp.backend = s->p.backend;
	mp.threads = sp->threads ? sp->threads : s->p.threads;
	mp.max_ctx = sp->max_ctx ? sp->max_ctx : s->p.ctx;
	mp.max_seqs = sp->max_seqs ? sp->max_seqs : s->p.max_running;
	mp.max_batch_tokens = s->p.max_batch_tokens;
	mp.page_size = s->p.page_size;
	mp.kv_bytes = s->p.kv_bytes;
	mp.kv_cache_dtype = s->p.kv_cache_dtype;
	model *m;
	if (sp->launch) {
		mp.kv_bytes = 0;
		mp.source = NULL;
		m = driver_model_load(&mp, sp->launch, err);
	} else {
		m = plan_world(s) > 1 ? plan_model_load(s, &mp, err) : model_load(&mp, err);
	}
	if (tok_thread) {
		pthread_join(tt, NULL);
		s->tk = tj.tk;
		if (!s->tk && m) { /* the model loaded; the tokenizer is what failed */
			model_free(m);
			m = NULL;
			*err = tj.err;
		}
	}
	pthread_mutex_lock(&s->mu);
	s->m = m;
	pthread_mutex_unlock(&s->mu);
	msrc_unref(src); /* the model holds its own reference */
	if (!s->m) {
		rc = err->code ? err->code : DS_EIO;
		goto fail;
	}
	s->max_ctx = model_max_ctx(s->m);
	s->vocab = model_vocab_size(s->m);
	s->has_chat = 0;
	if ((rc = chat_params_for_tok(s->tk, s->p.chat_template, &s->chat, err)) == DS_OK) {
		s->has_chat = 1;
	} else if (s->p.chat_template) {
		goto fail; /* an override that does not exist is an error */
	} else {
		log_warn("serve", "no chat template", "model=%s detail=\"%s\"", sp->model_path,
			 err->msg);
		*err = (ds_err){0};
	}
	s->n_eot = 0;
	find_eot(s);
	sched_params scp = {
		.max_running = mp.max_seqs,
		.max_waiting = s->p.max_waiting,
		.token_budget = s->p.max_batch_tokens,
		.prefill_chunk = s->p.prefill_chunk,
		.prefix_caching = s->p.prefix_caching,
	};
	sched *sc = sched_new(s->m, &scp, err);
	if (!sc) {
		rc = err->code ? err->code : DS_EIO;
		goto fail;
	}
	pthread_mutex_lock(&s->mu); /* invariant 3 */
	s->sc = sc;
	pthread_mutex_unlock(&s->mu);
	s->started_unix = (int64_t)time(NULL);
	atomic_store(&s->ready, 1);
	const kv_params *kp = kv_cache_params(model_kv(s->m));
	log_info("serve", "model loaded",
		 "model=%s arch=%s ctx=%d kv_pages=%d page_size=%d chat=%s load_s=%.2f", s->names[0],
		 model_arch_name(s->m), s->max_ctx, kp->n_pages, kp->page_size,
		 s->has_chat ? chat_template_name(s->chat.tmpl) : "none", ds_now_s() - t0);
	return DS_OK;
fail:
	pthread_mutex_lock(&s->mu);
	m = s->m;
	s->m = NULL;
	pthread_mutex_unlock(&s->mu);
	model_free(m);
	tok_free(s->tk);
	s->tk = NULL;
	return rc;
}

int serve_load(serve *s, ds_err *err)
{
	serve_spec sp = {.model_path = s->p.model_path, .names = s->p.names};
	return load_spec(s, &sp, 0, err);
}

void serve_drain(serve *s)
{
	if (!s)
		return;
	atomic_store(&s->draining, 1);
}

int serve_busy(serve *s)
{
	return s ? atomic_load(&s->users) : 0;
}

void serve_stop(serve *s)
{
	if (!s)
		return;
	atomic_store(&s->stopping, 1);
	atomic_store(&s->ready, 0);
}

int serve_wait_idle(serve *s, int timeout_ms)
{
	double until = ds_now_s() + timeout_ms / 1000.0;
	while (serve_busy(s) > 0) {
		if (ds_now_s() >= until)
			return 0;
		ds_sleep_ms(10);
	}
	return 1;
}

void serve_stop_error(serve *s, const char **code, const char **message)
{
	if (atomic_load(&s->draining)) {
		*code = "shutting_down";
		*message = "the server is shutting down: this request was stopped before it "
			   "finished; retry it on another server or once this one is back";
	} else {
		*code = "model_unloaded";
		*message = "the served model is being unloaded: this request was stopped before "
			   "it finished";
	}
}

/* Ends what is served: no new request is admitted (ready 0), open
 * generations end (stopping), and once no handler or stream uses the model
 * it is freed.  Run on the thread that loaded a driver's model, or any
 * thread for other models. */
static void unload(serve *s)
{
	atomic_store(&s->ready, 0);
	if (!s->m && !s->sc && !s->tk)
		return;
	atomic_store(&s->stopping, 1);
	double t0 = ds_now_s(), said = t0;
	while (atomic_load(&s->users) > 0) {
		if (ds_now_s() - said > 5) {
			log_warn("serve", "waiting for requests to end before unloading",
				 "users=%d waited_s=%.0f", atomic_load(&s->users), ds_now_s() - t0);
			said = ds_now_s();
		}
		ds_sleep_ms(10);
	}
	pthread_mutex_lock(&s->mu); /* serve_rank_pid reads m, the stats thread sc */
	model *m = s->m;
	sched *sc = s->sc;
	s->m = NULL;
	s->sc = NULL;
	pthread_mutex_unlock(&s->mu);
	sched_free(sc);
	model_free(m);
	tok_free(s->tk);
	s->tk = NULL;
	atomic_store(&s->stopping, 0);
}

/* ---- the loader thread: serve_deploy's loads and unloads ---- */

typedef struct serve_job {
	const serve_spec *spec; /* NULL: unload only */
	int rc, done;
	ds_err err;
} serve_job;

static void *loader_main(void *arg)
{
	serve *s = arg;
	pthread_mutex_lock(&s->mu);
	for (;;) {
		while (!s->job && !s->loader_stop)
			pthread_cond_wait(&s->cv, &s->mu);
		if (!s->job)
			break;
		serve_job *j = s->job;
		pthread_mutex_unlock(&s->mu);
		unload(s);
		j->rc = j->spec ? load_spec(s, j->spec, 1, &j->err) : DS_OK;
		pthread_mutex_lock(&s->mu);
		j->done = 1;
		s->job = NULL;
		pthread_cond_broadcast(&s->cv);
	}
	pthread_mutex_unlock(&s->mu);
	unload(s); /* what it loaded dies with it */
	return NULL;
}

static int loader_run(serve *s, const serve_spec *sp, ds_err *err)
{
	serve_job j = {.spec = sp};
	pthread_mutex_lock(&s->mu);
	if (!s->has_loader) {
		int e = pthread_create(&s->loader, NULL, loader_main, s);
		if (e) {
			pthread_mutex_unlock(&s->mu);
			return ds_err_set(err, DS_EIO, "cannot start the loader thread: %s", strerror(e));
		}
		s->has_loader = 1;
	}
	while (s->job) /* one job at a time */
		pthread_cond_wait(&s->cv, &s->mu);
	s->job = &j;
	pthread_cond_broadcast(&s->cv);
	while (!j.done)
		pthread_cond_wait(&s->cv, &s->mu);
	pthread_mutex_unlock(&s->mu);
	if (j.rc && err)
		*err = j.err;
	return j.rc;
}

static void why_set(serve *s, const char *code, const char *why)
{
	pthread_mutex_lock(&s->mu);
	snprintf(s->why_code, sizeof s->why_code, "%s", code ? code : "");
	snprintf(s->why, sizeof s->why, "%s", why ? why : "");
	pthread_mutex_unlock(&s->mu);
}

int serve_deploy(serve *s, const serve_spec *sp, ds_err *err)
{
	why_set(s, NULL, NULL); /* "loading" */
	int rc = loader_run(s, sp, err);
	if (rc)
		why_set(s, "load_failed", err->msg);
	return rc;
}

void serve_undeploy(serve *s, const char *code, const char *why)
{
	why_set(s, code, why);
	atomic_store(&s->ready, 0);
	loader_run(s, NULL, NULL);
}

void serve_refuse(serve *s, const char *code, const char *why)
{
	why_set(s, code, why);
	atomic_store(&s->ready, 0);
}

int serve_rank_pid(serve *s, int rank)
{
	pthread_mutex_lock(&s->mu);
	int pid = driver_rank_pid(s->m, rank);
	pthread_mutex_unlock(&s->mu);
	return pid;
}

void serve_free(serve *s)
{
	if (!s)
		return;
	atomic_store(&s->ready, 0);
	if (s->has_stats) {
		pthread_mutex_lock(&s->mu);
		s->stats_stop = 1;
		pthread_cond_broadcast(&s->stats_cv);
		pthread_mutex_unlock(&s->mu);
		pthread_join(s->stats, NULL);
	}
	if (s->has_loader) {
		pthread_mutex_lock(&s->mu);
		s->loader_stop = 1;
		pthread_cond_broadcast(&s->cv);
		pthread_mutex_unlock(&s->mu);
		pthread_join(s->loader, NULL);
	}
	unload(s);
	metrics_free(s->met);
	free(s->names_buf);
	pthread_cond_destroy(&s->stats_cv);
	pthread_cond_destroy(&s->cv);
	pthread_mutex_destroy(&s->mu);
	free(s);
}

/* ---- the throughput log line ---- */

/* Every stats_log_ms: while requests run (or tokens moved since the last
 * line), the prompt and generated tokens per second over the interval and
 * the running / waiting counts.  A new scheduler (a deployment) starts a new
 * baseline. */
static void *stats_main(void *arg)
{
	serve *s = arg;
	const sched *last_sc = NULL;
	uint64_t last_in = 0, last_out = 0;
	double last_t = 0;
	pthread_mutex_lock(&s->mu);
	while (!s->stats_stop) {
		struct timespec until;
		clock_gettime(CLOCK_MONOTONIC, &until);
		until.tv_sec += s->p.stats_log_ms / 1000;
		until.tv_nsec += (long)(s->p.stats_log_ms % 1000) * 1000000L;
		if (until.tv_nsec >= 1000000000L) {
			until.tv_sec++;
			until.tv_nsec -= 1000000000L;
		}
		while (!s->stats_stop &&
		       pthread_cond_timedwait(&s->stats_cv, &s->mu, &until) != ETIMEDOUT)
			;
		if (s->stats_stop)
			break;
		if (!s->sc) {
			last_sc = NULL;
			continue;
		}
		sched_stats st;
		sched_get_stats(s->sc, &st); /* invariant 3: sc lives while mu is held */
		double now = ds_now_s(), dt = now - last_t;
		int same = s->sc == last_sc && st.prompt_tokens >= last_in &&
			   st.generation_tokens >= last_out && dt > 0;
		int busy = st.running + st.waiting > 0 || st.prompt_tokens != last_in ||
			   st.generation_tokens != last_out;
		uint64_t d_in = st.prompt_tokens - last_in, d_out = st.generation_tokens - last_out;
		last_sc = s->sc;
		last_in = st.prompt_tokens;
		last_out = st.generation_tokens;
		last_t = now;
		if (!same || !busy)
			continue;
		pthread_mutex_unlock(&s->mu);
		log_info("serve", "throughput",
			 "prompt_tokens_per_s=%.1f generation_tokens_per_s=%.1f running=%d "
			 "waiting=%d kv_used_pct=%.0f interval_s=%.1f",
			 (double)d_in / dt, (double)d_out / dt, st.running, st.waiting,
			 st.kv_pages_total ? 100.0 * st.kv_pages_used / st.kv_pages_total : 0.0, dt);
		pthread_mutex_lock(&s->mu);
	}
	pthread_mutex_unlock(&s->mu);
	return NULL;
}

/* ---- shared helpers ---- */

int serve_check_ready(serve *s, http_resp *resp)
{
	if (atomic_load(&s->draining)) { /* invariant 2 */
		http_resp_error(resp, 503, "service_unavailable_error", "shutting_down",
				"the server is shutting down; retry on another server or once this "
				"one is back");
		http_resp_header(resp, "Retry-After", "5");
		return 1;
	}
	if (atomic_load(&s->ready))
		return 0;
	char code[sizeof s->why_code], why[sizeof s->why];
	pthread_mutex_lock(&s->mu);
	memcpy(code, s->why_code, sizeof code);
	memcpy(why, s->why, sizeof why);
	pthread_mutex_unlock(&s->mu);
	if (code[0])
		http_resp_error(resp, 503, "service_unavailable_error", code, "%s", why);
	else
		http_resp_error(resp, 503, "service_unavailable_error", "loading",
				"the model is loading; retry shortly");
	http_resp_header(resp, "Retry-After", "5");
	return 1;
}

int serve_auth(serve *s, const http_req *req, http_resp *resp, int64_t *key_id)
{
	return serve_auth_named(s, req, resp, key_id, NULL, 0);
}

int serve_auth_named(serve *s, const http_req *req, http_resp *resp, int64_t *key_id,
		     char *name, size_t n)
{
	*key_id = -1;
	if (name && n)
		snprintf(name, n, "-");
	if (!s->p.auth)
		return 0;
	ds_err err = {0};
	keys_identity who;
	if (keys_auth(s->p.keys, http_req_header(req, "Authorization"), (int64_t)time(NULL), &who,
		      &err) == DS_OK) {
		*key_id = who.id;
		if (name && n)
			snprintf(name, n, "%s", who.name);
		return 0;
	}
	metrics_rejected(s->met, MET_REJ_AUTH);
	http_resp_error(resp, 401, "authentication_error", "invalid_api_key", "%s", err.msg);
	http_resp_header(resp, "WWW-Authenticate", "Bearer");
	return 1;
}

/* The 429 / 400 / 401 of a refused admission or reservation. */
static int refuse(serve *s, int rc, const keys_denial *d, const ds_err *err, const char *param,
		  http_resp *resp)
{
	if (rc == DS_EBUSY) {
		char ra[32];
		metrics_rejected(s->met, MET_REJ_RATE_LIMIT);
		http_resp_error(resp, 429, "rate_limit_error", "rate_limit_exceeded", "%s", err->msg);
		snprintf(ra, sizeof ra, "%d", d->retry_after_s > 0 ? d->retry_after_s : 1);
		http_resp_header(resp, "Retry-After", ra);
	} else if (rc == DS_ERANGE) {
		metrics_rejected(s->met, MET_REJ_RATE_LIMIT);
		http_resp_error_param(resp, 400, "invalid_request_error", "exceeds_key_limit", param,
				      "%s", err->msg);
	} else {
		metrics_rejected(s->met, MET_REJ_AUTH);
		http_resp_error(resp, 401, "authentication_error", "invalid_api_key", "%s", err->msg);
	}
	return 1;
}

int serve_admit(serve *s, int64_t key_id, int64_t seqs, int queues, const char *param,
		keys_hold *h, http_resp *resp)
{
	memset(h, 0, sizeof *h);
	if (key_id < 0)
		return 0;
	/* the scheduler's own default when --max-waiting is 0 */
	keys_cost c = {.seqs = seqs,
		       .queue_cap = queues ? (s->p.max_waiting > 0 ? s->p.max_waiting : 256) : 0};
	keys_denial d = {0};
	ds_err err = {0};
	int rc = keys_admit(s->p.keys, key_id, &c, ds_now_s(), h, &d, &err);
	return rc == DS_OK ? 0 : refuse(s, rc, &d, &err, param, resp);
}

int serve_reserve(serve *s, keys_hold *h, int64_t tokens, const char *param, http_resp *resp)
{
	keys_denial d = {0};
	ds_err err = {0};
	int rc = keys_reserve(s->p.keys, h, tokens, ds_now_s(), &d, &err);
	if (rc == DS_OK)
		return 0;
	keys_drop(s->p.keys, h);
	return refuse(s, rc, &d, &err, param, resp);
}

json_t *serve_parse_body(serve *s, const http_req *req, http_resp *resp)
{
	const char *ct = http_req_header(req, "Content-Type");
	if (ct && strncasecmp(ct, "application/json", 16) != 0) {
		metrics_rejected(s->met, MET_REJ_BAD_REQUEST);
		http_resp_error(resp, 415, "invalid_request_error", "unsupported_media_type",
				"Content-Type must be application/json, got '%.64s'", ct);
		return NULL;
	}
	ds_err err = {0};
	json_t *v = jsonx_parse(req->body, req->body_len, MAX_JSON_DEPTH, &err);
	if (!v || !json_is_object(v)) {
		metrics_rejected(s->met, MET_REJ_BAD_REQUEST);
		http_resp_error(resp, 400, "invalid_request_error", "invalid_json",
				"the request body is not a JSON object: %s",
				v ? "found another JSON value" : err.msg);
		json_decref(v);
		return NULL;
	}
	return v;
}

const char *serve_model_name(serve *s, const json_t *body, http_resp *resp)
{
	json_t *m = json_object_get(body, "model");
	if (!m || json_is_null(m))
		return s->names[0];
	if (!json_is_string(m)) {
		http_resp_error_param(resp, 400, "invalid_request_error", "invalid_type", "model",
				      "'model' must be a string");
		return NULL;
	}
	for (int i = 0; i < s->n_names; i++)
		if (strcmp(json_string_value(m), s->names[i]) == 0)
			return s->names[i];
	http_resp_error_param(resp, 404, "not_found_error", "model_not_found", "model",
			      "The model `%.200s` does not exist.", json_string_value(m));
	return NULL;
}

void serve_request_id(const http_req *req, http_resp *resp, const char *prefix, char *id,
		      size_t n)
{
	const char *h = http_req_header(req, "X-Request-Id");
	int ok = h && *h && strlen(h) <= 128;
	for (const unsigned char *p = (const unsigned char *)h; ok && *p; p++)
		ok = *p > 0x20 && *p < 0x7f;
	unsigned char r[12];
	char hex[sizeof r * 2 + 1];
	randombytes_buf(r, sizeof r);
	sodium_bin2hex(hex, sizeof hex, r, sizeof r);
	if (ok) {
		snprintf(id, n, "%s", h);
		http_resp_header(resp, "X-Request-Id", h);
	} else {
		snprintf(id, n, "%s%s", prefix, hex);
		http_resp_header(resp, "X-Request-Id", id);
	}
}

/* ---- routes ---- */

static void reply(http_resp *resp, int status, json_t *v)
{
	http_resp_json(resp, status, v ? jsonx_dumps(v) : NULL);
	json_decref(v);
}

static void get_health(void *ud, const http_req *req, http_resp *resp)
{
	serve *s = ud;
	(void)req;
	if (serve_check_ready(s, resp))
		return;
	sched_stats st;
	sched_get_stats(s->sc, &st);
	if (!st.alive) {
		http_resp_error(resp, 503, "service_unavailable_error", "engine_dead",
				"the engine's step thread has stopped");
		return;
	}
	reply(resp, 200, json_pack("{s:s}", "status", "ok"));
}

static json_t *model_obj(serve *s, int i)
{
	return json_pack("{s:s,s:s,s:I,s:s,s:s,s:i}", "id", s->names[i], "object", "model",
			 "created", (json_int_t)s->started_unix, "owned_by", "dsagent", "root",
			 s->names[0], "max_model_len", s->max_ctx);
}

static void get_models(void *ud, const http_req *req, http_resp *resp)
{
	serve *s = ud;
	(void)req;
	if (serve_check_ready(s, resp))
		return;
	json_t *data = json_array();
	for (int i = 0; i < s->n_names; i++)
		json_array_append_new(data, model_obj(s, i));
	reply(resp, 200, json_pack("{s:s,s:o}", "object", "list", "data", data));
}

/* GET /v1/models/{id} (the SDKs' models.retrieve): one served name or
 * alias; no key needed, as for the list. */
static void get_model(void *ud, const http_req *req, http_resp *resp)
{
	serve *s = ud;
	if (serve_check_ready(s, resp))
		return;
	const char *id = req->path + strlen("/v1/models/");
	if (!*id) { /* "/v1/models/" names no model: no route, as elsewhere */
		http_resp_error(resp, 404, "invalid_request_error", "not_found",
				"no route for %s %s", req->method, req->path);
		return;
	}
	for (int i = 0; i < s->n_names; i++) {
		if (strcmp(id, s->names[i]) == 0) {
			reply(resp, 200, model_obj(s, i));
			return;
		}
	}
	http_resp_error_param(resp, 404, "not_found_error", "model_not_found", "model",
			      "The model `%.200s` does not exist.", id);
}

/* GET /version: the build, as vLLM's /version; no key, answers while
 * loading. */
static void get_version(void *ud, const http_req *req, http_resp *resp)
{
	(void)ud;
	(void)req;
	reply(resp, 200, json_pack("{s:s}", "version", eng_version()));
}

/* GET /: what this server is and where to read on; no key (it tells no
 * more than /version and /v1/models do), answers while loading. */
static void get_root(void *ud, const http_req *req, http_resp *resp)
{
	serve *s = ud;
	(void)req;
	int ready = atomic_load(&s->ready) && !atomic_load(&s->draining);
	json_t *models = json_array();
	for (int i = 0; ready && i < s->n_names; i++) /* names change only while not ready */
		json_array_append_new(models, json_string(s->names[i]));
	reply(resp, 200,
	      json_pack("{s:s,s:s,s:s,s:b,s:o,s:s,s:[s,s,s,s,s,s,s,s,s,s]}", "name", "dsagent",
			"description",
			"an OpenAI-compatible API: POST /v1/chat/completions and "
			"/v1/completions with 'Authorization: Bearer KEY' (a key from `dsctl "
			"keys create NAME`); any OpenAI client works with base URL /v1",
			"version", eng_version(), "ready", ready, "models", models, "docs",
			"docs/serving.md in the dsagent source tree (README.md to start)", "routes",
			"GET /health", "GET /version", "GET /v1/models", "GET /v1/models/{id}",
			"GET /metrics", "POST /v1/chat/completions", "POST /v1/completions",
			"POST /tokenize", "POST /detokenize", "GET /"));
}

static void get_metrics(void *ud, const http_req *req, http_resp *resp)
{
	serve *s = ud;
	int64_t key_id;
	if (s->p.metrics_auth && serve_auth(s, req, resp, &key_id))
		return;
	sched_stats st;
	int ready = atomic_load(&s->ready);
	if (ready)
		sched_get_stats(s->sc, &st);
	buf o;
	buf_init(&o, 4 << 20);
	if (metrics_render(s->met, ready ? &st : NULL, &o) != DS_OK) {
		buf_free(&o);
		http_resp_error(resp, 500, "server_error", NULL, "metrics text too large");
		return;
	}
	resp->status = 200;
	resp->body = buf_take(&o);
	if (!resp->body)
		resp->body = strdup("");
	resp->content_type = "text/plain; version=0.0.4; charset=utf-8";
}

/* Ends the metering of a /tokenize or /detokenize request: tokens (what it
 * produced or read) count as prompt tokens in the key's tpm window and usage. */
static void meter_end(serve *s, keys_hold *h, size_t tokens)
{
	ds_err err = {0};
	int64_t id = h->key_id;
	if (keys_finish(s->p.keys, h, ds_now_s(), (int64_t)tokens, 0, &err))
		log_warn("serve", "key usage not recorded", "key=%lld detail=\"%s\"", (long long)id,
			 err.msg);
}

/* POST /tokenize {"prompt": str} or {"messages": [...]} (rendered by the chat
 * template with the generation prompt): vLLM's shape.  Metered like a
 * request of one sequence: admitted (rpm, max_concurrency) before the text
 * is tokenized, its tokens charged when it ends. */
static void post_tokenize(void *ud, const http_req *req, http_resp *resp)
{
	serve *s = ud;
	int64_t key_id;
	keys_hold h;
	const char *text = NULL;
	int add_special = 1;
	ds_err err = {0};
	int32_t *ids = NULL;
	size_t n = 0;
	if (serve_check_ready(s, resp) || serve_auth(s, req, resp, &key_id))
		return;
	memset(&h, 0, sizeof h);
	json_t *body = serve_parse_body(s, req, resp);
	if (!body || !serve_model_name(s, body, resp) ||
	    serve_admit(s, key_id, 1, 0, "prompt", &h, resp))
		goto out;
	if (json_object_get(body, "messages")) {
		if (oai_chat_prompt(s, body, &ids, &n, resp)) {
			free(ids);
			ids = NULL;
			n = 0;
			goto out;
		}
		goto reply_ids;
	}
	if (jsonx_get_str(body, "prompt", 1, &text, &err) ||
	    jsonx_get_bool(body, "add_special_tokens", 0, &add_special, &err)) {
		http_resp_error_param(resp, 400, "invalid_request_error", "invalid_value",
				      strstr(err.msg, "add_special") ? "add_special_tokens" : "prompt",
				      "%s", err.msg);
		goto out;
	}
	unsigned flags = TOK_PARSE_SPECIAL;
	if (add_special && tok_bos_id(s->tk) >= 0 && tok_add_bos_default(s->tk))
		flags |= TOK_ADD_BOS;
	if (tok_encode_alloc(s->tk, text, strlen(text), flags, &ids, &n, &err)) {
		http_resp_error(resp, 400, "invalid_request_error", NULL, "%s", err.msg);
		n = 0;
		goto out;
	}
reply_ids:;
	json_t *arr = json_array();
	for (size_t i = 0; i < n; i++)
		json_array_append_new(arr, json_integer(ids[i]));
	free(ids);
	reply(resp, 200, json_pack("{s:o,s:I,s:i}", "tokens", arr, "count", (json_int_t)n,
				   "max_model_len", s->max_ctx));
out:
	meter_end(s, &h, n);
	json_decref(body);
}

/* POST /detokenize {"tokens": [ids]}: metered as /tokenize is. */
static void post_detokenize(void *ud, const http_req *req, http_resp *resp)
{
	serve *s = ud;
	int64_t key_id;
	keys_hold h;
	size_t n = 0;
	if (serve_check_ready(s, resp) || serve_auth(s, req, resp, &key_id))
		return;
	memset(&h, 0, sizeof h);
	json_t *body = serve_parse_body(s, req, resp);
	int32_t *ids = NULL;
	if (!body || !serve_model_name(s, body, resp) ||
	    serve_admit(s, key_id, 1, 0, "tokens", &h, resp))
		goto out;
	json_t *arr = json_object_get(body, "tokens");
	if (!json_is_array(arr)) {
		http_resp_error_param(resp, 400, "invalid_request_error", "invalid_value", "tokens",
				      "'tokens' must be an array of token ids");
		goto out;
	}
	size_t na = json_array_size(arr);
	ids = malloc((na ? na : 1) * sizeof *ids);
	if (!ids) {
		http_resp_error(resp, 500, "server_error", NULL, "out of memory");
		goto out;
	}
	for (size_t i = 0; i < na; i++) {
		json_t *v = json_array_get(arr, i);
		json_int_t id = json_is_integer(v) ? json_integer_value(v) : -1;
		if (id < 0 || id >= tok_vocab_size(s->tk) || !tok_token_text(s->tk, (int32_t)id, NULL)) {
			http_resp_error_param(resp, 400, "invalid_request_error", "invalid_value",
					      "tokens", "tokens[%zu] is not a token id of this model", i);
			goto out;
		}
		ids[i] = (int32_t)id;
	}
	char *text = NULL;
	size_t len = 0;
	ds_err err = {0};
	if (tok_decode_alloc(s->tk, ids, na, &text, &len, &err)) {
		http_resp_error(resp, 400, "invalid_request_error", NULL, "%s", err.msg);
		goto out;
	}
	n = na;
	/* decoded bytes may cut a character: JSON needs valid UTF-8 */
	buf clean;
	buf_init(&clean, 0);
	http_utf8_clean(text, len, &clean);
	free(text);
	reply(resp, 200, json_pack("{s:s%}", "prompt", clean.data ? clean.data : "", clean.len));
	buf_free(&clean);
out:
	meter_end(s, &h, n);
	free(ids);
	json_decref(body);
}

/* ---- the guard: every route counts as a user of the model ---- */

/* A stream's reader and done callbacks, wrapped so that the user count
 * drops when the stream is finished with. */
typedef struct guarded_stream {
	serve *s;
	http_stream_read read;
	http_stream_done done;
	void *ctx;
} guarded_stream;

static ssize_t guarded_read(void *ctx, char *out, size_t max)
{
	guarded_stream *g = ctx;
	return g->read(g->ctx, out, max);
}

static void guarded_done(void *ctx)
{
	guarded_stream *g = ctx;
	if (g->done)
		g->done(g->ctx);
	atomic_fetch_sub(&g->s->users, 1);
	free(g);
}

/* Counts the handler (and the stream it leaves) as a user, so unload
 * waits for it: the count goes up before ready is read, and unload clears
 * ready before it reads the count, so one of them sees the other. */
static void guarded(void *ud, const http_req *req, http_resp *resp, http_handler fn)
{
	serve *s = ud;
	atomic_fetch_add(&s->users, 1);
	fn(ud, req, resp);
	if (!resp->stream) {
		atomic_fetch_sub(&s->users, 1);
		return;
	}
	guarded_stream *g = malloc(sizeof *g);
	if (!g) { /* end the stream here: its done callback frees it */
		if (resp->stream_done)
			resp->stream_done(resp->stream_ctx);
		resp->stream = NULL;
		resp->stream_done = NULL;
		atomic_fetch_sub(&s->users, 1);
		http_resp_error(resp, 500, "server_error", NULL, "out of memory");
		return;
	}
	*g = (guarded_stream){s, resp->stream, resp->stream_done, resp->stream_ctx};
	resp->stream = guarded_read;
	resp->stream_done = guarded_done;
	resp->stream_ctx = g;
}

#define GUARD(name, fn)                                                          \
	static void name(void *ud, const http_req *req, http_resp *resp)        \
	{                                                                        \
		guarded(ud, req, resp, fn);                                      \
	}
GUARD(g_root, get_root)
GUARD(g_health, get_health)
GUARD(g_models, get_models)
GUARD(g_model, get_model)
GUARD(g_metrics, get_metrics)
GUARD(g_chat, oai_chat)
GUARD(g_completions, oai_completions)
GUARD(g_tokenize, post_tokenize)
GUARD(g_detokenize, post_detokenize)
#undef GUARD

/* The routes' auth rules as http.c checks them on the request headers,
 * before any body byte is read (a request without a valid key never gets
 * its body buffered); the handlers still check after the body. */
static int auth_key(void *ud, const http_req *req, http_resp *resp)
{
	int64_t key_id;
	return serve_auth(ud, req, resp, &key_id) == 0;
}

/* auth_key for a generation route: a refused request still ends with its
 * "request done" line (oai.c's form), with the id the handler would give. */
static int auth_gen(void *ud, const http_req *req, http_resp *resp, const char *prefix)
{
	int64_t key_id;
	if (serve_auth(ud, req, resp, &key_id) == 0)
		return 1;
	char rid[160], id[200];
	serve_request_id(req, resp, prefix, rid, sizeof rid);
	snprintf(id, sizeof id, "%s%s", strncmp(rid, prefix, strlen(prefix)) == 0 ? "" : prefix, rid);
	log_info("serve", "request done",
		 "id=%s key=- status=%d stream=0 prompt_tokens=0 completion_tokens=0 ttft_s=- "
		 "duration_s=0.000 finish=-", id, resp->status);
	return 0;
}

static int auth_chat(void *ud, const http_req *req, http_resp *resp)
{
	return auth_gen(ud, req, resp, "chatcmpl-");
}

static int auth_completions(void *ud, const http_req *req, http_resp *resp)
{
	return auth_gen(ud, req, resp, "cmpl-");
}

static int auth_metrics(void *ud, const http_req *req, http_resp *resp)
{
	const serve *s = ud;
	return !s->p.metrics_auth || auth_key(ud, req, resp);
}

const http_route serve_routes[] = {
	{.method = "GET", .path = "/", .fn = g_root},
	{.method = "GET", .path = "/version", .fn = get_version}, /* uses nothing of the model */
	{.method = "GET", .path = "/health", .fn = g_health},
	{.method = "GET", .path = "/v1/models", .fn = g_models},
	{.method = "GET", .path = "/v1/models/*", .fn = g_model},
	{.method = "GET", .path = "/metrics", .fn = g_metrics, .auth = auth_metrics},
	{.method = "POST", .path = "/v1/chat/completions", .fn = g_chat, .auth = auth_chat},
	{.method = "POST", .path = "/v1/completions", .fn = g_completions, .auth = auth_completions},
	{.method = "POST", .path = "/tokenize", .fn = g_tokenize, .auth = auth_key},
	{.method = "POST", .path = "/detokenize", .fn = g_detokenize, .auth = auth_key},
	{0},
};

/*
 * serve.c - the serving context and the small routes of the OpenAI API:
 * /health, /v1/models, /metrics, /tokenize, /detokenize (see serve.h), plus
 * what every handler shares: readiness, auth, body parsing, model names,
 * request ids.  The generation routes live in oai.c.
 *
 * Called from main (serve_new / serve_load / serve_free) and from HTTP
 * connection threads (handlers).  Invariant: s->ready is set only after
 * every member used by handlers is in place, and never cleared before
 * serve_free stops the HTTP server's use of it (main frees the server first).
 */
#include "agent/api/serve.h"
#include "agent/auth/keys.h"
#include "common/jsonx.h"
#include "common/log.h"
#include "common/strutil.h"
#include "engine/driver.h"
#include "engine/engine.h"
#include "engine/source.h"

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

serve *serve_new(const serve_params *p, ds_err *err)
{
	serve *s = calloc(1, sizeof *s);
	if (!s) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	s->p = *p;
	s->started_s = ds_now_s();
	s->started_unix = (int64_t)time(NULL);
	if (p->auth && !p->keys) {
		ds_err_set(err, DS_EINVAL, "serving with auth needs the key service");
		goto fail;
	}
	char base[256];
	s->names_buf = strdup(p->names ? p->names : base_name(p->model_path, base, sizeof base));
	if (!s->names_buf) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		goto fail;
	}
	for (char *t = s->names_buf, *next; t; t = next) {
		next = strchr(t, ',');
		if (next)
			*next++ = 0;
		if (!*t) {
			ds_err_set(err, DS_EINVAL, "--served-model-name '%s' has an empty name",
				   p->names);
			goto fail;
		}
		if (s->n_names == SERVE_MAX_NAMES) {
			ds_err_set(err, DS_EINVAL, "--served-model-name: at most %d names",
				   SERVE_MAX_NAMES);
			goto fail;
		}
		s->names[s->n_names++] = t;
	}
	if (!(s->met = metrics_new(s->names[0]))) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		goto fail;
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
 * shared out.  Called from the main thread, which lives as long as the agent
 * (the ranks' death signal follows the thread that forked them). */
static model *plan_model_load(serve *s, model_params *mp, ds_err *err)
{
	static char exe[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
	if (n <= 0 || (size_t)n >= sizeof exe - 1) {
		ds_err_set(err, DS_EIO, "cannot read this binary's path (/proc/self/exe)");
		return NULL;
	}
	exe[n] = '\0';
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

int serve_load(serve *s, ds_err *err)
{
	int rc;
	double t0 = ds_now_s();
	/* one open of the checkpoint for the tokenizer and the model */
	msrc *src = msrc_open(s->p.model_path, err);
	if (!src)
		return err->code ? err->code : DS_EIO;
	if (!(s->tk = eng_tok_load_source(src, err))) {
		msrc_unref(src);
		return err->code ? err->code : DS_EIO;
	}
	model_params mp = model_default_params();
	mp.path = s->p.model_path;
	mp.source = src;
	mp.backend = s->p.backend;
	mp.threads = s->p.threads;
	mp.max_ctx = s->p.ctx;
	mp.max_seqs = s->p.max_running;
	mp.max_batch_tokens = s->p.max_batch_tokens;
	mp.page_size = s->p.page_size;
	mp.kv_bytes = s->p.kv_bytes;
	s->m = plan_world(s) > 1 ? plan_model_load(s, &mp, err) : model_load(&mp, err);
	msrc_unref(src); /* the model holds its own reference */
	if (!s->m)
		return err->code ? err->code : DS_EIO;
	s->max_ctx = model_max_ctx(s->m);
	s->vocab = model_vocab_size(s->m);
	if ((rc = chat_params_for_tok(s->tk, s->p.chat_template, &s->chat, err)) == DS_OK) {
		s->has_chat = 1;
	} else if (s->p.chat_template) {
		return rc; /* an override that does not exist is an error */
	} else {
		log_warn("serve", "no chat template", "model=%s detail=\"%s\"", s->p.model_path,
			 err->msg);
		*err = (ds_err){0};
	}
	find_eot(s);
	sched_params sp = {
		.max_running = s->p.max_running,
		.max_waiting = s->p.max_waiting,
		.token_budget = s->p.max_batch_tokens,
		.prefill_chunk = s->p.prefill_chunk,
	};
	if (!(s->sc = sched_new(s->m, &sp, err)))
		return err->code ? err->code : DS_EIO;
	atomic_store(&s->ready, 1);
	const kv_params *kp = kv_cache_params(model_kv(s->m));
	log_info("serve", "model loaded",
		 "model=%s arch=%s ctx=%d kv_pages=%d page_size=%d chat=%s load_s=%.2f", s->names[0],
		 model_arch_name(s->m), s->max_ctx, kp->n_pages, kp->page_size,
		 s->has_chat ? chat_template_name(s->chat.tmpl) : "none", ds_now_s() - t0);
	return DS_OK;
}

void serve_stop(serve *s)
{
	if (!s)
		return;
	atomic_store(&s->stopping, 1);
	atomic_store(&s->ready, 0);
}

void serve_free(serve *s)
{
	if (!s)
		return;
	atomic_store(&s->ready, 0);
	sched_free(s->sc);
	model_free(s->m);
	tok_free(s->tk);
	metrics_free(s->met);
	free(s->names_buf);
	free(s);
}

/* ---- shared helpers ---- */

int serve_check_ready(serve *s, http_resp *resp)
{
	if (atomic_load(&s->ready))
		return 0;
	http_resp_error(resp, 503, "service_unavailable_error", "loading",
			"the model is loading; retry shortly");
	http_resp_header(resp, "Retry-After", "5");
	return 1;
}

int serve_auth(serve *s, const http_req *req, http_resp *resp, int64_t *key_id)
{
	*key_id = -1;
	if (!s->p.auth)
		return 0;
	ds_err err = {0};
	keys_identity who;
	if (keys_auth(s->p.keys, http_req_header(req, "Authorization"), (int64_t)time(NULL), &who,
		      &err) == DS_OK) {
		*key_id = who.id;
		return 0;
	}
	metrics_rejected(s->met, MET_REJ_AUTH);
	http_resp_error(resp, 401, "authentication_error", "invalid_api_key", "%s", err.msg);
	http_resp_header(resp, "WWW-Authenticate", "Bearer");
	return 1;
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

static void get_models(void *ud, const http_req *req, http_resp *resp)
{
	serve *s = ud;
	(void)req;
	if (serve_check_ready(s, resp))
		return;
	json_t *data = json_array();
	for (int i = 0; i < s->n_names; i++)
		json_array_append_new(data, json_pack("{s:s,s:s,s:I,s:s,s:s,s:i}", "id", s->names[i],
						      "object", "model", "created",
						      (json_int_t)s->started_unix, "owned_by", "dsagent",
						      "root", s->names[0], "max_model_len",
						      s->max_ctx));
	reply(resp, 200, json_pack("{s:s,s:o}", "object", "list", "data", data));
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

/* POST /tokenize {"prompt": str} or {"messages": [...]} (rendered by the chat
 * template with the generation prompt): vLLM's shape. */
static void post_tokenize(void *ud, const http_req *req, http_resp *resp)
{
	serve *s = ud;
	int64_t key_id;
	if (serve_check_ready(s, resp) || serve_auth(s, req, resp, &key_id))
		return;
	json_t *body = serve_parse_body(s, req, resp);
	if (!body || !serve_model_name(s, body, resp))
		goto out;
	const char *text = NULL;
	int add_special = 1;
	ds_err err = {0};
	int32_t *ids = NULL;
	size_t n = 0;
	if (json_object_get(body, "messages")) {
		if (oai_chat_prompt(s, body, &ids, &n, resp)) {
			free(ids);
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
	json_decref(body);
}

static void post_detokenize(void *ud, const http_req *req, http_resp *resp)
{
	serve *s = ud;
	int64_t key_id;
	if (serve_check_ready(s, resp) || serve_auth(s, req, resp, &key_id))
		return;
	json_t *body = serve_parse_body(s, req, resp);
	int32_t *ids = NULL;
	if (!body || !serve_model_name(s, body, resp))
		goto out;
	json_t *arr = json_object_get(body, "tokens");
	if (!json_is_array(arr)) {
		http_resp_error_param(resp, 400, "invalid_request_error", "invalid_value", "tokens",
				      "'tokens' must be an array of token ids");
		goto out;
	}
	size_t n = json_array_size(arr);
	ids = malloc((n ? n : 1) * sizeof *ids);
	if (!ids) {
		http_resp_error(resp, 500, "server_error", NULL, "out of memory");
		goto out;
	}
	for (size_t i = 0; i < n; i++) {
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
	if (tok_decode_alloc(s->tk, ids, n, &text, &len, &err)) {
		http_resp_error(resp, 400, "invalid_request_error", NULL, "%s", err.msg);
		goto out;
	}
	/* decoded bytes may cut a character: JSON needs valid UTF-8 */
	buf clean;
	buf_init(&clean, 0);
	http_utf8_clean(text, len, &clean);
	free(text);
	reply(resp, 200, json_pack("{s:s%}", "prompt", clean.data ? clean.data : "", clean.len));
	buf_free(&clean);
out:
	free(ids);
	json_decref(body);
}

const http_route serve_routes[] = {
	{.method = "GET", .path = "/health", .fn = get_health},
	{.method = "GET", .path = "/v1/models", .fn = get_models},
	{.method = "GET", .path = "/metrics", .fn = get_metrics},
	{.method = "POST", .path = "/v1/chat/completions", .fn = oai_chat},
	{.method = "POST", .path = "/v1/completions", .fn = oai_completions},
	{.method = "POST", .path = "/tokenize", .fn = post_tokenize},
	{.method = "POST", .path = "/detokenize", .fn = post_detokenize},
	{0},
};

/*
 * serve.h - the OpenAI-compatible API of one node: model, tokenizer, chat
 * template, scheduler and metrics behind the route table serve_routes.
 *
 *   main ──serve_new──> routes answer 503 "loading" (health too)
 *        ──serve_load─> model + tokenizer + scheduler; ready: 200
 *        ──serve_drain> (SIGTERM) new requests get 503 "shutting_down";
 *                       running ones go on while main waits up to
 *                       --shutdown-grace-ms for serve_busy to reach 0
 *        ──serve_stop─> what still runs ends: a stream with an error event
 *                       and `data: [DONE]`, an unstreamed request with 503;
 *                       serve_wait_idle lets them reach the client
 *        ──serve_free─> scheduler stopped, model freed
 *
 * A deployment (agent/api/deploy.h, `dsctl cluster up`) swaps the model at
 * run time: serve_deploy unloads what is served and loads another model,
 * serve_refuse turns new requests away with a reason while open ones end,
 * serve_undeploy unloads.  Loads and unloads of serve_deploy run on the
 * serve's own loader thread, which lives as long as the serve: the rank
 * processes a driver forks die with the thread that forked them.
 *
 * Routes (docs/serving.md): GET /, GET /version, GET /health,
 * GET /v1/models, GET /v1/models/{id}, GET /metrics,
 * POST /v1/chat/completions, POST /v1/completions, POST /tokenize,
 * POST /detokenize.  Every route but /, /version, /health, /v1/models,
 * /v1/models/{id} and (unless metrics_auth) /metrics needs
 * `Authorization: Bearer <key>` checked by the key service; OPTIONS
 * preflight is answered by http.c without auth.
 *
 * Logging: one line per finished generation request ("request done": id,
 * key name, status, tokens, TTFT, duration; never a prompt or a key), and
 * while requests run a "throughput" line every stats_log_ms.
 *
 * Threading: handlers run on HTTP connection threads; after serve_load the
 * struct is read-only except through its thread-safe members (sched,
 * metrics, keys).
 */
#ifndef DS_AGENT_SERVE_H
#define DS_AGENT_SERVE_H

#include "agent/api/http.h"
#include "agent/api/metrics.h"
#include "agent/auth/keys.h"
#include "engine/chat.h"
#include "engine/model.h"
#include "engine/sched.h"
#include "engine/tok.h"

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>

struct keys_svc;
struct driver_launch;
struct serve_job;

typedef struct serve_params {
	const char *model_path;
	const char *names;         /* NAME[,ALIAS...] or NULL */
	const char *chat_template; /* override name or NULL */
	const char *backend;
	int threads, ctx, max_running, max_waiting, max_batch_tokens, prefill_chunk, page_size;
	int prefix_caching;        /* automatic prefix caching (engine/sched.h) */
	int tp, pp, ep;            /* > 1 world: the model runs in rank processes (engine/driver.h) */
	size_t kv_bytes;
	const char *kv_cache_dtype; /* auto | f16 | f32 (NULL: auto) */
	int auth;                  /* 0 = --insecure-no-auth */
	int metrics_auth;
	int max_n, max_logprobs;
	int stats_log_ms;          /* period of the throughput log line; 0 = none */
	struct keys_svc *keys;     /* the key service (NULL only with auth 0) */
} serve_params;

/* What serve_deploy loads. */
typedef struct serve_spec {
	const char *model_path;
	const char *names;     /* NAME[,ALIAS...]; NULL = the path's base name */
	int threads;           /* per rank; 0 = serve_params' */
	int max_ctx, max_seqs; /* 0 = serve_params' ctx and max_running */
	/* The plan's ranks (engine/driver.h; argv, plan, hooks borrowed for
	 * the call); NULL = one model in this process. */
	const struct driver_launch *launch;
} serve_spec;

#define SERVE_MAX_NAMES 8
#define SERVE_MAX_EOT 4

typedef struct serve {
	serve_params p;
	char *names_buf;
	const char *names[SERVE_MAX_NAMES];
	int n_names;
	atomic_int ready;    /* 1 after serve_load succeeded */
	atomic_int stopping; /* 1 once serve_stop ran: generation loops end */
	atomic_int draining; /* 1 once serve_drain ran: new requests get 503 */
	atomic_int users;    /* handlers and open streams using the model */
	pthread_mutex_t mu;  /* why (below), the loader's job, sc's swaps, stats_stop */
	pthread_cond_t cv;
	pthread_cond_t stats_cv; /* wakes the stats thread to stop (mu) */
	int has_stats, stats_stop;
	pthread_t stats;     /* the throughput log line (stats_main) */
	char why[512];       /* why requests get 503 while not ready ("" = loading) */
	char why_code[32];
	int has_loader;      /* the loader thread runs */
	pthread_t loader;
	struct serve_job *job; /* the loader's current job (mu) */
	int loader_stop;
	double started_s;
	int64_t started_unix;
	model *m;
	tok *tk;
	chat_params chat;
	int has_chat;      /* a chat template was recognised (or given) */
	int32_t eot[SERVE_MAX_EOT]; /* end-of-turn ids of the template (beside the model's eos) */
	int n_eot;
	int max_ctx, vocab;
	sched *sc;
	metrics *met;
} serve;

extern const http_route serve_routes[];

/* Validates p and starts in the loading state (nothing loaded yet).
 * p->model_path NULL: nothing is to be loaded until serve_deploy; requests
 * get 503 "no_model". */
serve *serve_new(const serve_params *p, ds_err *err);
/* Loads model, tokenizer and scheduler; on success the routes serve. */
int serve_load(serve *s, ds_err *err);
/* Refuses new requests (503 "shutting_down", /health too) from now on;
 * running ones go on.  NULL is a no-op. */
void serve_drain(serve *s);
/* Handlers and streams in progress (generation and the small routes). */
int serve_busy(serve *s);
/* Refuses new requests and makes every open generation end (within a
 * fraction of a second: a stream with an error event and `data: [DONE]`,
 * an unstreamed request with a 503), so the HTTP server can stop; NULL is a
 * no-op. */
void serve_stop(serve *s);
/* Waits up to timeout_ms for serve_busy to reach 0 (after serve_stop: the
 * last events reached the clients); 1 when it did. */
int serve_wait_idle(serve *s, int timeout_ms);
void serve_free(serve *s);

/* Unloads what is served (open requests end as with serve_stop, then the
 * model, tokenizer and scheduler are freed) and loads sp on the loader
 * thread; returns when the new model serves, or with err (then nothing is
 * served and requests get 503 with the error).  One caller at a time. */
int serve_deploy(serve *s, const serve_spec *sp, ds_err *err);
/* Unloads what is served; requests then get 503 with code and why. */
void serve_undeploy(serve *s, const char *code, const char *why);
/* New requests get 503 with code and why from now on; open ones go on
 * (a model whose ranks died fails them with an error event). */
void serve_refuse(serve *s, const char *code, const char *why);
/* The pid of rank `rank` when the served model runs in rank processes
 * forked by this process, else 0. */
int serve_rank_pid(serve *s, int rank);

/* ---- shared by the handlers (serve.c, oai.c) ---- */

/* Checks the bearer key: 0 with *key_id set (-1 when auth is off), or
 * nonzero after filling resp with the 401. */
int serve_auth(serve *s, const http_req *req, http_resp *resp, int64_t *key_id);
/* Admits a request of key_id (-1: auth is off, nothing to check) that runs
 * seqs sequences, which wait in the scheduler's queue when `queues` (the
 * key's share of it applies): 0 with h holding them (zeroed without a key),
 * or nonzero after filling resp: 429 with Retry-After (over a limit now), 400
 * `exceeds_key_limit` with param (the request can never fit the key's
 * limits), 401 (revoked since serve_auth).  Checks nothing that needs the
 * prompt's tokens: call it before tokenizing (docs/keys.md). */
int serve_admit(serve *s, int64_t key_id, int64_t seqs, int queues, const char *param,
		keys_hold *h, http_resp *resp);
/* Reserves tokens against the tpm of h's key: 0, or nonzero after filling
 * resp as serve_admit does (400 names param) and dropping h. */
int serve_reserve(serve *s, keys_hold *h, int64_t tokens, const char *param, http_resp *resp);
/* serve_auth that also copies the key's name to name[n] ("-" when auth is
 * off or failed), for the request log line. */
int serve_auth_named(serve *s, const http_req *req, http_resp *resp, int64_t *key_id,
		     char *name, size_t n);
/* Code and message of the error that ends a generation cut by serve_stop
 * ("shutting_down") or by an unload of the model ("model_unloaded"). */
void serve_stop_error(serve *s, const char **code, const char **message);
/* 503 while loading; 0 when ready. */
int serve_check_ready(serve *s, http_resp *resp);
/* Parses the JSON object body (content type, depth, UTF-8), or fills resp. */
json_t *serve_parse_body(serve *s, const http_req *req, http_resp *resp);
/* The served name for a request's "model" (NULL/absent = the first name);
 * NULL after filling resp with the 404. */
const char *serve_model_name(serve *s, const json_t *body, http_resp *resp);
/* Adds X-Request-Id (the client's when it is sane, else a new one) to resp
 * and copies it to id. */
void serve_request_id(const http_req *req, http_resp *resp, const char *prefix, char *id,
		      size_t n);

/* The token ids of a chat request's "messages" rendered by the chat
 * template (with the generation prompt); nonzero after filling resp with the
 * 400.  *ids is malloc'd (caller frees, also on error). */
int oai_chat_prompt(serve *sv, const json_t *body, int32_t **ids, size_t *n, http_resp *resp);

/* The chat and completions handlers (oai.c). */
void oai_chat(void *ud, const http_req *req, http_resp *resp);
void oai_completions(void *ud, const http_req *req, http_resp *resp);

#endif

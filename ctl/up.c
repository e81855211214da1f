/*
 * up.c - `dsctl cluster up` / `dsctl cluster down`: the deployment flow (see
 * up.h).  Called by ctl/main.c; calls ctl/client.c for HTTP.  Single-threaded;
 * each phase polls with a sleep and stops at the one deadline.
 *
 *   wait_head ──head (+ expect alive)──> post_up ──202──> print_plan ──> follow
 *      │ 4xx, 401, unreachable             │ 503: retried          │
 *      v                                   v 4xx, 422 (shortfall)  v serving: DS_OK
 *    error                               error          failed/stopped/none/4xx: error
 *   (and the deadline passing in any phase: DS_ETIMEOUT)
 *
 * Rules: a 5xx or an unreachable agent while following is retried (the head
 * may be changing); before the POST an unreachable agent ends the command at
 * once (a wrong --agent should not make the operator wait).  Nothing of the
 * replies is trusted: every field is read with a type check and a default.
 */
#include "ctl/up.h"

#include "common/buf.h"
#include "common/jsonx.h"
#include "common/strutil.h"
#include "ctl/client.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { BAR = 24, POST_MIN_MS = 60000, RETRY_MS = 500 };
enum { GOING_ON = 1 }; /* follow: the deployment is still on its way */

up_params up_default_params(void)
{
	return (up_params){
		.request_ms = 10000,
		.wait_ms = 600000,
		.poll_ms = 100,
		.dsctl = "dsctl",
		.out = stdout,
		.err = stderr,
	};
}

void up_result_init(up_result *r)
{
	memset(r, 0, sizeof *r);
	r->deployment = -1;
	r->failed_rank = -1;
}

void up_result_free(up_result *r)
{
	if (!r)
		return;
	json_decref(r->shortfall);
	r->shortfall = NULL;
}

/* ---- small helpers ---- */

static int fail(up_result *res, int code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static int fail(up_result *res, int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(res->error, sizeof res->error, fmt, ap);
	va_end(ap);
	return code;
}

/* One line of JSON on out (the events of --json). */
static void emit(const up_params *p, json_t *ev)
{
	char *s = ev ? json_dumps(ev, JSON_COMPACT) : NULL;
	if (s)
		fprintf(p->out, "%s\n", s);
	fflush(p->out);
	free(s);
	json_decref(ev);
}

static void fmt_bytes(long long b, char *out, size_t n)
{
	if (b >= (1LL << 30))
		snprintf(out, n, "%.1f GiB", (double)b / (double)(1LL << 30));
	else
		snprintf(out, n, "%.1f MiB", (double)b / (double)(1LL << 20));
}

/* An answer of the agent: the status, the body as JSON (NULL when it is not
 * JSON) and a message for people (error.message, else the body's start). */
struct answer {
	long status;
	json_t *doc;
	char msg[512];
};

/* DS_OK with *a filled (a->doc owned by the caller), or DS_EIO with res->error
 * saying the agent cannot be reached. */
static int ask(const up_params *p, const char *method, const char *path, const json_t *body,
	       long timeout_ms, struct answer *a, up_result *res)
{
	ctl_client c = {.base_url = p->control_url, .token = p->token, .timeout_ms = timeout_ms};
	char *text = NULL;
	buf b;
	ds_err err = {0};
	memset(a, 0, sizeof *a);
	if (body && !(text = json_dumps(body, JSON_COMPACT)))
		return fail(res, DS_ENOMEM, "out of memory");
	buf_init(&b, 16 << 20);
	int rc = ctl_request(&c, method, path, text, &a->status, &b, &err);
	free(text);
	if (rc != DS_OK) {
		buf_free(&b);
		return fail(res, DS_EIO, "%s", err.msg);
	}
	a->doc = jsonx_parse(b.data ? b.data : "", b.len, 64, NULL);
	const json_t *m = json_object_get(json_object_get(a->doc, "error"), "message");
	if (json_is_string(m))
		snprintf(a->msg, sizeof a->msg, "%s", json_string_value(m));
	else
		snprintf(a->msg, sizeof a->msg, "%.200s", b.data ? b.data : "(empty body)");
	buf_free(&b);
	return DS_OK;
}

/* The outcome of an answer that is neither success nor to be retried. */
static int refused(const up_params *p, const char *method, const char *path,
		   const struct answer *a, up_result *res)
{
	if (a->status == 401)
		return fail(res, DS_EAUTH, "%s %s: the agent at %s rejected the admin token read "
			    "from %s: %s", method, path, p->control_url,
			    p->token_source ? p->token_source : "?", a->msg);
	return fail(res, DS_EINVAL, "%s %s answered %ld: %s", method, path, a->status, a->msg);
}

/* ---- phase 1: a head and the expected members ---- */

static int wait_head(const up_params *p, double deadline, up_result *res)
{
	char last[640] = "", now[640];
	for (;;) {
		struct answer a;
		int rc = ask(p, "GET", "/v1/cluster/state", NULL, p->request_ms, &a, res);
		if (rc != DS_OK)
			return rc;
		long long alive = 0, epoch = 0;
		int ok = 0;
		if (a.status >= 200 && a.status < 300 && json_is_object(a.doc)) {
			int has = json_is_true(json_object_get(a.doc, "has_head"));
			jsonx_int_at(a.doc, "alive", &alive);
			jsonx_int_at(a.doc, "head_epoch", &epoch);
			const char *head = jsonx_str_or(json_object_get(a.doc, "head"), "name", "?");
			if (!has)
				snprintf(now, sizeof now, "%s (%lld member(s) alive)",
					 jsonx_str_or(a.doc, "why", "no head yet"), alive);
			else if (p->expect > 0 && alive < p->expect)
				snprintf(now, sizeof now, "head %s; %lld of %d members alive", head,
					 alive, p->expect);
			else
				ok = 1;
			if (ok && p->json) {
				emit(p, json_pack("{s:s,s:s,s:I,s:I}", "event", "head", "head", head,
						  "epoch", (json_int_t)epoch, "alive",
						  (json_int_t)alive));
			} else if (ok) {
				fprintf(p->out, "head: %s (epoch %lld), %lld member(s) alive\n", head,
					epoch, alive);
				fflush(p->out);
			}
		} else if (a.status >= 500 || (a.status >= 200 && a.status < 300)) {
			snprintf(now, sizeof now, "GET /v1/cluster/state answered %ld: %s", a.status,
				 a.msg);
		} else {
			rc = refused(p, "GET", "/v1/cluster/state", &a, res);
			json_decref(a.doc);
			return rc;
		}
		json_decref(a.doc);
		if (ok)
			return DS_OK;
		if (strcmp(now, last) != 0) {
			if (p->json)
				emit(p, json_pack("{s:s,s:s}", "event", "waiting", "why", now));
			else
				fprintf(p->out, "waiting: %s\n", now);
			fflush(p->out);
			snprintf(last, sizeof last, "%s", now);
		}
		if (ds_now_s() >= deadline)
			return fail(res, DS_ETIMEOUT, "no head within --wait %ld ms: %s", p->wait_ms,
				    last);
		ds_sleep_ms(p->poll_ms);
	}
}

/* ---- phase 2: POST /v1/cluster/up ---- */

static json_t *up_body(const up_params *p)
{
	json_t *b = json_pack("{s:s}", "model", p->model);
	if (!b)
		return NULL;
	if (p->served_model_name)
		json_object_set_new(b, "served_model_name", json_string(p->served_model_name));
	if (p->tp > 0)
		json_object_set_new(b, "tp", json_integer(p->tp));
	if (p->pp > 0)
		json_object_set_new(b, "pp", json_integer(p->pp));
	if (p->ep > 0)
		json_object_set_new(b, "ep", json_integer(p->ep));
	if (p->max_ctx > 0)
		json_object_set_new(b, "max_ctx", json_integer(p->max_ctx));
	if (p->mem_fraction > 0)
		json_object_set_new(b, "mem_fraction", json_real(p->mem_fraction));
	return b;
}

/* Why a plan does not fit, from its "shortfall" (planner document). */
static void print_shortfall(const up_params *p, const json_t *plan)
{
	const json_t *s = json_object_get(plan, "shortfall");
	if (!json_is_object(s))
		return;
	long long bytes = 0, rank = -1, total = 0;
	char b1[32], b2[32];
	jsonx_int_at(s, "bytes", &bytes);
	jsonx_int_at(s, "rank", &rank);
	jsonx_int_at(s, "total_bytes", &total);
	fmt_bytes(bytes, b1, sizeof b1);
	fmt_bytes(total, b2, sizeof b2);
	fprintf(p->err, "the model does not fit: short by %s on rank %lld (%s over all devices)\n",
		b1, rank, b2);
	const json_t *sug = json_object_get(s, "suggestions");
	for (size_t i = 0; i < json_array_size(sug); i++) {
		const json_t *x = json_array_get(sug, i);
		if (json_is_string(x))
			fprintf(p->err, "  would fit: %s\n", json_string_value(x));
	}
}

static int post_up(const up_params *p, double deadline, json_t **doc, up_result *res)
{
	json_t *body = up_body(p);
	char last[600] = "";
	long t = p->request_ms > POST_MIN_MS ? p->request_ms : POST_MIN_MS;
	int rc;
	if (!body)
		return fail(res, DS_ENOMEM, "out of memory");
	for (;;) {
		struct answer a;
		if ((rc = ask(p, "POST", "/v1/cluster/up", body, t, &a, res)) != DS_OK)
			break;
		if (a.status >= 200 && a.status < 300 && json_is_object(a.doc)) {
			*doc = a.doc;
			break;
		}
		if (a.status >= 200 && a.status < 300) {
			rc = fail(res, DS_EINVAL, "POST /v1/cluster/up answered %ld with no JSON "
				  "object: %s", a.status, a.msg);
		} else if (a.status == 422) {
			const json_t *plan = json_object_get(a.doc, "plan");
			if (!p->json)
				print_shortfall(p, plan);
			res->shortfall = json_incref(json_object_get(plan, "shortfall"));
			rc = fail(res, DS_ERANGE, "POST /v1/cluster/up answered 422: %s", a.msg);
		} else if (a.status == 503) {
			if (strcmp(a.msg, last) != 0) {
				if (p->json)
					emit(p, json_pack("{s:s,s:s}", "event", "waiting", "why", a.msg));
				else
					fprintf(p->out, "waiting: the head is not ready: %s\n", a.msg);
				fflush(p->out);
				snprintf(last, sizeof last, "%s", a.msg);
			}
			json_decref(a.doc);
			if (ds_now_s() >= deadline) {
				rc = fail(res, DS_ETIMEOUT, "POST /v1/cluster/up still answered 503 "
					  "after --wait %ld ms: %s", p->wait_ms, last);
				break;
			}
			ds_sleep_ms(RETRY_MS);
			continue;
		} else {
			rc = refused(p, "POST", "/v1/cluster/up", &a, res);
		}
		json_decref(a.doc);
		break;
	}
	json_decref(body);
	return rc;
}

/* ---- the plan ---- */

/* "node2" for a rank: its node's name where the document has one, else the
 * hostname and index of its node. */
static void rank_node(const json_t *plan, const json_t *r, char *out, size_t n)
{
	const json_t *node = json_object_get(r, "node");
	long long idx = -1;
	if (json_is_string(json_object_get(r, "node_name"))) {
		snprintf(out, n, "%s", jsonx_str_or(r, "node_name", "?"));
		return;
	}
	if (json_is_string(node)) {
		snprintf(out, n, "%s", json_string_value(node));
		return;
	}
	jsonx_int_at(r, "node", &idx);
	const json_t *nd = idx >= 0 ? json_array_get(json_object_get(plan, "nodes"), (size_t)idx)
				    : NULL;
	if (json_is_string(json_object_get(nd, "name")))
		snprintf(out, n, "%s", jsonx_str_or(nd, "name", "?"));
	else
		snprintf(out, n, "node %lld (%s)", idx, jsonx_str_or(r, "hostname", jsonx_str_or(nd, "hostname", "?")));
}

static void rank_device(const json_t *plan, const json_t *r, char *out, size_t n)
{
	long long dev = -1, idx = -1;
	jsonx_int_at(r, "device", &dev);
	jsonx_int_at(r, "node", &idx);
	const json_t *nd = idx >= 0 ? json_array_get(json_object_get(plan, "nodes"), (size_t)idx)
				    : NULL;
	int cpu = dev < 0 || strcmp(jsonx_str_or(nd, "kind", "gpu"), "cpu") == 0;
	if (dev < 0)
		snprintf(out, n, "cpu");
	else
		snprintf(out, n, "%s%lld", cpu ? "cpu" : "gpu", dev);
}

static void print_plan(const up_params *p, const json_t *doc, up_result *res)
{
	const json_t *plan = json_object_get(doc, "plan");
	const json_t *ranks = json_object_get(plan, "ranks");
	const json_t *kv = json_object_get(plan, "kv");
	long long tp = 0, pp = 0, ep = 0, world = 0, ctx = -1, conc = -1, tokens = -1;
	jsonx_int_at(doc, "deployment", &res->deployment);
	jsonx_int_at(plan, "tp", &tp);
	jsonx_int_at(plan, "pp", &pp);
	jsonx_int_at(plan, "ep", &ep);
	jsonx_int_at(plan, "world", &world);
	jsonx_int_at(kv, "max_ctx", &ctx);
	jsonx_int_at(kv, "concurrency", &conc);
	jsonx_int_at(kv, "tokens", &tokens);
	if (p->json) {
		json_t *rs = json_array();
		for (size_t i = 0; rs && i < json_array_size(ranks); i++) {
			const json_t *r = json_array_get(ranks, i);
			char node[256], dev[32];
			long long k = (long long)i;
			jsonx_int_at(r, "rank", &k);
			rank_node(plan, r, node, sizeof node);
			rank_device(plan, r, dev, sizeof dev);
			json_array_append_new(rs, json_pack("{s:I,s:s,s:s}", "rank", (json_int_t)k,
							    "node", node, "device", dev));
		}
		json_t *ev = json_pack("{s:s,s:O,s:s,s:I,s:I,s:I,s:I,s:o,s:O,s:O}", "event", "plan",
				       "deployment", json_object_get(doc, "deployment") ?
				       json_object_get(doc, "deployment") : json_null(),
				       "state", jsonx_str_or(doc, "state", "?"), "tp", (json_int_t)tp,
				       "pp", (json_int_t)pp, "ep", (json_int_t)ep, "world",
				       (json_int_t)world, "ranks", rs ? rs : json_array(), "kv",
				       kv ? kv : json_null(), "plan", plan ? plan : json_null());
		emit(p, ev);
		return;
	}
	fprintf(p->out, "deployment %lld: %s; tp %lld x pp %lld x ep %lld = %lld rank(s)\n",
		res->deployment, p->model, tp, pp, ep, world);
	for (size_t i = 0; i < json_array_size(ranks); i++) {
		const json_t *r = json_array_get(ranks, i);
		char node[256], dev[32];
		long long k = (long long)i, stage = 0;
		jsonx_int_at(r, "rank", &k);
		jsonx_int_at(r, "stage", &stage);
		rank_node(plan, r, node, sizeof node);
		rank_device(plan, r, dev, sizeof dev);
		fprintf(p->out, "  rank %lld -> %s %s (stage %lld)\n", k, node, dev, stage);
	}
	if (ctx >= 0 && conc >= 0)
		fprintf(p->out, "KV: max context %lld, %lld sequence(s) of it at once (%lld tokens)\n",
			ctx, conc, tokens);
	else
		fprintf(p->out, "KV: (not in the plan)\n");
	fflush(p->out);
}

/* ---- phase 3: follow GET /v1/cluster/up ---- */

/* One node's progress: bytes when every rank knows its total, else the
 * rank states ("rank 0 loading, rank 1 ready"). */
struct node_view {
	char name[128];
	long long loaded, total;
	int bytes_known;
	char ranks[512];
};

static void node_view_of(const json_t *n, struct node_view *v)
{
	const json_t *rs = json_object_get(n, "ranks");
	size_t off = 0;
	memset(v, 0, sizeof *v);
	snprintf(v->name, sizeof v->name, "%s", jsonx_str_or(n, "name", "?"));
	v->bytes_known = json_array_size(rs) > 0;
	for (size_t i = 0; i < json_array_size(rs); i++) {
		const json_t *r = json_array_get(rs, i);
		long long k = -1, l = 0, t = 0;
		jsonx_int_at(r, "rank", &k);
		if (jsonx_int_at(r, "loaded_bytes", &l) && jsonx_int_at(r, "total_bytes", &t) && t > 0) {
			/* the total is the plan's estimate: a ready rank has all of it */
			if (strcmp(jsonx_str_or(r, "state", ""), "ready") == 0)
				l = t;
			v->loaded += l;
			v->total += t;
		} else {
			v->bytes_known = 0;
		}
		if (off < sizeof v->ranks)
			off += (size_t)snprintf(v->ranks + off, sizeof v->ranks - off, "%srank %lld %s",
						i ? ", " : "", k, jsonx_str_or(r, "state", "?"));
	}
	if (!json_array_size(rs))
		snprintf(v->ranks, sizeof v->ranks, "no ranks");
}

/* "[########----]  40%  1.2 GiB of 3.0 GiB" or "". */
static void fmt_bar(const struct node_view *v, char *out, size_t n)
{
	if (!v->bytes_known) {
		out[0] = '\0';
		return;
	}
	double f = v->total > 0 ? (double)v->loaded / (double)v->total : 0;
	f = f < 0 ? 0 : f > 1 ? 1 : f;
	char bar[BAR + 1], a[32], b[32];
	int full = (int)(f * BAR + 0.5);
	for (int i = 0; i < BAR; i++)
		bar[i] = i < full ? '#' : '-';
	bar[BAR] = '\0';
	fmt_bytes(v->loaded, a, sizeof a);
	fmt_bytes(v->total, b, sizeof b);
	snprintf(out, n, "[%s] %3d%%  %s of %s", bar, (int)(f * 100), a, b);
}

/* What is remembered between polls, to print on change only. */
struct follow {
	char state[32];
	char *nodes_json; /* --json: the last "nodes" printed */
	char sig[64][160]; /* text: per node, the states and the loaded tenth */
	int n_sig;
	int drawn; /* redraw: lines on screen to go back over */
};

static void render(const up_params *p, const json_t *doc, double t0, struct follow *f)
{
	const char *state = jsonx_str_or(doc, "state", "?");
	const json_t *nodes = json_object_get(doc, "nodes");
	double el = ds_now_s() - t0;
	int state_changed = strcmp(state, f->state) != 0;
	snprintf(f->state, sizeof f->state, "%s", state);
	if (p->json) {
		char *nj = json_dumps(nodes ? nodes : json_null(), JSON_COMPACT);
		if (state_changed || !nj || !f->nodes_json || strcmp(nj, f->nodes_json) != 0) {
			emit(p, json_pack("{s:s,s:O,s:s,s:f,s:O}", "event", "progress", "deployment",
					  json_object_get(doc, "deployment") ?
					  json_object_get(doc, "deployment") : json_null(),
					  "state", state, "elapsed_s", el, "nodes",
					  nodes ? nodes : json_null()));
			free(f->nodes_json);
			f->nodes_json = nj;
		} else {
			free(nj);
		}
		return;
	}
	size_t nn = json_array_size(nodes);
	if (p->redraw) {
		if (f->drawn)
			fprintf(p->out, "\033[%dA", f->drawn);
		fprintf(p->out, "\r\033[2K%s  %.1f s\n", state, el);
		for (size_t i = 0; i < nn; i++) {
			struct node_view v;
			char bar[128];
			node_view_of(json_array_get(nodes, i), &v);
			fmt_bar(&v, bar, sizeof bar);
			fprintf(p->out, "\r\033[2K  %-12s %s%s%s\n", v.name, bar, bar[0] ? "  " : "",
				v.ranks);
		}
		/* lines left over from a longer previous drawing */
		for (int i = (int)nn + 1; i < f->drawn; i++)
			fprintf(p->out, "\r\033[2K\n");
		if (f->drawn > (int)nn + 1)
			fprintf(p->out, "\033[%dA", f->drawn - ((int)nn + 1));
		f->drawn = (int)nn + 1;
		fflush(p->out);
		return;
	}
	if (state_changed)
		fprintf(p->out, "[%6.1fs] %s\n", el, state);
	for (size_t i = 0; i < nn && i < 64; i++) {
		struct node_view v;
		char sig[160], bar[128];
		node_view_of(json_array_get(nodes, i), &v);
		int tenth = v.bytes_known && v.total > 0 ? (int)(10 * v.loaded / v.total) : -1;
		snprintf(sig, sizeof sig, "%d %.150s", tenth, v.ranks);
		if (i < (size_t)f->n_sig && strcmp(sig, f->sig[i]) == 0)
			continue;
		snprintf(f->sig[i], sizeof f->sig[i], "%s", sig);
		fmt_bar(&v, bar, sizeof bar);
		fprintf(p->out, "[%6.1fs]   %s: %s%s%s\n", el, v.name, bar, bar[0] ? "; " : "",
			v.ranks);
	}
	f->n_sig = nn < 64 ? (int)nn : 64;
	fflush(p->out);
}

/* The progress of the worst node, for a timeout message. */
static void progress_summary(const json_t *doc, char *out, size_t n)
{
	const json_t *nodes = json_object_get(doc, "nodes");
	size_t off = (size_t)snprintf(out, n, "state %s", jsonx_str_or(doc, "state", "?"));
	for (size_t i = 0; i < json_array_size(nodes) && off < n; i++) {
		struct node_view v;
		node_view_of(json_array_get(nodes, i), &v);
		off += (size_t)snprintf(out + off, n - off, "; %s: %s", v.name, v.ranks);
	}
}

static void copy_str(char *dst, size_t n, const json_t *o, const char *k)
{
	snprintf(dst, n, "%s", jsonx_str_or(o, k, ""));
}

static int follow(const up_params *p, double deadline, double t0, up_result *res)
{
	struct follow f;
	char last[1024] = "";
	int rc;
	memset(&f, 0, sizeof f);
	for (;;) {
		struct answer a;
		rc = ask(p, "GET", "/v1/cluster/up", NULL, p->request_ms, &a, res);
		if (rc == DS_OK && a.status >= 200 && a.status < 300 && json_is_object(a.doc)) {
			const json_t *doc = a.doc;
			const char *state = jsonx_str_or(doc, "state", "?");
			long long dep = -1;
			int has_dep = jsonx_int_at(doc, "deployment", &dep);
			render(p, doc, t0, &f);
			if (res->deployment >= 0 && has_dep && dep != res->deployment) {
				rc = fail(res, DS_EINTERNAL, "deployment %lld was replaced by deployment "
					  "%lld (another `cluster up`?)", res->deployment, dep);
			} else if (strcmp(state, "serving") == 0) {
				res->serving = 1;
				copy_str(res->api_url, sizeof res->api_url, doc, "api_url");
				copy_str(res->control_url, sizeof res->control_url, doc, "control_url");
				copy_str(res->admin_token_file, sizeof res->admin_token_file, doc,
					 "admin_token_file");
				copy_str(res->served_model_name, sizeof res->served_model_name, doc,
					 "served_model_name");
				rc = DS_OK;
			} else if (strcmp(state, "failed") == 0) {
				long long fr = -1;
				copy_str(res->failed_node, sizeof res->failed_node, doc, "failed_node");
				if (jsonx_int_at(doc, "failed_rank", &fr))
					res->failed_rank = (int)fr;
				rc = fail(res, DS_EINTERNAL, "%s", jsonx_str_or(doc, "error", "the deployment "
									"failed (the head gave no reason)"));
			} else if (strcmp(state, "stopped") == 0) {
				rc = fail(res, DS_EINTERNAL, "the deployment was stopped (`dsctl cluster "
					  "down`?)%s%s", json_is_string(json_object_get(doc, "error")) ?
					  ": " : "", jsonx_str_or(doc, "error", ""));
			} else if (strcmp(state, "none") == 0) {
				rc = fail(res, DS_EINTERNAL, "the head has no deployment (did the head "
					  "change?)");
			} else {
				progress_summary(doc, last, sizeof last);
				rc = GOING_ON;
			}
			json_decref(a.doc);
			if (rc != GOING_ON) {
				free(f.nodes_json);
				return rc;
			}
		} else if (rc == DS_OK && a.status >= 400 && a.status < 500) {
			rc = refused(p, "GET", "/v1/cluster/up", &a, res);
			json_decref(a.doc);
			free(f.nodes_json);
			return rc;
		} else if (rc == DS_OK) {
			snprintf(last, sizeof last, "GET /v1/cluster/up answered %ld: %s", a.status,
				 a.msg);
			json_decref(a.doc);
		} else {
			snprintf(last, sizeof last, "%s", res->error); /* unreachable: retried */
		}
		if (ds_now_s() >= deadline) {
			free(f.nodes_json);
			return fail(res, DS_ETIMEOUT, "not serving within --wait %ld ms (%s)",
				    p->wait_ms, last);
		}
		ds_sleep_ms(p->poll_ms);
	}
}

int up_run(const up_params *p, up_result *res)
{
	double t0 = ds_now_s(), deadline = t0 + (double)p->wait_ms / 1000.0;
	json_t *doc = NULL;
	int rc = wait_head(p, deadline, res);
	if (rc == DS_OK)
		rc = post_up(p, deadline, &doc, res);
	if (rc != DS_OK)
		return rc;
	print_plan(p, doc, res);
	json_decref(doc);
	return follow(p, deadline, t0, res);
}

void up_result_print(const up_params *p, const up_result *res)
{
	char keys[2048];
	snprintf(keys, sizeof keys, "%s --agent %s --token-file %s keys create NAME", p->dsctl,
		 res->control_url, res->admin_token_file);
	if (p->json) {
		json_t *o;
		if (res->serving)
			o = json_pack("{s:b,s:s,s:s,s:s,s:s,s:s,s:s}", "serving", 1, "api_url",
				      res->api_url, "control_url", res->control_url,
				      "admin_token_file", res->admin_token_file,
				      "served_model_name", res->served_model_name, "model",
				      p->model ? p->model : "", "keys_create", keys);
		else
			o = json_pack("{s:b,s:s,s:o,s:o,s:O}", "serving", 0, "error", res->error,
				      "failed_node", res->failed_node[0] ?
				      json_string(res->failed_node) : json_null(),
				      "failed_rank", res->failed_rank >= 0 ?
				      json_integer(res->failed_rank) : json_null(),
				      "shortfall", res->shortfall ? res->shortfall : json_null());
		if (o && res->deployment >= 0)
			json_object_set_new(o, "deployment", json_integer(res->deployment));
		emit(p, o);
		if (res->serving)
			return;
	}
	if (res->serving) {
		fprintf(p->out, "serving %s (deployment %lld) at %s\n",
			res->served_model_name[0] ? res->served_model_name : p->model,
			res->deployment, res->api_url);
		fprintf(p->out, "create an API key for its clients with:\n");
		fprintf(p->out, "  %s\n", keys);
		fflush(p->out);
		return;
	}
	char where[400] = "";
	if (res->failed_node[0] && res->failed_rank >= 0)
		snprintf(where, sizeof where, "node %s, rank %d: ", res->failed_node,
			 res->failed_rank);
	else if (res->failed_node[0])
		snprintf(where, sizeof where, "node %s: ", res->failed_node);
	else if (res->failed_rank >= 0)
		snprintf(where, sizeof where, "rank %d: ", res->failed_rank);
	fprintf(p->err, "dsctl: cluster up failed: %s%s\n", where, res->error);
}

/* ---- cluster down ---- */

int up_down(const up_params *p, ds_err *err)
{
	struct answer a;
	up_result res;
	up_result_init(&res);
	if (ask(p, "DELETE", "/v1/cluster/up", NULL, p->request_ms > POST_MIN_MS ? p->request_ms :
		POST_MIN_MS, &a, &res) != DS_OK)
		return ds_err_set(err, DS_EIO, "%s", res.error);
	int rc = DS_OK;
	if (a.status < 200 || a.status > 299) {
		rc = refused(p, "DELETE", "/v1/cluster/up", &a, &res);
		ds_err_set(err, rc, "%s", res.error);
	} else if (!json_is_object(a.doc)) {
		rc = ds_err_set(err, DS_EFORMAT, "DELETE /v1/cluster/up answered %ld with no JSON "
				"object: %s", a.status, a.msg);
	} else if (p->json) {
		char *s = json_dumps(a.doc, JSON_INDENT(2) | JSON_SORT_KEYS);
		if (s)
			fprintf(p->out, "%s\n", s);
		free(s);
	} else {
		long long dep = -1;
		const json_t *nodes = json_object_get(a.doc, "nodes");
		if (jsonx_int_at(a.doc, "deployment", &dep))
			fprintf(p->out, "deployment %lld (%s): %s\n", dep, jsonx_str_or(a.doc, "model", "?"),
				jsonx_str_or(a.doc, "state", "?"));
		else
			fprintf(p->out, "no deployment: %s\n", jsonx_str_or(a.doc, "state", "?"));
		for (size_t i = 0; i < json_array_size(nodes); i++) {
			const json_t *n = json_array_get(nodes, i);
			const json_t *rs = json_object_get(n, "ranks");
			fprintf(p->out, "  %s:", jsonx_str_or(n, "name", "?"));
			for (size_t k = 0; k < json_array_size(rs); k++) {
				const json_t *r = json_array_get(rs, k);
				long long rank = -1, pid = -1;
				jsonx_int_at(r, "rank", &rank);
				char pids[32] = "";
				if (jsonx_int_at(r, "pid", &pid))
					snprintf(pids, sizeof pids, " (pid %lld)", pid);
				fprintf(p->out, "%s rank %lld%s %s", k ? "," : "", rank, pids,
					jsonx_str_or(r, "state", "?"));
			}
			fprintf(p->out, "%s\n", json_array_size(rs) ? "" : " no ranks");
		}
	}
	fflush(p->out);
	json_decref(a.doc);
	return rc;
}

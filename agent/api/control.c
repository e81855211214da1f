/*
 * control.c - handlers of the control API (see control.h).
 *
 * Callers: agent/api/http.c dispatches here (control_routes, ud = control_ctx).
 * Calls: agent/auth/keys for the key routes, eng_version for /v1/version,
 * agent/cluster/gossip for the membership routes, agent/cluster/cluster (and agent/cluster/rpc for
 * the cluster credential) for the cluster state and election routes.
 * Every admin route first checks the admin token (keys_admin_check, constant
 * time) and answers 401 in the OpenAI error shape otherwise; the key text
 * appears in exactly one response, the 201 of POST /v1/keys.
 *
 * Threading: handlers run on HTTP worker threads; control_ctx is read-only
 * after start and the keys service is thread-safe.
 */
#include "agent/api/control.h"
#include "agent/api/deploy.h"
#include "agent/api/serve.h"
#include "agent/launch/launch.h"
#include "common/jsonx.h"
#include "common/strutil.h"
#include "engine/engine.h"

#include <jansson.h>
#include <sodium.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void reply_status(http_resp *resp, int status, json_t *v)
{
	if (!v) {
		http_resp_error(resp, 500, "server_error", NULL, "out of memory");
		return;
	}
	http_resp_json(resp, status, jsonx_dumps(v));
	json_decref(v);
}

static void reply(http_resp *resp, json_t *v)
{
	reply_status(resp, 200, v);
}

static void get_health(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	reply(resp, json_pack("{s:s,s:s,s:s,s:s,s:I}", "status", "ok", "name", c->node_name,
			      "version", eng_version(), "backend", c->backend, "uptime_s",
			      (json_int_t)(ds_now_s() - c->started_s + 0.5))); /* whole seconds */
}

static void get_version(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	reply(resp, json_pack("{s:s,s:s,s:s}", "version", eng_version(), "backend", c->backend,
			      "backend_detail", c->backend_desc));
}

/* ---- admin routes: API keys ---- */

/* 1 when the Authorization header h carries the admin token; otherwise
 * resp holds the 401 (missing or invalid). */
static int admin_token_ok(const control_ctx *c, const char *h, http_resp *resp)
{
	const char *bearer;
	size_t len;
	if (keys_admin_check(c->admin_token, h))
		return 1;
	if (!keys_bearer(h, &bearer, &len))
		http_resp_error(resp, 401, "authentication_error", "missing_admin_token",
				"missing admin token: send 'Authorization: Bearer <token>' with "
				"the token of admin.token in the agent's data directory");
	else
		http_resp_error(resp, 401, "authentication_error", "invalid_admin_token",
				"invalid admin token (it is the content of admin.token in the "
				"agent's data directory)");
	http_resp_header(resp, "WWW-Authenticate", "Bearer");
	return 0;
}

/* 1 when the request may use the admin routes; otherwise resp holds the 401
 * (or 503 when the agent has no key service). */
static int admin_ok(const control_ctx *c, const http_req *req, http_resp *resp)
{
	if (!c->keys) {
		http_resp_error(resp, 503, "service_unavailable_error", NULL,
				"the key service is not running on this agent");
		return 0;
	}
	return admin_token_ok(c, http_req_header(req, "Authorization"), resp);
}

static json_t *opt_int(int64_t v)
{
	return v ? json_integer((json_int_t)v) : json_null();
}

/* A key as the control API shows it (never its text). */
static json_t *key_json(const store_key *r)
{
	json_t *o = json_object();
	if (!o)
		return NULL;
	int bad = 0;
	bad |= json_object_set_new(o, "id", json_integer((json_int_t)r->id));
	bad |= json_object_set_new(o, "name", json_string(r->name));
	bad |= json_object_set_new(o, "prefix", json_string(r->prefix));
	bad |= json_object_set_new(o, "created", json_integer((json_int_t)r->created));
	bad |= json_object_set_new(o, "expires", opt_int(r->expires));
	bad |= json_object_set_new(o, "last_used", opt_int(r->last_used));
	bad |= json_object_set_new(o, "revoked", json_boolean(r->revoked_at != 0));
	bad |= json_object_set_new(o, "revoked_at", opt_int(r->revoked_at));
	bad |= json_object_set_new(o, "rpm", opt_int(r->rpm));
	bad |= json_object_set_new(o, "tpm", opt_int(r->tpm));
	bad |= json_object_set_new(o, "max_concurrency", opt_int(r->max_concurrency));
	bad |= json_object_set_new(o, "requests", json_integer((json_int_t)r->requests));
	bad |= json_object_set_new(o, "prompt_tokens",
				   json_integer((json_int_t)r->prompt_tokens));
	bad |= json_object_set_new(o, "completion_tokens",
				   json_integer((json_int_t)r->completion_tokens));
	if (bad) {
		json_decref(o);
		return NULL;
	}
	return o;
}

static void bad_field(http_resp *resp, const char *field, const ds_err *e)
{
	http_resp_error_param(resp, 400, "invalid_request_error", "invalid_value", field, "%s",
			      e->msg);
}

static void post_keys(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	if (!admin_ok(c, req, resp))
		return;
	ds_err e = {0};
	keys_created made;
	json_t *body = jsonx_parse(req->body, req->body_len, 8, &e);
	if (!body || !json_is_object(body)) {
		http_resp_error(resp, 400, "invalid_request_error", "invalid_json",
				"the body must be a JSON object: %s",
				body ? "found another JSON value" : e.msg);
		goto out;
	}
	keys_params p = {0};
	if (jsonx_get_str(body, "name", 1, &p.name, &e) != DS_OK) {
		bad_field(resp, "name", &e);
		goto out;
	}
	static const struct {
		const char *field;
		size_t off;
		int64_t max;
	} nums[] = {
		{"expires_days", offsetof(keys_params, expires_days), KEYS_MAX_EXPIRES_DAYS},
		{"rpm", offsetof(keys_params, rpm), KEYS_MAX_RPM},
		{"tpm", offsetof(keys_params, tpm), KEYS_MAX_TPM},
		{"max_concurrency", offsetof(keys_params, max_concurrency), KEYS_MAX_CONCURRENCY},
	};
	for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
		int64_t *dst = (int64_t *)(void *)((char *)&p + nums[i].off);
		if (jsonx_get_i64(body, nums[i].field, 0, 0, nums[i].max, dst, &e) != DS_OK) {
			bad_field(resp, nums[i].field, &e);
			goto out;
		}
	}
	int rc = keys_create(c->keys, &p, &made, &e);
	if (rc == DS_EINVAL) {
		bad_field(resp, "name", &e);
	} else if (rc == DS_EBUSY) {
		http_resp_error_param(resp, 409, "invalid_request_error", "name_in_use", "name",
				      "%s", e.msg);
	} else if (rc == DS_ERANGE) {
		http_resp_error(resp, 409, "invalid_request_error", "too_many_keys", "%s", e.msg);
	} else if (rc) {
		http_resp_error(resp, 500, "server_error", NULL, "%s", e.msg);
	} else {
		json_t *o = key_json(&made.info);
		if (o && json_object_set_new(o, "key", json_string(made.key)) != 0) {
			json_decref(o);
			o = NULL;
		}
		reply_status(resp, 201, o);
	}
	sodium_memzero(&made, sizeof made);
out:
	json_decref(body);
}

static void get_keys(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	if (!admin_ok(c, req, resp))
		return;
	ds_err e = {0};
	store_key *rows = NULL;
	size_t n = 0;
	if (keys_list(c->keys, &rows, &n, &e) != DS_OK) {
		http_resp_error(resp, 500, "server_error", NULL, "%s", e.msg);
		return;
	}
	json_t *data = json_array();
	for (size_t i = 0; data && i < n; i++) {
		json_t *o = key_json(&rows[i]);
		if (!o || json_array_append_new(data, o) != 0) {
			json_decref(data);
			data = NULL;
		}
	}
	free(rows);
	reply(resp, data ? json_pack("{s:o}", "data", data) : NULL);
}

static void delete_key(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	if (!admin_ok(c, req, resp))
		return;
	const char *idtext = req->path + strlen("/v1/keys/");
	int64_t id = 0;
	if (ds_parse_i64(idtext, 1, INT64_MAX, &id) != DS_OK) {
		http_resp_error_param(resp, 400, "invalid_request_error", "invalid_value", "id",
				      "'%s' is not a key id (a positive integer)", idtext);
		return;
	}
	ds_err e = {0};
	store_key row;
	int rc = keys_revoke(c->keys, id, &row, &e);
	if (rc == DS_ENOTFOUND)
		http_resp_error_param(resp, 404, "not_found_error", "key_not_found", "id", "%s",
				      e.msg);
	else if (rc)
		http_resp_error(resp, 500, "server_error", NULL, "%s", e.msg);
	else
		reply(resp, key_json(&row));
}

/* ---- admin routes: cluster membership ---- */

static int gossip_ok(const control_ctx *c, http_resp *resp)
{
	if (c->gossip)
		return 1;
	http_resp_error(resp, 503, "service_unavailable_error", "no_cluster",
			"this agent runs as a single node: start it with --cluster-key FILE "
			"(and --join HOST:PORT) to turn on gossip membership");
	return 0;
}

static void get_cluster_members(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	if (!admin_ok(c, req, resp) || !gossip_ok(c, resp))
		return;
	reply(resp, gossip_status_json(c->gossip));
}

/* The test-only routes exist with --test-fault-injection and the admin
 * token; 0 after filling resp with the 404 or 401 otherwise. */
static int test_route_ok(const control_ctx *c, const http_req *req, http_resp *resp)
{
	if (!c->test_faults) {
		http_resp_error(resp, 404, "not_found_error", "route_not_found",
				"no route %s %s (it exists only with --test-fault-injection)",
				req->method, req->path);
		return 0;
	}
	return admin_ok(c, req, resp);
}

/* TEST ONLY (--test-fault-injection): cut gossip with the named members. */
static void post_test_drop(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	if (!test_route_ok(c, req, resp) || !gossip_ok(c, resp))
		return;
	ds_err e = {0};
	const char *peers = NULL;
	json_t *body = jsonx_parse(req->body, req->body_len, 4, &e);
	if (!body || !json_is_object(body) ||
	    jsonx_get_str(body, "peers", 1, &peers, &e) != DS_OK ||
	    gossip_test_drop(c->gossip, peers, &e) != DS_OK ||
	    (c->cluster && cluster_test_drop(c->cluster, peers, &e) != DS_OK)) {
		http_resp_error_param(resp, 400, "invalid_request_error", "invalid_value", "peers",
				      "expected {\"peers\": \"NAME,NAME\"}: %s",
				      e.msg[0] ? e.msg : "not a JSON object");
	} else {
		reply(resp, json_pack("{s:s}", "peers", peers));
	}
	json_decref(body);
}

/* TEST ONLY (--test-fault-injection): fail the next N engine steps. */
static void post_test_fail_steps(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	if (!test_route_ok(c, req, resp))
		return;
	serve *sv = __atomic_load_n(&c->serve, __ATOMIC_ACQUIRE);
	if (!sv || !atomic_load(&sv->ready)) {
		http_resp_error(resp, 503, "service_unavailable_error", "model_loading",
				"the model is not loaded yet");
		return;
	}
	ds_err e = {0};
	int64_t steps = 0;
	json_t *body = jsonx_parse(req->body, req->body_len, 4, &e);
	if (!body || !json_is_object(body) ||
	    jsonx_get_i64(body, "steps", 1, 0, 1000000, &steps, &e) != DS_OK) {
		http_resp_error_param(resp, 400, "invalid_request_error", "invalid_value", "steps",
				      "expected {\"steps\": N} with 0 <= N <= 1000000: %s",
				      e.msg[0] ? e.msg : "not a JSON object");
	} else {
		sched_test_fail_steps(sv->sc, (int)steps);
		reply(resp, json_pack("{s:I}", "steps", (json_int_t)steps));
	}
	json_decref(body);
}

/* ---- cluster state: operators (admin token) and other agents ---- */

enum { AUTH_ADMIN = 1, AUTH_PEER = 2 };

/* AUTH_ADMIN (the admin token), AUTH_PEER (another agent's cluster
 * credential; sender gets its id), or 0 with the 401/503 in resp. */
static int cluster_auth(const control_ctx *c, const http_req *req, http_resp *resp,
			char sender[GOSSIP_ID_HEX])
{
	const char *h = http_req_header(req, "Authorization");
	ds_err e = {0};
	sender[0] = '\0';
	if (!c->cluster) {
		http_resp_error(resp, 503, "service_unavailable_error", "no_cluster",
				"the cluster layer is not running on this agent");
		return 0;
	}
	if (rpc_auth_is_cluster(h)) {
		rpc_auth *a = cluster_rpc_auth(c->cluster);
		if (!a) {
			http_resp_error(resp, 401, "authentication_error", "no_cluster_key",
					"this agent runs without --cluster-key: it accepts no cluster "
					"credential (use the admin token)");
		} else if (rpc_auth_verify(a, req->method, req->path, req->body, req->body_len, h,
					   rpc_now_ms(), sender, &e) != DS_OK) {
			http_resp_error(resp, 401, "authentication_error", "invalid_cluster_credential",
					"%s", e.msg);
		} else if (cluster_sender_dropped(c->cluster, sender)) {
			http_resp_error(resp, 503, "service_unavailable_error", "dropped",
					"requests from this member are cut by the test fault switch");
		} else {
			return AUTH_PEER;
		}
		http_resp_header(resp, "WWW-Authenticate", "DSCluster");
		return 0;
	}
	return admin_token_ok(c, h, resp) ? AUTH_ADMIN : 0;
}

static void get_node(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	char sender[GOSSIP_ID_HEX];
	if (cluster_auth(c, req, resp, sender))
		reply(resp, cluster_node_json(c->cluster));
}

static void get_cluster_state(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	char sender[GOSSIP_ID_HEX];
	if (cluster_auth(c, req, resp, sender))
		reply(resp, cluster_state_json(c->cluster));
}

static void get_cluster_nodes(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	char sender[GOSSIP_ID_HEX];
	int who = cluster_auth(c, req, resp, sender);
	if (!who)
		return;
	json_t *out = NULL;
	ds_err e = {0};
	/* Only an operator's request is forwarded: a peer asking us gets our own
	 * answer, so a request never travels in a loop. */
	if (cluster_nodes_json(c->cluster, who == AUTH_ADMIN, &out, &e) != DS_OK) {
		http_resp_error(resp, 500, "server_error", NULL, "%s", e.msg);
		return;
	}
	/* the head adds each node's ranks of the deployment */
	size_t i;
	json_t *n;
	json_array_foreach(json_object_get(out, "nodes"), i, n) {
		const char *name = json_string_value(json_object_get(n, "name"));
		deploy *dp = __atomic_load_n(&c->deploy, __ATOMIC_ACQUIRE);
		json_t *rs = dp && cluster_is_head(c->cluster, NULL) && name
				     ? deploy_node_ranks(dp, name) : NULL;
		if (rs)
			json_object_set_new(n, "ranks", rs);
	}
	reply(resp, out);
}

static void get_cluster_plan(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	char sender[GOSSIP_ID_HEX];
	int who = cluster_auth(c, req, resp, sender);
	if (!who)
		return;
	json_t *out = NULL;
	ds_err e = {0};
	int rc = cluster_plan_json(c->cluster, who == AUTH_ADMIN, &out, &e);
	if (rc == DS_ENOTFOUND)
		http_resp_error(resp, 404, "not_found_error", "no_plan", "%s", e.msg);
	else if (rc == DS_EBUSY)
		http_resp_error(resp, 503, "service_unavailable_error", "no_head", "%s", e.msg);
	else if (rc)
		http_resp_error(resp, 500, "server_error", NULL, "%s", e.msg);
	else
		reply(resp, out);
}

/* The answer to a refused plan or deployment request (takes out): 422 with
 * the plan that does not fit under an error, 400 (bad_code; unsupported_code
 * for a model the planner cannot use), 404, 503 without a head (Retry-After
 * when retry), else 500. */
static void plan_refused(http_resp *resp, int rc, json_t *out, const ds_err *e,
			 const char *bad_code, const char *unsupported_code, int retry)
{
	if (rc == DS_ERANGE && json_is_object(out) && !json_object_get(out, "error")) {
		/* the plan that does not fit, with its shortfall, under an error */
		json_t *body = json_pack("{s:{s:s,s:s,s:s},s:o}", "error", "message", e->msg, "type",
					 "invalid_request_error", "code", "does_not_fit", "plan", out);
		reply_status(resp, 422, body);
		return;
	}
	json_decref(out);
	if (rc == DS_EINVAL)
		http_resp_error(resp, 400, "invalid_request_error", bad_code, "%s", e->msg);
	else if (rc == DS_ENOTFOUND)
		http_resp_error(resp, 404, "not_found_error", "not_found", "%s", e->msg);
	else if (rc == DS_ERANGE)
		http_resp_error(resp, 422, "invalid_request_error", "does_not_fit", "%s", e->msg);
	else if (rc == DS_EBUSY || rc == DS_EPERM) {
		http_resp_error(resp, 503, "service_unavailable_error", "no_head", "%s", e->msg);
		if (retry)
			http_resp_header(resp, "Retry-After", "2");
	} else if (rc == DS_EUNSUPPORTED || rc == DS_EFORMAT)
		http_resp_error(resp, 400, "invalid_request_error", unsupported_code, "%s", e->msg);
	else
		http_resp_error(resp, 500, "server_error", NULL, "%s", e->msg);
}

static void post_cluster_plan(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	char sender[GOSSIP_ID_HEX];
	int who = cluster_auth(c, req, resp, sender);
	if (!who)
		return;
	json_t *out = NULL;
	ds_err e = {0};
	int rc = cluster_plan_post(c->cluster, who == AUTH_ADMIN, req->body, req->body_len, &out,
				   &e);
	if (rc == DS_OK) {
		reply(resp, out);
		return;
	}
	plan_refused(resp, rc, out, &e, "invalid_plan_request", "unsupported_model", 0);
}

/* ---- deployments: POST / GET / DELETE /v1/cluster/up (agent/api/deploy.h) ---- */

/* An operator's request to a node that is not the head goes to the head,
 * and its answer comes back with its status. */
static void up_forward(const control_ctx *c, const http_req *req, http_resp *resp)
{
	int status = 0;
	json_t *ans = NULL;
	ds_err e = {0};
	if (cluster_head_call(c->cluster, req->method, req->path, req->body, req->body_len, 30000,
			      &status, &ans, &e) != DS_OK) {
		http_resp_error(resp, 503, "service_unavailable_error", "no_head", "%s", e.msg);
		http_resp_header(resp, "Retry-After", "2");
	} else if (!ans) {
		http_resp_error(resp, 502, "server_error", "bad_head_answer",
				"the head answered %d without a JSON document", status);
	} else {
		json_object_set_new(ans, "via", json_string(c->node_name));
		reply_status(resp, status, ans);
	}
}

static void cluster_up(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	char sender[GOSSIP_ID_HEX];
	int who = cluster_auth(c, req, resp, sender);
	if (!who)
		return;
	deploy *dp = __atomic_load_n(&c->deploy, __ATOMIC_ACQUIRE);
	if (!dp) {
		http_resp_error(resp, 503, "service_unavailable_error", "no_deploy",
				"this agent runs no deployments (yet: it is starting)");
		return;
	}
	if (!cluster_is_head(c->cluster, NULL)) {
		if (who == AUTH_ADMIN) {
			up_forward(c, req, resp);
		} else {
			http_resp_error(resp, 503, "service_unavailable_error", "not_head",
					"asked by a peer: only the head deploys");
		}
		return;
	}
	json_t *out = NULL;
	ds_err e = {0};
	int rc = DS_OK;
	if (strcmp(req->method, "GET") == 0) {
		reply(resp, deploy_status(dp));
		return;
	}
	if (strcmp(req->method, "DELETE") == 0)
		rc = deploy_down(dp, &out, &e);
	else
		rc = deploy_up(dp, req->body, req->body_len, &out, &e);
	if (rc == DS_OK) {
		reply_status(resp, strcmp(req->method, "POST") == 0 ? 202 : 200, out);
		return;
	}
	if (rc == DS_ECONFLICT) {
		json_decref(out);
		http_resp_error(resp, 409, "conflict_error", "deployment_starting", "%s", e.msg);
	} else {
		plan_refused(resp, rc, out, &e, "invalid_deployment", "invalid_deployment", 1);
	}
}

/* ---- rank processes of a plan on this node (agent/launch) ---- */

static int launcher_ok(const control_ctx *c, http_resp *resp)
{
	if (!c->launcher)
		http_resp_error(resp, 503, "service_unavailable_error", "no_launcher",
				"this agent runs no rank processes");
	return c->launcher != NULL;
}

/* POST /v1/ranks {"job", "epoch", "ranks": [{"rank", "args", "env"}]}: the
 * head (or an operator) starts this node's ranks of a plan; the epoch must
 * be the reign this node recognises (fencing). */
static void post_ranks(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	char sender[GOSSIP_ID_HEX];
	if (!cluster_auth(c, req, resp, sender) || !launcher_ok(c, resp))
		return;
	ds_err e = {0};
	const char *job = NULL;
	int64_t epoch = 0;
	json_t *body = jsonx_parse(req->body, req->body_len, 8, &e);
	if (!json_is_object(body) || jsonx_get_str(body, "job", 1, &job, &e) ||
	    jsonx_get_i64(body, "epoch", 1, 1, INT64_MAX, &epoch, &e)) {
		http_resp_error(resp, 400, "invalid_request_error", "invalid_ranks", "%s",
				e.msg[0] ? e.msg : "the body is not a JSON object");
		json_decref(body);
		return;
	}
	int rc = cluster_fence(c->cluster, (uint64_t)epoch, &e);
	if (rc == DS_OK)
		rc = launcher_start(c->launcher, job, (uint64_t)epoch, json_object_get(body, "ranks"),
				    &e);
	deploy *dp = __atomic_load_n(&c->deploy, __ATOMIC_ACQUIRE);
	if (rc == DS_OK && dp) /* a new head relaunches it (deploy_remember) */
		deploy_remember(dp, json_object_get(body, "deployment"), (uint64_t)epoch);
	if (rc == DS_OK)
		reply(resp, launcher_json(c->launcher));
	else if (rc == DS_EINVAL)
		http_resp_error(resp, 400, "invalid_request_error", "invalid_ranks", "%s", e.msg);
	else if (rc == DS_EPERM)
		http_resp_error(resp, 409, "conflict_error", "stale_epoch", "%s", e.msg);
	else if (rc == DS_EBUSY)
		http_resp_error(resp, 503, "service_unavailable_error", "no_head", "%s", e.msg);
	else
		http_resp_error(resp, 500, "server_error", NULL, "%s", e.msg);
	json_decref(body);
}

static void get_ranks(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	char sender[GOSSIP_ID_HEX];
	if (cluster_auth(c, req, resp, sender) && launcher_ok(c, resp))
		reply(resp, launcher_json(c->launcher));
}

/* DELETE /v1/ranks [{"forget": true}]: stops whatever job runs (SIGTERM,
 * SIGKILL after 2 s); with forget, the deployment's request is dropped too
 * (dsctl cluster down: no new head relaunches it). */
static void delete_ranks(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	char sender[GOSSIP_ID_HEX];
	if (!cluster_auth(c, req, resp, sender) || !launcher_ok(c, resp))
		return;
	ds_err e = {0};
	int forget = 0;
	if (req->body_len) {
		json_t *body = jsonx_parse(req->body, req->body_len, 4, &e);
		if (!json_is_object(body) || jsonx_get_bool(body, "forget", 0, &forget, &e)) {
			http_resp_error(resp, 400, "invalid_request_error", "invalid_body", "%s",
					e.msg[0] ? e.msg : "the body is not a JSON object");
			json_decref(body);
			return;
		}
		json_decref(body);
	}
	deploy *dp = __atomic_load_n(&c->deploy, __ATOMIC_ACQUIRE);
	if (forget && dp)
		deploy_forget(dp);
	if (launcher_stop(c->launcher, NULL, 2000, &e) != DS_OK)
		http_resp_error(resp, 500, "server_error", NULL, "%s", e.msg);
	else
		reply(resp, launcher_json(c->launcher));
}

static void post_election(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	char sender[GOSSIP_ID_HEX];
	int who = cluster_auth(c, req, resp, sender);
	if (!who)
		return;
	if (who != AUTH_PEER) {
		http_resp_error(resp, 403, "permission_error", "agents_only",
				"election messages come from agents (the cluster credential), "
				"not from the admin token");
		return;
	}
	json_t *out = NULL;
	ds_err e = {0};
	int rc = cluster_election_post(c->cluster, sender, req->body, req->body_len, &out, &e);
	if (rc == DS_EPERM)
		http_resp_error(resp, 403, "permission_error", "wrong_sender", "%s", e.msg);
	else if (rc)
		http_resp_error(resp, 400, "invalid_request_error", "invalid_message", "%s", e.msg);
	else
		reply(resp, out);
}

/* ---- auth rules on the headers: http.c runs them before reading a body ---- */

static int auth_admin(void *ud, const http_req *req, http_resp *resp)
{
	return admin_ok(ud, req, resp);
}

static int auth_test(void *ud, const http_req *req, http_resp *resp)
{
	return test_route_ok(ud, req, resp);
}

/* The admin token is checked whole; a cluster credential's MAC covers the
 * body, so here only its form and time (rpc_auth_check_header), and
 * cluster_auth verifies it after the body. */
static int auth_cluster(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	const char *h = http_req_header(req, "Authorization");
	char sender[GOSSIP_ID_HEX];
	ds_err e = {0};
	if (!c->cluster || !rpc_auth_is_cluster(h) || !cluster_rpc_auth(c->cluster))
		return cluster_auth(c, req, resp, sender) != 0; /* decided by the header */
	if (rpc_auth_check_header(h, rpc_now_ms(), &e) == DS_OK)
		return 1;
	http_resp_error(resp, 401, "authentication_error", "invalid_cluster_credential", "%s",
			e.msg);
	http_resp_header(resp, "WWW-Authenticate", "DSCluster");
	return 0;
}

const http_route control_routes[] = {
	{.method = "GET", .path = "/health", .fn = get_health},
	{.method = "GET", .path = "/v1/version", .fn = get_version},
	{.method = "POST", .path = "/v1/keys", .fn = post_keys, .auth = auth_admin},
	{.method = "GET", .path = "/v1/keys", .fn = get_keys, .auth = auth_admin},
	{.method = "DELETE", .path = "/v1/keys/*", .fn = delete_key, .auth = auth_admin},
	{.method = "GET", .path = "/v1/cluster/members", .fn = get_cluster_members,
	 .auth = auth_admin},
	{.method = "POST", .path = "/v1/cluster/test/drop", .fn = post_test_drop,
	 .auth = auth_test},
	{.method = "POST", .path = "/v1/test/fail-steps", .fn = post_test_fail_steps,
	 .auth = auth_test},
	{.method = "GET", .path = "/v1/node", .fn = get_node, .auth = auth_cluster},
	{.method = "GET", .path = "/v1/cluster/state", .fn = get_cluster_state,
	 .auth = auth_cluster},
	{.method = "GET", .path = "/v1/cluster/nodes", .fn = get_cluster_nodes,
	 .auth = auth_cluster},
	{.method = "GET", .path = "/v1/cluster/plan", .fn = get_cluster_plan, .auth = auth_cluster},
	{.method = "POST", .path = "/v1/cluster/plan", .fn = post_cluster_plan,
	 .auth = auth_cluster},
	{.method = "POST", .path = "/v1/cluster/up", .fn = cluster_up, .auth = auth_cluster},
	{.method = "GET", .path = "/v1/cluster/up", .fn = cluster_up, .auth = auth_cluster},
	{.method = "DELETE", .path = "/v1/cluster/up", .fn = cluster_up, .auth = auth_cluster},
	{.method = "POST", .path = "/v1/ranks", .fn = post_ranks, .auth = auth_cluster},
	{.method = "GET", .path = "/v1/ranks", .fn = get_ranks, .auth = auth_cluster},
	{.method = "DELETE", .path = "/v1/ranks", .fn = delete_ranks, .auth = auth_cluster},
	{.method = "POST", .path = "/v1/cluster/election", .fn = post_election,
	 .auth = auth_cluster},
	{0},
};

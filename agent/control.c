/*
 * control.c - handlers of the control API (see control.h).
 * Handlers run on HTTP worker threads; control_ctx is read-only after start.
 */
#include "agent/control.h"
#include "common/jsonx.h"
#include "common/strutil.h"
#include "engine/engine.h"

#include <jansson.h>

static void reply(http_resp *resp, json_t *v)
{
	if (!v) {
		http_resp_error(resp, 500, "internal_error", NULL, "out of memory");
		return;
	}
	http_resp_json(resp, 200, jsonx_dumps(v));
	json_decref(v);
}

static void get_health(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	reply(resp, json_pack("{s:s,s:s,s:s,s:s,s:f}", "status", "ok", "name", c->node_name,
			      "version", eng_version(), "backend", c->backend, "uptime_s",
			      ds_now_s() - c->started_s));
}

static void get_version(void *ud, const http_req *req, http_resp *resp)
{
	const control_ctx *c = ud;
	reply(resp, json_pack("{s:s,s:s,s:s}", "version", eng_version(), "backend", c->backend,
			      "backend_detail", c->backend_desc));
}

const http_route control_routes[] = {
	{"GET", "/health", get_health},
	{"GET", "/v1/version", get_version},
	{0},
};

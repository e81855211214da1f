/*
 * http.c - libmicrohttpd daemon with a route table (see http.h).
 *
 * Request lifecycle inside on_request (MHD calls it several times):
 *
 *   first call ──> allocate conn_state (body buf capped at max_body)
 *   upload chunk ─> append; past the cap mark `too_large`, keep draining
 *   last call ───> route: 413 | 404 | 405 | handler(ud, req, resp) ─> queue
 *   completed ───> on_done frees conn_state
 *
 * Threading: MHD's internal thread pool (epoll when available) calls
 * on_request; the route table and ud are read-only after start.
 */
#include "agent/http.h"
#include "common/buf.h"
#include "common/jsonx.h"
#include "common/log.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <microhttpd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct http_server {
	struct MHD_Daemon *d;
	http_params p;
	int port;
};

struct conn_state {
	buf body;
	int too_large;
};

http_params http_default_params(void)
{
	http_params p = {0};
	p.bind_addr = "127.0.0.1";
	p.max_body = 1 << 20;
	p.threads = 4;
	p.timeout_s = 30;
	return p;
}

void http_resp_json(http_resp *resp, int status, char *text)
{
	free(resp->body);
	resp->status = status;
	resp->body = text;
	resp->content_type = "application/json";
}

void http_resp_error(http_resp *resp, int status, const char *type, const char *code,
		     const char *fmt, ...)
{
	char msg[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	json_t *e = json_pack("{s:{s:s,s:s,s:o,s:o}}", "error", "message", msg, "type", type,
			      "param", json_null(), "code", code ? json_string(code) : json_null());
	http_resp_json(resp, status, e ? jsonx_dumps(e) : NULL);
	json_decref(e);
}

const char *http_req_header(const http_req *req, const char *name)
{
	return MHD_lookup_connection_value(req->conn, MHD_HEADER_KIND, name);
}

static enum MHD_Result send_resp(struct MHD_Connection *c, http_resp *r)
{
	const char *body = r->body ? r->body : "";
	struct MHD_Response *m = MHD_create_response_from_buffer(strlen(body), (void *)body,
								  r->body ? MHD_RESPMEM_MUST_FREE
									  : MHD_RESPMEM_PERSISTENT);
	if (!m) {
		free(r->body);
		return MHD_NO;
	}
	r->body = NULL;
	MHD_add_response_header(m, "Content-Type",
				r->content_type ? r->content_type : "application/json");
	enum MHD_Result ok = MHD_queue_response(c, (unsigned)r->status, m);
	MHD_destroy_response(m);
	return ok;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
				  const char *method, const char *version, const char *upload,
				  size_t *upload_size, void **con_cls)
{
	http_server *s = cls;
	struct conn_state *st = *con_cls;
	if (!st) {
		st = calloc(1, sizeof *st);
		if (!st)
			return MHD_NO;
		buf_init(&st->body, s->p.max_body);
		*con_cls = st;
		return MHD_YES;
	}
	if (*upload_size) {
		if (!st->too_large && buf_append(&st->body, upload, *upload_size) != DS_OK)
			st->too_large = 1;
		*upload_size = 0;
		return MHD_YES;
	}
	http_resp resp = {0};
	http_req req = {method, url, st->body.data ? st->body.data : "", st->body.len, c};
	if (st->too_large) {
		http_resp_error(&resp, 413, "invalid_request_error", "request_too_large",
				"request body is larger than the limit of %zu bytes", s->p.max_body);
		return send_resp(c, &resp);
	}
	int path_found = 0;
	for (const http_route *r = s->p.routes; r && r->path; r++) {
		if (strcmp(r->path, url) != 0)
			continue;
		path_found = 1;
		if (strcmp(r->method, method) == 0) {
			r->fn(s->p.ud, &req, &resp);
			if (!resp.status)
				http_resp_error(&resp, 500, "internal_error", NULL,
						"handler for %s %s produced no response", method, url);
			return send_resp(c, &resp);
		}
	}
	if (path_found)
		http_resp_error(&resp, 405, "invalid_request_error", "method_not_allowed",
				"method %s is not allowed on %s", method, url);
	else
		http_resp_error(&resp, 404, "invalid_request_error", "not_found",
				"no route for %s %s", method, url);
	return send_resp(c, &resp);
}

static void on_done(void *cls, struct MHD_Connection *c, void **con_cls,
		    enum MHD_RequestTerminationCode toe)
{
	struct conn_state *st = *con_cls;
	if (st) {
		buf_free(&st->body);
		free(st);
		*con_cls = NULL;
	}
}

http_server *http_server_new(const http_params *p, ds_err *err)
{
	http_server *s = calloc(1, sizeof *s);
	if (!s) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	s->p = *p;
	struct sockaddr_in sa = {0};
	sa.sin_family = AF_INET;
	sa.sin_port = htons((uint16_t)p->port);
	if (inet_pton(AF_INET, p->bind_addr ? p->bind_addr : "127.0.0.1", &sa.sin_addr) != 1) {
		ds_err_set(err, DS_EINVAL, "bind address '%s' is not an IPv4 address", p->bind_addr);
		free(s);
		return NULL;
	}
	unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
	if (MHD_is_feature_supported(MHD_FEATURE_EPOLL) == MHD_YES)
		flags |= MHD_USE_EPOLL;
	s->d = MHD_start_daemon(flags, (uint16_t)p->port, NULL, NULL, on_request, s,
				MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
				MHD_OPTION_THREAD_POOL_SIZE, (unsigned)(p->threads > 0 ? p->threads : 1),
				MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)p->timeout_s,
				MHD_OPTION_NOTIFY_COMPLETED, on_done, s, MHD_OPTION_END);
	if (!s->d) {
		ds_err_set(err, DS_EIO, "cannot listen on %s:%d (port in use or not permitted)",
			   p->bind_addr, p->port);
		free(s);
		return NULL;
	}
	const union MHD_DaemonInfo *info = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
	s->port = info ? info->port : p->port;
	return s;
}

void http_server_free(http_server *s)
{
	if (!s)
		return;
	MHD_stop_daemon(s->d);
	free(s);
}

int http_server_port(const http_server *s)
{
	return s->port;
}

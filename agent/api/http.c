/*
 * http.c - libmicrohttpd daemon with a route table (see http.h).
 *
 * Request lifecycle inside on_request (MHD calls it several times):
 *
 *   first call ──> allocate conn_state (body buf capped at max_body)
 *   upload chunk ─> append; past the cap mark `too_large`, keep draining
 *   last call ───> route: 413 | OPTIONS 204 | 404 | 405 | handler(ud, req, resp)
 *                  ─> queue a buffer response, or a callback response whose
 *                     reader is the handler's stream (chunked transfer)
 *   completed ───> on_done frees conn_state
 *
 * Threading: a thread per connection calls on_request and any stream reader,
 * so both may block; the route table and ud are read-only after start.
 */
#include "agent/api/http.h"
#include "common/buf.h"
#include "common/jsonx.h"
#include "common/log.h"
#include "common/utf8.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <microhttpd.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

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
	p.max_conns = 512;
	p.timeout_s = 600;
	return p;
}

void http_resp_json(http_resp *resp, int status, char *text)
{
	free(resp->body);
	resp->status = text ? status : 500;
	resp->body = text ? text : strdup("{\"error\":{\"message\":\"out of memory\","
					  "\"type\":\"server_error\",\"param\":null,"
					  "\"code\":null}}");
	resp->content_type = "application/json";
}

void http_utf8_clean(const char *text, size_t len, buf *out)
{
	const unsigned char *s = (const unsigned char *)text;
	size_t i = 0;
	while (i < len) {
		size_t n = 1;
		int k = utf8_check(s + i, len - i, &n);
		if (k == UTF8_OK) {
			buf_append(out, s + i, n);
			i += n;
		} else {
			buf_append(out, "\xEF\xBF\xBD", 3);
			i += k == UTF8_INCOMPLETE ? len - i : n;
		}
	}
}

static void resp_error_v(http_resp *resp, int status, const char *type, const char *code,
			 const char *param, const char *fmt, va_list ap)
{
	char raw[1024];
	buf msg; /* messages may quote client bytes, and a precision may cut a character */
	vsnprintf(raw, sizeof raw, fmt, ap);
	buf_init(&msg, 0);
	http_utf8_clean(raw, strlen(raw), &msg);
	json_t *e = json_pack("{s:{s:s,s:s,s:o,s:o}}", "error", "message",
			      msg.data ? msg.data : "", "type", type,
			      "param", param ? json_string(param) : json_null(), "code",
			      code ? json_string(code) : json_null());
	http_resp_json(resp, status, e ? jsonx_dumps(e) : NULL);
	json_decref(e);
	buf_free(&msg);
}

void http_resp_error(http_resp *resp, int status, const char *type, const char *code,
		     const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	resp_error_v(resp, status, type, code, NULL, fmt, ap);
	va_end(ap);
}

void http_resp_error_param(http_resp *resp, int status, const char *type, const char *code,
			   const char *param, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	resp_error_v(resp, status, type, code, param, fmt, ap);
	va_end(ap);
}

static int header_text_ok(const char *s)
{
	for (const unsigned char *p = (const unsigned char *)s; *p; p++)
		if (*p < 0x20 || *p == 0x7f)
			return 0;
	return 1;
}

int http_resp_header(http_resp *resp, const char *name, const char *value)
{
	if (resp->n_headers >= HTTP_MAX_HEADERS || !*name || !header_text_ok(name) ||
	    !header_text_ok(value))
		return DS_EINVAL;
	char *n = strdup(name), *v = strdup(value);
	if (!n || !v) {
		free(n);
		free(v);
		return DS_ENOMEM;
	}
	resp->headers[resp->n_headers][0] = n;
	resp->headers[resp->n_headers][1] = v;
	resp->n_headers++;
	return DS_OK;
}

/* Frees what resp holds (body, headers; calls stream_done when set). */
static void http_resp_clear(http_resp *resp)
{
	free(resp->body);
	resp->body = NULL;
	for (int i = 0; i < resp->n_headers; i++) {
		free(resp->headers[i][0]);
		free(resp->headers[i][1]);
	}
	resp->n_headers = 0;
	if (resp->stream && resp->stream_done)
		resp->stream_done(resp->stream_ctx);
	resp->stream = NULL;
	resp->stream_done = NULL;
}

const char *http_req_header(const http_req *req, const char *name)
{
	return MHD_lookup_connection_value(req->conn, MHD_HEADER_KIND, name);
}

int http_conn_gone(struct MHD_Connection *conn)
{
	const union MHD_ConnectionInfo *ci =
		MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
	if (!ci)
		return 1;
	struct pollfd pf = {.fd = ci->connect_fd, .events = POLLIN | POLLRDHUP};
	if (poll(&pf, 1, 0) <= 0)
		return 0;
	if (pf.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))
		return 1;
	char c;
	return recv(ci->connect_fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

int http_addr_is_loopback(const char *addr)
{
	struct in_addr a;
	if (!addr || inet_pton(AF_INET, addr, &a) != 1)
		return 0;
	return (ntohl(a.s_addr) >> 24) == 127;
}

static void add_cors(struct MHD_Response *m, const http_server *s)
{
	if (!s->p.cors_origin)
		return;
	MHD_add_response_header(m, "Access-Control-Allow-Origin", s->p.cors_origin);
	MHD_add_response_header(m, "Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
	MHD_add_response_header(m, "Access-Control-Allow-Headers",
				"Authorization, Content-Type, X-Request-Id");
	MHD_add_response_header(m, "Access-Control-Max-Age", "600");
}

static ssize_t stream_cb(void *cls, uint64_t pos, char *out, size_t max)
{
	http_resp *r = cls;
	(void)pos;
	return r->stream(r->stream_ctx, out, max);
}

static void stream_free_cb(void *cls)
{
	http_resp *r = cls;
	http_resp_clear(r);
	free(r);
}

static enum MHD_Result send_resp(const http_server *s, struct MHD_Connection *c, http_resp *r)
{
	struct MHD_Response *m;
	http_resp *h = NULL;
	if (r->stream) {
		/* The stream outlives this call: move resp to the heap; stream_free_cb
		 * releases it (and runs stream_done) when MHD is finished with it. */
		h = malloc(sizeof *h);
		if (!h) {
			http_resp_clear(r);
			return MHD_NO;
		}
		*h = *r;
		memset(r, 0, sizeof *r);
		free(h->body);
		h->body = NULL;
		m = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_cb, h,
						      stream_free_cb);
		if (!m) {
			stream_free_cb(h);
			return MHD_NO;
		}
		r = h;
	} else {
		const char *body = r->body ? r->body : "";
		m = MHD_create_response_from_buffer(strlen(body), (void *)body,
						    r->body ? MHD_RESPMEM_MUST_FREE
							    : MHD_RESPMEM_PERSISTENT);
		if (!m) {
			http_resp_clear(r);
			return MHD_NO;
		}
		r->body = NULL;
	}
	MHD_add_response_header(m, "Content-Type",
				r->content_type ? r->content_type : "application/json");
	for (int i = 0; i < r->n_headers; i++)
		MHD_add_response_header(m, r->headers[i][0], r->headers[i][1]);
	add_cors(m, s);
	unsigned status = (unsigned)r->status;
	if (!h)
		http_resp_clear(r);
	enum MHD_Result ok = MHD_queue_response(c, status, m);
	MHD_destroy_response(m);
	return ok;
}

static int route_match(const char *pattern, const char *path)
{
	size_t n = strlen(pattern);
	if (n && pattern[n - 1] == '*')
		return strncmp(pattern, path, n - 1) == 0;
	return strcmp(pattern, path) == 0;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
				  const char *method, const char *version, const char *upload,
				  size_t *upload_size, void **con_cls)
{
	http_server *s = cls;
	struct conn_state *st = *con_cls;
	(void)version;
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
	http_req req = {
		.method = method,
		.path = url,
		.body = st->body.data ? st->body.data : "",
		.body_len = st->body.len,
		.conn = c,
	};
	if (st->too_large) {
		http_resp_error(&resp, 413, "invalid_request_error", "request_too_large",
				"request body is larger than the limit of %zu bytes", s->p.max_body);
		return send_resp(s, c, &resp);
	}
	if (strcmp(method, "OPTIONS") == 0) { /* CORS preflight: never authenticated */
		resp.status = 204;
		return send_resp(s, c, &resp);
	}
	int path_found = 0;
	for (const http_route *r = s->p.routes; r && r->path; r++) {
		if (!route_match(r->path, url))
			continue;
		path_found = 1;
		if (strcmp(r->method, method) == 0) {
			r->fn(s->p.ud, &req, &resp);
			if (!resp.status)
				http_resp_error(&resp, 500, "server_error", NULL,
						"handler for %s %s produced no response", method, url);
			return send_resp(s, c, &resp);
		}
	}
	if (path_found)
		http_resp_error(&resp, 405, "invalid_request_error", "method_not_allowed",
				"method %s is not allowed on %s", method, url);
	else
		http_resp_error(&resp, 404, "invalid_request_error", "not_found",
				"no route for %s %s", method, url);
	return send_resp(s, c, &resp);
}

static void on_done(void *cls, struct MHD_Connection *c, void **con_cls,
		    enum MHD_RequestTerminationCode toe)
{
	struct conn_state *st = *con_cls;
	(void)cls;
	(void)c;
	(void)toe;
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
	unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
			 MHD_USE_ERROR_LOG;
	if (MHD_is_feature_supported(MHD_FEATURE_POLL) == MHD_YES)
		flags |= MHD_USE_POLL;
	s->d = MHD_start_daemon(flags, (uint16_t)p->port, NULL, NULL, on_request, s,
				MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
				MHD_OPTION_CONNECTION_LIMIT,
				(unsigned)(p->max_conns > 0 ? p->max_conns : 512),
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

/*
 * http.h - a small route table over libmicrohttpd.
 *
 * The control API (and later the OpenAI API) declare routes as
 * {method, path, handler}; this module owns the daemon, collects the request
 * body up to a hard cap (413 beyond it), dispatches, and sends the handler's
 * response.  Handlers run on libmicrohttpd's worker threads and must be
 * thread-safe; they never see a body larger than max_body.
 *
 * Errors are JSON in the OpenAI shape: {"error":{"message","type","code"}}.
 */
#ifndef DS_AGENT_HTTP_H
#define DS_AGENT_HTTP_H

#include "common/status.h"

#include <stddef.h>

struct MHD_Connection;

typedef struct http_req {
	const char *method;
	const char *path;
	const char *body; /* NUL-terminated; len bytes */
	size_t body_len;
	struct MHD_Connection *conn;
} http_req;

typedef struct http_resp {
	int status;
	char *body;               /* malloc'd; freed by the server after sending */
	const char *content_type; /* static string; default application/json */
} http_resp;

typedef void (*http_handler)(void *ud, const http_req *req, http_resp *resp);

typedef struct http_route {
	const char *method;
	const char *path;
	http_handler fn;
} http_route;

typedef struct http_params {
	const char *bind_addr;    /* IPv4 literal, default 127.0.0.1 */
	int port;                 /* 0 = any free port (see http_server_port) */
	const http_route *routes; /* ends with {0} */
	void *ud;                 /* passed to every handler */
	size_t max_body;          /* default 1 MiB */
	int threads;              /* worker threads, default 4 */
	int timeout_s;            /* idle connection timeout, default 30 */
} http_params;

typedef struct http_server http_server;

http_params http_default_params(void);
http_server *http_server_new(const http_params *p, ds_err *err);
void http_server_free(http_server *s);
int http_server_port(const http_server *s);

/* Fill resp with a JSON body (takes ownership of text) or an error object. */
void http_resp_json(http_resp *resp, int status, char *text);
void http_resp_error(http_resp *resp, int status, const char *type, const char *code,
		     const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Header value of the request, or NULL. */
const char *http_req_header(const http_req *req, const char *name);

#endif

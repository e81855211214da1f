/*
 * http.h - a small route table over libmicrohttpd.
 *
 * The control API and the OpenAI API declare routes as {method, path,
 * handler, auth}; a path ending in '*' matches every path with that prefix.
 * This module owns the daemon, checks a route's auth rule on the request
 * headers before any body byte is read, collects the body up to a hard cap
 * (413 beyond it, after draining the upload so the connection stays usable),
 * dispatches, and sends the handler's response: a whole body, or a stream
 * produced by a reader callback (SSE), with extra headers.
 *
 * Availability (docs/serving.md, "Timeouts and limits of the HTTP servers"):
 * request headers must be complete within header_timeout_s of a connection
 * opening or of its previous response ending (408 and closed otherwise, even
 * when bytes trickle in); a connection idle between requests is closed after
 * keepalive_timeout_s; one client address holds at most max_conns_per_addr
 * connections and the server at most max_conns: when either is reached, the
 * oldest connection that has not sent a whole request yet (or whose body is
 * only being drained) is closed to make room, else the new one is refused;
 * request bodies buffered at once across connections are capped by
 * max_body_total (503 + Retry-After beyond it, before the body is read).
 *
 * Threading: one thread per connection (MHD_USE_THREAD_PER_CONNECTION), so a
 * handler may block while the engine generates, and a stream reader may block
 * until its next event; one more thread per server enforces the header
 * deadline.  Handlers and auth checks must be thread-safe; handlers never
 * see a body larger than max_body.
 *
 * Errors are JSON in the OpenAI shape:
 *   {"error":{"message":..,"type":..,"param":..|null,"code":..|null}}.
 */
#ifndef DS_AGENT_HTTP_H
#define DS_AGENT_HTTP_H

#include "common/buf.h"
#include "common/status.h"

#include <stddef.h>
#include <sys/types.h>

struct MHD_Connection;

typedef struct http_req {
	const char *method;
	const char *path;
	const char *body; /* NUL-terminated; body_len bytes */
	size_t body_len;
	struct MHD_Connection *conn;
} http_req;

/* A streamed body: read() fills up to max bytes of out and returns how many,
 * blocking until it has some; HTTP_STREAM_END when the body is complete,
 * HTTP_STREAM_ERROR to drop the connection.  done() runs once when the
 * response is finished or the client went away (always, exactly once). */
#define HTTP_STREAM_END ((ssize_t)-1)
#define HTTP_STREAM_ERROR ((ssize_t)-2)
typedef ssize_t (*http_stream_read)(void *ctx, char *out, size_t max);
typedef void (*http_stream_done)(void *ctx);

#define HTTP_MAX_HEADERS 8

typedef struct http_resp {
	int status;
	char *body;               /* malloc'd; freed by the server after sending */
	const char *content_type; /* static string; default application/json */
	http_stream_read stream;  /* set: the body comes from stream(), body unused */
	http_stream_done stream_done;
	void *stream_ctx;
	int n_headers;
	char *headers[HTTP_MAX_HEADERS][2]; /* malloc'd name, value */
} http_resp;

typedef void (*http_handler)(void *ud, const http_req *req, http_resp *resp);

/* A route's auth rule, run when the request headers are complete and before
 * any body byte is read: req->body is "" (body_len 0), http_req_header works.
 * Returns 1 to go on (the body is read, then the handler runs and keeps its
 * own checks), or 0 with the refusal in resp (401, or whatever the owner's
 * rule answers from the headers alone): it is sent at once and the
 * connection is closed without reading the body. */
typedef int (*http_auth_fn)(void *ud, const http_req *req, http_resp *resp);

typedef struct http_route {
	const char *method;
	const char *path; /* exact, or a prefix when it ends in '*' */
	http_handler fn;
	http_auth_fn auth; /* NULL: no check before the body */
} http_route;

typedef struct http_params {
	const char *bind_addr;    /* IPv4 literal, default 127.0.0.1 */
	int port;                 /* 0 = any free port (see http_server_port) */
	const http_route *routes; /* ends with {0} */
	void *ud;                 /* passed to every handler */
	const char *name;         /* in log lines: "api", "control" (default "http") */
	size_t max_body;          /* one request's body, default 1 MiB (413 beyond) */
	size_t max_body_total;    /* bodies buffered at once, all connections: 256 MiB */
	int max_conns;            /* connections at once, default 1024 */
	int max_conns_per_addr;   /* from one client address, default 256; 0 = no limit */
	int header_timeout_s;     /* whole request headers within this, default 10 */
	int keepalive_timeout_s;  /* idle before a request's first byte, default 5 */
	int timeout_s;            /* no byte moving while a request is read or its
				     answer sent, default 600 */
	const char *cors_origin;  /* NULL = no CORS headers; "*" or one origin */
} http_params;

typedef struct http_server http_server;

http_params http_default_params(void);
http_server *http_server_new(const http_params *p, ds_err *err);
void http_server_free(http_server *s);
int http_server_port(const http_server *s);

/* Fill resp with a JSON body (takes ownership of text; NULL = 500) or an
 * error object.  param may be NULL (JSON null). */
void http_resp_json(http_resp *resp, int status, char *text);
void http_resp_error(http_resp *resp, int status, const char *type, const char *code,
		     const char *fmt, ...) __attribute__((format(printf, 5, 6)));
void http_resp_error_param(http_resp *resp, int status, const char *type, const char *code,
			   const char *param, const char *fmt, ...)
	__attribute__((format(printf, 6, 7)));
/* Adds a response header (copied).  Names and values with control characters
 * are refused (DS_EINVAL), so nothing a client sent can split a header. */
int http_resp_header(http_resp *resp, const char *name, const char *value);

/* Header value of the request, or NULL. */
const char *http_req_header(const http_req *req, const char *name);

/* 1 when the client hung up (checked without blocking; for handlers and
 * stream readers that wait on the engine).  A client that only half-closed
 * its socket after sending the whole request is not gone: it still reads
 * the answer.  TCP tells the two apart only when data reaches the peer (a
 * closed socket answers with a reset), so when the peer's FIN is seen while
 * a handler runs and nothing of the response was sent, an interim
 * "HTTP/1.1 100 Continue" goes out once (every HTTP/1.1 client skips it);
 * the reset it draws makes a later call return 1.  HTTP/1.0 requests get no
 * probe: a FIN alone never cancels them.  Call it from the connection's own
 * thread (the handler or its stream reader). */
int http_conn_gone(struct MHD_Connection *conn);

/* Appends text[0..len) with every ill-formed UTF-8 subpart replaced by
 * U+FFFD (JSON strings must be valid UTF-8). */
void http_utf8_clean(const char *text, size_t len, buf *out);

/* 1 when addr (an IPv4 literal) is a loopback address (127.0.0.0/8). */
int http_addr_is_loopback(const char *addr);

#endif

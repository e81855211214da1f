/*
 * http.c - libmicrohttpd daemon with a route table (see http.h).
 *
 * A connection (struct conn, on the server's list from MHD's STARTED to its
 * CLOSED notification, on_conn; phase and since under s->mu):
 *
 *      on_accept: at the address's or the server's limit the oldest WAIT or
 *      │          DRAIN connection is shut down to make room, else refused
 *      v
 *    WAIT ───── headers complete (on_headers) ─────> REQUEST
 *    ^  │                                              │  │ answer known before
 *    │  │ headers late (reap_main): 408, shut down     │  │ the body: 413/404/405
 *    │  │ idle keepalive_timeout_s: MHD closes it      │  │ (on_headers), budget
 *    │  v                                              │  │ out (on_upload)
 *    │ closed                                          │  v
 *    │                                                 │ DRAIN ── body late
 *    │                                                 │  │       (reap_main):
 *    └────────── response sent (on_done) ──────────────┴──┘       shut down
 *
 * A request inside REQUEST (MHD calls on_request several times):
 *
 *   headers ─> OPTIONS: 204 | route (404/405 kept for the end)
 *           ─> the route's auth(headers) fails ─> its answer now, body unread
 *           ─> Content-Length over max_body, or 404/405 ─> DRAIN: the body
 *              is read and dropped; 413 / 404 / 405 at the end
 *           ─> reserve Content-Length in the body budget ─over─> 503 now
 *   upload chunk ─> append (chunked: reserved as it comes; over: 503 at the end)
 *   last call ───> handler(ud, req, resp); body and reservation released
 *                  ─> queue a buffer response, or a callback response whose
 *                     reader is the handler's stream (chunked transfer)
 *   completed ───> on_done frees the request's state; the connection WAITs
 *
 * Invariants:
 *  1. No body byte is buffered before the route's auth rule passed and its
 *     reservation in the server's body budget (body_used <= max_body_total)
 *     was granted; a request answered from its headers is never read further
 *     (MHD closes the connection after the answer; what it read with the
 *     headers stays in its fixed per-connection pool).
 *  2. Only WAIT and DRAIN connections are shut down by the server
 *     (on_accept, reap_main): no handler runs on them, so nothing the
 *     engine does is cut.
 *  3. A conn's fd is shut down only under s->mu while the conn is on the
 *     list: MHD closes the fd after the CLOSED notification took it off, so
 *     the number never names another socket.
 *  4. answering, probed and http11 belong to the connection's thread.
 *
 * libmicrohttpd's own messages go to the log at debug level (mhd_log);
 * refusals, evictions and late headers are counted and logged at most once
 * per NOTE_EVERY_S per kind.
 *
 * Threading: a thread per connection calls on_request and any stream reader,
 * so both may block; MHD's listening thread calls on_accept and on_conn; one
 * reaper thread per server.  The route table and ud are read-only after
 * start.
 */
#include "agent/api/http.h"
#include "common/buf.h"
#include "common/jsonx.h"
#include "common/log.h"
#include "common/strutil.h"
#include "common/utf8.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define NOTE_EVERY_S 10.0
#define REAP_TICK_MS 200

enum conn_phase { CONN_WAIT, CONN_REQUEST, CONN_DRAIN };

struct conn {
	struct conn *prev, *next; /* s->conns, under s->mu */
	int fd;
	uint32_t addr;            /* IPv4, network order */
	enum conn_phase phase;    /* under s->mu */
	double since;             /* when the phase began (ds_now_s), under s->mu */
	int closing;              /* shut down by the server, under s->mu */
	/* the connection's thread only */
	int http11;               /* the current request is HTTP/1.1 */
	int answering;            /* its handler runs: no response byte sent yet */
	int probed;               /* the 100 Continue probe went out for it */
};

enum note_kind { NOTE_REFUSED_ADDR, NOTE_REFUSED_FULL, NOTE_EVICTED, NOTE_LATE, NOTE_N };

struct note {
	double last;          /* when the kind was last logged */
	unsigned long n;      /* events since */
	char addr[INET_ADDRSTRLEN]; /* the latest one's client */
};

struct http_server {
	struct MHD_Daemon *d;
	http_params p;
	int port;
	pthread_mutex_t mu;
	pthread_cond_t wake;  /* the reaper's sleep; signalled to stop it */
	pthread_t reaper;
	int reaper_started, stop;
	struct conn *conns;   /* every open connection */
	size_t body_used;     /* bytes reserved by requests' bodies */
	struct note notes[NOTE_N];
};

/* One request (MHD's con_cls). */
struct req_state {
	buf body;
	size_t reserved;     /* bytes of s->body_used held by this request */
	int declared;        /* Content-Length was given */
	int too_large;       /* 413 at the end */
	int busy;            /* the body budget ran out mid-upload: 503 at the end */
	int route_status;    /* 404 or 405 at the end, else 0 */
};

http_params http_default_params(void)
{
	http_params p = {0};
	p.bind_addr = "127.0.0.1";
	p.name = "http";
	p.max_body = 1 << 20;
	p.max_body_total = (size_t)256 << 20;
	p.max_conns = 1024;
	p.max_conns_per_addr = 256;
	p.header_timeout_s = 10;
	p.keepalive_timeout_s = 5;
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

int http_addr_is_loopback(const char *addr)
{
	struct in_addr a;
	if (!addr || inet_pton(AF_INET, addr, &a) != 1)
		return 0;
	return (ntohl(a.s_addr) >> 24) == 127;
}

/* ---- connections: limits, deadlines, hang-ups ---- */

static struct conn *conn_of(struct MHD_Connection *mc)
{
	const union MHD_ConnectionInfo *ci =
		MHD_get_connection_info(mc, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
	return ci ? ci->socket_context : NULL;
}

static void conn_phase_set(http_server *s, struct conn *k, enum conn_phase phase)
{
	if (!k)
		return;
	pthread_mutex_lock(&s->mu);
	k->phase = phase;
	k->since = ds_now_s();
	pthread_mutex_unlock(&s->mu);
}

static const struct {
	const char *what;
	enum log_level level;
	const char *limit; /* the setting the line shows */
} note_kinds[NOTE_N] = {
	[NOTE_REFUSED_ADDR] = {"connections refused: their address is at its connection limit",
			       LOG_WARN, "max_conns_per_addr"},
	[NOTE_REFUSED_FULL] = {"connections refused: the server is at its connection limit",
			       LOG_WARN, "max_conns"},
	[NOTE_EVICTED] = {"connections closed to make room: no whole request sent yet", LOG_INFO,
			  "max_conns"},
	[NOTE_LATE] = {"connections closed: request headers not complete in time", LOG_INFO,
		       "header_timeout_s"},
};

static int note_limit(const http_server *s, enum note_kind k)
{
	switch (k) {
	case NOTE_REFUSED_ADDR:
		return s->p.max_conns_per_addr;
	case NOTE_LATE:
		return s->p.header_timeout_s;
	default:
		return s->p.max_conns;
	}
}

/* Logs kind k's events since its last line, when there are some and
 * NOTE_EVERY_S has passed.  Under s->mu. */
static void note_flush(http_server *s, enum note_kind k, double now)
{
	struct note *n = &s->notes[k];
	if (!n->n || (n->last > 0 && now - n->last < NOTE_EVERY_S))
		return;
	log_write(note_kinds[k].level, "http", note_kinds[k].what,
		  "server=%s count=%lu last_addr=%s %s=%d", s->p.name, n->n, n->addr,
		  note_kinds[k].limit, note_limit(s, k));
	n->n = 0;
	n->last = now;
}

/* Counts one event of kind k from addr.  Under s->mu. */
static void note(http_server *s, enum note_kind k, uint32_t addr)
{
	struct note *n = &s->notes[k];
	n->n++;
	inet_ntop(AF_INET, &addr, n->addr, sizeof n->addr);
	note_flush(s, k, ds_now_s());
}

/* WAIT and DRAIN connections run no handler: the server may close them. */
static int evictable(const struct conn *k)
{
	return !k->closing && k->phase != CONN_REQUEST;
}

/* Shuts k's socket down (invariant 3: under s->mu, k on the list): its
 * thread sees the hang-up and MHD closes the connection. */
static void conn_shut(struct conn *k)
{
	k->closing = 1;
	shutdown(k->fd, SHUT_RDWR);
}

/* The evictable connection that has waited longest (of addr when only_addr). */
static struct conn *oldest_evictable(http_server *s, int only_addr, uint32_t addr)
{
	struct conn *best = NULL;
	for (struct conn *k = s->conns; k; k = k->next)
		if (evictable(k) && (!only_addr || k->addr == addr) &&
		    (!best || k->since < best->since))
			best = k;
	return best;
}

/* MHD's accept policy (listening thread): the address's limit, then the
 * server's.  At a limit the oldest evictable connection makes room. */
static enum MHD_Result on_accept(void *cls, const struct sockaddr *sa, socklen_t len)
{
	http_server *s = cls;
	if (!sa || sa->sa_family != AF_INET || len < (socklen_t)sizeof(struct sockaddr_in))
		return MHD_YES; /* the servers listen on IPv4 only */
	uint32_t addr = ((const struct sockaddr_in *)(const void *)sa)->sin_addr.s_addr;
	enum MHD_Result ok = MHD_YES;
	int n_all = 0, n_addr = 0;
	pthread_mutex_lock(&s->mu);
	for (struct conn *k = s->conns; k; k = k->next) {
		if (k->closing)
			continue;
		n_all++;
		n_addr += k->addr == addr;
	}
	if (s->p.max_conns_per_addr > 0 && n_addr >= s->p.max_conns_per_addr) {
		struct conn *v = oldest_evictable(s, 1, addr);
		if (!v) {
			note(s, NOTE_REFUSED_ADDR, addr);
			ok = MHD_NO;
			goto out;
		}
		conn_shut(v);
		note(s, NOTE_EVICTED, v->addr);
		n_all--;
	}
	if (n_all >= s->p.max_conns) {
		struct conn *v = oldest_evictable(s, 0, 0);
		if (!v) {
			note(s, NOTE_REFUSED_FULL, addr);
			ok = MHD_NO;
			goto out;
		}
		conn_shut(v);
		note(s, NOTE_EVICTED, v->addr);
	}
out:
	pthread_mutex_unlock(&s->mu);
	return ok;
}

/* MHD's connection notifications: STARTED (listening thread, after
 * on_accept) puts the connection on the list, CLOSED (before MHD closes
 * the fd) takes it off. */
static void on_conn(void *cls, struct MHD_Connection *mc, void **socket_context,
		    enum MHD_ConnectionNotificationCode code)
{
	http_server *s = cls;
	struct conn *k = *socket_context;
	if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
		if (!k)
			return;
		pthread_mutex_lock(&s->mu);
		if (k->prev)
			k->prev->next = k->next;
		else
			s->conns = k->next;
		if (k->next)
			k->next->prev = k->prev;
		pthread_mutex_unlock(&s->mu);
		free(k);
		*socket_context = NULL;
		return;
	}
	const union MHD_ConnectionInfo *fd =
		MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
	const union MHD_ConnectionInfo *ad =
		MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
	if (!fd)
		return;
	k = calloc(1, sizeof *k);
	if (!k) { /* untracked, it would escape every limit: refuse it */
		shutdown(fd->connect_fd, SHUT_RDWR);
		return;
	}
	k->fd = fd->connect_fd;
	if (ad && ad->client_addr && ad->client_addr->sa_family == AF_INET)
		k->addr = ((const struct sockaddr_in *)(const void *)ad->client_addr)->sin_addr.s_addr;
	k->phase = CONN_WAIT;
	k->since = ds_now_s();
	pthread_mutex_lock(&s->mu);
	k->next = s->conns;
	if (s->conns)
		s->conns->prev = k;
	s->conns = k;
	pthread_mutex_unlock(&s->mu);
	*socket_context = k;
}

/* The reaper: shuts down every WAIT connection whose request headers are not
 * complete header_timeout_s after the phase began (a 408 first) and every
 * DRAIN connection whose thrown-away body takes as long; flushes the notes. */
static void *reap_main(void *arg)
{
	http_server *s = arg;
	char late[512];
	int body_len = snprintf(late, sizeof late,
				"{\"error\":{\"message\":\"request headers not complete within %d "
				"s\",\"type\":\"invalid_request_error\",\"param\":null,\"code\":"
				"\"request_timeout\"}}",
				s->p.header_timeout_s);
	char msg[768];
	int msg_len = snprintf(msg, sizeof msg,
			       "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: "
			       "application/json\r\nContent-Length: %d\r\n\r\n%s",
			       body_len, late);
	pthread_mutex_lock(&s->mu);
	while (!s->stop) {
		double now = ds_now_s();
		for (struct conn *k = s->conns; k && s->p.header_timeout_s > 0; k = k->next) {
			if (!evictable(k) || now - k->since < s->p.header_timeout_s)
				continue;
			if (k->phase == CONN_WAIT) /* best effort: the socket is not ours to wait on */
				(void)!send(k->fd, msg, (size_t)msg_len, MSG_NOSIGNAL | MSG_DONTWAIT);
			conn_shut(k);
			note(s, NOTE_LATE, k->addr);
		}
		for (int i = 0; i < NOTE_N; i++)
			note_flush(s, (enum note_kind)i, now);
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		ts.tv_nsec += REAP_TICK_MS * 1000000L;
		if (ts.tv_nsec >= 1000000000L) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000L;
		}
		pthread_cond_timedwait(&s->wake, &s->mu, &ts);
	}
	pthread_mutex_unlock(&s->mu);
	return NULL;
}

int http_conn_gone(struct MHD_Connection *conn)
{
	static const char probe[] = "HTTP/1.1 100 Continue\r\n\r\n";
	const union MHD_ConnectionInfo *ci =
		MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
	if (!ci)
		return 1;
	struct pollfd pf = {.fd = ci->connect_fd, .events = POLLIN | POLLRDHUP};
	if (poll(&pf, 1, 0) <= 0)
		return 0;
	if (pf.revents & (POLLHUP | POLLERR | POLLNVAL)) /* a reset, or closed both ways */
		return 1;
	if (!(pf.revents & POLLRDHUP)) /* bytes of a pipelined request */
		return 0;
	/* FIN: the client is done sending; whether it still reads, only data
	 * sent to it tells (see http.h) */
	struct conn *k = conn_of(conn);
	if (!k || !k->answering || !k->http11 || k->probed)
		return 0;
	k->probed = 1;
	ssize_t n = send(ci->connect_fd, probe, sizeof probe - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
	return n < 0 && (errno == EPIPE || errno == ECONNRESET);
}

/* libmicrohttpd's own messages (client errors, mostly): into the log. */
__attribute__((format(printf, 2, 0))) static void mhd_log(void *cls, const char *fmt, va_list ap)
{
	const http_server *s = cls;
	char text[512];
	vsnprintf(text, sizeof text, fmt, ap);
	size_t n = strlen(text);
	while (n && (text[n - 1] == '\n' || text[n - 1] == '\r'))
		text[--n] = '\0';
	for (char *p = text; *p; p++)
		if (*p == '"' || (unsigned char)*p < 0x20)
			*p = '\'';
	log_debug("http", "libmicrohttpd", "server=%s text=\"%s\"", s->p.name, text);
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

/* The route of method + url, or NULL with *status 405 (the path exists
 * with other methods) or 404. */
static const http_route *route_find(const http_server *s, const char *method, const char *url,
				    int *status)
{
	int path_found = 0;
	for (const http_route *r = s->p.routes; r && r->path; r++) {
		if (!route_match(r->path, url))
			continue;
		path_found = 1;
		if (strcmp(r->method, method) == 0) {
			*status = 0;
			return r;
		}
	}
	*status = path_found ? 405 : 404;
	return NULL;
}

/* Reserves n more bytes of the server's body budget for st; 0 when they do
 * not fit (max_body_total 0: no budget). */
static int body_reserve(http_server *s, struct req_state *st, size_t n)
{
	int ok;
	pthread_mutex_lock(&s->mu);
	ok = !s->p.max_body_total || n <= s->p.max_body_total - s->body_used;
	if (ok) {
		s->body_used += n;
		st->reserved += n;
	}
	pthread_mutex_unlock(&s->mu);
	return ok;
}

/* Frees st's body and gives its reservation back. */
static void body_release(http_server *s, struct req_state *st)
{
	buf_free(&st->body);
	pthread_mutex_lock(&s->mu);
	s->body_used -= st->reserved;
	st->reserved = 0;
	pthread_mutex_unlock(&s->mu);
}

static void busy_error(const http_server *s, http_resp *resp)
{
	http_resp_error(resp, 503, "service_unavailable_error", "server_busy",
			"request bodies being received exceed this server's limit of %zu bytes; "
			"retry shortly",
			s->p.max_body_total);
	http_resp_header(resp, "Retry-After", "1");
}

/* The first call of a request: its headers are complete, no body byte was
 * read.  Answers now what the headers decide (invariant 1). */
static enum MHD_Result on_headers(http_server *s, struct MHD_Connection *c, const char *url,
				  const char *method, const char *version, void **con_cls)
{
	struct conn *k = conn_of(c);
	struct req_state *st = calloc(1, sizeof *st);
	if (!st)
		return MHD_NO;
	buf_init(&st->body, s->p.max_body);
	*con_cls = st;
	if (k) {
		k->http11 = version && strcmp(version, MHD_HTTP_VERSION_1_1) == 0;
		k->probed = 0;
	}
	conn_phase_set(s, k, CONN_REQUEST);
	MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)s->p.timeout_s);
	http_resp resp = {0};
	if (strcmp(method, "OPTIONS") == 0) { /* CORS preflight: never authenticated */
		resp.status = 204;
		return send_resp(s, c, &resp);
	}
	const http_route *r = route_find(s, method, url, &st->route_status);
	if (r && r->auth) {
		http_req req = {.method = method, .path = url, .body = "", .body_len = 0, .conn = c};
		if (!r->auth(s->p.ud, &req, &resp)) {
			if (!resp.status)
				http_resp_error(&resp, 500, "server_error", NULL,
						"auth check for %s %s produced no response", method,
						url);
			return send_resp(s, c, &resp);
		}
		http_resp_clear(&resp);
	}
	int64_t len = -1;
	const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND,
						     MHD_HTTP_HEADER_CONTENT_LENGTH);
	if (cl && ds_parse_i64(cl, 0, INT64_MAX, &len) != DS_OK)
		len = -1;
	st->declared = len >= 0;
	st->too_large = len > 0 && (uint64_t)len > s->p.max_body;
	if (st->too_large || st->route_status) { /* the answer is known: drain the body */
		conn_phase_set(s, k, CONN_DRAIN);
		return MHD_YES;
	}
	if (len > 0 && !body_reserve(s, st, (size_t)len)) {
		busy_error(s, &resp);
		return send_resp(s, c, &resp);
	}
	return MHD_YES;
}

/* An upload chunk: kept, or dropped when the answer is already known. */
static void on_upload(http_server *s, struct MHD_Connection *c, struct req_state *st,
		      const char *data, size_t n)
{
	if (st->too_large || st->busy || st->route_status)
		return;
	int rc = DS_OK;
	if (!st->declared && !body_reserve(s, st, n)) /* chunked: reserved as it comes */
		st->busy = 1;
	else if ((rc = buf_append(&st->body, data, n)) != DS_OK)
		*(rc == DS_ERANGE ? &st->too_large : &st->busy) = 1;
	if (st->too_large || st->busy) {
		body_release(s, st);
		conn_phase_set(s, conn_of(c), CONN_DRAIN);
	}
}

/* The last call: the whole body is in (or was drained). */
static enum MHD_Result on_complete(http_server *s, struct MHD_Connection *c, const char *url,
				   const char *method, struct req_state *st)
{
	http_resp resp = {0};
	if (st->too_large) {
		http_resp_error(&resp, 413, "invalid_request_error", "request_too_large",
				"request body is larger than the limit of %zu bytes", s->p.max_body);
	} else if (st->busy) {
		busy_error(s, &resp);
	} else if (st->route_status == 405) {
		http_resp_error(&resp, 405, "invalid_request_error", "method_not_allowed",
				"method %s is not allowed on %s", method, url);
	} else if (st->route_status) {
		http_resp_error(&resp, 404, "invalid_request_error", "not_found",
				"no route for %s %s", method, url);
	} else {
		int status;
		const http_route *r = route_find(s, method, url, &status);
		http_req req = {
			.method = method,
			.path = url,
			.body = st->body.data ? st->body.data : "",
			.body_len = st->body.len,
			.conn = c,
		};
		struct conn *k = conn_of(c);
		if (k)
			k->answering = 1;
		r->fn(s->p.ud, &req, &resp);
		if (k)
			k->answering = 0;
		body_release(s, st); /* a stream no longer needs it */
		if (!resp.status)
			http_resp_error(&resp, 500, "server_error", NULL,
					"handler for %s %s produced no response", method, url);
	}
	return send_resp(s, c, &resp);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
				  const char *method, const char *version, const char *upload,
				  size_t *upload_size, void **con_cls)
{
	http_server *s = cls;
	struct req_state *st = *con_cls;
	if (!st)
		return on_headers(s, c, url, method, version, con_cls);
	if (*upload_size) {
		on_upload(s, c, st, upload, *upload_size);
		*upload_size = 0;
		return MHD_YES;
	}
	return on_complete(s, c, url, method, st);
}

/* A request ended (answered, or its connection closed): its state goes, the
 * connection waits for the next request's headers. */
static void on_done(void *cls, struct MHD_Connection *c, void **con_cls,
		    enum MHD_RequestTerminationCode toe)
{
	http_server *s = cls;
	struct req_state *st = *con_cls;
	(void)toe;
	if (st) {
		body_release(s, st);
		free(st);
		*con_cls = NULL;
	}
	struct conn *k = conn_of(c);
	if (k)
		k->answering = 0;
	conn_phase_set(s, k, CONN_WAIT);
	MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT,
				  (unsigned)s->p.keepalive_timeout_s);
}

http_server *http_server_new(const http_params *p, ds_err *err)
{
	http_server *s = calloc(1, sizeof *s);
	if (!s) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	s->p = *p;
	if (!s->p.name)
		s->p.name = "http";
	if (s->p.max_conns <= 0)
		s->p.max_conns = 1024;
	if (s->p.header_timeout_s < 0 || s->p.keepalive_timeout_s < 0 || s->p.timeout_s < 0 ||
	    s->p.max_conns_per_addr < 0) {
		ds_err_set(err, DS_EINVAL, "%s: negative HTTP timeout or limit", s->p.name);
		free(s);
		return NULL;
	}
	struct sockaddr_in sa = {0};
	sa.sin_family = AF_INET;
	sa.sin_port = htons((uint16_t)p->port);
	if (inet_pton(AF_INET, p->bind_addr ? p->bind_addr : "127.0.0.1", &sa.sin_addr) != 1) {
		ds_err_set(err, DS_EINVAL, "bind address '%s' is not an IPv4 address", p->bind_addr);
		free(s);
		return NULL;
	}
	pthread_mutex_init(&s->mu, NULL);
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&s->wake, &ca);
	pthread_condattr_destroy(&ca);
	unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
			 MHD_USE_ERROR_LOG;
	if (MHD_is_feature_supported(MHD_FEATURE_POLL) == MHD_YES)
		flags |= MHD_USE_POLL;
	/* MHD's own limit leaves room for connections shut down (evicted) whose
	 * threads have not closed them yet; on_accept enforces max_conns. */
	unsigned mhd_limit = (unsigned)s->p.max_conns + (unsigned)s->p.max_conns / 4 + 16;
	s->d = MHD_start_daemon(flags, (uint16_t)p->port, on_accept, s, on_request, s,
				MHD_OPTION_EXTERNAL_LOGGER, mhd_log, s,
				MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
				MHD_OPTION_CONNECTION_LIMIT, mhd_limit,
				MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)s->p.keepalive_timeout_s,
				MHD_OPTION_NOTIFY_COMPLETED, on_done, s,
				MHD_OPTION_NOTIFY_CONNECTION, on_conn, s, MHD_OPTION_END);
	if (!s->d) {
		ds_err_set(err, DS_EIO, "cannot listen on %s:%d (port in use or not permitted)",
			   p->bind_addr, p->port);
		goto fail;
	}
	if (pthread_create(&s->reaper, NULL, reap_main, s) != 0) {
		ds_err_set(err, DS_ENOMEM, "%s: cannot start the header deadline thread",
			   s->p.name);
		MHD_stop_daemon(s->d);
		goto fail;
	}
	s->reaper_started = 1;
	const union MHD_DaemonInfo *info = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
	s->port = info ? info->port : p->port;
	return s;
fail:
	pthread_cond_destroy(&s->wake);
	pthread_mutex_destroy(&s->mu);
	free(s);
	return NULL;
}

void http_server_free(http_server *s)
{
	if (!s)
		return;
	pthread_mutex_lock(&s->mu);
	s->stop = 1;
	pthread_cond_signal(&s->wake);
	pthread_mutex_unlock(&s->mu);
	if (s->reaper_started)
		pthread_join(s->reaper, NULL);
	MHD_stop_daemon(s->d); /* the CLOSED notifications empty the list */
	pthread_cond_destroy(&s->wake);
	pthread_mutex_destroy(&s->mu);
	free(s);
}

int http_server_port(const http_server *s)
{
	return s->port;
}

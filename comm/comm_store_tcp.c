/*
 * comm_store_tcp.c - the rendezvous store of comm.h served over TCP: a
 * server thread in the launcher, a client (a comm_store) in every rank.
 *
 * Callers: the launcher (dsrun's driver, tests/unit/test_comm_gloo.c)
 * starts the server; each rank opens a client and hands it to a multi-rank
 * constructor (comm_gloo_new, comm_nccl_new).
 * Calls: sockets and poll(); common/log for the lines about bad clients.
 *
 * Protocol (all integers big-endian; one request at a time per connection,
 * the client waits for the reply before it sends the next):
 *
 *   request  = magic u8 'S' | op u8 | klen u16 | arg u32 | key[klen] | value
 *              op 1 SET: arg = value length, value[arg] follows
 *              op 2 GET: arg = how long to wait for the key, in ms; no value
 *   reply    = magic u8 'R' | status u8 | vlen u32 | value[vlen]
 *              status 0 ok (GET: the value), 1 timeout (the key never
 *              appeared), 2 refused (the store is full)
 *
 * Threading: the server is one thread (serve) that owns every connection
 * and the table; it polls the listening socket, the clients and a pipe
 * that stop writes to.  A GET whose key is absent parks its client on a
 * deadline (pending) and is answered by the SET that brings the key or by
 * the deadline, so a waiting client never holds up the others.  A client
 * handle is safe to share between threads (a mutex around each exchange).
 *
 * Invariants:
 *   1. the server trusts no size from the wire: magic, op, 1 <= klen <=
 *      KEY_MAX, a printable key and arg <= COMM_STORE_VALUE_MAX for SET are
 *      checked before a byte of the body is read; a bad frame closes that
 *      client's connection with a log line and nothing else changes.
 *   2. memory is bounded: at most CLIENTS_MAX connections (more are
 *      accepted and closed at once), at most ENTRIES_MAX keys (a SET of a
 *      new key past it is refused), fixed-size buffers per connection.
 *   3. a connection is in one state: reading a request, waiting for a key
 *      (pending), or writing a reply; it reads only when it has nothing to
 *      answer, so a client that pipelines gets no more than its share.
 *   4. the client trusts the server no more: a reply larger than
 *      COMM_STORE_VALUE_MAX or with a bad magic closes the connection
 *      (DS_EFORMAT) and later calls fail with DS_EIO.
 */
#include "comm/comm.h"
#include "common/log.h"
#include "common/strutil.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define KEY_MAX 256
#define CLIENTS_MAX 256
#define ENTRIES_MAX 16384
#define REQ_HDR 8 /* magic, op, klen u16, arg u32 */
#define REP_HDR 6 /* magic, status, vlen u32 */
#define MAGIC_REQ 'S'
#define MAGIC_REP 'R'
#define OP_SET 1
#define OP_GET 2
#define ST_OK 0
#define ST_TIMEOUT 1
#define ST_FULL 2

static void put_u16(unsigned char *p, uint32_t v)
{
	p[0] = (unsigned char)(v >> 8);
	p[1] = (unsigned char)v;
}

static void put_u32(unsigned char *p, uint32_t v)
{
	p[0] = (unsigned char)(v >> 24);
	p[1] = (unsigned char)(v >> 16);
	p[2] = (unsigned char)(v >> 8);
	p[3] = (unsigned char)v;
}

static uint32_t get_u16(const unsigned char *p)
{
	return (uint32_t)p[0] << 8 | p[1];
}

static uint32_t get_u32(const unsigned char *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static int64_t now_ms(void)
{
	return (int64_t)(ds_now_ns() / 1000000u);
}

/* Splits "host:port" (the last colon) into host and a port 0..65535. */
static int split_addr(const char *addr, char *host, size_t cap, char *port, size_t pcap)
{
	const char *colon = addr ? strrchr(addr, ':') : NULL;
	int p;
	if (!colon || colon == addr || (size_t)(colon - addr) >= cap || strlen(colon + 1) >= pcap ||
	    ds_parse_int(colon + 1, 0, 65535, &p) != 0)
		return -1;
	memcpy(host, addr, (size_t)(colon - addr));
	host[colon - addr] = '\0';
	ds_strlcpy(port, colon + 1, pcap);
	return 0;
}

/* ---- server ---- */

typedef struct entry {
	char *key;
	unsigned char *val;
	size_t len;
} entry;

typedef enum conn_state { CONN_READ, CONN_PENDING, CONN_WRITE } conn_state;

typedef struct conn {
	int fd; /* -1: free slot */
	conn_state state;
	char peer[64];
	size_t have;      /* bytes of the request in in[] */
	int64_t deadline; /* CONN_PENDING: when the GET gives up (ms) */
	char key[KEY_MAX + 1];
	size_t out_len, out_off;
	unsigned char in[REQ_HDR + KEY_MAX + COMM_STORE_VALUE_MAX];
	unsigned char out[REP_HDR + COMM_STORE_VALUE_MAX];
} conn;

struct comm_store_server {
	int lfd, wake[2];
	pthread_t thread;
	char addr[300];
	entry *tab;
	size_t n_tab;
	conn *conns; /* CLIENTS_MAX slots */
	struct pollfd *pf; /* CLIENTS_MAX + 2, for serve */
	int *idx;          /* pf slot -> conn */
};

static entry *tab_find(comm_store_server *s, const char *key)
{
	for (size_t i = 0; i < s->n_tab; i++)
		if (strcmp(s->tab[i].key, key) == 0)
			return &s->tab[i];
	return NULL;
}

static void conn_close(conn *c, const char *why)
{
	if (why)
		log_warn("comm_store", "closing client", "peer=%s reason=\"%s\"", c->peer, why);
	close(c->fd);
	c->fd = -1;
}

static void conn_reply(conn *c, int status, const void *val, size_t len)
{
	c->out[0] = MAGIC_REP;
	c->out[1] = (unsigned char)status;
	put_u32(c->out + 2, (uint32_t)len);
	if (len)
		memcpy(c->out + REP_HDR, val, len);
	c->out_len = REP_HDR + len;
	c->out_off = 0;
	c->state = CONN_WRITE;
}

/* Writes what it can of c's reply; back to CONN_READ when all is out. */
static void conn_flush(conn *c)
{
	while (c->out_off < c->out_len) {
		ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return;
		if (w <= 0) {
			conn_close(c, NULL); /* the client went away */
			return;
		}
		c->out_off += (size_t)w;
	}
	c->state = CONN_READ;
	c->have = 0;
}

static int set_value(comm_store_server *s, const char *key, const unsigned char *val, size_t len)
{
	entry *e = tab_find(s, key);
	unsigned char *copy = malloc(len ? len : 1);
	if (!copy)
		return ST_FULL;
	if (len)
		memcpy(copy, val, len);
	if (!e) {
		if (s->n_tab == ENTRIES_MAX) {
			free(copy);
			return ST_FULL;
		}
		char *k = strdup(key);
		if (!k) {
			free(copy);
			return ST_FULL;
		}
		e = &s->tab[s->n_tab++];
		e->key = k;
		e->val = NULL;
	}
	free(e->val);
	e->val = copy;
	e->len = len;
	/* wake the GETs parked on this key */
	for (int i = 0; i < CLIENTS_MAX; i++) {
		conn *w = &s->conns[i];
		if (w->fd >= 0 && w->state == CONN_PENDING && strcmp(w->key, key) == 0) {
			conn_reply(w, ST_OK, e->val, e->len);
			conn_flush(w);
		}
	}
	return ST_OK;
}

/* Checks the header in c->in (invariant 1); the body's size or -1 with why. */
static long frame_body(const conn *c, const char **why)
{
	const unsigned char *h = c->in;
	uint32_t klen = get_u16(h + 2), arg = get_u32(h + 4);
	if (h[0] != MAGIC_REQ) {
		*why = "bad magic byte";
		return -1;
	}
	if (h[1] != OP_SET && h[1] != OP_GET) {
		*why = "unknown op";
		return -1;
	}
	if (klen == 0 || klen > KEY_MAX) {
		*why = "key length out of bounds";
		return -1;
	}
	if (h[1] == OP_SET && arg > COMM_STORE_VALUE_MAX) {
		*why = "value longer than COMM_STORE_VALUE_MAX";
		return -1;
	}
	return (long)klen + (h[1] == OP_SET ? (long)arg : 0);
}

/* Handles the whole request in c->in. */
static void conn_request(comm_store_server *s, conn *c)
{
	uint32_t klen = get_u16(c->in + 2), arg = get_u32(c->in + 4);
	memcpy(c->key, c->in + REQ_HDR, klen);
	c->key[klen] = '\0';
	for (uint32_t i = 0; i < klen; i++) {
		if (c->in[REQ_HDR + i] < 0x21 || c->in[REQ_HDR + i] > 0x7e) {
			conn_close(c, "key is not printable ASCII");
			return;
		}
	}
	if (c->in[1] == OP_SET) {
		int st = set_value(s, c->key, c->in + REQ_HDR + klen, arg);
		if (st != ST_OK)
			log_warn("comm_store", "store full: set refused", "key=%s entries=%zu", c->key,
				 s->n_tab);
		conn_reply(c, st, NULL, 0);
		conn_flush(c);
		return;
	}
	entry *e = tab_find(s, c->key);
	if (e) {
		conn_reply(c, ST_OK, e->val, e->len);
		conn_flush(c);
		return;
	}
	c->state = CONN_PENDING;
	c->deadline = now_ms() + (int64_t)(arg > 3600000u ? 3600000u : arg);
}

/* Reads what is there of c's request (CONN_READ only, invariant 3). */
static void conn_read(comm_store_server *s, conn *c)
{
	for (;;) {
		size_t want = REQ_HDR;
		if (c->have >= REQ_HDR) {
			const char *why = NULL;
			long body = frame_body(c, &why);
			if (body < 0) {
				conn_close(c, why);
				return;
			}
			want = REQ_HDR + (size_t)body;
		}
		if (c->have == want && want > REQ_HDR) {
			conn_request(s, c);
			return;
		}
		ssize_t r = recv(c->fd, c->in + c->have, want - c->have, 0);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return;
		if (r <= 0) {
			conn_close(c, c->have ? "connection closed inside a request" : NULL);
			return;
		}
		c->have += (size_t)r;
	}
}

static void serve_accept(comm_store_server *s)
{
	struct sockaddr_storage ss;
	socklen_t sl = sizeof ss;
	int fd = accept4(s->lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
	if (fd < 0)
		return;
	char host[48] = "?", port[16] = "?";
	getnameinfo((struct sockaddr *)&ss, sl, host, sizeof host, port, sizeof port,
		    NI_NUMERICHOST | NI_NUMERICSERV);
	for (int i = 0; i < CLIENTS_MAX; i++) {
		conn *c = &s->conns[i];
		if (c->fd < 0) {
			c->fd = fd;
			c->state = CONN_READ;
			c->have = 0;
			snprintf(c->peer, sizeof c->peer, "%s:%s", host, port);
			return;
		}
	}
	log_warn("comm_store", "too many clients: connection refused", "peer=%s:%s max=%d", host, port,
		 CLIENTS_MAX);
	close(fd);
}

static void *serve(void *arg)
{
	comm_store_server *s = arg;
	struct pollfd *pf = s->pf;
	int *idx = s->idx;
	for (;;) {
		int n = 0, timeout = -1;
		int64_t now = now_ms();
		pf[n++] = (struct pollfd){.fd = s->wake[0], .events = POLLIN};
		pf[n++] = (struct pollfd){.fd = s->lfd, .events = POLLIN};
		for (int i = 0; i < CLIENTS_MAX; i++) {
			conn *c = &s->conns[i];
			if (c->fd < 0)
				continue;
			if (c->state == CONN_PENDING) {
				if (c->deadline <= now) {
					conn_reply(c, ST_TIMEOUT, NULL, 0);
					conn_flush(c);
					if (c->fd < 0)
						continue;
				} else {
					int64_t left = c->deadline - now;
					if (timeout < 0 || left < timeout)
						timeout = (int)left;
				}
			}
			/* a pending client is watched for hang-up only */
			short ev = c->state == CONN_READ ? POLLIN : c->state == CONN_WRITE ? POLLOUT : POLLRDHUP;
			idx[n] = i;
			pf[n++] = (struct pollfd){.fd = c->fd, .events = ev};
		}
		if (poll(pf, (nfds_t)n, timeout) < 0 && errno != EINTR) {
			log_error("comm_store", "poll failed: the store stops serving", "err=\"%s\"",
				  strerror(errno));
			return NULL;
		}
		if (pf[0].revents)
			return NULL;
		if (pf[1].revents & POLLIN)
			serve_accept(s);
		for (int j = 2; j < n; j++) {
			conn *c = &s->conns[idx[j]];
			if (!pf[j].revents || c->fd != pf[j].fd)
				continue;
			if (c->state == CONN_PENDING) { /* hung up while waiting */
				conn_close(c, NULL);
			} else if (c->state == CONN_WRITE) {
				conn_flush(c);
			} else {
				conn_read(s, c);
			}
		}
	}
}

comm_store_server *comm_store_server_start(const char *host, int port, ds_err *err)
{
	comm_store_server *s = calloc(1, sizeof *s);
	struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
				 .ai_flags = AI_PASSIVE | AI_NUMERICSERV},
			*res = NULL;
	char pstr[16];
	int rc = DS_OK;
	if (!s)
		return ds_err_set(err, DS_ENOMEM, "comm store server: out of memory"), NULL;
	s->lfd = s->wake[0] = s->wake[1] = -1;
	if (!host || !host[0] || port < 0 || port > 65535) {
		rc = ds_err_set(err, DS_EINVAL, "comm store server: address %s:%d is not host:port",
				host ? host : "(null)", port);
		goto out;
	}
	/* everything the thread needs is allocated here, so that it starts
	 * without touching the allocator (a process that forks right after
	 * start, like the tests, never copies a held allocator lock) */
	s->conns = calloc(CLIENTS_MAX, sizeof *s->conns);
	s->tab = calloc(ENTRIES_MAX, sizeof *s->tab);
	s->pf = calloc(CLIENTS_MAX + 2, sizeof *s->pf);
	s->idx = calloc(CLIENTS_MAX + 2, sizeof *s->idx);
	if (!s->conns || !s->tab || !s->pf || !s->idx) {
		rc = ds_err_set(err, DS_ENOMEM, "comm store server: out of memory");
		goto out;
	}
	for (int i = 0; i < CLIENTS_MAX; i++)
		s->conns[i].fd = -1;
	snprintf(pstr, sizeof pstr, "%d", port);
	if (getaddrinfo(host, pstr, &hints, &res) != 0 || !res) {
		rc = ds_err_set(err, DS_EINVAL, "comm store server: cannot resolve %s", host);
		goto out;
	}
	s->lfd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	int one = 1;
	if (s->lfd < 0 || setsockopt(s->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
	    bind(s->lfd, res->ai_addr, res->ai_addrlen) != 0 || listen(s->lfd, 128) != 0) {
		rc = ds_err_set(err, DS_EIO, "comm store server: listen on %s:%d: %s", host, port,
				strerror(errno));
		goto out;
	}
	struct sockaddr_storage ss;
	socklen_t sl = sizeof ss;
	char bound[16] = "?";
	if (getsockname(s->lfd, (struct sockaddr *)&ss, &sl) == 0)
		getnameinfo((struct sockaddr *)&ss, sl, NULL, 0, bound, sizeof bound, NI_NUMERICSERV);
	snprintf(s->addr, sizeof s->addr, "%s:%s", host, bound);
	if (pipe2(s->wake, O_CLOEXEC) != 0) {
		rc = ds_err_set(err, DS_EIO, "comm store server: pipe: %s", strerror(errno));
		goto out;
	}
	if (pthread_create(&s->thread, NULL, serve, s) != 0) {
		rc = ds_err_set(err, DS_EIO, "comm store server: cannot start its thread");
		goto out;
	}
	log_info("comm_store", "serving", "addr=%s", s->addr);
out:
	if (res)
		freeaddrinfo(res);
	if (rc) {
		if (s->wake[0] >= 0) {
			close(s->wake[0]);
			close(s->wake[1]);
		}
		if (s->lfd >= 0)
			close(s->lfd);
		free(s->conns);
		free(s->tab);
		free(s->pf);
		free(s->idx);
		free(s);
		return NULL;
	}
	return s;
}

const char *comm_store_server_addr(const comm_store_server *s)
{
	return s->addr;
}

void comm_store_server_stop(comm_store_server *s)
{
	if (!s)
		return;
	char b = 1;
	while (write(s->wake[1], &b, 1) < 0 && errno == EINTR)
		;
	pthread_join(s->thread, NULL);
	for (int i = 0; i < CLIENTS_MAX; i++)
		if (s->conns[i].fd >= 0)
			close(s->conns[i].fd);
	for (size_t i = 0; i < s->n_tab; i++) {
		free(s->tab[i].key);
		free(s->tab[i].val);
	}
	close(s->wake[0]);
	close(s->wake[1]);
	close(s->lfd);
	free(s->conns);
	free(s->tab);
	free(s->pf);
	free(s->idx);
	free(s);
}

/* ---- client ---- */

typedef struct client {
	int fd; /* -1 once the connection is lost */
	int timeout_ms; /* for connecting and for a SET's reply */
	pthread_mutex_t mu;
	char addr[300];
	unsigned char buf[REQ_HDR + KEY_MAX + COMM_STORE_VALUE_MAX];
} client;

/* Waits for fd to be ready for events until deadline (ms); 0, or
 * DS_ETIMEOUT / DS_EIO. */
static int wait_fd(int fd, short events, int64_t deadline)
{
	for (;;) {
		int64_t left = deadline - now_ms();
		if (left <= 0)
			return DS_ETIMEOUT;
		struct pollfd p = {.fd = fd, .events = events};
		int r = poll(&p, 1, (int)(left > 60000 ? 60000 : left));
		if (r > 0)
			return DS_OK;
		if (r < 0 && errno != EINTR)
			return DS_EIO;
	}
}

static int io_all(client *c, int writing, void *p, size_t n, int64_t deadline, const char *what,
		  ds_err *err)
{
	size_t done = 0;
	while (done < n) {
		int rc = wait_fd(c->fd, writing ? POLLOUT : POLLIN, deadline);
		if (rc == DS_ETIMEOUT)
			return ds_err_set(err, rc, "comm store %s: %s: no answer in time", c->addr, what);
		ssize_t r = rc ? -1
			       : writing ? send(c->fd, (char *)p + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT)
					 : recv(c->fd, (char *)p + done, n - done, MSG_DONTWAIT);
		if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) && !rc)
			continue;
		if (r <= 0)
			return ds_err_set(err, DS_EIO, "comm store %s: %s: %s", c->addr, what,
					  r == 0 ? "the server closed the connection" : strerror(errno));
		done += (size_t)r;
	}
	return DS_OK;
}

/* One exchange: sends the request in c->buf (n bytes), reads the reply's
 * header into *status / *vlen and its value into c->buf. */
static int exchange(client *c, size_t n, int64_t deadline, const char *what, int *status,
		    size_t *vlen, ds_err *err)
{
	unsigned char h[REP_HDR];
	int rc;
	if (c->fd < 0)
		return ds_err_set(err, DS_EIO, "comm store %s: %s: the connection was lost before",
				  c->addr, what);
	if ((rc = io_all(c, 1, c->buf, n, deadline, what, err)) ||
	    (rc = io_all(c, 0, h, REP_HDR, deadline, what, err)))
		goto broken;
	*status = h[1];
	*vlen = get_u32(h + 2);
	if (h[0] != MAGIC_REP || *vlen > COMM_STORE_VALUE_MAX) {
		rc = ds_err_set(err, DS_EFORMAT, "comm store %s: %s: malformed reply (%s)", c->addr, what,
				h[0] != MAGIC_REP ? "bad magic" : "value too long");
		goto broken;
	}
	if ((rc = io_all(c, 0, c->buf, *vlen, deadline, what, err)))
		goto broken;
	return DS_OK;
broken: /* the stream is out of step: nothing more can be read from it */
	close(c->fd);
	c->fd = -1;
	return rc;
}

static int check_key(const client *c, const char *key, const char *call, size_t *klen, ds_err *err)
{
	*klen = key ? strlen(key) : 0;
	if (*klen == 0 || *klen > KEY_MAX)
		return ds_err_set(err, DS_EINVAL, "comm store %s: %s: key must be 1..%d bytes", c->addr,
				  call, KEY_MAX);
	for (size_t i = 0; i < *klen; i++)
		if ((unsigned char)key[i] < 0x21 || (unsigned char)key[i] > 0x7e)
			return ds_err_set(err, DS_EINVAL, "comm store %s: %s: key %s has a byte that is "
							  "not printable ASCII", c->addr, call, key);
	return DS_OK;
}

static int client_set(void *ctx, const char *key, const void *value, size_t len, ds_err *err)
{
	client *c = ctx;
	size_t klen, vlen;
	int status = 0, rc = check_key(c, key, "set", &klen, err);
	char what[KEY_MAX + 16];
	if (rc)
		return rc;
	if (len > COMM_STORE_VALUE_MAX || (len && !value))
		return ds_err_set(err, DS_EINVAL, "comm store %s: set %s: value of %zu bytes (at most %d)",
				  c->addr, key, len, COMM_STORE_VALUE_MAX);
	snprintf(what, sizeof what, "set %s", key);
	pthread_mutex_lock(&c->mu);
	c->buf[0] = MAGIC_REQ;
	c->buf[1] = OP_SET;
	put_u16(c->buf + 2, (uint32_t)klen);
	put_u32(c->buf + 4, (uint32_t)len);
	memcpy(c->buf + REQ_HDR, key, klen);
	if (len)
		memcpy(c->buf + REQ_HDR + klen, value, len);
	rc = exchange(c, REQ_HDR + klen + len, now_ms() + c->timeout_ms, what, &status, &vlen, err);
	pthread_mutex_unlock(&c->mu);
	if (!rc && status != ST_OK)
		rc = ds_err_set(err, DS_ERANGE, "comm store %s: set %s: refused (the store is full)",
				c->addr, key);
	return rc;
}

static int client_get(void *ctx, const char *key, void *value, size_t cap, size_t *len,
		      int timeout_ms, ds_err *err)
{
	client *c = ctx;
	size_t klen, vlen = 0;
	int status = 0, rc = check_key(c, key, "get", &klen, err);
	char what[KEY_MAX + 16];
	if (rc)
		return rc;
	if (timeout_ms < 0)
		timeout_ms = 0;
	snprintf(what, sizeof what, "get %s", key);
	pthread_mutex_lock(&c->mu);
	c->buf[0] = MAGIC_REQ;
	c->buf[1] = OP_GET;
	put_u16(c->buf + 2, (uint32_t)klen);
	put_u32(c->buf + 4, (uint32_t)timeout_ms);
	memcpy(c->buf + REQ_HDR, key, klen);
	/* the server answers at its deadline; allow for the round trip */
	rc = exchange(c, REQ_HDR + klen, now_ms() + timeout_ms + 2000, what, &status, &vlen, err);
	if (!rc && status == ST_OK) {
		*len = vlen;
		if (vlen > cap)
			rc = ds_err_set(err, DS_ERANGE, "comm store %s: get %s: value of %zu bytes, room "
							"for %zu", c->addr, key, vlen, cap);
		else if (vlen)
			memcpy(value, c->buf, vlen);
	}
	pthread_mutex_unlock(&c->mu);
	if (!rc && status != ST_OK)
		rc = ds_err_set(err, DS_ETIMEOUT, "comm store %s: key %s did not appear within %d ms",
				c->addr, key, timeout_ms);
	return rc;
}

int comm_store_tcp_open(comm_store *st, const char *addr, int timeout_ms, ds_err *err)
{
	char host[256], port[16];
	struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
				 .ai_flags = AI_NUMERICSERV},
			*res = NULL;
	client *c = NULL;
	int rc = DS_OK, fd = -1;
	int64_t deadline = now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
	memset(st, 0, sizeof *st);
	if (split_addr(addr, host, sizeof host, port, sizeof port) != 0)
		return ds_err_set(err, DS_EINVAL, "comm store: address \"%s\" is not host:port",
				  addr ? addr : "(null)");
	if (timeout_ms <= 0)
		return ds_err_set(err, DS_EINVAL, "comm store %s: timeout %d ms: it must be positive",
				  addr, timeout_ms);
	if (getaddrinfo(host, port, &hints, &res) != 0 || !res)
		return ds_err_set(err, DS_EINVAL, "comm store %s: cannot resolve %s", addr, host);
	/* the server may not listen yet (a launcher racing its ranks): retry
	 * refused connections until the deadline */
	for (;;) {
		fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		if (fd < 0) {
			rc = ds_err_set(err, DS_EIO, "comm store %s: socket: %s", addr, strerror(errno));
			goto out;
		}
		int r = connect(fd, res->ai_addr, res->ai_addrlen), e = r == 0 ? 0 : errno;
		if (e == EINPROGRESS) {
			if (wait_fd(fd, POLLOUT, deadline) != DS_OK) {
				rc = ds_err_set(err, DS_ETIMEOUT, "comm store %s: connecting: no answer "
								  "within %d ms", addr, timeout_ms);
				goto out;
			}
			socklen_t el = sizeof e;
			getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
		}
		if (!e)
			break;
		close(fd);
		fd = -1;
		if (now_ms() + 50 >= deadline) {
			rc = ds_err_set(err, e == ECONNREFUSED ? DS_ETIMEOUT : DS_EIO,
					"comm store %s: connecting: %s (for %d ms)", addr, strerror(e),
					timeout_ms);
			goto out;
		}
		usleep(50 * 1000);
	}
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	c = calloc(1, sizeof *c);
	if (!c) {
		rc = ds_err_set(err, DS_ENOMEM, "comm store %s: out of memory", addr);
		goto out;
	}
	c->fd = fd;
	fd = -1;
	c->timeout_ms = timeout_ms;
	pthread_mutex_init(&c->mu, NULL);
	ds_strlcpy(c->addr, addr, sizeof c->addr);
	st->ctx = c;
	st->set = client_set;
	st->get = client_get;
out:
	if (fd >= 0)
		close(fd);
	freeaddrinfo(res);
	return rc;
}

void comm_store_tcp_close(comm_store *st)
{
	client *c = st ? st->ctx : NULL;
	if (!c)
		return;
	if (c->fd >= 0)
		close(c->fd);
	pthread_mutex_destroy(&c->mu);
	free(c);
	memset(st, 0, sizeof *st);
}

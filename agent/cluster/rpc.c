/*
 * rpc.c - agent-to-agent HTTP calls and the cluster credential (see rpc.h).
 *
 * Callers: agent/cluster/cluster.c (votes, heartbeats, inventory fetches, forwarding
 * /v1/cluster/nodes to the head) and agent/api/control.c (rpc_auth_verify).
 * Calls: libsodium (BLAKE2b), POSIX sockets and poll.
 *
 * One call goes through these states (each edge is one poll wake-up):
 *
 *   CONNECT --writable, SO_ERROR 0--> SEND --request written--> RECV
 *      |                                |                          |
 *      +------------ error ------------>+-----> DONE <-- EOF, or the whole
 *                                                        Content-Length read
 *
 * Invariants:
 *  1. Every socket is non-blocking and closed before rpc_run returns; sends
 *     use MSG_NOSIGNAL (a peer that closes early cannot raise SIGPIPE).
 *  2. Response bytes are capped at max_body plus RESP_HEAD_MAX of headers.
 *  3. The replay cache remembers every MAC accepted within the last
 *     RPC_SKEW_MS; when it is full the oldest entry is evicted and its time
 *     becomes a floor below which nothing is accepted, so an evicted MAC can
 *     never be replayed.
 *
 * Threading: rpc_run keeps its state on its own stack and heap; rpc_auth's
 * cache is guarded by its mutex.
 */
#include "agent/cluster/rpc.h"
#include "common/hex.h"
#include "common/strutil.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RESP_HEAD_MAX (64 << 10)
static const char CONTEXT[] = "dsagent-control v1";

int64_t rpc_now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- authentication ---- */

struct replay_slot {
	uint8_t mac[16];
	int64_t ts;
	int used;
};

struct rpc_auth {
	int n;
	uint8_t key[RPC_KEYS_MAX][crypto_generichash_BYTES];
	char self_hex[33];
	pthread_mutex_t mu;
	struct replay_slot *ring; /* RPC_REPLAY_SLOTS */
	size_t next;
	int64_t floor_ms;         /* nothing at or below this time is accepted */
};

rpc_auth *rpc_auth_new(const uint8_t keys[][RPC_KEY_LEN], int n_keys, const uint8_t self_id[16],
		       ds_err *err)
{
	if (n_keys < 1 || n_keys > RPC_KEYS_MAX) {
		ds_err_set(err, DS_EINVAL, "rpc: %d cluster keys (1..%d)", n_keys, RPC_KEYS_MAX);
		return NULL;
	}
	if (sodium_init() < 0) {
		ds_err_set(err, DS_EINTERNAL, "libsodium failed to initialise");
		return NULL;
	}
	rpc_auth *a = calloc(1, sizeof *a);
	if (a)
		a->ring = calloc(RPC_REPLAY_SLOTS, sizeof *a->ring);
	if (!a || !a->ring) {
		free(a);
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	a->n = n_keys;
	for (int i = 0; i < n_keys; i++)
		crypto_generichash(a->key[i], sizeof a->key[i], (const unsigned char *)CONTEXT,
				   sizeof CONTEXT - 1, keys[i], RPC_KEY_LEN);
	ds_hex_encode(self_id, 16, a->self_hex);
	pthread_mutex_init(&a->mu, NULL);
	return a;
}

void rpc_auth_free(rpc_auth *a)
{
	if (!a)
		return;
	sodium_memzero(a->key, sizeof a->key);
	pthread_mutex_destroy(&a->mu);
	free(a->ring);
	free(a);
}

static void mac_of(const uint8_t key[crypto_generichash_BYTES], const char *method,
		   const char *path, const char *body, size_t body_len, int64_t ms,
		   const char *nonce, const char *sender, uint8_t out[32])
{
	uint8_t bh[32];
	char bhex[65], head[512];
	crypto_generichash(bh, sizeof bh, (const unsigned char *)(body ? body : ""),
			   body ? body_len : 0, NULL, 0);
	ds_hex_encode(bh, sizeof bh, bhex);
	int n = snprintf(head, sizeof head, "%s\n%s\n%lld\n%s\n%s\n%s", method, path,
			 (long long)ms, nonce, sender, bhex);
	if (n < 0 || (size_t)n >= sizeof head) /* paths are capped well below this */
		n = (int)sizeof head - 1;
	crypto_generichash(out, 32, (const unsigned char *)head, (size_t)n, key,
			   crypto_generichash_BYTES);
}

void rpc_auth_sign(rpc_auth *a, const char *method, const char *path, const char *body,
		   size_t body_len, int64_t now_ms, char out[RPC_AUTH_MAX])
{
	uint8_t mac[32], nb[8];
	char mhex[65], nonce[17];
	randombytes_buf(nb, sizeof nb);
	ds_hex_encode(nb, sizeof nb, nonce);
	mac_of(a->key[0], method, path, body, body_len, now_ms, nonce, a->self_hex, mac);
	ds_hex_encode(mac, sizeof mac, mhex);
	snprintf(out, RPC_AUTH_MAX, "DSCluster %s.%lld.%s.%s", a->self_hex, (long long)now_ms,
		 nonce, mhex);
}

int rpc_auth_is_cluster(const char *header)
{
	return header && strncasecmp(header, "DSCluster ", 10) == 0;
}

/* 2n lower-case hex digits of s into out[n]; 0 or -1.  Upper case is
 * refused: the sender's id text is compared as text later. */
static int unhex(const char *s, size_t n, uint8_t *out)
{
	for (size_t i = 0; i < 2 * n; i++)
		if (s[i] >= 'A' && s[i] <= 'F')
			return -1;
	return ds_hex_decode(s, n, out);
}

/* The parts of a DSCluster value. */
struct cred {
	uint8_t mac[32];
	int64_t ms;
	char idhex[33], nonce[17];
};

/* Parses a DSCluster value and checks its time against now_ms: DS_OK, or
 * DS_EAUTH with a message naming what is wrong. */
static int cred_parse(const char *header, int64_t now_ms, struct cred *c, ds_err *err)
{
	uint8_t idb[16], nb[8];
	char mstext[24];
	if (!rpc_auth_is_cluster(header))
		return ds_err_set(err, DS_EAUTH, "no cluster credential (Authorization: DSCluster ...)");
	const char *p = header + 10;
	const char *d1 = strchr(p, '.'), *d2 = d1 ? strchr(d1 + 1, '.') : NULL;
	const char *d3 = d2 ? strchr(d2 + 1, '.') : NULL;
	if (!d1 || !d2 || !d3 || d1 - p != 32 || d2 - d1 - 1 < 1 ||
	    d2 - d1 - 1 >= (long)sizeof mstext || d3 - d2 - 1 != 16 || strlen(d3 + 1) != 64 ||
	    unhex(p, 16, idb) || unhex(d2 + 1, 8, nb) || unhex(d3 + 1, 32, c->mac))
		return ds_err_set(err, DS_EAUTH, "malformed cluster credential");
	memcpy(c->nonce, d2 + 1, 16);
	c->nonce[16] = '\0';
	memcpy(c->idhex, p, 32);
	c->idhex[32] = '\0';
	memcpy(mstext, d1 + 1, (size_t)(d2 - d1 - 1));
	mstext[d2 - d1 - 1] = '\0';
	if (ds_parse_i64(mstext, 0, INT64_MAX / 2, &c->ms) != DS_OK)
		return ds_err_set(err, DS_EAUTH, "malformed cluster credential time");
	if (c->ms < now_ms - RPC_SKEW_MS || c->ms > now_ms + RPC_SKEW_MS)
		return ds_err_set(err, DS_EAUTH,
				  "cluster credential time is %lld ms off this node's clock "
				  "(more than %d ms: are the clocks synchronised?)",
				  (long long)(c->ms - now_ms), RPC_SKEW_MS);
	return DS_OK;
}

int rpc_auth_check_header(const char *header, int64_t now_ms, ds_err *err)
{
	struct cred c;
	return cred_parse(header, now_ms, &c, err);
}

int rpc_auth_verify(rpc_auth *a, const char *method, const char *path, const char *body,
		    size_t body_len, const char *header, int64_t now_ms, char sender[33],
		    ds_err *err)
{
	uint8_t want[32];
	struct cred c;
	sender[0] = '\0';
	int rc = cred_parse(header, now_ms, &c, err);
	if (rc != DS_OK)
		return rc;
	const uint8_t *got = c.mac;
	const char *idhex = c.idhex, *nonce = c.nonce;
	int64_t ms = c.ms;
	int ok = 0;
	for (int i = 0; i < a->n; i++) {
		mac_of(a->key[i], method, path, body, body_len, ms, nonce, idhex, want);
		ok |= sodium_memcmp(want, got, sizeof want) == 0;
	}
	if (!ok)
		return ds_err_set(err, DS_EAUTH,
				  "cluster credential does not verify (another cluster key?)");
	pthread_mutex_lock(&a->mu);
	if (ms <= a->floor_ms) {
		rc = ds_err_set(err, DS_EAUTH, "cluster credential older than the replay window");
		goto out;
	}
	for (size_t i = 0; i < RPC_REPLAY_SLOTS; i++) {
		struct replay_slot *r = &a->ring[i];
		if (r->used && r->ts == ms && memcmp(r->mac, got, sizeof r->mac) == 0) {
			rc = ds_err_set(err, DS_EAUTH, "replayed cluster request");
			goto out;
		}
	}
	struct replay_slot *slot = &a->ring[a->next];
	/* Only an entry still inside the window raises the floor when evicted. */
	if (slot->used && slot->ts > a->floor_ms && slot->ts >= now_ms - RPC_SKEW_MS)
		a->floor_ms = slot->ts;
	memcpy(slot->mac, got, sizeof slot->mac);
	slot->ts = ms;
	slot->used = 1;
	a->next = (a->next + 1) % RPC_REPLAY_SLOTS;
	memcpy(sender, idhex, 33);
out:
	pthread_mutex_unlock(&a->mu);
	return rc;
}

/* ---- calls ---- */

int rpc_call_init(rpc_call *c, const char *host, int port, const char *method,
		  const char *path, const char *body, size_t body_len)
{
	struct in_addr ia;
	memset(c, 0, sizeof *c);
	buf_init(&c->resp, 0);
	if (!host || inet_pton(AF_INET, host, &ia) != 1 || port < 1 || port > 65535 ||
	    ds_strlcpy(c->host, host, sizeof c->host) >= sizeof c->host ||
	    ds_strlcpy(c->method, method, sizeof c->method) >= sizeof c->method ||
	    ds_strlcpy(c->path, path, sizeof c->path) >= sizeof c->path || path[0] != '/') {
		c->rc = DS_EINVAL;
		c->port = 0; /* rpc_run leaves it alone */
		snprintf(c->err, sizeof c->err, "bad call target %s:%d %s", host ? host : "(none)",
			 port, path ? path : "");
		return DS_EINVAL;
	}
	c->port = port;
	c->body = body;
	c->body_len = body ? body_len : 0;
	c->rc = DS_EINTERNAL; /* until rpc_run */
	return DS_OK;
}

void rpc_call_free(rpc_call *c)
{
	if (c)
		buf_free(&c->resp);
}

enum { ST_CONNECT, ST_SEND, ST_RECV, ST_DONE };

struct conn {
	int fd;
	int st;
	buf out;      /* request bytes */
	size_t sent;
	buf in;       /* response bytes */
};

static void fail(rpc_call *c, struct conn *k, int rc, const char *what, int e)
{
	c->rc = rc;
	if (e)
		snprintf(c->err, sizeof c->err, "%s %s:%d: %s", what, c->host, c->port, strerror(e));
	else
		snprintf(c->err, sizeof c->err, "%s %s:%d", what, c->host, c->port);
	k->st = ST_DONE;
}

/* Parses k->in into c; 1 when the response is complete, 0 when more bytes
 * are needed (only when !eof), and marks c done either way when complete or
 * malformed. */
static int parse_resp(rpc_call *c, struct conn *k, int eof, size_t max_body)
{
	const char *d = k->in.data ? k->in.data : "";
	const char *end = strstr(d, "\r\n\r\n");
	if (!end) {
		if (eof || k->in.len > RESP_HEAD_MAX) {
			fail(c, k, DS_EFORMAT, eof ? "truncated HTTP response from" :
						     "HTTP headers too long from", 0);
			return 1;
		}
		return 0;
	}
	int status = 0;
	if (sscanf(d, "HTTP/1.%*d %d", &status) != 1 || status < 100 || status > 599) {
		fail(c, k, DS_EFORMAT, "not an HTTP response from", 0);
		return 1;
	}
	int64_t clen = -1;
	for (const char *h = strstr(d, "\r\n"); h && h < end; h = strstr(h + 2, "\r\n")) {
		const char *line = h + 2;
		if (strncasecmp(line, "Content-Length:", 15) == 0) {
			char num[24];
			size_t i = 0;
			const char *v = line + 15;
			while (*v == ' ')
				v++;
			while (i + 1 < sizeof num && v[i] >= '0' && v[i] <= '9') {
				num[i] = v[i];
				i++;
			}
			num[i] = '\0';
			if (ds_parse_i64(num, 0, INT64_MAX, &clen) != DS_OK) {
				fail(c, k, DS_EFORMAT, "bad Content-Length from", 0);
				return 1;
			}
		} else if (strncasecmp(line, "Transfer-Encoding:", 18) == 0 &&
			   strstr(line, "chunked") && strstr(line, "chunked") < strstr(line, "\r\n")) {
			fail(c, k, DS_EFORMAT, "chunked response (not expected) from", 0);
			return 1;
		}
	}
	const char *body = end + 4;
	size_t have = k->in.len - (size_t)(body - d);
	if (clen >= 0 && (size_t)clen > max_body) {
		fail(c, k, DS_ERANGE, "response body over the limit from", 0);
		return 1;
	}
	if (clen >= 0 && have < (size_t)clen) {
		if (eof) {
			fail(c, k, DS_EIO, "response cut short by", 0);
			return 1;
		}
		return 0;
	}
	if (clen < 0 && !eof)
		return 0;
	size_t n = clen >= 0 ? (size_t)clen : have;
	buf_clear(&c->resp);
	if (buf_append(&c->resp, body, n) != DS_OK) {
		fail(c, k, DS_ERANGE, "response body over the limit from", 0);
		return 1;
	}
	c->status = status;
	c->rc = DS_OK;
	k->st = ST_DONE;
	return 1;
}

static void start(rpc_call *c, struct conn *k, rpc_auth *auth, size_t max_body)
{
	char authz[RPC_AUTH_MAX] = "";
	struct sockaddr_in sa = {0};
	k->fd = -1;
	buf_init(&k->out, 0);
	buf_init(&k->in, max_body + RESP_HEAD_MAX);
	c->resp.max = max_body + 1;
	if (c->port == 0) { /* rpc_call_init refused it: rc stays DS_EINVAL */
		k->st = ST_DONE;
		return;
	}
	if (auth)
		rpc_auth_sign(auth, c->method, c->path, c->body, c->body_len, rpc_now_ms(), authz);
	if (buf_printf(&k->out,
		       "%s %s HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n"
		       "Accept: application/json\r\n%s%s%s",
		       c->method, c->path, c->host, c->port, authz[0] ? "Authorization: " : "",
		       authz, authz[0] ? "\r\n" : "") != DS_OK ||
	    (c->body ? buf_printf(&k->out,
				  "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
				  c->body_len)
		     : buf_puts(&k->out, "Content-Length: 0\r\n\r\n")) != DS_OK ||
	    (c->body && buf_append(&k->out, c->body, c->body_len) != DS_OK)) {
		fail(c, k, DS_ENOMEM, "out of memory calling", 0);
		return;
	}
	sa.sin_family = AF_INET;
	sa.sin_port = htons((uint16_t)c->port);
	inet_pton(AF_INET, c->host, &sa.sin_addr);
	k->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (k->fd < 0) {
		fail(c, k, DS_EIO, "socket for", errno);
		return;
	}
	int one = 1;
	setsockopt(k->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	if (connect(k->fd, (struct sockaddr *)&sa, sizeof sa) == 0)
		k->st = ST_SEND;
	else if (errno == EINPROGRESS)
		k->st = ST_CONNECT;
	else
		fail(c, k, DS_EIO, "cannot connect to", errno);
}

static void step(rpc_call *c, struct conn *k, short revents, size_t max_body)
{
	if (k->st == ST_CONNECT) {
		int e = 0;
		socklen_t len = sizeof e;
		if (getsockopt(k->fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0)
			e = errno;
		if (e) {
			fail(c, k, DS_EIO, "cannot connect to", e);
			return;
		}
		k->st = ST_SEND;
	}
	if (k->st == ST_SEND) {
		while (k->sent < k->out.len) {
			ssize_t w = send(k->fd, k->out.data + k->sent, k->out.len - k->sent,
					 MSG_NOSIGNAL);
			if (w < 0) {
				if (errno == EAGAIN || errno == EWOULDBLOCK)
					return;
				if (errno == EINTR)
					continue;
				fail(c, k, DS_EIO, "cannot send to", errno);
				return;
			}
			k->sent += (size_t)w;
		}
		k->st = ST_RECV;
		return;
	}
	if (k->st == ST_RECV && (revents & (POLLIN | POLLHUP | POLLERR))) {
		char tmp[16384];
		for (;;) {
			ssize_t r = recv(k->fd, tmp, sizeof tmp, 0);
			if (r < 0) {
				if (errno == EAGAIN || errno == EWOULDBLOCK)
					break;
				if (errno == EINTR)
					continue;
				fail(c, k, DS_EIO, "cannot receive from", errno);
				return;
			}
			if (r == 0) {
				parse_resp(c, k, 1, max_body);
				return;
			}
			if (buf_append(&k->in, tmp, (size_t)r) != DS_OK) {
				fail(c, k, DS_ERANGE, "response over the limit from", 0);
				return;
			}
		}
		parse_resp(c, k, 0, max_body);
	}
}

size_t rpc_run(rpc_call *calls, size_t n, rpc_auth *auth, int timeout_ms, size_t max_body)
{
	if (n == 0)
		return 0;
	struct conn *k = calloc(n, sizeof *k);
	struct pollfd *pf = calloc(n, sizeof *pf);
	size_t *idx = calloc(n, sizeof *idx);
	size_t ok = 0;
	if (!k || !pf || !idx) {
		for (size_t i = 0; i < n; i++) {
			calls[i].rc = DS_ENOMEM;
			snprintf(calls[i].err, sizeof calls[i].err, "out of memory");
		}
		free(k);
		free(pf);
		free(idx);
		return 0;
	}
	for (size_t i = 0; i < n; i++)
		start(&calls[i], &k[i], auth, max_body);
	double deadline = ds_now_s() + timeout_ms / 1000.0;
	for (;;) {
		size_t np = 0;
		for (size_t i = 0; i < n; i++) {
			if (k[i].st == ST_DONE)
				continue;
			pf[np].fd = k[i].fd;
			pf[np].events = k[i].st == ST_RECV ? POLLIN : POLLOUT;
			pf[np].revents = 0;
			idx[np++] = i;
		}
		if (np == 0)
			break;
		double left = deadline - ds_now_s();
		if (left <= 0) {
			for (size_t j = 0; j < np; j++)
				fail(&calls[idx[j]], &k[idx[j]], DS_ETIMEOUT, "no answer in time from", 0);
			break;
		}
		int pr = poll(pf, (nfds_t)np, (int)(left * 1000) + 1);
		if (pr < 0 && errno != EINTR) {
			for (size_t j = 0; j < np; j++)
				fail(&calls[idx[j]], &k[idx[j]], DS_EIO, "poll while calling", errno);
			break;
		}
		for (size_t j = 0; pr > 0 && j < np; j++)
			if (pf[j].revents)
				step(&calls[idx[j]], &k[idx[j]], pf[j].revents, max_body);
	}
	for (size_t i = 0; i < n; i++)
		ok += calls[i].rc == DS_OK;
	for (size_t i = 0; i < n; i++) {
		if (k[i].fd >= 0)
			close(k[i].fd);
		buf_free(&k[i].out);
		buf_free(&k[i].in);
	}
	free(k);
	free(pf);
	free(idx);
	return ok;
}

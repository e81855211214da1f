/*
 * test_rpc.c - agent/cluster/rpc: the cluster credential (sign, verify, every kind
 * of tampering, clock skew, replay, key rotation) and rpc_run against real
 * sockets: an agent HTTP server (agent/api/http.c) answering in parallel, a
 * closed port, and a listener that never answers.
 */
#include "agent/api/http.h"
#include "agent/cluster/rpc.h"
#include "common/strutil.h"
#include "tests/unit/unit.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void rand_bytes(uint8_t *b, size_t n)
{
	for (size_t i = 0; i < n; i++)
		b[i] = (uint8_t)ut_rand_u64();
}

TEST(rpc_auth_sign_verify_and_tampering)
{
	uint8_t keys[2][RPC_KEY_LEN], other[1][RPC_KEY_LEN], id[16], id2[16];
	rand_bytes(&keys[0][0], sizeof keys);
	rand_bytes(&other[0][0], sizeof other);
	rand_bytes(id, sizeof id);
	rand_bytes(id2, sizeof id2);
	rpc_auth *a = rpc_auth_new((const uint8_t(*)[RPC_KEY_LEN])keys, 2, id, NULL);
	rpc_auth *b = rpc_auth_new((const uint8_t(*)[RPC_KEY_LEN])keys, 1, id2, NULL);
	rpc_auth *x = rpc_auth_new((const uint8_t(*)[RPC_KEY_LEN])other, 1, id2, NULL);
	/* the second key of a's keyring signs c's requests: rotation */
	rpc_auth *c = rpc_auth_new((const uint8_t(*)[RPC_KEY_LEN])&keys[1], 1, id2, NULL);
	CHECK(a && b && x && c);
	if (!a || !b || !x || !c)
		goto out;
	char h[RPC_AUTH_MAX], sender[33], idhex[33];
	const char *body = "{\"kind\":\"vote\",\"epoch\":3}";
	int64_t now = rpc_now_ms();
	snprintf(idhex, sizeof idhex, "%s", "");
	for (int i = 0; i < 16; i++)
		snprintf(idhex + 2 * i, 3, "%02x", id2[i]);
	ds_err e = {0};
	rpc_auth_sign(b, "POST", "/v1/cluster/election", body, strlen(body), now, h);
	CHECK(rpc_auth_is_cluster(h));
	CHECK_EQ(rpc_auth_verify(a, "POST", "/v1/cluster/election", body, strlen(body), h, now,
				 sender, &e), DS_OK);
	CHECK_STR(sender, idhex);
	/* the same request again is a replay */
	CHECK_EQ(rpc_auth_verify(a, "POST", "/v1/cluster/election", body, strlen(body), h, now,
				 sender, &e), DS_EAUTH);
	CHECK(strstr(e.msg, "replayed") != NULL);
	/* each part of the request is covered by the MAC */
	rpc_auth_sign(b, "POST", "/v1/cluster/election", body, strlen(body), now, h);
	CHECK_EQ(rpc_auth_verify(a, "GET", "/v1/cluster/election", body, strlen(body), h, now,
				 sender, &e), DS_EAUTH);
	CHECK_EQ(rpc_auth_verify(a, "POST", "/v1/cluster/electioN", body, strlen(body), h, now,
				 sender, &e), DS_EAUTH);
	CHECK_EQ(rpc_auth_verify(a, "POST", "/v1/cluster/election", body, strlen(body) - 1, h, now,
				 sender, &e), DS_EAUTH);
	for (int k = 0; k < 20; k++) { /* one hex digit changed anywhere after the scheme */
		char t[RPC_AUTH_MAX];
		memcpy(t, h, sizeof t);
		size_t pos = 10 + ut_rand_u64() % (strlen(h) - 10);
		if (t[pos] == '.')
			continue;
		t[pos] = t[pos] == '0' ? '1' : '0';
		CHECK_EQ(rpc_auth_verify(a, "POST", "/v1/cluster/election", body, strlen(body), t,
					 now, sender, &e), DS_EAUTH);
	}
	CHECK_EQ(rpc_auth_verify(a, "POST", "/v1/cluster/election", body, strlen(body), h, now,
				 sender, &e), DS_OK);
	/* clock skew beyond 30 s either way */
	rpc_auth_sign(b, "GET", "/v1/node", NULL, 0, now - RPC_SKEW_MS - 1000, h);
	CHECK_EQ(rpc_auth_verify(a, "GET", "/v1/node", NULL, 0, h, now, sender, &e), DS_EAUTH);
	CHECK(strstr(e.msg, "clock") != NULL);
	rpc_auth_sign(b, "GET", "/v1/node", NULL, 0, now + RPC_SKEW_MS + 1000, h);
	CHECK_EQ(rpc_auth_verify(a, "GET", "/v1/node", NULL, 0, h, now, sender, &e), DS_EAUTH);
	/* another cluster key; a rotated one; garbage */
	rpc_auth_sign(x, "GET", "/v1/node", NULL, 0, now, h);
	CHECK_EQ(rpc_auth_verify(a, "GET", "/v1/node", NULL, 0, h, now, sender, &e), DS_EAUTH);
	CHECK(strstr(e.msg, "another cluster key") != NULL);
	rpc_auth_sign(c, "GET", "/v1/node", NULL, 0, now, h);
	CHECK_EQ(rpc_auth_verify(a, "GET", "/v1/node", NULL, 0, h, now, sender, &e), DS_OK);
	CHECK_EQ(rpc_auth_verify(b, "GET", "/v1/node", NULL, 0, h, now + 1, sender, &e), DS_EAUTH);
	static const char *junk[] = {NULL, "", "Bearer abc", "DSCluster ", "DSCluster a.b.c.d",
				     "DSCluster 00000000000000000000000000000000.1.0000000000000000.00"};
	for (size_t i = 0; i < sizeof junk / sizeof junk[0]; i++)
		CHECK_EQ(rpc_auth_verify(a, "GET", "/v1/node", NULL, 0, junk[i], now, sender, &e),
			 DS_EAUTH);
	/* two identical requests in one millisecond are two requests (nonce) */
	char h1[RPC_AUTH_MAX], h2[RPC_AUTH_MAX];
	rpc_auth_sign(b, "GET", "/v1/node", NULL, 0, now + 5, h1);
	rpc_auth_sign(b, "GET", "/v1/node", NULL, 0, now + 5, h2);
	CHECK(strcmp(h1, h2) != 0);
	CHECK_EQ(rpc_auth_verify(a, "GET", "/v1/node", NULL, 0, h1, now, sender, &e), DS_OK);
	CHECK_EQ(rpc_auth_verify(a, "GET", "/v1/node", NULL, 0, h2, now, sender, &e), DS_OK);
out:
	rpc_auth_free(a);
	rpc_auth_free(b);
	rpc_auth_free(x);
	rpc_auth_free(c);
}

/* The header-only check the control API runs before reading a body: form
 * and time, and nothing that needs the body or a key. */
TEST(rpc_auth_check_header_form_and_time)
{
	uint8_t key[1][RPC_KEY_LEN], id[16];
	rand_bytes(&key[0][0], sizeof key);
	rand_bytes(id, sizeof id);
	rpc_auth *a = rpc_auth_new((const uint8_t(*)[RPC_KEY_LEN])key, 1, id, NULL);
	CHECK(a != NULL);
	if (!a)
		return;
	char h[RPC_AUTH_MAX];
	int64_t now = rpc_now_ms();
	ds_err e = {0};
	rpc_auth_sign(a, "POST", "/v1/ranks", "{}", 2, now, h);
	CHECK_EQ(rpc_auth_check_header(h, now, &e), DS_OK);
	CHECK_EQ(rpc_auth_check_header(h, now + RPC_SKEW_MS + 1000, &e), DS_EAUTH);
	CHECK(strstr(e.msg, "clock") != NULL);
	h[strlen(h) - 1] = h[strlen(h) - 1] == '0' ? '1' : '0'; /* a wrong MAC passes here */
	CHECK_EQ(rpc_auth_check_header(h, now, &e), DS_OK);
	static const char *junk[] = {NULL, "", "Bearer abc", "DSCluster ", "DSCluster a.b.c.d",
				     "DSCluster 00000000000000000000000000000000.1.0000000000000000.00"};
	for (size_t i = 0; i < sizeof junk / sizeof junk[0]; i++)
		CHECK_EQ(rpc_auth_check_header(junk[i], now, &e), DS_EAUTH);
	rpc_auth_free(a);
}

/* ---- rpc_run against real sockets ---- */

struct srv_ctx {
	rpc_auth *auth;
};

static void echo(void *ud, const http_req *req, http_resp *resp)
{
	struct srv_ctx *c = ud;
	char sender[33];
	ds_err e = {0};
	const char *h = http_req_header(req, "Authorization");
	if (rpc_auth_verify(c->auth, req->method, req->path, req->body, req->body_len, h,
			    rpc_now_ms(), sender, &e) != DS_OK) {
		http_resp_error(resp, 401, "authentication_error", NULL, "%s", e.msg);
		return;
	}
	char *out = malloc(req->body_len + 64);
	if (!out)
		return;
	snprintf(out, req->body_len + 64, "{\"path\":\"%s\",\"len\":%zu}", req->path, req->body_len);
	http_resp_json(resp, 200, out);
}

static const http_route echo_routes[] = {
	{"POST", "/echo/*", echo},
	{"GET", "/echo/*", echo},
	{0},
};

TEST(rpc_run_parallel_refused_and_silent_peers)
{
	uint8_t key[1][RPC_KEY_LEN], id[16];
	rand_bytes(&key[0][0], sizeof key);
	rand_bytes(id, sizeof id);
	rpc_auth *auth = rpc_auth_new((const uint8_t(*)[RPC_KEY_LEN])key, 1, id, NULL);
	struct srv_ctx ctx = {auth};
	http_params hp = http_default_params();
	hp.bind_addr = "127.0.0.1";
	hp.port = 0;
	hp.routes = echo_routes;
	hp.ud = &ctx;
	ds_err e = {0};
	http_server *srv = http_server_new(&hp, &e);
	CHECK(srv != NULL);
	/* a port that refuses, and a listener that never accepts or answers */
	int closed = socket(AF_INET, SOCK_STREAM, 0), silent = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {0};
	socklen_t sl = sizeof sa;
	sa.sin_family = AF_INET;
	sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	CHECK_EQ(bind(closed, (struct sockaddr *)&sa, sizeof sa), 0);
	getsockname(closed, (struct sockaddr *)&sa, &sl);
	int closed_port = ntohs(sa.sin_port);
	close(closed); /* nothing listens there now */
	sa.sin_port = 0;
	CHECK_EQ(bind(silent, (struct sockaddr *)&sa, sizeof sa), 0);
	CHECK_EQ(listen(silent, 4), 0);
	sl = sizeof sa;
	getsockname(silent, (struct sockaddr *)&sa, &sl);
	int silent_port = ntohs(sa.sin_port);
	if (!srv || !auth)
		goto out;
	enum { N = 8 };
	rpc_call calls[N + 3];
	char bodies[N][600];
	for (int i = 0; i < N; i++) {
		int len = (int)(ut_rand_u64() % 500);
		memset(bodies[i], 'x', (size_t)len);
		bodies[i][len] = '\0';
		char path[64];
		snprintf(path, sizeof path, "/echo/%d", i);
		CHECK_EQ(rpc_call_init(&calls[i], "127.0.0.1", http_server_port(srv),
				       i % 2 ? "POST" : "GET", path, i % 2 ? bodies[i] : NULL,
				       strlen(bodies[i])), DS_OK);
	}
	CHECK_EQ(rpc_call_init(&calls[N], "127.0.0.1", closed_port, "GET", "/", NULL, 0), DS_OK);
	CHECK_EQ(rpc_call_init(&calls[N + 1], "127.0.0.1", silent_port, "GET", "/", NULL, 0), DS_OK);
	CHECK_EQ(rpc_call_init(&calls[N + 2], "localhost", 80, "GET", "/", NULL, 0), DS_EINVAL);
	double t0 = ds_now_s();
	size_t ok = rpc_run(calls, N + 3, auth, 400, 1 << 20);
	double took = ds_now_s() - t0;
	CHECK_EQ(ok, N);
	for (int i = 0; i < N; i++) {
		CHECK_EQ(calls[i].rc, DS_OK);
		CHECK_EQ(calls[i].status, 200);
		char want[128];
		snprintf(want, sizeof want, "{\"path\":\"/echo/%d\",\"len\":%zu}", i,
			 i % 2 ? strlen(bodies[i]) : (size_t)0);
		CHECK_STR(calls[i].resp.data, want);
	}
	CHECK_EQ(calls[N].rc, DS_EIO);
	CHECK(strstr(calls[N].err, "cannot connect") != NULL);
	CHECK_EQ(calls[N + 1].rc, DS_ETIMEOUT);
	CHECK_EQ(calls[N + 2].rc, DS_EINVAL);
	/* the silent peer costs the timeout once, not per call */
	CHECK(took >= 0.35 && took < 1.5);
	/* a response over the cap */
	rpc_call big;
	CHECK_EQ(rpc_call_init(&big, "127.0.0.1", http_server_port(srv), "GET", "/echo/1", NULL, 0),
		 DS_OK);
	rpc_run(&big, 1, auth, 2000, 8);
	CHECK_EQ(big.rc, DS_ERANGE);
	rpc_call_free(&big);
	/* unsigned: the server's check refuses it (401 is still an HTTP answer) */
	rpc_call un;
	CHECK_EQ(rpc_call_init(&un, "127.0.0.1", http_server_port(srv), "GET", "/echo/1", NULL, 0),
		 DS_OK);
	rpc_run(&un, 1, NULL, 2000, 1 << 20);
	CHECK_EQ(un.rc, DS_OK);
	CHECK_EQ(un.status, 401);
	rpc_call_free(&un);
	for (int i = 0; i < N + 3; i++)
		rpc_call_free(&calls[i]);
out:
	close(silent);
	http_server_free(srv);
	rpc_auth_free(auth);
}

/*
 * test_comm_store.c - the TCP rendezvous store (comm/comm_store_tcp.c): a
 * real server on loopback, real clients.
 *
 * What is checked: set/get round trips and replacement, a get that waits
 * for a later set while other clients go on being served, the timeout
 * naming the key, a value larger than the caller's room (DS_ERANGE), and
 * that garbage or oversized frames on one connection close that connection
 * only.
 */
#include "comm/comm.h"
#include "common/strutil.h"
#include "tests/unit/unit.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static comm_store_server *start_server(void)
{
	ds_err err = {0};
	comm_store_server *s = comm_store_server_start("127.0.0.1", 0, &err);
	if (!s)
		ut_fail(__FILE__, __LINE__, "server start: %s", err.msg);
	return s;
}

static int open_client(comm_store *st, comm_store_server *s)
{
	ds_err err = {0};
	int rc = comm_store_tcp_open(st, comm_store_server_addr(s), 2000, &err);
	if (rc)
		ut_fail(__FILE__, __LINE__, "open %s: %s", comm_store_server_addr(s), err.msg);
	return rc;
}

TEST(comm_store_set_get_replace)
{
	comm_store_server *s = start_server();
	comm_store a = {0}, b = {0};
	if (!s || open_client(&a, s) || open_client(&b, s))
		goto out;
	ds_err err = {0};
	unsigned char val[COMM_STORE_VALUE_MAX], got[COMM_STORE_VALUE_MAX];
	for (size_t i = 0; i < sizeof val; i++)
		val[i] = (unsigned char)(1 + ut_rand_u64() % 255);
	size_t len = 0;
	CHECK_EQ(a.set(a.ctx, "job/g/0/addr", val, sizeof val, &err), 0);
	CHECK_EQ(b.get(b.ctx, "job/g/0/addr", got, sizeof got, &len, 1000, &err), 0);
	CHECK_EQ(len, sizeof val);
	CHECK(memcmp(got, val, sizeof val) == 0);
	/* replace with a shorter value; an empty value is a value */
	CHECK_EQ(b.set(b.ctx, "job/g/0/addr", "xyz", 3, &err), 0);
	CHECK_EQ(a.get(a.ctx, "job/g/0/addr", got, sizeof got, &len, 1000, &err), 0);
	CHECK_EQ(len, 3);
	CHECK(memcmp(got, "xyz", 3) == 0);
	CHECK_EQ(a.set(a.ctx, "empty", NULL, 0, &err), 0);
	CHECK_EQ(b.get(b.ctx, "empty", got, sizeof got, &len, 1000, &err), 0);
	CHECK_EQ(len, 0);
	/* too small a room: DS_ERANGE with the size */
	CHECK_EQ(a.get(a.ctx, "job/g/0/addr", got, 2, &len, 1000, &err), DS_ERANGE);
	CHECK_EQ(len, 3);
	/* the connection stays usable after DS_ERANGE */
	CHECK_EQ(a.get(a.ctx, "job/g/0/addr", got, sizeof got, &len, 1000, &err), 0);
	/* bad arguments are refused by the client */
	CHECK_EQ(a.set(a.ctx, "", "x", 1, &err), DS_EINVAL);
	CHECK_EQ(a.set(a.ctx, "has space", "x", 1, &err), DS_EINVAL);
	CHECK_EQ(a.set(a.ctx, "k", val, COMM_STORE_VALUE_MAX + 1, &err), DS_EINVAL);
out:
	comm_store_tcp_close(&a);
	comm_store_tcp_close(&b);
	comm_store_server_stop(s);
}

TEST(comm_store_get_times_out_naming_the_key)
{
	comm_store_server *s = start_server();
	comm_store a = {0};
	if (!s || open_client(&a, s))
		goto out;
	ds_err err = {0};
	char got[16];
	size_t len;
	uint64_t t0 = ds_now_ns();
	CHECK_EQ(a.get(a.ctx, "job/g/3/ready", got, sizeof got, &len, 200, &err), DS_ETIMEOUT);
	double ms = (double)(ds_now_ns() - t0) / 1e6;
	CHECK(ms >= 190 && ms < 1500);
	CHECK(strstr(err.msg, "job/g/3/ready") != NULL);
	/* the connection is still good */
	CHECK_EQ(a.set(a.ctx, "k", "v", 1, &err), 0);
out:
	comm_store_tcp_close(&a);
	comm_store_server_stop(s);
}

typedef struct waiter {
	comm_store st;
	int rc;
	char got[16];
	size_t len;
} waiter;

static void *wait_key(void *arg)
{
	waiter *w = arg;
	ds_err err = {0};
	w->rc = w->st.get(w->st.ctx, "late", w->got, sizeof w->got, &w->len, 3000, &err);
	return NULL;
}

/* Eight clients wait for one key; meanwhile another client is served at
 * once; a set wakes them all. */
TEST(comm_store_waiting_gets_do_not_block_others)
{
	enum { N = 8 };
	comm_store_server *s = start_server();
	waiter w[N];
	pthread_t th[N];
	int started = 0;
	comm_store a = {0};
	memset(w, 0, sizeof w);
	if (!s || open_client(&a, s))
		goto out;
	for (; started < N; started++) {
		if (open_client(&w[started].st, s))
			goto out;
		pthread_create(&th[started], NULL, wait_key, &w[started]);
	}
	usleep(100 * 1000);
	ds_err err = {0};
	char got[16];
	size_t len;
	uint64_t t0 = ds_now_ns();
	CHECK_EQ(a.set(a.ctx, "other", "1", 1, &err), 0);
	CHECK_EQ(a.get(a.ctx, "other", got, sizeof got, &len, 1000, &err), 0);
	CHECK((ds_now_ns() - t0) / 1000000u < 500);
	CHECK_EQ(a.set(a.ctx, "late", "hello", 5, &err), 0);
out:
	for (int i = 0; i < started; i++) {
		pthread_join(th[i], NULL);
		CHECK_EQ(w[i].rc, 0);
		CHECK_EQ(w[i].len, 5);
		CHECK(memcmp(w[i].got, "hello", 5) == 0);
	}
	for (int i = 0; i < N; i++)
		comm_store_tcp_close(&w[i].st);
	comm_store_tcp_close(&a);
	comm_store_server_stop(s);
}

/* A raw connection to the server; -1 on failure. */
static int raw_connect(comm_store_server *s)
{
	const char *addr = comm_store_server_addr(s);
	const char *colon = strrchr(addr, ':');
	int port = 0;
	if (!colon || ds_parse_int(colon + 1, 1, 65535, &port) != 0)
		return -1;
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
	inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
		close(fd);
		fd = -1;
	}
	return fd;
}

/* 1 when the server closed fd (read returns 0 or an error within 2 s). */
static int closed_by_server(int fd)
{
	struct timeval tv = {.tv_sec = 2};
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	char b[64];
	ssize_t r;
	while ((r = recv(fd, b, sizeof b, 0)) > 0)
		;
	return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

TEST(comm_store_garbage_closes_only_that_client)
{
	comm_store_server *s = start_server();
	comm_store a = {0};
	if (!s || open_client(&a, s))
		goto out;
	ds_err err = {0};
	CHECK_EQ(a.set(a.ctx, "k", "v", 1, &err), 0);
	static const unsigned char frames[][8] = {
		{'X', 1, 0, 1, 0, 0, 0, 1},          /* bad magic */
		{'S', 9, 0, 1, 0, 0, 0, 1},          /* unknown op */
		{'S', 1, 0, 0, 0, 0, 0, 1},          /* empty key */
		{'S', 1, 0xff, 0xff, 0, 0, 0, 1},    /* key too long */
		{'S', 1, 0, 1, 0xff, 0xff, 0xff, 0xff}, /* value of 4 GiB */
		{'S', 1, 0, 1, 0, 0, 0x10, 0x01},    /* value of COMM_STORE_VALUE_MAX + 1 */
	};
	for (size_t i = 0; i < sizeof frames / sizeof frames[0]; i++) {
		int fd = raw_connect(s);
		CHECK(fd >= 0);
		if (fd < 0)
			continue;
		CHECK(send(fd, frames[i], 8, MSG_NOSIGNAL) == 8);
		CHECK(closed_by_server(fd));
		close(fd);
	}
	/* a key with a control byte, and random bytes */
	int fd = raw_connect(s);
	unsigned char bad_key[9] = {'S', 2, 0, 1, 0, 0, 0, 10, '\n'};
	CHECK(fd >= 0 && send(fd, bad_key, sizeof bad_key, MSG_NOSIGNAL) == (ssize_t)sizeof bad_key);
	CHECK(closed_by_server(fd));
	close(fd);
	fd = raw_connect(s);
	unsigned char junk[512];
	for (size_t i = 0; i < sizeof junk; i++)
		junk[i] = (unsigned char)ut_rand_u64();
	junk[0] = 'G'; /* never a valid magic */
	CHECK(fd >= 0 && send(fd, junk, sizeof junk, MSG_NOSIGNAL) == (ssize_t)sizeof junk);
	CHECK(closed_by_server(fd));
	close(fd);
	/* a client that hangs up inside a frame */
	fd = raw_connect(s);
	CHECK(fd >= 0 && send(fd, "S\1\0\5ab", 6, MSG_NOSIGNAL) == 6);
	close(fd);
	/* the good client is still served */
	char got[4];
	size_t len = 0;
	CHECK_EQ(a.get(a.ctx, "k", got, sizeof got, &len, 1000, &err), 0);
	CHECK_EQ(len, 1);
out:
	comm_store_tcp_close(&a);
	comm_store_server_stop(s);
}

TEST(comm_store_open_refuses_bad_addresses)
{
	comm_store st;
	ds_err err = {0};
	CHECK_EQ(comm_store_tcp_open(&st, "nocolon", 100, &err), DS_EINVAL);
	CHECK_EQ(comm_store_tcp_open(&st, "127.0.0.1:99999", 100, &err), DS_EINVAL);
	CHECK_EQ(comm_store_tcp_open(&st, NULL, 100, &err), DS_EINVAL);
	/* nobody listens: refused until the timeout */
	comm_store_server *s = start_server();
	char addr[300];
	ds_strlcpy(addr, s ? comm_store_server_addr(s) : "127.0.0.1:1", sizeof addr);
	comm_store_server_stop(s);
	int rc = comm_store_tcp_open(&st, addr, 200, &err);
	CHECK(rc == DS_ETIMEOUT || rc == DS_EIO);
	comm_store_tcp_close(NULL);
}

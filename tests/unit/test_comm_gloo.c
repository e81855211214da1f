/*
 * test_comm_gloo.c - the Gloo backend (comm/comm_gloo.cc) with real ranks:
 * forked processes that meet through a store served by the test on
 * loopback.
 *
 * What is checked:
 *   - every collective a step uses, on both of the backend's paths (the
 *     sync mesh for messages up to its limit, the unbound path above it),
 *     gives every rank the same bits, the same bits again on a second
 *     call, and values within rounding of a reference computed here (the
 *     inputs are a function of rank and index, so the parent recomputes
 *     them);
 *   - busy-polling sync pairs (comm_params.spin) give the same bits;
 *   - a peer that dies is DS_EIO naming its rank, a peer that never calls
 *     is DS_ETIMEOUT, on the sync path, sleeping or polling (the unbound
 *     path's are the driver tests' business).
 * Each rank writes its outputs into a shared mapping; the parent compares.
 */
#include "comm/comm.h"
#include "tests/unit/store_proc.h"
#include "tests/unit/unit.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define WMAX 3
#define NBIG 100000 /* f32 elements: above the sync mesh's 256 KiB */
#define NSMALL 2048
#define NGATHER 4000
#define NFRAME 4096

/* What one rank hands back: its outputs and its calls' codes. */
typedef struct rank_out {
	int rc[16];
	char msg[256];
	float small[2][NSMALL];   /* all_reduce f32 sum, twice */
	float big[2][NBIG];       /* all_reduce f32 sum above the sync limit, twice */
	uint16_t bf[NSMALL];      /* all_reduce bf16 sum */
	int32_t i32[NSMALL];      /* all_reduce i32 sum (wrapping) */
	float mx[NSMALL];         /* all_reduce f32 max */
	float gath[WMAX * NGATHER]; /* all_gather */
	uint8_t frame[NFRAME];    /* broadcast from rank 1 */
} rank_out;

static float input_f(int rank, int i)
{
	uint32_t h = (uint32_t)(rank * 7919 + i) * 2654435761u;
	return ((float)(h >> 8) / 16777216.0f - 0.5f) * 8.0f; /* [-4, 4) */
}

static int spin_mode; /* comm_params.spin of the ranks forked next */

static comm_group *join(const char *addr, const char *prefix, int rank, int W, int timeout_ms,
			comm_store *st, ds_err *err)
{
	if (comm_store_tcp_open(st, addr, 10000, err))
		return NULL;
	comm_params p = comm_default_params();
	p.rank = rank;
	p.world_size = W;
	p.timeout_ms = timeout_ms;
	p.name = "test";
	p.spin = spin_mode;
	return comm_gloo_new(&p, st, prefix, "127.0.0.1", err);
}

static void rank_collectives(const char *addr, int rank, int W, rank_out *o)
{
	ds_err err = {0};
	comm_store st;
	int k = 0;
	comm_group *g = join(addr, "agree", rank, W, 20000, &st, &err);
	if (!g) {
		o->rc[0] = DS_EIO;
		snprintf(o->msg, sizeof o->msg, "%s", err.msg);
		_exit(1);
	}
	for (int rep = 0; rep < 2; rep++) {
		for (int i = 0; i < NSMALL; i++)
			o->small[rep][i] = input_f(rank, i);
		o->rc[k++] = comm_all_reduce(g, o->small[rep], o->small[rep], NSMALL, COMM_F32, COMM_SUM, &err);
		float *in = malloc(NBIG * sizeof(float));
		for (int i = 0; in && i < NBIG; i++)
			in[i] = input_f(rank, i);
		o->rc[k++] = in ? comm_all_reduce(g, in, o->big[rep], NBIG, COMM_F32, COMM_SUM, &err) : DS_ENOMEM;
		free(in);
	}
	uint16_t bin[NSMALL];
	int32_t iin[NSMALL];
	float fin[NSMALL], gin[NGATHER];
	for (int i = 0; i < NSMALL; i++) {
		float f = input_f(rank, i);
		uint32_t u;
		memcpy(&u, &f, 4);
		bin[i] = (uint16_t)(u >> 16);
		iin[i] = (int32_t)(0x7FFFFF00u + (uint32_t)(rank * 1000 + i)); /* sums wrap */
		fin[i] = f;
	}
	for (int i = 0; i < NGATHER; i++)
		gin[i] = input_f(rank, i + 1);
	o->rc[k++] = comm_all_reduce(g, bin, o->bf, NSMALL, COMM_BF16, COMM_SUM, &err);
	o->rc[k++] = comm_all_reduce(g, iin, o->i32, NSMALL, COMM_I32, COMM_SUM, &err);
	o->rc[k++] = comm_all_reduce(g, fin, o->mx, NSMALL, COMM_F32, COMM_MAX, &err);
	o->rc[k++] = comm_all_gather(g, gin, o->gath, NGATHER, COMM_F32, &err);
	for (int i = 0; i < NFRAME; i++)
		o->frame[i] = rank == 1 ? (uint8_t)(i * 13 + 5) : 0;
	o->rc[k++] = comm_broadcast(g, o->frame, NFRAME, COMM_U8, 1, &err);
	if (err.code)
		snprintf(o->msg, sizeof o->msg, "%s", err.msg);
	comm_group_free(g);
	comm_store_tcp_close(&st);
	_exit(0);
}

/* Forks W ranks running fn against a store server in its own process
 * (store_proc.h: the test process has one thread when it forks) and reaps
 * them; the number of ranks that did not exit with 0. */
static int run_ranks(int W, void (*fn)(const char *, int, int, rank_out *), rank_out *out)
{
	store_proc sp;
	if (store_proc_start(&sp))
		return -1;
	pid_t pid[WMAX];
	fflush(NULL);
	for (int r = 0; r < W; r++) {
		pid[r] = fork();
		if (pid[r] == 0)
			fn(sp.addr, r, W, &out[r]);
	}
	int bad = 0;
	for (int r = 0; r < W; r++) {
		int st = 0;
		if (pid[r] < 0) {
			bad++;
			continue;
		}
		waitpid(pid[r], &st, 0);
		bad += !WIFEXITED(st) || WEXITSTATUS(st) != 0;
	}
	store_proc_stop(&sp);
	return bad;
}

/* W ranks run rank_collectives; checks their outputs against each other
 * and the reference.  The outputs (a shared mapping the caller unmaps), or
 * NULL. */
static rank_out *check_collectives(int W)
{
	rank_out *o = mmap(NULL, WMAX * sizeof *o, PROT_READ | PROT_WRITE,
			   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	CHECK(o != MAP_FAILED);
	if (o == MAP_FAILED)
		return NULL;
	CHECK_EQ(run_ranks(W, rank_collectives, o), 0);
	for (int r = 0; r < W; r++) {
		for (int k = 0; k < 16; k++)
			if (o[r].rc[k])
				ut_fail(__FILE__, __LINE__, "W=%d rank %d call %d: %d %s", W, r, k,
					o[r].rc[k], o[r].msg);
		/* every rank the same bits as rank 0, and a rerun too */
		CHECK(memcmp(o[r].small[0], o[0].small[0], sizeof o[0].small[0]) == 0);
		CHECK(memcmp(o[r].small[1], o[0].small[0], sizeof o[0].small[0]) == 0);
		CHECK(memcmp(o[r].big[0], o[0].big[0], sizeof o[0].big[0]) == 0);
		CHECK(memcmp(o[r].big[1], o[0].big[0], sizeof o[0].big[0]) == 0);
		CHECK(memcmp(o[r].bf, o[0].bf, sizeof o[0].bf) == 0);
		CHECK(memcmp(o[r].i32, o[0].i32, sizeof o[0].i32) == 0);
		CHECK(memcmp(o[r].mx, o[0].mx, sizeof o[0].mx) == 0);
		CHECK(memcmp(o[r].gath, o[0].gath, (size_t)W * NGATHER * sizeof(float)) == 0);
	}
	/* against the reference */
	int bad = 0;
	for (int i = 0; i < NSMALL; i++) {
		float s = 0, m = -INFINITY;
		uint32_t is = 0;
		for (int r = 0; r < W; r++) {
			s += input_f(r, i);
			m = fmaxf(m, input_f(r, i));
			is += 0x7FFFFF00u + (uint32_t)(r * 1000 + i);
		}
		bad += fabsf(o[0].small[0][i] - s) > 1e-5f * 4 * W;
		bad += o[0].mx[i] != m;
		bad += (uint32_t)o[0].i32[i] != is;
		uint32_t u = (uint32_t)o[0].bf[i] << 16;
		float b;
		memcpy(&b, &u, 4);
		bad += fabsf(b - s) > 0.02f * 4 * W;
	}
	for (int i = 0; i < NBIG; i += 97) {
		float s = 0;
		for (int r = 0; r < W; r++)
			s += input_f(r, i);
		bad += fabsf(o[0].big[0][i] - s) > 1e-5f * 4 * W;
	}
	for (int r = 0; r < W; r++)
		for (int i = 0; i < NGATHER; i++)
			bad += o[0].gath[r * NGATHER + i] != input_f(r, i + 1);
	for (int r = 0; r < W; r++)
		for (int i = 0; i < NFRAME; i++)
			bad += o[r].frame[i] != (uint8_t)(i * 13 + 5);
	CHECK_EQ(bad, 0);
	return o;
}

TEST(comm_gloo_collectives_agree_bit_for_bit)
{
	spin_mode = 0;
	for (int W = 2; W <= WMAX; W++) {
		rank_out *o = check_collectives(W);
		if (o)
			munmap(o, WMAX * sizeof *o);
	}
}

/* Busy-polling sync pairs (comm_params.spin, two ranks: one core each on
 * the smallest CI machine) give the same bits as sleeping ones. */
TEST(comm_gloo_spinning_sync_mesh_gives_the_same_bits)
{
	spin_mode = 0;
	rank_out *a = check_collectives(2);
	spin_mode = 1;
	rank_out *b = check_collectives(2);
	spin_mode = 0;
	if (a && b) {
		CHECK(memcmp(a[0].small, b[0].small, sizeof a[0].small) == 0);
		CHECK(memcmp(a[0].big, b[0].big, sizeof a[0].big) == 0);
		CHECK(memcmp(a[0].bf, b[0].bf, sizeof a[0].bf) == 0);
		CHECK(memcmp(a[0].gath, b[0].gath, 2 * NGATHER * sizeof(float)) == 0);
	}
	if (a)
		munmap(a, WMAX * sizeof *a);
	if (b)
		munmap(b, WMAX * sizeof *b);
}

/* Rank 0 calls; rank 1 dies after joining (mode 0) or sleeps past the
 * timeout (mode 1). */
static int failure_mode;

static void rank_failure(const char *addr, int rank, int W, rank_out *o)
{
	ds_err err = {0};
	comm_store st;
	comm_group *g = join(addr, failure_mode ? "late" : "dead", rank, W, 1000, &st, &err);
	if (!g) {
		snprintf(o->msg, sizeof o->msg, "join: %s", err.msg);
		o->rc[0] = err.code ? err.code : DS_EIO;
		_exit(1);
	}
	float buf[64] = {0};
	if (rank == 1) {
		comm_all_reduce(g, buf, buf, 64, COMM_F32, COMM_SUM, &err); /* the sync objects exist */
		if (failure_mode == 0)
			_exit(0); /* dies without closing: the kernel resets the connections */
		usleep(3000 * 1000);
		_exit(0);
	}
	o->rc[0] = comm_all_reduce(g, buf, buf, 64, COMM_F32, COMM_SUM, &err);
	o->rc[1] = comm_all_reduce(g, buf, buf, 64, COMM_F32, COMM_SUM, &err);
	o->rc[2] = comm_broadcast(g, buf, 64, COMM_F32, 0, &err); /* the group stays broken */
	snprintf(o->msg, sizeof o->msg, "%s", err.msg);
	_exit(0);
}

TEST(comm_gloo_dead_and_silent_peers_on_the_sync_path)
{
	/* sleeping and busy-polling sync pairs alike */
	for (int k = 0; k < 4; k++) {
		failure_mode = k % 2;
		spin_mode = k / 2;
		rank_out *o = mmap(NULL, 2 * sizeof *o, PROT_READ | PROT_WRITE,
				   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
		CHECK(o != MAP_FAILED);
		if (o == MAP_FAILED)
			return;
		run_ranks(2, rank_failure, o);
		CHECK_EQ(o[0].rc[0], DS_OK);
		int want = failure_mode == 0 ? DS_EIO : DS_ETIMEOUT;
		CHECK_EQ(o[0].rc[1], want);
		CHECK_EQ(o[0].rc[2], want);
		if (failure_mode == 0 && !strstr(o[0].msg, "rank 1"))
			ut_fail(__FILE__, __LINE__, "a dead peer is not named: %s", o[0].msg);
		munmap(o, 2 * sizeof *o);
	}
	spin_mode = 0;
}

/*
 * bench_comm.c - latency of the Gloo collectives a decode step calls, on
 * loopback (make bench).
 *
 * Forks W ranks (2 and 4) that meet through a store served by the parent
 * and time, per call: all_reduce of D floats (the all-reduce after o_proj
 * and after the MLP, D = 2048 and 7168), all_gather of V/W floats (the
 * lm_head's vocab slices, V = 32000) and a send/recv ping-pong of D floats
 * (a pipeline stage boundary).  Rank 0 prints microseconds per call, the
 * median of 5 rounds of N calls.  The baseline in the same run is a memcpy
 * of the same bytes (what one rank pays for the data alone).
 *
 * Usage: bench_comm [--calls N]
 */
#include "comm/comm.h"
#include "common/strutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define ROUNDS 5

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof *v, cmp_double);
	return v[n / 2];
}

enum what { ALL_REDUCE, ALL_GATHER, PING_PONG, N_WHAT };
static const char *const what_name[N_WHAT] = {"all_reduce", "all_gather", "send/recv ping-pong"};

static int one_call(comm_group *g, enum what w, float *a, float *b, int64_t n, ds_err *err)
{
	const int me = comm_group_rank(g), W = comm_group_size(g);
	switch (w) {
	case ALL_REDUCE:
		return comm_all_reduce(g, a, a, n, COMM_F32, COMM_SUM, err);
	case ALL_GATHER:
		return comm_all_gather(g, a, b, n / W, COMM_F32, err);
	case PING_PONG:
		if (me == 0)
			return comm_send(g, a, n, COMM_F32, 1, err) ?: comm_recv(g, b, n, COMM_F32, 1, err);
		if (me == 1)
			return comm_recv(g, b, n, COMM_F32, 0, err) ?: comm_send(g, b, n, COMM_F32, 0, err);
		return DS_OK;
	default:
		return DS_EINVAL;
	}
}

static int rank_main(const char *addr, int rank, int W, int calls)
{
	ds_err err = {0};
	comm_store st;
	if (comm_store_tcp_open(&st, addr, 10000, &err))
		goto fail;
	comm_params p = comm_default_params();
	p.rank = rank;
	p.world_size = W;
	p.timeout_ms = 30000;
	char prefix[64];
	snprintf(prefix, sizeof prefix, "bench%d/world", W);
	comm_group *g = comm_gloo_new(&p, &st, prefix, "127.0.0.1", &err);
	if (!g)
		goto fail;
	static const int64_t sizes[][2] = {{ALL_REDUCE, 2048}, {ALL_REDUCE, 7168}, {ALL_GATHER, 32000},
					   {PING_PONG, 2048}, {PING_PONG, 7168}};
	float *a = malloc(32000 * sizeof(float)), *b = malloc(32000 * sizeof(float));
	for (int i = 0; a && i < 32000; i++)
		a[i] = (float)(i % 97) * 0.01f;
	for (size_t s = 0; a && b && s < sizeof sizes / sizeof sizes[0]; s++) {
		enum what w = (enum what)sizes[s][0];
		const int64_t n = sizes[s][1];
		double us[ROUNDS], cp[ROUNDS];
		for (int r = 0; r < ROUNDS; r++) {
			if (comm_barrier(g, &err))
				goto fail;
			double t0 = ds_now_s();
			for (int c = 0; c < calls; c++)
				if (one_call(g, w, a, b, n, &err))
					goto fail;
			us[r] = (ds_now_s() - t0) / calls * 1e6;
			t0 = ds_now_s();
			for (int c = 0; c < calls; c++) {
				memcpy(b, a, (size_t)n * sizeof(float));
				__asm__ volatile("" ::: "memory");
			}
			cp[r] = (ds_now_s() - t0) / calls * 1e6;
		}
		if (rank == 0)
			printf("%-20s W=%d %6lld floats %9.1f us/call   memcpy %6.2f us\n", what_name[w], W,
			       (long long)n, median(us, ROUNDS), median(cp, ROUNDS));
	}
	fflush(stdout);
	free(a);
	free(b);
	comm_group_free(g);
	comm_store_tcp_close(&st);
	return 0;
fail:
	fprintf(stderr, "bench_comm: rank %d: %s\n", rank, err.msg);
	return 1;
}

int main(int argc, char **argv)
{
	int calls = 300;
	if (argc == 3 && strcmp(argv[1], "--calls") == 0 && ds_parse_int(argv[2], 1, 1 << 24, &calls))
		calls = 0;
	if (calls < 1 || (argc != 1 && argc != 3)) {
		fprintf(stderr, "usage: bench_comm [--calls N]\n");
		return 2;
	}
	printf("bench_comm: Gloo over loopback TCP, %ld cores\n", sysconf(_SC_NPROCESSORS_ONLN));
	fflush(stdout);
	int status = 0;
	for (int W = 2; W <= 4; W += 2) {
		ds_err err = {0};
		comm_store_server *srv = comm_store_server_start("127.0.0.1", 0, &err);
		if (!srv) {
			fprintf(stderr, "bench_comm: %s\n", err.msg);
			return 1;
		}
		pid_t pids[4];
		for (int r = 0; r < W; r++) {
			pids[r] = fork();
			if (pids[r] == 0)
				_exit(rank_main(comm_store_server_addr(srv), r, W, calls));
		}
		for (int r = 0; r < W; r++) {
			int st = 0;
			waitpid(pids[r], &st, 0);
			if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
				status = 1;
		}
		comm_store_server_stop(srv);
	}
	return status;
}

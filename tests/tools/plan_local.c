/*
 * plan_local.c - a parallel plan's logits against one rank, on one machine,
 * without a network: the plan's ranks are forked processes that talk over a
 * shared-memory test transport (a comm backend of this file, behind the
 * comm_ops table of comm/comm_impl.h).  It checks the graphs' splits (heads,
 * rows, vocab, stages) apart from any real transport; tests/tools/plan_check
 * does the same over Gloo.  Run by tests/integration/test_plan_llama.py.
 *
 * Usage: plan_local -m MODEL [--tp N] [--pp N] [--ep N] [--steps N] [--tol T]
 *
 *   1. one rank: a step of two prompts (9 and 6 tokens, two sequences, so a
 *      pipeline cuts it into micro-batches), then --steps decode steps of
 *      both sequences, each fed the reference's greedy ids; every logit row
 *      is kept.
 *   2. the plan: W = tp * pp * ep forked ranks, each loads its slice
 *      (model_params.rank) and runs the same steps; world rank 0 compares
 *      each row with the reference (max |a - b| / max |b|) and its argmax.
 * Prints one line per step on rank 0 and "plan_local: ok" or "plan_local:
 * FAIL"; exit 0, 1 (over the tolerance or a greedy id differs) or 2 (error,
 * including an error or a refusal of the plan on any rank: the message is
 * printed).
 *
 * Transport: one shared region per group made before fork: a process-shared
 * barrier, one slot per rank for the collectives and one mailbox per
 * (sender, receiver) pair for send / recv (two semaphores each).
 * all_reduce sums the slots in rank order (the same f32 sum on every rank).
 * A rank that hangs is ended by alarm().
 */
#include "comm/comm_impl.h"
#include "common/strutil.h"
#include "engine/model.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXW 16
#define NSEQ 2
#define CTX 256
#define BT 64

/* ---- shared-memory transport ---- */

typedef struct shm_hdr {
	pthread_barrier_t bar;
	sem_t full[MAXW][MAXW], empty[MAXW][MAXW]; /* [from][to] */
	int size;
	size_t slot; /* bytes of each slot and mailbox */
} shm_hdr;

typedef struct shm_group {
	comm_group g; /* first */
	shm_hdr *h;
} shm_group;

static uint8_t *slot_at(shm_hdr *h, int r)
{
	return (uint8_t *)h + ((sizeof *h + 63) & ~(size_t)63) + (size_t)r * h->slot;
}

static uint8_t *box_at(shm_hdr *h, int from, int to)
{
	return slot_at(h, h->size + from * h->size + to);
}

static shm_hdr *shm_region_new(int size, size_t slot)
{
	size_t bytes = ((sizeof(shm_hdr) + 63) & ~(size_t)63) + (size_t)(size + size * size) * slot;
	shm_hdr *h = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (h == MAP_FAILED)
		return NULL;
	pthread_barrierattr_t ba;
	pthread_barrierattr_init(&ba);
	pthread_barrierattr_setpshared(&ba, PTHREAD_PROCESS_SHARED);
	pthread_barrier_init(&h->bar, &ba, (unsigned)size);
	for (int i = 0; i < size; i++)
		for (int j = 0; j < size; j++) {
			sem_init(&h->full[i][j], 1, 0);
			sem_init(&h->empty[i][j], 1, 1);
		}
	h->size = size;
	h->slot = slot;
	return h;
}

static shm_hdr *hdr(comm_group *g)
{
	return ((shm_group *)g)->h;
}

static size_t dt_size(comm_dtype dt)
{
	return dt == COMM_F32 || dt == COMM_I32 ? 4 : dt == COMM_U8 ? 1 : 2;
}

static int too_big(comm_group *g, size_t bytes, ds_err *err)
{
	if (bytes <= hdr(g)->slot)
		return 0;
	ds_err_set(err, DS_EINVAL, "shm group %s: %zu bytes exceed the %zu-byte slot", g->name, bytes,
		   hdr(g)->slot);
	return 1;
}

static int shm_all_reduce(comm_group *g, const void *send, void *recv, int64_t count, comm_dtype dt,
			  comm_op op, ds_err *err)
{
	shm_hdr *h = hdr(g);
	if (dt != COMM_F32 || op != COMM_SUM)
		return ds_err_set(err, DS_EUNSUPPORTED, "shm group: all_reduce is f32 sum only");
	if (too_big(g, (size_t)count * 4, err))
		return DS_EINVAL;
	memcpy(slot_at(h, g->rank), send, (size_t)count * 4);
	pthread_barrier_wait(&h->bar);
	float *out = recv;
	for (int64_t i = 0; i < count; i++) {
		float s = 0;
		for (int r = 0; r < h->size; r++)
			s += ((const float *)slot_at(h, r))[i];
		out[i] = s;
	}
	pthread_barrier_wait(&h->bar);
	return DS_OK;
}

static int shm_all_gather(comm_group *g, const void *send, void *recv, int64_t count, comm_dtype dt,
			  ds_err *err)
{
	shm_hdr *h = hdr(g);
	size_t n = (size_t)count * dt_size(dt);
	if (too_big(g, n, err))
		return DS_EINVAL;
	memcpy(slot_at(h, g->rank), send, n);
	pthread_barrier_wait(&h->bar);
	for (int r = 0; r < h->size; r++)
		memcpy((uint8_t *)recv + (size_t)r * n, slot_at(h, r), n);
	pthread_barrier_wait(&h->bar);
	return DS_OK;
}

static int shm_send(comm_group *g, const void *buf, int64_t count, comm_dtype dt, int peer, ds_err *err)
{
	shm_hdr *h = hdr(g);
	size_t n = (size_t)count * dt_size(dt);
	if (too_big(g, n, err))
		return DS_EINVAL;
	while (sem_wait(&h->empty[g->rank][peer]) && errno == EINTR)
		;
	memcpy(box_at(h, g->rank, peer), buf, n);
	sem_post(&h->full[g->rank][peer]);
	return DS_OK;
}

static int shm_recv(comm_group *g, void *buf, int64_t count, comm_dtype dt, int peer, ds_err *err)
{
	shm_hdr *h = hdr(g);
	size_t n = (size_t)count * dt_size(dt);
	if (too_big(g, n, err))
		return DS_EINVAL;
	while (sem_wait(&h->full[peer][g->rank]) && errno == EINTR)
		;
	memcpy(buf, box_at(h, peer, g->rank), n);
	sem_post(&h->empty[peer][g->rank]);
	return DS_OK;
}

static int shm_barrier(comm_group *g, ds_err *err)
{
	pthread_barrier_wait(&hdr(g)->bar);
	return DS_OK;
}

static void shm_free(comm_group *g)
{
	free(g);
}

static const comm_ops shm_ops = {
	.name = "shm",
	.mem = COMM_MEM_HOST,
	.free = shm_free,
	.all_reduce = shm_all_reduce,
	.all_gather = shm_all_gather,
	.send = shm_send,
	.recv = shm_recv,
	.barrier = shm_barrier,
};

static comm_group *shm_group_new(shm_hdr *h, int rank, const char *name)
{
	shm_group *s = calloc(1, sizeof *s);
	comm_params p = comm_default_params();
	ds_err err = {0};
	p.rank = rank;
	p.world_size = h->size;
	p.name = name;
	if (!s || comm_group_init(&s->g, &shm_ops, &p, &err)) {
		fprintf(stderr, "plan_local: group %s: %s\n", name, err.msg);
		exit(2);
	}
	s->h = h;
	return &s->g;
}

/* ---- the steps ---- */

typedef struct run {
	model *m;
	kv_seq kv[NSEQ];
	int len[NSEQ];
	int32_t tables[NSEQ][CTX];
} run;

static int V;

static int step(run *r, int n, const int32_t *toks, const int32_t *sidx, float *out, ds_err *err)
{
	int32_t pos[BT];
	int grow[NSEQ] = {0}, filled[NSEQ] = {0};
	for (int i = 0; i < n; i++)
		grow[sidx[i]]++;
	for (int s = 0; s < NSEQ; s++) {
		if (grow[s] && kv_seq_reserve(model_kv(r->m), &r->kv[s], r->len[s] + grow[s], err))
			return err->code;
		for (int b = 0; b < r->kv[s].n_blocks; b++)
			r->tables[s][b] = r->kv[s].blocks[b];
	}
	for (int i = 0; i < n; i++)
		pos[i] = r->len[sidx[i]] + filled[sidx[i]]++;
	eng_batch b = {.n_tok = n, .tokens = toks, .pos = pos, .seq = sidx, .n_seq = NSEQ,
		       .block_tables = &r->tables[0][0], .max_blocks = CTX};
	int rc = model_forward(r->m, &b, out, err);
	for (int s = 0; s < NSEQ; s++)
		r->len[s] += grow[s];
	return rc;
}

static int argmax(const float *l)
{
	int best = 0;
	for (int v = 1; v < V; v++)
		if (l[v] > l[best])
			best = v;
	return best;
}

static double row_err(const float *a, const float *b)
{
	double num = 0, den = 0;
	for (int v = 0; v < V; v++) {
		double d = fabs((double)a[v] - (double)b[v]);
		num = d > num ? d : num;
		den = fabs((double)b[v]) > den ? fabs((double)b[v]) : den;
	}
	return den > 0 ? num / den : num;
}

/* The prompts and the step layout: step 0 is both prompts (PA + PB
 * tokens), step k > 0 one token of each sequence. */
#define PA 9
#define PB 6
static const int32_t prompt[PA + PB] = {1, 504, 3458, 282, 4649, 314, 253, 1030, 30, 1, 2683, 2273, 281, 253, 2498};

static int step_tokens(int k, const int *greedy_prev, int32_t *toks, int32_t *sidx)
{
	if (k == 0) {
		for (int i = 0; i < PA + PB; i++) {
			toks[i] = prompt[i] % V;
			sidx[i] = i >= PA;
		}
		return PA + PB;
	}
	for (int s = 0; s < NSEQ; s++) {
		toks[s] = greedy_prev[s];
		sidx[s] = s;
	}
	return NSEQ;
}

/* Logit rows of step k in ref: step 0 has PA + PB rows, later ones NSEQ. */
static size_t row0_of(int k)
{
	return k == 0 ? 0 : (size_t)(PA + PB) + (size_t)(k - 1) * NSEQ;
}

/* Runs the steps on r.  ref == NULL: the reference, every logit row into
 * rec.  Else the inputs come from ref's greedy ids, and when compare is set
 * (world rank 0) each step's rows are checked against ref; other ranks
 * pass no logits.  0, 1 (a step off the tolerance or a greedy id differs)
 * or a negative code with err filled. */
static int run_steps(run *r, int steps, float *rec, const float *ref, int compare, double tol, ds_err *err)
{
	int32_t toks[BT], sidx[BT];
	int greedy[NSEQ] = {0}, bad = 0;
	float *buf = compare ? malloc((size_t)(PA + PB) * (size_t)V * sizeof(float)) : NULL;
	if (compare && !buf)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	for (int k = 0; k <= steps; k++) {
		int n = step_tokens(k, greedy, toks, sidx);
		float *dst = !ref ? rec + row0_of(k) * (size_t)V : buf;
		int rc = step(r, n, toks, sidx, dst, err);
		if (rc) {
			free(buf);
			return rc;
		}
		const float *truth = ref ? ref + row0_of(k) * (size_t)V : dst;
		if (compare) {
			double worst = 0;
			int ids_ok = 1;
			for (int i = 0; i < n; i++) {
				double e = row_err(dst + (size_t)i * V, truth + (size_t)i * V);
				worst = e > worst ? e : worst;
				ids_ok &= argmax(dst + (size_t)i * V) == argmax(truth + (size_t)i * V);
			}
			int ok = worst <= tol && ids_ok;
			printf("%s step %d (%d tokens): max rel err %.3g (tol %g), greedy ids %s\n", ok ? "ok  " : "FAIL",
			       k, n, worst, tol, ids_ok ? "equal" : "DIFFER");
			bad += !ok;
		}
		/* the next inputs: the reference's greedy ids (every rank has ref) */
		const int last[NSEQ] = {PA - 1, PA + PB - 1};
		for (int s = 0; s < NSEQ; s++)
			greedy[s] = argmax(truth + (size_t)(k == 0 ? last[s] : s) * V);
	}
	free(buf);
	return bad ? 1 : 0;
}

static model *load(const char *path, const model_rank *rank, ds_err *err)
{
	model_params p = model_default_params();
	p.path = path;
	p.backend = "cpu";
	p.threads = 1;
	p.max_batch_tokens = BT;
	p.max_ctx = CTX;
	p.max_seqs = NSEQ;
	p.page_size = 16;
	p.rank = rank;
	return model_load(&p, err);
}

static void usage(void)
{
	fprintf(stderr, "usage: plan_local -m MODEL [--tp N] [--pp N] [--ep N] [--steps N] [--tol T]\n");
	exit(2);
}

static int int_arg(const char *s)
{
	int v;
	if (ds_parse_int(s, 1, MAXW, &v))
		usage();
	return v;
}

int main(int argc, char **argv)
{
	const char *path = NULL;
	model_plan plan = {.tp = 1, .pp = 1, .ep = 1};
	int steps = 4;
	double tol = 1e-5;
	for (int i = 1; i < argc; i++) {
		if (i + 1 >= argc)
			usage();
		if (!strcmp(argv[i], "-m"))
			path = argv[++i];
		else if (!strcmp(argv[i], "--tp"))
			plan.tp = int_arg(argv[++i]);
		else if (!strcmp(argv[i], "--pp"))
			plan.pp = int_arg(argv[++i]);
		else if (!strcmp(argv[i], "--ep"))
			plan.ep = int_arg(argv[++i]);
		else if (!strcmp(argv[i], "--steps"))
			steps = int_arg(argv[++i]);
		else if (strcmp(argv[i], "--tol") != 0 || ds_parse_double(argv[++i], 0, 1, &tol))
			usage();
	}
	const int W = plan.tp * plan.pp * plan.ep, S = plan.tp * plan.ep;
	if (!path || W > MAXW)
		usage();
	ds_err err = {0};
	run ref_run = {0};
	if (!(ref_run.m = load(path, NULL, &err))) {
		fprintf(stderr, "plan_local: one rank: %s\n", err.msg);
		return 2;
	}
	V = model_vocab_size(ref_run.m);
	const size_t rows = (size_t)(PA + PB) + (size_t)steps * NSEQ;
	float *ref = malloc(rows * (size_t)V * sizeof(float));
	if (!ref || run_steps(&ref_run, steps, ref, NULL, 0, tol, &err)) {
		fprintf(stderr, "plan_local: one rank: %s\n", err.msg);
		return 2;
	}
	for (int s = 0; s < NSEQ; s++)
		kv_seq_free(model_kv(ref_run.m), &ref_run.kv[s]);
	model_free(ref_run.m);

	/* the groups: world, one per stage, one per (stage, ep) for tp */
	const size_t slot = (size_t)BT * (size_t)V * sizeof(float) + 4096;
	shm_hdr *world = shm_region_new(W, slot), *stage[MAXW], *tpg[MAXW];
	for (int s = 0; s < plan.pp; s++)
		stage[s] = shm_region_new(S, slot);
	for (int i = 0; i < plan.pp * plan.ep; i++)
		tpg[i] = shm_region_new(plan.tp, slot);
	pid_t pids[MAXW];
	for (int r = 0; r < W; r++) {
		if ((pids[r] = fork()) < 0) {
			perror("plan_local: fork");
			return 2;
		}
		if (pids[r])
			continue;
		alarm(600);
		model_rank mr = {.plan = plan, .rank = r};
		model_rank_coords(&plan, r, &mr.stage, &mr.tp_rank, &mr.ep_rank);
		mr.world = shm_group_new(world, r, "world");
		mr.stage_grp = shm_group_new(stage[mr.stage], r % S, "stage");
		mr.tp_grp = shm_group_new(tpg[mr.stage * plan.ep + mr.ep_rank], mr.tp_rank, "tp");
		run rr = {0};
		if (!(rr.m = load(path, &mr, &err))) {
			fprintf(stderr, "plan_local: rank %d: %s\n", r, err.msg);
			_exit(2);
		}
		if (r == 0)
			printf("plan_local: tp %d pp %d ep %d, rank 0 holds %zu weight bytes\n", plan.tp, plan.pp,
			       plan.ep, model_weight_bytes(rr.m));
		int rc = run_steps(&rr, steps, NULL, ref, r == 0, tol, &err);
		if (rc < 0)
			fprintf(stderr, "plan_local: rank %d: %s\n", r, err.msg);
		fflush(stdout);
		_exit(rc < 0 ? 2 : rc);
	}
	int worst = 0;
	for (int r = 0; r < W; r++) {
		int st = 0;
		if (waitpid(pids[r], &st, 0) < 0 || !WIFEXITED(st)) {
			fprintf(stderr, "plan_local: rank %d did not exit normally\n", r);
			worst = 2;
			continue;
		}
		if (WEXITSTATUS(st) > worst)
			worst = WEXITSTATUS(st);
	}
	printf("plan_local: %s\n", worst == 0 ? "ok" : "FAIL");
	return worst;
}

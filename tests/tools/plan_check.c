/*
 * plan_check.c - a model under a parallel plan gives the logits of one rank.
 * Run by tests/integration/test_plan_numerics.py over plans x checkpoints.
 *
 * Usage: plan_check -m MODEL [--tp N] [--pp N] [--ep N] [--attn FORM]
 *                   [--comm gloo|shm] [--tol T]
 *
 * Forks tp * pp * ep rank processes first (before anything starts a
 * kernel thread pool, which a fork would not carry), each makes its world,
 * stage and tp groups and loads MODEL with its model_rank; then the parent
 * loads the model on one rank.  All of them run the same steps:
 *
 *   step 0   a prefill of 9 tokens of 2 sequences (5 + 4), every row's logits
 *   step 1   a prefill of 3 more tokens of sequence 0, 1 decode of sequence
 *            1 and the 2-token prefill of a third sequence; logits of the
 *            last row of sequences 0 and 1 only, none of the third (3
 *            sequences: pp = 3 gets 3 micro-batches, one without logits)
 *   step 2.. decodes of the three sequences (3 tokens a step)
 *
 * with fixed page tables (sequence s owns pages s * MAXB ...).  World rank
 * 0 hands its logits to the parent through shared memory; the parent prints
 * each step's max relative error (max |a - b| / max |b| over a row, worst
 * row) and whether every row's argmax (the greedy id) agrees, then
 * "plan_check: ok" or "plan_check: FAIL" (exit 1); 2 on a setup error.
 *
 * Transport (--comm):
 *   gloo  (the default) the product's CPU transport: the parent serves the
 *         rendezvous store on loopback (comm_store_server_start), each rank
 *         connects to it and makes its groups with comm_gloo_new (keys
 *         "plan<pid>/world", "plan<pid>/stage<s>", "plan<pid>/tp<s>.<e>");
 *         a group of one rank is comm_single_new.
 *   shm   a small comm backend of this file over shared memory between the
 *         forked ranks (comm/comm_impl.h): no sockets, so a failure here and
 *         not there points at the transport.  Collectives copy through one
 *         slot per rank and sum in rank order, so every rank gets the same
 *         bits; send/recv go through one mailbox per ordered pair.  Waits
 *         spin with short sleeps and give up after the group's timeout
 *         (DS_ETIMEOUT), so a dead rank ends the run instead of hanging it.
 */
#include "comm/comm_impl.h"
#include "common/strutil.h"
#include "engine/model.h"

#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAXW 16                 /* ranks */
#define SLOT ((size_t)256 << 10) /* bytes a rank's slot / a mailbox holds at once */
#define NSEQ 3
#define MAXB 8                  /* blocks per sequence */
#define PAGE 4                  /* positions per page: prefills cross pages */
#define NSTEP 6
#define MAXTOK 16

/* ---- a comm backend over shared memory (forked ranks) ---- */

typedef struct shm_box {
	atomic_int full;
	size_t len;
	uint8_t data[SLOT];
} shm_box;

/* One group's shared state, mapped before the fork. */
typedef struct shm_region {
	atomic_int arrived, gen;
	uint8_t slot[MAXW][SLOT];
	shm_box box[MAXW][MAXW]; /* [from][to] */
} shm_region;

typedef struct shm_group {
	comm_group g; /* first: comm.c sees this part */
	shm_region *r;
} shm_group;

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void pause_briefly(int spins)
{
	if (spins < 64)
		return;
	struct timespec ts = {.tv_sec = 0, .tv_nsec = 20000};
	nanosleep(&ts, NULL);
}

static int shm_wait_timeout(comm_group *g, const char *what, ds_err *err)
{
	return ds_err_set(err, DS_ETIMEOUT, "comm %s: %s waited %d ms for its peers", g->name, what,
			  g->timeout_ms);
}

static int shm_barrier(comm_group *g, ds_err *err)
{
	shm_region *r = ((shm_group *)g)->r;
	int gen = atomic_load(&r->gen);
	if (atomic_fetch_add(&r->arrived, 1) == g->size - 1) {
		atomic_store(&r->arrived, 0);
		atomic_fetch_add(&r->gen, 1);
		return DS_OK;
	}
	double t0 = now_s();
	for (int spins = 0; atomic_load(&r->gen) == gen; spins++) {
		if (now_s() - t0 > g->timeout_ms / 1000.0)
			return shm_wait_timeout(g, "barrier", err);
		pause_briefly(spins);
	}
	return DS_OK;
}

static void reduce_f32(float *acc, const float *x, int64_t n, comm_op op)
{
	for (int64_t i = 0; i < n; i++)
		acc[i] = op == COMM_SUM ? acc[i] + x[i] : op == COMM_MAX ? fmaxf(acc[i], x[i]) : fminf(acc[i], x[i]);
}

static int shm_all_reduce(comm_group *g, const void *send, void *recv, int64_t count, comm_dtype dt,
			  comm_op op, ds_err *err)
{
	if (dt != COMM_F32)
		return ds_err_set(err, DS_EUNSUPPORTED, "comm %s: the shm backend reduces f32 only", g->name);
	shm_region *r = ((shm_group *)g)->r;
	const int64_t per = (int64_t)(SLOT / sizeof(float));
	for (int64_t off = 0; off < count; off += per) {
		int64_t n = count - off < per ? count - off : per;
		memcpy(r->slot[g->rank], (const float *)send + off, (size_t)n * sizeof(float));
		int rc = shm_barrier(g, err);
		if (rc)
			return rc;
		float *out = (float *)recv + off; /* every rank sums in rank order: same bits */
		memcpy(out, r->slot[0], (size_t)n * sizeof(float));
		for (int k = 1; k < g->size; k++)
			reduce_f32(out, (const float *)r->slot[k], n, op);
		if ((rc = shm_barrier(g, err)))
			return rc;
	}
	return DS_OK;
}

static int shm_all_gather(comm_group *g, const void *send, void *recv, int64_t count, comm_dtype dt,
			  ds_err *err)
{
	shm_region *r = ((shm_group *)g)->r;
	const size_t esz = comm_dtype_size(dt), bytes = (size_t)count * esz;
	for (size_t off = 0; off < bytes || (off == 0 && bytes == 0); off += SLOT) {
		size_t n = bytes - off < SLOT ? bytes - off : SLOT;
		memcpy(r->slot[g->rank], (const uint8_t *)send + off, n);
		int rc = shm_barrier(g, err);
		if (rc)
			return rc;
		for (int k = 0; k < g->size; k++)
			if (k != g->rank || (const uint8_t *)send != (uint8_t *)recv + (size_t)k * bytes)
				memcpy((uint8_t *)recv + (size_t)k * bytes + off, r->slot[k], n);
		if ((rc = shm_barrier(g, err)))
			return rc;
		if (bytes == 0)
			break;
	}
	return DS_OK;
}

static int shm_send(comm_group *g, const void *buf, int64_t count, comm_dtype dt, int peer, ds_err *err)
{
	shm_box *b = &((shm_group *)g)->r->box[g->rank][peer];
	const size_t bytes = (size_t)count * comm_dtype_size(dt);
	for (size_t off = 0; off < bytes; off += SLOT) {
		double t0 = now_s();
		for (int spins = 0; atomic_load(&b->full); spins++) {
			if (now_s() - t0 > g->timeout_ms / 1000.0)
				return shm_wait_timeout(g, "send", err);
			pause_briefly(spins);
		}
		b->len = bytes - off < SLOT ? bytes - off : SLOT;
		memcpy(b->data, (const uint8_t *)buf + off, b->len);
		atomic_store(&b->full, 1);
	}
	return DS_OK;
}

static int shm_recv(comm_group *g, void *buf, int64_t count, comm_dtype dt, int peer, ds_err *err)
{
	shm_box *b = &((shm_group *)g)->r->box[peer][g->rank];
	const size_t bytes = (size_t)count * comm_dtype_size(dt);
	for (size_t off = 0; off < bytes; off += SLOT) {
		double t0 = now_s();
		for (int spins = 0; !atomic_load(&b->full); spins++) {
			if (now_s() - t0 > g->timeout_ms / 1000.0)
				return shm_wait_timeout(g, "recv", err);
			pause_briefly(spins);
		}
		size_t n = bytes - off < SLOT ? bytes - off : SLOT;
		if (b->len != n)
			return ds_err_set(err, DS_EFORMAT, "comm %s: recv of %zu bytes met a send of %zu",
					  g->name, n, b->len);
		memcpy((uint8_t *)buf + off, b->data, n);
		atomic_store(&b->full, 0);
	}
	return DS_OK;
}

static int shm_unsupported(comm_group *g, ds_err *err)
{
	return ds_err_set(err, DS_EUNSUPPORTED, "comm %s: the shm test backend lacks this call", g->name);
}

static int shm_reduce_scatter(comm_group *g, const void *send, void *recv, int64_t count, comm_dtype dt,
			      comm_op op, ds_err *err)
{
	return shm_unsupported(g, err);
}

static int shm_broadcast(comm_group *g, void *buf, int64_t count, comm_dtype dt, int root, ds_err *err)
{
	return shm_unsupported(g, err);
}

static int shm_all_to_allv(comm_group *g, const void *send, const int64_t *sc, const int64_t *sd, void *recv,
			   const int64_t *rc, const int64_t *rd, comm_dtype dt, ds_err *err)
{
	return shm_unsupported(g, err);
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
	.reduce_scatter = shm_reduce_scatter,
	.broadcast = shm_broadcast,
	.all_to_allv = shm_all_to_allv,
	.send = shm_send,
	.recv = shm_recv,
	.barrier = shm_barrier,
};

static comm_group *shm_group_new(shm_region *r, int rank, int size, const char *name, ds_err *err)
{
	shm_group *s = calloc(1, sizeof *s);
	comm_params p = comm_default_params();
	p.rank = rank;
	p.world_size = size;
	p.name = name;
	p.timeout_ms = 60000;
	if (!s || comm_group_init(&s->g, &shm_ops, &p, err)) {
		free(s);
		return NULL;
	}
	s->r = r;
	return &s->g;
}

static void *shared_map(size_t bytes)
{
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	return p == MAP_FAILED ? NULL : p;
}

/* ---- Gloo groups through the parent's store ---- */

static const char *store_addr; /* --comm gloo: the parent's store server */

static comm_group *gloo_group(const comm_store *st, const char *key, int rank, int size, const char *name,
			      ds_err *err)
{
	comm_params p = comm_default_params();
	p.rank = rank;
	p.world_size = size;
	p.name = name;
	if (size == 1)
		return comm_single_new(&p, err);
	char prefix[96];
	snprintf(prefix, sizeof prefix, "plan%ld/%s", (long)getppid(), key);
	return comm_gloo_new(&p, st, prefix, "127.0.0.1", err);
}

/* ---- the steps ---- */

typedef struct step_def {
	int n;
	int32_t tok[MAXTOK], seq[MAXTOK], pos[MAXTOK];
	uint8_t want[MAXTOK];
	int n_want;
} step_def;

static step_def steps[NSTEP];
static int32_t tables[NSEQ][MAXB];
static int V;

static void make_steps(void)
{
	uint64_t x = 0x9E3779B97F4A7C15ull;
	int len[NSEQ] = {0};
	for (int k = 0; k < NSTEP; k++) {
		step_def *s = &steps[k];
		int per[NSEQ] = {k == 0 ? 5 : k == 1 ? 3 : 1, k == 0 ? 4 : 1, k == 0 ? 0 : k == 1 ? 2 : 1};
		for (int q = 0; q < NSEQ; q++)
			for (int i = 0; i < per[q]; i++) {
				x ^= x << 13, x ^= x >> 7, x ^= x << 17;
				s->tok[s->n] = (int32_t)(x % (uint64_t)V);
				s->seq[s->n] = q;
				s->pos[s->n] = len[q]++;
				/* step 1 wants the last row of sequences 0 and 1 only:
				 * sequence 2's rows are a prefill chunk without logits
				 * (a micro-batch of it gathers no rows) */
				s->want[s->n] = k != 1 || (q < 2 && i == per[q] - 1);
				s->n_want += s->want[s->n];
				s->n++;
			}
	}
	for (int q = 0; q < NSEQ; q++)
		for (int b = 0; b < MAXB; b++)
			tables[q][b] = q * MAXB + b;
}

/* Runs every step; logits of step k at out + offset[k] (when out). */
static int run_steps(model *m, float *out, const int64_t *offset, ds_err *err)
{
	for (int k = 0; k < NSTEP; k++) {
		const step_def *s = &steps[k];
		eng_batch b = {.n_tok = s->n, .tokens = s->tok, .pos = s->pos, .seq = s->seq,
			       .want_logits = s->want, .n_seq = NSEQ, .block_tables = &tables[0][0],
			       .max_blocks = MAXB};
		int rc = model_forward(m, &b, out ? out + offset[k] : NULL, err);
		if (rc)
			return rc;
	}
	return DS_OK;
}

static model_params base_params(const char *path, enum model_attn attn)
{
	model_params p = model_default_params();
	p.path = path;
	p.backend = "cpu";
	p.threads = 1;
	p.max_batch_tokens = MAXTOK;
	p.max_ctx = MAXB * PAGE;
	p.max_seqs = NSEQ;
	p.page_size = PAGE;
	p.n_pages = NSEQ * MAXB;
	p.attn = attn;
	p.weights = MODEL_WEIGHTS_MMAP;
	return p;
}

typedef struct shared_out {
	atomic_int done; /* 1: logits written, 2: rank 0 failed */
	char msg[DS_ERR_MSG_MAX];
	size_t weight_bytes[MAXW];
	float logits[];
} shared_out;

static int rank_main(int r, const model_plan *plan, const char *path, enum model_attn attn,
		     shm_region *world_r, shm_region *stage_r, shm_region *tp_r, shared_out *out,
		     const int64_t *offset)
{
	ds_err err = {0};
	model_rank mr = {.plan = *plan, .rank = r};
	model_rank_coords(plan, r, &mr.stage, &mr.tp_rank, &mr.ep_rank);
	const int S = plan->tp * plan->ep, W = model_plan_world(plan);
	char sname[32], tname[32];
	snprintf(sname, sizeof sname, "stage%d", mr.stage);
	snprintf(tname, sizeof tname, "tp%d.%d", mr.stage, mr.ep_rank);
	comm_store st = {0};
	if (store_addr) { /* every rank makes the groups in the same order: world, stage, tp */
		if (comm_store_tcp_open(&st, store_addr, 30000, &err) == DS_OK &&
		    (mr.world = gloo_group(&st, "world", r, W, "world", &err)) &&
		    (mr.stage_grp = gloo_group(&st, sname, r % S, S, sname, &err)))
			mr.tp_grp = gloo_group(&st, tname, mr.tp_rank, plan->tp, tname, &err);
	} else {
		mr.world = shm_group_new(world_r, r, W, "world", &err);
		mr.stage_grp = mr.world ? shm_group_new(stage_r + mr.stage, r % S, S, sname, &err) : NULL;
		mr.tp_grp = mr.stage_grp ? shm_group_new(tp_r + mr.stage * plan->ep + mr.ep_rank, mr.tp_rank,
							 plan->tp, tname, &err)
					 : NULL;
	}
	model *m = NULL;
	int rc = mr.tp_grp ? DS_OK : DS_EINTERNAL;
	model_params p = base_params(path, attn);
	p.rank = &mr;
	if (!rc && !(m = model_load(&p, &err)))
		rc = err.code ? err.code : DS_EINTERNAL;
	if (!rc) {
		out->weight_bytes[r] = model_weight_bytes(m);
		rc = run_steps(m, r == 0 ? out->logits : NULL, offset, &err);
	}
	if (r == 0) {
		if (rc)
			ds_strlcpy(out->msg, err.msg, sizeof out->msg);
		atomic_store(&out->done, rc ? 2 : 1);
	}
	if (rc)
		fprintf(stderr, "plan_check: rank %d: %s\n", r, err.msg);
	model_free(m);
	comm_group_free(mr.tp_grp);
	comm_group_free(mr.stage_grp);
	comm_group_free(mr.world);
	if (store_addr)
		comm_store_tcp_close(&st);
	return rc ? 1 : 0;
}

static int argmax(const float *l)
{
	int best = 0;
	for (int v = 1; v < V; v++)
		best = l[v] > l[best] ? v : best;
	return best;
}

static int usage(void)
{
	fprintf(stderr, "usage: plan_check -m MODEL [--tp N] [--pp N] [--ep N] [--attn auto|naive|absorbed]"
			" [--comm gloo|shm] [--tol T]\n");
	return 2;
}

int main(int argc, char **argv)
{
	const char *path = NULL, *comm = "gloo";
	model_plan plan = {.tp = 1, .pp = 1, .ep = 1};
	enum model_attn attn = MODEL_ATTN_AUTO;
	double tol = 1e-5;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		int n = 0;
		if (!v)
			return usage();
		if (strcmp(a, "-m") == 0)
			path = v;
		else if (strcmp(a, "--comm") == 0)
			comm = v;
		else if (strcmp(a, "--tol") == 0) {
			if (ds_parse_double(v, 0, 1, &tol))
				return usage();
		} else if (strcmp(a, "--attn") == 0) {
			if (model_attn_parse(v, &attn))
				return usage();
		} else if ((strcmp(a, "--tp") == 0 || strcmp(a, "--pp") == 0 || strcmp(a, "--ep") == 0) &&
			   ds_parse_int(v, 1, MAXW, &n) == DS_OK)
			*(a[2] == 't' ? &plan.tp : a[2] == 'p' ? &plan.pp : &plan.ep) = n;
		else
			return usage();
		i++;
	}
	ds_err err = {0};
	const int shm = strcmp(comm, "shm") == 0;
	if (!path || (!shm && strcmp(comm, "gloo") != 0) || model_plan_check(&plan, &err) ||
	    model_plan_world(&plan) > MAXW)
		return usage();
	const int W = model_plan_world(&plan), S = plan.tp * plan.ep;

	/* the vocabulary, from a load in a child: the cpu backend's thread pool
	 * starts with the first kernel (norm conversions at load), and forked
	 * ranks must not inherit a started pool; the parent loads its one-rank
	 * reference only after the ranks are done */
	model_params p1 = base_params(path, attn);
	int vpipe[2];
	if (pipe(vpipe))
		return 2;
	pid_t probe = fork();
	if (probe == 0) {
		model *m = model_load(&p1, &err);
		int vv = m ? model_vocab_size(m) : -1;
		if (!m)
			fprintf(stderr, "plan_check: %s\n", err.msg);
		(void)!write(vpipe[1], &vv, sizeof vv);
		_exit(m ? 0 : 2);
	}
	int status = 0;
	if (read(vpipe[0], &V, sizeof V) != sizeof V || waitpid(probe, &status, 0) < 0 || V <= 0)
		return 2;
	make_steps();
	int64_t offset[NSTEP + 1] = {0};
	for (int k = 0; k < NSTEP; k++)
		offset[k + 1] = offset[k] + (int64_t)steps[k].n_want * V;

	shared_out *out = shared_map(sizeof(shared_out) + (size_t)offset[NSTEP] * sizeof(float));
	shm_region *world_r = NULL, *stage_r = NULL, *tp_r = NULL;
	if (shm) { /* one region per group: the world, each stage, each tp group */
		world_r = shared_map(sizeof(shm_region));
		stage_r = shared_map(sizeof(shm_region) * (size_t)plan.pp);
		tp_r = shared_map(sizeof(shm_region) * (size_t)(plan.pp * plan.ep));
	}
	if (!out || (shm && (!world_r || !stage_r || !tp_r)))
		return 2;
	comm_store_server *server = NULL;
	if (!shm) {
		if (!(server = comm_store_server_start("127.0.0.1", 0, &err))) {
			fprintf(stderr, "plan_check: store: %s\n", err.msg);
			return 2;
		}
		store_addr = comm_store_server_addr(server);
	}
	pid_t pids[MAXW];
	for (int r = 0; r < W; r++) {
		pids[r] = fork();
		if (pids[r] < 0)
			return 2;
		if (pids[r] == 0)
			_exit(rank_main(r, &plan, path, attn, world_r, stage_r, tp_r, out, offset));
	}
	int failed_ranks = 0;
	for (int r = 0; r < W; r++) {
		if (waitpid(pids[r], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
			failed_ranks++;
	}
	comm_store_server_stop(server);
	if (failed_ranks || atomic_load(&out->done) != 1) {
		fprintf(stderr, "plan_check: %d of %d ranks failed%s%s\n", failed_ranks, W,
			out->msg[0] ? ": " : "", out->msg);
		return 2;
	}

	model *ref = model_load(&p1, &err);
	float *want = ref ? malloc((size_t)offset[NSTEP] * sizeof(float)) : NULL;
	if (!want || run_steps(ref, want, offset, &err)) {
		fprintf(stderr, "plan_check: one rank: %s\n", err.msg);
		return 2;
	}
	size_t total = 0;
	for (int r = 0; r < W; r++)
		total += out->weight_bytes[r];
	printf("plan tp=%d pp=%d ep=%d (%d ranks, stage of %d): weight bytes per rank", plan.tp, plan.pp,
	       plan.ep, W, S);
	for (int r = 0; r < W; r++)
		printf(" %zu", out->weight_bytes[r]);
	printf(" (one rank %zu)\n", model_weight_bytes(ref));
	double worst = 0;
	int ids_ok = 1;
	for (int k = 0; k < NSTEP; k++) {
		double serr = 0;
		int same = 1;
		for (int row = 0; row < steps[k].n_want; row++) {
			const float *a = out->logits + offset[k] + (int64_t)row * V, *b = want + offset[k] + (int64_t)row * V;
			double num = 0, den = 0;
			for (int v = 0; v < V; v++) {
				num = fmax(num, fabs((double)a[v] - (double)b[v]));
				den = fmax(den, fabs((double)b[v]));
			}
			serr = fmax(serr, den > 0 ? num / den : num);
			same &= argmax(a) == argmax(b);
		}
		printf("step %d: %2d tokens, %d rows: max rel err %.3g, greedy ids %s\n", k, steps[k].n,
		       steps[k].n_want, serr, same ? "same" : "DIFFER");
		worst = fmax(worst, serr);
		ids_ok &= same;
	}
	int ok = worst <= tol && ids_ok && isfinite(worst);
	printf("plan_check: %s (max rel err %.3g, tol %g)\n", ok ? "ok" : "FAIL", worst, tol);
	free(want);
	model_free(ref);
	return ok ? 0 : 1;
}

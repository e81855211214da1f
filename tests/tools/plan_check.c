/*
 * plan_check.c - a model under a parallel plan gives the logits of one rank.
 * Run by tests/integration/test_plan_numerics.py and test_plan_llama.py over
 * plans x checkpoints.
 *
 * Usage: plan_check -m MODEL [--tp N] [--pp N] [--ep N] [--attn FORM]
 *                   [--tol T] [--batch-check]
 *
 * Forks tp * pp * ep rank processes first (before anything starts a
 * kernel thread pool, which a fork would not carry), each makes its world,
 * stage and tp groups and loads MODEL with its model_rank; then the parent
 * loads the model on one rank.  All of them run the same steps, with fixed
 * page tables (sequence s owns pages s * MAXB ...).  The steps (a schedule):
 *
 *   plan (the default)
 *     step 0   a prefill of 9 tokens of 2 sequences (5 + 4), every row's logits
 *     step 1   a prefill of 3 more tokens of sequence 0, 1 decode of sequence
 *              1 and the 2-token prefill of a third sequence; logits of the
 *              last row of sequences 0 and 1 only, none of the third (3
 *              sequences: pp = 3 gets 3 micro-batches, one without logits)
 *     step 2.. decodes of the three sequences (3 tokens a step)
 *
 *   --batch-check: 4 sequences together, then the same 4 alone
 *     together  one step of the 4 prompts (5, 3, 6 and 4 tokens; the last
 *               row of each), then NDEC steps of one decode of each of the 4
 *               (sequences 0..3)
 *     alone     each prompt in a step of its own, then its NDEC decodes one
 *               token a step (sequences 4..7)
 *     with the same tokens (the decodes are fixed tokens, not sampled).
 *     Under pp > 1 the model cuts a step of several sequences into
 *     micro-batches at sequence edges (model_micro_batches), so a
 *     together step runs as parts of fewer rows while an alone step is one
 *     part; the parent then also compares the plan's together rows with its
 *     alone rows (the same sequence and position) and fails unless every
 *     together step was cut into more than one micro-batch.  The count
 *     comes from model_micro_batches, the rule model_forward cuts by.
 *
 * World rank 0 hands its logits to the parent through a shared mapping; the
 * parent prints each step's max relative error against the one-rank model
 * (max |a - b| / max |b| over a row, worst row) and whether every row's
 * argmax (the greedy id) agrees, then "plan_check: ok" or "plan_check:
 * FAIL" (exit 1); 2 on a setup error.  These lines are what the tests read.
 *
 * Transport: Gloo, the product's CPU transport.  The parent serves the
 * rendezvous store on loopback (comm_store_server_start), each rank connects
 * to it and makes its groups with comm_gloo_new (keys "plan<pid>/world",
 * "plan<pid>/stage<s>", "plan<pid>/tp<s>.<e>"); a group of one rank is
 * comm_single_new.
 */
#include "comm/comm.h"
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
#include <unistd.h>

#define ADDR_BYTES 64              /* the store address a rank reads from its pipe */
#define MAXW 16    /* ranks */
#define MAXSEQ 8   /* sequences of a schedule */
#define MAXB 8     /* blocks per sequence */
#define PAGE 4     /* positions per page: prefills cross pages */
#define MAXSTEP 32 /* steps of a schedule */
#define MAXTOK 24  /* tokens of a step */
#define NBATCH 4   /* --batch-check: sequences decoded together */
#define NDEC 4     /* --batch-check: decode steps after the prompts */
#define NKEY (NBATCH * (1 + NDEC)) /* --batch-check: rows compared */

/* ---- Gloo groups through the parent's store ---- */

static const char *store_addr; /* the parent's store server */

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
	/* --batch-check: per wanted row in order, which row of which sequence
	 * it is (the same key in both schedules); whether the step is one of
	 * the together schedule */
	int32_t key[MAXTOK];
	int together;
} step_def;

static step_def steps[MAXSTEP];
static int nstep, nseq;
static int32_t tables[MAXSEQ][MAXB];
static int V;
static uint64_t rng = 0x9E3779B97F4A7C15ull;

static int32_t next_token(void)
{
	rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
	return (int32_t)(rng % (uint64_t)V);
}

static void add_token(step_def *s, int seq, int pos, int32_t tok, int want, int key)
{
	s->tok[s->n] = tok;
	s->seq[s->n] = seq;
	s->pos[s->n] = pos;
	s->want[s->n] = (uint8_t)want;
	if (want)
		s->key[s->n_want++] = key;
	s->n++;
}

static void make_tables(void)
{
	for (int q = 0; q < nseq; q++)
		for (int b = 0; b < MAXB; b++)
			tables[q][b] = q * MAXB + b;
}

/* The default schedule (see the top of the file). */
static void make_plan_steps(void)
{
	enum { NSEQ = 3, NSTEP = 6 };
	int len[NSEQ] = {0};
	nseq = NSEQ;
	nstep = NSTEP;
	for (int k = 0; k < NSTEP; k++) {
		step_def *s = &steps[k];
		int per[NSEQ] = {k == 0 ? 5 : k == 1 ? 3 : 1, k == 0 ? 4 : 1, k == 0 ? 0 : k == 1 ? 2 : 1};
		for (int q = 0; q < NSEQ; q++)
			for (int i = 0; i < per[q]; i++) {
				/* step 1 wants the last row of sequences 0 and 1 only:
				 * sequence 2's rows are a prefill chunk without logits
				 * (a micro-batch of it gathers no rows) */
				int32_t tok = next_token();
				add_token(s, q, len[q]++, tok, k != 1 || (q < 2 && i == per[q] - 1), 0);
			}
	}
	make_tables();
}

/* --batch-check's schedule: together on sequences 0..3, alone on 4..7.
 * Key of a row: sequence * (1 + NDEC) + (0 for its prompt's last row, 1 + d
 * for its decode d). */
static void make_batch_steps(void)
{
	static const int plen[NBATCH] = {5, 3, 6, 4};
	int32_t prompt[NBATCH][8], dec[NBATCH][NDEC];
	for (int q = 0; q < NBATCH; q++) {
		for (int i = 0; i < plen[q]; i++)
			prompt[q][i] = next_token();
		for (int d = 0; d < NDEC; d++)
			dec[q][d] = next_token();
	}
	nseq = 2 * NBATCH;
	nstep = 0;
	step_def *s = &steps[nstep++];
	s->together = 1;
	for (int q = 0; q < NBATCH; q++)
		for (int i = 0; i < plen[q]; i++)
			add_token(s, q, i, prompt[q][i], i == plen[q] - 1, q * (1 + NDEC));
	for (int d = 0; d < NDEC; d++) {
		s = &steps[nstep++];
		s->together = 1;
		for (int q = 0; q < NBATCH; q++)
			add_token(s, q, plen[q] + d, dec[q][d], 1, q * (1 + NDEC) + 1 + d);
	}
	for (int q = 0; q < NBATCH; q++) {
		s = &steps[nstep++];
		for (int i = 0; i < plen[q]; i++)
			add_token(s, NBATCH + q, i, prompt[q][i], i == plen[q] - 1, q * (1 + NDEC));
		for (int d = 0; d < NDEC; d++)
			add_token(&steps[nstep++], NBATCH + q, plen[q] + d, dec[q][d], 1, q * (1 + NDEC) + 1 + d);
	}
	make_tables();
}

/* How many micro-batches model_forward cuts a step into for pp stages
 * (engine/model.h: model_micro_batches, the rule forward_pipeline uses). */
static int micro_batch_count(const step_def *s, int pp)
{
	eng_batch b = {.n_tok = s->n, .tokens = s->tok, .pos = s->pos, .seq = s->seq};
	int cut[MODEL_MAX_MICRO + 1];
	return model_micro_batches(&b, pp, cut, MODEL_MAX_MICRO);
}

/* Runs every step; logits of step k at out + offset[k] (when out). */
static int run_steps(model *m, float *out, const int64_t *offset, ds_err *err)
{
	for (int k = 0; k < nstep; k++) {
		const step_def *s = &steps[k];
		eng_batch b = {.n_tok = s->n, .tokens = s->tok, .pos = s->pos, .seq = s->seq,
			       .want_logits = s->want, .n_seq = nseq, .block_tables = &tables[0][0],
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
	p.max_seqs = nseq;
	p.page_size = PAGE;
	p.n_pages = nseq * MAXB;
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

static void *shared_map(size_t bytes)
{
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	return p == MAP_FAILED ? NULL : p;
}

static int rank_main(int r, const model_plan *plan, const char *path, enum model_attn attn, shared_out *out,
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
	/* every rank makes the groups in the same order: world, stage, tp */
	if (comm_store_tcp_open(&st, store_addr, 30000, &err) == DS_OK &&
	    (mr.world = gloo_group(&st, "world", r, W, "world", &err)) &&
	    (mr.stage_grp = gloo_group(&st, sname, r % S, S, sname, &err)))
		mr.tp_grp = gloo_group(&st, tname, mr.tp_rank, plan->tp, tname, &err);
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

/* max |a - b| / max |b| over one row of V logits */
static double row_rel_err(const float *a, const float *b)
{
	double num = 0, den = 0;
	for (int v = 0; v < V; v++) {
		num = fmax(num, fabs((double)a[v] - (double)b[v]));
		den = fmax(den, fabs((double)b[v]));
	}
	return den > 0 ? num / den : num;
}

/* --batch-check: the plan's together rows against its alone rows, and the
 * micro-batch count of each together step.  Returns 1 when both hold. */
static int compare_batch(const float *logits, const int64_t *offset, int pp, double tol)
{
	int64_t at[2][NKEY]; /* [together][key]: the row's offset */
	int mb_min = MAXTOK, mb_max = 0;
	for (int k = 0; k < nstep; k++) {
		for (int row = 0; row < steps[k].n_want; row++)
			at[steps[k].together][steps[k].key[row]] = offset[k] + (int64_t)row * V;
		if (steps[k].together) {
			int mb = micro_batch_count(&steps[k], pp);
			mb_min = mb < mb_min ? mb : mb_min;
			mb_max = mb > mb_max ? mb : mb_max;
		}
	}
	double worst = 0;
	int same = 1;
	for (int key = 0; key < NKEY; key++) {
		const float *a = logits + at[1][key], *b = logits + at[0][key];
		worst = fmax(worst, row_rel_err(a, b));
		same &= argmax(a) == argmax(b);
	}
	const int cut = pp == 1 || mb_min > 1;
	printf("batch: steps of %d sequences together cut into %d..%d micro-batches (pp %d)%s\n",
	       NBATCH, mb_min, mb_max, pp, cut ? "" : ": NOT CUT");
	printf("batch: %d rows together vs alone: max rel err %.3g, greedy ids %s\n", NKEY, worst,
	       same ? "same" : "DIFFER");
	return cut && same && worst <= tol && isfinite(worst);
}

static int usage(void)
{
	fprintf(stderr, "usage: plan_check -m MODEL [--tp N] [--pp N] [--ep N] [--attn auto|naive|absorbed]"
			" [--tol T] [--batch-check]\n");
	return 2;
}

int main(int argc, char **argv)
{
	const char *path = NULL;
	model_plan plan = {.tp = 1, .pp = 1, .ep = 1};
	enum model_attn attn = MODEL_ATTN_AUTO;
	double tol = 1e-5;
	int batch_check = 0;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		int n = 0;
		if (strcmp(a, "--batch-check") == 0) {
			batch_check = 1;
			continue;
		}
		if (!v)
			return usage();
		if (strcmp(a, "-m") == 0)
			path = v;
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
	if (!path || model_plan_check(&plan, &err) || model_plan_world(&plan) > MAXW)
		return usage();
	const int W = model_plan_world(&plan), S = plan.tp * plan.ep;
	nseq = batch_check ? 2 * NBATCH : 3; /* base_params sizes the KV cache by it */

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
	if (batch_check)
		make_batch_steps();
	else
		make_plan_steps();
	int64_t offset[MAXSTEP + 1] = {0};
	for (int k = 0; k < nstep; k++)
		offset[k + 1] = offset[k] + (int64_t)steps[k].n_want * V;

	shared_out *out = shared_map(sizeof(shared_out) + (size_t)offset[nstep] * sizeof(float));
	if (!out)
		return 2;
	/* the ranks are forked before the store server's thread exists: a
	 * child forked beside a running thread can inherit a lock that thread
	 * held (the allocator's, under the sanitizers) and hang; each rank
	 * reads the server's address from a pipe instead */
	int apipe[2];
	if (pipe(apipe))
		return 2;
	pid_t pids[MAXW];
	for (int r = 0; r < W; r++) {
		pids[r] = fork();
		if (pids[r] < 0)
			return 2;
		if (pids[r] == 0) {
			static char addr[ADDR_BYTES];
			close(apipe[1]);
			if (read(apipe[0], addr, sizeof addr) != (ssize_t)sizeof addr)
				_exit(2);
			addr[sizeof addr - 1] = 0;
			store_addr = addr;
			_exit(rank_main(r, &plan, path, attn, out, offset));
		}
	}
	close(apipe[0]);
	comm_store_server *server = comm_store_server_start("127.0.0.1", 0, &err);
	if (!server)
		fprintf(stderr, "plan_check: store: %s\n", err.msg);
	char addr[ADDR_BYTES] = {0};
	if (server)
		snprintf(addr, sizeof addr, "%s", comm_store_server_addr(server));
	for (int r = 0; server && r < W; r++) /* one whole message per rank (< PIPE_BUF) */
		if (write(apipe[1], addr, sizeof addr) != (ssize_t)sizeof addr)
			break;
	close(apipe[1]); /* without a server the ranks read the end and exit */
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
	float *want = ref ? malloc((size_t)offset[nstep] * sizeof(float)) : NULL;
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
	for (int k = 0; k < nstep; k++) {
		double serr = 0;
		int same = 1;
		for (int row = 0; row < steps[k].n_want; row++) {
			const float *a = out->logits + offset[k] + (int64_t)row * V, *b = want + offset[k] + (int64_t)row * V;
			serr = fmax(serr, row_rel_err(a, b));
			same &= argmax(a) == argmax(b);
		}
		printf("step %d: %2d tokens, %d rows: max rel err %.3g, greedy ids %s\n", k, steps[k].n,
		       steps[k].n_want, serr, same ? "same" : "DIFFER");
		worst = fmax(worst, serr);
		ids_ok &= same;
	}
	int ok = worst <= tol && ids_ok && isfinite(worst);
	if (batch_check)
		ok &= compare_batch(out->logits, offset, plan.pp, tol);
	printf("plan_check: %s (max rel err %.3g, tol %g)\n", ok ? "ok" : "FAIL", worst, tol);
	free(want);
	model_free(ref);
	return ok ? 0 : 1;
}

/*
 * test_comm.c - the collectives of comm/comm.h on the one-rank group,
 * against references computed here from every rank's inputs.
 *
 * The cases are a table (coll_cases): each collective has a run function
 * (this rank's call through comm.h, out of place or in the in-place form of
 * comm.h) and a reference (what rank `rank` of W must receive, computed
 * from the inputs of all W ranks).  Every rank draws the inputs of all W
 * ranks from the same random sequence (ut_rand_*, seeded by the test's
 * name), so a multi-rank run of the same table (the conformance program of
 * the distributed engine: one process per rank, each with its own group)
 * computes the same references without exchanging anything.  Here W = 1,
 * where every result must be bit-exact; the reductions' references round
 * once from an f32 accumulator, as comm.h says backends do, and a
 * multi-rank backend gets a tolerance for the order of its sums (cmp_tol).
 *
 * The boundary (comm.c) is also tested with W = 2 through a fake backend
 * whose ops succeed or fail on command: what is refused before a backend
 * is reached, and that a timeout or a dead peer breaks the group for good.
 *
 * The Gloo backend runs the same table with W = 1..8 ranks, each a forked
 * child of the test with the rendezvous store served by the test process
 * (run_ranks); then send/recv and barrier, bit-identical reductions across
 * ranks and reruns with random delays, and failures that must end in a
 * DS_E* code within the timeout: a peer that dies inside a collective or
 * exits, a peer that stalls, a rank that never comes, garbage in the store
 * and garbage on a rank's transport port (where Gloo aborts the process:
 * the test accepts that outcome, documented in docs/distributed.md, and
 * checks that nothing hangs).
 */
#include "comm/comm.h"
#include "comm/comm_impl.h" /* a fake backend for the boundary tests */
#include "kernels/cpu/cpu.h"
#include "tests/unit/store_proc.h"
#include "tests/unit/unit.h"

#include "common/strutil.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define GUARD 16     /* elements past every output that must stay untouched */
#define SENTINEL 0xA5 /* fill byte of outputs before a call */
#define W_MAX 8

static const comm_dtype all_dtypes[] = {COMM_F32, COMM_BF16, COMM_F16, COMM_I32, COMM_U8};
static const comm_op all_ops[] = {COMM_SUM, COMM_MAX, COMM_MIN};

/* ---- element helpers (independent of comm/) ---- */

static uint16_t f32_to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
	return (uint16_t)(u >> 16);
}

static uint16_t f32_to_f16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	uint32_t sign = (u >> 16) & 0x8000u, mant = u & 0x7FFFFFu;
	int exp = (int)((u >> 23) & 0xFF) - 127 + 15;
	if (exp >= 31)
		return (uint16_t)(sign | 0x7C00u);
	if (exp <= 0) { /* subnormal */
		if (exp < -10)
			return (uint16_t)sign;
		mant |= 0x800000u;
		int shift = 14 - exp;
		uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
		if (rem > half || (rem == half && (h & 1)))
			h++;
		return (uint16_t)(sign | h);
	}
	uint32_t h = ((uint32_t)exp << 10) | (mant >> 13), rem = mant & 0x1FFFu;
	if (rem > 0x1000u || (rem == 0x1000u && (h & 1)))
		h++;
	return (uint16_t)(sign | h);
}

static float load_f(const void *p, comm_dtype dt, int64_t i)
{
	uint16_t h;
	switch (dt) {
	case COMM_F32: {
		float f;
		memcpy(&f, (const char *)p + 4 * i, 4);
		return f;
	}
	case COMM_BF16:
		memcpy(&h, (const char *)p + 2 * i, 2);
		return kc_bf16_to_f32(h);
	case COMM_F16:
		memcpy(&h, (const char *)p + 2 * i, 2);
		return kc_f16_to_f32(h);
	default:
		return 0.0f;
	}
}

static void store_f(void *p, comm_dtype dt, int64_t i, float f)
{
	uint16_t h;
	switch (dt) {
	case COMM_F32:
		memcpy((char *)p + 4 * i, &f, 4);
		break;
	case COMM_BF16:
		h = f32_to_bf16(f);
		memcpy((char *)p + 2 * i, &h, 2);
		break;
	case COMM_F16:
		h = f32_to_f16(f);
		memcpy((char *)p + 2 * i, &h, 2);
		break;
	default:
		break;
	}
}

/* n random elements, never zero: magnitudes in [0.25, 4) with either sign
 * for the floats, [1, 2^20] for i32, [1, 255] for u8. */
static void fill_random(void *p, comm_dtype dt, int64_t n)
{
	for (int64_t i = 0; i < n; i++) {
		uint64_t r = ut_rand_u64();
		float f = ut_rand_float(0.25f, 4.0f) * ((r & 1) ? -1.0f : 1.0f);
		if (dt == COMM_I32) {
			int32_t v = (int32_t)(1 + (r >> 8) % (1u << 20)) * ((r & 1) ? -1 : 1);
			memcpy((char *)p + 4 * i, &v, 4);
		} else if (dt == COMM_U8) {
			((uint8_t *)p)[i] = (uint8_t)(1 + (r >> 8) % 255);
		} else {
			store_f(p, dt, i, f);
		}
	}
}

/* out[i] = op over the W inputs of element i, in rank order. */
static void ref_reduce(int W, const void *const ins[], int64_t off, void *out, int64_t n,
		       comm_dtype dt, comm_op op)
{
	size_t es = comm_dtype_size(dt);
	for (int64_t i = 0; i < n; i++) {
		if (dt == COMM_I32 || dt == COMM_U8) {
			int64_t acc = 0;
			for (int r = 0; r < W; r++) {
				int64_t v;
				if (dt == COMM_I32) {
					int32_t x;
					memcpy(&x, (const char *)ins[r] + (off + i) * (int64_t)es, 4);
					v = x;
				} else {
					v = ((const uint8_t *)ins[r])[off + i];
				}
				acc = r == 0 ? v : op == COMM_SUM ? acc + v : op == COMM_MAX ? (v > acc ? v : acc)
											: (v < acc ? v : acc);
			}
			if (dt == COMM_I32) {
				int32_t x = (int32_t)(uint32_t)(uint64_t)acc; /* wraps like the transports */
				memcpy((char *)out + i * 4, &x, 4);
			} else {
				((uint8_t *)out)[i] = (uint8_t)(uint64_t)acc;
			}
			continue;
		}
		float acc = 0.0f;
		for (int r = 0; r < W; r++) {
			float v = load_f(ins[r], dt, off + i);
			acc = r == 0 ? v : op == COMM_SUM ? acc + v : op == COMM_MAX ? (v > acc ? v : acc)
										: (v < acc ? v : acc);
		}
		store_f(out, dt, i, acc);
	}
}

/* ---- the table of collectives ---- */

typedef struct coll_args {
	int W, rank;
	int64_t count;
	comm_dtype dt;
	comm_op op;
} coll_args;

/* all_to_allv layout: elements rank s sends to rank d (never all zero), and
 * one unused element before every range so displacements matter. */
static int64_t a2a_count(const coll_args *a, int s, int d)
{
	return (a->count + s * 3 + d * 5) % (a->count + 1);
}

static void a2a_layout(const coll_args *a, int me, int sending, int64_t *counts, int64_t *displs,
		       int64_t *total)
{
	int64_t off = 0;
	for (int p = 0; p < a->W; p++) {
		counts[p] = sending ? a2a_count(a, me, p) : a2a_count(a, p, me);
		displs[p] = off + 1;
		off += counts[p] + 1;
	}
	*total = off;
}

typedef struct coll_case {
	const char *name;
	int reduces;  /* takes a comm_op */
	int in_place; /* has an in-place form */
	/* elements of rank r's input and of its output */
	void (*sizes)(const coll_args *a, int r, int64_t *n_in, int64_t *n_out);
	/* runs this rank's call; out has n_out elements (+ GUARD); in place uses
	 * scratch (n_in + n_out elements) and copies the result to out */
	int (*run)(comm_group *g, const coll_args *a, const void *in, void *out, void *scratch,
		   int in_place, ds_err *err);
	/* out (n_out elements, prefilled with SENTINEL) = rank a->rank's result */
	void (*ref)(const coll_args *a, const void *const ins[], void *out);
} coll_case;

static void sizes_same(const coll_args *a, int r, int64_t *n_in, int64_t *n_out)
{
	*n_in = *n_out = a->count;
}

static void sizes_gather(const coll_args *a, int r, int64_t *n_in, int64_t *n_out)
{
	*n_in = a->count;
	*n_out = a->count * a->W;
}

static void sizes_scatter(const coll_args *a, int r, int64_t *n_in, int64_t *n_out)
{
	*n_in = a->count * a->W;
	*n_out = a->count;
}

static void sizes_a2a(const coll_args *a, int r, int64_t *n_in, int64_t *n_out)
{
	int64_t c[W_MAX], d[W_MAX];
	a2a_layout(a, r, 1, c, d, n_in);
	a2a_layout(a, r, 0, c, d, n_out);
}

static int run_all_reduce(comm_group *g, const coll_args *a, const void *in, void *out,
			  void *scratch, int in_place, ds_err *err)
{
	size_t n = (size_t)a->count * comm_dtype_size(a->dt);
	if (!in_place)
		return comm_all_reduce(g, in, out, a->count, a->dt, a->op, err);
	memcpy(scratch, in, n);
	int rc = comm_all_reduce(g, scratch, scratch, a->count, a->dt, a->op, err);
	memcpy(out, scratch, n);
	return rc;
}

static void ref_all_reduce(const coll_args *a, const void *const ins[], void *out)
{
	ref_reduce(a->W, ins, 0, out, a->count, a->dt, a->op);
}

static int run_all_gather(comm_group *g, const coll_args *a, const void *in, void *out,
			  void *scratch, int in_place, ds_err *err)
{
	size_t n = (size_t)a->count * comm_dtype_size(a->dt);
	if (!in_place)
		return comm_all_gather(g, in, out, a->count, a->dt, err);
	char *mine = (char *)scratch + (size_t)a->rank * n;
	memset(scratch, SENTINEL, n * (size_t)a->W);
	memcpy(mine, in, n);
	int rc = comm_all_gather(g, mine, scratch, a->count, a->dt, err);
	memcpy(out, scratch, n * (size_t)a->W);
	return rc;
}

static void ref_all_gather(const coll_args *a, const void *const ins[], void *out)
{
	size_t n = (size_t)a->count * comm_dtype_size(a->dt);
	for (int r = 0; r < a->W; r++)
		memcpy((char *)out + (size_t)r * n, ins[r], n);
}

static int run_reduce_scatter(comm_group *g, const coll_args *a, const void *in, void *out,
			      void *scratch, int in_place, ds_err *err)
{
	size_t n = (size_t)a->count * comm_dtype_size(a->dt);
	if (!in_place)
		return comm_reduce_scatter(g, in, out, a->count, a->dt, a->op, err);
	memcpy(scratch, in, n * (size_t)a->W);
	char *mine = (char *)scratch + (size_t)a->rank * n;
	int rc = comm_reduce_scatter(g, scratch, mine, a->count, a->dt, a->op, err);
	memcpy(out, mine, n);
	return rc;
}

static void ref_reduce_scatter(const coll_args *a, const void *const ins[], void *out)
{
	ref_reduce(a->W, ins, (int64_t)a->rank * a->count, out, a->count, a->dt, a->op);
}

/* root = the last rank, so that on W > 1 most ranks receive */
static int run_broadcast(comm_group *g, const coll_args *a, const void *in, void *out,
			 void *scratch, int in_place, ds_err *err)
{
	memcpy(out, in, (size_t)a->count * comm_dtype_size(a->dt));
	return comm_broadcast(g, out, a->count, a->dt, a->W - 1, err);
}

static void ref_broadcast(const coll_args *a, const void *const ins[], void *out)
{
	memcpy(out, ins[a->W - 1], (size_t)a->count * comm_dtype_size(a->dt));
}

static int run_all_to_allv(comm_group *g, const coll_args *a, const void *in, void *out,
			   void *scratch, int in_place, ds_err *err)
{
	int64_t sc[W_MAX], sd[W_MAX], rc_[W_MAX], rd[W_MAX], n;
	a2a_layout(a, a->rank, 1, sc, sd, &n);
	a2a_layout(a, a->rank, 0, rc_, rd, &n);
	return comm_all_to_allv(g, in, sc, sd, out, rc_, rd, a->dt, err);
}

static void ref_all_to_allv(const coll_args *a, const void *const ins[], void *out)
{
	size_t es = comm_dtype_size(a->dt);
	int64_t rcnt[W_MAX], rd[W_MAX], n;
	a2a_layout(a, a->rank, 0, rcnt, rd, &n);
	for (int s = 0; s < a->W; s++) {
		int64_t sc[W_MAX], sd[W_MAX];
		a2a_layout(a, s, 1, sc, sd, &n);
		memcpy((char *)out + (size_t)rd[s] * es, (const char *)ins[s] + (size_t)sd[a->rank] * es,
		       (size_t)sc[a->rank] * es);
	}
}

static const coll_case coll_cases[] = {
	{.name = "all_reduce", .reduces = 1, .in_place = 1, .sizes = sizes_same,
	 .run = run_all_reduce, .ref = ref_all_reduce},
	{.name = "all_gather", .reduces = 0, .in_place = 1, .sizes = sizes_gather,
	 .run = run_all_gather, .ref = ref_all_gather},
	{.name = "reduce_scatter", .reduces = 1, .in_place = 1, .sizes = sizes_scatter,
	 .run = run_reduce_scatter, .ref = ref_reduce_scatter},
	{.name = "broadcast", .reduces = 0, .in_place = 0, .sizes = sizes_same,
	 .run = run_broadcast, .ref = ref_broadcast},
	{.name = "all_to_allv", .reduces = 0, .in_place = 0, .sizes = sizes_a2a,
	 .run = run_all_to_allv, .ref = ref_all_to_allv},
};

/* 0 when got equals want: bit-exact when tol is 0, else (float
 * reductions of W > 1 ranks, summed in another order than the reference's)
 * within tol absolute plus one unit of the dtype's precision relative: an
 * f32 sum in another order differs by a few ulps of the inputs' scale, and
 * bf16/f16 results rounded once from it by at most one ulp. */
static int cmp_tol(const void *got, const void *want, int64_t n, comm_dtype dt, double tol)
{
	if (tol == 0.0 || dt == COMM_I32 || dt == COMM_U8)
		return memcmp(got, want, (size_t)n * comm_dtype_size(dt)) != 0;
	double rel = dt == COMM_BF16 ? 1.0 / 128 : dt == COMM_F16 ? 1.0 / 1024 : 1e-6;
	for (int64_t i = 0; i < n; i++) {
		double x = load_f(got, dt, i), y = load_f(want, dt, i);
		if (!(fabs(x - y) <= tol + rel * fabs(y)))
			return 1;
	}
	return 0;
}

/* Runs one case on g (rank and size from g) and checks it; returns the
 * number of failures. */
static int check_case(comm_group *g, const coll_case *cc, comm_dtype dt, comm_op op, int64_t count,
		      int in_place, double tol)
{
	coll_args a = {.W = comm_group_size(g), .rank = comm_group_rank(g), .count = count, .dt = dt,
		       .op = op};
	size_t es = comm_dtype_size(dt);
	void *ins[W_MAX] = {0};
	int64_t n_in = 0, n_out = 0, n;
	int fails = 0;
	for (int r = 0; r < a.W; r++) { /* every rank's inputs, in rank order */
		cc->sizes(&a, r, &n, &n_out);
		ins[r] = malloc((size_t)(n + 1) * es);
		fill_random(ins[r], dt, n);
		if (r == a.rank)
			n_in = n;
	}
	cc->sizes(&a, a.rank, &n_in, &n_out);
	size_t out_bytes = (size_t)(n_out + GUARD) * es;
	char *out = malloc(out_bytes), *want = malloc(out_bytes);
	char *scratch = malloc((size_t)(n_in + n_out + 1) * es);
	char *in_copy = malloc((size_t)(n_in + 1) * es);
	memset(out, SENTINEL, out_bytes);
	memset(want, SENTINEL, out_bytes);
	memcpy(in_copy, ins[a.rank], (size_t)n_in * es);
	cc->ref(&a, (const void *const *)ins, want);
	ds_err err = {0};
	int rc = cc->run(g, &a, ins[a.rank], out, scratch, in_place, &err);
	if (rc) {
		ut_fail(__FILE__, __LINE__, "%s %s %s count %lld%s: %s", cc->name, comm_dtype_name(dt),
			cc->reduces ? comm_op_name(op) : "", (long long)count, in_place ? " in place" : "",
			err.msg);
		fails++;
	} else if (cmp_tol(out, want, n_out, dt, tol) ||
		   memcmp(out + n_out * es, want + n_out * es, GUARD * es) != 0 ||
		   memcmp(in_copy, ins[a.rank], (size_t)n_in * es) != 0) {
		ut_fail(__FILE__, __LINE__, "%s %s %s count %lld%s: result differs from the reference "
					    "(or wrote past it, or changed its input)",
			cc->name, comm_dtype_name(dt), cc->reduces ? comm_op_name(op) : "", (long long)count,
			in_place ? " in place" : "");
		fails++;
	}
	for (int r = 0; r < a.W; r++)
		free(ins[r]);
	free(out);
	free(want);
	free(scratch);
	free(in_copy);
	return fails;
}

/* Every collective x dtype x op x count x (out of place, in place). */
static int check_all_cases(comm_group *g, double tol)
{
	static const int64_t counts[] = {1, 7, 1000};
	int fails = 0;
	for (size_t c = 0; c < sizeof coll_cases / sizeof coll_cases[0]; c++) {
		const coll_case *cc = &coll_cases[c];
		for (size_t d = 0; d < sizeof all_dtypes / sizeof all_dtypes[0]; d++)
			for (size_t o = 0; o < (cc->reduces ? 3u : 1u); o++)
				for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++)
					for (int ip = 0; ip <= cc->in_place; ip++)
						fails += check_case(g, cc, all_dtypes[d], all_ops[o],
								    counts[k], ip, tol);
	}
	return fails;
}

TEST(comm_single_collectives_match_reference)
{
	ds_err err = {0};
	comm_group *g = comm_single_new(NULL, &err);
	CHECK(g != NULL);
	if (!g)
		return;
	CHECK_EQ(check_all_cases(g, 0.0), 0);
	comm_group_free(g);
}

TEST(comm_f16_bf16_helpers_round_trip)
{
	/* the test's own encoders: exact on values that fit, ties to even */
	for (int i = 0; i < 1000; i++) {
		float f = ut_rand_float(-4.0f, 4.0f);
		uint16_t b = f32_to_bf16(f), h = f32_to_f16(f);
		CHECK_EQ(f32_to_bf16(kc_bf16_to_f32(b)), b);
		CHECK_EQ(f32_to_f16(kc_f16_to_f32(h)), h);
		CHECK_NEAR(kc_bf16_to_f32(b), f, fabs(f) / 256.0);
		CHECK_NEAR(kc_f16_to_f32(h), f, fabs(f) / 2048.0);
	}
	CHECK_EQ(f32_to_f16(1.0f + 1.0f / 2048.0f), 0x3C00); /* tie: to even */
	CHECK_EQ(f32_to_f16(1.0f + 3.0f / 2048.0f), 0x3C02);
	CHECK_EQ(f32_to_bf16(1.0f + 1.0f / 256.0f), 0x3F80);
	CHECK_EQ(f32_to_f16(65536.0f * 2), 0x7C00);
}

TEST(comm_single_group_accessors)
{
	ds_err err = {0};
	comm_params p = comm_default_params();
	CHECK_EQ(p.world_size, 1);
	CHECK_EQ(p.rank, 0);
	CHECK(p.timeout_ms > 0);
	p.name = "tp";
	comm_group *g = comm_single_new(&p, &err);
	CHECK(g != NULL);
	if (!g)
		return;
	CHECK_EQ(comm_group_rank(g), 0);
	CHECK_EQ(comm_group_size(g), 1);
	CHECK_STR(comm_group_name(g), "tp");
	CHECK_STR(comm_group_backend(g), "single");
	CHECK_EQ(comm_group_mem(g), COMM_MEM_HOST);
	CHECK_EQ(comm_group_timeout_ms(g), COMM_TIMEOUT_MS_DEFAULT);
	CHECK_EQ(comm_group_set_timeout(g, 250, &err), DS_OK);
	CHECK_EQ(comm_group_timeout_ms(g), 250);
	CHECK_EQ(comm_group_set_timeout(g, 0, &err), DS_EINVAL);
	CHECK(strstr(err.msg, "positive") != NULL);
	CHECK_EQ(comm_group_timeout_ms(g), 250);
	CHECK_EQ(comm_barrier(g, &err), DS_OK);
	CHECK_EQ(comm_group_sync(g, &err), DS_OK);
	CHECK_EQ(comm_dtype_size(COMM_F32), 4);
	CHECK_EQ(comm_dtype_size(COMM_BF16), 2);
	CHECK_EQ(comm_dtype_size(COMM_F16), 2);
	CHECK_EQ(comm_dtype_size(COMM_I32), 4);
	CHECK_EQ(comm_dtype_size(COMM_U8), 1);
	CHECK_EQ(comm_dtype_size((comm_dtype)42), 0);
	CHECK_STR(comm_dtype_name(COMM_BF16), "bf16");
	CHECK_STR(comm_op_name(COMM_SUM), "sum");
	comm_group_free(g);
	comm_group_free(NULL);
}

TEST(comm_single_new_refuses_bad_params)
{
	ds_err err = {0};
	comm_params p = comm_default_params();
	p.world_size = 2;
	CHECK(comm_single_new(&p, &err) == NULL);
	CHECK_EQ(err.code, DS_EINVAL);
	CHECK(strstr(err.msg, "multi-rank backend") != NULL);
	p = comm_default_params();
	p.rank = 1;
	CHECK(comm_single_new(&p, &err) == NULL);
	CHECK(strstr(err.msg, "rank 1 is outside 0..0") != NULL);
	p = comm_default_params();
	p.timeout_ms = 0;
	CHECK(comm_single_new(&p, &err) == NULL);
	CHECK(strstr(err.msg, "timeout") != NULL);
}

/* rc must be DS_EINVAL and the message must contain want. */
#define CHECK_BAD(call, want)                                                            \
	do {                                                                             \
		ds_err_clear(&err);                                                      \
		CHECK_EQ((call), DS_EINVAL);                                             \
		if (!strstr(err.msg, (want)))                                            \
			ut_fail(__FILE__, __LINE__, "%s: message \"%s\" lacks \"%s\"", #call, \
				err.msg, (want));                                        \
	} while (0)

TEST(comm_single_refuses_bad_arguments)
{
	ds_err err = {0};
	comm_group *g = comm_single_new(NULL, &err);
	CHECK(g != NULL);
	if (!g)
		return;
	float buf[16], out[16];
	for (int i = 0; i < 16; i++)
		buf[i] = ut_rand_float(0.5f, 2.0f);
	int64_t c1[1] = {4}, d1[1] = {0}, neg[1] = {-1}, c3[1] = {3};

	CHECK_BAD(comm_all_reduce(NULL, buf, out, 4, COMM_F32, COMM_SUM, &err), "no group");
	CHECK_BAD(comm_all_reduce(g, buf, out, -1, COMM_F32, COMM_SUM, &err), "count -1 is negative");
	CHECK_BAD(comm_all_reduce(g, NULL, out, 4, COMM_F32, COMM_SUM, &err), "send buffer is NULL");
	CHECK_BAD(comm_all_reduce(g, buf, NULL, 4, COMM_F32, COMM_SUM, &err), "recv buffer is NULL");
	CHECK_BAD(comm_all_reduce(g, buf, out, 4, (comm_dtype)99, COMM_SUM, &err), "unknown dtype 99");
	CHECK_BAD(comm_all_reduce(g, buf, out, 4, COMM_F32, (comm_op)9, &err), "unknown reduce op 9");
	CHECK_BAD(comm_all_reduce(g, buf, buf + 1, 4, COMM_F32, COMM_SUM, &err), "overlap");
	CHECK_BAD(comm_all_reduce(g, buf, out, INT64_MAX / 2, COMM_F32, COMM_SUM, &err), "too large");
	CHECK_BAD(comm_all_gather(g, buf, out, -3, COMM_F32, &err), "negative");
	CHECK_BAD(comm_all_gather(g, buf + 1, buf, 4, COMM_F32, &err), "in place");
	CHECK_BAD(comm_reduce_scatter(g, buf, buf + 2, 4, COMM_F32, COMM_SUM, &err), "in place");
	CHECK_BAD(comm_reduce_scatter(g, buf, out, 4, COMM_I32, (comm_op)0, &err), "unknown reduce op");
	CHECK_BAD(comm_broadcast(g, buf, 4, COMM_F32, 1, &err), "root 1 is outside 0..0");
	CHECK_BAD(comm_broadcast(g, buf, 4, COMM_F32, -1, &err), "root -1");
	CHECK_BAD(comm_broadcast(g, NULL, 4, COMM_F32, 0, &err), "NULL");
	CHECK_BAD(comm_send(g, buf, 4, COMM_F32, 0, &err), "no loopback");
	CHECK_BAD(comm_recv(g, out, 4, COMM_F32, 0, &err), "no loopback");
	CHECK_BAD(comm_send(g, buf, 4, COMM_F32, 1, &err), "peer 1 is outside 0..0");
	CHECK_BAD(comm_recv(g, out, -2, COMM_F32, 0, &err), "negative");
	CHECK_BAD(comm_all_to_allv(g, buf, NULL, d1, out, c1, d1, COMM_F32, &err), "send counts");
	CHECK_BAD(comm_all_to_allv(g, buf, c1, d1, out, c1, NULL, COMM_F32, &err), "recv counts");
	CHECK_BAD(comm_all_to_allv(g, buf, neg, d1, out, c1, d1, COMM_F32, &err), "send_counts[0] -1");
	CHECK_BAD(comm_all_to_allv(g, buf, c1, neg, out, c1, d1, COMM_F32, &err), "send_displs[0] -1");
	CHECK_BAD(comm_all_to_allv(g, buf, c1, d1, out, c3, d1, COMM_F32, &err),
		  "sends 4 elements to itself but its recv_counts[0] is 3");
	CHECK_BAD(comm_all_to_allv(g, buf, c1, d1, buf, c1, d1, COMM_F32, &err), "overlap");
	CHECK_BAD(comm_all_to_allv(g, NULL, c1, d1, out, c1, d1, COMM_F32, &err), "send buffer is NULL");

	/* argument errors leave the group usable; empty calls need no buffers */
	CHECK_EQ(comm_all_reduce(g, buf, out, 4, COMM_F32, COMM_SUM, &err), DS_OK);
	CHECK(memcmp(buf, out, 4 * sizeof(float)) == 0);
	CHECK_EQ(comm_all_reduce(g, NULL, NULL, 0, COMM_F32, COMM_SUM, &err), DS_OK);
	CHECK_EQ(comm_broadcast(g, NULL, 0, COMM_U8, 0, &err), DS_OK);
	int64_t z[1] = {0};
	CHECK_EQ(comm_all_to_allv(g, NULL, z, z, NULL, z, z, COMM_F32, &err), DS_OK);
	comm_group_free(g);
}

/* ---- the boundary with more than one rank: a fake backend ---- */

static int fake_rc;   /* what the fake ops return */
static int fake_calls; /* ops that reached the backend */

static int fake_result(ds_err *err)
{
	fake_calls++;
	return fake_rc ? ds_err_set(err, fake_rc, "fake: rank 1 stopped answering") : DS_OK;
}

static void fake_free(comm_group *g)
{
	free(g);
}

static int fake_all_reduce(comm_group *g, const void *send, void *recv, int64_t count,
			   comm_dtype dt, comm_op op, ds_err *err)
{
	return fake_result(err);
}

static int fake_all_gather(comm_group *g, const void *send, void *recv, int64_t count,
			   comm_dtype dt, ds_err *err)
{
	return fake_result(err);
}

static int fake_broadcast(comm_group *g, void *buf, int64_t count, comm_dtype dt, int root,
			  ds_err *err)
{
	return fake_result(err);
}

static int fake_all_to_allv(comm_group *g, const void *send, const int64_t *sc, const int64_t *sd,
			    void *recv, const int64_t *rc, const int64_t *rd, comm_dtype dt,
			    ds_err *err)
{
	return fake_result(err);
}

static int fake_p2p(comm_group *g, const void *buf, int64_t count, comm_dtype dt, int peer,
		    ds_err *err)
{
	return fake_result(err);
}

static int fake_recv(comm_group *g, void *buf, int64_t count, comm_dtype dt, int peer, ds_err *err)
{
	return fake_result(err);
}

static int fake_barrier(comm_group *g, ds_err *err)
{
	return fake_result(err);
}

static const comm_ops fake_ops = {
	.name = "fake",
	.mem = COMM_MEM_HOST,
	.free = fake_free,
	.all_reduce = fake_all_reduce,
	.all_gather = fake_all_gather,
	.broadcast = fake_broadcast,
	.all_to_allv = fake_all_to_allv,
	.send = fake_p2p,
	.recv = fake_recv,
	.barrier = fake_barrier,
	.sync = fake_barrier,
};

static comm_group *fake_new(int rank, int size)
{
	ds_err err = {0};
	comm_params p = comm_default_params();
	p.rank = rank;
	p.world_size = size;
	comm_group *g = calloc(1, sizeof *g);
	if (g && comm_group_init(g, &fake_ops, &p, &err)) {
		free(g);
		g = NULL;
	}
	return g;
}

TEST(comm_boundary_checks_with_two_ranks)
{
	ds_err err = {0};
	comm_group *g = fake_new(1, 2);
	CHECK(g != NULL);
	if (!g)
		return;
	float buf[32];
	for (int i = 0; i < 32; i++)
		buf[i] = ut_rand_float(0.5f, 2.0f);
	fake_rc = 0;
	fake_calls = 0;
	/* allowed: in place at this rank's slot, send to the other rank */
	CHECK_EQ(comm_all_gather(g, buf + 4, buf, 4, COMM_F32, &err), DS_OK);
	CHECK_EQ(comm_send(g, buf, 4, COMM_F32, 0, &err), DS_OK);
	CHECK_EQ(comm_broadcast(g, buf, 4, COMM_F32, 0, &err), DS_OK);
	CHECK_EQ(fake_calls, 3);
	/* refused before the backend */
	CHECK_BAD(comm_all_gather(g, buf, buf, 4, COMM_F32, &err), "in place");
	CHECK_BAD(comm_recv(g, buf, 4, COMM_F32, 1, &err), "peer 1 is this rank");
	CHECK_BAD(comm_broadcast(g, buf, 4, COMM_F32, 2, &err), "root 2 is outside 0..1");
	int64_t sc[2] = {2, 2}, sd[2] = {0, 2}, rc[2] = {3, 3}, rd[2] = {0, 2};
	CHECK_BAD(comm_all_to_allv(g, buf, sc, sd, buf + 8, rc, rd, COMM_F32, &err),
		  "recv ranges of peers 0 and 1 overlap");
	rd[1] = 3;
	CHECK_EQ(comm_all_to_allv(g, buf, sc, sd, buf + 8, rc, rd, COMM_F32, &err), DS_OK);
	/* a rank that moves nothing still takes part */
	int64_t z[2] = {0, 0};
	CHECK_EQ(comm_all_to_allv(g, NULL, z, z, NULL, z, z, COMM_F32, &err), DS_OK);
	CHECK_EQ(fake_calls, 5);
	comm_group_free(g);
}

TEST(comm_transport_errors_break_the_group)
{
	ds_err err = {0};
	comm_group *g = fake_new(0, 2);
	CHECK(g != NULL);
	if (!g)
		return;
	float buf[8] = {1, 2, 3, 4, 5, 6, 7, 8};
	/* an error that is not the transport's leaves the group usable */
	fake_rc = DS_EINVAL;
	CHECK_EQ(comm_all_reduce(g, buf, buf, 8, COMM_F32, COMM_SUM, &err), DS_EINVAL);
	fake_rc = 0;
	CHECK_EQ(comm_barrier(g, &err), DS_OK);
	/* a timeout breaks it: every later call fails the same way, unsent */
	fake_rc = DS_ETIMEOUT;
	CHECK_EQ(comm_all_reduce(g, buf, buf, 8, COMM_F32, COMM_SUM, NULL), DS_ETIMEOUT);
	fake_rc = 0;
	fake_calls = 0;
	CHECK_EQ(comm_barrier(g, &err), DS_ETIMEOUT);
	CHECK(strstr(err.msg, "rank 1 stopped answering") != NULL);
	CHECK_EQ(comm_broadcast(g, buf, 8, COMM_F32, 0, &err), DS_ETIMEOUT);
	CHECK_EQ(comm_send(g, buf, 8, COMM_F32, 1, &err), DS_ETIMEOUT);
	CHECK_EQ(comm_group_sync(g, &err), DS_ETIMEOUT);
	CHECK_EQ(fake_calls, 0);
	comm_group_free(g);

	g = fake_new(0, 2); /* and a dead peer (DS_EIO) likewise */
	CHECK(g != NULL);
	if (!g)
		return;
	fake_rc = DS_EIO;
	CHECK_EQ(comm_recv(g, buf, 8, COMM_F32, 1, &err), DS_EIO);
	fake_rc = 0;
	CHECK_EQ(comm_all_gather(g, buf, buf, 4, COMM_F32, &err), DS_EIO);
	comm_group_free(g);
}

/* ---- the Gloo backend: W ranks as forked children of the test ----
 *
 * A process of its own serves the rendezvous store (store_proc.h); the
 * test process forks one child per rank; each child opens a store client,
 * makes its Gloo group on loopback, runs a body and exits with its number of
 * failures (capped), or 120+ when it could not start.  Children draw
 * their inputs from the random state they inherit, so every rank computes
 * the same references (as the header says).  The parent reaps every child
 * within a deadline and kills the ones that overrun it: a hang is a
 * failure, never a stuck test. */

#define RANK_EXIT_SETUP 120 /* the store could not be opened */
#define RANK_EXIT_NEW 140   /* comm_gloo_new failed with DS code -(status - 140) */

typedef struct rank_ctx {
	comm_group *g;
	comm_store *st;
	const char *prefix;
	int rank, W;
	void *arg;
} rank_ctx;

typedef int (*rank_body)(rank_ctx *rc);

typedef struct rank_run rank_run;
struct rank_run {
	int W, timeout_ms, wait_ms;
	rank_body body;
	void *arg;
	int ranks;   /* processes to fork (0: W); the test plays the others */
	int quiet;   /* constructor failures are expected */
	/* run in the test process once the prefix is chosen: before the fork,
	 * and after it (before the ranks start) */
	void (*before)(struct rank_run *rr, store_proc *s);
	void (*after)(struct rank_run *rr, store_proc *s);
	/* filled by run_ranks */
	char prefix[96];
	int status[W_MAX]; /* waitpid status per rank */
	int hung;          /* ranks killed at the deadline */
	double seconds;
};

static unsigned run_seq;

static void rank_main(const char *addr, rank_run *rr, int rank, int go)
{
	comm_store st;
	ds_err err = {0};
	char b;
	/* wait until every rank is forked (see run_ranks) */
	while (read(go, &b, 1) < 0 && errno == EINTR)
		;
	close(go);
	if (rr->quiet) /* expected failures (Gloo's abort prints through libstdc++) */
		dup2(open("/dev/null", O_WRONLY), 2);
	if (comm_store_tcp_open(&st, addr, 5000, &err)) {
		fprintf(stderr, "    rank %d: %s\n", rank, err.msg);
		_exit(RANK_EXIT_SETUP);
	}
	comm_params p = comm_default_params();
	p.rank = rank;
	p.world_size = rr->W;
	p.timeout_ms = rr->timeout_ms;
	p.name = "test";
	comm_group *g = comm_gloo_new(&p, &st, rr->prefix, "127.0.0.1", &err);
	if (!g) {
		if (!rr->quiet)
			fprintf(stderr, "    rank %d: %s\n", rank, err.msg);
		_exit(RANK_EXIT_NEW - err.code);
	}
	rank_ctx rc = {.g = g, .st = &st, .prefix = rr->prefix, .rank = rank, .W = rr->W,
		       .arg = rr->arg};
	int fails = rr->body(&rc);
	comm_group_free(g);
	comm_store_tcp_close(&st);
	_exit(fails > 100 ? 100 : fails);
}

/* Forks rr->W ranks against server s and reaps them all (killing those
 * still running after rr->wait_ms).  The ranks start only once all are
 * forked and rr->after has run (they wait for the end of a pipe). */
static void run_ranks(store_proc *s, rank_run *rr)
{
	pid_t pids[W_MAX];
	int alive = 0;
	snprintf(rr->prefix, sizeof rr->prefix, "job%d/run%u", (int)getpid(), ++run_seq);
	rr->hung = 0;
	int n = rr->ranks ? rr->ranks : rr->W;
	if (rr->before)
		rr->before(rr, s);
	fflush(NULL);
	int go[2];
	if (pipe(go) != 0) {
		ut_fail(__FILE__, __LINE__, "pipe: %s", strerror(errno));
		return;
	}
	uint64_t t0 = ds_now_ns();
	for (int r = 0; r < n; r++) {
		pids[r] = fork();
		if (pids[r] == 0) {
			close(go[1]);
			rank_main(s->addr, rr, r, go[0]);
		}
		if (pids[r] < 0) {
			ut_fail(__FILE__, __LINE__, "fork: %s", strerror(errno));
			rr->status[r] = -1;
		} else {
			alive++;
		}
	}
	close(go[0]);
	if (rr->after)
		rr->after(rr, s);
	close(go[1]); /* the ranks start */
	uint64_t deadline = t0 + (uint64_t)rr->wait_ms * 1000000u;
	while (alive > 0) {
		int st;
		pid_t pid = waitpid(-1, &st, WNOHANG);
		if (pid > 0) {
			for (int r = 0; r < n; r++) {
				if (pids[r] == pid) {
					rr->status[r] = st;
					pids[r] = 0;
					alive--;
				}
			}
			continue;
		}
		if (ds_now_ns() > deadline) { /* a hang: kill and reap */
			for (int r = 0; r < n; r++) {
				if (pids[r] > 0) {
					kill(pids[r], SIGKILL);
					waitpid(pids[r], &rr->status[r], 0);
					pids[r] = 0;
					rr->hung++;
					alive--;
				}
			}
			break;
		}
		usleep(2000);
	}
	rr->seconds = (double)(ds_now_ns() - t0) / 1e9;
}

/* 1 when every rank exited with 0; reports the others. */
static int ranks_ok(const rank_run *rr)
{
	int ok = !rr->hung;
	if (rr->hung)
		ut_fail(__FILE__, __LINE__, "W=%d: %d ranks hung past %d ms", rr->W, rr->hung,
			rr->wait_ms);
	for (int r = 0; r < rr->W; r++) {
		int st = rr->status[r];
		if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
			continue;
		ok = 0;
		if (WIFEXITED(st))
			ut_fail(__FILE__, __LINE__, "W=%d rank %d exited with %d", rr->W, r, WEXITSTATUS(st));
		else
			ut_fail(__FILE__, __LINE__, "W=%d rank %d ended by signal %d", rr->W, r,
				WIFSIGNALED(st) ? WTERMSIG(st) : -1);
	}
	return ok;
}

/* The store server in its own process (store_proc.h), checked with one
 * round trip; the test process stays single-threaded when it forks. */
static store_proc *store_start(void)
{
	ds_err err = {0};
	comm_store cl;
	size_t len;
	char v;
	store_proc *s = malloc(sizeof *s);
	if (!s || store_proc_start(s)) {
		free(s);
		return NULL;
	}
	if (comm_store_tcp_open(&cl, s->addr, 2000, &err) || cl.set(cl.ctx, "ping", "1", 1, &err) ||
	    cl.get(cl.ctx, "ping", &v, 1, &len, 1000, &err))
		ut_fail(__FILE__, __LINE__, "store server: %s", err.msg);
	comm_store_tcp_close(&cl);
	return s;
}

static void store_stop(store_proc *s)
{
	if (s)
		store_proc_stop(s);
	free(s);
}

/* Tolerance of float reductions against the rank-order reference. */
#define GLOO_TOL 1e-4

/* The table of collectives, then broadcast from every root, zero counts. */
static int body_collectives(rank_ctx *rc)
{
	int fails = check_all_cases(rc->g, GLOO_TOL);
	static const comm_dtype dts[] = {COMM_F32, COMM_U8};
	for (int root = 0; root < rc->W; root++) {
		for (size_t d = 0; d < 2; d++) {
			int64_t count = 1 + (int64_t)(ut_rand_u64() % 999);
			size_t es = comm_dtype_size(dts[d]);
			char *want = malloc((size_t)count * es), *buf = malloc((size_t)count * es);
			fill_random(want, dts[d], count); /* root's data: same draw on every rank */
			fill_random(buf, dts[d], count);  /* the others' data, overwritten */
			ds_err err = {0};
			if (rc->rank == root)
				memcpy(buf, want, (size_t)count * es);
			int r = comm_broadcast(rc->g, buf, count, dts[d], root, &err);
			if (r || memcmp(buf, want, (size_t)count * es) != 0) {
				ut_fail(__FILE__, __LINE__, "broadcast root %d count %lld: %s", root,
					(long long)count, r ? err.msg : "wrong data");
				fails++;
			}
			free(want);
			free(buf);
		}
	}
	/* empty parts: every call with zero elements succeeds at once */
	ds_err err = {0};
	float one = 1.0f;
	int64_t zeros[W_MAX] = {0};
	if (comm_all_reduce(rc->g, &one, &one, 0, COMM_F32, COMM_SUM, &err) ||
	    comm_all_gather(rc->g, &one, NULL, 0, COMM_F32, &err) ||
	    comm_reduce_scatter(rc->g, NULL, &one, 0, COMM_F32, COMM_SUM, &err) ||
	    comm_broadcast(rc->g, NULL, 0, COMM_F32, 0, &err) ||
	    comm_all_to_allv(rc->g, NULL, zeros, zeros, NULL, zeros, zeros, COMM_F32, &err)) {
		ut_fail(__FILE__, __LINE__, "zero-count call: %s", err.msg);
		fails++;
	}
	return fails;
}

static void run_collectives(int w_lo, int w_hi)
{
	store_proc *s = store_start();
	if (!s)
		return;
	for (int W = w_lo; W <= w_hi; W++) {
		rank_run rr = {.W = W, .timeout_ms = 10000, .wait_ms = 60000, .body = body_collectives};
		run_ranks(s, &rr);
		ranks_ok(&rr);
		if (getenv("DS_TEST_VERBOSE"))
			fprintf(stderr, "    W=%d: %.2f s\n", W, rr.seconds);
	}
	store_stop(s);
}

/* World sizes 1..8 in tests of a few seconds each (a 2-core machine runs
 * W processes of about 240 collectives each). */
TEST(comm_gloo_collectives_match_reference_w1_to_4)
{
	run_collectives(1, 4);
}

TEST(comm_gloo_collectives_match_reference_w5_6)
{
	run_collectives(5, 6);
}

TEST(comm_gloo_collectives_match_reference_w7)
{
	run_collectives(7, 7);
}

TEST(comm_gloo_collectives_match_reference_w8)
{
	run_collectives(8, 8);
}

/* Every ordered pair (s, d) in one global order: s sends an odd count of
 * random elements, d receives and checks; then barriers. */
static int body_p2p(rank_ctx *rc)
{
	int fails = 0;
	for (int s = 0; s < rc->W; s++) {
		for (int d = 0; d < rc->W; d++) {
			if (s == d)
				continue;
			int64_t count = 1 + 2 * (int64_t)(ut_rand_u64() % 500);
			int32_t *want = malloc((size_t)count * 4), *got = malloc((size_t)count * 4 + 4);
			fill_random(want, COMM_I32, count);
			ds_err err = {0};
			int r = 0;
			if (rc->rank == s)
				r = comm_send(rc->g, want, count, COMM_I32, d, &err);
			else if (rc->rank == d)
				r = comm_recv(rc->g, got, count, COMM_I32, s, &err);
			if (r || (rc->rank == d && memcmp(got, want, (size_t)count * 4) != 0)) {
				ut_fail(__FILE__, __LINE__, "%d -> %d count %lld: %s", s, d, (long long)count,
					r ? err.msg : "wrong data");
				fails++;
			}
			free(want);
			free(got);
		}
	}
	for (int i = 0; i < 3; i++) {
		ds_err err = {0};
		usleep((useconds_t)(rc->rank * 3000));
		if (comm_barrier(rc->g, &err)) {
			ut_fail(__FILE__, __LINE__, "barrier: %s", err.msg);
			fails++;
		}
	}
	return fails;
}

TEST(comm_gloo_send_recv_and_barrier)
{
	store_proc *s = store_start();
	if (!s)
		return;
	for (int W = 2; W <= W_MAX; W += 3) {
		rank_run rr = {.W = W, .timeout_ms = 10000, .wait_ms = 60000, .body = body_p2p};
		run_ranks(s, &rr);
		ranks_ok(&rr);
	}
	store_stop(s);
}

/* ---- determinism: every rank, every run, the same bits ---- */

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		h = (h ^ ((const unsigned char *)p)[i]) * 0x100000001b3ull;
	return h;
}

/* Reductions of f32 and bf16 (all_reduce, reduce_scatter) with random
 * delays before each call (drawn from the pid: they differ per rank and
 * per run); publishes the hash of every result as "<prefix>/hash/<rank>". */
static int body_determinism(rank_ctx *rc)
{
	uint64_t delay_rng = (uint64_t)getpid() * 0x9E3779B97F4A7C15ull | 1, h = 0xcbf29ce484222325ull;
	int fails = 0;
	enum { N = 4099 }; /* odd, more than one ring segment per rank at W = 8 */
	for (int it = 0; it < 6; it++) {
		comm_dtype dt = it & 1 ? COMM_BF16 : COMM_F32;
		size_t es = comm_dtype_size(dt);
		char *in = malloc(N * es * W_MAX), *out = malloc(N * es * W_MAX);
		char *other = malloc(N * es * W_MAX);
		for (int r = 0; r < rc->W; r++) /* rank r's input: the r-th draw */
			fill_random(r == rc->rank ? in : other, dt, (int64_t)N * rc->W);
		free(other);
		delay_rng ^= delay_rng << 13;
		delay_rng ^= delay_rng >> 7;
		delay_rng ^= delay_rng << 17;
		usleep((useconds_t)(delay_rng % 3000));
		ds_err err = {0};
		int r = it % 3 == 2 ? comm_reduce_scatter(rc->g, in, out, N, dt, COMM_SUM, &err)
				    : comm_all_reduce(rc->g, in, out, (int64_t)N * rc->W, dt, COMM_SUM, &err);
		if (r) {
			ut_fail(__FILE__, __LINE__, "iteration %d: %s", it, err.msg);
			fails++;
		}
		/* reduce_scatter: every rank hashes all parts via all_gather */
		if (!r && it % 3 == 2) {
			char *all = malloc(N * es * W_MAX);
			r = comm_all_gather(rc->g, out, all, N, dt, &err);
			memcpy(out, all, N * es * (size_t)rc->W);
			free(all);
		}
		h = fnv(h, out, N * es * (size_t)rc->W);
		free(in);
		free(out);
	}
	char key[160];
	snprintf(key, sizeof key, "%s/hash/%d", rc->prefix, rc->rank);
	ds_err err = {0};
	if (rc->st->set(rc->st->ctx, key, &h, sizeof h, &err)) {
		ut_fail(__FILE__, __LINE__, "publish: %s", err.msg);
		fails++;
	}
	return fails;
}

TEST(comm_gloo_reductions_are_bit_identical_across_ranks_and_runs)
{
	store_proc *s = store_start();
	comm_store cl = {0};
	ds_err err = {0};
	if (!s || comm_store_tcp_open(&cl, s->addr, 2000, &err)) {
		store_stop(s);
		return;
	}
	static const int worlds[] = {3, 8};
	for (size_t w = 0; w < 2; w++) {
		uint64_t first = 0;
		for (int run = 0; run < 3; run++) {
			rank_run rr = {.W = worlds[w], .timeout_ms = 10000, .wait_ms = 60000,
				       .body = body_determinism};
			run_ranks(s, &rr);
			if (!ranks_ok(&rr))
				continue;
			for (int r = 0; r < rr.W; r++) {
				char key[160];
				uint64_t h = 0;
				size_t len = 0;
				snprintf(key, sizeof key, "%s/hash/%d", rr.prefix, r);
				CHECK_EQ(cl.get(cl.ctx, key, &h, sizeof h, &len, 1000, &err), 0);
				if (!first)
					first = h;
				if (h != first)
					ut_fail(__FILE__, __LINE__, "W=%d run %d rank %d: hash %016llx, first "
						"%016llx", rr.W, run, r, (unsigned long long)h,
						(unsigned long long)first);
			}
		}
	}
	comm_store_tcp_close(&cl);
	store_stop(s);
}

/* ---- failures: each ends in a DS_E* code within the timeout ---- */

#define FAIL_TIMEOUT_MS 1000

/* 0 when rc is one of the transport codes and the call took at most the
 * timeout plus a margin for a loaded machine; the group must then stay
 * broken with the same code. */
static int check_failed(rank_ctx *rc, const char *what, int r, const ds_err *err, uint64_t t0)
{
	double ms = (double)(ds_now_ns() - t0) / 1e6;
	int fails = 0;
	if (r != DS_EIO && r != DS_ETIMEOUT) {
		ut_fail(__FILE__, __LINE__, "rank %d %s: rc %d (%s), wanted EIO or ETIMEOUT", rc->rank, what,
			r, err->msg);
		fails++;
	}
	if (ms > FAIL_TIMEOUT_MS + 2500) {
		ut_fail(__FILE__, __LINE__, "rank %d %s: took %.0f ms", rc->rank, what, ms);
		fails++;
	}
	if (getenv("DS_TEST_VERBOSE"))
		fprintf(stderr, "    rank %d %s after %.0f ms: %s\n", rc->rank, what, ms, err->msg);
	ds_err again = {0};
	float x = 1.0f;
	if (comm_all_reduce(rc->g, &x, &x, 1, COMM_F32, COMM_SUM, &again) != r ||
	    strcmp(again.msg, err->msg) != 0) {
		ut_fail(__FILE__, __LINE__, "rank %d: the group is not broken after %s", rc->rank, what);
		fails++;
	}
	return fails;
}

/* The last rank dies inside a large all_reduce (SIGALRM, default action:
 * the process ends with its sockets); the others must see DS_EIO. */
static int body_peer_dies(rank_ctx *rc)
{
	const int64_t n = 1 << 22;
	float *buf = malloc((size_t)n * 4);
	ds_err err = {0};
	int fails = 0;
	for (int64_t i = 0; i < n; i++)
		buf[i] = 1.0f + (float)(i % 7);
	if (comm_barrier(rc->g, &err)) {
		ut_fail(__FILE__, __LINE__, "barrier: %s", err.msg);
		free(buf);
		return 1;
	}
	if (rc->rank == rc->W - 1)
		ualarm(3000, 0);
	uint64_t t0 = ds_now_ns();
	int r = comm_all_reduce(rc->g, buf, buf, n, COMM_F32, COMM_SUM, &err);
	if (rc->rank == rc->W - 1) /* the call finished before the alarm: die now */
		raise(SIGALRM);
	fails += check_failed(rc, "all_reduce with a dying peer", r, &err, t0);
	/* a rank names the peer it lost: the dead one, or a neighbour that
	 * gave up on it first and closed (DS_ETIMEOUT: a send still waiting
	 * for the dead rank's receive sees no error until the timeout) */
	if (r == DS_EIO && !strstr(err.msg, "is dead or unreachable")) {
		ut_fail(__FILE__, __LINE__, "rank %d: DS_EIO names no rank: %s", rc->rank, err.msg);
		fails++;
	}
	free(buf);
	return fails;
}

/* The last rank exits without a word right after joining. */
static int body_peer_exits(rank_ctx *rc)
{
	if (rc->rank == rc->W - 1)
		_exit(0);
	ds_err err = {0};
	int32_t x[5] = {1, 2, 3, 4, 5};
	uint64_t t0 = ds_now_ns();
	int r = comm_all_reduce(rc->g, x, x, 5, COMM_I32, COMM_SUM, &err);
	int fails = check_failed(rc, "all_reduce after a peer exited", r, &err, t0);
	if (r == DS_EIO && !strstr(err.msg, "is dead or unreachable")) {
		ut_fail(__FILE__, __LINE__, "rank %d: DS_EIO names no rank: %s", rc->rank, err.msg);
		fails++;
	}
	return fails;
}

/* The last rank never calls (sleeps past the others' timeout). */
static int body_peer_stalls(rank_ctx *rc)
{
	if (rc->rank == rc->W - 1) {
		usleep((FAIL_TIMEOUT_MS + 700) * 1000);
		return 0;
	}
	ds_err err = {0};
	float x[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
	uint64_t t0 = ds_now_ns();
	int r = comm_all_reduce(rc->g, x, x, 9, COMM_F32, COMM_SUM, &err);
	return check_failed(rc, "all_reduce with a stalled peer", r, &err, t0);
}

/* Rank 0 waits for a message rank 1 never sends. */
static int body_recv_stalls(rank_ctx *rc)
{
	if (rc->rank == 1) {
		usleep((FAIL_TIMEOUT_MS + 700) * 1000);
		return 0;
	}
	ds_err err = {0};
	uint8_t b[3];
	uint64_t t0 = ds_now_ns();
	int r = comm_recv(rc->g, b, 3, COMM_U8, 1, &err);
	int fails = check_failed(rc, "recv from a silent peer", r, &err, t0);
	if (r != DS_ETIMEOUT || !strstr(err.msg, "peer rank 1")) {
		ut_fail(__FILE__, __LINE__, "recv: wanted DS_ETIMEOUT naming peer rank 1: %d %s", r, err.msg);
		fails++;
	}
	return fails;
}

/* The failing rank's own end is not checked (it died or slept); every
 * other rank must have passed its checks. */
static void run_failure(store_proc *s, int W, rank_body body)
{
	rank_run rr = {.W = W, .timeout_ms = FAIL_TIMEOUT_MS, .wait_ms = 15000, .body = body};
	run_ranks(s, &rr);
	CHECK_EQ(rr.hung, 0);
	for (int r = 0; r < W; r++) {
		int st = rr.status[r];
		int culprit = body == body_recv_stalls ? r == 1 : r == W - 1;
		if (culprit)
			continue;
		if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
			ut_fail(__FILE__, __LINE__, "W=%d rank %d: status %d", W, r, st);
	}
}

TEST(comm_gloo_dead_peer_is_eio)
{
	store_proc *s = store_start();
	if (!s)
		return;
	run_failure(s, 3, body_peer_dies);
	run_failure(s, 4, body_peer_exits);
	store_stop(s);
}

TEST(comm_gloo_stalled_peer_is_etimeout)
{
	store_proc *s = store_start();
	if (!s)
		return;
	run_failure(s, 3, body_peer_stalls);
	run_failure(s, 2, body_recv_stalls);
	store_stop(s);
}

/* A world of W where only W - 1 ranks come: the constructor names the
 * missing rank. */
static int body_nothing(rank_ctx *rc)
{
	return 0;
}

TEST(comm_gloo_missing_rank_is_named)
{
	store_proc *s = store_start();
	if (!s)
		return;
	rank_run rr = {.W = 3, .ranks = 2, .quiet = 1, .timeout_ms = 800, .wait_ms = 15000,
		       .body = body_nothing};
	run_ranks(s, &rr);
	CHECK_EQ(rr.hung, 0);
	for (int r = 0; r < 2; r++) {
		CHECK(WIFEXITED(rr.status[r]));
		CHECK_EQ(WEXITSTATUS(rr.status[r]), RANK_EXIT_NEW - DS_ETIMEOUT);
	}
	store_stop(s);
}

/* ---- garbage from the store and on the transport ----
 * W = 2, one real rank (0); the test plays rank 1 by writing its keys. */

static void put_key(store_proc *s, const char *prefix, const char *suffix, const void *v,
		    size_t n)
{
	comm_store cl;
	ds_err err = {0};
	char key[200];
	snprintf(key, sizeof key, "%s/%s", prefix, suffix);
	if (comm_store_tcp_open(&cl, s->addr, 2000, &err) ||
	    cl.set(cl.ctx, key, v, n, &err))
		ut_fail(__FILE__, __LINE__, "set %s: %s", key, err.msg);
	comm_store_tcp_close(&cl);
}

/* Rank 1's Gloo addresses: a header that is not one */
static void before_bad_header(rank_run *rr, store_proc *s)
{
	put_key(s, rr->prefix, "1/host", "127.0.0.1", 9);
	put_key(s, rr->prefix, "gloo/rank_1", "x", 1);
	put_key(s, rr->prefix, "gloo/1", "garbage!", 8);
}

/* ... a header announcing 300 random bytes that are not an address */
static void before_bad_address(rank_run *rr, store_proc *s)
{
	unsigned char junk[300];
	for (size_t i = 0; i < sizeof junk; i++)
		junk[i] = (unsigned char)ut_rand_u64();
	put_key(s, rr->prefix, "1/host", "127.0.0.1", 9);
	put_key(s, rr->prefix, "gloo/rank_1", "x", 1);
	put_key(s, rr->prefix, "gloo/1#0", junk, sizeof junk);
	put_key(s, rr->prefix, "gloo/1", "1 300", 5);
}

/* ... an address of the right size whose family is nonsense */
static void before_bad_family(rank_run *rr, store_proc *s)
{
	unsigned char junk[136];
	for (size_t i = 0; i < sizeof junk; i++)
		junk[i] = (unsigned char)ut_rand_u64();
	junk[0] = 0xee;
	junk[1] = 0xee;
	put_key(s, rr->prefix, "1/host", "127.0.0.1", 9);
	put_key(s, rr->prefix, "gloo/rank_1", "x", 1);
	put_key(s, rr->prefix, "gloo/1#0", junk, sizeof junk);
	put_key(s, rr->prefix, "gloo/1", "1 136", 5);
}

TEST(comm_gloo_garbage_in_the_store_fails_the_constructor)
{
	void (*hooks[])(rank_run *, store_proc *) = {before_bad_header, before_bad_address,
							     before_bad_family};
	store_proc *s = store_start();
	if (!s)
		return;
	for (size_t h = 0; h < sizeof hooks / sizeof hooks[0]; h++) {
		rank_run rr = {.W = 2, .ranks = 1, .quiet = 1, .timeout_ms = FAIL_TIMEOUT_MS,
			       .wait_ms = 15000, .body = body_nothing, .before = hooks[h]};
		run_ranks(s, &rr);
		CHECK_EQ(rr.hung, 0);
		int st = rr.status[0];
		/* a DS_E* code from the constructor, never a crash */
		if (!WIFEXITED(st) || WEXITSTATUS(st) <= RANK_EXIT_NEW)
			ut_fail(__FILE__, __LINE__, "hook %zu: rank 0 status %d (signal %d)", h, st,
				WIFSIGNALED(st) ? WTERMSIG(st) : 0);
		else if (getenv("DS_TEST_VERBOSE"))
			fprintf(stderr, "    hook %zu: rank 0 failed with %s\n", h,
				ds_status_name(RANK_EXIT_NEW - WEXITSTATUS(st)));
	}
	store_stop(s);
}

/* Garbage on a rank's transport port: the test plays rank 1, connects to
 * the listening port rank 0 published for it and sends random bytes
 * (rank 1's own address is set to port 65535 so that rank 0 is the side
 * that accepts).  Gloo accepts the first connection on that port without
 * a handshake and parses frames on its loop thread, where a failed check
 * ends the process: the documented outcome is rank 0 aborting (SIGABRT,
 * after comm_gloo's terminate handler logs why) or a DS_E* error; what
 * must never happen is a hang. */
typedef struct attack {
	store_proc *s;
	const char *prefix;
	int done;
} attack;

static void *attack_main(void *arg)
{
	attack *a = arg;
	comm_store cl;
	ds_err err = {0};
	char key[200], hdr[64];
	unsigned char addr[COMM_STORE_VALUE_MAX];
	size_t len = 0;
	int fd = -1;
	if (comm_store_tcp_open(&cl, a->s->addr, 2000, &err))
		goto out;
	snprintf(key, sizeof key, "%s/gloo/0", a->prefix);
	if (cl.get(cl.ctx, key, hdr, sizeof hdr, &len, 5000, &err))
		goto out;
	snprintf(key, sizeof key, "%s/gloo/0#0", a->prefix);
	if (cl.get(cl.ctx, key, addr, sizeof addr, &len, 5000, &err) || len < 4)
		goto out;
	struct sockaddr_in sa;
	memcpy(&sa, addr, sizeof sa); /* Gloo's address: a sockaddr_storage first */
	sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0)
		goto out;
	unsigned char junk[4096];
	uint64_t x = 0x9E3779B97F4A7C15ull;
	for (size_t i = 0; i < sizeof junk; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		junk[i] = (unsigned char)x;
	}
	/* first a well-formed frame of Gloo's (six size_t: nbytes, opcode,
	 * slot, offset, length, roffset) sending 8 bytes to an unbound
	 * buffer on a slot nobody receives on, then random bytes */
	size_t pre[6] = {6 * sizeof(size_t) + 8, 1 /* SEND_UNBOUND_BUFFER */, 0x1234, 0, 8, 0};
	memcpy(junk, pre, sizeof pre);
	/* then publish rank 1's keys so that rank 0 goes on to connect */
	unsigned char fake[136] = {0};
	struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = 0xFFFF,
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	memcpy(fake, &me, sizeof me);
	memset(fake + 128, 0xff, 8); /* sequence -1 */
	snprintf(key, sizeof key, "%s/1/host", a->prefix);
	cl.set(cl.ctx, key, "127.0.0.1", 9, &err);
	snprintf(key, sizeof key, "%s/gloo/rank_1", a->prefix);
	cl.set(cl.ctx, key, "x", 1, &err);
	snprintf(key, sizeof key, "%s/gloo/1#0", a->prefix);
	cl.set(cl.ctx, key, fake, sizeof fake, &err);
	snprintf(key, sizeof key, "%s/gloo/1", a->prefix);
	cl.set(cl.ctx, key, "1 136", 5, &err);
	for (int i = 0; i < 8 && !a->done; i++) {
		if (send(fd, junk, sizeof junk, MSG_NOSIGNAL) < 0)
			break;
		usleep(20 * 1000);
	}
	while (!a->done)
		usleep(10 * 1000);
out:
	if (fd >= 0)
		close(fd);
	comm_store_tcp_close(&cl);
	return NULL;
}

static void after_attack(rank_run *rr, store_proc *s)
{
	attack *a = rr->arg;
	a->s = s;
	a->prefix = rr->prefix;
	pthread_t *th = (pthread_t *)(a + 1);
	pthread_create(th, NULL, attack_main, a);
}

TEST(comm_gloo_garbage_on_the_transport_never_hangs)
{
	struct {
		attack a;
		pthread_t th;
	} at = {0};
	store_proc *s = store_start();
	if (!s)
		return;
	rank_run rr = {.W = 2, .ranks = 1, .quiet = 1, .timeout_ms = FAIL_TIMEOUT_MS, .wait_ms = 15000,
		       .body = body_nothing, .after = after_attack, .arg = &at.a};
	run_ranks(s, &rr);
	at.a.done = 1;
	pthread_join(at.th, NULL);
	CHECK_EQ(rr.hung, 0);
	int st = rr.status[0];
	int aborted = WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT;
	int failed = WIFEXITED(st) && WEXITSTATUS(st) > RANK_EXIT_NEW;
	if (!aborted && !failed)
		ut_fail(__FILE__, __LINE__, "rank 0: status %d: neither an error nor Gloo's abort", st);
	if (getenv("DS_TEST_VERBOSE"))
		fprintf(stderr, "    rank 0: %s\n", aborted ? "aborted (SIGABRT)"
					     : failed ? ds_status_name(RANK_EXIT_NEW - WEXITSTATUS(st))
						      : "?");
	store_stop(s);
}

/* Without CUDA the NCCL constructor exists and says why it cannot work. */
TEST(comm_nccl_without_cuda_is_unsupported)
{
#ifdef DS_HAVE_CUDA
	UT_SKIP("built with CUDA: NCCL needs GPUs, not run by the unit tier");
#else
	store_proc *s = store_start();
	comm_store cl = {0};
	ds_err err = {0};
	if (!s || comm_store_tcp_open(&cl, s->addr, 2000, &err)) {
		store_stop(s);
		return;
	}
	comm_params p = comm_default_params();
	CHECK(comm_nccl_new(&p, &cl, "job/g", 0, &err) == NULL);
	CHECK_EQ(err.code, DS_EUNSUPPORTED);
	CHECK(strstr(err.msg, "CUDA") != NULL);
	comm_store_tcp_close(&cl);
	store_stop(s);
#endif
}

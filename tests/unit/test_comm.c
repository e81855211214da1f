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
 */
#include "comm/comm.h"
#include "comm/comm_impl.h" /* a fake backend for the boundary tests */
#include "kernels/cpu/cpu.h"
#include "tests/unit/unit.h"

#include <stdlib.h>
#include <string.h>

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

/* 0 when got equals want: bit-exact, or within tol (relative) for float
 * reductions of W > 1 ranks. */
static int cmp_tol(const void *got, const void *want, int64_t n, comm_dtype dt, double tol)
{
	if (tol == 0.0 || dt == COMM_I32 || dt == COMM_U8)
		return memcmp(got, want, (size_t)n * comm_dtype_size(dt)) != 0;
	for (int64_t i = 0; i < n; i++) {
		double x = load_f(got, dt, i), y = load_f(want, dt, i);
		if (!(fabs(x - y) <= tol * (fabs(y) + 1e-6)))
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

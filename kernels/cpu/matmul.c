/*
 * matmul.c - y (+)= x W^T on the CPU: the scalar reference, and the driver
 * that runs the per-ISA micro-kernels (matmul_avx2.c, matmul_avx512.c) over
 * the thread pool.
 *
 * Called by backend_cpu.c (after argument checks), tests/conformance, the
 * bench and the unit tests.  Thread rule: one caller at a time (the pool's
 * rule); the work is split so that each y element is written by one thread.
 *
 * Blocking (see matmul_impl.h for the tile contract):
 *   items   = m-blocks (mc rows of x) x chunks of W-row panels; the pool hands
 *             items to threads, each writes a disjoint block of y.
 *   panel   = nr rows of W (8 when M <= m_wide: 1 on AVX2, 3 on AVX-512;
 *             else 4): more rows in flight, more memory streams per tile.
 *   M = 1 with whole contiguous BF16 or FP8 rows (kc_mm_rows): the rows
 *             cut into ROWS_SHARES shares per thread, which the threads
 *             claim in turn; each share is read row by row in memory
 *             order, one sequential stream with a software prefetch
 *             ROWS_PF_BYTES ahead; no tiles, no panels.  A batch of such products whose
 *             W matrices lie back to back streams as one
 *             (kc_matmul_batch_isa), and so do several products of any
 *             placement (kc_matmul_multi_isa).
 *   M <= 6 mr_max (other decode, small batches): tiles of mr_max x rows;
 *             each panel is streamed once, K chunk by K chunk (KC_MM_KC
 *             elements), converted in registers, the vector accumulators
 *             parked between chunks; the next tiles of x rows read the
 *             panel again from L1 / L2: every W byte is read from memory
 *             once per call, lanes summed once.
 *   M >  6 mr_max (prefill): K chunk outermost, so the m-block's x chunk
 *             (mc = 16 tiles of rows x KC_MM_KC, 256 KiB) stays in L2 while
 *             every panel passes; each panel chunk is dequantized once into a
 *             32 KiB f32 buffer (L1, on the stack of the thread running the
 *             item) and reused by all the tiles; tiles add each chunk's sums
 *             into y (the first chunk stores when accumulate = 0).
 * Invariants: y elements depend only on (x row, W row), never on the thread
 * count or the tile shape; x and y never alias (kb_matmul_args).
 */
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/matmul_impl.h"
#include "kernels/cpu/pool.h"

#include <stdlib.h>
#include <string.h>

/* ---- reference ---- */

static double dot_ref(const kb_matmul_args *a, const float *x, int64_t n)
{
	double s = 0.0;
	const int64_t K = a->K;
	switch (a->wtype) {
	case KB_F32: {
		const float *w = (const float *)a->w + n * a->w_stride;
		for (int64_t k = 0; k < K; k++)
			s += (double)x[k] * (double)w[k];
		break;
	}
	case KB_F16: {
		const uint16_t *w = (const uint16_t *)a->w + n * a->w_stride;
		for (int64_t k = 0; k < K; k++)
			s += (double)x[k] * (double)kc_f16_to_f32(w[k]);
		break;
	}
	case KB_BF16: {
		const uint16_t *w = (const uint16_t *)a->w + n * a->w_stride;
		for (int64_t k = 0; k < K; k++)
			s += (double)x[k] * (double)kc_bf16_to_f32(w[k]);
		break;
	}
	case KB_F8_E4M3: {
		const uint8_t *w = (const uint8_t *)a->w + n * a->w_stride;
		const float *lut = kc_fp8_e4m3_lut();
		const float *sc = a->w_scale + (n / a->block) * a->scale_stride;
		for (int64_t k = 0; k < K; k++)
			s += (double)x[k] * ((double)lut[w[k]] * (double)sc[k / a->block]);
		break;
	}
	default:
		break;
	}
	return s;
}

static void ref_rows(const kb_matmul_args *a, int64_t n0, int64_t n1)
{
	for (int64_t m = 0; m < a->M; m++) {
		const float *x = a->x + m * a->x_stride;
		float *y = a->y + m * a->y_stride;
		for (int64_t n = n0; n < n1; n++) {
			double s = dot_ref(a, x, n);
			y[n] = (float)(a->accumulate ? (double)y[n] + s : s);
		}
	}
}

void kc_matmul_ref(const kb_matmul_args *a)
{
	ref_rows(a, 0, a->N);
}

static void ref_item(void *ctx, int64_t b, int64_t e)
{
	ref_rows(ctx, b, e);
}

/* ---- SIMD driver ---- */

typedef struct mm_job {
	const kb_matmul_args *a;
	const kc_mm_kernels *kn;
	int64_t mc;       /* x rows per m-block */
	int64_t nr;       /* W rows per panel */
	int64_t ppc;      /* panels per chunk */
	int64_t n_chunks; /* chunks per m-block */
	int pack;         /* prefill order, panels dequantized into the f32 buffer; 0: decode order */
	int xperm;        /* decode: a->x is permuted (kc_mm_permute_x) */
} mm_job;

/* Asks for W rows [r0, r1) x [k0, k0 + nk): in the prefill order a panel
 * chunk is a few short strided segments that the hardware prefetchers pick
 * up late, so the next one is requested while the current one is used. */
static void prefetch_rows(const kb_matmul_args *a, int64_t r0, int64_t r1, int64_t k0, int64_t nk)
{
	const size_t es = kb_dtype_size(a->wtype);
	for (int64_t r = r0; r < r1; r++) {
		const char *p = (const char *)a->w + (size_t)(r * a->w_stride + k0) * es;
		for (size_t b = 0; b < (size_t)nk * es; b += 64)
			__builtin_prefetch(p + b, 0, 2);
	}
}

#define PF_BYTES 8192 /* decode prefetch distance, at least (see mm_block_decode) */
/* The row kernels' L2 request distance (kc_mm_rows.pf_bytes).  On the Zen 4
 * host of 2026-12-07 (2 vCPUs, 29-40 GB/s) a synthetic step of the V3
 * benchmark model's products (one process, the forms alternating step by
 * step, medians of 60 steps) took 4-6% less time natively and 4-9% less on
 * AVX2 with 12 KiB than with 8 (10 and 14 KiB in between); the Zen 5 host of
 * 2026-12-04 (84 GB/s) had it at 0.96-1.02 of 8 KiB (docs/benchmarks.md). */
#define ROWS_PF_BYTES 12288

/* Decode order (decode_order: up to DECODE_TILES tiles of x rows): each
 * panel of W rows is streamed once, K chunk by K chunk, the accumulators
 * parked between chunks, then read from cache by the next tiles of rows. */
static void mm_block_decode(const mm_job *j, int64_t n0, int64_t n1)
{
	const kb_matmul_args *a = j->a;
	const size_t es = kb_dtype_size(a->wtype);
	_Alignas(64) float accs[KC_MM_ACC_TILE];
	/* the fields every tile shares are set once: with short rows (the
	 * absorbed-MLA heads, K = 128) per-tile set-up is as long as the tile */
	kc_mm_tile t;
	memset(&t, 0, sizeof t);
	t.store = !a->accumulate;
	t.x_stride = a->x_stride;
	t.y_stride = a->y_stride;
	t.acc = accs;
	t.dt = a->wtype;
	t.w_stride = a->w_stride;
	t.block = a->wtype == KB_F8_E4M3 ? a->block : 0;
	t.xperm = j->xperm;
	/* scale block row of W row n, and n's place in it, kept without dividing */
	int64_t sb = t.block ? n0 / t.block : 0, sb_off = t.block ? n0 % t.block : 0;
	const int64_t panel_bytes = j->nr * (a->K < KC_MM_KC ? a->K : KC_MM_KC) * (int64_t)es;
	const int64_t pf_ahead = a->K <= KC_MM_KC ? (PF_BYTES + panel_bytes - 1) / panel_bytes : 1;
	for (int64_t n = n0; n < n1; n += j->nr) {
		t.nr = (int)(n1 - n < j->nr ? n1 - n : j->nr);
		if (t.block) {
			for (int r = 0, b = (int)sb, o = (int)sb_off; r < t.nr; r++) {
				t.scale[r] = a->w_scale + b * a->scale_stride;
				if (++o == t.block)
					o = 0, b++;
			}
			sb_off += t.nr;
			while (sb_off >= t.block)
				sb_off -= t.block, sb++;
		}
		/* the first tile of x rows streams the panel from memory; the
		 * others find it in L1 / L2 (a panel is at most 8 rows of K) */
		for (int64_t m = 0; m < a->M; m += j->kn->mr_max) {
			t.mr = (int)(a->M - m < j->kn->mr_max ? a->M - m : j->kn->mr_max);
			t.y = a->y + m * a->y_stride + n;
			for (int64_t k0 = 0; k0 < a->K; k0 += KC_MM_KC) {
				t.nk = a->K - k0 < KC_MM_KC ? a->K - k0 : KC_MM_KC;
				t.kabs = k0;
				t.acc_load = k0 > 0;
				t.acc_keep = k0 + t.nk < a->K;
				t.w = (const char *)a->w + (size_t)(n * a->w_stride + k0) * es;
				/* the next tile: this panel's next K chunk, else the
				 * panel pf_ahead panels on (short rows: far enough
				 * ahead to hide the memory latency) */
				int64_t pn = n, pk = k0 + KC_MM_KC;
				if (pk >= a->K) {
					pn = n + j->nr * pf_ahead;
					pk = 0;
				}
				t.pf = NULL;
				if (m == 0 && pn < n1) {
					t.pf = (const char *)a->w + (size_t)(pn * a->w_stride + pk) * es;
					t.pf_nr = (int)(n1 - pn < j->nr ? n1 - pn : j->nr);
					t.pf_nk = a->K - pk < KC_MM_KC ? a->K - pk : KC_MM_KC;
				}
				t.x = a->x + m * a->x_stride + k0;
				j->kn->tile(&t);
			}
		}
	}
}

/* Prefill order (more rows): for each K chunk, the x rows of the m-block
 * (mc x KC_MM_KC floats, in L2) meet every panel of W rows in turn; a panel
 * chunk is dequantized once into an L1 buffer and reused by all the tiles;
 * each tile adds its chunk's sums into y. */
static void mm_block_prefill(const mm_job *j, int64_t m0, int64_t m1, int64_t n0, int64_t n1)
{
	const kb_matmul_args *a = j->a;
	const kc_mm_kernels *kn = j->kn;
	const size_t es = kb_dtype_size(a->wtype);
	_Alignas(64) float panel[KC_MM_NR_MAX * KC_MM_KC]; /* 32 KiB */
	for (int64_t k0 = 0; k0 < a->K; k0 += KC_MM_KC) {
		for (int64_t n = n0; n < n1; n += j->nr) {
			kc_mm_tile t;
			memset(&t, 0, sizeof t);
			t.nr = (int)(n1 - n < j->nr ? n1 - n : j->nr);
			if (a->wtype == KB_F8_E4M3) {
				t.block = a->block;
				for (int r = 0; r < t.nr; r++)
					t.scale[r] = a->w_scale + ((n + r) / a->block) * a->scale_stride;
			}
			t.nk = a->K - k0 < KC_MM_KC ? a->K - k0 : KC_MM_KC;
			t.kabs = k0;
			t.store = k0 == 0 && !a->accumulate;
			t.dt = a->wtype;
			t.w = (const char *)a->w + (size_t)(n * a->w_stride + k0) * es;
			t.w_stride = a->w_stride;
			if (j->pack) {
				kn->pack(panel, KC_MM_KC, &t);
				t.dt = KB_F32;
				t.w = panel;
				t.w_stride = KC_MM_KC;
			}
			prefetch_rows(a, n + j->nr, n + 2 * j->nr < n1 ? n + 2 * j->nr : n1, k0, t.nk);
			t.x_stride = a->x_stride;
			t.y_stride = a->y_stride;
			for (int64_t m = m0; m < m1; m += kn->mr_max) {
				t.mr = (int)(m1 - m < kn->mr_max ? m1 - m : kn->mr_max);
				t.x = a->x + m * a->x_stride + k0;
				t.y = a->y + m * a->y_stride + n;
				kn->tile(&t);
			}
		}
	}
}

/* Decode order for up to DECODE_TILES tiles of x rows (18 on AVX2, 24 on
 * AVX-512): W is widened in registers once per tile of rows, which beat
 * dequantizing each panel chunk into f32 once and reading it back for so
 * few rows.  FP8 2048 x 2048, 2 threads, one process alternating the two
 * orders: 2.0-2.4x faster at M = 4-5, 1.6-2.4x at 6-8, 1.2-1.9x at 9-14 on
 * either ISA; at 16-24 even on AVX2, 1.1-1.7x on AVX-512. */
#define DECODE_TILES 6

static int decode_order(const kb_matmul_args *a, const kc_mm_kernels *kn)
{
	return a->M <= (int64_t)kn->mr_max * DECODE_TILES;
}

static void mm_item(void *ctx, int64_t b, int64_t e)
{
	const mm_job *j = ctx;
	const kb_matmul_args *a = j->a;
	for (int64_t it = b; it < e; it++) {
		int64_t mb = it / j->n_chunks, ch = it % j->n_chunks;
		int64_t m0 = mb * j->mc, m1 = m0 + j->mc < a->M ? m0 + j->mc : a->M;
		int64_t n0 = ch * j->ppc * j->nr, n1 = n0 + j->ppc * j->nr;
		if (n1 > a->N)
			n1 = a->N;
		if (!j->pack)
			mm_block_decode(j, n0, n1);
		else
			mm_block_prefill(j, m0, m1, n0, n1);
	}
}

/* Decode with one x row through kc_mm_kernels.rows: shares of whole rows,
 * each starting on a 16-row boundary so that no two threads write one cache
 * line of y, ROWS_SHARES per thread, claimed in turn (the pool's chunks), so
 * that a thread the host slows down or a stream that starts late leaves
 * less for the others to wait on.  With one share per thread the caller
 * waited for the other thread 5-16% of the time it worked in these jobs on
 * a V3-shaped decode; with 8, 2.5-4.3% (a pool instrumented per job,
 * DS_CPU_ISA=avx2, 2 threads).  A share's first ROWS_PF_BYTES start cold,
 * which 8 shares per thread did not show. */
#define ROWS_SHARES 8

typedef struct rows_job {
	kc_mm_rows proto; /* all but n0, n1, xs, pf_end */
	const kc_mm_kernels *kn;
	int64_t N, per;   /* rows (of all products), rows per share */
} rows_job;

static void rows_item(void *ctx, int64_t b, int64_t e)
{
	const rows_job *j = ctx;
	_Alignas(64) float xs[KC_MM_ROWS_MAXK];
	const size_t rb = (size_t)j->proto.K * kb_dtype_size(j->proto.dt);
	for (int64_t it = b; it < e; it++) {
		kc_mm_rows t = j->proto;
		t.n0 = it * j->per;
		t.n1 = t.n0 + j->per < j->N ? t.n0 + j->per : j->N;
		t.xs = xs;
		t.pf_end = (const char *)t.w + (size_t)t.n1 * rb;
		j->kn->rows(&t);
	}
}

/* Threads for a product of macs multiply-adds: below 64 Ki the hand-off
 * costs more than it saves. */
static int64_t threads_for(double macs)
{
	return macs < 65536.0 ? 1 : kc_pool_threads();
}

/* a->batch products (at least 1) whose W matrices lie back to back, x
 * permuted into xp (K floats per product). */
static void rows_run(const kb_matmul_args *a, const kc_mm_kernels *kn, const float *xp, int64_t threads)
{
	const int64_t B = a->batch > 1 ? a->batch : 1;
	rows_job j = {.kn = kn, .N = B * a->N};
	j.proto = (kc_mm_rows){
		.dt = a->wtype, .x = xp, .w = a->w, .K = a->K, .y = a->y, .store = !a->accumulate,
		.scale = a->w_scale, .scale_stride = a->scale_stride, .block = a->block,
		.per_item = a->N, .y_bstride = a->y_bstride, .s_bstride = a->s_bstride, .pf_bytes = ROWS_PF_BYTES,
	};
	j.per = (j.N + threads * ROWS_SHARES - 1) / (threads * ROWS_SHARES);
	j.per = (j.per + 15) / 16 * 16;
	const int64_t items = (j.N + j.per - 1) / j.per;
	if (items == 1)
		rows_item(&j, 0, 1);
	else
		kc_parallel_for(items, 1, rows_item, &j);
}

/* 1 when the products of a (one, or a->batch back to back) can go through
 * kn->rows: one x row, whole contiguous rows, a dtype the kernel widens
 * with a permuted x (g, its group). */
static int rows_fit(const kb_matmul_args *a, const kc_mm_kernels *kn, int g)
{
	return g && kn && a->M == 1 && kn->rows && a->w_stride == a->K &&
	       a->K <= KC_MM_ROWS_MAXK &&
	       (a->batch <= 1 || a->w_bstride == a->N * a->K);
}

#define XPERM_STACK 16384 /* floats of permuted x on the stack; more are malloc'ed */

static void mm_run(const kb_matmul_args *a, const kc_mm_kernels *kn)
{
	mm_job j = {.a = a, .kn = kn};
	/* decode: x permuted once per call for kernels that want it */
	kb_matmul_args ap;
	_Alignas(64) float xs[XPERM_STACK];
	float *xheap = NULL;
	int g = a->M <= kn->mr_max && kn->xperm ? kn->xperm(a->wtype, a->block, a->M) : 0;
	if (g) {
		float *xb = a->M * a->K <= XPERM_STACK ? xs : (xheap = malloc((size_t)(a->M * a->K) * sizeof(float)));
		if (xb) {
			for (int64_t m = 0; m < a->M; m++)
				kn->permute_x(xb + m * a->K, a->x + m * a->x_stride, a->K, g);
			ap = *a;
			ap.x = xb;
			ap.x_stride = a->K;
			j.a = a = &ap;
			j.xperm = 1;
		}
	}
	const int64_t threads = threads_for((double)a->M * (double)a->N * (double)a->K);
	if (j.xperm && rows_fit(a, kn, g)) {
		rows_run(a, kn, a->x, threads);
		free(xheap);
		return;
	}
	const int dec = decode_order(a, kn);
	j.nr = a->M <= kn->m_wide ? kn->nr_m1 : kn->nr;
	j.pack = !dec;
	j.mc = dec ? a->M : 16 * (int64_t)kn->mr_max;
	const int64_t m_blocks = (a->M + j.mc - 1) / j.mc;
	const int64_t panels = (a->N + j.nr - 1) / j.nr;
	/* prefill: about 4 items per thread, so that uneven progress evens
	 * out; decode: one contiguous stretch of W per thread, which streams
	 * better than 4 (each item starts with a cold panel), 1 MB expert
	 * matrices about 10-20% faster (bench_kernels --decode) */
	int64_t want = (threads * (dec ? 1 : 4) + m_blocks - 1) / m_blocks;
	if (want < 1)
		want = 1;
	j.ppc = (panels + want - 1) / want;
	j.n_chunks = (panels + j.ppc - 1) / j.ppc;
	const int64_t items = m_blocks * j.n_chunks;
	if (threads == 1)
		mm_item(&j, 0, items);
	else
		kc_parallel_for(items, 1, mm_item, &j);
	free(xheap);
}

static void zero_y(const kb_matmul_args *a)
{
	for (int64_t m = 0; m < a->M; m++)
		memset(a->y + m * a->y_stride, 0, (size_t)a->N * sizeof(float));
}

static const kc_mm_kernels *kernels_for(enum kc_isa isa)
{
	switch (isa) {
	case KC_ISA_AVX512BF16:
	case KC_ISA_AVX512: return kc_mm_kernels_avx512();
	case KC_ISA_AVX2: return kc_mm_kernels_avx2();
	default: return NULL;
	}
}

int kc_matmul_isa(enum kc_isa isa, const kb_matmul_args *a)
{
	if (isa > kc_isa_detect())
		return DS_EUNSUPPORTED;
	if (a->M == 0 || a->N == 0)
		return DS_OK;
	if (a->K == 0) {
		if (!a->accumulate)
			zero_y(a);
		return DS_OK;
	}
	const kc_mm_kernels *kn = kernels_for(isa);
	if (!kn) { /* scalar: the reference, rows of W spread over the pool */
		int64_t grain = (int64_t)(262144.0 / ((double)a->M * (double)a->K + 1.0)) + 1;
		kc_parallel_for(a->N, grain, ref_item, (void *)a);
		return DS_OK;
	}
	mm_run(a, kn);
	return DS_OK;
}

/* ---- several products of one x row as one job (kb_matmul_multi) ---- */

#define MM_MULTI_MAX 32

/* The rows of all products as one range, product i from first[i] (each
 * start rounded up to 16 so that a share boundary never splits a cache
 * line of y), cut into shares as for one product (rows_run).  A product
 * whose rows the one-row kernels take (rows_fit) runs them on its part of
 * a share; any other (rows longer than KC_MM_ROWS_MAXK: DeepSeek-V3's
 * hidden size) runs the decode tiles on it (mm_block_decode), which give
 * each row the same bits whatever the range. */
typedef struct multi_rows_job {
	kc_mm_rows proto[MM_MULTI_MAX]; /* one-row products: all but n0, n1, xs, pf_end */
	kb_matmul_args ta[MM_MULTI_MAX]; /* tile products: the arguments, x permuted ... */
	mm_job tj[MM_MULTI_MAX];         /* ... and their decode job (tj[i].a = &ta[i]) */
	int tile[MM_MULTI_MAX];
	int64_t N[MM_MULTI_MAX];
	int64_t first[MM_MULTI_MAX + 1];
	int n;
	const kc_mm_kernels *kn;
	int64_t per; /* rows per share */
} multi_rows_job;

static void multi_rows_item(void *ctx, int64_t b, int64_t e)
{
	const multi_rows_job *j = ctx;
	_Alignas(64) float xs[KC_MM_ROWS_MAXK];
	for (int64_t it = b; it < e; it++) {
		const int64_t r0 = it * j->per, r1 = r0 + j->per;
		for (int i = 0; i < j->n; i++) {
			int64_t lo = r0 > j->first[i] ? r0 - j->first[i] : 0;
			int64_t hi = r1 - j->first[i] < j->N[i] ? r1 - j->first[i] : j->N[i];
			if (lo >= hi)
				continue;
			if (j->tile[i]) {
				mm_block_decode(&j->tj[i], lo, hi);
				continue;
			}
			kc_mm_rows t = j->proto[i];
			t.n0 = lo;
			t.n1 = hi;
			t.xs = xs;
			t.pf_end = (const char *)t.w + (size_t)hi * (size_t)t.K * kb_dtype_size(t.dt);
			j->kn->rows(&t);
		}
	}
}

int kc_matmul_multi_isa(enum kc_isa isa, const kb_matmul_args *a, int n)
{
	if (isa > kc_isa_detect() || n < 1 || n > MM_MULTI_MAX)
		return DS_EUNSUPPORTED;
	const kc_mm_kernels *kn = kernels_for(isa);
	if (!kn || !kn->xperm)
		return DS_EUNSUPPORTED;
	/* x permuted once per distinct (x, K, group): same[i] is the first
	 * product with product i's, xfloats their floats (none for a product
	 * whose dtype the kernels read with x as it is) */
	int g[MM_MULTI_MAX], same[MM_MULTI_MAX];
	int64_t xfloats = 0;
	for (int i = 0; i < n; i++) {
		if (a[i].M != 1 || a[i].N < 1 || a[i].K < 1 || a[i].batch > 1 || kb_dtype_is_quant(a[i].wtype))
			return DS_EUNSUPPORTED;
		g[i] = kn->xperm(a[i].wtype, a[i].block, 1);
		same[i] = i;
		for (int q = 0; q < i && same[i] == i; q++)
			if (a[q].x == a[i].x && a[q].K == a[i].K && g[q] == g[i])
				same[i] = q;
		xfloats += same[i] == i && g[i] ? a[i].K : 0;
	}
	if (xfloats > XPERM_STACK)
		return DS_EUNSUPPORTED;
	_Alignas(64) float xp[XPERM_STACK];
	const float *px[MM_MULTI_MAX];
	multi_rows_job j = {.n = n, .kn = kn};
	int64_t used = 0;
	double macs = 0.0;
	for (int i = 0; i < n; i++) {
		px[i] = same[i] < i ? px[same[i]] : a[i].x;
		if (same[i] == i && g[i]) {
			kn->permute_x(xp + used, a[i].x, a[i].K, g[i]);
			px[i] = xp + used;
			used += a[i].K;
		}
		j.tile[i] = !rows_fit(&a[i], kn, g[i]);
		if (j.tile[i]) {
			j.ta[i] = a[i];
			j.ta[i].x = px[i];
			j.ta[i].x_stride = a[i].K;
			j.tj[i] = (mm_job){.a = &j.ta[i], .kn = kn, .mc = 1, .nr = kn->nr_m1, .xperm = g[i] != 0};
		} else {
			j.proto[i] = (kc_mm_rows){
				.dt = a[i].wtype, .x = px[i], .w = a[i].w, .K = a[i].K, .y = a[i].y,
				.store = !a[i].accumulate, .scale = a[i].w_scale, .scale_stride = a[i].scale_stride,
				.block = a[i].block, .per_item = a[i].N, .pf_bytes = ROWS_PF_BYTES,
			};
		}
		j.N[i] = a[i].N;
		j.first[i + 1] = j.first[i] + (a[i].N + 15) / 16 * 16;
		macs += (double)a[i].N * (double)a[i].K;
	}
	const int64_t threads = threads_for(macs), total = j.first[n];
	j.per = ((total + threads * ROWS_SHARES - 1) / (threads * ROWS_SHARES) + 15) / 16 * 16;
	const int64_t items = (total + j.per - 1) / j.per;
	if (items == 1)
		multi_rows_item(&j, 0, 1);
	else
		kc_parallel_for(items, 1, multi_rows_item, &j);
	return DS_OK;
}

typedef struct batch_job {
	enum kc_isa isa;
	const kb_matmul_args *a;
} batch_job;

/* one product per item; its own matmul runs serially inside the job (the
 * pool does not nest) */
static void batch_items(void *ctx, int64_t begin, int64_t end)
{
	const batch_job *j = ctx;
	const kb_matmul_args *a = j->a;
	for (int64_t i = begin; i < end; i++) {
		kb_matmul_args one = *a;
		one.batch = 0;
		one.x = a->x + i * a->x_bstride;
		one.y = a->y + i * a->y_bstride;
		one.w = (const char *)a->w + kb_dtype_bytes(a->wtype, i * a->w_bstride);
		if (a->w_scale)
			one.w_scale = a->w_scale + i * a->s_bstride;
		kc_matmul_isa(j->isa, &one);
	}
}

/* The per-head products of absorbed MLA (16 x 64 KiB on the bench model)
 * as one stream: 8-10% faster per call than one product per item, each of
 * which started cold (A/B on alternate decode steps). */
int kc_matmul_batch_isa(enum kc_isa isa, const kb_matmul_args *a)
{
	if (isa > kc_isa_detect())
		return DS_EUNSUPPORTED;
	if (a->batch <= 1)
		return kc_matmul_isa(isa, a);
	const kc_mm_kernels *kn = kernels_for(isa);
	const int g = kn && kn->xperm && a->M == 1 ? kn->xperm(a->wtype, a->block, 1) : 0;
	if (a->N > 0 && a->K > 0 && rows_fit(a, kn, g) && a->batch * a->K <= XPERM_STACK) {
		_Alignas(64) float xp[XPERM_STACK];
		for (int64_t i = 0; i < a->batch; i++)
			kn->permute_x(xp + i * a->K, a->x + i * a->x_bstride, a->K, g);
		rows_run(a, kn, xp, threads_for((double)a->batch * (double)a->N * (double)a->K));
		return DS_OK;
	}
	batch_job j = {isa, a};
	kc_parallel_for(a->batch, 1, batch_items, &j);
	return DS_OK;
}

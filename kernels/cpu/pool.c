/*
 * pool.c - persistent thread pool for the CPU kernels (see pool.h).
 *
 * Called by the CPU ops (matmul, the element-wise ops, membw) through
 * kc_parallel_for, and by backend_cpu.c (set_threads).
 *
 * Threading rule and invariants:
 *  1. `busy` is held by exactly one thread while it runs a job or reconfigures
 *     the pool; kc_parallel_for only try-locks it (a second caller, or a nested
 *     call from inside fn, runs its range serially instead of waiting), while
 *     set_threads/shutdown wait for it.
 *  2. The job descriptor (fn, ctx, n_items, grain, n_chunks) is written only by
 *     the busy holder, before it bumps the participants' tickets (seq_cst, so a
 *     release) and after `pending` reached 0 for the previous job (acquire): a
 *     worker reads it only between those two points, so it is never read while
 *     being written.
 *  3. Each worker has its own ticket; the caller bumps the tickets of the
 *     workers it wants (never more than there are chunks), so a worker that is
 *     slow to wake can never join the wrong job.
 *  4. Sleeping uses the store-then-check pattern on both sides with seq_cst
 *     atomics (worker: sleeping=1 then re-read ticket; caller: bump ticket then
 *     read sleeping), under the worker's mutex, so a wake-up cannot be lost.
 *     The same pattern guards the caller's wait for `pending` to reach 0.
 *  5. kc_pool_threads never blocks (an atomic copy of the thread count), so
 *     ops may ask it from inside a job; set_threads and shutdown from inside a
 *     job refuse (DS_EBUSY / no-op) instead of waiting for themselves.
 *
 *   worker:  spin on ticket (~50 us) -> sleep on cv -> ticket changed
 *            -> claim chunks (atomic `next`) -> pending-- (last one wakes the caller)
 */
#include "kernels/cpu/pool.h"

#include "common/status.h"
#include "common/strutil.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define SPIN_NS 50000 /* how long an idle thread spins before it sleeps */

typedef struct worker {
	pthread_t tid;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	uint64_t ticket; /* atomic: bumped by the caller for each job given to this worker */
	int sleeping;    /* atomic: 1 while waiting on cv */
	int started;
} __attribute__((aligned(64))) worker;

static struct {
	int busy;        /* atomic: invariant 1 */
	int stop;        /* atomic: workers exit at their next ticket */
	int configured;  /* threads wanted (caller included); 0 = not yet chosen */
	int threads_now; /* atomic: what kc_pool_threads reports (0 = not chosen) */
	int n_workers;   /* workers running */
	worker *w;       /* [n_workers] */
	/* job descriptor (invariant 2) */
	void (*fn)(void *, int64_t, int64_t);
	void *ctx;
	int64_t n_items, grain, n_chunks;
	int64_t next __attribute__((aligned(64))); /* atomic: next chunk to claim */
	int pending __attribute__((aligned(64)));  /* atomic: participants still working */
	int caller_sleeping;                       /* atomic */
	pthread_mutex_t done_mu;
	pthread_cond_t done_cv;
} P = {
	.done_mu = PTHREAD_MUTEX_INITIALIZER,
	.done_cv = PTHREAD_COND_INITIALIZER,
};

static __thread int in_job; /* set while this thread runs chunks of a job */
static pthread_once_t atexit_once = PTHREAD_ONCE_INIT;

static void register_atexit(void)
{
	atexit(kc_pool_shutdown);
}

static int online_cpus(void)
{
	cpu_set_t set;
	if (sched_getaffinity(0, sizeof set, &set) == 0) {
		int n = CPU_COUNT(&set);
		if (n > 0)
			return n;
	}
	long n = sysconf(_SC_NPROCESSORS_ONLN);
	return n > 0 ? (int)n : 1;
}

static void run_chunks(void)
{
	const int64_t n_chunks = P.n_chunks, grain = P.grain, n = P.n_items;
	void (*fn)(void *, int64_t, int64_t) = P.fn;
	void *ctx = P.ctx;
	in_job = 1;
	for (;;) {
		int64_t c = __atomic_fetch_add(&P.next, 1, __ATOMIC_RELAXED);
		if (c >= n_chunks)
			break;
		int64_t b = c * grain, e = b + grain < n ? b + grain : n;
		fn(ctx, b, e);
	}
	in_job = 0;
}

/* Spins up to SPIN_NS while *p == old; 1 when it changed, 0 on time-out. */
static int spin_while_eq_u64(const uint64_t *p, uint64_t old)
{
	uint64_t t0 = ds_now_ns();
	for (;;) {
		for (int i = 0; i < 64; i++) {
			if (__atomic_load_n(p, __ATOMIC_ACQUIRE) != old)
				return 1;
			cpu_relax();
		}
		if (ds_now_ns() - t0 > SPIN_NS)
			return 0;
	}
}

static void *worker_main(void *arg)
{
	worker *w = arg;
	uint64_t seen = 0;
	for (;;) {
		if (!spin_while_eq_u64(&w->ticket, seen)) {
			pthread_mutex_lock(&w->mu);
			__atomic_store_n(&w->sleeping, 1, __ATOMIC_SEQ_CST);
			while (__atomic_load_n(&w->ticket, __ATOMIC_SEQ_CST) == seen)
				pthread_cond_wait(&w->cv, &w->mu);
			__atomic_store_n(&w->sleeping, 0, __ATOMIC_RELAXED);
			pthread_mutex_unlock(&w->mu);
		}
		seen = __atomic_load_n(&w->ticket, __ATOMIC_ACQUIRE);
		if (__atomic_load_n(&P.stop, __ATOMIC_ACQUIRE))
			break;
		run_chunks();
		if (__atomic_sub_fetch(&P.pending, 1, __ATOMIC_SEQ_CST) == 0 &&
		    __atomic_load_n(&P.caller_sleeping, __ATOMIC_SEQ_CST)) {
			pthread_mutex_lock(&P.done_mu);
			pthread_cond_signal(&P.done_cv);
			pthread_mutex_unlock(&P.done_mu);
		}
	}
	return NULL;
}

static void wake(worker *w)
{
	__atomic_add_fetch(&w->ticket, 1, __ATOMIC_SEQ_CST);
	if (__atomic_load_n(&w->sleeping, __ATOMIC_SEQ_CST)) {
		pthread_mutex_lock(&w->mu);
		pthread_cond_signal(&w->cv);
		pthread_mutex_unlock(&w->mu);
	}
}

static void busy_lock(void)
{
	int expected = 0;
	while (!__atomic_compare_exchange_n(&P.busy, &expected, 1, 0, __ATOMIC_ACQUIRE,
					    __ATOMIC_RELAXED)) {
		expected = 0;
		sched_yield();
	}
}

static int busy_trylock(void)
{
	int expected = 0;
	return __atomic_compare_exchange_n(&P.busy, &expected, 1, 0, __ATOMIC_ACQUIRE,
					   __ATOMIC_RELAXED);
}

static void busy_unlock(void)
{
	__atomic_store_n(&P.busy, 0, __ATOMIC_RELEASE);
}

/* Joins every worker.  Caller holds busy. */
static void stop_workers(void)
{
	if (!P.w)
		return;
	__atomic_store_n(&P.stop, 1, __ATOMIC_RELEASE);
	for (int i = 0; i < P.n_workers; i++)
		if (P.w[i].started)
			wake(&P.w[i]);
	for (int i = 0; i < P.n_workers; i++) {
		if (P.w[i].started)
			pthread_join(P.w[i].tid, NULL);
		pthread_mutex_destroy(&P.w[i].mu);
		pthread_cond_destroy(&P.w[i].cv);
	}
	free(P.w);
	P.w = NULL;
	P.n_workers = 0;
	__atomic_store_n(&P.stop, 0, __ATOMIC_RELEASE);
}

/* Starts configured-1 workers.  Caller holds busy and there are none. */
static int start_workers(void)
{
	pthread_once(&atexit_once, register_atexit);
	if (P.configured <= 0)
		P.configured = online_cpus() < KC_POOL_MAX_THREADS ? online_cpus() : KC_POOL_MAX_THREADS;
	int want = P.configured - 1;
	__atomic_store_n(&P.threads_now, 1, __ATOMIC_RELEASE);
	if (want <= 0)
		return DS_OK;
	P.w = calloc((size_t)want, sizeof *P.w);
	if (!P.w)
		return DS_ENOMEM;
	int rc = DS_OK;
	for (int i = 0; i < want; i++) {
		worker *w = &P.w[i];
		pthread_mutex_init(&w->mu, NULL);
		pthread_cond_init(&w->cv, NULL);
		P.n_workers = i + 1;
		if (pthread_create(&w->tid, NULL, worker_main, w) != 0) {
			rc = DS_EINTERNAL;
			break;
		}
		w->started = 1;
	}
	if (rc) { /* keep the workers that did start */
		while (P.n_workers > 0 && !P.w[P.n_workers - 1].started) {
			pthread_mutex_destroy(&P.w[P.n_workers - 1].mu);
			pthread_cond_destroy(&P.w[P.n_workers - 1].cv);
			P.n_workers--;
		}
	}
	__atomic_store_n(&P.threads_now, P.n_workers + 1, __ATOMIC_RELEASE);
	return rc;
}

int kc_pool_set_threads(int n)
{
	if (n < 0 || n > KC_POOL_MAX_THREADS)
		return DS_EINVAL;
	if (in_job)
		return DS_EBUSY; /* from inside a job: the job holds the pool */
	if (n == 0)
		n = online_cpus();
	if (n > KC_POOL_MAX_THREADS)
		n = KC_POOL_MAX_THREADS;
	busy_lock();
	stop_workers();
	P.configured = n;
	int rc = start_workers();
	busy_unlock();
	return rc;
}

int kc_pool_threads(void)
{
	/* lock-free: callable from inside a job and while another thread runs one */
	int n = __atomic_load_n(&P.threads_now, __ATOMIC_ACQUIRE);
	if (n > 0)
		return n;
	n = online_cpus(); /* what the first job will start */
	return n < KC_POOL_MAX_THREADS ? n : KC_POOL_MAX_THREADS;
}

void kc_pool_shutdown(void)
{
	if (in_job)
		return;
	busy_lock();
	stop_workers();
	/* the next job starts P.configured threads again */
	__atomic_store_n(&P.threads_now, P.configured, __ATOMIC_RELEASE);
	busy_unlock();
}

static void wait_pending(void)
{
	uint64_t t0 = ds_now_ns();
	for (;;) {
		for (int i = 0; i < 64; i++) {
			if (__atomic_load_n(&P.pending, __ATOMIC_ACQUIRE) == 0)
				return;
			cpu_relax();
		}
		if (ds_now_ns() - t0 > SPIN_NS)
			break;
	}
	pthread_mutex_lock(&P.done_mu);
	__atomic_store_n(&P.caller_sleeping, 1, __ATOMIC_SEQ_CST);
	while (__atomic_load_n(&P.pending, __ATOMIC_SEQ_CST) != 0)
		pthread_cond_wait(&P.done_cv, &P.done_mu);
	__atomic_store_n(&P.caller_sleeping, 0, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&P.done_mu);
}

void kc_parallel_for(int64_t n_items, int64_t grain,
		     void (*fn)(void *ctx, int64_t begin, int64_t end), void *ctx)
{
	if (n_items <= 0)
		return;
	if (grain < 1)
		grain = 1;
	int64_t n_chunks = (n_items + grain - 1) / grain;
	if (n_chunks == 1 || in_job || !busy_trylock()) {
		fn(ctx, 0, n_items);
		return;
	}
	if (!P.w && P.configured != 1)
		start_workers(); /* on failure: runs with the workers that started */
	int helpers = P.n_workers;
	if ((int64_t)helpers > n_chunks - 1)
		helpers = (int)(n_chunks - 1);
	if (helpers <= 0) {
		busy_unlock();
		fn(ctx, 0, n_items);
		return;
	}
	P.fn = fn;
	P.ctx = ctx;
	P.n_items = n_items;
	P.grain = grain;
	P.n_chunks = n_chunks;
	__atomic_store_n(&P.next, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&P.pending, helpers, __ATOMIC_RELAXED);
	for (int i = 0; i < helpers; i++)
		wake(&P.w[i]);
	run_chunks();
	wait_pending();
	busy_unlock();
}

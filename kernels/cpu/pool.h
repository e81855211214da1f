/*
 * pool.h - the CPU backend's persistent thread pool.
 *
 * Workers are created once (at the first kc_parallel_for or kc_pool_set_threads)
 * and live until kc_pool_shutdown (registered with atexit).  Between jobs a
 * worker spins briefly on its own ticket, then sleeps on a condition variable;
 * no thread is created per call.
 *
 * One caller at a time: kc_parallel_for is meant to be called from one thread
 * (the engine's compute thread).  A second thread that calls it while a job is
 * running does not race: it runs its whole range itself, serially.  A call made
 * from inside a job (fn calling kc_parallel_for) also runs serially.
 */
#ifndef DS_KERNELS_CPU_POOL_H
#define DS_KERNELS_CPU_POOL_H

#include <stdint.h>

/* Maximum threads (caller included) the pool will run. */
#define KC_POOL_MAX_THREADS 256

/* Sets the number of threads that share a job, the caller included (n = 1:
 * the caller alone); 0 = the number of online CPUs this process may run on
 * (sched_getaffinity; the default before any call).  Restarts the workers;
 * waits for a running job to end.  DS_EINVAL when n < 0 or n > KC_POOL_MAX_THREADS;
 * DS_EBUSY when called from inside a job; DS_ENOMEM / DS_EINTERNAL when a
 * worker could not be started (the pool then runs with the workers it has). */
int kc_pool_set_threads(int n);

/* Threads a job uses, the caller included (>= 1).  Never blocks. */
int kc_pool_threads(void);

/* Calls fn(ctx, begin, end) over [0, n_items) in chunks of grain items (the
 * last chunk may be shorter), spread over the workers and the calling thread;
 * returns when every chunk is done.  Chunks are claimed dynamically, so fn
 * must not assume which thread runs which chunk.  n_items <= 0 does nothing;
 * grain < 1 counts as 1. */
void kc_parallel_for(int64_t n_items, int64_t grain,
		     void (*fn)(void *ctx, int64_t begin, int64_t end), void *ctx);

/* Stops and joins the workers (idempotent; registered with atexit; a no-op
 * from inside a job).  A later kc_parallel_for starts them again. */
void kc_pool_shutdown(void);

#endif

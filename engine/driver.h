/*
 * driver.h - a model whose plan runs in rank processes on this machine (the
 * distributed driver): dsrun --tp/--pp/--ep, later the agent's launcher.
 *
 * driver_model_load starts a rendezvous store (comm_store_server, 127.0.0.1,
 * any port) when the plan has more than one rank, forks the plan's world
 * ranks (l->argv followed by the rank options: `dsagent worker --rank R
 * --tp .. --store ADDR --job ID ...`, see worker/worker.h), talks to rank 0
 * over a socket on its stdin/stdout (engine/rankproto.h frames) and returns
 * a `model` (engine/model.h) that the scheduler and dsrun use unchanged:
 *   - model_forward sends a STEP and reads rank 0's LOGITS (or ERROR);
 *   - model_kv is a bookkeeping cache with the ranks' page size and page
 *     count (kv_seq_* hand out the page ids the ranks use; it holds one f32
 *     per position, which the driver never touches: kv_cache_new has no
 *     storage-less form, so this is the smallest one);
 *   - the getters answer from READY (vocabulary, limits, eos ids, arch,
 *     backend) and from a STATS at load (weight and extra bytes: the sums
 *     over the ranks).
 *
 * Every wait is bounded: replies are awaited in short polls, and between
 * them every rank is checked (waitpid WNOHANG).  A rank that exits or is
 * killed fails the call within a fraction of a second with an error naming
 * it ("rank 2 (pid N) was killed by signal 9"); from then on the model is
 * broken: the remaining ranks are killed and every later call returns the
 * same error.  model_free sends STOP, waits briefly, then SIGKILLs and reaps
 * every rank: no process is left behind.  Each rank also dies with this
 * process (PR_SET_PDEATHSIG, set before exec).
 *
 * Thread rule: as model.h (one call at a time per model).  The model forks
 * from the thread that loads it; that thread's exit kills the ranks (the
 * death signal follows the forking thread).
 */
#ifndef DS_ENGINE_DRIVER_H
#define DS_ENGINE_DRIVER_H

#include "common/status.h"
#include "engine/model.h"

#include <stdint.h>

#define DRIVER_LOAD_TIMEOUT_MS_DEFAULT 600000
#define DRIVER_MAX_RANKS 256 /* ranks of one driver on one machine */

typedef struct driver_launch {
	/* The rank command before its options, NULL-terminated, argv[0] a
	 * path: {"/usr/bin/dsagent", "worker", NULL}.  Borrowed. */
	const char *const *argv;
	model_plan plan;
	int load_timeout_ms;  /* longest wait for READY (0 = DRIVER_LOAD_TIMEOUT_MS_DEFAULT) */
	int comm_timeout_ms;  /* the ranks' --comm-timeout-ms (0 = their default) */
	int reply_timeout_ms; /* longest wait for one reply (0 = as long as every rank lives) */
	const char *log_level; /* the ranks' --log-level (NULL = "warn") */
	/* Ranks started elsewhere (by the agents of other nodes).  remote NULL:
	 * every rank is forked here.  Else remote[r] != 0 marks rank r (never
	 * rank 0, which talks to this driver over its stdin/stdout) as started
	 * by start_remote, called once per such rank with its options (what
	 * follows the command: `--model ... --rank R ...`, NULL-terminated,
	 * valid during the call) after the local ranks are forked; a failure
	 * fails the load.  Such a rank gets no --parent-pid, and the driver
	 * cannot wait for it: its death reaches the driver as rank 0's error
	 * (the collective that lost it), not by name and pid. */
	const uint8_t *remote;
	int (*start_remote)(void *ctx, int rank, const char *const *opts, ds_err *err);
	void *remote_ctx;
	/* Where the rendezvous store listens and the ranks dial it (NULL =
	 * 127.0.0.1), and each rank's --host, the address it listens on for
	 * its peers ([W]; NULL = 127.0.0.1 for all).  Ranks with the same host
	 * are counted as one machine's for --local-ranks. */
	const char *store_host;
	const char *const *rank_hosts;
	/* "NAME=VALUE" entries (NULL-terminated, or NULL) added to the
	 * environment of the ranks forked here (a plan's NCCL variables);
	 * they replace variables of the same name. */
	const char *const *env;
	/* While the ranks load: each rank's weight bytes copied so far
	 * (reported through the rendezvous store about every 250 ms, and once
	 * more when all are ready), on the loading thread.  NULL = not asked. */
	void (*on_progress)(void *ctx, int rank, uint64_t bytes);
	void *progress_ctx;
} driver_launch;

/* The plan 1 x 1 x 1, no command, the timeouts 0 (defaults), log "warn". */
driver_launch driver_default_launch(void);

/* Starts the plan's ranks for p (p->path names the checkpoint every rank
 * opens; p->source, p->backend_override and p->rank are not used;
 * p->kv_bytes must be 0) and waits for READY.  NULL with err filled:
 * DS_EINVAL for a bad plan or command, the store's errors, DS_EIO naming
 * a rank that exited or was killed while loading (its log is on this
 * process's stderr), rank 0's ERROR (the load failure), DS_ETIMEOUT past
 * the load timeout.  Nothing is left running on failure. */
model *driver_model_load(const model_params *p, const driver_launch *l, ds_err *err);

/* 1 when m is a driver's model. */
int driver_is_model(const model *m);

typedef struct driver_rank_stat {
	int rank;
	int pid;
	uint64_t weight_bytes;   /* model_weight_bytes of the rank */
	uint64_t extra_bytes;    /* model_extra_bytes */
	uint64_t peak_rss_bytes; /* VmHWM of the rank process */
	double comm_seconds;     /* model_comm_seconds */
} driver_rank_stat;

/* Asks every rank for its record (a STATS frame): out[0..W) in rank
 * order, W = the plan's world size; returns W, or a negative code with err
 * (DS_EINVAL when m is not a driver's model, DS_ERANGE when cap < W, the
 * errors of model_forward). */
int driver_rank_stats(model *m, driver_rank_stat *out, int cap, ds_err *err);

/* The pid of rank r when this driver forked it; 0 for a rank started
 * elsewhere, a bad r, or a model that is not a driver's.  Any thread: the
 * pids are set at load. */
int driver_rank_pid(const model *m, int r);

/* For a signal handler (async-signal-safe): SIGKILL every rank of every
 * driver model of this process.  The models stay to be freed. */
void driver_signal_teardown(void);

#endif

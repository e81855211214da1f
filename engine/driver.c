/*
 * driver.c - the distributed driver: a `model` whose plan runs in rank
 * processes (driver.h says what callers get).  Called by dsrun (--tp, --pp,
 * --ep, --driver); calls comm/ (the rendezvous store server), engine/
 * rankproto (frames), engine/kv (the bookkeeping cache) and the C library's
 * fork/exec/poll/waitpid.  It never includes worker/: it only speaks the
 * frame protocol to the rank command it is given.
 *
 * Lifecycle (each edge names the function that takes it):
 *
 *   driver_model_load ──comm_store_server_start (W > 1)──> STORE
 *     ──ranks_spawn (fork; child: PDEATHSIG, parent check, exec)──> SPAWNED
 *     ──ready_wait (READY frame, or a rank's death, or the load timeout)──> READY
 *     ──stats_fetch (STATS: weight and extra bytes)──> SERVING
 *     └── any failure: ranks_kill, ranks_reap, comm_store_server_stop ──> NULL
 *
 *   SERVING ──drv_forward: STEP out, LOGITS in──> SERVING
 *           ──drv_forward: ERROR in (step refused, ranks go on)──> SERVING
 *           ──a rank died, rank 0's ERROR names a broken group, a bad
 *             frame, an I/O error: broken_set (ranks_kill)──> BROKEN
 *   BROKEN  ──every call──> the same error
 *   SERVING | BROKEN ──drv_free: STOP (SERVING), wait up to STOP_GRACE_MS,
 *             ranks_kill, ranks_reap, store stop──> gone
 *
 * Threading: one caller at a time (model.h); the store server has its own
 * thread inside comm/.  Forking happens while that thread runs, so the
 * child calls only async-signal-safe functions before exec (prctl, getppid,
 * dup2, open, close_range, signal, sigprocmask, execve, write, _exit) and
 * every argv string is built before fork.
 *
 * Invariants:
 *   1. every wait is a poll of at most POLL_MS followed by ranks_check, so
 *      a dead rank is seen within POLL_MS whatever the other ranks do.
 *   2. the forward path never allocates: the drain buffer (also where an
 *      ERROR's message lands, READY's included) exists from the start, the
 *      frame buffer (16 + max_payload bytes) from READY; logits are read
 *      straight into the caller's rows.
 *   3. a pid is in the signal registry from fork until just before it is
 *      reaped (never after: a reaped pid may be reused).
 *   4. rank 0's socket is the only channel to the ranks; the others have
 *      /dev/null for stdin and stdout and share this process's stderr.
 */
#include "engine/driver.h"
#include "comm/comm.h"
#include "common/log.h"
#include "common/strutil.h"
#include "engine/engine.h"
#include "engine/kv.h"
#include "engine/model_impl.h"
#include "engine/rankproto.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define POLL_MS 50          /* invariant 1 */
#define PROGRESS_MS 250     /* load progress polls */
#define STOP_GRACE_MS 2000  /* model_free: how long ranks get to exit after STOP */
#define BLAME_WAIT_MS 2000  /* a broken group: how long to wait for the rank that died */
#define ERROR_MSG_MAX 4096  /* bytes of an ERROR message kept */
#define DRAIN_BYTES 65536
#define RANK_ARGS 48        /* options after the command prefix */
#define ARG_BYTES 64        /* one numeric option value */

typedef struct rank_proc {
	pid_t pid;
	int reaped, status; /* status: waitpid's, once reaped */
} rank_proc;

typedef struct driver {
	model base;
	kb_backend be;         /* only .name: the ranks' backend */
	char arch[32], backend[16];
	int W;
	rank_proc *ranks;      /* [W] */
	int fd;                /* rank 0's socket (non-blocking) */
	comm_store_server *store;
	int reply_timeout_ms, max_seqs, max_blocks;
	size_t max_payload;
	uint8_t *frame;        /* [RANKPROTO_HEADER_BYTES + max_payload] */
	uint8_t *drain;        /* [DRAIN_BYTES] */
	uint32_t next_id;
	int broken;
	ds_err broken_err;
	/* while loading: each rank's "<job>/progress/<rank>" to on_progress */
	void (*on_progress)(void *ctx, int rank, uint64_t bytes);
	void *progress_ctx;
	comm_store progress; /* a client of the driver's own store */
	int have_progress;
	char job[64];
	double next_progress_ms;
} driver;

/* ---- the signal registry (invariant 3) ---- */

static volatile pid_t g_pids[DRIVER_MAX_RANKS * 4];

static void registry_add(pid_t pid)
{
	for (size_t i = 0; i < sizeof g_pids / sizeof g_pids[0]; i++)
		if (__sync_bool_compare_and_swap(&g_pids[i], 0, pid))
			return;
}

static void registry_del(pid_t pid)
{
	for (size_t i = 0; i < sizeof g_pids / sizeof g_pids[0]; i++)
		if (__sync_bool_compare_and_swap(&g_pids[i], pid, 0))
			return;
}

void driver_signal_teardown(void)
{
	for (size_t i = 0; i < sizeof g_pids / sizeof g_pids[0]; i++) {
		pid_t p = g_pids[i];
		if (p > 0)
			kill(p, SIGKILL);
	}
}

/* ---- ranks ---- */

static double now_ms(void)
{
	return ds_now_s() * 1e3;
}

/* "rank 2 (pid N) was killed by signal 9" / "exited with status 1". */
static int death_msg(const driver *d, int r, ds_err *err, const char *when)
{
	const rank_proc *p = &d->ranks[r];
	if (WIFSIGNALED(p->status))
		return ds_err_set(err, DS_EIO, "rank %d (pid %d) was killed by signal %d%s", r, (int)p->pid,
				  WTERMSIG(p->status), when);
	return ds_err_set(err, DS_EIO, "rank %d (pid %d) exited with status %d%s", r, (int)p->pid,
			  WIFEXITED(p->status) ? WEXITSTATUS(p->status) : -1, when);
}

/* Reaps the ranks that ended.  DS_OK when none ended since the start,
 * else DS_EIO naming one: a rank killed by a signal before one that exited,
 * a non-zero status before zero, the lowest rank first. */
static int ranks_check(driver *d, const char *when, ds_err *err)
{
	int worst = -1, worst_score = 0;
	for (int r = 0; r < d->W; r++) {
		rank_proc *p = &d->ranks[r];
		if (!p->reaped && p->pid > 0) {
			int st;
			pid_t got = waitpid(p->pid, &st, WNOHANG);
			if (got == p->pid) {
				registry_del(p->pid);
				p->reaped = 1;
				p->status = st;
			}
		}
		if (!p->reaped)
			continue;
		int score = WIFSIGNALED(p->status) ? 3 : (WEXITSTATUS(p->status) != 0 ? 2 : 1);
		if (score > worst_score)
			worst = r, worst_score = score;
	}
	return worst < 0 ? DS_OK : death_msg(d, worst, err, when);
}

static void ranks_kill(driver *d)
{
	for (int r = 0; r < d->W; r++)
		if (d->ranks[r].pid > 0 && !d->ranks[r].reaped)
			kill(d->ranks[r].pid, SIGKILL);
}

/* Waits (blocking; call after ranks_kill or once they exit) for every rank. */
static void ranks_reap(driver *d)
{
	for (int r = 0; r < d->W; r++) {
		rank_proc *p = &d->ranks[r];
		if (p->pid <= 0 || p->reaped)
			continue;
		registry_del(p->pid);
		while (waitpid(p->pid, &p->status, 0) < 0 && errno == EINTR)
			;
		p->reaped = 1;
	}
}

static int broken_set(driver *d, const ds_err *e, ds_err *err)
{
	if (!d->broken) {
		d->broken = 1;
		d->broken_err = *e;
		log_error("driver", "the ranks failed", "error=\"%s\"", e->msg);
		ranks_kill(d);
	}
	if (err)
		*err = d->broken_err;
	return d->broken_err.code;
}

/* ---- I/O on rank 0's socket (invariant 1) ---- */

/* Each rank's load progress from the store to on_progress (while loading,
 * at most every PROGRESS_MS). */
static void progress_poll(driver *d)
{
	if (!d->have_progress || now_ms() < d->next_progress_ms)
		return;
	d->next_progress_ms = now_ms() + PROGRESS_MS;
	for (int r = 0; r < d->W; r++) {
		char key[128], v[32];
		size_t n = 0;
		ds_err e = {0};
		snprintf(key, sizeof key, "%s/progress/%d", d->job, r);
		if (d->progress.get(d->progress.ctx, key, v, sizeof v - 1, &n, 1, &e) != DS_OK)
			continue; /* not reported yet */
		v[n] = 0;
		char *end = NULL;
		unsigned long long b = strtoull(v, &end, 10);
		if (end != v && *end == 0)
			d->on_progress(d->progress_ctx, r, (uint64_t)b);
	}
}

/* Waits for fd to be ready for events; deadline_ms 0 = none. */
static int fd_wait(driver *d, short events, double deadline_ms, const char *what, ds_err *err)
{
	for (;;) {
		progress_poll(d);
		struct pollfd pf = {.fd = d->fd, .events = events};
		int n = poll(&pf, 1, POLL_MS);
		if (n < 0 && errno != EINTR)
			return ds_err_set(err, DS_EIO, "poll on rank 0's socket: %m");
		if (n > 0 && (pf.revents & (events | POLLHUP | POLLERR)))
			return DS_OK;
		int rc = ranks_check(d, what, err);
		if (rc)
			return rc;
		if (deadline_ms > 0 && now_ms() > deadline_ms)
			return ds_err_set(err, DS_ETIMEOUT, "no answer from rank 0 (pid %d)%s",
					  (int)d->ranks[0].pid, what);
	}
}

/* Rank 0's socket closed or reset under us: rank 0 is ending (or ended).
 * Waits up to BLAME_WAIT_MS for a rank to be seen ending, to name it; else
 * the socket's own error (errno of the failed call, 0 for the end of input). */
static int rank0_gone(driver *d, int errnum, const char *what, ds_err *err)
{
	double until = now_ms() + BLAME_WAIT_MS;
	while (now_ms() < until) {
		int rc = ranks_check(d, what, err);
		if (rc)
			return rc;
		struct timespec ts = {0, 10 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
	if (!errnum)
		return ds_err_set(err, DS_EIO, "rank 0 (pid %d) closed its socket%s", (int)d->ranks[0].pid,
				  what);
	return ds_err_set(err, DS_EIO, "rank 0 (pid %d): the socket failed%s: %s", (int)d->ranks[0].pid,
			  what, strerror(errnum));
}

static int read_exact(driver *d, void *buf, size_t n, double deadline_ms, const char *what,
		      ds_err *err)
{
	size_t got = 0;
	while (got < n) {
		ssize_t r = recv(d->fd, (char *)buf + got, n - got, 0);
		if (r > 0) {
			got += (size_t)r;
			continue;
		}
		if (r == 0) /* rank 0 closed: it is exiting; name why */
			return rank0_gone(d, 0, what, err);
		if (errno == EINTR)
			continue;
		if (errno != EAGAIN && errno != EWOULDBLOCK)
			return rank0_gone(d, errno, what, err);
		int rc = fd_wait(d, POLLIN, deadline_ms, what, err);
		if (rc)
			return rc;
	}
	return DS_OK;
}

/* Reads and drops n bytes. */
static int read_skip(driver *d, size_t n, double deadline_ms, const char *what, ds_err *err)
{
	while (n) {
		size_t c = n < DRAIN_BYTES ? n : DRAIN_BYTES;
		int rc = read_exact(d, d->drain, c, deadline_ms, what, err);
		if (rc)
			return rc;
		n -= c;
	}
	return DS_OK;
}

static int write_all(driver *d, const void *buf, size_t n, ds_err *err)
{
	size_t put = 0;
	while (put < n) {
		ssize_t w = send(d->fd, (const char *)buf + put, n - put, MSG_NOSIGNAL);
		if (w > 0) {
			put += (size_t)w;
			continue;
		}
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
			return rank0_gone(d, errno, "", err);
		int rc = fd_wait(d, POLLOUT, 0, "", err);
		if (rc)
			return rc;
	}
	return DS_OK;
}

static double reply_deadline(const driver *d)
{
	return d->reply_timeout_ms > 0 ? now_ms() + d->reply_timeout_ms : 0;
}

/* Reads a reply header and checks it; *h filled. */
static int header_read(driver *d, rankproto_header *h, double deadline_ms, const char *what,
		       ds_err *err)
{
	uint8_t b[RANKPROTO_HEADER_BYTES];
	int rc = read_exact(d, b, sizeof b, deadline_ms, what, err);
	if (rc)
		return rc;
	rankproto_header_get(b, h);
	if (h->magic != RANKPROTO_MAGIC || h->version != RANKPROTO_VERSION)
		return ds_err_set(err, DS_EFORMAT, "rank 0 sent a frame with magic 0x%08x version %u "
				  "(want 0x%08x version %d)", h->magic, h->version, RANKPROTO_MAGIC,
				  RANKPROTO_VERSION);
	return DS_OK;
}

/* Reads an ERROR payload of h->length bytes into e (the message as sent). */
static int error_read(driver *d, const rankproto_header *h, double deadline_ms, ds_err *e,
		      ds_err *err)
{
	if (h->length < 4)
		return ds_err_set(err, DS_EFORMAT, "rank 0 sent an ERROR of %u bytes", h->length);
	int32_t code;
	int rc = read_exact(d, &code, 4, deadline_ms, "", err);
	size_t n = h->length - 4, keep = n < ERROR_MSG_MAX ? n : ERROR_MSG_MAX;
	char *msg = (char *)d->drain;
	if (!rc)
		rc = read_exact(d, msg, keep, deadline_ms, "", err);
	if (!rc)
		rc = read_skip(d, n - keep, deadline_ms, "", err);
	if (rc)
		return rc;
	ds_err_set(e, code < 0 ? code : DS_EINTERNAL, "%.*s", (int)keep, msg);
	return DS_OK;
}

/* Rank 0 said its group broke (e0): the rank that died is the better name,
 * so give the ranks a moment to be seen ending.  *out gets the error to
 * report. */
static void blame_name(driver *d, const ds_err *e0, const char *when, ds_err *out)
{
	ds_err e = {0};
	double until = now_ms() + BLAME_WAIT_MS;
	int rc;
	while (!(rc = ranks_check(d, when, &e)) && now_ms() < until) {
		struct timespec ts = {0, 20 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
	if (rc)
		ds_err_set(out, DS_EIO, "%s (rank 0: %s)", e.msg, e0->msg);
	else
		*out = *e0;
}

static int blame(driver *d, const ds_err *e0, ds_err *err)
{
	ds_err e = {0};
	blame_name(d, e0, "", &e);
	return broken_set(d, &e, err);
}

/* ---- the model ---- */

static driver *drv_of(model *m)
{
	return (driver *)m;
}

static int drv_forward(model *m, const eng_batch *b, float *logits, ds_err *err)
{
	driver *d = drv_of(m);
	if (d->broken)
		return broken_set(d, NULL, err);
	int rc = model_check_batch(m, b, err);
	if (rc)
		return rc;
	if (b->n_seq > d->max_seqs || b->max_blocks > d->max_blocks)
		return ds_err_set(err, DS_ERANGE, "a step of %d sequences with %d blocks each: the ranks "
				  "take at most %d and %d", b->n_seq, b->max_blocks, d->max_seqs,
				  d->max_blocks);
	size_t len;
	if ((rc = rankproto_step_put(b, d->frame + RANKPROTO_HEADER_BYTES, d->max_payload, &len, err)))
		return rc;
	uint32_t id = ++d->next_id;
	rankproto_header_put(d->frame, RANKPROTO_STEP, id, (uint32_t)len);
	ds_err e = {0};
	rankproto_header h;
	double dl = reply_deadline(d);
	if ((rc = write_all(d, d->frame, RANKPROTO_HEADER_BYTES + len, &e)) ||
	    (rc = header_read(d, &h, dl, " during a step", &e)))
		return broken_set(d, &e, err);
	if (h.id != id)
		goto bad;
	if (h.kind == RANKPROTO_ERROR) {
		ds_err re = {0};
		if ((rc = error_read(d, &h, dl, &re, &e)))
			return broken_set(d, &e, err);
		if (re.code == DS_EIO || re.code == DS_ETIMEOUT) /* a broken group: rank 0 exits */
			return blame(d, &re, err);
		*err = re;
		return re.code;
	}
	if (h.kind != RANKPROTO_LOGITS || h.length < 8)
		goto bad;
	int32_t head[2];
	if ((rc = read_exact(d, head, sizeof head, dl, " during a step", &e)))
		return broken_set(d, &e, err);
	int32_t want = 0;
	for (int i = 0; i < b->n_tok; i++)
		want += !b->want_logits || b->want_logits[i];
	const size_t row = (size_t)d->base.vocab_size * sizeof(float);
	if (head[0] != want || head[1] != d->base.vocab_size || h.length != 8 + (size_t)want * row)
		goto bad;
	rc = logits ? read_exact(d, logits, (size_t)want * row, dl, " during a step", &e)
		    : read_skip(d, (size_t)want * row, dl, " during a step", &e);
	return rc ? broken_set(d, &e, err) : DS_OK;
bad:
	ds_err_set(&e, DS_EFORMAT, "rank 0 answered step %u with a %s frame (id %u, %u bytes) that "
		   "does not match it", id, rankproto_kind_name(h.kind), h.id, h.length);
	return broken_set(d, &e, err);
}

/* The STATS exchange: out[W]. */
static int stats_fetch(driver *d, driver_rank_stat *out, double deadline_ms, ds_err *err)
{
	if (d->broken)
		return broken_set(d, NULL, err);
	uint32_t id = ++d->next_id;
	uint8_t hb[RANKPROTO_HEADER_BYTES];
	rankproto_header_put(hb, RANKPROTO_STATS, id, 0);
	ds_err e = {0};
	rankproto_header h;
	int rc;
	if ((rc = write_all(d, hb, sizeof hb, &e)) || (rc = header_read(d, &h, deadline_ms, "", &e)))
		return broken_set(d, &e, err);
	if (h.id == id && h.kind == RANKPROTO_ERROR) {
		ds_err re = {0};
		if ((rc = error_read(d, &h, deadline_ms, &re, &e)))
			return broken_set(d, &e, err);
		return blame(d, &re, err); /* only a collective fails a STATS */
	}
	int32_t head[2];
	if (h.id != id || h.kind != RANKPROTO_STATS_REPLY ||
	    h.length != 8 + (uint64_t)d->W * RANKPROTO_STAT_BYTES ||
	    (rc = read_exact(d, head, sizeof head, deadline_ms, "", &e)) || head[0] != d->W ||
	    head[1] != RANKPROTO_STAT_BYTES) {
		if (!rc)
			ds_err_set(&e, DS_EFORMAT, "rank 0 answered STATS with a %s frame of %u bytes",
				   rankproto_kind_name(h.kind), h.length);
		return broken_set(d, &e, err);
	}
	for (int r = 0; r < d->W; r++) {
		uint8_t rec[RANKPROTO_STAT_BYTES];
		rankproto_stat s;
		if ((rc = read_exact(d, rec, sizeof rec, deadline_ms, "", &e)))
			return broken_set(d, &e, err);
		rankproto_stat_get(rec, &s);
		out[r] = (driver_rank_stat){.rank = r, .pid = (int)d->ranks[r].pid,
					    .weight_bytes = s.weight_bytes, .extra_bytes = s.extra_bytes,
					    .peak_rss_bytes = s.peak_rss_bytes,
					    .comm_seconds = s.comm_seconds};
	}
	return DS_OK;
}

static void drv_free(model *m)
{
	driver *d = drv_of(m);
	if (d->fd >= 0 && !d->broken && d->ranks[0].pid > 0 && !d->ranks[0].reaped) {
		uint8_t hb[RANKPROTO_HEADER_BYTES];
		ds_err e = {0};
		rankproto_header_put(hb, RANKPROTO_STOP, 0, 0);
		(void)send(d->fd, hb, sizeof hb, MSG_NOSIGNAL | MSG_DONTWAIT);
		double until = now_ms() + STOP_GRACE_MS;
		for (;;) {
			(void)ranks_check(d, "", &e);
			int left = 0;
			for (int r = 0; r < d->W; r++)
				left += d->ranks[r].pid > 0 && !d->ranks[r].reaped;
			if (!left || now_ms() > until)
				break;
			struct timespec ts = {0, 5 * 1000 * 1000};
			nanosleep(&ts, NULL);
		}
	}
	if (d->ranks) {
		ranks_kill(d);
		ranks_reap(d);
	}
	if (d->fd >= 0)
		close(d->fd);
	if (d->have_progress)
		comm_store_tcp_close(&d->progress);
	comm_store_server_stop(d->store);
	kv_cache_free(d->base.kv);
	free(d->frame);
	free(d->drain);
	free(d->ranks);
	free(d);
}

static const model_ops driver_ops = {
	.forward = drv_forward,
	.free = drv_free,
};

int driver_is_model(const model *m)
{
	return m && m->ops == &driver_ops;
}

int driver_rank_stats(model *m, driver_rank_stat *out, int cap, ds_err *err)
{
	if (!driver_is_model(m))
		return ds_err_set(err, DS_EINVAL, "per-rank stats: the model is not run by the driver");
	driver *d = drv_of(m);
	if (cap < d->W)
		return ds_err_set(err, DS_ERANGE, "per-rank stats: %d ranks, room for %d", d->W, cap);
	int rc = stats_fetch(d, out, reply_deadline(d), err);
	return rc ? rc : d->W;
}

int driver_rank_pid(const model *m, int r)
{
	if (!driver_is_model(m))
		return 0;
	const driver *d = (const driver *)m;
	return r >= 0 && r < d->W ? (int)d->ranks[r].pid : 0;
}

driver_launch driver_default_launch(void)
{
	return (driver_launch){.plan = {.tp = 1, .pp = 1, .ep = 1}, .log_level = "warn"};
}

/* ---- start-up ---- */

/* argv of every rank, built before fork: one block of strings. */
typedef struct rank_argv {
	char *args[DRIVER_MAX_RANKS][RANK_ARGS + 16];
	char vals[DRIVER_MAX_RANKS][RANK_ARGS][ARG_BYTES];
} rank_argv;

static int argv_build(rank_argv *a, const driver_launch *l, const model_params *p, int W,
		      const char *store, const char *job, ds_err *err)
{
	int n0 = 0;
	while (l->argv[n0])
		n0++;
	if (n0 > 15)
		return ds_err_set(err, DS_EINVAL, "the rank command has %d words; at most 15", n0);
	const char *attn = p->attn == MODEL_ATTN_NAIVE ? "naive"
			   : p->attn == MODEL_ATTN_ABSORBED ? "absorbed" : "auto";
	for (int r = 0; r < W; r++) {
		char **v = a->args[r];
		int n = 0, k = 0;
		for (int i = 0; i < n0; i++)
			v[n++] = (char *)l->argv[i];
#define OPT(name, ...)                                                             \
	do {                                                                       \
		v[n++] = (char *)(name);                                           \
		snprintf(a->vals[r][k], ARG_BYTES, __VA_ARGS__);                   \
		v[n++] = a->vals[r][k++];                                          \
	} while (0)
		v[n++] = (char *)"--model";
		v[n++] = (char *)p->path;
		OPT("--backend", "%s", p->backend ? p->backend : "auto");
		OPT("--threads", "%d", p->threads);
		OPT("--tp", "%d", l->plan.tp);
		OPT("--pp", "%d", l->plan.pp);
		OPT("--ep", "%d", l->plan.ep);
		OPT("--rank", "%d", r);
		OPT("--job", "%s", job);
		if (store)
			OPT("--store", "%s", store);
		OPT("--max-batch-tokens", "%d", p->max_batch_tokens);
		OPT("--max-ctx", "%d", p->max_ctx);
		OPT("--max-seqs", "%d", p->max_seqs);
		OPT("--page-size", "%d", p->page_size);
		OPT("--n-pages", "%d", p->n_pages);
		OPT("--attn", "%s", attn);
		OPT("--kv-cache-dtype", "%s", p->kv_cache_dtype ? p->kv_cache_dtype : "auto");
		if (l->comm_timeout_ms > 0)
			OPT("--comm-timeout-ms", "%d", l->comm_timeout_ms);
		OPT("--log-level", "%s", l->log_level ? l->log_level : "warn");
		if (!(l->remote && l->remote[r]))
			OPT("--parent-pid", "%d", (int)getpid());
		const char *host = l->rank_hosts && l->rank_hosts[r] ? l->rank_hosts[r] : "127.0.0.1";
		int same = 0;
		for (int q = 0; q < W; q++)
			same += strcmp(l->rank_hosts && l->rank_hosts[q] ? l->rank_hosts[q] : "127.0.0.1",
				       host) == 0;
		OPT("--host", "%s", host);
		OPT("--local-ranks", "%d", same);
		if (p->weights == MODEL_WEIGHTS_MMAP)
			v[n++] = (char *)"--mmap";
#undef OPT
		v[n] = NULL;
	}
	return DS_OK;
}

/* The environment of the ranks forked here: environ with l->env applied
 * (replacing same-name entries), built before fork.  NULL with err. */
static char **env_build(const driver_launch *l, ds_err *err)
{
	extern char **environ;
	size_t n = 0, k = 0;
	while (environ[n])
		n++;
	while (l->env && l->env[k])
		k++;
	char **e = calloc(n + k + 1, sizeof *e);
	if (!e) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	size_t m = 0;
	for (size_t i = 0; i < n; i++) {
		size_t len = strcspn(environ[i], "=");
		int replaced = 0;
		for (size_t j = 0; j < k && !replaced; j++)
			replaced = strncmp(l->env[j], environ[i], len) == 0 && l->env[j][len] == '=';
		if (!replaced)
			e[m++] = environ[i];
	}
	for (size_t j = 0; j < k; j++) {
		if (!strchr(l->env[j], '=') || l->env[j][0] == '=') {
			free(e);
			ds_err_set(err, DS_EINVAL, "rank environment entry '%.64s' is not NAME=VALUE",
				   l->env[j]);
			return NULL;
		}
		e[m++] = (char *)l->env[j];
	}
	e[m] = NULL;
	return e;
}

/* In the child, before exec: only async-signal-safe calls. */
static void child_exec(char **argv, char **envp, int sock, pid_t parent)
{
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
		_exit(1);
	if (sock >= 0) {
		if (dup2(sock, 0) < 0 || dup2(sock, 1) < 0)
			_exit(127);
	} else {
		int nul = open("/dev/null", O_RDWR);
		if (nul < 0 || dup2(nul, 0) < 0 || dup2(nul, 1) < 0)
			_exit(127);
	}
	close_range(3, ~0u, 0);
	signal(SIGPIPE, SIG_DFL);
	sigset_t none; /* a launcher that blocks signals for sigwait (dsagent) */
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	execve(argv[0], argv, envp);
	static const char msg[] = "driver: cannot run the rank command\n";
	ssize_t w = write(2, msg, sizeof msg - 1);
	(void)w;
	_exit(127);
}

static int ranks_spawn(driver *d, rank_argv *a, const driver_launch *l, ds_err *err)
{
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
		return ds_err_set(err, DS_EIO, "socketpair for rank 0: %m");
	pid_t parent = getpid();
	int rc = DS_OK;
	char **envp = env_build(l, err);
	if (!envp) {
		close(sv[0]);
		close(sv[1]);
		return err->code;
	}
	for (int r = 0; r < d->W; r++) {
		if (l->remote && l->remote[r])
			continue; /* started by start_remote, below */
		pid_t pid = fork();
		if (pid < 0) {
			rc = ds_err_set(err, DS_EIO, "fork of rank %d: %m", r);
			break;
		}
		if (pid == 0)
			child_exec(a->args[r], envp, r == 0 ? sv[1] : -1, parent);
		d->ranks[r].pid = pid;
		registry_add(pid);
	}
	free(envp);
	close(sv[1]);
	d->fd = sv[0];
	if (fcntl(d->fd, F_SETFL, fcntl(d->fd, F_GETFL) | O_NONBLOCK) != 0 && !rc)
		rc = ds_err_set(err, DS_EIO, "fcntl: %m");
	int n0 = 0;
	while (l->argv[n0])
		n0++;
	for (int r = 1; !rc && l->remote && r < d->W; r++)
		if (l->remote[r] &&
		    (rc = l->start_remote(l->remote_ctx, r, (const char *const *)a->args[r] + n0, err)))
			ds_err_wrap(err, "starting rank %d elsewhere", r);
	return rc;
}

/* READY (or rank 0's ERROR, a rank's death, the timeout). */
static int ready_wait(driver *d, int timeout_ms, rankproto_ready *rd, ds_err *err)
{
	double dl = now_ms() + timeout_ms;
	const char *when = " while loading (its log is on stderr)";
	rankproto_header h;
	int rc = header_read(d, &h, dl, when, err);
	if (rc)
		return rc == DS_ETIMEOUT ? ds_err_set(err, DS_ETIMEOUT, "the ranks did not load within %d ms",
						      timeout_ms) : rc;
	if (h.kind == RANKPROTO_ERROR) {
		ds_err re = {0};
		if ((rc = error_read(d, &h, dl, &re, err)))
			return rc;
		if (re.code == DS_EIO || re.code == DS_ETIMEOUT) { /* a peer did not join */
			blame_name(d, &re, when, err);
			return err->code;
		}
		return ds_err_set(err, re.code, "%s", re.msg);
	}
	if (h.kind != RANKPROTO_READY || h.length != RANKPROTO_READY_BYTES)
		return ds_err_set(err, DS_EFORMAT, "rank 0's first frame is %s of %u bytes, not READY",
				  rankproto_kind_name(h.kind), h.length);
	uint8_t p[RANKPROTO_READY_BYTES];
	if ((rc = read_exact(d, p, sizeof p, dl, when, err)) ||
	    (rc = rankproto_ready_get(p, sizeof p, rd, err)))
		return rc;
	if (rd->world_size != d->W || rd->rank != 0)
		return ds_err_set(err, DS_EFORMAT, "READY says rank %d of %d; the plan has %d ranks",
				  rd->rank, rd->world_size, d->W);
	return DS_OK;
}

model *driver_model_load(const model_params *p, const driver_launch *l, ds_err *err)
{
	driver *d = NULL;
	rank_argv *a = NULL;
	int rc = model_plan_check(&l->plan, err);
	if (rc)
		return NULL;
	const int W = model_plan_world(&l->plan);
	if (W > DRIVER_MAX_RANKS) {
		ds_err_set(err, DS_EINVAL, "a plan of %d ranks: the driver starts at most %d on one machine",
			   W, DRIVER_MAX_RANKS);
		return NULL;
	}
	if (!l->argv || !l->argv[0] || !p->path) {
		ds_err_set(err, DS_EINVAL, "the driver needs a rank command and a checkpoint path");
		return NULL;
	}
	if (p->kv_bytes) {
		ds_err_set(err, DS_EUNSUPPORTED, "the driver's ranks take --n-pages, not a KV byte cap");
		return NULL;
	}
	d = calloc(1, sizeof *d);
	a = calloc(1, sizeof *a);
	if (!d || !a || !(d->ranks = calloc((size_t)W, sizeof *d->ranks)) ||
	    !(d->drain = malloc(DRAIN_BYTES))) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		goto fail;
	}
	d->fd = -1;
	d->W = W;
	d->base.ops = &driver_ops;
	d->reply_timeout_ms = l->reply_timeout_ms;
	if (l->remote && (l->remote[0] || !l->start_remote)) {
		ds_err_set(err, DS_EINVAL, "remote ranks need start_remote, and rank 0 runs here");
		goto fail;
	}
	if (W > 1 && !(d->store = comm_store_server_start(l->store_host ? l->store_host : "127.0.0.1",
							  0, err)))
		goto fail;
	char job[64];
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	snprintf(job, sizeof job, "drv%d-%llx", (int)getpid(),
		 (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec);
	if (argv_build(a, l, p, W, d->store ? comm_store_server_addr(d->store) : NULL, job, err))
		goto fail;
	if (l->on_progress && d->store) {
		ds_err pe = {0}; /* without it the load goes on, unreported */
		snprintf(d->job, sizeof d->job, "%s", job);
		d->on_progress = l->on_progress;
		d->progress_ctx = l->progress_ctx;
		d->have_progress = comm_store_tcp_open(&d->progress, comm_store_server_addr(d->store),
						       2000, &pe) == DS_OK;
	}
	if (ranks_spawn(d, a, l, err))
		goto fail;
	free(a);
	a = NULL;
	rankproto_ready rd;
	rc = ready_wait(d, l->load_timeout_ms > 0 ? l->load_timeout_ms : DRIVER_LOAD_TIMEOUT_MS_DEFAULT,
			&rd, err);
	if (d->have_progress) {
		d->next_progress_ms = 0;
		if (rc == DS_OK)
			progress_poll(d); /* the final figures */
		comm_store_tcp_close(&d->progress);
		d->have_progress = 0;
	}
	if (rc)
		goto fail;
	kv_params kp = {.n_layers = 1, .row_elems = 1, .page_size = rd.page_size,
			.n_pages = rd.n_pages};
	d->max_payload = (size_t)rd.max_payload;
	d->max_seqs = rd.max_seqs;
	d->max_blocks = rd.max_blocks;
	d->frame = malloc(RANKPROTO_HEADER_BYTES + d->max_payload);
	if (!d->frame) {
		ds_err_set(err, DS_ENOMEM, "out of memory for a step frame of %zu bytes", d->max_payload);
		goto fail;
	}
	if (!(d->base.kv = kv_cache_new(&kp, err)))
		goto fail;
	snprintf(d->arch, sizeof d->arch, "%s", rd.arch);
	snprintf(d->backend, sizeof d->backend, "%s", rd.backend);
	d->be.name = d->backend;
	d->base.be = &d->be;
	d->base.arch = d->arch;
	d->base.vocab_size = rd.vocab_size;
	d->base.ctx = rd.max_ctx;
	d->base.bt = rd.max_batch_tokens;
	d->base.n_eos = rd.n_eos < MODEL_MAX_EOS ? rd.n_eos : MODEL_MAX_EOS;
	for (int i = 0; i < d->base.n_eos; i++)
		d->base.eos_ids[i] = rd.eos[i];
	d->base.rank = (model_rank){.plan = l->plan};
	driver_rank_stat *st = calloc((size_t)W, sizeof *st);
	if (!st) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		goto fail;
	}
	rc = stats_fetch(d, st, now_ms() + (l->load_timeout_ms > 0 ? l->load_timeout_ms
								 : DRIVER_LOAD_TIMEOUT_MS_DEFAULT), err);
	for (int r = 0; !rc && r < W; r++) {
		d->base.weight_bytes += st[r].weight_bytes;
		d->base.extra_bytes += st[r].extra_bytes;
	}
	free(st);
	if (rc)
		goto fail;
	log_debug("driver", "ranks ready", "world=%d tp=%d pp=%d ep=%d arch=%s backend=%s vocab=%d "
		 "page_size=%d n_pages=%d", W, l->plan.tp, l->plan.pp, l->plan.ep, d->arch, d->backend,
		 rd.vocab_size, rd.page_size, rd.n_pages);
	return &d->base;
fail:
	free(a);
	if (d) {
		d->broken = 1; /* no STOP: kill and reap */
		drv_free(&d->base);
	}
	return NULL;
}

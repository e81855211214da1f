/*
 * worker.c - the rank process (`dsagent worker`): join the plan's groups,
 * load this rank's part of the model, run the launcher's requests.  Frames:
 * engine/rankproto.h; options, behaviour and exit statuses: worker.h.
 *
 * Callers: agent/main.c dispatches `dsagent worker ARGS...` here before the
 * agent's own start-up; engine/driver.c (dsrun --tp/--pp/--ep), the agent's
 * launcher (planned) and tests/integration/test_worker.py drive it over
 * stdin/stdout.
 * Calls: engine/model.h (load, forward), engine/rankproto.h (frames),
 * comm/comm.h (the store client and the groups), common/config.h
 * (options), common/log.h (stderr).
 *
 * Lifecycle (each edge names the function that takes it):
 *
 *   start ──groups_open (comm_store_tcp_open, comm_gloo_new x 3, or
 *           comm_single_new for one rank)──> JOINED
 *     ──worker_open (model_load with the model_rank, limits_agree)──> LOADED
 *     ──send_ready (rank 0)──> SERVING
 *     └── any of it fails: ERROR frame (rank 0, id 0), exit 1
 *
 *   SERVING ──frame_next: rank 0 reads a frame from stdin, frame_share
 *            broadcasts it over the world group (header and the first
 *            FRAME_INLINE payload bytes in one call)──> one frame:
 *     STEP  ──step_run (every rank: model_check_batch, model_forward)──> LOGITS
 *           or ERROR (rank 0); a refused step goes on, a failed forward with
 *           more than one rank ends the rank (step_run says why) ─> exit 1
 *     STATS ──stats_run (every rank: comm_all_gather)──> STATS_REPLY (rank 0)
 *     another kind ──reply_error (rank 0)──> ERROR ──────────> SERVING
 *     no frame for comm-timeout-ms / 4 (rank 0: input_ready) ──rank 0 shares
 *           an IDLE frame, every rank goes on──> SERVING (the peers' wait
 *           for the next frame is a collective bounded by the timeout)
 *     STOP, or the end of input between frames (rank 0 shares it as STOP) ──> exit 0
 *     bad header, end of input inside a frame ──fatal (rank 0 shares a
 *       STOP first)──> ERROR frame, exit 1
 *     a collective fails (DS_EIO, DS_ETIMEOUT: the group is broken) ──fatal──> exit 1
 *     a reply that cannot be written ────────────────────────> exit 1
 *
 * Threading: one thread (the model's step rule: one step at a time); the
 * CPU backend's pool works under model_forward.
 *
 * Invariants:
 *   1. every buffer is sized in worker_open from the limits READY announces
 *      (max_payload bytes of frame, max_batch_tokens rows of logits on
 *      rank 0 only); the step loop never allocates.
 *   2. a payload is read whole before it is decoded, and decoded only
 *      against its own length: counts are checked against the limits and
 *      the length before any array is touched.  What the model must check
 *      (token ids, positions, page ids) model_forward checks.  Ranks other
 *      than 0 check the shared header's length against the same limit.
 *   3. stdout carries frames only, and only rank 0's: one fwrite sequence
 *      and one fflush per frame; everything else goes to the log on stderr.
 *   4. every rank handles the same frames in the same order (rank 0's), so
 *      the collectives of a step or a STATS line up.  A step that is
 *      refused is refused by every rank alike (the checks see the same
 *      bytes, before any collective), so nobody is left waiting; a rank
 *      whose forward fails leaves the group, so nobody waits long.
 */
#include "worker/worker.h"
#include "comm/comm.h"
#include "common/config.h"
#include "common/fileutil.h"
#include "common/log.h"
#include "common/status.h"
#include "engine/engine.h"
#include "engine/kv.h"
#include "engine/model.h"
#include "engine/rankproto.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define MAX_PAYLOAD_LIMIT ((uint64_t)1 << 30) /* a STEP frame larger than this is a config error */
#define JOB_MAX 64
#define FRAME_INLINE 4080 /* payload bytes that travel with the header (frame_share) */

struct worker_cfg {
	char *model, *backend, *attn, *kv_dtype, *log_level, *store, *job, *host, *comm_spin;
	int threads, rank, world_size, tp, pp, ep, max_batch_tokens, max_ctx, max_seqs, page_size;
	int n_pages, comm_timeout_ms, mmap_weights, parent_pid, local_ranks, help;
};

#define O(f) offsetof(struct worker_cfg, f)
static const cfg_opt opts[] = {
	{"model", CFG_STR, O(model), NULL, 1, 0, "checkpoint directory or .gguf file", 'm'},
	{"backend", CFG_STR, O(backend), "auto", 1, 0, "compute backend: auto, cpu or cuda"},
	{"threads", CFG_INT, O(threads), "0", 0, 1024, "CPU threads (0 = one per core)", 't'},
	{"tp", CFG_INT, O(tp), "1", 1, 65536, "tensor-parallel ranks per stage and expert group"},
	{"pp", CFG_INT, O(pp), "1", 1, 65536, "pipeline stages"},
	{"ep", CFG_INT, O(ep), "1", 1, 65536, "expert-parallel groups per stage"},
	{"rank", CFG_INT, O(rank), "0", 0, 65535, "this worker's rank in the world group"},
	{"world-size", CFG_INT, O(world_size), "0", 0, 65536,
	 "ranks in the world group: tp * pp * ep, which it must equal when given (0 = that)"},
	{"store", CFG_STR, O(store), NULL, 1, 0,
	 "HOST:PORT of the launcher's rendezvous store (needed for more than one rank)"},
	{"job", CFG_STR, O(job), "job", 1, 0, "key prefix of this run's groups in the store"},
	{"host", CFG_STR, O(host), "127.0.0.1", 1, 0, "address this rank listens on for its peers"},
	{"max-batch-tokens", CFG_INT, O(max_batch_tokens), "512", 1, 1 << 20, "tokens per step"},
	{"max-ctx", CFG_INT, O(max_ctx), "0", 0, 1 << 24,
	 "longest sequence (0 = the model's, at most 4096)"},
	{"max-seqs", CFG_INT, O(max_seqs), "16", 1, 1 << 16,
	 "sequences per step (rows of block_tables); with n-pages 0 the cache holds this many of "
	 "max-ctx"},
	{"page-size", CFG_INT, O(page_size), "64", 1, 1 << 16, "positions per KV page"},
	{"n-pages", CFG_INT, O(n_pages), "0", 0, 1 << 30,
	 "KV pages (0 = enough for max-seqs sequences of max-ctx)"},
	{"attn", CFG_STR, O(attn), "auto", 1, 0, "MLA form: auto, naive or absorbed"},
	{"kv-cache-dtype", CFG_STR, O(kv_dtype), "auto", 1, 0,
	 "KV cache elements: auto (llama-family K/V in f16, DeepSeek's latent rows in f32), f16 or f32"},
	{"mmap", CFG_BOOL, O(mmap_weights), "false", 1, 0,
	 "keep safetensors weights in the file mapping (as dsrun --mmap)"},
	{"comm-timeout-ms", CFG_INT, O(comm_timeout_ms), "60000", 1, 1 << 30,
	 "longest wait of one collective (and of the rendezvous) for its peers; an idle rank 0 "
	 "tells its peers it lives every quarter of it"},
	{"local-ranks", CFG_INT, O(local_ranks), "1", 1, 65536,
	 "ranks of this run on this machine (comm-spin auto counts their threads against the cores)"},
	{"comm-spin", CFG_STR, O(comm_spin), "auto", 1, 0,
	 "inside a step, wait for peers by polling the socket: on, off, or auto (on when "
	 "local-ranks x threads fit the CPUs this process may use)"},
	{"parent-pid", CFG_INT, O(parent_pid), "0", 0, 1 << 30,
	 "exit at once unless the parent process is this pid (0 = no check): a launcher that "
	 "died before this rank started"},
	{"log-level", CFG_STR, O(log_level), "info", 1, 0, "debug, info, warn, error or off (stderr)"},
	{"help", CFG_BOOL, O(help), "false", 1, 0, "this help", 'h'},
	{0},
};

static void usage(FILE *f)
{
	fprintf(f, "usage: dsagent worker --model PATH [--tp N --pp N --ep N --rank R --store HOST:PORT "
		   "--job ID] [options]\n\n"
		   "The rank process: rank 0 runs the requests framed on stdin and answers on\n"
		   "stdout (protocol in engine/rankproto.h, behaviour in worker/worker.h); the\n"
		   "other ranks follow it over the world group.  Options (each also DSWORKER_<NAME>):\n");
	cfg_print_help(opts, "DSWORKER", f);
}

typedef struct worker {
	model *m;
	comm_store store;
	int have_store;
	comm_group *world, *stage, *tp;
	model_rank mr;
	int rank, W;
	int idle_ms; /* rank 0: an IDLE frame to the peers after this long without input */
	FILE *in, *out;
	int vocab, bt, max_ctx, max_seqs, max_blocks, page_size, n_pages;
	size_t max_payload;
	uint8_t *frame;   /* [RANKPROTO_HEADER_BYTES + max_payload] the frame being handled */
	uint8_t *payload; /* frame + RANKPROTO_HEADER_BYTES */
	float *logits;    /* [bt][vocab] rank 0 only */
	uint8_t *stats;   /* [W][RANKPROTO_STAT_BYTES] */
} worker;

/* ---- frames ---- */

static int32_t get_i32(const uint8_t *p)
{
	int32_t v;
	memcpy(&v, p, 4);
	return v;
}

static uint32_t get_u32(const uint8_t *p)
{
	uint32_t v;
	memcpy(&v, p, 4);
	return v;
}

/* Writes one frame (rank 0 only): header, then the payload in two parts
 * (b may be NULL). */
static int frame_write(worker *w, unsigned kind, uint32_t id, const void *a, size_t na,
		       const void *b, size_t nb, ds_err *err)
{
	uint8_t h[RANKPROTO_HEADER_BYTES];
	if (w->rank != 0)
		return DS_OK;
	rankproto_header_put(h, kind, id, (uint32_t)(na + nb));
	if (fwrite(h, 1, sizeof h, w->out) != sizeof h || (na && fwrite(a, 1, na, w->out) != na) ||
	    (nb && fwrite(b, 1, nb, w->out) != nb) || fflush(w->out) != 0)
		return ds_err_set(err, DS_EIO, "writing a reply frame on stdout failed: %m");
	return DS_OK;
}

static int reply_error(worker *w, uint32_t id, const ds_err *e, ds_err *err)
{
	uint8_t code[4];
	int32_t c = e->code ? e->code : DS_EINTERNAL;
	memcpy(code, &c, 4);
	return frame_write(w, RANKPROTO_ERROR, id, code, 4, e->msg, strlen(e->msg), err);
}

/* Reads up to n bytes; the count read (short only at the end of input or
 * on an error, which ferror tells). */
static size_t read_full(FILE *f, void *buf, size_t n)
{
	size_t got = 0;
	while (got < n) {
		size_t r = fread((char *)buf + got, 1, n - got, f);
		if (r == 0)
			break;
		got += r;
	}
	return got;
}

/* Points b at the arrays of a STEP payload (invariant 2). */
static int step_decode(const worker *w, const uint8_t *p, size_t len, eng_batch *b, ds_err *err)
{
	if (len < 16)
		return ds_err_set(err, DS_EFORMAT, "STEP payload of %zu bytes: its four counts alone take 16",
				  len);
	int32_t n_tok = get_i32(p), n_seq = get_i32(p + 4), mb = get_i32(p + 8);
	uint32_t flags = get_u32(p + 12);
	if (n_tok < 1 || n_tok > w->bt)
		return ds_err_set(err, DS_ERANGE, "STEP n_tok %d: a step holds 1..%d tokens "
						  "(--max-batch-tokens)", n_tok, w->bt);
	if (n_seq < 1 || n_seq > w->max_seqs)
		return ds_err_set(err, DS_ERANGE, "STEP n_seq %d: a step holds 1..%d sequences (--max-seqs)",
				  n_seq, w->max_seqs);
	if (mb < 1 || mb > w->max_blocks)
		return ds_err_set(err, DS_ERANGE, "STEP max_blocks %d: a block table has 1..%d entries "
						  "(max-ctx %d / page-size %d)", mb, w->max_blocks, w->max_ctx,
				  w->page_size);
	if (flags & ~RANKPROTO_STEP_WANT)
		return ds_err_set(err, DS_EFORMAT, "STEP flags 0x%x: only 0x%x (want_logits present) is "
						   "defined", flags, RANKPROTO_STEP_WANT);
	const int want = (flags & RANKPROTO_STEP_WANT) != 0;
	size_t nt = (size_t)n_tok, want_bytes = want ? (nt + 3) & ~(size_t)3 : 0;
	uint64_t need = rankproto_step_bytes(n_tok, n_seq, mb, want);
	if (len != need)
		return ds_err_set(err, DS_EFORMAT, "STEP payload is %zu bytes but n_tok %d, n_seq %d, "
						   "max_blocks %d%s need %llu", len, n_tok, n_seq, mb,
				  want ? " with want_logits" : "", (unsigned long long)need);
	const uint8_t *q = p + 16;
	*b = (eng_batch){
		.n_tok = n_tok,
		.tokens = (const int32_t *)q,
		.pos = (const int32_t *)(q + 4 * nt),
		.seq = (const int32_t *)(q + 8 * nt),
		.want_logits = want ? q + 12 * nt : NULL,
		.n_seq = n_seq,
		.block_tables = (const int32_t *)(q + 12 * nt + want_bytes),
		.max_blocks = mb,
	};
	return DS_OK;
}

/* Runs one STEP on every rank; rank 0 replies LOGITS or ERROR.
 *
 * A step the checks refuse (step_decode, model_check_batch: they see the
 * same bytes on every rank) is refused by every rank alike before any
 * collective, and the loop goes on.  A step that fails inside model_forward
 * with more than one rank ends this rank (after rank 0's ERROR reply): its
 * peers may be inside a collective it will never join, and its exit turns
 * their wait into DS_EIO naming it at once, where waiting would last the
 * group's timeout.  So no collective of its own is needed to agree on a
 * step's status: rank 0 cannot finish a step's collectives without every
 * rank's part, and replies LOGITS only then.  Returned: a failed reply, or
 * (with more than one rank) the failure, which ends the loop. */
static int step_run(worker *w, uint32_t id, size_t len, ds_err *err)
{
	eng_batch b;
	ds_err e = {0};
	int rc = step_decode(w, w->payload, len, &b, &e);
	if (!rc)
		rc = model_check_batch(w->m, &b, &e);
	if (rc) {
		log_warn("worker", "step refused", "rank=%d id=%u error=\"%s\"", w->rank, id, e.msg);
		return reply_error(w, id, &e, err);
	}
	if ((rc = model_forward(w->m, &b, w->logits, &e))) {
		if (w->W == 1) {
			log_warn("worker", "step failed", "rank=%d id=%u error=\"%s\"", w->rank, id, e.msg);
			return reply_error(w, id, &e, err);
		}
		log_error("worker", "step failed: this rank leaves the group", "rank=%d id=%u error=\"%s\"",
			  w->rank, id, e.msg);
		int wrc = reply_error(w, id, &e, err);
		if (!wrc)
			*err = e;
		return rc;
	}
	int32_t rows = 0;
	for (int i = 0; i < b.n_tok; i++)
		rows += !b.want_logits || b.want_logits[i];
	int32_t head[2] = {rows, w->vocab};
	return frame_write(w, RANKPROTO_LOGITS, id, head, sizeof head, w->logits,
			   (size_t)rows * (size_t)w->vocab * sizeof(float), err);
}

/* Every rank's record, gathered over the world group; rank 0 replies. */
static int stats_run(worker *w, uint32_t id, ds_err *err)
{
	rankproto_stat s = {.rank = w->rank,
			    .weight_bytes = model_weight_bytes(w->m),
			    .extra_bytes = model_extra_bytes(w->m),
			    .peak_rss_bytes = ds_peak_rss_bytes(),
			    .comm_seconds = model_comm_seconds(w->m)};
	uint8_t *mine = w->stats + (size_t)w->rank * RANKPROTO_STAT_BYTES;
	rankproto_stat_put(&s, mine);
	ds_err e = {0};
	int rc = comm_all_gather(w->world, mine, w->stats, RANKPROTO_STAT_BYTES, COMM_U8, &e);
	if (rc) {
		int wrc = reply_error(w, id, &e, err);
		if (!wrc)
			*err = e;
		return wrc ? wrc : rc;
	}
	int32_t head[2] = {w->W, RANKPROTO_STAT_BYTES};
	return frame_write(w, RANKPROTO_STATS_REPLY, id, head, sizeof head, w->stats,
			   (size_t)w->W * RANKPROTO_STAT_BYTES, err);
}

/* A fatal error: tell the launcher (rank 0), then end the loop with it. */
static int fatal(worker *w, uint32_t id, ds_err *err)
{
	ds_err io = {0};
	log_error("worker", "fatal error", "rank=%d error=\"%s\"", w->rank, err->msg);
	if (reply_error(w, id, err, &io))
		log_error("worker", "cannot send the error", "error=\"%s\"", io.msg);
	return err->code;
}

/* Rank 0 read the frame from its launcher into w->frame; every rank gets
 * it here: one broadcast of a fixed size carries the header and the first
 * FRAME_INLINE payload bytes (all of a decode step's), a second one the
 * rest when the header says there is more (the other ranks check that
 * length against the limit first).  One call a step where there were two,
 * and always of the same size, so Gloo's broadcast object is made once.
 * The one-rank group makes the broadcasts no-ops. */
static int frame_share(worker *w, ds_err *err)
{
	size_t inline_bytes = w->max_payload < FRAME_INLINE ? w->max_payload : FRAME_INLINE;
	int rc = comm_broadcast(w->world, w->frame, (int64_t)(RANKPROTO_HEADER_BYTES + inline_bytes),
				COMM_U8, 0, err);
	if (rc)
		return rc;
	uint32_t len = get_u32(w->frame + 12);
	if (len > w->max_payload)
		return ds_err_set(err, DS_ERANGE, "shared frame of %u payload bytes: the limit is %zu", len,
				  w->max_payload);
	if (len <= inline_bytes)
		return DS_OK;
	return comm_broadcast(w->world, w->payload + inline_bytes, (int64_t)(len - inline_bytes),
			      COMM_U8, 0, err);
}

/* Rank 0 ends the loop on its own (end of input, a bad frame): the other
 * ranks wait in frame_share, so they get a STOP to exit on. */
static void stop_peers(worker *w)
{
	if (w->W == 1)
		return;
	ds_err e = {0};
	rankproto_header_put(w->frame, RANKPROTO_STOP, 0, 0);
	if (frame_share(w, &e))
		log_warn("worker", "cannot stop the other ranks", "error=\"%s\"", e.msg);
}

/* Rank 0, between frames: 1 when input came within w->idle_ms (or the end
 * of input or an error, which frame_read reports), 0 when none did: the
 * peers then get an IDLE frame, so that their wait for the next frame, a
 * collective, stays within the comm timeout while nothing is asked.
 * w->in is unbuffered (worker_main), so poll sees every byte not read. */
static int input_ready(worker *w)
{
	struct pollfd p = {.fd = fileno(w->in), .events = POLLIN};
	int r;
	do
		r = poll(&p, 1, w->idle_ms);
	while (r < 0 && errno == EINTR);
	return r != 0;
}

/* Rank 0: the next frame from stdin into w->frame.  1 = a frame, 0 = the
 * end of input between frames, < 0 = fatal (err filled, *id set). */
static int frame_read(worker *w, uint32_t *id, ds_err *err)
{
	uint8_t *h = w->frame;
	size_t got = read_full(w->in, h, RANKPROTO_HEADER_BYTES);
	if (got == 0 && !ferror(w->in))
		return 0;
	if (got < RANKPROTO_HEADER_BYTES)
		return ds_err_set(err, ferror(w->in) ? DS_EIO : DS_EFORMAT,
				  "truncated frame header: %zu of %d bytes before the end of input", got,
				  RANKPROTO_HEADER_BYTES);
	rankproto_header hd;
	rankproto_header_get(h, &hd);
	*id = hd.id;
	if (hd.magic != RANKPROTO_MAGIC)
		return ds_err_set(err, DS_EFORMAT, "bad frame magic 0x%08x (want 0x%08x, \"DSWK\"): not a "
						   "worker frame", hd.magic, RANKPROTO_MAGIC);
	if (hd.version != RANKPROTO_VERSION)
		return ds_err_set(err, DS_EFORMAT, "frame protocol version %u: this worker speaks version %d",
				  hd.version, RANKPROTO_VERSION);
	if (hd.length > w->max_payload)
		return ds_err_set(err, DS_ERANGE, "%s frame of %u payload bytes: the limit is %zu",
				  rankproto_kind_name(hd.kind), hd.length, w->max_payload);
	got = read_full(w->in, w->payload, hd.length);
	if (got < hd.length)
		return ds_err_set(err, ferror(w->in) ? DS_EIO : DS_EFORMAT,
				  "truncated %s frame: %zu of %u payload bytes before the end of input",
				  rankproto_kind_name(hd.kind), got, hd.length);
	return 1;
}

/* The request loop: DS_OK after STOP or a clean end of input, else the
 * fatal error (already reported on stdout when stdout still works). */
static int serve(worker *w, ds_err *err)
{
	for (uint64_t n_steps = 0;;) {
		uint32_t id = 0;
		int beat = 0;
		if (w->rank == 0 && w->W > 1 && !input_ready(w)) {
			rankproto_header_put(w->frame, RANKPROTO_IDLE, 0, 0);
			beat = 1;
		} else if (w->rank == 0) {
			int got = frame_read(w, &id, err);
			if (got == 0) {
				log_info("worker", "end of input", "steps=%llu", (unsigned long long)n_steps);
				stop_peers(w);
				return DS_OK;
			}
			if (got < 0) {
				stop_peers(w);
				return fatal(w, id, err);
			}
		}
		int rc = frame_share(w, err);
		if (rc)
			return fatal(w, id, err);
		rankproto_header hd;
		rankproto_header_get(w->frame, &hd);
		id = hd.id;
		if (hd.kind == RANKPROTO_STOP) {
			log_info("worker", "stop", "rank=%d steps=%llu", w->rank, (unsigned long long)n_steps);
			return DS_OK;
		}
		if (hd.kind == RANKPROTO_IDLE && (beat || w->rank != 0))
			continue; /* rank 0 lives; a launcher's IDLE gets rank 0's ERROR below */
		if (hd.kind == RANKPROTO_STEP) {
			n_steps++;
			rc = step_run(w, id, hd.length, err);
		} else if (hd.kind == RANKPROTO_STATS) {
			rc = stats_run(w, id, err);
		} else {
			ds_err e = {0};
			ds_err_set(&e, DS_EFORMAT, "frame kind %u (%s) is not one a worker accepts: STEP = %d, "
						   "STOP = %d, STATS = %d", hd.kind, rankproto_kind_name(hd.kind),
				   RANKPROTO_STEP, RANKPROTO_STOP, RANKPROTO_STATS);
			rc = reply_error(w, id, &e, err);
		}
		if (rc) { /* the reply could not be written, or the group broke */
			log_error("worker", "stopping", "rank=%d error=\"%s\"", w->rank, err->msg);
			return rc;
		}
	}
}

/* ---- set-up ---- */

static void worker_close(worker *w)
{
	free(w->stats);
	free(w->logits);
	free(w->frame);
	model_free(w->m);
	comm_group_free(w->tp);
	comm_group_free(w->stage);
	comm_group_free(w->world);
	if (w->have_store)
		comm_store_tcp_close(&w->store);
}

/* --comm-spin: 1 when the step's groups should poll for their peers.
 * auto: only when every rank of this machine can have a core per thread
 * (a polling rank that shares a core stalls the one computing on it). */
static int spin_wanted(const struct worker_cfg *c)
{
	if (strcmp(c->comm_spin, "auto") != 0)
		return strcmp(c->comm_spin, "on") == 0;
	cpu_set_t set;
	int ncpu = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
	int threads = c->threads > 0 ? c->threads : ncpu;
	return (long)c->local_ranks * threads <= ncpu;
}

/* One group of the plan: the one-rank group when it has one rank, else
 * Gloo under "<job>/<name>". */
static comm_group *group_new(worker *w, const struct worker_cfg *c, const char *name, int rank,
			     int size, int spin, ds_err *err)
{
	comm_params cp = comm_default_params();
	cp.rank = rank;
	cp.world_size = size;
	cp.timeout_ms = c->comm_timeout_ms;
	cp.name = name;
	cp.spin = spin;
	if (size == 1)
		return comm_single_new(&cp, err);
	char prefix[JOB_MAX + 32];
	snprintf(prefix, sizeof prefix, "%s/%s", c->job, name);
	comm_group *g = comm_gloo_new(&cp, &w->store, prefix, c->host, err);
	if (!g)
		ds_err_wrap(err, "rank %d joining group %s", w->rank, prefix);
	return g;
}

/* The world, stage and tp groups of this rank (model.h's layout).  The
 * world group carries the frames, whose wait may be long (idle), so it
 * never spins; the stage and tp groups carry a step's collectives. */
static int groups_open(worker *w, const struct worker_cfg *c, ds_err *err)
{
	model_plan plan = {.tp = c->tp, .pp = c->pp, .ep = c->ep};
	int stage, tp_rank, ep_rank;
	model_rank_coords(&plan, w->rank, &stage, &tp_rank, &ep_rank);
	if (w->W > 1) {
		if (comm_store_tcp_open(&w->store, c->store, c->comm_timeout_ms, err))
			return ds_err_wrap(err, "rank %d: the rendezvous store %s", w->rank, c->store);
		w->have_store = 1;
	}
	char sname[32], tname[48];
	snprintf(sname, sizeof sname, "stage%d", stage);
	snprintf(tname, sizeof tname, "tp%d.%d", stage, ep_rank);
	const int S = plan.tp * plan.ep;
	int spin = spin_wanted(c);
	if (!(w->world = group_new(w, c, "world", w->rank, w->W, 0, err)) ||
	    !(w->stage = group_new(w, c, sname, w->rank % S, S, spin, err)) ||
	    !(w->tp = group_new(w, c, tname, tp_rank, plan.tp, spin, err)))
		return err->code;
	if (w->W > 1)
		log_info("worker", "step collectives", "rank=%d spin=%s (comm-spin %s, %d local ranks)",
			 w->rank, spin ? "on" : "off", c->comm_spin, c->local_ranks);
	w->mr = (model_rank){.plan = plan, .rank = w->rank, .stage = stage, .tp_rank = tp_rank,
			     .ep_rank = ep_rank, .world = w->world, .stage_grp = w->stage,
			     .tp_grp = w->tp};
	return DS_OK;
}

/* Every rank must announce the same limits (they came from the same
 * options): rank 0's READY speaks for all. */
static int limits_agree(worker *w, ds_err *err)
{
	if (w->W == 1)
		return DS_OK;
	int32_t mine[5] = {w->vocab, w->bt, w->max_ctx, w->page_size, w->n_pages};
	int32_t *all = calloc((size_t)w->W * 5, sizeof *all);
	if (!all)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	int rc = comm_all_gather(w->world, mine, all, 5, COMM_I32, err);
	for (int r = 0; !rc && r < w->W; r++)
		if (memcmp(all + 5 * r, mine, sizeof mine) != 0)
			rc = ds_err_set(err, DS_EINVAL, "rank %d has vocab %d, max_batch_tokens %d, max_ctx %d, "
					"page_size %d, n_pages %d; rank %d has %d, %d, %d, %d, %d", r,
					all[5 * r], all[5 * r + 1], all[5 * r + 2], all[5 * r + 3],
					all[5 * r + 4], w->rank, mine[0], mine[1], mine[2], mine[3],
					mine[4]);
	free(all);
	return rc;
}

/* ---- load progress: "<job>/progress/<rank>" in the rendezvous store ---- */

#define PROGRESS_MS 250

typedef struct progress {
	worker *w;
	char key[160];
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int done;
} progress;

/* The weight bytes copied so far, as decimal text, under the rank's key. */
static void progress_put(progress *p)
{
	char v[32];
	int n = snprintf(v, sizeof v, "%llu", (unsigned long long)model_load_bytes());
	ds_err e = {0};
	if (p->w->store.set(p->w->store.ctx, p->key, v, (size_t)n, &e) != DS_OK)
		log_debug("worker", "cannot report load progress", "error=\"%s\"", e.msg);
}

static void *progress_main(void *arg)
{
	progress *p = arg;
	pthread_mutex_lock(&p->mu);
	while (!p->done) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		ts.tv_nsec += PROGRESS_MS * 1000000L;
		if (ts.tv_nsec >= 1000000000L) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000L;
		}
		pthread_cond_timedwait(&p->cv, &p->mu, &ts);
		pthread_mutex_unlock(&p->mu);
		progress_put(p);
		pthread_mutex_lock(&p->mu);
	}
	pthread_mutex_unlock(&p->mu);
	return NULL;
}

static int worker_open(worker *w, const struct worker_cfg *c, ds_err *err)
{
	int rc = groups_open(w, c, err);
	if (rc)
		return rc;
	/* while the model loads, its bytes so far go to the store every
	 * PROGRESS_MS (the launcher shows them); without a store, nothing */
	progress pg = {.w = w};
	pthread_t pt;
	int have_pt = 0;
	if (w->have_store) {
		snprintf(pg.key, sizeof pg.key, "%s/progress/%d", c->job, w->rank);
		pthread_mutex_init(&pg.mu, NULL);
		pthread_cond_init(&pg.cv, NULL);
		have_pt = pthread_create(&pt, NULL, progress_main, &pg) == 0;
	}
	model_params mp = model_default_params();
	mp.path = c->model;
	mp.backend = c->backend;
	mp.threads = c->threads;
	mp.max_batch_tokens = c->max_batch_tokens;
	mp.max_ctx = c->max_ctx;
	mp.max_seqs = c->max_seqs;
	mp.page_size = c->page_size;
	mp.n_pages = c->n_pages;
	mp.kv_cache_dtype = c->kv_dtype;
	mp.weights = c->mmap_weights ? MODEL_WEIGHTS_MMAP : MODEL_WEIGHTS_AUTO;
	mp.rank = w->W > 1 ? &w->mr : NULL;
	(void)model_attn_parse(c->attn, &mp.attn); /* checked in worker_main */
	w->m = model_load(&mp, err);
	if (w->have_store) {
		if (have_pt) {
			pthread_mutex_lock(&pg.mu);
			pg.done = 1;
			pthread_cond_signal(&pg.cv);
			pthread_mutex_unlock(&pg.mu);
			pthread_join(pt, NULL);
		}
		if (w->m)
			progress_put(&pg); /* the whole share */
		pthread_cond_destroy(&pg.cv);
		pthread_mutex_destroy(&pg.mu);
	}
	if (!w->m)
		return ds_err_wrap(err, "rank %d loading %s", w->rank, c->model);
	const kv_params *kp = kv_cache_params(model_kv(w->m));
	w->vocab = model_vocab_size(w->m);
	w->bt = model_max_batch_tokens(w->m);
	w->max_ctx = model_max_ctx(w->m);
	w->max_seqs = c->max_seqs;
	w->page_size = kp->page_size;
	w->n_pages = kp->n_pages;
	w->max_blocks = (w->max_ctx + kp->page_size - 1) / kp->page_size;
	uint64_t maxp = rankproto_step_bytes(w->bt, w->max_seqs, w->max_blocks, 1);
	if (maxp > MAX_PAYLOAD_LIMIT)
		return ds_err_set(err, DS_ERANGE, "a STEP frame could take %llu bytes (max-batch-tokens %d, "
						  "max-seqs %d, %d blocks): lower them below %llu bytes",
				  (unsigned long long)maxp, w->bt, w->max_seqs, w->max_blocks,
				  (unsigned long long)MAX_PAYLOAD_LIMIT);
	w->max_payload = (size_t)maxp;
	w->frame = malloc(RANKPROTO_HEADER_BYTES + w->max_payload);
	w->payload = w->frame ? w->frame + RANKPROTO_HEADER_BYTES : NULL;
	w->stats = calloc((size_t)w->W, RANKPROTO_STAT_BYTES);
	if (w->rank == 0)
		w->logits = malloc((size_t)w->bt * (size_t)w->vocab * sizeof(float));
	if (!w->payload || !w->stats || (w->rank == 0 && !w->logits))
		return ds_err_set(err, DS_ENOMEM, "out of memory for %d rows of %d logits", w->bt, w->vocab);
	return limits_agree(w, err);
}

static int send_ready(worker *w, ds_err *err)
{
	rankproto_ready r = {.rank = w->rank, .world_size = w->W, .vocab_size = w->vocab,
			     .max_batch_tokens = w->bt, .max_ctx = w->max_ctx,
			     .page_size = w->page_size, .n_pages = w->n_pages,
			     .max_seqs = w->max_seqs, .max_blocks = w->max_blocks,
			     .max_payload = (int32_t)w->max_payload};
	const int *eos;
	int n = model_eos_ids(w->m, &eos);
	r.n_eos = n < RANKPROTO_MAX_EOS ? n : RANKPROTO_MAX_EOS;
	for (int i = 0; i < r.n_eos; i++)
		r.eos[i] = eos[i];
	snprintf(r.arch, sizeof r.arch, "%s", model_arch_name(w->m));
	snprintf(r.backend, sizeof r.backend, "%s", model_backend_name(w->m));
	uint8_t p[RANKPROTO_READY_BYTES];
	rankproto_ready_put(&r, p);
	return frame_write(w, RANKPROTO_READY, 0, p, sizeof p, NULL, 0, err);
}

/* The options that make sense together; 2 with a message on stderr else. */
static int cfg_check(struct worker_cfg *c)
{
	model_plan plan = {.tp = c->tp, .pp = c->pp, .ep = c->ep};
	ds_err e = {0};
	enum log_level lv;
	enum model_attn attn;
	if (model_plan_check(&plan, &e) != DS_OK) {
		fprintf(stderr, "dsagent worker: %s\n", e.msg);
		return 2;
	}
	int W = model_plan_world(&plan);
	if (c->world_size != 0 && c->world_size != W) {
		fprintf(stderr, "dsagent worker: --world-size %d does not match the plan: --tp %d x --pp %d "
				"x --ep %d = %d ranks (leave --world-size out)\n", c->world_size, c->tp, c->pp,
			c->ep, W);
		return 2;
	}
	c->world_size = W;
	if (c->rank >= W) {
		fprintf(stderr, "dsagent worker: --rank %d is outside 0..%d (%d ranks)\n", c->rank, W - 1, W);
		return 2;
	}
	if (W > 1 && !c->store) {
		fprintf(stderr, "dsagent worker: %d ranks need --store HOST:PORT (the launcher's rendezvous "
				"store)\n", W);
		return 2;
	}
	if (strlen(c->job) > JOB_MAX) {
		fprintf(stderr, "dsagent worker: --job is longer than %d bytes\n", JOB_MAX);
		return 2;
	}
	if (strcmp(c->comm_spin, "auto") != 0 && strcmp(c->comm_spin, "on") != 0 &&
	    strcmp(c->comm_spin, "off") != 0) {
		fprintf(stderr, "dsagent worker: --comm-spin must be auto, on or off, got '%s'\n",
			c->comm_spin);
		return 2;
	}
	/* set explicitly, as the agent does: the log's own default is not
	 * relied on */
	if (log_level_parse(c->log_level, &lv) != DS_OK) {
		fprintf(stderr, "dsagent worker: --log-level must be debug, info, warn, error or off, "
				"got '%s'\n", c->log_level);
		return 2;
	}
	log_set_level(lv);
	if (model_attn_parse(c->attn, &attn) != DS_OK) {
		fprintf(stderr, "dsagent worker: --attn must be auto, naive or absorbed, got '%s'\n", c->attn);
		return 2;
	}
	return 0;
}

int worker_main(int argc, char **argv)
{
	struct worker_cfg cfg;
	ds_err err = {0};
	worker w = {.in = stdin, .out = stdout};
	int next = 0, rc = 0;

	/* a rank whose launcher dies goes with it (PR_SET_PDEATHSIG); the
	 * launcher may have died before that took effect, which --parent-pid
	 * catches (checked once the options are read) */
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0)
		return 1;
	/* a launcher that went away makes writes fail (DS_EIO), not kill us */
	signal(SIGPIPE, SIG_IGN);
	if (cfg_load(opts, &cfg, "DSWORKER", argc, argv, 1, &next, &err) != DS_OK) {
		fprintf(stderr, "dsagent worker: %s\n", err.msg);
		rc = 2;
		goto out;
	}
	if (next < argc) {
		fprintf(stderr, "dsagent worker: unexpected argument '%s' (see --help)\n", argv[next]);
		rc = 2;
		goto out;
	}
	if (cfg.help) {
		usage(stdout);
		goto out;
	}
	if (cfg.parent_pid && getppid() != (pid_t)cfg.parent_pid) {
		fprintf(stderr, "dsagent worker: the launcher (pid %d) is gone\n", cfg.parent_pid);
		rc = 1;
		goto out;
	}
	if (!cfg.model) {
		fprintf(stderr, "dsagent worker: --model PATH is required (see --help)\n");
		rc = 2;
		goto out;
	}
	if ((rc = cfg_check(&cfg)))
		goto out;
	w.rank = cfg.rank;
	w.W = cfg.world_size;
	w.idle_ms = cfg.comm_timeout_ms / 4 > 0 ? cfg.comm_timeout_ms / 4 : 1;
	setvbuf(w.in, NULL, _IONBF, 0); /* input_ready polls the descriptor */
	if (worker_open(&w, &cfg, &err) != DS_OK) {
		rc = 1;
		log_error("worker", "cannot start", "rank=%d error=\"%s\"", cfg.rank, err.msg);
		ds_err io = {0};
		reply_error(&w, 0, &err, &io);
		goto out;
	}
	log_info("worker", "ready", "rank=%d world_size=%d tp=%d pp=%d ep=%d model=%s backend=%s arch=%s "
		 "comm=%s vocab=%d max_batch_tokens=%d max_ctx=%d page_size=%d n_pages=%d", w.rank, w.W,
		 cfg.tp, cfg.pp, cfg.ep, cfg.model, model_backend_name(w.m), model_arch_name(w.m),
		 comm_group_backend(w.world), w.vocab, w.bt, w.max_ctx, w.page_size, w.n_pages);
	if (send_ready(&w, &err) != DS_OK || serve(&w, &err) != DS_OK) {
		log_error("worker", "stopped on an error", "rank=%d error=\"%s\"", cfg.rank, err.msg);
		rc = 1;
	}
out:
	worker_close(&w);
	cfg_free(opts, &cfg);
	return rc;
}

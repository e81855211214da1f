/*
 * worker.c - the rank process (`dsagent worker`): load the model, join the
 * group, run the launcher's steps.  Frames and exit statuses: worker.h.
 *
 * Callers: agent/main.c dispatches `dsagent worker ARGS...` here before the
 * agent's own start-up; the launcher (agent/launch, planned) and
 * tests/integration/test_worker.py drive it over stdin/stdout.
 * Calls: engine/model.h (load, forward), comm/comm.h (the group),
 * common/config.h (options), common/log.h (stderr).
 *
 * Lifecycle (each edge names the function that takes it):
 *
 *   start ──worker_open (model_load, comm_single_new)──> LOADED ──send_ready──> SERVING
 *     └── it fails: ERROR frame (id 0), exit 1
 *
 *   SERVING ──serve (read_full, frame_share)──> one frame:
 *     STEP ──step_run──> LOGITS or ERROR reply ──────────────> SERVING
 *     another kind ──reply_error──> ERROR reply ─────────────> SERVING
 *     STOP, or the end of input between frames ──────────────> exit 0
 *     bad header, end of input inside a frame ──fatal──> ERROR frame, exit 1
 *     a reply that cannot be written ────────────────────────> exit 1
 *
 * Threading: one thread (the model's step rule: one step at a time); the
 * CPU backend's pool works under model_forward.
 *
 * Invariants:
 *   1. every buffer is sized in worker_open from the limits READY announces
 *      (max_payload bytes of frame, max_batch_tokens rows of logits); the
 *      step loop never allocates.
 *   2. a payload is read whole before it is decoded, and decoded only
 *      against its own length: counts are checked against the limits and
 *      the length before any array is touched.  What the model must check
 *      (token ids, positions, page ids) model_forward checks.
 *   3. stdout carries frames only: one fwrite sequence and one fflush per
 *      frame; everything else goes to the log on stderr.
 */
#include "worker/worker.h"
#include "comm/comm.h"
#include "common/config.h"
#include "common/log.h"
#include "common/status.h"
#include "engine/engine.h"
#include "engine/kv.h"
#include "engine/model.h"

#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Frames are little-endian and copied with memcpy: this build assumes the
 * host is too (every machine dsagent targets). */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "worker frames are little-endian; this host is not"
#endif

#define MAX_PAYLOAD_LIMIT ((uint64_t)1 << 30) /* a STEP frame larger than this is a config error */
#define READY_FIELDS 10

struct worker_cfg {
	char *model, *backend, *attn, *log_level;
	int threads, rank, world_size, max_batch_tokens, max_ctx, max_seqs, page_size, n_pages;
	int comm_timeout_ms, help;
};

#define O(f) offsetof(struct worker_cfg, f)
static const cfg_opt opts[] = {
	{"model", CFG_STR, O(model), NULL, 1, 0, "checkpoint directory or .gguf file", 'm'},
	{"backend", CFG_STR, O(backend), "auto", 1, 0, "compute backend: auto, cpu or cuda"},
	{"threads", CFG_INT, O(threads), "0", 0, 1024, "CPU threads (0 = one per core)", 't'},
	{"rank", CFG_INT, O(rank), "0", 0, 65535, "this worker's rank in the world group"},
	{"world-size", CFG_INT, O(world_size), "1", 1, 65536,
	 "ranks in the world group (only 1 until the distributed engine exists)"},
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
	{"comm-timeout-ms", CFG_INT, O(comm_timeout_ms), "60000", 1, 1 << 30,
	 "longest wait of one collective for its peers"},
	{"log-level", CFG_STR, O(log_level), "info", 1, 0, "debug, info, warn, error or off (stderr)"},
	{"help", CFG_BOOL, O(help), "false", 1, 0, "this help", 'h'},
	{0},
};

static void usage(FILE *f)
{
	fprintf(f, "usage: dsagent worker --model PATH [options]\n\n"
		   "The rank process: runs the steps framed on stdin, answers on stdout\n"
		   "(protocol in worker/worker.h).  Options (each also DSWORKER_<NAME>):\n");
	cfg_print_help(opts, "DSWORKER", f);
}

typedef struct worker {
	model *m;
	comm_group *g;
	FILE *in, *out;
	int vocab, bt, max_ctx, max_seqs, max_blocks, page_size, n_pages;
	size_t max_payload;
	uint8_t *payload; /* [max_payload] the frame being handled */
	float *logits;    /* [bt][vocab] */
} worker;

/* ---- frames ---- */

static void put_u32(uint8_t *p, uint32_t v)
{
	memcpy(p, &v, 4);
}

static uint32_t get_u32(const uint8_t *p)
{
	uint32_t v;
	memcpy(&v, p, 4);
	return v;
}

static int32_t get_i32(const uint8_t *p)
{
	int32_t v;
	memcpy(&v, p, 4);
	return v;
}

static uint16_t get_u16(const uint8_t *p)
{
	uint16_t v;
	memcpy(&v, p, 2);
	return v;
}

/* Writes one frame: header, then the payload in two parts (b may be NULL). */
static int frame_write(worker *w, enum worker_kind kind, uint32_t id, const void *a, size_t na,
		       const void *b, size_t nb, ds_err *err)
{
	uint8_t h[WORKER_HEADER_BYTES];
	uint16_t version = WORKER_PROTO_VERSION, k = (uint16_t)kind;
	put_u32(h, WORKER_MAGIC);
	memcpy(h + 4, &version, 2);
	memcpy(h + 6, &k, 2);
	put_u32(h + 8, id);
	put_u32(h + 12, (uint32_t)(na + nb));
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
	return frame_write(w, WORKER_ERROR, id, code, 4, e->msg, strlen(e->msg), err);
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

static const char *kind_name(unsigned kind)
{
	switch (kind) {
	case WORKER_STEP:
		return "STEP";
	case WORKER_STOP:
		return "STOP";
	case WORKER_READY:
		return "READY";
	case WORKER_LOGITS:
		return "LOGITS";
	case WORKER_ERROR:
		return "ERROR";
	}
	return "unknown";
}

static size_t pad4(size_t n)
{
	return (n + 3) & ~(size_t)3;
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
	if (flags & ~WORKER_STEP_WANT)
		return ds_err_set(err, DS_EFORMAT, "STEP flags 0x%x: only 0x%x (want_logits present) is "
						   "defined", flags, WORKER_STEP_WANT);
	size_t nt = (size_t)n_tok, want_bytes = (flags & WORKER_STEP_WANT) ? pad4(nt) : 0;
	size_t need = 16 + 12 * nt + want_bytes + 4 * (size_t)n_seq * (size_t)mb;
	if (len != need)
		return ds_err_set(err, DS_EFORMAT, "STEP payload is %zu bytes but n_tok %d, n_seq %d, "
						   "max_blocks %d%s need %zu", len, n_tok, n_seq, mb,
				  want_bytes ? " with want_logits" : "", need);
	const uint8_t *q = p + 16;
	*b = (eng_batch){
		.n_tok = n_tok,
		.tokens = (const int32_t *)q,
		.pos = (const int32_t *)(q + 4 * nt),
		.seq = (const int32_t *)(q + 8 * nt),
		.want_logits = want_bytes ? q + 12 * nt : NULL,
		.n_seq = n_seq,
		.block_tables = (const int32_t *)(q + 12 * nt + want_bytes),
		.max_blocks = mb,
	};
	return DS_OK;
}

/* Runs one STEP and replies LOGITS or ERROR; only a failed reply is
 * returned (the step's own failure is the reply). */
static int step_run(worker *w, uint32_t id, size_t len, ds_err *err)
{
	eng_batch b;
	ds_err e = {0};
	int rc = step_decode(w, w->payload, len, &b, &e);
	if (!rc)
		rc = model_forward(w->m, &b, w->logits, &e);
	if (rc) {
		log_warn("worker", "step refused", "id=%u error=\"%s\"", id, e.msg);
		return reply_error(w, id, &e, err);
	}
	int32_t rows = 0;
	for (int i = 0; i < b.n_tok; i++)
		rows += !b.want_logits || b.want_logits[i];
	int32_t head[2] = {rows, w->vocab};
	return frame_write(w, WORKER_LOGITS, id, head, sizeof head, w->logits,
			   (size_t)rows * (size_t)w->vocab * sizeof(float), err);
}

/* A fatal protocol error: tell the launcher, then end the loop with it. */
static int fatal(worker *w, uint32_t id, ds_err *err)
{
	ds_err io = {0};
	log_error("worker", "protocol error", "error=\"%s\"", err->msg);
	if (reply_error(w, id, err, &io))
		log_error("worker", "cannot send the error", "error=\"%s\"", io.msg);
	return err->code;
}

/* Rank 0 read the frame from its launcher; every other rank gets it here.
 * The one-rank group makes both broadcasts no-ops. */
static int frame_share(worker *w, uint8_t *header, size_t len, ds_err *err)
{
	int rc = comm_broadcast(w->g, header, WORKER_HEADER_BYTES, COMM_U8, 0, err);
	if (!rc)
		rc = comm_broadcast(w->g, w->payload, (int64_t)len, COMM_U8, 0, err);
	return rc;
}

/* The step loop: DS_OK after STOP or a clean end of input, else the fatal
 * error (already reported on stdout when stdout still works). */
static int serve(worker *w, ds_err *err)
{
	for (uint64_t n_steps = 0;;) {
		uint8_t h[WORKER_HEADER_BYTES];
		size_t got = read_full(w->in, h, sizeof h);
		if (got == 0 && !ferror(w->in)) {
			log_info("worker", "end of input", "steps=%llu", (unsigned long long)n_steps);
			return DS_OK;
		}
		if (got < sizeof h) {
			ds_err_set(err, ferror(w->in) ? DS_EIO : DS_EFORMAT,
				   "truncated frame header: %zu of %d bytes before the end of input", got,
				   WORKER_HEADER_BYTES);
			return fatal(w, 0, err);
		}
		uint32_t magic = get_u32(h), id = get_u32(h + 8), len = get_u32(h + 12);
		unsigned version = get_u16(h + 4), kind = get_u16(h + 6);
		if (magic != WORKER_MAGIC) {
			ds_err_set(err, DS_EFORMAT, "bad frame magic 0x%08x (want 0x%08x, \"DSWK\"): not a worker "
						    "frame", magic, WORKER_MAGIC);
			return fatal(w, id, err);
		}
		if (version != WORKER_PROTO_VERSION) {
			ds_err_set(err, DS_EFORMAT, "frame protocol version %u: this worker speaks version %d",
				   version, WORKER_PROTO_VERSION);
			return fatal(w, id, err);
		}
		if (len > w->max_payload) {
			ds_err_set(err, DS_ERANGE, "%s frame of %u payload bytes: the limit is %zu", kind_name(kind),
				   len, w->max_payload);
			return fatal(w, id, err);
		}
		got = read_full(w->in, w->payload, len);
		if (got < len) {
			ds_err_set(err, ferror(w->in) ? DS_EIO : DS_EFORMAT,
				   "truncated %s frame: %zu of %u payload bytes before the end of input",
				   kind_name(kind), got, len);
			return fatal(w, id, err);
		}
		int rc = frame_share(w, h, len, err);
		if (rc)
			return fatal(w, id, err);
		if (kind == WORKER_STOP) {
			log_info("worker", "stop", "steps=%llu", (unsigned long long)n_steps);
			return DS_OK;
		}
		if (kind == WORKER_STEP) {
			n_steps++;
			rc = step_run(w, id, len, err);
		} else {
			ds_err e = {0};
			ds_err_set(&e, DS_EFORMAT, "frame kind %u (%s) is not one a worker accepts: STEP = %d, "
						   "STOP = %d", kind, kind_name(kind), WORKER_STEP, WORKER_STOP);
			rc = reply_error(w, id, &e, err);
		}
		if (rc) /* the reply could not be written: nobody is listening */
			return rc;
	}
}

/* ---- set-up ---- */

static void worker_close(worker *w)
{
	free(w->logits);
	free(w->payload);
	comm_group_free(w->g);
	model_free(w->m);
}

static int worker_open(worker *w, const struct worker_cfg *c, ds_err *err)
{
	model_params mp = model_default_params();
	mp.path = c->model;
	mp.backend = c->backend;
	mp.threads = c->threads;
	mp.max_batch_tokens = c->max_batch_tokens;
	mp.max_ctx = c->max_ctx;
	mp.max_seqs = c->max_seqs;
	mp.page_size = c->page_size;
	mp.n_pages = c->n_pages;
	(void)model_attn_parse(c->attn, &mp.attn); /* checked in worker_main */
	if (!(w->m = model_load(&mp, err)))
		return ds_err_wrap(err, "loading %s", c->model);
	comm_params cp = comm_default_params();
	cp.rank = c->rank;
	cp.world_size = c->world_size;
	cp.timeout_ms = c->comm_timeout_ms;
	cp.name = "world";
	if (!(w->g = comm_single_new(&cp, err)))
		return err->code;
	const kv_params *kp = kv_cache_params(model_kv(w->m));
	w->vocab = model_vocab_size(w->m);
	w->bt = model_max_batch_tokens(w->m);
	w->max_ctx = model_max_ctx(w->m);
	w->max_seqs = c->max_seqs;
	w->page_size = kp->page_size;
	w->n_pages = kp->n_pages;
	w->max_blocks = (w->max_ctx + kp->page_size - 1) / kp->page_size;
	uint64_t bt = (uint64_t)w->bt;
	uint64_t maxp = 16 + 12 * bt + pad4((size_t)bt) +
			4 * (uint64_t)w->max_seqs * (uint64_t)w->max_blocks;
	if (maxp > MAX_PAYLOAD_LIMIT)
		return ds_err_set(err, DS_ERANGE, "a STEP frame could take %llu bytes (max-batch-tokens %d, "
						  "max-seqs %d, %d blocks): lower them below %llu bytes",
				  (unsigned long long)maxp, w->bt, w->max_seqs, w->max_blocks,
				  (unsigned long long)MAX_PAYLOAD_LIMIT);
	w->max_payload = (size_t)maxp;
	w->payload = malloc(w->max_payload);
	w->logits = malloc((size_t)w->bt * (size_t)w->vocab * sizeof(float));
	if (!w->payload || !w->logits)
		return ds_err_set(err, DS_ENOMEM, "out of memory for %d rows of %d logits", w->bt, w->vocab);
	return DS_OK;
}

static int send_ready(worker *w, ds_err *err)
{
	int32_t f[READY_FIELDS] = {comm_group_rank(w->g), comm_group_size(w->g), w->vocab, w->bt,
				   w->max_ctx, w->page_size, w->n_pages, w->max_seqs, w->max_blocks,
				   (int32_t)w->max_payload};
	return frame_write(w, WORKER_READY, 0, f, sizeof f, NULL, 0, err);
}

int worker_main(int argc, char **argv)
{
	struct worker_cfg cfg;
	ds_err err = {0};
	worker w = {.in = stdin, .out = stdout};
	int next = 0, rc = 0;

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
	if (!cfg.model) {
		fprintf(stderr, "dsagent worker: --model PATH is required (see --help)\n");
		rc = 2;
		goto out;
	}
	if (cfg.world_size != 1) {
		fprintf(stderr, "dsagent worker: --world-size %d: running more than one rank needs the "
				"distributed engine (not built yet); use --world-size 1\n", cfg.world_size);
		rc = 2;
		goto out;
	}
	if (cfg.rank >= cfg.world_size) {
		fprintf(stderr, "dsagent worker: --rank %d is outside 0..%d (--world-size %d)\n", cfg.rank,
			cfg.world_size - 1, cfg.world_size);
		rc = 2;
		goto out;
	}
	/* set explicitly, as the agent does: the log's own default is not
	 * relied on */
	enum log_level lv;
	if (log_level_parse(cfg.log_level, &lv) != DS_OK) {
		fprintf(stderr, "dsagent worker: --log-level must be debug, info, warn, error or off, "
				"got '%s'\n", cfg.log_level);
		rc = 2;
		goto out;
	}
	log_set_level(lv);
	enum model_attn attn;
	if (model_attn_parse(cfg.attn, &attn) != DS_OK) {
		fprintf(stderr, "dsagent worker: --attn must be auto, naive or absorbed, got '%s'\n", cfg.attn);
		rc = 2;
		goto out;
	}
	if (worker_open(&w, &cfg, &err) != DS_OK) {
		rc = 1;
		log_error("worker", "cannot start", "rank=%d error=\"%s\"", cfg.rank, err.msg);
		ds_err io = {0};
		reply_error(&w, 0, &err, &io);
		goto out;
	}
	log_info("worker", "ready", "rank=%d world_size=%d model=%s backend=%s arch=%s comm=%s vocab=%d "
		 "max_batch_tokens=%d max_ctx=%d page_size=%d n_pages=%d", comm_group_rank(w.g),
		 comm_group_size(w.g), cfg.model, model_backend_name(w.m), model_arch_name(w.m),
		 comm_group_backend(w.g), w.vocab, w.bt, w.max_ctx, w.page_size, w.n_pages);
	if (send_ready(&w, &err) != DS_OK || serve(&w, &err) != DS_OK) {
		log_error("worker", "stopped on an error", "rank=%d error=\"%s\"", cfg.rank, err.msg);
		rc = 1;
	}
out:
	worker_close(&w);
	cfg_free(opts, &cfg);
	return rc;
}

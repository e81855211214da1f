/*
 * dsrun.c - the single-process engine CLI (generate, tokenize, dump logits,
 * bench).  Every form the tests and the benchmarks use:
 *
 * DIR is a checkpoint directory or a .gguf file.
 *
 *   dsrun -m DIR -p TEXT [-n N] [--temp T] [--top-p P] [--top-k K] [--seed S] [--threads N]
 *   dsrun -m DIR --chat TEXT ...              (the model's chat template first)
 *   dsrun -m DIR --tokens 1,2,3 --dump-logits FILE   (f32 LE [n_tokens][vocab])
 *   dsrun -m DIR --tokens 1,2,3 -n N --temp 0 --ids  (JSON array of the N ids)
 *   dsrun -m DIR --tokenize TEXT | --detokenize 1,2,3
 *   dsrun -m DIR --bench [--prompt-len 512] [-n 128] [--batch B] [--json] [--membw] [--profile]
 *
 * Any of them (but --tokenize, --detokenize, --membw and --profile) runs under a
 * parallel plan with --tp N --pp N --ep N (any > 1, or --driver for the
 * one-rank plan): the model is then engine/driver.c's, whose ranks are
 * `dsagent worker` processes (the dsagent next to this executable, or
 * $DSRUN_DSAGENT); --threads is threads per rank (default cores / ranks).
 *
 * Options come from one table (common/config.h), so each is also DSRUN_<NAME>
 * in the environment.  Errors go to stderr with a non-zero exit: 2 for bad
 * usage, 1 for everything else (missing files, bad checkpoints, bad ids).
 */
#include "common/buf.h"
#include "common/config.h"
#include "common/fileutil.h"
#include "common/log.h"
#include "common/strutil.h"
#include "engine/chat.h"
#include "engine/driver.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/source.h"
#include "engine/tok.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/membw.h"
#include "kernels/cpu/profile.h"

#include <limits.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_PROMPT_TOKENS (1 << 20)

struct run_cfg {
	char *model, *prompt, *chat, *tokens, *dump_logits, *tokenize, *detokenize, *backend, *attn, *kv_dtype;
	char *system, *stop_ids;
	int n_predict, top_k, threads, ids, bench, prompt_len, batch, json, ctx, ignore_eos, membw, profile;
	int mmap_weights, tp, pp, ep, driver;
	int version, backends, help, show_prompt;
	double temp, top_p, min_p, repeat_penalty, presence_penalty, frequency_penalty;
	int64_t seed;
};

#define O(f) offsetof(struct run_cfg, f)
static const cfg_opt opts[] = {
	{"model", CFG_STR, O(model), NULL, 1, 0, "the model: a checkpoint directory (config.json + safetensors) or a .gguf file", 'm'},
	{"prompt", CFG_STR, O(prompt), NULL, 1, 0, "generate from this raw text", 'p'},
	{"chat", CFG_STR, O(chat), NULL, 1, 0, "generate from this user message through the chat template"},
	{"system", CFG_STR, O(system), NULL, 1, 0, "system message for --chat"},
	{"tokens", CFG_STR, O(tokens), NULL, 1, 0, "prompt as token ids: 1,2,3"},
	{"n-predict", CFG_INT, O(n_predict), "64", 0, 1 << 20, "tokens to generate", 'n'},
	{"temp", CFG_DOUBLE, O(temp), "0.8", 0, 100, "sampling temperature (0 = greedy)"},
	{"top-p", CFG_DOUBLE, O(top_p), "1.0", 0, 1, "nucleus sampling threshold (1 = off)"},
	{"top-k", CFG_INT, O(top_k), "0", 0, 1 << 30, "keep the k most likely tokens (0 = off)"},
	{"min-p", CFG_DOUBLE, O(min_p), "0", 0, 1, "drop tokens below min_p * p(max) (0 = off)"},
	{"repeat-penalty", CFG_DOUBLE, O(repeat_penalty), "1.0", 0.01, 10, "repetition penalty (1 = off)"},
	{"presence-penalty", CFG_DOUBLE, O(presence_penalty), "0", -2, 2, "presence penalty"},
	{"frequency-penalty", CFG_DOUBLE, O(frequency_penalty), "0", -2, 2, "frequency penalty"},
	{"seed", CFG_I64, O(seed), "-1", -1, 9.2e18, "sampling seed (-1 = random)", 's'},
	{"stop-ids", CFG_STR, O(stop_ids), NULL, 1, 0, "also stop after any of these token ids: 5,6"},
	{"ignore-eos", CFG_BOOL, O(ignore_eos), "false", 1, 0, "keep generating past end-of-sequence"},
	{"threads", CFG_INT, O(threads), "0", 0, 1024, "CPU threads (0 = one per core)", 't'},
	{"ctx", CFG_INT, O(ctx), "0", 0, 1 << 24, "context length (0 = prompt + n-predict)", 'c'},
	{"dump-logits", CFG_STR, O(dump_logits), NULL, 1, 0,
	 "write f32 logits of every prompt position to FILE"},
	{"ids", CFG_BOOL, O(ids), "false", 1, 0, "print generated token ids as a JSON array"},
	{"tokenize", CFG_STR, O(tokenize), NULL, 1, 0, "print the token ids of TEXT as a JSON array"},
	{"detokenize", CFG_STR, O(detokenize), NULL, 1, 0, "print the text of ids 1,2,3"},
	{"show-prompt", CFG_BOOL, O(show_prompt), "false", 1, 0,
	 "print the prompt's token ids as a JSON array on stderr"},
	{"bench", CFG_BOOL, O(bench), "false", 1, 0, "measure prefill and decode speed"},
	{"prompt-len", CFG_INT, O(prompt_len), "512", 1, 1 << 20, "--bench prompt length"},
	{"batch", CFG_INT, O(batch), "1", 1, 4096, "--bench sequences decoded together"},
	{"json", CFG_BOOL, O(json), "false", 1, 0, "--bench: one JSON object on stdout"},
	{"membw", CFG_BOOL, O(membw), "false", 1, 0,
	 "--bench on the cpu backend: then decode N more steps, each followed by one read and one "
	 "Triad pass of a memory probe, and report both rates over that stretch"},
	{"profile", CFG_BOOL, O(profile), "false", 1, 0,
	 "--bench on the cpu backend: then decode N more steps with every backend call timed, "
	 "and print where a step goes"},
	{"attn", CFG_STR, O(attn), "auto", 1, 0, "MLA form: auto, naive or absorbed"},
	{"kv-cache-dtype", CFG_STR, O(kv_dtype), "auto", 1, 0,
	 "KV cache elements: auto (llama-family K/V in f16, DeepSeek's latent rows in f32), f16 or f32"},
	{"backend", CFG_STR, O(backend), "auto", 1, 0, "compute backend: auto, cpu or cuda"},
	{"mmap", CFG_BOOL, O(mmap_weights), "false", 1, 0,
	 "keep safetensors weights in the file mapping (the cpu backend otherwise copies them "
	 "into huge pages)"},
	{"tp", CFG_INT, O(tp), "1", 1, 4096, "tensor-parallel ranks (rank processes; see --driver)"},
	{"pp", CFG_INT, O(pp), "1", 1, 4096, "pipeline stages (rank processes)"},
	{"ep", CFG_INT, O(ep), "1", 1, 4096, "expert-parallel groups (rank processes)"},
	{"driver", CFG_BOOL, O(driver), "false", 1, 0,
	 "run the model in rank processes (dsagent worker) even when tp = pp = ep = 1"},
	{"backends", CFG_BOOL, O(backends), "false", 1, 0, "list compute backends and exit"},
	{"version", CFG_BOOL, O(version), "false", 1, 0, "print the version"},
	{"help", CFG_BOOL, O(help), "false", 1, 0, "this help", 'h'},
	{0},
};

static void usage(FILE *f)
{
	fprintf(f, "usage: dsrun -m DIR [-p TEXT | --chat TEXT | --tokens IDS] [options]\n"
		   "       dsrun -m DIR --tokenize TEXT | --detokenize IDS | --bench\n\n");
	cfg_print_help(opts, "DSRUN", f);
}

static int list_backends(void)
{
	for (int i = 0; i < kb_backend_count(); i++) {
		ds_err err = {0};
		const char *name = kb_backend_name_at(i);
		const kb_backend *b = kb_backend_get(name, &err);
		if (b)
			printf("%-5s usable    %s\n", name, kb_describe(b));
		else
			printf("%-5s absent    %s\n", name, err.msg);
	}
	printf("cpu isa: detected %s, active %s\n", kc_isa_name(kc_isa_detect()),
	       kc_isa_name(kc_isa_active()));
	return 0;
}

/* ---- one sequence's state: KV pages and a block table row ---- */

typedef struct seqst {
	kv_seq kv;
	int32_t len; /* positions filled */
} seqst;

typedef struct runner {
	model *m;
	int32_t max_blocks;
	int32_t *tables; /* [n_seq][max_blocks] */
	int32_t *toks, *pos, *seq;
	uint8_t *want;
	float *logits;   /* [max_batch_tokens][vocab] */
} runner;

/* logit_rows: the most tokens of one step that want logits (the whole step
 * for --dump-logits, one per sequence otherwise). */
static int runner_init(runner *r, model *m, int n_seq, int logit_rows, ds_err *err)
{
	const kv_params *kp = kv_cache_params(model_kv(m));
	int bt = model_max_batch_tokens(m);
	r->m = m;
	r->max_blocks = (model_max_ctx(m) + kp->page_size - 1) / kp->page_size;
	r->tables = calloc((size_t)n_seq * (size_t)r->max_blocks, sizeof *r->tables);
	r->toks = calloc((size_t)bt, sizeof *r->toks);
	r->pos = calloc((size_t)bt, sizeof *r->pos);
	r->seq = calloc((size_t)bt, sizeof *r->seq);
	r->want = calloc((size_t)bt, 1);
	r->logits = malloc((size_t)logit_rows * (size_t)model_vocab_size(m) * sizeof(float));
	if (!r->tables || !r->toks || !r->pos || !r->seq || !r->want || !r->logits)
		return ds_err_set(err, DS_ENOMEM, "out of memory for %d rows of logits", logit_rows);
	return DS_OK;
}

static void runner_free(runner *r)
{
	free(r->tables);
	free(r->toks);
	free(r->pos);
	free(r->seq);
	free(r->want);
	free(r->logits);
}

static void sync_table(runner *r, int row, const seqst *s)
{
	int32_t *t = r->tables + (int64_t)row * r->max_blocks;
	for (int i = 0; i < s->kv.n_blocks; i++)
		t[i] = s->kv.blocks[i];
}

/* Feeds toks[0..n) to sequence `row` in steps of max_batch_tokens.  Logits of
 * every position go to out_all (n rows) when not NULL, else the last
 * position's logits to out_last. */
static int feed(runner *r, seqst *s, int row, const int32_t *toks, int n, float *out_all,
		float *out_last, ds_err *err)
{
	const int V = model_vocab_size(r->m), bt = model_max_batch_tokens(r->m);
	int rc = kv_seq_reserve(model_kv(r->m), &s->kv, s->len + n, err);
	if (rc)
		return rc;
	sync_table(r, row, s);
	for (int done = 0; done < n;) {
		int c = n - done < bt ? n - done : bt;
		for (int i = 0; i < c; i++) {
			r->toks[i] = toks[done + i];
			r->pos[i] = s->len + done + i;
			r->seq[i] = 0;
			r->want[i] = out_all || (done + i == n - 1);
		}
		eng_batch b = {.n_tok = c, .tokens = r->toks, .pos = r->pos, .seq = r->seq,
			       .want_logits = r->want, .n_seq = 1,
			       .block_tables = r->tables + (int64_t)row * r->max_blocks,
			       .max_blocks = r->max_blocks};
		if ((rc = model_forward(r->m, &b, r->logits, err)))
			return rc;
		if (out_all)
			memcpy(out_all + (int64_t)done * V, r->logits, (size_t)c * V * sizeof(float));
		else if (done + c == n)
			memcpy(out_last, r->logits, (size_t)V * sizeof(float));
		done += c;
	}
	s->len += n;
	return DS_OK;
}

/* One decode step for n sequences, each fed one token; logits [n][V]. */
static int decode_step(runner *r, seqst *ss, const int32_t *toks, int n, ds_err *err)
{
	int rc;
	for (int i = 0; i < n; i++) {
		if ((rc = kv_seq_reserve(model_kv(r->m), &ss[i].kv, ss[i].len + 1, err)))
			return rc;
		sync_table(r, i, &ss[i]);
		r->toks[i] = toks[i];
		r->pos[i] = ss[i].len;
		r->seq[i] = i;
		r->want[i] = 1;
	}
	eng_batch b = {.n_tok = n, .tokens = r->toks, .pos = r->pos, .seq = r->seq, .want_logits = r->want,
		       .n_seq = n, .block_tables = r->tables, .max_blocks = r->max_blocks};
	if ((rc = model_forward(r->m, &b, r->logits, err)))
		return rc;
	for (int i = 0; i < n; i++)
		ss[i].len++;
	return DS_OK;
}

/* ---- commands ---- */

static int parse_ids(const char *text, int64_t **ids, size_t *n, ds_err *err)
{
	size_t cap = 1;
	for (const char *p = text; *p; p++)
		cap += *p == ',';
	if (cap > MAX_PROMPT_TOKENS)
		return ds_err_set(err, DS_ERANGE, "more than %d token ids", MAX_PROMPT_TOKENS);
	*ids = malloc(cap * sizeof **ids);
	if (!*ids)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	if (ds_parse_i64_list(text, -((int64_t)1 << 40), (int64_t)1 << 40, *ids, cap, n) != DS_OK)
		return ds_err_set(err, DS_EINVAL, "token ids must be comma-separated integers, got '%.60s'",
				  text);
	return DS_OK;
}

static int write_logits(const char *path, const float *lg, size_t n, ds_err *err)
{
	FILE *f = fopen(path, "wb");
	if (!f)
		return ds_err_set(err, DS_EIO, "cannot write %s: %m", path);
	size_t w = fwrite(lg, sizeof(float), n, f);
	int bad = fclose(f) != 0 || w != n;
	return bad ? ds_err_set(err, DS_EIO, "writing %s failed", path) : DS_OK;
}

/* next[b] = the argmax of sequence b's logits (the bench's tokens: argmax
 * keeps its runs deterministic). */
static void greedy_next(const runner *r, int B, int32_t *next)
{
	const int V = model_vocab_size(r->m);
	for (int b = 0; b < B; b++) {
		const float *lg = r->logits + (int64_t)b * V;
		int32_t best = 0;
		float bv = lg[0]; /* kept in a register: the loop is timed with the decode */
		for (int v = 1; v < V; v++)
			if (lg[v] > bv)
				bv = lg[v], best = v;
		next[b] = best;
	}
}

/* n greedy decode steps of the B sequences from next (the bench's timed
 * decode and the --profile stretch). */
static int decode_greedy(runner *r, seqst *ss, int32_t *next, int B, int n, ds_err *err)
{
	int rc = DS_OK;
	for (int step = 0; step < n && !rc; step++)
		if (!(rc = decode_step(r, ss, next, B, err)))
			greedy_next(r, B, next);
	return rc;
}

/* Rates over the stretch of --bench --membw. */
typedef struct bw_stretch {
	double decode_tok_s, read_bytes_s, triad_bytes_s;
	double hot_bytes_s[2]; /* the hot-product probe: FP8, BF16 */
} bw_stretch;

#define MEMBW_READ_BYTES ((size_t)128 << 20) /* 4x the L3 of the machines we measure on */
#define MEMBW_TRIAD_ELEMENTS ((size_t)4 << 20) /* 3 arrays of 32 MiB */

/* Decodes c->n_predict more steps from where the bench left ss; after each
 * step one read pass and one Triad pass of the probe.  Each of the three
 * rates is its work over its own time, so they cover the same stretch of
 * wall time, interleaved step by step: on a shared machine the bandwidth
 * moves by tens of percent from one second to the next, and a probe taken
 * before or after the decode does not see the bandwidth the decode had.
 * The probe also empties the caches before every step, which can only
 * slow the decode.  Last after each step, one pass of the hot-product probe
 * for FP8 and for BF16 weights (membw.h): how fast the decode kernels
 * consume weights in cache over the same stretch, the ceiling they put on
 * a step when the memory is faster than they are. */
static int bench_membw(const struct run_cfg *c, runner *r, seqst *ss, int32_t *next, bw_stretch *out,
		       ds_err *err)
{
	const int B = c->batch;
	kc_membw *p = NULL;
	int rc = kc_membw_open(&p, MEMBW_READ_BYTES, MEMBW_TRIAD_ELEMENTS);
	if (rc)
		return ds_err_set(err, rc, "--membw: cannot allocate the probe's buffers");
	static const enum kb_dtype hot_dt[2] = {KB_F8_E4M3, KB_BF16};
	kc_hotmm *hot[2] = {NULL, NULL};
	for (int i = 0; i < 2 && !rc; i++)
		if ((rc = kc_hotmm_open(&hot[i], hot_dt[i])))
			ds_err_set(err, rc, "--membw: cannot allocate the hot-product probe");
	double t_dec = 0.0, t_rd = 0.0, t_tr = 0.0, b_rd = 0.0, b_tr = 0.0, t_hot[2] = {0}, b_hot[2] = {0};
	for (int step = 0; step < c->n_predict && !rc; step++) {
		double t0 = ds_now_s();
		if ((rc = decode_step(r, ss, next, B, err)))
			break;
		greedy_next(r, B, next);
		t_dec += ds_now_s() - t0;
		double nb = 0.0;
		t_rd += kc_membw_read_pass(p, &nb);
		b_rd += nb;
		t_tr += kc_membw_triad_pass(p, &nb);
		b_tr += nb;
		for (int i = 0; i < 2; i++) {
			t_hot[i] += kc_hotmm_pass(hot[i], &nb);
			b_hot[i] += nb;
		}
	}
	if (!rc && (rc = kc_membw_triad_check(p)))
		ds_err_set(err, rc, "--membw: the Triad pass did not compute a = b + s * c");
	for (int i = 0; i < 2 && !rc; i++)
		if ((rc = kc_hotmm_check(hot[i])))
			ds_err_set(err, rc, "--membw: the hot-product probe's %s product is not the reference's",
				   i ? "BF16" : "FP8");
	for (int i = 0; i < 2; i++)
		kc_hotmm_close(hot[i]);
	kc_membw_close(p);
	if (rc)
		return rc;
	out->decode_tok_s = (double)c->n_predict * B / t_dec;
	out->read_bytes_s = b_rd / t_rd;
	out->triad_bytes_s = b_tr / t_tr;
	for (int i = 0; i < 2; i++)
		out->hot_bytes_s[i] = b_hot[i] / t_hot[i];
	return DS_OK;
}

/* The stretch of --bench --profile. */
typedef struct prof_stretch {
	int steps, n;
	double wall;
	int64_t dropped;
	kc_prof_row rows[KC_PROF_MAX_ROWS];
} prof_stretch;

/* Decodes c->n_predict more steps with every backend call timed
 * (kernels/cpu/profile.h) into *out. */
static int bench_profile(const struct run_cfg *c, runner *r, seqst *ss, int32_t *next, prof_stretch *out,
			 ds_err *err)
{
	kc_profile_start();
	const double t0 = ds_now_s();
	const int rc = decode_greedy(r, ss, next, c->batch, c->n_predict, err);
	out->wall = ds_now_s() - t0;
	kc_profile_stop();
	out->steps = c->n_predict;
	out->n = kc_profile_rows(out->rows, KC_PROF_MAX_ROWS);
	out->dropped = kc_profile_dropped();
	return rc;
}

/* ,"profile":{...} of the JSON object */
static void print_profile_json(const prof_stretch *p)
{
	printf(",\"profile\":{\"steps\":%d,\"seconds\":%.6f,\"dropped\":%lld,\"calls\":[", p->steps, p->wall,
	       (long long)p->dropped);
	for (int i = 0; i < p->n; i++)
		printf("%s{\"call\":\"%s\",\"calls\":%lld,\"seconds\":%.6f,\"weight_bytes\":%.0f}", i ? "," : "",
		       p->rows[i].call, (long long)p->rows[i].calls, p->rows[i].seconds, p->rows[i].weight_bytes);
	printf("]}");
}

/* One line per kind of call, the costliest first: its share of the
 * stretch's wall time, time and calls per step, GB/s of weights. */
static void print_profile_text(const prof_stretch *p)
{
	double inside = 0.0;
	for (int i = 0; i < p->n; i++)
		inside += p->rows[i].seconds;
	printf("profile: %d steps of %.3f ms; %.3f ms (%.1f%%) inside %d kinds of backend call\n"
	       "   share   ms/step  calls/step    us/call    GB/s  call\n",
	       p->steps, p->wall / p->steps * 1e3, inside / p->steps * 1e3, 100.0 * inside / p->wall, p->n);
	for (int i = 0; i < p->n; i++) {
		const kc_prof_row *w = &p->rows[i];
		char gbs[16] = "";
		if (w->weight_bytes > 0 && w->seconds > 0)
			snprintf(gbs, sizeof gbs, "%.1f", w->weight_bytes / w->seconds / 1e9);
		printf("  %5.1f%%  %8.3f  %10.2f  %9.1f %7s  %s\n", 100.0 * w->seconds / p->wall,
		       w->seconds / p->steps * 1e3, (double)w->calls / p->steps, w->seconds / (double)w->calls * 1e6,
		       gbs, w->call);
	}
	if (p->dropped)
		printf("  (%lld calls of further kinds were not timed)\n", (long long)p->dropped);
}

static int cmd_bench(const struct run_cfg *c, model *m, runner *r, ds_err *err)
{
	const int V = model_vocab_size(m), B = c->batch;
	int rc = DS_OK;
	seqst *ss = calloc((size_t)B, sizeof *ss);
	int32_t *prompt = malloc((size_t)c->prompt_len * sizeof *prompt);
	int32_t *next = malloc((size_t)B * sizeof *next);
	float *last = malloc((size_t)V * sizeof *last);
	prof_stretch *prof = NULL;
	if (!ss || !prompt || !next || !last) {
		rc = ds_err_set(err, DS_ENOMEM, "out of memory");
		goto out;
	}
	uint64_t x = 0x9E3779B97F4A7C15ull;
	for (int i = 0; i < c->prompt_len; i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		prompt[i] = (int32_t)(x % (uint64_t)V);
	}
	/* Warm-up (untimed, as llama-bench does): one prefill of the prompt pages
	 * the mapped weights in, so the timings measure compute, not the disk. */
	if ((rc = feed(r, &ss[0], 0, prompt, c->prompt_len, NULL, last, err)))
		goto out;
	kv_seq_free(model_kv(m), &ss[0].kv);
	ss[0].len = 0;
	double t0 = ds_now_s();
	for (int b = 0; b < B; b++)
		if ((rc = feed(r, &ss[b], b, prompt, c->prompt_len, NULL, last, err)))
			goto out;
	double t_prefill = ds_now_s() - t0;
	for (int b = 0; b < B; b++)
		next[b] = (int32_t)((prompt[b % c->prompt_len] + 1) % V);
	t0 = ds_now_s();
	if ((rc = decode_greedy(r, ss, next, B, c->n_predict, err)))
		goto out;
	double t_decode = ds_now_s() - t0;
	double pf = (double)c->prompt_len * B / t_prefill;
	double dc = c->n_predict ? (double)c->n_predict * B / t_decode : 0.0;
	long rss = (long)ds_peak_rss_bytes(); /* before the probe's buffers exist */
	if (c->profile) {
		if (!(prof = calloc(1, sizeof *prof))) {
			rc = ds_err_set(err, DS_ENOMEM, "out of memory");
			goto out;
		}
		if ((rc = bench_profile(c, r, ss, next, prof, err)))
			goto out;
	}
	bw_stretch bw = {0};
	if (c->membw && (rc = bench_membw(c, r, ss, next, &bw, err)))
		goto out;
	if (c->json && driver_is_model(m)) {
		driver_rank_stat st[DRIVER_MAX_RANKS];
		int n = driver_rank_stats(m, st, DRIVER_MAX_RANKS, err);
		if (n < 0) {
			rc = n;
			goto out;
		}
		printf("{\"prefill_tok_s\":%.3f,\"decode_tok_s\":%.3f,\"peak_rss_bytes\":%ld,"
		       "\"plan\":{\"tp\":%d,\"pp\":%d,\"ep\":%d},\"ranks\":[",
		       pf, dc, rss, c->tp, c->pp, c->ep);
		for (int i = 0; i < n; i++)
			printf("%s{\"rank\":%d,\"pid\":%d,\"weight_bytes\":%llu,\"extra_bytes\":%llu,"
			       "\"peak_rss_bytes\":%llu,\"comm_seconds\":%.6f}", i ? "," : "", st[i].rank,
			       st[i].pid, (unsigned long long)st[i].weight_bytes,
			       (unsigned long long)st[i].extra_bytes,
			       (unsigned long long)st[i].peak_rss_bytes, st[i].comm_seconds);
		printf("]}\n");
	} else if (c->json) {
		printf("{\"prefill_tok_s\":%.3f,\"decode_tok_s\":%.3f,\"peak_rss_bytes\":%ld", pf, dc, rss);
		if (c->membw)
			printf(",\"membw\":{\"steps\":%d,\"decode_tok_s\":%.3f,\"read_bytes_s\":%.0f,"
			       "\"triad_bytes_s\":%.0f,\"fp8_hot_bytes_s\":%.0f,\"bf16_hot_bytes_s\":%.0f}",
			       c->n_predict, bw.decode_tok_s, bw.read_bytes_s, bw.triad_bytes_s,
			       bw.hot_bytes_s[0], bw.hot_bytes_s[1]);
		if (prof)
			print_profile_json(prof);
		printf("}\n");
	} else
		printf("model %s (%s), batch %d, threads %d\n"
		       "prefill: %d tokens x %d in %.3f s = %.2f tok/s\n"
		       "decode:  %d steps x %d in %.3f s = %.2f tok/s\n"
		       "peak RSS: %.1f MiB (weights %.1f MiB, engine buffers %.1f MiB, kv cache %.1f MiB)\n",
		       c->model, model_arch_name(m), B, kc_isa_active() >= 0 ? c->threads : 0,
		       c->prompt_len, B, t_prefill, pf, c->n_predict, B, t_decode, dc,
		       (double)rss / (1 << 20), (double)model_weight_bytes(m) / (1 << 20),
		       (double)model_extra_bytes(m) / (1 << 20),
		       (double)kv_cache_bytes(model_kv(m)) / (1 << 20));
	if (!c->json && c->membw)
		printf("with the memory probe between steps: decode %.2f tok/s, read %.2f GB/s, "
		       "Triad %.2f GB/s; one-row products in cache: FP8 %.2f GB/s, BF16 %.2f GB/s\n",
		       bw.decode_tok_s, bw.read_bytes_s / 1e9, bw.triad_bytes_s / 1e9,
		       bw.hot_bytes_s[0] / 1e9, bw.hot_bytes_s[1] / 1e9);
	if (!c->json && prof)
		print_profile_text(prof);
out:
	free(prof);
	for (int b = 0; ss && b < B; b++)
		kv_seq_free(model_kv(m), &ss[b].kv);
	free(ss);
	free(prompt);
	free(next);
	free(last);
	return rc;
}

static int is_stop(const struct run_cfg *c, const int64_t *stop, size_t n_stop, const model *m,
		   int32_t id)
{
	for (size_t i = 0; i < n_stop; i++)
		if (stop[i] == id)
			return 1;
	if (c->ignore_eos)
		return 0;
	const int *eos;
	int n = model_eos_ids(m, &eos);
	for (int i = 0; i < n; i++)
		if (eos[i] == id)
			return 1;
	return 0;
}

/* Generates from prompt ids: prints ids (JSON) or streamed text. */
static int cmd_generate(const struct run_cfg *c, model *m, runner *r, tok *tk,
			const int32_t *prompt, int n_prompt, ds_err *err)
{
	const int V = model_vocab_size(m);
	smp_params sp = smp_default_params();
	sp.temperature = (float)c->temp;
	sp.top_k = c->top_k;
	sp.top_p = (float)c->top_p;
	sp.min_p = (float)c->min_p;
	sp.repetition_penalty = (float)c->repeat_penalty;
	sp.presence_penalty = (float)c->presence_penalty;
	sp.frequency_penalty = (float)c->frequency_penalty;
	sp.has_seed = c->seed >= 0;
	sp.seed = (uint64_t)c->seed;
	seqst s = {0};
	int rc = DS_OK, n_out = 0;
	buf piece;
	int64_t *stop = NULL;
	size_t n_stop = 0;
	buf_init(&piece, 1 << 16);
	int32_t *out = malloc((size_t)(c->n_predict + 1) * sizeof *out);
	float *last = malloc((size_t)V * sizeof *last);
	smp_state *smp = smp_new(&sp, V, err);
	tok_stream tstream, *ts = NULL;
	if (tk) { /* special tokens (EOS, end-of-turn markers) are not printed */
		tok_stream_init(&tstream, tk, TOK_SKIP_SPECIAL);
		ts = &tstream;
	}
	if (!out || !last || !smp) {
		rc = err->code ? err->code : ds_err_set(err, DS_ENOMEM, "out of memory");
		goto out;
	}
	if (c->stop_ids && (rc = parse_ids(c->stop_ids, &stop, &n_stop, err)))
		goto out;
	smp_add_prompt(smp, prompt, n_prompt);
	if ((rc = feed(r, &s, 0, prompt, n_prompt, NULL, last, err)))
		goto out;
	while (n_out < c->n_predict) {
		int32_t id = smp_sample(smp, last);
		out[n_out++] = id;
		if (!c->ids && ts) {
			buf_clear(&piece);
			if ((rc = tok_stream_feed(ts, id, &piece, err)))
				goto out;
			fwrite(piece.data ? piece.data : "", 1, piece.len, stdout);
			fflush(stdout);
		}
		if (is_stop(c, stop, n_stop, m, id) || n_out == c->n_predict)
			break;
		if ((rc = decode_step(r, &s, &id, 1, err)))
			goto out;
		memcpy(last, r->logits, (size_t)V * sizeof(float));
	}
	if (c->ids) {
		printf("[");
		for (int i = 0; i < n_out; i++)
			printf("%s%d", i ? "," : "", out[i]);
		printf("]\n");
	} else if (ts) {
		buf_clear(&piece);
		if ((rc = tok_stream_flush(ts, &piece, err)))
			goto out;
		fwrite(piece.data ? piece.data : "", 1, piece.len, stdout);
		printf("\n");
	}
out:
	kv_seq_free(model_kv(m), &s.kv);
	free(stop);
	buf_free(&piece);
	smp_free(smp);
	free(out);
	free(last);
	return rc;
}

/* The rank command: the dsagent next to this executable, or $DSRUN_DSAGENT. */
static int dsagent_path(char *out, size_t cap, ds_err *err)
{
	const char *env = getenv("DSRUN_DSAGENT");
	if (env && *env) {
		snprintf(out, cap, "%s", env);
	} else {
		char self[PATH_MAX];
		if (ds_self_exe(self, sizeof self, err) != DS_OK)
			return err->code;
		char *slash = strrchr(self, '/');
		if (slash)
			*slash = 0;
		snprintf(out, cap, "%s/dsagent", slash ? self : ".");
	}
	if (access(out, X_OK) != 0)
		return ds_err_set(err, DS_ENOTFOUND, "the rank processes need %s (dsagent worker): %m; "
				  "set DSRUN_DSAGENT to its path", out);
	return DS_OK;
}

static void on_signal(int sig)
{
	driver_signal_teardown();
	signal(sig, SIG_DFL);
	raise(sig);
}

/* The model under --tp/--pp/--ep/--driver: rank processes (engine/driver.h);
 * threads per rank default to the cores shared out. */
static model *plan_load(const struct run_cfg *c, model_params *mp, ds_err *err)
{
	static char exe[PATH_MAX];
	if (dsagent_path(exe, sizeof exe, err))
		return NULL;
	const char *argv[] = {exe, "worker", NULL};
	driver_launch l = driver_default_launch();
	l.argv = argv;
	l.plan = (model_plan){.tp = c->tp, .pp = c->pp, .ep = c->ep};
	if (model_plan_check(&l.plan, err))
		return NULL;
	if (mp->threads == 0) {
		long cores = sysconf(_SC_NPROCESSORS_ONLN);
		long per = cores / model_plan_world(&l.plan);
		mp->threads = per < 1 ? 1 : (int)per;
	}
	struct sigaction sa = {0};
	sa.sa_handler = on_signal;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	return driver_model_load(mp, &l, err);
}

static int run(const struct run_cfg *c, ds_err *err)
{
	int rc = DS_OK;
	msrc *src = NULL;
	tok *tk = NULL;
	model *m = NULL;
	runner r = {0};
	int64_t *ids64 = NULL;
	int32_t *prompt = NULL;
	size_t n_prompt = 0;

	/* the checkpoint is opened once: the tokenizer and the model read it */
	if (!(src = msrc_open(c->model, err)))
		return err->code;
	if (c->tokenize || c->detokenize || c->prompt || c->chat) {
		if (!(tk = eng_tok_load_source(src, err))) {
			rc = err->code;
			goto out;
		}
	}
	if (c->tokenize) {
		if ((rc = tok_encode_alloc(tk, c->tokenize, strlen(c->tokenize), TOK_PARSE_SPECIAL,
					   &prompt, &n_prompt, err)))
			goto out;
		printf("[");
		for (size_t i = 0; i < n_prompt; i++)
			printf("%s%d", i ? "," : "", prompt[i]);
		printf("]\n");
		goto out;
	}
	if (c->detokenize) {
		size_t n = 0;
		if ((rc = parse_ids(c->detokenize, &ids64, &n, err)))
			goto out;
		prompt = malloc((n ? n : 1) * sizeof *prompt);
		if (!prompt) {
			rc = ds_err_set(err, DS_ENOMEM, "out of memory");
			goto out;
		}
		for (size_t i = 0; i < n; i++) {
			if (ids64[i] < 0 || ids64[i] >= tok_vocab_size(tk)) {
				rc = ds_err_set(err, DS_EINVAL, "token id %lld is out of range: the vocabulary has %d ids",
						(long long)ids64[i], tok_vocab_size(tk));
				goto out;
			}
			prompt[i] = (int32_t)ids64[i];
		}
		char *text = NULL;
		size_t len = 0;
		if ((rc = tok_decode_alloc(tk, prompt, n, &text, &len, err)))
			goto out;
		fwrite(text, 1, len, stdout);
		printf("\n");
		free(text);
		goto out;
	}

	/* prompt ids */
	if (c->tokens) {
		if ((rc = parse_ids(c->tokens, &ids64, &n_prompt, err)))
			goto out;
		prompt = malloc(n_prompt * sizeof *prompt);
		if (!prompt) {
			rc = ds_err_set(err, DS_ENOMEM, "out of memory");
			goto out;
		}
		for (size_t i = 0; i < n_prompt; i++) {
			if (ids64[i] < 0 || ids64[i] > INT32_MAX) {
				rc = ds_err_set(err, DS_EINVAL, "token id %lld is out of range", (long long)ids64[i]);
				goto out;
			}
			prompt[i] = (int32_t)ids64[i];
		}
	} else if (c->chat) {
		chat_msg msgs[2] = {{0}};
		size_t nm = 0;
		chat_params cp;
		buf text;
		if (c->system)
			msgs[nm++] = (chat_msg){.role = CHAT_ROLE_SYSTEM, .content = c->system};
		msgs[nm++] = (chat_msg){.role = CHAT_ROLE_USER, .content = c->chat};
		if ((rc = chat_params_for_tok(tk, NULL, &cp, err)))
			goto out;
		tok_ids ids;
		buf_init(&text, 64 << 20);
		tok_ids_init(&ids, 0);
		/* the rendered prompt carries BOS already; the texts are plain
		 * text: a marker typed in them is not a control token */
		rc = chat_render_ids(&cp, tk, msgs, nm, &ids, &text, err);
		buf_free(&text);
		if (rc) {
			tok_ids_free(&ids);
			goto out;
		}
		if (!ids.v && (ids.v = malloc(sizeof *ids.v)) == NULL) {
			rc = ds_err_set(err, DS_ENOMEM, "out of memory");
			goto out;
		}
		prompt = ids.v; /* freed with free() like tok_encode_alloc's */
		n_prompt = ids.n;
	} else if (c->prompt) {
		unsigned flags = TOK_PARSE_SPECIAL | (tok_bos_id(tk) >= 0 && tok_add_bos_default(tk) ? TOK_ADD_BOS : 0u);
		if ((rc = tok_encode_alloc(tk, c->prompt, strlen(c->prompt), flags, &prompt, &n_prompt, err)))
			goto out;
	} else if (!c->bench) {
		rc = ds_err_set(err, DS_EINVAL, "nothing to do: give -p, --chat, --tokens, --tokenize, "
						"--detokenize or --bench (see --help)");
		goto out;
	}
	if (c->show_prompt) {
		fprintf(stderr, "[");
		for (size_t i = 0; i < n_prompt; i++)
			fprintf(stderr, "%s%d", i ? "," : "", prompt[i]);
		fprintf(stderr, "]\n");
	}
	if (!c->bench && n_prompt == 0) {
		rc = ds_err_set(err, DS_EINVAL, "the prompt is empty");
		goto out;
	}

	model_params mp = model_default_params();
	mp.path = c->model;
	mp.source = src;
	mp.backend = c->backend;
	mp.threads = c->threads;
	mp.kv_cache_dtype = c->kv_dtype;
	mp.weights = c->mmap_weights ? MODEL_WEIGHTS_MMAP : MODEL_WEIGHTS_AUTO;
	if (model_attn_parse(c->attn, &mp.attn) != DS_OK) {
		rc = ds_err_set(err, DS_EINVAL, "--attn must be auto, naive or absorbed, got '%s'", c->attn);
		goto out;
	}
	if (c->membw && !c->bench) {
		rc = ds_err_set(err, DS_EINVAL, "--membw is a --bench option");
		goto out;
	}
	if (c->membw && c->n_predict < 1) {
		rc = ds_err_set(err, DS_EINVAL, "--membw needs -n of at least 1");
		goto out;
	}
	if (c->profile && !c->bench) {
		rc = ds_err_set(err, DS_EINVAL, "--profile is a --bench option");
		goto out;
	}
	if (c->profile && c->n_predict < 1) {
		rc = ds_err_set(err, DS_EINVAL, "--profile needs -n of at least 1");
		goto out;
	}
	/* --membw and --profile each decode n_predict more steps */
	int64_t need = c->bench ? (int64_t)c->prompt_len + (int64_t)c->n_predict * (1 + c->membw + c->profile)
				: (int64_t)n_prompt + c->n_predict;
	mp.max_ctx = c->ctx > 0 ? c->ctx : (int)need;
	mp.max_seqs = c->bench ? c->batch : 1;
	/* --dump-logits is one prefill: the step must hold the whole prompt */
	if (c->dump_logits && (int64_t)n_prompt > mp.max_batch_tokens)
		mp.max_batch_tokens = (int)n_prompt;
	if (c->bench && c->batch > mp.max_batch_tokens)
		mp.max_batch_tokens = c->batch;
	if (c->tp * c->pp * c->ep > 1 || c->driver) {
		if (c->membw) {
			rc = ds_err_set(err, DS_EINVAL, "--membw probes this process's memory: it does not "
							"apply under a plan of rank processes");
			goto out;
		}
		if (c->profile) {
			rc = ds_err_set(err, DS_EINVAL, "--profile times this process's cpu backend: it does "
							"not apply under a plan of rank processes");
			goto out;
		}
		m = plan_load(c, &mp, err);
	} else {
		m = model_load(&mp, err);
	}
	if (!m) {
		rc = err->code;
		goto out;
	}
	for (size_t i = 0; i < n_prompt; i++) {
		if (prompt[i] >= model_vocab_size(m)) {
			rc = ds_err_set(err, DS_EINVAL, "token id %d is out of range: the vocabulary has %d ids (0..%d)",
					prompt[i], model_vocab_size(m), model_vocab_size(m) - 1);
			goto out;
		}
	}
	if ((int64_t)n_prompt + (c->dump_logits ? 0 : c->n_predict) > model_max_ctx(m)) {
		rc = ds_err_set(err, DS_ERANGE, "prompt (%zu tokens) + %d to generate exceed the context of %d",
				n_prompt, c->n_predict, model_max_ctx(m));
		goto out;
	}
	int n_seq = c->bench ? c->batch : 1;
	if ((rc = runner_init(&r, m, n_seq, c->dump_logits ? model_max_batch_tokens(m) : n_seq, err)))
		goto out;
	if (c->bench && c->membw && strcmp(model_backend_name(m), "cpu") != 0) {
		rc = ds_err_set(err, DS_EINVAL, "--membw probes host memory: it applies to the cpu backend, "
						"not %s", model_backend_name(m));
	} else if (c->bench && c->profile && strcmp(model_backend_name(m), "cpu") != 0) {
		rc = ds_err_set(err, DS_EINVAL, "--profile times the cpu backend's calls, not %s's",
				model_backend_name(m));
	} else if (c->bench) {
		rc = cmd_bench(c, m, &r, err);
	} else if (c->dump_logits) {
		size_t n = n_prompt * (size_t)model_vocab_size(m);
		float *all = malloc(n * sizeof *all);
		seqst s = {0};
		if (!all) {
			rc = ds_err_set(err, DS_ENOMEM, "out of memory for %zu logits", n);
			goto out;
		}
		rc = feed(&r, &s, 0, prompt, (int)n_prompt, all, NULL, err);
		if (!rc)
			rc = write_logits(c->dump_logits, all, n, err);
		kv_seq_free(model_kv(m), &s.kv);
		free(all);
	} else {
		rc = cmd_generate(c, m, &r, c->ids ? NULL : tk, prompt, (int)n_prompt, err);
	}
out:
	runner_free(&r);
	model_free(m);
	tok_free(tk);
	msrc_unref(src);
	free(ids64);
	free(prompt);
	return rc;
}

int main(int argc, char **argv)
{
	struct run_cfg cfg;
	ds_err err = {0};
	int next = 0, rc = 0;
	if (cfg_load(opts, &cfg, "DSRUN", argc, argv, 1, &next, &err) != DS_OK) {
		fprintf(stderr, "dsrun: %s\n", err.msg);
		rc = 2;
		goto out;
	}
	if (next < argc) {
		fprintf(stderr, "dsrun: unexpected argument '%s' (see --help)\n", argv[next]);
		rc = 2;
		goto out;
	}
	if (cfg.help) {
		usage(stdout);
	} else if (cfg.version) {
		printf("dsrun %s\n", eng_version());
	} else if (cfg.backends) {
		rc = list_backends();
	} else if (!cfg.model) {
		fprintf(stderr, "dsrun: -m MODEL is required: a checkpoint directory or a .gguf file "
			"(see --help)\n");
		rc = 2;
	} else if (run(&cfg, &err) != DS_OK) {
		fprintf(stderr, "dsrun: %s\n", err.msg);
		rc = 1;
	}
out:
	cfg_free(opts, &cfg);
	return rc;
}

/*
 * rankproto.c - encoding and decoding of the launcher <-> rank 0 frames
 * (format in rankproto.h).  Called by engine/driver.c (the launcher side)
 * and worker/worker.c (the rank side).  Pure functions on caller buffers:
 * no allocation, no I/O, no state.
 */
#include "engine/rankproto.h"

#include <string.h>

/* Frames are little-endian and copied with memcpy: this build assumes the
 * host is too (every machine dsagent targets). */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "rank frames are little-endian; this host is not"
#endif

void rankproto_header_put(uint8_t out[RANKPROTO_HEADER_BYTES], unsigned kind, uint32_t id,
			  uint32_t length)
{
	uint32_t magic = RANKPROTO_MAGIC;
	uint16_t version = RANKPROTO_VERSION, k = (uint16_t)kind;
	memcpy(out, &magic, 4);
	memcpy(out + 4, &version, 2);
	memcpy(out + 6, &k, 2);
	memcpy(out + 8, &id, 4);
	memcpy(out + 12, &length, 4);
}

void rankproto_header_get(const uint8_t in[RANKPROTO_HEADER_BYTES], rankproto_header *h)
{
	uint16_t version, kind;
	memcpy(&h->magic, in, 4);
	memcpy(&version, in + 4, 2);
	memcpy(&kind, in + 6, 2);
	memcpy(&h->id, in + 8, 4);
	memcpy(&h->length, in + 12, 4);
	h->version = version;
	h->kind = kind;
}

const char *rankproto_kind_name(unsigned kind)
{
	static const char *const names[] = {
		[RANKPROTO_STEP] = "STEP",     [RANKPROTO_STOP] = "STOP",
		[RANKPROTO_READY] = "READY",   [RANKPROTO_LOGITS] = "LOGITS",
		[RANKPROTO_ERROR] = "ERROR",   [RANKPROTO_STATS] = "STATS",
		[RANKPROTO_STATS_REPLY] = "STATS_REPLY", [RANKPROTO_IDLE] = "IDLE",
	};
	if (kind < sizeof names / sizeof names[0] && names[kind])
		return names[kind];
	return "unknown";
}

void rankproto_ready_put(const rankproto_ready *r, uint8_t out[RANKPROTO_READY_BYTES])
{
	const int32_t f[11] = {r->rank, r->world_size, r->vocab_size, r->max_batch_tokens,
			       r->max_ctx, r->page_size, r->n_pages, r->max_seqs, r->max_blocks,
			       r->max_payload, r->n_eos};
	memset(out, 0, RANKPROTO_READY_BYTES);
	memcpy(out, f, sizeof f);
	memcpy(out + 44, r->eos, sizeof r->eos);
	memcpy(out + 44 + sizeof r->eos, r->arch, strnlen(r->arch, sizeof r->arch - 1));
	memcpy(out + 44 + sizeof r->eos + 32, r->backend, strnlen(r->backend, sizeof r->backend - 1));
}

int rankproto_ready_get(const uint8_t *p, size_t len, rankproto_ready *r, ds_err *err)
{
	if (len != RANKPROTO_READY_BYTES)
		return ds_err_set(err, DS_EFORMAT, "READY payload of %zu bytes: version %d sends %d", len,
				  RANKPROTO_VERSION, RANKPROTO_READY_BYTES);
	int32_t f[11];
	memcpy(f, p, sizeof f);
	*r = (rankproto_ready){.rank = f[0], .world_size = f[1], .vocab_size = f[2],
			       .max_batch_tokens = f[3], .max_ctx = f[4], .page_size = f[5],
			       .n_pages = f[6], .max_seqs = f[7], .max_blocks = f[8],
			       .max_payload = f[9], .n_eos = f[10]};
	memcpy(r->eos, p + 44, sizeof r->eos);
	memcpy(r->arch, p + 44 + sizeof r->eos, 31);
	memcpy(r->backend, p + 44 + sizeof r->eos + 32, 15);
	static const char *const names[] = {"rank", "world_size", "vocab_size", "max_batch_tokens",
					    "max_ctx", "page_size", "n_pages", "max_seqs",
					    "max_blocks", "max_payload"};
	for (int i = 0; i < 10; i++)
		if (f[i] < (i == 0 ? 0 : 1))
			return ds_err_set(err, DS_EFORMAT, "READY %s is %d", names[i], f[i]);
	if (r->n_eos < 0 || r->n_eos > RANKPROTO_MAX_EOS)
		return ds_err_set(err, DS_EFORMAT, "READY n_eos is %d (0..%d)", r->n_eos, RANKPROTO_MAX_EOS);
	for (int i = 0; i < r->n_eos; i++)
		if (r->eos[i] < 0 || r->eos[i] >= r->vocab_size)
			return ds_err_set(err, DS_EFORMAT, "READY eos id %d is outside the vocabulary of %d",
					  r->eos[i], r->vocab_size);
	return DS_OK;
}

uint64_t rankproto_step_bytes(int64_t n_tok, int64_t n_seq, int64_t max_blocks, int with_want)
{
	if (n_tok < 1 || n_seq < 1 || max_blocks < 1)
		return 0;
	uint64_t nt = (uint64_t)n_tok, want = with_want ? (nt + 3) & ~(uint64_t)3 : 0;
	return 16 + 12 * nt + want + 4 * (uint64_t)n_seq * (uint64_t)max_blocks;
}

int rankproto_step_put(const eng_batch *b, uint8_t *out, size_t cap, size_t *len, ds_err *err)
{
	const int want = b->want_logits != NULL;
	uint64_t need = rankproto_step_bytes(b->n_tok, b->n_seq, b->max_blocks, want);
	if (need == 0 || need > cap)
		return ds_err_set(err, DS_ERANGE, "a step of %d tokens, %d sequences and %d blocks takes "
				  "%llu bytes; the ranks take at most %zu", b->n_tok, b->n_seq,
				  b->max_blocks, (unsigned long long)need, cap);
	const size_t nt = (size_t)b->n_tok, tb = (size_t)b->n_seq * (size_t)b->max_blocks;
	const uint32_t flags = want ? RANKPROTO_STEP_WANT : 0;
	const int32_t counts[3] = {b->n_tok, b->n_seq, b->max_blocks};
	uint8_t *q = out;
	memcpy(q, counts, 12);
	memcpy(q + 12, &flags, 4);
	q += 16;
	memcpy(q, b->tokens, 4 * nt);
	memcpy(q + 4 * nt, b->pos, 4 * nt);
	memcpy(q + 8 * nt, b->seq, 4 * nt);
	q += 12 * nt;
	if (want) {
		size_t padded = (nt + 3) & ~(size_t)3;
		memcpy(q, b->want_logits, nt);
		memset(q + nt, 0, padded - nt);
		q += padded;
	}
	memcpy(q, b->block_tables, 4 * tb);
	*len = (size_t)need;
	return DS_OK;
}

void rankproto_stat_put(const rankproto_stat *s, uint8_t out[RANKPROTO_STAT_BYTES])
{
	memset(out, 0, RANKPROTO_STAT_BYTES);
	memcpy(out, &s->rank, 4);
	memcpy(out + 8, &s->weight_bytes, 8);
	memcpy(out + 16, &s->extra_bytes, 8);
	memcpy(out + 24, &s->peak_rss_bytes, 8);
	memcpy(out + 32, &s->comm_seconds, 8);
}

void rankproto_stat_get(const uint8_t in[RANKPROTO_STAT_BYTES], rankproto_stat *s)
{
	memcpy(&s->rank, in, 4);
	memcpy(&s->weight_bytes, in + 8, 8);
	memcpy(&s->extra_bytes, in + 16, 8);
	memcpy(&s->peak_rss_bytes, in + 24, 8);
	memcpy(&s->comm_seconds, in + 32, 8);
}

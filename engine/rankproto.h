/*
 * rankproto.h - the frames between a launcher and rank 0 of a plan (the
 * rank process is worker/, the launcher engine/driver.c or a test).  One
 * definition of the format for both ends: worker/ includes it from here
 * because the engine may not include worker/.
 *
 * Frames (both directions).  Every integer is little-endian; i32 arrays are
 * packed, with no padding between fields except where stated.
 *
 *   header, 16 bytes:
 *     u32 magic    RANKPROTO_MAGIC (the bytes "DSWK")
 *     u16 version  RANKPROTO_VERSION
 *     u16 kind     STEP, STATS, STOP (to the rank); READY, LOGITS,
 *                  STATS_REPLY, ERROR (from it)
 *     u32 id       chosen by the sender of a request; its reply carries
 *                  the same id (0 for READY and for errors outside a step)
 *     u32 length   bytes of payload that follow (at most the limit READY
 *                  announces)
 *
 *   STEP payload: the fields of eng_batch (engine/model.h), unchanged
 *     i32 n_tok, i32 n_seq, i32 max_blocks, u32 flags
 *     i32 tokens[n_tok], i32 pos[n_tok], i32 seq[n_tok]
 *     u8  want_logits[n_tok], then zero bytes up to a multiple of 4
 *         (present only when flags & RANKPROTO_STEP_WANT: without it every
 *         token wants logits)
 *     i32 block_tables[n_seq][max_blocks]  (page ids of the ranks' caches)
 *   length must be exactly rankproto_step_bytes of the counts.  The
 *   launcher owns the page layout (READY says n_pages).
 *
 *   STATS payload: empty.  Every rank answers with its record, gathered
 *   over the world group; rank 0 replies STATS_REPLY.
 *
 *   STOP payload: empty.  Every rank exits 0 without a reply.
 *
 *   IDLE payload: empty.  Between ranks only: rank 0 shares one with its
 *   peers when no frame came for a quarter of the comm timeout, so that
 *   their wait for the next frame (a broadcast) never times out while the
 *   launcher has nothing to ask.  A launcher does not send it; if it does,
 *   rank 0 answers ERROR.
 *
 *   READY payload (sent once, after every rank loaded its part and joined
 *   its groups, before any request is read), RANKPROTO_READY_BYTES:
 *     10 x i32  rank, world_size, vocab_size, max_batch_tokens (the most
 *               n_tok), max_ctx, page_size, n_pages, max_seqs (the most
 *               n_seq), max_blocks (the most max_blocks), max_payload
 *               (bytes of the largest request)
 *     i32 n_eos, i32 eos[RANKPROTO_MAX_EOS] (the first n_eos used)
 *     char arch[32], char backend[16]  (NUL-padded: "deepseek_v3", "cpu")
 *
 *   LOGITS payload (the reply to a step that ran):
 *     i32 n_rows, i32 vocab_size, f32 logits[n_rows][vocab_size]
 *   rows for the tokens that want logits, in batch order (n_rows may be 0).
 *
 *   STATS_REPLY payload: i32 n_ranks, i32 RANKPROTO_STAT_BYTES, then one
 *   record per world rank in rank order:
 *     i32 rank, i32 zero, u64 weight_bytes (model_weight_bytes), u64
 *     extra_bytes (model_extra_bytes), u64 peak_rss_bytes (VmHWM), f64
 *     comm_seconds (model_comm_seconds)
 *
 *   ERROR payload: i32 code (a DS_E* status), then the message (UTF-8, no
 *   NUL; length - 4 bytes).  The reply to a request that was refused or
 *   failed (the id is the request's), or the last frame before rank 0
 *   exits with an error (load failure: id 0).
 *
 * Version history: 1 = STEP/STOP/READY(10 x i32)/LOGITS/ERROR; 2 adds
 * STATS/STATS_REPLY and READY's eos ids, arch and backend.  IDLE (kind 8)
 * came later without a version change: the launcher's side of the
 * protocol did not change.
 */
#ifndef DS_ENGINE_RANKPROTO_H
#define DS_ENGINE_RANKPROTO_H

#include "common/status.h"
#include "engine/model.h"

#include <stddef.h>
#include <stdint.h>

#define RANKPROTO_MAGIC 0x4B575344u /* "DSWK" read as a little-endian u32 */
#define RANKPROTO_VERSION 2
#define RANKPROTO_HEADER_BYTES 16
#define RANKPROTO_STEP_WANT 1u /* STEP flags: want_logits[] is present */
#define RANKPROTO_MAX_EOS 8
#define RANKPROTO_READY_BYTES (10 * 4 + 4 + RANKPROTO_MAX_EOS * 4 + 32 + 16)
#define RANKPROTO_STAT_BYTES 40

enum rankproto_kind {
	RANKPROTO_STEP = 1,
	RANKPROTO_STOP = 2,
	RANKPROTO_READY = 3,
	RANKPROTO_LOGITS = 4,
	RANKPROTO_ERROR = 5,
	RANKPROTO_STATS = 6,
	RANKPROTO_STATS_REPLY = 7,
	RANKPROTO_IDLE = 8,
};

typedef struct rankproto_header {
	uint32_t magic;
	unsigned version, kind;
	uint32_t id, length;
} rankproto_header;

void rankproto_header_put(uint8_t out[RANKPROTO_HEADER_BYTES], unsigned kind, uint32_t id,
			  uint32_t length);
void rankproto_header_get(const uint8_t in[RANKPROTO_HEADER_BYTES], rankproto_header *h);
/* "STEP", "READY"...; "unknown" for any other kind. */
const char *rankproto_kind_name(unsigned kind);

typedef struct rankproto_ready {
	int32_t rank, world_size, vocab_size, max_batch_tokens, max_ctx, page_size, n_pages;
	int32_t max_seqs, max_blocks, max_payload;
	int32_t n_eos, eos[RANKPROTO_MAX_EOS];
	char arch[32], backend[16]; /* NUL-terminated (truncated to fit) */
} rankproto_ready;

void rankproto_ready_put(const rankproto_ready *r, uint8_t out[RANKPROTO_READY_BYTES]);
/* DS_EFORMAT naming the field when len is not RANKPROTO_READY_BYTES or a
 * count is out of range (a launcher never trusts a rank's sizes). */
int rankproto_ready_get(const uint8_t *p, size_t len, rankproto_ready *r, ds_err *err);

/* Payload bytes of a STEP with these counts (0 when a count is < 1). */
uint64_t rankproto_step_bytes(int64_t n_tok, int64_t n_seq, int64_t max_blocks, int with_want);
/* Writes b as a STEP payload into out[cap]; *len gets its size.
 * DS_ERANGE when it does not fit. */
int rankproto_step_put(const eng_batch *b, uint8_t *out, size_t cap, size_t *len, ds_err *err);

typedef struct rankproto_stat {
	int32_t rank;
	uint64_t weight_bytes, extra_bytes, peak_rss_bytes;
	double comm_seconds;
} rankproto_stat;

void rankproto_stat_put(const rankproto_stat *s, uint8_t out[RANKPROTO_STAT_BYTES]);
void rankproto_stat_get(const uint8_t in[RANKPROTO_STAT_BYTES], rankproto_stat *s);

#endif

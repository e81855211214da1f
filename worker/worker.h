/*
 * worker.h - the rank process: `dsagent worker [options]`.
 *
 * A worker loads the model (engine/model.h), joins its comm group (comm/,
 * the one-rank group today: --world-size other than 1 is refused until the
 * distributed engine exists), announces itself, then runs the steps its
 * launcher sends on stdin and answers each on stdout, until a STOP frame or
 * the end of stdin.  The log (common/log.h) goes to stderr; stdout carries
 * frames only.
 *
 * Frames (both directions).  Every integer is little-endian; i32 arrays are
 * packed, with no padding between fields except where stated.
 *
 *   header, 16 bytes:
 *     u32 magic    WORKER_MAGIC (the bytes "DSWK")
 *     u16 version  WORKER_PROTO_VERSION
 *     u16 kind     WORKER_STEP, WORKER_STOP (to the worker);
 *                  WORKER_READY, WORKER_LOGITS, WORKER_ERROR (from it)
 *     u32 id       chosen by the sender of a STEP; its reply carries the
 *                  same id (0 for READY and for errors outside a step)
 *     u32 length   bytes of payload that follow (at most the limit READY
 *                  announces)
 *
 *   STEP payload: the fields of eng_batch (engine/model.h), unchanged
 *     i32 n_tok, i32 n_seq, i32 max_blocks, u32 flags
 *     i32 tokens[n_tok], i32 pos[n_tok], i32 seq[n_tok]
 *     u8  want_logits[n_tok], then zero bytes up to a multiple of 4
 *         (present only when flags & WORKER_STEP_WANT: without it every
 *         token wants logits)
 *     i32 block_tables[n_seq][max_blocks]  (page ids of the worker's cache)
 *   length must be exactly what the counts imply.  The launcher owns the
 *   page layout: it gives each sequence pages 0..n_pages-1 of the cache
 *   (READY says n_pages) and never two live sequences the same page.
 *
 *   STOP payload: empty.  The worker exits 0 without a reply.
 *
 *   READY payload (sent once, after the model is loaded and the group is
 *   joined, before any step is read): 10 x i32
 *     rank, world_size, vocab_size, max_batch_tokens (the most n_tok),
 *     max_ctx, page_size, n_pages, max_seqs (the most n_seq), max_blocks
 *     (the most max_blocks), max_payload (bytes of the largest STEP)
 *
 *   LOGITS payload (the reply to a step that ran):
 *     i32 n_rows, i32 vocab_size, f32 logits[n_rows][vocab_size]
 *   rows for the tokens that want logits, in batch order (n_rows may be 0).
 *
 *   ERROR payload: i32 code (a DS_E* status), then the message (UTF-8, no
 *   NUL; length - 4 bytes).  The reply to a step that was refused or
 *   failed (the id is the step's), or the last frame before the worker
 *   exits with an error (model load failure: id 0).
 *
 * What happens on bad input:
 *   - a STEP whose payload does not match its counts, whose counts exceed
 *     the limits, or that the model refuses (token out of the vocabulary,
 *     position past max_ctx, page id out of range): ERROR reply, the
 *     worker goes on with the next frame (the length told where it ends);
 *   - an unknown kind with a valid header: its payload is skipped, ERROR
 *     reply, the worker goes on;
 *   - a header with a wrong magic or version, or a length over the limit:
 *     ERROR reply, then exit 1 (the stream cannot be resynchronised);
 *   - end of stdin inside a frame (header or payload): ERROR reply naming
 *     what was missing, then exit 1;
 *   - end of stdin between frames: exit 0, like STOP.
 * Exit status: 0 after STOP or a clean end of stdin, 1 after a fatal error
 * (load, protocol, I/O), 2 for bad options (nothing written to stdout).
 *
 * With more ranks (the distributed engine), rank 0 reads the frames and
 * broadcasts each over the group; every rank runs the step; rank 0 writes
 * the reply.  The loop is already written that way (comm_broadcast on the
 * one-rank group is a no-op).
 */
#ifndef DS_WORKER_H
#define DS_WORKER_H

#include <stdint.h>

#define WORKER_MAGIC 0x4B575344u /* "DSWK" read as a little-endian u32 */
#define WORKER_PROTO_VERSION 1
#define WORKER_HEADER_BYTES 16
#define WORKER_STEP_WANT 1u /* flags: want_logits[] is present */

enum worker_kind {
	WORKER_STEP = 1,
	WORKER_STOP = 2,
	WORKER_READY = 3,
	WORKER_LOGITS = 4,
	WORKER_ERROR = 5,
};

/* `dsagent worker ARGS...`: argv[0] is "worker"; --help prints the options.
 * Returns the process exit status (above). */
int worker_main(int argc, char **argv);

#endif

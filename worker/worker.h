/*
 * worker.h - the rank process: `dsagent worker [options]`.
 *
 * A plan of tp x pp x ep ranks (engine/model.h) runs as that many worker
 * processes.  Each joins its groups through the launcher's rendezvous
 * store (--store HOST:PORT, keys under --job ID): the world group
 * "<job>/world", its stage group "<job>/stage<s>" (the tp*ep ranks of its
 * pipeline stage, in local-index order) and its tp group "<job>/tp<s>.<e>"
 * (Gloo; a group of one rank is the one-rank group, and a one-rank plan
 * needs no store).  It then loads its part of the model (model_params.rank),
 * and rank 0 announces the run once every rank is loaded.  The log
 * (common/log.h) goes to stderr; rank 0's stdout carries frames only, the
 * other ranks never write to stdout and never read stdin.
 *
 * Frames, both directions, are engine/rankproto.h's (version
 * RANKPROTO_VERSION): STEP, STATS, STOP to rank 0; READY, LOGITS,
 * STATS_REPLY, ERROR from it.  Rank 0 reads each frame from stdin and
 * broadcasts it over the world group (the 16-byte header first, then the
 * payload of the length it names); every rank handles it: a STEP runs
 * model_forward on every rank (logits come out on rank 0, which replies), a
 * STATS gathers every rank's record (comm_all_gather) into rank 0's reply,
 * a STOP makes every rank exit 0.
 *
 * The launcher owns the page layout: it gives each sequence pages
 * 0..n_pages-1 of the cache (READY says n_pages) and never two live
 * sequences the same page; every rank's cache has the same page ids.
 *
 * What happens on bad input (rank 0):
 *   - a STEP whose payload does not match its counts, whose counts exceed
 *     the limits, or that the model refuses (token out of the vocabulary,
 *     position past max_ctx, page id out of range): ERROR reply, the
 *     ranks go on with the next frame (the length told where it ends);
 *   - an unknown kind with a valid header: its payload is skipped, ERROR
 *     reply, the ranks go on;
 *   - a header with a wrong magic or version, or a length over the limit:
 *     ERROR reply, then exit 1 (the stream cannot be resynchronised);
 *   - end of stdin inside a frame (header or payload): ERROR reply naming
 *     what was missing, then exit 1;
 *   - end of stdin between frames: exit 0, like STOP.
 * In the last three cases rank 0 first shares a STOP so the other ranks exit.
 *
 * Failures of the plan: a collective that fails (a peer died: DS_EIO naming
 * the rank when the comm layer knows it; or DS_ETIMEOUT past
 * --comm-timeout-ms) breaks the group, so rank 0 replies ERROR with the
 * message and exits 1, and every other rank exits 1 when its own call
 * fails.  A rank that cannot join or load exits 1 (rank 0 after an ERROR
 * frame with id 0).  Each rank asks for SIGKILL when its parent dies
 * (PR_SET_PDEATHSIG; strictly, when the parent's thread that forked it
 * ends, so a launcher forks from a thread that outlives its ranks) and,
 * given --parent-pid, exits at once when its parent is already another
 * process.
 *
 * Exit status: 0 after STOP or a clean end of input, 1 after a fatal error
 * (load, join, protocol, I/O, a broken group), 2 for bad options (nothing
 * written to stdout), among them --world-size that differs from
 * tp * pp * ep and more than one rank without --store.
 */
#ifndef DS_WORKER_H
#define DS_WORKER_H

#include "engine/rankproto.h"

/* `dsagent worker ARGS...`: argv[0] is "worker"; --help prints the options.
 * Returns the process exit status (above). */
int worker_main(int argc, char **argv);

#endif

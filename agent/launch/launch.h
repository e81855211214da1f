/*
 * launch.h - the rank processes this agent runs for a plan (docs/cluster.md,
 * "Rank processes on a node").
 *
 *     launcher *l = launcher_new(data_dir, &err);
 *     launcher_start(l, "job-7", epoch, ranks_json, &err);   (POST /v1/ranks)
 *     json_t *j = launcher_json(l);                           (GET /v1/ranks)
 *     launcher_stop(l, NULL, 2000, &err);                     (DELETE /v1/ranks)
 *     launcher_free(l);                                       (kills what runs)
 *
 * A job is one plan's ranks on this node.  Each rank is `<this binary>
 * worker ARGS...` (the same binary and code path as dsrun's ranks), with the
 * agent's environment plus the plan's variables, stdin and stdout on
 * /dev/null (rank 0, which speaks frames, runs beside the head's driver, not
 * here), stderr appended to DATA_DIR/ranks/<job>.rank<R>.log, and
 * PR_SET_PDEATHSIG: ranks die with their agent.  A rank's "files"
 * ({"VAR": content}) are written, mode 0600, to DATA_DIR/ranks/<job>.<var
 * in lower case>.xml (content starting with '<') or .txt before any rank
 * starts, and VAR is set to that path in the rank's environment (how a
 * plan's NCCL topology file reaches NCCL_TOPO_FILE: only the node knows
 * its path).  The ranks of a job on a node share one file per variable, so
 * they must agree on its content.  One job at a time: a new
 * job replaces the running one (its ranks are killed first), unless the
 * running one is of a newer epoch (DS_EPERM: a deposed head cannot replace
 * its successor's ranks).
 *
 * Threading: one mutex; every function may be called from any thread.
 * Children are reaped by launcher_json / launcher_start / launcher_stop
 * (waitpid WNOHANG on their own pids only).
 */
#ifndef DS_AGENT_LAUNCH_H
#define DS_AGENT_LAUNCH_H

#include "common/status.h"

#include <jansson.h>
#include <stdint.h>

#define LAUNCH_RANKS_MAX 64   /* ranks of one job on one node */
#define LAUNCH_ARGS_MAX 64    /* options of one rank */
#define LAUNCH_ENV_MAX 64     /* plan variables of one rank */
#define LAUNCH_JOB_MAX 64     /* job id: [A-Za-z0-9._-], 1..64 bytes */
#define LAUNCH_STR_MAX 4096   /* one option or value */
#define LAUNCH_VAR_MAX 255    /* one variable name */
#define LAUNCH_FILES_MAX 4    /* files of one job (variables over all its ranks) */
#define LAUNCH_FILE_MAX (1 << 20) /* bytes of one file */

typedef struct launcher launcher;

/* NULL with err on failure (the ranks/ directory, this binary's path). */
launcher *launcher_new(const char *data_dir, ds_err *err);

/* Kills (SIGKILL) and reaps every rank still running.  NULL is a no-op. */
void launcher_free(launcher *l);

/* Starts job's ranks: ranks is a JSON array of {"rank": R, "args": [...],
 * "env": {...}, "files": {"VAR": content}} ("env" and "files" optional).
 * Everything is checked before anything is started (DS_EINVAL naming the
 * first problem: a bad job id, rank, option, variable name or value, a
 * duplicate rank, too many of something, a file that is not a string, is
 * larger than LAUNCH_FILE_MAX or holds a NUL, a variable both in "env" and
 * "files", two ranks giving one variable different contents); then the
 * running job, if any, is stopped (DS_EPERM, and nothing changes, when it
 * is of a newer epoch), the files are written (DS_EIO naming the file, and
 * no rank starts), then every rank is forked.  A fork that fails kills the
 * ranks already started (DS_EIO). */
int launcher_start(launcher *l, const char *job, uint64_t epoch, const json_t *ranks,
		   ds_err *err);

/* Stops the running job (job NULL: whatever runs; else only that job,
 * DS_ENOTFOUND when another one runs): SIGTERM, then SIGKILL after grace_ms,
 * then reaped.  DS_OK also when nothing runs and job is NULL. */
int launcher_stop(launcher *l, const char *job, int grace_ms, ds_err *err);

/* {"job", "epoch", "ranks": [{"rank", "pid", "state" (running | exited |
 * killed), "exit_code" or "signal", "started", "ended", "log", "last_error"
 * (an ended rank's last log line that says level=error, else its last
 * line)}], "files": {"VAR": path}} of the current (or last) job;
 * {"job": null} before the first.  NULL on ENOMEM. */
json_t *launcher_json(launcher *l);

#endif

/*
 * local.h - a cluster of N dsagent processes on this machine, for `dsctl
 * cluster up --local N` and `dsctl cluster down --local` (docs/cluster.md,
 * "dsctl cluster up / down").
 *
 * Everything lives in one directory DIR:
 *
 *   DIR/cluster.key     the cluster key of the agents (0600)
 *   DIR/cluster.json    the running agents: name, pid, URLs, data dir, log
 *   DIR/nodeK/          node K's data directory (admin.token, dsagent.db)
 *   DIR/nodeK/agent.log its stdout and stderr, appended to
 *
 * Agent K is `dsagent --name nodeK`, loopback only, ports 0 (each prints
 * what it got), --expect N, node 1 with --priority 1 (it becomes the head)
 * and the others joining node 1's gossip port.  They are detached (own
 * session, stdin /dev/null) and outlive dsctl; DSAGENT_* variables of
 * dsctl's environment reach them.  A pid counts as one of the agents only
 * while /proc/PID/cmdline is a dsagent with that agent's --data-dir (a
 * recycled pid is never signalled).  Single-threaded.
 */
#ifndef DS_CTL_LOCAL_H
#define DS_CTL_LOCAL_H

#include "common/status.h"

#include <limits.h>
#include <stdio.h>

#define LOCAL_MAX 64 /* agents of one local cluster */

enum local_outcome {
	LOCAL_RUNNING = 0, /* local_up: started or found running */
	LOCAL_GONE,        /* local_down: was not running */
	LOCAL_TERMINATED,  /* local_down: ended after SIGTERM */
	LOCAL_KILLED,      /* local_down: ended after SIGKILL */
	LOCAL_STUCK,       /* local_down: still there after SIGKILL */
};

typedef struct local_agent {
	char name[32];
	int pid;
	char control_url[80], api_url[80];
	char gossip[80]; /* ADDR:PORT */
	char node_id[40];
	char data_dir[PATH_MAX];
	char log[PATH_MAX];
	enum local_outcome outcome;
} local_agent;

typedef struct local_cluster {
	char dir[PATH_MAX]; /* absolute */
	char key_file[PATH_MAX];
	int n;
	local_agent *agents; /* n of them; owned (local_cluster_free) */
	int reused;          /* local_up: the agents were running already */
} local_cluster;

/* Frees lc->agents (lc itself is caller storage); NULL is a no-op. */
void local_cluster_free(local_cluster *lc);

typedef struct local_params {
	const char *dir;       /* made absolute against the working directory */
	int n;                 /* 1..LOCAL_MAX */
	const char *fake_gpus; /* dsagent --fake-gpus of every agent, or NULL */
	const char *dsagent;   /* NULL: the dsagent beside this program's binary */
	long start_ms;         /* how long one agent may take to print its ports */
	FILE *diag;            /* where the log tail of an agent that died goes */
} local_params;

/* start_ms 60000, diag stderr. */
local_params local_default_params(void);

/* Fills *lc (zeroed first: free it with local_cluster_free, whatever the
 * outcome).  Starts the agents, or finds them running (lc->reused) when DIR/cluster.json
 * names N live agents; writes DIR/cluster.json.  DS_EBUSY when DIR holds a
 * cluster that is partly running or of another size (stop it first);
 * DS_EIO when an agent exits or stays silent during start-up (its log tail
 * is written to diag, the agents started are stopped, err names the agent
 * and its log); DS_ENOTFOUND when there is no dsagent binary; DS_EFORMAT for
 * a cluster.json that is not ours. */
int local_up(const local_params *p, local_cluster *lc, ds_err *err);

/* Stops the agents of DIR/cluster.json (lc, when not NULL, is filled as for
 * local_up): SIGTERM, up to grace_ms for them to
 * end, then SIGKILL; removes cluster.json.  lc (may be NULL) gets the agents
 * with their outcome.  DS_ENOTFOUND naming DIR/cluster.json when there is
 * none; DS_EBUSY when an agent is still there after SIGKILL (cluster.json is
 * kept). */
int local_down(const char *dir, long grace_ms, local_cluster *lc, ds_err *err);

#endif

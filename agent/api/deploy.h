/*
 * deploy.h - one model served across the nodes of the cluster: the head's
 * side of `dsctl cluster up` / `dsctl cluster down` (docs/cluster.md,
 * "Deployments: dsctl cluster up").
 *
 *     deploy *d = deploy_new(&params, &err);      (main, after the APIs start)
 *     deploy_up(d, body, len, &doc, &err);        POST   /v1/cluster/up (202)
 *     json_t *st = deploy_status(d);              GET    /v1/cluster/up
 *     deploy_down(d, &doc, &err);                 DELETE /v1/cluster/up
 *     deploy_free(d);                             (stops this deployment's ranks)
 *
 * deploy_up plans over the cluster (cluster_plan_post: the plan is stored,
 * fenced by the head's epoch) and hands the launch to the runner thread:
 *   1. the previous deployment's ranks stop on every node (DELETE /v1/ranks);
 *   2. serve_deploy loads the model under the distributed driver
 *      (engine/driver.h) on the serve's loader thread: rank 0 is the
 *      driver's child on this node; every other rank is started by the
 *      agent of its node (POST /v1/ranks with the rank's options and its
 *      node's plan environment; this node's own launcher directly), with
 *      the rendezvous store on the head's address;
 *   3. once rank 0 says READY (every rank loaded its slice) the API serves.
 * The monitor thread polls every node's ranks (GET /v1/ranks) while the
 * deployment loads or serves.  A rank that exits or is killed fails the
 * deployment within about a second: new requests get 503 naming the rank,
 * requests in flight end with the engine's error, then the model is unloaded
 * and the other ranks are stopped.  `dsctl cluster up` again relaunches.
 *
 * Threading: every function may be called from any thread.
 */
#ifndef DS_AGENT_DEPLOY_H
#define DS_AGENT_DEPLOY_H

#include "agent/api/serve.h"
#include "agent/cluster/cluster.h"
#include "agent/launch/launch.h"
#include "agent/store/store.h"
#include "common/status.h"

#include <jansson.h>

typedef struct deploy_params {
	cluster *cl;            /* not owned */
	launcher *lr;           /* this node's rank launcher, not owned */
	serve *sv;              /* the OpenAI API's serving context, not owned */
	store *st;              /* the plan's status goes to its row; not owned */
	const char *data_dir;   /* where admin.token lies (reported to dsctl) */
	const char *control_host, *api_host; /* bind addresses ("0.0.0.0": the node's) */
	int control_port, api_port;
	int threads;            /* per rank; 0 = this machine's cores over its ranks */
	int ctx, max_running;   /* the agent's --ctx and --max-running: caps on the plan's */
	int comm_timeout_ms;    /* the ranks' (0 = their default) */
	int poll_ms;            /* the monitor's period (0 = 500) */
} deploy_params;

typedef struct deploy deploy;

deploy *deploy_new(const deploy_params *p, ds_err *err);
/* Stops the threads, the model and this deployment's ranks on every node
 * (best effort, bounded).  NULL is a no-op. */
void deploy_free(deploy *d);

/* On the head: plans the request (POST /v1/cluster/plan's body plus
 * "served_model_name") and starts launching it.  DS_OK and *out (202): the
 * deployment id, state and plan.  Errors as cluster_plan_post (with *out
 * the plan that does not fit for DS_ERANGE), DS_EBUSY when this node is
 * not the head, DS_ECONFLICT when a deployment is still starting. */
int deploy_up(deploy *d, const char *body, size_t len, json_t **out, ds_err *err);

/* The deployment's state (see docs/cluster.md): state, error, per node
 * its ranks, the API and control URLs.  New reference (NULL on ENOMEM). */
json_t *deploy_status(deploy *d);

/* Stops the deployment (model unloaded, ranks stopped everywhere); *out is
 * the status after.  DS_EBUSY when this node is not the head. */
int deploy_down(deploy *d, json_t **out, ds_err *err);

/* A follower keeps the request of the deployment its ranks belong to
 * (POST /v1/ranks "deployment", from the head of epoch): when the head
 * changes, the new head relaunches it (once per reign), so the cluster
 * serves again without an operator.  deploy_forget drops it (dsctl cluster
 * down: DELETE /v1/ranks {"forget": true}). */
void deploy_remember(deploy *d, const json_t *request, uint64_t epoch);
void deploy_forget(deploy *d);

/* The ranks on node `name` of the current deployment as a JSON array (a
 * new reference), or NULL when it has none. */
json_t *deploy_node_ranks(deploy *d, const char *name);

#endif

/*
 * cluster.h - the cluster layer of one agent: its own inventory, the head
 * election driven by the gossip view, the cluster record the head keeps, and
 * the JSON answers of the cluster routes of the control API
 * (docs/cluster.md: "Election", "Cluster inventory", "Control API and dsctl").
 *
 *     cluster_params p = cluster_default_params();   ... fill ...
 *     cluster *c = cluster_new(&p, &err);     discovery, own node in the store,
 *                                             the election (single node: head now)
 *     cluster_meta_initial(c, meta, sizeof meta, &meta_len, &err);
 *     gossip_new(... meta, on_event -> cluster_member_event(c, ev) ...)
 *     cluster_start(c, gossip_or_NULL, control_port, api_port, &err);
 *                                             publishes the metadata with the ports
 *     ... control API handlers call cluster_*_json / cluster_election_post ...
 *     cluster_free(c);                        stops its threads (before gossip_free)
 *
 * Two threads run after cluster_start: the election thread (gossip view ->
 * election_set_view, election_tick, this node's gossip metadata) and the
 * inventory thread (this node's discovery every health_ms; on the head, the
 * members' inventories over GET /v1/node into the store).
 *
 * Threading: every function may be called from any thread once cluster_new
 * returned.
 */
#ifndef DS_AGENT_CLUSTER_H
#define DS_AGENT_CLUSTER_H

#include "agent/node/discover.h"
#include "agent/cluster/election.h"
#include "agent/cluster/gossip.h"
#include "agent/cluster/rpc.h"
#include "agent/store/store.h"
#include "common/status.h"

#include <jansson.h>

typedef struct cluster_params {
	const char *node_name;   /* this node's name (borrowed for the cluster's life) */
	const char *data_dir;    /* DATA_DIR/node.id is its identity */
	const char *version;     /* agent version for the metadata */
	store *store;            /* not owned */
	const char *cluster_key; /* key file; NULL = a single-node cluster, no gossip */
	disc_params disc;        /* how to discover this node (strings borrowed) */
	int expect;              /* --expect: cluster size; 0 = no election with gossip */
	int settle_ms, lease_ms, health_ms;
	int eligible;
	int priority;
} cluster_params;

/* Single node, settle 3000 ms, lease 5000 ms, health 10000 ms, eligible. */
cluster_params cluster_default_params(void);

typedef struct cluster cluster;

/* Discovers this node (DS_EINVAL etc. from disc_run), writes it to the store,
 * loads the cluster key (when set) and creates the election.  NULL with err. */
cluster *cluster_new(const cluster_params *p, ds_err *err);
/* This node's gossip metadata as the cluster publishes it (role, epoch,
 * eligible, priority, inventory digest; no ports yet), for gossip_params.meta:
 * the cluster is the only writer of the metadata, from the first version on.
 * Call before cluster_start.  DS_ERANGE when cap is too small. */
int cluster_meta_initial(cluster *c, uint8_t *out, size_t cap, size_t *len, ds_err *err);
/* Publishes the metadata with the ports (when g) and starts the threads; g
 * is the gossip instance (NULL exactly when cluster_key was NULL) and must
 * outlive cluster_free. */
int cluster_start(cluster *c, gossip *g, int control_port, int api_port, ds_err *err);
/* Stops the threads and frees.  NULL is a no-op. */
void cluster_free(cluster *c);

/* Records a membership change (member_events).  Safe on the gossip thread. */
void cluster_member_event(cluster *c, const gossip_event *ev);

/* The credential checker of agent-to-agent requests (NULL for a single node). */
rpc_auth *cluster_rpc_auth(cluster *c);

/* GET /v1/node: this node (identity, role, epoch, digest, inventory with the
 * latest health).  New reference or NULL (out of memory). */
json_t *cluster_node_json(cluster *c);

/* GET /v1/cluster/state: this node's view of membership and election, and
 * the recent epochs. */
json_t *cluster_state_json(cluster *c);

/* GET /v1/cluster/nodes: every node with inventory and health.  The head
 * answers from its record; another node forwards to the head when forward
 * is set (an operator's request), else, or when the head cannot be reached,
 * answers from its own view with "stale": true and the reason.  DS_OK and
 * *out, or DS_ENOMEM. */
int cluster_nodes_json(cluster *c, int forward, json_t **out, ds_err *err);

/* GET /v1/cluster/plan: the current shard plan (the newest row of plans,
 * with its ranks and comm groups) from the head's store, with "source":
 * "head".  Another node forwards to the head when forward is set.
 * DS_ENOTFOUND when there is no plan yet; DS_EBUSY with the reason when
 * there is no head or it cannot be reached (the caller answers 503). */
int cluster_plan_json(cluster *c, int forward, json_t **out, ds_err *err);

/* election_fence at this moment: DS_OK when epoch is the reign this node
 * recognises (DS_EPERM stale, DS_EBUSY no head or not heard of yet). */
int cluster_fence(cluster *c, uint64_t epoch, ds_err *err);

/* POST /v1/cluster/plan {"model": PATH, "tp", "pp", "ep", "max_ctx" (0 or
 * absent: the planner chooses), "mem_fraction"}: the head plans over the
 * alive nodes of its record (itself first; agent/plan/plan.h), and writes
 * the plan with its epoch (election_fence, then store_plan_insert).  *out:
 * the planner's document with "version", "epoch", "source": "head" (also
 * when it does not fit: DS_ERANGE, the document says by how much).  Another
 * node forwards when forward is set.  DS_EINVAL for a bad body or plan
 * request (400), DS_ENOTFOUND for a missing model (404), DS_EBUSY / DS_EPERM
 * without a head or with a stale epoch (503). */
int cluster_plan_post(cluster *c, int forward, const char *body, size_t len, json_t **out,
		      ds_err *err);

/* 1 when this node is the head now; *epoch (when not NULL) gets the
 * epoch of the head this node knows. */
int cluster_is_head(cluster *c, uint64_t *epoch);

/* One call to the control API of member node_id (32 hex) of the gossip
 * view, signed with the cluster key, at most timeout_ms.  DS_OK with the
 * HTTP *status (any) and *answer (the body when it is a JSON object, else
 * NULL; a new reference); DS_ENOTFOUND (not a member, no control port),
 * DS_EIO / DS_ETIMEOUT naming the node. */
int cluster_node_call(cluster *c, const char *node_id, const char *method, const char *path,
		      const char *body, size_t len, int timeout_ms, int *status, json_t **answer,
		      ds_err *err);

/* cluster_node_call to the head this node knows (also when that is this
 * node); DS_EBUSY with the reason when there is none or it cannot be
 * reached. */
int cluster_head_call(cluster *c, const char *method, const char *path, const char *body,
		      size_t len, int timeout_ms, int *status, json_t **answer, ds_err *err);

/* POST /v1/cluster/election from sender (hex id, authenticated): parses the
 * message, checks that it comes from sender, and hands it to the election.
 * DS_OK and *reply; DS_EFORMAT / DS_EPERM with a message for a 400 / 403. */
int cluster_election_post(cluster *c, const char *sender, const char *body, size_t len,
			  json_t **reply, ds_err *err);

/* TEST ONLY (--test-fault-injection): cut agent-to-agent calls to and from
 * the members named in names_csv ("" = none), like gossip_test_drop does for
 * gossip.  DS_EINVAL for a bad list. */
int cluster_test_drop(cluster *c, const char *names_csv, ds_err *err);
/* 1 when requests from this sender (hex id) are to be refused (test drop). */
int cluster_sender_dropped(cluster *c, const char *sender);

#endif

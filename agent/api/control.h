/*
 * control.h - the control API of one agent (HTTP on --control-port).
 *
 * Public:  GET /health, GET /v1/version.
 * Admin (Authorization: Bearer <DATA_DIR/admin.token>, else 401):
 *   POST   /v1/keys       {"name", "expires_days", "rpm", "tpm", "max_concurrency"}
 *                         -> 201 {"id","name","key","prefix","created",...}
 *   GET    /v1/keys       -> 200 {"data":[{...key without its text, usage totals}]}
 *   DELETE /v1/keys/ID    -> 200 {...the key, "revoked": true}
 * (docs/keys.md).  The cluster routes join this table as the agent grows.
 * Cluster (admin; 503 when the agent runs without --cluster-key):
 *   GET    /v1/cluster/members  -> 200 {"self","members":[...],"stats":{...},
 *                                       "profile","joined"} (gossip_status_json)
 *   POST   /v1/cluster/test/drop {"peers":"a,b"} -> 200 {"peers":"a,b"}
 *          TEST ONLY: exists with --test-fault-injection (404 otherwise); cuts
 *          gossip with those members ("" restores it), and agent-to-agent
 *          calls with them (cluster_test_drop).
 * Engine (admin):
 *   POST   /v1/test/fail-steps {"steps": N} -> 200 {"steps": N}
 *          TEST ONLY: exists with --test-fault-injection (404 otherwise); the
 *          next N engine steps fail as a forward error would (the requests in
 *          them end with 500 / an SSE error event); 0 cancels.  503 until the
 *          model is loaded.
 * Cluster state (the admin token, or the cluster credential of another agent:
 * "Authorization: DSCluster ..." of agent/cluster/rpc.h; docs/cluster.md):
 *   GET    /v1/node             -> 200 this node: id, name, role, epoch, digest,
 *                                       inventory (with health)
 *   GET    /v1/cluster/state    -> 200 this node's view: role, epoch, head,
 *                                       quorum, why no head, members, elections
 *   GET    /v1/cluster/nodes    -> 200 every node with inventory and health; a
 *                                       follower forwards an operator's request
 *                                       to the head, and answers from its own
 *                                       view ("stale": true, "reason") when the
 *                                       head cannot be reached
 * Deployments (the admin token; a follower forwards an operator's request to
 * the head, and answers its status; agent/api/deploy.h):
 *   POST   /v1/cluster/up {"model", "served_model_name", "tp", "pp", "ep",
 *                          "max_ctx", "mem_fraction"} -> 202 {"deployment",
 *                          "state", "plan"}; 422 {"error", "plan"} when it does
 *                          not fit; 409 while another one starts
 *   GET    /v1/cluster/up   -> 200 state, error, ranks per node, URLs
 *   DELETE /v1/cluster/up   -> 200 the state after stopping
 * Agents only (the cluster credential):
 *   POST   /v1/cluster/election  election message -> 200 reply (agent/cluster/election.h)
 */
#ifndef DS_AGENT_CONTROL_H
#define DS_AGENT_CONTROL_H

#include "agent/cluster/cluster.h"
#include "agent/cluster/gossip.h"
#include "agent/api/http.h"
#include "agent/auth/keys.h"

typedef struct control_ctx {
	const char *node_name;
	const char *backend;     /* name of the compute backend in use */
	const char *backend_desc;
	double started_s;        /* ds_now_s() at start */
	keys_svc *keys;          /* NULL: the key routes answer 503 */
	const char *admin_token; /* NULL or empty: every admin route answers 401 */
	gossip *gossip;          /* NULL: single node, the cluster routes answer 503 */
	int test_faults;         /* --test-fault-injection: the test/drop route exists */
	cluster *cluster;        /* NULL: the cluster state routes answer 503 */
	struct launcher *launcher; /* NULL: the /v1/ranks routes answer 503 */
	struct serve *serve;     /* the OpenAI API's state, published (atomic store,
				  * release) once it exists: the engine test route */
	struct deploy *deploy;   /* NULL: the /v1/cluster/up routes answer 503;
				  * published like serve once it exists */
} control_ctx;

extern const http_route control_routes[];

#endif

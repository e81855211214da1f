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
 */
#ifndef DS_AGENT_CONTROL_H
#define DS_AGENT_CONTROL_H

#include "agent/http.h"
#include "agent/keys.h"

typedef struct control_ctx {
	const char *node_name;
	const char *backend;     /* name of the compute backend in use */
	const char *backend_desc;
	double started_s;        /* ds_now_s() at start */
	keys_svc *keys;          /* NULL: the key routes answer 503 */
	const char *admin_token; /* NULL or empty: every admin route answers 401 */
} control_ctx;

extern const http_route control_routes[];

#endif

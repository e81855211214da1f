/*
 * control.h - the control API of one agent (HTTP on --control-port).
 *
 * Today: GET /health and GET /v1/version.  The cluster routes
 * (/v1/cluster/state, /v1/cluster/nodes, /v1/node) and the admin routes used
 * by `dsctl keys` join this table as the agent grows.
 */
#ifndef DS_AGENT_CONTROL_H
#define DS_AGENT_CONTROL_H

#include "agent/http.h"

typedef struct control_ctx {
	const char *node_name;
	const char *backend;     /* name of the compute backend in use */
	const char *backend_desc;
	double started_s;        /* ds_now_s() at start */
} control_ctx;

extern const http_route control_routes[];

#endif

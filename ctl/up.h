/*
 * up.h - the deployment flow behind `dsctl cluster up` and `dsctl cluster
 * down` (docs/cluster.md, "dsctl cluster up / down").
 *
 * up_run talks to one agent's control API with the admin token (a node that
 * is not the head forwards to the head):
 *
 *   GET /v1/cluster/state until there is a head and `expect` members alive
 *   POST /v1/cluster/up {model, ...}     503: retried; 4xx: the end
 *   print the plan (tp/pp/ep, rank -> node/device, KV)
 *   GET /v1/cluster/up every poll_ms     progress on change
 *     "serving" -> DS_OK; "failed", "stopped", "none", a 4xx -> an error
 *
 * all within wait_ms.  Progress goes to out as text lines, as bars redrawn
 * in place (redraw: a terminal), or as one JSON object per line (json).
 * up_result_print then prints the outcome as the last line.  dsctl is
 * single-threaded; so is this module.
 */
#ifndef DS_CTL_UP_H
#define DS_CTL_UP_H

#include "common/status.h"

#include <jansson.h>
#include <limits.h>
#include <stdio.h>

typedef struct up_params {
	const char *control_url;       /* the agent asked, e.g. http://127.0.0.1:7481 */
	const char *token;             /* admin token */
	const char *token_source;      /* where it was read from, for a 401 message */
	long request_ms;               /* timeout of one request */
	const char *model;             /* path every node sees; required */
	const char *served_model_name; /* N[,ALIAS]; NULL: the head's default */
	int tp, pp, ep;                /* 0: the planner chooses */
	int max_ctx;                   /* 0: the planner's default */
	double mem_fraction;           /* 0: the planner's default */
	int expect;                    /* alive members to wait for (0: a head suffices) */
	long wait_ms;                  /* deadline of the whole flow */
	long poll_ms;                  /* interval of GET /v1/cluster/state and /v1/cluster/up */
	int json;                      /* one JSON object per line instead of text */
	int redraw;                    /* out is a terminal: bars redrawn in place */
	const char *dsctl;             /* how the printed `keys create` line runs dsctl */
	FILE *out;                     /* progress and the outcome */
	FILE *err;                     /* text-mode failures and hints */
} up_params;

/* request_ms 10000, wait_ms 600000, poll_ms 250, dsctl "dsctl", out stdout,
 * err stderr; everything else 0/NULL. */
up_params up_default_params(void);

/* What up_run ended with.  Strings are empty when unknown. */
typedef struct up_result {
	int serving;
	long long deployment; /* -1: none */
	char error[1024];
	char failed_node[256];
	int failed_rank; /* -1: none */
	char api_url[512], control_url[512], admin_token_file[PATH_MAX];
	char served_model_name[256];
	json_t *shortfall; /* owned: the plan's shortfall of a 422 answer, or NULL */
} up_result;

void up_result_init(up_result *r);
void up_result_free(up_result *r); /* NULL is a no-op */

/* Runs the flow (see the top).  DS_OK when the deployment serves; else
 * DS_EAUTH (401), DS_EIO (agent unreachable), DS_EINVAL (a 4xx answer),
 * DS_ERANGE (422: does not fit; res->shortfall set), DS_ETIMEOUT, or
 * DS_EINTERNAL (the deployment failed, was stopped or replaced), with
 * res->error saying what and, when the head says, res->failed_node and
 * res->failed_rank. */
int up_run(const up_params *p, up_result *res);

/* The last line(s): text (success on out: the API URL and the exact
 * `dsctl keys create NAME` line; failure on err: "dsctl: cluster up failed:
 * ...") or one JSON object on out ({"serving": true, "api_url", ...} or
 * {"serving": false, "error", "failed_node", "failed_rank"}). */
void up_result_print(const up_params *p, const up_result *res);

/* DELETE /v1/cluster/up and prints what stopped (with json: the answer).
 * DS_OK, or an error code with err saying what went wrong. */
int up_down(const up_params *p, ds_err *err);

#endif

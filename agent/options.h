/*
 * options.h - dsagent's settings: one struct, one table (common/config.h).
 * Sources, later winning: defaults, --config FILE, DSAGENT_* environment, flags.
 */
#ifndef DS_AGENT_OPTIONS_H
#define DS_AGENT_OPTIONS_H

#include "common/config.h"

typedef struct agent_opts {
	char *name;         /* node name; default: hostname */
	char *bind;         /* address of the control API */
	int control_port;
	char *data_dir;
	char *backend;      /* auto | cpu | cuda */
	char *log_level;
	/* serving (docs/serving.md) */
	char *model;             /* checkpoint dir or .gguf; NULL = the default model */
	char *served_model_name; /* NAME[,ALIAS...]; NULL = the model file's base name */
	char *api_bind;
	int api_port;
	int insecure_no_auth;
	int metrics_auth;
	char *cors_origin;
	char *chat_template;     /* override name (chatml, llama3, deepseek-v3, ...) */
	char *kv_cache_dtype;    /* auto | f16 | f32 */
	int threads;
	int tp, pp, ep;          /* a plan of rank processes on this machine (engine/driver.h) */
	int ctx;
	int max_running, max_waiting, max_batch_tokens, prefill_chunk, page_size;
	int enable_prefix_caching;
	int kv_cache_mb;
	int max_body_kb;
	/* both HTTP servers (agent/api/http.h) */
	int http_max_conns, http_max_conns_per_addr;
	int http_header_timeout_s, http_keepalive_timeout_s, http_timeout_s;
	int http_max_body_total_mb;
	int max_n, max_logprobs;
	int shutdown_grace_ms;   /* SIGTERM: time running requests get to finish */
	int stats_log_ms;        /* throughput log line period; 0 = none */
	/* discovery (agent/node/discover.h) */
	char *sysroot;           /* read /proc, /sys, /etc under it; "/" = this machine */
	char *fake_gpus;         /* NxMODEL-MEMGB[:topology] or 0 instead of NVML */
	char *nvml_lib;          /* NVML library path (tests: a fake); NULL = the default */
	int discover;            /* print the inventory as JSON and exit */
	/* gossip membership (agent/cluster/gossip.h, docs/cluster.md) */
	char *cluster_key;       /* key file; NULL = single node, no gossip */
	char *gossip_bind;
	int gossip_port;
	char *join;              /* HOST:PORT[,...] seeds */
	char *advertise_addr;
	char *gossip_profile;    /* lan | test */
	int test_fault_injection; /* TEST ONLY: POST /v1/cluster/test/drop, /v1/test/fail-steps */
	/* election and cluster inventory (agent/cluster/election.h, agent/cluster/cluster.h) */
	int expect;              /* cluster size N; 0 = no election (gossip only) */
	int settle_ms;           /* formation: membership unchanged this long */
	int lease_ms;            /* head lease / follower promise */
	int eligible;            /* may become head */
	int priority;            /* higher ranks first */
	int health_ms;           /* inventory and health refresh period */
	int print_config;
	int help;
	int version;
} agent_opts;

extern const cfg_opt agent_opts_table[];

/* Loads opts from all sources and validates cross-field rules. */
int agent_opts_load(agent_opts *o, int argc, char **argv, ds_err *err);
void agent_opts_free(agent_opts *o);

#endif

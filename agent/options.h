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
	int threads;
	int ctx;
	int max_running, max_waiting, max_batch_tokens, prefill_chunk, page_size;
	int kv_cache_mb;
	int max_body_kb;
	int max_n, max_logprobs;
	int print_config;
	int help;
	int version;
} agent_opts;

extern const cfg_opt agent_opts_table[];

/* Loads opts from all sources and validates cross-field rules. */
int agent_opts_load(agent_opts *o, int argc, char **argv, ds_err *err);
void agent_opts_free(agent_opts *o);

#endif

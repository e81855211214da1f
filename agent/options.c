/*
 * options.c - the dsagent option table (see options.h).  The table is the
 * single source for flag parsing, the config file, DSAGENT_* variables,
 * --help and --print-config.  Called once from main before anything starts.
 */
#include "agent/options.h"
#include "common/log.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define O(f) offsetof(agent_opts, f)

const cfg_opt agent_opts_table[] = {
	{"name", CFG_STR, O(name), NULL, 1, 0, "node name (default: the hostname)"},
	{"bind", CFG_STR, O(bind), "127.0.0.1", 1, 0, "IPv4 address the control API listens on"},
	{"control-port", CFG_INT, O(control_port), "7481", 0, 65535,
	 "port of the control API (0 = any free port, printed at start)"},
	{"data-dir", CFG_STR, O(data_dir), "/var/lib/dsagent", 1, 0,
	 "directory of the agent's state (database, admin token)"},
	{"backend", CFG_STR, O(backend), "auto", 1, 0, "compute backend: auto, cpu or cuda"},
	{"log-level", CFG_STR, O(log_level), "info", 1, 0, "debug, info, warn or error"},
	{"http-threads", CFG_INT, O(http_threads), "4", 1, 256, "HTTP worker threads"},
	{"print-config", CFG_BOOL, O(print_config), "false", 1, 0,
	 "print the effective configuration as 'key = value' lines and exit"},
	{"version", CFG_BOOL, O(version), "false", 1, 0, "print the version and exit"},
	{"help", CFG_BOOL, O(help), "false", 1, 0, "this help"},
	{0},
};

int agent_opts_load(agent_opts *o, int argc, char **argv, ds_err *err)
{
	int next = 0;
	int rc = cfg_load(agent_opts_table, o, "DSAGENT", argc, argv, 1, &next, err);
	if (rc)
		return rc;
	if (next < argc)
		return ds_err_set(err, DS_EINVAL, "unexpected argument '%s' (see --help)",
				  argv[next]);
	enum log_level lv;
	if (log_level_parse(o->log_level, &lv) != DS_OK)
		return ds_err_set(err, DS_EINVAL,
				  "--log-level=%s is not one of debug, info, warn, error, off",
				  o->log_level);
	log_set_level(lv);
	if (!o->name) {
		char host[256] = "";
		if (gethostname(host, sizeof host - 1) != 0 || !host[0])
			strncpy(host, "node", sizeof host - 1);
		return cfg_set(agent_opts_table, o, "name", host, "hostname", err);
	}
	return DS_OK;
}

void agent_opts_free(agent_opts *o)
{
	cfg_free(agent_opts_table, o);
}

/*
 * main.c - dsagent: the per-node agent.
 *
 * Start-up order (teardown is the reverse):
 *   options -> compute backend -> control API -> sd_notify(READY=1) -> wait for
 *   SIGINT/SIGTERM -> stop HTTP -> exit 0.
 * Discovery, gossip, election, store and the OpenAI API join this sequence in
 * later steps (docs/architecture.md).
 */
#include "agent/control.h"
#include "agent/http.h"
#include "agent/options.h"
#include "common/log.h"
#include "common/strutil.h"
#include "engine/engine.h"

#include <signal.h>
#include <stdio.h>
#include <systemd/sd-daemon.h>

static void usage(FILE *f)
{
	fprintf(f, "usage: dsagent [options]\n\nOptions (each also DSAGENT_<NAME> or 'name = value' "
		   "in --config FILE):\n");
	cfg_print_help(agent_opts_table, "DSAGENT", f);
}

static void print_config(const agent_opts *o)
{
	char v[1024];
	for (const cfg_opt *t = agent_opts_table; t->name; t++) {
		if (cfg_get(agent_opts_table, o, t->name, v, sizeof v) == DS_OK)
			printf("%s = %s\n", t->name, v);
	}
}

int main(int argc, char **argv)
{
	agent_opts opts;
	ds_err err = {0};
	http_server *control = NULL;
	int rc = 0;

	if (agent_opts_load(&opts, argc, argv, &err) != DS_OK) {
		fprintf(stderr, "dsagent: %s\n", err.msg);
		rc = 2;
		goto out;
	}
	if (opts.help) {
		usage(stdout);
		goto out;
	}
	if (opts.version) {
		printf("dsagent %s\n", eng_version());
		goto out;
	}
	if (opts.print_config) {
		print_config(&opts);
		goto out;
	}

	const kb_backend *be = eng_backend_choose(opts.backend, &err);
	if (!be) {
		fprintf(stderr, "dsagent: %s\n", err.msg);
		rc = 1;
		goto out;
	}

	/* Block the stop signals before any thread starts, so only sigwait sees them. */
	sigset_t stop;
	sigemptyset(&stop);
	sigaddset(&stop, SIGINT);
	sigaddset(&stop, SIGTERM);
	pthread_sigmask(SIG_BLOCK, &stop, NULL);

	control_ctx ctx = {opts.name, be->name, be->describe(), ds_now_s()};
	http_params hp = http_default_params();
	hp.bind_addr = opts.bind;
	hp.port = opts.control_port;
	hp.routes = control_routes;
	hp.ud = &ctx;
	hp.threads = opts.http_threads;
	control = http_server_new(&hp, &err);
	if (!control) {
		fprintf(stderr, "dsagent: control API: %s\n", err.msg);
		rc = 1;
		goto out;
	}
	log_info("agent", "ready", "name=%s control=%s:%d backend=%s", opts.name, opts.bind,
		 http_server_port(control), be->name);
	/* One machine-readable line for scripts and tests that asked for port 0. */
	printf("dsagent listening control=%s:%d\n", opts.bind, http_server_port(control));
	fflush(stdout);
	sd_notify(0, "READY=1");

	int sig = 0;
	sigwait(&stop, &sig);
	sd_notify(0, "STOPPING=1");
	log_info("agent", "stopping", "signal=%d", sig);
out:
	http_server_free(control);
	agent_opts_free(&opts);
	return rc;
}

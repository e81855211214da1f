/*
 * main.c - dsctl: the operator's command line.
 *
 * dsctl [global flags] COMMAND [args]; commands are rows of one table
 * (name, handler, help).  Global flags: --agent URL (else $DSCTL_AGENT, else
 * http://127.0.0.1:7481), --json, --timeout MS.  dsctl only talks HTTP to the
 * agent; it links nothing of the engine.
 */
#include "common/buf.h"
#include "common/config.h"
#include "common/jsonx.h"
#include "ctl/client.h"

#include <jansson.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ctl_opts {
	char *agent;
	int json;
	int timeout_ms;
	int help;
};

static const cfg_opt opts_table[] = {
	{"agent", CFG_STR, offsetof(struct ctl_opts, agent), "http://127.0.0.1:7481", 1, 0,
	 "URL of the agent's control API"},
	{"json", CFG_BOOL, offsetof(struct ctl_opts, json), "false", 1, 0,
	 "print one JSON document instead of text"},
	{"timeout", CFG_INT, offsetof(struct ctl_opts, timeout_ms), "10000", 1, 600000,
	 "request timeout in milliseconds"},
	{"help", CFG_BOOL, offsetof(struct ctl_opts, help), "false", 1, 0, "this help"},
	{0},
};

typedef int (*cmd_fn)(const struct ctl_opts *o, int argc, char **argv);

/* GETs path and returns the parsed JSON body of a 2xx reply (NULL otherwise,
 * after printing why). */
static json_t *get_json(const struct ctl_opts *o, const char *path)
{
	ctl_client c = {o->agent, NULL, o->timeout_ms};
	buf body;
	ds_err err = {0};
	long status = 0;
	json_t *v = NULL;
	buf_init(&body, 16 << 20);
	if (ctl_request(&c, "GET", path, NULL, &status, &body, &err) != DS_OK) {
		fprintf(stderr, "dsctl: %s\n", err.msg);
		goto out;
	}
	v = jsonx_parse(body.data ? body.data : "", body.len, 64, &err);
	if (status < 200 || status > 299) {
		json_t *m = v ? json_object_get(json_object_get(v, "error"), "message") : NULL;
		fprintf(stderr, "dsctl: the agent answered %ld: %s\n", status,
			json_is_string(m) ? json_string_value(m) : (body.data ? body.data : ""));
		json_decref(v);
		v = NULL;
	} else if (!v) {
		fprintf(stderr, "dsctl: the agent's reply is not JSON: %s\n", err.msg);
	}
out:
	buf_free(&body);
	return v;
}

static int print_json(const json_t *v)
{
	char *s = json_dumps(v, JSON_INDENT(2) | JSON_SORT_KEYS);
	if (!s)
		return 1;
	printf("%s\n", s);
	free(s);
	return 0;
}

static int cmd_health(const struct ctl_opts *o, int argc, char **argv)
{
	json_t *v = get_json(o, "/health");
	if (!v)
		return 1;
	int rc = 0;
	if (o->json) {
		rc = print_json(v);
	} else {
		json_t *up = json_object_get(v, "uptime_s");
		printf("%s: %s (dsagent %s, backend %s, up %.0f s)\n",
		       json_string_value(json_object_get(v, "name")),
		       json_string_value(json_object_get(v, "status")),
		       json_string_value(json_object_get(v, "version")),
		       json_string_value(json_object_get(v, "backend")),
		       json_is_number(up) ? json_number_value(up) : 0.0);
	}
	json_decref(v);
	return rc;
}

static int cmd_version(const struct ctl_opts *o, int argc, char **argv)
{
	json_t *v = get_json(o, "/v1/version");
	if (!v)
		return 1;
	int rc = 0;
	if (o->json)
		rc = print_json(v);
	else
		printf("dsagent %s (%s: %s)\n", json_string_value(json_object_get(v, "version")),
		       json_string_value(json_object_get(v, "backend")),
		       json_string_value(json_object_get(v, "backend_detail")));
	json_decref(v);
	return rc;
}

static const struct {
	const char *name;
	cmd_fn fn;
	const char *help;
} commands[] = {
	{"health", cmd_health, "is the agent up; its name, version and backend"},
	{"version", cmd_version, "version and compute backend of the agent"},
	{NULL, NULL, NULL},
};

static void usage(FILE *f)
{
	fprintf(f, "usage: dsctl [flags] COMMAND\n\nCommands:\n");
	for (int i = 0; commands[i].name; i++)
		fprintf(f, "  %-12s %s\n", commands[i].name, commands[i].help);
	fprintf(f, "\nFlags (also DSCTL_<NAME> in the environment):\n");
	cfg_print_help(opts_table, "DSCTL", f);
}

int main(int argc, char **argv)
{
	struct ctl_opts o;
	ds_err err = {0};
	int next = 0, rc = 2;
	if (cfg_load(opts_table, &o, "DSCTL", argc, argv, 1, &next, &err) != DS_OK) {
		fprintf(stderr, "dsctl: %s\n", err.msg);
		goto out;
	}
	if (o.help || next >= argc) {
		usage(o.help ? stdout : stderr);
		rc = o.help ? 0 : 2;
		goto out;
	}
	/* flags may also follow the command: `dsctl health --json` */
	int cmd_at = next;
	int rest = cmd_at + 1;
	if (cfg_parse_args(opts_table, &o, argc, argv, rest, &rest, &err) != DS_OK) {
		fprintf(stderr, "dsctl: %s\n", err.msg);
		goto out;
	}
	for (int i = 0; commands[i].name; i++) {
		if (strcmp(commands[i].name, argv[cmd_at]) == 0) {
			rc = commands[i].fn(&o, argc - rest, argv + rest);
			goto out;
		}
	}
	fprintf(stderr, "dsctl: unknown command '%s' (see dsctl --help)\n", argv[cmd_at]);
out:
	cfg_free(opts_table, &o);
	return rc;
}

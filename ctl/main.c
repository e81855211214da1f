/*
 * main.c - dsctl: the operator's command line.
 *
 * dsctl [global flags] COMMAND [SUBCOMMAND] [args and flags]; commands are
 * rows of one table (words, handler, flags, arguments, help).  Help at every
 * level: `dsctl -h|--help|help`, `dsctl help keys`, `dsctl keys --help`,
 * `dsctl keys create -h` (a positional "help" right after a command asks
 * for its help; `--` before it makes it an argument).  A word that is no
 * command or subcommand is named, with the nearest one as "did you mean".
 * Global flags may come before or after the command:
 *   --agent URL       else $DSCTL_AGENT, else http://127.0.0.1:7481
 *   --token-file F    admin token file, else $DSCTL_TOKEN (the token itself),
 *                     else DATA_DIR/admin.token with --data-dir DATA_DIR
 *                     (default /var/lib/dsagent)
 *   --json            one JSON document on stdout
 *   --timeout MS
 * Exit status: 0 done, 1 failed (agent unreachable, refused, error reply),
 * 2 bad usage.  dsctl only talks HTTP to the agent; it links nothing of the
 * engine.  Single-threaded.
 */
#include "common/buf.h"
#include "common/config.h"
#include "common/fileutil.h"
#include "common/jsonx.h"
#include "common/strutil.h"
#include "ctl/client.h"
#include "ctl/keyfile.h"
#include "ctl/local.h"
#include "ctl/up.h"

#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_DATA_DIR "/var/lib/dsagent"
#define TOKEN_MAX 4096

struct ctl_opts {
	char *agent;
	char *token_file;
	char *data_dir;
	int json;
	int timeout_ms;
	int help;
};

static const cfg_opt opts_table[] = {
	{.name = "agent", .type = CFG_STR, .offset = offsetof(struct ctl_opts, agent),
	 .def = "http://127.0.0.1:7481", .min = 1, .max = 0,
	 .help = "URL of the agent's control API"},
	{.name = "token-file", .type = CFG_STR, .offset = offsetof(struct ctl_opts, token_file),
	 .def = NULL, .min = 1, .max = 0,
	 .help = "file holding the admin token (else $DSCTL_TOKEN, else DATA_DIR/admin.token)"},
	{.name = "data-dir", .type = CFG_STR, .offset = offsetof(struct ctl_opts, data_dir),
	 .def = DEFAULT_DATA_DIR, .min = 1, .max = 0,
	 .help = "the agent's data directory, where admin.token is read from"},
	{.name = "json", .type = CFG_BOOL, .offset = offsetof(struct ctl_opts, json),
	 .def = "false", .min = 1, .max = 0, .help = "print one JSON document instead of text"},
	{.name = "timeout", .type = CFG_INT, .offset = offsetof(struct ctl_opts, timeout_ms),
	 .def = "10000", .min = 1, .max = 600000, .help = "request timeout in milliseconds"},
	{.name = "help", .type = CFG_BOOL, .offset = offsetof(struct ctl_opts, help),
	 .def = "false", .min = 1, .max = 0, .help = "this help", .short_flag = 'h'},
	{.name = NULL},
};

/* Flags of the subcommands (each command's table points into this struct). */
struct cmd_flags {
	int64_t expires_days;
	int64_t rpm, tpm, max_concurrency;
	char *key_file; /* cluster init */
	int force;
	/* cluster up / down */
	char *model, *served_model_name, *local_dir, *fake_gpus;
	int tp, pp, ep, max_ctx, expect, local_n, local;
	double mem_fraction;
	int64_t wait_ms;
};

#define F(f) offsetof(struct cmd_flags, f)
static const cfg_opt create_flags[] = {
	{.name = "expires", .type = CFG_I64, .offset = F(expires_days), .def = NULL, .min = 0,
	 .max = 36500, .help = "days until the key expires (default: never)"},
	{.name = "rpm", .type = CFG_I64, .offset = F(rpm), .def = NULL, .min = 0, .max = 1e9,
	 .help = "requests per minute (default: unlimited)"},
	{.name = "tpm", .type = CFG_I64, .offset = F(tpm), .def = NULL, .min = 0, .max = 1e12,
	 .help = "prompt + completion tokens per minute (default: unlimited)"},
	{.name = "max-concurrency", .type = CFG_I64, .offset = F(max_concurrency), .def = NULL,
	 .min = 0, .max = 1e6, .help = "requests in flight at once (default: unlimited)"},
	{.name = NULL},
};
static const cfg_opt cluster_init_flags[] = {
	{.name = "key-file", .type = CFG_STR, .offset = F(key_file),
	 .def = "/etc/dsagent/cluster.key", .min = 1, .max = 0,
	 .help = "where to write the key (created with mode 0600, parent directories 0700)"},
	{.name = "force", .type = CFG_BOOL, .offset = F(force), .def = "false", .min = 1, .max = 0,
	 .help = "replace an existing key file (every node then needs the new key)"},
	{.name = NULL},
};
#define UP_WAIT_MS "600000"
#define LOCAL_DIR "run/cluster"
static const cfg_opt cluster_up_flags[] = {
	{.name = "model", .type = CFG_STR, .offset = F(model), .def = NULL, .min = 1, .max = 0,
	 .help = "the model to serve: a checkpoint every node reads at this path (required)"},
	{.name = "served-model-name", .type = CFG_STR, .offset = F(served_model_name),
	 .def = NULL, .min = 1, .max = 0,
	 .help = "NAME[,ALIAS...] clients use as 'model' (default: the head's choice)"},
	{.name = "tp", .type = CFG_INT, .offset = F(tp), .def = "0", .min = 0, .max = 65536,
	 .help = "tensor-parallel ranks (0: the planner chooses)"},
	{.name = "pp", .type = CFG_INT, .offset = F(pp), .def = "0", .min = 0, .max = 65536,
	 .help = "pipeline stages (0: the planner chooses)"},
	{.name = "ep", .type = CFG_INT, .offset = F(ep), .def = "0", .min = 0, .max = 65536,
	 .help = "expert-parallel groups (0: the planner chooses)"},
	{.name = "max-ctx", .type = CFG_INT, .offset = F(max_ctx), .def = "0", .min = 0,
	 .max = 1 << 24, .help = "longest sequence the KV cache must hold (0: the planner's)"},
	{.name = "mem-fraction", .type = CFG_DOUBLE, .offset = F(mem_fraction), .def = NULL,
	 .min = 0.01, .max = 1.0, .help = "share of each device's memory to use (default 0.9)"},
	{.name = "expect", .type = CFG_INT, .offset = F(expect), .def = "0", .min = 0,
	 .max = 1000, .help = "wait for this many alive members before launching (--local: N)"},
	{.name = "wait", .type = CFG_I64, .offset = F(wait_ms), .def = UP_WAIT_MS, .min = 1,
	 .max = 86400000,
	 .help = "give up after this many ms: head, launch and load together (default "
		 UP_WAIT_MS ")"},
	{.name = "local", .type = CFG_INT, .offset = F(local_n), .def = NULL, .min = 1,
	 .max = LOCAL_MAX,
	 .help = "start N agents on this machine first (reused while they run), then deploy on "
		 "them"},
	{.name = "local-dir", .type = CFG_STR, .offset = F(local_dir), .def = NULL, .min = 1,
	 .max = 0, .help = "--local: the cluster's directory (default " LOCAL_DIR ")"},
	{.name = "fake-gpus", .type = CFG_STR, .offset = F(fake_gpus), .def = NULL, .min = 1,
	 .max = 0, .help = "--local: dsagent --fake-gpus SPEC for every agent (e.g. 2xH100-80GB)"},
	{.name = NULL},
};
static const cfg_opt cluster_down_flags[] = {
	{.name = "local", .type = CFG_BOOL, .offset = F(local), .def = "false", .min = 1,
	 .max = 0, .help = "stop the agents of `cluster up --local` instead (SIGTERM, then SIGKILL)"},
	{.name = "local-dir", .type = CFG_STR, .offset = F(local_dir), .def = NULL, .min = 1,
	 .max = 0, .help = "--local: the cluster's directory (default " LOCAL_DIR ")"},
	{.name = NULL},
};
static const cfg_opt no_flags[] = {{0}};

static const char *progname = "dsctl"; /* argv[0], for command lines dsctl prints */

typedef int (*cmd_fn)(const struct ctl_opts *o, const struct cmd_flags *fl, int argc,
		      char **argv);

/* ---- talking to the agent ---- */

/* Where the admin token came from, for messages. */
struct token {
	char text[TOKEN_MAX];
	char source[1100];
};

static int read_token_file(const char *path, struct token *t)
{
	size_t n = 0;
	ds_err err = {0};
	if (ds_file_read_small(path, 0, t->text, sizeof t->text - 1, &n, &err) != DS_OK) {
		fprintf(stderr,
			"dsctl: cannot read the admin token from %s: %s (pass --token-file FILE, "
			"set $DSCTL_TOKEN, or --data-dir DIR of the agent; the agent of `make up` "
			"keeps its data in run/data: dsctl --data-dir run/data ...)\n",
			path, err.msg);
		return 1;
	}
	t->text[n] = '\0';
	snprintf(t->source, sizeof t->source, "%s", path);
	return 0;
}

/* Trims t->text in place; 1 (after a message) when nothing is left. */
static int trim_token(struct token *t)
{
	char *s = t->text;
	while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')
		s++;
	size_t n = strlen(s);
	while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\n' || s[n - 1] == '\r'))
		n--;
	memmove(t->text, s, n);
	t->text[n] = '\0';
	if (!n || strpbrk(t->text, " \t\r\n")) {
		fprintf(stderr, "dsctl: the admin token from %s is %s\n", t->source,
			n ? "not one word" : "empty");
		return 1;
	}
	return 0;
}

static int load_token(const struct ctl_opts *o, struct token *t)
{
	const char *env = getenv("DSCTL_TOKEN");
	int rc;
	if (o->token_file) {
		rc = read_token_file(o->token_file, t);
	} else if (env && *env) {
		snprintf(t->text, sizeof t->text, "%s", env);
		snprintf(t->source, sizeof t->source, "$DSCTL_TOKEN");
		rc = 0;
	} else {
		char path[1100];
		snprintf(path, sizeof path, "%s/admin.token", o->data_dir);
		rc = read_token_file(path, t);
	}
	return rc ? rc : trim_token(t);
}

static const char *str_or(const json_t *v, const char *dflt)
{
	return json_is_string(v) ? json_string_value(v) : dflt;
}

static const char *error_message(const json_t *v, const buf *body)
{
	json_t *m = v ? json_object_get(json_object_get(v, "error"), "message") : NULL;
	return json_is_string(m) ? json_string_value(m) : (body->data ? body->data : "");
}

/* One request (with the admin token when admin); returns the parsed body of
 * a 2xx answer, or NULL after printing why: agent unreachable (its URL), 401
 * (where the token was read from), any other status with the agent's
 * message. */
static json_t *call(const struct ctl_opts *o, const char *method, const char *path,
		    const json_t *req, int admin)
{
	struct token tok;
	ctl_client c = {.base_url = o->agent, .timeout_ms = o->timeout_ms};
	buf body;
	ds_err err = {0};
	json_t *v = NULL;
	char *text = NULL;
	long status = 0;
	if (admin) {
		if (load_token(o, &tok))
			return NULL;
		c.token = tok.text;
	}
	if (req && !(text = json_dumps(req, JSON_COMPACT))) {
		fprintf(stderr, "dsctl: out of memory\n");
		return NULL;
	}
	buf_init(&body, 16 << 20);
	if (ctl_request(&c, method, path, text, &status, &body, &err) != DS_OK) {
		fprintf(stderr, "dsctl: %s\n", err.msg);
		goto out;
	}
	v = jsonx_parse(body.data ? body.data : "", body.len, 64, &err);
	if (status == 401 && admin) {
		fprintf(stderr, "dsctl: the agent at %s rejected the admin token read from %s: %s\n",
			o->agent, tok.source, error_message(v, &body));
	} else if (status < 200 || status > 299) {
		fprintf(stderr, "dsctl: the agent answered %ld: %s\n", status,
			error_message(v, &body));
	} else if (!v) {
		fprintf(stderr, "dsctl: the agent's reply is not JSON: %s\n", err.msg);
		goto out;
	} else {
		goto out; /* success: keep v */
	}
	json_decref(v);
	v = NULL;
out:
	free(text);
	memset(&tok, 0, sizeof tok);
	buf_free(&body);
	return v;
}

/* GET path as admin and the array `field` of the reply: the reply (caller
 * frees) with *list pointing into it, or NULL after saying what is wrong. */
static json_t *call_list(const struct ctl_opts *o, const char *path, const char *field,
			 json_t **list)
{
	json_t *v = call(o, "GET", path, NULL, 1);
	if (!v)
		return NULL;
	*list = json_object_get(v, field);
	if (!json_is_array(*list)) {
		fprintf(stderr, "dsctl: the agent's reply has no \"%s\" list\n", field);
		json_decref(v);
		return NULL;
	}
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

/* ---- health, version ---- */

static int cmd_health(const struct ctl_opts *o, const struct cmd_flags *fl, int argc,
		      char **argv)
{
	json_t *v = call(o, "GET", "/health", NULL, 0);
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

static int cmd_version(const struct ctl_opts *o, const struct cmd_flags *fl, int argc,
		       char **argv)
{
	json_t *v = call(o, "GET", "/v1/version", NULL, 0);
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

/* ---- keys ---- */

static int cmd_keys_create(const struct ctl_opts *o, const struct cmd_flags *fl, int argc,
			   char **argv)
{
	json_t *req = json_pack("{s:s}", "name", argv[0]);
	if (!req)
		return 1;
	if (fl->expires_days)
		json_object_set_new(req, "expires_days", json_integer(fl->expires_days));
	if (fl->rpm)
		json_object_set_new(req, "rpm", json_integer(fl->rpm));
	if (fl->tpm)
		json_object_set_new(req, "tpm", json_integer(fl->tpm));
	if (fl->max_concurrency)
		json_object_set_new(req, "max_concurrency", json_integer(fl->max_concurrency));
	json_t *v = call(o, "POST", "/v1/keys", req, 1);
	json_decref(req);
	if (!v)
		return 1;
	json_t *id = json_object_get(v, "id"), *key = json_object_get(v, "key");
	int rc = 0;
	if (!json_is_integer(id) || !json_is_string(key)) {
		fprintf(stderr, "dsctl: the agent's reply has no id or key\n");
		rc = 1;
	} else if (o->json) {
		json_t *out = json_pack("{s:O,s:O,s:O}", "id", id, "name",
					json_object_get(v, "name"), "key", key);
		rc = out ? print_json(out) : 1;
		json_decref(out);
	} else {
		printf("created key %lld '%s' (dsk-%s...); it is shown only now and cannot be "
		       "shown again, store it safely:\n%s\n",
		       (long long)json_integer_value(id),
		       json_string_value(json_object_get(v, "name")),
		       json_string_value(json_object_get(v, "prefix")), json_string_value(key));
	}
	json_decref(v);
	return rc;
}

static void fmt_time(const json_t *v, const char *none, char *out, size_t n)
{
	if (!json_is_integer(v)) {
		snprintf(out, n, "%s", none);
		return;
	}
	time_t t = (time_t)json_integer_value(v);
	struct tm tm;
	if (!gmtime_r(&t, &tm) || !strftime(out, n, "%Y-%m-%d %H:%M", &tm))
		snprintf(out, n, "%lld", (long long)t);
}

static void fmt_int(const json_t *v, const char *none, char *out, size_t n)
{
	if (json_is_integer(v))
		snprintf(out, n, "%lld", (long long)json_integer_value(v));
	else
		snprintf(out, n, "%s", none);
}

enum { NCOL = 13, CELL = 72 };

static int cmd_keys_list(const struct ctl_opts *o, const struct cmd_flags *fl, int argc,
			 char **argv)
{
	json_t *data;
	json_t *v = call_list(o, "/v1/keys", "data", &data);
	if (!v)
		return 1;
	if (o->json) {
		json_t *out = json_pack("{s:O}", "data", data);
		int rc = out ? print_json(out) : 1;
		json_decref(out);
		json_decref(v);
		return rc;
	}
	static const char *head[NCOL] = {"ID",	     "NAME",	 "PREFIX",     "CREATED (UTC)",
					 "LAST USED", "REQUESTS", "PROMPT TOK", "COMPL TOK",
					 "RPM",	     "TPM",	 "CONC",       "EXPIRES",
					 "REVOKED"};
	size_t rows = json_array_size(data);
	char(*cells)[NCOL][CELL] = calloc(rows + 1, sizeof *cells);
	if (!cells) {
		json_decref(v);
		return 1;
	}
	for (int c = 0; c < NCOL; c++)
		snprintf(cells[0][c], CELL, "%s", head[c]);
	for (size_t r = 0; r < rows; r++) {
		json_t *k = json_array_get(data, r);
		char(*row)[CELL] = cells[r + 1];
		fmt_int(json_object_get(k, "id"), "?", row[0], CELL);
		snprintf(row[1], CELL, "%s", str_or(json_object_get(k, "name"), "?"));
		snprintf(row[2], CELL, "dsk-%s",
			 str_or(json_object_get(k, "prefix"), "?"));
		fmt_time(json_object_get(k, "created"), "?", row[3], CELL);
		fmt_time(json_object_get(k, "last_used"), "never", row[4], CELL);
		fmt_int(json_object_get(k, "requests"), "0", row[5], CELL);
		fmt_int(json_object_get(k, "prompt_tokens"), "0", row[6], CELL);
		fmt_int(json_object_get(k, "completion_tokens"), "0", row[7], CELL);
		fmt_int(json_object_get(k, "rpm"), "-", row[8], CELL);
		fmt_int(json_object_get(k, "tpm"), "-", row[9], CELL);
		fmt_int(json_object_get(k, "max_concurrency"), "-", row[10], CELL);
		fmt_time(json_object_get(k, "expires"), "never", row[11], CELL);
		fmt_time(json_object_get(k, "revoked_at"), "no", row[12], CELL);
	}
	int w[NCOL] = {0};
	for (size_t r = 0; r <= rows; r++)
		for (int c = 0; c < NCOL; c++) {
			int l = (int)strlen(cells[r][c]);
			w[c] = l > w[c] ? l : w[c];
		}
	for (size_t r = 0; r <= rows; r++) {
		for (int c = 0; c < NCOL; c++)
			printf(c + 1 < NCOL ? "%-*s  " : "%-*s\n", c + 1 < NCOL ? w[c] : 0,
			       cells[r][c]);
	}
	if (rows == 0)
		printf("(no keys: create one with `dsctl keys create NAME`)\n");
	free(cells);
	json_decref(v);
	return 0;
}

static int cmd_keys_revoke(const struct ctl_opts *o, const struct cmd_flags *fl, int argc,
			   char **argv)
{
	int64_t id;
	if (ds_parse_i64(argv[0], 1, INT64_MAX, &id) != DS_OK) {
		fprintf(stderr, "dsctl: '%s' is not a key id (see `dsctl keys list`)\n", argv[0]);
		return 2;
	}
	char path[64];
	snprintf(path, sizeof path, "/v1/keys/%lld", (long long)id);
	json_t *v = call(o, "DELETE", path, NULL, 1);
	if (!v)
		return 1;
	int rc = 0;
	if (o->json)
		rc = print_json(v);
	else
		printf("revoked key %lld '%s' (dsk-%s...)\n", (long long)id,
		       str_or(json_object_get(v, "name"), "?"),
		       str_or(json_object_get(v, "prefix"), "?"));
	json_decref(v);
	return rc;
}

/* ---- cluster ---- */

static void key_file_exists(const char *path)
{
	fprintf(stderr,
		"dsctl: %s exists; pass --force to replace it (the cluster then needs the new key "
		"on every node)\n",
		path);
}

static int cmd_cluster_init(const struct ctl_opts *o, const struct cmd_flags *fl, int argc,
			    char **argv)
{
	const char *path = fl->key_file;
	uint8_t kid = 0;
	ds_err err = {0};
	int rc = keyfile_write(path, fl->force ? KEYFILE_FORCE : 0, &kid, &err);
	if (rc == DS_EBUSY) {
		key_file_exists(path);
		return 1;
	}
	if (rc != DS_OK) {
		fprintf(stderr, "dsctl: cannot write %s: %s\n", path, err.msg);
		return 1;
	}
	if (o->json) {
		json_t *out = json_pack("{s:s,s:i}", "key_file", path, "key_id", (int)kid);
		rc = out ? print_json(out) : 1;
		json_decref(out);
		return rc;
	}
	printf("wrote a new cluster key to %s (mode 0600, key id %02x).\n"
	       "Place the same file on every node, readable only by the agent's user:\n"
	       "  scp -p %s NODE:%s && ssh NODE chmod 600 %s\n"
	       "then start every agent with it, the others joining the first one:\n"
	       "  dsagent --cluster-key %s                      # first node\n"
	       "  dsagent --cluster-key %s --join FIRST:7946    # every other node\n"
	       "Keep it secret: whoever holds it can join and speak for the cluster.\n",
	       path, kid, path, path, path, path, path);
	return 0;
}

static int cmd_cluster_members(const struct ctl_opts *o, const struct cmd_flags *fl, int argc,
			       char **argv)
{
	json_t *ms;
	json_t *v = call_list(o, "/v1/cluster/members", "members", &ms);
	if (!v)
		return 1;
	if (o->json) {
		int rc = print_json(v);
		json_decref(v);
		return rc;
	}
	printf("%-20s  %-32s  %-21s  %-7s  %11s  %s\n", "NAME", "ID", "ADDRESS", "STATE",
	       "INCARNATION", "SINCE (UTC)");
	for (size_t i = 0; i < json_array_size(ms); i++) {
		json_t *m = json_array_get(ms, i);
		char since[32], inc[32];
		json_t *ch = json_object_get(m, "changed");
		json_t *t = json_integer(json_is_number(ch) ? (json_int_t)json_number_value(ch) : 0);
		fmt_time(t, "?", since, sizeof since);
		json_decref(t);
		fmt_int(json_object_get(m, "incarnation"), "?", inc, sizeof inc);
		printf("%-20s  %-32s  %-21s  %-7s  %11s  %s%s\n",
		       str_or(json_object_get(m, "name"), "?"), str_or(json_object_get(m, "id"), "?"),
		       str_or(json_object_get(m, "addr"), "?"),
		       str_or(json_object_get(m, "state"), "?"), inc, since,
		       json_is_true(json_object_get(m, "self")) ? "  (this agent)" : "");
	}
	json_decref(v);
	return 0;
}

/* ---- nodes and cluster status ---- */

/* "now", "12s ago", "5m ago", or the UTC time for older. */
static void fmt_ago(const json_t *v, char *out, size_t n)
{
	if (!json_is_integer(v)) {
		snprintf(out, n, "-");
		return;
	}
	long long d = (long long)time(NULL) - (long long)json_integer_value(v);
	if (d < 2)
		snprintf(out, n, "now");
	else if (d < 120)
		snprintf(out, n, "%llds ago", d);
	else if (d < 7200)
		snprintf(out, n, "%lldm ago", d / 60);
	else
		fmt_time(v, "-", out, n);
}

static void fmt_gib(long long bytes, char *out, size_t n)
{
	snprintf(out, n, "%.1f", (double)bytes / (double)(1LL << 30));
}

static void fmt_rate(double g, char *out, size_t n)
{
	if (g == (double)(long long)g)
		snprintf(out, n, "%lldG", (long long)g);
	else
		snprintf(out, n, "%.1fG", g);
}

/* Prints rows[0..nrows] (row 0 = the header) as aligned columns. */
static void print_table(char (*cells)[16][CELL], size_t nrows, int ncol)
{
	int w[16] = {0};
	for (size_t r = 0; r < nrows; r++)
		for (int c = 0; c < ncol; c++) {
			int l = (int)strlen(cells[r][c]);
			w[c] = l > w[c] ? l : w[c];
		}
	for (size_t r = 0; r < nrows; r++)
		for (int c = 0; c < ncol; c++)
			printf(c + 1 < ncol ? "%-*s  " : "%-*s\n", c + 1 < ncol ? w[c] : 0, cells[r][c]);
}

/* The one-line columns of a node (GET /v1/cluster/nodes "nodes" entry). */
static void node_row(const json_t *n, char (*row)[CELL])
{
	const json_t *s = json_object_get(n, "summary");
	long long v = 0, w = 0;
	char a[40], b[40];
	snprintf(row[0], CELL, "%s%s", jsonx_str_or(n, "name", "?"),
		 json_is_true(json_object_get(n, "self")) ? "*" : "");
	snprintf(row[1], CELL, "%s", jsonx_str_or(n, "addr", "-"));
	snprintf(row[2], CELL, "%s", jsonx_str_or(n, "status", "?"));
	snprintf(row[3], CELL, "%s", jsonx_str_or(n, "role", "-"));
	if (!json_is_object(s)) {
		for (int c = 4; c < 9; c++)
			snprintf(row[c], CELL, "?");
	} else {
		if (jsonx_int_at(s, "gpus", &v) && v > 0)
			snprintf(row[4], CELL, "%lld", v);
		else
			snprintf(row[4], CELL, "0 (%s)", jsonx_str_or(s, "compute", "cpu"));
		if (jsonx_int_at(s, "gpu_memory_total_bytes", &w)) {
			fmt_gib(w, b, sizeof b);
			if (jsonx_int_at(s, "gpu_memory_used_bytes", &v))
				fmt_gib(v, a, sizeof a);
			else
				snprintf(a, sizeof a, "?");
			snprintf(row[5], CELL, "%s/%s", a, b);
		} else {
			snprintf(row[5], CELL, "-");
		}
		if (jsonx_int_at(s, "max_temperature_c", &v))
			snprintf(row[6], CELL, "%lldC", v);
		else
			snprintf(row[6], CELL, "-");
		int hv = jsonx_int_at(s, "ecc_uncorrected_volatile", &v), ha = jsonx_int_at(s, "ecc_uncorrected_aggregate", &w);
		if (hv || ha)
			snprintf(row[7], CELL, "%s/%s", hv ? (snprintf(a, sizeof a, "%lld", v), a) : "?",
				 ha ? (snprintf(b, sizeof b, "%lld", w), b) : "?");
		else
			snprintf(row[7], CELL, "-");
		v = w = 0;
		jsonx_int_at(s, "ib_ports_up", &v);
		jsonx_int_at(s, "ib_ports_total", &w);
		const json_t *lo = json_object_get(s, "ib_rate_gbps_min");
		const json_t *hi = json_object_get(s, "ib_rate_gbps_max");
		if (json_is_number(lo) && json_is_number(hi)) {
			fmt_rate(json_number_value(lo), a, sizeof a);
			fmt_rate(json_number_value(hi), b, sizeof b);
			if (strcmp(a, b) == 0)
				snprintf(row[8], CELL, "%lld/%lld @%s", v, w, a);
			else
				snprintf(row[8], CELL, "%lld/%lld @%s-%s", v, w, a, b);
		} else {
			snprintf(row[8], CELL, "%lld/%lld", v, w);
		}
	}
	fmt_ago(json_object_get(n, "last_seen"), row[9], CELL);
	/* the deployment's ranks on this node (the head adds them): R:state ... */
	const json_t *ranks = json_object_get(n, "ranks");
	size_t i, used = 0;
	const json_t *k;
	snprintf(row[10], CELL, "-");
	json_array_foreach(ranks, i, k) {
		long long r = -1;
		jsonx_int_at(k, "rank", &r);
		int wr = snprintf(row[10] + used, CELL - used, "%s%lld:%s", i ? " " : "", r,
				 jsonx_str_or(k, "state", "?"));
		if (wr < 0 || (size_t)wr >= CELL - used) {
			snprintf(row[10] + (CELL > 4 ? CELL - 4 : 0), 4, "...");
			break;
		}
		used += (size_t)wr;
	}
}

/* Says where the answer came from when it is not the head's record. */
static void print_source(const json_t *v)
{
	const json_t *head = json_object_get(v, "head");
	long long ep = 0;
	jsonx_int_at(v, "epoch", &ep);
	if (json_is_true(json_object_get(v, "stale")))
		fprintf(stderr,
			"dsctl: warning: %s answered from its own view (%s); other nodes' "
			"inventories are not shown\n",
			jsonx_str_or(v, "answered_by", "the agent"), jsonx_str_or(v, "reason", "no head"));
	else if (json_is_object(head))
		printf("head: %s (epoch %lld)\n", jsonx_str_or(head, "name", jsonx_str_or(head, "id", "?")), ep);
}

static const json_t *find_node(const json_t *nodes, const char *name)
{
	const json_t *hit = NULL;
	for (size_t i = 0; i < json_array_size(nodes); i++) {
		const json_t *n = json_array_get(nodes, i);
		if (strcmp(jsonx_str_or(n, "name", ""), name) == 0 || strcmp(jsonx_str_or(n, "id", ""), name) == 0)
			return n;
		if (strlen(name) >= 4 && strncmp(jsonx_str_or(n, "id", ""), name, strlen(name)) == 0)
			hit = n; /* an id prefix */
	}
	return hit;
}

static void print_node_detail(const json_t *n)
{
	const json_t *inv = json_object_get(n, "inventory");
	const json_t *host = json_object_get(inv, "host");
	const json_t *comp = json_object_get(inv, "compute");
	const json_t *src = json_object_get(inv, "gpu_source");
	char t1[64], t2[64];
	long long v = 0;
	printf("node %s  (id %s%s)\n", jsonx_str_or(n, "name", "?"), jsonx_str_or(n, "id", "?"),
	       json_is_true(json_object_get(n, "self")) ? ", the agent asked" : "");
	printf("  address     %s  control port %s  api port %s\n", jsonx_str_or(n, "addr", "-"),
	       jsonx_int_at(n, "control_port", &v) ? (snprintf(t1, sizeof t1, "%lld", v), t1) : "-",
	       jsonx_int_at(n, "api_port", &v) ? (snprintf(t2, sizeof t2, "%lld", v), t2) : "-");
	jsonx_int_at(n, "epoch", &v);
	fmt_ago(json_object_get(n, "last_seen"), t1, sizeof t1);
	printf("  status      %s  role %s  epoch %lld  last seen %s\n", jsonx_str_or(n, "status", "?"),
	       jsonx_str_or(n, "role", "-"), v, t1);
	fmt_time(json_object_get(n, "inventory_at"), "-", t1, sizeof t1);
	fmt_time(json_object_get(n, "health_at"), "-", t2, sizeof t2);
	printf("  inventory   %s UTC (health %s UTC), digest %.16s...\n", t1, t2,
	       jsonx_str_or(n, "digest", "-"));
	if (!json_is_object(inv)) {
		printf("  (no inventory: the head has not fetched it yet, or this answer is stale)\n");
		return;
	}
	long long cpus = 0, sockets = 0, mem = 0, ranks = 0;
	jsonx_int_at(host, "cpus", &cpus);
	jsonx_int_at(host, "sockets", &sockets);
	jsonx_int_at(host, "memory_bytes", &mem);
	jsonx_int_at(comp, "ranks", &ranks);
	fmt_gib(mem, t1, sizeof t1);
	printf("  host        %s: %s, %lld CPUs, %lld sockets, %s GiB, %zu NUMA nodes\n",
	       jsonx_str_or(host, "hostname", "?"), jsonx_str_or(host, "cpu_model", "?"), cpus, sockets, t1,
	       json_array_size(json_object_get(host, "numa_nodes")));
	printf("  compute     %s, %lld ranks; GPUs from %s%s%s%s%s\n", jsonx_str_or(comp, "kind", "?"), ranks,
	       jsonx_str_or(src, "kind", "?"), json_is_string(json_object_get(src, "spec")) ? " " : "",
	       jsonx_str_or(src, "spec", ""), json_is_string(json_object_get(src, "driver_version")) ?
	       ", driver " : "", jsonx_str_or(src, "driver_version", ""));
	const json_t *gpus = json_object_get(inv, "gpus");
	if (json_array_size(gpus)) {
		printf("\n  %-4s %-24s %-13s %-4s %-15s %-5s %-8s %-7s %s\n", "GPU", "NAME", "BUS ID",
		       "NUMA", "MEM GiB", "TEMP", "POWER W", "ECC V/A", "NVLINKS");
		for (size_t i = 0; i < json_array_size(gpus); i++) {
			const json_t *g = json_array_get(gpus, i);
			const json_t *h = json_object_get(g, "health");
			long long idx = 0, numa = -1, tot = 0, used = 0, temp = 0, pw = 0, ev = 0, ea = 0,
				  nl = 0;
			char mm[48], tt[16], pp[16], ee[48], nn[16];
			jsonx_int_at(g, "index", &idx);
			int hn = jsonx_int_at(g, "numa_node", &numa);
			int ht = jsonx_int_at(g, "memory_total_bytes", &tot), hu = jsonx_int_at(h, "memory_used_bytes", &used);
			fmt_gib(used, t1, sizeof t1);
			fmt_gib(tot, t2, sizeof t2);
			snprintf(mm, sizeof mm, "%s/%s", hu ? t1 : "?", ht ? t2 : "?");
			int has_t = jsonx_int_at(h, "temperature_c", &temp), has_p = jsonx_int_at(h, "power_mw", &pw);
			snprintf(tt, sizeof tt, has_t ? "%lldC" : "-", temp);
			snprintf(pp, sizeof pp, has_p ? "%lld" : "-", pw / 1000);
			int a1 = jsonx_int_at(h, "ecc_uncorrected_volatile", &ev);
			int a2 = jsonx_int_at(h, "ecc_uncorrected_aggregate", &ea);
			snprintf(ee, sizeof ee, "%s/%s", a1 ? (snprintf(t1, sizeof t1, "%lld", ev), t1) : "-",
				 a2 ? (snprintf(t2, sizeof t2, "%lld", ea), t2) : "-");
			jsonx_int_at(g, "nvlinks", &nl);
			snprintf(nn, sizeof nn, "%lld%s", nl,
				 json_is_true(json_object_get(g, "nvswitch")) ? " (NVSwitch)" : "");
			char numa_s[16];
			snprintf(numa_s, sizeof numa_s, hn ? "%lld" : "-", numa);
			printf("  %-4lld %-24.24s %-13s %-4s %-15s %-5s %-8s %-7s %s\n", idx,
			       jsonx_str_or(g, "name", "?"), jsonx_str_or(g, "bus_id", "?"), numa_s, mm, tt, pp, ee, nn);
		}
	}
	/* nvidia-smi topo -m style: GPU rows, GPU and RDMA device columns */
	const json_t *links = json_object_get(inv, "gpu_links");
	const json_t *gn = json_object_get(inv, "gpu_nic");
	size_t ng = json_array_size(gpus);
	if (ng > 1 || json_array_size(gn)) {
		const char *nics[64];
		size_t nn = 0;
		for (size_t i = 0; i < json_array_size(gn) && nn < 64; i++) {
			const char *nic = jsonx_str_or(json_array_get(gn, i), "nic", "?");
			size_t k = 0;
			while (k < nn && strcmp(nics[k], nic) != 0)
				k++;
			if (k == nn)
				nics[nn++] = nic;
		}
		printf("\n  topology  ");
		for (size_t b = 0; b < ng && b < 64; b++)
			printf("GPU%-4zu", b);
		for (size_t k = 0; k < nn; k++)
			printf("%-8s", nics[k]);
		printf("\n");
		for (size_t a = 0; a < ng && a < 64; a++) {
			printf("  GPU%-6zu", a);
			for (size_t b = 0; b < ng && b < 64; b++) {
				const char *lv = a == b ? "X" : "?";
				for (size_t i = 0; i < json_array_size(links); i++) {
					const json_t *l = json_array_get(links, i);
					long long la = -1, lb = -1;
					jsonx_int_at(l, "a", &la);
					jsonx_int_at(l, "b", &lb);
					if ((la == (long long)a && lb == (long long)b) ||
					    (la == (long long)b && lb == (long long)a))
						lv = jsonx_str_or(l, "level", "?");
				}
				printf("%-7s", lv);
			}
			for (size_t k = 0; k < nn; k++) {
				const char *lv = "?";
				for (size_t i = 0; i < json_array_size(gn); i++) {
					const json_t *e = json_array_get(gn, i);
					long long g = -1;
					jsonx_int_at(e, "gpu", &g);
					if (g == (long long)a && strcmp(jsonx_str_or(e, "nic", ""), nics[k]) == 0)
						lv = jsonx_str_or(e, "level", "?");
				}
				printf("%-8s", lv);
			}
			printf("\n");
		}
	}
	const json_t *ports = json_object_get(inv, "ib_ports");
	if (json_array_size(ports)) {
		printf("\n  %-10s %-4s %-10s %-8s %-8s %-11s %-8s %-4s %s\n", "DEVICE", "PORT", "LINK",
		       "STATE", "PHYS", "RATE", "NETDEV", "GID", "USABLE");
		for (size_t i = 0; i < json_array_size(ports); i++) {
			const json_t *p = json_array_get(ports, i);
			long long port = 0, gid = 0;
			const json_t *r = json_object_get(p, "rate_gbps");
			char rate[32] = "-", gs[16] = "-";
			jsonx_int_at(p, "port", &port);
			if (json_is_number(r)) {
				fmt_rate(json_number_value(r), t1, sizeof t1);
				snprintf(rate, sizeof rate, "%s %s", t1, jsonx_str_or(p, "speed", ""));
			}
			if (jsonx_int_at(p, "gid_index", &gid))
				snprintf(gs, sizeof gs, "%lld", gid);
			printf("  %-10s %-4lld %-10s %-8s %-8s %-11s %-8s %-4s %s\n",
			       jsonx_str_or(p, "device", "?"), port, jsonx_str_or(p, "link_layer", "?"),
			       jsonx_str_or(p, "state", "?"), jsonx_str_or(p, "phys_state", "?"), rate,
			       jsonx_str_or(p, "netdev", "-"), gs,
			       json_is_true(json_object_get(p, "usable")) ? "yes" : "no");
		}
	}
	const json_t *nicl = json_object_get(inv, "nics");
	if (json_array_size(nicl)) {
		printf("\n  NICs\n");
		for (size_t i = 0; i < json_array_size(nicl); i++) {
			const json_t *x = json_array_get(nicl, i);
			printf("  %-10s", jsonx_str_or(x, "name", "?"));
			const char *fam[2] = {"ipv4", "ipv6"};
			for (int f = 0; f < 2; f++) {
				const json_t *a = json_object_get(x, fam[f]);
				for (size_t k = 0; k < json_array_size(a); k++)
					printf(" %s", str_or(json_array_get(a, k), "?"));
			}
			printf("\n");
		}
	}
	const json_t *notes = json_object_get(inv, "notes");
	if (json_array_size(notes)) {
		printf("\n  notes\n");
		for (size_t i = 0; i < json_array_size(notes); i++) {
			const json_t *x = json_array_get(notes, i);
			printf("  %-10s %s\n", jsonx_str_or(x, "source", "?"), jsonx_str_or(x, "message", "?"));
		}
	}
}

static int cmd_nodes(const struct ctl_opts *o, const struct cmd_flags *fl, int argc, char **argv)
{
	json_t *nodes;
	json_t *v = call_list(o, "/v1/cluster/nodes", "nodes", &nodes);
	if (!v)
		return 1;
	int rc = 0;
	if (argc == 1) {
		const json_t *n = find_node(nodes, argv[0]);
		if (!n) {
			fprintf(stderr, "dsctl: no node named '%s' (see `dsctl nodes`)\n", argv[0]);
			rc = 1;
		} else if (o->json) {
			rc = print_json(n);
		} else {
			print_source(v);
			print_node_detail(n);
		}
		json_decref(v);
		return rc;
	}
	if (o->json) {
		rc = print_json(v);
		json_decref(v);
		return rc;
	}
	enum { NC = 11 };
	static const char *head[NC] = {"NAME", "ADDRESS", "STATUS", "ROLE", "GPUS",
				      "GPU MEM GiB", "MAX TEMP", "ECC V/A", "IB UP/TOTAL", "LAST SEEN",
				      "RANKS"};
	size_t rows = json_array_size(nodes);
	char(*cells)[16][CELL] = calloc(rows + 1, sizeof *cells);
	if (!cells) {
		json_decref(v);
		return 1;
	}
	for (int c = 0; c < NC; c++)
		snprintf(cells[0][c], CELL, "%s", head[c]);
	for (size_t r = 0; r < rows; r++)
		node_row(json_array_get(nodes, r), cells[r + 1]);
	print_source(v);
	print_table(cells, rows + 1, NC);
	printf("(* = the agent asked; `dsctl nodes NAME` for one node in full)\n");
	free(cells);
	json_decref(v);
	return 0;
}

/* ---- the shard plan ---- */

/* One rank row of GET /v1/cluster/plan as table cells. */
static void plan_rank_row(const json_t *k, char (*row)[CELL])
{
	long long v[8] = {0}, w = -1, kv = -1;
	static const char *const f[8] = {"rank", "device", "stage", "tp_rank", "ep_rank",
					  "layer_first", "layer_count", "expert_first"};
	for (int i = 0; i < 8; i++)
		jsonx_int_at(k, f[i], &v[i]);
	long long ec = 0;
	jsonx_int_at(k, "expert_count", &ec);
	jsonx_int_at(k, "weight_bytes", &w);
	jsonx_int_at(k, "kv_bytes", &kv);
	snprintf(row[0], CELL, "%lld", v[0]);
	snprintf(row[1], CELL, "%s", jsonx_str_or(k, "node_name", jsonx_str_or(k, "node_id", "?")));
	if (v[1] < 0)
		snprintf(row[2], CELL, "cpu");
	else
		snprintf(row[2], CELL, "gpu%lld", v[1]);
	snprintf(row[3], CELL, "%lld", v[2]);
	snprintf(row[4], CELL, "%lld", v[3]);
	snprintf(row[5], CELL, "%lld", v[4]);
	snprintf(row[6], CELL, "%lld-%lld", v[5], v[5] + v[6] - 1);
	if (ec > 0)
		snprintf(row[7], CELL, "%lld-%lld", v[7], v[7] + ec - 1);
	else
		snprintf(row[7], CELL, "-");
	if (w >= 0)
		fmt_gib(w, row[8], CELL);
	else
		snprintf(row[8], CELL, "-");
	if (kv >= 0)
		fmt_gib(kv, row[9], CELL);
	else
		snprintf(row[9], CELL, "-");
}

/* The planner's memory figures of rank r (the plan's document): reserve
 * (workspace) and what is left free, in GiB, or "-". */
static void plan_rank_memory(const json_t *doc, long long r, char (*row)[CELL])
{
	const json_t *m = json_object_get(json_array_get(json_object_get(doc, "ranks"), (size_t)r),
					  "memory");
	long long v = 0;
	if (jsonx_int_at(m, "reserve", &v))
		fmt_gib(v, row[10], CELL);
	else
		snprintf(row[10], CELL, "-");
	if (jsonx_int_at(m, "free", &v))
		fmt_gib(v, row[11], CELL);
	else
		snprintf(row[11], CELL, "-");
}

/* Why this plan: its estimated cost per decode token and the layouts the
 * planner rejected with theirs. */
static void print_plan_cost(const json_t *doc)
{
	const json_t *c = json_object_get(doc, "cost");
	if (!json_is_object(c))
		return;
	printf("\n  why: %.3f ms per decode token (weight reads %.3f ms, collectives %.3f ms)\n",
	       1e3 * json_number_value(json_object_get(c, "seconds_per_token")),
	       1e3 * json_number_value(json_object_get(c, "read_s")),
	       1e3 * json_number_value(json_object_get(c, "comm_s")));
	printf("  cost model: %s\n", jsonx_str_or(c, "model", "?"));
	const json_t *rej = json_object_get(c, "rejected");
	if (json_array_size(rej))
		printf("  rejected:\n");
	for (size_t i = 0; i < json_array_size(rej); i++) {
		const json_t *x = json_array_get(rej, i);
		long long t = 0, p = 0, e = 0;
		jsonx_int_at(x, "tp", &t);
		jsonx_int_at(x, "pp", &p);
		jsonx_int_at(x, "ep", &e);
		printf("    tp %lld x pp %lld x ep %lld: %.3f ms per token, %s\n", t, p, e,
		       1e3 * json_number_value(json_object_get(x, "seconds_per_token")),
		       jsonx_str_or(x, "reason", "?"));
	}
}

/* The environment of each node: that of its first rank (a node's ranks
 * share the fabric variables; per-rank ones show in --json). */
static void print_plan_env(const json_t *ranks)
{
	for (size_t i = 0; i < json_array_size(ranks); i++) {
		const json_t *k = json_array_get(ranks, i);
		const char *node = jsonx_str_or(k, "node_id", "?");
		int seen = 0;
		for (size_t j = 0; j < i && !seen; j++)
			seen = strcmp(jsonx_str_or(json_array_get(ranks, j), "node_id", ""), node) == 0;
		const json_t *env = json_object_get(k, "env");
		if (seen || !json_is_object(env))
			continue;
		printf("\n  environment of %s (rank %lld)\n", jsonx_str_or(k, "node_name", node),
		       (long long)json_integer_value(json_object_get(k, "rank")));
		const char *name;
		const json_t *val;
		json_object_foreach((json_t *)env, name, val)
		{
			printf("    %s=%s\n", name, json_is_string(val) ? json_string_value(val) : "?");
		}
	}
}

static int cmd_plan_show(const struct ctl_opts *o, const struct cmd_flags *fl, int argc,
			 char **argv)
{
	json_t *v = call(o, "GET", "/v1/cluster/plan", NULL, 1);
	if (!v)
		return 1;
	if (o->json) {
		int rc = print_json(v);
		json_decref(v);
		return rc;
	}
	long long ver = 0, ep = 0, tp = 0, pp = 0, epn = 0, W = 0, ctx = -1, seqs = -1;
	jsonx_int_at(v, "version", &ver);
	jsonx_int_at(v, "epoch", &ep);
	jsonx_int_at(v, "tp", &tp);
	jsonx_int_at(v, "pp", &pp);
	jsonx_int_at(v, "ep", &epn);
	jsonx_int_at(v, "world_size", &W);
	jsonx_int_at(v, "max_ctx", &ctx);
	jsonx_int_at(v, "max_seqs", &seqs);
	char since[64];
	fmt_ago(json_object_get(v, "status_at"), since, sizeof since);
	printf("plan v%lld (epoch %lld): %s since %s%s%s\n", ver, ep, jsonx_str_or(v, "status", "?"), since,
	       json_is_string(json_object_get(v, "reason")) ? ": " : "", jsonx_str_or(v, "reason", ""));
	printf("model:   %s\n", jsonx_str_or(v, "model", "?"));
	printf("ranks:   tp %lld x pp %lld x ep %lld = %lld\n", tp, pp, epn, W);
	if (ctx >= 0 && seqs >= 0)
		printf("kv:      max context %lld, %lld sequences of it at once\n", ctx, seqs);
	else if (ctx >= 0)
		printf("kv:      max context %lld\n", ctx);
	const json_t *ranks = json_object_get(v, "ranks"), *doc = json_object_get(v, "document");
	enum { NC = 12 };
	static const char *head[NC] = {"RANK", "NODE", "DEVICE", "STAGE", "TP", "EP",
				      "LAYERS", "EXPERTS", "WEIGHTS GiB", "KV GiB", "RESERVE GiB",
				      "FREE GiB"};
	size_t rows = json_array_size(ranks);
	char(*cells)[16][CELL] = calloc(rows + 1, sizeof *cells);
	if (!cells) {
		json_decref(v);
		return 1;
	}
	for (int c = 0; c < NC; c++)
		snprintf(cells[0][c], CELL, "%s", head[c]);
	for (size_t r = 0; r < rows; r++) {
		plan_rank_row(json_array_get(ranks, r), cells[r + 1]);
		plan_rank_memory(doc, (long long)r, cells[r + 1]);
	}
	printf("\n");
	print_table(cells, rows + 1, NC);
	free(cells);
	print_plan_cost(doc);
	const json_t *groups = json_object_get(v, "comm_groups");
	if (json_array_size(groups))
		printf("\n  comm groups\n");
	for (size_t i = 0; i < json_array_size(groups); i++) {
		const json_t *g = json_array_get(groups, i);
		char *r = json_dumps(json_object_get(g, "ranks"), JSON_COMPACT);
		printf("    %-12s %s\n", jsonx_str_or(g, "name", "?"), r ? r : "?");
		free(r);
	}
	print_plan_env(ranks);
	printf("\n(`dsctl plan show --json` for the whole plan, the planner's document included)\n");
	json_decref(v);
	return 0;
}

static int cmd_cluster_status(const struct ctl_opts *o, const struct cmd_flags *fl, int argc,
			      char **argv)
{
	json_t *v = call(o, "GET", "/v1/cluster/state", NULL, 1);
	if (!v)
		return 1;
	if (o->json) {
		int rc = print_json(v);
		json_decref(v);
		return rc;
	}
	const json_t *self = json_object_get(v, "self");
	const json_t *head = json_object_get(v, "head");
	long long ep = 0, hep = 0, lease = 0, expect = 0, quorum = 0, alive = 0, known = 0;
	jsonx_int_at(v, "epoch", &ep);
	jsonx_int_at(v, "head_epoch", &hep);
	jsonx_int_at(v, "lease_left_ms", &lease);
	jsonx_int_at(v, "expect", &expect);
	jsonx_int_at(v, "quorum", &quorum);
	jsonx_int_at(v, "alive", &alive);
	jsonx_int_at(v, "known", &known);
	printf("agent:   %s (%s), %s, epoch %lld%s\n", jsonx_str_or(self, "name", "?"), jsonx_str_or(self, "id", "?"),
	       jsonx_str_or(v, "role", "?"), ep,
	       json_is_true(json_object_get(v, "single")) ? " (single node: no --cluster-key)" : "");
	if (json_is_object(head)) {
		char l[48];
		if (lease < 0)
			snprintf(l, sizeof l, "no expiry");
		else
			snprintf(l, sizeof l, "lease %lld ms left here", lease);
		printf("head:    %s (epoch %lld, %s)\n", jsonx_str_or(head, "name", "?"), hep, l);
	} else {
		printf("head:    none: %s\n", jsonx_str_or(v, "why", "?"));
	}
	printf("members: %lld alive, %lld known (not left); expect %lld, quorum %lld%s\n", alive,
	       known, expect, quorum,
	       json_is_true(json_object_get(v, "formed")) ? "" : "; not formed yet");
	const json_t *ms = json_object_get(v, "members");
	size_t rows = json_array_size(ms);
	enum { NC = 8 };
	static const char *mh[NC] = {"NAME", "ID", "ADDRESS", "STATE", "ROLE", "EPOCH", "ELIGIBLE",
				     "PRIORITY"};
	char(*cells)[16][CELL] = calloc(rows + 1, sizeof *cells);
	if (cells) {
		for (int c = 0; c < NC; c++)
			snprintf(cells[0][c], CELL, "%s", mh[c]);
		for (size_t r = 0; r < rows; r++) {
			const json_t *m = json_array_get(ms, r);
			char(*row)[CELL] = cells[r + 1];
			long long e = 0, prio = 0, port = 0;
			jsonx_int_at(m, "epoch", &e);
			jsonx_int_at(m, "priority", &prio);
			snprintf(row[0], CELL, "%s%s", jsonx_str_or(m, "name", "?"),
				 json_is_true(json_object_get(m, "self")) ? "*" : "");
			snprintf(row[1], CELL, "%.12s", jsonx_str_or(m, "id", "?"));
			if (jsonx_int_at(m, "port", &port))
				snprintf(row[2], CELL, "%s:%lld", jsonx_str_or(m, "addr", "?"), port);
			else
				snprintf(row[2], CELL, "-");
			snprintf(row[3], CELL, "%s", jsonx_str_or(m, "state", "?"));
			snprintf(row[4], CELL, "%s", jsonx_str_or(m, "role", "?"));
			snprintf(row[5], CELL, "%lld", e);
			snprintf(row[6], CELL, "%s",
				 json_is_true(json_object_get(m, "eligible")) ? "yes" : "no");
			snprintf(row[7], CELL, "%lld", prio);
		}
		printf("\n");
		print_table(cells, rows + 1, NC);
		free(cells);
	}
	const json_t *hist = json_object_get(v, "elections");
	rows = json_array_size(hist);
	if (rows) {
		enum { NH = 6 };
		static const char *hh[NH] = {"EPOCH", "HEAD", "CANDIDATE", "VOTES", "OUTCOME HERE",
					     "WHEN (UTC)"};
		cells = calloc(rows + 1, sizeof *cells);
		if (cells) {
			for (int c = 0; c < NH; c++)
				snprintf(cells[0][c], CELL, "%s", hh[c]);
			for (size_t r = 0; r < rows; r++) {
				const json_t *e = json_array_get(hist, r);
				char(*row)[CELL] = cells[r + 1];
				long long x = 0, q = 0;
				jsonx_int_at(e, "epoch", &x);
				snprintf(row[0], CELL, "%lld", x);
				snprintf(row[1], CELL, "%s",
					 jsonx_str_or(e, "head_name", jsonx_str_or(e, "head", "(none)")));
				snprintf(row[2], CELL, "%s",
					 jsonx_str_or(e, "candidate_name", jsonx_str_or(e, "candidate", "-")));
				if (jsonx_int_at(e, "votes", &x) && jsonx_int_at(e, "quorum", &q))
					snprintf(row[3], CELL, "%lld of %lld", x, q);
				else
					snprintf(row[3], CELL, "-");
				snprintf(row[4], CELL, "%s", jsonx_str_or(e, "outcome", "?"));
				fmt_time(json_object_get(e, "ts"), "?", row[5], CELL);
			}
			printf("\nrecent elections (as this agent recorded them):\n");
			print_table(cells, rows + 1, NH);
			free(cells);
		}
	}
	json_decref(v);
	return 0;
}

/* ---- cluster up / down ---- */

static int bad_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int bad_usage(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "dsctl: ");
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, " (see dsctl --help)\n");
	va_end(ap);
	return 2;
}

static void print_local(const struct ctl_opts *o, const local_cluster *lc)
{
	if (o->json) {
		json_t *as = json_array();
		for (int i = 0; as && i < lc->n; i++) {
			const local_agent *a = &lc->agents[i];
			json_array_append_new(as, json_pack("{s:s,s:i,s:s,s:s,s:s,s:s}", "name",
							    a->name, "pid", a->pid, "control_url",
							    a->control_url, "api_url", a->api_url,
							    "data_dir", a->data_dir, "log", a->log));
		}
		json_t *ev = json_pack("{s:s,s:s,s:b,s:o}", "event", "local", "dir", lc->dir,
				       "reused", lc->reused, "agents", as ? as : json_array());
		char *s = ev ? json_dumps(ev, JSON_COMPACT) : NULL;
		if (s)
			printf("%s\n", s);
		free(s);
		json_decref(ev);
	} else {
		printf("%s %d local agent(s) in %s:\n", lc->reused ? "reusing the" : "started", lc->n,
		       lc->dir);
		for (int i = 0; i < lc->n; i++) {
			const local_agent *a = &lc->agents[i];
			printf("  %-8s pid %-8d control %s  api %s  log %s\n", a->name, a->pid,
			       a->control_url, a->api_url, a->log);
		}
	}
	fflush(stdout);
}

/* The admin token of a local cluster's node1, into t. */
static int local_token(const local_cluster *lc, struct token *t, up_result *res)
{
	size_t n = 0;
	ds_err err = {0};
	snprintf(t->source, sizeof t->source, "%s/admin.token", lc->agents[0].data_dir);
	if (ds_file_read_small(t->source, 0, t->text, sizeof t->text - 1, &n, &err) != DS_OK) {
		snprintf(res->error, sizeof res->error, "cannot read %s's admin token: %s",
			 lc->agents[0].name, err.msg);
		return 1;
	}
	t->text[n] = '\0';
	if (trim_token(t)) {
		snprintf(res->error, sizeof res->error, "%s's admin token %s is not usable",
			 lc->agents[0].name, t->source);
		return 1;
	}
	return 0;
}

static int cmd_cluster_up(const struct ctl_opts *o, const struct cmd_flags *fl, int argc,
			  char **argv)
{
	if (!fl->model)
		return bad_usage("cluster up needs --model PATH (a checkpoint every node reads at "
				 "that path)");
	if (!fl->local_n && (fl->local_dir || fl->fake_gpus))
		return bad_usage("--%s needs --local N", fl->local_dir ? "local-dir" : "fake-gpus");
	if (fl->local_n && fl->expect && fl->expect != fl->local_n)
		return bad_usage("--expect %d contradicts --local %d (the local cluster has %d "
				 "agents and waits for all of them)",
				 fl->expect, fl->local_n, fl->local_n);
	const char *dir = fl->local_dir ? fl->local_dir : LOCAL_DIR;
	const char *term = getenv("TERM");
	char model_abs[PATH_MAX];
	struct token tok;
	local_cluster lc = {0};
	up_result res;
	up_params up = up_default_params();
	int rc = DS_EIO;
	memset(&tok, 0, sizeof tok);
	up_result_init(&res);
	up.model = fl->model;
	up.served_model_name = fl->served_model_name;
	up.tp = fl->tp;
	up.pp = fl->pp;
	up.ep = fl->ep;
	up.max_ctx = fl->max_ctx;
	up.mem_fraction = fl->mem_fraction;
	up.expect = fl->expect;
	up.wait_ms = (long)fl->wait_ms;
	up.request_ms = o->timeout_ms;
	up.json = o->json;
	up.redraw = !o->json && isatty(STDOUT_FILENO) && !(term && strcmp(term, "dumb") == 0);
	up.dsctl = progname;
	if (fl->local_n) {
		local_params lp = local_default_params();
		ds_err err = {0};
		lp.dir = dir;
		lp.n = fl->local_n;
		lp.fake_gpus = fl->fake_gpus;
		if (local_up(&lp, &lc, &err) != DS_OK) {
			snprintf(res.error, sizeof res.error, "--local %d: %s", fl->local_n, err.msg);
			goto out;
		}
		print_local(o, &lc);
		/* the local agents run where dsctl runs: give the head a path that does
		 * not depend on that (a path that does not exist is the head's 404) */
		if (realpath(fl->model, model_abs))
			up.model = model_abs;
		if (local_token(&lc, &tok, &res))
			goto out;
		up.control_url = lc.agents[0].control_url;
		up.expect = fl->local_n;
	} else {
		if (load_token(o, &tok))
			return 1;
		up.control_url = o->agent;
	}
	up.token = tok.text;
	up.token_source = tok.source;
	rc = up_run(&up, &res);
out:
	if (rc != DS_OK && lc.n)
		fprintf(stderr, "dsctl: the %d local agent(s) keep running; stop them with: %s "
			"cluster down --local --local-dir %s\n", lc.n, progname, dir);
	else if (rc != DS_OK && res.deployment >= 0)
		fprintf(stderr, "dsctl: ranks of deployment %lld may still run; `%s cluster down` "
			"stops them\n", res.deployment, progname);
	up_result_print(&up, &res);
	up_result_free(&res);
	local_cluster_free(&lc);
	explicit_bzero(&tok, sizeof tok);
	return rc == DS_OK ? 0 : 1;
}

static const char *outcome_name(enum local_outcome oc)
{
	switch (oc) {
	case LOCAL_GONE:
		return "not running";
	case LOCAL_TERMINATED:
		return "stopped";
	case LOCAL_KILLED:
		return "killed (SIGKILL: it did not stop on SIGTERM)";
	case LOCAL_STUCK:
		return "STILL RUNNING after SIGKILL";
	case LOCAL_RUNNING:
		break;
	}
	return "running";
}

static int cmd_cluster_down(const struct ctl_opts *o, const struct cmd_flags *fl, int argc,
			    char **argv)
{
	ds_err err = {0};
	if (!fl->local && fl->local_dir)
		return bad_usage("--local-dir needs --local");
	if (!fl->local) {
		struct token tok;
		if (load_token(o, &tok))
			return 1;
		up_params up = up_default_params();
		up.control_url = o->agent;
		up.token = tok.text;
		up.token_source = tok.source;
		up.request_ms = o->timeout_ms;
		up.json = o->json;
		int rc = up_down(&up, &err);
		explicit_bzero(&tok, sizeof tok);
		if (rc != DS_OK) {
			fprintf(stderr, "dsctl: cluster down failed: %s\n", err.msg);
			return 1;
		}
		return 0;
	}
	const char *dir = fl->local_dir ? fl->local_dir : LOCAL_DIR;
	local_cluster lc = {0};
	int rc = local_down(dir, 15000, &lc, &err);
	if (o->json && lc.n) {
		json_t *as = json_array();
		for (int i = 0; as && i < lc.n; i++)
			json_array_append_new(as, json_pack("{s:s,s:i,s:s}", "name",
							    lc.agents[i].name, "pid",
							    lc.agents[i].pid, "outcome",
							    outcome_name(lc.agents[i].outcome)));
		json_t *v = json_pack("{s:s,s:b,s:o}", "dir", lc.dir, "removed", rc == DS_OK,
				      "agents", as ? as : json_array());
		if (v)
			print_json(v);
		json_decref(v);
	} else if (lc.n) {
		printf("local cluster in %s:\n", lc.dir);
		for (int i = 0; i < lc.n; i++)
			printf("  %-8s pid %-8d %s\n", lc.agents[i].name, lc.agents[i].pid,
			       outcome_name(lc.agents[i].outcome));
		if (rc == DS_OK)
			printf("removed %s/cluster.json\n", lc.dir);
	}
	local_cluster_free(&lc);
	if (rc != DS_OK) {
		fprintf(stderr, "dsctl: cluster down --local: %s\n", err.msg);
		return 1;
	}
	return 0;
}

/* ---- the command table ---- */

static const struct command {
	const char *word, *sub; /* "keys" "create"; sub NULL for one-word commands */
	cmd_fn fn;
	const cfg_opt *flags;
	int nargs;              /* number of positional arguments required */
	const char *args;       /* their names, for usage */
	const char *help;
	int opt_args;           /* optional positional arguments after those */
} commands[] = {
	{.word = "health", .fn = cmd_health, .flags = no_flags, .args = "",
	 .help = "is the agent up; its name, version and backend"},
	{.word = "version", .fn = cmd_version, .flags = no_flags, .args = "",
	 .help = "version and compute backend of the agent"},
	{.word = "keys", .sub = "create", .fn = cmd_keys_create, .flags = create_flags, .nargs = 1,
	 .args = "NAME [--expires DAYS] [--rpm N] [--tpm N] [--max-concurrency N]",
	 .help = "create an API key and print it (once)"},
	{.word = "keys", .sub = "list", .fn = cmd_keys_list, .flags = no_flags, .args = "",
	 .help = "every key: id, name, prefix, times, usage, limits, revoked"},
	{.word = "keys", .sub = "revoke", .fn = cmd_keys_revoke, .flags = no_flags, .nargs = 1,
	 .args = "ID", .help = "revoke a key at once"},
	{.word = "cluster", .sub = "init", .fn = cmd_cluster_init, .flags = cluster_init_flags,
	 .args = "[--key-file F] [--force]",
	 .help = "write a new cluster key file (0600) for dsagent --cluster-key; no agent needed"},
	{.word = "cluster", .sub = "members", .fn = cmd_cluster_members, .flags = no_flags,
	 .args = "", .help = "the agent's member list: name, node id, address, state, incarnation"},
	{.word = "cluster", .sub = "status", .fn = cmd_cluster_status, .flags = no_flags,
	 .args = "",
	 .help = "membership and election as the agent sees them: head, epoch, lease, quorum, "
		 "members, recent elections"},
	{.word = "cluster", .sub = "up", .fn = cmd_cluster_up, .flags = cluster_up_flags,
	 .args = "--model PATH [--tp N] [--pp N] [--ep N] [--max-ctx N] [--mem-fraction F] "
		 "[--served-model-name N] [--expect N] [--wait MS] [--local N [--local-dir DIR] "
		 "[--fake-gpus SPEC]]",
	 .help = "deploy a model on the cluster: wait for a head, plan, launch the ranks on every "
		 "node, follow their loading, print the API URL once it serves (exit 0) or what "
		 "failed where (exit 1); --local N first starts N agents on this machine"},
	{.word = "cluster", .sub = "down", .fn = cmd_cluster_down, .flags = cluster_down_flags,
	 .args = "[--local [--local-dir DIR]]",
	 .help = "stop the deployment's ranks on every node (the agents keep running); --local: "
		 "stop the agents of `cluster up --local` and remove its cluster.json"},
	{.word = "plan", .sub = "show", .fn = cmd_plan_show, .flags = no_flags, .args = "",
	 .help = "the current shard plan from the head: version, epoch, status, tp x pp x ep, each "
		 "rank's node, device, layers and experts, the comm groups, each node's environment"},
	{.word = "nodes", .fn = cmd_nodes, .flags = no_flags, .args = "[NAME]",
	 .help = "one row per node: address, status, role, GPUs, GPU memory, temperature, ECC, IB "
		 "ports, last seen; with NAME, that node in full (GPUs, topology, ports, NICs, "
		 "notes)",
	 .opt_args = 1},
	{.word = NULL},
};

/* One command: its words, arguments, help and flags. */
static void command_usage(FILE *f, const struct command *c)
{
	fprintf(f, "  %s%s%s%s%s\n      %s\n", c->word, c->sub ? " " : "", c->sub ? c->sub : "",
		c->args[0] ? " " : "", c->args, c->help);
	for (const cfg_opt *t = c->flags; t->name; t++)
		fprintf(f, "      --%-18s %s\n", t->name, t->help);
}

/* 1 when word has subcommands ("keys"), 0 for a one-word command. */
static int commands_of(const char *word)
{
	for (int i = 0; commands[i].word; i++)
		if (strcmp(commands[i].word, word) == 0 && commands[i].sub)
			return 1;
	return 0;
}

/* word NULL: every command and the global flags; else the commands of
 * that word (one command when sub is given too). */
static void usage(FILE *f, const char *word, const char *sub)
{
	if (!word)
		fprintf(f, "usage: dsctl [flags] COMMAND [args]   (dsctl help COMMAND: one "
			   "command)\n\nCommands:\n");
	else if (sub || !commands_of(word))
		fprintf(f, "usage: dsctl [flags] %s%s%s [args and flags below]\n\n", word,
			sub ? " " : "", sub ? sub : "");
	else
		fprintf(f, "usage: dsctl [flags] %s SUBCOMMAND [args]\n\nSubcommands:\n", word);
	for (int i = 0; commands[i].word; i++)
		if ((!word || strcmp(commands[i].word, word) == 0) &&
		    (!sub || (commands[i].sub && strcmp(commands[i].sub, sub) == 0)))
			command_usage(f, &commands[i]);
	if (word) {
		fprintf(f, "\nGlobal flags: dsctl --help\n");
		return;
	}
	fprintf(f, "\nGlobal flags (also DSCTL_<NAME> in the environment; the admin token "
		   "itself may be given as $DSCTL_TOKEN):\n");
	cfg_print_help(opts_table, "DSCTL", f);
}

static int is_help(const char *a)
{
	return strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0 || strcmp(a, "help") == 0;
}

/* Edits from a to b (insert, delete, replace, swap of neighbours), capped
 * at 9 (words longer than 31 characters count as far). */
static int edit_distance(const char *a, const char *b)
{
	size_t n = strlen(a), m = strlen(b);
	int d[32][32];
	if (n > 31 || m > 31)
		return 9;
	for (size_t i = 0; i <= n; i++)
		d[i][0] = (int)i;
	for (size_t j = 0; j <= m; j++)
		d[0][j] = (int)j;
	for (size_t i = 1; i <= n; i++) {
		for (size_t j = 1; j <= m; j++) {
			int c = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
			if (d[i - 1][j] + 1 < c)
				c = d[i - 1][j] + 1;
			if (d[i][j - 1] + 1 < c)
				c = d[i][j - 1] + 1;
			if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] &&
			    d[i - 2][j - 2] + 1 < c)
				c = d[i - 2][j - 2] + 1;
			d[i][j] = c;
		}
	}
	return d[n][m] > 9 ? 9 : d[n][m];
}

/* The command word (word NULL) or subcommand of word nearest to s, when it
 * is near enough to be a typo or s begins it; NULL otherwise. */
static const char *nearest(const char *word, const char *s)
{
	const char *best = NULL;
	int best_d = 3; /* at most 2 edits */
	for (int i = 0; commands[i].word; i++) {
		const char *cand = word ? commands[i].sub : commands[i].word;
		if (!cand || (word && strcmp(commands[i].word, word) != 0))
			continue;
		int d = strncmp(cand, s, strlen(s)) == 0 && strlen(s) >= 2 ? 1 : edit_distance(s, cand);
		if (d < best_d && (d < (int)strlen(cand) || d == 1)) {
			best_d = d;
			best = cand;
		}
	}
	return best;
}

static const cfg_opt *find_flag(const cfg_opt *tab, const char *name, size_t len)
{
	for (const cfg_opt *t = tab; t->name; t++)
		if (strlen(t->name) == len && strncmp(t->name, name, len) == 0)
			return t;
	return NULL;
}

/* Parses argv[start..]: flags of the command or global flags anywhere,
 * `--name value`, `--name=value`, bare `--flag` for booleans; everything
 * else (and all after "--") is positional.  Returns 0 or prints and returns 2. */
static int parse_rest(int argc, char **argv, int start, const struct command *cmd,
		      struct cmd_flags *fl, struct ctl_opts *o, char **pos, int *npos)
{
	ds_err err = {0};
	int only_pos = 0;
	*npos = 0;
	for (int i = start; i < argc; i++) {
		const char *a = argv[i];
		if (!only_pos && strcmp(a, "--") == 0) {
			only_pos = 1;
			continue;
		}
		if (only_pos || a[0] != '-' || a[1] == '\0') {
			if (*npos >= argc) /* cannot happen: pos has argc slots */
				return 2;
			pos[(*npos)++] = argv[i];
			continue;
		}
		const char *name = a + (a[1] == '-' ? 2 : 1);
		const char *eq = strchr(name, '=');
		size_t len = eq ? (size_t)(eq - name) : strlen(name);
		const cfg_opt *tab = cmd->flags, *opt = find_flag(tab, name, len);
		void *cfg = fl;
		if (!opt) {
			tab = opts_table;
			opt = find_flag(tab, name, len);
			cfg = o;
		}
		if (strcmp(a, "-h") == 0) {
			o->help = 1;
			continue;
		}
		if (!opt || a[1] != '-') {
			fprintf(stderr, "dsctl: unknown flag %s for '%s%s%s' (see dsctl --help)\n", a,
				cmd->word, cmd->sub ? " " : "", cmd->sub ? cmd->sub : "");
			return 2;
		}
		const char *val;
		if (eq)
			val = eq + 1;
		else if (opt->type == CFG_BOOL)
			val = "true";
		else if (i + 1 < argc)
			val = argv[++i];
		else {
			fprintf(stderr, "dsctl: flag --%s needs a value\n", opt->name);
			return 2;
		}
		if (cfg_set(tab, cfg, opt->name, val, "flag", &err) != DS_OK) {
			fprintf(stderr, "dsctl: %s\n", err.msg);
			return 2;
		}
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct ctl_opts o;
	struct cmd_flags fl = {0};
	ds_err err = {0};
	int next = 0, rc = 2;
	char **pos = NULL;
	const struct command *cmd = NULL;
	if (argc > 0 && argv[0] && argv[0][0])
		progname = argv[0];
	if (cfg_load(opts_table, &o, "DSCTL", argc, argv, 1, &next, &err) != DS_OK) {
		fprintf(stderr, "dsctl: %s\n", err.msg);
		goto out;
	}
	/* `dsctl help [COMMAND [SUB]]` is `dsctl [COMMAND [SUB]] --help` */
	if (next < argc && strcmp(argv[next], "help") == 0) {
		o.help = 1;
		next++;
	}
	if (next >= argc) {
		usage(o.help ? stdout : stderr, NULL, NULL);
		rc = o.help ? 0 : 2;
		goto out;
	}
	const char *word = argv[next];
	int has_group = 0;
	for (int i = 0; commands[i].word; i++) {
		if (strcmp(commands[i].word, word) != 0)
			continue;
		has_group = 1;
		if (!commands[i].sub ||
		    (next + 1 < argc && strcmp(commands[i].sub, argv[next + 1]) == 0)) {
			cmd = &commands[i];
			break;
		}
	}
	if (!cmd && !has_group) {
		const char *near = nearest(NULL, word);
		fprintf(stderr, "dsctl: unknown command '%s'%s%s%s (see dsctl --help)\n", word,
			near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "");
		goto out;
	}
	if (!cmd) { /* a word of subcommands without a known one */
		const char *sub = next + 1 < argc ? argv[next + 1] : NULL;
		if (o.help || (sub && is_help(sub))) {
			usage(stdout, word, NULL);
			rc = 0;
		} else if (!sub || sub[0] == '-') {
			fprintf(stderr, "dsctl: '%s' needs a subcommand:\n", word);
			usage(stderr, word, NULL);
		} else {
			const char *near = nearest(word, sub);
			fprintf(stderr, "dsctl: unknown subcommand '%s' of '%s'%s%s%s; these are:\n",
				sub, word, near ? " (did you mean '" : "", near ? near : "",
				near ? "'?)" : "");
			usage(stderr, word, NULL);
		}
		goto out;
	}
	int first = next + (cmd->sub ? 2 : 1);
	if (o.help || (first < argc && strcmp(argv[first], "help") == 0)) {
		usage(stdout, cmd->word, cmd->sub);
		rc = 0;
		cmd = NULL; /* no flags were set */
		goto out;
	}
	if (cfg_defaults(cmd->flags, &fl, &err) != DS_OK) {
		fprintf(stderr, "dsctl: %s\n", err.msg);
		goto out;
	}
	pos = calloc((size_t)argc, sizeof *pos);
	int npos = 0;
	if (!pos)
		goto out;
	rc = parse_rest(argc, argv, first, cmd, &fl, &o, pos, &npos);
	if (rc)
		goto out;
	if (o.help) {
		usage(stdout, cmd->word, cmd->sub);
		goto out;
	}
	if (npos < cmd->nargs || npos > cmd->nargs + cmd->opt_args) {
		fprintf(stderr, "dsctl: usage: dsctl %s%s%s%s%s\n", cmd->word, cmd->sub ? " " : "",
			cmd->sub ? cmd->sub : "", cmd->args[0] ? " " : "", cmd->args);
		rc = 2;
		goto out;
	}
	rc = cmd->fn(&o, &fl, npos, pos);
out:
	free(pos);
	if (cmd)
		cfg_free(cmd->flags, &fl);
	cfg_free(opts_table, &o);
	return rc;
}

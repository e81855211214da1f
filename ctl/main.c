/*
 * main.c - dsctl: the operator's command line.
 *
 * dsctl [global flags] COMMAND [SUBCOMMAND] [args and flags]; commands are
 * rows of one table (words, handler, flags, arguments, help).  Global flags
 * may come before or after the command:
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
#include "common/jsonx.h"
#include "common/strutil.h"
#include "ctl/client.h"

#include <errno.h>
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
	{"agent", CFG_STR, offsetof(struct ctl_opts, agent), "http://127.0.0.1:7481", 1, 0,
	 "URL of the agent's control API"},
	{"token-file", CFG_STR, offsetof(struct ctl_opts, token_file), NULL, 1, 0,
	 "file holding the admin token (else $DSCTL_TOKEN, else DATA_DIR/admin.token)"},
	{"data-dir", CFG_STR, offsetof(struct ctl_opts, data_dir), DEFAULT_DATA_DIR, 1, 0,
	 "the agent's data directory, where admin.token is read from"},
	{"json", CFG_BOOL, offsetof(struct ctl_opts, json), "false", 1, 0,
	 "print one JSON document instead of text"},
	{"timeout", CFG_INT, offsetof(struct ctl_opts, timeout_ms), "10000", 1, 600000,
	 "request timeout in milliseconds"},
	{"help", CFG_BOOL, offsetof(struct ctl_opts, help), "false", 1, 0, "this help"},
	{0},
};

/* Flags of the subcommands (each command's table points into this struct). */
struct cmd_flags {
	int64_t expires_days;
	int64_t rpm, tpm, max_concurrency;
};

#define F(f) offsetof(struct cmd_flags, f)
static const cfg_opt create_flags[] = {
	{"expires", CFG_I64, F(expires_days), NULL, 0, 36500,
	 "days until the key expires (default: never)"},
	{"rpm", CFG_I64, F(rpm), NULL, 0, 1e9, "requests per minute (default: unlimited)"},
	{"tpm", CFG_I64, F(tpm), NULL, 0, 1e12,
	 "prompt + completion tokens per minute (default: unlimited)"},
	{"max-concurrency", CFG_I64, F(max_concurrency), NULL, 0, 1e6,
	 "requests in flight at once (default: unlimited)"},
	{0},
};
static const cfg_opt no_flags[] = {{0}};

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
	FILE *f = fopen(path, "r");
	if (!f) {
		fprintf(stderr,
			"dsctl: cannot read the admin token from %s: %s (pass --token-file FILE, "
			"set $DSCTL_TOKEN, or --data-dir DIR of the agent)\n",
			path, strerror(errno));
		return 1;
	}
	size_t n = fread(t->text, 1, sizeof t->text - 1, f);
	int err = ferror(f);
	fclose(f);
	if (err) {
		fprintf(stderr, "dsctl: cannot read the admin token from %s\n", path);
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
	ctl_client c = {o->agent, NULL, o->timeout_ms};
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
	json_t *v = call(o, "GET", "/v1/keys", NULL, 1);
	if (!v)
		return 1;
	json_t *data = json_object_get(v, "data");
	if (!json_is_array(data)) {
		fprintf(stderr, "dsctl: the agent's reply has no \"data\" list\n");
		json_decref(v);
		return 1;
	}
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

/* ---- the command table ---- */

static const struct command {
	const char *word, *sub; /* "keys" "create"; sub NULL for one-word commands */
	cmd_fn fn;
	const cfg_opt *flags;
	int nargs;              /* exact number of positional arguments */
	const char *args;       /* their names, for usage */
	const char *help;
} commands[] = {
	{"health", NULL, cmd_health, no_flags, 0, "", "is the agent up; its name, version and backend"},
	{"version", NULL, cmd_version, no_flags, 0, "", "version and compute backend of the agent"},
	{"keys", "create", cmd_keys_create, create_flags, 1,
	 "NAME [--expires DAYS] [--rpm N] [--tpm N] [--max-concurrency N]",
	 "create an API key and print it (once)"},
	{"keys", "list", cmd_keys_list, no_flags, 0, "",
	 "every key: id, name, prefix, times, usage, limits, revoked"},
	{"keys", "revoke", cmd_keys_revoke, no_flags, 1, "ID", "revoke a key at once"},
	{NULL, NULL, NULL, NULL, 0, NULL, NULL},
};

static void usage(FILE *f)
{
	fprintf(f, "usage: dsctl [flags] COMMAND [args]\n\nCommands:\n");
	for (int i = 0; commands[i].word; i++) {
		char cmd[128];
		snprintf(cmd, sizeof cmd, "%s%s%s%s%s", commands[i].word,
			 commands[i].sub ? " " : "", commands[i].sub ? commands[i].sub : "",
			 commands[i].args[0] ? " " : "", commands[i].args);
		fprintf(f, "  %s\n      %s\n", cmd, commands[i].help);
		for (const cfg_opt *t = commands[i].flags; t->name; t++)
			fprintf(f, "      --%-18s %s\n", t->name, t->help);
	}
	fprintf(f, "\nGlobal flags (also DSCTL_<NAME> in the environment; the admin token "
		   "itself may be given as $DSCTL_TOKEN):\n");
	cfg_print_help(opts_table, "DSCTL", f);
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
	struct cmd_flags fl;
	ds_err err = {0};
	int next = 0, rc = 2;
	char **pos = NULL;
	if (cfg_load(opts_table, &o, "DSCTL", argc, argv, 1, &next, &err) != DS_OK) {
		fprintf(stderr, "dsctl: %s\n", err.msg);
		goto out;
	}
	if (o.help || next >= argc) {
		usage(o.help ? stdout : stderr);
		rc = o.help ? 0 : 2;
		goto out;
	}
	const char *word = argv[next];
	const struct command *cmd = NULL;
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
	if (!cmd) {
		if (has_group)
			fprintf(stderr, "dsctl: '%s' needs a subcommand:\n", word);
		else
			fprintf(stderr, "dsctl: unknown command '%s' (see dsctl --help)\n", word);
		if (has_group)
			for (int i = 0; commands[i].word; i++)
				if (strcmp(commands[i].word, word) == 0)
					fprintf(stderr, "  dsctl %s %s%s%s\n", word, commands[i].sub,
						commands[i].args[0] ? " " : "", commands[i].args);
		goto out;
	}
	if (cfg_defaults(create_flags, &fl, &err) != DS_OK) {
		fprintf(stderr, "dsctl: %s\n", err.msg);
		goto out;
	}
	pos = calloc((size_t)argc, sizeof *pos);
	int npos = 0;
	if (!pos)
		goto out;
	rc = parse_rest(argc, argv, next + (cmd->sub ? 2 : 1), cmd, &fl, &o, pos, &npos);
	if (rc)
		goto out;
	if (o.help) {
		usage(stdout);
		goto out;
	}
	if (npos != cmd->nargs) {
		fprintf(stderr, "dsctl: usage: dsctl %s%s%s%s%s\n", cmd->word, cmd->sub ? " " : "",
			cmd->sub ? cmd->sub : "", cmd->args[0] ? " " : "", cmd->args);
		rc = 2;
		goto out;
	}
	rc = cmd->fn(&o, &fl, npos, pos);
out:
	free(pos);
	cfg_free(opts_table, &o);
	return rc;
}

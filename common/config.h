/*
 * config.h - one table drives flags, the config file, the environment, help
 * text and `config get`.
 *
 * A program declares its settings once:
 *
 *     static const cfg_opt opts[] = {
 *         {"api-port", CFG_INT, offsetof(struct agent_cfg, api_port), "8000", 1, 65535,
 *          "port of the OpenAI-compatible API"},
 *         ...
 *         {0}
 *     };
 *
 * and cfg_load fills its struct in this order, later sources winning:
 *
 *     defaults  ->  config file  ->  environment  ->  command-line flags
 *
 * The config file is `--config FILE` (or $<PREFIX>_CONFIG): lines of
 * `key = value`, `#` comments, keys spelled as the flags.  The environment
 * variable of "api-port" with prefix "DSAGENT" is DSAGENT_API_PORT.
 * A boolean is set true by its bare flag (`--name`) and false by `--no-name`
 * or `--name=false`.
 * CFG_STR fields are `char *` owned by the struct (cfg_free releases them);
 * CFG_INT are int, CFG_I64 int64_t, CFG_DOUBLE double, CFG_BOOL int (0/1).
 */
#ifndef DS_CONFIG_H
#define DS_CONFIG_H

#include "common/status.h"

#include <stddef.h>
#include <stdio.h>

enum cfg_type { CFG_STR = 1, CFG_INT, CFG_I64, CFG_DOUBLE, CFG_BOOL };

typedef struct cfg_opt {
	const char *name;   /* flag and file key, e.g. "api-port"; NULL ends the table */
	enum cfg_type type;
	size_t offset;      /* of the field in the program's config struct */
	const char *def;    /* default as text; NULL = unset (NULL string / 0) */
	double min, max;    /* inclusive bounds for numbers (ignored when min > max) */
	const char *help;
	char short_flag;    /* optional one-letter alias: 'm' accepts "-m VALUE" */
} cfg_opt;

/* Sets every field to its default. */
int cfg_defaults(const cfg_opt *tab, void *cfg, ds_err *err);

/* Sets one option from text, validating type and bounds. `src` names the
 * source for the error message ("flag", "file x.conf:3", "env FOO"). */
int cfg_set(const cfg_opt *tab, void *cfg, const char *name, const char *value, const char *src,
	    ds_err *err);

int cfg_load_file(const cfg_opt *tab, void *cfg, const char *path, ds_err *err);

/* The whole sequence: defaults, file, env, flags. */
int cfg_load(const cfg_opt *tab, void *cfg, const char *env_prefix, int argc, char **argv,
	     int start, int *next, ds_err *err);

/* Writes the value of one option as text; DS_ENOTFOUND for unknown names. */
int cfg_get(const cfg_opt *tab, const void *cfg, const char *name, char *out, size_t size);

void cfg_print_help(const cfg_opt *tab, const char *env_prefix, FILE *f);
void cfg_free(const cfg_opt *tab, void *cfg);

#endif

/*
 * config.c - table-driven configuration (see config.h).
 *
 * Invariant: after cfg_defaults every CFG_STR field is either NULL or a
 * malloc'd string owned by the struct; cfg_set replaces (and frees) it, so
 * loading the same key from several sources never leaks.
 * Not thread-safe: configuration is loaded once at start-up.
 */
#include "common/config.h"
#include "common/strutil.h"

#include <ctype.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const cfg_opt *find(const cfg_opt *tab, const char *name, size_t len)
{
	for (const cfg_opt *o = tab; o->name; o++)
		if (strlen(o->name) == len && strncmp(o->name, name, len) == 0)
			return o;
	return NULL;
}

static int set_opt(const cfg_opt *o, void *cfg, const char *value, const char *src, ds_err *err)
{
	char *field = (char *)cfg + o->offset;
	int has_bounds = o->min <= o->max;
	int rc = DS_OK;
	switch (o->type) {
	case CFG_STR: {
		char **p = (char **)field;
		char *dup = value ? strdup(value) : NULL;
		if (value && !dup)
			return ds_err_set(err, DS_ENOMEM, "out of memory");
		free(*p);
		*p = dup;
		return DS_OK;
	}
	case CFG_INT: {
		int v = 0;
		if (value)
			rc = ds_parse_int(value, has_bounds ? (int)o->min : INT32_MIN,
					  has_bounds ? (int)o->max : INT32_MAX, &v);
		if (rc == DS_OK)
			*(int *)field = v;
		break;
	}
	case CFG_I64: {
		int64_t v = 0;
		if (value)
			rc = ds_parse_i64(value, has_bounds ? (int64_t)o->min : INT64_MIN,
					  has_bounds ? (int64_t)o->max : INT64_MAX, &v);
		if (rc == DS_OK)
			*(int64_t *)field = v;
		break;
	}
	case CFG_DOUBLE: {
		double v = 0;
		if (value)
			rc = ds_parse_double(value, has_bounds ? o->min : -1e308,
					     has_bounds ? o->max : 1e308, &v);
		if (rc == DS_OK)
			*(double *)field = v;
		break;
	}
	case CFG_BOOL: {
		int v = 0;
		if (value)
			rc = ds_parse_bool(value, &v);
		if (rc == DS_OK)
			*(int *)field = v;
		break;
	}
	}
	if (rc == DS_ERANGE)
		return ds_err_set(err, DS_EINVAL, "%s: --%s=%s is out of range [%g, %g]", src,
				  o->name, value, o->min, o->max);
	if (rc)
		return ds_err_set(err, DS_EINVAL, "%s: --%s=%s is not a valid %s", src, o->name,
				  value,
				  o->type == CFG_BOOL ? "boolean (true/false)"
				  : o->type == CFG_DOUBLE ? "number"
							  : "integer");
	return DS_OK;
}

int cfg_defaults(const cfg_opt *tab, void *cfg, ds_err *err)
{
	for (const cfg_opt *o = tab; o->name; o++) {
		if (o->type == CFG_STR)
			*(char **)((char *)cfg + o->offset) = NULL;
		int rc = set_opt(o, cfg, o->def, "default", err);
		if (rc)
			return rc;
	}
	return DS_OK;
}

int cfg_set(const cfg_opt *tab, void *cfg, const char *name, const char *value, const char *src,
	    ds_err *err)
{
	const cfg_opt *o = find(tab, name, strlen(name));
	if (!o)
		return ds_err_set(err, DS_EINVAL, "%s: unknown option '%s'", src, name);
	return set_opt(o, cfg, value, src, err);
}

static char *trim(char *s)
{
	while (isspace((unsigned char)*s))
		s++;
	char *e = s + strlen(s);
	while (e > s && isspace((unsigned char)e[-1]))
		*--e = '\0';
	return s;
}

int cfg_load_file(const cfg_opt *tab, void *cfg, const char *path, ds_err *err)
{
	FILE *f = fopen(path, "r");
	if (!f)
		return ds_err_set(err, DS_ENOTFOUND, "cannot open config file %s: %m", path);
	char line[4096];
	int lineno = 0, rc = DS_OK;
	while (fgets(line, sizeof line, f)) {
		lineno++;
		char src[512];
		snprintf(src, sizeof src, "config file %s:%d", path, lineno);
		if (!strchr(line, '\n') && !feof(f)) {
			rc = ds_err_set(err, DS_EINVAL, "%s: line longer than %zu bytes", src,
					sizeof line - 2);
			break;
		}
		char *hash = strchr(line, '#');
		if (hash)
			*hash = '\0';
		char *s = trim(line);
		if (!*s)
			continue;
		char *eq = strchr(s, '=');
		if (!eq) {
			rc = ds_err_set(err, DS_EINVAL, "%s: expected 'key = value'", src);
			break;
		}
		*eq = '\0';
		char *key = trim(s), *val = trim(eq + 1);
		if (strcmp(key, "config") == 0) {
			rc = ds_err_set(err, DS_EINVAL, "%s: 'config' cannot be set in a file", src);
			break;
		}
		size_t vl = strlen(val);
		if (vl >= 2 && val[0] == '"' && val[vl - 1] == '"') {
			val[vl - 1] = '\0';
			val++;
		}
		rc = cfg_set(tab, cfg, key, val, src, err);
		if (rc)
			break;
	}
	fclose(f);
	return rc;
}

static void env_name(const char *prefix, const char *name, char *out, size_t size)
{
	size_t n = (size_t)snprintf(out, size, "%s_%s", prefix, name);
	for (size_t i = 0; i < n && i < size; i++)
		out[i] = out[i] == '-' ? '_' : (char)toupper((unsigned char)out[i]);
}

static int cfg_load_env(const cfg_opt *tab, void *cfg, const char *prefix, ds_err *err)
{
	for (const cfg_opt *o = tab; o->name; o++) {
		char name[128];
		env_name(prefix, o->name, name, sizeof name);
		const char *v = getenv(name);
		if (!v)
			continue;
		char src[160];
		snprintf(src, sizeof src, "environment %s", name);
		int rc = set_opt(o, cfg, v, src, err);
		if (rc)
			return rc;
	}
	return DS_OK;
}

/* Parses argv[start..]: `--name value`, `--name=value`, bare `--flag` for bools
 * (and `--no-flag` to set one false), `-x value` for options with a short_flag.
 * Stops at "--" or at the first argument that is not a flag; *next gets its
 * index (argc when all were consumed).  `--config` is accepted and skipped. */
static int cfg_parse_args(const cfg_opt *tab, void *cfg, int argc, char **argv, int start,
			  int *next, ds_err *err)
{
	int i = start;
	while (i < argc) {
		const char *a = argv[i];
		if (strcmp(a, "--") == 0) {
			i++;
			break;
		}
		const char *name, *eq;
		size_t len;
		const cfg_opt *o = NULL;
		int negated = 0; /* --no-NAME of a boolean NAME: false */
		if (a[0] == '-' && a[1] && a[1] != '-' && a[2] == '\0') {
			for (const cfg_opt *s = tab; s->name && !o; s++)
				if (s->short_flag == a[1])
					o = s;
			if (!o)
				return ds_err_set(err, DS_EINVAL, "unknown flag %s (see --help)", a);
			name = o->name;
			eq = NULL;
			len = strlen(name);
			goto have_opt;
		}
		if (strncmp(a, "--", 2) != 0 || a[2] == '\0')
			break;
		name = a + 2;
		eq = strchr(name, '=');
		len = eq ? (size_t)(eq - name) : strlen(name);
		if (len == 6 && strncmp(name, "config", 6) == 0) {
			i += eq ? 1 : 2;
			continue;
		}
		o = find(tab, name, len);
		if (!o && !eq && len > 3 && strncmp(name, "no-", 3) == 0) {
			o = find(tab, name + 3, len - 3);
			negated = o && o->type == CFG_BOOL;
			if (!negated)
				o = NULL;
		}
		if (!o)
			return ds_err_set(err, DS_EINVAL, "unknown flag --%.*s (see --help)", (int)len,
					  name);
	have_opt:;
		const char *val;
		if (negated) {
			val = "false";
			i++;
		} else if (eq) {
			val = eq + 1;
			i++;
		} else if (o->type == CFG_BOOL) {
			val = "true";
			i++;
		} else {
			if (i + 1 >= argc)
				return ds_err_set(err, DS_EINVAL, "flag --%s needs a value", o->name);
			val = argv[i + 1];
			i += 2;
		}
		int rc = set_opt(o, cfg, val, "flag", err);
		if (rc)
			return rc;
	}
	if (next)
		*next = i;
	return DS_OK;
}

static const char *find_config_path(int argc, char **argv, int start, const char *prefix)
{
	for (int i = start; i < argc; i++) {
		if (strcmp(argv[i], "--") == 0)
			break;
		if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
			return argv[i + 1];
		if (strncmp(argv[i], "--config=", 9) == 0)
			return argv[i] + 9;
	}
	char name[128];
	env_name(prefix, "config", name, sizeof name);
	return getenv(name);
}

int cfg_load(const cfg_opt *tab, void *cfg, const char *env_prefix, int argc, char **argv,
	     int start, int *next, ds_err *err)
{
	int rc = cfg_defaults(tab, cfg, err);
	if (rc)
		return rc;
	const char *path = find_config_path(argc, argv, start, env_prefix);
	if (path && (rc = cfg_load_file(tab, cfg, path, err)))
		return rc;
	if ((rc = cfg_load_env(tab, cfg, env_prefix, err)))
		return rc;
	return cfg_parse_args(tab, cfg, argc, argv, start, next, err);
}

int cfg_get(const cfg_opt *tab, const void *cfg, const char *name, char *out, size_t size)
{
	const cfg_opt *o = find(tab, name, strlen(name));
	if (!o)
		return DS_ENOTFOUND;
	const char *field = (const char *)cfg + o->offset;
	switch (o->type) {
	case CFG_STR: {
		const char *s = *(char *const *)field;
		snprintf(out, size, "%s", s ? s : "");
		break;
	}
	case CFG_INT: snprintf(out, size, "%d", *(const int *)field); break;
	case CFG_I64: snprintf(out, size, "%lld", (long long)*(const int64_t *)field); break;
	case CFG_DOUBLE: snprintf(out, size, "%g", *(const double *)field); break;
	case CFG_BOOL: snprintf(out, size, "%s", *(const int *)field ? "true" : "false"); break;
	}
	return DS_OK;
}

void cfg_print_help(const cfg_opt *tab, const char *env_prefix, FILE *f)
{
	fprintf(f, "  %-28s config file of 'key = value' lines (env %s_CONFIG)\n", "--config FILE",
		env_prefix);
	for (const cfg_opt *o = tab; o->name; o++) {
		char flag[64];
		char shortf[8] = "";
		if (o->short_flag)
			snprintf(shortf, sizeof shortf, "-%c, ", o->short_flag);
		snprintf(flag, sizeof flag, "%s--%s%s", shortf, o->name,
			 o->type == CFG_BOOL ? ""
			 : o->type == CFG_STR ? " S"
					      : " N");
		fprintf(f, "  %-28s %s", flag, o->help ? o->help : "");
		if (o->def && !(o->type == CFG_BOOL && strcmp(o->def, "false") == 0))
			fprintf(f, " (default %s)", o->def); /* a flag is off unless given */
		fprintf(f, "\n");
	}
}

void cfg_free(const cfg_opt *tab, void *cfg)
{
	if (!cfg)
		return;
	for (const cfg_opt *o = tab; o->name; o++) {
		if (o->type == CFG_STR) {
			char **p = (char **)((char *)cfg + o->offset);
			free(*p);
			*p = NULL;
		}
	}
}

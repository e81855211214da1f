/*
 * jsonx.c - bounded JSON parsing and typed getters on top of jansson.
 * Pure functions; thread-safe (jansson values are not shared across threads
 * by these helpers).
 */
#include "common/jsonx.h"

#include <math.h>
#include <string.h>

int jsonx_depth(const char *text, size_t len)
{
	int depth = 0, max = 0, in_str = 0;
	for (size_t i = 0; i < len; i++) {
		char c = text[i];
		if (in_str) {
			if (c == '\\')
				i++;
			else if (c == '"')
				in_str = 0;
			continue;
		}
		if (c == '"') {
			in_str = 1;
		} else if (c == '[' || c == '{') {
			if (++depth > max)
				max = depth;
		} else if (c == ']' || c == '}') {
			if (--depth < 0)
				return -1;
		}
	}
	return depth == 0 && !in_str ? max : -1;
}

json_t *jsonx_parse(const char *text, size_t len, int max_depth, ds_err *err)
{
	int depth = jsonx_depth(text, len);
	if (depth > max_depth) {
		ds_err_set(err, DS_ERANGE, "JSON nested %d levels deep; the limit is %d", depth,
			   max_depth);
		return NULL;
	}
	json_error_t je;
	json_t *v = json_loadb(text, len, 0, &je);
	if (!v) {
		ds_err_set(err, DS_EFORMAT, "invalid JSON at line %d column %d: %s", je.line,
			   je.column, je.text);
		return NULL;
	}
	return v;
}

static int absent(const json_t *obj, const char *key, int required, json_t **v, ds_err *err)
{
	*v = json_is_object(obj) ? json_object_get(obj, key) : NULL;
	if (*v && !json_is_null(*v))
		return 0;
	if (required)
		return ds_err_set(err, DS_EINVAL, "'%s' is required", key);
	return 1;
}

int jsonx_get_str(const json_t *obj, const char *key, int required, const char **out, ds_err *err)
{
	json_t *v;
	int a = absent(obj, key, required, &v, err);
	if (a)
		return a < 0 ? a : DS_OK;
	if (!json_is_string(v))
		return ds_err_set(err, DS_EINVAL, "'%s' must be a string", key);
	*out = json_string_value(v);
	return DS_OK;
}

int jsonx_get_i64(const json_t *obj, const char *key, int required, int64_t min, int64_t max,
		  int64_t *out, ds_err *err)
{
	json_t *v;
	int a = absent(obj, key, required, &v, err);
	if (a)
		return a < 0 ? a : DS_OK;
	int64_t x;
	if (json_is_integer(v)) {
		x = (int64_t)json_integer_value(v);
	} else if (json_is_real(v) && floor(json_real_value(v)) == json_real_value(v) &&
		   fabs(json_real_value(v)) < 9e15) {
		x = (int64_t)json_real_value(v);
	} else {
		return ds_err_set(err, DS_EINVAL, "'%s' must be an integer", key);
	}
	if (x < min || x > max)
		return ds_err_set(err, DS_EINVAL, "'%s' must be in [%lld, %lld], got %lld", key,
				  (long long)min, (long long)max, (long long)x);
	*out = x;
	return DS_OK;
}

int jsonx_get_double(const json_t *obj, const char *key, int required, double min, double max,
		     double *out, ds_err *err)
{
	json_t *v;
	int a = absent(obj, key, required, &v, err);
	if (a)
		return a < 0 ? a : DS_OK;
	if (!json_is_number(v))
		return ds_err_set(err, DS_EINVAL, "'%s' must be a number", key);
	double x = json_number_value(v);
	if (!(x >= min && x <= max))
		return ds_err_set(err, DS_EINVAL, "'%s' must be in [%g, %g], got %g", key, min, max,
				  x);
	*out = x;
	return DS_OK;
}

int jsonx_get_bool(const json_t *obj, const char *key, int required, int *out, ds_err *err)
{
	json_t *v;
	int a = absent(obj, key, required, &v, err);
	if (a)
		return a < 0 ? a : DS_OK;
	if (!json_is_boolean(v))
		return ds_err_set(err, DS_EINVAL, "'%s' must be true or false", key);
	*out = json_is_true(v);
	return DS_OK;
}

char *jsonx_dumps(const json_t *v)
{
	return json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
}

const char *jsonx_str_or(const json_t *o, const char *key, const char *dflt)
{
	const json_t *v = json_object_get(o, key);
	return json_is_string(v) ? json_string_value(v) : dflt;
}

int jsonx_int_at(const json_t *o, const char *key, long long *out)
{
	const json_t *v = json_object_get(o, key);
	if (!json_is_integer(v))
		return 0;
	*out = (long long)json_integer_value(v);
	return 1;
}

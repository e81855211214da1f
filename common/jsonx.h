/*
 * jsonx.h - jansson helpers with bounds and clear errors.
 *
 * jsonx_parse rejects input nested deeper than max_depth before jansson sees
 * it, and reports line/column on syntax errors.  The getters validate type and
 * range and name the key in the error ("'max_tokens' must be an integer in
 * [1, 32768]"), so request validation reads as a list of one-liners.
 * For each getter: absent key and !required -> DS_OK with *out untouched.
 */
#ifndef DS_JSONX_H
#define DS_JSONX_H

#include "common/status.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

/* Deepest nesting of [ and { outside strings; -1 if the text is not balanced. */
int jsonx_depth(const char *text, size_t len);

/* New reference or NULL with err filled (DS_EFORMAT or DS_ERANGE for depth). */
json_t *jsonx_parse(const char *text, size_t len, int max_depth, ds_err *err);

int jsonx_get_str(const json_t *obj, const char *key, int required, const char **out, ds_err *err);
int jsonx_get_i64(const json_t *obj, const char *key, int required, int64_t min, int64_t max,
		  int64_t *out, ds_err *err);
int jsonx_get_double(const json_t *obj, const char *key, int required, double min, double max,
		     double *out, ds_err *err);
int jsonx_get_bool(const json_t *obj, const char *key, int required, int *out, ds_err *err);

/* Compact one-line text ("{"a":1}"), caller frees with free(); NULL on ENOMEM. */
char *jsonx_dumps(const json_t *v);

/* Lenient reads for printing what an agent answered: the string at key
 * (else dflt), and 1 with *out for an integer at key (else 0). */
const char *jsonx_str_or(const json_t *o, const char *key, const char *dflt);
int jsonx_int_at(const json_t *o, const char *key, long long *out);

#endif

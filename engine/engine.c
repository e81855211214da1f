/*
 * engine.c - version string, backend selection against a graph's needs, and
 * the tokenizer of a model source (see engine.h).  Called by dsrun, model.c
 * and dsagent at start-up; thread-safe (no state of its own; the one log
 * line goes through common/log).
 *
 * Backend choice for "auto" (eng_backend_pick):
 *
 *   for name in cuda, cpu (compiled in only):
 *     kb_backend_check(name, needs)  -- from the backend's table, no device
 *        fails: cuda -> log "backend cuda cannot run this model (...); using cpu", next
 *               cpu  -> error naming the op
 *     kb_backend_get(name)           -- cuda without a device: next, silently
 *        -> the backend
 */
#include "engine/engine.h"

#include "common/log.h"
#include "engine/gguf.h"
#include "engine/source.h"
#include "engine/tok.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *eng_version(void)
{
	return DS_VERSION;
}

static int compiled_in(const char *name)
{
	for (int i = 0; i < kb_backend_count(); i++)
		if (strcmp(kb_backend_name_at(i), name) == 0)
			return 1;
	return 0;
}

const kb_backend *eng_backend_pick(const char *want, const kb_op_need *needs, int n_needs,
				   const char *what, ds_err *err)
{
	static const char *const order[] = {"cuda", "cpu"};
	if (want && strcmp(want, "auto") != 0) {
		if (!compiled_in(want))
			return kb_backend_get(want, err); /* unknown, or not compiled in: says which */
		if (kb_backend_check(want, needs, n_needs, err)) {
			if (what)
				ds_err_wrap(err, "model %s", what);
			return NULL;
		}
		return kb_backend_get(want, err);
	}
	for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
		const char *name = order[i];
		ds_err why = {0};
		const int last = i + 1 == sizeof order / sizeof order[0];
		if (!compiled_in(name))
			continue;
		if (kb_backend_check(name, needs, n_needs, &why)) {
			if (last) {
				if (err)
					*err = why;
				if (what)
					ds_err_wrap(err, "model %s", what);
				return NULL;
			}
			char line[DS_ERR_MSG_MAX + 64];
			snprintf(line, sizeof line, "backend %s cannot run this model (%s); using %s", name,
				 why.msg, order[i + 1]);
			log_warn("engine", line, "model=%s", what ? what : "-");
			continue;
		}
		const kb_backend *be = kb_backend_get(name, last ? err : NULL);
		if (be)
			return be;
	}
	return NULL;
}

const kb_backend *eng_backend_choose(const char *want, ds_err *err)
{
	return eng_backend_pick(want, NULL, 0, NULL, err);
}

tok *eng_tok_load_source(const msrc *s, ds_err *err)
{
	if (msrc_kind(s) == MSRC_GGUF) /* tokenizer.ggml.* metadata */
		return tok_load_gguf(msrc_gguf(s), err);
	const char *dir = msrc_path(s);
	size_t n = strlen(dir) + sizeof "/tokenizer_config.json";
	char *json = malloc(n), *cfg = malloc(n);
	tok *t = NULL;
	if (!json || !cfg) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		goto out;
	}
	snprintf(json, n, "%s/tokenizer.json", dir);
	snprintf(cfg, n, "%s/tokenizer_config.json", dir);
	t = tok_load_hf(json, access(cfg, R_OK) == 0 ? cfg : NULL, err);
out:
	free(json);
	free(cfg);
	return t;
}

tok *eng_tok_load(const char *path, ds_err *err)
{
	msrc *s = msrc_open(path, err);
	tok *t = s ? eng_tok_load_source(s, err) : NULL;
	msrc_unref(s);
	return t;
}

/*
 * engine.c - version string and backend selection (see engine.h).
 * Called by dsrun and dsagent at start-up; thread-safe (no state of its own).
 */
#include "engine/engine.h"

#include <string.h>

const char *eng_version(void)
{
	return DS_VERSION;
}

const kb_backend *eng_backend_choose(const char *want, ds_err *err)
{
	if (!want || strcmp(want, "auto") == 0) {
		const kb_backend *b = kb_backend_get("cuda", NULL);
		return b ? b : kb_backend_get("cpu", err);
	}
	return kb_backend_get(want, err);
}

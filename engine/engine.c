/*
 * engine.c - version string, backend selection and the tokenizer of a model
 * path (see engine.h).  Called by dsrun and dsagent at start-up; thread-safe
 * (no state of its own).
 */
#include "engine/engine.h"
#include "engine/gguf.h"
#include "engine/tok.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

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

int eng_path_is_gguf(const char *path)
{
	size_t n = strlen(path);
	return n > 5 && strcmp(path + n - 5, ".gguf") == 0;
}

tok *eng_tok_load(const char *path, ds_err *err)
{
	char json[4096], cfg[4096];
	if (eng_path_is_gguf(path)) { /* tokenizer.ggml.* metadata */
		gguf_file *g = gguf_open(path, err);
		tok *t = g ? tok_load_gguf(g, err) : NULL;
		gguf_close(g);
		return t;
	}
	snprintf(json, sizeof json, "%s/tokenizer.json", path);
	snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", path);
	return tok_load_hf(json, access(cfg, R_OK) == 0 ? cfg : NULL, err);
}

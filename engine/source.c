/*
 * source.c - a model source: the checkpoint opened once (see source.h).
 *
 * Callers: model.c (model_load opens one or takes the caller's, picks the
 * graph from msrc_arch), deepseek.c and llama.c (config, tensors), engine.c
 * (the tokenizer), dsrun.  Calls gguf.c, safetensors.c, common/ (whole-file
 * read of config.json, jsonx).
 *
 *   msrc_open(path)
 *     .gguf  --gguf_open--> kind GGUF (arch = general.architecture)
 *     DIR    --ds_file_read_all(config.json, MCFG_MAX_FILE_BYTES), jsonx_parse
 *            --> kind HF (arch = model_type; a config.json absent, over the
 *                cap or not a JSON object is kept as an error for
 *                msrc_config, so a tokenizer-only directory still opens)
 *   msrc_tensors (HF, first call)   --st_open--> shards mapped (page cache)
 *   msrc_hold_weights(mode) (HF)    --st_remap--> e.g. huge-page copies
 *   msrc_unref (last)               --gguf_close / st_close, json_decref
 *
 * Invariants:
 *  1. a source is opened once per path: every reader of the checkpoint in a
 *     process that holds the source goes through it;
 *  2. kind GGUF: g != NULL, st == NULL, cfg == NULL; kind HF: g == NULL;
 *  3. refs > 0 while any holder exists; the last unref frees everything.
 * Thread rule: as source.h (load on one thread, then read-only).
 */
#include "engine/source.h"

#include "common/jsonx.h"
#include "common/strutil.h"
#include "engine/gguf.h"
#include "engine/mconfig.h"
#include "engine/safetensors.h"

#include <errno.h>
#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MSRC_ARCH_MAX 64

struct msrc {
	atomic_int refs;
	enum msrc_kind kind;
	char *path;
	char arch[MSRC_ARCH_MAX];
	gguf_file *g;        /* GGUF */
	st_model *st;        /* HF: NULL until msrc_tensors */
	json_t *cfg;         /* HF: config.json, or NULL ... */
	char *cfg_path;      /* HF: DIR/config.json */
	ds_err cfg_err;      /* ... with the reason kept here */
};

static int path_is_gguf(const char *path)
{
	size_t n = strlen(path);
	return n > 5 && strcmp(path + n - 5, ".gguf") == 0;
}

static int open_gguf(msrc *s, ds_err *err)
{
	const char *arch = NULL;
	if (!(s->g = gguf_open(s->path, err)))
		return err && err->code ? err->code : DS_EIO;
	if (gguf_get_str(s->g, "general.architecture", &arch, NULL, NULL) == DS_OK)
		ds_strlcpy(s->arch, arch, sizeof s->arch);
	return DS_OK;
}

static int open_hf(msrc *s, ds_err *err)
{
	struct stat st;
	char *text = NULL;
	size_t len = 0, n = strlen(s->path) + sizeof "/config.json";
	if (stat(s->path, &st) != 0)
		return ds_err_set(err, errno == ENOENT ? DS_ENOTFOUND : DS_EIO, "model %s: %s", s->path,
				  strerror(errno));
	if (!S_ISDIR(st.st_mode))
		return ds_err_set(err, DS_EINVAL, "model %s: neither a checkpoint directory nor a "
				  ".gguf file", s->path);
	if (!(s->cfg_path = malloc(n)))
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	snprintf(s->cfg_path, n, "%s/config.json", s->path);
	/* an absent or unusable config.json is kept as an error for msrc_config:
	 * the tokenizer of a tokenizer-only directory still loads, and the model
	 * loaders report it */
	if (ds_file_read_all(s->cfg_path, MCFG_MAX_FILE_BYTES, &text, &len, &s->cfg_err))
		return DS_OK;
	s->cfg = jsonx_parse(text, len, MCFG_JSON_MAX_DEPTH, &s->cfg_err);
	free(text);
	if (!s->cfg) {
		ds_err_wrap(&s->cfg_err, "%s", s->cfg_path);
		return DS_OK;
	}
	if (!json_is_object(s->cfg)) {
		ds_err_set(&s->cfg_err, DS_EFORMAT, "%s: must be a JSON object", s->cfg_path);
		json_decref(s->cfg);
		s->cfg = NULL;
		return DS_OK;
	}
	const char *type = json_string_value(json_object_get(s->cfg, "model_type"));
	if (type)
		ds_strlcpy(s->arch, type, sizeof s->arch);
	return DS_OK;
}

msrc *msrc_open(const char *path, ds_err *err)
{
	ds_err local = {0};
	if (!err)
		err = &local;
	if (!path || !path[0]) {
		ds_err_set(err, DS_EINVAL, "no model path given");
		return NULL;
	}
	msrc *s = calloc(1, sizeof *s);
	if (!s || !(s->path = strdup(path))) {
		free(s);
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	atomic_init(&s->refs, 1);
	s->kind = path_is_gguf(path) ? MSRC_GGUF : MSRC_HF;
	int rc = s->kind == MSRC_GGUF ? open_gguf(s, err) : open_hf(s, err);
	if (rc) {
		msrc_unref(s);
		return NULL;
	}
	return s;
}

msrc *msrc_ref(msrc *s)
{
	atomic_fetch_add(&s->refs, 1);
	return s;
}

void msrc_unref(msrc *s)
{
	if (!s || atomic_fetch_sub(&s->refs, 1) != 1)
		return;
	gguf_close(s->g);
	st_close(s->st);
	json_decref(s->cfg);
	free(s->cfg_path);
	free(s->path);
	free(s);
}

enum msrc_kind msrc_kind(const msrc *s)
{
	return s->kind;
}

const char *msrc_path(const msrc *s)
{
	return s->path;
}

const char *msrc_arch(const msrc *s)
{
	return s->arch;
}

gguf_file *msrc_gguf(const msrc *s)
{
	return s->g;
}

int msrc_config(const msrc *s, const json_t **root, const char **path, ds_err *err)
{
	*root = s->cfg;
	if (path)
		*path = s->cfg_path ? s->cfg_path : s->path;
	if (s->cfg)
		return DS_OK;
	if (s->kind == MSRC_GGUF)
		return ds_err_set(err, DS_EINVAL, "%s: a GGUF file has no config.json", s->path);
	if (err)
		*err = s->cfg_err;
	return s->cfg_err.code ? s->cfg_err.code : DS_ENOTFOUND;
}

st_model *msrc_tensors(msrc *s, ds_err *err)
{
	if (s->kind != MSRC_HF) {
		ds_err_set(err, DS_EINVAL, "%s: a GGUF file has no safetensors shards", s->path);
		return NULL;
	}
	if (!s->st)
		s->st = st_open(s->path, err);
	return s->st;
}

int msrc_hold_weights(msrc *s, enum ds_map_mode mode, ds_err *err)
{
	if (s->kind != MSRC_HF)
		return DS_OK;
	st_model *st = msrc_tensors(s, err);
	return st ? st_remap(st, mode, err) : (err && err->code ? err->code : DS_EIO);
}

size_t msrc_tensor_count(msrc *s, ds_err *err)
{
	if (s->kind == MSRC_GGUF)
		return gguf_tensor_count(s->g);
	st_model *st = msrc_tensors(s, err);
	return st ? st_count(st) : 0;
}

msrc_tensor msrc_tensor_at(const msrc *s, size_t i)
{
	if (s->kind == MSRC_GGUF) {
		const gguf_tensor *t = gguf_tensor_at(s->g, i);
		return (msrc_tensor){.name = t->name, .dtype = t->dtype, .n_dims = t->n_dims};
	}
	const st_tensor *t = st_at(s->st, i);
	return (msrc_tensor){.name = t->name, .dtype = t->dtype, .n_dims = t->n_dims};
}

enum kb_dtype msrc_tensor_dtype(const msrc *s, const char *name)
{
	if (s->kind == MSRC_GGUF) {
		const gguf_tensor *t = gguf_find_tensor(s->g, name);
		return t ? t->dtype : KB_DTYPE_COUNT;
	}
	const st_tensor *t = s->st ? st_find(s->st, name) : NULL;
	return t ? t->dtype : KB_DTYPE_COUNT;
}

size_t msrc_tensor_bytes(const msrc *s)
{
	if (s->kind == MSRC_GGUF)
		return gguf_total_bytes(s->g);
	return s->st ? st_total_bytes(s->st) : 0;
}

/*
 * engine.h - the engine's top-level interface: version and backend choice.
 *
 * The model, weights, tokenizer, KV cache, scheduler and sampler modules grow
 * beside this file (see docs/architecture.md); they compute only through the
 * kb_backend chosen here.
 */
#ifndef DS_ENGINE_H
#define DS_ENGINE_H

#include "common/status.h"
#include "kernels/backend.h"

#define DS_VERSION "0.1.0"

const char *eng_version(void);

/* want: "auto" (cuda when a device is present, else cpu), "cpu" or "cuda".
 * NULL with err filled when the requested backend is unavailable. */
const kb_backend *eng_backend_choose(const char *want, ds_err *err);

/* 1 when path names a .gguf file (else it is a checkpoint directory). */
int eng_path_is_gguf(const char *path);
/* The tokenizer of a model path: a GGUF file's tokenizer.ggml.* metadata, or
 * DIR/tokenizer.json (+ DIR/tokenizer_config.json when readable). */
struct tok;
struct tok *eng_tok_load(const char *path, ds_err *err);

#endif

/*
 * engine.h - the engine's top-level interface: version, backend choice and
 * the tokenizer of a model.
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

/* The backend to run a graph that needs needs[0..n_needs) (ops x dtypes).
 * want "auto" (or NULL): cuda, then cpu, each compiled-in one checked
 * first from its table (no device needed); a cuda that lacks an op is
 * skipped with one log line "backend cuda cannot run this model (the cuda
 * backend has no matmul for bf16 weights); using cpu", one without a device
 * silently.  want "cpu" / "cuda": that backend, or DS_EUNSUPPORTED naming
 * the op it lacks.  what names the model in messages (may be NULL).  NULL
 * with err filled; the backend is borrowed for the process lifetime. */
const kb_backend *eng_backend_pick(const char *want, const kb_op_need *needs, int n_needs,
				   const char *what, ds_err *err);
/* eng_backend_pick with no needs: whether want is usable at all (dsagent's
 * start-up check; the model load makes the real choice). */
const kb_backend *eng_backend_choose(const char *want, ds_err *err);

/* The tokenizer of a model: a GGUF file's tokenizer.ggml.* metadata, or
 * DIR/tokenizer.json (+ DIR/tokenizer_config.json when readable).
 * eng_tok_load_source reads an open source (engine/source.h), e.g. the one
 * the model is loaded from; eng_tok_load(path) opens one for the call. */
struct tok;
struct msrc;
struct tok *eng_tok_load_source(const struct msrc *s, ds_err *err);
struct tok *eng_tok_load(const char *path, ds_err *err);

#endif

/*
 * test_model_load.c - model load through a model source: config.json read
 * whole under its cap, the op-support check against the chosen backend
 * (a fake backend lacking one op is refused by name), the source kept alive
 * by the model.
 *
 * The checkpoint is a tiny llama-family Hugging Face directory written here:
 * config.json + one model.safetensors with f32 norms and embeddings and bf16
 * Linear weights, so "matmul on bf16" is one of the needs.
 */
#include "tests/unit/unit.h"

#include "common/status.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/mconfig.h"
#include "engine/source.h"
#include "kernels/backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { V = 16, D = 8, F = 16, HEADS = 2, KV = 1, HD = 4 };

typedef struct tiny_t {
	const char *name;
	int bf16;
	int n_dims;
	int64_t shape[2];
} tiny_t;

static const tiny_t tiny_tensors[] = {
	{"model.embed_tokens.weight", 0, 2, {V, D}},
	{"model.norm.weight", 0, 1, {D}},
	{"lm_head.weight", 1, 2, {V, D}},
	{"model.layers.0.input_layernorm.weight", 0, 1, {D}},
	{"model.layers.0.post_attention_layernorm.weight", 0, 1, {D}},
	{"model.layers.0.self_attn.q_proj.weight", 1, 2, {HEADS * HD, D}},
	{"model.layers.0.self_attn.k_proj.weight", 1, 2, {KV * HD, D}},
	{"model.layers.0.self_attn.v_proj.weight", 1, 2, {KV * HD, D}},
	{"model.layers.0.self_attn.o_proj.weight", 1, 2, {D, HEADS * HD}},
	{"model.layers.0.mlp.gate_proj.weight", 1, 2, {F, D}},
	{"model.layers.0.mlp.up_proj.weight", 1, 2, {F, D}},
	{"model.layers.0.mlp.down_proj.weight", 1, 2, {D, F}},
};
#define N_TINY (sizeof tiny_tensors / sizeof tiny_tensors[0])

static int write_file(const char *path, const void *data, size_t n)
{
	FILE *f = fopen(path, "wb");
	if (!f)
		return -1;
	size_t w = fwrite(data, 1, n, f);
	return fclose(f) == 0 && w == n ? 0 : -1;
}

/* config.json with a "padding" string of pad bytes (0: none). */
static int write_config(const char *dir, size_t pad)
{
	char path[1024];
	static const char head[] =
		"{\"model_type\": \"llama\", \"vocab_size\": 16, \"hidden_size\": 8,"
		" \"intermediate_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 2,"
		" \"num_key_value_heads\": 1, \"max_position_embeddings\": 64, \"rms_norm_eps\": 1e-5,"
		" \"padding\": \"";
	size_t n = sizeof head - 1 + pad + 3;
	char *text = malloc(n + 1);
	if (!text)
		return -1;
	memcpy(text, head, sizeof head - 1);
	memset(text + sizeof head - 1, 'x', pad);
	memcpy(text + sizeof head - 1 + pad, "\"}\n", 4);
	snprintf(path, sizeof path, "%s/config.json", dir);
	int rc = write_file(path, text, n);
	free(text);
	return rc;
}

static int write_weights(const char *dir)
{
	char path[1024], header[4096];
	size_t hl = 0, off = 0;
	unsigned char *data = calloc(1, 64 << 10);
	if (!data)
		return -1;
	hl += (size_t)snprintf(header + hl, sizeof header - hl, "{");
	for (size_t i = 0; i < N_TINY; i++) {
		const tiny_t *t = &tiny_tensors[i];
		size_t count = (size_t)t->shape[0] * (size_t)(t->n_dims == 2 ? t->shape[1] : 1);
		size_t bytes = count * (t->bf16 ? 2 : 4);
		for (size_t j = 0; j < count; j++) {
			/* norms 1, weights small values of both signs */
			float v = t->n_dims == 1 ? 1.0f : ut_rand_float(-0.5f, 0.5f);
			uint32_t u;
			memcpy(&u, &v, 4);
			if (t->bf16) {
				uint16_t h = (uint16_t)(u >> 16);
				memcpy(data + off + j * 2, &h, 2);
			} else {
				memcpy(data + off + j * 4, &u, 4);
			}
		}
		if (t->n_dims == 1)
			hl += (size_t)snprintf(header + hl, sizeof header - hl,
					       "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld],\"data_offsets\":[%zu,%zu]}",
					       i ? "," : "", t->name, t->bf16 ? "BF16" : "F32",
					       (long long)t->shape[0], off, off + bytes);
		else
			hl += (size_t)snprintf(header + hl, sizeof header - hl,
					       "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld,%lld],\"data_offsets\":[%zu,%zu]}",
					       i ? "," : "", t->name, t->bf16 ? "BF16" : "F32",
					       (long long)t->shape[0], (long long)t->shape[1], off, off + bytes);
		off += bytes;
	}
	hl += (size_t)snprintf(header + hl, sizeof header - hl, "}");
	/* spaces up to a multiple of 8 after the length word, as Hugging Face's
	 * writer pads: the data then starts aligned for its f32 tensors */
	while ((8 + hl) % 8 && hl < sizeof header - 1)
		header[hl++] = ' ';
	snprintf(path, sizeof path, "%s/model.safetensors", dir);
	FILE *f = fopen(path, "wb");
	int rc = -1;
	if (f) {
		unsigned char len[8];
		for (int i = 0; i < 8; i++)
			len[i] = (unsigned char)((uint64_t)hl >> (8 * i));
		rc = fwrite(len, 1, 8, f) == 8 && fwrite(header, 1, hl, f) == hl &&
				     fwrite(data, 1, off, f) == off
			     ? 0
			     : -1;
		if (fclose(f) != 0)
			rc = -1;
	}
	free(data);
	return rc;
}

/* One decode step of token 3 at position 0; 0 when the logits are finite. */
static int step_ok(model *m)
{
	int32_t tok = 3, pos = 0, seq = 0, table = 0;
	float logits[V];
	eng_batch b = {.n_tok = 1, .tokens = &tok, .pos = &pos, .seq = &seq, .n_seq = 1,
		       .block_tables = &table, .max_blocks = 1};
	ds_err err = {0};
	if (model_forward(m, &b, logits, &err) != DS_OK)
		return -1;
	for (int i = 0; i < V; i++)
		if (!isfinite(logits[i]))
			return -1;
	return 0;
}

static model_params tiny_params(const char *dir)
{
	model_params p = model_default_params();
	p.path = dir;
	p.backend = "cpu";
	p.threads = 1;
	p.max_batch_tokens = 4;
	p.max_seqs = 1;
	p.max_ctx = 16;
	return p;
}

/* A config.json longer than the engine's old fixed buffers (64 KiB in the
 * architecture sniffing, 1 MiB in the llama loader, both truncating
 * silently) loads; one over MCFG_MAX_FILE_BYTES is refused naming the file
 * and the cap. */
TEST(model_load_reads_config_whole_under_its_cap)
{
	char *dir = ut_tmpdir_new("mload");
	if (!dir)
		return;
	char cfg[1024];
	snprintf(cfg, sizeof cfg, "%s/config.json", dir);
	CHECK_EQ(write_weights(dir), 0);
	CHECK_EQ(write_config(dir, (size_t)3 << 19), 0); /* 1.5 MiB of padding */
	model_params p = tiny_params(dir);
	ds_err err = {0};
	model *m = model_load(&p, &err);
	CHECK(m != NULL);
	if (!m)
		fprintf(stderr, "  load: %s\n", err.msg);
	if (m) {
		CHECK_STR(model_arch_name(m), "llama");
		CHECK_EQ(model_vocab_size(m), V);
		CHECK_EQ(step_ok(m), 0);
	}
	model_free(m);

	CHECK_EQ(truncate(cfg, (off_t)MCFG_MAX_FILE_BYTES + 1), 0);
	err = (ds_err){0};
	CHECK(model_load(&p, &err) == NULL);
	CHECK_EQ(err.code, DS_ERANGE);
	CHECK(strstr(err.msg, cfg) != NULL);
	CHECK(strstr(err.msg, "at most 4194304") != NULL);
	ut_tmpdir_free(dir);
}

/* The cpu backend's table with matmul on bf16 denied. */
static int deny_bf16_matmul(enum kb_op op, enum kb_dtype dtype)
{
	if (op == KB_OP_MATMUL && dtype == KB_BF16)
		return 0;
	return kb_backend_get("cpu", NULL)->supports_op(op, dtype);
}

static int deny_paged_attn(enum kb_op op, enum kb_dtype dtype)
{
	return op != KB_OP_PAGED_ATTN && kb_backend_get("cpu", NULL)->supports_op(op, dtype);
}

TEST(model_load_refuses_a_backend_lacking_an_op)
{
	char *dir = ut_tmpdir_new("mload");
	if (!dir)
		return;
	CHECK_EQ(write_weights(dir), 0);
	CHECK_EQ(write_config(dir, 0), 0);
	kb_backend fake = *kb_backend_get("cpu", NULL);
	fake.name = "fake";
	fake.supports_op = deny_bf16_matmul;
	model_params p = tiny_params(dir);
	p.backend_override = &fake;
	ds_err err = {0};
	CHECK(model_load(&p, &err) == NULL);
	CHECK_EQ(err.code, DS_EUNSUPPORTED);
	CHECK(strstr(err.msg, "the fake backend has no matmul for bf16 weights") != NULL);
	CHECK(strstr(err.msg, dir) != NULL);

	fake.supports_op = deny_paged_attn;
	err = (ds_err){0};
	CHECK(model_load(&p, &err) == NULL);
	CHECK(strstr(err.msg, "the fake backend has no paged_attn") != NULL);

	/* the same object with every op it needs runs the model */
	fake.supports_op = kb_backend_get("cpu", NULL)->supports_op;
	err = (ds_err){0};
	model *m = model_load(&p, &err);
	CHECK(m != NULL);
	if (m) {
		CHECK_STR(model_backend_name(m), "fake");
		CHECK_EQ(step_ok(m), 0);
	}
	model_free(m);
	ut_tmpdir_free(dir);
}

/* A source opened by the caller: model_load takes its own reference, so the
 * caller may drop its one right away and the weights stay mapped. */
TEST(model_load_keeps_the_source)
{
	char *dir = ut_tmpdir_new("mload");
	if (!dir)
		return;
	CHECK_EQ(write_weights(dir), 0);
	CHECK_EQ(write_config(dir, 0), 0);
	ds_err err = {0};
	msrc *s = msrc_open(dir, &err);
	CHECK(s != NULL);
	if (!s) {
		ut_tmpdir_free(dir);
		return;
	}
	CHECK_EQ(msrc_kind(s), MSRC_HF);
	CHECK_STR(msrc_arch(s), "llama");
	model_params p = tiny_params("/nonexistent/path/is/not/opened");
	p.source = s;
	model *m = model_load(&p, &err);
	msrc_unref(s);
	CHECK(m != NULL);
	if (m)
		CHECK_EQ(step_ok(m), 0);
	model_free(m);

	/* a directory without config.json opens (tokenizer-only), the model
	 * load then names the missing file */
	char cfg[1024];
	snprintf(cfg, sizeof cfg, "%s/config.json", dir);
	CHECK_EQ(unlink(cfg), 0);
	err = (ds_err){0};
	s = msrc_open(dir, &err);
	CHECK(s != NULL);
	p.source = s;
	CHECK(s && model_load(&p, &err) == NULL);
	CHECK_EQ(err.code, DS_ENOTFOUND);
	CHECK(strstr(err.msg, cfg) != NULL);
	msrc_unref(s);
	ut_tmpdir_free(dir);
}

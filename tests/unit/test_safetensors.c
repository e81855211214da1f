/*
 * test_safetensors.c - unit tests of engine/safetensors: single files, sharded
 * checkpoints with an index, FP8 weight+scale pairs, and corrupt files
 * (truncated, flipped bytes, lying headers) that must fail with a message
 * naming the file, never crash.  Fixtures are written at run time into a
 * mkdtemp directory and removed afterwards.
 */
#include "engine/safetensors.h"
#include "tests/unit/unit.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- fixture helpers ---- */

typedef struct fx {
	const char *name, *dtype;
	int nd;
	int64_t shape[4];
} fx;

static size_t fx_elem(const char *dtype)
{
	if (strcmp(dtype, "F32") == 0 || strcmp(dtype, "I32") == 0)
		return 4;
	if (strcmp(dtype, "F16") == 0 || strcmp(dtype, "BF16") == 0)
		return 2;
	if (strcmp(dtype, "I64") == 0 || strcmp(dtype, "F64") == 0)
		return 8;
	return 1;
}

static size_t fx_bytes(const fx *t)
{
	size_t n = fx_elem(t->dtype);
	for (int i = 0; i < t->nd; i++)
		n *= (size_t)t->shape[i];
	return n;
}

static void path_in(char *buf, size_t size, const char *dir, const char *name)
{
	snprintf(buf, size, "%s/%s", dir, name);
}

/* Writes u64 LE len(header) + header + data. */
static void write_raw(const char *path, const char *header, size_t hlen, const void *data,
		      size_t dlen)
{
	FILE *f = fopen(path, "wb");
	unsigned char len[8];
	for (int i = 0; i < 8; i++)
		len[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
	CHECK(f != NULL);
	if (!f)
		return;
	fwrite(len, 1, 8, f);
	fwrite(header, 1, hlen, f);
	if (dlen)
		fwrite(data, 1, dlen, f);
	fclose(f);
}

static void write_text(const char *path, const char *text)
{
	FILE *f = fopen(path, "wb");
	CHECK(f != NULL);
	if (f) {
		fputs(text, f);
		fclose(f);
	}
}

/* A valid shard with random contents; returns the data area (caller frees)
 * and its size; *offs[i] gets tensor i's begin offset. */
static unsigned char *write_shard(const char *path, const fx *ts, int n, size_t *dlen,
				  size_t *offs)
{
	char h[8192];
	size_t hl = (size_t)snprintf(h, sizeof h, "{\"__metadata__\":{\"format\":\"pt\"}");
	size_t off = 0;
	for (int i = 0; i < n; i++) {
		hl += (size_t)snprintf(h + hl, sizeof h - hl,
				       ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", ts[i].name,
				       ts[i].dtype);
		for (int d = 0; d < ts[i].nd; d++)
			hl += (size_t)snprintf(h + hl, sizeof h - hl, "%s%lld", d ? "," : "",
					       (long long)ts[i].shape[d]);
		offs[i] = off;
		off += fx_bytes(&ts[i]);
		hl += (size_t)snprintf(h + hl, sizeof h - hl, "],\"data_offsets\":[%zu,%zu]}",
				       offs[i], off);
	}
	hl += (size_t)snprintf(h + hl, sizeof h - hl, "}");
	while (hl % 8) /* pad like the safetensors writer */
		h[hl++] = ' ';
	unsigned char *data = malloc(off ? off : 1);
	for (size_t i = 0; i < off; i++)
		data[i] = (unsigned char)ut_rand_u64();
	write_raw(path, h, hl, data, off);
	*dlen = off;
	return data;
}

static int contains(const char *hay, const char *needle)
{
	return hay && needle && strstr(hay, needle) != NULL;
}

#define CHECK_HAS(msg, needle)                                                           \
	do {                                                                             \
		if (!contains((msg), (needle)))                                          \
			ut_fail(__FILE__, __LINE__, "message \"%s\" lacks \"%s\"", (msg), \
				(needle));                                               \
	} while (0)

static size_t file_size(const char *path)
{
	struct stat st;
	return stat(path, &st) == 0 ? (size_t)st.st_size : 0;
}

/* ---- a single file ---- */

static const fx single[] = {
	{"model.norm.weight", "BF16", 1, {64}},
	{"w.q", "F8_E4M3", 2, {40, 300}},
	{"w.q_scale_inv", "F32", 2, {3, 19}}, /* block 16 */
	{"scalar", "F32", 0, {0}},
	{"ids", "I64", 1, {5}},
	{"empty", "F16", 2, {0, 4}},
	{"half", "F16", 3, {2, 3, 5}},
};
#define N_SINGLE ((int)(sizeof single / sizeof single[0]))

TEST(st_single_file_maps_every_tensor)
{
	char *dir = ut_tmpdir_new("st"), path[1024];
	size_t dlen, offs[N_SINGLE];
	path_in(path, sizeof path, dir, "model.safetensors");
	unsigned char *data = write_shard(path, single, N_SINGLE, &dlen, offs);
	ds_err err = {0};
	st_model *m = st_open(dir, &err);
	CHECK(m != NULL);
	if (!m)
		goto out;
	CHECK_EQ(st_count(m), N_SINGLE);
	CHECK_EQ(st_shard_count(m), 1);
	CHECK_STR(st_shard_path(m, 0), path);
	CHECK_EQ(st_file_bytes(m), file_size(path));
	size_t total = 0;
	for (int i = 0; i < N_SINGLE; i++) {
		const st_tensor *t = st_find(m, single[i].name);
		CHECK(t != NULL);
		if (!t)
			continue;
		CHECK(t == st_at(m, (size_t)i)); /* header order */
		CHECK_STR(t->name, single[i].name);
		CHECK_STR(t->dtype_name, single[i].dtype);
		CHECK_EQ(t->n_dims, single[i].nd);
		for (int d = 0; d < t->n_dims; d++)
			CHECK_EQ(t->shape[d], single[i].shape[d]);
		CHECK_EQ(t->nbytes, fx_bytes(&single[i]));
		CHECK(t->nbytes == 0 || memcmp(t->data, data + offs[i], t->nbytes) == 0);
		total += t->nbytes;
	}
	CHECK_EQ(st_total_bytes(m), total);
	CHECK_EQ(st_find(m, "model.norm.weight")->dtype, KB_BF16);
	CHECK_EQ(st_find(m, "w.q")->dtype, KB_F8_E4M3);
	CHECK_EQ(st_find(m, "ids")->dtype, ST_DTYPE_NONE);
	CHECK(st_find(m, "model.norm") == NULL);
	CHECK(st_at(m, N_SINGLE) == NULL);
	st_close(m);
out:
	free(data);
	ut_tmpdir_free(dir);
}

TEST(st_get_validates_dtype_and_shape)
{
	char *dir = ut_tmpdir_new("st"), path[1024], want[1200];
	size_t dlen, offs[N_SINGLE];
	path_in(path, sizeof path, dir, "model.safetensors");
	free(write_shard(path, single, N_SINGLE, &dlen, offs));
	ds_err err = {0};
	st_model *m = st_open(dir, &err);
	CHECK(m != NULL);
	if (!m)
		goto out;
	int64_t s64[1] = {64}, s63[1] = {63}, any[1] = {-1}, s235[3] = {2, -1, 5};
	int64_t s236[3] = {2, 3, 6};
	CHECK(st_get(m, "model.norm.weight", KB_BF16, 1, s64, &err) != NULL);
	CHECK(st_get(m, "model.norm.weight", ST_DTYPE_ANY, 1, any, &err) != NULL);
	CHECK(st_get(m, "model.norm.weight", KB_BF16, -1, NULL, &err) != NULL);
	CHECK(st_get(m, "half", KB_F16, 3, s235, &err) != NULL);
	CHECK(st_get(m, "scalar", KB_F32, 0, NULL, &err) != NULL);

	CHECK(st_get(m, "model.norm.weight", KB_BF16, 1, s63, &err) == NULL);
	CHECK_EQ(err.code, DS_EFORMAT);
	CHECK_STR(err.msg, "tensor model.norm.weight: expected shape [63], found [64]");
	CHECK(st_get(m, "half", KB_F16, 3, s236, &err) == NULL);
	CHECK_STR(err.msg, "tensor half: expected shape [2, 3, 6], found [2, 3, 5]");
	CHECK(st_get(m, "half", KB_F16, 2, s236, &err) == NULL);
	CHECK_STR(err.msg, "tensor half: expected shape [2, 3], found [2, 3, 5]");
	CHECK(st_get(m, "model.norm.weight", KB_F32, 1, s64, &err) == NULL);
	CHECK_EQ(err.code, DS_EFORMAT);
	CHECK_STR(err.msg, "tensor model.norm.weight: dtype F32 expected, found BF16");
	CHECK(st_get(m, "ids", ST_DTYPE_ANY, -1, NULL, &err) == NULL);
	CHECK_EQ(err.code, DS_EUNSUPPORTED);
	CHECK_STR(err.msg, "tensor ids: dtype I64 is not supported (F32, F16, BF16, F8_E4M3 are)");
	CHECK(st_get(m, "nope", ST_DTYPE_ANY, -1, NULL, &err) == NULL);
	CHECK_EQ(err.code, DS_ENOTFOUND);
	snprintf(want, sizeof want, "tensor nope not found in the checkpoint (dir %s)", dir);
	CHECK_STR(err.msg, want);
	st_close(m);
out:
	ut_tmpdir_free(dir);
}

TEST(st_get_fp8_pairs_weight_and_block_scale)
{
	char *dir = ut_tmpdir_new("st"), path[1024];
	size_t dlen, offs[N_SINGLE];
	path_in(path, sizeof path, dir, "model.safetensors");
	free(write_shard(path, single, N_SINGLE, &dlen, offs));
	ds_err err = {0};
	st_model *m = st_open(dir, &err);
	CHECK(m != NULL);
	if (!m)
		goto out;
	const st_tensor *scale = NULL;
	const st_tensor *w = st_get_fp8(m, "w.q", 40, 300, 16, &scale, &err);
	CHECK(w != NULL && w == st_find(m, "w.q"));
	CHECK(scale != NULL && scale == st_find(m, "w.q_scale_inv"));
	CHECK(st_get_fp8(m, "w.q", 40, 300, 128, &scale, &err) == NULL);
	CHECK_EQ(err.code, DS_EFORMAT);
	CHECK_STR(err.msg, "FP8 weight w.q (block 128) needs its scale: tensor w.q_scale_inv: "
			   "expected shape [1, 3], found [3, 19]");
	CHECK(st_get_fp8(m, "w.q", 40, 301, 16, &scale, &err) == NULL);
	CHECK_STR(err.msg, "tensor w.q: expected shape [40, 301], found [40, 300]");
	CHECK(st_get_fp8(m, "model.norm.weight", 64, 1, 16, &scale, &err) == NULL);
	CHECK_HAS(err.msg, "dtype F8_E4M3 expected, found BF16");
	CHECK(st_get_fp8(m, "w.q", 40, 300, 0, &scale, &err) == NULL);
	CHECK_EQ(err.code, DS_EINVAL);
	st_close(m);
out:
	ut_tmpdir_free(dir);
}

/* ---- sharded checkpoints ---- */

static const fx shard_a[] = {
	{"model.embed_tokens.weight", "BF16", 2, {17, 8}},
	{"model.layers.0.self_attn.q_a_proj.weight", "F8_E4M3", 2, {32, 64}},
};
static const fx shard_b[] = {
	{"model.layers.0.self_attn.q_a_proj.weight_scale_inv", "F32", 2, {1, 1}},
	{"model.layers.0.mlp.gate.e_score_correction_bias", "F32", 1, {8}},
};
static const fx shard_c[] = {
	{"lm_head.weight", "BF16", 2, {17, 8}},
	{"model.norm.weight", "BF16", 1, {8}},
	{"extra.not_in_index", "U8", 1, {3}},
};

/* Three shards, names chosen so that no name parser could guess them. */
static const char *const shard_names[3] = {"model-00001-of-000163.safetensors",
					   "model-00002-of-000163.safetensors",
					   "zz-last.bin.safetensors"};

static void write_index(const char *dir, const char *extra_entry)
{
	char p[1024], text[4096];
	const fx *sets[3] = {shard_a, shard_b, shard_c};
	int ns[3] = {2, 2, 2}; /* extra.not_in_index is deliberately unlisted */
	size_t tl = (size_t)snprintf(text, sizeof text,
				     "{\"metadata\": {\"total_size\": 1234},\n \"weight_map\": {");
	const char *sep = "";
	for (int s = 0; s < 3; s++) {
		for (int i = 0; i < ns[s]; i++) {
			tl += (size_t)snprintf(text + tl, sizeof text - tl, "%s\n  \"%s\": \"%s\"",
					       sep, sets[s][i].name, shard_names[s]);
			sep = ",";
		}
	}
	if (extra_entry)
		tl += (size_t)snprintf(text + tl, sizeof text - tl, ",\n  %s", extra_entry);
	snprintf(text + tl, sizeof text - tl, "\n }\n}\n");
	path_in(p, sizeof p, dir, "model.safetensors.index.json");
	write_text(p, text);
}

static void write_shards(const char *dir, size_t offs[3][4], unsigned char *data[3])
{
	char p[1024];
	size_t dlen;
	const fx *sets[3] = {shard_a, shard_b, shard_c};
	int ns[3] = {2, 2, 3};
	for (int s = 0; s < 3; s++) {
		path_in(p, sizeof p, dir, shard_names[s]);
		data[s] = write_shard(p, sets[s], ns[s], &dlen, offs[s]);
	}
}

static void free3(unsigned char *data[3])
{
	for (int s = 0; s < 3; s++)
		free(data[s]);
}

TEST(st_index_opens_each_shard_once_and_finds_tensors)
{
	char *dir = ut_tmpdir_new("st"), p[1024];
	size_t offs[3][4];
	unsigned char *data[3];
	write_shards(dir, offs, data);
	write_index(dir, NULL);
	/* a stray model.safetensors must be ignored when the index exists */
	path_in(p, sizeof p, dir, "model.safetensors");
	write_text(p, "garbage");
	ds_err err = {0};
	st_model *m = st_open(dir, &err);
	CHECK(m != NULL);
	if (!m) {
		printf("  %s\n", err.msg);
		goto out;
	}
	CHECK_EQ(st_shard_count(m), 3);
	CHECK_EQ(st_count(m), 7);
	const st_tensor *w = st_find(m, "model.layers.0.self_attn.q_a_proj.weight");
	CHECK(w != NULL && memcmp(w->data, data[0] + offs[0][1], w->nbytes) == 0);
	path_in(p, sizeof p, dir, shard_names[0]);
	CHECK_STR(st_shard_path(m, w->shard), p);
	const st_tensor *bias = st_find(m, "model.layers.0.mlp.gate.e_score_correction_bias");
	CHECK(bias != NULL && memcmp(bias->data, data[1] + offs[1][1], 32) == 0);
	const st_tensor *head = st_find(m, "lm_head.weight");
	CHECK(head != NULL && memcmp(head->data, data[2] + offs[2][0], 17 * 8 * 2) == 0);
	CHECK(st_find(m, "extra.not_in_index") != NULL);
	const st_tensor *scale = NULL;
	CHECK(st_get_fp8(m, "model.layers.0.self_attn.q_a_proj.weight", 32, 64, 128, &scale,
			 &err) == w);
	CHECK(scale != NULL && scale->shard != w->shard);
	size_t files = 0;
	for (int s = 0; s < 3; s++) {
		path_in(p, sizeof p, dir, shard_names[s]);
		files += file_size(p);
	}
	CHECK_EQ(st_file_bytes(m), files);
	st_close(m);
out:
	free3(data);
	ut_tmpdir_free(dir);
}

TEST(st_huge_page_copy_holds_the_same_bytes)
{
	char *dir = ut_tmpdir_new("st");
	size_t offs[3][4];
	unsigned char *data[3];
	write_shards(dir, offs, data);
	write_index(dir, NULL);
	ds_err err = {0};
	st_model *a = st_open(dir, &err), *b = st_open_mode(dir, DS_MAP_HUGE_COPY, &err);
	CHECK(a != NULL && b != NULL);
	if (a && b) {
		CHECK_EQ(st_count(b), st_count(a));
		CHECK_EQ(st_file_bytes(b), st_file_bytes(a));
		for (size_t i = 0; i < st_count(a); i++) {
			const st_tensor *ta = st_at(a, i), *tb = st_find(b, ta->name);
			CHECK(tb != NULL && tb->nbytes == ta->nbytes && tb->data != ta->data);
			if (tb)
				CHECK(memcmp(tb->data, ta->data, ta->nbytes) == 0);
		}
		const st_tensor *w = st_find(b, "model.layers.0.self_attn.q_a_proj.weight");
		CHECK(w != NULL && memcmp(w->data, data[0] + offs[0][1], w->nbytes) == 0);
	}
	st_close(a);
	st_close(b);
	/* st_remap: the file mapping moved into huge pages, every tensor with it */
	a = st_open(dir, &err);
	CHECK(a != NULL);
	if (a) {
		const st_tensor *w = st_find(a, "model.layers.0.self_attn.q_a_proj.weight");
		const void *before = w->data;
		CHECK_EQ(st_remap(a, DS_MAP_HUGE_COPY, &err), DS_OK);
		CHECK(w->data != before && memcmp(w->data, data[0] + offs[0][1], w->nbytes) == 0);
		CHECK_EQ(st_remap(a, DS_MAP_HUGE_COPY, &err), DS_OK); /* already so */
		for (size_t i = 0; i < st_count(a); i++)
			CHECK(st_at(a, i)->nbytes == 0 || st_at(a, i)->data != NULL);
		st_close(a);
	}
	/* errors as in the mapped form: a missing shard is named */
	char p[1024];
	path_in(p, sizeof p, dir, shard_names[1]);
	remove(p);
	CHECK(st_open_mode(dir, DS_MAP_HUGE_COPY, &err) == NULL);
	CHECK(strstr(err.msg, shard_names[1]) != NULL);
	free3(data);
	ut_tmpdir_free(dir);
}

TEST(st_index_errors_name_tensor_and_shard)
{
	char *dir = ut_tmpdir_new("st"), p[1024], want[2048];
	size_t offs[3][4];
	unsigned char *data[3];
	ds_err err = {0};
	write_shards(dir, offs, data);

	write_index(dir, "\"model.layers.1.ghost\": \"model-00002-of-000163.safetensors\"");
	CHECK(st_open(dir, &err) == NULL);
	CHECK_EQ(err.code, DS_EFORMAT);
	snprintf(want, sizeof want,
		 "tensor model.layers.1.ghost is listed in %s/model.safetensors.index.json but "
		 "absent from its shard %s/model-00002-of-000163.safetensors", dir, dir);
	CHECK_STR(err.msg, want);

	write_index(dir, "\"extra.not_in_index\": \"model-00001-of-000163.safetensors\"");
	CHECK(st_open(dir, &err) == NULL);
	CHECK_HAS(err.msg, "tensor extra.not_in_index: ");
	CHECK_HAS(err.msg, "names shard");
	CHECK_HAS(err.msg, "zz-last.bin.safetensors");

	write_index(dir, "\"x\": \"model-00009-of-000163.safetensors\"");
	CHECK(st_open(dir, &err) == NULL);
	CHECK_EQ(err.code, DS_ENOTFOUND);
	snprintf(want, sizeof want, "%s/model-00009-of-000163.safetensors", dir);
	CHECK_HAS(err.msg, want);

	write_index(dir, "\"x\": \"../model.safetensors\"");
	CHECK(st_open(dir, &err) == NULL);
	CHECK_HAS(err.msg, "weight_map[\"x\"] must be a file name");

	write_index(dir, "\"x\": 3");
	CHECK(st_open(dir, &err) == NULL);
	CHECK_HAS(err.msg, "weight_map[\"x\"]");

	path_in(p, sizeof p, dir, "model.safetensors.index.json");
	write_text(p, "{\"metadata\": {}}");
	CHECK(st_open(dir, &err) == NULL);
	CHECK_HAS(err.msg, "model.safetensors.index.json: 'weight_map' missing");

	write_text(p, "{\"weight_map\": {\n  \"a\": \"b\",\n  oops}}");
	CHECK(st_open(dir, &err) == NULL);
	CHECK_EQ(err.code, DS_EFORMAT);
	CHECK_HAS(err.msg, "model.safetensors.index.json: invalid JSON at line 3 column");

	CHECK_EQ(truncate(p, (off_t)ST_MAX_INDEX_BYTES + 1), 0); /* sparse, never read */
	CHECK(st_open(dir, &err) == NULL);
	CHECK_EQ(err.code, DS_ERANGE);
	CHECK_HAS(err.msg, "model.safetensors.index.json is 104857601 bytes; at most 104857600");
	free3(data);
	ut_tmpdir_free(dir);
}

TEST(st_duplicate_tensor_across_shards_is_an_error)
{
	char *dir = ut_tmpdir_new("st"), p[1024];
	size_t dlen, offs[2];
	const fx a[] = {{"dup", "F32", 1, {2}}, {"a", "F32", 1, {1}}};
	const fx b[] = {{"b", "F32", 1, {1}}, {"dup", "F32", 1, {2}}};
	path_in(p, sizeof p, dir, "s1.safetensors");
	free(write_shard(p, a, 2, &dlen, offs));
	path_in(p, sizeof p, dir, "s2.safetensors");
	free(write_shard(p, b, 2, &dlen, offs));
	path_in(p, sizeof p, dir, "model.safetensors.index.json");
	write_text(p, "{\"weight_map\": {\"dup\": \"s1.safetensors\", \"b\": \"s2.safetensors\"}}");
	ds_err err = {0};
	CHECK(st_open(dir, &err) == NULL);
	CHECK_HAS(err.msg, "tensor dup appears twice");
	CHECK_HAS(err.msg, "s1.safetensors");
	CHECK_HAS(err.msg, "s2.safetensors");
	ut_tmpdir_free(dir);
}

TEST(st_missing_paths_are_named)
{
	char *dir = ut_tmpdir_new("st"), p[1024], want[1200];
	ds_err err = {0};
	path_in(p, sizeof p, dir, "nowhere");
	CHECK(st_open(p, &err) == NULL);
	CHECK_EQ(err.code, DS_ENOTFOUND);
	snprintf(want, sizeof want, "checkpoint directory %s: No such file or directory", p);
	CHECK_STR(err.msg, want);

	CHECK(st_open(dir, &err) == NULL);
	CHECK_EQ(err.code, DS_ENOTFOUND);
	snprintf(want, sizeof want,
		 "checkpoint directory %s has neither model.safetensors.index.json nor "
		 "model.safetensors", dir);
	CHECK_STR(err.msg, want);

	path_in(p, sizeof p, dir, "file");
	write_text(p, "x");
	CHECK(st_open(p, &err) == NULL);
	CHECK_HAS(err.msg, "not a directory");
	st_close(NULL);
	ut_tmpdir_free(dir);
}

/* ---- corrupt files ---- */

/* Writes `header` (+ dlen random data bytes) as dir/model.safetensors and
 * expects st_open to fail with a message naming the file and holding `want`. */
static void expect_header_error(const char *dir, const char *header, size_t dlen,
				const char *want, int line, int case_no)
{
	char p[1024];
	unsigned char data[64];
	for (size_t i = 0; i < sizeof data; i++)
		data[i] = (unsigned char)ut_rand_u64();
	path_in(p, sizeof p, dir, "model.safetensors");
	write_raw(p, header, strlen(header), data, dlen);
	ds_err err = {0};
	st_model *m = st_open(dir, &err);
	if (m) {
		ut_fail(__FILE__, line, "case %d: accepted header %s", case_no, header);
		st_close(m);
		return;
	}
	if (!contains(err.msg, p) || !contains(err.msg, want))
		ut_fail(__FILE__, line, "case %d: message \"%s\" lacks the path or \"%s\"",
			case_no, err.msg, want);
}

TEST(st_lying_headers_are_rejected_with_the_reason)
{
	char *dir = ut_tmpdir_new("st");
	static const struct {
		const char *header;
		size_t dlen;
		const char *want;
	} cases[] = {
		{"[1, 2]", 0, "JSON must be an object"},
		{"{\"a\": {", 0, "invalid JSON at line 1 column"},
		{"{\"a\": 5}", 0, "tensor a: entry must be an object"},
		{"{\"a\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", 4,
		 "tensor a: 'dtype' missing"},
		{"{\"a\": {\"dtype\": 7, \"shape\": [1], \"data_offsets\": [0, 4]}}", 4,
		 "tensor a: 'dtype' missing or not a string"},
		{"{\"a\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", 4,
		 "tensor a: 'shape' must be an array"},
		{"{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 4,
		 "tensor a: shape[0] must be a non-negative integer"},
		{"{\"a\": {\"dtype\": \"F32\", \"shape\": [1, 2.5], \"data_offsets\": [0, 4]}}", 4,
		 "tensor a: shape[1] must be a non-negative integer"},
		{"{\"a\": {\"dtype\": \"U8\", \"shape\": [1,1,1,1,1,1,1,1,1], "
		 "\"data_offsets\": [0, 1]}}", 1, "tensor a: 9 dimensions; at most 8"},
		{"{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}", 4,
		 "tensor a: 'data_offsets' must be [begin, end]"},
		{"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4]}}", 4,
		 "tensor a: 'data_offsets' must be [begin, end]"},
		{"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, -4]}}", 4,
		 "tensor a: 'data_offsets' must be [begin, end]"},
		{"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 4]}}", 16,
		 "tensor a: data_offsets [8, 4] outside the data area of 16 bytes"},
		{"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}", 12,
		 "tensor a: data_offsets [0, 16] outside the data area of 12 bytes"},
		{"{\"a\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 16]}}", 16,
		 "tensor a: F32 shape needs 3 x 4 bytes but data_offsets span 16"},
		{"{\"a\": {\"dtype\": \"BF16\", \"shape\": [4611686018427387904, 8], "
		 "\"data_offsets\": [0, 16]}}", 16, "tensor a: shape overflows"},
		{"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
		 "\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}", 8,
		 "invalid JSON"},
		{"{\"__metadata__\": [[[[[[[[[[1]]]]]]]]]]}", 0, "nested 11 levels deep"},
	};
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
		expect_header_error(dir, cases[i].header, cases[i].dlen, cases[i].want, __LINE__,
				    (int)i);
	ut_tmpdir_free(dir);
}

TEST(st_unknown_dtypes_are_listed_not_fatal)
{
	char *dir = ut_tmpdir_new("st"), p[1024];
	const char *h =
		"{\"mask\": {\"dtype\": \"BOOL\", \"shape\": [3], \"data_offsets\": [0, 3]},"
		"\"packed\": {\"dtype\": \"F4\", \"shape\": [4], \"data_offsets\": [3, 5]},"
		"\"e5\": {\"dtype\": \"F8_E5M2\", \"shape\": [3], \"data_offsets\": [5, 8]}}";
	unsigned char data[8] = {1, 0, 1, 9, 9, 1, 2, 3};
	path_in(p, sizeof p, dir, "model.safetensors");
	write_raw(p, h, strlen(h), data, sizeof data);
	ds_err err = {0};
	st_model *m = st_open(dir, &err);
	CHECK(m != NULL);
	if (m) {
		CHECK_EQ(st_count(m), 3);
		CHECK_STR(st_find(m, "packed")->dtype_name, "F4");
		CHECK_EQ(st_find(m, "packed")->nbytes, 2);
		CHECK(st_get(m, "e5", ST_DTYPE_ANY, -1, NULL, &err) == NULL);
		CHECK_STR(err.msg, "tensor e5: dtype F8_E5M2 is not supported (F32, F16, BF16, "
				   "F8_E4M3 are)");
		st_close(m);
	}
	/* a BOOL tensor whose size disagrees with its shape is still a format error */
	expect_header_error(dir,
			    "{\"mask\": {\"dtype\": \"BOOL\", \"shape\": [3], "
			    "\"data_offsets\": [0, 2]}}", 2,
			    "BOOL shape needs 3 x 1 bytes but data_offsets span 2", __LINE__, 0);
	ut_tmpdir_free(dir);
}

TEST(st_truncated_and_oversized_headers)
{
	char *dir = ut_tmpdir_new("st"), p[1024];
	ds_err err = {0};
	path_in(p, sizeof p, dir, "model.safetensors");
	for (size_t n = 0; n < 8; n++) {
		write_raw(p, "", 0, NULL, 0);
		if (truncate(p, (off_t)n) != 0)
			CHECK(0);
		CHECK(st_open(dir, &err) == NULL);
		CHECK_EQ(err.code, DS_EFORMAT);
		CHECK_HAS(err.msg, p);
		CHECK_HAS(err.msg, "truncated");
	}
	/* header length larger than the file */
	write_raw(p, "{\"a\":{}}", 8, NULL, 0);
	if (truncate(p, 12) != 0)
		CHECK(0);
	CHECK(st_open(dir, &err) == NULL);
	CHECK_HAS(err.msg, "header length 8 exceeds the file (12 bytes)");
	/* header length above the 100 MiB cap, in a sparse file that is large enough */
	{
		uint64_t n = (uint64_t)ST_MAX_HEADER_BYTES + 1;
		unsigned char len[8];
		for (int i = 0; i < 8; i++)
			len[i] = (unsigned char)(n >> (8 * i));
		int fd = open(p, O_WRONLY | O_TRUNC);
		CHECK(fd >= 0);
		if (fd >= 0) {
			CHECK_EQ(write(fd, len, 8), 8);
			CHECK_EQ(ftruncate(fd, (off_t)(n + 64)), 0);
			close(fd);
		}
		CHECK(st_open(dir, &err) == NULL);
		CHECK_HAS(err.msg, p);
		CHECK_HAS(err.msg, "exceeds the limit of 104857600");
	}
	ut_tmpdir_free(dir);
}

/* Touches every byte of every tensor so a bad mapping would fault. */
static unsigned touch_all(const st_model *m)
{
	unsigned sum = 0;
	for (size_t i = 0; i < st_count(m); i++) {
		const st_tensor *t = st_at(m, i);
		for (size_t b = 0; b < t->nbytes; b++)
			sum += ((const unsigned char *)t->data)[b];
	}
	return sum;
}

TEST(st_every_truncation_and_random_flips_fail_cleanly)
{
	char *dir = ut_tmpdir_new("st"), p[1024];
	size_t dlen, offs[N_SINGLE];
	path_in(p, sizeof p, dir, "model.safetensors");
	free(write_shard(p, single, N_SINGLE, &dlen, offs));
	size_t size = file_size(p);
	unsigned char *orig = malloc(size), *buf = malloc(size);
	FILE *f = fopen(p, "rb");
	CHECK(f && fread(orig, 1, size, f) == size);
	if (f)
		fclose(f);
	ds_err err = {0};
	/* every strict prefix must be rejected (the last tensor ends at EOF) */
	for (size_t n = 0; n < size; n++) {
		if (truncate(p, (off_t)n) != 0)
			CHECK(0);
		st_model *m = st_open(dir, &err);
		if (m) {
			ut_fail(__FILE__, __LINE__, "accepted a file truncated to %zu of %zu", n,
				size);
			st_close(m);
		} else if (!contains(err.msg, p)) {
			ut_fail(__FILE__, __LINE__, "truncated to %zu: \"%s\"", n, err.msg);
		}
	}
	/* random byte flips (odd rounds: anywhere; even: in the length and JSON):
	 * success with sane tensors, or a named error */
	size_t head = 8 + (size_t)orig[0] + ((size_t)orig[1] << 8);
	int ok = 0, failed = 0;
	for (int it = 0; it < 1500; it++) {
		memcpy(buf, orig, size);
		int flips = 1 + (int)(ut_rand_u64() % 3);
		for (int k = 0; k < flips; k++) {
			size_t at = (size_t)(ut_rand_u64() % (it % 2 ? size : head));
			if (ut_rand_u64() % 2)
				buf[at] = (unsigned char)ut_rand_u64();
			else
				buf[at] ^= (unsigned char)(1u << (ut_rand_u64() % 8));
		}
		f = fopen(p, "wb");
		fwrite(buf, 1, size, f);
		fclose(f);
		st_model *m = st_open(dir, &err);
		if (m) {
			ok++;
			(void)touch_all(m);
			for (size_t i = 0; i < st_count(m); i++)
				CHECK(st_at(m, i)->nbytes <= size);
			st_close(m);
		} else {
			failed++;
			if (!contains(err.msg, p))
				ut_fail(__FILE__, __LINE__, "flip %d: \"%s\" lacks the path", it,
					err.msg);
		}
	}
	CHECK(ok > 0 && failed > 0); /* both outcomes happen */
	free(orig);
	free(buf);
	ut_tmpdir_free(dir);
}

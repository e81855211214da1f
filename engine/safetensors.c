/*
 * safetensors.c - open a Hugging Face safetensors checkpoint (see safetensors.h).
 *
 * Called by the model source (engine/source.c: st_open when the loader
 * first asks for tensors, st_remap once the backend is chosen) and tests;
 * calls jansson and common/ (ds_file_map, ds_file_read_all for the index).
 * Thread rule: st_open/st_close on one thread; the st_model is immutable in
 * between, so lookups from many threads need no lock.
 *
 * Load sequence (st_open):
 *
 *   dir --stat--> index.json present? --yes--> read_index: weight_map -> shard list
 *                      |                             |
 *                      no -> one shard "model.safetensors"
 *                                                    v
 *            for each shard: map_shard (open, fstat, ds_file_map, close fd)
 *                            parse_header (bounds, JSON, one add_tensor per entry)
 *                                                    v
 *            indexed only: check_index (every listed tensor sits in its shard)
 *
 *   st_remap(mode): each shard mapped again as mode says, its tensors' data
 *   pointers moved by the same offset, the old mapping dropped.
 *
 * File layout: u64 little-endian N, N bytes of JSON, then the data buffer;
 * data_offsets are relative to the first byte after the JSON.
 *
 * Invariants once st_open returns a model:
 *  1. every tensor's [data, data + nbytes) lies inside its shard's mapping;
 *  2. for a known dtype, nbytes == product(shape) * element size;
 *  3. names are unique across all shards; `map` finds each in O(1);
 *  4. with an index, the tensor set of the index is a subset of the shards'
 *     and each sits in the shard the index names (extra tensors in a shard
 *     are kept).
 */
#include "engine/safetensors.h"

#include "common/fileutil.h"
#include "common/jsonx.h"
#include "common/strutil.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define INDEX_NAME "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"
#define HEADER_MAX_DEPTH 8
#define DTYPE_NAME_MAX 16

/* ---- string -> int hash map (open addressing; keys are borrowed) ---- */

typedef struct strmap {
	const char **keys; /* NULL = empty slot */
	int32_t *vals;
	size_t cap;        /* power of two, or 0 */
	size_t n;
} strmap;

static uint64_t hash_str(const char *s)
{
	uint64_t h = 1469598103934665603ull; /* FNV-1a */
	for (; *s; s++) {
		h ^= (unsigned char)*s;
		h *= 1099511628211ull;
	}
	return h;
}

static size_t map_slot(const strmap *mp, const char *key)
{
	size_t i = hash_str(key) & (mp->cap - 1);
	while (mp->keys[i] && strcmp(mp->keys[i], key) != 0)
		i = (i + 1) & (mp->cap - 1);
	return i;
}

static int32_t map_get(const strmap *mp, const char *key)
{
	if (mp->cap == 0)
		return -1;
	size_t i = map_slot(mp, key);
	return mp->keys[i] ? mp->vals[i] : -1;
}

static int map_grow(strmap *mp)
{
	size_t cap = mp->cap ? mp->cap * 2 : 64;
	strmap nm = {calloc(cap, sizeof *nm.keys), calloc(cap, sizeof *nm.vals), cap, 0};
	if (!nm.keys || !nm.vals) {
		free(nm.keys);
		free(nm.vals);
		return DS_ENOMEM;
	}
	for (size_t i = 0; i < mp->cap; i++) {
		if (!mp->keys[i])
			continue;
		size_t j = map_slot(&nm, mp->keys[i]);
		nm.keys[j] = mp->keys[i];
		nm.vals[j] = mp->vals[i];
		nm.n++;
	}
	free(mp->keys);
	free(mp->vals);
	*mp = nm;
	return DS_OK;
}

/* Inserts key -> val.  Returns DS_OK, DS_ENOMEM, or 1 when the key was
 * already there (*old gets its value; nothing changes). */
static int map_put(strmap *mp, const char *key, int32_t val, int32_t *old)
{
	if ((mp->n + 1) * 2 > mp->cap && map_grow(mp) != DS_OK)
		return DS_ENOMEM;
	size_t i = map_slot(mp, key);
	if (mp->keys[i]) {
		*old = mp->vals[i];
		return 1;
	}
	mp->keys[i] = key;
	mp->vals[i] = val;
	mp->n++;
	return DS_OK;
}

static void map_free(strmap *mp)
{
	free(mp->keys);
	free(mp->vals);
}

/* ---- the model ---- */

typedef struct shard_file {
	char *name;  /* as in the index, e.g. "model-00001-of-000163.safetensors" */
	char *path;  /* dir/name */
	void *map;   /* read-only (ds_file_map); NULL until mapped */
	size_t size, map_len;
} shard_file;

typedef struct entry {
	st_tensor t; /* first: st_at returns &entry.t */
	char dtype[DTYPE_NAME_MAX];
} entry;

struct st_model {
	char *dir;
	shard_file *shards;
	int n_shards, cap_shards;
	strmap shard_ix; /* shard name -> index */
	entry *ents;
	size_t n, cap;
	strmap tensor_ix; /* tensor name -> index into ents */
	size_t total_bytes, file_bytes;
	char *index_path; /* dir/model.safetensors.index.json, or NULL (single file) */
	enum ds_map_mode map_mode;
};

/* dtype strings of the safetensors format; kb < 0: not supported by kernels. */
static const struct {
	const char *name;
	int kb;
	size_t size;
} dtypes[] = {
	{"F32", KB_F32, 4}, {"F16", KB_F16, 2}, {"BF16", KB_BF16, 2}, {"F8_E4M3", KB_F8_E4M3, 1},
	{"F64", -1, 8},     {"I64", -1, 8},     {"U64", -1, 8},       {"I32", -1, 4},
	{"U32", -1, 4},     {"I16", -1, 2},     {"U16", -1, 2},       {"I8", -1, 1},
	{"U8", -1, 1},      {"BOOL", -1, 1},    {"F8_E5M2", -1, 1},   {"F8_E8M0", -1, 1},
};

const char *st_dtype_name(enum kb_dtype t)
{
	for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
		if (dtypes[i].kb >= 0 && dtypes[i].kb == (int)t)
			return dtypes[i].name;
	return "?";
}

/* Element size and kernel dtype of a header dtype string; size 0 = unknown
 * string (kept as unsupported; its byte count cannot be checked). */
static size_t dtype_lookup(const char *name, enum kb_dtype *kb)
{
	*kb = ST_DTYPE_NONE;
	for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
		if (strcmp(dtypes[i].name, name) == 0) {
			if (dtypes[i].kb >= 0)
				*kb = (enum kb_dtype)dtypes[i].kb;
			return dtypes[i].size;
		}
	}
	return 0;
}

static char *path_join(const char *dir, const char *name)
{
	size_t n = strlen(dir) + strlen(name) + 2;
	char *p = malloc(n);
	if (p)
		snprintf(p, n, "%s/%s", dir, name);
	return p;
}

static int add_shard(st_model *m, const char *name, int *idx, ds_err *err)
{
	int32_t old;
	if (m->n_shards == m->cap_shards) {
		int cap = m->cap_shards ? m->cap_shards * 2 : 8;
		shard_file *s = realloc(m->shards, (size_t)cap * sizeof *s);
		if (!s)
			return ds_err_set(err, DS_ENOMEM, "out of memory listing shards");
		m->shards = s;
		m->cap_shards = cap;
	}
	shard_file *s = &m->shards[m->n_shards];
	memset(s, 0, sizeof *s);
	s->name = strdup(name);
	s->path = s->name ? path_join(m->dir, name) : NULL;
	if (!s->path) {
		free(s->name);
		return ds_err_set(err, DS_ENOMEM, "out of memory listing shards");
	}
	int rc = map_put(&m->shard_ix, s->name, m->n_shards, &old);
	if (rc < 0) {
		free(s->name);
		free(s->path);
		return ds_err_set(err, DS_ENOMEM, "out of memory listing shards");
	}
	*idx = m->n_shards++;
	return DS_OK;
}

/* ---- one shard: map it, then parse its header ---- */

static int map_shard(st_model *m, shard_file *s, ds_err *err)
{
	int fd = open(s->path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return ds_err_set(err, errno == ENOENT ? DS_ENOTFOUND : DS_EIO, "%s: %s%s", s->path,
				  strerror(errno), m->index_path ? " (named by the index)" : "");
	int rc = DS_OK;
	struct stat st;
	if (fstat(fd, &st) != 0) {
		rc = ds_err_set(err, DS_EIO, "%s: %s", s->path, strerror(errno));
		goto out;
	}
	if (!S_ISREG(st.st_mode)) {
		rc = ds_err_set(err, DS_EFORMAT, "%s: not a regular file", s->path);
		goto out;
	}
	s->size = (size_t)st.st_size;
	if (s->size < 8) {
		rc = ds_err_set(err, DS_EFORMAT,
				"%s: truncated: %zu bytes, a safetensors file starts with an "
				"8-byte header length", s->path, s->size);
		goto out;
	}
	if ((rc = ds_file_map(fd, s->path, s->size, m->map_mode, &s->map, &s->map_len, err)))
		goto out;
	m->file_bytes += s->size;
out:
	close(fd);
	return rc;
}

static uint64_t read_u64_le(const unsigned char *p)
{
	uint64_t v = 0;
	for (int i = 7; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

/* 0 and *out set for a non-negative JSON integer, else -1. */
static int get_count(const json_t *v, uint64_t *out)
{
	if (!json_is_integer(v) || json_integer_value(v) < 0)
		return -1;
	*out = (uint64_t)json_integer_value(v);
	return 0;
}

static int parse_shape(const shard_file *s, const char *name, const json_t *shape, st_tensor *t,
		       uint64_t *count, ds_err *err)
{
	if (!json_is_array(shape))
		return ds_err_set(err, DS_EFORMAT, "%s: tensor %s: 'shape' must be an array",
				  s->path, name);
	size_t nd = json_array_size(shape);
	if (nd > ST_MAX_DIMS)
		return ds_err_set(err, DS_EFORMAT, "%s: tensor %s: %zu dimensions; at most %d",
				  s->path, name, nd, ST_MAX_DIMS);
	*count = 1;
	for (size_t i = 0; i < nd; i++) {
		uint64_t d;
		if (get_count(json_array_get(shape, i), &d) != 0 || d > INT64_MAX)
			return ds_err_set(err, DS_EFORMAT, "%s: tensor %s: shape[%zu] must be a "
					  "non-negative integer", s->path, name, i);
		if (__builtin_mul_overflow(*count, d, count))
			return ds_err_set(err, DS_EFORMAT, "%s: tensor %s: shape overflows",
					  s->path, name);
		t->shape[i] = (int64_t)d;
	}
	t->n_dims = (int)nd;
	return DS_OK;
}

static int parse_offsets(const shard_file *s, const char *name, const json_t *offs,
			 uint64_t data_len, uint64_t *begin, uint64_t *end, ds_err *err)
{
	if (!json_is_array(offs) || json_array_size(offs) != 2 ||
	    get_count(json_array_get(offs, 0), begin) != 0 ||
	    get_count(json_array_get(offs, 1), end) != 0)
		return ds_err_set(err, DS_EFORMAT,
				  "%s: tensor %s: 'data_offsets' must be [begin, end] with "
				  "non-negative integers", s->path, name);
	if (*begin > *end || *end > data_len)
		return ds_err_set(err, DS_EFORMAT,
				  "%s: tensor %s: data_offsets [%llu, %llu] outside the data area "
				  "of %llu bytes", s->path, name, (unsigned long long)*begin,
				  (unsigned long long)*end, (unsigned long long)data_len);
	return DS_OK;
}

static int push_entry(st_model *m, entry **e, ds_err *err)
{
	if (m->n == m->cap) {
		size_t cap = m->cap ? m->cap * 2 : 256;
		entry *p = realloc(m->ents, cap * sizeof *p);
		if (!p)
			return ds_err_set(err, DS_ENOMEM, "out of memory listing tensors");
		m->ents = p;
		m->cap = cap;
	}
	*e = &m->ents[m->n];
	memset(*e, 0, sizeof **e);
	return DS_OK;
}

/* Registers the entry just filled at m->ents[m->n] under its (owned) name. */
static int commit_entry(st_model *m, int si, ds_err *err)
{
	entry *e = &m->ents[m->n];
	int32_t old;
	int rc = map_put(&m->tensor_ix, e->t.name, (int32_t)m->n, &old);
	if (rc == 1) {
		const shard_file *a = &m->shards[m->ents[old].t.shard];
		rc = ds_err_set(err, DS_EFORMAT, "tensor %s appears twice: in %s and in %s",
				e->t.name, a->path, m->shards[si].path);
	} else if (rc < 0) {
		rc = ds_err_set(err, DS_ENOMEM, "out of memory indexing tensors");
	}
	if (rc != DS_OK) {
		free((char *)e->t.name);
		return rc;
	}
	m->total_bytes += e->t.nbytes;
	m->n++;
	return DS_OK;
}

static int add_tensor(st_model *m, int si, const char *name, const json_t *v,
		      const unsigned char *data, uint64_t data_len, ds_err *err)
{
	const shard_file *s = &m->shards[si];
	if (!json_is_object(v))
		return ds_err_set(err, DS_EFORMAT, "%s: tensor %s: entry must be an object",
				  s->path, name);
	const json_t *dt = json_object_get(v, "dtype");
	if (!json_is_string(dt))
		return ds_err_set(err, DS_EFORMAT, "%s: tensor %s: 'dtype' missing or not a string",
				  s->path, name);
	entry *e = NULL;
	int rc = push_entry(m, &e, err);
	if (rc)
		return rc;
	uint64_t count = 0, begin = 0, end = 0;
	rc = parse_shape(s, name, json_object_get(v, "shape"), &e->t, &count, err);
	if (!rc)
		rc = parse_offsets(s, name, json_object_get(v, "data_offsets"), data_len, &begin,
				   &end, err);
	if (rc)
		return rc;
	ds_strlcpy(e->dtype, json_string_value(dt), sizeof e->dtype);
	size_t esize = dtype_lookup(json_string_value(dt), &e->t.dtype);
	uint64_t want;
	if (esize && (__builtin_mul_overflow(count, esize, &want) || want != end - begin))
		return ds_err_set(err, DS_EFORMAT,
				  "%s: tensor %s: %s shape needs %llu x %zu bytes but data_offsets "
				  "span %llu", s->path, name, e->dtype, (unsigned long long)count,
				  esize, (unsigned long long)(end - begin));
	e->t.dtype_name = e->dtype;
	e->t.data = data + begin;
	e->t.nbytes = (size_t)(end - begin);
	e->t.shard = si;
	e->t.name = strdup(name);
	if (!e->t.name)
		return ds_err_set(err, DS_ENOMEM, "out of memory listing tensors");
	return commit_entry(m, si, err);
}

/* Parses JSON refusing duplicate keys and deep nesting; errors name `what`. */
static json_t *parse_json(const char *what, const char *text, size_t len, ds_err *err)
{
	int depth = jsonx_depth(text, len);
	if (depth > HEADER_MAX_DEPTH) {
		ds_err_set(err, DS_EFORMAT, "%s: JSON nested %d levels deep (limit %d)", what,
			   depth, HEADER_MAX_DEPTH);
		return NULL;
	}
	json_error_t je;
	json_t *v = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
	if (!v)
		ds_err_set(err, DS_EFORMAT, "%s: invalid JSON at line %d column %d: %s", what,
			   je.line, je.column, je.text);
	else if (!json_is_object(v)) {
		ds_err_set(err, DS_EFORMAT, "%s: JSON must be an object", what);
		json_decref(v);
		v = NULL;
	}
	return v;
}

static int parse_header(st_model *m, int si, ds_err *err)
{
	const shard_file *s = &m->shards[si];
	const unsigned char *p = s->map;
	uint64_t n = read_u64_le(p);
	if (n > s->size - 8)
		return ds_err_set(err, DS_EFORMAT,
				  "%s: header length %llu exceeds the file (%zu bytes): truncated "
				  "or not a safetensors file", s->path, (unsigned long long)n,
				  s->size);
	if (n > ST_MAX_HEADER_BYTES)
		return ds_err_set(err, DS_EFORMAT, "%s: header length %llu exceeds the limit of %u",
				  s->path, (unsigned long long)n, ST_MAX_HEADER_BYTES);
	json_t *h = parse_json(s->path, (const char *)p + 8, (size_t)n, err);
	if (!h)
		return err->code;
	int rc = DS_OK;
	const char *key;
	json_t *v;
	json_object_foreach(h, key, v) {
		if (strcmp(key, "__metadata__") == 0)
			continue;
		rc = add_tensor(m, si, key, v, p + 8 + n, s->size - 8 - n, err);
		if (rc)
			break;
	}
	json_decref(h);
	return rc;
}

/* ---- the index ---- */

/* A shard must be a plain file name inside the checkpoint directory. */
static int shard_name_ok(const char *s)
{
	return s[0] && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

/* Parses the index and registers its shards in first-seen order.  *root_out
 * is owned (caller decrefs); *wmap_out is borrowed from it. */
static int read_index(st_model *m, json_t **wmap_out, json_t **root_out, ds_err *err)
{
	char *text = NULL;
	size_t len = 0;
	int rc = ds_file_read_all(m->index_path, ST_MAX_INDEX_BYTES, &text, &len, err);
	if (rc)
		return rc;
	json_t *root = parse_json(m->index_path, text, len, err);
	free(text);
	if (!root)
		return err->code;
	json_t *wmap = json_object_get(root, "weight_map");
	if (!json_is_object(wmap)) {
		rc = ds_err_set(err, DS_EFORMAT, "%s: 'weight_map' missing or not an object",
				m->index_path);
		goto out;
	}
	const char *name;
	json_t *v;
	json_object_foreach(wmap, name, v) {
		int idx;
		if (!json_is_string(v) || !shard_name_ok(json_string_value(v))) {
			rc = ds_err_set(err, DS_EFORMAT,
					"%s: weight_map[\"%s\"] must be a file name in the "
					"checkpoint directory", m->index_path, name);
			goto out;
		}
		if (map_get(&m->shard_ix, json_string_value(v)) < 0 &&
		    (rc = add_shard(m, json_string_value(v), &idx, err)) != DS_OK)
			goto out;
	}
	*wmap_out = wmap;
	*root_out = root;
	root = NULL;
out:
	json_decref(root);
	return rc;
}

static int check_index(const st_model *m, const json_t *wmap, ds_err *err)
{
	const char *name;
	json_t *v;
	json_object_foreach((json_t *)wmap, name, v) {
		int want = map_get(&m->shard_ix, json_string_value(v));
		int32_t i = map_get(&m->tensor_ix, name);
		if (i < 0)
			return ds_err_set(err, DS_EFORMAT,
					  "tensor %s is listed in %s but absent from its shard %s",
					  name, m->index_path, m->shards[want].path);
		if (m->ents[i].t.shard != want)
			return ds_err_set(err, DS_EFORMAT,
					  "tensor %s: %s names shard %s, but it is in %s", name,
					  m->index_path, m->shards[want].path,
					  m->shards[m->ents[i].t.shard].path);
	}
	return DS_OK;
}

/* ---- public ---- */

static int locate(st_model *m, ds_err *err)
{
	struct stat st;
	if (stat(m->dir, &st) != 0)
		return ds_err_set(err, errno == ENOENT ? DS_ENOTFOUND : DS_EIO,
				  "checkpoint directory %s: %s", m->dir, strerror(errno));
	if (!S_ISDIR(st.st_mode))
		return ds_err_set(err, DS_ENOTFOUND, "checkpoint directory %s: not a directory",
				  m->dir);
	m->index_path = path_join(m->dir, INDEX_NAME);
	if (!m->index_path)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	if (stat(m->index_path, &st) == 0)
		return DS_OK;
	free(m->index_path);
	m->index_path = NULL;
	int idx;
	int rc = add_shard(m, SINGLE_NAME, &idx, err);
	if (rc)
		return rc;
	if (stat(m->shards[0].path, &st) != 0)
		return ds_err_set(err, DS_ENOTFOUND,
				  "checkpoint directory %s has neither %s nor %s", m->dir,
				  INDEX_NAME, SINGLE_NAME);
	return DS_OK;
}

st_model *st_open(const char *dir, ds_err *err)
{
	return st_open_mode(dir, DS_MAP_FILE, err);
}

st_model *st_open_mode(const char *dir, enum ds_map_mode mode, ds_err *err)
{
	ds_err local = {0};
	if (!err)
		err = &local;
	json_t *root = NULL, *wmap = NULL;
	st_model *m = calloc(1, sizeof *m);
	int rc = m ? DS_OK : ds_err_set(err, DS_ENOMEM, "out of memory");
	if (m)
		m->map_mode = mode;
	if (!rc && !(m->dir = strdup(dir)))
		rc = ds_err_set(err, DS_ENOMEM, "out of memory");
	if (!rc)
		rc = locate(m, err);
	if (!rc && m->index_path)
		rc = read_index(m, &wmap, &root, err);
	for (int i = 0; !rc && i < m->n_shards; i++) {
		rc = map_shard(m, &m->shards[i], err);
		if (!rc)
			rc = parse_header(m, i, err);
	}
	if (!rc && wmap)
		rc = check_index(m, wmap, err);
	json_decref(root);
	if (rc) {
		st_close(m);
		return NULL;
	}
	return m;
}

int st_remap(st_model *m, enum ds_map_mode mode, ds_err *err)
{
	if (m->map_mode == mode)
		return DS_OK;
	for (int i = 0; i < m->n_shards; i++) {
		shard_file *s = &m->shards[i];
		void *map = NULL;
		size_t map_len = 0;
		int fd = open(s->path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			return ds_err_set(err, errno == ENOENT ? DS_ENOTFOUND : DS_EIO, "%s: %s", s->path,
					  strerror(errno));
		int rc = ds_file_map(fd, s->path, s->size, mode, &map, &map_len, err);
		close(fd);
		if (rc)
			return rc;
		/* the same bytes at a new address: every tensor of the shard moves */
		for (size_t j = 0; j < m->n; j++) {
			st_tensor *t = &m->ents[j].t;
			if (t->shard == i)
				t->data = (const char *)map + ((const char *)t->data - (const char *)s->map);
		}
		ds_file_unmap(s->map, s->map_len);
		s->map = map;
		s->map_len = map_len;
	}
	m->map_mode = mode;
	return DS_OK;
}

void st_close(st_model *m)
{
	if (!m)
		return;
	for (size_t i = 0; i < m->n; i++)
		free((char *)m->ents[i].t.name);
	for (int i = 0; i < m->n_shards; i++) {
		ds_file_unmap(m->shards[i].map, m->shards[i].map_len);
		free(m->shards[i].name);
		free(m->shards[i].path);
	}
	map_free(&m->tensor_ix);
	map_free(&m->shard_ix);
	free(m->ents);
	free(m->shards);
	free(m->index_path);
	free(m->dir);
	free(m);
}

const st_tensor *st_find(const st_model *m, const char *name)
{
	int32_t i = map_get(&m->tensor_ix, name);
	return i < 0 ? NULL : &m->ents[i].t;
}

/* "[32, 64]"; negative dims print as "*". */
static void shape_str(char *buf, size_t size, int n_dims, const int64_t *shape)
{
	size_t off = (size_t)snprintf(buf, size, "[");
	for (int i = 0; i < n_dims && off < size; i++) {
		if (shape[i] < 0)
			off += (size_t)snprintf(buf + off, size - off, "%s*", i ? ", " : "");
		else
			off += (size_t)snprintf(buf + off, size - off, "%s%lld", i ? ", " : "",
						(long long)shape[i]);
	}
	if (off < size)
		snprintf(buf + off, size - off, "]");
}

static int shape_matches(const st_tensor *t, int n_dims, const int64_t *shape)
{
	if (n_dims < 0)
		return 1;
	if (t->n_dims != n_dims)
		return 0;
	for (int i = 0; i < n_dims; i++)
		if (shape[i] >= 0 && shape[i] != t->shape[i])
			return 0;
	return 1;
}

const st_tensor *st_get(const st_model *m, const char *name, enum kb_dtype dtype, int n_dims,
			const int64_t *shape, ds_err *err)
{
	const st_tensor *t = st_find(m, name);
	if (!t) {
		ds_err_set(err, DS_ENOTFOUND, "tensor %s not found in the checkpoint (dir %s)",
			   name, m->dir);
		return NULL;
	}
	if (t->dtype == ST_DTYPE_NONE) {
		ds_err_set(err, DS_EUNSUPPORTED,
			   "tensor %s: dtype %s is not supported (F32, F16, BF16, F8_E4M3 are)",
			   name, t->dtype_name);
		return NULL;
	}
	if (dtype != ST_DTYPE_ANY && t->dtype != dtype) {
		ds_err_set(err, DS_EFORMAT, "tensor %s: dtype %s expected, found %s", name,
			   st_dtype_name(dtype), t->dtype_name);
		return NULL;
	}
	if (!shape_matches(t, n_dims, shape)) {
		char want[160], got[160];
		shape_str(want, sizeof want, n_dims, shape);
		shape_str(got, sizeof got, t->n_dims, t->shape);
		ds_err_set(err, DS_EFORMAT, "tensor %s: expected shape %s, found %s", name, want,
			   got);
		return NULL;
	}
	return t;
}

const st_tensor *st_get_fp8(const st_model *m, const char *name, int64_t n, int64_t k,
			    int64_t block, const st_tensor **scale, ds_err *err)
{
	char sname[512];
	if (block <= 0 || n <= 0 || k <= 0) {
		ds_err_set(err, DS_EINVAL, "tensor %s: FP8 shape [%lld, %lld] block %lld must be "
			   "positive", name, (long long)n, (long long)k, (long long)block);
		return NULL;
	}
	if ((size_t)snprintf(sname, sizeof sname, "%s_scale_inv", name) >= sizeof sname) {
		ds_err_set(err, DS_EINVAL, "tensor name too long: %s", name);
		return NULL;
	}
	int64_t wshape[2] = {n, k};
	int64_t sshape[2] = {(n + block - 1) / block, (k + block - 1) / block};
	const st_tensor *w = st_get(m, name, KB_F8_E4M3, 2, wshape, err);
	const st_tensor *s = w ? st_get(m, sname, KB_F32, 2, sshape, err) : NULL;
	if (w && !s) {
		ds_err_wrap(err, "FP8 weight %s (block %lld) needs its scale", name,
			    (long long)block);
		return NULL;
	}
	*scale = s;
	return w;
}

size_t st_count(const st_model *m)
{
	return m->n;
}

const st_tensor *st_at(const st_model *m, size_t i)
{
	return i < m->n ? &m->ents[i].t : NULL;
}

size_t st_total_bytes(const st_model *m)
{
	return m->total_bytes;
}

size_t st_file_bytes(const st_model *m)
{
	return m->file_bytes;
}

int st_shard_count(const st_model *m)
{
	return m->n_shards;
}

const char *st_shard_path(const st_model *m, int i)
{
	return i >= 0 && i < m->n_shards ? m->shards[i].path : NULL;
}

/*
 * gguf.c - open and validate a GGUF file (see gguf.h for the layout and the API).
 *
 * Called by the model source (engine/source.c, which the graphs and
 * tok_gguf.c's tokenizer read through) and tests; calls
 * common/ (ds_file_map).  Thread rule: gguf_open/gguf_close on one thread; the
 * gguf_file is immutable in between, so lookups from many threads need no lock.
 *
 * Load sequence (gguf_open):
 *
 *   path --map_file (open, fstat, ds_file_map, close fd)--> mapping
 *        --parse_header: magic, version, counts (bounded by the file size)
 *        --parse_kvs: n_kv x (key, type, value); values become `rec`s
 *        --parse_tensor_infos: n_tensors x (name, dims, type, offset)
 *        --place_tensors: data start = align(end of infos); sizes and ranges
 *
 * Every read goes through `struct rd`, which refuses to step past the end of
 * the mapping and says what it was reading.  A count read from the file
 * never sizes an allocation before it is bounded by the bytes left: each
 * element takes at least one byte (a string 8, an array 12, a metadata entry
 * 13, a tensor info 24).
 *
 * Values: a metadata value (top level or array element) is a `rec`: its type,
 * the file offset of its payload (scalar bytes, string bytes, first array
 * element) and a length (string bytes, array elements).  Arrays of strings or
 * of arrays keep one rec per element, contiguous in g->recs from `first`, so
 * element i is O(1) at any depth.
 *
 * Invariants once gguf_open returns a file:
 *  1. every rec's payload lies inside the mapping (strings: off + n <= size;
 *     fixed-size arrays: off + n * elem size <= size);
 *  2. keys are unique and NUL-free; tensor names likewise; the maps find each
 *     in O(1);
 *  3. for a tensor of a type known here: ne[0] is a multiple of the block,
 *     nbytes = ne[0] / block * block bytes * ne[1] * ne[2] * ne[3], and
 *     [data, data + nbytes) lies inside the mapping; offset % alignment == 0;
 *  4. alignment is a power of two (general.alignment, a u32, or 32).
 */
#include "engine/gguf.h"

#include "common/fileutil.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Values are read byte by byte (little-endian), but the typed getters copy
 * the low bytes of a u64 into the caller's type. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "gguf.c assumes a little-endian host");

#define KEY_ALIGNMENT "general.alignment"
#define NAME_SHOW 64 /* bytes of a name or key quoted in a message */

/* ---- ggml types ------------------------------------------------------------ */

static const struct {
	uint32_t id;
	const char *name;
	uint32_t block;
	uint32_t bytes; /* per block */
	int kb;         /* enum kb_dtype, or -1 */
} ggml_types[] = {
	{ 0, "F32", 1, 4, KB_F32 },         { 1, "F16", 1, 2, KB_F16 },
	{ 2, "Q4_0", 32, 18, KB_Q4_0 },     { 3, "Q4_1", 32, 20, KB_Q4_1 },
	{ 6, "Q5_0", 32, 22, -1 },          { 7, "Q5_1", 32, 24, -1 },
	{ 8, "Q8_0", 32, 34, KB_Q8_0 },     { 9, "Q8_1", 32, 40, -1 },
	{ 10, "Q2_K", 256, 84, -1 },        { 11, "Q3_K", 256, 110, -1 },
	{ 12, "Q4_K", 256, 144, KB_Q4_K },  { 13, "Q5_K", 256, 176, KB_Q5_K },
	{ 14, "Q6_K", 256, 210, KB_Q6_K },  { 15, "Q8_K", 256, 292, -1 },
	{ 16, "IQ2_XXS", 256, 66, -1 },     { 17, "IQ2_XS", 256, 74, -1 },
	{ 18, "IQ3_XXS", 256, 98, -1 },     { 19, "IQ1_S", 256, 50, -1 },
	{ 20, "IQ4_NL", 32, 18, -1 },       { 21, "IQ3_S", 256, 110, -1 },
	{ 22, "IQ2_S", 256, 82, -1 },       { 23, "IQ4_XS", 256, 136, -1 },
	{ 24, "I8", 1, 1, -1 },             { 25, "I16", 1, 2, -1 },
	{ 26, "I32", 1, 4, -1 },            { 27, "I64", 1, 8, -1 },
	{ 28, "F64", 1, 8, -1 },            { 29, "IQ1_M", 256, 56, -1 },
	{ 30, "BF16", 1, 2, KB_BF16 },      { 34, "TQ1_0", 256, 54, -1 },
	{ 35, "TQ2_0", 256, 66, -1 },       { 39, "MXFP4", 32, 17, -1 },
};
#define N_GGML_TYPES (sizeof ggml_types / sizeof ggml_types[0])

static int ggml_index(uint32_t id)
{
	for (size_t i = 0; i < N_GGML_TYPES; i++)
		if (ggml_types[i].id == id)
			return (int)i;
	return -1;
}

enum kb_dtype gguf_ggml_to_dtype(uint32_t id)
{
	int i = ggml_index(id);
	return i >= 0 && ggml_types[i].kb >= 0 ? (enum kb_dtype)ggml_types[i].kb : GGUF_DTYPE_NONE;
}

const char *gguf_ggml_type_name(uint32_t id)
{
	int i = ggml_index(id);
	return i >= 0 ? ggml_types[i].name : "?";
}

int gguf_dtype_to_ggml(enum kb_dtype t)
{
	for (size_t i = 0; i < N_GGML_TYPES; i++)
		if (ggml_types[i].kb >= 0 && ggml_types[i].kb == (int)t)
			return (int)ggml_types[i].id;
	return -1;
}

/* ---- metadata value types ------------------------------------------------------ */

static const char *const type_names[GGUF_TYPE_COUNT] = {
	"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64",
};

/* Bytes of a fixed-size value; 0 for string and array. */
static const uint8_t type_size[GGUF_TYPE_COUNT] = { 1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8 };

const char *gguf_type_name(enum gguf_type t)
{
	return (unsigned)t < GGUF_TYPE_COUNT ? type_names[t] : "?";
}

static int type_is_int(enum gguf_type t)
{
	return t <= GGUF_TYPE_I32 || t == GGUF_TYPE_BOOL || t == GGUF_TYPE_U64 || t == GGUF_TYPE_I64;
}

/* ---- string -> index hash map (open addressing; keys borrowed) ----------------- */

typedef struct strmap {
	const char **keys; /* NULL = empty slot */
	uint32_t *vals;
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
	return h ^ (h >> 29);
}

static size_t map_slot(const strmap *mp, const char *key)
{
	size_t i = hash_str(key) & (mp->cap - 1);
	while (mp->keys[i] && strcmp(mp->keys[i], key) != 0)
		i = (i + 1) & (mp->cap - 1);
	return i;
}

static int64_t map_get(const strmap *mp, const char *key)
{
	if (mp->cap == 0)
		return -1;
	size_t i = map_slot(mp, key);
	return mp->keys[i] ? (int64_t)mp->vals[i] : -1;
}

/* Sized once for n keys (load factor <= 1/2). */
static int map_init(strmap *mp, size_t n)
{
	size_t cap = 16;
	while (cap < 2 * n + 2)
		cap <<= 1;
	mp->keys = calloc(cap, sizeof *mp->keys);
	mp->vals = calloc(cap, sizeof *mp->vals);
	mp->cap = cap;
	mp->n = 0;
	return mp->keys && mp->vals ? DS_OK : DS_ENOMEM;
}

/* 0 inserted, 1 already present (*old set). */
static int map_put(strmap *mp, const char *key, uint32_t val, uint32_t *old)
{
	size_t i = map_slot(mp, key);
	if (mp->keys[i]) {
		*old = mp->vals[i];
		return 1;
	}
	mp->keys[i] = key;
	mp->vals[i] = val;
	mp->n++;
	return 0;
}

static void map_free(strmap *mp)
{
	free(mp->keys);
	free(mp->vals);
}

/* ---- the file -------------------------------------------------------------------- */

typedef struct rec {
	uint64_t off;   /* file offset of the payload */
	uint64_t n;     /* string: bytes; array: elements */
	uint32_t first; /* arrays of strings / arrays: recs[first .. first + n) */
	uint8_t type;   /* enum gguf_type */
	uint8_t elem;   /* arrays: element type */
} rec;

typedef struct kv {
	char *key;
	char *str; /* scalar strings: NUL-terminated copy */
	rec v;
} kv;

typedef struct tinfo {
	gguf_tensor t; /* first: gguf_tensor_at returns &tinfo.t */
	char type_buf[16];
} tinfo;

struct gguf_file {
	char *path;
	const unsigned char *map;
	size_t size;
	uint32_t version, alignment;
	size_t data_off;
	kv *kvs;
	size_t n_kv;
	rec *recs; /* array elements of strings / arrays */
	size_t n_recs, cap_recs;
	strmap kv_ix;
	tinfo *ts;
	size_t n_t;
	strmap t_ix;
	size_t total_bytes;
};

/* ---- the bounded reader ------------------------------------------------------------ */

struct rd {
	gguf_file *g;
	size_t off;
	ds_err *err;
};

static int rd_need(struct rd *r, uint64_t n, const char *what)
{
	if (n > r->g->size - r->off)
		return ds_err_set(r->err, DS_EFORMAT,
				  "%s: truncated: %s needs %llu bytes at offset %zu, the file has %zu",
				  r->g->path, what, (unsigned long long)n, r->off, r->g->size);
	return DS_OK;
}

static uint64_t le(const unsigned char *p, unsigned n)
{
	uint64_t v = 0;
	for (unsigned i = n; i-- > 0;)
		v = (v << 8) | p[i];
	return v;
}

static int rd_u32(struct rd *r, uint32_t *out, const char *what)
{
	int rc = rd_need(r, 4, what);
	if (rc)
		return rc;
	*out = (uint32_t)le(r->g->map + r->off, 4);
	r->off += 4;
	return DS_OK;
}

static int rd_u64(struct rd *r, uint64_t *out, const char *what)
{
	int rc = rd_need(r, 8, what);
	if (rc)
		return rc;
	*out = le(r->g->map + r->off, 8);
	r->off += 8;
	return DS_OK;
}

/* A string: *off and *len of its bytes (inside the file once this returns 0). */
static int rd_str(struct rd *r, uint64_t *off, uint64_t *len, const char *what)
{
	int rc = rd_u64(r, len, what);
	if (!rc)
		rc = rd_need(r, *len, what);
	if (rc)
		return rc;
	*off = r->off;
	r->off += (size_t)*len;
	return DS_OK;
}

/* A key or tensor name: a NUL-terminated copy; empty or holding a NUL is an error. */
static int rd_name(struct rd *r, char **out, const char *what)
{
	uint64_t off, len;
	int rc = rd_str(r, &off, &len, what);
	if (rc)
		return rc;
	const char *s = (const char *)r->g->map + off;
	if (len == 0 || memchr(s, '\0', (size_t)len))
		return ds_err_set(r->err, DS_EFORMAT, "%s: %s at offset %llu is %s", r->g->path, what,
				  (unsigned long long)off - 8, len ? "holds a NUL byte" : "empty");
	*out = malloc((size_t)len + 1);
	if (!*out)
		return ds_err_set(r->err, DS_ENOMEM, "%s: out of memory", r->g->path);
	memcpy(*out, s, (size_t)len);
	(*out)[len] = '\0';
	return DS_OK;
}

/* ---- metadata ------------------------------------------------------------------------ */

static int recs_reserve(gguf_file *g, uint64_t n, uint32_t *first, ds_err *err)
{
	if (n > UINT32_MAX - g->n_recs)
		return ds_err_set(err, DS_EFORMAT, "%s: more than 2^32 array elements", g->path);
	if (g->n_recs + n > g->cap_recs) {
		size_t cap = g->cap_recs ? g->cap_recs : 256;
		while (cap < g->n_recs + n)
			cap *= 2;
		rec *p = realloc(g->recs, cap * sizeof *p);
		if (!p)
			return ds_err_set(err, DS_ENOMEM, "%s: out of memory for %llu array elements",
					  g->path, (unsigned long long)n);
		g->recs = p;
		g->cap_recs = cap;
	}
	*first = (uint32_t)g->n_recs;
	g->n_recs += (size_t)n;
	return DS_OK;
}

/* Reads one value of type `type` at the cursor into *out.  what: "metadata
 * 'key'" for messages. */
static int parse_value(struct rd *r, uint32_t type, rec *out, int depth, const char *what)
{
	gguf_file *g = r->g;
	int rc;
	memset(out, 0, sizeof *out);
	if (type >= GGUF_TYPE_COUNT)
		return ds_err_set(r->err, DS_EFORMAT, "%s: %s at offset %zu: unknown value type %u",
				  g->path, what, r->off - 4, type);
	out->type = (uint8_t)type;
	if (type == GGUF_TYPE_STRING)
		return rd_str(r, &out->off, &out->n, what);
	if (type != GGUF_TYPE_ARRAY) {
		if ((rc = rd_need(r, type_size[type], what)) != 0)
			return rc;
		out->off = r->off;
		r->off += type_size[type];
		return DS_OK;
	}
	if (depth >= GGUF_MAX_ARRAY_DEPTH)
		return ds_err_set(r->err, DS_EFORMAT, "%s: %s: arrays nested more than %d deep",
				  g->path, what, GGUF_MAX_ARRAY_DEPTH);
	uint32_t elem;
	uint64_t n;
	if ((rc = rd_u32(r, &elem, what)) != 0 || (rc = rd_u64(r, &n, what)) != 0)
		return rc;
	if (elem >= GGUF_TYPE_COUNT)
		return ds_err_set(r->err, DS_EFORMAT,
				  "%s: %s at offset %zu: unknown array element type %u", g->path, what,
				  r->off - 12, elem);
	out->elem = (uint8_t)elem;
	out->n = n;
	size_t left = g->size - r->off;
	unsigned min = elem == GGUF_TYPE_STRING ? 8 : elem == GGUF_TYPE_ARRAY ? 12 : type_size[elem];
	if (n > left / min)
		return ds_err_set(r->err, DS_EFORMAT,
				  "%s: truncated: %s: array of %llu %s elements at offset %zu does not "
				  "fit in the %zu bytes left", g->path, what, (unsigned long long)n,
				  type_names[elem], r->off - 12, left);
	out->off = r->off;
	if (type_size[elem]) {
		r->off += (size_t)n * type_size[elem];
		return DS_OK;
	}
	uint32_t first = 0;
	if ((rc = recs_reserve(g, n, &first, r->err)) != 0)
		return rc;
	out->first = first;
	for (uint64_t i = 0; i < n; i++) {
		rec e;
		if ((rc = parse_value(r, elem, &e, depth + 1, what)) != 0)
			return rc;
		g->recs[first + i] = e; /* after the call: recursion may move g->recs */
	}
	return DS_OK;
}

static int parse_kvs(struct rd *r, uint64_t n_kv)
{
	gguf_file *g = r->g;
	int rc;
	char what[NAME_SHOW + 64];
	g->kvs = calloc(n_kv ? (size_t)n_kv : 1, sizeof *g->kvs);
	if (!g->kvs || map_init(&g->kv_ix, (size_t)n_kv) != DS_OK)
		return ds_err_set(r->err, DS_ENOMEM, "%s: out of memory", g->path);
	for (uint64_t i = 0; i < n_kv; i++) {
		kv *e = &g->kvs[i];
		uint32_t type, old;
		snprintf(what, sizeof what, "the key of metadata entry %llu", (unsigned long long)i);
		if ((rc = rd_name(r, &e->key, what)) != 0)
			return rc;
		g->n_kv++;
		snprintf(what, sizeof what, "metadata '%.*s'", NAME_SHOW, e->key);
		if ((rc = rd_u32(r, &type, what)) != 0 || (rc = parse_value(r, type, &e->v, 0, what)) != 0)
			return rc;
		if (map_put(&g->kv_ix, e->key, (uint32_t)i, &old))
			return ds_err_set(r->err, DS_EFORMAT, "%s: metadata key '%.*s' appears twice "
					  "(entries %u and %llu)", g->path, NAME_SHOW, e->key, old,
					  (unsigned long long)i);
		if (type == GGUF_TYPE_STRING) {
			e->str = malloc((size_t)e->v.n + 1);
			if (!e->str)
				return ds_err_set(r->err, DS_ENOMEM, "%s: out of memory", g->path);
			memcpy(e->str, g->map + e->v.off, (size_t)e->v.n);
			e->str[e->v.n] = '\0';
		}
	}
	return DS_OK;
}

/* ---- tensors --------------------------------------------------------------------------- */

static int parse_tensor_infos(struct rd *r, uint64_t n_t)
{
	gguf_file *g = r->g;
	int rc;
	char what[NAME_SHOW + 64];
	g->ts = calloc(n_t ? (size_t)n_t : 1, sizeof *g->ts);
	if (!g->ts || map_init(&g->t_ix, (size_t)n_t) != DS_OK)
		return ds_err_set(r->err, DS_ENOMEM, "%s: out of memory", g->path);
	for (uint64_t i = 0; i < n_t; i++) {
		gguf_tensor *t = &g->ts[i].t;
		char *name = NULL;
		uint32_t nd, type, old;
		snprintf(what, sizeof what, "the name of tensor %llu", (unsigned long long)i);
		if ((rc = rd_name(r, &name, what)) != 0)
			return rc;
		t->name = name;
		g->n_t++;
		snprintf(what, sizeof what, "tensor '%.*s'", NAME_SHOW, name);
		if ((rc = rd_u32(r, &nd, what)) != 0)
			return rc;
		if (nd > GGUF_MAX_DIMS)
			return ds_err_set(r->err, DS_EFORMAT, "%s: %s has %u dimensions; at most %d",
					  g->path, what, nd, GGUF_MAX_DIMS);
		t->n_dims = (int)nd;
		for (int d = 0; d < GGUF_MAX_DIMS; d++)
			t->ne[d] = 1;
		for (uint32_t d = 0; d < nd; d++) {
			uint64_t v;
			if ((rc = rd_u64(r, &v, what)) != 0)
				return rc;
			if (v > INT64_MAX)
				return ds_err_set(r->err, DS_EFORMAT, "%s: %s: ne[%u] = %llu is too large",
						  g->path, what, d, (unsigned long long)v);
			t->ne[d] = (int64_t)v;
			t->shape[nd - 1 - d] = (int64_t)v;
		}
		if ((rc = rd_u32(r, &type, what)) != 0 || (rc = rd_u64(r, &t->offset, what)) != 0)
			return rc;
		t->ggml_type = type;
		t->dtype = gguf_ggml_to_dtype(type);
		if (ggml_index(type) >= 0) {
			t->type_name = gguf_ggml_type_name(type);
		} else {
			snprintf(g->ts[i].type_buf, sizeof g->ts[i].type_buf, "unknown-%u", type);
			t->type_name = g->ts[i].type_buf;
		}
		if (map_put(&g->t_ix, name, (uint32_t)i, &old))
			return ds_err_set(r->err, DS_EFORMAT, "%s: tensor '%.*s' appears twice "
					  "(infos %u and %llu)", g->path, NAME_SHOW, name, old,
					  (unsigned long long)i);
	}
	return DS_OK;
}

/* Bytes of a tensor of a known type; checks the block and overflow. */
static int tensor_bytes(const gguf_file *g, const gguf_tensor *t, size_t *out, ds_err *err)
{
	int k = ggml_index(t->ggml_type);
	uint64_t block = ggml_types[k].block, bytes = ggml_types[k].bytes;
	if (t->ne[0] % (int64_t)block != 0)
		return ds_err_set(err, DS_EFORMAT,
				  "%s: tensor '%.*s': %s rows of %lld elements are not a whole number "
				  "of %llu-element blocks", g->path, NAME_SHOW, t->name, t->type_name,
				  (long long)t->ne[0], (unsigned long long)block);
	uint64_t n = (uint64_t)t->ne[0] / block * bytes;
	for (int d = 1; d < GGUF_MAX_DIMS; d++)
		if (__builtin_mul_overflow(n, (uint64_t)t->ne[d], &n))
			return ds_err_set(err, DS_EFORMAT, "%s: tensor '%.*s': size overflows",
					  g->path, NAME_SHOW, t->name);
	*out = (size_t)n;
	return DS_OK;
}

static int place_tensors(gguf_file *g, size_t end_of_infos, ds_err *err)
{
	uint64_t a = g->alignment;
	uint64_t start = (end_of_infos + a - 1) / a * a;
	g->data_off = (size_t)start;
	if (g->n_t && start > g->size)
		return ds_err_set(err, DS_EFORMAT, "%s: truncated: the data section would start at "
				  "offset %llu, the file has %zu bytes", g->path,
				  (unsigned long long)start, g->size);
	for (size_t i = 0; i < g->n_t; i++) {
		gguf_tensor *t = &g->ts[i].t;
		size_t nbytes = 0;
		int rc;
		if (t->offset % a != 0)
			return ds_err_set(err, DS_EFORMAT, "%s: tensor '%.*s': offset %llu is not a "
					  "multiple of the alignment %llu", g->path, NAME_SHOW, t->name,
					  (unsigned long long)t->offset, (unsigned long long)a);
		if (ggml_index(t->ggml_type) >= 0 && (rc = tensor_bytes(g, t, &nbytes, err)) != 0)
			return rc;
		uint64_t left = g->size - start;
		if (t->offset > left || nbytes > left - t->offset)
			return ds_err_set(err, DS_EFORMAT,
					  "%s: tensor '%.*s': data [%llu, +%zu) lies outside the data "
					  "section of %llu bytes (truncated file?)", g->path, NAME_SHOW,
					  t->name, (unsigned long long)t->offset, nbytes,
					  (unsigned long long)left);
		t->data = g->map + start + t->offset;
		t->nbytes = nbytes;
		g->total_bytes += nbytes;
	}
	return DS_OK;
}

/* ---- open / close ------------------------------------------------------------------------ */

static int map_file(gguf_file *g, ds_err *err)
{
	int fd = open(g->path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return ds_err_set(err, errno == ENOENT ? DS_ENOTFOUND : DS_EIO, "%s: %s", g->path,
				  strerror(errno));
	int rc = DS_OK;
	struct stat st;
	if (fstat(fd, &st) != 0) {
		rc = ds_err_set(err, DS_EIO, "%s: %s", g->path, strerror(errno));
		goto out;
	}
	if (!S_ISREG(st.st_mode)) {
		rc = ds_err_set(err, DS_EFORMAT, "%s: not a regular file", g->path);
		goto out;
	}
	g->size = (size_t)st.st_size;
	if (g->size < 4) {
		rc = ds_err_set(err, DS_EFORMAT, "%s: truncated: %zu bytes; a GGUF file starts with "
				"the magic \"GGUF\"", g->path, g->size);
		goto out;
	}
	void *p = NULL;
	size_t len = 0;
	if ((rc = ds_file_map(fd, g->path, g->size, DS_MAP_FILE, &p, &len, err)))
		goto out;
	g->map = p;
out:
	close(fd);
	return rc;
}

static int parse_header(struct rd *r, uint64_t *n_t, uint64_t *n_kv)
{
	gguf_file *g = r->g;
	int rc;
	if (memcmp(g->map, "GGUF", 4) != 0)
		return ds_err_set(r->err, DS_EFORMAT,
				  "%s: not a GGUF file (magic %02x %02x %02x %02x, expected \"GGUF\")",
				  g->path, g->map[0], g->map[1], g->map[2], g->map[3]);
	r->off = 4;
	if ((rc = rd_u32(r, &g->version, "the version")) != 0)
		return rc;
	if (g->version == 1)
		return ds_err_set(r->err, DS_EUNSUPPORTED,
				  "%s: GGUF version 1 is not supported (2 and 3 are); convert the file again",
				  g->path);
	if ((g->version & 0xffff) == 0 && (g->version >> 16) != 0)
		return ds_err_set(r->err, DS_EUNSUPPORTED,
				  "%s: big-endian GGUF (version read as 0x%08x) is not supported",
				  g->path, g->version);
	if (g->version < 2 || g->version > 3)
		return ds_err_set(r->err, DS_EUNSUPPORTED,
				  "%s: GGUF version %u is not supported (2 and 3 are)", g->path,
				  g->version);
	if ((rc = rd_u64(r, n_t, "the tensor count")) != 0 ||
	    (rc = rd_u64(r, n_kv, "the metadata count")) != 0)
		return rc;
	size_t left = g->size - r->off;
	if (*n_kv > left / 13)
		return ds_err_set(r->err, DS_EFORMAT,
				  "%s: %llu metadata entries cannot fit in the %zu bytes left (truncated "
				  "or corrupt header)", g->path, (unsigned long long)*n_kv, left);
	if (*n_t > left / 24)
		return ds_err_set(r->err, DS_EFORMAT,
				  "%s: %llu tensor infos cannot fit in the %zu bytes left (truncated "
				  "or corrupt header)", g->path, (unsigned long long)*n_t, left);
	return DS_OK;
}

static int read_alignment(gguf_file *g, ds_err *err)
{
	g->alignment = GGUF_DEFAULT_ALIGNMENT;
	int64_t i = map_get(&g->kv_ix, KEY_ALIGNMENT);
	if (i < 0)
		return DS_OK;
	const rec *v = &g->kvs[i].v;
	if (v->type != GGUF_TYPE_U32)
		return ds_err_set(err, DS_EFORMAT, "%s: %s must be a u32, found %s", g->path,
				  KEY_ALIGNMENT, type_names[v->type]);
	uint32_t a = (uint32_t)le(g->map + v->off, 4);
	if (a == 0 || (a & (a - 1)) != 0)
		return ds_err_set(err, DS_EFORMAT, "%s: %s = %u is not a power of two", g->path,
				  KEY_ALIGNMENT, a);
	g->alignment = a;
	return DS_OK;
}

gguf_file *gguf_open(const char *path, ds_err *err)
{
	ds_err local = { 0 };
	if (!err)
		err = &local;
	gguf_file *g = calloc(1, sizeof *g);
	uint64_t n_t = 0, n_kv = 0;
	struct rd r = { g, 0, err };
	int rc = g ? DS_OK : ds_err_set(err, DS_ENOMEM, "out of memory");
	if (!rc && !(g->path = strdup(path)))
		rc = ds_err_set(err, DS_ENOMEM, "out of memory");
	if (!rc)
		rc = map_file(g, err);
	if (!rc)
		rc = parse_header(&r, &n_t, &n_kv);
	if (!rc)
		rc = parse_kvs(&r, n_kv);
	if (!rc)
		rc = read_alignment(g, err);
	if (!rc)
		rc = parse_tensor_infos(&r, n_t);
	if (!rc)
		rc = place_tensors(g, r.off, err);
	if (rc) {
		gguf_close(g);
		return NULL;
	}
	return g;
}

void gguf_close(gguf_file *g)
{
	if (!g)
		return;
	for (size_t i = 0; i < g->n_t; i++)
		free((char *)g->ts[i].t.name);
	for (size_t i = 0; i < g->n_kv; i++) {
		free(g->kvs[i].key);
		free(g->kvs[i].str);
	}
	map_free(&g->t_ix);
	map_free(&g->kv_ix);
	free(g->ts);
	free(g->recs);
	free(g->kvs);
	if (g->map)
		ds_file_unmap((void *)g->map, g->size); /* DS_MAP_FILE: the length is the size */
	free(g->path);
	free(g);
}

const char *gguf_path(const gguf_file *g)
{
	return g->path;
}

uint32_t gguf_version(const gguf_file *g)
{
	return g->version;
}

uint32_t gguf_alignment(const gguf_file *g)
{
	return g->alignment;
}

size_t gguf_data_offset(const gguf_file *g)
{
	return g->data_off;
}

const void *gguf_mapping(const gguf_file *g, size_t *size)
{
	if (size)
		*size = g->size;
	return g->map;
}

size_t gguf_total_bytes(const gguf_file *g)
{
	return g->total_bytes;
}

size_t gguf_file_bytes(const gguf_file *g)
{
	return g->size;
}

/* ---- metadata getters ------------------------------------------------------------------- */

size_t gguf_kv_count(const gguf_file *g)
{
	return g->n_kv;
}

const char *gguf_kv_key(const gguf_file *g, size_t i)
{
	return i < g->n_kv ? g->kvs[i].key : NULL;
}

enum gguf_type gguf_kv_type(const gguf_file *g, size_t i)
{
	return i < g->n_kv ? (enum gguf_type)g->kvs[i].v.type : GGUF_TYPE_COUNT;
}

int64_t gguf_find_key(const gguf_file *g, const char *key)
{
	return key ? map_get(&g->kv_ix, key) : -1;
}

/* The index and rec of key, checked against type (GGUF_TYPE_COUNT: any). */
static int get_rec(const gguf_file *g, const char *key, enum gguf_type type, const rec **out,
		   int64_t *index, ds_err *err)
{
	int64_t i = gguf_find_key(g, key);
	if (i < 0)
		return ds_err_set(err, DS_ENOTFOUND, "%s: metadata key '%s' not found", g->path,
				  key ? key : "(null)");
	const rec *v = &g->kvs[i].v;
	if (type != GGUF_TYPE_COUNT && v->type != type)
		return ds_err_set(err, DS_EFORMAT, "%s: metadata '%s' is a %s, expected a %s", g->path,
				  key, type_names[v->type], type_names[type]);
	*out = v;
	if (index)
		*index = i;
	return DS_OK;
}

static uint64_t raw_at(const gguf_file *g, uint64_t off, enum gguf_type t)
{
	return le(g->map + off, type_size[t]);
}

/* Value of an integer/bool rec as int64 (u64 wraps); sign-extends the signed types. */
static int64_t int_value(const gguf_file *g, uint64_t off, enum gguf_type t)
{
	uint64_t u = raw_at(g, off, t);
	switch (t) {
	case GGUF_TYPE_I8: return (int8_t)u;
	case GGUF_TYPE_I16: return (int16_t)u;
	case GGUF_TYPE_I32: return (int32_t)u;
	case GGUF_TYPE_BOOL: return u != 0;
	default: return (int64_t)u;
	}
}

static double float_value(const gguf_file *g, uint64_t off, enum gguf_type t)
{
	uint64_t u = raw_at(g, off, t);
	if (t == GGUF_TYPE_F32) {
		uint32_t b = (uint32_t)u;
		float f;
		memcpy(&f, &b, 4);
		return f;
	}
	if (t == GGUF_TYPE_F64) {
		double d;
		memcpy(&d, &u, 8);
		return d;
	}
	if (t == GGUF_TYPE_U64)
		return (double)u;
	return (double)int_value(g, off, t);
}

#define GETTER(fn, ctype, gtype)                                                          \
	int fn(const gguf_file *g, const char *key, ctype *out, ds_err *err)              \
	{                                                                                 \
		const rec *v;                                                             \
		int rc = get_rec(g, key, gtype, &v, NULL, err);                           \
		if (rc)                                                                   \
			return rc;                                                        \
		uint64_t u = raw_at(g, v->off, gtype);                                    \
		memcpy(out, &u, sizeof *out); /* little-endian host: the low bytes */     \
		return DS_OK;                                                             \
	}

GETTER(gguf_get_u8, uint8_t, GGUF_TYPE_U8)
GETTER(gguf_get_i8, int8_t, GGUF_TYPE_I8)
GETTER(gguf_get_u16, uint16_t, GGUF_TYPE_U16)
GETTER(gguf_get_i16, int16_t, GGUF_TYPE_I16)
GETTER(gguf_get_u32, uint32_t, GGUF_TYPE_U32)
GETTER(gguf_get_i32, int32_t, GGUF_TYPE_I32)
GETTER(gguf_get_u64, uint64_t, GGUF_TYPE_U64)
GETTER(gguf_get_i64, int64_t, GGUF_TYPE_I64)
GETTER(gguf_get_f32, float, GGUF_TYPE_F32)
GETTER(gguf_get_f64, double, GGUF_TYPE_F64)

int gguf_get_bool(const gguf_file *g, const char *key, int *out, ds_err *err)
{
	const rec *v;
	int rc = get_rec(g, key, GGUF_TYPE_BOOL, &v, NULL, err);
	if (rc)
		return rc;
	*out = g->map[v->off] != 0;
	return DS_OK;
}

int gguf_get_str(const gguf_file *g, const char *key, const char **out, size_t *len, ds_err *err)
{
	const rec *v;
	int64_t i;
	int rc = get_rec(g, key, GGUF_TYPE_STRING, &v, &i, err);
	if (rc)
		return rc;
	*out = g->kvs[i].str;
	if (len)
		*len = (size_t)v->n;
	return DS_OK;
}

int gguf_get_int(const gguf_file *g, const char *key, int64_t min, int64_t max, int64_t *out,
		 ds_err *err)
{
	const rec *v;
	int rc = get_rec(g, key, GGUF_TYPE_COUNT, &v, NULL, err);
	if (rc)
		return rc;
	enum gguf_type t = (enum gguf_type)v->type;
	if (!type_is_int(t))
		return ds_err_set(err, DS_EFORMAT, "%s: metadata '%s' is a %s, expected an integer",
				  g->path, key, type_names[t]);
	uint64_t u = raw_at(g, v->off, t);
	int64_t x = int_value(g, v->off, t);
	if ((t == GGUF_TYPE_U64 && u > INT64_MAX) || x < min || x > max) {
		if (t == GGUF_TYPE_U64)
			return ds_err_set(err, DS_ERANGE, "%s: metadata '%s' = %llu is outside [%lld, %lld]",
					  g->path, key, (unsigned long long)u, (long long)min,
					  (long long)max);
		return ds_err_set(err, DS_ERANGE, "%s: metadata '%s' = %lld is outside [%lld, %lld]",
				  g->path, key, (long long)x, (long long)min, (long long)max);
	}
	*out = x;
	return DS_OK;
}

int gguf_get_float(const gguf_file *g, const char *key, double *out, ds_err *err)
{
	const rec *v;
	int rc = get_rec(g, key, GGUF_TYPE_COUNT, &v, NULL, err);
	if (rc)
		return rc;
	enum gguf_type t = (enum gguf_type)v->type;
	if (t != GGUF_TYPE_F32 && t != GGUF_TYPE_F64 && !type_is_int(t))
		return ds_err_set(err, DS_EFORMAT, "%s: metadata '%s' is a %s, expected a number",
				  g->path, key, type_names[t]);
	*out = float_value(g, v->off, t);
	return DS_OK;
}

/* ---- arrays ------------------------------------------------------------------------------ */

static void arr_of(const gguf_file *g, const rec *v, gguf_arr *out)
{
	out->g = g;
	out->type = (enum gguf_type)v->elem;
	out->n = v->n;
	out->data = type_size[v->elem] ? g->map + v->off : NULL;
	out->first = v->first;
}

int gguf_get_arr(const gguf_file *g, const char *key, enum gguf_type elem, gguf_arr *out,
		 ds_err *err)
{
	const rec *v;
	int rc = get_rec(g, key, GGUF_TYPE_ARRAY, &v, NULL, err);
	if (rc)
		return rc;
	if (elem != GGUF_TYPE_COUNT && v->elem != elem)
		return ds_err_set(err, DS_EFORMAT, "%s: metadata '%s' is an array of %s, expected "
				  "an array of %s", g->path, key, type_names[v->elem],
				  gguf_type_name(elem));
	arr_of(g, v, out);
	return DS_OK;
}

int64_t gguf_arr_i64(const gguf_arr *a, uint64_t i)
{
	if (i >= a->n || !type_is_int(a->type))
		return 0;
	size_t off = (size_t)((const unsigned char *)a->data - a->g->map) + (size_t)i * type_size[a->type];
	return int_value(a->g, off, a->type);
}

uint64_t gguf_arr_u64(const gguf_arr *a, uint64_t i)
{
	if (i >= a->n || !type_is_int(a->type))
		return 0;
	if (a->type == GGUF_TYPE_U64)
		return le((const unsigned char *)a->data + i * 8, 8);
	return (uint64_t)gguf_arr_i64(a, i);
}

double gguf_arr_f64(const gguf_arr *a, uint64_t i)
{
	if (i >= a->n || !type_size[a->type])
		return 0;
	size_t off = (size_t)((const unsigned char *)a->data - a->g->map) + (size_t)i * type_size[a->type];
	return float_value(a->g, off, a->type);
}

const char *gguf_arr_str(const gguf_arr *a, uint64_t i, size_t *len)
{
	if (i >= a->n || a->type != GGUF_TYPE_STRING)
		return NULL;
	const rec *e = &a->g->recs[a->first + i];
	if (len)
		*len = (size_t)e->n;
	return (const char *)a->g->map + e->off;
}

int gguf_arr_arr(const gguf_arr *a, uint64_t i, gguf_arr *out)
{
	if (i >= a->n || a->type != GGUF_TYPE_ARRAY)
		return DS_EINVAL;
	arr_of(a->g, &a->g->recs[a->first + i], out);
	return DS_OK;
}

/* ---- tensors ----------------------------------------------------------------------------- */

size_t gguf_tensor_count(const gguf_file *g)
{
	return g->n_t;
}

const gguf_tensor *gguf_tensor_at(const gguf_file *g, size_t i)
{
	return i < g->n_t ? &g->ts[i].t : NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *g, const char *name)
{
	int64_t i = name ? map_get(&g->t_ix, name) : -1;
	return i < 0 ? NULL : &g->ts[i].t;
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

static const char *dtype_name(enum kb_dtype t)
{
	int id = gguf_dtype_to_ggml(t);
	return id >= 0 ? gguf_ggml_type_name((uint32_t)id) : t == KB_F8_E4M3 ? "F8_E4M3" : "?";
}

const gguf_tensor *gguf_get_tensor(const gguf_file *g, const char *name, enum kb_dtype dtype,
				   int n_dims, const int64_t *shape, ds_err *err)
{
	const gguf_tensor *t = gguf_find_tensor(g, name);
	if (!t) {
		ds_err_set(err, DS_ENOTFOUND, "%s: tensor %s not found", g->path, name ? name : "(null)");
		return NULL;
	}
	if (t->dtype == GGUF_DTYPE_NONE) {
		ds_err_set(err, DS_EUNSUPPORTED, "%s: tensor %s: ggml type %u (%s) is not supported "
			   "(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K are)", g->path, name,
			   t->ggml_type, t->type_name);
		return NULL;
	}
	if (dtype != GGUF_DTYPE_ANY && t->dtype != dtype) {
		ds_err_set(err, DS_EFORMAT, "%s: tensor %s: type %s expected, found %s", g->path, name,
			   dtype_name(dtype), t->type_name);
		return NULL;
	}
	int ok = n_dims < 0 || t->n_dims == n_dims;
	for (int i = 0; ok && n_dims > 0 && i < n_dims; i++)
		if (shape[i] >= 0 && shape[i] != t->shape[i])
			ok = 0;
	if (!ok) {
		char want[160], got[160];
		shape_str(want, sizeof want, n_dims, shape);
		shape_str(got, sizeof got, t->n_dims, t->shape);
		ds_err_set(err, DS_EFORMAT, "%s: tensor %s: expected shape %s, found %s", g->path, name,
			   want, got);
		return NULL;
	}
	return t;
}

/*
 * test_gguf.c - unit tests of engine/gguf.c (the GGUF reader) and
 * engine/tok_gguf.c (the tokenizer from GGUF metadata).
 *
 * GGUF files are written here byte by byte (an independent little writer,
 * not the reader's code) into a mkdtemp directory: every metadata value type
 * with random values, arrays of every type, nested arrays of strings, an empty
 * array, tensors of supported and unsupported ggml types with 1..4 dimensions,
 * default and custom alignment.  Then: every getter and accessor against the
 * values written; every prefix of the file must fail cleanly; random byte
 * flips must never crash (the whole file is walked when it still opens; run
 * under ASan by `make asan`); one test per validation rule, each checking the
 * code and that the message names the file.
 */
#include "common/buf.h"
#include "engine/gguf.h"
#include "engine/tok.h"
#include "engine/unicode.h"
#include "tests/unit/unit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- files ---------------------------------------------------------------------- */

static void write_bytes(const char *path, const void *data, size_t n)
{
	FILE *f = fopen(path, "wb");
	if (!f) {
		ut_fail(__FILE__, __LINE__, "cannot write %s", path);
		return;
	}
	if (n && fwrite(data, 1, n, f) != n)
		ut_fail(__FILE__, __LINE__, "short write %s", path);
	fclose(f);
}

static int contains(const char *hay, const char *needle)
{
	return hay && needle && strstr(hay, needle) != NULL;
}

/* ---- a byte-level GGUF writer ------------------------------------------------------- */

static void put_le(buf *b, uint64_t v, int n)
{
	unsigned char x[8];
	for (int i = 0; i < n; i++)
		x[i] = (unsigned char)(v >> (8 * i));
	buf_append(b, x, (size_t)n);
}

static void put_strn(buf *b, const char *s, size_t n)
{
	put_le(b, n, 8);
	buf_append(b, s, n);
}

static void put_str(buf *b, const char *s)
{
	put_strn(b, s, strlen(s));
}

static void put_key(buf *b, const char *key, uint32_t type)
{
	put_str(b, key);
	put_le(b, type, 4);
}

static void put_f32(buf *b, float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	put_le(b, u, 4);
}

static void put_f64(buf *b, double d)
{
	uint64_t u;
	memcpy(&u, &d, 8);
	put_le(b, u, 8);
}

static void pad_to(buf *b, size_t align)
{
	while (b->len % align)
		put_le(b, 0, 1);
}

static void patch_le(buf *b, size_t at, uint64_t v, int n)
{
	for (int i = 0; i < n; i++)
		b->data[at + (size_t)i] = (char)(v >> (8 * i));
}

/* ---- the reference file ------------------------------------------------------------ */

#define N_TENSORS 11
#define N_ASTR 5

typedef struct fxt {
	const char *name;
	uint32_t ggml;
	int nd;
	int64_t ne[4];
	size_t nbytes;
	enum kb_dtype dtype; /* GGUF_DTYPE_NONE when unsupported */
	uint64_t off;        /* filled by build */
	size_t at;           /* file offset of the info's n_dims (filled by build) */
} fxt;

/* ne[0] multiples of each type's block; nbytes = ne0/block*bytes*rest. */
static const fxt tensors0[N_TENSORS] = {
	{ "tok.f32", 0, 2, { 5, 3 }, 60, KB_F32 },
	{ "blk.0.q8", 8, 2, { 64, 2 }, 136, KB_Q8_0 },
	{ "blk.0.q4k", 12, 3, { 256, 2, 1 }, 288, KB_Q4_K },
	{ "v.f16", 1, 1, { 7 }, 14, KB_F16 },
	{ "x.bf16", 30, 4, { 2, 2, 2, 2 }, 32, KB_BF16 },
	{ "u.q5_0", 6, 2, { 32, 1 }, 22, GGUF_DTYPE_NONE },
	{ "u.i32", 26, 1, { 4 }, 16, GGUF_DTYPE_NONE },
	{ "q4_0", 2, 1, { 32 }, 18, KB_Q4_0 },
	{ "q4_1", 3, 2, { 32, 3 }, 60, KB_Q4_1 },
	{ "q5k", 13, 1, { 256 }, 176, KB_Q5_K },
	{ "q6k", 14, 1, { 256 }, 210, KB_Q6_K }, /* last: its data ends the file */
};

typedef struct ref {
	uint8_t u8;
	int8_t i8;
	uint16_t u16;
	int16_t i16;
	uint32_t u32;
	int32_t i32;
	float f32;
	int flag;
	uint64_t u64;
	int64_t i64;
	double f64;
	char str[40];
	uint8_t au8[9];
	int16_t ai16[3];
	int32_t ai32[7];
	float af32[5];
	uint64_t au64[3];
	double af64[4];
	int abool[6];
	char astr[N_ASTR][24];
	fxt t[N_TENSORS];
	size_t data_off;
} ref;

/* Offsets of fields that tests patch. */
typedef struct marks {
	size_t version, n_t, n_kv;
	size_t u8_type;     /* value type of the first entry (u8) */
	size_t str_len;     /* length of the scalar string value */
	size_t arr_elem;    /* element type of the i32 array */
	size_t arr_count;   /* count of the i32 array */
	size_t key2;        /* first byte of the second key's text */
	size_t align_value; /* general.alignment's value (when written) */
} marks;

static uint64_t rnd(void)
{
	return ut_rand_u64();
}

static void ref_init(ref *r)
{
	memset(r, 0, sizeof *r);
	r->u8 = (uint8_t)(rnd() | 0x80);
	r->i8 = (int8_t)-(int)(1 + rnd() % 120);
	r->u16 = (uint16_t)(rnd() | 0x8000);
	r->i16 = (int16_t)-(int)(1 + rnd() % 30000);
	r->u32 = (uint32_t)rnd() | 0x80000000u;
	r->i32 = -(int32_t)(1 + rnd() % 2000000000);
	r->f32 = ut_rand_float(-1000, 1000);
	r->flag = 1;
	r->u64 = rnd() | (1ull << 63);
	r->i64 = -(int64_t)(rnd() >> 2) - 1;
	r->f64 = (double)ut_rand_float(-1, 1) * 1e300;
	snprintf(r->str, sizeof r->str, "héllo %016llx", (unsigned long long)rnd());
	for (int i = 0; i < 9; i++)
		r->au8[i] = (uint8_t)rnd();
	for (int i = 0; i < 3; i++)
		r->ai16[i] = (int16_t)rnd();
	for (int i = 0; i < 7; i++)
		r->ai32[i] = (int32_t)rnd();
	for (int i = 0; i < 5; i++)
		r->af32[i] = ut_rand_float(-5, 5);
	for (int i = 0; i < 3; i++)
		r->au64[i] = rnd();
	for (int i = 0; i < 4; i++)
		r->af64[i] = (double)ut_rand_float(-1, 1) / 3.0;
	for (int i = 0; i < 6; i++)
		r->abool[i] = (int)(rnd() & 1);
	for (int i = 0; i < N_ASTR; i++)
		snprintf(r->astr[i], sizeof r->astr[i], i == 2 ? "" : "s%d-%llx", i,
			 (unsigned long long)(rnd() & 0xffff));
	memcpy(r->t, tensors0, sizeof tensors0);
}

enum { KV_COUNT_BASE = 22 };

typedef struct bopt {
	uint32_t alignment; /* 0: no general.alignment key (default 32) */
	int dup_key, dup_tensor;
} bopt;

/* Writes the reference file into b (fresh), recording offsets in m. */
static void build(ref *r, const bopt *o, buf *b, marks *m)
{
	buf_clear(b);
	memset(m, 0, sizeof *m);
	size_t align = o->alignment ? o->alignment : 32;
	buf_append(b, "GGUF", 4);
	m->version = b->len;
	put_le(b, 3, 4);
	m->n_t = b->len;
	put_le(b, N_TENSORS + (o->dup_tensor ? 1 : 0), 8);
	m->n_kv = b->len;
	put_le(b, KV_COUNT_BASE + 3 + (o->alignment ? 1 : 0) + (o->dup_key ? 1 : 0), 8);

	put_str(b, "t.u8");
	m->u8_type = b->len;
	put_le(b, GGUF_TYPE_U8, 4);
	put_le(b, r->u8, 1);
	m->key2 = b->len + 8;
	put_key(b, "t.i8", GGUF_TYPE_I8), put_le(b, (uint8_t)r->i8, 1);
	put_key(b, "t.u16", GGUF_TYPE_U16), put_le(b, r->u16, 2);
	put_key(b, "t.i16", GGUF_TYPE_I16), put_le(b, (uint16_t)r->i16, 2);
	put_key(b, "t.u32", GGUF_TYPE_U32), put_le(b, r->u32, 4);
	put_key(b, "t.i32", GGUF_TYPE_I32), put_le(b, (uint32_t)r->i32, 4);
	put_key(b, "t.f32", GGUF_TYPE_F32), put_f32(b, r->f32);
	put_key(b, "t.bool", GGUF_TYPE_BOOL), put_le(b, 1, 1);
	put_key(b, "t.u64", GGUF_TYPE_U64), put_le(b, r->u64, 8);
	put_key(b, "t.i64", GGUF_TYPE_I64), put_le(b, (uint64_t)r->i64, 8);
	put_key(b, "t.f64", GGUF_TYPE_F64), put_f64(b, r->f64);
	put_key(b, "t.str", GGUF_TYPE_STRING);
	m->str_len = b->len;
	put_str(b, r->str);
	put_key(b, "t.small", GGUF_TYPE_U16), put_le(b, 300, 2);

	put_key(b, "a.u8", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_U8, 4), put_le(b, 9, 8);
	for (int i = 0; i < 9; i++)
		put_le(b, r->au8[i], 1);
	put_key(b, "a.i16", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_I16, 4), put_le(b, 3, 8);
	for (int i = 0; i < 3; i++)
		put_le(b, (uint16_t)r->ai16[i], 2);
	put_key(b, "a.i32", GGUF_TYPE_ARRAY);
	m->arr_elem = b->len;
	put_le(b, GGUF_TYPE_I32, 4);
	m->arr_count = b->len;
	put_le(b, 7, 8);
	for (int i = 0; i < 7; i++)
		put_le(b, (uint32_t)r->ai32[i], 4);
	put_key(b, "a.f32", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_F32, 4), put_le(b, 5, 8);
	for (int i = 0; i < 5; i++)
		put_f32(b, r->af32[i]);
	put_key(b, "a.u64", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_U64, 4), put_le(b, 3, 8);
	for (int i = 0; i < 3; i++)
		put_le(b, r->au64[i], 8);
	put_key(b, "a.f64", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_F64, 4), put_le(b, 4, 8);
	for (int i = 0; i < 4; i++)
		put_f64(b, r->af64[i]);
	put_key(b, "a.bool", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_BOOL, 4), put_le(b, 6, 8);
	for (int i = 0; i < 6; i++)
		put_le(b, (uint64_t)r->abool[i], 1);
	put_key(b, "a.str", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_STRING, 4), put_le(b, N_ASTR, 8);
	for (int i = 0; i < N_ASTR; i++)
		put_str(b, r->astr[i]);
	put_key(b, "a.empty", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_I64, 4), put_le(b, 0, 8);
	/* [[astr0, astr1], [], [astr3]] and [[[1, 2], [3]], [[4]]] */
	put_key(b, "a.nested", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_ARRAY, 4), put_le(b, 3, 8);
	put_le(b, GGUF_TYPE_STRING, 4), put_le(b, 2, 8), put_str(b, r->astr[0]), put_str(b, r->astr[1]);
	put_le(b, GGUF_TYPE_STRING, 4), put_le(b, 0, 8);
	put_le(b, GGUF_TYPE_STRING, 4), put_le(b, 1, 8), put_str(b, r->astr[3]);
	put_key(b, "a.deep", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_ARRAY, 4), put_le(b, 2, 8);
	put_le(b, GGUF_TYPE_ARRAY, 4), put_le(b, 2, 8);
	put_le(b, GGUF_TYPE_U32, 4), put_le(b, 2, 8), put_le(b, 1, 4), put_le(b, 2, 4);
	put_le(b, GGUF_TYPE_U32, 4), put_le(b, 1, 8), put_le(b, 3, 4);
	put_le(b, GGUF_TYPE_ARRAY, 4), put_le(b, 1, 8);
	put_le(b, GGUF_TYPE_U32, 4), put_le(b, 1, 8), put_le(b, 4, 4);
	put_key(b, "general.architecture", GGUF_TYPE_STRING), put_str(b, "llama");
	if (o->alignment) {
		put_key(b, "general.alignment", GGUF_TYPE_U32);
		m->align_value = b->len;
		put_le(b, o->alignment, 4);
	}
	if (o->dup_key)
		put_key(b, "t.u16", GGUF_TYPE_U16), put_le(b, 1, 2);

	/* tensor infos; offsets aligned in the data section */
	uint64_t off = 0;
	for (int i = 0; i < N_TENSORS + (o->dup_tensor ? 1 : 0); i++) {
		fxt *t = &r->t[i < N_TENSORS ? i : 0];
		off = (off + align - 1) / align * align;
		put_str(b, t->name);
		if (i < N_TENSORS)
			t->at = b->len;
		put_le(b, (uint64_t)t->nd, 4);
		for (int d = 0; d < t->nd; d++)
			put_le(b, (uint64_t)t->ne[d], 8);
		put_le(b, t->ggml, 4);
		put_le(b, i < N_TENSORS ? off : 0, 8);
		if (i < N_TENSORS) {
			t->off = off;
			off += t->nbytes;
		}
	}
	pad_to(b, align);
	r->data_off = b->len;
	/* data: byte k of tensor i is (i * 37 + k * 11 + 5) & 255 */
	for (int i = 0; i < N_TENSORS; i++) {
		while (b->len < r->data_off + r->t[i].off)
			put_le(b, 0xEE, 1);
		for (size_t k = 0; k < r->t[i].nbytes; k++)
			put_le(b, (uint64_t)(i * 37 + (int)k * 11 + 5) & 255, 1);
	}
}

static int data_ok(const ref *r, int i, const gguf_tensor *t)
{
	const unsigned char *p = t->data;
	for (size_t k = 0; k < r->t[i].nbytes; k++)
		if (p[k] != (unsigned char)((i * 37 + (int)k * 11 + 5) & 255))
			return 0;
	return 1;
}

/* ---- the reference file, read back -------------------------------------------------- */

static void check_scalars(const gguf_file *g, const ref *r)
{
	ds_err err = { 0 };
	uint8_t u8 = 0;
	int8_t i8 = 0;
	uint16_t u16 = 0;
	int16_t i16 = 0;
	uint32_t u32 = 0;
	int32_t i32 = 0;
	float f32 = 0;
	uint64_t u64 = 0;
	int64_t i64 = 0;
	double f64 = 0;
	int flag = 0;
	const char *s = NULL;
	size_t len = 0;
	CHECK_EQ(gguf_get_u8(g, "t.u8", &u8, &err), 0);
	CHECK_EQ(u8, r->u8);
	CHECK_EQ(gguf_get_i8(g, "t.i8", &i8, &err), 0);
	CHECK_EQ(i8, r->i8);
	CHECK_EQ(gguf_get_u16(g, "t.u16", &u16, &err), 0);
	CHECK_EQ(u16, r->u16);
	CHECK_EQ(gguf_get_i16(g, "t.i16", &i16, &err), 0);
	CHECK_EQ(i16, r->i16);
	CHECK_EQ(gguf_get_u32(g, "t.u32", &u32, &err), 0);
	CHECK_EQ(u32, r->u32);
	CHECK_EQ(gguf_get_i32(g, "t.i32", &i32, &err), 0);
	CHECK_EQ(i32, r->i32);
	CHECK_EQ(gguf_get_f32(g, "t.f32", &f32, &err), 0);
	CHECK(f32 == r->f32);
	CHECK_EQ(gguf_get_bool(g, "t.bool", &flag, &err), 0);
	CHECK_EQ(flag, 1);
	CHECK_EQ(gguf_get_u64(g, "t.u64", &u64, &err), 0);
	CHECK(u64 == r->u64);
	CHECK_EQ(gguf_get_i64(g, "t.i64", &i64, &err), 0);
	CHECK_EQ(i64, r->i64);
	CHECK_EQ(gguf_get_f64(g, "t.f64", &f64, &err), 0);
	CHECK(f64 == r->f64);
	CHECK_EQ(gguf_get_str(g, "t.str", &s, &len, &err), 0);
	CHECK_STR(s, r->str);
	CHECK_EQ(len, strlen(r->str));
	CHECK_EQ(gguf_get_str(g, "general.architecture", &s, NULL, &err), 0);
	CHECK_STR(s, "llama");

	/* wrong type, absent key: the value is untouched */
	u32 = 7;
	CHECK_EQ(gguf_get_u32(g, "t.i32", &u32, &err), DS_EFORMAT);
	CHECK(contains(err.msg, "'t.i32' is a i32, expected a u32"));
	CHECK_EQ(u32, 7);
	CHECK_EQ(gguf_get_u32(g, "no.such.key", &u32, &err), DS_ENOTFOUND);
	CHECK(contains(err.msg, "no.such.key"));
	CHECK_EQ(gguf_get_u32(g, "no.such.key", &u32, NULL), DS_ENOTFOUND);
	CHECK_EQ(gguf_get_str(g, "t.u8", &s, NULL, &err), DS_EFORMAT);
	CHECK_EQ(gguf_get_bool(g, "t.u8", &flag, &err), DS_EFORMAT);
	gguf_arr a;
	CHECK_EQ(gguf_get_arr(g, "t.str", GGUF_TYPE_COUNT, &a, &err), DS_EFORMAT);
	CHECK_EQ(gguf_get_arr(g, "a.i32", GGUF_TYPE_U32, &a, &err), DS_EFORMAT);
	CHECK(contains(err.msg, "array of i32, expected an array of u32"));

	/* lenient getters */
	CHECK_EQ(gguf_get_int(g, "t.i8", INT64_MIN, INT64_MAX, &i64, &err), 0);
	CHECK_EQ(i64, r->i8);
	CHECK_EQ(gguf_get_int(g, "t.u32", 0, UINT32_MAX, &i64, &err), 0);
	CHECK_EQ(i64, r->u32);
	CHECK_EQ(gguf_get_int(g, "t.bool", 0, 1, &i64, &err), 0);
	CHECK_EQ(i64, 1);
	CHECK_EQ(gguf_get_int(g, "t.small", 0, 299, &i64, &err), DS_ERANGE);
	CHECK(contains(err.msg, "300"));
	CHECK_EQ(gguf_get_int(g, "t.u64", INT64_MIN, INT64_MAX, &i64, &err), DS_ERANGE);
	CHECK_EQ(gguf_get_int(g, "t.f32", INT64_MIN, INT64_MAX, &i64, &err), DS_EFORMAT);
	CHECK_EQ(gguf_get_int(g, "t.str", INT64_MIN, INT64_MAX, &i64, &err), DS_EFORMAT);
	CHECK_EQ(gguf_get_float(g, "t.f32", &f64, &err), 0);
	CHECK(f64 == (double)r->f32);
	CHECK_EQ(gguf_get_float(g, "t.i16", &f64, &err), 0);
	CHECK(f64 == (double)r->i16);
	CHECK_EQ(gguf_get_float(g, "a.f32", &f64, &err), DS_EFORMAT);
}

static void check_arrays(const gguf_file *g, const ref *r)
{
	ds_err err = { 0 };
	gguf_arr a, b, c;
	size_t len;
	CHECK_EQ(gguf_get_arr(g, "a.u8", GGUF_TYPE_U8, &a, &err), 0);
	CHECK_EQ(a.n, 9);
	for (int i = 0; i < 9; i++)
		CHECK_EQ(gguf_arr_i64(&a, (uint64_t)i), r->au8[i]);
	CHECK_EQ(((const uint8_t *)a.data)[4], r->au8[4]);
	CHECK_EQ(gguf_get_arr(g, "a.i16", GGUF_TYPE_I16, &a, &err), 0);
	for (int i = 0; i < 3; i++)
		CHECK_EQ(gguf_arr_i64(&a, (uint64_t)i), r->ai16[i]);
	CHECK_EQ(gguf_get_arr(g, "a.i32", GGUF_TYPE_COUNT, &a, &err), 0);
	CHECK_EQ(a.type, GGUF_TYPE_I32);
	CHECK_EQ(a.n, 7);
	for (int i = 0; i < 7; i++) {
		CHECK_EQ(gguf_arr_i64(&a, (uint64_t)i), r->ai32[i]);
		CHECK(gguf_arr_f64(&a, (uint64_t)i) == (double)r->ai32[i]);
	}
	CHECK_EQ(gguf_arr_i64(&a, 7), 0); /* out of range: 0 */
	CHECK(gguf_arr_str(&a, 0, &len) == NULL);
	CHECK_EQ(gguf_arr_arr(&a, 0, &b), DS_EINVAL);
	CHECK_EQ(gguf_get_arr(g, "a.f32", GGUF_TYPE_F32, &a, &err), 0);
	for (int i = 0; i < 5; i++)
		CHECK(gguf_arr_f64(&a, (uint64_t)i) == (double)r->af32[i]);
	CHECK_EQ(gguf_arr_i64(&a, 0), 0); /* not an integer array */
	CHECK_EQ(gguf_get_arr(g, "a.u64", GGUF_TYPE_U64, &a, &err), 0);
	for (int i = 0; i < 3; i++)
		CHECK(gguf_arr_u64(&a, (uint64_t)i) == r->au64[i]);
	CHECK_EQ(gguf_get_arr(g, "a.f64", GGUF_TYPE_F64, &a, &err), 0);
	for (int i = 0; i < 4; i++)
		CHECK(gguf_arr_f64(&a, (uint64_t)i) == r->af64[i]);
	CHECK_EQ(gguf_get_arr(g, "a.bool", GGUF_TYPE_BOOL, &a, &err), 0);
	for (int i = 0; i < 6; i++)
		CHECK_EQ(gguf_arr_i64(&a, (uint64_t)i), r->abool[i]);
	CHECK_EQ(gguf_get_arr(g, "a.str", GGUF_TYPE_STRING, &a, &err), 0);
	CHECK_EQ(a.n, N_ASTR);
	for (int i = 0; i < N_ASTR; i++) {
		const char *s = gguf_arr_str(&a, (uint64_t)i, &len);
		CHECK(s != NULL && len == strlen(r->astr[i]) && memcmp(s, r->astr[i], len) == 0);
	}
	CHECK(gguf_arr_str(&a, N_ASTR, &len) == NULL);
	CHECK_EQ(gguf_get_arr(g, "a.empty", GGUF_TYPE_I64, &a, &err), 0);
	CHECK_EQ(a.n, 0);
	CHECK_EQ(gguf_arr_i64(&a, 0), 0);

	CHECK_EQ(gguf_get_arr(g, "a.nested", GGUF_TYPE_ARRAY, &a, &err), 0);
	CHECK_EQ(a.n, 3);
	static const int want_n[3] = { 2, 0, 1 };
	static const int want_s[3][2] = { { 0, 1 }, { -1, -1 }, { 3, -1 } };
	for (int i = 0; i < 3; i++) {
		CHECK_EQ(gguf_arr_arr(&a, (uint64_t)i, &b), 0);
		CHECK_EQ(b.type, GGUF_TYPE_STRING);
		CHECK_EQ(b.n, want_n[i]);
		for (int k = 0; k < want_n[i]; k++) {
			const char *s = gguf_arr_str(&b, (uint64_t)k, &len);
			const char *w = r->astr[want_s[i][k]];
			CHECK(s && len == strlen(w) && memcmp(s, w, len) == 0);
		}
	}
	CHECK_EQ(gguf_arr_arr(&a, 3, &b), DS_EINVAL);
	CHECK_EQ(gguf_get_arr(g, "a.deep", GGUF_TYPE_ARRAY, &a, &err), 0);
	CHECK_EQ(gguf_arr_arr(&a, 0, &b), 0);
	CHECK_EQ(b.n, 2);
	CHECK_EQ(gguf_arr_arr(&b, 0, &c), 0);
	CHECK(c.type == GGUF_TYPE_U32 && c.n == 2 && gguf_arr_i64(&c, 0) == 1 && gguf_arr_i64(&c, 1) == 2);
	CHECK_EQ(gguf_arr_arr(&b, 1, &c), 0);
	CHECK(c.n == 1 && gguf_arr_i64(&c, 0) == 3);
	CHECK_EQ(gguf_arr_arr(&a, 1, &b), 0);
	CHECK_EQ(gguf_arr_arr(&b, 0, &c), 0);
	CHECK(c.n == 1 && gguf_arr_u64(&c, 0) == 4);
}

static void check_tensors(const gguf_file *g, const ref *r, uint32_t align)
{
	ds_err err = { 0 };
	size_t size;
	const unsigned char *map = gguf_mapping(g, &size);
	CHECK_EQ(gguf_alignment(g), align);
	CHECK_EQ(gguf_data_offset(g), r->data_off);
	CHECK_EQ(r->data_off % align, 0);
	CHECK_EQ(gguf_tensor_count(g), N_TENSORS);
	CHECK_EQ(gguf_file_bytes(g), size);
	size_t total = 0;
	for (int i = 0; i < N_TENSORS; i++) {
		const fxt *w = &r->t[i];
		const gguf_tensor *t = gguf_tensor_at(g, (size_t)i);
		CHECK(t != NULL && t == gguf_find_tensor(g, w->name));
		if (!t)
			continue;
		CHECK_STR(t->name, w->name);
		CHECK_EQ(t->ggml_type, w->ggml);
		CHECK_EQ(t->dtype, w->dtype);
		CHECK_EQ(t->n_dims, w->nd);
		for (int d = 0; d < 4; d++)
			CHECK_EQ(t->ne[d], d < w->nd ? w->ne[d] : 1);
		for (int d = 0; d < w->nd; d++)
			CHECK_EQ(t->shape[d], w->ne[w->nd - 1 - d]);
		CHECK_EQ(t->offset, w->off);
		CHECK_EQ(t->nbytes, w->nbytes);
		CHECK((const unsigned char *)t->data == map + r->data_off + w->off);
		CHECK(data_ok(r, i, t));
		total += w->nbytes;
	}
	CHECK_EQ(gguf_total_bytes(g), total);
	CHECK(gguf_tensor_at(g, N_TENSORS) == NULL);
	CHECK(gguf_find_tensor(g, "nope") == NULL);
	CHECK_STR(gguf_find_tensor(g, "u.q5_0")->type_name, "Q5_0");
	CHECK_STR(gguf_find_tensor(g, "blk.0.q4k")->type_name, "Q4_K");

	int64_t s2[2] = { 2, 64 }, s2any[2] = { -1, 64 }, s2bad[2] = { 2, 32 };
	CHECK(gguf_get_tensor(g, "blk.0.q8", KB_Q8_0, 2, s2, &err) != NULL);
	CHECK(gguf_get_tensor(g, "blk.0.q8", GGUF_DTYPE_ANY, 2, s2any, &err) != NULL);
	CHECK(gguf_get_tensor(g, "blk.0.q8", GGUF_DTYPE_ANY, -1, NULL, &err) != NULL);
	CHECK(gguf_get_tensor(g, "blk.0.q8", KB_F32, 2, s2, &err) == NULL);
	CHECK_EQ(err.code, DS_EFORMAT);
	CHECK(contains(err.msg, "type F32 expected, found Q8_0"));
	CHECK(gguf_get_tensor(g, "blk.0.q8", KB_Q8_0, 2, s2bad, &err) == NULL);
	CHECK(contains(err.msg, "expected shape [2, 32], found [2, 64]"));
	int64_t s3[3] = { 1, 2, 64 };
	CHECK(gguf_get_tensor(g, "blk.0.q8", KB_Q8_0, 3, s3, &err) == NULL);
	CHECK(contains(err.msg, "expected shape [1, 2, 64], found [2, 64]"));
	CHECK(gguf_get_tensor(g, "u.q5_0", GGUF_DTYPE_ANY, -1, NULL, &err) == NULL);
	CHECK_EQ(err.code, DS_EUNSUPPORTED);
	CHECK(contains(err.msg, "Q5_0"));
	CHECK(gguf_get_tensor(g, "absent", GGUF_DTYPE_ANY, -1, NULL, &err) == NULL);
	CHECK_EQ(err.code, DS_ENOTFOUND);
	CHECK(contains(err.msg, gguf_path(g)));
}

static void check_kv_iteration(const gguf_file *g, int with_align)
{
	static const char *const keys[KV_COUNT_BASE] = {
		"t.u8", "t.i8", "t.u16", "t.i16", "t.u32", "t.i32", "t.f32", "t.bool",
		"t.u64", "t.i64", "t.f64", "t.str", "t.small", "a.u8", "a.i16", "a.i32",
		"a.f32", "a.u64", "a.f64", "a.bool", "a.str", "a.empty",
	};
	/* ... then a.nested, a.deep, general.architecture: counted below */
	CHECK_EQ(gguf_kv_count(g), KV_COUNT_BASE + 3 + with_align);
	for (int i = 0; i < KV_COUNT_BASE; i++) {
		CHECK_STR(gguf_kv_key(g, (size_t)i), keys[i]);
		CHECK_EQ(gguf_find_key(g, keys[i]), i);
	}
	CHECK_EQ(gguf_kv_type(g, 0), GGUF_TYPE_U8);
	CHECK_EQ(gguf_kv_type(g, 11), GGUF_TYPE_STRING);
	CHECK_EQ(gguf_kv_type(g, 13), GGUF_TYPE_ARRAY);
	CHECK(gguf_kv_key(g, 1000) == NULL);
	CHECK_EQ(gguf_kv_type(g, 1000), GGUF_TYPE_COUNT);
	CHECK_EQ(gguf_find_key(g, "nope"), -1);
	CHECK_STR(gguf_type_name(GGUF_TYPE_F64), "f64");
}

TEST(gguf_reads_every_value_type_and_tensor)
{
	static const uint32_t aligns[] = { 0, 64, 1, 4096 };
	char *dir = ut_tmpdir_new("gguf"), path[1024];
	CHECK(dir != NULL);
	if (!dir)
		return;
	buf b;
	buf_init(&b, 0);
	for (size_t k = 0; k < sizeof aligns / sizeof aligns[0]; k++) {
		ref r;
		marks m;
		bopt o = { aligns[k], 0, 0 };
		ref_init(&r);
		build(&r, &o, &b, &m);
		snprintf(path, sizeof path, "%s/ref%zu.gguf", dir, k);
		write_bytes(path, b.data, b.len);
		ds_err err = { 0 };
		gguf_file *g = gguf_open(path, &err);
		CHECK(g != NULL);
		if (!g) {
			fprintf(stderr, "    %s\n", err.msg);
			continue;
		}
		CHECK_STR(gguf_path(g), path);
		CHECK_EQ(gguf_version(g), 3);
		check_kv_iteration(g, aligns[k] != 0);
		check_scalars(g, &r);
		check_arrays(g, &r);
		check_tensors(g, &r, aligns[k] ? aligns[k] : 32);
		gguf_close(g);
		/* version 2 has the same layout */
		patch_le(&b, m.version, 2, 4);
		write_bytes(path, b.data, b.len);
		g = gguf_open(path, &err);
		CHECK(g != NULL && gguf_version(g) == 2);
		gguf_close(g);
	}
	gguf_close(NULL);
	buf_free(&b);
	ut_tmpdir_free(dir);
}

TEST(gguf_ggml_type_table)
{
	CHECK_EQ(gguf_ggml_to_dtype(0), KB_F32);
	CHECK_EQ(gguf_ggml_to_dtype(1), KB_F16);
	CHECK_EQ(gguf_ggml_to_dtype(2), KB_Q4_0);
	CHECK_EQ(gguf_ggml_to_dtype(3), KB_Q4_1);
	CHECK_EQ(gguf_ggml_to_dtype(8), KB_Q8_0);
	CHECK_EQ(gguf_ggml_to_dtype(12), KB_Q4_K);
	CHECK_EQ(gguf_ggml_to_dtype(13), KB_Q5_K);
	CHECK_EQ(gguf_ggml_to_dtype(14), KB_Q6_K);
	CHECK_EQ(gguf_ggml_to_dtype(30), KB_BF16);
	CHECK_EQ(gguf_ggml_to_dtype(6), GGUF_DTYPE_NONE);
	CHECK_EQ(gguf_ggml_to_dtype(4), GGUF_DTYPE_NONE);
	CHECK_EQ(gguf_ggml_to_dtype(1000), GGUF_DTYPE_NONE);
	CHECK_STR(gguf_ggml_type_name(23), "IQ4_XS");
	CHECK_STR(gguf_ggml_type_name(1000), "?");
	for (int t = 0; t < KB_DTYPE_COUNT; t++) {
		int id = gguf_dtype_to_ggml((enum kb_dtype)t);
		if (t == KB_F8_E4M3) {
			CHECK_EQ(id, -1);
			continue;
		}
		CHECK(id >= 0 && gguf_ggml_to_dtype((uint32_t)id) == (enum kb_dtype)t);
	}
}

/* ---- corrupt files ---------------------------------------------------------------- */

/* Opens b's bytes written to path; expects failure with code and a message
 * holding want (and the path). */
static void expect_fail(const char *path, const buf *b, int code, const char *want, int line)
{
	ds_err err = { 0 };
	write_bytes(path, b->data, b->len);
	gguf_file *g = gguf_open(path, &err);
	if (g) {
		ut_fail(__FILE__, line, "opened a corrupt file (want \"%s\")", want);
		gguf_close(g);
		return;
	}
	if (err.code != code || !contains(err.msg, want) || !contains(err.msg, path))
		ut_fail(__FILE__, line, "code %s msg \"%s\"; want %s \"%s\"", ds_status_name(err.code),
			err.msg, ds_status_name(code), want);
}

TEST(gguf_every_prefix_fails_cleanly)
{
	char *dir = ut_tmpdir_new("gguf"), path[1024];
	if (!dir)
		return;
	ref r;
	marks m;
	bopt o = { 0, 0, 0 };
	buf b, cut;
	buf_init(&b, 0);
	buf_init(&cut, 0);
	ref_init(&r);
	build(&r, &o, &b, &m);
	snprintf(path, sizeof path, "%s/cut.gguf", dir);
	int bad = 0;
	for (size_t n = 0; n < b.len; n++) {
		ds_err err = { 0 };
		write_bytes(path, b.data, n);
		gguf_file *g = gguf_open(path, &err);
		if (g || err.code != DS_EFORMAT || !contains(err.msg, path) ||
		    !contains(err.msg, "truncated")) {
			if (bad++ < 5)
				ut_fail(__FILE__, __LINE__, "prefix of %zu bytes: %s %s", n,
					g ? "opened" : ds_status_name(err.code), err.msg);
		}
		gguf_close(g);
	}
	ds_err err = { 0 };
	write_bytes(path, b.data, b.len);
	gguf_file *g = gguf_open(path, &err);
	CHECK(g != NULL);
	gguf_close(g);
	buf_free(&cut);
	buf_free(&b);
	ut_tmpdir_free(dir);
}

TEST(gguf_rejects_each_kind_of_corruption)
{
	char *dir = ut_tmpdir_new("gguf"), path[1024];
	if (!dir)
		return;
	snprintf(path, sizeof path, "%s/bad.gguf", dir);
	ref r;
	marks m;
	bopt o = { 0, 0, 0 };
	buf b;
	buf_init(&b, 0);
	ref_init(&r);
#define FRESH() build(&r, &o, &b, &m)
	FRESH(), b.data[0] = 'X';
	expect_fail(path, &b, DS_EFORMAT, "not a GGUF file", __LINE__);
	FRESH(), patch_le(&b, m.version, 1, 4);
	expect_fail(path, &b, DS_EUNSUPPORTED, "version 1 is not supported", __LINE__);
	FRESH(), patch_le(&b, m.version, 4, 4);
	expect_fail(path, &b, DS_EUNSUPPORTED, "version 4 is not supported", __LINE__);
	FRESH(), patch_le(&b, m.version, 0x03000000u, 4);
	expect_fail(path, &b, DS_EUNSUPPORTED, "big-endian", __LINE__);
	FRESH(), patch_le(&b, m.n_kv, 1ull << 60, 8);
	expect_fail(path, &b, DS_EFORMAT, "metadata entries cannot fit", __LINE__);
	FRESH(), patch_le(&b, m.n_t, 1ull << 40, 8);
	expect_fail(path, &b, DS_EFORMAT, "tensor infos cannot fit", __LINE__);
	FRESH(), patch_le(&b, m.u8_type, 13, 4);
	expect_fail(path, &b, DS_EFORMAT, "unknown value type 13", __LINE__);
	FRESH(), patch_le(&b, m.arr_elem, 99, 4);
	expect_fail(path, &b, DS_EFORMAT, "unknown array element type 99", __LINE__);
	FRESH(), patch_le(&b, m.str_len, 1ull << 62, 8);
	expect_fail(path, &b, DS_EFORMAT, "metadata 't.str'", __LINE__);
	FRESH(), patch_le(&b, m.arr_count, 1ull << 61, 8);
	expect_fail(path, &b, DS_EFORMAT, "array of 2305843009213693952 i32 elements", __LINE__);
	FRESH(), b.data[m.key2 + 1] = '\0';
	expect_fail(path, &b, DS_EFORMAT, "holds a NUL byte", __LINE__);
	/* a key made empty: its bytes then read as the next fields */
	FRESH(), patch_le(&b, m.key2 - 8, 0, 8);
	expect_fail(path, &b, DS_EFORMAT, "is empty", __LINE__);
	const fxt *t1 = &r.t[1]; /* blk.0.q8: nd 2, ne {64, 2}, Q8_0 */
	FRESH(), patch_le(&b, t1->at, 5, 4);
	expect_fail(path, &b, DS_EFORMAT, "has 5 dimensions; at most 4", __LINE__);
	FRESH(), patch_le(&b, t1->at + 4, 63, 8);
	expect_fail(path, &b, DS_EFORMAT, "rows of 63 elements are not a whole number of 32-element",
		    __LINE__);
	FRESH(), patch_le(&b, t1->at + 4, 1ull << 63, 8);
	expect_fail(path, &b, DS_EFORMAT, "too large", __LINE__);
	FRESH(), patch_le(&b, t1->at + 4, 1ull << 40, 8), patch_le(&b, t1->at + 12, 1ull << 40, 8);
	expect_fail(path, &b, DS_EFORMAT, "size overflows", __LINE__);
	FRESH(), patch_le(&b, t1->at + 4 + 16 + 4, t1->off + 1, 8);
	expect_fail(path, &b, DS_EFORMAT, "is not a multiple of the alignment 32", __LINE__);
	FRESH(), patch_le(&b, t1->at + 4 + 16 + 4, 1ull << 40, 8);
	expect_fail(path, &b, DS_EFORMAT, "outside the data section", __LINE__);
	FRESH(), patch_le(&b, t1->at + 4 + 16, 0, 4); /* Q8_0 -> F32: 4x the bytes, past the end? */
	{
		/* F32 [2][64] = 512 bytes at its offset: lies inside only if the file is long enough */
		ds_err err = { 0 };
		write_bytes(path, b.data, b.len);
		gguf_file *g = gguf_open(path, &err);
		if (g) {
			const gguf_tensor *t = gguf_find_tensor(g, "blk.0.q8");
			CHECK(t && t->nbytes == 512 && t->dtype == KB_F32);
		} else {
			CHECK(contains(err.msg, "outside the data section"));
		}
		gguf_close(g);
	}
	/* an unknown ggml type is listed, size unknown, refused when requested */
	FRESH(), patch_le(&b, t1->at + 4 + 16, 777, 4);
	{
		ds_err err = { 0 };
		write_bytes(path, b.data, b.len);
		gguf_file *g = gguf_open(path, &err);
		CHECK(g != NULL);
		const gguf_tensor *t = g ? gguf_find_tensor(g, "blk.0.q8") : NULL;
		CHECK(t && t->dtype == GGUF_DTYPE_NONE && t->nbytes == 0);
		CHECK(t && contains(t->type_name, "unknown-777"));
		CHECK(g && !gguf_get_tensor(g, "blk.0.q8", GGUF_DTYPE_ANY, -1, NULL, &err));
		CHECK(contains(err.msg, "ggml type 777 (unknown-777) is not supported"));
		gguf_close(g);
	}

	o.dup_key = 1;
	FRESH();
	expect_fail(path, &b, DS_EFORMAT, "metadata key 't.u16' appears twice", __LINE__);
	o.dup_key = 0, o.dup_tensor = 1;
	FRESH();
	expect_fail(path, &b, DS_EFORMAT, "tensor 'tok.f32' appears twice", __LINE__);
	o.dup_tensor = 0, o.alignment = 64;
	FRESH(), patch_le(&b, m.align_value, 48, 4);
	expect_fail(path, &b, DS_EFORMAT, "general.alignment = 48 is not a power of two", __LINE__);
	FRESH(), patch_le(&b, m.align_value, 0, 4);
	expect_fail(path, &b, DS_EFORMAT, "general.alignment = 0", __LINE__);
	FRESH(), patch_le(&b, m.align_value - 4, GGUF_TYPE_I32, 4);
	expect_fail(path, &b, DS_EFORMAT, "general.alignment must be a u32, found i32", __LINE__);
#undef FRESH

	/* arrays nested 8 deep are fine, 9 are not */
	for (int depth = 8; depth <= 9; depth++) {
		buf_clear(&b);
		buf_append(&b, "GGUF", 4);
		put_le(&b, 3, 4), put_le(&b, 0, 8), put_le(&b, 1, 8);
		put_key(&b, "deep", GGUF_TYPE_ARRAY);
		for (int i = 1; i < depth; i++)
			put_le(&b, GGUF_TYPE_ARRAY, 4), put_le(&b, 1, 8);
		put_le(&b, GGUF_TYPE_U8, 4), put_le(&b, 1, 8), put_le(&b, 42, 1);
		if (depth == 9) {
			expect_fail(path, &b, DS_EFORMAT, "nested more than 8 deep", __LINE__);
		} else {
			ds_err err = { 0 };
			write_bytes(path, b.data, b.len);
			gguf_file *g = gguf_open(path, &err);
			gguf_arr a;
			CHECK(g && gguf_get_arr(g, "deep", GGUF_TYPE_ARRAY, &a, &err) == 0);
			for (int i = 1; g && i < depth; i++)
				CHECK_EQ(gguf_arr_arr(&a, 0, &a), 0);
			CHECK(g && a.type == GGUF_TYPE_U8 && gguf_arr_i64(&a, 0) == 42);
			/* no tensors: no data section needed */
			CHECK(g && gguf_tensor_count(g) == 0 && gguf_data_offset(g) >= b.len);
			gguf_close(g);
		}
	}

	/* not there, not a file, empty */
	ds_err err = { 0 };
	char missing[1100];
	snprintf(missing, sizeof missing, "%s/missing.gguf", dir);
	CHECK(gguf_open(missing, &err) == NULL);
	CHECK_EQ(err.code, DS_ENOTFOUND);
	CHECK(contains(err.msg, missing));
	CHECK(gguf_open(dir, &err) == NULL);
	CHECK(contains(err.msg, "not a regular file"));
	buf_clear(&b);
	expect_fail(path, &b, DS_EFORMAT, "truncated: 0 bytes", __LINE__);
	CHECK(gguf_open(missing, NULL) == NULL);
	buf_free(&b);
	ut_tmpdir_free(dir);
}

/* Reads everything a file offers; every pointer must lie inside the mapping. */
static size_t walk_arr(const gguf_arr *a, const unsigned char *lo, const unsigned char *hi, int depth)
{
	size_t sum = 0;
	for (uint64_t i = 0; i < a->n && i < 4096; i++) {
		if (a->type == GGUF_TYPE_STRING) {
			size_t len;
			const unsigned char *s = (const unsigned char *)gguf_arr_str(a, i, &len);
			CHECK(s >= lo && s + len <= hi);
			for (size_t k = 0; k < len; k++)
				sum += s[k];
		} else if (a->type == GGUF_TYPE_ARRAY) {
			gguf_arr sub;
			CHECK_EQ(gguf_arr_arr(a, i, &sub), 0);
			CHECK(depth < GGUF_MAX_ARRAY_DEPTH);
			sum += walk_arr(&sub, lo, hi, depth + 1);
		} else {
			sum += (size_t)gguf_arr_u64(a, i) + (size_t)gguf_arr_f64(a, i);
		}
	}
	return sum;
}

static size_t walk(const gguf_file *g)
{
	size_t size, sum = 0;
	const unsigned char *lo = gguf_mapping(g, &size), *hi = lo + size;
	ds_err err = { 0 };
	for (size_t i = 0; i < gguf_kv_count(g); i++) {
		const char *key = gguf_kv_key(g, i);
		int64_t v;
		double d;
		const char *s;
		size_t len;
		gguf_arr a;
		CHECK_EQ(gguf_find_key(g, key), (int64_t)i);
		if (gguf_get_int(g, key, INT64_MIN, INT64_MAX, &v, &err) == 0)
			sum += (size_t)v;
		if (gguf_get_float(g, key, &d, &err) == 0)
			sum += d == d ? 1 : 0;
		if (gguf_get_str(g, key, &s, &len, &err) == 0) {
			CHECK(s[len] == '\0');
			sum += len;
		}
		if (gguf_get_arr(g, key, GGUF_TYPE_COUNT, &a, &err) == 0)
			sum += walk_arr(&a, lo, hi, 1);
	}
	for (size_t i = 0; i < gguf_tensor_count(g); i++) {
		const gguf_tensor *t = gguf_tensor_at(g, i);
		const unsigned char *p = t->data;
		CHECK(p >= lo && p + t->nbytes <= hi);
		CHECK(gguf_find_tensor(g, t->name) == t);
		for (size_t k = 0; k < t->nbytes; k++)
			sum += p[k];
	}
	return sum;
}

TEST(gguf_random_byte_flips_never_crash)
{
	char *dir = ut_tmpdir_new("gguf"), path[1024];
	if (!dir)
		return;
	snprintf(path, sizeof path, "%s/flip.gguf", dir);
	ref r;
	marks m;
	bopt o = { 64, 0, 0 };
	buf b, c;
	buf_init(&b, 0);
	buf_init(&c, 0);
	ref_init(&r);
	build(&r, &o, &b, &m);
	int opened = 0, failed = 0;
	size_t sum = 0;
	for (int it = 0; it < 1500; it++) {
		buf_clear(&c);
		buf_append(&c, b.data, b.len);
		int flips = 1 + (int)(ut_rand_u64() % 4);
		for (int f = 0; f < flips; f++) {
			/* mostly in the header and infos, where the structure is */
			size_t at = (size_t)(ut_rand_u64() % (it % 4 ? r.data_off : c.len));
			unsigned char x = (unsigned char)(ut_rand_u64() % 255 + 1);
			if (ut_rand_u64() % 3 == 0)
				x = (unsigned char)(1u << (ut_rand_u64() % 8));
			c.data[at] = (char)((unsigned char)c.data[at] ^ x);
		}
		write_bytes(path, c.data, c.len);
		ds_err err = { 0 };
		gguf_file *g = gguf_open(path, &err);
		if (g) {
			opened++;
			sum += walk(g);
			gguf_close(g);
		} else {
			failed++;
			CHECK(err.code != DS_OK && err.msg[0] != '\0');
			CHECK(contains(err.msg, path));
		}
	}
	CHECK(opened > 100 && failed > 100);
	(void)sum;
	buf_free(&c);
	buf_free(&b);
	ut_tmpdir_free(dir);
}

/* ---- the tokenizer from GGUF metadata --------------------------------------------------- */

/* Byte-level text of s (the GPT-2 alphabet), into out (NUL-terminated). */
static void bl(const char *s, char *out, size_t cap)
{
	size_t o = 0;
	for (; *s; s++) {
		unsigned char u[4];
		size_t n = utf8_encode(tok_byte_to_cp((unsigned char)*s), u);
		if (o + n + 1 > cap)
			break;
		memcpy(out + o, u, n);
		o += n;
	}
	out[o] = '\0';
}

typedef struct tokfx {
	const char *model, *pre;
	int with_types, add_bos;     /* add_bos: -1 = key absent */
	int64_t bos, eos, pad;       /* -1 = key absent */
	const char *bad_merge;       /* replaces merge 0 */
	int types_len_delta;
	const char *template;
} tokfx;

/* Tokens: the 256 bytes (ids 0..255), then merges' results, control,
 * user-defined, unused, a repeated text. */
static const char *const merges_txt[][2] = {
	{ "h", "e" }, { "l", "l" }, { "he", "ll" }, { "hell", "o" }, { " ", "w" }, { "1", "2" },
	{ " w", "o" },
};
#define N_MERGES (sizeof merges_txt / sizeof merges_txt[0])
enum { ID_HE = 256, ID_LL, ID_HELL, ID_HELLO, ID_SPW, ID_12, ID_SPWO, ID_CTL_A, ID_CTL_B,
       ID_USER, ID_UNUSED, ID_REPEAT, N_TOKS };

static void build_tok_gguf(const tokfx *f, buf *b)
{
	char tmp[64], tmp2[64];
	int n_kv = 3 + (f->model ? 1 : 0) + (f->pre ? 1 : 0) + (f->with_types ? 1 : 0) +
		   (f->add_bos >= 0 ? 1 : 0) + (f->bos >= 0) + (f->eos >= 0) + (f->pad >= 0) +
		   (f->template ? 1 : 0);
	buf_clear(b);
	buf_append(b, "GGUF", 4);
	put_le(b, 3, 4), put_le(b, 0, 8), put_le(b, (uint64_t)n_kv, 8);
	put_key(b, "general.architecture", GGUF_TYPE_STRING), put_str(b, "llama");
	if (f->model)
		put_key(b, "tokenizer.ggml.model", GGUF_TYPE_STRING), put_str(b, f->model);
	if (f->pre)
		put_key(b, "tokenizer.ggml.pre", GGUF_TYPE_STRING), put_str(b, f->pre);
	put_key(b, "tokenizer.ggml.tokens", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_STRING, 4);
	put_le(b, N_TOKS, 8);
	for (int i = 0; i < 256; i++) {
		unsigned char u[4];
		size_t n = utf8_encode(tok_byte_to_cp((unsigned char)i), u);
		put_strn(b, (const char *)u, n);
	}
	for (size_t k = 0; k < N_MERGES; k++) {
		snprintf(tmp2, sizeof tmp2, "%s%s", merges_txt[k][0], merges_txt[k][1]);
		bl(tmp2, tmp, sizeof tmp);
		put_str(b, tmp);
	}
	put_str(b, "<|im_start|>");
	put_str(b, "<|im_end|>");
	put_str(b, "<tool>");
	put_str(b, "[PAD0]");
	put_str(b, "he"); /* ID_REPEAT: same text as ID_HE */
	if (f->with_types) {
		int n = N_TOKS + f->types_len_delta;
		put_key(b, "tokenizer.ggml.token_type", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_I32, 4);
		put_le(b, (uint64_t)n, 8);
		for (int i = 0; i < n; i++)
			put_le(b, i == ID_CTL_A || i == ID_CTL_B ? 3 : i == ID_USER ? 4 : i == ID_UNUSED ? 5 : 1, 4);
	}
	put_key(b, "tokenizer.ggml.merges", GGUF_TYPE_ARRAY), put_le(b, GGUF_TYPE_STRING, 4);
	put_le(b, N_MERGES, 8);
	for (size_t k = 0; k < N_MERGES; k++) {
		char l[16], r[16];
		bl(merges_txt[k][0], l, sizeof l);
		bl(merges_txt[k][1], r, sizeof r);
		snprintf(tmp, sizeof tmp, "%s %s", l, r);
		put_str(b, k == 0 && f->bad_merge ? f->bad_merge : tmp);
	}
	if (f->add_bos >= 0)
		put_key(b, "tokenizer.ggml.add_bos_token", GGUF_TYPE_BOOL), put_le(b, (uint64_t)f->add_bos, 1);
	if (f->bos >= 0)
		put_key(b, "tokenizer.ggml.bos_token_id", GGUF_TYPE_U32), put_le(b, (uint64_t)f->bos, 4);
	if (f->eos >= 0)
		put_key(b, "tokenizer.ggml.eos_token_id", GGUF_TYPE_I32), put_le(b, (uint64_t)f->eos, 4);
	if (f->pad >= 0)
		put_key(b, "tokenizer.ggml.padding_token_id", GGUF_TYPE_U32), put_le(b, (uint64_t)f->pad, 4);
	if (f->template)
		put_key(b, "tokenizer.chat_template", GGUF_TYPE_STRING), put_str(b, f->template);
	/* the mandatory trailer of a file with no tensors is nothing at all */
}

static tok *load_tok(const char *path, const tokfx *f, buf *b, ds_err *err)
{
	build_tok_gguf(f, b);
	write_bytes(path, b->data, b->len);
	gguf_file *g = gguf_open(path, err);
	if (!g)
		return NULL;
	tok *t = tok_load_gguf(g, err);
	gguf_close(g); /* the tok must not borrow from the file */
	return t;
}

static int encode_is(const tok *t, const char *text, unsigned flags, const int32_t *want, size_t n)
{
	tok_ids ids;
	ds_err err = { 0 };
	tok_ids_init(&ids, 0);
	int ok = tok_encode(t, text, strlen(text), flags, &ids, &err) == 0 && ids.n == n &&
		 (n == 0 || memcmp(ids.v, want, n * sizeof *want) == 0);
	if (!ok) {
		fprintf(stderr, "    encode \"%s\":", text);
		for (size_t i = 0; i < ids.n; i++)
			fprintf(stderr, " %d", ids.v[i]);
		fprintf(stderr, "\n");
	}
	tok_ids_free(&ids);
	return ok;
}

TEST(gguf_tokenizer_from_metadata)
{
	char *dir = ut_tmpdir_new("gguf"), path[1024];
	if (!dir)
		return;
	snprintf(path, sizeof path, "%s/tok.gguf", dir);
	buf b;
	buf_init(&b, 0);
	ds_err err = { 0 };
	tokfx f = { "gpt2", "smollm", 1, 0, ID_CTL_A, ID_CTL_B, 1000000, NULL, 0,
		    "{{ '<|im_start|>' }} {{ '<|im_end|>' }} You are a helpful AI assistant named "
		    "SmolLM, trained by Hugging Face" };
	tok *t = load_tok(path, &f, &b, &err);
	CHECK(t != NULL);
	if (!t) {
		fprintf(stderr, "    %s\n", err.msg);
		goto out;
	}
	CHECK_EQ(tok_vocab_size(t), N_TOKS);
	CHECK_EQ(tok_bos_id(t), ID_CTL_A);
	CHECK_EQ(tok_eos_id(t), ID_CTL_B);
	CHECK_EQ(tok_add_bos_default(t), 0);
	CHECK(contains(tok_chat_template(t), "SmolLM"));
	{
		const int32_t hello[] = { ID_HELLO };
		const int32_t hw[] = { ID_HELLO, ID_SPWO, 'r', 'l', 'd' };
		const int32_t ctl[] = { ID_CTL_A, ID_HELLO, ID_CTL_B, ID_USER };
		const int32_t digits[] = { ' ', '1', '2', '3' }; /* smollm: digits one by one */
		const int32_t bos_hello[] = { ID_CTL_A, ID_HELLO };
		CHECK(encode_is(t, "hello", 0, hello, 1));
		CHECK(encode_is(t, "hello world", 0, hw, 5));
		CHECK(encode_is(t, "<|im_start|>hello<|im_end|><tool>", TOK_PARSE_SPECIAL, ctl, 4));
		CHECK(encode_is(t, " 123", TOK_PARSE_SPECIAL, digits, 4));
		CHECK(encode_is(t, "hello", TOK_ADD_BOS, bos_hello, 2));
		/* without parse_special the markers are plain text */
		tok_ids ids;
		tok_ids_init(&ids, 0);
		CHECK_EQ(tok_encode(t, "<tool>", 6, 0, &ids, &err), 0);
		CHECK(ids.n > 1 && ids.v[0] != ID_USER);
		tok_ids_free(&ids);
		/* decoding: control skipped by TOK_SKIP_SPECIAL, user-defined kept */
		buf out;
		buf_init(&out, 0);
		CHECK_EQ(tok_decode(t, ctl, 4, TOK_SKIP_SPECIAL, &out, &err), 0);
		CHECK_STR(out.data, "hello<tool>");
		buf_clear(&out);
		CHECK_EQ(tok_decode(t, ctl, 4, 0, &out, &err), 0);
		CHECK_STR(out.data, "<|im_start|>hello<|im_end|><tool>");
		/* unused ids are no token; a repeated text keeps its first id */
		const int32_t unused[] = { ID_UNUSED };
		CHECK_EQ(tok_decode(t, unused, 1, 0, &out, &err), DS_EINVAL);
		CHECK_EQ(tok_find_token(t, "he", 2), ID_HE);
		CHECK(tok_token_text(t, ID_REPEAT, NULL) == NULL);
		buf_free(&out);
	}
	tok_gguf_meta m;
	{
		gguf_file *g = gguf_open(path, &err);
		CHECK(g && tok_gguf_meta_read(g, &m, &err) == 0);
		if (g) {
			CHECK_STR(m.model, "gpt2");
			CHECK_STR(m.pre, "smollm");
			CHECK_EQ(m.n_tokens, N_TOKS);
			CHECK_EQ(m.bos, ID_CTL_A);
			CHECK_EQ(m.eos, ID_CTL_B);
			CHECK_EQ(m.pad, -1); /* out of range: counts as absent */
			CHECK_EQ(m.eot, -1);
			CHECK_EQ(m.unk, -1);
			CHECK_EQ(m.add_bos, 0);
			CHECK(contains(m.chat_template, "<|im_start|>"));
		}
		gguf_close(g);
	}
	tok_free(t);

	/* gpt2 pre: "12" merges; llama-bpe: add_bos defaults to on; no types: all normal */
	tokfx f2 = { "gpt2", "gpt2", 0, -1, -1, -1, -1, NULL, 0, NULL };
	t = load_tok(path, &f2, &b, &err);
	CHECK(t != NULL);
	if (t) {
		const int32_t d12[] = { ' ', ID_12, '3' };
		const int32_t ctl_text[] = { '<', '|', 'i', 'm', '_', 's', 't', 'a', 'r', 't', '|', '>' };
		CHECK(encode_is(t, " 123", TOK_PARSE_SPECIAL, d12, 3));
		/* without token types nothing is an added token */
		CHECK(encode_is(t, "<|im_start|>", TOK_PARSE_SPECIAL, ctl_text, 12));
		CHECK_EQ(tok_bos_id(t), -1);
		CHECK_EQ(tok_add_bos_default(t), 0);
		tok_free(t);
	}
	f2.pre = "llama-bpe";
	t = load_tok(path, &f2, &b, &err);
	CHECK(t != NULL && tok_add_bos_default(t) == 1);
	tok_free(t);
	f2.add_bos = 0;
	t = load_tok(path, &f2, &b, &err);
	CHECK(t != NULL && tok_add_bos_default(t) == 0);
	tok_free(t);
	static const char *const pres[] = { "deepseek-v3", "qwen2", "llama3", "gpt-2" };
	for (size_t i = 0; i < 4; i++) {
		f2.pre = pres[i];
		t = load_tok(path, &f2, &b, &err);
		CHECK(t != NULL);
		tok_free(t);
	}
out:
	buf_free(&b);
	ut_tmpdir_free(dir);
}

TEST(gguf_tokenizer_errors_name_the_problem)
{
	char *dir = ut_tmpdir_new("gguf"), path[1024];
	if (!dir)
		return;
	snprintf(path, sizeof path, "%s/tok.gguf", dir);
	buf b;
	buf_init(&b, 0);
	static const struct {
		tokfx f;
		int code;
		const char *want;
	} cases[] = {
		{ { "llama", "smollm", 1, 0, -1, -1, -1, NULL, 0, NULL }, DS_EUNSUPPORTED,
		  "\"llama\" (SentencePiece) is not supported" },
		{ { "bert", "smollm", 1, 0, -1, -1, -1, NULL, 0, NULL }, DS_EUNSUPPORTED,
		  "\"bert\" is not supported" },
		{ { "gpt2", "falcon", 1, 0, -1, -1, -1, NULL, 0, NULL }, DS_EUNSUPPORTED,
		  "pre-tokenizer 'falcon' is not supported (known: deepseek-llm, deepseek-v3, gpt-2, gpt2, "
		  "llama-bpe, "
		  "llama3, qwen2, smollm)" },
		{ { "gpt2", NULL, 1, 0, -1, -1, -1, NULL, 0, NULL }, DS_EUNSUPPORTED,
		  "tokenizer.ggml.pre is missing, so the pre-tokenizer is not known (known: deepseek-llm, "
		  "deepseek-v3" },
		{ { NULL, "smollm", 1, 0, -1, -1, -1, NULL, 0, NULL }, DS_ENOTFOUND,
		  "'tokenizer.ggml.model' not found" },
		{ { "gpt2", "smollm", 1, 0, -1, -1, -1, "hello", 0, NULL }, DS_EFORMAT,
		  "tokenizer.ggml.merges[0] \"hello\" is not \"left right\"" },
		{ { "gpt2", "smollm", 1, 0, -1, -1, -1, "a b c", 0, NULL }, DS_EFORMAT,
		  "is not \"left right\"" },
		{ { "gpt2", "smollm", 1, 0, -1, -1, -1, "zz qq", 0, NULL }, DS_EINVAL,
		  "merge 0: token \"zz\" is not in the vocab" },
		{ { "gpt2", "smollm", 1, 0, -1, -1, -1, NULL, -1, NULL }, DS_EFORMAT,
		  "tokenizer.ggml.token_type must be 268 integers, found 267" },
		{ { "gpt2", "smollm", 1, 0, N_TOKS, -1, -1, NULL, 0, NULL }, DS_EFORMAT,
		  "tokenizer.ggml.bos_token_id = 268 is not a token id" },
		{ { "gpt2", "smollm", 1, 0, -1, 999999, -1, NULL, 0, NULL }, DS_EFORMAT,
		  "tokenizer.ggml.eos_token_id = 999999" },
	};
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		ds_err err = { 0 };
		tok *t = load_tok(path, &cases[i].f, &b, &err);
		if (t || err.code != cases[i].code || !contains(err.msg, cases[i].want) ||
		    !contains(err.msg, path))
			ut_fail(__FILE__, __LINE__, "case %zu: %s \"%s\"; want %s \"%s\"", i,
				t ? "loaded" : ds_status_name(err.code), err.msg,
				ds_status_name(cases[i].code), cases[i].want);
		tok_free(t);
	}
	/* a token type outside 0..6 */
	{
		tokfx f = { "gpt2", "smollm", 1, 0, -1, -1, -1, NULL, 0, NULL };
		build_tok_gguf(&f, &b);
		/* the types array holds 1s; find the first control type (3) and make it 9 */
		size_t types_at = 0;
		for (size_t k = 0; k + 25 <= b.len; k++)
			if (memcmp(b.data + k, "tokenizer.ggml.token_type", 25) == 0)
				types_at = k + 25 + 4 + 4 + 8;
		CHECK(types_at > 0);
		if (types_at) {
			patch_le(&b, types_at + 4 * ID_CTL_A, 9, 4);
			ds_err err = { 0 };
			write_bytes(path, b.data, b.len);
			gguf_file *g = gguf_open(path, &err);
			tok *t = g ? tok_load_gguf(g, &err) : NULL;
			char want[96];
			snprintf(want, sizeof want, "tokenizer.ggml.token_type[%d] = 9 is not a token type",
				 ID_CTL_A);
			CHECK(t == NULL);
			CHECK(contains(err.msg, want));
			tok_free(t);
			gguf_close(g);
		}
	}
	buf_free(&b);
	ut_tmpdir_free(dir);
}

TEST(gguf_tokenizer_random_flips_never_crash)
{
	char *dir = ut_tmpdir_new("gguf"), path[1024];
	if (!dir)
		return;
	snprintf(path, sizeof path, "%s/tokflip.gguf", dir);
	tokfx f = { "gpt2", "smollm", 1, 1, ID_CTL_A, ID_CTL_B, 0, NULL, 0, "<|im_start|><|im_end|>" };
	buf b, c;
	buf_init(&b, 0);
	buf_init(&c, 0);
	build_tok_gguf(&f, &b);
	int built = 0, refused = 0;
	for (int it = 0; it < 1000; it++) {
		buf_clear(&c);
		buf_append(&c, b.data, b.len);
		for (int k = 1 + (int)(ut_rand_u64() % 3); k > 0; k--) {
			size_t at = (size_t)(ut_rand_u64() % c.len);
			c.data[at] = (char)((unsigned char)c.data[at] ^ (unsigned char)(1u << (ut_rand_u64() % 8)));
		}
		write_bytes(path, c.data, c.len);
		ds_err err = { 0 };
		gguf_file *g = gguf_open(path, &err);
		tok *t = g ? tok_load_gguf(g, &err) : NULL;
		gguf_close(g);
		if (!t) {
			refused++;
			CHECK(err.code != DS_OK && err.msg[0] != '\0');
			continue;
		}
		built++;
		/* whatever was built encodes and decodes */
		static const char text[] = "<|im_start|>hello world 123<|im_end|>\xff";
		int32_t *ids = NULL;
		size_t n = 0;
		CHECK_EQ(tok_encode_alloc(t, text, sizeof text - 1, TOK_PARSE_SPECIAL | TOK_ADD_BOS, &ids,
					  &n, &err), 0);
		char *back = NULL;
		size_t len = 0;
		if (tok_decode_alloc(t, ids, n, &back, &len, &err) == 0)
			CHECK(len > 0);
		free(back);
		free(ids);
		tok_free(t);
	}
	if (!(built > 30 && refused > 100))
		ut_fail(__FILE__, __LINE__, "built %d refused %d", built, refused);
	buf_free(&c);
	buf_free(&b);
	ut_tmpdir_free(dir);
}

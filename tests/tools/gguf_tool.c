/*
 * gguf_tool.c - GGUF reader and GGUF tokenizer helper for the integration tests.
 *
 *   gguf_tool dump FILE.gguf
 *       one JSON object: {"version", "alignment", "data_offset", "kv": [{"key",
 *       "type", "value"}...], "tensors": [{"name", "type", "ggml_type",
 *       "dtype_supported", "shape", "ne", "offset", "nbytes", "fnv"}...]}
 *       (values: integers as numbers (a u64 above 2^63-1 as the string
 *       "u64:N"), floats as numbers (non-finite as "nan"/"inf"/"-inf"), bools,
 *       strings (invalid UTF-8 as {"hex": "..."}), arrays nested; fnv: FNV-1a
 *       64 of the tensor bytes in hex)
 *   gguf_tool open FILE.gguf
 *       prints "ok" and exits 0, or prints the error to stderr and exits 1
 *   gguf_tool tok FILE.gguf  < requests
 *       tok_load_gguf, then one JSON request per line on stdin, one answer per
 *       line on stdout:
 *         {"text": "...", "special": true, "bos": false}  ->  [id, ...]
 *         {"ids": [...], "skip_special": false}  ->  {"hex": "...", "stream": "..."}
 *         {"chat": [messages], "template": null|name, "gen": true}
 *             ->  {"template": name, "text": "...", "ids": [...]}
 *         {"info": true}  ->  {"vocab_size", "bos", "eos", "unk", "pad", "eot",
 *                              "add_bos", "model", "pre", "has_template"}
 *       a bad line answers {"error": "..."}.  --time (after "tok") prints the
 *       load and encode seconds to stderr at the end.
 * Single-threaded; exits 2 on usage errors, 1 when the file or tokenizer
 * cannot load.
 */
#include "common/buf.h"
#include "common/jsonx.h"
#include "common/strutil.h"
#include "engine/chat.h"
#include "engine/gguf.h"
#include "engine/tok.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- dump ------------------------------------------------------------------------ */

static json_t *str_value(const char *s, size_t len)
{
	json_t *v = json_stringn(s, len);
	if (v)
		return v;
	buf b;
	buf_init(&b, 0);
	buf_puts(&b, "");
	for (size_t i = 0; i < len; i++)
		buf_printf(&b, "%02x", (unsigned char)s[i]);
	v = json_pack("{s:s}", "hex", b.data);
	buf_free(&b);
	return v;
}

static json_t *real_value(double d)
{
	if (isnan(d))
		return json_string("nan");
	if (isinf(d))
		return json_string(d > 0 ? "inf" : "-inf");
	return json_real(d);
}

static json_t *int_value(uint64_t u, int is_u64)
{
	if (is_u64 && u > (uint64_t)INT64_MAX) {
		char s[40];
		snprintf(s, sizeof s, "u64:%llu", (unsigned long long)u);
		return json_string(s);
	}
	return json_integer((json_int_t)u);
}

static json_t *arr_value(const gguf_arr *a)
{
	json_t *out = json_array();
	for (uint64_t i = 0; i < a->n; i++) {
		json_t *v = NULL;
		switch (a->type) {
		case GGUF_TYPE_STRING: {
			size_t len;
			const char *s = gguf_arr_str(a, i, &len);
			v = str_value(s, len);
			break;
		}
		case GGUF_TYPE_ARRAY: {
			gguf_arr sub;
			v = gguf_arr_arr(a, i, &sub) == 0 ? arr_value(&sub) : json_null();
			break;
		}
		case GGUF_TYPE_BOOL:
			v = json_boolean(gguf_arr_i64(a, i));
			break;
		case GGUF_TYPE_F32:
		case GGUF_TYPE_F64:
			v = real_value(gguf_arr_f64(a, i));
			break;
		case GGUF_TYPE_U64:
			v = int_value(gguf_arr_u64(a, i), 1);
			break;
		default:
			v = json_integer(gguf_arr_i64(a, i));
			break;
		}
		json_array_append_new(out, v);
	}
	return out;
}

static json_t *kv_value(const gguf_file *g, const char *key, enum gguf_type t)
{
	ds_err err = { 0 };
	switch (t) {
	case GGUF_TYPE_U8: { uint8_t v; gguf_get_u8(g, key, &v, &err); return json_integer(v); }
	case GGUF_TYPE_I8: { int8_t v; gguf_get_i8(g, key, &v, &err); return json_integer(v); }
	case GGUF_TYPE_U16: { uint16_t v; gguf_get_u16(g, key, &v, &err); return json_integer(v); }
	case GGUF_TYPE_I16: { int16_t v; gguf_get_i16(g, key, &v, &err); return json_integer(v); }
	case GGUF_TYPE_U32: { uint32_t v; gguf_get_u32(g, key, &v, &err); return json_integer(v); }
	case GGUF_TYPE_I32: { int32_t v; gguf_get_i32(g, key, &v, &err); return json_integer(v); }
	case GGUF_TYPE_U64: { uint64_t v; gguf_get_u64(g, key, &v, &err); return int_value(v, 1); }
	case GGUF_TYPE_I64: { int64_t v; gguf_get_i64(g, key, &v, &err); return json_integer(v); }
	case GGUF_TYPE_F32: { float v; gguf_get_f32(g, key, &v, &err); return real_value(v); }
	case GGUF_TYPE_F64: { double v; gguf_get_f64(g, key, &v, &err); return real_value(v); }
	case GGUF_TYPE_BOOL: { int v; gguf_get_bool(g, key, &v, &err); return json_boolean(v); }
	case GGUF_TYPE_STRING: {
		const char *s;
		size_t len;
		gguf_get_str(g, key, &s, &len, &err);
		return str_value(s, len);
	}
	case GGUF_TYPE_ARRAY: {
		gguf_arr a;
		gguf_get_arr(g, key, GGUF_TYPE_COUNT, &a, &err);
		return arr_value(&a);
	}
	default:
		return json_null();
	}
}

static int do_dump(const gguf_file *g)
{
	json_t *kvs = json_array(), *ts = json_array();
	for (size_t i = 0; i < gguf_kv_count(g); i++) {
		const char *key = gguf_kv_key(g, i);
		enum gguf_type t = gguf_kv_type(g, i);
		json_array_append_new(kvs, json_pack("{s:s,s:s,s:o}", "key", key, "type",
						     gguf_type_name(t), "value", kv_value(g, key, t)));
	}
	for (size_t i = 0; i < gguf_tensor_count(g); i++) {
		const gguf_tensor *t = gguf_tensor_at(g, i);
		json_t *shape = json_array(), *ne = json_array();
		for (int d = 0; d < t->n_dims; d++) {
			json_array_append_new(shape, json_integer(t->shape[d]));
			json_array_append_new(ne, json_integer(t->ne[d]));
		}
		uint64_t h = 1469598103934665603ull;
		const unsigned char *p = t->data;
		for (size_t k = 0; k < t->nbytes; k++) {
			h ^= p[k];
			h *= 1099511628211ull;
		}
		char hex[17];
		snprintf(hex, sizeof hex, "%016llx", (unsigned long long)h);
		json_array_append_new(ts, json_pack("{s:s,s:s,s:i,s:b,s:o,s:o,s:I,s:I,s:s}", "name",
						    t->name, "type", t->type_name, "ggml_type",
						    (int)t->ggml_type, "dtype_supported",
						    t->dtype != GGUF_DTYPE_NONE, "shape", shape, "ne", ne,
						    "offset", (json_int_t)t->offset, "nbytes",
						    (json_int_t)t->nbytes, "fnv", hex));
	}
	json_t *o = json_pack("{s:i,s:i,s:I,s:o,s:o}", "version", (int)gguf_version(g), "alignment",
			      (int)gguf_alignment(g), "data_offset", (json_int_t)gguf_data_offset(g),
			      "kv", kvs, "tensors", ts);
	char *s = o ? jsonx_dumps(o) : NULL;
	json_decref(o);
	if (!s) {
		fprintf(stderr, "gguf_tool: cannot print the dump\n");
		return 1;
	}
	printf("%s\n", s);
	free(s);
	return 0;
}

/* ---- tok ---------------------------------------------------------------------------- */

static void print_json(json_t *o)
{
	char *s = o ? jsonx_dumps(o) : NULL;
	printf("%s\n", s ? s : "{\"error\":\"cannot print the answer\"}");
	free(s);
	json_decref(o);
}

static void print_error(const char *msg)
{
	print_json(json_pack("{s:s}", "error", msg));
}

static json_t *ids_json(const int32_t *v, size_t n)
{
	json_t *a = json_array();
	for (size_t i = 0; i < n; i++)
		json_array_append_new(a, json_integer(v[i]));
	return a;
}

#define MAX_MSGS 64

static int do_chat(const tok *t, const json_t *req, ds_err *err)
{
	const json_t *list = json_object_get(req, "chat");
	chat_msg msgs[MAX_MSGS];
	size_t n = json_array_size(list);
	int rc;
	if (n > MAX_MSGS)
		return ds_err_set(err, DS_ERANGE, "at most %d messages", MAX_MSGS);
	memset(msgs, 0, sizeof msgs);
	for (size_t i = 0; i < n; i++) {
		const json_t *m = json_array_get(list, i);
		if ((rc = chat_role_parse(json_string_value(json_object_get(m, "role")), &msgs[i].role,
					  err)))
			return rc;
		msgs[i].content = json_string_value(json_object_get(m, "content"));
	}
	chat_params p;
	if ((rc = chat_params_for_tok(t, json_string_value(json_object_get(req, "template")), &p, err)))
		return rc;
	const json_t *gen = json_object_get(req, "gen");
	p.add_generation_prompt = !gen || json_is_true(gen);
	buf text;
	tok_ids ids;
	buf_init(&text, 0);
	tok_ids_init(&ids, 0);
	if ((rc = chat_render_ids(&p, t, msgs, n, &ids, &text, err)) == 0)
		print_json(json_pack("{s:s,s:s%,s:o}", "template", chat_template_name(p.tmpl), "text",
				     text.data ? text.data : "", text.len, "ids", ids_json(ids.v, ids.n)));
	tok_ids_free(&ids);
	buf_free(&text);
	return rc;
}

static void do_ids(const tok *t, const json_t *req, const json_t *ids)
{
	ds_err err = { 0 };
	size_t n = json_array_size(ids);
	int32_t *v = calloc(n ? n : 1, sizeof *v);
	for (size_t i = 0; v && i < n; i++)
		v[i] = (int32_t)json_integer_value(json_array_get(ids, i));
	unsigned flags = json_is_true(json_object_get(req, "skip_special")) ? TOK_SKIP_SPECIAL : 0;
	buf raw, st, hex;
	buf_init(&raw, 0);
	buf_init(&st, 0);
	buf_init(&hex, 0);
	int rc = v ? tok_decode(t, v, n, flags, &raw, &err) : ds_err_set(&err, DS_ENOMEM, "oom");
	tok_stream s;
	tok_stream_init(&s, t, flags);
	for (size_t i = 0; rc == 0 && i < n; i++)
		rc = tok_stream_feed(&s, v[i], &st, &err);
	if (rc == 0)
		rc = tok_stream_flush(&s, &st, &err);
	if (rc) {
		print_error(err.msg);
	} else {
		buf_puts(&hex, "");
		for (size_t i = 0; i < raw.len; i++)
			buf_printf(&hex, "%02x", (unsigned char)raw.data[i]);
		print_json(json_pack("{s:s,s:s%}", "hex", hex.data, "stream", st.data ? st.data : "",
				     st.len));
	}
	buf_free(&hex);
	buf_free(&st);
	buf_free(&raw);
	free(v);
}

static void do_line(const tok *t, const tok_gguf_meta *meta, const char *line, size_t len,
		    double *enc_s)
{
	ds_err err = { 0 };
	json_t *req = jsonx_parse(line, len, 16, &err);
	if (!req || !json_is_object(req)) {
		print_error(req ? "not an object" : err.msg);
		json_decref(req);
		return;
	}
	const json_t *text = json_object_get(req, "text");
	const json_t *ids = json_object_get(req, "ids");
	if (json_is_string(text)) {
		const json_t *sp = json_object_get(req, "special");
		unsigned flags = (!sp || json_is_true(sp)) ? TOK_PARSE_SPECIAL : 0;
		if (json_is_true(json_object_get(req, "bos")))
			flags |= TOK_ADD_BOS;
		tok_ids out;
		tok_ids_init(&out, 0);
		double t0 = ds_now_s();
		int rc = tok_encode(t, json_string_value(text), json_string_length(text), flags, &out, &err);
		*enc_s += ds_now_s() - t0;
		if (rc)
			print_error(err.msg);
		else
			print_json(ids_json(out.v, out.n));
		tok_ids_free(&out);
	} else if (json_is_array(ids)) {
		do_ids(t, req, ids);
	} else if (json_is_array(json_object_get(req, "chat"))) {
		if (do_chat(t, req, &err) != 0)
			print_error(err.msg);
	} else if (json_is_true(json_object_get(req, "info"))) {
		print_json(json_pack("{s:i,s:i,s:i,s:i,s:i,s:i,s:b,s:b,s:s,s:s?,s:b}", "vocab_size",
				     (int)tok_vocab_size(t), "bos", (int)tok_bos_id(t), "eos",
				     (int)tok_eos_id(t), "unk", (int)meta->unk, "pad", (int)meta->pad,
				     "eot", (int)meta->eot, "add_bos", tok_add_bos_default(t),
				     "meta_add_bos", meta->add_bos, "model", meta->model, "pre",
				     meta->pre, "has_template", tok_chat_template(t) != NULL));
	} else {
		print_error("expected \"text\", \"ids\", \"chat\" or \"info\"");
	}
	fflush(stdout);
	json_decref(req);
}

static int do_tok(const gguf_file *g, int timing, double load_s)
{
	ds_err err = { 0 };
	tok_gguf_meta meta;
	double t0 = ds_now_s();
	tok *t = tok_load_gguf(g, &err);
	if (!t || tok_gguf_meta_read(g, &meta, &err) != 0) {
		fprintf(stderr, "gguf_tool: %s\n", err.msg);
		tok_free(t);
		return 1;
	}
	load_s += ds_now_s() - t0;
	char *line = NULL;
	size_t cap = 0;
	ssize_t n;
	double enc_s = 0;
	while ((n = getline(&line, &cap, stdin)) > 0) {
		while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
			n--;
		if (n > 0)
			do_line(t, &meta, line, (size_t)n, &enc_s);
	}
	free(line);
	if (timing)
		fprintf(stderr, "load_s=%.4f encode_s=%.4f\n", load_s, enc_s);
	tok_free(t);
	return 0;
}

int main(int argc, char **argv)
{
	int a = 2, timing = 0;
	if (argc >= 3 && strcmp(argv[1], "tok") == 0 && strcmp(argv[2], "--time") == 0) {
		timing = 1;
		a = 3;
	}
	if (argc != a + 1 || (strcmp(argv[1], "dump") != 0 && strcmp(argv[1], "open") != 0 &&
			      strcmp(argv[1], "tok") != 0)) {
		fprintf(stderr, "usage: gguf_tool dump|open FILE.gguf\n"
				"       gguf_tool tok [--time] FILE.gguf < requests\n");
		return 2;
	}
	ds_err err = { 0 };
	double t0 = ds_now_s();
	gguf_file *g = gguf_open(argv[a], &err);
	if (!g) {
		fprintf(stderr, "gguf_tool: %s (%s)\n", err.msg, ds_status_name(err.code));
		return 1;
	}
	int rc;
	if (strcmp(argv[1], "dump") == 0) {
		rc = do_dump(g);
	} else if (strcmp(argv[1], "open") == 0) {
		printf("ok\n");
		rc = 0;
	} else {
		rc = do_tok(g, timing, ds_now_s() - t0);
	}
	gguf_close(g);
	return rc;
}

/*
 * tok_tool.c - batch tokenizer helper for the integration tests.
 *
 *   tok_tool [--time] TOKENIZER_JSON [TOKENIZER_CONFIG_JSON]  < requests
 *
 * Reads one JSON object per line on stdin and answers one line on stdout:
 *   {"text": "...", "special": true|false, "bos": false}  ->  [id, id, ...]
 *       (special: parse added tokens, default true; bos: add BOS, default false)
 *   {"ids": [...], "skip_special": false}  ->  {"hex": "...", "stream": "..."}
 *       (hex: tok_decode's raw bytes; stream: the same ids through
 *        tok_stream_feed one by one + flush, always valid UTF-8)
 *   {"pretok": "...", "preset": "deepseek-llm"}  ->  ["piece", ...]  (the Split
 *       cascade only, no added tokens; preset: a tok_pretok_preset name,
 *       default "deepseek-v3")
 *   {"chat": [messages], "template": null|"deepseek-v3"|"deepseek-r1", "gen": true}
 *       ->  {"template": name, "text": rendered prompt, "ids": [...]}
 *       (messages in OpenAI shape: role, content (string or null), tool_calls
 *        [{type, function: {name, arguments}}]; template null = detect from the
 *        config's chat_template; ids = tok_encode(text, parse_special, no BOS))
 *   {"info": true}  ->  {"vocab_size": N, "bos": id, "eos": id, "unicode": "16.0.0"}
 * A bad line answers {"error": "..."} and the tool goes on.  --time prints
 * load and total encode seconds to stderr at the end.
 * Single-threaded; exits 2 on usage errors, 1 when the tokenizer cannot load.
 */
#include "common/buf.h"
#include "common/jsonx.h"
#include "common/strutil.h"
#include "engine/chat.h"
#include "engine/tok.h"
#include "engine/unicode.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void print_error(const char *msg)
{
	json_t *o = json_pack("{s:s}", "error", msg);
	char *s = jsonx_dumps(o);
	printf("%s\n", s ? s : "{\"error\":\"?\"}");
	free(s);
	json_decref(o);
}

struct pieces {
	const char *text;
	json_t *arr;
};

static int add_piece(void *ctx, size_t start, size_t end)
{
	struct pieces *p = ctx;
	json_array_append_new(p->arr, json_stringn(p->text + start, end - start));
	return 0;
}

#define MAX_MSGS 64
#define MAX_CALLS 8

static int do_chat(const tok *t, const json_t *req, ds_err *err)
{
	const json_t *list = json_object_get(req, "chat");
	chat_msg msgs[MAX_MSGS];
	chat_tool_call calls[MAX_MSGS][MAX_CALLS];
	size_t n = json_array_size(list);
	int rc;
	if (n > MAX_MSGS)
		return ds_err_set(err, DS_ERANGE, "at most %d messages", MAX_MSGS);
	memset(msgs, 0, sizeof msgs);
	for (size_t i = 0; i < n; i++) {
		const json_t *m = json_array_get(list, i);
		if ((rc = chat_role_parse(json_string_value(json_object_get(m, "role")), &msgs[i].role, err)))
			return rc;
		msgs[i].content = json_string_value(json_object_get(m, "content"));
		const json_t *tc = json_object_get(m, "tool_calls");
		size_t nc = json_array_size(tc);
		if (nc > MAX_CALLS)
			return ds_err_set(err, DS_ERANGE, "at most %d tool calls", MAX_CALLS);
		for (size_t k = 0; k < nc; k++) {
			const json_t *c = json_array_get(tc, k), *f = json_object_get(c, "function");
			calls[i][k].type = json_string_value(json_object_get(c, "type"));
			calls[i][k].name = json_string_value(json_object_get(f, "name"));
			calls[i][k].arguments = json_string_value(json_object_get(f, "arguments"));
		}
		msgs[i].tool_calls = calls[i];
		msgs[i].n_tool_calls = nc;
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
	json_t *o = NULL, *arr = NULL;
	if ((rc = chat_render_ids(&p, t, msgs, n, &ids, &text, err)) == 0) {
		arr = json_array();
		for (size_t i = 0; i < ids.n; i++)
			json_array_append_new(arr, json_integer(ids.v[i]));
		o = json_pack("{s:s,s:s%,s:o}", "template", chat_template_name(p.tmpl), "text",
			      text.data ? text.data : "", text.len, "ids", arr);
		char *js = o ? jsonx_dumps(o) : NULL;
		if (js)
			printf("%s\n", js);
		else
			rc = ds_err_set(err, DS_EINTERNAL, "cannot print the answer");
		free(js);
		json_decref(o);
	}
	tok_ids_free(&ids);
	buf_free(&text);
	return rc;
}

static const char *const *g_pats;
static size_t g_npats;

static void do_line(const tok *t, const char *line, size_t len, double *enc_s)
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
	const json_t *pre = json_object_get(req, "pretok");
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
		if (rc) {
			print_error(err.msg);
		} else {
			buf b;
			buf_init(&b, 0);
			buf_puts(&b, "[");
			for (size_t i = 0; i < out.n; i++)
				buf_printf(&b, i ? ",%d" : "%d", (int)out.v[i]);
			buf_puts(&b, "]");
			printf("%s\n", b.data);
			buf_free(&b);
		}
		tok_ids_free(&out);
	} else if (json_is_array(ids)) {
		size_t n = json_array_size(ids);
		int32_t *v = calloc(n ? n : 1, sizeof *v);
		for (size_t i = 0; i < n; i++)
			v[i] = (int32_t)json_integer_value(json_array_get(ids, i));
		unsigned flags = json_is_true(json_object_get(req, "skip_special")) ? TOK_SKIP_SPECIAL : 0;
		buf raw, st, hex;
		buf_init(&raw, 0);
		buf_init(&st, 0);
		buf_init(&hex, 0);
		int rc = tok_decode(t, v, n, flags, &raw, &err);
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
			json_t *o = json_pack("{s:s,s:s%}", "hex", hex.data ? hex.data : "", "stream",
					      st.data ? st.data : "", st.len);
			char *js = o ? jsonx_dumps(o) : NULL;
			if (js)
				printf("%s\n", js);
			else
				print_error("stream output is not valid UTF-8");
			free(js);
			json_decref(o);
		}
		buf_free(&hex);
		buf_free(&st);
		buf_free(&raw);
		free(v);
	} else if (json_is_string(pre)) {
		struct pieces p = { json_string_value(pre), json_array() };
		const char *preset = json_string_value(json_object_get(req, "preset"));
		const char *const *pats = g_pats;
		size_t npats = g_npats;
		if ((preset && tok_pretok_preset(preset, &pats, &npats, &err) != 0) ||
		    tok_pretokenize(pats, npats, p.text, json_string_length(pre), add_piece, &p, &err) != 0) {
			print_error(err.msg);
		} else {
			char *js = jsonx_dumps(p.arr);
			printf("%s\n", js ? js : "[]");
			free(js);
		}
		json_decref(p.arr);
	} else if (json_is_array(json_object_get(req, "chat"))) {
		if (do_chat(t, req, &err) != 0)
			print_error(err.msg);
	} else if (json_is_true(json_object_get(req, "info"))) {
		printf("{\"vocab_size\": %d, \"bos\": %d, \"eos\": %d, \"unicode\": \"%s\"}\n",
		       (int)tok_vocab_size(t), (int)tok_bos_id(t), (int)tok_eos_id(t), uni_version());
	} else {
		print_error("expected \"text\", \"ids\", \"pretok\", \"chat\" or \"info\"");
	}
	fflush(stdout);
	json_decref(req);
}

int main(int argc, char **argv)
{
	int timing = 0, a = 1;
	if (a < argc && strcmp(argv[a], "--time") == 0) {
		timing = 1;
		a++;
	}
	if (argc - a < 1 || argc - a > 2) {
		fprintf(stderr, "usage: tok_tool [--time] TOKENIZER_JSON [TOKENIZER_CONFIG_JSON] < requests\n");
		return 2;
	}
	ds_err err = { 0 };
	double t0 = ds_now_s();
	tok *t = tok_load_hf(argv[a], a + 1 < argc ? argv[a + 1] : NULL, &err);
	if (!t) {
		fprintf(stderr, "tok_tool: %s\n", err.msg);
		return 1;
	}
	double load_s = ds_now_s() - t0;
	/* the pre-tokenizer of DeepSeek-V3 for "pretok" requests */
	if (tok_pretok_preset("deepseek-v3", &g_pats, &g_npats, &err) != 0) {
		fprintf(stderr, "tok_tool: %s\n", err.msg);
		tok_free(t);
		return 1;
	}
	char *line = NULL;
	size_t cap = 0;
	ssize_t n;
	double enc_s = 0;
	while ((n = getline(&line, &cap, stdin)) > 0) {
		while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
			n--;
		if (n == 0)
			continue;
		do_line(t, line, (size_t)n, &enc_s);
	}
	free(line);
	if (timing)
		fprintf(stderr, "load_s=%.4f encode_s=%.4f\n", load_s, enc_s);
	tok_free(t);
	return 0;
}

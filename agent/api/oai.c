/*
 * oai.c - POST /v1/chat/completions and POST /v1/completions (see serve.h).
 *
 * One request becomes a `gen`: its validated options, one `choice` per
 * (prompt, n) pair, each choice one scheduler sequence.  Tokens flow
 *
 *   sched_seq_next ─> tok_stream (whole UTF-8 characters) ─> hold
 *     hold ─> stop strings: text that could still begin a stop string stays
 *             held; a full match trims the output there and cancels the
 *             sequence ─> released text
 *     released ─> R1 reasoning splitter (chat, deepseek-r1 template) ─>
 *                 content / reasoning_content
 *     content ─> tool-call parser (chat with tools shown, engine/chat.h
 *                chat_calls) ─> content / tool_calls (each call whole)
 *
 * Chat prompts are rendered and encoded by chat_render_ids: only the
 * template's markers are control tokens, contents are plain text.  With
 * tool_choice required / named the prompt ends with the opening of a call,
 * which each choice's parser is fed first.
 *
 * Non-streaming requests wait in the handler (checking that the client is
 * still there) and answer one JSON document.  Streaming requests return an
 * http stream whose reader blocks for the next tokens and writes SSE events:
 * exactly `data: ` + compact JSON + a blank line; the role chunk goes out
 * with the first token; finish_reason rides on the last chunk of a choice;
 * the usage chunk (choices []) only with stream_options.include_usage; then
 * `data: [DONE]`.  A client that disconnects cancels every sequence of the
 * request (the scheduler frees the pages at its next step).  serve_stop
 * (shutdown after the grace period, or an unload) ends a stream with an error
 * event and `data: [DONE]`, an unstreamed request with a 503.
 *
 * Metering (docs/keys.md): a request's key is charged in two steps, the
 * cheap one before any prompt is tokenized (serve_admit: rpm, its prompts x n
 * sequences against max_concurrency and the key's share of the waiting
 * queue), then serve_reserve: prompt tokens + max_tokens x n against tpm.
 * Between reads `meter` moves the sequences the scheduler started out of the
 * key's queue share and stops the request when its key was revoked (an error
 * event ends a stream, a non-streamed request gets a 401); gen_free settles
 * the reservation with what was used (keys_finish).
 *
 * Each request ends with one log line, "request done" (log_done): id, key
 * name, HTTP status, tokens, TTFT and duration; never the prompt or the key.
 *
 * Threading: a gen belongs to the connection thread that runs its handler
 * and then its stream reader; nothing here is shared between requests except
 * the serve context's thread-safe members.
 */
#include "agent/auth/keys.h"
#include "agent/api/serve.h"
#include "common/jsonx.h"
#include "common/log.h"
#include "common/strutil.h"

#include <math.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_STOPS 16
#define MAX_STOP_LEN 256
#define MAX_PROMPTS 64
#define TEXT_CAP (64u << 20)

/* ---- request options ---- */

typedef struct gen_opts {
	int chat;
	int n;
	int64_t max_tokens; /* -1 = up to the context */
	smp_params smp;
	char *stop[MAX_STOPS];
	int n_stop;
	int32_t *stop_ids;
	int n_stop_ids;
	int ignore_eos;
	int stream, include_usage;
	int logprobs, top_logprobs;
	int skip_special;
	int include_stop;
} gen_opts;

typedef struct choice {
	sched_seq *q;
	int index, prompt_i;
	tok_stream ts;
	buf hold;   /* decoded, not released: may begin a stop string */
	buf text;   /* released content not yet sent (stream) / all of it */
	buf reason; /* released reasoning not yet sent / all of it */
	chat_reasoning rs;
	chat_calls calls;  /* tool calls parsed out of the content (gen.tools_on) */
	size_t calls_sent; /* stream: calls already sent */
	buf scratch;       /* content between the reasoning splitter and the parser */
	json_t *lp;     /* chat: logprob entries; completions: {tokens, ...} arrays */
	int32_t n_tok;
	int finished, flushed, role_sent, final_sent;
	int cut; /* ended by a stop string */
	int dequeued; /* started by the scheduler: out of the key's queue share */
	const char *finish_reason;
	char error[256];
	double t_first, t_last;
	int64_t text_offset; /* completions logprobs: bytes of text before the token */
} choice;

typedef struct req_tools {
	chat_tool *tools;
	size_t n;
	chat_tool_choice choice;
	char *name; /* NAMED */
	int parse;  /* tools shown to the model: its output is parsed for calls */
} req_tools;

typedef struct gen {
	serve *sv;
	struct MHD_Connection *conn;
	gen_opts o;
	char id[160];
	const char *model;
	json_int_t created;
	int reasoning; /* split R1 <think> output */
	keys_hold hold; /* what it holds against its key's limits (zero: no key) */
	double t_meter; /* when meter last asked the scheduler */
	req_tools rt;
	int tools_on;  /* parse the content for tool calls */
	char *opening; /* the forced opening of a call the prompt ends with, or NULL */
	int32_t marker_ids[8]; /* the tool format's markers: decoded even when special */
	int n_marker_ids;
	char key_name[STORE_NAME_MAX + 1]; /* for the log line */
	int n_prompts;
	int32_t prompt_tokens; /* sum over prompts, each counted once */
	int n_choices;
	choice *ch;
	double t_arrival;
	buf out;        /* SSE bytes not yet handed to MHD */
	size_t out_off;
	int done_sent;
	int aborted;
} gen;

static void opts_free(gen_opts *o)
{
	for (int i = 0; i < o->n_stop; i++)
		free(o->stop[i]);
	free(o->stop_ids);
}

static int bad(http_resp *resp, const char *param, const char *msg)
{
	http_resp_error_param(resp, 400, "invalid_request_error", "invalid_value", param, "%s",
			      msg);
	return DS_EINVAL;
}

/* Fields that would change the output in ways this server does not do: an
 * error naming them beats silently different output. */
static int refuse_unsupported(const json_t *b, int chat, http_resp *resp)
{
	json_t *v;
	if ((v = json_object_get(b, "logit_bias")) && json_is_object(v) && json_object_size(v))
		return bad(resp, "logit_bias", "'logit_bias' is not supported by this server");
	if ((v = json_object_get(b, "min_tokens")) && json_is_integer(v) && json_integer_value(v) > 0)
		return bad(resp, "min_tokens", "'min_tokens' is not supported by this server");
	if ((v = json_object_get(b, "response_format")) && json_is_object(v)) {
		json_t *t = json_object_get(v, "type");
		if (json_is_string(t) && strcmp(json_string_value(t), "text") != 0)
			return bad(resp, "response_format",
				   "'response_format' other than {\"type\":\"text\"} (structured "
				   "output) is not supported by this server");
	}
	if (!chat) {
		if ((v = json_object_get(b, "echo")) && json_is_true(v))
			return bad(resp, "echo", "'echo' is not supported by this server");
		if ((v = json_object_get(b, "suffix")) && json_is_string(v) && *json_string_value(v))
			return bad(resp, "suffix", "'suffix' is not supported by this server");
	}
	return DS_OK;
}

static int parse_stop(const json_t *b, gen_opts *o, http_resp *resp)
{
	json_t *v = json_object_get(b, "stop");
	if (!v || json_is_null(v))
		return DS_OK;
	json_t *one[1] = {v};
	size_t n = json_is_array(v) ? json_array_size(v) : 1;
	if (!json_is_array(v) && !json_is_string(v))
		return bad(resp, "stop", "'stop' must be a string or an array of strings");
	if (n > MAX_STOPS) {
		char m[128];
		snprintf(m, sizeof m, "'stop' may hold at most %d strings, got %zu", MAX_STOPS, n);
		return bad(resp, "stop", m);
	}
	for (size_t i = 0; i < n; i++) {
		json_t *s = json_is_array(v) ? json_array_get(v, i) : one[0];
		if (!json_is_string(s) || json_string_length(s) == 0 ||
		    json_string_length(s) > MAX_STOP_LEN)
			return bad(resp, "stop", "each 'stop' entry must be a non-empty string of at "
						 "most 256 bytes");
		if (!(o->stop[o->n_stop] = strdup(json_string_value(s))))
			return bad(resp, "stop", "out of memory");
		o->n_stop++;
	}
	return DS_OK;
}

static int parse_stop_ids(serve *sv, const json_t *b, gen_opts *o, http_resp *resp)
{
	json_t *v = json_object_get(b, "stop_token_ids");
	if (!v || json_is_null(v))
		return DS_OK;
	if (!json_is_array(v) || json_array_size(v) > 256)
		return bad(resp, "stop_token_ids", "'stop_token_ids' must be an array of at most 256 "
						   "token ids");
	o->stop_ids = malloc((json_array_size(v) + 1) * sizeof *o->stop_ids);
	if (!o->stop_ids)
		return bad(resp, "stop_token_ids", "out of memory");
	for (size_t i = 0; i < json_array_size(v); i++) {
		json_t *x = json_array_get(v, i);
		if (!json_is_integer(x) || json_integer_value(x) < 0 ||
		    json_integer_value(x) >= sv->vocab)
			return bad(resp, "stop_token_ids", "'stop_token_ids' holds an id outside the "
							   "vocabulary");
		o->stop_ids[o->n_stop_ids++] = (int32_t)json_integer_value(x);
	}
	return DS_OK;
}

/* One optional request field: 'i' int64 in [min, max], 'd' double, 'b' bool. */
typedef struct field {
	const char *key; /* NULL: not read for this endpoint */
	char type;
	double min, max;
	void *out;
} field;

static int get_field(const json_t *b, const field *f, ds_err *err)
{
	if (f->type == 'i')
		return jsonx_get_i64(b, f->key, 0, (int64_t)f->min, (int64_t)f->max, f->out, err);
	if (f->type == 'd')
		return jsonx_get_double(b, f->key, 0, f->min, f->max, f->out, err);
	return jsonx_get_bool(b, f->key, 0, f->out, err);
}

static int parse_opts(serve *sv, const json_t *b, int chat, gen_opts *o, http_resp *resp)
{
	ds_err err = {0};
	int64_t n = 1, mt = -1, seed = 0, top_k = 0, top_lp = 0, lp_int = -1, best_of = 0;
	double temp = 1.0, top_p = 1.0, min_p = 0.0, pres = 0.0, freq = 0.0, rep = 1.0;
	int has_seed = 0, lp_bool = 0;
	const char *param = NULL;
	json_t *so;
	memset(o, 0, sizeof *o);
	o->chat = chat;
	o->skip_special = 1;
	if (refuse_unsupported(b, chat, resp))
		return DS_EINVAL;
	const field fields[] = {
		{"n", 'i', 1, sv->p.max_n, &n},
		{"best_of", 'i', 1, sv->p.max_n, &best_of},
		{"max_tokens", 'i', 1, INT32_MAX, &mt},
		{chat ? "max_completion_tokens" : NULL, 'i', 1, INT32_MAX, &mt},
		{"temperature", 'd', 0.0, 2.0, &temp},
		{"top_p", 'd', 1e-9, 1.0, &top_p},
		{"top_k", 'i', -1, INT32_MAX, &top_k},
		{"min_p", 'd', 0.0, 1.0, &min_p},
		{"presence_penalty", 'd', -2.0, 2.0, &pres},
		{"frequency_penalty", 'd', -2.0, 2.0, &freq},
		{"repetition_penalty", 'd', 1e-3, 10.0, &rep},
		{"ignore_eos", 'b', 0, 0, &o->ignore_eos},
		{"stream", 'b', 0, 0, &o->stream},
		{"skip_special_tokens", 'b', 0, 0, &o->skip_special},
		{"include_stop_str_in_output", 'b', 0, 0, &o->include_stop},
		{chat ? "logprobs" : NULL, 'b', 0, 0, &lp_bool},
		{chat ? "top_logprobs" : NULL, 'i', 0, sv->p.max_logprobs, &top_lp},
		{chat ? NULL : "logprobs", 'i', 0, sv->p.max_logprobs, &lp_int},
	};
	for (size_t i = 0; i < sizeof fields / sizeof *fields; i++) {
		if (fields[i].key && get_field(b, &fields[i], &err)) {
			param = fields[i].key;
			goto bad_field;
		}
	}
	if (json_object_get(b, "seed") && !json_is_null(json_object_get(b, "seed"))) {
		if (jsonx_get_i64(b, "seed", 1, INT64_MIN, INT64_MAX, &seed, &err)) {
			param = "seed";
			goto bad_field;
		}
		has_seed = 1;
	}
	if (chat) {
		if (json_object_get(b, "top_logprobs") && !json_is_null(json_object_get(b, "top_logprobs")) && !lp_bool)
			return bad(resp, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
		o->logprobs = lp_bool;
		o->top_logprobs = (int)top_lp;
	} else {
		o->logprobs = lp_int >= 0;
		o->top_logprobs = lp_int > 0 ? (int)lp_int : 0;
	}
	if ((so = json_object_get(b, "stream_options")) && !json_is_null(so)) {
		if (!json_is_object(so))
			return bad(resp, "stream_options", "'stream_options' must be an object");
		if (!o->stream)
			return bad(resp, "stream_options",
				   "'stream_options' is only allowed with 'stream': true");
		if (jsonx_get_bool(so, "include_usage", 0, &o->include_usage, &err)) {
			param = "stream_options";
			goto bad_field;
		}
	}
	if (best_of > n)
		return bad(resp, "best_of", "'best_of' larger than 'n' is not supported");
	o->n = (int)n;
	o->max_tokens = mt;
	o->smp = smp_default_params();
	o->smp.temperature = (float)temp;
	o->smp.top_p = (float)top_p;
	o->smp.top_k = top_k > 0 ? (int)top_k : 0;
	o->smp.min_p = (float)min_p;
	o->smp.presence_penalty = (float)pres;
	o->smp.frequency_penalty = (float)freq;
	o->smp.repetition_penalty = (float)rep;
	o->smp.has_seed = has_seed;
	o->smp.seed = (uint64_t)seed;
	if (parse_stop(b, o, resp) || parse_stop_ids(sv, b, o, resp))
		return DS_EINVAL;
	return DS_OK;
bad_field:
	http_resp_error_param(resp, 400, "invalid_request_error", "invalid_value", param, "%s",
			      err.msg);
	return DS_EINVAL;
}

/* ---- prompts ---- */

typedef struct prompt {
	int32_t *ids;
	size_t n;
} prompt;

/* Text of a chat message's content: a string, an array of text parts
 * (joined with "\n", as vLLM does), or null.  *owned is set when the text
 * was built (caller frees). */
static int content_text(const json_t *c, size_t mi, const char **text, char **owned,
			http_resp *resp)
{
	char param[64];
	snprintf(param, sizeof param, "messages[%zu].content", mi);
	*owned = NULL;
	if (!c || json_is_null(c)) {
		*text = NULL;
		return DS_OK;
	}
	if (json_is_string(c)) {
		*text = json_string_value(c);
		return DS_OK;
	}
	if (!json_is_array(c))
		return bad(resp, param, "message content must be a string or an array of text parts");
	buf b;
	buf_init(&b, TEXT_CAP);
	size_t i;
	json_t *part;
	json_array_foreach(c, i, part) {
		json_t *type = json_object_get(part, "type"), *t = json_object_get(part, "text");
		if (!json_is_string(type) || strcmp(json_string_value(type), "text") != 0 ||
		    !json_is_string(t)) {
			buf_free(&b);
			return bad(resp, param, "only content parts of type \"text\" with a string "
						"'text' are supported");
		}
		if ((i && buf_append(&b, "\n", 1)) ||
		    buf_append(&b, json_string_value(t), json_string_length(t))) {
			buf_free(&b);
			return bad(resp, param, "message content is too large");
		}
	}
	*owned = buf_take(&b);
	if (!*owned)
		*owned = strdup("");
	*text = *owned;
	return *owned ? DS_OK : bad(resp, param, "out of memory");
}

/* ---- tools ---- */

#define MAX_TOOLS 128
#define MAX_TOOL_TEXT (1u << 20) /* a description or a parameters schema */

/* A request's tools and tool_choice (struct req_tools) are owned by the gen:
 * a stream outlives the body. */
static void req_tools_free(req_tools *rt)
{
	for (size_t i = 0; rt && i < rt->n; i++) {
		free((char *)rt->tools[i].name);
		free((char *)rt->tools[i].description);
		free((char *)rt->tools[i].parameters);
	}
	if (rt) {
		free(rt->tools);
		free(rt->name);
		memset(rt, 0, sizeof *rt);
	}
}

/* A name OpenAI accepts: 1 to 64 of [A-Za-z0-9_-]. */
static int tool_name_ok(const char *s)
{
	size_t n = strlen(s);
	if (n == 0 || n > 64)
		return 0;
	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '_' || c == '-'))
			return 0;
	}
	return 1;
}

/* A 400 naming tools[i] + field. */
static int bad_at(http_resp *resp, size_t i, const char *member, const char *msg)
{
	char param[96];
	snprintf(param, sizeof param, "tools[%zu]%s", i, member);
	return bad(resp, param, msg);
}

/* One entry of "tools" into rt->tools[i]. */
static int parse_tool(const json_t *t, size_t i, req_tools *rt, http_resp *resp)
{
	json_t *type = json_object_get(t, "type"), *fn = json_object_get(t, "function");
	if (!json_is_object(t))
		return bad_at(resp, i, "", "each tool must be an object {\"type\": "
						       "\"function\", \"function\": {...}}");
	if (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0)
		return bad_at(resp, i, ".type", "the type of a tool must be \"function\"");
	if (!json_is_object(fn))
		return bad_at(resp, i, ".function", "'function' must be an object with a "
							     "'name'");
	json_t *name = json_object_get(fn, "name"), *desc = json_object_get(fn, "description");
	json_t *params = json_object_get(fn, "parameters");
	if (!json_is_string(name) || !tool_name_ok(json_string_value(name)))
		return bad_at(resp, i, ".function.name",
			      "a function name must be 1 to 64 letters, digits, '_' or '-'");
	for (size_t k = 0; k < i; k++)
		if (strcmp(rt->tools[k].name, json_string_value(name)) == 0)
			return bad_at(resp, i, ".function.name",
				      "two tools have the same function name");
	if (desc && !json_is_null(desc) &&
	    (!json_is_string(desc) || json_string_length(desc) > MAX_TOOL_TEXT))
		return bad_at(resp, i, ".function.description",
			      "'description' must be a string of at most 1 MiB");
	if (params && !json_is_null(params) && !json_is_object(params))
		return bad_at(resp, i, ".function.parameters",
			      "'parameters' must be a JSON Schema object");
	chat_tool *ct = &rt->tools[i];
	ct->name = strdup(json_string_value(name));
	ct->description = json_is_string(desc) ? strdup(json_string_value(desc)) : NULL;
	ct->parameters = json_is_object(params) ? jsonx_dumps(params) : NULL;
	rt->n = i + 1; /* freed from here on */
	if (!ct->name || (json_is_string(desc) && !ct->description) ||
	    (json_is_object(params) && !ct->parameters))
		return bad_at(resp, i, "", "out of memory");
	if (ct->parameters && strlen(ct->parameters) > MAX_TOOL_TEXT)
		return bad_at(resp, i, ".function.parameters",
			      "'parameters' must be at most 1 MiB of JSON");
	return DS_OK;
}

/* "tools", "tool_choice", "parallel_tool_calls" of a chat request. */
static int parse_tools(serve *sv, const json_t *b, req_tools *rt, http_resp *resp)
{
	json_t *tools = json_object_get(b, "tools"), *tc = json_object_get(b, "tool_choice");
	json_t *par = json_object_get(b, "parallel_tool_calls");
	memset(rt, 0, sizeof *rt);
	if (json_object_get(b, "functions") || json_object_get(b, "function_call"))
		return bad(resp, json_object_get(b, "functions") ? "functions" : "function_call",
			   "'functions' and 'function_call' are not supported: use 'tools' and "
			   "'tool_choice'");
	if (par && !json_is_null(par) && !json_is_boolean(par))
		return bad(resp, "parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
	if (tools && !json_is_null(tools)) {
		if (!json_is_array(tools) || json_array_size(tools) > MAX_TOOLS)
			return bad(resp, "tools", "'tools' must be an array of at most 128 tools");
		if (json_array_size(tools) &&
		    !(rt->tools = calloc(json_array_size(tools), sizeof *rt->tools)))
			return bad(resp, "tools", "out of memory");
		for (size_t i = 0; i < json_array_size(tools); i++)
			if (parse_tool(json_array_get(tools, i), i, rt, resp))
				return DS_EINVAL;
	}
	rt->choice = rt->n ? CHAT_CHOICE_AUTO : CHAT_CHOICE_NONE;
	if (json_is_string(tc)) {
		const char *c = json_string_value(tc);
		if (strcmp(c, "none") == 0)
			rt->choice = CHAT_CHOICE_NONE;
		else if (strcmp(c, "auto") == 0)
			rt->choice = CHAT_CHOICE_AUTO;
		else if (strcmp(c, "required") == 0)
			rt->choice = CHAT_CHOICE_REQUIRED;
		else
			return bad(resp, "tool_choice", "'tool_choice' must be \"none\", \"auto\", "
							"\"required\" or {\"type\": \"function\", "
							"\"function\": {\"name\": ...}}");
	} else if (json_is_object(tc)) {
		json_t *type = json_object_get(tc, "type");
		json_t *name = json_object_get(json_object_get(tc, "function"), "name");
		if (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0 ||
		    !json_is_string(name))
			return bad(resp, "tool_choice", "a named 'tool_choice' is {\"type\": "
							"\"function\", \"function\": {\"name\": ...}}");
		size_t k = 0;
		while (k < rt->n && strcmp(rt->tools[k].name, json_string_value(name)) != 0)
			k++;
		if (k == rt->n)
			return bad(resp, "tool_choice", "'tool_choice' names a function that is not in "
							"'tools'");
		rt->choice = CHAT_CHOICE_NAMED;
		if (!(rt->name = strdup(json_string_value(name))))
			return bad(resp, "tool_choice", "out of memory");
	} else if (tc && !json_is_null(tc)) {
		return bad(resp, "tool_choice", "'tool_choice' must be a string or an object");
	}
	if (!rt->n && (rt->choice == CHAT_CHOICE_REQUIRED || rt->choice == CHAT_CHOICE_NAMED))
		return bad(resp, "tool_choice", "'tool_choice' \"required\" needs 'tools'");
	rt->parse = rt->n > 0 && rt->choice != CHAT_CHOICE_NONE;
	if (rt->parse && sv->chat.tool_format == CHAT_TOOLS_NONE) {
		char m[256];
		snprintf(m, sizeof m, "the chat template of this model (%s) has no tool-call format, so "
				      "'tools' cannot be used (only with tool_choice \"none\")",
			 chat_template_name(sv->chat.tmpl));
		return bad(resp, "tools", m);
	}
	return DS_OK;
}

static int chat_prompt(serve *sv, const json_t *b, prompt *pr, req_tools *rt, http_resp *resp);

int oai_chat_prompt(serve *sv, const json_t *body, int32_t **ids, size_t *n, http_resp *resp)
{
	prompt pr = {0};
	req_tools rt;
	int rc = chat_prompt(sv, body, &pr, &rt, resp);
	req_tools_free(&rt);
	*ids = pr.ids;
	*n = pr.n;
	return rc;
}

/* The prompt of a chat request, and its tools into rt (which the caller
 * frees, also on error). */
static int chat_prompt(serve *sv, const json_t *b, prompt *pr, req_tools *rt, http_resp *resp)
{
	json_t *msgs = json_object_get(b, "messages");
	memset(rt, 0, sizeof *rt);
	if (!json_is_array(msgs) || json_array_size(msgs) == 0)
		return bad(resp, "messages", "'messages' must be a non-empty array");
	if (!sv->has_chat)
		return bad(resp, "messages", "this model has no chat template the server knows; use "
					     "/v1/completions or start dsagent with --chat-template");
	size_t n = json_array_size(msgs);
	if (n > 4096)
		return bad(resp, "messages", "'messages' may hold at most 4096 entries");
	if (parse_tools(sv, b, rt, resp))
		return DS_EINVAL;
	chat_msg *cm = calloc(n, sizeof *cm);
	char **owned = calloc(n, sizeof *owned);
	chat_tool_call *calls = NULL;
	size_t n_calls = 0, i;
	json_t *m;
	buf text;
	int rc = DS_EINVAL;
	buf_init(&text, TEXT_CAP);
	if (!cm || !owned) {
		bad(resp, "messages", "out of memory");
		goto out;
	}
	json_array_foreach(msgs, i, m) { /* count tool calls first: one array for all */
		json_t *tc = json_object_get(m, "tool_calls");
		if (json_is_array(tc))
			n_calls += json_array_size(tc);
	}
	if (n_calls && !(calls = calloc(n_calls, sizeof *calls))) {
		bad(resp, "messages", "out of memory");
		goto out;
	}
	n_calls = 0;
	json_array_foreach(msgs, i, m) {
		char param[64];
		snprintf(param, sizeof param, "messages[%zu].role", i);
		json_t *role = json_object_get(m, "role");
		ds_err err = {0};
		if (!json_is_object(m) || !json_is_string(role)) {
			bad(resp, param, "each message must be an object with a string 'role'");
			goto out;
		}
		const char *r = json_string_value(role);
		if (strcmp(r, "developer") == 0)
			r = "system";
		if (chat_role_parse(r, &cm[i].role, &err)) {
			bad(resp, param, err.msg);
			goto out;
		}
		if (content_text(json_object_get(m, "content"), i, &cm[i].content, &owned[i], resp))
			goto out;
		json_t *tc = json_object_get(m, "tool_calls");
		if (json_is_array(tc) && json_array_size(tc)) {
			cm[i].tool_calls = calls + n_calls;
			size_t k;
			json_t *c;
			json_array_foreach(tc, k, c) {
				json_t *fn = json_object_get(c, "function"), *type = json_object_get(c, "type");
				json_t *name = json_object_get(fn, "name"), *args = json_object_get(fn, "arguments");
				snprintf(param, sizeof param, "messages[%zu].tool_calls[%zu]", i, k);
				if (!json_is_string(name) || !json_is_string(args)) {
					bad(resp, param, "each tool call needs function.name and "
							 "function.arguments strings");
					goto out;
				}
				if (type && (!json_is_string(type) ||
					     strcmp(json_string_value(type), "function") != 0)) {
					bad(resp, param, "the type of a tool call must be \"function\"");
					goto out;
				}
				calls[n_calls++] = (chat_tool_call){"function", json_string_value(name),
								    json_string_value(args)};
			}
			cm[i].n_tool_calls = json_array_size(tc);
		}
	}
	ds_err err = {0};
	tok_ids ids;
	tok_ids_init(&ids, 0);
	chat_params cp = sv->chat;
	cp.tools = rt->tools;
	cp.n_tools = rt->n;
	cp.tool_choice = rt->choice;
	cp.tool_name = rt->name;
	/* only the template's markers become control tokens: contents are text */
	if (chat_render_ids(&cp, sv->tk, cm, n, &ids, &text, &err)) {
		tok_ids_free(&ids);
		bad(resp, err.code == DS_EUNSUPPORTED ? "tools" : "messages", err.msg);
		goto out;
	}
	if (!ids.v && !(ids.v = malloc(sizeof *ids.v))) {
		bad(resp, "messages", "out of memory");
		goto out;
	}
	pr->ids = ids.v;
	pr->n = ids.n;
	rc = DS_OK;
out:
	for (size_t k = 0; owned && k < n; k++)
		free(owned[k]);
	free(owned);
	free(cm);
	free(calls);
	buf_free(&text);
	return rc;
}

static int ids_prompt(serve *sv, const json_t *arr, prompt *pr, http_resp *resp)
{
	size_t n = json_array_size(arr);
	pr->ids = malloc((n ? n : 1) * sizeof *pr->ids);
	if (!pr->ids)
		return bad(resp, "prompt", "out of memory");
	for (size_t i = 0; i < n; i++) {
		json_t *v = json_array_get(arr, i);
		if (!json_is_integer(v) || json_integer_value(v) < 0 ||
		    json_integer_value(v) >= sv->vocab)
			return bad(resp, "prompt", "a token-id prompt holds an id outside the vocabulary");
		pr->ids[i] = (int32_t)json_integer_value(v);
	}
	pr->n = n;
	return DS_OK;
}

/* /v1/completions "prompt": a string, token ids, or an array of either. */
static int completion_prompts(serve *sv, const json_t *b, prompt *prs, int *n_prs, http_resp *resp)
{
	json_t *p = json_object_get(b, "prompt");
	json_t *items[MAX_PROMPTS];
	int n = 0;
	if (json_is_string(p) || (json_is_array(p) && json_array_size(p) &&
				  json_is_integer(json_array_get(p, 0)))) {
		items[n++] = p;
	} else if (json_is_array(p) && json_array_size(p) > 0) {
		if (json_array_size(p) > MAX_PROMPTS)
			return bad(resp, "prompt", "'prompt' may hold at most 64 prompts");
		for (size_t i = 0; i < json_array_size(p); i++)
			items[n++] = json_array_get(p, i);
	} else {
		return bad(resp, "prompt", "'prompt' must be a string, an array of strings, an array "
					   "of token ids or an array of such arrays");
	}
	for (int i = 0; i < n; i++) {
		*n_prs = i + 1;
		if (json_is_string(items[i])) {
			ds_err err = {0};
			unsigned flags = TOK_PARSE_SPECIAL;
			if (tok_bos_id(sv->tk) >= 0 && tok_add_bos_default(sv->tk))
				flags |= TOK_ADD_BOS;
			if (tok_encode_alloc(sv->tk, json_string_value(items[i]),
					     json_string_length(items[i]), flags, &prs[i].ids, &prs[i].n,
					     &err))
				return bad(resp, "prompt", err.msg);
		} else if (json_is_array(items[i])) {
			if (ids_prompt(sv, items[i], &prs[i], resp))
				return DS_EINVAL;
		} else {
			return bad(resp, "prompt", "each prompt must be a string or an array of token ids");
		}
		if (prs[i].n == 0)
			return bad(resp, "prompt", "the prompt is empty");
	}
	return DS_OK;
}

/* ---- token processing ---- */

/* Released text to reasoning / content, and content through the tool-call
 * parser. */
static void emit(gen *g, choice *c, const char *s, size_t n)
{
	ds_err err = {0};
	if (!n)
		return;
	if (g->reasoning && g->tools_on) {
		buf_clear(&c->scratch);
		chat_reasoning_feed(&c->rs, s, n, &c->reason, &c->scratch, &err);
		chat_calls_feed(&c->calls, c->scratch.data, c->scratch.len, &c->text, &err);
	} else if (g->reasoning) {
		chat_reasoning_feed(&c->rs, s, n, &c->reason, &c->text, &err);
	} else if (g->tools_on) {
		chat_calls_feed(&c->calls, s, n, &c->text, &err);
	} else {
		buf_append(&c->text, s, n);
	}
}

static int is_tool_marker(const gen *g, int32_t id)
{
	for (int i = 0; i < g->n_marker_ids; i++)
		if (g->marker_ids[i] == id)
			return 1;
	return 0;
}

static void finish(choice *c, const char *reason)
{
	if (!c->finished) {
		c->finished = 1;
		c->finish_reason = reason;
	}
}

/* Moves what can no longer begin a stop string from hold to the output;
 * final: the sequence ended, release everything. */
static void release(gen *g, choice *c, int final)
{
	size_t cut = c->hold.len, stop_len = 0;
	int matched = 0;
	for (int i = 0; i < g->o.n_stop; i++) {
		const char *p = c->hold.data ? memmem(c->hold.data, c->hold.len, g->o.stop[i],
						      strlen(g->o.stop[i]))
					     : NULL;
		if (p && (size_t)(p - c->hold.data) < cut) {
			cut = (size_t)(p - c->hold.data);
			stop_len = strlen(g->o.stop[i]);
			matched = 1;
		}
	}
	if (matched) {
		emit(g, c, c->hold.data, cut + (g->o.include_stop ? stop_len : 0));
		buf_clear(&c->hold);
		c->cut = 1;
		finish(c, "stop");
		sched_seq_cancel(c->q);
		return;
	}
	size_t keep = 0;
	if (!final) {
		for (int i = 0; i < g->o.n_stop; i++) {
			size_t sl = strlen(g->o.stop[i]);
			for (size_t k = sl - 1 < c->hold.len ? sl - 1 : c->hold.len; k > keep; k--)
				if (memcmp(c->hold.data + c->hold.len - k, g->o.stop[i], k) == 0) {
					keep = k;
					break;
				}
		}
	}
	emit(g, c, c->hold.data, c->hold.len - keep);
	if (keep)
		memmove(c->hold.data, c->hold.data + c->hold.len - keep, keep);
	c->hold.len = keep;
	if (c->hold.data)
		c->hold.data[keep] = 0;
}

static json_t *token_str(serve *sv, int32_t id, json_t **bytes)
{
	size_t len = 0;
	const char *t = tok_token_text(sv->tk, id, &len);
	buf b;
	buf_init(&b, 0);
	http_utf8_clean(t ? t : "", t ? len : 0, &b);
	json_t *s = json_stringn(b.data ? b.data : "", b.len);
	buf_free(&b);
	if (bytes) {
		*bytes = json_array();
		for (size_t i = 0; t && i < len; i++)
			json_array_append_new(*bytes, json_integer((unsigned char)t[i]));
	}
	return s;
}

static double lp_value(float v)
{
	return isfinite(v) ? (double)v : -9999.0; /* JSON has no -inf */
}

static void add_logprobs(gen *g, choice *c, const sched_tok *t, size_t text_len_before)
{
	serve *sv = g->sv;
	if (g->o.chat) {
		json_t *bytes, *top = json_array();
		json_t *tokstr = token_str(sv, t->id, &bytes);
		for (int k = 0; k < t->n_top; k++) {
			json_t *tb;
			json_t *ts = token_str(sv, t->top_id[k], &tb);
			json_array_append_new(top, json_pack("{s:o,s:f,s:o}", "token", ts, "logprob",
							     lp_value(t->top_logprob[k]), "bytes", tb));
		}
		json_array_append_new(c->lp, json_pack("{s:o,s:f,s:o,s:o}", "token", tokstr,
						       "logprob", lp_value(t->logprob), "bytes", bytes,
						       "top_logprobs", top));
		return;
	}
	json_t *top = json_object();
	for (int k = 0; k < t->n_top; k++) {
		json_t *ts = token_str(sv, t->top_id[k], NULL);
		json_object_set_new(top, json_string_value(ts), json_real(lp_value(t->top_logprob[k])));
		json_decref(ts);
	}
	json_array_append_new(json_object_get(c->lp, "tokens"), token_str(sv, t->id, NULL));
	json_array_append_new(json_object_get(c->lp, "token_logprobs"),
			      json_real(lp_value(t->logprob)));
	json_array_append_new(json_object_get(c->lp, "top_logprobs"), top);
	json_array_append_new(json_object_get(c->lp, "text_offset"),
			      json_integer((json_int_t)(c->text_offset + (int64_t)text_len_before)));
}

static json_t *new_lp(int chat)
{
	if (chat)
		return json_array();
	return json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs",
			 "text_offset");
}

static const char *finish_name(sched_finish f)
{
	switch (f) {
	case SCHED_FIN_STOP:
		return "stop";
	case SCHED_FIN_LENGTH:
		return "length";
	case SCHED_FIN_ERROR:
		return "error";
	default:
		return "abort";
	}
}

/* Takes what the scheduler has for c (waiting up to timeout_ms); 1 when
 * anything changed. */
static int pull(gen *g, choice *c, int timeout_ms)
{
	sched_tok toks[32];
	sched_finish fin = SCHED_RUNNING;
	if (c->flushed)
		return 0;
	int n = sched_seq_next(c->q, toks, 32, timeout_ms, &fin);
	double now = ds_now_s();
	if (n > 0) {
		if (!c->t_first) {
			c->t_first = now;
			if (c->index == 0)
				metrics_observe(g->sv->met, MET_TTFT, now - g->t_arrival);
		} else {
			metrics_observe(g->sv->met, MET_ITL, (now - c->t_last) / n);
		}
		c->t_last = now;
	}
	for (int i = 0; i < n && !c->finished; i++) {
		c->n_tok++;
		size_t before = c->text.len + c->reason.len + c->hold.len;
		if (g->o.logprobs)
			add_logprobs(g, c, &toks[i], before);
		if (fin == SCHED_FIN_STOP && i == n - 1)
			break; /* the eos / stop id itself is not text */
		ds_err err = {0};
		unsigned flags = c->ts.flags;
		if (is_tool_marker(g, toks[i].id)) /* the parser needs it, special or not */
			c->ts.flags &= ~(unsigned)TOK_SKIP_SPECIAL;
		tok_stream_feed(&c->ts, toks[i].id, &c->hold, &err);
		c->ts.flags = flags;
		release(g, c, 0);
	}
	if (!c->finished && fin != SCHED_RUNNING) {
		finish(c, finish_name(fin));
		if (fin == SCHED_FIN_ERROR)
			snprintf(c->error, sizeof c->error, "%s", sched_seq_error(c->q));
	}
	if (c->finished && !c->flushed) {
		ds_err err = {0};
		if (!c->cut) { /* not cut by a stop string: flush the decoder */
			tok_stream_flush(&c->ts, &c->hold, &err);
			release(g, c, 1);
		}
		if (g->reasoning)
			chat_reasoning_finish(&c->rs, &c->reason, &c->text, &err);
		if (g->tools_on)
			chat_calls_finish(&c->calls, &c->text, &err);
		c->flushed = 1;
	}
	return n > 0 || c->flushed;
}

/* ---- output ---- */

static json_t *chunk_base(gen *g)
{
	return json_pack("{s:s,s:s,s:I,s:s}", "id", g->id, "object",
			 g->o.chat ? "chat.completion.chunk" : "text_completion", "created",
			 g->created, "model", g->model);
}

static json_t *usage(gen *g)
{
	int64_t comp = 0;
	for (int i = 0; i < g->n_choices; i++)
		comp += g->ch[i].n_tok;
	return json_pack("{s:i,s:I,s:I}", "prompt_tokens", g->prompt_tokens, "completion_tokens",
			 (json_int_t)comp, "total_tokens", (json_int_t)(g->prompt_tokens + comp));
}

static void sse(gen *g, json_t *v)
{
	char *s = v ? jsonx_dumps(v) : NULL;
	json_decref(v);
	if (!s)
		return;
	buf_append(&g->out, "data: ", 6);
	buf_append(&g->out, s, strlen(s));
	buf_append(&g->out, "\n\n", 2);
	free(s);
}

static json_t *take_lp(gen *g, choice *c)
{
	if (!g->o.logprobs)
		return json_null();
	json_t *lp = c->lp;
	c->lp = new_lp(g->o.chat);
	if (g->o.chat)
		return json_pack("{s:o}", "content", lp);
	return lp;
}

/* "tool_calls" when the model called tools and stopped by itself. */
static const char *api_finish(const choice *c)
{
	return c->calls.n_calls && strcmp(c->finish_reason, "stop") == 0 ? "tool_calls"
									    : c->finish_reason;
}

/* Calls [from, to) of c as OpenAI tool_calls entries (with "index" in a stream). */
static json_t *calls_json(const choice *c, size_t from, size_t to, int stream)
{
	json_t *arr = json_array();
	for (size_t k = from; k < to; k++) {
		unsigned char r[12];
		char hex[sizeof r * 2 + 1], id[32];
		randombytes_buf(r, sizeof r);
		sodium_bin2hex(hex, sizeof hex, r, sizeof r);
		snprintf(id, sizeof id, "call_%s", hex);
		json_t *v = json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", id, "type", "function", "function",
				      "name", c->calls.calls[k].name, "arguments",
				      c->calls.calls[k].arguments);
		if (stream)
			json_object_set_new(v, "index", json_integer((json_int_t)k));
		json_array_append_new(arr, v);
	}
	return arr;
}

/* The chunks of choice c for what changed since the last call. */
static void stream_choice(gen *g, choice *c)
{
	int new_calls = c->calls.n_calls > c->calls_sent;
	int has_text = c->text.len || c->reason.len || new_calls;
	int has_lp = g->o.logprobs && (g->o.chat ? json_array_size(c->lp)
						 : json_array_size(json_object_get(c->lp, "tokens")));
	int last = c->flushed && !c->final_sent;
	if (g->o.chat && !c->role_sent && (c->t_first || last)) {
		json_t *v = chunk_base(g);
		json_object_set_new(v, "choices",
				    json_pack("[{s:i,s:{s:s,s:s},s:n,s:n}]", "index", c->index, "delta",
					      "role", "assistant", "content", "", "logprobs",
					      "finish_reason"));
		sse(g, v);
		c->role_sent = 1;
	}
	if (!has_text && !has_lp && !last)
		return;
	json_t *v = chunk_base(g), *ch;
	if (g->o.chat) {
		json_t *delta = json_object();
		if (c->reason.len)
			json_object_set_new(delta, "reasoning_content",
					    json_stringn(c->reason.data, c->reason.len));
		if (c->text.len)
			json_object_set_new(delta, "content", json_stringn(c->text.data, c->text.len));
		if (new_calls) {
			json_object_set_new(delta, "tool_calls",
					    calls_json(c, c->calls_sent, c->calls.n_calls, 1));
			c->calls_sent = c->calls.n_calls;
		}
		ch = json_pack("{s:i,s:o}", "index", c->index, "delta", delta);
	} else {
		ch = json_pack("{s:i,s:s%}", "index", c->index, "text", c->text.data ? c->text.data : "",
			       c->text.len);
	}
	c->text_offset += (int64_t)c->text.len;
	buf_clear(&c->text);
	buf_clear(&c->reason);
	json_object_set_new(ch, "logprobs", take_lp(g, c));
	json_object_set_new(ch, "finish_reason", last ? json_string(api_finish(c)) : json_null());
	json_object_set_new(v, "choices", json_pack("[o]", ch));
	sse(g, v);
	if (last)
		c->final_sent = 1;
}

static const char *first_error(gen *g)
{
	for (int i = 0; i < g->n_choices; i++)
		if (g->ch[i].finished && strcmp(g->ch[i].finish_reason, "error") == 0)
			return g->ch[i].error[0] ? g->ch[i].error : "the engine failed";
	return NULL;
}

static int all_flushed(gen *g)
{
	for (int i = 0; i < g->n_choices; i++)
		if (!g->ch[i].flushed)
			return 0;
	return 1;
}

static void cancel_all(gen *g)
{
	for (int i = 0; i < g->n_choices; i++)
		if (g->ch[i].q && !g->ch[i].flushed)
			sched_seq_cancel(g->ch[i].q);
}

/* One round: pulls every unfinished choice, waiting on the first; 1 when
 * anything changed. */
static int pull_round(gen *g)
{
	int changed = 0, waited = 0;
	for (int i = 0; i < g->n_choices; i++) {
		choice *c = &g->ch[i];
		if (c->flushed)
			continue;
		changed |= pull(g, c, waited ? 0 : (g->n_choices == 1 ? 200 : 10));
		waited = 1;
	}
	return changed;
}

/* Metering between reads: the sequences the scheduler started (or ended)
 * leave the key's queue share, looked up at most every 50 ms; 1 when the key
 * was revoked (err names it), else 0. */
static int meter(gen *g, ds_err *err)
{
	keys_svc *k = g->sv->p.keys;
	if (g->hold.key_id <= 0)
		return 0;
	double now = ds_now_s();
	if (g->hold.queued > 0 && now - g->t_meter >= 0.05) {
		int64_t left = 0;
		g->t_meter = now;
		for (int i = 0; i < g->n_choices; i++) {
			choice *c = &g->ch[i];
			if (c->dequeued || !c->q)
				continue;
			if (c->t_first || c->finished || sched_seq_times(c->q).admitted > 0) {
				c->dequeued = 1;
				left++;
			}
		}
		keys_dequeue(k, &g->hold, left);
	}
	return keys_hold_revoked(k, &g->hold, err);
}

static ssize_t stream_read(void *ctx, char *out, size_t max)
{
	gen *g = ctx;
	for (;;) {
		if (g->out_off < g->out.len) {
			size_t n = g->out.len - g->out_off;
			if (n > max)
				n = max;
			memcpy(out, g->out.data + g->out_off, n);
			g->out_off += n;
			return (ssize_t)n;
		}
		buf_clear(&g->out);
		g->out_off = 0;
		if (g->done_sent)
			return HTTP_STREAM_END;
		if (all_flushed(g)) {
			const char *e = first_error(g);
			if (e) {
				sse(g, json_pack("{s:{s:s,s:s,s:n,s:s}}", "error", "message", e, "type",
						 "server_error", "param", "code", "engine_error"));
			} else if (g->o.include_usage) { /* final chunks went out with the last pull */
				json_t *v = chunk_base(g);
				json_object_set_new(v, "choices", json_array());
				json_object_set_new(v, "usage", usage(g));
				sse(g, v);
			}
			buf_append(&g->out, "data: [DONE]\n\n", 14);
			g->done_sent = 1;
			continue;
		}
		int changed = pull_round(g);
		ds_err revoked = {0};
		if (meter(g, &revoked)) { /* the key was revoked: end here */
			g->aborted = 1;
			cancel_all(g);
			sse(g, json_pack("{s:{s:s,s:s,s:n,s:s}}", "error", "message", revoked.msg,
					 "type", "authentication_error", "param", "code",
					 "api_key_revoked"));
			buf_append(&g->out, "data: [DONE]\n\n", 14);
			g->done_sent = 1;
			continue;
		}
		if (changed) {
			for (int i = 0; i < g->n_choices; i++) {
				choice *c = &g->ch[i];
				if (!(c->flushed && strcmp(c->finish_reason, "error") == 0))
					stream_choice(g, c);
			}
		}
		if (atomic_load(&g->sv->stopping) && !all_flushed(g)) {
			/* what was decoded went out above; then the error and [DONE] */
			const char *code, *msg;
			g->aborted = 1;
			cancel_all(g);
			serve_stop_error(g->sv, &code, &msg);
			sse(g, json_pack("{s:{s:s,s:s,s:n,s:s}}", "error", "message", msg, "type",
					 "service_unavailable_error", "param", "code", code));
			buf_append(&g->out, "data: [DONE]\n\n", 14);
			g->done_sent = 1;
		} else if (!changed && http_conn_gone(g->conn)) {
			g->aborted = 1;
			cancel_all(g);
			return HTTP_STREAM_ERROR;
		}
	}
}

static json_t *whole_response(gen *g)
{
	json_t *choices = json_array();
	for (int i = 0; i < g->n_choices; i++) {
		choice *c = &g->ch[i];
		json_t *ch;
		if (g->o.chat) {
			json_t *msg = json_pack("{s:s,s:s%}", "role", "assistant", "content",
						c->text.data ? c->text.data : "", c->text.len);
			if (c->calls.n_calls && !c->text.len)
				json_object_set_new(msg, "content", json_null());
			if (c->calls.n_calls)
				json_object_set_new(msg, "tool_calls",
						    calls_json(c, 0, c->calls.n_calls, 0));
			if (g->reasoning)
				json_object_set_new(msg, "reasoning_content",
						    json_stringn(c->reason.data ? c->reason.data : "",
								 c->reason.len));
			ch = json_pack("{s:i,s:o}", "index", c->index, "message", msg);
		} else {
			ch = json_pack("{s:i,s:s%}", "index", c->index, "text",
				       c->text.data ? c->text.data : "", c->text.len);
		}
		json_object_set_new(ch, "logprobs", take_lp(g, c));
		json_object_set_new(ch, "finish_reason", json_string(g->o.chat ? api_finish(c)
									      : c->finish_reason));
		json_array_append_new(choices, ch);
	}
	json_t *v = json_pack("{s:s,s:s,s:I,s:s,s:o,s:o}", "id", g->id, "object",
			      g->o.chat ? "chat.completion" : "text_completion", "created",
			      g->created, "model", g->model, "choices", choices, "usage", usage(g));
	return v;
}

/* ---- lifecycle ---- */

/* The one log line of a finished request (g NULL: refused before it had
 * one): never the prompt, never the key. */
static void log_done(const char *id, const char *key_name, int status, int stream,
		     const gen *g, double t0)
{
	int64_t comp = 0;
	double first = 0;
	const char *fin = "-";
	for (int i = 0; g && i < g->n_choices; i++) {
		const choice *c = &g->ch[i];
		comp += c->n_tok;
		if (c->t_first && (!first || c->t_first < first))
			first = c->t_first;
		if (i == 0)
			fin = g->aborted ? "abort" : c->finished ? c->finish_reason : "abort";
	}
	char ttft[32] = "-";
	if (first)
		snprintf(ttft, sizeof ttft, "%.3f", first - t0);
	log_info("serve", "request done",
		 "id=%s key=%s status=%d stream=%d prompt_tokens=%d completion_tokens=%lld "
		 "ttft_s=%s duration_s=%.3f finish=%s",
		 id, key_name, status, stream, g ? g->prompt_tokens : 0, (long long)comp, ttft,
		 ds_now_s() - t0, fin);
}

static void gen_free(gen *g)
{
	if (!g)
		return;
	serve *sv = g->sv;
	int64_t comp = 0;
	double now = ds_now_s();
	for (int i = 0; i < g->n_choices; i++) {
		choice *c = &g->ch[i];
		if (!c->q)
			continue;
		if (!c->flushed)
			sched_seq_cancel(c->q);
		sched_times t = sched_seq_times(c->q);
		if (t.admitted > 0)
			metrics_observe(sv->met, MET_QUEUE, t.admitted - t.submitted);
		const char *r = c->finished ? c->finish_reason : "abort";
		metrics_reason mr = strcmp(r, "stop") == 0     ? MET_FIN_STOP
				    : strcmp(r, "length") == 0 ? MET_FIN_LENGTH
				    : strcmp(r, "error") == 0  ? MET_FIN_ERROR
							       : MET_FIN_ABORT;
		if (g->aborted)
			mr = MET_FIN_ABORT;
		metrics_finished(sv->met, mr, i == 0 ? (uint64_t)g->prompt_tokens : 0,
				 (uint64_t)c->n_tok);
		metrics_observe(sv->met, MET_GEN_TOKENS, c->n_tok);
		comp += c->n_tok;
		sched_seq_release(c->q);
	}
	if (g->n_choices) {
		metrics_observe(sv->met, MET_E2E, now - g->t_arrival);
		metrics_observe(sv->met, MET_PROMPT_TOKENS, g->prompt_tokens);
	}
	if (!g->ch) { /* refused before anything was submitted */
		keys_drop(sv->p.keys, &g->hold);
	} else if (g->hold.key_id > 0) {
		ds_err err = {0};
		int64_t id = g->hold.key_id;
		if (keys_finish(sv->p.keys, &g->hold, now, g->prompt_tokens, comp, &err))
			log_warn("serve", "key usage not recorded", "key=%lld detail=\"%s\"",
				 (long long)id, err.msg);
	}
	for (int i = 0; i < g->n_choices; i++) {
		buf_free(&g->ch[i].hold);
		buf_free(&g->ch[i].text);
		buf_free(&g->ch[i].reason);
		buf_free(&g->ch[i].scratch);
		chat_calls_free(&g->ch[i].calls);
		json_decref(g->ch[i].lp);
	}
	free(g->ch);
	req_tools_free(&g->rt);
	free(g->opening);
	buf_free(&g->out);
	opts_free(&g->o);
	free(g);
}

static void stream_done(void *ctx)
{
	gen *g = ctx;
	if (!all_flushed(g))
		g->aborted = 1;
	log_done(g->id, g->key_name, 200, 1, g, g->t_arrival);
	gen_free(g);
}

/* Parsing of tool calls for g: the format's marker ids and, when the prompt
 * ends with the opening of a call, that opening (R1 then writes no
 * reasoning: the splitter is off).  500 on failure. */
static int tools_setup(gen *g, http_resp *resp)
{
	serve *sv = g->sv;
	chat_params cp = sv->chat;
	ds_err err = {0};
	buf b;
	size_t n = 0;
	cp.tools = g->rt.tools;
	cp.n_tools = g->rt.n;
	cp.tool_choice = g->rt.choice;
	cp.tool_name = g->rt.name;
	g->tools_on = 1;
	buf_init(&b, TEXT_CAP);
	if (chat_call_opening(&cp, &b, &err)) {
		buf_free(&b);
		http_resp_error(resp, 500, "server_error", NULL, "%s", err.msg);
		return DS_EINTERNAL;
	}
	if (b.len) {
		g->opening = buf_take(&b);
		g->reasoning = 0;
	}
	buf_free(&b);
	const char *const *mk = chat_tool_markers(sv->chat.tool_format, &n);
	for (size_t i = 0; i < n && g->n_marker_ids < (int)(sizeof g->marker_ids / sizeof *g->marker_ids); i++) {
		int32_t id = tok_find_token(sv->tk, mk[i], strlen(mk[i]));
		if (id >= 0)
			g->marker_ids[g->n_marker_ids++] = id;
	}
	return DS_OK;
}

/* Context check (C14): both numbers in the message and in the error object. */
static int check_context(serve *sv, const prompt *pr, gen_opts *o, http_resp *resp)
{
	int64_t np = (int64_t)pr->n, L = sv->max_ctx;
	int64_t want = o->max_tokens < 0 ? 0 : o->max_tokens;
	if (np < L && np + want <= L)
		return DS_OK;
	char msg[512];
	if (np >= L)
		snprintf(msg, sizeof msg,
			 "This model's maximum context length is %lld tokens. However, your request "
			 "has %lld input tokens. Please reduce the length of the input.",
			 (long long)L, (long long)np);
	else
		snprintf(msg, sizeof msg,
			 "This model's maximum context length is %lld tokens. However, you requested "
			 "%lld tokens (%lld in the messages, %lld in the completion). Please reduce "
			 "the length of the messages or completion.",
			 (long long)L, (long long)(np + want), (long long)np, (long long)want);
	json_t *e = json_pack("{s:{s:s,s:s,s:s,s:s,s:I,s:I}}", "error", "message", msg, "type",
			      "invalid_request_error", "param",
			      np >= L ? (o->chat ? "messages" : "prompt") : "max_tokens", "code",
			      "context_length_exceeded", "n_prompt_tokens", (json_int_t)np, "n_ctx",
			      (json_int_t)L);
	http_resp_json(resp, 400, e ? jsonx_dumps(e) : NULL);
	json_decref(e);
	return DS_EINVAL;
}

/* How many prompts a /v1/completions body holds, read from its shape alone
 * (no tokenizing) for admission: 1 for a shape completion_prompts refuses. */
static int prompt_count(const json_t *b)
{
	json_t *p = json_object_get(b, "prompt");
	if (!json_is_array(p) || json_array_size(p) == 0 || json_is_integer(json_array_get(p, 0)))
		return 1;
	return json_array_size(p) > MAX_PROMPTS ? MAX_PROMPTS : (int)json_array_size(p);
}

/* The most tokens the request may use, reserved against tpm: each prompt
 * once, and max_tokens (chat without it: the rest of the context) for each of
 * its n sequences, as usage will count them. */
static int64_t most_tokens(const serve *sv, const gen *g, const prompt *prs, int n_prs)
{
	int64_t most = 0;
	for (int i = 0; i < n_prs; i++)
		most += (int64_t)prs[i].n + (int64_t)g->o.n * (g->o.max_tokens > 0
								? g->o.max_tokens
								: sv->max_ctx - (int64_t)prs[i].n);
	return most;
}

static void handle(serve *sv, const http_req *req, http_resp *resp, int chat)
{
	double t0 = ds_now_s();
	int64_t key_id = -1;
	json_t *body = NULL;
	gen *g = NULL;
	prompt prs[MAX_PROMPTS] = {{0}};
	int n_prs = 0;
	char rid[160], id[160], key_name[STORE_NAME_MAX + 1] = "-";

	serve_request_id(req, resp, chat ? "chatcmpl-" : "cmpl-", rid, sizeof rid);
	snprintf(id, sizeof id, "%s%s",
		 strncmp(rid, chat ? "chatcmpl-" : "cmpl-", chat ? 9 : 5) == 0 ? ""
										: (chat ? "chatcmpl-" : "cmpl-"),
		 rid);
	if (serve_check_ready(sv, resp) ||
	    serve_auth_named(sv, req, resp, &key_id, key_name, sizeof key_name))
		goto out;
	if (!(body = serve_parse_body(sv, req, resp)))
		goto out;
	const char *model_name = serve_model_name(sv, body, resp);
	if (!model_name)
		goto out;
	if (!(g = calloc(1, sizeof *g))) {
		http_resp_error(resp, 500, "server_error", NULL, "out of memory");
		goto out;
	}
	g->sv = sv;
	g->conn = req->conn;
	g->t_arrival = t0;
	g->model = model_name;
	g->created = (json_int_t)time(NULL);
	snprintf(g->key_name, sizeof g->key_name, "%s", key_name);
	buf_init(&g->out, 0);
	snprintf(g->id, sizeof g->id, "%s", id);
	if (parse_opts(sv, body, chat, &g->o, resp))
		goto bad_request;
	/* the cheap limits, before any prompt is tokenized */
	if (serve_admit(sv, key_id, (int64_t)(chat ? 1 : prompt_count(body)) * g->o.n, 1,
			g->o.n > 1 ? "n" : (chat ? "messages" : "prompt"), &g->hold, resp))
		goto out;
	if (chat) {
		if (chat_prompt(sv, body, &prs[0], &g->rt, resp))
			goto bad_request;
		n_prs = 1;
		g->reasoning = sv->chat.tmpl == CHAT_TMPL_DEEPSEEK_R1;
		if (g->rt.parse && tools_setup(g, resp))
			goto out;
	} else if (completion_prompts(sv, body, prs, &n_prs, resp)) {
		goto bad_request;
	}
	if (!chat && g->o.max_tokens < 0)
		g->o.max_tokens = 16; /* OpenAI's default for completions */
	for (int i = 0; i < n_prs; i++) {
		if (check_context(sv, &prs[i], &g->o, resp))
			goto bad_request;
		g->prompt_tokens += (int32_t)prs[i].n;
	}
	if (serve_reserve(sv, &g->hold, most_tokens(sv, g, prs, n_prs), "max_tokens", resp))
		goto out;
	g->n_prompts = n_prs;
	g->n_choices = n_prs * g->o.n;
	if (!(g->ch = calloc((size_t)g->n_choices, sizeof *g->ch))) {
		http_resp_error(resp, 500, "server_error", NULL, "out of memory");
		goto out;
	}
	for (int p = 0; p < n_prs; p++) {
		for (int j = 0; j < g->o.n; j++) {
			int k = p * g->o.n + j;
			choice *c = &g->ch[k];
			c->index = k;
			c->prompt_i = p;
			tok_stream_init(&c->ts, sv->tk, g->o.skip_special ? TOK_SKIP_SPECIAL : 0);
			buf_init(&c->hold, TEXT_CAP);
			buf_init(&c->text, TEXT_CAP);
			buf_init(&c->reason, TEXT_CAP);
			buf_init(&c->scratch, TEXT_CAP);
			chat_reasoning_init(&c->rs);
			chat_calls_init(&c->calls, g->tools_on ? sv->chat.tool_format : CHAT_TOOLS_NONE,
					g->rt.tools, g->rt.n, TEXT_CAP);
			if (g->opening) { /* as if the model had written it */
				ds_err err = {0};
				chat_calls_feed(&c->calls, g->opening, strlen(g->opening), &c->text, &err);
			}
			c->lp = new_lp(chat);
			sched_req r = {0};
			r.prompt = prs[p].ids;
			r.n_prompt = (int32_t)prs[p].n;
			r.sampling = g->o.smp;
			if (g->o.smp.has_seed)
				r.sampling.seed = g->o.smp.seed + (uint64_t)k;
			r.max_tokens = (int32_t)(g->o.max_tokens > 0
							 ? g->o.max_tokens
							 : sv->max_ctx - (int64_t)prs[p].n);
			r.ignore_eos = g->o.ignore_eos;
			r.eos_ids = sv->eot;
			r.n_eos_ids = sv->n_eot;
			r.stop_ids = g->o.stop_ids;
			r.n_stop_ids = g->o.n_stop_ids;
			r.logprobs = g->o.logprobs;
			r.top_logprobs = g->o.top_logprobs;
			ds_err err = {0};
			if (!(c->q = sched_submit(sv->sc, &r, &err))) {
				cancel_all(g);
				if (err.code == DS_EBUSY) {
					metrics_rejected(sv->met, MET_REJ_QUEUE_FULL);
					http_resp_error(resp, 503, "service_unavailable_error",
							"server_overloaded",
							"the server is overloaded: %s; retry later",
							err.msg);
					http_resp_header(resp, "Retry-After", "1");
				} else if (err.code == DS_EINVAL) {
					http_resp_error(resp, 400, "invalid_request_error", NULL, "%s",
							err.msg);
				} else {
					http_resp_error(resp, 500, "server_error", NULL, "%s", err.msg);
				}
				/* gen_free releases the submitted ones (q set) and frees
				 * every choice's buffers (calloc'd, so unset ones are empty) */
				g->aborted = 1;
				goto out;
			}
		}
	}
	log_info("serve", "request", "id=%s kind=%s prompt_tokens=%d n=%d stream=%d key=%lld",
		 g->id, chat ? "chat" : "completion", g->prompt_tokens, g->o.n, g->o.stream,
		 (long long)key_id);
	if (g->o.stream) {
		resp->status = 200;
		resp->content_type = "text/event-stream";
		http_resp_header(resp, "Cache-Control", "no-cache");
		resp->stream = stream_read;
		resp->stream_done = stream_done;
		resp->stream_ctx = g;
		g = NULL; /* owned by the stream now */
		goto out;
	}
	while (!all_flushed(g)) {
		pull_round(g);
		ds_err revoked = {0};
		if (meter(g, &revoked)) {
			g->aborted = 1;
			cancel_all(g);
			http_resp_error(resp, 401, "authentication_error", "api_key_revoked", "%s",
					revoked.msg);
			goto out;
		}
		if (http_conn_gone(req->conn)) {
			g->aborted = 1;
			cancel_all(g);
			resp->status = 499; /* nobody reads it; MHD drops the connection */
			goto out;
		}
		if (atomic_load(&sv->stopping) && !all_flushed(g)) {
			const char *code, *msg;
			g->aborted = 1;
			cancel_all(g);
			serve_stop_error(sv, &code, &msg);
			http_resp_error(resp, 503, "service_unavailable_error", code, "%s", msg);
			goto out;
		}
	}
	const char *e = first_error(g);
	if (e)
		http_resp_error(resp, 500, "server_error", "engine_error", "%s", e);
	else {
		json_t *v = whole_response(g);
		http_resp_json(resp, 200, v ? jsonx_dumps(v) : NULL);
		json_decref(v);
	}
	goto out;
bad_request:
	metrics_rejected(sv->met, MET_REJ_BAD_REQUEST);
out:
	if (!resp->stream) /* a stream logs when it ends (stream_done) */
		log_done(id, key_name, resp->status, g ? g->o.stream : 0, g, t0);
	gen_free(g);
	for (int i = 0; i < n_prs; i++)
		free(prs[i].ids);
	json_decref(body);
}

void oai_chat(void *ud, const http_req *req, http_resp *resp)
{
	handle(ud, req, resp, 1);
}

void oai_completions(void *ud, const http_req *req, http_resp *resp)
{
	handle(ud, req, resp, 0);
}

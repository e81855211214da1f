/*
 * chat.c - prompt rendering (DeepSeek-V3 / R1, ChatML, SmolLM2, Llama 3) with
 * tools, the tool-call parser and the R1 reasoning splitter (see chat.h).
 *
 * Callers: the agent's OpenAI chat endpoint and /tokenize (chat_render_ids;
 * parse streamed output with chat_calls and, R1, chat_reasoning), dsrun,
 * tests.  Calls common/buf, jansson (tool arguments) and tok.h (marker ids,
 * chat_params_for_tok).  No global state: thread-safe; a chat_calls or
 * chat_reasoning belongs to one request.
 *
 * DeepSeek rendering is written from the spec's description (§6.3), not from
 * template source; ChatML / SmolLM2 / Llama 3 from what their public
 * templates render (checked against jinja2 by
 * tests/integration/test_gguf_tokenizer.py).  State while walking DeepSeek
 * messages: `in_tool` (a run of tool messages is open: the next assistant turn
 * opens with <｜tool▁outputs▁end｜>, any other turn or the end closes it first).
 *
 * Rendering invariants: every marker of a template is written with mark(),
 * everything else (message contents, tool names, descriptions, parameters,
 * arguments, and the template's own plain text) with put(); chat_render_ids
 * turns only marked spans into added tokens, so content can never produce
 * one.
 *
 * Parser invariants: every byte fed is, in order, released as content, part
 * of a call that was accepted whole, or in `hold`; in TEXT `hold` is at most
 * a proper prefix of the opening marker; a call is added to `calls` only
 * whole and valid, and is never removed (Llama 3's all-or-nothing parse
 * removes only what it added in the same step).
 *
 * Splitter invariants: `hold` is always a proper prefix of the marker the
 * state looks for (START: whitespace then a prefix of "<think>"; THINK: a
 * prefix of "</think>"); every byte fed is either emitted, dropped as part of
 * a marker, or in `hold`, in order.
 */
#include "engine/chat.h"
#include "engine/tok.h"
#include "engine/unicode.h"
#include "common/jsonx.h"

#include <stdlib.h>
#include <string.h>

#define M_BOS "<｜begin▁of▁sentence｜>"
#define M_EOS "<｜end▁of▁sentence｜>"
#define M_USER "<｜User｜>"
#define M_ASSISTANT "<｜Assistant｜>"
#define M_CALLS_BEGIN "<｜tool▁calls▁begin｜>"
#define M_CALLS_END "<｜tool▁calls▁end｜>"
#define M_CALL_BEGIN "<｜tool▁call▁begin｜>"
#define M_CALL_END "<｜tool▁call▁end｜>"
#define M_OUTPUTS_BEGIN "<｜tool▁outputs▁begin｜>"
#define M_OUTPUTS_END "<｜tool▁outputs▁end｜>"
#define M_OUTPUT_BEGIN "<｜tool▁output▁begin｜>"
#define M_OUTPUT_END "<｜tool▁output▁end｜>"
#define M_SEP "<｜tool▁sep｜>"
#define THINK_OPEN "<think>"
#define THINK_CLOSE "</think>"

#define IM_START "<|im_start|>"
#define IM_END "<|im_end|>"
#define L3_BOS "<|begin_of_text|>"
#define L3_START "<|start_header_id|>"
#define L3_END "<|end_header_id|>"
#define L3_EOT "<|eot_id|>"
#define L31_MARK "Cutting Knowledge Date"
#define L3_IPYTHON "ipython"
#define L3_PYTHON_TAG "<|python_tag|>"
#define H_CALL "<tool_call>"
#define H_CALL_END "</tool_call>"
#define H_RESP "<tool_response>"
#define H_RESP_END "</tool_response>"

static const char *const role_names[] = { "system", "user", "assistant", "tool" };

int chat_role_parse(const char *s, chat_role *out, ds_err *err)
{
	for (size_t i = 0; s && i < sizeof role_names / sizeof role_names[0]; i++) {
		if (strcmp(s, role_names[i]) == 0) {
			*out = (chat_role)i;
			return 0;
		}
	}
	return ds_err_set(err, DS_EINVAL, "role '%s' is not one of system, user, assistant, tool",
			  s ? s : "(null)");
}

chat_template chat_template_detect(const char *jinja)
{
	if (!jinja)
		return CHAT_TMPL_UNKNOWN;
	if (strstr(jinja, M_USER) && strstr(jinja, M_ASSISTANT))
		return strstr(jinja, THINK_CLOSE) || strstr(jinja, THINK_OPEN) ? CHAT_TMPL_DEEPSEEK_R1
									      : CHAT_TMPL_DEEPSEEK_V3;
	if (strstr(jinja, L3_START) && strstr(jinja, L3_END) && strstr(jinja, L3_EOT))
		return strstr(jinja, L31_MARK) ? CHAT_TMPL_UNKNOWN : CHAT_TMPL_LLAMA3;
	if (strstr(jinja, IM_START) && strstr(jinja, IM_END))
		return strstr(jinja, CHAT_SMOLLM2_SYSTEM) ? CHAT_TMPL_SMOLLM2 : CHAT_TMPL_CHATML;
	return CHAT_TMPL_UNKNOWN;
}

const char *chat_template_name(chat_template t)
{
	switch (t) {
	case CHAT_TMPL_DEEPSEEK_V3: return "deepseek-v3";
	case CHAT_TMPL_DEEPSEEK_R1: return "deepseek-r1";
	case CHAT_TMPL_CHATML: return "chatml";
	case CHAT_TMPL_SMOLLM2: return "smollm2";
	case CHAT_TMPL_LLAMA3: return "llama3";
	case CHAT_TMPL_UNKNOWN:
	case CHAT_TMPL_COUNT: break;
	}
	return "unknown";
}

#define KNOWN_NAMES "deepseek-v3, deepseek-r1, chatml, smollm2, llama3"

int chat_template_choose(const char *override_name, const char *jinja, chat_template *out,
			 ds_err *err)
{
	if (override_name && *override_name) {
		for (int t = CHAT_TMPL_UNKNOWN + 1; t < CHAT_TMPL_COUNT; t++) {
			if (strcmp(override_name, chat_template_name((chat_template)t)) == 0) {
				*out = (chat_template)t;
				return 0;
			}
		}
		return ds_err_set(err, DS_EINVAL, "chat template '%s' is not known (" KNOWN_NAMES ")",
				  override_name);
	}
	*out = chat_template_detect(jinja);
	if (*out != CHAT_TMPL_UNKNOWN)
		return 0;
	if (!jinja)
		return ds_err_set(err, DS_ENOTFOUND,
				  "the tokenizer has no chat template; pass an override (" KNOWN_NAMES ")");
	if (strstr(jinja, L3_START) && strstr(jinja, L31_MARK))
		return ds_err_set(err, DS_ENOTFOUND,
				  "the chat template is a Llama 3.1+ one (dated system block, tools), "
				  "which is not rendered here; pass the override 'llama3' for the Llama 3 "
				  "format");
	return ds_err_set(err, DS_ENOTFOUND,
			  "unknown chat template (not DeepSeek-V3, ChatML or Llama 3); pass an override ("
			  KNOWN_NAMES ")");
}

chat_tool_format chat_tool_format_detect(chat_template t, const char *jinja)
{
	switch (t) {
	case CHAT_TMPL_DEEPSEEK_V3:
	case CHAT_TMPL_DEEPSEEK_R1:
		return CHAT_TOOLS_DEEPSEEK;
	case CHAT_TMPL_CHATML:
	case CHAT_TMPL_SMOLLM2:
		return jinja && strstr(jinja, "tools") && strstr(jinja, H_CALL) ? CHAT_TOOLS_HERMES
										 : CHAT_TOOLS_NONE;
	case CHAT_TMPL_LLAMA3:
		return jinja && strstr(jinja, "tools") && strstr(jinja, L3_IPYTHON) ? CHAT_TOOLS_LLAMA3
										     : CHAT_TOOLS_NONE;
	case CHAT_TMPL_UNKNOWN:
	case CHAT_TMPL_COUNT:
		break;
	}
	return CHAT_TOOLS_NONE;
}

const char *chat_tool_format_name(chat_tool_format f)
{
	switch (f) {
	case CHAT_TOOLS_DEEPSEEK: return "deepseek";
	case CHAT_TOOLS_HERMES: return "hermes";
	case CHAT_TOOLS_LLAMA3: return "llama3-json";
	case CHAT_TOOLS_NONE: break;
	}
	return "none";
}

void chat_default_params(chat_params *p)
{
	memset(p, 0, sizeof *p);
	p->tmpl = CHAT_TMPL_DEEPSEEK_V3;
	p->add_generation_prompt = 1;
	p->tool_format = CHAT_TOOLS_DEEPSEEK;
}

int chat_params_for_tok(const tok *t, const char *override_name, chat_params *p, ds_err *err)
{
	chat_default_params(p);
	int rc = chat_template_choose(override_name, tok_chat_template(t), &p->tmpl, err);
	if (rc)
		return rc;
	p->tool_format = chat_tool_format_detect(p->tmpl, tok_chat_template(t));
	int32_t bos = tok_bos_id(t);
	if (bos >= 0)
		p->bos = tok_token_text(t, bos, NULL);
	return 0;
}

/* ---- rendering ------------------------------------------------------------------ */

struct span {
	size_t off, len;
};

/* The text being rendered and, for chat_render_ids, where the template's own
 * markers are in it. */
struct out {
	buf *b;
	int rc;
	int record;
	struct span *sp;
	size_t nsp, asp;
};

static void put(struct out *o, const char *s)
{
	if (!o->rc && s)
		o->rc = buf_puts(o->b, s);
}

static void putn(struct out *o, const char *s, size_t n)
{
	if (!o->rc && n)
		o->rc = buf_append(o->b, s, n);
}

/* A marker of the template: may become a control token. */
static void mark(struct out *o, const char *s)
{
	size_t off = o->b->len;
	put(o, s);
	if (o->rc || !o->record || o->b->len == off)
		return;
	if (o->nsp == o->asp) {
		size_t na = o->asp ? o->asp * 2 : 32;
		struct span *sp = realloc(o->sp, na * sizeof *sp);
		if (!sp) {
			o->rc = DS_ENOMEM;
			return;
		}
		o->sp = sp;
		o->asp = na;
	}
	o->sp[o->nsp++] = (struct span){ off, o->b->len - off };
}

/* Template prose s, whose occurrences of the markers mk[0..n) are marked. */
static void put_prose(struct out *o, const char *s, const char *const *mk, size_t n)
{
	while (*s) {
		const char *first = NULL;
		size_t k_first = 0;
		for (size_t k = 0; k < n; k++) {
			const char *q = strstr(s, mk[k]);
			if (q && (!first || q < first)) {
				first = q;
				k_first = k;
			}
		}
		if (!first) {
			put(o, s);
			return;
		}
		putn(o, s, (size_t)(first - s));
		mark(o, mk[k_first]);
		s = first + strlen(mk[k_first]);
	}
}

/* s as a JSON string (Python's json.dumps with ensure_ascii=False). */
static void put_json_str(struct out *o, const char *s)
{
	static const char hex[] = "0123456789abcdef";
	size_t start = 0, i;
	put(o, "\"");
	for (i = 0; s[i]; i++) {
		unsigned char c = (unsigned char)s[i];
		char esc[7] = { 0 };
		switch (c) {
		case '"': memcpy(esc, "\\\"", 2); break;
		case '\\': memcpy(esc, "\\\\", 2); break;
		case '\n': memcpy(esc, "\\n", 2); break;
		case '\r': memcpy(esc, "\\r", 2); break;
		case '\t': memcpy(esc, "\\t", 2); break;
		case '\b': memcpy(esc, "\\b", 2); break;
		case '\f': memcpy(esc, "\\f", 2); break;
		default:
			if (c < 0x20) {
				memcpy(esc, "\\u00", 4);
				esc[4] = hex[c >> 4];
				esc[5] = hex[c & 15];
			}
		}
		if (esc[0]) {
			putn(o, s + start, i - start);
			put(o, esc);
			start = i + 1;
		}
	}
	putn(o, s + start, i - start);
	put(o, "\"");
}

/* {"type":"function","function":{"name":..,"description":..,"parameters":..}} */
static void put_tool_json(struct out *o, const chat_tool *t)
{
	put(o, "{\"type\":\"function\",\"function\":{\"name\":");
	put_json_str(o, t->name);
	if (t->description) {
		put(o, ",\"description\":");
		put_json_str(o, t->description);
	}
	if (t->parameters) {
		put(o, ",\"parameters\":");
		put(o, t->parameters);
	}
	put(o, "}}");
}

/* p's tool format when it goes with its template (DeepSeek markers only with
 * the DeepSeek templates, the others only with the header templates), else
 * none. */
static chat_tool_format tool_format(const chat_params *p)
{
	int deepseek = p->tmpl == CHAT_TMPL_DEEPSEEK_V3 || p->tmpl == CHAT_TMPL_DEEPSEEK_R1;
	if (deepseek != (p->tool_format == CHAT_TOOLS_DEEPSEEK))
		return CHAT_TOOLS_NONE;
	return p->tool_format;
}

static int tools_shown(const chat_params *p)
{
	return p->n_tools > 0 && p->tool_choice != CHAT_CHOICE_NONE;
}

/* The generation prompt ends with the opening of a call. */
static int call_forced(const chat_params *p)
{
	return tools_shown(p) && p->add_generation_prompt &&
	       (p->tool_choice == CHAT_CHOICE_REQUIRED || p->tool_choice == CHAT_CHOICE_NAMED);
}

/* R1 history: only the text after the last "</think>". */
static const char *after_last_think(const char *s)
{
	const char *p = s, *last = NULL;
	while ((p = strstr(p, THINK_CLOSE)) != NULL) {
		last = p;
		p += strlen(THINK_CLOSE);
	}
	return last ? last + strlen(THINK_CLOSE) : s;
}

/* Python's str.isspace code points (what jinja's `trim` strips). */
static int py_space(uint32_t c)
{
	return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
	       c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
	       c == 0x202F || c == 0x205F || c == 0x3000;
}

/* The well-formed UTF-8 character at s[0..n): its code point and length, or 0. */
static size_t utf8_at(const unsigned char *s, size_t n, uint32_t *cp)
{
	size_t len = 0;
	if (utf8_check(s, n, &len) != UTF8_OK)
		return 0;
	utf8_decode(s, len, cp);
	return len;
}

/* s trimmed like Python's str.strip(): *start and *len of what is left. */
static void py_strip(const char *s, size_t *start, size_t *len)
{
	const unsigned char *u = (const unsigned char *)s;
	size_t a = 0, z = strlen(s);
	uint32_t cp;
	size_t k;
	while (a < z && (k = utf8_at(u + a, z - a, &cp)) && py_space(cp))
		a += k;
	while (z > a) {
		/* the last character: step back over continuation bytes (at most 3) */
		size_t b = z - 1;
		while (b > a && z - b < 4 && (u[b] & 0xC0) == 0x80)
			b--;
		if ((k = utf8_at(u + b, z - b, &cp)) != z - b || !py_space(cp))
			break;
		z = b;
	}
	*start = a;
	*len = z - a;
}

/* ---- ChatML, SmolLM2 and Llama 3: one header + content + end marker per message */

static void head_open(const chat_params *p, struct out *o, const char *role)
{
	if (p->tmpl == CHAT_TMPL_LLAMA3) {
		mark(o, L3_START);
		put(o, role);
		mark(o, L3_END);
		put(o, "\n\n");
	} else {
		mark(o, IM_START);
		put(o, role);
		put(o, "\n");
	}
}

static void head_close(const chat_params *p, struct out *o)
{
	if (p->tmpl == CHAT_TMPL_LLAMA3) {
		mark(o, L3_EOT);
	} else {
		mark(o, IM_END);
		put(o, "\n");
	}
}

/* A content as the template writes it: Llama 3 trims it. */
static void put_content(const chat_params *p, struct out *o, const char *content)
{
	content = content ? content : "";
	if (p->tmpl == CHAT_TMPL_LLAMA3) {
		size_t a, len;
		py_strip(content, &a, &len);
		putn(o, content + a, len);
	} else {
		put(o, content);
	}
}

/* The system turn that carries the tool list (Hermes, Llama 3 JSON). */
static void tools_turn(const chat_params *p, const chat_msg *sys, struct out *o)
{
	static const char *const hermes_mk[] = { H_CALL, H_CALL_END };
	head_open(p, o, "system");
	size_t body = o->b->len;
	if (sys)
		put_content(p, o, sys->content);
	else if (p->tmpl == CHAT_TMPL_SMOLLM2)
		put(o, CHAT_SMOLLM2_SYSTEM);
	if (o->b->len > body)
		put(o, "\n\n");
	if (tool_format(p) == CHAT_TOOLS_HERMES) {
		put(o, CHAT_HERMES_TOOLS_HEAD);
		for (size_t k = 0; k < p->n_tools; k++) {
			put_tool_json(o, &p->tools[k]);
			put(o, "\n");
		}
		put_prose(o, CHAT_HERMES_TOOLS_TAIL, hermes_mk, 2);
	} else {
		put(o, CHAT_LLAMA3_TOOLS_HEAD);
		for (size_t k = 0; k < p->n_tools; k++) {
			if (k)
				put(o, "\n");
			put_tool_json(o, &p->tools[k]);
		}
	}
	head_close(p, o);
}

static void hermes_calls(const chat_msg *m, struct out *o)
{
	int any = m->content && *m->content;
	for (size_t k = 0; k < m->n_tool_calls; k++) {
		const chat_tool_call *c = &m->tool_calls[k];
		if (k || any)
			put(o, "\n");
		mark(o, H_CALL);
		put(o, "\n{\"name\": ");
		put_json_str(o, c->name);
		put(o, ", \"arguments\": ");
		put(o, c->arguments);
		put(o, "}\n");
		mark(o, H_CALL_END);
	}
}

static void llama3_history_calls(const chat_msg *m, struct out *o)
{
	for (size_t k = 0; k < m->n_tool_calls; k++) {
		const chat_tool_call *c = &m->tool_calls[k];
		if (k)
			put(o, "; ");
		put(o, "{\"name\": ");
		put_json_str(o, c->name);
		put(o, ", \"parameters\": ");
		put(o, c->arguments);
		put(o, "}");
	}
}

/* What follows the assistant header when a call is forced. */
static void headers_call_opening(const chat_params *p, struct out *o)
{
	int named = p->tool_choice == CHAT_CHOICE_NAMED;
	if (tool_format(p) == CHAT_TOOLS_HERMES) {
		mark(o, H_CALL);
		put(o, "\n");
		if (named) {
			put(o, "{\"name\": ");
			put_json_str(o, p->tool_name);
			put(o, ", \"arguments\": ");
		}
	} else if (named) {
		put(o, "{\"name\": ");
		put_json_str(o, p->tool_name);
		put(o, ", \"parameters\": ");
	} else {
		put(o, "{\"name\": \"");
	}
}

static void render_headers(const chat_params *p, const chat_msg *msgs, size_t n, struct out *o)
{
	int llama3 = p->tmpl == CHAT_TMPL_LLAMA3;
	chat_tool_format fmt = tool_format(p);
	size_t i0 = 0;
	if (llama3 && (n > 0 || tools_shown(p)))
		mark(o, p->bos ? p->bos : L3_BOS);
	if (tools_shown(p)) {
		const chat_msg *sys = n > 0 && msgs[0].role == CHAT_ROLE_SYSTEM ? &msgs[0] : NULL;
		tools_turn(p, sys, o);
		i0 = sys ? 1 : 0;
	} else if (p->tmpl == CHAT_TMPL_SMOLLM2 && n > 0 && msgs[0].role != CHAT_ROLE_SYSTEM) {
		mark(o, IM_START);
		put(o, "system\n" CHAT_SMOLLM2_SYSTEM);
		mark(o, IM_END);
		put(o, "\n");
	}
	for (size_t i = i0; i < n; i++) {
		const chat_msg *m = &msgs[i];
		if (m->role == CHAT_ROLE_TOOL && fmt == CHAT_TOOLS_HERMES) {
			/* a run of tool results is one user turn */
			if (i == i0 || msgs[i - 1].role != CHAT_ROLE_TOOL) {
				mark(o, IM_START);
				put(o, "user");
			}
			put(o, "\n");
			mark(o, H_RESP);
			put(o, "\n");
			put(o, m->content);
			put(o, "\n");
			mark(o, H_RESP_END);
			if (i + 1 == n || msgs[i + 1].role != CHAT_ROLE_TOOL) {
				mark(o, IM_END);
				put(o, "\n");
			}
			continue;
		}
		if (m->role == CHAT_ROLE_TOOL && fmt == CHAT_TOOLS_LLAMA3) {
			head_open(p, o, L3_IPYTHON);
			put(o, m->content); /* not trimmed (the Llama 3.1 templates do not) */
			head_close(p, o);
			continue;
		}
		head_open(p, o, role_names[m->role]);
		if (m->n_tool_calls && fmt == CHAT_TOOLS_LLAMA3) {
			size_t before = o->b->len;
			put_content(p, o, m->content);
			if (o->b->len > before)
				put(o, "\n\n");
			llama3_history_calls(m, o);
		} else {
			put_content(p, o, m->content);
			if (m->n_tool_calls)
				hermes_calls(m, o);
		}
		head_close(p, o);
	}
	if (!p->add_generation_prompt)
		return;
	head_open(p, o, "assistant");
	if (call_forced(p))
		headers_call_opening(p, o);
}

/* ---- DeepSeek V3 / R1 ----------------------------------------------------------- */

static const char *const ds_markers[] = { M_CALLS_BEGIN, M_CALLS_END, M_CALL_BEGIN, M_CALL_END, M_SEP };

static void deepseek_tools(const chat_params *p, struct out *o)
{
	put(o, "## Tools\n\nYou can call these functions:\n");
	for (size_t k = 0; k < p->n_tools; k++) {
		const chat_tool *t = &p->tools[k];
		put(o, "\n### ");
		put(o, t->name);
		put(o, "\n");
		if (t->description) {
			put(o, "Description: ");
			put(o, t->description);
			put(o, "\n");
		}
		put(o, "Parameters: ");
		put(o, t->parameters ? t->parameters : "{}");
		put(o, "\n");
	}
	put_prose(o, CHAT_DEEPSEEK_TOOLS_HOWTO, ds_markers, sizeof ds_markers / sizeof *ds_markers);
}

static void deepseek_call_opening(const chat_params *p, struct out *o)
{
	mark(o, M_CALLS_BEGIN);
	mark(o, M_CALL_BEGIN);
	put(o, "function");
	mark(o, M_SEP);
	if (p->tool_choice == CHAT_CHOICE_NAMED) {
		put(o, p->tool_name);
		put(o, "\n```json\n");
	}
}

static void render_deepseek(const chat_params *p, const chat_msg *msgs, size_t n, struct out *o)
{
	int in_tool = 0, r1 = p->tmpl == CHAT_TMPL_DEEPSEEK_R1, any_sys = 0;
	mark(o, p->bos ? p->bos : M_BOS);
	for (size_t i = 0; i < n; i++) {
		if (msgs[i].role != CHAT_ROLE_SYSTEM)
			continue;
		if (any_sys)
			put(o, "\n\n");
		put(o, msgs[i].content);
		any_sys = 1;
	}
	if (tools_shown(p)) {
		if (any_sys)
			put(o, "\n\n");
		deepseek_tools(p, o);
	}

	for (size_t i = 0; i < n && !o->rc; i++) {
		const chat_msg *m = &msgs[i];
		switch (m->role) {
		case CHAT_ROLE_SYSTEM:
			break;
		case CHAT_ROLE_USER:
			if (in_tool)
				mark(o, M_OUTPUTS_END);
			in_tool = 0;
			mark(o, M_USER);
			put(o, m->content);
			break;
		case CHAT_ROLE_ASSISTANT: {
			const char *content = m->content;
			if (content && r1)
				content = after_last_think(content);
			mark(o, in_tool ? M_OUTPUTS_END : M_ASSISTANT);
			in_tool = 0;
			put(o, content);
			if (m->n_tool_calls) {
				mark(o, M_CALLS_BEGIN);
				for (size_t k = 0; k < m->n_tool_calls; k++) {
					const chat_tool_call *c = &m->tool_calls[k];
					if (k)
						put(o, "\n");
					mark(o, M_CALL_BEGIN);
					put(o, c->type ? c->type : "function");
					mark(o, M_SEP);
					put(o, c->name);
					put(o, "\n```json\n");
					put(o, c->arguments);
					put(o, "\n```");
					mark(o, M_CALL_END);
				}
				mark(o, M_CALLS_END);
			}
			mark(o, M_EOS);
			break;
		}
		case CHAT_ROLE_TOOL:
			if (in_tool) {
				put(o, "\n");
			} else {
				mark(o, M_OUTPUTS_BEGIN);
			}
			mark(o, M_OUTPUT_BEGIN);
			put(o, m->content);
			mark(o, M_OUTPUT_END);
			in_tool = 1;
			break;
		}
	}
	if (in_tool) {
		/* the model answers right after the outputs, without <｜Assistant｜> */
		mark(o, M_OUTPUTS_END);
		if (call_forced(p))
			deepseek_call_opening(p, o);
	} else if (p->add_generation_prompt) {
		mark(o, M_ASSISTANT);
		if (call_forced(p)) {
			deepseek_call_opening(p, o); /* R1 too: a forced call skips the reasoning */
		} else if (r1) {
			mark(o, THINK_OPEN);
			put(o, "\n");
		}
	}
}

/* Checks, then renders into o; o->rc is left for the caller. */
static int render(const chat_params *p, const chat_msg *msgs, size_t n, struct out *o, ds_err *err)
{
	int headers = p->tmpl == CHAT_TMPL_CHATML || p->tmpl == CHAT_TMPL_SMOLLM2 ||
		      p->tmpl == CHAT_TMPL_LLAMA3;
	int deepseek = p->tmpl == CHAT_TMPL_DEEPSEEK_V3 || p->tmpl == CHAT_TMPL_DEEPSEEK_R1;

	if (!deepseek && !headers)
		return ds_err_set(err, DS_EINVAL, "chat template %d is not known", (int)p->tmpl);
	if (tools_shown(p) && tool_format(p) == CHAT_TOOLS_NONE)
		return ds_err_set(err, DS_EUNSUPPORTED, "the %s chat template of this model has no "
				  "tool-call format", chat_template_name(p->tmpl));
	for (size_t k = 0; k < p->n_tools; k++)
		if (!p->tools[k].name || !*p->tools[k].name)
			return ds_err_set(err, DS_EINVAL, "tool %zu has no name", k);
	if (tools_shown(p) && p->tool_choice == CHAT_CHOICE_NAMED) {
		size_t k = 0;
		while (p->tool_name && k < p->n_tools && strcmp(p->tools[k].name, p->tool_name) != 0)
			k++;
		if (!p->tool_name || k == p->n_tools)
			return ds_err_set(err, DS_EINVAL, "the named tool '%s' is not one of the tools",
					  p->tool_name ? p->tool_name : "(null)");
	}
	for (size_t i = 0; i < n; i++) {
		const chat_msg *m = &msgs[i];
		if (m->role > CHAT_ROLE_TOOL)
			return ds_err_set(err, DS_EINVAL, "message %zu: role %d is not known", i, (int)m->role);
		if (m->n_tool_calls && m->role != CHAT_ROLE_ASSISTANT)
			return ds_err_set(err, DS_EINVAL, "message %zu: only assistant turns carry tool calls", i);
		for (size_t k = 0; k < m->n_tool_calls; k++) {
			const chat_tool_call *c = &m->tool_calls[k];
			if (!c->name || !c->arguments)
				return ds_err_set(err, DS_EINVAL, "message %zu: tool call %zu needs a name and arguments",
						  i, k);
		}
		if (m->n_tool_calls && tool_format(p) == CHAT_TOOLS_NONE)
			return ds_err_set(err, DS_EINVAL, "message %zu: the %s template has no format for tool "
					  "calls", i, chat_template_name(p->tmpl));
	}
	if (headers)
		render_headers(p, msgs, n, o);
	else
		render_deepseek(p, msgs, n, o);
	return 0;
}

int chat_render(const chat_params *p, const chat_msg *msgs, size_t n, buf *b, ds_err *err)
{
	struct out o = { .b = b };
	size_t len0 = b->len;
	int rc = render(p, msgs, n, &o, err);
	if (rc)
		return rc;
	if (o.rc) {
		b->len = len0;
		if (b->data)
			b->data[len0] = '\0';
		return ds_err_set(err, o.rc, "rendered prompt is over %zu bytes", b->max);
	}
	return 0;
}

int chat_call_opening(const chat_params *p, buf *b, ds_err *err)
{
	struct out o = { .b = b };
	size_t len0 = b->len;
	if (!call_forced(p) || tool_format(p) == CHAT_TOOLS_NONE)
		return 0;
	if (tool_format(p) == CHAT_TOOLS_DEEPSEEK)
		deepseek_call_opening(p, &o);
	else
		headers_call_opening(p, &o);
	if (o.rc) {
		b->len = len0;
		if (b->data)
			b->data[len0] = '\0';
		return ds_err_set(err, o.rc, "the opening of the call is over %zu bytes", b->max);
	}
	return 0;
}

const char *const *chat_tool_markers(chat_tool_format f, size_t *n)
{
	static const char *const hermes[] = { H_CALL, H_CALL_END };
	static const char *const llama3[] = { L3_PYTHON_TAG };
	switch (f) {
	case CHAT_TOOLS_DEEPSEEK:
		*n = sizeof ds_markers / sizeof *ds_markers;
		return ds_markers;
	case CHAT_TOOLS_HERMES:
		*n = 2;
		return hermes;
	case CHAT_TOOLS_LLAMA3:
		*n = 1;
		return llama3;
	case CHAT_TOOLS_NONE:
		break;
	}
	*n = 0;
	return NULL;
}

/* ---- encoding ------------------------------------------------------------------- */

#define MARK_CACHE 32

struct mark_id {
	const char *s;
	size_t len;
	int32_t id;
};

/* The id of marker s[0..len) when t has it as an added token (it encodes to
 * one id with added tokens matched, and to something else without), else -1. */
static int marker_id(const tok *t, const char *s, size_t len, struct mark_id *cache, size_t *nc,
		     int32_t *id, ds_err *err)
{
	for (size_t i = 0; i < *nc; i++) {
		if (cache[i].len == len && memcmp(cache[i].s, s, len) == 0) {
			*id = cache[i].id;
			return 0;
		}
	}
	tok_ids sp, pl;
	tok_ids_init(&sp, 0);
	tok_ids_init(&pl, 0);
	int rc = tok_encode(t, s, len, TOK_PARSE_SPECIAL, &sp, err);
	if (!rc)
		rc = tok_encode(t, s, len, 0, &pl, err);
	if (!rc) {
		int same = sp.n == pl.n && memcmp(sp.v, pl.v, sp.n * sizeof *sp.v) == 0;
		*id = sp.n == 1 && !same ? sp.v[0] : -1;
		if (*nc < MARK_CACHE)
			cache[(*nc)++] = (struct mark_id){ s, len, *id };
	}
	tok_ids_free(&sp);
	tok_ids_free(&pl);
	return rc;
}

int chat_render_ids(const chat_params *p, const tok *t, const chat_msg *msgs, size_t n,
		    tok_ids *ids, buf *text, ds_err *err)
{
	buf local;
	buf *b = text;
	if (!b) {
		buf_init(&local, 0);
		b = &local;
	}
	size_t len0 = b->len, n0 = ids->n, pos = len0;
	struct out o = { .b = b, .record = 1 };
	struct mark_id cache[MARK_CACHE];
	size_t nc = 0;
	int rc = render(p, msgs, n, &o, err);
	if (!rc && o.rc)
		rc = o.rc == DS_ERANGE
			     ? ds_err_set(err, o.rc, "rendered prompt is over %zu bytes", b->max)
			     : ds_err_set(err, o.rc, "rendering the prompt: out of memory");
	for (size_t k = 0; !rc && k < o.nsp; k++) {
		const char *m = b->data + o.sp[k].off;
		int32_t id;
		if ((rc = marker_id(t, m, o.sp[k].len, cache, &nc, &id, err)) != 0 || id < 0)
			continue; /* not a token of t: plain text like the rest */
		if ((rc = tok_encode(t, b->data + pos, o.sp[k].off - pos, 0, ids, err)) == 0)
			rc = tok_encode(t, m, o.sp[k].len, TOK_PARSE_SPECIAL, ids, err);
		pos = o.sp[k].off + o.sp[k].len;
	}
	if (!rc && b->len > pos)
		rc = tok_encode(t, b->data + pos, b->len - pos, 0, ids, err);
	free(o.sp);
	if (rc) {
		ids->n = n0;
		b->len = len0;
		if (b->data)
			b->data[len0] = '\0';
	}
	if (!text)
		buf_free(&local);
	return rc;
}

/* ---- the tool-call parser ------------------------------------------------------- */

enum { CP_TEXT, CP_BLOCK, CP_AFTER, CP_CALL, CP_START, CP_JSON, CP_PLAIN };

#define CALLS_TEXT_DEFAULT ((size_t)64 << 20)
#define ARGS_MAX_DEPTH 64

void chat_calls_init(chat_calls *p, chat_tool_format fmt, const chat_tool *tools, size_t n_tools,
		     size_t max_text)
{
	memset(p, 0, sizeof *p);
	p->fmt = fmt;
	p->tools = tools;
	p->n_tools = n_tools;
	p->max_text = max_text ? max_text : CALLS_TEXT_DEFAULT;
	buf_init(&p->hold, p->max_text);
	p->state = fmt == CHAT_TOOLS_DEEPSEEK || fmt == CHAT_TOOLS_HERMES ? CP_TEXT
		   : fmt == CHAT_TOOLS_LLAMA3				    ? CP_START
									    : CP_PLAIN;
}

void chat_calls_free(chat_calls *p)
{
	if (!p)
		return;
	for (size_t i = 0; i < p->n_calls; i++) {
		free(p->calls[i].name);
		free(p->calls[i].arguments);
	}
	free(p->calls);
	p->calls = NULL;
	p->n_calls = 0;
	buf_free(&p->hold);
}

static int cp_space(char c)
{
	return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

static size_t skip_ws(const char *s, size_t i, size_t n)
{
	while (i < n && cp_space(s[i]))
		i++;
	return i;
}

static void trim(const char **s, size_t *n)
{
	while (*n && cp_space(**s)) {
		(*s)++;
		(*n)--;
	}
	while (*n && cp_space((*s)[*n - 1]))
		(*n)--;
}

static int starts(const char *s, size_t n, const char *mk)
{
	size_t l = strlen(mk);
	return n >= l && memcmp(s, mk, l) == 0;
}

/* s[0..n) is a proper prefix of mk. */
static int part_of(const char *s, size_t n, const char *mk)
{
	return n < strlen(mk) && memcmp(s, mk, n) == 0;
}

/* The longest suffix of s[0..n) that is a proper prefix of mk. */
static size_t tail_prefix(const char *s, size_t n, const char *mk)
{
	size_t l = strlen(mk), k = n < l - 1 ? n : l - 1;
	for (; k > 0; k--)
		if (memcmp(s + n - k, mk, k) == 0)
			return k;
	return 0;
}

static const char *find(const char *s, size_t n, const char *mk)
{
	return n ? memmem(s, n, mk, strlen(mk)) : NULL;
}

/* Drops hold[0..n). */
static void consume(chat_calls *p, size_t n)
{
	if (!n)
		return;
	memmove(p->hold.data, p->hold.data + n, p->hold.len - n);
	p->hold.len -= n;
	p->hold.data[p->hold.len] = '\0';
	p->pos = p->scan = 0;
}

/* hold[0..n) is content. */
static int release_held(chat_calls *p, size_t n, buf *content)
{
	int rc = n ? buf_append(content, p->hold.data, n) : 0;
	if (!rc)
		consume(p, n);
	return rc;
}

/* Something malformed: what is held and everything after is content. */
static int go_plain(chat_calls *p, buf *content)
{
	p->state = CP_PLAIN;
	return release_held(p, p->hold.len, content);
}

/* The search for marker mk from p->scan found nothing in hold[0..n):
 * resume where a marker cut at the end could start. */
static void rescan_from(chat_calls *p, size_t n, const char *mk)
{
	size_t l = strlen(mk);
	if (n >= l && n - l + 1 > p->scan)
		p->scan = n - l + 1;
}

static int known_tool(const chat_calls *p, const char *name, size_t len)
{
	for (size_t k = 0; k < p->n_tools; k++)
		if (strlen(p->tools[k].name) == len && memcmp(p->tools[k].name, name, len) == 0)
			return 1;
	return 0;
}

static int add_call(chat_calls *p, const char *name, size_t nlen, const char *args, size_t alen)
{
	if (p->n_calls >= CHAT_MAX_CALLS || p->text_bytes + nlen + alen > p->max_text)
		return DS_ERANGE;
	chat_call *c = realloc(p->calls, (p->n_calls + 1) * sizeof *c);
	if (!c)
		return DS_ENOMEM;
	p->calls = c;
	char *nm = strndup(name, nlen), *ar = strndup(args, alen);
	if (!nm || !ar) {
		free(nm);
		free(ar);
		return DS_ENOMEM;
	}
	p->calls[p->n_calls++] = (chat_call){ nm, ar };
	p->text_bytes += nlen + alen;
	return 0;
}

static void drop_calls_from(chat_calls *p, size_t n0)
{
	while (p->n_calls > n0) {
		p->n_calls--;
		p->text_bytes -= strlen(p->calls[p->n_calls].name) + strlen(p->calls[p->n_calls].arguments);
		free(p->calls[p->n_calls].name);
		free(p->calls[p->n_calls].arguments);
	}
}

/* The JSON object s[0..n) is (nothing else around it), or NULL. */
static json_t *parse_object(const char *s, size_t n)
{
	ds_err err = { 0 };
	json_t *v = jsonx_parse(s, n, ARGS_MAX_DEPTH, &err);
	if (v && !json_is_object(v)) {
		json_decref(v);
		v = NULL;
	}
	return v;
}

/* A call written as JSON: {"name": a tool, key (or alt): an object, or a
 * string holding one}. */
static int json_call(chat_calls *p, const json_t *v, const char *key, const char *alt)
{
	json_t *name = json_object_get(v, "name"), *args = json_object_get(v, key), *obj = NULL;
	if (!args && alt)
		args = json_object_get(v, alt);
	if (!json_is_string(name) || !known_tool(p, json_string_value(name), json_string_length(name)))
		return DS_EFORMAT;
	if (json_is_object(args))
		obj = json_incref(args);
	else if (json_is_string(args))
		obj = parse_object(json_string_value(args), json_string_length(args));
	if (!obj)
		return DS_EFORMAT;
	char *text = jsonx_dumps(obj);
	json_decref(obj);
	if (!text)
		return DS_ENOMEM;
	int rc = add_call(p, json_string_value(name), json_string_length(name), text, strlen(text));
	free(text);
	return rc;
}

/* The body of a DeepSeek call (between <｜tool▁call▁begin｜> and
 * <｜tool▁call▁end｜>): function<｜tool▁sep｜>NAME\n```json\nARGS\n```
 * (whitespace around the fence and the name is not counted). */
static int deepseek_call(chat_calls *p, const char *b, size_t n)
{
	const char *sep = find(b, n, M_SEP);
	if (!sep)
		return DS_EFORMAT;
	const char *type = b;
	size_t tn = (size_t)(sep - b);
	trim(&type, &tn);
	if (tn != 8 || memcmp(type, "function", 8) != 0)
		return DS_EFORMAT;
	const char *r = sep + strlen(M_SEP);
	size_t rn = n - (size_t)(r - b);
	const char *nl = memchr(r, '\n', rn);
	if (!nl)
		return DS_EFORMAT;
	const char *name = r;
	size_t nn = (size_t)(nl - r);
	trim(&name, &nn);
	if (!nn || !known_tool(p, name, nn))
		return DS_EFORMAT;
	const char *a = nl + 1;
	size_t an = rn - (size_t)(a - r);
	trim(&a, &an);
	if (starts(a, an, "```json"))
		a += 7, an -= 7;
	else if (starts(a, an, "```"))
		a += 3, an -= 3;
	else
		return DS_EFORMAT;
	if (an < 3 || memcmp(a + an - 3, "```", 3) != 0)
		return DS_EFORMAT;
	an -= 3;
	trim(&a, &an);
	json_t *v = parse_object(a, an);
	if (!v)
		return DS_EFORMAT;
	json_decref(v);
	return add_call(p, name, nn, a, an);
}

static int step_deepseek(chat_calls *p, buf *content, int final)
{
	for (;;) {
		const char *h = p->hold.data ? p->hold.data : "";
		size_t n = p->hold.len;
		if (p->state == CP_TEXT) {
			const char *m = find(h, n, M_CALLS_BEGIN);
			if (m) {
				int rc = release_held(p, (size_t)(m - h), content);
				if (rc)
					return rc;
				/* pos past the opening marker: no call of this block yet (a
				 * call accepted drops the opening with it and leaves pos 0) */
				p->state = CP_BLOCK;
				p->pos = strlen(M_CALLS_BEGIN);
				continue;
			}
			return release_held(p, n - (final ? 0 : tail_prefix(h, n, M_CALLS_BEGIN)), content);
		}
		if (p->state != CP_BLOCK)
			return release_held(p, n, content);
		size_t q = skip_ws(h, p->pos, n), rn = n - q;
		const char *r = h + q;
		if (starts(r, rn, M_CALL_BEGIN)) {
			size_t from = q + strlen(M_CALL_BEGIN);
			if (p->scan < from)
				p->scan = from;
			const char *e = find(h + p->scan, n - p->scan, M_CALL_END);
			if (!e) {
				if (final)
					return go_plain(p, content);
				rescan_from(p, n, M_CALL_END);
				return 0;
			}
			if (deepseek_call(p, h + from, (size_t)(e - (h + from))) != 0)
				return go_plain(p, content);
			consume(p, (size_t)(e - h) + strlen(M_CALL_END));
			continue;
		}
		if (starts(r, rn, M_CALLS_END)) {
			consume(p, q + strlen(M_CALLS_END));
			p->state = CP_AFTER;
			continue;
		}
		if (rn == 0 || part_of(r, rn, M_CALL_BEGIN) || part_of(r, rn, M_CALLS_END)) {
			if (!final)
				return 0;
			if (rn == 0 && p->pos == 0) { /* calls, then the end: a block left open */
				consume(p, n);
				return 0;
			}
		}
		return go_plain(p, content);
	}
}

static int hermes_call(chat_calls *p, const char *b, size_t n)
{
	trim(&b, &n);
	json_t *v = parse_object(b, n);
	if (!v)
		return DS_EFORMAT;
	int rc = json_call(p, v, "arguments", "parameters");
	json_decref(v);
	return rc;
}

static int step_hermes(chat_calls *p, buf *content, int final)
{
	for (;;) {
		const char *h = p->hold.data ? p->hold.data : "";
		size_t n = p->hold.len;
		if (p->state == CP_TEXT) {
			if (p->after_call) {
				size_t w = skip_ws(h, 0, n);
				if (w == n) {
					if (final)
						consume(p, n);
					return 0;
				}
				consume(p, w);
				p->after_call = 0;
				continue;
			}
			const char *m = find(h, n, H_CALL);
			if (m) {
				int rc = release_held(p, (size_t)(m - h), content);
				if (rc)
					return rc;
				p->state = CP_CALL;
				continue;
			}
			return release_held(p, n - (final ? 0 : tail_prefix(h, n, H_CALL)), content);
		}
		if (p->state != CP_CALL)
			return release_held(p, n, content);
		size_t from = strlen(H_CALL);
		if (p->scan < from)
			p->scan = from;
		const char *e = find(h + p->scan, n - p->scan, H_CALL_END);
		if (!e) {
			if (final)
				return go_plain(p, content);
			rescan_from(p, n, H_CALL_END);
			return 0;
		}
		if (hermes_call(p, h + from, (size_t)(e - (h + from))) != 0)
			return go_plain(p, content);
		consume(p, (size_t)(e - h) + strlen(H_CALL_END));
		p->state = CP_TEXT;
		p->after_call = 1;
	}
}

/* The whole output as Llama 3 JSON calls: [<|python_tag|>] obj (";" obj)*. */
static int llama3_calls(chat_calls *p, const char *s, size_t n)
{
	size_t i = skip_ws(s, 0, n);
	if (starts(s + i, n - i, L3_PYTHON_TAG))
		i += strlen(L3_PYTHON_TAG);
	for (;;) {
		json_error_t je;
		i = skip_ws(s, i, n);
		json_t *v = i < n ? json_loadb(s + i, n - i, JSON_DISABLE_EOF_CHECK, &je) : NULL;
		if (!v)
			return DS_EFORMAT;
		i += (size_t)je.position;
		int rc = json_is_object(v) ? json_call(p, v, "parameters", "arguments") : DS_EFORMAT;
		json_decref(v);
		if (rc)
			return rc;
		i = skip_ws(s, i, n);
		if (i == n)
			return 0;
		if (s[i] != ';')
			return DS_EFORMAT;
		i++;
	}
}

static int step_llama3(chat_calls *p, buf *content, int final)
{
	const char *h = p->hold.data ? p->hold.data : "";
	size_t n = p->hold.len;
	if (p->state == CP_START) {
		size_t w = skip_ws(h, 0, n), rn = n - w;
		const char *r = h + w;
		if (rn == 0 && !final)
			return 0;
		if (rn && (r[0] == '{' || starts(r, rn, L3_PYTHON_TAG)))
			p->state = CP_JSON;
		else if (rn && part_of(r, rn, L3_PYTHON_TAG) && !final)
			return 0;
		else
			p->state = CP_PLAIN;
	}
	if (p->state == CP_JSON) {
		if (!final)
			return 0;
		size_t n0 = p->n_calls;
		if (llama3_calls(p, h, n) == 0) {
			consume(p, n);
			return 0;
		}
		drop_calls_from(p, n0);
		p->state = CP_PLAIN;
	}
	return release_held(p, n, content);
}

static int step(chat_calls *p, buf *content, int final)
{
	switch (p->fmt) {
	case CHAT_TOOLS_DEEPSEEK: return step_deepseek(p, content, final);
	case CHAT_TOOLS_HERMES: return step_hermes(p, content, final);
	case CHAT_TOOLS_LLAMA3: return step_llama3(p, content, final);
	case CHAT_TOOLS_NONE: break;
	}
	return release_held(p, p->hold.len, content);
}

int chat_calls_feed(chat_calls *p, const char *text, size_t len, buf *content, ds_err *err)
{
	int rc;
	if (p->state == CP_PLAIN || p->state == CP_AFTER) { /* nothing is held there */
		rc = len ? buf_append(content, text, len) : 0;
	} else if (buf_append(&p->hold, text, len) != 0) {
		/* past the cap of what may be held: it is all content */
		if ((rc = go_plain(p, content)) == 0)
			rc = buf_append(content, text, len);
	} else {
		rc = step(p, content, 0);
	}
	if (rc)
		return ds_err_set(err, rc, "content is over its cap");
	return 0;
}

int chat_calls_finish(chat_calls *p, buf *content, ds_err *err)
{
	int rc = step(p, content, 1);
	if (rc)
		return ds_err_set(err, rc, "content is over its cap");
	return 0;
}

/* ---- the reasoning splitter ---------------------------------------------------- */

enum { RS_START, RS_THINK, RS_CONTENT };

void chat_reasoning_init(chat_reasoning *r)
{
	memset(r, 0, sizeof *r);
	r->state = RS_START;
}

int chat_reasoning_done(const chat_reasoning *r)
{
	return r->state == RS_CONTENT;
}

static int is_ws(char c)
{
	return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

/* THINK: feeds one byte; emits to out what can no longer start "</think>". */
static void think_byte(chat_reasoning *r, char c, struct out *o)
{
	static const char mk[] = THINK_CLOSE;
	const size_t ml = sizeof mk - 1;
	r->hold[r->nhold++] = c;
	if (memcmp(r->hold, mk, r->nhold) == 0) {
		if (r->nhold == ml) {
			r->nhold = 0;
			r->state = RS_CONTENT;
		}
		return;
	}
	/* drop the shortest head whose remainder can still begin the marker */
	size_t k = 1;
	while (k < r->nhold && memcmp(r->hold + k, mk, r->nhold - k) != 0)
		k++;
	putn(o, r->hold, k);
	memmove(r->hold, r->hold + k, r->nhold - k);
	r->nhold -= k;
}

/* START: feeds one byte; leaves START once the prefix decides.  Leading
 * whitespace is held too (at most sizeof hold bytes, then it counts as text). */
static void start_byte(chat_reasoning *r, char c, struct out *o, struct out *co)
{
	static const char mk[] = THINK_OPEN;
	const size_t ml = sizeof mk - 1;
	char held[sizeof r->hold + 1];
	size_t nh;
	if (r->nhold < sizeof r->hold) {
		r->hold[r->nhold++] = c;
		size_t w = 0;
		while (w < r->nhold && is_ws(r->hold[w]))
			w++;
		size_t rest = r->nhold - w;
		if (rest <= ml && memcmp(r->hold + w, mk, rest) == 0) {
			if (rest == ml) { /* ws* "<think>": dropped */
				r->nhold = 0;
				r->state = RS_THINK;
			}
			return;
		}
		nh = r->nhold;
		memcpy(held, r->hold, nh);
	} else {
		nh = r->nhold;
		memcpy(held, r->hold, nh);
		held[nh++] = c;
	}
	/* no opening marker: what was held is reasoning text (and may begin "</think>") */
	r->nhold = 0;
	r->state = RS_THINK;
	size_t i = 0;
	while (i < nh && r->state == RS_THINK)
		think_byte(r, held[i++], o);
	putn(co, held + i, nh - i); /* (cannot happen: held is too short to close) */
}

int chat_reasoning_feed(chat_reasoning *r, const char *text, size_t len, buf *reasoning,
			buf *content, ds_err *err)
{
	struct out ro = { reasoning, 0 }, co = { content, 0 };
	size_t i = 0;
	while (i < len && !ro.rc && !co.rc) {
		switch (r->state) {
		case RS_START:
			start_byte(r, text[i++], &ro, &co);
			break;
		case RS_THINK:
			if (r->nhold == 0) { /* fast path: copy up to the next '<' */
				const char *lt = memchr(text + i, '<', len - i);
				size_t run = lt ? (size_t)(lt - (text + i)) : len - i;
				putn(&ro, text + i, run);
				i += run;
				if (i == len)
					break;
			}
			think_byte(r, text[i++], &ro);
			break;
		default:
			putn(&co, text + i, len - i);
			i = len;
			break;
		}
	}
	if (ro.rc || co.rc)
		return ds_err_set(err, ro.rc ? ro.rc : co.rc, "%s is over its cap",
				  ro.rc ? "reasoning" : "content");
	return 0;
}

int chat_reasoning_finish(chat_reasoning *r, buf *reasoning, buf *content, ds_err *err)
{
	struct out ro = { reasoning, 0 };
	(void)content;
	if (r->state != RS_CONTENT)
		putn(&ro, r->hold, r->nhold);
	r->nhold = 0;
	if (ro.rc)
		return ds_err_set(err, ro.rc, "reasoning is over its cap");
	return 0;
}

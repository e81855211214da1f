/*
 * chat.c - prompt rendering (DeepSeek-V3 / R1, ChatML, SmolLM2, Llama 3) and
 * the R1 reasoning splitter (see chat.h).
 *
 * Callers: the agent's OpenAI chat endpoint (render, then tok_encode with
 * TOK_PARSE_SPECIAL and no TOK_ADD_BOS; split streamed R1 output),
 * tests.  Calls common/buf (and tok.h for chat_params_for_tok).  No global state: thread-safe; a
 * chat_reasoning belongs to one request.
 *
 * DeepSeek rendering is written from the spec's description (§6.3), not from
 * template source; ChatML / SmolLM2 / Llama 3 from what their public
 * templates render (checked against jinja2 by
 * tests/integration/test_gguf_tokenizer.py).  State while walking DeepSeek
 * messages: `in_tool` (a run of tool messages is open: the next assistant turn
 * opens with <｜tool▁outputs▁end｜>, any other turn or the end closes it first).
 *
 * Splitter invariants: `hold` is always a proper prefix of the marker the
 * state looks for (START: whitespace then a prefix of "<think>"; THINK: a
 * prefix of "</think>"); every byte fed is either emitted, dropped as part of
 * a marker, or in `hold`, in order.
 */
#include "engine/chat.h"
#include "engine/tok.h"
#include "engine/unicode.h"

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

void chat_default_params(chat_params *p)
{
	memset(p, 0, sizeof *p);
	p->tmpl = CHAT_TMPL_DEEPSEEK_V3;
	p->add_generation_prompt = 1;
}

int chat_params_for_tok(const tok *t, const char *override_name, chat_params *p, ds_err *err)
{
	chat_default_params(p);
	int rc = chat_template_choose(override_name, tok_chat_template(t), &p->tmpl, err);
	if (rc)
		return rc;
	int32_t bos = tok_bos_id(t);
	if (bos >= 0)
		p->bos = tok_token_text(t, bos, NULL);
	return 0;
}

/* ---- rendering ------------------------------------------------------------------ */

struct out {
	buf *b;
	int rc;
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

/* ChatML, SmolLM2 and Llama 3: one header + content + end marker per message. */
static void render_headers(const chat_params *p, const chat_msg *msgs, size_t n, struct out *o)
{
	int llama3 = p->tmpl == CHAT_TMPL_LLAMA3;
	if (p->tmpl == CHAT_TMPL_SMOLLM2 && n > 0 && msgs[0].role != CHAT_ROLE_SYSTEM)
		put(o, IM_START "system\n" CHAT_SMOLLM2_SYSTEM IM_END "\n");
	for (size_t i = 0; i < n; i++) {
		const char *content = msgs[i].content ? msgs[i].content : "";
		if (llama3) {
			size_t a, len;
			if (i == 0)
				put(o, p->bos ? p->bos : L3_BOS);
			put(o, L3_START);
			put(o, role_names[msgs[i].role]);
			put(o, L3_END "\n\n");
			py_strip(content, &a, &len);
			putn(o, content + a, len);
			put(o, L3_EOT);
		} else {
			put(o, IM_START);
			put(o, role_names[msgs[i].role]);
			put(o, "\n");
			put(o, content);
			put(o, IM_END "\n");
		}
	}
	if (p->add_generation_prompt)
		put(o, llama3 ? L3_START "assistant" L3_END "\n\n" : IM_START "assistant\n");
}

int chat_render(const chat_params *p, const chat_msg *msgs, size_t n, buf *b, ds_err *err)
{
	struct out o = { b, 0 };
	size_t len0 = b->len;
	int in_tool = 0, r1 = p->tmpl == CHAT_TMPL_DEEPSEEK_R1;
	int headers = p->tmpl == CHAT_TMPL_CHATML || p->tmpl == CHAT_TMPL_SMOLLM2 ||
		      p->tmpl == CHAT_TMPL_LLAMA3;

	if (p->tmpl != CHAT_TMPL_DEEPSEEK_V3 && p->tmpl != CHAT_TMPL_DEEPSEEK_R1 && !headers)
		return ds_err_set(err, DS_EINVAL, "chat template %d is not known", (int)p->tmpl);
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
		if (headers && m->n_tool_calls)
			return ds_err_set(err, DS_EINVAL, "message %zu: the %s template has no format for tool "
					  "calls", i, chat_template_name(p->tmpl));
	}
	if (headers) {
		render_headers(p, msgs, n, &o);
		goto done;
	}

	put(&o, p->bos ? p->bos : M_BOS);
	int first_sys = 1;
	for (size_t i = 0; i < n; i++) {
		if (msgs[i].role != CHAT_ROLE_SYSTEM)
			continue;
		if (!first_sys)
			put(&o, "\n\n");
		put(&o, msgs[i].content);
		first_sys = 0;
	}

	for (size_t i = 0; i < n && !o.rc; i++) {
		const chat_msg *m = &msgs[i];
		switch (m->role) {
		case CHAT_ROLE_SYSTEM:
			break;
		case CHAT_ROLE_USER:
			if (in_tool)
				put(&o, M_OUTPUTS_END);
			in_tool = 0;
			put(&o, M_USER);
			put(&o, m->content);
			break;
		case CHAT_ROLE_ASSISTANT: {
			const char *content = m->content;
			if (content && r1)
				content = after_last_think(content);
			put(&o, in_tool ? M_OUTPUTS_END : M_ASSISTANT);
			in_tool = 0;
			put(&o, content);
			if (m->n_tool_calls) {
				put(&o, M_CALLS_BEGIN);
				for (size_t k = 0; k < m->n_tool_calls; k++) {
					const chat_tool_call *c = &m->tool_calls[k];
					if (k)
						put(&o, "\n");
					put(&o, M_CALL_BEGIN);
					put(&o, c->type ? c->type : "function");
					put(&o, M_SEP);
					put(&o, c->name);
					put(&o, "\n```json\n");
					put(&o, c->arguments);
					put(&o, "\n```");
					put(&o, M_CALL_END);
				}
				put(&o, M_CALLS_END);
			}
			put(&o, M_EOS);
			break;
		}
		case CHAT_ROLE_TOOL:
			put(&o, in_tool ? "\n" M_OUTPUT_BEGIN : M_OUTPUTS_BEGIN M_OUTPUT_BEGIN);
			put(&o, m->content);
			put(&o, M_OUTPUT_END);
			in_tool = 1;
			break;
		}
	}
	if (in_tool)
		put(&o, M_OUTPUTS_END);
	else if (p->add_generation_prompt)
		put(&o, r1 ? M_ASSISTANT THINK_OPEN "\n" : M_ASSISTANT);
done:
	if (o.rc) {
		b->len = len0;
		if (b->data)
			b->data[len0] = '\0';
		return ds_err_set(err, o.rc, "rendered prompt is over %zu bytes", b->max);
	}
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

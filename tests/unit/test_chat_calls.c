/*
 * test_chat_calls.c - unit tests of the tool-call parser (engine/chat.c,
 * chat_calls): scripted model outputs in the DeepSeek, Hermes and Llama 3
 * JSON formats, whole and cut at every one or two places and byte by byte
 * (the same content and calls must come out however the text is streamed),
 * malformed outputs (unknown names, bad JSON, markers out of place, calls cut
 * short) coming back as plain content, the forced openings of
 * chat_call_opening, and the caps.
 */
#include "common/buf.h"
#include "common/status.h"
#include "engine/chat.h"
#include "tests/unit/unit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CSB "<｜tool▁calls▁begin｜>"
#define CSE "<｜tool▁calls▁end｜>"
#define CB "<｜tool▁call▁begin｜>"
#define CE "<｜tool▁call▁end｜>"
#define SEP "<｜tool▁sep｜>"
#define DS_CALL(name, args) CB "function" SEP name "\n```json\n" args "\n```" CE

static const chat_tool tools[] = {
	{ "get_weather", "Weather of a city", "{\"type\":\"object\"}" },
	{ "get_time", NULL, NULL },
};

typedef struct pcase {
	const char *text;
	const char *content;
	size_t n_calls;
	const char *calls[4][2]; /* name, arguments */
} pcase;

/* Feeds opening (may be NULL) then text cut at cuts; 1 when the result is want. */
static int run(chat_tool_format f, const char *opening, const char *text, const size_t *cuts,
	       size_t ncuts, const pcase *want, int line)
{
	chat_calls p;
	chat_calls_init(&p, f, tools, 2, 0);
	buf content;
	buf_init(&content, 0);
	int ok = 1;
	if (opening)
		ok &= chat_calls_feed(&p, opening, strlen(opening), &content, NULL) == 0;
	size_t len = strlen(text), prev = 0;
	for (size_t i = 0; i <= ncuts; i++) {
		size_t end = i < ncuts ? cuts[i] : len;
		ok &= chat_calls_feed(&p, text + prev, end - prev, &content, NULL) == 0;
		prev = end;
	}
	ok &= chat_calls_finish(&p, &content, NULL) == 0;
	ok &= strcmp(content.data ? content.data : "", want->content) == 0;
	ok &= p.n_calls == want->n_calls;
	for (size_t k = 0; ok && k < p.n_calls; k++)
		ok &= strcmp(p.calls[k].name, want->calls[k][0]) == 0 &&
		      strcmp(p.calls[k].arguments, want->calls[k][1]) == 0;
	if (!ok) {
		ut_fail(__FILE__, line, "[%s] cut at %zu,%zu: content [%s] (want [%s]), %zu calls (want %zu)%s%s%s%s",
			text, ncuts > 0 ? cuts[0] : 0, ncuts > 1 ? cuts[1] : 0,
			content.data ? content.data : "", want->content, p.n_calls, want->n_calls,
			p.n_calls ? ": " : "", p.n_calls ? p.calls[0].name : "", p.n_calls ? " " : "",
			p.n_calls ? p.calls[0].arguments : "");
	}
	buf_free(&content);
	chat_calls_free(&p);
	return ok;
}

/* Whole, at every cut and every pair of cuts, and byte by byte. */
static void check_every_cut(chat_tool_format f, const char *opening, const pcase *c, int line)
{
	size_t len = strlen(c->text);
	if (!run(f, opening, c->text, NULL, 0, c, line))
		return;
	for (size_t a = 0; a <= len; a++) {
		size_t one[1] = { a };
		if (!run(f, opening, c->text, one, 1, c, line))
			return;
		for (size_t b = a; b <= len && len < 200; b++) {
			size_t two[2] = { a, b };
			if (!run(f, opening, c->text, two, 2, c, line))
				return;
		}
	}
	size_t *cuts = malloc((len + 1) * sizeof *cuts);
	for (size_t k = 1; k < len; k++)
		cuts[k - 1] = k;
	run(f, opening, c->text, cuts, len ? len - 1 : 0, c, line);
	free(cuts);
}

TEST(chat_calls_deepseek_complete_and_streamed)
{
	static const pcase cases[] = {
		{ "Hello there", "Hello there", 0, { { 0 } } },
		{ "", "", 0, { { 0 } } },
		{ "Let me check." CSB DS_CALL("get_weather", "{\"city\": \"Paris\"}") "\n"
		  DS_CALL("get_time", "{}") CSE,
		  "Let me check.", 2, { { "get_weather", "{\"city\": \"Paris\"}" }, { "get_time", "{}" } } },
		/* no fence language, whitespace around the name and the JSON */
		{ CSB CB "function" SEP " get_time \n```\n  {\"tz\": \"UTC\"}  \n```" CE CSE, "", 1,
		  { { "get_time", "{\"tz\": \"UTC\"}" } } },
		/* text after the block is content */
		{ CSB DS_CALL("get_time", "{}") CSE " ok", " ok", 1, { { "get_time", "{}" } } },
		/* the block never closed, but its calls did */
		{ CSB DS_CALL("get_time", "{}") "\n", "", 1, { { "get_time", "{}" } } },
		/* a marker cut by the end of the output is text */
		{ "abc<｜tool▁ca", "abc<｜tool▁ca", 0, { { 0 } } },
		{ "a < b <｜ c", "a < b <｜ c", 0, { { 0 } } },
		/* a call marker in plain text does not open a block */
		{ "x" CB "y", "x" CB "y", 0, { { 0 } } },
	};
	for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
		check_every_cut(CHAT_TOOLS_DEEPSEEK, NULL, &cases[i], __LINE__);
}

TEST(chat_calls_deepseek_malformed_is_content)
{
	static const pcase cases[] = {
		/* an unknown name, bad JSON, an array, a type other than function */
		{ CSB DS_CALL("rm_rf", "{}") CSE, CSB DS_CALL("rm_rf", "{}") CSE, 0, { { 0 } } },
		{ "t" CSB DS_CALL("get_time", "{tz: UTC}") CSE, "t" CSB DS_CALL("get_time", "{tz: UTC}") CSE, 0,
		  { { 0 } } },
		{ CSB DS_CALL("get_time", "[1]") CSE, CSB DS_CALL("get_time", "[1]") CSE, 0, { { 0 } } },
		{ CSB CB "tool" SEP "get_time\n```json\n{}\n```" CE CSE,
		  CSB CB "tool" SEP "get_time\n```json\n{}\n```" CE CSE, 0, { { 0 } } },
		/* no fence, no separator, no newline after the name */
		{ CSB CB "function" SEP "get_time\n{}" CE, CSB CB "function" SEP "get_time\n{}" CE, 0, { { 0 } } },
		{ CSB CB "function get_time\n```json\n{}\n```" CE, CSB CB "function get_time\n```json\n{}\n```" CE,
		  0, { { 0 } } },
		{ CSB CB "function" SEP "get_time```json {} ```" CE, CSB CB "function" SEP "get_time```json {} ```" CE,
		  0, { { 0 } } },
		/* cut short by the end of the output */
		{ CSB DS_CALL("get_weather", "{\"ci"), CSB DS_CALL("get_weather", "{\"ci"), 0, { { 0 } } },
		{ "q" CSB CB "function" SEP "get_weather\n```json\n{\"ci", "q" CSB CB "function" SEP "get_weather\n```json\n{\"ci",
		  0, { { 0 } } },
		{ CSB, CSB, 0, { { 0 } } },
		{ CSB "\n", CSB "\n", 0, { { 0 } } },
		/* a good call, then garbage: the call stands, the rest is content */
		{ CSB DS_CALL("get_time", "{}") "xyz" DS_CALL("get_weather", "{}") CSE,
		  "xyz" DS_CALL("get_weather", "{}") CSE, 1, { { "get_time", "{}" } } },
		{ CSB DS_CALL("get_time", "{}") "<｜tool▁calls", "<｜tool▁calls", 1, { { "get_time", "{}" } } },
		/* a marker inside the arguments ends the call early: bad JSON */
		{ CSB DS_CALL("get_time", "{\"x\": \"" CE "\"}") CSE, CSB DS_CALL("get_time", "{\"x\": \"" CE "\"}") CSE,
		  0, { { 0 } } },
		/* after a malformed block everything is content, even a good block */
		{ CSB "junk" CSE CSB DS_CALL("get_time", "{}") CSE, CSB "junk" CSE CSB DS_CALL("get_time", "{}") CSE,
		  0, { { 0 } } },
	};
	for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
		check_every_cut(CHAT_TOOLS_DEEPSEEK, NULL, &cases[i], __LINE__);
}

#define HC(json) "<tool_call>\n" json "\n</tool_call>"

TEST(chat_calls_hermes)
{
	static const pcase cases[] = {
		{ "Sure.\n" HC("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}") "\n"
		  HC("{\"name\": \"get_time\", \"arguments\": {}}") "\n",
		  "Sure.\n", 2, { { "get_weather", "{\"city\":\"Paris\"}" }, { "get_time", "{}" } } },
		/* arguments as a string holding JSON; "parameters" for "arguments" */
		{ HC("{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": 1}\"}"), "", 1,
		  { { "get_time", "{\"tz\":1}" } } },
		{ HC("{\"name\": \"get_time\", \"parameters\": {\"tz\": 1}}") "\n\nDone.", "Done.", 1,
		  { { "get_time", "{\"tz\":1}" } } },
		{ "no calls <tool", "no calls <tool", 0, { { 0 } } },
		{ "", "", 0, { { 0 } } },
		/* malformed */
		{ HC("{\"name\": \"nope\", \"arguments\": {}}"), HC("{\"name\": \"nope\", \"arguments\": {}}"), 0,
		  { { 0 } } },
		{ HC("{\"name\": \"get_time\", \"arguments\": [1]}"), HC("{\"name\": \"get_time\", \"arguments\": [1]}"),
		  0, { { 0 } } },
		{ HC("{\"name\": \"get_time\"}"), HC("{\"name\": \"get_time\"}"), 0, { { 0 } } },
		{ HC("not json"), HC("not json"), 0, { { 0 } } },
		{ "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}",
		  "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}", 0, { { 0 } } },
		{ HC("{\"name\": \"get_time\", \"arguments\": {}}") " " HC("{}"), HC("{}"), 1,
		  { { "get_time", "{}" } } },
	};
	for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
		check_every_cut(CHAT_TOOLS_HERMES, NULL, &cases[i], __LINE__);
}

TEST(chat_calls_llama3_json)
{
	static const pcase cases[] = {
		{ "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", "", 1,
		  { { "get_weather", "{\"city\":\"Paris\"}" } } },
		{ " <|python_tag|>{\"name\": \"get_time\", \"parameters\": {}}; {\"name\": \"get_weather\", "
		  "\"arguments\": {}}\n",
		  "", 2, { { "get_time", "{}" }, { "get_weather", "{}" } } },
		{ "  Hello", "  Hello", 0, { { 0 } } },
		{ "<|python", "<|python", 0, { { 0 } } },
		{ "   ", "   ", 0, { { 0 } } },
		{ "", "", 0, { { 0 } } },
		/* all or nothing */
		{ "{\"name\": \"get_time\", \"parameters\": {}} trailing",
		  "{\"name\": \"get_time\", \"parameters\": {}} trailing", 0, { { 0 } } },
		{ "{\"name\": \"get_time\", \"parameters\": {}}; {\"name\": \"zzz\", \"parameters\": {}}",
		  "{\"name\": \"get_time\", \"parameters\": {}}; {\"name\": \"zzz\", \"parameters\": {}}", 0, { { 0 } } },
		{ "{not json", "{not json", 0, { { 0 } } },
		{ "{\"name\": \"get_time\", \"parameters\": {}};", "{\"name\": \"get_time\", \"parameters\": {}};", 0,
		  { { 0 } } },
	};
	for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
		check_every_cut(CHAT_TOOLS_LLAMA3, NULL, &cases[i], __LINE__);
	/* no format: everything is content */
	static const pcase none = { CSB DS_CALL("get_time", "{}") CSE, CSB DS_CALL("get_time", "{}") CSE, 0,
				    { { 0 } } };
	check_every_cut(CHAT_TOOLS_NONE, NULL, &none, __LINE__);
}

/* chat_call_opening for each format, fed before the model's output. */
static char *opening(chat_template tmpl, chat_tool_format f, chat_tool_choice choice, const char *name)
{
	chat_params p;
	chat_default_params(&p);
	p.tmpl = tmpl;
	p.tool_format = f;
	p.tools = tools;
	p.n_tools = 2;
	p.tool_choice = choice;
	p.tool_name = name;
	buf b;
	buf_init(&b, 0);
	ds_err err = { 0 };
	CHECK_EQ(chat_call_opening(&p, &b, &err), 0);
	char *s = buf_take(&b);
	return s ? s : strdup("");
}

TEST(chat_calls_forced_openings)
{
	char *o = opening(CHAT_TMPL_DEEPSEEK_R1, CHAT_TOOLS_DEEPSEEK, CHAT_CHOICE_NAMED, "get_weather");
	CHECK_STR(o, CSB CB "function" SEP "get_weather\n```json\n");
	static const pcase named = { "{\"city\":\"Paris\"}\n```" CE CSE, "", 1,
				     { { "get_weather", "{\"city\":\"Paris\"}" } } };
	check_every_cut(CHAT_TOOLS_DEEPSEEK, o, &named, __LINE__);
	/* a forced opening the model does not finish: all of it is content */
	static const pcase junk = { "oops", CSB CB "function" SEP "get_weather\n```json\noops", 0, { { 0 } } };
	check_every_cut(CHAT_TOOLS_DEEPSEEK, o, &junk, __LINE__);
	free(o);
	o = opening(CHAT_TMPL_DEEPSEEK_V3, CHAT_TOOLS_DEEPSEEK, CHAT_CHOICE_REQUIRED, NULL);
	CHECK_STR(o, CSB CB "function" SEP);
	static const pcase req = { "get_time\n```json\n{}\n```" CE "\n" DS_CALL("get_time", "{\"a\": 2}") CSE, "",
				   2, { { "get_time", "{}" }, { "get_time", "{\"a\": 2}" } } };
	check_every_cut(CHAT_TOOLS_DEEPSEEK, o, &req, __LINE__);
	free(o);
	o = opening(CHAT_TMPL_CHATML, CHAT_TOOLS_HERMES, CHAT_CHOICE_NAMED, "get_time");
	CHECK_STR(o, "<tool_call>\n{\"name\": \"get_time\", \"arguments\": ");
	static const pcase hn = { "{\"tz\": 3}}\n</tool_call>", "", 1, { { "get_time", "{\"tz\":3}" } } };
	check_every_cut(CHAT_TOOLS_HERMES, o, &hn, __LINE__);
	free(o);
	o = opening(CHAT_TMPL_LLAMA3, CHAT_TOOLS_LLAMA3, CHAT_CHOICE_REQUIRED, NULL);
	CHECK_STR(o, "{\"name\": \"");
	static const pcase lr = { "get_time\", \"parameters\": {}}", "", 1, { { "get_time", "{}" } } };
	check_every_cut(CHAT_TOOLS_LLAMA3, o, &lr, __LINE__);
	free(o);
	/* auto, none, a template without a format: no opening */
	o = opening(CHAT_TMPL_DEEPSEEK_V3, CHAT_TOOLS_DEEPSEEK, CHAT_CHOICE_AUTO, NULL);
	CHECK_STR(o, "");
	free(o);
	o = opening(CHAT_TMPL_SMOLLM2, CHAT_TOOLS_NONE, CHAT_CHOICE_REQUIRED, NULL);
	CHECK_STR(o, "");
	free(o);
}

TEST(chat_calls_caps)
{
	/* past max_text held: what was held and the rest are content */
	chat_calls p;
	chat_calls_init(&p, CHAT_TOOLS_DEEPSEEK, tools, 2, 64);
	buf content;
	buf_init(&content, 0);
	const char *text = CSB DS_CALL("get_time", "{\"pad\": \"0123456789012345678901234567890123456789\"}") CSE;
	for (size_t i = 0; text[i]; i++)
		CHECK_EQ(chat_calls_feed(&p, text + i, 1, &content, NULL), 0);
	CHECK_EQ(chat_calls_finish(&p, &content, NULL), 0);
	CHECK_STR(content.data, text);
	CHECK_EQ(p.n_calls, 0);
	chat_calls_free(&p);
	/* at most CHAT_MAX_CALLS calls: the next is content */
	chat_calls_init(&p, CHAT_TOOLS_DEEPSEEK, tools, 2, 0);
	buf_clear(&content);
	CHECK_EQ(chat_calls_feed(&p, CSB, strlen(CSB), &content, NULL), 0);
	for (int i = 0; i <= CHAT_MAX_CALLS; i++)
		CHECK_EQ(chat_calls_feed(&p, DS_CALL("get_time", "{}"), strlen(DS_CALL("get_time", "{}")), &content,
					 NULL), 0);
	CHECK_EQ(chat_calls_finish(&p, &content, NULL), 0);
	CHECK_EQ(p.n_calls, CHAT_MAX_CALLS);
	CHECK_STR(content.data, DS_CALL("get_time", "{}"));
	chat_calls_free(&p);
	chat_calls_free(NULL);
	/* content past its cap is an error the caller sees */
	buf small;
	buf_init(&small, 4);
	chat_calls_init(&p, CHAT_TOOLS_HERMES, tools, 2, 0);
	ds_err err = { 0 };
	CHECK_EQ(chat_calls_feed(&p, "too long", 8, &small, &err), DS_ERANGE);
	CHECK(strstr(err.msg, "cap") != NULL);
	chat_calls_free(&p);
	buf_free(&small);
	buf_free(&content);
}

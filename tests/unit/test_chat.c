/*
 * test_chat.c - unit tests of engine/chat.c: DeepSeek-V3 / R1 rendering (spec
 * §6.3 examples, system joining, generation prompt, R1 reasoning stripping,
 * tool calls and outputs), template detection, and the R1 reasoning splitter
 * with its markers cut at every possible chunk boundary.
 */
#include "common/buf.h"
#include "common/status.h"
#include "engine/chat.h"
#include "tests/unit/unit.h"

#include <stdio.h>
#include <string.h>

#define BOS "<｜begin▁of▁sentence｜>"
#define EOS "<｜end▁of▁sentence｜>"
#define U "<｜User｜>"
#define A "<｜Assistant｜>"

static void check_render(chat_template tmpl, int gen, const chat_msg *m, size_t n, const char *want,
			 int line)
{
	chat_params p;
	chat_default_params(&p);
	p.tmpl = tmpl;
	p.add_generation_prompt = gen;
	buf b;
	buf_init(&b, 0);
	ds_err err = { 0 };
	if (chat_render(&p, m, n, &b, &err) != 0)
		ut_fail(__FILE__, line, "render: %s", err.msg);
	else if (strcmp(b.data ? b.data : "", want) != 0)
		ut_fail(__FILE__, line, "rendered\n  %s\nwant\n  %s", b.data ? b.data : "", want);
	buf_free(&b);
}

TEST(chat_v3_and_r1_spec_examples)
{
	const chat_msg m[] = {
		{ CHAT_ROLE_SYSTEM, "S", NULL, 0 },
		{ CHAT_ROLE_USER, "U1", NULL, 0 },
		{ CHAT_ROLE_ASSISTANT, "A1", NULL, 0 },
		{ CHAT_ROLE_USER, "U2", NULL, 0 },
	};
	check_render(CHAT_TMPL_DEEPSEEK_V3, 1, m, 4, BOS "S" U "U1" A "A1" EOS U "U2" A, __LINE__);
	check_render(CHAT_TMPL_DEEPSEEK_R1, 1, m, 4, BOS "S" U "U1" A "A1" EOS U "U2" A "<think>\n",
		     __LINE__);
	check_render(CHAT_TMPL_DEEPSEEK_V3, 0, m, 4, BOS "S" U "U1" A "A1" EOS U "U2", __LINE__);
	check_render(CHAT_TMPL_DEEPSEEK_V3, 1, NULL, 0, BOS A, __LINE__);
}

TEST(chat_system_messages_are_joined_wherever_they_are)
{
	const chat_msg m[] = {
		{ CHAT_ROLE_USER, "hi", NULL, 0 },
		{ CHAT_ROLE_SYSTEM, "one", NULL, 0 },
		{ CHAT_ROLE_ASSISTANT, "yo", NULL, 0 },
		{ CHAT_ROLE_SYSTEM, "two", NULL, 0 },
	};
	check_render(CHAT_TMPL_DEEPSEEK_V3, 1, m, 4, BOS "one\n\ntwo" U "hi" A "yo" EOS A, __LINE__);
}

TEST(chat_r1_drops_reasoning_from_history)
{
	const chat_msg m[] = {
		{ CHAT_ROLE_USER, "q1", NULL, 0 },
		{ CHAT_ROLE_ASSISTANT, "<think>\nstep</think>x</think>\n\nfinal", NULL, 0 },
		{ CHAT_ROLE_USER, "q2", NULL, 0 },
		{ CHAT_ROLE_ASSISTANT, "no think here", NULL, 0 },
	};
	check_render(CHAT_TMPL_DEEPSEEK_R1, 1, m, 4,
		     BOS U "q1" A "\n\nfinal" EOS U "q2" A "no think here" EOS A "<think>\n", __LINE__);
	check_render(CHAT_TMPL_DEEPSEEK_V3, 0, m, 2, BOS U "q1" A "<think>\nstep</think>x</think>\n\nfinal" EOS,
		     __LINE__);
}

TEST(chat_tool_calls_and_outputs)
{
	const chat_tool_call calls[] = {
		{ "function", "f", "{\"a\": 1}" },
		{ NULL, "g", "{}" },
	};
	const chat_msg m[] = {
		{ CHAT_ROLE_USER, "u", NULL, 0 },
		{ CHAT_ROLE_ASSISTANT, NULL, calls, 2 },
		{ CHAT_ROLE_TOOL, "r1", NULL, 0 },
		{ CHAT_ROLE_TOOL, "r2", NULL, 0 },
		{ CHAT_ROLE_ASSISTANT, "done", NULL, 0 },
		{ CHAT_ROLE_USER, "again", NULL, 0 },
		{ CHAT_ROLE_ASSISTANT, "pre", calls, 1 },
		{ CHAT_ROLE_TOOL, "r3", NULL, 0 },
	};
	const char *call_f = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```<｜tool▁call▁end｜>";
	const char *call_g = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{}\n```<｜tool▁call▁end｜>";
	char want[2048];
	snprintf(want, sizeof want,
		 BOS U "u" A "<｜tool▁calls▁begin｜>%s\n%s<｜tool▁calls▁end｜>" EOS
		 "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>r1<｜tool▁output▁end｜>\n"
		 "<｜tool▁output▁begin｜>r2<｜tool▁output▁end｜><｜tool▁outputs▁end｜>done" EOS
		 U "again" A "pre<｜tool▁calls▁begin｜>%s<｜tool▁calls▁end｜>" EOS
		 "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>r3<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
		 call_f, call_g, call_f);
	/* ends with tool output: the block is closed and no generation prompt follows */
	check_render(CHAT_TMPL_DEEPSEEK_V3, 1, m, 8, want, __LINE__);
	/* a user turn right after tool output closes the block first */
	const chat_msg m2[] = {
		{ CHAT_ROLE_TOOL, "r", NULL, 0 },
		{ CHAT_ROLE_USER, "u", NULL, 0 },
	};
	check_render(CHAT_TMPL_DEEPSEEK_R1, 1, m2, 2,
		     BOS "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>r<｜tool▁output▁end｜>"
			 "<｜tool▁outputs▁end｜>" U "u" A "<think>\n",
		     __LINE__);
}

TEST(chat_render_errors_and_cap)
{
	chat_params p;
	chat_default_params(&p);
	buf b;
	buf_init(&b, 40);
	ds_err err = { 0 };
	const chat_tool_call call = { "function", "f", "{}" };
	const chat_msg bad[] = { { CHAT_ROLE_USER, "x", &call, 1 } };
	CHECK_EQ(chat_render(&p, bad, 1, &b, &err), DS_EINVAL);
	CHECK(strstr(err.msg, "only assistant") != NULL);
	const chat_msg longer[] = { { CHAT_ROLE_USER, "a long message that will not fit", NULL, 0 } };
	CHECK_EQ(buf_puts(&b, "keep"), 0);
	CHECK_EQ(chat_render(&p, longer, 1, &b, &err), DS_ERANGE);
	CHECK_STR(b.data, "keep"); /* back to its length at entry */
	p.tmpl = CHAT_TMPL_UNKNOWN;
	CHECK_EQ(chat_render(&p, longer, 1, &b, &err), DS_EINVAL);
	buf_free(&b);
	p.tmpl = CHAT_TMPL_DEEPSEEK_V3;
	p.bos = "<s>";
	buf_init(&b, 0);
	CHECK_EQ(chat_render(&p, NULL, 0, &b, &err), 0);
	CHECK_STR(b.data, "<s>" A);
	buf_free(&b);
	chat_role r;
	CHECK_EQ(chat_role_parse("tool", &r, &err), 0);
	CHECK_EQ(r, CHAT_ROLE_TOOL);
	CHECK_EQ(chat_role_parse("developer", &r, &err), DS_EINVAL);
	CHECK(strstr(err.msg, "developer") != NULL);
}

TEST(chat_template_detection_and_override)
{
	const char *v3 = "{{bos_token}}{%- if message['role'] == 'user' %}{{'<｜User｜>' + "
			 "message['content']}}{%- endif %}{{'<｜Assistant｜>'}}";
	const char *r1 = "{% set content = content.split('</think>')[-1] %}{{'<｜User｜>'}}"
			 "{{'<｜Assistant｜><think>\\n'}}";
	CHECK_EQ(chat_template_detect(v3), CHAT_TMPL_DEEPSEEK_V3);
	CHECK_EQ(chat_template_detect(r1), CHAT_TMPL_DEEPSEEK_R1);
	CHECK_EQ(chat_template_detect("{{ '<|im_start|>' }}"), CHAT_TMPL_UNKNOWN);
	CHECK_EQ(chat_template_detect(NULL), CHAT_TMPL_UNKNOWN);
	chat_template t;
	ds_err err = { 0 };
	CHECK_EQ(chat_template_choose(NULL, r1, &t, &err), 0);
	CHECK_EQ(t, CHAT_TMPL_DEEPSEEK_R1);
	CHECK_EQ(chat_template_choose("deepseek-v3", r1, &t, &err), 0);
	CHECK_EQ(t, CHAT_TMPL_DEEPSEEK_V3);
	CHECK_EQ(chat_template_choose("vicuna", v3, &t, &err), DS_EINVAL); /* chatml is known now */
	CHECK(strstr(err.msg, "vicuna") != NULL);
	CHECK_EQ(chat_template_choose(NULL, "{{ '<|im_start|>' }}", &t, &err), DS_ENOTFOUND);
	CHECK_EQ(chat_template_choose(NULL, NULL, &t, &err), DS_ENOTFOUND);
	CHECK_STR(chat_template_name(CHAT_TMPL_DEEPSEEK_R1), "deepseek-r1");
}

/* ---- the reasoning splitter ----------------------------------------------------------- */

/* Feeds text cut at the given boundaries (sorted, may repeat) and checks both outputs. */
static int split_run(const char *text, const size_t *cuts, size_t ncuts, const char *want_r,
		     const char *want_c)
{
	chat_reasoning r;
	chat_reasoning_init(&r);
	buf rb, cb;
	buf_init(&rb, 0);
	buf_init(&cb, 0);
	size_t len = strlen(text), prev = 0;
	int ok = 1;
	for (size_t i = 0; i <= ncuts; i++) {
		size_t end = i < ncuts ? cuts[i] : len;
		ok &= chat_reasoning_feed(&r, text + prev, end - prev, &rb, &cb, NULL) == 0;
		prev = end;
	}
	ok &= chat_reasoning_finish(&r, &rb, &cb, NULL) == 0;
	ok &= strcmp(rb.data ? rb.data : "", want_r) == 0 && strcmp(cb.data ? cb.data : "", want_c) == 0;
	if (!ok)
		ut_fail(__FILE__, __LINE__, "\"%s\" cut at %zu,%zu: reasoning \"%s\" content \"%s\"", text,
			ncuts > 0 ? cuts[0] : 0, ncuts > 1 ? cuts[1] : 0, rb.data ? rb.data : "",
			cb.data ? cb.data : "");
	buf_free(&rb);
	buf_free(&cb);
	return ok;
}

TEST(chat_reasoning_splitter_every_cut)
{
	static const struct {
		const char *text, *reasoning, *content;
	} c[] = {
		{ "<think>\nabc</think>\n\ndef", "\nabc", "\n\ndef" },
		{ "abc</think>def", "abc", "def" },
		{ " \n<think>x</think>y", "x", "y" },
		{ "<thinking>x</think>y", "<thinking>x", "y" },
		{ "a</thinx>b</think>c", "a</thinx>b", "c" },
		{ "a<</think>b", "a<", "b" },
		{ "a<<//think></think>b", "a<<//think>", "b" },
		{ "<think>never closed </thi", "never closed </thi", "" },
		{ "</think>", "", "" },
		{ "x</think>y</think>z", "x", "y</think>z" },
		{ "<<think>>", "<<think>>", "" },
		{ "<think><think></think>", "<think>", "" },
		{ "  <thin", "  <thin", "" },
		{ "plain reasoning only", "plain reasoning only", "" },
		{ "", "", "" },
	};
	for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
		size_t len = strlen(c[i].text);
		int ok = split_run(c[i].text, NULL, 0, c[i].reasoning, c[i].content);
		for (size_t a = 0; ok && a <= len; a++) {
			size_t one[1] = { a };
			ok = split_run(c[i].text, one, 1, c[i].reasoning, c[i].content);
			for (size_t b = a; ok && b <= len; b++) {
				size_t two[2] = { a, b };
				ok = split_run(c[i].text, two, 2, c[i].reasoning, c[i].content);
			}
		}
		/* byte by byte */
		if (ok && len > 1) {
			size_t cuts[64];
			for (size_t k = 1; k < len && k < 64; k++)
				cuts[k - 1] = k;
			split_run(c[i].text, cuts, len - 1 < 63 ? len - 1 : 63, c[i].reasoning, c[i].content);
		}
	}
	chat_reasoning r;
	chat_reasoning_init(&r);
	buf rb, cb;
	buf_init(&rb, 0);
	buf_init(&cb, 0);
	CHECK_EQ(chat_reasoning_feed(&r, "a</thi", 6, &rb, &cb, NULL), 0);
	CHECK(!chat_reasoning_done(&r));
	CHECK_EQ(chat_reasoning_feed(&r, "nk>b", 4, &rb, &cb, NULL), 0);
	CHECK(chat_reasoning_done(&r));
	CHECK_STR(rb.data, "a");
	CHECK_STR(cb.data, "b");
	buf_free(&rb);
	buf_free(&cb);
}

TEST(chat_reasoning_long_leading_whitespace_and_caps)
{
	char text[128];
	memset(text, ' ', 60);
	snprintf(text + 60, sizeof text - 60, "<think>r</think>c");
	/* more whitespace than the splitter holds: kept as reasoning text */
	char want[128];
	memset(want, ' ', 60);
	snprintf(want + 60, sizeof want - 60, "<think>r");
	split_run(text, NULL, 0, want, "c");
	chat_reasoning r;
	chat_reasoning_init(&r);
	buf rb, cb;
	buf_init(&rb, 4);
	buf_init(&cb, 0);
	ds_err err = { 0 };
	CHECK_EQ(chat_reasoning_feed(&r, "<think>too long reasoning", 25, &rb, &cb, &err), DS_ERANGE);
	CHECK(strstr(err.msg, "reasoning") != NULL);
	buf_free(&rb);
	buf_free(&cb);
}

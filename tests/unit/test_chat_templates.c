/*
 * test_chat_templates.c - unit tests of engine/chat.c's ChatML, SmolLM2 and
 * Llama 3 templates: byte-exact renderings of known conversations (default
 * system message, generation prompt, empty conversations, Python-style
 * trimming of Llama 3 contents, BOS override), tool calls refused, and the
 * recognition of template texts (SmolLM2's hub template, a plain ChatML one,
 * Llama 3, Llama 3.1+ refused with a hint, DeepSeek unchanged).
 * The same renderings are compared with jinja2 in
 * tests/integration/test_gguf_tokenizer.py.
 */
#include "common/buf.h"
#include "common/status.h"
#include "engine/chat.h"
#include "tests/unit/unit.h"

#include <stdio.h>
#include <string.h>

#define IMS "<|im_start|>"
#define IME "<|im_end|>"
#define SMOL_SYS IMS "system\n" CHAT_SMOLLM2_SYSTEM IME "\n"
#define L3B "<|begin_of_text|>"
#define L3H(role) "<|start_header_id|>" role "<|end_header_id|>\n\n"
#define EOT "<|eot_id|>"

/* SmolLM2-135M-Instruct's tokenizer.chat_template, as its GGUF carries it. */
static const char smollm2_template[] =
	"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
	"{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
	"Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
	"message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
	"{{ '<|im_start|>assistant\n' }}{% endif %}";

static void check_render(chat_template tmpl, int gen, const char *bos, const chat_msg *m, size_t n,
			 const char *want, int line)
{
	chat_params p;
	chat_default_params(&p);
	p.tmpl = tmpl;
	p.add_generation_prompt = gen;
	p.bos = bos;
	buf b;
	buf_init(&b, 0);
	ds_err err = { 0 };
	if (chat_render(&p, m, n, &b, &err) != 0)
		ut_fail(__FILE__, line, "render: %s", err.msg);
	else if (strcmp(b.data ? b.data : "", want) != 0)
		ut_fail(__FILE__, line, "rendered\n  [%s]\nwant\n  [%s]", b.data ? b.data : "", want);
	buf_free(&b);
}

TEST(chat_smollm2_and_chatml_byte_exact)
{
	const chat_msg one[] = { { CHAT_ROLE_USER, "Hi there", NULL, 0 } };
	check_render(CHAT_TMPL_SMOLLM2, 1, NULL, one, 1,
		     SMOL_SYS IMS "user\nHi there" IME "\n" IMS "assistant\n", __LINE__);
	check_render(CHAT_TMPL_CHATML, 1, NULL, one, 1, IMS "user\nHi there" IME "\n" IMS "assistant\n",
		     __LINE__);
	check_render(CHAT_TMPL_SMOLLM2, 0, NULL, one, 1, SMOL_SYS IMS "user\nHi there" IME "\n",
		     __LINE__);

	const chat_msg conv[] = {
		{ CHAT_ROLE_SYSTEM, "Be brief.", NULL, 0 },
		{ CHAT_ROLE_USER, " 2+2? \n", NULL, 0 },
		{ CHAT_ROLE_ASSISTANT, "4", NULL, 0 },
		{ CHAT_ROLE_TOOL, "{\"x\": 1}", NULL, 0 },
		{ CHAT_ROLE_USER, NULL, NULL, 0 },
	};
	/* a system message first: no default one; contents verbatim; NULL = empty */
	check_render(CHAT_TMPL_SMOLLM2, 1, NULL, conv, 5,
		     IMS "system\nBe brief." IME "\n" IMS "user\n 2+2? \n" IME "\n" IMS "assistant\n4" IME
		     "\n" IMS "tool\n{\"x\": 1}" IME "\n" IMS "user\n" IME "\n" IMS "assistant\n",
		     __LINE__);
	/* a system message later: the default is still inserted first */
	check_render(CHAT_TMPL_SMOLLM2, 0, NULL, conv + 1, 2,
		     SMOL_SYS IMS "user\n 2+2? \n" IME "\n" IMS "assistant\n4" IME "\n", __LINE__);
	const chat_msg late_sys[] = { { CHAT_ROLE_USER, "a", NULL, 0 }, { CHAT_ROLE_SYSTEM, "s", NULL, 0 } };
	check_render(CHAT_TMPL_SMOLLM2, 0, NULL, late_sys, 2,
		     SMOL_SYS IMS "user\na" IME "\n" IMS "system\ns" IME "\n", __LINE__);
	/* no messages: the loop never runs, so no default system message */
	check_render(CHAT_TMPL_SMOLLM2, 1, NULL, NULL, 0, IMS "assistant\n", __LINE__);
	check_render(CHAT_TMPL_SMOLLM2, 0, NULL, NULL, 0, "", __LINE__);
}

TEST(chat_llama3_byte_exact_and_trimmed)
{
	const chat_msg conv[] = {
		{ CHAT_ROLE_SYSTEM, "  You are terse.\n", NULL, 0 },
		{ CHAT_ROLE_USER, "\t\nHello\r\n", NULL, 0 },
		{ CHAT_ROLE_ASSISTANT, "Hi!", NULL, 0 },
		{ CHAT_ROLE_USER, "\xe3\x80\x80wide\xc2\xa0\xe2\x80\xa8", NULL, 0 }, /* U+3000, NBSP, U+2028 */
	};
	check_render(CHAT_TMPL_LLAMA3, 1, NULL, conv, 4,
		     L3B L3H("system") "You are terse." EOT L3H("user") "Hello" EOT L3H("assistant")
		     "Hi!" EOT L3H("user") "wide" EOT L3H("assistant"), __LINE__);
	check_render(CHAT_TMPL_LLAMA3, 0, NULL, conv + 2, 1, L3B L3H("assistant") "Hi!" EOT, __LINE__);
	check_render(CHAT_TMPL_LLAMA3, 0, "<BOS>", conv + 2, 1, "<BOS>" L3H("assistant") "Hi!" EOT,
		     __LINE__);
	/* whitespace only, NULL, inner whitespace kept, zero-width space (not
	 * whitespace to Python) kept, invalid UTF-8 kept */
	const chat_msg edge[] = {
		{ CHAT_ROLE_USER, " \x1c\x1f\xc2\x85 ", NULL, 0 }, /* U+0085 is whitespace too */
		{ CHAT_ROLE_ASSISTANT, NULL, NULL, 0 },
		{ CHAT_ROLE_USER, " a \t b ", NULL, 0 },
		{ CHAT_ROLE_USER, "\xe2\x80\x8bx\xe2\x80\x8b", NULL, 0 },
		{ CHAT_ROLE_TOOL, " \xff\xfe ", NULL, 0 },
	};
	check_render(CHAT_TMPL_LLAMA3, 0, NULL, edge, 5,
		     L3B L3H("user") EOT L3H("assistant") EOT L3H("user") "a \t b" EOT
		     L3H("user") "\xe2\x80\x8bx\xe2\x80\x8b" EOT L3H("tool") "\xff\xfe" EOT, __LINE__);
	/* no messages: no BOS either (it is emitted with the first message) */
	check_render(CHAT_TMPL_LLAMA3, 1, NULL, NULL, 0, L3H("assistant"), __LINE__);
}

TEST(chat_header_templates_refuse_tool_calls)
{
	const chat_tool_call call = { "function", "f", "{}" };
	const chat_msg m[] = { { CHAT_ROLE_USER, "q", NULL, 0 }, { CHAT_ROLE_ASSISTANT, NULL, &call, 1 } };
	static const chat_template ts[] = { CHAT_TMPL_CHATML, CHAT_TMPL_SMOLLM2, CHAT_TMPL_LLAMA3 };
	for (size_t i = 0; i < 3; i++) {
		chat_params p;
		chat_default_params(&p);
		p.tmpl = ts[i];
		buf b;
		buf_init(&b, 0);
		ds_err err = { 0 };
		CHECK_EQ(chat_render(&p, m, 2, &b, &err), DS_EINVAL);
		CHECK(strstr(err.msg, "no format for tool calls") != NULL);
		CHECK_EQ(b.len, 0);
		buf_free(&b);
	}
	/* the cap still holds, and out is left as it was */
	chat_params p;
	chat_default_params(&p);
	p.tmpl = CHAT_TMPL_SMOLLM2;
	buf b;
	buf_init(&b, 40);
	buf_puts(&b, "keep");
	ds_err err = { 0 };
	CHECK_EQ(chat_render(&p, m, 1, &b, &err), DS_ERANGE);
	CHECK_STR(b.data, "keep");
	buf_free(&b);
}

TEST(chat_template_recognition)
{
	static const char llama3[] =
		"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
		"'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
		"| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
		"{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
		"'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
	static const char llama31[] =
		"{{- bos_token }}{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}"
		"{{- \"Cutting Knowledge Date: December 2023\\n\" }}{{- \"<|eot_id|>\" }}";
	static const char qwen_like[] =
		"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
		"message['content'] + '<|im_end|>' + '\n'}}{% endfor %}";
	CHECK_EQ(chat_template_detect(smollm2_template), CHAT_TMPL_SMOLLM2);
	CHECK_EQ(chat_template_detect(qwen_like), CHAT_TMPL_CHATML);
	CHECK_EQ(chat_template_detect(llama3), CHAT_TMPL_LLAMA3);
	CHECK_EQ(chat_template_detect(llama31), CHAT_TMPL_UNKNOWN);
	CHECK_EQ(chat_template_detect("{{ '<｜User｜>' + '<｜Assistant｜>' }}"), CHAT_TMPL_DEEPSEEK_V3);
	CHECK_EQ(chat_template_detect("<|im_start|> only"), CHAT_TMPL_UNKNOWN);
	CHECK_EQ(chat_template_detect(NULL), CHAT_TMPL_UNKNOWN);

	chat_template t = CHAT_TMPL_UNKNOWN;
	ds_err err = { 0 };
	CHECK_EQ(chat_template_choose(NULL, llama31, &t, &err), DS_ENOTFOUND);
	CHECK(strstr(err.msg, "Llama 3.1+") && strstr(err.msg, "'llama3'"));
	CHECK_EQ(chat_template_choose("llama3", llama31, &t, &err), 0);
	CHECK_EQ(t, CHAT_TMPL_LLAMA3);
	CHECK_EQ(chat_template_choose(NULL, "{{ x }}", &t, &err), DS_ENOTFOUND);
	CHECK(strstr(err.msg, "deepseek-v3, deepseek-r1, chatml, smollm2, llama3") != NULL);
	CHECK_EQ(chat_template_choose("vicuna", NULL, &t, &err), DS_EINVAL);
	CHECK(strstr(err.msg, "'vicuna' is not known (deepseek-v3, deepseek-r1, chatml, smollm2, llama3)"));
	for (int k = CHAT_TMPL_DEEPSEEK_V3; k < CHAT_TMPL_COUNT; k++) {
		CHECK_EQ(chat_template_choose(chat_template_name((chat_template)k), NULL, &t, &err), 0);
		CHECK_EQ(t, k);
	}
	CHECK_STR(chat_template_name(CHAT_TMPL_COUNT), "unknown");
}

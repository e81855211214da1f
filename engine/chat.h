/*
 * chat.h - chat templates (DeepSeek-V3 / R1, ChatML, SmolLM2, Llama 3) and the
 * R1 reasoning splitter.
 *
 * chat_render turns a list of messages into the prompt text the model was
 * trained on (spec §6.3 for DeepSeek).  DeepSeek and Llama 3 texts start with
 * the BOS string, so encode the text with TOK_PARSE_SPECIAL and WITHOUT
 * TOK_ADD_BOS (else BOS twice); ChatML texts carry no BOS (SmolLM2's GGUF
 * says add_bos_token false, and HF's apply_chat_template adds none either).
 * Caution: message contents are pasted verbatim, so a user who types
 * "<｜Assistant｜>" or "<|im_end|>" produces that marker when the whole text is
 * encoded with parse_special; callers that must prevent it encode contents
 * separately.
 *
 * Which template (chat_template_choose):
 *   1. an explicit override name (chat_template_name of any template) wins;
 *   2. else the model's chat_template text (tokenizer_config.json or GGUF
 *      tokenizer.chat_template) is recognised by its markers:
 *      - "<｜User｜>" and "<｜Assistant｜>" (the V3 family): R1 if it also
 *        mentions "</think>" or "<think>" (R1 templates strip reasoning and/or
 *        open a <think> block), otherwise V3;
 *      - "<|start_header_id|>", "<|end_header_id|>" and "<|eot_id|>": Llama 3,
 *        unless it has "Cutting Knowledge Date" (the Llama 3.1+ templates,
 *        whose dated system block and tool formats are not rendered here);
 *      - "<|im_start|>" and "<|im_end|>": ChatML; SmolLM2 when the text holds
 *        SmolLM2's default system message (CHAT_SMOLLM2_SYSTEM);
 *   3. anything else is DS_ENOTFOUND ("unknown chat template; pass an override").
 *
 * chat_reasoning splits R1 output into reasoning_content and content while it
 * streams: see the struct below.  All functions are reentrant; a
 * chat_reasoning belongs to one request.
 */
#ifndef DS_ENGINE_CHAT_H
#define DS_ENGINE_CHAT_H

#include "common/buf.h"
#include "common/status.h"

#include <stddef.h>

typedef enum chat_role {
	CHAT_ROLE_SYSTEM,
	CHAT_ROLE_USER,
	CHAT_ROLE_ASSISTANT,
	CHAT_ROLE_TOOL,
} chat_role;

/* "system" | "user" | "assistant" | "tool"; DS_EINVAL otherwise. */
int chat_role_parse(const char *s, chat_role *out, ds_err *err);

typedef struct chat_tool_call {
	const char *type;      /* "function" */
	const char *name;
	const char *arguments; /* JSON text, pasted verbatim */
} chat_tool_call;

typedef struct chat_msg {
	chat_role role;
	const char *content; /* NULL = none (an assistant turn with only tool calls) */
	const chat_tool_call *tool_calls; /* assistant only */
	size_t n_tool_calls;
} chat_msg;

typedef enum chat_template {
	CHAT_TMPL_UNKNOWN = 0,
	CHAT_TMPL_DEEPSEEK_V3,
	CHAT_TMPL_DEEPSEEK_R1,
	CHAT_TMPL_CHATML,  /* <|im_start|>role\ncontent<|im_end|>\n */
	CHAT_TMPL_SMOLLM2, /* ChatML + a default system message when the first is not one */
	CHAT_TMPL_LLAMA3,  /* <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> */
	CHAT_TMPL_COUNT
} chat_template;

/* The system message SmolLM2's template inserts. */
#define CHAT_SMOLLM2_SYSTEM "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

/* The template a chat_template text is (rule 2 above). */
chat_template chat_template_detect(const char *jinja);
/* "deepseek-v3", "deepseek-r1", "chatml", "smollm2", "llama3"; "unknown". */
const char *chat_template_name(chat_template t);
/* Rules 1-3 above; override and jinja may be NULL. */
int chat_template_choose(const char *override_name, const char *jinja, chat_template *out,
			 ds_err *err);

typedef struct chat_params {
	chat_template tmpl;
	const char *bos;           /* BOS text (DeepSeek, Llama 3); NULL = the template's own:
				    * "<｜begin▁of▁sentence｜>" / "<|begin_of_text|>" */
	int add_generation_prompt; /* end with the assistant prompt (not after tool output) */
} chat_params;

void chat_default_params(chat_params *p); /* V3, default BOS, generation prompt on */

struct tok;
/* Defaults, then the template of t (chat_template_choose with override_name and
 * the chat template t was loaded with: tokenizer_config.json's or GGUF
 * tokenizer.chat_template) and t's BOS text (borrowed from t). */
int chat_params_for_tok(const struct tok *t, const char *override_name, chat_params *p,
			ds_err *err);

/* Appends the rendered prompt to out.
 *
 * ChatML (the SmolLM2 template on the hub, rendered exactly):
 *   [SmolLM2, and messages[0] is not system: <|im_start|>system\n
 *    CHAT_SMOLLM2_SYSTEM<|im_end|>\n]
 *   each message  <|im_start|>role\ncontent<|im_end|>\n   (role: system, user,
 *                 assistant, tool; content verbatim)
 *   generation    <|im_start|>assistant\n
 * Llama 3 (the Meta-Llama-3-Instruct template):
 *   BOS before the first message (none when there are no messages)
 *   each message  <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
 *                 with content trimmed of leading and trailing whitespace as
 *                 jinja's `trim` does (Python str.strip)
 *   generation    <|start_header_id|>assistant<|end_header_id|>\n\n
 * Both: a NULL content renders as empty; tool calls are DS_EINVAL (these
 * templates have no tool-call format).
 *
 * DeepSeek V3 / R1 (spec §6.3):
 *   BOS, then every system content joined by "\n\n" (wherever they appear);
 *   user          <｜User｜>content
 *   assistant     <｜Assistant｜>content<｜end▁of▁sentence｜>
 *                 (after tool output the opening marker is <｜tool▁outputs▁end｜>;
 *                 R1 keeps only the text after the last "</think>")
 *   tool calls    <｜Assistant｜>[content]<｜tool▁calls▁begin｜> calls joined by
 *                 "\n", each <｜tool▁call▁begin｜>type<｜tool▁sep｜>name
 *                 "\n```json\n"args"\n```"<｜tool▁call▁end｜>, then
 *                 <｜tool▁calls▁end｜><｜end▁of▁sentence｜>
 *   tool          a run of tool messages is one block:
 *                 <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>c1<｜tool▁output▁end｜>
 *                 "\n"<｜tool▁output▁begin｜>c2<｜tool▁output▁end｜> ... closed by
 *                 <｜tool▁outputs▁end｜> before the next non-assistant turn or at the end
 *   generation    <｜Assistant｜> (V3) / <｜Assistant｜><think>\n (R1)
 * R1 joins system messages like V3 (the R1-Distill copy of the template keeps
 * only the last one; the spec leaves the 671B hub template open, §11).
 * Deliberate differences from the Dec-2024 hub V3 template, whose state flags
 * never reset: tool calls are always closed after the last call, and every
 * tool run opens its own block.  DS_EINVAL for an unknown template or a
 * message that makes no sense (tool calls on a user turn), DS_ERANGE past the
 * buf's cap (out is then back to its length at entry). */
int chat_render(const chat_params *p, const chat_msg *msgs, size_t n, buf *out, ds_err *err);

/* ---- R1 reasoning splitter ------------------------------------------------------
 *
 *      feed: ws* "<think>"                 feed: "</think>"
 *   START ───────────────────────► THINK ────────────────────► CONTENT
 *     │   (dropped)                  ▲   (dropped)                (all text
 *     └──── anything else ───────────┘                              to content)
 *           (kept, as reasoning)
 *
 * Text before "</think>" is reasoning (a leading "<think>", optionally after
 * whitespace, is dropped: R1 prompts end in "<think>\n" so the model usually
 * starts inside the block, but it may emit the marker itself); text after it is
 * content, verbatim (no trimming).  Bytes that could be the start of a marker
 * are held until the next chunk decides, so a marker cut anywhere across
 * chunks is still recognised and never leaks.  chat_reasoning_finish releases
 * what is held (as reasoning when the block never closed). */
typedef struct chat_reasoning {
	int state;
	char hold[32];
	size_t nhold;
} chat_reasoning;

void chat_reasoning_init(chat_reasoning *r);
/* Appends to reasoning / content; DS_ERANGE past a buf's cap. */
int chat_reasoning_feed(chat_reasoning *r, const char *text, size_t len, buf *reasoning,
			buf *content, ds_err *err);
int chat_reasoning_finish(chat_reasoning *r, buf *reasoning, buf *content, ds_err *err);
/* 1 once "</think>" was seen. */
int chat_reasoning_done(const chat_reasoning *r);

#endif

/*
 * chat.h - chat templates (DeepSeek-V3 / R1, ChatML, SmolLM2, Llama 3), tool
 * calls (rendered into the prompt, parsed out of the output) and the R1
 * reasoning splitter.
 *
 * chat_render turns a list of messages into the prompt text the model was
 * trained on (spec §6.3 for DeepSeek).  chat_render_ids renders AND encodes
 * it, and that is what a server must use: only the template's own markers
 * (<｜User｜>, <|im_end|>, the BOS text ...) become control tokens; message
 * contents, tool names, descriptions and arguments are encoded as plain text,
 * so a user who types "<｜Assistant｜>" or "<|im_end|>" gets those characters,
 * never the marker (encoding the whole text with TOK_PARSE_SPECIAL would let
 * any content close its turn or open a fake system turn).
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
 *        whose dated system block is not rendered here);
 *      - "<|im_start|>" and "<|im_end|>": ChatML; SmolLM2 when the text holds
 *        SmolLM2's default system message (CHAT_SMOLLM2_SYSTEM);
 *   3. anything else is DS_ENOTFOUND ("unknown chat template; pass an override").
 *
 * Tool calls (chat_tool_format_detect): the DeepSeek templates have their
 * markers (<｜tool▁calls▁begin｜> ...); ChatML / SmolLM2 use the Hermes
 * convention (<tool_call>{json}</tool_call>) only when the model's template
 * text mentions "tools" and "<tool_call>"; Llama 3 uses Llama 3.1-style JSON
 * calls only when its template text mentions "tools" and "ipython" (a Llama
 * 3.1+ model served with the override 'llama3'); every other template has no
 * tool format and chat_render refuses tools.  chat_calls parses a model's
 * output back into calls (below).
 *
 * chat_reasoning splits R1 output into reasoning_content and content while it
 * streams: see the struct below.  All functions are reentrant; a
 * chat_reasoning or chat_calls belongs to one request.
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

/* How the template lets the model call tools. */
typedef enum chat_tool_format {
	CHAT_TOOLS_NONE = 0, /* no format: tools are refused */
	CHAT_TOOLS_DEEPSEEK, /* <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>... */
	CHAT_TOOLS_HERMES,   /* <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> */
	CHAT_TOOLS_LLAMA3,   /* the whole answer is {"name": ..., "parameters": {...}} */
} chat_tool_format;

/* One function the model may call (validated by the caller: a non-empty name
 * without control characters). */
typedef struct chat_tool {
	const char *name;
	const char *description; /* NULL = none */
	const char *parameters;  /* JSON object text, pasted verbatim; NULL = none */
} chat_tool;

typedef enum chat_tool_choice {
	CHAT_CHOICE_AUTO = 0, /* the model decides */
	CHAT_CHOICE_NONE,     /* tools are not shown and no call is parsed */
	CHAT_CHOICE_REQUIRED, /* the prompt ends with the opening of a call */
	CHAT_CHOICE_NAMED,    /* ... of a call of tool_name, up to its arguments */
} chat_tool_choice;

/* The system message SmolLM2's template inserts. */
#define CHAT_SMOLLM2_SYSTEM "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

/* The template a chat_template text is (rule 2 above). */
chat_template chat_template_detect(const char *jinja);
/* "deepseek-v3", "deepseek-r1", "chatml", "smollm2", "llama3"; "unknown". */
const char *chat_template_name(chat_template t);
/* Rules 1-3 above; override and jinja may be NULL. */
int chat_template_choose(const char *override_name, const char *jinja, chat_template *out,
			 ds_err *err);
/* The tool format of template t whose model ships the template text jinja
 * (NULL = none: only the DeepSeek templates then have one). */
chat_tool_format chat_tool_format_detect(chat_template t, const char *jinja);
/* "deepseek", "hermes", "llama3-json"; "none". */
const char *chat_tool_format_name(chat_tool_format f);

typedef struct chat_params {
	chat_template tmpl;
	const char *bos;           /* BOS text (DeepSeek, Llama 3); NULL = the template's own:
				    * "<｜begin▁of▁sentence｜>" / "<|begin_of_text|>" */
	int add_generation_prompt; /* end with the assistant prompt (not after tool output) */
	chat_tool_format tool_format; /* of the model (chat_tool_format_detect) */
	/* Per request: the tools shown to the model and the choice.  Tools are
	 * rendered when n_tools > 0 and tool_choice is not NONE; REQUIRED and
	 * NAMED also end the generation prompt with the opening of a call. */
	const chat_tool *tools;
	size_t n_tools;
	chat_tool_choice tool_choice;
	const char *tool_name; /* NAMED: one of tools[] */
} chat_params;

/* V3, default BOS, generation prompt on, DeepSeek tool format, no tools. */
void chat_default_params(chat_params *p);

struct tok;
struct tok_ids;
/* Defaults, then the template of t (chat_template_choose with override_name and
 * the chat template t was loaded with: tokenizer_config.json's or GGUF
 * tokenizer.chat_template), its tool format and t's BOS text (borrowed from
 * t). */
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
 * Both: a NULL content renders as empty; without a tool format tool calls are
 * DS_EINVAL.
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
 * tool run opens its own block.
 *
 * Tools (docs/serving.md shows each block whole).  The official V3 template
 * renders no tool list (R1 is rendered the same way), so the list is one
 * more system content after the client's (joined with "\n\n" like them):
 *   "## Tools\n\nYou can call these functions:\n", per tool "\n### NAME\n"
 *   ["Description: DESC\n"] "Parameters: PARAMS\n" (PARAMS "{}" when none),
 *   then CHAT_DEEPSEEK_TOOLS_HOWTO (which names the call markers).
 * Hermes: the system turn (the client's first system message, or
 * SmolLM2's default one, else a new one) ends with "\n\n" (when it has
 * content) and "# Tools\n\n..." (CHAT_HERMES_TOOLS_HEAD, one compact
 * {"type":"function","function":{...}} line per tool, CHAT_HERMES_TOOLS_TAIL);
 * assistant calls are [content "\n"]<tool_call>\n{"name": NAME, "arguments":
 * ARGS}\n</tool_call> joined by "\n"; a run of tool messages is one user
 * turn of "\n<tool_response>\nCONTENT\n</tool_response>" each.
 * Llama 3 JSON: the system turn likewise holds CHAT_LLAMA3_TOOLS_HEAD and one
 * compact tool JSON per line; assistant calls are {"name": NAME,
 * "parameters": ARGS} joined by "; "; tool messages are ipython turns
 * (content not trimmed).
 * tool_choice REQUIRED ends the generation prompt with the opening of a call
 * (DeepSeek <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>,
 * with no <think> for R1; Hermes <tool_call>\n; Llama {"name": "), NAMED
 * with the call up to its arguments (DeepSeek NAME"\n```json\n", Hermes
 * {"name": "NAME", "arguments": , Llama {"name": "NAME", "parameters": ).
 *
 * DS_EINVAL for an unknown template or a message that makes no sense (tool
 * calls on a user turn), DS_EUNSUPPORTED for tools or tool calls the
 * template has no format for, DS_ERANGE past the buf's cap (out is then back
 * to its length at entry). */
int chat_render(const chat_params *p, const chat_msg *msgs, size_t n, buf *out, ds_err *err);

/* Renders as chat_render and appends the ids of the prompt to ids: each
 * marker the template itself wrote (BOS, role and turn markers, tool-call
 * markers) that t has as an added token becomes that token; everything
 * between two such markers (template text and message contents alike) is
 * encoded as plain text, so no added token can come out of it.  For
 * ordinary contents the ids equal those of the whole text encoded with
 * TOK_PARSE_SPECIAL (what Hugging Face's apply_chat_template gives), added
 * tokens with lstrip/rstrip aside (none of the supported families has
 * one as a marker).  text (may be NULL) receives the rendered text.  Errors
 * as chat_render and tok_encode; on failure ids and text are back to their
 * length at entry. */
int chat_render_ids(const chat_params *p, const struct tok *t, const chat_msg *msgs, size_t n,
		    struct tok_ids *ids, buf *text, ds_err *err);

/* Appends the opening of a call that chat_render ends the generation prompt
 * with (tool_choice REQUIRED or NAMED; nothing otherwise): a parser of the
 * output is fed it first.  DS_ERANGE past the cap (out unchanged). */
int chat_call_opening(const chat_params *p, buf *out, ds_err *err);
/* The markers of tool format f that a model writes in its calls (for a
 * decoder that skips special tokens: these must reach the parser); *n set. */
const char *const *chat_tool_markers(chat_tool_format f, size_t *n);

/* The fixed prose of the tool blocks (chat_render above). */
#define CHAT_DEEPSEEK_TOOLS_HOWTO                                                                 \
	"\nTo call functions, answer with <｜tool▁calls▁begin｜>, then for each call "              \
	"<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGUMENTS\n```<｜tool▁call▁end｜> " \
	"(calls separated by a newline), then <｜tool▁calls▁end｜>. NAME is one of the functions "  \
	"above; ARGUMENTS is a JSON object that follows its parameters."
#define CHAT_HERMES_TOOLS_HEAD                                                                    \
	"# Tools\n\nYou can call the functions whose signatures are inside <tools></tools>:\n"      \
	"<tools>\n"
#define CHAT_HERMES_TOOLS_TAIL                                                                    \
	"</tools>\n\nFor each call, answer with a JSON object holding the function's name and its " \
	"arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": NAME, "            \
	"\"arguments\": ARGUMENTS}\n</tool_call>"
#define CHAT_LLAMA3_TOOLS_HEAD                                                                    \
	"You can call the functions below. To call one, answer with only a JSON object "           \
	"{\"name\": NAME, \"parameters\": ARGUMENTS}, where ARGUMENTS is a JSON object that "       \
	"follows its parameters.\n\n"

/* ---- tool-call parser -------------------------------------------------------------
 *
 * Splits a model's output (after the reasoning splitter, R1) into content and
 * calls while it streams.  A call is released only once it is whole and
 * well-formed: its name is one of the request's tools and its arguments a
 * JSON object.  So a streamed answer and an unstreamed one hold the same
 * calls, and nothing released is ever taken back.  Anything malformed (a
 * marker out of place, a call cut short by the end of the output, bad JSON,
 * an unknown name) is released as content, verbatim, and all output after it
 * is content too.
 *
 *   DeepSeek  TEXT ──"<｜tool▁calls▁begin｜>"──> BLOCK ──"<｜tool▁calls▁end｜>"──> AFTER
 *             (content;  markers      (calls, each       (content)
 *             cut across  held)        released at
 *             chunks are              <｜tool▁call▁end｜>)
 *   Hermes    TEXT ──"<tool_call>"──> CALL ──"</tool_call>"──> TEXT (whitespace
 *             between and after calls is dropped)
 *   Llama 3   START ──ws* "{" or "<|python_tag|>"──> JSON (held to the end: the
 *             whole output must be calls separated by ";") ; anything else
 *             ──> plain content
 *   any ──malformed──> PLAIN (everything is content)
 *
 * Text that could still begin a marker is held until the next chunk decides.
 * Forced call openings (tool_choice required / named) are fed first with
 * chat_calls_feed, as if the model had written them.  Caps: the held text
 * and the calls' text are at most max_text bytes, at most CHAT_MAX_CALLS
 * calls: past either the rest is content. */
#define CHAT_MAX_CALLS 128

typedef struct chat_call {
	char *name;      /* owned */
	char *arguments; /* owned: JSON object text (DeepSeek: as written, trimmed;
			  * Hermes / Llama: re-written compact) */
} chat_call;

typedef struct chat_calls {
	chat_tool_format fmt;
	const chat_tool *tools; /* borrowed: the names a call may have */
	size_t n_tools;
	int state;
	buf hold;       /* output not released yet */
	size_t pos;     /* BLOCK: where the next call starts in hold */
	size_t scan;    /* where the search for the closing marker resumes */
	int after_call; /* Hermes: whitespace after a call is dropped */
	size_t max_text;
	chat_call *calls;
	size_t n_calls;
	size_t text_bytes; /* of names and arguments, against max_text */
} chat_calls;

/* max_text 0 = 64 MiB.  tools must outlive p. */
void chat_calls_init(chat_calls *p, chat_tool_format fmt, const chat_tool *tools, size_t n_tools,
		     size_t max_text);
void chat_calls_free(chat_calls *p); /* NULL is a no-op */
/* Appends what is sure to be content to content and records finished calls
 * in p->calls; DS_ERANGE past content's cap, DS_ENOMEM. */
int chat_calls_feed(chat_calls *p, const char *text, size_t len, buf *content, ds_err *err);
/* The output ended: what is held becomes content, unless it finishes calls
 * (a DeepSeek block whose calls all closed needs no <｜tool▁calls▁end｜>; the
 * Llama JSON is parsed here). */
int chat_calls_finish(chat_calls *p, buf *content, ds_err *err);

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

"""Tool calls through the official `openai` SDK against real agents
(docs/serving.md, "Tool calls").

- The prompt: POST /tokenize with messages + tools equals a reference built
  here from the official DeepSeek-V3 template (tokenizer_config.json,
  rendered by jinja2) with the documented tool block as one more system
  message, and, for tool_choice required / named, the documented call
  opening after the generation prompt (reference_ids of
  test_control_tokens.py: template markers as their ids, contents as plain
  text).
- The output: a tiny V3 whose weights script its greedy output (a bigram
  model: every layer adds nothing, the embedding of a token of a chain
  points the head at the next one), so the real engine writes a known call
  or a known malformed one; the answers, streamed (accumulated by the SDK's
  stream helper) and not, are checked against what the script wrote.
- Validation 400s naming the field, and the default model (SmolLM2, whose
  template has no tool format) refusing tools.
The parser itself (every cut of complete, split and malformed outputs) is
tested in tests/unit/test_chat_calls.c."""
import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest

from conftest import ROOT, start_agent
from tests.fixtures import safetensors_io as st
from tests.fixtures.shared import shared_data
from tests.fixtures.tiny_models import read_all, write_model

sys.path.insert(0, str(ROOT / "tests" / "integration"))
from test_control_tokens import BOS, DEFAULT, reference_ids  # noqa: E402

A = "<｜Assistant｜>"
CSB, CSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
HOWTO = ("\nTo call functions, answer with <｜tool▁calls▁begin｜>, then for each call "
         "<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGUMENTS\n```<｜tool▁call▁end｜> "
         "(calls separated by a newline), then <｜tool▁calls▁end｜>. NAME is one of the functions "
         "above; ARGUMENTS is a JSON object that follows its parameters.")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city <｜tool▁sep｜> today",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "Weather in Paris?"}]
SCRIPTED_ARGS = '{"city":"Paris"}'
MALFORMED = f"{CSB}{CB}function{SEP}get_weather"


def tools_block(tools):
    """The documented DeepSeek tool block, contents through sentinel."""
    def block(sentinel):
        s = "## Tools\n\nYou can call these functions:\n"
        for t in tools:
            f = t["function"]
            s += f"\n### {sentinel(f['name'])}\n"
            if f.get("description") is not None:
                s += f"Description: {sentinel(f['description'])}\n"
            params = f.get("parameters")
            s += "Parameters: " + (sentinel(json.dumps(params, ensure_ascii=False, separators=(",", ":")))
                                   if params is not None else "{}") + "\n"
        return s + HOWTO
    return block


def call_opening(name=None):
    def opening(sentinel):
        return f"{CSB}{CB}function{SEP}" + (sentinel(name + "\n```json\n") if name else "")
    return opening


def post(agent, path, body, status=200):
    req = urllib.request.Request(agent.api_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            got, doc = r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        got, doc = e.code, json.loads(e.read())
    assert got == status, doc
    return doc


def client(agent):
    return openai.OpenAI(base_url=agent.api_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


# ---- the scripted model ----------------------------------------------------------------

def tokenizers_of(d):
    from tokenizers import Tokenizer
    tokjson = json.loads((d / "tokenizer.json").read_text())
    return (Tokenizer.from_str(json.dumps(tokjson)),
            Tokenizer.from_str(json.dumps({**tokjson, "added_tokens": []})))


def script(d):
    """{token: next token} of the chains the model follows greedily."""
    full, plain = tokenizers_of(d)
    enc = lambda s: plain.encode(s, add_special_tokens=False).ids  # noqa: E731
    tid = full.token_to_id
    eos = 1
    chains = [
        # tool_choice named: the prompt ends with ...get_weather\n```json\n
        [enc("get_weather\n```json\n")[-1], *enc(SCRIPTED_ARGS + "\n```"), tid(CE), tid(CSE), eos],
        # after <｜Assistant｜> (auto, no tools) and after <｜tool▁sep｜> (required):
        # a call cut short, so malformed
        [tid(A), tid(CSB), tid(CB), *enc("function"), tid(SEP), *enc("get_weather"), eos],
        # R1 (prompt ending in <think>\n): reasoning, then the malformed call
        [enc("<think>\n")[-1], *enc("hm</think>"), tid(CSB)],
    ]
    nxt = {}
    for c in chains:
        for a, b in zip(c, c[1:]):
            assert nxt.setdefault(a, b) == b, f"token {a} would have two successors"
    return nxt


def write_scripted(d, nxt):
    """Every layer adds nothing (o_proj and down projections zero), token a of
    the script embeds as basis vector i(a), and the head's row of its
    successor reads that coordinate: greedy decoding follows the script."""
    cfg, tensors, _, index = read_all(d)
    keys = sorted(nxt)
    assert len(keys) <= cfg["hidden_size"]
    col = {a: i for i, a in enumerate(keys)}
    one, ten = st.bf16_encode([1.0, 10.0])
    t = {k: st.Tensor(v.dtype, v.data.copy()) for k, v in tensors.items()}
    for name, v in t.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            v.data[...] = 0
    emb, head = t["model.embed_tokens.weight"].data, t["lm_head.weight"].data
    head[:, :len(keys)] = 0
    for a, b in nxt.items():
        emb[a, :] = 0
        emb[a, col[a]] = one
        head[b, col[a]] = ten
    by_file = {}
    for name, f in index["weight_map"].items():
        by_file.setdefault(f, {})[name] = t[name]
    for f, part in by_file.items():
        st.write_file(d / f, part, {"format": "pt"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    src = shared_data("deepseek-v3/tokenizer.json").parent
    d = write_model("v3", tmp_path_factory.mktemp("toolv3") / "m",
                    overrides={"vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1,
                               "max_position_embeddings": 2048})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    write_scripted(d, script(d))
    return d


def serve(tmp_path_factory, d, *extra):
    a = start_agent(tmp_path_factory.mktemp("toolagent"), "--model", str(d), "--threads", "2",
                    "--ctx", "2048", "--insecure-no-auth", *extra)
    a.wait_serving(timeout=120)
    a.dir = d
    return a


@pytest.fixture(scope="module")
def v3(tmp_path_factory, model_dir):
    a = serve(tmp_path_factory, model_dir)
    yield a
    assert a.stop() == 0, a.log_tail()


@pytest.fixture(scope="module")
def r1(tmp_path_factory, model_dir):
    a = serve(tmp_path_factory, model_dir, "--chat-template", "deepseek-r1")
    yield a
    assert a.stop() == 0, a.log_tail()


# ---- the prompt ------------------------------------------------------------------------

def reference(agent, msgs, tools, opening=None):
    cfg = json.loads((agent.dir / "tokenizer_config.json").read_text())
    tokjson = json.loads((agent.dir / "tokenizer.json").read_text())
    return reference_ids(cfg["chat_template"], tokjson, msgs, BOS, tools_block(tools), opening)


def test_prompt_with_tools_is_the_documented_one(v3):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
        {"role": "assistant", "content": "18C at noon."},
        {"role": "user", "content": "And tomorrow?"}]
    for msgs in (ASK, history):
        want, _ = reference(v3, msgs, TOOLS)
        assert post(v3, "/tokenize", {"messages": msgs, "tools": TOOLS})["tokens"] == want
        assert post(v3, "/tokenize", {"messages": msgs, "tools": TOOLS,
                                      "tool_choice": "auto"})["tokens"] == want
    # no system message of the client: the block is the whole system prompt
    want, _ = reference(v3, ASK[1:], [TIME])
    assert post(v3, "/tokenize", {"messages": ASK[1:], "tools": [TIME]})["tokens"] == want
    # required / named: the generation prompt ends with the opening of a call
    want, _ = reference(v3, ASK, TOOLS, call_opening())
    got = post(v3, "/tokenize", {"messages": ASK, "tools": TOOLS, "tool_choice": "required"})
    assert got["tokens"] == want and got["tokens"][-1] == 128814  # <｜tool▁sep｜>
    named = {"type": "function", "function": {"name": "get_weather"}}
    want, _ = reference(v3, ASK, TOOLS, call_opening("get_weather"))
    assert post(v3, "/tokenize", {"messages": ASK, "tools": TOOLS,
                                  "tool_choice": named})["tokens"] == want
    # none: the model is not shown the tools
    plain = post(v3, "/tokenize", {"messages": ASK})["tokens"]
    assert post(v3, "/tokenize", {"messages": ASK, "tools": TOOLS,
                                  "tool_choice": "none"})["tokens"] == plain
    assert len(plain) < len(want)


# ---- the output ------------------------------------------------------------------------

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_call_non_streamed_and_streamed(v3):
    c = client(v3)
    r = c.chat.completions.create(model=v3.model, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                  temperature=0, max_tokens=40)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and call.function.arguments == SCRIPTED_ARGS
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # generated: the arguments and the fence (6 tokens), the two closing markers, EOS
    assert r.usage.completion_tokens == 9
    # the SDK's stream helper accumulates the deltas into the same message
    with c.chat.completions.stream(model=v3.model, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                   temperature=0, max_tokens=40) as s:
        chunks = []
        for ev in s:
            if ev.type == "chunk":
                chunks.append(ev.chunk)
        final = s.get_final_completion()
    fch = final.choices[0]
    assert fch.finish_reason == "tool_calls"
    assert not fch.message.content
    (fcall,) = fch.message.tool_calls
    assert (fcall.function.name, fcall.function.arguments) == ("get_weather", SCRIPTED_ARGS)
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == SCRIPTED_ARGS
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    # n = 2: each choice its own call
    r2 = c.chat.completions.create(model=v3.model, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                   temperature=0, max_tokens=40, n=2)
    assert [x.message.tool_calls[0].function.arguments for x in r2.choices] == [SCRIPTED_ARGS] * 2
    assert r2.choices[0].message.tool_calls[0].id != r2.choices[1].message.tool_calls[0].id


def test_malformed_call_comes_back_as_content(v3):
    c = client(v3)
    usage = []
    for kw in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "required"}):
        r = c.chat.completions.create(model=v3.model, messages=ASK, temperature=0, max_tokens=40, **kw)
        usage.append((r.usage.prompt_tokens, r.usage.completion_tokens))
        ch = r.choices[0]
        # auto: the model wrote the whole opening; required: the prompt held it
        # and the model wrote the name: either way the call is cut short
        assert ch.message.content == MALFORMED, kw
        assert ch.message.tool_calls is None and ch.finish_reason == "stop"
        chunks = list(c.chat.completions.create(model=v3.model, messages=ASK, temperature=0,
                                                max_tokens=40, stream=True, **kw))
        assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == MALFORMED
        assert not any(x.choices[0].delta.tool_calls for x in chunks if x.choices)
    # required: 4 tokens of the opening moved from the output (auto: <｜tool▁calls▁begin｜>
    # <｜tool▁call▁begin｜> function <｜tool▁sep｜> get _ weather EOS) into the prompt
    assert usage[1] == (usage[0][0] + 4, usage[0][1] - 4) and usage[0][1] == 8
    # no tools: the same text is plain content too, never parsed
    r = c.chat.completions.create(model=v3.model, messages=ASK, temperature=0, max_tokens=40)
    assert r.choices[0].message.content == MALFORMED and r.choices[0].finish_reason == "stop"


def test_r1_calls_come_from_the_content_after_the_reasoning(r1):
    c = client(r1)
    r = c.chat.completions.create(model=r1.model, messages=ASK, tools=TOOLS, temperature=0,
                                  max_tokens=40)
    msg = r.model_dump()["choices"][0]["message"]
    assert msg["reasoning_content"] == "hm" and msg["content"] == MALFORMED
    assert msg["tool_calls"] is None
    # a named call skips the reasoning: the prompt opens the call right away
    ids = post(r1, "/tokenize", {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED})["tokens"]
    text = post(r1, "/detokenize", {"tokens": ids})["prompt"]
    assert text.endswith("Weather in Paris?" + A + CSB + CB + "function" + SEP + "get_weather\n```json\n")
    assert ids[-12:-8] == [128804, 128806, 128808, 8701]  # <｜Assistant｜><｜tool▁calls▁begin｜>...function
    r = c.chat.completions.create(model=r1.model, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                  temperature=0, max_tokens=40)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.arguments == SCRIPTED_ARGS and r.choices[0].finish_reason == "tool_calls"


# ---- refusals --------------------------------------------------------------------------

BAD = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [7]}, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [TIME, {"type": "function", "function": {"description": "x"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [TIME, TIME]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "tools[0].function.description"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"type": "code", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[2].tool_calls[0]"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[2].tool_calls[0]"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_tools_are_400_naming_the_field(v3, extra, param):
    for path in ("/v1/chat/completions", "/tokenize"):
        e = post(v3, path, {"messages": ASK, "max_tokens": 1, **extra}, status=400)["error"]
        assert e["param"] == param and e["type"] == "invalid_request_error", e


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    if not DEFAULT.exists():
        pytest.skip("models/default.gguf missing: make model")
    a = start_agent(tmp_path_factory.mktemp("toolsmol"), "--model", str(DEFAULT), "--threads", "2",
                    "--insecure-no-auth")
    a.wait_serving(timeout=120)
    yield a
    assert a.stop() == 0, a.log_tail()


def test_default_model_refuses_tools(smol):
    c = client(smol)
    for choice in ("auto", "required", NAMED):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=smol.model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                      max_tokens=4)
        assert e.value.body["param"] == "tools"
        assert "smollm2" in e.value.body["message"] and "no tool-call format" in e.value.body["message"]
    # tool_choice none: the tools are not shown, the request is served
    r = c.chat.completions.create(model=smol.model, messages=ASK, tools=TOOLS, tool_choice="none",
                                  max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls is None
    plain = post(smol, "/tokenize", {"messages": ASK})["tokens"]
    assert post(smol, "/tokenize", {"messages": ASK, "tools": TOOLS,
                                    "tool_choice": "none"})["tokens"] == plain
    # a tool call in the history has no format either
    hist = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
    e = post(smol, "/tokenize", {"messages": hist}, status=400)["error"]
    assert e["param"] == "messages" and "no format for tool calls" in e["message"]


HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools: signatures in <tools></tools>, calls in "
    "<tool_call></tool_call><|im_end|>\\n' }}{%- endif %}{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    """The default model with a ChatML template that mentions tools and
    <tool_call>: the Hermes format."""
    if not DEFAULT.exists():
        pytest.skip("models/default.gguf missing: make model")
    d = tmp_path_factory.mktemp("hermes")
    (d / "t.jinja").write_text(HERMES_TEMPLATE)
    r = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--chat-template-file",
                        str(d / "t.jinja"), str(DEFAULT), str(d / "h.gguf")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    a = start_agent(d, "--model", str(d / "h.gguf"), "--threads", "2", "--insecure-no-auth")
    a.wait_serving(timeout=120)
    yield a
    assert a.stop() == 0, a.log_tail()


def hermes_prompt(msgs, tools, opening):
    """The documented Hermes rendering (docs/serving.md) of a conversation
    without system message."""
    lines = "".join(json.dumps(t, ensure_ascii=False, separators=(",", ":")) + "\n" for t in tools)
    s = ("<|im_start|>system\n# Tools\n\nYou can call the functions whose signatures are inside "
         "<tools></tools>:\n<tools>\n" + lines + "</tools>\n\nFor each call, answer with a JSON object "
         "holding the function's name and its arguments inside <tool_call></tool_call> tags:\n"
         "<tool_call>\n{\"name\": NAME, \"arguments\": ARGUMENTS}\n</tool_call><|im_end|>\n")
    for m in msgs:
        s += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return s + "<|im_start|>assistant\n" + opening


def test_hermes_format_on_a_chatml_model_whose_template_mentions_tools(hermes):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [WEATHER]
    for choice, opening in (("auto", ""), ("required", "<tool_call>\n"),
                            (NAMED, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ")):
        ids = post(hermes, "/tokenize", {"messages": msgs, "tools": tools, "tool_choice": choice})["tokens"]
        assert post(hermes, "/detokenize", {"tokens": ids})["prompt"] == hermes_prompt(msgs, tools, opening)
    # the model (not trained for tools) answers something; streamed and not, the same
    c = client(hermes)
    for choice in ("auto", "required", NAMED):
        kw = dict(model=hermes.model, messages=msgs, tools=tools, tool_choice=choice, temperature=0,
                  max_tokens=48)
        r = c.chat.completions.create(**kw).choices[0]
        content, calls, finish = "", {}, None
        for ch in c.chat.completions.create(stream=True, **kw):
            d = ch.choices[0].delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                got = calls.setdefault(tc.index, ["", ""])
                got[0] += tc.function.name or ""
                got[1] += tc.function.arguments or ""
            finish = ch.choices[0].finish_reason or finish
        assert content == (r.message.content or "") and finish == r.finish_reason
        assert [tuple(calls[k]) for k in sorted(calls)] == \
               [(x.function.name, x.function.arguments) for x in r.message.tool_calls or []]
        for call in r.message.tool_calls or []:
            assert call.function.name == "get_weather"
            assert isinstance(json.loads(call.function.arguments), dict)
        if choice != "auto" and not r.message.tool_calls:  # malformed: the opening is content too
            assert r.message.content.startswith("<tool_call>\n")

"""The OpenAI API through the official `openai` Python SDK, against a real
dsagent on loopback serving the embedded default model (SmolLM2-135M-Instruct
Q4_1).  Keys are created with `dsctl keys` over the control API, exactly as an
operator does.  Numbers are checked against independent computations: the
same request unstreamed, dsrun's logits, the tokenizer endpoint."""
import json
import subprocess
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from conftest import ROOT, binary, start_agent

MODEL = ROOT / "models" / "default.gguf"
pytestmark = pytest.mark.skipif(not MODEL.exists(), reason="models/default.gguf missing: make model")

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def dsctl(agent, *args):
    r = subprocess.run([binary("dsctl"), "--agent", agent.url, "--data-dir", str(agent.data_dir),
                        *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def create_key(agent, name, *limits):
    doc = json.loads(dsctl(agent, "--json", "keys", "create", name, *limits))
    assert doc["key"].startswith("dsk-") and doc["name"] == name
    return doc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    a = start_agent(tmp_path_factory.mktemp("srv"), "--threads", "2", "--max-logprobs", "20")
    a.wait_serving()
    a.key = create_key(a, "tests")["key"]
    yield a
    assert a.stop() == 0


def client(server, key=None, **kw):
    return openai.OpenAI(base_url=server.api_url + "/v1",
                         api_key=key if key is not None else server.key, max_retries=0,
                         timeout=120, **kw)


def test_models_list(server):
    models = client(server).models.list()
    ids = [m.id for m in models.data]
    assert ids == [server.model]


def test_chat_answers_and_counts_usage(server):
    r = client(server).chat.completions.create(model=server.model, messages=FRANCE,
                                               max_tokens=32, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.prompt_tokens > 5 and u.completion_tokens >= 1
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"


def test_model_may_be_omitted_and_content_parts_equal_string(server):
    c = client(server)
    a = c.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=16,
                                  temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": FRANCE[0]["content"]}]}]
    b = c.chat.completions.with_raw_response.create(
        model=server.model, messages=parts, max_tokens=16, temperature=0,
        extra_body={"lora_path": None, "best_of": 1, "unknown_field": {"x": 1}})
    assert b.parse().choices[0].message.content == a.choices[0].message.content
    # "model" missing: the server's default model (vLLM's behaviour)
    raw = c.post("/chat/completions", cast_to=object,
                 body={"messages": FRANCE, "max_tokens": 16, "temperature": 0})
    assert raw["choices"][0]["message"]["content"] == a.choices[0].message.content
    assert raw["model"] == server.model


def test_stream_equals_non_stream_and_usage_chunk(server):
    c = client(server)
    whole = c.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=40,
                                      temperature=0)
    chunks = list(c.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=40,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] == "stop" and all(f is None for f in finish[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({ch.id for ch in chunks}) == 1
    # without include_usage no chunk has empty choices (SGLang's bench indexes choices[0])
    plain = list(c.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=8,
                                           temperature=0, stream=True))
    assert all(ch.choices for ch in plain)


def test_completions_exact_length_with_ignore_eos(server):
    c = client(server)
    r = c.completions.create(model=server.model, prompt="Once upon a time", max_tokens=24,
                             temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    s = list(c.completions.create(model=server.model, prompt="Once upon a time", max_tokens=24,
                                  temperature=0, stream=True,
                                  stream_options={"include_usage": True},
                                  extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == r.choices[0].text
    assert s[-1].usage.completion_tokens == 24
    # max_completion_tokens (chat) is exact too
    ch = c.chat.completions.create(model=server.model, messages=FRANCE,
                                   max_completion_tokens=11, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert ch.usage.completion_tokens == 11 and ch.choices[0].finish_reason == "length"


def test_default_completion_length_is_16(server):
    r = client(server).completions.create(model=server.model, prompt="The numbers: 1, 2, 3,",
                                          temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_n_choices_and_seed(server):
    c = client(server)
    kw = dict(model=server.model, messages=[{"role": "user", "content": "Tell me a story."}],
              max_tokens=24, temperature=1.0, seed=1234)
    kw["extra_body"] = {"ignore_eos": True}
    a = c.chat.completions.create(n=2, **kw)
    assert [ch.index for ch in a.choices] == [0, 1]
    assert a.usage.completion_tokens == 48  # both choices counted, prompt once
    b = c.chat.completions.create(n=2, **kw)
    assert [ch.message.content for ch in a.choices] == [ch.message.content for ch in b.choices]
    others = {c.chat.completions.create(**{**kw, "seed": s}).choices[0].message.content
              for s in (1, 2, 3)}
    assert len(others) > 1, "different seeds gave identical samples"
    # streamed n=2: each index gets its own role chunk and finish
    chunks = list(c.chat.completions.create(n=2, stream=True, **kw))
    for i in (0, 1):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason is not None
        assert "".join(x.delta.content or "" for x in mine) == a.choices[i].message.content


def test_stop_strings_trim_output(server):
    c = client(server)
    base = c.completions.create(model=server.model, prompt="The days of the week are",
                                max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert len(text) > 12
    stop = text[8:11]  # a cut in the middle of the output
    cut = text.index(stop)
    r = c.completions.create(model=server.model, prompt="The days of the week are",
                             max_tokens=40, temperature=0, stop=[stop, "@@never@@"],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:cut] and r.choices[0].finish_reason == "stop"
    s = list(c.completions.create(model=server.model, prompt="The days of the week are",
                                  max_tokens=40, temperature=0, stop=stop, stream=True,
                                  extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in s) == text[:cut]
    assert s[-1].choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < base.usage.completion_tokens


def tokenize(server, text=None, messages=None, ids=None):
    """POST /tokenize (text or chat messages) or, with ids, /detokenize."""
    body = {"tokens": ids} if ids is not None else \
        {"messages": messages} if messages is not None else {"prompt": text}
    req = urllib.request.Request(server.api_url + ("/detokenize" if ids else "/tokenize"),
                                 method="POST", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + server.key,
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        doc = json.loads(r.read())
    return doc["prompt"] if ids is not None else doc["tokens"]


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def test_logprobs_match_dsrun_logits(server, tmp_path):
    c = client(server)
    ids = tokenize(server, "The capital of Italy is")
    r = c.completions.create(model=server.model, prompt=ids, max_tokens=4, temperature=0,
                             logprobs=3, extra_body={"ignore_eos": True,
                                                      "return_token_ids": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and len(lp.top_logprobs) == 4
    # the generated ids, recovered by tokenizing the text piece by piece is fragile:
    # ask for the same greedy ids through dsrun instead
    out = subprocess.run([binary("dsrun"), "-m", str(MODEL), "--tokens", ",".join(map(str, ids)),
                          "-n", "4", "--temp", "0", "--ids", "--ignore-eos", "--threads", "2"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    gen = json.loads(out.stdout)
    full = ids + gen[:3]
    f = tmp_path / "logits.f32"
    out = subprocess.run([binary("dsrun"), "-m", str(MODEL), "--tokens", ",".join(map(str, full)),
                          "--dump-logits", str(f), "--threads", "2"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    logits = np.fromfile(f, dtype="<f4").reshape(len(full), -1)
    for k in range(4):
        ref = log_softmax(logits[len(ids) - 1 + k])
        assert abs(lp.token_logprobs[k] - ref[gen[k]]) < 2e-3, (k, lp.token_logprobs[k], ref[gen[k]])
        top = sorted(lp.top_logprobs[k].values(), reverse=True)
        want = np.sort(ref)[::-1][:3]
        assert np.allclose(top, want, atol=2e-3), (k, top, want)
    # chat form: content entries with top_logprobs, greedy token is the best one
    ch = c.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=6,
                                   temperature=0, logprobs=True, top_logprobs=5)
    content = ch.choices[0].logprobs.content
    assert len(content) == ch.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 5 and e.logprob <= 0
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6
        assert sum(np.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-4
        assert bytes(e.bytes).decode("utf-8", "replace") != "" or e.token == ""


def test_error_statuses_map_to_sdk_exceptions(server):
    c = client(server)
    with pytest.raises(openai.AuthenticationError):
        client(server, key="dsk-not-a-real-key").chat.completions.create(
            model=server.model, messages=FRANCE, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):  # well-formed but unknown
        client(server, key="dsk-" + "A" * 43).completions.create(model=server.model, prompt="x",
                                                                 max_tokens=2)
    req = urllib.request.Request(server.api_url + "/v1/completions", method="POST",
                                 data=b'{"prompt":"x"}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:  # no Authorization header at all
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401
    assert json.loads(e.value.read())["error"]["type"] == "authentication_error"
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="no-such-model", messages=FRANCE, max_tokens=4)
    assert e.value.body["param"] == "model" and "no-such-model" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=FRANCE, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=[], max_tokens=4)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=server.model, prompt="hello", max_tokens=100000)
    msg = e.value.body["message"]
    assert "4096" in msg and "100000" in msg and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model=server.model, prompt="x" * (3 << 20), max_tokens=2)
    assert e.value.status_code == 413
    # and the server still serves
    assert c.completions.create(model=server.model, prompt="Hi", max_tokens=2).usage


def admin_post(agent, path, doc):
    token = (agent.data_dir / "admin.token").read_text().strip()
    return agent.get(path, "POST", json.dumps(doc).encode(),
                     {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})


def test_fault_route_exists_only_with_the_flag(server):
    status, body = admin_post(server, "/v1/test/fail-steps", {"steps": 1})
    assert status == 404 and "--test-fault-injection" in body["error"]["message"]


def test_engine_failure_is_500_and_the_server_recovers(tmp_path):
    """An engine step that fails (the test-only switch POST /v1/test/fail-steps
    on the control API, as a forward error would) ends the requests in it: a
    500 with a nested error object (openai.InternalServerError), or an error
    event in a stream that already started (openai.APIError); the next
    requests are served as usual."""
    a = start_agent(tmp_path, "--threads", "2", "--test-fault-injection")
    try:
        a.wait_serving()
        c = openai.OpenAI(base_url=a.api_url + "/v1", api_key=create_key(a, "t")["key"],
                          max_retries=0, timeout=120)
        status, body = admin_post(a, "/v1/test/fail-steps", {"steps": -1})
        assert status == 400 and body["error"]["param"] == "steps"
        ok = c.chat.completions.create(model=a.model, messages=FRANCE, max_tokens=8,
                                       temperature=0)
        assert admin_post(a, "/v1/test/fail-steps", {"steps": 1}) == (200, {"steps": 1})
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model=a.model, messages=FRANCE, max_tokens=8,
                                      temperature=0)
        assert e.value.status_code == 500
        assert e.value.body["type"] == "server_error" and e.value.body["code"] == "engine_error"
        assert "fault injection" in e.value.body["message"]
        assert admin_post(a, "/v1/test/fail-steps", {"steps": 1}) == (200, {"steps": 1})
        with pytest.raises(openai.APIError) as e:
            for _ in c.chat.completions.create(model=a.model, messages=FRANCE, max_tokens=8,
                                               temperature=0, stream=True):
                pass
        assert not isinstance(e.value, openai.APIStatusError)   # in the stream, after 200
        assert e.value.body["code"] == "engine_error"
        # the engine is not left broken: the same request gives the same answer
        again = c.chat.completions.create(model=a.model, messages=FRANCE, max_tokens=8,
                                          temperature=0)
        assert again.choices[0].message.content == ok.choices[0].message.content
        assert a.get("/health")[0] == 200
    finally:
        assert a.stop() == 0


def test_rate_limits_return_429_with_retry_after(server):
    k = create_key(server, "limited", "--rpm", "2")
    c = client(server, key=k["key"])
    for _ in range(2):
        c.completions.create(model=server.model, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=server.model, prompt="Hi", max_tokens=2)
    ra = int(e.value.response.headers["retry-after"])
    assert 1 <= ra <= 60
    # concurrency limit: a second request while one streams is refused
    k2 = create_key(server, "one-at-a-time", "--max-concurrency", "1")
    c2 = client(server, key=k2["key"])
    stream = c2.completions.create(model=server.model, prompt="Count:", max_tokens=200,
                                   stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    with pytest.raises(openai.RateLimitError):
        c2.completions.create(model=server.model, prompt="Hi", max_tokens=2)
    stream.close()
    time.sleep(0.5)
    assert c2.completions.create(model=server.model, prompt="Hi", max_tokens=2).usage


def test_revoked_key_rejected_within_a_second(server):
    k = create_key(server, "short-lived")
    c = client(server, key=k["key"])
    c.completions.create(model=server.model, prompt="Hi", max_tokens=2)
    dsctl(server, "keys", "revoke", str(k["id"]))
    t0 = time.monotonic()
    with pytest.raises(openai.AuthenticationError):
        c.completions.create(model=server.model, prompt="Hi", max_tokens=2)
    assert time.monotonic() - t0 < 1.0
    listed = json.loads(dsctl(server, "--json", "keys", "list"))["data"]
    mine = [x for x in listed if x["id"] == k["id"]][0]
    assert mine["revoked"] and mine["requests"] >= 1 and mine["completion_tokens"] >= 1


def test_request_id_passthrough(server):
    r = client(server).completions.with_raw_response.create(
        model=server.model, prompt="Hi", max_tokens=2, extra_headers={"X-Request-Id": "bench-7f-3"})
    assert r.headers["x-request-id"] == "bench-7f-3"


def test_queue_full_gives_503_with_retry_after(tmp_path):
    a = start_agent(tmp_path, "--threads", "2", "--max-running", "1", "--max-waiting", "1",
                    "--insecure-no-auth")
    a.wait_serving()
    try:
        c = openai.OpenAI(base_url=a.api_url + "/v1", api_key="unused", max_retries=0)
        streams = []
        for _ in range(2):  # one running (its first token seen), then one waiting
            streams.append(c.completions.create(model=a.model, prompt="Count:", max_tokens=400,
                                                stream=True, extra_body={"ignore_eos": True}))
            if len(streams) == 1:
                next(iter(streams[0]))
        time.sleep(0.3)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=a.model, prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
        for s in streams:
            s.close()
    finally:
        assert a.stop() == 0


def test_reasoning_split_with_r1_template(tmp_path):
    """With the R1 template the prompt ends in "<think>\\n": what the model
    writes before "</think>" is reasoning_content, the rest content; the two
    together are exactly the raw completion of the same prompt."""
    a = start_agent(tmp_path, "--threads", "2", "--chat-template", "deepseek-r1",
                    "--insecure-no-auth")
    a.wait_serving()
    try:
        c = openai.OpenAI(base_url=a.api_url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "Why is the sky blue?"}]
        r = c.chat.completions.create(model=a.model, messages=msgs, max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
        m = r.choices[0].message
        reasoning = m.model_extra["reasoning_content"]
        a.key = "unused"
        ids = tokenize(a, messages=msgs)
        text = tokenize(a, ids=ids)
        assert text.endswith("<｜User｜>Why is the sky blue?<｜Assistant｜><think>\n")
        raw = c.completions.create(model=a.model, prompt=ids, max_tokens=24, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
        if "</think>" in raw:
            head, tail = raw.split("</think>", 1)
            assert (reasoning, m.content) == (head, tail)
        else:
            assert reasoning == raw and m.content == ""
        chunks = list(c.chat.completions.create(model=a.model, messages=msgs, max_tokens=24,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        streamed = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                           for ch in chunks if ch.choices)
        assert streamed == reasoning
    finally:
        assert a.stop() == 0


def test_concurrent_clients_get_their_own_answers(server):
    """Eight threads at once: each answer equals the same request made alone."""
    c = client(server)
    prompts = [f"Write the number {i} in words:" for i in range(8)]
    alone = [c.completions.create(model=server.model, prompt=p, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
             for p in prompts]
    got = [None] * 8

    def go(i):
        got[i] = c.completions.create(model=server.model, prompt=prompts[i], max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    ts = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert got == alone

"""Per-key limits count what requests cost (docs/keys.md, "Limits"), against a
real dsagent serving the default model with one thread, through the official
`openai` SDK and plain HTTP:

- max_concurrency counts sequences (prompts x n), not requests: a request
  with more sequences than the limit is refused outright (400), one that
  does not fit beside the sequences in flight waits (429);
- tpm reserves prompt + max_tokens x n at admission, so parallel requests do
  not overshoot it, and settles to what was used when the request ends;
- a key's share of the scheduler's waiting queue: one key cannot fill it and
  starve another;
- /tokenize and /detokenize are metered (rpm, concurrency, usage), and the
  cheap limits (auth, rpm, concurrency) are checked before a prompt is
  tokenized;
- revoking a key stops its running requests within a second: a stream ends
  with an error event naming the revocation, a non-streamed request gets 401;
- a weak admin token written by the operator stops dsagent at start.

Every generation is short or is cancelled by the test; timing bounds are
several times what the server needs."""
import json
import os
import secrets
import subprocess
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from conftest import ROOT, binary, start_agent

MODEL = ROOT / "models" / "default.gguf"
pytestmark = pytest.mark.skipif(not MODEL.exists(), reason="models/default.gguf missing: make model")

LONG = {"ignore_eos": True}   # generation that runs until max_tokens


def dsctl(agent, *args):
    r = subprocess.run([binary("dsctl"), "--agent", agent.url, "--data-dir", str(agent.data_dir),
                        *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def create_key(agent, name, *limits):
    return json.loads(dsctl(agent, "--json", "keys", "create", name, *limits))


def key_row(agent, key):
    rows = json.loads(dsctl(agent, "--json", "keys", "list"))["data"]
    return [r for r in rows if r["id"] == key["id"]][0]


def client(agent, key, timeout=60):
    return openai.OpenAI(base_url=agent.api_url + "/v1", api_key=key["key"], max_retries=0,
                         timeout=timeout)


def post(agent, path, body, key, timeout=30):
    """Plain HTTP POST to the OpenAI port: (status, headers, parsed body)."""
    req = urllib.request.Request(agent.api_url + path, method="POST",
                                 data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + key["key"],
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def metric(agent, name):
    with urllib.request.urlopen(agent.api_url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return None


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def open_stream(c, agent, n=1, max_tokens=400, prompt="Count:"):
    """A streamed completion that runs until closed (or max_tokens)."""
    return c.completions.create(model=agent.model, prompt=prompt, n=n, max_tokens=max_tokens,
                                stream=True, extra_body=LONG)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = start_agent(tmp_path_factory.mktemp("limits"), "--threads", "1")
    a.wait_serving()
    yield a
    assert a.stop() == 0


def test_concurrency_counts_sequences(agent):
    k = create_key(agent, "conc4", "--max-concurrency", "4")
    c = client(agent, k)
    # more sequences than the limit can never run: 400 naming the field
    for extra in ({"n": 5}, {"n": 2, "prompt": ["a", "b", "c"]}):
        body = {"prompt": "Hi", "max_tokens": 1, **extra}
        status, _, doc = post(agent, "/v1/completions", body, k)
        assert status == 400, doc
        assert doc["error"]["code"] == "exceeds_key_limit"
        assert doc["error"]["param"] == "n"
        assert "max_concurrency" in doc["error"]["message"]
    # three sequences in flight: two more do not fit (429), one does
    s = open_stream(c, agent, n=3)
    next(iter(s))
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=agent.model, prompt="Hi", n=2, max_tokens=1)
    assert "max_concurrency" in e.value.body["message"]
    assert int(e.value.response.headers["retry-after"]) >= 1
    assert c.completions.create(model=agent.model, prompt="Hi", max_tokens=1).usage
    s.close()
    # the slots come back once the stream is gone
    wait_for(lambda: post(agent, "/v1/completions", {"prompt": "Hi", "n": 4, "max_tokens": 1},
                          k)[0] == 200, 10, "4 sequences admitted after the stream closed")


def test_tpm_reserves_at_admission_and_settles(agent):
    k = create_key(agent, "tpm300", "--tpm", "300")
    c = client(agent, k)
    n_prompt = post(agent, "/tokenize", {"prompt": "Count:"}, k)[2]["count"]
    # a request that could never fit: 400 naming max_tokens
    status, _, doc = post(agent, "/v1/completions",
                          {"prompt": "Count:", "max_tokens": 400}, k)
    assert status == 400 and doc["error"]["param"] == "max_tokens", doc
    assert "tpm" in doc["error"]["message"] and "300" in doc["error"]["message"]
    # settling: a request reserving 250 that stops at once leaves only what it
    # used in the window, so a second one reserving 250 fits
    r = c.completions.create(model=agent.model, prompt="Count:", max_tokens=250, stop=[" "],
                             temperature=0)
    used = r.usage.total_tokens
    assert used < 300 - (n_prompt + 250), f"the model wrote {used} tokens before a space"
    r2 = c.completions.create(model=agent.model, prompt="Count:", max_tokens=250, stop=[" "],
                              temperature=0)
    assert r2.usage.total_tokens == used
    row = key_row(agent, k)
    assert row["prompt_tokens"] + row["completion_tokens"] == 2 * used + n_prompt
    # parallel requests: each reserves n_prompt + 90; the fourth does not fit
    k2 = create_key(agent, "tpm300b", "--tpm", str(3 * (n_prompt + 90) + 10))
    c2 = client(agent, k2)
    streams = [open_stream(c2, agent, max_tokens=90) for _ in range(3)]
    try:
        with pytest.raises(openai.RateLimitError) as e:
            open_stream(c2, agent, max_tokens=90)
        assert "tpm" in e.value.body["message"]
        assert int(e.value.response.headers["retry-after"]) >= 1
    finally:
        for s in streams:
            s.close()


def test_tokenize_is_metered_and_cheap_limits_come_first(agent):
    k = create_key(agent, "tok-rpm2", "--rpm", "2")
    s1, _, d1 = post(agent, "/tokenize", {"prompt": "Hello there"}, k)
    s2, _, d2 = post(agent, "/detokenize", {"tokens": d1["tokens"]}, k)
    assert (s1, s2) == (200, 200) and d2["prompt"].endswith("Hello there")
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
        status, hdrs, doc = post(agent, path, body, k)
        assert status == 429 and doc["error"]["type"] == "rate_limit_error", (path, doc)
        assert "requests per minute" in doc["error"]["message"] and int(hdrs["Retry-After"]) >= 1
    row = key_row(agent, k)
    assert row["requests"] == 2
    assert row["prompt_tokens"] == 2 * d1["count"]

    # a key over its rpm gets 429 for a prompt too long for the context: the
    # limit was checked before the prompt was tokenized (else: 400, 4096)
    k1 = create_key(agent, "rpm1", "--rpm", "1")
    assert client(agent, k1).completions.create(model=agent.model, prompt="Hi",
                                                max_tokens=1).usage
    huge = "hello world " * 170000   # about 2 MB, 340,000 tokens
    t0 = time.monotonic()
    status, _, doc = post(agent, "/v1/completions", {"prompt": huge, "max_tokens": 1}, k1)
    assert status == 429 and "requests per minute" in doc["error"]["message"], doc
    status, _, doc = post(agent, "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": huge}], "max_tokens": 1}, k1)
    assert status == 429, doc
    assert time.monotonic() - t0 < 10

    # a tokenize request holds a concurrency slot like a sequence
    kc = create_key(agent, "tok-conc1", "--max-concurrency", "1")
    s = open_stream(client(agent, kc), agent)
    next(iter(s))
    status, _, doc = post(agent, "/tokenize", {"prompt": huge}, kc)
    assert status == 429 and "max_concurrency" in doc["error"]["message"], doc
    s.close()
    wait_for(lambda: post(agent, "/tokenize", {"prompt": "Hi"}, kc)[0] == 200, 10,
             "tokenize admitted once the stream closed")


def test_queue_share_keeps_one_key_from_filling_the_queue(tmp_path):
    """--max-waiting 8: a key alone may queue 4 sequences (8 / 2), and 2
    (8 / 3) while one other key queues; the other key still gets in."""
    a = start_agent(tmp_path, "--threads", "1", "--max-running", "1", "--max-waiting", "8")
    a.wait_serving()
    streams = []
    try:
        ka, kb = create_key(a, "greedy"), create_key(a, "modest")
        ca, cb = client(a, ka), client(a, kb)
        running = open_stream(ca, a)   # takes the one running place
        streams.append(running)
        next(iter(running))
        status, _, doc = post(a, "/v1/completions", {"prompt": "Hi", "n": 5, "max_tokens": 1}, ka)
        assert status == 400 and doc["error"]["code"] == "exceeds_key_limit", doc
        assert "waiting queue" in doc["error"]["message"]
        refused = None
        for _ in range(4):   # 2 + 2 queued, then refused: never the whole queue
            try:
                streams.append(open_stream(ca, a, n=2))
            except (openai.RateLimitError, openai.InternalServerError) as e:
                refused = e
                break
        assert isinstance(refused, openai.RateLimitError), refused
        assert len(streams) == 3 and "waiting queue" in refused.body["message"]
        # the other key is not starved: its two sequences are queued (200)
        streams.append(open_stream(cb, a, n=2))
        wait_for(lambda: metric(a, "vllm:num_requests_waiting") == 6, 10, "6 waiting")
        # beside the other key, the first one's share is 8 / 3 = 2: full
        with pytest.raises(openai.RateLimitError):
            open_stream(ca, a)
    finally:
        for s in streams:
            s.close()
        assert a.stop() == 0


def test_revocation_stops_running_requests(agent):
    k = create_key(agent, "revoked-mid-stream")
    c = client(agent, k, timeout=40)
    s = open_stream(c, agent, max_tokens=3000)
    it = iter(s)
    got = sum(1 for _, _ in zip(range(5), it))
    assert got == 5
    dsctl(agent, "keys", "revoke", str(k["id"]))
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as e:
        for _ in it:
            got += 1
    took = time.monotonic() - t0
    assert not isinstance(e.value, openai.APIStatusError)   # an event in the 200 stream
    assert "revoked" in e.value.message and e.value.body["code"] == "api_key_revoked"
    assert took < 2.5, f"the stream ran {took:.1f} s after the revocation"
    assert got < 300

    k2 = create_key(agent, "revoked-mid-request")
    c2 = client(agent, k2, timeout=40)
    out = {}

    def run():
        try:
            out["r"] = c2.completions.create(model=agent.model, prompt="Count:",
                                              max_tokens=3000, extra_body=LONG)
        except Exception as ex:  # noqa: BLE001 - handed to the test thread
            out["e"] = ex
    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: metric(agent, "vllm:num_requests_running") >= 1, 20, "the request runs")
    time.sleep(0.5)
    dsctl(agent, "keys", "revoke", str(k2["id"]))
    t0 = time.monotonic()
    t.join(45)
    took = time.monotonic() - t0
    assert isinstance(out.get("e"), openai.AuthenticationError), out
    assert "revoked" in out["e"].body["message"] and out["e"].body["code"] == "api_key_revoked"
    assert took < 2.5, f"the request ran {took:.1f} s after the revocation"
    wait_for(lambda: metric(agent, "vllm:num_requests_running") == 0, 10, "nothing runs")


@pytest.mark.parametrize("token", ["password", "a" * 40, "0123456789abcdef" * 3,
                                   "ab" * 20, "x" * 31],
                         ids=["short", "one-char", "run", "repeat", "31-chars"])
def test_weak_admin_token_refused_at_start(tmp_path, token):
    data = tmp_path / "data"
    data.mkdir()
    path = data / "admin.token"
    path.write_text(token + "\n")
    os.chmod(path, 0o600)
    r = subprocess.run([binary("dsagent"), "--bind", "127.0.0.1", "--control-port", "0",
                        "--api-port", "0", "--data-dir", str(data), "--backend", "cpu",
                        "--threads", "1"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "admin.token" in r.stderr and "weak" in r.stderr, r.stderr
    assert token not in r.stderr


def test_strong_operator_admin_token_accepted(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    token = secrets.token_hex(16)   # `openssl rand -hex 16`
    (data / "admin.token").write_text(token + "\n")
    os.chmod(data / "admin.token", 0o600)
    a = start_agent(tmp_path, "--threads", "1")
    try:
        assert a.token() == token
        status, _ = a.get("/v1/keys", headers={"Authorization": "Bearer " + token})
        assert status == 200
    finally:
        a.stop()

"""Everyday use of a real dsagent (default model, --threads 1) and dsctl:

- the small routes: GET / (what this is, where the docs are), GET /version,
  GET /v1/models/{id} (the SDK's models.retrieve); no key needed, as for
  /v1/models;
- the request log: one "request done" line per finished request (id, key
  name, status, tokens, TTFT, duration; never the prompt or the key), and a
  "throughput" line while requests run;
- help at every level of dsctl (-h, --help, help), unknown words named with a
  "did you mean", the no-token message naming `make up`'s run/data; dsagent -h;
- minor: stream_options without stream is a 400, boolean flags show no
  "(default false)", dsrun -m names both model forms, uptime_s is whole
  seconds, the README's example request has max_tokens and temperature 0;
- the election route's "not JSON" message is not printed into itself
  (agent/cluster/cluster.c formatted it into the buffer it read from).
"""
import base64
import hashlib
import http.client
import json
import re
import secrets
import subprocess
import time

import openai
import pytest

from conftest import ROOT, binary, start_agent

MODEL = ROOT / "models" / "default.gguf"
needs_model = pytest.mark.skipif(not MODEL.exists(),
                                 reason="models/default.gguf missing: make model")
NAMES = "everyday-model,everyday-alias"


def run(*args, **kw):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=60,
                          **kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    a = start_agent(tmp_path_factory.mktemp("everyday"), "--threads", "1",
                    "--served-model-name", NAMES, "--stats-log-ms", "300")
    a.wait_serving()
    r = run(binary("dsctl"), "--agent", a.url, "--data-dir", a.data_dir, "--json", "keys",
            "create", "everyday-key")
    assert r.returncode == 0, r.stderr
    a.key = json.loads(r.stdout)["key"]
    yield a
    assert a.stop() == 0


def api(server, method, path, body=None, headers=None):
    c = http.client.HTTPConnection(server.api_host, server.api_port, timeout=120)
    c.request(method, path, json.dumps(body) if body is not None else None,
              {"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    status, text = r.status, r.read().decode()
    c.close()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def sdk(server, key=None):
    return openai.OpenAI(base_url=server.api_url + "/v1", api_key=key or server.key,
                         max_retries=0, timeout=120)


def wait_log(server, pattern, timeout=30):
    rx = re.compile(pattern, re.M)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = rx.search(server.log())
        if m:
            return m
        time.sleep(0.05)
    raise AssertionError(f"no log line {pattern!r}: {server.log_tail()}")


# ------------------------------------------------------------------ routes --

@needs_model
def test_models_retrieve_version_and_root(server):
    c = sdk(server)
    for name in NAMES.split(","):
        m = c.models.retrieve(name)
        assert m.id == name and m.object == "model" and m.owned_by == "dsagent"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert "no-such-model" in e.value.body["message"]

    version = run(binary("dsagent"), "--version").stdout.split()[1]
    # no key needed: the same rule as GET /v1/models
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        st, body = api(server, "GET", "/version", headers=headers)
        assert st == 200 and body == {"version": version}, body
        st, body = api(server, "GET", "/v1/models/everyday-alias", headers=headers)
        assert st == 200 and body["id"] == "everyday-alias", body
        st, body = api(server, "GET", "/", headers=headers)
        assert st == 200, body
        assert body["name"] == "dsagent" and body["version"] == version
        assert body["ready"] is True and body["models"] == NAMES.split(",")
        assert "docs/serving.md" in body["docs"]
        assert "POST /v1/chat/completions" in body["routes"]
        assert "Authorization: Bearer" in body["description"]
    # while the generation routes do need one
    st, body = api(server, "POST", "/tokenize", {"prompt": "hi"})
    assert st == 401, body


# ----------------------------------------------------------------- the log --

def done_line(server, rid):
    return wait_log(server, r'msg="request done" id=' + re.escape(rid) +
                    r' key=(\S+) status=(\d+) stream=(\d) prompt_tokens=(\d+) '
                    r'completion_tokens=(\d+) ttft_s=(\S+) duration_s=([\d.]+) finish=(\S+)$')


@needs_model
def test_one_log_line_per_finished_request_without_prompt_or_key(server):
    marker = "zebracorn" + secrets.token_hex(4)
    msgs = [{"role": "user", "content": f"Say hello to {marker}."}]
    c = sdk(server)
    r = c.chat.completions.with_raw_response.create(
        model="everyday-model", messages=msgs, max_tokens=6, temperature=0,
        extra_headers={"X-Request-Id": "everyday-plain"})
    resp = r.parse()
    m = done_line(server, "chatcmpl-everyday-plain")
    key, status, stream, pt, ct, ttft, dur, fin = m.groups()
    assert (key, status, stream) == ("everyday-key", "200", "0")
    assert int(pt) == resp.usage.prompt_tokens and int(ct) == resp.usage.completion_tokens
    assert 0 < float(ttft) <= float(dur) and fin == resp.choices[0].finish_reason

    s = c.chat.completions.create(model="everyday-model", messages=msgs, max_tokens=5,
                                  temperature=0, stream=True,
                                  extra_headers={"X-Request-Id": "everyday-stream"})
    n = sum(1 for ch in s if ch.choices and ch.choices[0].delta.content)
    m = done_line(server, "chatcmpl-everyday-stream")
    key, status, stream, pt, ct, ttft, dur, fin = m.groups()
    assert (key, status, stream, ct, fin) == ("everyday-key", "200", "1", "5", "length")
    assert n >= 1 and 0 < float(ttft) <= float(dur)

    # refused requests get their line too
    st, _ = api(server, "POST", "/v1/chat/completions",
                {"messages": msgs, "temperature": 9},
                {"Authorization": f"Bearer {server.key}", "X-Request-Id": "everyday-bad"})
    assert st == 400
    assert done_line(server, "chatcmpl-everyday-bad").group(2) == "400"
    st, _ = api(server, "POST", "/v1/completions", {"prompt": marker},
                {"Authorization": "Bearer dsk-not-a-key", "X-Request-Id": "everyday-401"})
    assert st == 401
    m = done_line(server, "cmpl-everyday-401")
    assert m.group(1) == "-" and m.group(2) == "401"

    log = server.log()
    assert marker not in log and server.key not in log and "dsk-not-a-key" not in log


@needs_model
def test_throughput_line_while_busy_only(server):
    before = len(re.findall(r'msg="throughput"', server.log()))
    r = sdk(server).completions.create(model="everyday-model", prompt="Once upon a time",
                                       max_tokens=48, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 48
    lines = wait_log(server, r'msg="throughput" prompt_tokens_per_s=([\d.]+) '
                             r'generation_tokens_per_s=([\d.]+) running=(\d+) waiting=(\d+) '
                             r'kv_used_pct=\d+ interval_s=[\d.]+$')
    found = re.findall(r'msg="throughput" prompt_tokens_per_s=([\d.]+) '
                       r'generation_tokens_per_s=([\d.]+) running=(\d+)', server.log())
    assert len(found) > before and any(float(g) > 0 for _, g, _ in found), lines
    # the line of the last busy interval goes out, then none while idle
    count = lambda: len(re.findall(r'msg="throughput"', server.log()))  # noqa: E731
    idle, since, deadline = count(), time.monotonic(), time.monotonic() + 30
    while time.monotonic() - since < 1.0 and time.monotonic() < deadline:
        time.sleep(0.1)
        if count() != idle:
            idle, since = count(), time.monotonic()
    time.sleep(1.5)  # five idle intervals
    assert count() == idle


# ------------------------------------------------------------------- minor --

@needs_model
def test_stream_options_need_stream(server):
    h = {"Authorization": f"Bearer {server.key}"}
    msgs = [{"role": "user", "content": "Hi"}]
    for extra in ({}, {"stream": False}):
        st, body = api(server, "POST", "/v1/chat/completions",
                       {"messages": msgs, "max_tokens": 2, "temperature": 0,
                        "stream_options": {"include_usage": True}, **extra}, h)
        assert st == 400 and body["error"]["param"] == "stream_options", body
        assert "'stream': true" in body["error"]["message"]
    st, body = api(server, "POST", "/v1/completions",
                   {"prompt": "Hi", "max_tokens": 2, "stream_options": {}}, h)
    assert st == 400 and body["error"]["param"] == "stream_options", body
    s = sdk(server).chat.completions.create(model="everyday-model", messages=msgs,
                                            max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    assert [ch.usage.completion_tokens for ch in s if ch.usage] == [2]


@needs_model
def test_readme_example_is_bounded_greedy_and_works(server):
    text = (ROOT / "README.md").read_text()
    curl = re.search(r"^(curl http://127\.0\.0\.1:8000/v1/chat/completions.*?}')$", text,
                     re.M | re.S).group(1)
    body = json.loads(re.search(r"-d '(.*)'$", curl, re.S).group(1))
    assert body["max_tokens"] > 0 and body["temperature"] == 0, body
    cmd = curl.replace("http://127.0.0.1:8000", server.api_url).replace("$(cat run/api.key)",
                                                                        server.key)
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    doc = json.loads(r.stdout)
    assert doc["usage"]["completion_tokens"] <= body["max_tokens"], doc
    assert "Paris" in doc["choices"][0]["message"]["content"], doc


def test_uptime_is_whole_seconds(agent):
    st, body = agent.get("/health")
    assert st == 200 and isinstance(body["uptime_s"], int) and body["uptime_s"] >= 0, body


def test_help_texts():
    r = run(binary("dsagent"), "--help")
    assert r.returncode == 0 and "(default false)" not in r.stdout
    assert re.search(r"--insecure-no-auth +serve without API keys.*\)\n", r.stdout)
    assert "--eligible" in r.stdout and "(default true)" in r.stdout
    r = run(binary("dsctl"), "--help")
    assert "(default false)" not in r.stdout and "--json " in r.stdout
    r = run(binary("dsrun"), "--help")
    line = next(ln for ln in r.stdout.splitlines() if "--model" in ln)
    assert "directory" in line and ".gguf" in line, line
    assert "(default false)" not in r.stdout
    r = run(binary("dsrun"), "-p", "hi")
    assert r.returncode == 2 and "directory" in r.stderr and ".gguf" in r.stderr, r.stderr


# -------------------------------------------------------------------- help --

def test_dsagent_takes_h():
    long = run(binary("dsagent"), "--help")
    r = run(binary("dsagent"), "-h")
    assert r.returncode == 0 and r.stdout == long.stdout, r.stderr
    assert r.stdout.startswith("usage: dsagent") and "-h, --help" in r.stdout


def test_dsctl_help_at_every_level():
    top = run(binary("dsctl"), "--help")
    assert top.returncode == 0 and top.stdout.startswith("usage: dsctl")
    for args in (["-h"], ["help"]):
        r = run(binary("dsctl"), *args)
        assert r.returncode == 0 and r.stdout == top.stdout, args
    for args in (["keys", "--help"], ["keys", "-h"], ["keys", "help"], ["help", "keys"],
                 ["--help", "keys"]):
        r = run(binary("dsctl"), *args)
        assert r.returncode == 0, (args, r.stderr)
        subs = re.findall(r"^  (keys \w+)", r.stdout, re.M)
        assert subs == ["keys create", "keys list", "keys revoke"], (args, r.stdout)
        assert "cluster" not in r.stdout
    for args in (["keys", "create", "--help"], ["keys", "create", "-h"],
                 ["keys", "create", "help"], ["help", "keys", "create"]):
        r = run(binary("dsctl"), *args)
        assert r.returncode == 0, (args, r.stderr)
        assert "keys create NAME" in r.stdout and "--max-concurrency" in r.stdout
        assert "keys list" not in r.stdout
    r = run(binary("dsctl"), "health", "-h")
    assert r.returncode == 0 and "is the agent up" in r.stdout and "keys" not in r.stdout


def test_dsctl_names_unknown_words_with_a_suggestion():
    r = run(binary("dsctl"), "kyes", "list")
    assert r.returncode == 2 and "unknown command 'kyes'" in r.stderr
    assert "did you mean 'keys'" in r.stderr
    r = run(binary("dsctl"), "keys", "crate", "x")
    assert r.returncode == 2 and "unknown subcommand 'crate'" in r.stderr, r.stderr
    assert "did you mean 'create'" in r.stderr and "keys revoke ID" in r.stderr
    r = run(binary("dsctl"), "cluster", "stat")
    assert r.returncode == 2 and "did you mean 'status'" in r.stderr, r.stderr
    r = run(binary("dsctl"), "zzzzzz")
    assert r.returncode == 2 and "unknown command 'zzzzzz'" in r.stderr
    assert "did you mean" not in r.stderr
    r = run(binary("dsctl"), "keys")
    assert r.returncode == 2 and "needs a subcommand" in r.stderr and "keys list" in r.stderr


def test_dsctl_without_a_token_names_run_data(tmp_path):
    r = run(binary("dsctl"), "--data-dir", tmp_path / "nothing", "keys", "list",
            env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 1, r.stderr
    assert str(tmp_path / "nothing" / "admin.token") in r.stderr
    assert "run/data" in r.stderr and "make up" in r.stderr


# --------------------------------------------- the election route's message --

def sign(key, method, path, body, sender):
    """The DSCluster credential of agent/cluster/rpc.h."""
    k = hashlib.blake2b(b"dsagent-control v1", digest_size=32, key=key).digest()
    ms = int(time.time() * 1000)
    nonce = secrets.token_hex(8)
    bh = hashlib.blake2b(body, digest_size=32).hexdigest()
    head = f"{method}\n{path}\n{ms}\n{nonce}\n{sender}\n{bh}".encode()
    mac = hashlib.blake2b(head, digest_size=32, key=k).hexdigest()
    return f"DSCluster {sender}.{ms}.{nonce}.{mac}"


def test_election_route_says_the_body_is_not_json_once(tmp_path):
    key_file = tmp_path / "cluster.key"
    r = run(binary("dsctl"), "cluster", "init", "--key-file", key_file)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in key_file.read_text().splitlines() if ln.startswith("dsck1:"))
    key = base64.b64decode(line.split(":")[2])
    a = start_agent(tmp_path, "--cluster-key", key_file, "--gossip-bind", "127.0.0.1",
                    "--gossip-port", "0", "--gossip-profile", "test")
    try:
        body = b"this is not json"
        path = "/v1/cluster/election"
        st, reply = a.get(path, "POST", body, {
            "Authorization": sign(key, "POST", path, body, secrets.token_hex(16)),
            "Content-Type": "application/json"})
        assert st == 400, reply
        msg = reply["error"]["message"]
        assert msg.startswith("the body is not JSON: ") and msg.count("not JSON") == 1, msg
        assert len(msg) > len("the body is not JSON: ") + 3, msg
    finally:
        assert a.stop() == 0

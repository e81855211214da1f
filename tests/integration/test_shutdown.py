"""Shutdown and restarts, against real dsagent processes serving the default
model (models/default.gguf) on loopback with --threads 1.

- SIGTERM while requests run: new requests get 503 at once, running ones get
  --shutdown-grace-ms to finish, then each open stream ends with an error
  event and `data: [DONE]` (the OpenAI SDK raises APIError on it), an
  unstreamed request gets a 503 JSON error, and the agent exits 0; a second
  signal ends the requests at once.
- One agent per data directory: a second one on the same --data-dir is
  refused with a message naming the first one's pid, and nothing in the
  directory changes; `make up` (tools/up.sh) twice leaves the running
  agent's log alone.
"""
import hashlib
import http.client
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import openai
import pytest

from conftest import BUILD, ROOT, binary, start_agent
from tests.fixtures.agent import AgentProcess

MODEL = ROOT / "models" / "default.gguf"
pytestmark = pytest.mark.skipif(not MODEL.exists(), reason="models/default.gguf missing: make model")

LONG = 4000  # tokens: a request that runs far past any grace period here


def chat_body(max_tokens, stream, **extra):
    return {"messages": [{"role": "user", "content": "Count from one to a thousand."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            **extra}


class RawStream(threading.Thread):
    """A streamed chat request over plain HTTP: every `data:` line with the
    time it arrived, and how the response ended (clean end of the chunked
    body, or an exception)."""

    def __init__(self, agent, max_tokens):
        super().__init__(daemon=True)
        self.agent, self.max_tokens = agent, max_tokens
        self.events, self.status, self.error = [], None, None
        self.first = threading.Event()
        self.start()

    def run(self):
        try:
            c = http.client.HTTPConnection(self.agent.api_host, self.agent.api_port, timeout=120)
            c.request("POST", "/v1/chat/completions",
                      json.dumps(chat_body(self.max_tokens, True)),
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            self.status = r.status
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.decode().rstrip("\r\n")
                if line.startswith("data: "):
                    self.events.append((time.monotonic(), line[6:]))
                    self.first.set()
            c.close()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.first.set()


def post_json(agent, path, body, timeout=120):
    c = http.client.HTTPConnection(agent.api_host, agent.api_port, timeout=timeout)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    status, text = r.status, r.read().decode()
    c.close()
    return status, json.loads(text) if text else None


def get(agent, path):
    c = http.client.HTTPConnection(agent.api_host, agent.api_port, timeout=30)
    c.request("GET", path)
    r = c.getresponse()
    status, text = r.status, r.read().decode()
    c.close()
    return status, json.loads(text) if text else None


def serving_agent(tmp_path, *args):
    a = start_agent(tmp_path, "--threads", "1", "--insecure-no-auth", *args)
    a.wait_serving()
    return a


def sdk(agent):
    return openai.OpenAI(base_url=agent.api_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def sanitized():
    """A sanitizer build of dsagent: several times slower per token."""
    with open(binary("dsagent"), "rb") as f:
        return b"__asan_init" in f.read()


def test_sigterm_gives_a_grace_period_then_ends_every_stream_cleanly(tmp_path):
    grace = 12.0 if sanitized() else 4.0
    a = serving_agent(tmp_path, "--shutdown-grace-ms", str(int(grace * 1000)))
    try:
        long_raw = RawStream(a, LONG)
        sdk_result = {}

        def sdk_stream():
            chunks = 0
            try:
                s = sdk(a).completions.create(model=a.model, prompt="Once upon a time",
                                              max_tokens=LONG, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
                for _ in s:
                    chunks += 1
                    sdk_result["chunks"] = chunks
                sdk_result["ended"] = "no error"
            except openai.APIError as e:
                sdk_result["ended"] = e
        t_sdk = threading.Thread(target=sdk_stream, daemon=True)
        t_sdk.start()
        unstreamed = {}
        t_plain = threading.Thread(
            target=lambda: unstreamed.update(r=post_json(a, "/v1/chat/completions",
                                                         chat_body(LONG, False))),
            daemon=True)
        t_plain.start()
        assert long_raw.first.wait(120)
        deadline = time.monotonic() + 120
        while sdk_result.get("chunks", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sdk_result.get("chunks", 0) >= 1, sdk_result
        assert long_raw.status == 200 and long_raw.error is None, long_raw.error
        # a stream still running at SIGTERM that ends well inside the grace
        # period: its length from the pace of the others on this machine now
        while len(long_raw.events) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        ts = [t for t, _ in long_raw.events[2:6]]
        per_token = (ts[-1] - ts[0]) / (len(ts) - 1)
        short_raw = RawStream(a, max(2, min(24, int(grace / 4 / per_token))))
        assert short_raw.first.wait(120)

        t0 = time.monotonic()
        a.send(signal.SIGTERM)
        time.sleep(0.5)
        # during the grace period: new requests are refused at once
        st, body = get(a, "/health")
        assert st == 503 and body["error"]["code"] == "shutting_down", body
        st, body = post_json(a, "/v1/chat/completions", chat_body(4, False))
        assert st == 503 and body["error"]["code"] == "shutting_down", body
        assert a.alive()

        for t in (long_raw, short_raw, t_sdk, t_plain):
            t.join(grace + 60)
        exit_code = a.stop(None, grace + 30)
        took = time.monotonic() - t0
        assert exit_code == 0, a.log_tail()
        assert took < grace + 15, took

        # the short stream finished normally inside the grace period
        assert short_raw.error is None, short_raw.error
        assert short_raw.events[-1][1] == "[DONE]" and short_raw.events[-1][0] > t0
        last = json.loads(short_raw.events[-2][1])
        assert "error" not in last and last["choices"][0]["finish_reason"] == "length", last

        # the long stream ran on through the grace period, then got an error
        # event and [DONE], and its chunked body ended cleanly
        assert long_raw.error is None, long_raw.error
        assert [e for _, e in long_raw.events[-1:]] == ["[DONE]"], long_raw.events[-3:]
        t_err, err = long_raw.events[-2]
        err = json.loads(err)["error"]
        assert err["code"] == "shutting_down" and err["type"] == "service_unavailable_error"
        assert "shutting down" in err["message"]
        assert t_err - t0 >= grace - 0.2, t_err - t0
        assert any(t0 + 1.0 < t < t_err and "choices" in e for t, e in long_raw.events), \
            "no tokens streamed during the grace period"

        # the SDK raised APIError on the error event
        ended = sdk_result["ended"]
        assert isinstance(ended, openai.APIError), ended
        assert "shutting down" in str(ended)

        # the unstreamed request got a 503 JSON error
        st, body = unstreamed["r"]
        assert st == 503 and body["error"]["code"] == "shutting_down", (st, body)
        assert "request done" in a.log() and "status=503" in a.log()
    finally:
        a.stop(signal.SIGKILL)


def test_second_signal_ends_the_grace_period(tmp_path):
    a = serving_agent(tmp_path, "--shutdown-grace-ms", "600000")
    try:
        s = RawStream(a, LONG)
        assert s.first.wait(120) and s.error is None
        t0 = time.monotonic()
        a.send(signal.SIGTERM)
        time.sleep(1.0)
        assert a.alive() and not s.events[-1][1] == "[DONE]"
        a.send(signal.SIGINT)
        assert a.stop(None, 30) == 0, a.log_tail()
        assert time.monotonic() - t0 < 20
        s.join(30)
        assert s.error is None and s.events[-1][1] == "[DONE]", s.events[-2:]
        assert json.loads(s.events[-2][1])["error"]["code"] == "shutting_down"
        assert "second stop signal" in a.log()
    finally:
        a.stop(signal.SIGKILL)


def snapshot(d):
    """Every file under d: inode, size, mtime and content hash."""
    out = {}
    for p in sorted(pathlib.Path(d).rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(d))] = (st.st_ino, st.st_size, st.st_mtime_ns,
                                          hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def test_second_agent_on_the_same_data_dir_is_refused_untouched(tmp_path):
    a = serving_agent(tmp_path, "--health-ms", "3600000")
    data = a.data_dir
    try:
        # the first agent's own start-up writes settle first
        before, still_since = snapshot(data), time.monotonic()
        deadline = time.monotonic() + 30
        while time.monotonic() - still_since < 1.0:
            assert time.monotonic() < deadline, "the first agent kept writing"
            time.sleep(0.1)
            now = snapshot(data)
            if now != before:
                before, still_since = now, time.monotonic()
        b = AgentProcess(binary("dsagent"),
                         ["--bind", "127.0.0.1", "--control-port", "0", "--api-port", "0",
                          "--data-dir", str(data), "--backend", "cpu", "--threads", "1",
                          "--insecure-no-auth"], log_dir=tmp_path / "second")
        try:
            deadline = time.monotonic() + 30
            while b.alive() and time.monotonic() < deadline:
                assert "dsagent listening" not in b.stdout(), "the second agent started"
                time.sleep(0.05)
        finally:
            rc = b.stop(signal.SIGKILL)
        assert rc == 1, (rc, b.log())
        assert f"pid {a.pid}" in b.log() and str(data) in b.log(), b.log()
        assert "in use" in b.log()
        assert snapshot(data) == before
        # the first one still serves
        st, body = get(a, "/health")
        assert st == 200, body
        st, body = post_json(a, "/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                                    "temperature": 0})
        assert st == 200 and body["usage"]["completion_tokens"] == 2, body
    finally:
        assert a.stop() == 0
    # once it is gone, the directory is free again
    c = start_agent(tmp_path, "--threads", "1", "--insecure-no-auth")
    try:
        c.wait_serving()
    finally:
        assert c.stop() == 0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid, name):
    out = []
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == pid and comm == name:
            out.append(int(d.name))
    return out


def check_examples(out, proj):
    """The curl and SDK examples `make up` printed are bounded (max_tokens)
    and greedy (temperature 0), and work as pasted."""
    curl = re.search(r"^  (curl http.*?}')$", out, re.M | re.S).group(1)
    body = json.loads(re.search(r"-d '(.*)'$", curl, re.S).group(1))
    assert body["max_tokens"] > 0 and body["temperature"] == 0, body
    answers = []
    for _ in range(2):
        r = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120,
                           cwd=proj)
        doc = json.loads(r.stdout)
        assert doc["usage"]["completion_tokens"] <= body["max_tokens"], doc
        answers.append(doc["choices"][0]["message"]["content"])
    assert answers[0] == answers[1] and "Paris" in answers[0], answers
    py = re.search(r"^  (\.venv/bin/python -c '.*?\)')$", out, re.M | re.S).group(1)
    assert "max_tokens=" in py and "temperature=0" in py, py
    r = subprocess.run(["bash", "-c", py], capture_output=True, text=True, timeout=120, cwd=proj)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_make_up_twice_leaves_the_running_agent_and_its_log_alone(tmp_path):
    proj = tmp_path / "proj"
    (proj / "tools").mkdir(parents=True)
    (proj / "examples").mkdir()
    shutil.copy(ROOT / "tools" / "up.sh", proj / "tools" / "up.sh")
    shutil.copy(ROOT / "examples" / "dsagent.conf", proj / "examples" / "dsagent.conf")
    (proj / "models").symlink_to(ROOT / "models")
    (proj / ".venv").symlink_to(ROOT / ".venv")
    env = {**os.environ, "DS_API_PORT": str(free_port()), "DS_CONTROL_PORT": str(free_port()),
           "DSAGENT_THREADS": "1", "DSAGENT_BACKEND": "cpu"}
    up = [shutil.which("bash"), str(proj / "tools" / "up.sh"), str(BUILD)]
    with open(tmp_path / "first.out", "w") as fo, open(tmp_path / "first.err", "w") as fe:
        first = subprocess.Popen(up, stdout=fo, stderr=fe, env=env, cwd=proj)
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C stops it." not in (tmp_path / "first.out").read_text():
            assert first.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "first.err").read_text()
            time.sleep(0.1)
        agents = children(first.pid, "dsagent")
        assert len(agents) == 1, agents
        log = proj / "run" / "dsagent.out"
        assert "dsagent serving model=" in log.read_text()
        log_before = (log.stat().st_ino, log.stat().st_mtime_ns, log.read_bytes())
        data_before = snapshot(proj / "run" / "data")

        second = subprocess.run(up, capture_output=True, text=True, env=env, cwd=proj,
                                timeout=120)
        assert second.returncode != 0, second.stdout
        assert f"pid {agents[0]}" in second.stderr, second.stderr
        assert (log.stat().st_ino, log.stat().st_mtime_ns, log.read_bytes()) == log_before
        assert snapshot(proj / "run" / "data") == data_before
        assert sorted(p.name for p in (proj / "run").iterdir()) == \
            ["api.key", "data", "dsagent.out"]
        assert first.poll() is None
        check_examples((tmp_path / "first.out").read_text(), proj)
    finally:
        first.send_signal(signal.SIGTERM)
        try:
            first.wait(60)
        except subprocess.TimeoutExpired:
            for pid in children(first.pid, "dsagent"):
                os.kill(pid, signal.SIGKILL)
            first.kill()
            first.wait()
    assert first.returncode == 0
    assert "stopping dsagent" in (tmp_path / "first.out").read_text()

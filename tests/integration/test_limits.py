"""Limits and credentials of a real dsagent (the default model, one
thread), through the official `openai` SDK and plain HTTP:

- a weak admin token written by the operator stops dsagent at start, a
  strong one is used as written."""
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

"""Everyday use of a real dsagent (default model, --threads 1) and dsctl:

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

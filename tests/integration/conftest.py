"""Fixtures of the integration tier: real dsagent processes on loopback.

Binaries come from $DS_BUILD (default build/).  An agent is started with
--control-port 0 and reports the port it got on stdout
("dsagent listening control=HOST:PORT"), so tests never race for ports.
"""
import json
import os
import pathlib
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = ROOT / os.environ.get("DS_BUILD", "build")


def binary(name):
    path = BUILD / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make` first")
    return str(path)


class Agent:
    def __init__(self, proc, host, port):
        self.proc, self.host, self.port = proc, host, port
        self.url = f"http://{host}:{port}"

    def get(self, path, method="GET", body=None, headers=None):
        """Returns (status, parsed JSON or raw text)."""
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def stop(self, sig=signal.SIGTERM, timeout=10):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_agent(tmp_path, *args, env=None):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    cmd = [binary("dsagent"), "--bind", "127.0.0.1", "--control-port", "0",
           "--data-dir", str(data), "--backend", "cpu", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    deadline = time.time() + 20
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("dsagent listening control="):
            host, port = line.split("=", 1)[1].strip().rsplit(":", 1)
            return Agent(proc, host, int(port))
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"dsagent did not start: {proc.stderr.read()}")


@pytest.fixture
def agent(tmp_path):
    a = start_agent(tmp_path, "--name", "node-a")
    yield a
    a.stop()

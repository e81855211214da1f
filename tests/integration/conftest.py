"""Fixtures of the integration tier: real dsagent processes on loopback.

Binaries come from $DS_BUILD (default build/).  An agent is started with
--control-port 0 --api-port 0 and reports the ports it got on stdout
("dsagent listening control=HOST:PORT api=HOST:PORT"), so tests never race
for ports; "dsagent serving model=NAME" follows once the model is loaded.
The working directory is the repository root, so the default model is
models/default.gguf (`make model`).
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
    def __init__(self, proc, host, port, api_host=None, api_port=None, data_dir=None):
        self.proc, self.host, self.port = proc, host, port
        self.url = f"http://{host}:{port}"
        self.api_url = f"http://{api_host}:{api_port}" if api_port else None
        self.data_dir = data_dir
        self.model = None

    def wait_serving(self, timeout=60):
        """Blocks until the model is loaded; returns the served model name."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("dsagent serving model="):
                self.model = line.split("=", 1)[1].strip()
                return self.model
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError(f"dsagent did not start serving: {self.log()}")

    def log(self):
        """Everything the agent wrote to stderr so far."""
        return _stderr_text(self.proc)

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


def _stderr_text(proc):
    f = proc.stderr_file
    f.flush()
    f.seek(0)
    return f.read()


def start_agent(tmp_path, *args, env=None):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    cmd = [binary("dsagent"), "--bind", "127.0.0.1", "--control-port", "0",
           "--data-dir", str(data), "--backend", "cpu"]
    if "--api-port" not in args:
        cmd += ["--api-port", "0"]
    cmd += list(args)
    # stderr (the log) goes to a file: a pipe nobody reads would block a
    # long-running agent once it fills
    err = open(data.parent / "dsagent.stderr", "a+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, **(env or {})}, cwd=ROOT)
    proc.stderr_file = err
    deadline = time.time() + 20
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("dsagent listening control="):
            fields = dict(f.split("=", 1) for f in line.split()[2:])
            host, port = fields["control"].rsplit(":", 1)
            api_host, api_port = fields["api"].rsplit(":", 1)
            return Agent(proc, host, int(port), api_host, int(api_port), data)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"dsagent did not start: {_stderr_text(proc)}")


@pytest.fixture
def agent(tmp_path):
    a = start_agent(tmp_path, "--name", "node-a")
    yield a
    a.stop()

"""Fixtures of the integration tier: real dsagent processes on loopback.

Binaries come from $DS_BUILD (default build/).  An agent is started with
--control-port 0 --api-port 0 and reports the ports it got on stdout
("dsagent listening control=HOST:PORT api=HOST:PORT"), so tests never race
for ports; "dsagent serving model=NAME" follows once the model is loaded.
The working directory is the repository root, so the default model is
models/default.gguf (`make model`).  Every dsagent process of the tests and
benchmarks starts and stops through tests/fixtures/agent.py.
"""
import json
import os
import pathlib
import random
import signal
import sys
import urllib.error
import urllib.request
import zlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # test files import tests.fixtures.*
    sys.path.insert(0, str(ROOT))
from tests.fixtures.agent import AgentProcess  # noqa: E402
BUILD = ROOT / os.environ.get("DS_BUILD", "build")


def binary(name):
    path = BUILD / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make` first")
    return str(path)


class Agent(AgentProcess):
    """A dsagent started by start_agent: the launcher (tests/fixtures/agent.py)
    plus .host/.port (the control API) and get()."""

    @property
    def host(self):
        return self.control_host

    @property
    def port(self):
        return self.control_port

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


def start_agent(tmp_path, *args, env=None):
    """A dsagent on 127.0.0.1 with ephemeral ports, its data in tmp_path/data
    and its logs in tmp_path; returns once it is listening."""
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    cmd = ["--bind", "127.0.0.1", "--control-port", "0", "--data-dir", str(data),
           "--backend", "cpu"]
    if "--api-port" not in args:
        cmd += ["--api-port", "0"]
    a = Agent(binary("dsagent"), [*cmd, *args], log_dir=tmp_path, env=env)
    try:
        return a.wait_listening()
    except RuntimeError:
        a.stop(signal.SIGKILL)
        raise


def seed_of(nodeid):
    """A stable seed from a pytest node id (a test, or a module for module
    fixtures): adding, removing or reordering tests or parameters changes no
    other test's random inputs, and a failure reproduces by name."""
    return zlib.crc32(nodeid.encode())


@pytest.fixture
def rng(request):
    """random.Random seeded from the test's node id."""
    return random.Random(seed_of(request.node.nodeid))


@pytest.fixture(autouse=True, scope="module")
def _global_random_by_module(request):
    """Module fixtures that draw from the global `random` (start orders and
    delays of the gossip and election clusters) draw from a sequence seeded
    by the module's node id: autouse fixtures of a scope are set up before
    the others of that scope."""
    random.seed(seed_of(request.node.nodeid))


@pytest.fixture(autouse=True)
def _global_random_by_test(request):
    """The same for each test that uses the global `random`."""
    random.seed(seed_of(request.node.nodeid))


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory):
    """The tiny DeepSeek checkpoints of tests/fixtures/tiny_models.py, one
    directory per kind (v3, v3-fp8, v2-lite), written once for the session
    and shared by the modules that read them: tests must not change them
    (copy one first, as test_engine_numerics' error cases do)."""
    from tests.fixtures import tiny_models
    d = tmp_path_factory.mktemp("tiny_deepseek")
    return {k: tiny_models.write_model(k, d / k) for k in tiny_models.KINDS}


@pytest.fixture
def agent(tmp_path):
    a = start_agent(tmp_path, "--name", "node-a")
    yield a
    a.stop()

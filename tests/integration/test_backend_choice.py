"""Backend choice at model load: the graph's needed ops are checked against
each backend's table before the backend is taken.

With the CUDA backend compiled in (`make CUDA=1`; `dsrun --backends` lists
it, device or not), `--backend auto` on a checkpoint the CUDA backend cannot
run logs one line naming the missing op and runs on cpu, and `--backend cuda`
is an error naming the op.  The op check comes before any device probe, so
this holds on a machine without a GPU.  On a build without CUDA those tests
are skipped and the cpu-only behaviour is checked instead."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, binary

sys.path.insert(0, str(ROOT))
from tests.fixtures.tiny_models import write_model  # noqa: E402


def dsrun(*args):
    # the fallback line is a warning: make sure warnings reach stderr whatever
    # the caller's DS_LOG_LEVEL (and not journald)
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    env["DS_LOG_LEVEL"] = "info"
    return subprocess.run([binary("dsrun"), *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


def compiled_backends():
    r = dsrun("--backends")
    assert r.returncode == 0, r.stderr
    return [line.split()[0] for line in r.stdout.splitlines()
            if line.split() and line.split()[1] in ("usable", "absent")]


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return write_model("v3", tmp_path_factory.mktemp("backend") / "m")


def greedy(model, backend):
    return dsrun("-m", model, "--tokens", "1,2,3", "-n", "4", "--temp", "0", "--ids",
                 "--backend", backend, "--threads", "1")


def test_backends_lists_cpu():
    assert "cpu" in compiled_backends()


def test_auto_falls_back_to_cpu_naming_the_missing_op(v3):
    if "cuda" not in compiled_backends():
        pytest.skip("this build has no CUDA backend (build with make CUDA=1 to run this test)")
    auto, cpu = greedy(v3, "auto"), greedy(v3, "cpu")
    assert auto.returncode == 0, auto.stderr
    assert cpu.returncode == 0, cpu.stderr
    lines = [l for l in auto.stderr.splitlines() if "backend cuda cannot run this model" in l]
    assert len(lines) == 1, auto.stderr
    assert "(the cuda backend has no matmul for bf16 weights); using cpu" in lines[0]
    assert "level=warn" in lines[0] and "mod=engine" in lines[0]
    assert json.loads(auto.stdout) == json.loads(cpu.stdout)
    assert "cannot run" not in cpu.stderr


def test_explicit_cuda_names_the_missing_op(v3):
    if "cuda" not in compiled_backends():
        pytest.skip("this build has no CUDA backend (build with make CUDA=1 to run this test)")
    r = greedy(v3, "cuda")
    assert r.returncode == 1
    assert "the cuda backend has no matmul for bf16 weights" in r.stderr
    assert str(v3) in r.stderr


def test_cpu_only_build_auto_is_quiet_and_cuda_is_absent(v3):
    if "cuda" in compiled_backends():
        pytest.skip("this build has the CUDA backend (the tests above cover it)")
    auto = greedy(v3, "auto")
    assert auto.returncode == 0, auto.stderr
    assert "cannot run" not in auto.stderr
    r = greedy(v3, "cuda")
    assert r.returncode == 1 and "not compiled in" in r.stderr

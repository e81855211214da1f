"""Engine invariants on each tiny checkpoint, through build/tests/engine_check:
naive and absorbed MLA agree, 64 incremental decode steps through the paged
cache equal full recomputes, a batch of 4 prompts (and a step mixing decodes
with a prefill) equals each prompt alone, and every KV page comes back.

Tolerance: max |a - b| / max |b| per logits row < 1e-5 (f32 compute; the two
sides differ only in summation order).  Pages of 16 positions, so prompts of
23-101 tokens span several pages."""
import subprocess
import sys

import pytest

from conftest import ROOT, binary

sys.path.insert(0, str(ROOT))
from tests.fixtures.tiny_models import write_model  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiny")
    return {k: write_model(k, base / k) for k in ("v3", "v3-fp8", "v2-lite")}


@pytest.mark.parametrize("kind", ["v3", "v3-fp8", "v2-lite"])
def test_engine_invariants(models, kind):
    r = subprocess.run([binary("tests/engine_check"), str(models[kind]), "--page-size", "16",
                        "--tol", "1e-5"], capture_output=True, text=True, timeout=600)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for check in ("attn-forms", "incremental", "batch", "pages"):
        assert any(line.startswith("ok") and check in line for line in lines), check
    assert lines[-1] == "engine_check: 4 passed, 0 failed"

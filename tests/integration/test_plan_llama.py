"""The llama-family graph under parallel plans against one rank: world rank
0's logits (max |a - b| / max |b| per row) and greedy ids for a prefill of two
prompts and decode steps, through

  tests/plan_local  the plan's ranks forked over a shared-memory test
                    transport (always built: checks the graph's splits alone)
  tests/plan_check  the same over Gloo (skipped until it is built)

On the default model (SmolLM2-135M Q4_1: 9 query heads, 3 kv heads, 30
layers) tp 2, 3 and 4 (uneven: the fourth rank holds no kv head) agree with
one rank bit for bit: each output element is computed by one rank with the
one-rank kernel call, and the parts are gathered (docs/distributed.md).

pp 2 cuts a decode step of two sequences into two micro-batches of one row.
The CPU backend's quantized GEMV adds a row's blocks in an order that depends
on how many rows the call has (its unroll: U = 4 for one row, 2 for two), and
its 8-bit activation steps grow that last-bit change to about 1e-4 over 30
layers.  The same effect shows up on one rank: engine_check's batch and
incremental checks on this model.  So pp on the default model is held to the
greedy ids and 1e-3 here, and the 1e-5 check is an expected failure until the
kernel's row sums no longer depend on the row count.  On the tiny f32/f16
models every plan is exact."""
import pathlib
import subprocess
import sys

import pytest

from conftest import BUILD, ROOT, binary

sys.path.insert(0, str(ROOT))
from tests.fixtures.tiny_llama import write_gguf, write_hf  # noqa: E402

DEFAULT = ROOT / "models" / "default.gguf"

needs_default = pytest.mark.skipif(not DEFAULT.exists(), reason="models/default.gguf is absent (make model)")


def run_plan(tool, model, tp=1, pp=1, ep=1, tol=1e-5, steps=3):
    if tool == "plan_check" and not (BUILD / "tests" / "plan_check").exists():
        pytest.skip("tests/plan_check (Gloo) is not built")
    args = [binary(f"tests/{tool}"), "-m", str(model), "--tp", str(tp), "--pp", str(pp), "--ep", str(ep)]
    if tool == "plan_local":
        args += ["--tol", str(tol), "--steps", str(steps)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    print(r.stdout, r.stderr)
    return r


TOOLS = ["plan_local", "plan_check"]


@needs_default
@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("plan", [dict(tp=3), dict(tp=2), dict(tp=4), dict(tp=2, ep=2)],
                         ids=["tp3", "tp2", "tp4-uneven", "tp2-ep2"])
def test_default_model_tp_is_exact(tool, plan):
    r = run_plan(tool, DEFAULT, **plan)
    assert r.returncode == 0, r.stdout + r.stderr
    if tool == "plan_local":
        assert "greedy ids DIFFER" not in r.stdout
        assert r.stdout.rstrip().endswith("plan_local: ok")


@needs_default
@pytest.mark.parametrize("plan", [dict(pp=2), dict(tp=3, pp=2)], ids=["pp2", "tp3-pp2"])
def test_default_model_pp_greedy_ids(plan):
    r = run_plan("plan_local", DEFAULT, tol=1e-3, **plan)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "greedy ids DIFFER" not in r.stdout


@needs_default
@pytest.mark.xfail(reason="the CPU quantized GEMV's row sums depend on the row count of the call "
                          "(see the module docstring)", strict=False)
@pytest.mark.parametrize("tool", TOOLS)
def test_default_model_pp2_within_1e5(tool):
    r = run_plan(tool, DEFAULT, pp=2)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = pathlib.Path(tmp_path_factory.mktemp("tiny_llama"))
    tied, _, _ = write_hf(base / "hf-tied", tie_word_embeddings=True)
    untied, cfg, w = write_hf(base / "hf")
    gg = write_gguf(base / "tiny-f16.gguf", cfg, w, dtype="F16")
    return {"hf-tied": tied, "hf": untied, "gguf-f16": gg}


@pytest.mark.parametrize("kind", ["hf-tied", "hf", "gguf-f16"])
@pytest.mark.parametrize("plan", [dict(tp=2), dict(tp=4), dict(pp=2), dict(tp=2, pp=2, ep=2)],
                         ids=["tp2", "tp4-uneven", "pp2", "tp2-pp2-ep2"])
def test_tiny_llama_plans_are_exact(tiny, kind, plan):
    # 4 heads over 2 kv heads: tp 4 leaves two ranks without attention; the
    # tied head on a last stage that is not stage 0 copies its own vocab rows
    r = run_plan("plan_local", tiny[kind], **plan)
    assert r.returncode == 0, r.stdout + r.stderr


def test_plan_with_more_stages_than_layers_is_refused(tiny):
    r = run_plan("plan_local", tiny["hf"], pp=3)  # the tiny model has 2 layers
    assert r.returncode == 2
    assert "3 pipeline stages for 2 layers" in r.stderr

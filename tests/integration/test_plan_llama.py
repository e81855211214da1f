"""The llama-family graph under parallel plans against one rank, through
tests/tools/plan_check (build/tests/plan_check; skipped until it is built):
the plan's ranks are forked, load the checkpoint with their model_rank (owned
windows of their weights only), talk over Gloo and run the same prefill,
mixed and decode steps as a one-rank model; pass: max |a - b| / max |b| per row within the tolerance on
every row and the same greedy id on every row.

On the default model (SmolLM2-135M Q4_1: 9 query heads, 3 kv heads, 30
layers) tp 2, 3 and 4 (uneven: the fourth rank holds no kv head) give the
one-rank logits bit for bit: each output element is computed by one rank with
the one-rank kernel call and the parts are gathered (docs/distributed.md).

pp cuts a step into micro-batches with fewer rows.  The CPU backend's
quantized products add a row's blocks in an order that depends on how many
rows the call has (the GEMV's unroll, U = 4 for one row and 2 for two, and
the GEMV/GEMM switch at gemm_min_m rows), and their 8-bit activation steps
grow that last-bit change to about 2e-4 over 30 layers; one rank shows the
same (engine_check's batch and incremental checks on this model).  So pp on the default model is held to the greedy ids and 1e-3, and
the 1e-5 check is an expected failure until the kernel's row sums no longer
depend on the row count.  On the tiny f32/f16 models every plan is within
1e-5 (pp bit for bit)."""
import pathlib
import subprocess
import sys

import pytest

from conftest import BUILD, ROOT, binary

sys.path.insert(0, str(ROOT))
from tests.fixtures.tiny_llama import write_gguf, write_hf  # noqa: E402

DEFAULT = ROOT / "models" / "default.gguf"

needs_default = pytest.mark.skipif(not DEFAULT.exists(), reason="models/default.gguf is absent (make model)")
needs_tool = pytest.mark.skipif(not (BUILD / "tests" / "plan_check").exists(),
                                reason="tests/plan_check is not built (tests/tools/plan_check.c)")


def plan_check(model, tp=1, pp=1, ep=1, tol=1e-5):
    r = subprocess.run([binary("tests/plan_check"), "-m", str(model), "--tp", str(tp), "--pp", str(pp),
                        "--ep", str(ep), "--tol", str(tol)],
                       capture_output=True, text=True, timeout=600)
    print(r.stdout, r.stderr)
    return r


def assert_ok(r, exact=False):
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plan_check: ok" in r.stdout
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert steps and all(line.endswith("greedy ids same") for line in steps), r.stdout
    if exact:
        assert all("max rel err 0," in line for line in steps), r.stdout


@needs_tool
@needs_default
@pytest.mark.parametrize("plan", [dict(tp=3), dict(tp=2), dict(tp=4), dict(tp=2, ep=2)],
                         ids=["tp3", "tp2", "tp4-uneven", "tp2-ep2"])
def test_default_model_tp_is_bit_exact(plan):
    assert_ok(plan_check(DEFAULT, **plan), exact=True)


@needs_tool
@needs_default
@pytest.mark.parametrize("plan", [dict(pp=2), dict(tp=3, pp=2)], ids=["pp2", "tp3-pp2"])
def test_default_model_pp_greedy_ids(plan):
    assert_ok(plan_check(DEFAULT, tol=1e-3, **plan))


@needs_tool
@needs_default
@pytest.mark.xfail(reason="the CPU quantized GEMV's row sums depend on the row count of the call "
                          "(see the module docstring)", strict=False)
def test_default_model_pp2_within_1e5():
    assert_ok(plan_check(DEFAULT, pp=2))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = pathlib.Path(tmp_path_factory.mktemp("tiny_llama"))
    tied, _, _ = write_hf(base / "hf-tied", tie_word_embeddings=True)
    untied, cfg, w = write_hf(base / "hf")
    gg = write_gguf(base / "tiny-f16.gguf", cfg, w, dtype="F16")
    return {"hf-tied": tied, "hf": untied, "gguf-f16": gg}


@needs_tool
@pytest.mark.parametrize("kind", ["hf-tied", "hf", "gguf-f16"])
@pytest.mark.parametrize("plan", [dict(tp=2), dict(tp=4), dict(pp=2), dict(tp=2, pp=2, ep=2)],
                         ids=["tp2", "tp4-uneven", "pp2", "tp2-pp2-ep2"])
def test_tiny_llama_plans(tiny, kind, plan):
    # 4 heads over 2 kv heads: tp 4 leaves two ranks without attention; the
    # tied head on a last stage that is not stage 0 copies its own vocab rows
    assert_ok(plan_check(tiny[kind], **plan))


@needs_tool
def test_plan_with_more_stages_than_layers_is_refused(tiny):
    r = plan_check(tiny["hf"], pp=3)  # the tiny model has 2 layers
    assert r.returncode == 2
    assert "3 pipeline stages for 2 layers" in r.stderr

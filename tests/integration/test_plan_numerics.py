"""DeepSeek under a parallel plan gives the logits of one rank.

Each case runs tests/tools/plan_check (build/tests/plan_check): it forks the
plan's ranks, which load the checkpoint with their model_rank (owned windows
of their weights only) and run the same steps as a one-rank model in the
parent: a prefill of 9 tokens of 2 sequences, a step mixing a 3-token
prefill, a decode and a third sequence's 2-token prefill (logits of the last
rows only; PP=3 cuts it into 3 micro-batches), then decodes, over fixed page
tables.  The ranks talk through Gloo (a store served by the parent on
loopback), the product's transport: the tool has no collectives of its own.
Pass: max |a - b| / max |b| per row <= 1e-5 on every row of every step, and
the same argmax (greedy id) on every row.

Plans: TP=2, TP=4, PP=2, PP=3, EP=2, EP=4, TP=2xPP=2, TP=2xEP=2, PP=2xEP=2,
TP=2xEP=4 (a stage of 8 ranks over 4 heads: attention, dense and shared MLP
split over the stage, so half the ranks hold no heads and add zeros; each
expert's intermediate size split over tp) over the tiny checkpoints v3 (BF16), v3-fp8 (FP8 with 128x128 scales: its
head windows fall off the scale blocks, so some windows are f32 or on a
finer grid) and v2-lite (q_proj, softmax routing, 2 shared experts); then
GGUF files of the tiny models (F16 whole attn_kv_b, BF16 split attn_k_b /
attn_v_b, Q8_0 with column windows off the 32-blocks).

Batches under the pipeline (plan_check --batch-check): 4 sequences decoded
together through PP=2 (and PP=3), each step of the 4 cut into micro-batches
at sequence edges, give the logits of the same 4 decoded alone, one
sequence a step, within 1e-5; the tool fails unless every step of the 4 was
cut into more than one micro-batch.

Q8_0 is held to 1e-3: its cpu products quantize the activations to Q8_0 per
row and pick their accumulation order from the row count M, so a rounding
difference of 1e-7 (a sum over ranks in another order) or a micro-batch of
fewer rows can move an activation to the next 8-bit step; one rank shows
the same between a prompt alone and in a batch.  The greedy ids must still
agree.
"""
import subprocess
import sys

import pytest

from conftest import ROOT, binary

sys.path.insert(0, str(ROOT))
from tests.fixtures import tiny_models  # noqa: E402

PLANS = {
    "tp2": (2, 1, 1), "tp4": (4, 1, 1), "pp2": (1, 2, 1), "pp3": (1, 3, 1),
    "ep2": (1, 1, 2), "ep4": (1, 1, 4), "tp2pp2": (2, 2, 1), "tp2ep2": (2, 1, 2),
    "pp2ep2": (1, 2, 2), "tp2ep4": (2, 1, 4), "one": (1, 1, 1),
}
TOL = 1e-5
Q8_TOL = 1e-3


@pytest.fixture(scope="module")
def models(tiny_deepseek):
    return tiny_deepseek


def plan_check(model, plan, *extra, tol=TOL):
    tp, pp, ep = PLANS[plan]
    r = subprocess.run([binary("tests/plan_check"), "-m", str(model), "--tp", str(tp), "--pp", str(pp),
                        "--ep", str(ep), "--tol", str(tol), *map(str, extra)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"plan {plan} on {model}:\n{r.stdout}{r.stderr}"
    assert "plan_check: ok" in r.stdout
    return r.stdout


@pytest.mark.parametrize("kind", tiny_models.KINDS)
def test_one_rank_plan_is_bit_identical(models, kind):
    """A plan of one rank runs on owned copies of every weight instead of the
    mapping: the same bytes, so the same bits."""
    plan_check(models[kind], "one", tol=0)


@pytest.mark.parametrize("plan", [p for p in PLANS if p != "one"])
@pytest.mark.parametrize("kind", tiny_models.KINDS)
def test_plan_logits_equal_one_rank(models, kind, plan):
    out = plan_check(models[kind], plan)
    # every rank holds a share: less than the one-rank model's weights
    line = next(x for x in out.splitlines() if "weight bytes per rank" in x)
    per_rank = [int(v) for v in line.split("per rank")[1].split("(")[0].split()]
    one = int(line.rsplit("one rank", 1)[1].strip(" )"))
    assert all(0 < b < one for b in per_rank), line


@pytest.mark.parametrize("tp,pp,ep", [(3, 1, 1), (3, 3, 1), (4, 1, 4), (2, 3, 2), (1, 2, 8)],
                         ids=["tp3-uneven-heads", "tp3pp3", "tp4ep4-ranks-without-experts",
                              "tp2pp3ep2", "pp2ep8"])
@pytest.mark.parametrize("kind", ["v3-fp8", "v2-lite"])
def test_uneven_and_larger_plans(models, kind, tp, pp, ep):
    """Heads split 2 + 1 + 1, stages with one layer, 16 ranks for 12 experts
    (four ranks hold none and add zeros), all three kinds at once; up to 16
    rank processes in Gloo groups."""
    r = subprocess.run([binary("tests/plan_check"), "-m", str(models[kind]), "--tp", str(tp), "--pp", str(pp),
                        "--ep", str(ep)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "plan_check: ok" in r.stdout, r.stdout + r.stderr


def test_more_tp_ranks_than_heads_is_refused(models):
    r = subprocess.run([binary("tests/plan_check"), "-m", str(models["v3"]), "--tp", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "tp 8 is more than the model's 4 attention heads" in r.stderr


@pytest.mark.parametrize("plan", ["pp2", "pp3", "tp2pp2"])
@pytest.mark.parametrize("kind", ["v3", "v2-lite"])
def test_batch_through_the_pipeline_equals_each_alone(models, kind, plan):
    """4 sequences in one step (their prompts, then 4 decodes of one token
    each) against each sequence in steps of its own, on the same ranks."""
    out = plan_check(models[kind], plan, "--batch-check")
    cut = next(x for x in out.splitlines() if x.startswith("batch:") and "micro-batches" in x)
    assert "NOT CUT" not in cut and "cut into 1.." not in cut, cut
    row = next(x for x in out.splitlines() if x.startswith("batch:") and "together vs alone" in x)
    assert row.endswith("greedy ids same"), row
    assert float(row.split("max rel err ")[1].split(",")[0]) <= TOL, row


@pytest.mark.parametrize("attn", ["naive", "absorbed"])
def test_both_attention_forms_under_tp_and_pp(models, attn):
    plan_check(models["v3-fp8"], "tp2pp2", "--attn", attn)


@pytest.fixture(scope="module")
def ggufs(models, tmp_path_factory):
    pytest.importorskip("gguf")
    from tests.fixtures import tiny_deepseek_gguf as tg
    d = tmp_path_factory.mktemp("plan_gguf")
    q8 = tiny_models.write_model("v3", d / "v3-q8-hf", overrides=tg.Q8_OVERRIDES["v3"])
    return {
        "v3-f16-kv_b": tg.convert(models["v3"], d / "v3-f16.gguf", "kv_b", "F16").path,
        "v2-lite-bf16-split": tg.convert(models["v2-lite"], d / "v2-bf16.gguf", "split", "BF16").path,
        "v3-q8-split": tg.convert(q8, d / "v3-q8.gguf", "split", "Q8_0").path,
    }


@pytest.mark.parametrize("plan", ["tp2", "tp4", "pp3", "ep4", "tp2ep2", "tp2pp2", "tp2ep4"])
@pytest.mark.parametrize("kind", ["v3-f16-kv_b", "v2-lite-bf16-split", "v3-q8-split"])
def test_gguf_plan_logits_equal_one_rank(ggufs, kind, plan):
    plan_check(ggufs[kind], plan, tol=Q8_TOL if "q8" in kind else TOL)

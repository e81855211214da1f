"""The engine's numerics on tiny DeepSeek checkpoints, through the dsrun CLI,
against the independent float64 numpy reference (tests/reference).

CLI contract used here (binary from $DS_BUILD, default build/):
  dsrun -m DIR --tokens 1,2,3 --dump-logits FILE
      one prefill of the prompt; FILE = float32 little-endian, row-major
      [n_tokens][vocab_size]: the logits of EVERY prompt position.
  dsrun -m DIR --tokens 1,2,3 -n N --temp 0 --ids
      greedy generation; stdout is a JSON array of the N generated ids.
  Errors: exit status != 0 and a message on stderr that names the culprit.

Metric for logits: per row (position) max_v |engine - reference| / max_v |reference|.
Tolerances: engine vs reference 1e-4 (f32 engine vs f64 reference); FP8 checkpoint
vs its dequantized F32 copy, both through the engine, 1e-5.

Routing is discontinuous: where two experts' scores nearly tie, float32 rounding
may legitimately pick the other one.  Prompts are therefore drawn (seeded) until
every routing decision of the reference has a margin >= MIN_ROUTE_MARGIN (in the
units of the deciding score: biased sigmoid for V3, softmax probability for V2),
far above the engine's rounding (~1e-6).
"""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import binary  # noqa: E402
from tests.fixtures import safetensors_io as st  # noqa: E402
from tests.fixtures import tiny_models  # noqa: E402
from tests.reference import deepseek_numpy as ref  # noqa: E402

LOGIT_RTOL = 1e-4         # engine (f32) vs numpy reference (f64), per row
FP8_RTOL = 1e-5           # FP8 checkpoint vs its dequantized F32 copy, per row
MIN_ROUTE_MARGIN = 3e-4   # prompts whose routing is closer to a tie are not used
GREEDY_TIE = 1e-3         # greedy: top-2 logit gap below this x max|logit| is a near-tie
N_PROMPT = 40             # > original_max_position_embeddings (16) of every tiny model
N_GEN = 8

MODEL_KINDS = ("v3", "v3-fp8", "v2-lite", "v3-fp8-f32")


@pytest.fixture(scope="module")
def models(tiny_deepseek, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_models")
    out = dict(tiny_deepseek)
    out["v3-fp8-f32"] = tiny_models.write_dequantized_copy(out["v3-fp8"], d / "v3-fp8-f32")
    return out


def dsrun(*args, timeout=120):
    return subprocess.run([binary("dsrun"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def route_margin(model_dir, ids):
    stats = {}
    logits = ref.forward(model_dir, ids, stats=stats)
    m = np.concatenate(stats["route_margin"]) if stats.get("route_margin") else np.array([np.inf])
    return logits, float(m.min())


def pick_prompt(model_dir, n=N_PROMPT):
    """A seeded random prompt (BOS first, the last vocabulary id included) whose
    reference routing has no near-ties.  Returns (ids, reference logits)."""
    cfg = ref.load(model_dir).cfg
    V = cfg["vocab_size"]
    for seed in range(200):
        rng = np.random.default_rng(1000 + seed)
        ids = rng.integers(0, V, n)
        ids[0] = cfg.get("bos_token_id", 0)
        ids[rng.integers(1, n)] = V - 1
        logits, margin = route_margin(model_dir, ids)
        if margin >= MIN_ROUTE_MARGIN:
            return [int(i) for i in ids], logits
    pytest.fail(f"{model_dir}: no prompt with routing margins >= {MIN_ROUTE_MARGIN}")


def dump_logits(model_dir, ids, out_file):
    r = dsrun("-m", model_dir, "--tokens", ",".join(map(str, ids)), "--dump-logits", out_file)
    assert r.returncode == 0, f"dsrun failed ({r.returncode}): {r.stderr}"
    V = ref.load(model_dir).cfg["vocab_size"]
    raw = pathlib.Path(out_file).read_bytes()
    assert len(raw) == len(ids) * V * 4, \
        f"--dump-logits wrote {len(raw)} bytes, want {len(ids)} x {V} x 4"
    return np.frombuffer(raw, dtype="<f4").reshape(len(ids), V).astype(np.float64)


def rowrel(a, b):
    return np.max(np.abs(a - b), axis=-1) / np.max(np.abs(b), axis=-1)


# ------------------------------------------------------------------ prefill logits

@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_prefill_logits_match_reference(models, kind, tmp_path):
    ids, want = pick_prompt(models[kind])
    got = dump_logits(models[kind], ids, tmp_path / "logits.f32")
    assert np.all(np.isfinite(got))
    rel = rowrel(got, want)
    worst = int(np.argmax(rel))
    assert rel.max() < LOGIT_RTOL, (
        f"{kind}: position {worst} (of {len(ids)}) differs by {rel[worst]:.3e} relative; "
        f"first bad positions {np.nonzero(rel >= LOGIT_RTOL)[0][:10].tolist()}")


def test_fp8_checkpoint_equals_its_dequantized_copy(models, tmp_path):
    ids, _ = pick_prompt(models["v3-fp8"])
    a = dump_logits(models["v3-fp8"], ids, tmp_path / "fp8.f32")
    b = dump_logits(models["v3-fp8-f32"], ids, tmp_path / "f32.f32")
    rel = rowrel(a, b)
    assert rel.max() < FP8_RTOL, f"worst position {int(np.argmax(rel))}: {rel.max():.3e}"


# ------------------------------------------------------------------ greedy generation

@pytest.mark.parametrize("kind", ("v3", "v3-fp8", "v2-lite"))
def test_greedy_ids_match_reference(models, kind):
    """Each generated id must be the reference argmax of the sequence so far
    (the reference recomputes the whole sequence every step, on the engine's own
    earlier choices).  Steps where the reference top-2 logits are within
    GREEDY_TIE x max|logit| accept either token (a near-tie), and steps whose
    routing has a near-tie are not judged; both are counted, and most steps must
    be judged strictly."""
    d = models[kind]
    cfg = ref.load(d).cfg
    ids, _ = pick_prompt(d)
    r = dsrun("-m", d, "--tokens", ",".join(map(str, ids)), "-n", N_GEN, "--temp", 0, "--ids")
    assert r.returncode == 0, f"dsrun failed ({r.returncode}): {r.stderr}"
    lines = [ln for ln in r.stdout.strip().splitlines() if ln.strip()]
    assert lines, f"no output; stderr: {r.stderr}"
    gen = json.loads(lines[-1])
    assert isinstance(gen, list) and all(isinstance(x, int) for x in gen), lines[-1]
    eos = cfg.get("eos_token_id")
    assert len(gen) == N_GEN or (0 < len(gen) < N_GEN and gen[-1] == eos), gen
    strict, ties, unjudged = 0, [], []
    for step, tok in enumerate(gen):
        ctx = ids + gen[:step]
        logits, margin = route_margin(d, ctx)
        last = logits[-1]
        assert 0 <= tok < cfg["vocab_size"], (step, tok)
        if margin < MIN_ROUTE_MARGIN:
            unjudged.append(step)
            continue
        order = np.argsort(-last)
        tol = GREEDY_TIE * np.max(np.abs(last))
        if last[order[0]] - last[order[1]] > tol:
            assert tok == order[0], (
                f"{kind} step {step}: engine chose {tok}, reference argmax {order[0]} "
                f"(logits {last[tok]:.5f} vs {last[order[0]]:.5f}); generated so far {gen[:step]}")
            strict += 1
        else:
            assert last[order[0]] - last[tok] <= tol, (step, tok, order[:3])
            ties.append(step)
    print(f"{kind}: {len(gen)} greedy steps: {strict} strict, near-ties at {ties}, "
          f"routing near-ties (not judged) at {unjudged}")
    assert strict >= len(gen) // 2, (strict, ties, unjudged)


# ------------------------------------------------------------------ error cases

def _copy(models, kind, tmp_path):
    dst = tmp_path / f"{kind}-copy"
    shutil.copytree(models[kind], dst)
    return dst


def test_missing_model_dir_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    r = dsrun("-m", missing, "--tokens", "1,2,3", "--dump-logits", tmp_path / "x.f32")
    assert r.returncode != 0
    assert str(missing) in r.stderr, r.stderr


@pytest.mark.parametrize("keep", ("half", "header"))
def test_truncated_shard_is_named(models, tmp_path, keep):
    d = _copy(models, "v3", tmp_path)
    shard = d / "model-00002-of-000003.safetensors"
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) // 2] if keep == "half" else raw[:12])
    r = dsrun("-m", d, "--tokens", "1,2,3", "--dump-logits", tmp_path / "x.f32")
    assert r.returncode != 0
    assert shard.name in r.stderr, r.stderr


def test_wrong_tensor_shape_names_tensor_and_both_shapes(models, tmp_path):
    d = _copy(models, "v3", tmp_path)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / index["weight_map"][name]
    tensors, meta = st.read_file(shard)
    good = tensors[name].shape                      # (176, 48) = [nh*(nope+v), kv_lora]
    assert good == (176, 48)
    bad = np.zeros((176, 47), dtype=np.uint16)
    bad[:] = tensors[name].data[:, :47]
    tensors[name] = st.Tensor("BF16", bad)
    st.write_file(shard, tensors, meta)
    r = dsrun("-m", d, "--tokens", "1,2,3", "--dump-logits", tmp_path / "x.f32")
    assert r.returncode != 0
    assert name in r.stderr, r.stderr
    # shapes in the file's [out, in] order, any punctuation: "[176, 48]", "176x48", ...
    assert re.search(r"176\D{1,4}48(?!\d)", r.stderr), r.stderr
    assert re.search(r"176\D{1,4}47(?!\d)", r.stderr), r.stderr


def test_unsupported_model_type_is_named(models, tmp_path):
    d = _copy(models, "v2-lite", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    r = dsrun("-m", d, "--tokens", "1,2,3", "--dump-logits", tmp_path / "x.f32")
    assert r.returncode != 0
    assert "mixtral" in r.stderr, r.stderr


def test_token_id_out_of_range_names_id_and_vocab(models, tmp_path):
    d = models["v2-lite"]
    V = ref.load(d).cfg["vocab_size"]
    bad = V + 17
    r = dsrun("-m", d, "--tokens", f"1,2,{bad}", "--dump-logits", tmp_path / "x.f32")
    assert r.returncode != 0
    assert str(bad) in r.stderr and str(V) in r.stderr, r.stderr

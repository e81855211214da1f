"""The parallel plans through dsrun itself: engine/driver.c forks `dsagent
worker` ranks (Gloo groups, docs/distributed.md), and world rank 0's results
must be the one-rank results.

For each tiny DeepSeek checkpoint (v3 BF16, v3-fp8, v2-lite; the session's
tiny_deepseek fixture) under each plan of the acceptance matrix

    TP=2, TP=4, PP=2, PP=3, EP=2, EP=4, TP=2xPP=2, TP=2xEP=2, PP=2xEP=2

and for the default GGUF model (models/default.gguf, SmolLM2-135M: 9 query
heads over 3 kv heads, skipped when absent) under TP=3, TP=2, PP=2 and TP=4
(the fourth rank holds no kv head: an uneven split):

- `dsrun -m M --tokens IDS --dump-logits F` (f32 LE [n_tokens][vocab], every
  prompt position) under the plan is within 1e-5 of plain dsrun's, per row:
  max |a - b| / max |b| <= 1e-5 on every position;
- `dsrun -m M --tokens IDS -n 16 --temp 0 --ids --ignore-eos` gives the same
  16 ids;
- the run really went through the plan's ranks: DSRUN_DSAGENT points at a
  wrapper that logs each rank's command line before it execs dsagent, and
  there is one line per rank, ranks 0..W-1, each with the plan's --tp --pp --ep.

The prompt is 14 tokens.  Every run uses --threads 1 (per rank): the CI
machine has 2 cores and the ranks of a plan share them.

PP=2 on the default model holds to 1e-5 here (bit for bit, as do its TP
plans) while test_plan_llama holds plan_check's PP=2 to 1e-3: dsrun's steps
hold one sequence, which the pipeline never cuts into micro-batches, so every
product has the rows of the one-rank call; plan_check's steps of several
sequences are cut, and the CPU's quantized products sum a row in an order
that depends on the row count.  Batches cut into micro-batches are
test_plan_numerics' --batch-check cases.
"""
import json
import os
import stat
import subprocess

import numpy as np
import pytest

from conftest import ROOT, binary

TIMEOUT = 300
RTOL = 1e-5
N_GEN = 16
GGUF = ROOT / "models" / "default.gguf"

PLANS = {
    "tp2": (2, 1, 1), "tp4": (4, 1, 1), "pp2": (1, 2, 1), "pp3": (1, 3, 1),
    "ep2": (1, 1, 2), "ep4": (1, 1, 4), "tp2pp2": (2, 2, 1), "tp2ep2": (2, 1, 2),
    "pp2ep2": (1, 2, 2),
}
GGUF_PLANS = {"tp3": (3, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "tp4-uneven": (4, 1, 1)}

# 14 ids below every vocabulary here (the tiny models' 368 and 400)
TINY_PROMPT = [3, 17, 5, 9, 22, 41, 8, 60, 11, 2, 33, 7, 19, 25]
GGUF_PROMPT = [1, 504, 3459, 314, 253, 1023, 42, 7, 900, 2201, 13, 88, 1500, 61]


def dsrun(*args, env=None):
    r = subprocess.run([binary("dsrun"), *map(str, args)], capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=ROOT, env=env)
    assert r.returncode == 0, f"dsrun {' '.join(map(str, args))}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return r


def plan_args(plan):
    tp, pp, ep = plan
    return ["--tp", tp, "--pp", pp, "--ep", ep]


@pytest.fixture
def rank_log(tmp_path):
    """(env, read): env runs the ranks through a wrapper that logs each one's
    arguments; read() returns the logged command lines."""
    log = tmp_path / "ranks.log"
    wrapper = tmp_path / "dsagent-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{binary("dsagent")}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ, DSRUN_DSAGENT=str(wrapper))
    return env, lambda: log.read_text().splitlines() if log.exists() else []


def assert_ran_ranks(lines, plan):
    tp, pp, ep = plan
    world = tp * pp * ep
    assert len(lines) == world, f"{len(lines)} ranks started, want {world}: {lines}"
    ranks = sorted(int(x.split("--rank ")[1].split()[0]) for x in lines)
    assert ranks == list(range(world)), lines
    assert all(f"--tp {tp} --pp {pp} --ep {ep}" in x for x in lines), lines


def dump_logits(model, ids, out, *extra, env=None):
    dsrun("-m", model, "--threads", "1", "--tokens", ",".join(map(str, ids)), "--dump-logits", out,
          *extra, env=env)
    a = np.fromfile(out, dtype="<f4")
    assert a.size > 0 and a.size % len(ids) == 0, f"{out}: {a.size} floats for {len(ids)} tokens"
    return a.reshape(len(ids), -1).astype(np.float64)


def greedy(model, ids, *extra, env=None):
    r = dsrun("-m", model, "--threads", "1", "--tokens", ",".join(map(str, ids)), "-n", N_GEN,
              "--temp", "0", "--ids", "--ignore-eos", *extra, env=env)
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Plain dsrun's logits and ids for a model, computed once per model."""
    cache = {}
    d = tmp_path_factory.mktemp("one_rank")

    def get(model, ids):
        if model not in cache:
            cache[model] = (dump_logits(model, ids, d / f"{len(cache)}.f32"), greedy(model, ids))
            assert len(cache[model][1]) == N_GEN
        return cache[model]

    return get


def check_plan(model, ids, plan, one_rank, rank_log, tmp_path):
    want_logits, want_ids = one_rank(model, ids)
    env, read_log = rank_log
    got = dump_logits(model, ids, tmp_path / "plan.f32", *plan_args(plan), env=env)
    assert_ran_ranks(read_log(), plan)
    assert got.shape == want_logits.shape
    assert np.all(np.isfinite(got))
    rel = np.abs(got - want_logits).max(axis=1) / np.abs(want_logits).max(axis=1)
    worst = int(np.argmax(rel))
    assert rel.max() <= RTOL, f"position {worst} of {len(ids)}: max rel err {rel[worst]:.3g}"
    assert greedy(model, ids, *plan_args(plan)) == want_ids


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("kind", ["v3", "v3-fp8", "v2-lite"])
def test_tiny_deepseek_plan_matches_one_rank(tiny_deepseek, one_rank, rank_log, tmp_path, kind, plan):
    check_plan(tiny_deepseek[kind], TINY_PROMPT, PLANS[plan], one_rank, rank_log, tmp_path)


@pytest.mark.skipif(not GGUF.exists(), reason="models/default.gguf is absent (make model)")
@pytest.mark.parametrize("plan", GGUF_PLANS)
def test_default_model_plan_matches_one_rank(one_rank, rank_log, tmp_path, plan):
    check_plan(GGUF, GGUF_PROMPT, GGUF_PLANS[plan], one_rank, rank_log, tmp_path)

"""The continuous-batching scheduler (engine/sched.c) through
build/tests/sched_check on a tiny DeepSeek V3 checkpoint and a tiny llama GGUF.

Independent checks:
  * greedy outputs of 8 concurrent requests (prompt lengths 2..60, one
    submitting thread each) equal the same requests run alone, also with a
    pool of 7 pages that forces preemptions and 5-token prefill chunks;
  * the per-step trace the tool records obeys the step rules (token budget,
    chunk size, contiguous positions, recompute from 0 after a preemption,
    every decoding sequence gets a token in every step);
  * log-probabilities equal log_softmax of `dsrun --dump-logits` rows computed
    in numpy (1e-4 absolute), top ids are that row's argsort;
  * finish rules (max_tokens, request eos ids, stop ids, ignore_eos),
    cancel / release / sched_free in flight, the waiting bound, a failed step.
Run against build-sched-asan style builds with DS_BUILD to check for leaks
(LeakSanitizer fails the tool's exit status)."""
import json
import random
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, binary

sys.path.insert(0, str(ROOT))
from tests.fixtures.tiny_llama import write_gguf, write_hf  # noqa: E402
from tests.fixtures.tiny_models import write_model  # noqa: E402

LENGTHS = (3, 17, 40, 9, 25, 60, 2, 33)
EBUSY = -8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("sched")
    d, cfg, w = write_hf(base / "llama-hf")
    return {
        "v3": (write_model("v3", base / "v3"), 400),
        "llama": (write_gguf(base / "llama.gguf", cfg, w), cfg["vocab_size"]),
    }


def run(model, reqs, tmp_path, *flags, check=True):
    path = tmp_path / f"reqs{random.random()}.json"
    path.write_text(json.dumps(reqs))
    r = subprocess.run([binary("tests/sched_check"), str(model), "--threads", "1",
                        "--requests", str(path), *map(str, flags)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


def prompts(seed, vocab, lengths=LENGTHS):
    g = random.Random(seed)
    return [[g.randrange(vocab) for _ in range(n)] for n in lengths]


def greedy(ps, max_tokens=24, **extra):
    return [dict(prompt=p, max_tokens=max_tokens, ignore_eos=True, **extra) for p in ps]


def check_trace(out, reqs, budget, chunk, page=None):
    """Step rules, from the trace alone: each step within budget; prefill
    chunks <= chunk; a sequence's positions continue where they stopped (or
    restart at 0 after a preemption in that step; with prefix caching, page
    given, at any whole page of its known ids); every sequence that
    decoded and is not done decodes again next step unless preempted; each
    request samples exactly once per delivered token."""
    trace = out["trace"]
    nxt, sampled, decoding = {}, {}, set()
    for step, n_tok, admitted, preempted, pages, seqs in trace:
        assert 0 < n_tok <= budget
        assert sum(e[1] for e in seqs) == n_tok
        present = {e[0] for e in seqs}
        assert len(present) == len(seqs)
        for r in decoding - present:  # left: finished or preempted in this step
            if sampled[r] < len(out["results"][r]["tokens"]):
                assert preempted > 0, f"request {r} skipped in step {step}"
        decoding = set()
        seen_prefill = False
        for r, n, pos, dec, smp in seqs:
            if dec:
                assert n == 1 and not seen_prefill, "decodes come first"
                decoding.add(r)
            else:
                seen_prefill = True
                assert n <= chunk
            known = len(reqs[r]["prompt"]) + sampled.get(r, 0)  # ids before this sample
            assert (pos == nxt.get(r, 0) or pos == 0 or
                    (page and pos % page == 0 and pos < known)), (step, r, pos, nxt.get(r))
            nxt[r] = pos + n
            sampled[r] = sampled.get(r, 0) + smp
            # logits only for the last known id: prompt + generated so far
            assert nxt[r] == known if smp else nxt[r] < known
    for r, res in enumerate(out["results"]):
        assert sampled.get(r, 0) == len(res["tokens"]), r


@pytest.mark.parametrize("kind", ["v3", "llama"])
def test_concurrent_equals_alone(models, kind, tmp_path):
    model, vocab = models[kind]
    reqs = greedy(prompts(1, vocab))
    # slow steps (0.5 ms) so the 8 submitting threads land while the first run
    out = run(model, reqs, tmp_path, "--alone", "--batch-tokens", 64, "--step-delay-us", 500)
    for r, (a, b) in enumerate(zip(out["results"], out["alone"])):
        assert a["finish"] == b["finish"] == "length"
        assert len(a["tokens"]) == 24
        assert a["tokens"] == b["tokens"], r
    st = out["stats"]
    assert st["prompt_tokens"] == sum(LENGTHS)
    assert st["generation_tokens"] == 24 * len(LENGTHS)
    assert st["preemptions"] == 0 and st["running"] == 0 and st["waiting"] == 0
    assert out["pages_used_after"] == 0 and st["kv_pages_used"] == 0
    assert max(t[1] for t in out["trace"]) == out["max_step_tokens"] <= 64
    # several sequences really shared steps
    assert max(len(t[5]) for t in out["trace"]) >= 4
    check_trace(out, reqs, 64, 64)


@pytest.mark.parametrize("kind", ["v3", "llama"])
def test_preemption_and_chunks_equal_alone(models, kind, tmp_path):
    model, vocab = models[kind]
    reqs = greedy(prompts(2, vocab))
    # 7 pages of 16 positions hold one 83-position sequence; 8 may run at once
    out = run(model, reqs, tmp_path, "--alone", "--pages", 7, "--page-size", 16, "--chunk", 5,
              "--max-running", 8, "--budget", 16, "--step-delay-us", 300)
    st = out["stats"]
    assert st["preemptions"] > 0
    assert sum(t[3] for t in out["trace"]) == st["preemptions"]
    assert st["prompt_tokens"] == sum(LENGTHS)  # counted once, not per recompute
    for r, (a, b) in enumerate(zip(out["results"], out["alone"])):
        assert a["finish"] == b["finish"] == "length"
        assert a["tokens"] == b["tokens"], r
    assert out["max_step_tokens"] <= 16
    assert all(t[4] <= 7 for t in out["trace"])
    assert out["pages_used_after"] == 0
    check_trace(out, reqs, 16, 5)
    # a recompute really happened: some request restarted at position 0
    restarted = set()
    first = {}
    for t in out["trace"]:
        for r, n, pos, dec, smp in t[5]:
            if r in first and pos == 0:
                restarted.add(r)
            first.setdefault(r, pos)
    assert restarted


@pytest.mark.parametrize("kind", ["v3", "llama"])
def test_prefix_caching_with_preemption_equals_alone(models, kind, tmp_path):
    """Prefix caching (sched_params.prefix_caching) in a pool that preempts:
    requests sharing a 40-token start reuse each other's pages and their own
    after a preemption, and every output equals the request run alone with
    an empty cache (each --alone run gets a fresh scheduler)."""
    model, vocab = models[kind]
    g = random.Random(7)
    shared = [g.randrange(vocab) for _ in range(40)]
    reqs = greedy([shared + p for p in prompts(3, vocab, (3, 9, 17, 1, 12, 5))], max_tokens=20)
    out = run(model, reqs, tmp_path, "--alone", "--prefix-caching", "--ordered", "--pages", 8,
              "--page-size", 16, "--chunk", 5, "--max-running", 6, "--budget", 16,
              "--step-delay-us", 300)
    st = out["stats"]
    for r, (a, b) in enumerate(zip(out["results"], out["alone"])):
        assert a["finish"] == b["finish"] == "length"
        assert a["tokens"] == b["tokens"], r
    assert st["prefix_hits"] >= 32 and st["prefix_queries"] >= sum(len(q["prompt"]) for q in reqs)
    assert st["preemptions"] > 0
    assert out["pages_used_after"] == 0 and st["kv_pages_used"] == 0
    assert 0 < st["kv_pages_cached"] <= 8  # published pages stay, evictable
    check_trace(out, reqs, 16, 5, page=16)
    # a request started past position 0 at its first step: reused pages
    first = {}
    for t in out["trace"]:
        for r, n, pos, dec, smp in t[5]:
            first.setdefault(r, pos)
    assert any(p > 0 for p in first.values()), first


def test_decode_not_stalled_by_chunked_prefill(models, tmp_path):
    model, vocab = models["v3"]
    a, b = prompts(3, vocab, (4, 100))
    reqs = [dict(prompt=a, max_tokens=30, ignore_eos=True),
            dict(prompt=b, max_tokens=4, ignore_eos=True)]
    out = run(model, reqs, tmp_path, "--ordered", "--chunk", 5, "--budget", 5)
    check_trace(out, reqs, 5, 5)
    a_samples, overlap = 0, 0
    for step, n_tok, _, _, _, seqs in out["trace"]:
        by = {e[0]: e for e in seqs}
        b_prefill = 1 in by and not by[1][4]
        if b_prefill:
            assert by[1][1] <= 5
            if 0 < a_samples < 30:
                assert 0 in by and by[0][3] == 1 and by[0][1] == 1, f"A stalled in step {step}"
                overlap += 1
        if 0 in by:
            a_samples += by[0][4]
    assert overlap >= 20  # B's 100 tokens take 25 chunks of 4 beside A
    assert [len(r["tokens"]) for r in out["results"]] == [30, 4]


def test_cancel_and_release_free_pages(models, tmp_path):
    model, vocab = models["v3"]
    ps = prompts(4, vocab, (5, 12, 7, 30))
    reqs = [dict(prompt=ps[0], max_tokens=100, ignore_eos=True, cancel_after=3),
            dict(prompt=ps[1], max_tokens=100, ignore_eos=True, release_after=2),
            dict(prompt=ps[2], max_tokens=10, ignore_eos=True),
            dict(prompt=ps[3], max_tokens=60, ignore_eos=True, cancel_after=1)]
    out = run(model, reqs, tmp_path, "--step-delay-us", 2000)
    res = out["results"]
    assert res[0]["finish"] == "abort" and 3 <= len(res[0]["tokens"]) < 100
    assert res[1]["finish"] == "released"
    assert res[2]["finish"] == "length" and len(res[2]["tokens"]) == 10
    assert res[3]["finish"] == "abort" and 1 <= len(res[3]["tokens"]) < 60
    assert out["pages_used_after"] == 0
    assert out["stats"]["kv_pages_used"] == 0 and out["stats"]["running"] == 0


def test_free_with_requests_in_flight(models, tmp_path):
    model, vocab = models["llama"]
    reqs = greedy(prompts(5, vocab, (6, 20, 3, 11)), max_tokens=150)
    out = run(model, reqs, tmp_path, "--max-running", 2, "--free-after", 2,
              "--step-delay-us", 2000)
    for r in out["results"]:
        assert r["finish"] == "abort" and len(r["tokens"]) < 150
    assert any(len(r["tokens"]) >= 2 for r in out["results"])
    assert out["pages_used_after"] == 0


def test_waiting_queue_bound(models, tmp_path):
    model, vocab = models["v3"]
    reqs = greedy(prompts(6, vocab, (8,)), max_tokens=50)
    out = run(model, reqs, tmp_path, "--busy", "--max-running", 1, "--max-waiting", 2)
    busy = out["busy"]
    assert busy["codes"] == [0, 0, 0, EBUSY]
    assert busy["held_stats"]["running"] == 1 and busy["held_stats"]["waiting"] == 0
    assert busy["full_stats"]["waiting"] == 2
    assert busy["finish"] == ["abort"] * 3
    assert out["pages_used_after"] == 0


@pytest.mark.parametrize("kind", ["v3", "llama"])
def test_finish_rules(models, kind, tmp_path):
    model, vocab = models[kind]
    p = prompts(7, vocab, (9,))[0]
    base = run(model, [dict(prompt=p, max_tokens=12, ignore_eos=True)], tmp_path)["results"][0]
    assert base["finish"] == "length" and len(base["tokens"]) == 12
    toks = base["tokens"]
    t = toks[3]
    cut = toks.index(t) + 1  # the first time greedy produces it
    reqs = [dict(prompt=p, max_tokens=12, eos_ids=[t]),
            dict(prompt=p, max_tokens=12, eos_ids=[t], ignore_eos=True),
            dict(prompt=p, max_tokens=12, stop_ids=[t], ignore_eos=True),
            dict(prompt=p, max_tokens=5, ignore_eos=True)]
    res = run(model, reqs, tmp_path)["results"]
    assert res[0]["finish"] == "stop" and res[0]["tokens"] == toks[:cut]
    assert res[1]["finish"] == "length" and res[1]["tokens"] == toks
    assert res[2]["finish"] == "stop" and res[2]["tokens"] == toks[:cut]
    assert res[3]["finish"] == "length" and res[3]["tokens"] == toks[:5]


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("kind", ["v3", "llama"])
def test_logprobs_match_dumped_logits(models, kind, tmp_path):
    model, vocab = models[kind]
    ps = prompts(8, vocab, (7, 15, 4))
    reqs = [dict(prompt=ps[0], max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5),
            # sampled and penalised: logprobs stay those of the raw logits
            dict(prompt=ps[1], max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5,
                 temperature=0.8, seed=3, repetition_penalty=1.3),
            dict(prompt=ps[2], max_tokens=6, ignore_eos=True)]
    out = run(model, reqs, tmp_path)
    for r, q in zip(out["results"][:2], reqs):
        ids = q["prompt"] + r["tokens"][:-1]
        f = tmp_path / "logits.bin"
        d = subprocess.run([binary("dsrun"), "-m", str(model), "--tokens", ",".join(map(str, ids)),
                            "-n", "1", "--dump-logits", str(f)],
                           capture_output=True, text=True, timeout=120)
        assert d.returncode == 0, d.stderr
        ref = log_softmax(np.fromfile(f, dtype="<f4").reshape(len(ids), vocab))
        n0 = len(q["prompt"]) - 1
        for i, tok in enumerate(r["tokens"]):
            row = ref[n0 + i]
            assert abs(r["logprobs"][i] - row[tok]) < 1e-4
            want = np.argsort(-row, kind="stable")[:5]
            got = [e[0] for e in r["top"][i]]
            assert got == list(want), (i, got, want)
            assert np.abs(np.array([e[1] for e in r["top"][i]]) - row[want]).max() < 1e-4
            if "temperature" not in q:
                assert tok == want[0]
    assert out["results"][2]["top"] == [[]] * 6


def test_seeded_sampling_reproduces(models, tmp_path):
    model, vocab = models["v3"]
    ps = prompts(9, vocab, (10, 10, 21))
    reqs = [dict(prompt=ps[0], max_tokens=20, ignore_eos=True, temperature=0.8, seed=11),
            dict(prompt=ps[0], max_tokens=20, ignore_eos=True, temperature=0.8, seed=12),
            dict(prompt=ps[2], max_tokens=20, ignore_eos=True, temperature=0.8, seed=11,
                 top_p=0.9)]
    one = run(model, reqs, tmp_path, "--alone")
    two = run(model, reqs, tmp_path, "--pages", 4, "--chunk", 3, "--budget", 8,
              "--max-running", 3)
    toks = [r["tokens"] for r in one["results"]]
    assert toks == [r["tokens"] for r in one["alone"]]
    assert toks == [r["tokens"] for r in two["results"]]
    assert toks[0] != toks[1]  # the seed matters


def test_failed_step_errors_its_batch_only(models, tmp_path):
    model, vocab = models["llama"]
    reqs = greedy(prompts(10, vocab, (5, 9, 4)), max_tokens=8)
    out = run(model, reqs, tmp_path, "--ordered", "--max-running", 2, "--fail-step", 3, "--alone")
    step3 = next(t for t in out["trace"] if t[0] == 3)
    failed = {e[0] for e in step3[5]}  # max_running 2, all queued by step 2
    assert failed == {0, 1}
    for r, res in enumerate(out["results"]):
        if r in failed:
            assert res["finish"] == "error" and "fault injection" in res["error"]
            assert res["tokens"] == out["alone"][r]["tokens"][:len(res["tokens"])]
        else:
            assert res["finish"] == "length" and res["tokens"] == out["alone"][r]["tokens"]
    assert out["pages_used_after"] == 0 and out["stats"]["alive"] == 1


def test_rejected_requests(models, tmp_path):
    model, vocab = models["v3"]  # context 128
    reqs = [dict(prompt=[5] * 100, max_tokens=29),
            dict(prompt=[5, 6], max_tokens=4, logprobs=True, top_logprobs=21),
            dict(prompt=[5, 6], max_tokens=4, top_logprobs=2),
            dict(prompt=[], max_tokens=4),
            dict(prompt=[5, 6], max_tokens=4, top_p=0),
            dict(prompt=[5] * 40, max_tokens=40)]
    res = run(model, reqs, tmp_path, "--pages", 4)["results"]
    assert [r["finish"] for r in res] == ["rejected"] * 6
    assert "100" in res[0]["error"] and "29" in res[0]["error"] and "128" in res[0]["error"]
    assert "top_logprobs" in res[1]["error"] and "top_logprobs" in res[2]["error"]
    assert "empty" in res[3]["error"]
    assert "top_p" in res[4]["error"]
    assert "pages" in res[5]["error"]

"""Serving benchmark in the manner of vLLM's benchmark_serving (make bench).

Starts its own dsagent (binary from $DS_BUILD, default build/) on the default
model (or --model) with API keys off on loopback, then for each concurrency
level (default 1, 4, 16) sends a fixed number of requests (max(8, 2 x level)
unless --requests) through a pool of that many client threads:

    POST /v1/completions  {"prompt": ~512 tokens of varied text, "max_tokens": 128,
                           "ignore_eos": true, "temperature": 0, "stream": true,
                           "stream_options": {"include_usage": true}}

Every prompt is different (sentences drawn from a seeded generator, its
length checked with POST /tokenize).  Per request, from the client side:
TTFT = time to the first SSE chunk with non-empty choices (vLLM's rule),
E2E = time to the last chunk, output tokens from the usage chunk, and
TPOT = (E2E - TTFT) / (output_tokens - 1).  Per level it prints request
throughput (req/s), output tokens/s (all output tokens / wall time of the
level), TTFT p50/p99 and TPOT p50/p99; finally the ratio of output tok/s at
the highest level over the lowest (continuous batching should give >= 4x at
16 vs 1).  --json prints one JSON object instead.

Standard library only (threads + http.client).

Usage: python tests/bench/bench_serving.py [--model PATH] [--levels 1,4,16]
       [--requests N] [--prompt-len 512] [--output-len 128] [--threads T]
       [--backend auto|cpu|cuda] [--json]
"""
import argparse
import http.client
import json
import math
import os
import pathlib
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = ROOT / os.environ.get("DS_BUILD", "build")
sys.path.insert(0, str(ROOT))
from tests.fixtures.agent import AgentProcess  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river mountain garden "
         "engine lantern harbor copper meadow thunder marble orbit canyon velvet ember signal "
         "library window market teacher doctor village ocean forest winter summer morning "
         "evening kitchen bridge station journey letter picture music story history science "
         "language question answer reason energy machine network system pattern").split()
VERBS = ("finds builds watches carries follows changes opens remembers explains describes "
         "measures paints repairs visits crosses studies writes reads moves holds").split()
ADJS = ("quiet bright old new small large distant early late gentle strange simple careful "
        "silver green hidden broken famous narrow ancient modern").split()


def sentence(rng):
    return (f"The {rng.choice(ADJS)} {rng.choice(WORDS)} {rng.choice(VERBS)} a "
            f"{rng.choice(ADJS)} {rng.choice(WORDS)} near the {rng.choice(WORDS)}"
            f"{rng.choice(['.', ',', ';', '!', '?'])} ")


class Agent:
    def __init__(self, model, threads, backend, extra):
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-serving-")
        tmp = pathlib.Path(self.tmp.name)
        (tmp / "data").mkdir()
        exe = BUILD / "dsagent"
        if not exe.exists():
            sys.exit(f"bench_serving: {exe} is missing: run `make` first")
        cmd = ["--bind", "127.0.0.1", "--control-port", "0", "--api-port", "0",
               "--data-dir", str(tmp / "data"), "--insecure-no-auth", "--backend", backend,
               "--threads", str(threads), "--model", str(model), *extra]
        self.agent = AgentProcess(exe, cmd, log_dir=tmp)
        self.proc = self.agent.proc
        try:
            self.port = self.agent.wait_listening(300).api_port
            self.model = self.agent.wait_serving(300)
        except RuntimeError as e:
            self.stop()
            sys.exit(f"bench_serving: {e}")

    def call(self, method, path, body=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            c.request(method, path, body=json.dumps(body) if body is not None else None,
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
        finally:
            c.close()
        if r.status != 200:
            raise RuntimeError(f"{method} {path}: HTTP {r.status}: {data[:300]!r}")
        return json.loads(data)

    def metric(self, name):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        c.close()
        m = re.search(r"^" + re.escape(name) + r"\{[^}]*\} (\S+)$", text, re.M)
        return float(m.group(1)) if m else float("nan")

    def stop(self):
        self.agent.stop(signal.SIGTERM, timeout=30)
        self.tmp.cleanup()


def make_prompt(agent, rng, target):
    """Varied text of at most target tokens (counted by the server's
    tokenizer), as close to it as whole words allow; returns (text, tokens)."""
    words = []
    while len(words) < target * 2:
        words += sentence(rng).split()
    count = lambda w: agent.call("POST", "/tokenize", {"prompt": " ".join(words[:w])})["count"]  # noqa: E731
    lo, hi = 1, len(words)  # count(lo) <= target < count(hi) (words >= 1 token each)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= target:
            lo = mid
        else:
            hi = mid
    return " ".join(words[:lo]), count(lo)


def one_request(port, prompt, output_len):
    """Returns (ttft s, e2e s, output tokens) measured by the client."""
    body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    t0 = time.perf_counter()
    ttft = last = None
    out_tokens = None
    try:
        c.request("POST", "/v1/completions", body=json.dumps(body),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        done = False
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            ev = json.loads(payload)
            if "error" in ev:
                raise RuntimeError(f"error event: {ev['error']}")
            now = time.perf_counter()
            if ev.get("choices"):
                if ttft is None:
                    ttft = now - t0
                last = now - t0
            if ev.get("usage"):
                out_tokens = ev["usage"]["completion_tokens"]
        if not done:
            raise RuntimeError("stream ended without [DONE]")
    finally:
        c.close()
    if ttft is None or out_tokens is None:
        raise RuntimeError("no choice chunk or no usage chunk")
    return ttft, last, out_tokens


def percentile(xs, p):
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_level(agent, prompts, concurrency, output_len):
    results, errors = [], []
    lock = threading.Lock()
    queue = list(prompts)

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                p = queue.pop(0)
            try:
                r = one_request(agent.port, p, output_len)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    tpots = [(r[1] - r[0]) / (r[2] - 1) for r in results if r[2] > 1]
    out = sum(r[2] for r in results)
    return {
        "concurrency": concurrency, "requests": len(results), "failed": len(errors),
        "errors": errors[:5], "duration_s": round(wall, 3),
        "request_throughput": round(len(results) / wall, 4),
        "output_tok_s": round(out / wall, 2), "output_tokens": out,
        "mean_output_tokens": round(out / len(results), 2) if results else 0,
        "ttft_ms_p50": round(1e3 * percentile(ttfts, 50), 1),
        "ttft_ms_p99": round(1e3 * percentile(ttfts, 99), 1),
        "tpot_ms_p50": round(1e3 * percentile(tpots, 50), 2),
        "tpot_ms_p99": round(1e3 * percentile(tpots, 99), 2),
        "e2e_ms_mean": round(1e3 * statistics.fmean([r[1] for r in results]), 1)
        if results else float("nan"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "default.gguf"))
    ap.add_argument("--levels", default="1,4,16", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per level (default: max(8, 2 x concurrency))")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="dsagent --threads (0 = one per core)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("agent_args", nargs="*", help="extra dsagent flags (after --)")
    a = ap.parse_args()
    if not pathlib.Path(a.model).exists():
        sys.exit(f"bench_serving: {a.model} is missing (`make model` fetches the default model)")
    levels = [int(x) for x in a.levels.split(",") if x.strip()]
    say = (lambda *x: None) if a.json else (lambda *x: print(*x, flush=True))

    agent = Agent(a.model, a.threads, a.backend, a.agent_args)
    try:
        rng = random.Random(a.seed)
        counts = {c: a.requests or max(8, 2 * c) for c in levels}
        say(f"bench_serving: model {agent.model} ({a.model}), prompts ~{a.prompt_len} tokens, "
            f"{a.output_len} output tokens (ignore_eos, temperature 0), levels {levels}, "
            f"requests {[counts[c] for c in levels]}")
        prompts = {c: [make_prompt(agent, rng, a.prompt_len) for _ in range(counts[c])]
                   for c in levels}
        lens = [n for c in levels for _, n in prompts[c]]
        say(f"bench_serving: prompt tokens min {min(lens)} mean {statistics.fmean(lens):.0f} "
            f"max {max(lens)}")
        one_request(agent.port, make_prompt(agent, rng, 32)[0], 8)  # warm-up
        rows = []
        for c in levels:
            row = run_level(agent, [p for p, _ in prompts[c]], c, a.output_len)
            row["mean_prompt_tokens"] = round(statistics.fmean(n for _, n in prompts[c]), 1)
            rows.append(row)
            say(f"concurrency {c:>3}: {row['requests']} req ({row['failed']} failed) in "
                f"{row['duration_s']:.1f} s | {row['request_throughput']:.3f} req/s | "
                f"{row['output_tok_s']:.1f} output tok/s | TTFT p50 {row['ttft_ms_p50']:.0f} ms "
                f"p99 {row['ttft_ms_p99']:.0f} ms | TPOT p50 {row['tpot_ms_p50']:.1f} ms "
                f"p99 {row['tpot_ms_p99']:.1f} ms")
            for e in row["errors"]:
                say(f"  error: {e}")
        preempt = agent.metric("vllm:num_preemptions_total")
    finally:
        agent.stop()
    lo, hi = rows[0], rows[-1]
    ratio = hi["output_tok_s"] / lo["output_tok_s"] if lo["output_tok_s"] else float("nan")
    summary = {"model": agent.model, "model_path": str(a.model), "prompt_len": a.prompt_len,
               "output_len": a.output_len, "threads": a.threads, "backend": a.backend,
               "preemptions": preempt, "levels": rows,
               "scaling": {"from": lo["concurrency"], "to": hi["concurrency"],
                           "output_tok_s_ratio": round(ratio, 2), "target": 4.0}}
    if a.json:
        print(json.dumps(summary))
    else:
        say(f"output tok/s at concurrency {hi['concurrency']} / concurrency {lo['concurrency']}: "
            f"{ratio:.2f}x (target >= 4x){'' if ratio >= 4 else '  BELOW TARGET'}")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

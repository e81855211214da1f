"""Prefix-caching benchmark (make bench): time to first token of a chat's
second turn over its first, with automatic prefix caching on and off.

Starts one dsagent (binary from $DS_BUILD, default build/) per setting on the
default model (or --model), API keys off, on loopback.  Each round is a new
chat (different seeded text, so nothing of an earlier round is cached):

    turn 1: system + user(shared history of ~--history tokens + question)
    turn 2: turn 1's messages + the assistant's answer + a new question

both greedy (temperature 0), max_tokens 16, streamed; TTFT is the time to
the first chunk with content, from the client.  Per setting it prints each
round's TTFTs and the median ratio turn 2 / turn 1 (the target with the
cache is <= 0.2), the prefix-cache counters (vllm:prefix_cache_queries_total,
vllm:prefix_cache_hits_total, in tokens) and whether both settings gave the
same answers.  The shared history's length is checked with POST /tokenize.

Standard library only.

Usage: python tests/bench/bench_prefix_cache.py [--model PATH] [--rounds 5]
       [--history 1500] [--threads T] [--backend auto|cpu|cuda] [--json]
"""
import argparse
import http.client
import json
import os
import pathlib
import random
import re
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests.bench.bench_serving import Agent as ServingAgent  # noqa: E402

WORDS = ("river mountain lantern copper whisper orchard glacier harbor velvet meadow "
         "compass thunder saffron pillar quartz ember falcon willow marble canyon violet "
         "anchor prairie cobalt beacon tundra juniper lagoon granite sparrow").split()
VERBS = "carries finds paints measures remembers hides follows builds answers counts".split()


def history(seed, n_sentences):
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        w = rng.sample(WORDS, 5)
        out.append(f"The {w[0]} {rng.choice(VERBS)} {rng.randint(2, 999)} {w[1]}s near the "
                   f"{w[2]} while a {w[3]} {rng.choice(VERBS)} the {w[4]}.")
    return "Here are my travel notes; I will ask about them.\n\n" + " ".join(out)


class Agent(ServingAgent):
    """bench_serving.py's agent (started the same way, call and metric) with a
    streamed chat call that times the first token."""

    def chat(self, messages):
        """(answer, ttft seconds) of a greedy streamed chat call."""
        body = {"model": self.model, "messages": messages, "max_tokens": 16, "temperature": 0,
                "stream": True}
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.monotonic()
        ttft, parts = None, []
        try:
            c.request("POST", "/v1/chat/completions", body=json.dumps(body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                raise RuntimeError(f"chat: HTTP {r.status}: {r.read()[:300]!r}")
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                for ch in ev.get("choices", []):
                    piece = ch.get("delta", {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.monotonic() - t0
                        parts.append(piece)
        finally:
            c.close()
        return "".join(parts), ttft


def run_setting(a, label, rounds, n_sentences):
    rows, answers = [], []
    for r in range(rounds):
        msgs = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": history(1000 + r, n_sentences) +
                 "\n\nWhich river is mentioned first?"}]
        n_hist = a.call("POST", "/tokenize", {"messages": msgs})["count"]
        ans1, t1 = a.chat(msgs)
        msgs += [{"role": "assistant", "content": ans1},
                 {"role": "user", "content": "And which metal?"}]
        ans2, t2 = a.chat(msgs)
        rows.append({"round": r + 1, "turn1_prompt_tokens": n_hist, "ttft1_s": t1, "ttft2_s": t2,
                     "ratio": t2 / t1})
        answers.append((ans1, ans2))
        print(f"  {label} round {r + 1}: turn-1 prompt {n_hist} tokens, TTFT turn 1 "
              f"{t1 * 1000:.0f} ms, turn 2 {t2 * 1000:.0f} ms, ratio {t2 / t1:.3f}", flush=True)
    res = {"median_ratio": statistics.median(x["ratio"] for x in rows),
           "median_ttft1_s": statistics.median(x["ttft1_s"] for x in rows),
           "median_ttft2_s": statistics.median(x["ttft2_s"] for x in rows),
           "queries_tokens": a.metric("vllm:prefix_cache_queries_total"),
           "hits_tokens": a.metric("vllm:prefix_cache_hits_total"),
           "rounds": rows}
    return res, answers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "default.gguf"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--history", type=int, default=1500, help="shared history, tokens (about)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cpu = open("/proc/cpuinfo").read()
    name = re.search(r"model name\s*:\s*(.*)", cpu)
    isa = "avx512" if " avx512f" in cpu else "avx2"
    print(f"bench_prefix_cache: {name.group(1) if name else '?'}, {isa} "
          f"(DS_CPU_ISA={os.environ.get('DS_CPU_ISA', 'unset')}), {os.cpu_count()} CPUs, "
          f"threads {a.threads}, model {pathlib.Path(a.model).name}, {a.rounds} rounds, "
          f"history ~{a.history} tokens", flush=True)
    n_sentences = max(1, a.history // 20)  # about 20 tokens a sentence (checked below)
    out = {}
    answers = {}
    for label, extra in (("cache on", []), ("cache off", ["--no-enable-prefix-caching"])):
        ag = Agent(a.model, a.threads, a.backend, extra)
        try:
            out[label], answers[label] = run_setting(ag, label, a.rounds, n_sentences)
        finally:
            ag.stop()
    same = answers["cache on"] == answers["cache off"]
    if a.json:
        print(json.dumps({"settings": out, "same_answers": same}, indent=1))
        return
    for label, r in out.items():
        print(f"{label}: median TTFT turn 1 {r['median_ttft1_s'] * 1000:.0f} ms, turn 2 "
              f"{r['median_ttft2_s'] * 1000:.0f} ms, median ratio {r['median_ratio']:.3f}; "
              f"prefix cache hits {r['hits_tokens']:.0f} of {r['queries_tokens']:.0f} tokens "
              f"queried")
    target = "met" if out["cache on"]["median_ratio"] <= 0.2 else "NOT met"
    print(f"target turn-2 TTFT <= 0.2x turn 1 with the cache: {target}; identical greedy "
          f"answers with the cache on and off: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()

"""Distributed-engine benchmark on the synthetic V3-shaped model (make bench).

Uses the FP8 V3-shaped checkpoint that bench_engine.py writes (cached under
.cache/bench/; written here when absent) and runs, in one run,

    dsrun -m DIR --bench --prompt-len P -n N --batch 1 --json  --tp 1 --threads 2
    dsrun -m DIR --bench ... --tp 2 --threads 1
    dsrun -m DIR --bench ... --ep 2 --threads 1
    dsrun -m DIR --bench ... --tp 2 --threads 1   with DSWORKER_COMM_SPIN=off

It reports batch-1 decode tokens/s of each plan, the ratio of each two-rank
plan to the one-rank baseline (the same cores: 2 threads in one process
against 1 thread in each of 2 ranks; the issue's target is >= 0.8), and the
communication seconds per step.  The two-rank plans run with the worker's
default --comm-spin auto (on here: 2 ranks x 1 thread fit 2 cores); the last
row turns it off, to show what sleeping in recv at every collective costs.

Memory: for each rank of the two-rank plans, the weight bytes the rank
reports (model_weight_bytes: what it copied out of the checkpoint) against
its share computed here from the safetensors headers by the split rules of
docs/distributed.md (target: within 2%), and its peak RSS against that share
plus its KV cache plus 64 MiB.

Usage: python tests/bench/bench_distributed.py [--quick] [--rounds N]
"""
import argparse
import json
import math
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench.bench_engine import QUICK, SHAPE, model_dir  # noqa: E402

BUILD = ROOT / os.environ.get("DS_BUILD", "build")
MIB = 1 << 20


def headers(d):
    """{name: (dtype, shape)} from the safetensors headers."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h = json.loads(fh.read(n))
        for k, v in h.items():
            if k != "__metadata__":
                out[k] = (v["dtype"], v["shape"])
    return out


def split(n, parts, i):
    q, r = divmod(n, parts)
    return i * q + min(i, r), q + (1 if i < r else 0)


ELEM = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}


def window_bytes(hd, name, r0, rows, c0, cols, block=128):
    """Bytes of the owned copy of a window (engine/model.c model_weight_window):
    FP8 codes padded to 64 plus a scale grid of block gcd(block, r0, c0);
    other dtypes the window's elements."""
    dt, _ = hd[name]
    if rows == 0 or cols == 0:
        return 0
    if dt == "F8_E4M3" and name + "_scale_inv" in hd:
        g = math.gcd(math.gcd(block, r0), c0)
        if g < 16:
            return rows * cols * 4
        code = rows * cols
        return ((code + 63) & ~63) + math.ceil(rows / g) * math.ceil(cols / g) * 4
    return rows * cols * ELEM[dt]


def share_bytes(d, tp, ep, rank):
    """Weight bytes of `rank` in a one-stage plan tp x ep (docs/distributed.md):
    attention heads, dense and shared MLP split over the S = tp*ep ranks of
    the stage (local index l = rank); routed experts whole over ep, each
    expert's intermediate size over tp (gate/up rows, down columns); lm_head
    rows over S; everything else replicated."""
    cfg = json.loads((d / "config.json").read_text())
    hd = headers(d)
    S = tp * ep
    t, e = rank % tp, rank // tp
    H, qk = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    kvp = cfg["qk_nope_head_dim"] + cfg["v_head_dim"]
    h0, hn = split(H, S, rank)
    e0, en = split(cfg["n_routed_experts"], ep, e)
    j0, jn = split(cfg["moe_intermediate_size"], tp, t)
    total = 0
    for name, (dt, shape) in hd.items():
        if name.endswith("_scale_inv") or len(shape) != 2:
            continue  # scale grids go with their weight; vectors are f32 copies (extra bytes)
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m and int(m.group(1)) >= cfg["num_hidden_layers"]:
            continue  # the MTP layer is never loaded
        n, k = shape
        rest = m.group(2) if m else name
        if rest in ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight"):
            total += window_bytes(hd, name, h0 * qk, hn * qk, 0, k)
        elif rest == "self_attn.kv_b_proj.weight":
            total += window_bytes(hd, name, h0 * kvp, hn * kvp, 0, k)
        elif rest == "self_attn.o_proj.weight":
            vd = cfg["v_head_dim"]
            total += window_bytes(hd, name, 0, n, h0 * vd, hn * vd)
        elif re.match(r"mlp\.(shared_experts\.)?(gate|up)_proj\.weight", rest):
            r0, rn = split(n, S, rank)
            total += window_bytes(hd, name, r0, rn, 0, k)
        elif re.match(r"mlp\.(shared_experts\.)?down_proj\.weight", rest):
            c0, cn = split(k, S, rank)
            total += window_bytes(hd, name, 0, n, c0, cn)
        elif (mx := re.match(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj", rest)):
            if e0 <= int(mx.group(1)) < e0 + en:
                if mx.group(2) == "down":
                    total += window_bytes(hd, name, 0, n, j0, jn)
                else:
                    total += window_bytes(hd, name, j0, jn, 0, k)
        elif name == "lm_head.weight":
            r0, rn = split(n, S, rank)
            total += window_bytes(hd, name, r0, rn, 0, k)
        else:
            total += window_bytes(hd, name, 0, n, 0, k)
    return total


def run(d, plan, threads, prompt_len, n, env=None):
    cmd = [str(BUILD / "dsrun"), "-m", str(d), "--bench", "--prompt-len", str(prompt_len),
           "-n", str(n), "--batch", "1", "--threads", str(threads), "--json",
           "--ctx", str(prompt_len + n + 64)]
    for k, v in plan.items():
        cmd += [f"--{k}", str(v)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                       env=dict(os.environ, **(env or {})))
    if r.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the smaller model, fewer tokens")
    ap.add_argument("--rounds", type=int, default=2, help="best of N runs per plan")
    a = ap.parse_args()
    shape, tag = (QUICK, "quick") if a.quick else (SHAPE, "v3shape")
    prompt_len, n = (32, 16) if a.quick else (64, 64)
    d = model_dir("v3-fp8", shape, tag)
    cfg = json.loads((d / "config.json").read_text())
    kv_row = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    plans = [("tp1 x 2 threads", {"tp": 1}, 2), ("tp2 x 1 thread", {"tp": 2}, 1),
             ("ep2 x 1 thread", {"ep": 2}, 1), ("tp2, spin off", {"tp": 2}, 1)]
    envs = {"tp2, spin off": {"DSWORKER_COMM_SPIN": "off"}}
    res = {}
    for rnd in range(a.rounds):  # interleaved rounds: each plan sees the same machine
        for label, plan, threads in plans:
            r = run(d, plan, threads, prompt_len, n, envs.get(label))
            if label not in res or r["decode_tok_s"] > res[label]["decode_tok_s"]:
                res[label] = r
    base = res[plans[0][0]]["decode_tok_s"]
    cpu = open("/proc/cpuinfo").read()
    model_name = re.search(r"model name\s*:\s*(.*)", cpu)
    isa = "avx512" if " avx512f" in cpu else "avx2"
    print(f"bench_distributed: {model_name.group(1) if model_name else '?'}, {isa} "
          f"(DS_CPU_ISA={os.environ.get('DS_CPU_ISA', 'unset')}), V3-shaped FP8 {tag}, "
          f"prompt {prompt_len}, decode {n}, batch 1, best of {a.rounds}")
    print(f"{'plan':<18}{'decode t/s':>11}{'vs tp1':>8}{'comm s/step':>13}")
    for label, plan, _ in plans:
        r = res[label]
        steps = n + 1
        comm = max((x["comm_seconds"] for x in r.get("ranks", [])), default=0.0)
        print(f"{label:<18}{r['decode_tok_s']:>11.2f}{r['decode_tok_s'] / base:>8.2f}"
              f"{comm / steps * 1e3:>11.2f}ms")
    print(f"{'plan':<10}{'rank':>5}{'weights MB':>12}{'share MB':>10}{'diff':>8}"
          f"{'peak RSS MB':>13}{'limit MB':>10}{'ok':>4}")
    kv_bytes = kv_row * (prompt_len + n)
    for label, plan, _ in plans[1:3]:
        tp, ep = plan.get("tp", 1), plan.get("ep", 1)
        for x in res[label]["ranks"]:
            share = share_bytes(d, tp, ep, x["rank"])
            limit = share + kv_bytes + 64 * MIB
            ok = abs(x["weight_bytes"] - share) <= 0.02 * share and x["peak_rss_bytes"] <= limit
            print(f"{label.split()[0]:<10}{x['rank']:>5}{x['weight_bytes'] / 1e6:>12.1f}"
                  f"{share / 1e6:>10.1f}{(x['weight_bytes'] - share) / share * 100:>7.2f}%"
                  f"{x['peak_rss_bytes'] / 1e6:>13.1f}{limit / 1e6:>10.1f}{'yes' if ok else 'NO':>4}")


if __name__ == "__main__":
    main()

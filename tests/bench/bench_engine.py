"""Engine benchmark on a synthetic DeepSeek-V3-shaped model (make bench).

Builds (once, cached under .cache/bench/) a V3-shaped checkpoint of about
1.2 GB (FP8, 128x128 block scales) and its BF16 twin (about 2.2 GB) with
random weights, in the exact Hugging Face layout, then runs

    dsrun -m DIR --bench --prompt-len 512 -n 128 --batch B --threads T --json

for B = 1 and 16 and reports prefill and decode tokens/s, peak RSS, and decode
speed at batch 1 as a fraction of the memory-bandwidth bound:

    bound tok/s = bandwidth / weight bytes read per token

(the "+KV" column: bandwidth / (weight bytes + the latent-cache bytes a step
of the stretch reads on average), with the bandwidth measured in the same
seconds as the decode: the batch-1 runs add --membw, which decodes another n
steps with one pass of a read probe (pure loads, 2 streams per thread) and
one pass of STREAM's Triad after each step, and reports the three rates over
that stretch (the host's bandwidth moves by a third from one second to the
next on a shared VM, so a probe run before or after the decode measures
another machine).  Both ratios are printed; the higher bandwidth gives the
stricter one.  Batch 1 runs three times, and a closing line gives each
path's median "of bound" over its three stretches: the figure a target
such as 0.8 of the bound is read from (one stretch alone carries the
host's moments: its probe and its steps do not see quite the same
seconds).

The same stretch also times the decode kernels on weights in cache (one-row
FP8 and BF16 products of 512 KiB per thread, "FP8 hot" / "BF16 hot" GB/s,
kernels/cpu/membw.h): what they consume when memory is not the limit.  "of
roof" = decode tok/s over the roofline those make with the read probe, each
dtype's bytes at the lower of its hot rate and the read rate.  A step well
below its bandwidth bound but near 1 of its roof is held by the kernels'
arithmetic on this machine at that moment, not by the memory (on shared
2-vCPU hosts the arithmetic rate itself moves by tens of percent).

Last, where a batch-1 FP8 step goes (natively and on AVX2): dsrun --profile
times every backend call of n more decode steps, and each kind of call that
holds 1% of the step or more is printed with its share, ms per step and GB/s.

The bytes per token are counted from the checkpoint itself: every tensor
that one token touches (attention, dense MLP, router, shared expert, the
num_experts_per_tok routed experts of each MoE layer, final norm, lm_head and
one embedding row).  Resident memory is compared with the checkpoint's bytes
plus the KV cache.

Then the default model (models/default.gguf, SmolLM2-135M-Instruct Q4_1):
prompt processing of 512 tokens (pp512) and generation of 128 tokens from an
empty context (tg128), as llama-bench defines them, plus generation right after
the 512-token prompt, peak RSS.  The comparison with llama.cpp (the same rows
at equal cache depth, and serving) is tests/bench/bench_llamacpp.py.

Usage: python tests/bench/bench_engine.py [--threads N] [--quick] [--only v3|default]
"""
import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.fixtures.tiny_models import write_model  # noqa: E402

BUILD = ROOT / os.environ.get("DS_BUILD", "build")

# V3's shapes scaled down: MLA with q LoRA, 64 experts of which 8 per token in
# 8 groups (4 kept), one shared expert, one dense layer then MoE layers.
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=512,
             num_hidden_layers=5, num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=8,
             n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=1,
             rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                               beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
             num_nextn_predict_layers=0)
QUICK = dict(SHAPE, num_hidden_layers=2, n_routed_experts=16, n_group=4, topk_group=2,
             vocab_size=8000)


def model_dir(kind, shape, tag):
    d = ROOT / ".cache" / "bench" / f"{tag}-{kind}"
    if not (d / "config.json").exists():
        print(f"bench: writing the synthetic {kind} model to {d.relative_to(ROOT)} ...",
              flush=True)
        write_model(kind, d, seed=7, overrides=shape)
    return d


def tensor_bytes(d):
    """{name: (bytes, dtype)} from the safetensors headers."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            hdr = json.loads(fh.read(n))
        for k, v in hdr.items():
            if k != "__metadata__":
                b, e = v["data_offsets"]
                out[k] = (e - b, v["dtype"])
    return out


def bytes_per_token(d):
    """(bytes one token reads, checkpoint bytes, the first split by the
    tensors' dtypes: {"F8_E4M3": ..., "BF16": ...})."""
    cfg = json.loads((d / "config.json").read_text())
    tb = tensor_bytes(d)
    k = cfg["num_experts_per_tok"]
    total, by_dtype = 0, {}
    for name, (b, dt) in tb.items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.", name)
        if name == "model.embed_tokens.weight":
            b = b // cfg["vocab_size"]          # one row
        elif m:
            b = b * k / cfg["n_routed_experts"]  # k of E experts per layer
        total += b
        by_dtype[dt] = by_dtype.get(dt, 0) + b
    return total, sum(b for b, _ in tb.values()), by_dtype


def run_bench(d, batch, threads, prompt_len, n, extra=(), env=None):
    """dsrun --bench --json on d (extra flags such as --membw, env added to
    this process's): its JSON object."""
    cmd = [str(BUILD / "dsrun"), "-m", str(d), "--bench", "--prompt-len", str(prompt_len),
           "-n", str(n), "--batch", str(batch), "--threads", str(threads), "--json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                       env={**os.environ, **(env or {})})
    if r.returncode != 0:
        sys.exit(f"bench: {env or ''} {' '.join(cmd)} failed: {r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def has_avx512():
    return "avx512f" in pathlib.Path("/proc/cpuinfo").read_text().split()


def bench_default(threads):
    model = ROOT / "models" / "default.gguf"
    if not model.exists():
        sys.exit("bench: models/default.gguf is missing: run `make model`")
    # llama-bench's definitions: pp512 = one 512-token prefill; tg128 = 128
    # tokens generated from an empty context.  Decoding after the 512-token
    # prompt (positions 512..639) is slower (longer attention) and printed too.
    r = run_bench(model, 1, threads, 512, 128)
    tg = run_bench(model, 1, threads, 1, 128)
    r["decode_after_prompt_tok_s"] = r["decode_tok_s"]
    r["decode_tok_s"] = tg["decode_tok_s"]
    print(f"\ndefault model {model.relative_to(ROOT)} ({threads} threads): pp512 "
          f"{r['prefill_tok_s']:.1f} tok/s, tg128 {r['decode_tok_s']:.1f} tok/s "
          f"(after the 512-token prompt: {r['decode_after_prompt_tok_s']:.1f} tok/s), peak RSS "
          f"{r['peak_rss_bytes'] / 2**20:.1f} MiB", flush=True)


def kv_bytes_per_position(cfg):
    """The latent cache of one position, all layers: kv_lora + rope floats each."""
    return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4


def kv_read_per_token(cfg, prompt_len, n):
    """Bytes of latent cache a decode step of the --membw stretch reads, on
    average: every layer's rows of all the positions up to the token's own.
    The stretch decodes positions prompt_len + n .. prompt_len + 2n - 1
    (after the bench's own n steps)."""
    return kv_bytes_per_position(cfg) * (prompt_len + n + (n + 1) / 2)


# (of bound, ceiling) of every batch-1 stretch, by path ("fp8", "fp8 avx2",
# "bf16"), for the closing summary: ceiling = the highest "of bound" the
# kernels' in-cache rates allow in that stretch (1 unless one is slower
# than the memory)
OF_BOUND = {}


def probe_cols(label, r, per_tok, kv_tok, by_dtype):
    """The columns of a --membw run: decode tok/s over the probe's stretch,
    the read probe's GB/s and the fraction of its bound (the weights a token
    reads, per_tok), the same with the latent cache it reads (kv_tok) added
    to the bytes, then Triad's GB/s and the fraction of its bound (weights);
    last the hot-product probe's FP8 and BF16 GB/s (one-row products in
    cache) and the fraction of the roofline they make with the read probe:
    each dtype's bytes at the lower of the read rate and its hot rate, the
    rest at the read rate.  Records the stretch's "of bound" and ceiling
    under label in OF_BOUND."""
    m = r["membw"]
    tok = m["decode_tok_s"]
    rd = m["read_bytes_s"]
    hot = {"F8_E4M3": m["fp8_hot_bytes_s"], "BF16": m["bf16_hot_bytes_s"]}
    roof_s = sum(b / min(rd, hot.get(dt, rd)) for dt, b in by_dtype.items())
    of_bound = tok * per_tok / rd
    OF_BOUND.setdefault(label, []).append((of_bound, per_tok / rd / roof_s))
    return (f" |{'':15}{tok:>11.2f}{rd / 1e9:>11.1f}"
            f"{of_bound:>9.2f}"
            f"{tok / (rd / (per_tok + kv_tok)):>8.2f}"
            f"{m['triad_bytes_s'] / 1e9:>12.1f}"
            f"{tok / (m['triad_bytes_s'] / per_tok):>9.2f}"
            f"{hot['F8_E4M3'] / 1e9:>9.1f}{hot['BF16'] / 1e9:>9.1f}{tok * roof_s:>9.2f}")


def bench_load_memory(shape, tag, threads, prompt_len, n):
    """Rows of the FP8 model at batch 1 as other machines run it: with the
    kernels capped at AVX2 (DS_CPU_ISA=avx2) where this CPU has AVX-512 (three
    runs with the probe, as the native rows), and with the file mapping kept
    as on a kernel without transparent huge pages (DS_THP=never).  Peak RSS
    must stay about (checkpoint + KV) x 1.1 in each (docs/engine.md,
    Memory)."""
    d = model_dir("v3-fp8", shape, tag)
    per_tok, ckpt, by_dtype = bytes_per_token(d)
    cfg = json.loads((d / "config.json").read_text())
    kv = kv_bytes_per_position(cfg) * (prompt_len + n)
    runs = [("fp8 avx2", {"DS_CPU_ISA": "avx2"}, True)] * 3 if has_avx512() else []
    runs.append(("fp8 noTHP", {"DS_THP": "never"}, False))
    for label, env, membw in runs:
        r = run_bench(d, 1, threads, prompt_len, n, ["--membw"] if membw else [], env)
        kv_bytes = kv * (prompt_len + n * 2) / (prompt_len + n) if membw else kv
        print(f"{label:<10}{ckpt / 1e9:>9.2f}{per_tok / 1e6:>10.1f}{1:>6}"
              f"{r['prefill_tok_s']:>13.1f}{r['decode_tok_s']:>12.2f}"
              f"{r['peak_rss_bytes'] / 1e9:>13.2f}{r['peak_rss_bytes'] / (ckpt + kv_bytes):>9.3f}"
              f"{probe_cols(label, r, per_tok, kv_read_per_token(cfg, prompt_len, n), by_dtype) if membw else ''}",
              flush=True)


def bound_summary(target=0.8):
    """The line the issue's target is read from: per path, the median "of
    bound" over its three batch-1 stretches (each against the read probe of
    its own seconds; docs/benchmarks.md says why one stretch alone is not
    the figure on a shared host), then every stretch, and where the
    kernels' in-cache rates were below the memory's, the ceiling they put
    on "of bound" in that stretch."""
    parts = []
    for label, v in OF_BOUND.items():
        med = statistics.median(x for x, _ in v)
        each = ", ".join(f"{x:.2f}" + (f" (ceiling {c:.2f})" if c < 0.995 else "") for x, c in v)
        parts.append(f"{label} {med:.2f} {'met' if med >= target else 'MISSED'} [{each}]")
    print(f"\nbatch-1 decode / bandwidth bound, median of the stretches (target {target}): "
          + "; ".join(parts), flush=True)


def bench_profile(shape, tag, threads, prompt_len, n):
    """Where a batch-1 step of the FP8 model goes, from dsrun --profile (every
    backend call of n more decode steps timed; docs/engine.md), natively and,
    where this CPU has AVX-512, with the kernels capped at AVX2: each kind of
    call holding 1% of the step or more, the rest summed."""
    d = model_dir("v3-fp8", shape, tag)
    runs = [("native", {})] + ([("avx2", {"DS_CPU_ISA": "avx2"})] if has_avx512() else [])
    for label, env in runs:
        p = run_bench(d, 1, threads, prompt_len, n, ["--profile"], env)["profile"]
        steps, wall = p["steps"], p["seconds"]
        print(f"\nwhere a batch-1 FP8 step goes ({label}, dsrun --profile, depth {prompt_len + n}-"
              f"{prompt_len + 2 * n}): {wall / steps * 1e3:.2f} ms a step\n"
              f"{'share':>7}{'ms/step':>9}{'calls':>7}{'GB/s':>7}  call")
        rest = wall
        for c in p["calls"]:
            if c["seconds"] < 0.01 * wall:
                continue
            rest -= c["seconds"]
            gbs = f"{c['weight_bytes'] / c['seconds'] / 1e9:.1f}" if c["weight_bytes"] else ""
            print(f"{c['seconds'] / wall:>7.1%}{c['seconds'] / steps * 1e3:>9.3f}"
                  f"{c['calls'] / steps:>7.1f}{gbs:>7}  {c['call']}")
        print(f"{rest / wall:>7.1%}{rest / steps * 1e3:>9.3f}{'':>14}  the other calls and the "
              "engine between them", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="a smaller model, fewer tokens")
    ap.add_argument("--only", choices=("v3", "default"))
    a = ap.parse_args()
    if a.only != "v3":
        bench_default(a.threads)
    if a.only == "default":
        return
    shape, tag = (QUICK, "quick") if a.quick else (SHAPE, "v3shape")
    prompt_len, n = (128, 32) if a.quick else (512, 128)
    print(f"{'model':<10}{'ckpt GB':>9}{'B/tok MB':>10}{'batch':>6}{'prefill t/s':>13}"
          f"{'decode t/s':>12}{'peak RSS GB':>13}{'RSS/ckpt':>9}"
          f" | with the probe:{'decode t/s':>11}{'read GB/s':>11}{'of bound':>9}{'+KV':>8}"
          f"{'triad GB/s':>12}{'of bound':>9}{'FP8 hot':>9}{'BF16 hot':>9}{'of roof':>9}")
    for kind in ("v3-fp8", "v3"):
        d = model_dir(kind, shape, tag)
        per_tok, ckpt, by_dtype = bytes_per_token(d)
        cfg = json.loads((d / "config.json").read_text())
        kv = kv_bytes_per_position(cfg)
        for batch in (1, 1, 1, 16):
            r = run_bench(d, batch, a.threads, prompt_len, n, ["--membw"] if batch == 1 else [])
            # --membw decodes n more steps: the cache holds prompt + 2n then
            kv_bytes = kv * (prompt_len + n * (2 if batch == 1 else 1)) * batch
            label = "fp8" if kind == "v3-fp8" else "bf16"
            cols = (probe_cols(label, r, per_tok, kv_read_per_token(cfg, prompt_len, n), by_dtype)
                    if batch == 1 else "")
            print(f"{label:<10}{ckpt / 1e9:>9.2f}"
                  f"{per_tok / 1e6:>10.1f}{batch:>6}{r['prefill_tok_s']:>13.1f}"
                  f"{r['decode_tok_s']:>12.2f}{r['peak_rss_bytes'] / 1e9:>13.2f}"
                  f"{r['peak_rss_bytes'] / (ckpt + kv_bytes):>9.3f}{cols}", flush=True)
    bench_load_memory(shape, tag, a.threads, prompt_len, n)
    bound_summary()
    bench_profile(shape, tag, a.threads, prompt_len, n)


if __name__ == "__main__":
    main()

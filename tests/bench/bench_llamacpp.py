"""dsagent's engine and server against llama.cpp on the same GGUF (make bench).

Engine (needs LLAMA_BENCH=/path/to/llama-bench): the same rows measured the
same way on both, 2 threads each, at equal cache depth:

    row                     dsrun --bench ... -n 128      llama-bench
    prefill 512             --prompt-len 512  (prefill)   -p 512  -n 0
    prefill 2048            --prompt-len 2048 (prefill)   -p 2048 -n 0
    decode 128 at depth D   --prompt-len D    (decode)    -p 0 -n 128 -d D  (D = 512, 2048)
    decode 128 at depth 0   --prompt-len 1    (decode)    -p 0 -n 128 -d 0

llama-bench's -d D puts D tokens in the cache before it times the 128 steps,
and dsrun --prompt-len D decodes right after a D-token prompt: both time the
steps at positions D..D+127.  dsrun's prompt is at least one token, so its
depth-0 row decodes positions 1..128 (one position deeper than llama-bench's
0..127, the nearest it can do).  The prefill and the decode of one dsrun run
are timed apart, so the depth-512 and depth-2048 runs also give the two
prefill rows.  llama-bench runs with -r 1 (one timed sample per row, as one
dsrun run gives); both do an untimed warm-up first.

Batched decode (batch 4 and 16): llama-bench has no form for it in this
version (its -pg is one sequence, a prompt then its generation; it has no
parallel-sequence option), so batches are compared in the serving part only.

Serving (needs LLAMA_SERVER=/path/to/llama-server): the same workload against
llama-server (-np 16 -t 2 -c 4096: 16 slots of 256 positions, room for the 192
each request needs) and against dsagent started as bench_serving.py starts it
(--threads 2, keys off, loopback): prompts of at most 64 tokens (the same
texts on both, counted by dsagent's tokenizer), 128 output tokens with
ignore_eos, temperature 0, streamed /v1/completions, concurrency 1, 4, 16
with max(8, 2 x concurrency) requests; output tokens/s = all output tokens of
a level over its wall time (bench_serving.py's client and rule).  One server
runs at a time.

The machine is noisy: every row runs --rounds times (default 2), the order of
the two programs swapped from one round to the next; the table shows each
round and the best of each side; the ratio is best over best.  A closing
summary checks the targets: every ratio >= 1.2x, and our decode at depth 2048
>= 0.5 x our decode at depth 0 (llama.cpp's own figure printed beside).

--isa native (default) lets our kernels use what the CPU has; --isa avx2 sets
DS_CPU_ISA=avx2 for dsrun and dsagent and takes llama.cpp from
LLAMA_BENCH_AVX2 / LLAMA_SERVER_AVX2 (a build with GGML_NATIVE=OFF and AVX2
only), so that an AVX-512 machine covers both instruction sets.  Without the
variables a part prints one skip line.  ../shared/tools/llamacpp.sh (outside
the repository) builds both programs and prints the variables.

Usage: python tests/bench/bench_llamacpp.py [--only engine|serving] [--rounds N]
       [--isa native|avx2] [--threads 2]
"""
import argparse
import http.client
import json
import os
import pathlib
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench.bench_serving import Agent, make_prompt, one_request, run_level  # noqa: E402

BUILD = ROOT / os.environ.get("DS_BUILD", "build")
MODEL = ROOT / "models" / "default.gguf"
TARGET = 1.2          # every row: ours / llama.cpp
DEPTH_TARGET = 0.5    # our decode at depth 2048 / at depth 0
DEPTHS = (0, 512, 2048)
PREFILLS = (512, 2048)
LEVELS = (1, 4, 16)
PROMPT_LEN, OUTPUT_LEN = 64, 128


def cpu_line():
    """The CPU model, what it has, and what our dispatch uses under isa."""
    cpu = open("/proc/cpuinfo").read()
    name = re.search(r"model name\s*:\s*(.*)", cpu)
    out = subprocess.run([str(BUILD / "dsrun"), "--backends"], capture_output=True, text=True,
                         timeout=60)
    m = re.search(r"cpu isa: detected (\S+), active (\S+)", out.stdout)
    ours = f"detected {m.group(1)}, active {m.group(2)}" if m else "unknown"
    return (f"{name.group(1) if name else '?'}, {os.cpu_count()} CPUs, {load()}; our dispatch "
            f"(DS_CPU_ISA={os.environ.get('DS_CPU_ISA', 'unset')}): {ours}")


def exe_isa(exe):
    """What a llama.cpp binary was compiled for, read from its code: AVX-512
    instructions use zmm registers, AVX2 ymm (llama.cpp's builds report their
    features only at trace log level)."""
    try:
        code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", exe], capture_output=True,
                              text=True, timeout=300).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "ISA unknown (no objdump)"
    z, y = code.count("%zmm"), code.count("%ymm")
    return (f"AVX-512 code ({z} instructions on zmm)" if z else
            f"no AVX-512 code, {'AVX2' if y else 'no AVX2'} ({y} on ymm)")


def load():
    """The 1-minute load average: other work on the machine slows both programs,
    and llama.cpp's spin-waiting threads far more when it takes one of the cores."""
    return f"load average {open('/proc/loadavg').read().split()[0]}"


def has_avx512():
    return " avx512f" in open("/proc/cpuinfo").read()


def best(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def ratio(a, b):
    return a / b if a and b else None


# ---- engine ----

def dsrun(prompt_len, n, threads):
    cmd = [str(BUILD / "dsrun"), "-m", str(MODEL), "--bench", "--prompt-len", str(prompt_len),
           "-n", str(n), "--batch", "1", "--threads", str(threads), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"bench_llamacpp: {' '.join(cmd)} failed: {r.stderr.strip()}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def ours_engine(threads):
    """{row: tok/s} from three dsrun runs (prompt 1, 512, 2048; 128 steps each)."""
    rows = {}
    for p in (1, *PREFILLS):
        r = dsrun(p, 128, threads)
        if p in PREFILLS:
            rows[f"prefill {p}"] = r["prefill_tok_s"]
        rows[f"decode 128 @ depth {0 if p == 1 else p}"] = r["decode_tok_s"]
    return rows


def llama_bench(exe, args, threads):
    cmd = [exe, "-m", str(MODEL), "-t", str(threads), "-r", "1", "-o", "json", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"bench_llamacpp: {' '.join(cmd)} failed: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout)


def theirs_engine(exe, threads, info):
    rows = {}
    for x in llama_bench(exe, ["-p", ",".join(map(str, PREFILLS)), "-n", "0"], threads):
        rows[f"prefill {x['n_prompt']}"] = x["avg_ts"]
        info.update({k: x.get(k) for k in ("build_commit", "build_number", "cpu_info",
                                            "backends", "flash_attn", "type_k", "n_batch",
                                            "n_ubatch")})
    for x in llama_bench(exe, ["-p", "0", "-n", "128", "-d", ",".join(map(str, DEPTHS))],
                         threads):
        rows[f"decode 128 @ depth {x['n_depth']}"] = x["avg_ts"]
    return rows


def bench_engine(exe, rounds, threads):
    names = [f"prefill {p}" for p in PREFILLS] + [f"decode 128 @ depth {d}" for d in DEPTHS]
    ours, theirs, info = [], [], {}
    for i in range(rounds):
        order = ("dsrun", "llama") if i % 2 == 0 else ("llama", "dsrun")
        print(f"engine round {i + 1}: {order[0]} first", flush=True)
        for who in order:
            if who == "dsrun":
                ours.append(ours_engine(threads))
            else:
                theirs.append(theirs_engine(exe, threads, info))
    print(f"llama-bench: build {info.get('build_commit')} ({info.get('build_number')}), "
          f"cpu_info {info.get('cpu_info')!r}, backends {info.get('backends')}, flash_attn "
          f"{info.get('flash_attn')}, cache {info.get('type_k')}, batch {info.get('n_batch')}/"
          f"{info.get('n_ubatch')}; {threads} threads each, best of {rounds} rounds")
    rr = "".join(f"{'r' + str(i + 1):>8}" for i in range(rounds))
    print(f"{'tok/s':<24}| dsrun{rr} | llama.cpp{rr} | {'dsrun':>8}{'llama':>8}{'ratio':>7}")
    res = {}
    for n in names:
        a, b = best(r.get(n) for r in ours), best(r.get(n) for r in theirs)
        res[n] = (a, b)
        q = ratio(a, b)
        print(f"{n:<24}|      " + "".join(f"{fmt(r.get(n)):>8}" for r in ours) + " |          "
              + "".join(f"{fmt(r.get(n)):>8}" for r in theirs)
              + f" | {fmt(a):>8}{fmt(b):>8}{fmt(q, '.2f'):>6}x", flush=True)
    print("(dsrun's depth-0 row decodes after a 1-token prompt, positions 1..128; "
          "llama-bench's, positions 0..127)")
    print("decode at batch 4 and 16: llama-bench has no batched-decode form (-pg is one "
          "sequence); compared in the serving part")
    return res


# ---- serving ----

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on loopback with the serving benchmark's slots; .port as Agent has."""

    def __init__(self, exe, threads):
        self.log = tempfile.NamedTemporaryFile(prefix="bench-llama-server-", suffix=".log",
                                               delete=False)
        self.port = free_port()
        cmd = [exe, "-m", str(MODEL), "--host", "127.0.0.1", "--port", str(self.port),
               "-np", "16", "-t", str(threads), "-c", str(16 * 256)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"bench_llamacpp: llama-server exited: {self.tail()}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("GET", "/health")
                ok = c.getresponse().status == 200
                c.close()
                if ok:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        sys.exit("bench_llamacpp: llama-server did not become healthy in 300 s")

    def tail(self):
        return pathlib.Path(self.log.name).read_text(errors="replace")[-2000:]

    def count(self, text):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        c.request("POST", "/tokenize", body=json.dumps({"content": text, "add_special": True}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        n = len(json.loads(r.read())["tokens"])
        c.close()
        return n

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def run_levels(server, prompts):
    one_request(server.port, prompts["warm-up"], 8)  # a prompt no level sends
    out = {}
    for c in LEVELS:
        row = run_level(server, prompts[c], c, OUTPUT_LEN)
        if row["failed"]:
            sys.exit(f"bench_llamacpp: {row['failed']} requests failed at concurrency {c}: "
                     f"{row['errors']}")
        if row["mean_output_tokens"] != OUTPUT_LEN:
            sys.exit(f"bench_llamacpp: mean output {row['mean_output_tokens']} tokens at "
                     f"concurrency {c}, not {OUTPUT_LEN}")
        out[c] = row["output_tok_s"]
    return out


def bench_serving(exe, rounds, threads, seed=0):
    prompts, ours, theirs = None, [], []
    for i in range(rounds):
        order = ("dsagent", "llama") if i % 2 == 0 else ("llama", "dsagent")
        print(f"serving round {i + 1}: {order[0]} first", flush=True)
        for who in order:
            if who == "dsagent":
                agent = Agent(MODEL, threads, "cpu", [])
                try:
                    if prompts is None:
                        rng = random.Random(seed)
                        made = {c: [make_prompt(agent, rng, PROMPT_LEN)
                                    for _ in range(max(8, 2 * c))] for c in LEVELS}
                        prompts = {c: [p for p, _ in made[c]] for c in LEVELS}
                        prompts["warm-up"] = make_prompt(agent, rng, 32)[0]
                        ours_n = [n for c in LEVELS for _, n in made[c]]
                    ours.append(run_levels(agent, prompts))
                finally:
                    agent.stop()
            else:  # round 1 starts with dsagent, whose tokenizer sized the prompts
                srv = LlamaServer(exe, threads)
                try:
                    if not theirs:
                        theirs_n = [srv.count(p) for c in LEVELS for p in prompts[c]]
                    theirs.append(run_levels(srv, prompts))
                finally:
                    srv.stop()
    print(f"prompt tokens (same texts): dsagent's tokenizer mean {statistics.fmean(ours_n):.1f} "
          f"(max {max(ours_n)}), llama-server's (with its specials) mean "
          f"{statistics.fmean(theirs_n):.1f}; {OUTPUT_LEN} out (ignore_eos); requests "
          f"{[max(8, 2 * c) for c in LEVELS]}")
    rr = "".join(f"{'r' + str(i + 1):>8}" for i in range(rounds))
    print(f"{'output tok/s':<24}| dsagent{rr} | llama-server{rr} | "
          f"{'dsagent':>8}{'llama':>8}{'ratio':>7}")
    res = {}
    for c in LEVELS:
        n = f"serving, concurrency {c}"
        a, b = best(r[c] for r in ours), best(r[c] for r in theirs)
        res[n] = (a, b)
        print(f"{n:<24}|        " + "".join(f"{fmt(r[c]):>8}" for r in ours)
              + " |             " + "".join(f"{fmt(r[c]):>8}" for r in theirs)
              + f" | {fmt(a):>8}{fmt(b):>8}{fmt(ratio(a, b), '.2f'):>6}x", flush=True)
    return res


def summary(tag, res):
    print(f"\nbench_llamacpp summary ({tag}): target ours / llama.cpp >= {TARGET}x on every row")
    below = 0
    for n, (a, b) in res.items():
        q = ratio(a, b)
        ok = q is not None and q >= TARGET
        below += not ok
        print(f"  {n:<24}{fmt(q, '.3f'):>7}x  {'meets' if ok else 'BELOW TARGET'}")
    d0, d2k = res.get("decode 128 @ depth 0"), res.get("decode 128 @ depth 2048")
    if d0 and d2k:
        ours, theirs = ratio(d2k[0], d0[0]), ratio(d2k[1], d0[1])
        ok = ours is not None and ours >= DEPTH_TARGET
        below += not ok
        print(f"  decode depth 2048 / depth 0: ours {fmt(ours, '.2f')} (target >= "
              f"{DEPTH_TARGET}) {'meets' if ok else 'BELOW TARGET'}; llama.cpp's "
              f"{fmt(theirs, '.2f')}")
    print(f"  {len(res) + bool(d0 and d2k) - below} of {len(res) + bool(d0 and d2k)} "
          f"targets met")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("engine", "serving"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="avx2: DS_CPU_ISA=avx2 for us, LLAMA_*_AVX2 for llama.cpp")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    suffix = "_AVX2" if a.isa == "avx2" else ""
    bench_exe = os.environ.get("LLAMA_BENCH" + suffix)
    server_exe = os.environ.get("LLAMA_SERVER" + suffix)
    want_engine, want_serving = a.only != "serving", a.only != "engine"
    if a.isa == "avx2" and not has_avx512():
        print("bench_llamacpp --isa avx2: skipped (no AVX-512 here: the native run is the "
              "AVX2 run)")
        return 0
    if (not want_engine or not bench_exe) and (not want_serving or not server_exe):
        print(f"bench_llamacpp ({a.isa}): skipped: set LLAMA_BENCH{suffix}=/path/to/llama-bench "
              f"and/or LLAMA_SERVER{suffix}=/path/to/llama-server "
              f"(../shared/tools/llamacpp.sh{' --isa avx2' if suffix else ''} builds them)")
        return 0
    if not MODEL.exists():
        sys.exit("bench_llamacpp: models/default.gguf is missing: run `make model`")
    if a.isa == "avx2":
        os.environ["DS_CPU_ISA"] = "avx2"
    else:
        os.environ.pop("DS_CPU_ISA", None)
    tag = f"--isa {a.isa}"
    print(f"bench_llamacpp ({tag}): {time.strftime('%Y-%m-%d %H:%M %Z')}, {cpu_line()}; "
          f"model {MODEL.relative_to(ROOT)}, {a.threads} threads", flush=True)
    res = {}
    for part, want, exe, name, var, run in (
            ("engine", want_engine, bench_exe, "llama-bench", "LLAMA_BENCH", bench_engine),
            ("serving", want_serving, server_exe, "llama-server", "LLAMA_SERVER", bench_serving)):
        if not want:
            continue
        if exe:
            print(f"{name}: {exe}: {exe_isa(exe)}")
            res.update(run(exe, a.rounds, a.threads))
        else:
            print(f"bench_llamacpp {part}: skipped (set {var}{suffix})")
    summary(tag, res)
    print(f"  ({load()} at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""dsrun under a plan of rank processes (engine/driver.c driving
`dsagent worker` processes, docs/distributed.md "Driver and rank processes").

- The one-rank plan forced through the driver (--driver) gives byte-identical
  --dump-logits and the same --ids as plain dsrun, on the default GGUF model
  and on a tiny DeepSeek-V3 checkpoint: the rank runs the same code on the
  same steps, only across a process boundary.  --chat and --bench --json
  (with the per-rank stats) run through it too.
- Two-rank plans (tp2, ep2, pp2 over Gloo) give the one-rank logits of the
  tiny V3 within 1e-5 and the same greedy ids (skipped while the graph of
  the build does not run plans).
- Failures: a plan that cannot load is named; a rank killed with SIGKILL
  mid-generation makes dsrun exit non-zero within 5 s with a message naming
  that rank (by rank and pid), and no process of the run (dsrun and every
  descendant it had) is left; on the one-rank plan, --tp 2 (rank 1 or rank
  0) and --pp 2 (either stage).  dsrun itself killed with SIGKILL takes its
  ranks with it within a few seconds (PR_SET_PDEATHSIG), and SIGTERM does
  too (its handler); on the one-rank plan and --tp 2.
- engine/sched.c runs unchanged over the driver (tests/tools/sched_check.c
  with DS_SCHED_PLAN), also when the steps are further apart than the
  ranks' comm timeout (rank 0 tells its idle peers it lives), and when the
  ranks other than 0 are started elsewhere (driver_launch.start_remote, as
  other nodes' agents will): detached processes the driver cannot wait for,
  which still exit when the model is freed.
"""
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import ROOT, binary

TIMEOUT = 300
GGUF = ROOT / "models" / "default.gguf"


@pytest.fixture(scope="module")
def models(tiny_deepseek):
    out = {"v3": tiny_deepseek["v3"]}
    if GGUF.exists():
        out["gguf"] = GGUF
    return out


def dsrun(*args, check=True):
    r = subprocess.run([binary("dsrun"), *map(str, args)], capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=ROOT)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def prompt(kind):
    return "1,2,3,4,5,6,7" if kind == "gguf" else "3,17,5,9,22,41,8"


@pytest.mark.parametrize("kind", ["gguf", "v3"])
def test_one_rank_plan_matches_plain_dsrun(models, kind, tmp_path):
    if kind not in models:
        pytest.skip("models/default.gguf is missing (make model)")
    m, ids = models[kind], prompt(kind)
    dsrun("-m", m, "--threads", "2", "--tokens", ids, "--dump-logits", tmp_path / "plain.f32")
    dsrun("-m", m, "--threads", "2", "--tokens", ids, "--dump-logits", tmp_path / "drv.f32",
          "--driver")
    a = np.fromfile(tmp_path / "plain.f32", dtype="<f4")
    b = np.fromfile(tmp_path / "drv.f32", dtype="<f4")
    assert a.size > 0 and np.array_equal(a, b)

    gen = ("-m", m, "--threads", "2", "--tokens", ids, "-n", "12", "--temp", "0", "--ids",
           "--ignore-eos")
    plain = json.loads(dsrun(*gen).stdout)
    drv = json.loads(dsrun(*gen, "--driver").stdout)
    assert len(plain) == 12 and drv == plain


@pytest.mark.parametrize("plan", [["--tp", "2"], ["--ep", "2"], ["--pp", "2"]],
                         ids=["tp2", "ep2", "pp2"])
def test_two_rank_plans_match_one_rank(models, plan, tmp_path):
    """End to end through dsrun: Gloo groups, the graph's split, rank 0's
    logits.  Partial sums in another order move the last bits only."""
    m, ids = models["v3"], prompt("v3")
    dsrun("-m", m, "--threads", "1", "--tokens", ids, "--dump-logits", tmp_path / "one.f32")
    r = dsrun("-m", m, "--threads", "1", "--tokens", ids, "--dump-logits",
              tmp_path / "plan.f32", *plan, check=False)
    if r.returncode != 0 and "rank 1: the step failed" in r.stderr:
        pytest.skip("the graph of this build does not run this plan yet")
    assert r.returncode == 0, r.stderr
    a = np.fromfile(tmp_path / "one.f32", dtype="<f4")
    b = np.fromfile(tmp_path / "plan.f32", dtype="<f4")
    assert a.size == b.size and np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    gen = ("-m", m, "--threads", "1", "--tokens", ids, "-n", "8", "--temp", "0", "--ids",
           "--ignore-eos")
    assert json.loads(dsrun(*gen, *plan).stdout) == json.loads(dsrun(*gen).stdout)


def test_chat_and_bench_through_the_driver(models):
    if "gguf" not in models:
        pytest.skip("models/default.gguf is missing (make model)")
    m = models["gguf"]
    chat = ("-m", m, "--threads", "2", "--chat", "Hi", "-n", "8", "--temp", "0")
    assert dsrun(*chat, "--driver").stdout == dsrun(*chat).stdout
    r = dsrun("-m", m, "--threads", "2", "--bench", "--prompt-len", "8", "-n", "4", "--json",
              "--driver")
    j = json.loads(r.stdout.strip().splitlines()[-1])
    assert j["plan"] == {"tp": 1, "pp": 1, "ep": 1}
    assert j["decode_tok_s"] > 0 and len(j["ranks"]) == 1
    rk = j["ranks"][0]
    assert rk["rank"] == 0 and rk["weight_bytes"] > 0 and rk["comm_seconds"] == 0.0
    assert rk["peak_rss_bytes"] >= rk["weight_bytes"] // 2


def test_missing_rank_command_is_named(models, tmp_path):
    env = dict(os.environ, DSRUN_DSAGENT=str(tmp_path / "no-dsagent"))
    r = subprocess.run([binary("dsrun"), "-m", str(models["v3"]), "--tokens", "1,2", "-n", "1",
                        "--driver"], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert r.returncode == 1 and "no-dsagent" in r.stderr and "DSRUN_DSAGENT" in r.stderr


# ---- failures ----

def test_a_plan_that_cannot_load_is_named(models):
    """Four stages for the tiny V3's three layers: every rank refuses its
    part; dsrun names a rank and the reason, or the rank that exited first."""
    r = dsrun("-m", models["v3"], "--threads", "1", "--tokens", "1,2", "-n", "1", "--pp", "4",
              check=False)
    assert r.returncode == 1
    assert ("rank 0 loading" in r.stderr and "4 pipeline stages for 3 layers" in r.stderr) \
        or "exited with status 1 while loading" in r.stderr, r.stderr


def children(pid):
    out = []
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
    except FileNotFoundError:
        pass
    return out


def alive(pid):
    """Running (a zombie has exited: only its parent's reaping is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


PLANS = {"one": ["--driver"], "tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}


def start_generation(plan):
    """A long greedy generation under the plan; returns (proc, rank pids)."""
    if not GGUF.exists():
        pytest.skip("models/default.gguf is missing (make model)")
    cmd = [binary("dsrun"), "-m", str(GGUF), "--threads", "1", "--tokens", "1,2,3", "-n",
           "3000", "--ctx", "3100", "--ignore-eos", "--temp", "0", "--ids", *PLANS[plan]]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         cwd=ROOT)
    want = 1 if plan == "one" else 2
    deadline = time.monotonic() + 60
    pids = []
    while time.monotonic() < deadline and p.poll() is None:
        pids = children(p.pid)
        if len(pids) == want:
            break
        time.sleep(0.05)
    if p.poll() is not None:
        pytest.fail(f"dsrun ended early ({p.returncode}): {p.stderr.read()}")
    assert len(pids) == want, pids
    time.sleep(1.5)  # loaded and generating
    if p.poll() is not None:
        pytest.fail(f"dsrun ended early ({p.returncode}): {p.stderr.read()}")
    return p, pids


def descendants(pid):
    out = children(pid)
    for c in list(out):
        out += descendants(c)
    return out


@pytest.mark.parametrize("plan,victim", [("one", 0), ("tp2", 1), ("tp2", 0), ("pp2", 1), ("pp2", 0)],
                         ids=["one", "tp2-rank1", "tp2-rank0", "pp2-last-stage", "pp2-first-stage"])
def test_killed_rank_fails_the_run_and_leaves_nothing(plan, victim):
    """Rank 0 (which answers dsrun) or another; a tp peer or a pipeline
    stage: the survivors are blocked in a collective or a stage transfer."""
    p, pids = start_generation(plan)  # rank order is fork order
    run = [p.pid] + descendants(p.pid)  # every process of the run
    t0 = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    try:
        rc = p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        pytest.fail("dsrun did not exit within 5 s of a rank's death")
    took = time.monotonic() - t0
    err = p.stderr.read()
    assert rc != 0, err
    assert f"rank {victim} (pid {pids[victim]}) was killed by signal 9" in err, err
    assert took < 5
    assert not [q for q in run if alive(q)], "processes of the run left behind"


@pytest.mark.parametrize("plan,sig", [("one", signal.SIGKILL), ("tp2", signal.SIGKILL),
                                      ("tp2", signal.SIGTERM)], ids=["one-kill", "tp2-kill",
                                                                    "tp2-term"])
def test_ranks_exit_when_dsrun_is_killed(plan, sig):
    """SIGKILL: the ranks' death signal; SIGTERM: dsrun's handler kills them."""
    p, pids = start_generation(plan)
    p.send_signal(sig)
    assert p.wait(timeout=10) == -sig
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and [q for q in pids if alive(q)]:
        time.sleep(0.05)
    assert not [q for q in pids if alive(q)], "ranks outlived dsrun"


# ---- the scheduler over the driver ----

@pytest.mark.parametrize("plan", ["1,1,1", "2,1,1"], ids=["one", "tp2"])
def test_scheduler_runs_unchanged_over_the_driver(models, plan, tmp_path):
    """engine/sched.c batches three greedy requests (prefill chunks and
    decodes of several sequences in one step, its own page layout) through
    the driver's model: the same tokens as on the local model."""
    reqs = [dict(prompt=p, max_tokens=8, ignore_eos=True)
            for p in ([3, 17, 5, 9, 22], [41, 8, 2], [7, 7, 30, 100, 12, 5, 1])]
    path = tmp_path / "reqs.json"
    path.write_text(json.dumps(reqs))
    cmd = [binary("tests/sched_check"), str(models["v3"]), "--threads", "1", "--requests",
           str(path), "--chunk", "4"]

    def run(env):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        res = json.loads(r.stdout)["results"]
        if any("rank 1: the step failed" in x["error"] for x in res):
            pytest.skip("the graph of this build does not run this plan yet")
        assert all(x["error"] == "" for x in res), res
        return [x["tokens"] for x in res]

    local = run(dict(os.environ))
    drv = run(dict(os.environ, DS_SCHED_PLAN=plan, DS_DSAGENT=binary("dsagent")))
    assert len(local) == 3 and all(len(t) == 8 for t in local)
    assert drv == local


def test_idle_ranks_outlive_the_comm_timeout(models, tmp_path):
    """The scheduler sleeps 2.5 s before each step (--step-delay-us) while
    the ranks' comm timeout is 1 s: rank 1 waits for the next frame in a
    broadcast, which would time out without the IDLE frames rank 0 shares
    every quarter of the timeout.  The tokens equal the local model's."""
    reqs = [dict(prompt=[3, 17, 5, 9, 22], max_tokens=3, ignore_eos=True)]
    path = tmp_path / "reqs.json"
    path.write_text(json.dumps(reqs))
    cmd = [binary("tests/sched_check"), str(models["v3"]), "--threads", "1", "--requests",
           str(path), "--step-delay-us", "2500000"]

    def run(env):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        res = json.loads(r.stdout)["results"]
        assert all(x["error"] == "" for x in res), res
        return [x["tokens"] for x in res]

    local = run(dict(os.environ))
    drv = run(dict(os.environ, DS_SCHED_PLAN="2,1,1", DS_DSAGENT=binary("dsagent"),
                   DS_SCHED_COMM_TIMEOUT_MS="1000"))
    assert len(local[0]) == 3
    assert drv == local


def worker_pids(marker):
    """pids of live `dsagent worker` processes whose command line has marker."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            stat = open(f"/proc/{d}/stat").read().split()
        except OSError:
            continue
        if b"worker" in cmd and marker.encode() in cmd and stat[2] != "Z":
            out.append(int(d))
    return out


@pytest.mark.parametrize("plan", ["2,1,1", "1,2,1"], ids=["tp2", "pp2"])
def test_ranks_started_elsewhere(models, plan, tmp_path):
    """Ranks 1.. are started by a hook that detaches them (double fork):
    the same tokens as the local model, and none of them is left running
    once sched_check frees the model (rank 0 shares STOP with them)."""
    model = tmp_path / "v3"
    shutil.copytree(models["v3"], model)   # a path only this test's ranks name
    reqs = [dict(prompt=p, max_tokens=6, ignore_eos=True) for p in ([3, 17, 5, 9], [41, 8, 2])]
    path = tmp_path / "reqs.json"
    path.write_text(json.dumps(reqs))
    cmd = [binary("tests/sched_check"), str(model), "--threads", "1", "--requests", str(path)]

    def run(env, n_remote):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout)
        assert all(x["error"] == "" for x in out["results"]), out["results"]
        assert out["remote_ranks"] == n_remote
        return [x["tokens"] for x in out["results"]]

    local = run(dict(os.environ), 0)
    remote = run(dict(os.environ, DS_SCHED_PLAN=plan, DS_DSAGENT=binary("dsagent"),
                      DS_SCHED_REMOTE="1"), 1)
    assert remote == local and all(len(t) == 6 for t in local)
    deadline = time.monotonic() + 10
    while worker_pids(str(model)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_pids(str(model)) == [], "ranks started elsewhere outlived the model"

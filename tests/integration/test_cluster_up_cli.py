"""`dsctl cluster up` / `dsctl cluster down` (docs/cluster.md, "dsctl cluster
up / down"), against real agents (`--local`): what the operator sees.

- `cluster up --local 3` starts three agents that elect one head (node1, which
  has the priority) as each agent's GET /v1/cluster/state shows, and serves;
  a second `cluster up --local 3` reuses them;
- on a terminal: the plan summary, progress bars redrawn in place, the API
  URL, and the exact `dsctl keys create NAME` line last, which works;
- `--json`: one object per line (plan, progress with loaded bytes, the last
  with "serving": true and the URLs);
- `cluster down` stops the ranks and keeps the agents (the API answers 503
  "no_model"), and `cluster up` serves again;
- a plan that does not fit: exit 1 and the shortfall; a launch that fails
  (no tokenizer in the checkpoint): exit 1 and a last line saying why; a
  rejected admin token: exit 1 naming the token file;
- an agent that dies during start-up is named with its log, and the agents
  already started are stopped;
- `cluster down --local` leaves no agent of the directory and removes
  cluster.json; with no cluster.json it exits 1 naming it;
- bad flags exit 2 naming the flag.
"""
import json
import os
import pathlib
import pty
import signal
import subprocess
import threading
import time
import shutil
import urllib.error
import urllib.request

import pytest

from conftest import ROOT, binary
from tests.fixtures.shared import shared_data
from tests.fixtures.tiny_models import write_model

FAST = {"DSAGENT_THREADS": "1"}


def dsctl(*args, env=None, timeout=60):
    return subprocess.run([binary("dsctl"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def last_line(text):
    lines = [l for l in text.splitlines() if l.strip()]
    return lines[-1] if lines else ""


# ------------------------------------------------------------ bad usage --

@pytest.mark.parametrize("args,flag", [
    (["cluster", "up", "--tp", "2"], "--model"),
    (["cluster", "up", "--local", "0", "--model", "m"], "--local"),
    (["cluster", "up", "--model", "m", "--tp", "x"], "--tp"),
    (["cluster", "up", "--model", "m", "--mem-fraction", "2"], "--mem-fraction"),
    (["cluster", "up", "--model", "m", "--wait", "-1"], "--wait"),
    (["cluster", "up", "--model", "m", "--local-dir", "d"], "--local-dir"),
    (["cluster", "up", "--model", "m", "--local", "2", "--expect", "3"], "--expect"),
    (["cluster", "up", "--model", "m", "--nosuch"], "--nosuch"),
    (["cluster", "down", "--local-dir", "d"], "--local-dir"),
])
def test_bad_flags(args, flag, tmp_path):
    r = dsctl(*args, "--data-dir", tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert flag in r.stderr, r.stderr
    assert not r.stdout


def test_down_local_without_cluster_json(tmp_path):
    r = dsctl("cluster", "down", "--local", "--local-dir", tmp_path / "empty")
    assert r.returncode == 1 and "cluster.json" in r.stderr, r.stderr
    (tmp_path / "empty").mkdir()
    r = dsctl("cluster", "down", "--local", "--local-dir", tmp_path / "empty")
    assert r.returncode == 1, r.stderr
    assert f"{tmp_path / 'empty' / 'cluster.json'} does not exist" in r.stderr, r.stderr


# --------------------------------------------------------- real agents --

def agents_in(d):
    """pids of running dsagent processes whose --data-dir is under d."""
    d = str(pathlib.Path(d).resolve())
    out = []
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in argv]
        if not argv or os.path.basename(argv[0]) != "dsagent" or "--data-dir" not in argv:
            continue
        i = argv.index("--data-dir")
        if i + 1 < len(argv) and argv[i + 1].startswith(d + "/"):
            out.append(int(p.name))
    return sorted(out)


def kill_all(d):
    for pid in agents_in(d):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def get(url, path, token=None):
    """(status, JSON body) of GET url+path."""
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"}
                                 if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def on_a_terminal(args, env=None, timeout=240):
    """Runs dsctl with stdout on a pseudo-terminal: (exit status, what the
    terminal got, stderr)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([binary("dsctl"), *map(str, args)], stdout=slave,
                         stderr=subprocess.PIPE, cwd=ROOT,
                         env={**os.environ, "TERM": "xterm", **(env or {})})
    os.close(slave)
    chunks = []

    def drain():
        while True:
            try:
                b = os.read(master, 4096)
            except OSError:
                return
            if not b:
                return
            chunks.append(b)
    t = threading.Thread(target=drain, daemon=True)
    t.start()
    rc = p.wait(timeout=timeout)
    t.join(timeout=5)
    os.close(master)
    return rc, b"".join(chunks).decode(errors="replace"), p.stderr.read().decode()


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """Tiny V3 weights with the real vocabulary and tokenizer files."""
    src = shared_data("deepseek-v3/tokenizer.json").parent
    d = write_model("v3", tmp_path_factory.mktemp("cliv3") / "m",
                    overrides={"vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    return d


@pytest.fixture(scope="module")
def local3(tmp_path_factory, tiny_chat):
    """`cluster up --local 3 --pp 3` once for the module, on a terminal:
    (dir, exit status, terminal, stderr)."""
    d = tmp_path_factory.mktemp("local3") / "cluster"
    rc, screen, err = on_a_terminal(["cluster", "up", "--local", "3", "--local-dir", d,
                                     "--model", tiny_chat, "--pp", "3", "--max-ctx", "128",
                                     "--served-model-name", "m,alias"], env=FAST)
    yield d, rc, screen, err
    dsctl("cluster", "down", "--local", "--local-dir", d)
    kill_all(d)


def swap_shape(model_dir, name):
    """Reverses the shape of tensor name in its safetensors header (same
    bytes, so the file stays valid; only a rank that loads it fails)."""
    idx = json.loads((model_dir / "model.safetensors.index.json").read_text())
    f = model_dir / idx["weight_map"][name]
    b = f.read_bytes()
    n = int.from_bytes(b[:8], "little")
    h = json.loads(b[8:8 + n])
    assert h[name]["shape"][0] != h[name]["shape"][1]
    h[name]["shape"] = h[name]["shape"][::-1]
    hs = json.dumps(h, separators=(",", ":")).encode()
    assert len(hs) <= n
    f.write_bytes(b[:8] + hs + b" " * (n - len(hs)) + b[8 + n:])


def node1(d):
    a = json.loads((d / "cluster.json").read_text())["agents"][0]
    return a["control_url"], pathlib.Path(a["data_dir"]) / "admin.token"


def test_local_three_agents_elect_one_head(local3, tiny_chat):
    d, rc, screen, err = local3
    assert rc == 0, screen + err
    doc = json.loads((d / "cluster.json").read_text())
    agents = doc["agents"]
    assert [a["name"] for a in agents] == ["node1", "node2", "node3"], screen + err
    assert sorted(a["pid"] for a in agents) == agents_in(d)
    assert (d.stat().st_mode & 0o777) == 0o700 and (d / "cluster.key").stat().st_mode & 0o77 == 0
    for a in agents:
        assert a["data_dir"] == str(d.resolve() / a["name"])
    deadline = time.monotonic() + 5
    while True:
        views = {}
        for a in agents:
            tok = (pathlib.Path(a["data_dir"]) / "admin.token").read_text().strip()
            views[a["name"]] = get(a["control_url"], "/v1/cluster/state", tok)[1]
        if all(v["has_head"] for v in views.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    heads = {(v["head"] or {}).get("name") for v in views.values()}
    assert heads == {"node1"}, views                     # node1 has --priority 1
    assert [v["role"] for v in views.values()].count("head") == 1, views
    assert all(v["alive"] == 3 and v["expect"] == 3 for v in views.values()), views
    # a second `cluster up --local 3` reuses the running agents (and relaunches)
    r2 = dsctl("cluster", "up", "--local", "3", "--local-dir", d, "--model", tiny_chat,
               "--pp", "3", "--max-ctx", "128", "--served-model-name", "m,alias", "--json",
               env=FAST, timeout=240)
    assert r2.returncode == 0, r2.stdout + r2.stderr
    events = [json.loads(line) for line in r2.stdout.splitlines()]  # one object per line
    assert events[0]["event"] == "local" and events[0]["reused"] is True, r2.stdout
    assert [a["pid"] for a in events[0]["agents"]] == [a["pid"] for a in agents]
    plan = next(e for e in events if e.get("event") == "plan")
    assert (plan["tp"], plan["pp"], plan["ep"]) == (1, 3, 1), plan
    progress = [e for e in events if e.get("event") == "progress"]
    assert progress and progress[-1]["state"] == "serving", progress
    ranks = [k for n in progress[-1]["nodes"] for k in n["ranks"]]
    assert sorted(k["rank"] for k in ranks) == [0, 1, 2]
    assert all(k["state"] == "ready" and k["loaded_bytes"] > 0 for k in ranks), ranks
    last = events[-1]
    assert last["serving"] is True and last["api_url"].endswith("/v1"), last
    assert last["deployment"] > 1 and last["control_url"] == node1(d)[0]
    # another size while it runs: refused, nothing started
    r3 = dsctl("cluster", "up", "--local", "2", "--local-dir", d, "--model", tiny_chat, env=FAST)
    assert r3.returncode == 1 and "cluster down --local" in last_line(r3.stderr), r3.stderr
    assert agents_in(d) == sorted(a["pid"] for a in agents)


def test_terminal_output_and_the_keys_line(local3):
    d, rc, screen, err = local3
    assert rc == 0, screen + err
    assert "tp 1 x pp 3 x ep 1 = 3 rank(s)" in screen, screen
    assert "\x1b[2K" in screen and "100%" in screen, screen    # bars redrawn in place
    assert "serving m,alias (deployment" in screen and "/v1" in screen, screen
    keys_line = last_line(screen.replace("\r", "\n")).strip()
    assert keys_line.startswith(binary("dsctl")) and keys_line.endswith("keys create NAME")
    r = subprocess.run(keys_line.replace("NAME", "cli").split() + ["--json"],
                       capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    key = json.loads(r.stdout)["key"]
    api = screen[screen.index("serving m,alias (deployment"):].split(" at ")[1].split()[0]
    status, models = get(api, "/models", key)
    assert status == 200 and [m["id"] for m in models["data"]] == ["m", "alias"], models


def test_down_keeps_the_agents_and_up_serves_again(local3, tiny_chat):
    d, rc, _, _ = local3
    url, tok = node1(d)
    pids = agents_in(d)
    r = dsctl("--agent", url, "--token-file", tok, "cluster", "down")
    assert r.returncode == 0, r.stderr
    assert "stopped" in r.stdout, r.stdout
    assert agents_in(d) == pids
    st = get(url, "/v1/cluster/up", tok.read_text().strip())[1]
    assert st["state"] == "stopped", st
    api = st["api_url"]
    status, body = get(api, "/models")
    assert status == 503 and body["error"]["code"] == "no_model", body
    r = dsctl("--agent", url, "--token-file", tok, "--json", "cluster", "up", "--model",
              tiny_chat, "--pp", "3", "--max-ctx", "128", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(last_line(r.stdout))["serving"] is True


def test_does_not_fit_and_failed_launch(local3, tiny_chat, tmp_path):
    d, rc, _, _ = local3
    url, tok = node1(d)
    r = dsctl("--agent", url, "--token-file", tok, "cluster", "up", "--model", tiny_chat,
              "--mem-fraction", "0.01", "--max-ctx", "128")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "short by" in r.stderr and "422" in last_line(r.stderr), r.stderr
    r = dsctl("--agent", url, "--token-file", tok, "--json", "cluster", "up", "--model",
              tiny_chat, "--mem-fraction", "0.01", "--max-ctx", "128")
    last = json.loads(last_line(r.stdout))
    assert r.returncode == 1 and last["serving"] is False and last["shortfall"]["bytes"] > 0
    # a checkpoint without its tokenizer: planned, launched, and failed at load
    bare = tmp_path / "bare"
    shutil.copytree(tiny_chat, bare)
    (bare / "tokenizer.json").unlink()
    r = dsctl("--agent", url, "--token-file", tok, "--json", "cluster", "up", "--model", bare,
              "--pp", "3", "--max-ctx", "128", timeout=240)
    assert r.returncode == 1, r.stdout + r.stderr
    last = json.loads(last_line(r.stdout))
    assert last["serving"] is False and "tokenizer.json" in last["error"], last
    r = dsctl("--agent", url, "--token-file", tok, "cluster", "up", "--model", bare, "--pp", "3",
              "--max-ctx", "128", timeout=240)
    assert r.returncode == 1 and "tokenizer.json" in last_line(r.stderr), r.stderr
    # a checkpoint whose layer 2 (stage 2 of pp 3: node3's rank) has a tensor
    # of the wrong shape: that rank fails to load, and the last line says so
    bad = tmp_path / "bad"
    shutil.copytree(tiny_chat, bad)
    swap_shape(bad, "model.layers.2.self_attn.o_proj.weight")
    r = dsctl("--agent", url, "--token-file", tok, "--json", "cluster", "up", "--model", bad,
              "--pp", "3", "--max-ctx", "128", timeout=240)
    assert r.returncode == 1, r.stdout + r.stderr
    last = json.loads(last_line(r.stdout))
    assert last["serving"] is False and last["failed_rank"] == 2, last
    assert last["failed_node"] == "node3" and "expected shape" in last["error"], last
    assert "node node3, rank 2" in last_line(r.stderr), r.stderr
    # a rejected admin token: nothing is posted
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-the-token\n")
    r = dsctl("--agent", url, "--token-file", wrong, "cluster", "up", "--model", tiny_chat)
    assert r.returncode == 1 and "rejected the admin token" in r.stderr, r.stderr
    assert str(wrong) in last_line(r.stderr)


def test_local_down_leaves_nothing(local3):
    d, _, _, _ = local3
    assert len(agents_in(d)) == 3
    r = dsctl("cluster", "down", "--local", "--local-dir", d)
    assert r.returncode == 0, r.stderr
    assert agents_in(d) == [] and not (d / "cluster.json").exists()
    assert r.stdout.count(" stopped") == 3, r.stdout
    r = dsctl("cluster", "down", "--local", "--local-dir", d)
    assert r.returncode == 1 and "cluster.json" in r.stderr


def test_local_agent_dying_at_start(tmp_path, tiny_chat):
    """node2 cannot open its store (its dsagent.db is a directory): dsctl names
    node2 and its log, shows the log's end, and stops node1, which started."""
    d = tmp_path / "cluster"
    (d / "node2" / "dsagent.db").mkdir(parents=True)
    try:
        r = dsctl("cluster", "up", "--local", "2", "--local-dir", d, "--model", tiny_chat,
                  "--wait", "30000", env=FAST)
        assert r.returncode == 1, r.stdout + r.stderr
        log = d / "node2" / "agent.log"
        assert f"node2 exited with status 1 during start-up (its log: {log})" in \
            last_line(r.stderr), r.stderr
        assert f"--- the end of {log} ---" in r.stderr and "dsagent.db" in r.stderr
        assert agents_in(d) == [] and not (d / "cluster.json").exists()
        assert "dsagent listening" in (d / "node1" / "agent.log").read_text()
    finally:
        kill_all(d)

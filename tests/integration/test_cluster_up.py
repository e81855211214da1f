"""One command to serve across nodes, on one machine: `dsctl cluster up
--local N` starts N agents (each its own data dir, one fresh cluster key),
waits for a head, plans, launches the ranks through every agent and returns
once the head serves.  The `openai` SDK then gets the same greedy text and
tokens as from a one-node dsagent serving the same files; the plan in the
head's SQLite is what `dsctl plan show --json` prints and what each rank
process has in its environment; a rank killed during 16 streams ends each
stream with an error event or a clean finish, turns /health to 503 naming
it, shows in `dsctl nodes`, and `dsctl cluster up` serves again.  A head
whose agent is killed is replaced by one that relaunches the deployment
(replanned over the nodes left) and serves the same text; its API answers
503 with Retry-After until then.  `dsctl cluster down --local` leaves no
process behind."""
import json
import os
import pathlib
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from conftest import ROOT, binary, start_agent
from tests.fixtures.shared import shared_data
from tests.fixtures.tiny_models import write_model

GGUF = ROOT / "models" / "default.gguf"
PROMPT = "the quick brown fox"
UP_WAIT = 240  # s: agents, election, load; generous for a loaded 2-core machine


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """Tiny V3 weights with the real vocabulary and tokenizer files (the API
    needs a tokenizer)."""
    src = shared_data("deepseek-v3/tokenizer.json").parent
    d = write_model("v3", tmp_path_factory.mktemp("upv3") / "m",
                    overrides={"vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    return d


def dsctl(*args, timeout=UP_WAIT + 60):
    return subprocess.run([binary("dsctl"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def last_json(out):
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines, "no output"
    return json.loads(lines[-1])


def procs_of(word):
    """pids whose command line holds word (a local cluster's directory)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read()
            st = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        if word.encode() in cmd and st[st.rindex(")") + 2] != "Z":
            out.append(int(d))
    return out


class Cluster:
    """`dsctl cluster up --local N` in dir; .up is the last JSON line."""

    def __init__(self, tmp, n, model, *plan, extra=()):
        self.dir = tmp / "cluster"
        self.n, self.model, self.plan, self.extra = n, model, plan, list(extra)
        self.up = None

    def start(self):
        r = dsctl("--json", "cluster", "up", "--local", self.n, "--local-dir", self.dir,
                  "--model", self.model, "--max-ctx", 128, *self.plan, *self.extra)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:], self.logs())
        self.up = last_json(r.stdout)
        assert self.up["serving"] is True and self.up["api_url"].endswith("/v1"), self.up
        self.starts = getattr(self, "starts", 0) + 1
        r = dsctl("--agent", self.up["control_url"], "--token-file", self.up["admin_token_file"],
                  "--json", "keys", "create", f"t{self.starts}")
        assert r.returncode == 0, r.stderr
        self.key = json.loads(r.stdout)["key"]
        return self

    def ctl(self, *args):
        return dsctl("--agent", self.up["control_url"], "--token-file",
                     self.up["admin_token_file"], *args, timeout=60)

    def logs(self):
        out = []
        for p in sorted(self.dir.glob("node*/agent.log")) + sorted(self.dir.glob("node*/ranks/*.log")):
            out.append(f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}")
        return "\n".join(out)

    def down(self):
        r = dsctl("cluster", "down", "--local", "--local-dir", self.dir, timeout=120)
        deadline = time.monotonic() + 20
        while procs_of(str(self.dir)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = procs_of(str(self.dir))
        assert r.returncode == 0, r.stderr
        assert not left, f"left running: {left}"


def complete(api_url, key):
    c = openai.OpenAI(base_url=api_url, api_key=key, max_retries=0, timeout=120)
    r = c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=12,
                             temperature=0, extra_body={"ignore_eos": True}, logprobs=1)
    return r.choices[0].text, r.choices[0].logprobs.tokens, r.usage.completion_tokens


_one_node = {}


def one_node(tmp, model):
    """The greedy answer of one dsagent serving model alone (cached per model)."""
    if str(model) not in _one_node:
        a = start_agent(tmp / "one", "--model", str(model), "--threads", "1", "--ctx", "128",
                        "--max-running", "4")
        try:
            a.wait_serving(timeout=120)
            r = dsctl("--agent", a.url, "--data-dir", a.data_dir, "--json", "keys", "create", "t")
            assert r.returncode == 0, r.stderr
            _one_node[str(model)] = complete(a.api_url + "/v1", json.loads(r.stdout)["key"])
        finally:
            assert a.stop() == 0, a.log_tail()
    return _one_node[str(model)]


def rank_env(pid):
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def check_plan_rows(c):
    """dsctl plan show --json = the head's SQLite rows; each rank's process
    has its row's environment."""
    r = c.ctl("--json", "plan", "show")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    head_dir = os.path.dirname(c.up["admin_token_file"])
    db = sqlite3.connect(os.path.join(head_dir, "dsagent.db"))
    try:
        plan = db.execute("SELECT id, tp, pp, ep, world_size, model FROM plans "
                          "ORDER BY id DESC LIMIT 1").fetchone()
        rows = db.execute("SELECT rank, node_name, device, stage, env FROM plan_ranks "
                          "WHERE plan_id = ? ORDER BY rank", (plan[0],)).fetchall()
        groups = dict(db.execute("SELECT name, ranks FROM comm_groups WHERE plan_id = ?",
                                 (plan[0],)).fetchall())
    finally:
        db.close()
    assert (shown["version"], shown["tp"], shown["pp"], shown["ep"], shown["world_size"],
            shown["model"]) == plan
    assert len(shown["ranks"]) == len(rows) == plan[4]
    for k, row in zip(shown["ranks"], rows):
        assert (k["rank"], k["node_name"], k["stage"]) == (row[0], row[1], row[3]), (k, row)
        assert k["env"] == json.loads(row[4])
    assert {g["name"]: g["ranks"] for g in shown["comm_groups"]} == \
        {k: json.loads(v) for k, v in groups.items()}
    # the text form says why: memory per device, the cost, what was rejected
    # (a plan the planner chose itself: one without --tp has alternatives)
    token = open(c.up["admin_token_file"]).read().strip()
    req = urllib.request.Request(c.up["control_url"] + "/v1/cluster/plan", method="POST",
                                 data=json.dumps({"model": shown["model"],
                                                  "max_ctx": 128}).encode(),
                                 headers={"Authorization": "Bearer " + token,
                                          "Content-Type": "application/json"})
    auto = json.loads(urllib.request.urlopen(req, timeout=30).read())
    r = c.ctl("plan", "show")
    assert r.returncode == 0, r.stderr
    text, cost = r.stdout, auto["cost"]
    assert "RESERVE GiB" in text and "FREE GiB" in text, text
    assert f"why: {cost['seconds_per_token'] * 1e3:.3f} ms per decode token" in text, text
    assert cost["rejected"], cost
    for x in cost["rejected"]:
        line = (f"tp {x['tp']} x pp {x['pp']} x ep {x['ep']}: "
                f"{x['seconds_per_token'] * 1e3:.3f} ms per token, {x['reason']}")
        assert line in text, (line, text)
    # every rank process has its row's environment
    req = urllib.request.Request(c.up["control_url"] + "/v1/cluster/up", headers={
        "Authorization": "Bearer " + open(c.up["admin_token_file"]).read().strip()})
    status = json.loads(urllib.request.urlopen(req, timeout=10).read())
    pids = {k["rank"]: k["pid"] for n in status["nodes"] for k in n["ranks"]}
    assert sorted(pids) == list(range(plan[4])) and all(pids.values()), status
    for rank, env_text in ((row[0], row[4]) for row in rows):
        env = rank_env(pids[rank])
        want = json.loads(env_text)
        assert want and {k: env.get(k) for k in want} == want, (rank, want)


CASES = [
    ("tp2", 2, "tiny", ("--tp", 2)),
    ("pp3", 3, "tiny", ("--pp", 3)),
    ("tp2ep2", 4, "tiny", ("--tp", 2, "--ep", 2)),
    ("gguf-pp2", 2, "gguf", ("--pp", 2)),
]


@pytest.mark.parametrize("name,n,kind,plan", CASES, ids=[c[0] for c in CASES])
def test_cluster_up_local_serves_the_one_node_text(tmp_path, tiny_chat, name, n, kind, plan):
    if kind == "gguf" and not GGUF.exists():
        pytest.skip("models/default.gguf missing: make model")
    model = tiny_chat if kind == "tiny" else GGUF
    want = one_node(tmp_path, model)
    c = Cluster(tmp_path, n, model, *plan)
    try:
        c.start()
        got = complete(c.up["api_url"], c.key)
        print(f"{name}: {got[0]!r}")
        assert got == want and got[2] == 12
        if name == "tp2":
            check_plan_rows(c)
    finally:
        c.down()
    assert not (c.dir / "cluster.json").exists()


def stream_one(api_url, key, i, out, started):
    """One streaming chat request: ('finish', reason) after a clean end,
    ('error', message) for an error event, ('cut', exception) otherwise;
    started gets i once its first chunk came."""
    body = json.dumps({"model": None, "stream": True, "max_tokens": 100, "temperature": 0,
                       "ignore_eos": True,
                       "messages": [{"role": "user", "content": f"count to {i}"}]}).encode()
    req = urllib.request.Request(api_url + "/chat/completions", data=body, headers={
        "Authorization": "Bearer " + key, "Content-Type": "application/json"})
    finish = error = None
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                started.add(i)
                if "error" in ev:
                    error = ev["error"].get("message", "")
                for ch in ev.get("choices", []):
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
        out[i] = ("error", error) if error else ("finish", finish) if finish else ("cut", "no end")
    except Exception as e:  # noqa: BLE001 - any cut connection is the failure we look for
        out[i] = ("cut", repr(e))


def test_kill_a_rank_during_streams(tmp_path, tiny_chat):
    c = Cluster(tmp_path, 2, tiny_chat, "--tp", 2, extra=["--served-model-name", "m"])
    try:
        c.start()
        token = open(c.up["admin_token_file"]).read().strip()

        def status():
            req = urllib.request.Request(c.up["control_url"] + "/v1/cluster/up",
                                         headers={"Authorization": "Bearer " + token})
            return json.loads(urllib.request.urlopen(req, timeout=10).read())

        st = status()
        victim = next(k for n in st["nodes"] for k in n["ranks"] if k["rank"] == 1)
        victim_node = next(n["name"] for n in st["nodes"]
                           if any(k["rank"] == 1 for k in n["ranks"]))
        out, started = [None] * 16, set()
        threads = [threading.Thread(target=stream_one,
                                    args=(c.up["api_url"], c.key, i, out, started))
                   for i in range(16)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(started) < 16 and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(victim["pid"], signal.SIGKILL)  # the streams are running
        for t in threads:
            t.join(200)
        assert all(o and o[0] in ("error", "finish") for o in out), out
        assert any(o[0] == "error" for o in out), out
        # /health: 503 naming the rank
        health = c.up["api_url"][:-3] + "/health"
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(health, timeout=5)
                code, text = 200, ""
            except urllib.error.HTTPError as e:
                code, text = e.code, e.read().decode()
            if code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert code == 503 and "rank 1" in text, (code, text)
        # dsctl nodes names the dead rank on its node
        r = c.ctl("--json", "nodes")
        assert r.returncode == 0, r.stderr
        nodes = json.loads(r.stdout)["nodes"]
        dead = [k for n in nodes if n["name"] == victim_node for k in n.get("ranks", [])
                if k["rank"] == 1]
        assert dead and dead[0]["state"] == "killed" and dead[0]["pid"] == victim["pid"], nodes
        r = c.ctl("nodes")
        assert "killed" in r.stdout, r.stdout
        # dsctl cluster up serves again
        c.start()
        got = complete(c.up["api_url"], c.key)
        assert got[2] == 12
    finally:
        c.down()


def test_a_new_head_relaunches(tmp_path, tiny_chat):
    """The head's agent is SIGKILLed: a new head is elected, relaunches the
    deployment over the nodes left and serves the same text; until then its
    API answers 503 with Retry-After."""
    want = one_node(tmp_path, tiny_chat)
    c = Cluster(tmp_path, 3, tiny_chat, "--pp", 3)
    try:
        c.start()
        agents = json.loads((c.dir / "cluster.json").read_text())["agents"]
        head = next(a for a in agents if a["control_url"] == c.up["control_url"])
        others = [a for a in agents if a is not head]
        os.kill(head["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        seen, served = set(), None
        while served is None and time.monotonic() - t0 < 90:
            for a in others:
                try:
                    with urllib.request.urlopen(a["api_url"] + "/v1/models", timeout=5) as r:
                        served = a
                        break
                except urllib.error.HTTPError as e:
                    seen.add((e.code, e.headers.get("Retry-After") is not None,
                              json.loads(e.read())["error"]["code"]))
                except urllib.error.URLError:
                    seen.add(("refused",))
            time.sleep(0.1)
        assert served, (seen, c.logs())
        print(f"serving again after {time.monotonic() - t0:.1f} s; answers meanwhile: {seen}")
        assert seen and all(s[0] == 503 and s[1] for s in seen), seen
        token = (pathlib.Path(served["data_dir"]) / "admin.token").read_text().strip()
        req = urllib.request.Request(served["control_url"] + "/v1/cluster/up",
                                     headers={"Authorization": "Bearer " + token})
        st = json.loads(urllib.request.urlopen(req, timeout=10).read())
        assert st["state"] == "serving" and st["world"] == 2, st  # replanned over 2
        r = dsctl("--agent", served["control_url"], "--token-file",
                  pathlib.Path(served["data_dir"]) / "admin.token", "--json", "keys", "create",
                  "after")
        assert r.returncode == 0, r.stderr
        got = complete(served["api_url"] + "/v1", json.loads(r.stdout)["key"])
        assert got == want
    finally:
        c.down()


def test_hidden_topology_reaches_every_rank(tmp_path, tiny_chat):
    """Nodes whose topology NCCL cannot see (the vm fixture: RDMA functions
    without a NUMA node) get the plan's NCCL topology file: every rank's
    NCCL_TOPO_FILE names a file on its node holding exactly its node's XML
    (rank 0's written by the head, the others' by their node's launcher).
    The ranks are CPU ranks here (the agents run --backend cpu): the plan is
    the GPUs'."""
    from tests.fixtures import sysroots as sr
    root = tmp_path / "vmroot"
    sr.build("vm", str(root))
    c = Cluster(tmp_path, 2, tiny_chat, extra=["--fake-gpus", "2xH100-80GB:nvswitch"])
    os.environ["DSAGENT_SYSROOT"] = str(root)  # dsctl passes DSAGENT_* to the agents
    try:
        c.start()
    finally:
        del os.environ["DSAGENT_SYSROOT"]
    try:
        doc = json.loads(c.ctl("--json", "plan", "show").stdout)["document"]
        xml = {n["name"]: n["nccl_topo_xml"] for n in doc["nodes"]}
        assert all(isinstance(x, str) and x.startswith("<system") for x in xml.values()), xml
        token = open(c.up["admin_token_file"]).read().strip()
        req = urllib.request.Request(c.up["control_url"] + "/v1/cluster/up",
                                     headers={"Authorization": "Bearer " + token})
        st = json.loads(urllib.request.urlopen(req, timeout=10).read())
        ranks = [(n["name"], k) for n in st["nodes"] for k in n["ranks"]]
        assert len(ranks) == doc["world"] == 4, st
        for node, k in ranks:
            path = rank_env(k["pid"])["NCCL_TOPO_FILE"]
            assert f"/{node}/ranks/" in path, (node, path)
            assert os.stat(path).st_mode & 0o777 == 0o600
            assert open(path).read() == xml[node], (node, k["rank"])
    finally:
        c.down()

"""Head election, the cluster inventory and the cluster control API between
real dsagent processes on loopback (docs/cluster.md, "Election", "Cluster
inventory", "Control API and dsctl").

- one agent without a cluster key is a single-node cluster, its own head at
  epoch 1: `dsctl nodes` and `dsctl cluster status` work; dsctl says clearly
  when the agent is unreachable or the token is wrong;
- four agents on the fixture sysroots of tests/fixtures/sysroots.py (8xH100
  with InfiniBand, RoCE, no InfiniBand, no NVML) form a cluster; each node's
  inventory, as `dsctl nodes --json` shows it and as the head's SQLite file
  holds it (read here with Python's sqlite3), equals the inventory the fixture
  declares; every node's own file holds its own row;
- five agents started in random order with random delays agree on the member
  list and on one head within 5 s of the last start;
- the head SIGKILLed: a new head with a higher epoch within 10 s; the old
  head restarted rejoins as a follower (no preemption, though it may rank
  first); every node's store shows the same epoch history;
- a partition (the test-only drop switch) that puts the head in the minority:
  only the majority side has a head, the minority does not raise its epoch;
  healed, one head again and no node's epoch went backwards.

Timings use the gossip "test" profile, --settle-ms 300, --lease-ms 1500.
Each agent's stdout/stderr go to files in its own temporary directory.
"""
import http.client
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from conftest import ROOT, binary, start_agent

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests.fixtures import sysroots as sr  # noqa: E402
from tests.fixtures.net import free_port  # noqa: E402
from tests.fixtures.agent import GOSSIP, AgentProcess, start_shuffled  # noqa: E402

MODEL = ROOT / "models" / "default.gguf"
LEASE_MS = 1500
SETTLE_MS = 300
CONVERGE_S = 5.0
FAILOVER_S = 10.0


class Node:
    """One dsagent in a cluster: .name, .ctl (control port), .node_id, .data."""

    def __init__(self, tmp, name, key, seed_port, expect, gossip_port=0, extra=(), env=None):
        self.name, self.tmp = name, tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.data = tmp / "data"
        self.key, self.seed_port, self.expect = key, seed_port, expect
        self.gossip_port, self.extra, self.env = gossip_port, list(extra), env or {}
        self.proc = None
        self.start()

    def start(self):
        cmd = ["--name", self.name, "--bind", "127.0.0.1",
               "--control-port", "0", "--api-port", "0", "--data-dir", str(self.data),
               "--backend", "cpu", "--threads", "1", "--kv-cache-mb", "8",
               "--model", str(MODEL), "--cluster-key", str(self.key),
               "--gossip-bind", "127.0.0.1", "--gossip-port", str(self.gossip_port),
               "--gossip-profile", "test", "--join", f"127.0.0.1:{self.seed_port}",
               "--expect", str(self.expect), "--settle-ms", str(SETTLE_MS),
               "--lease-ms", str(LEASE_MS), "--health-ms", "1000",
               "--test-fault-injection", *self.extra]
        self.agent = AgentProcess(binary("dsagent"), cmd, log_dir=self.tmp, env=self.env)
        self.proc, self.out, self.err = self.agent.proc, self.agent.out_path, self.agent.err_path
        self.started = self.agent.started
        self.ctl = self.node_id = None

    def wait_listening(self, timeout=60):
        self.node_id = self.agent.wait_line(GOSSIP, timeout, f"{self.name}: gossip=").group(3)
        self.ctl = self.agent.wait_listening(timeout).control_port
        self.token = self.agent.token()
        self.url = f"http://127.0.0.1:{self.ctl}"

    def request(self, method, path, body=None, token=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.ctl, timeout=10)
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None,
                         headers={"Authorization": f"Bearer {token or self.token}"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    def state(self):
        status, body = self.request("GET", "/v1/cluster/state")
        assert status == 200, body
        return body

    def drop(self, peers):
        status, body = self.request("POST", "/v1/cluster/test/drop", {"peers": peers})
        assert status == 200, body

    def elections(self):
        """(epoch, head id) of every epoch with a head in this node's store."""
        db = sqlite3.connect(str(self.data / "dsagent.db"), timeout=10)
        try:
            return db.execute("SELECT epoch, head_id FROM elections WHERE head_id IS NOT NULL "
                              "ORDER BY epoch").fetchall()
        finally:
            db.close()

    def kill(self, sig=signal.SIGKILL):
        """Stops the agent; returns its exit status (0 after a clean SIGTERM
        stop: no sanitizer report in an ASan build)."""
        return self.agent.stop(sig, timeout=20)

    def alive(self):
        return self.proc.poll() is None


def wait_for(pred, timeout, what, step=0.05):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        ok, last = pred()
        if ok:
            return time.monotonic()
        time.sleep(step)
    raise AssertionError(f"{what} not within {timeout} s; last: {last}")


def heads(nodes):
    """{name: (has_head, head id, head epoch, epoch, role)} of every node."""
    out = {}
    for n in nodes:
        s = n.state()
        out[n.name] = (s["has_head"], (s["head"] or {}).get("id"), s["head_epoch"], s["epoch"],
                       s["role"])
    return out


def agreed(nodes, exclude_id=None):
    """Every node has a head, the same one, at the same epoch; all see the
    same members alive.  Returns (ok, (head id, epoch) or the views)."""
    view = heads(nodes)
    hs = {(h, e) for has, h, e, _, _ in view.values() if has}
    if len(hs) != 1 or not all(v[0] for v in view.values()):
        return False, view
    (h, e), = hs
    if h == exclude_id:
        return False, view
    names = {n.name for n in nodes}
    for n in nodes:
        ms = {m["name"]: m["state"] for m in n.state()["members"]}
        if {k for k, v in ms.items() if v == "alive"} != names:
            return False, {n.name: ms}
    roles = {n.name: view[n.name][4] for n in nodes}
    if sorted(roles.values()).count("head") != 1:
        return False, roles
    return True, (h, e)


def agent_log(a):
    """What a conftest agent wrote to stderr (a file or a pipe)."""
    if hasattr(a, "log"):
        return a.log()
    return a.proc.stderr.read() if a.proc.stderr else ""


def dsctl(*args, env=None):
    return subprocess.run([binary("dsctl"), *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})


def make_key(tmp):
    key = tmp / "cluster.key"
    r = dsctl("cluster", "init", "--key-file", str(key))
    assert r.returncode == 0, r.stderr
    return key


# ----------------------------------------------------------------- one node --

def test_single_node_is_its_own_head(tmp_path):
    a = start_agent(tmp_path, "--name", "solo", "--threads", "1", "--kv-cache-mb", "8")
    try:
        data = str(a.data_dir)
        r = dsctl("--agent", a.url, "--data-dir", data, "cluster", "status", "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert st["single"] is True and st["role"] == "head" and st["has_head"] is True
        assert st["epoch"] == 1 and st["head_epoch"] == 1 and st["quorum"] == 1
        assert st["head"]["name"] == "solo"
        assert [e["epoch"] for e in st["elections"]] == [1]
        r = dsctl("--agent", a.url, "--data-dir", data, "nodes", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["source"] == "head" and doc["stale"] is False
        assert [n["name"] for n in doc["nodes"]] == ["solo"]
        node = doc["nodes"][0]
        assert node["role"] == "head" and node["status"] == "alive" and node["self"] is True
        assert node["inventory"]["schema"] == 1 and len(node["digest"]) == 64
        r = dsctl("--agent", a.url, "--data-dir", data, "nodes")
        assert r.returncode == 0, r.stderr
        assert re.search(r"^solo\*\s+-\s+alive\s+head\s", r.stdout, re.M), r.stdout
        r = dsctl("--agent", a.url, "--data-dir", data, "cluster", "status")
        assert r.returncode == 0 and "head:    solo (epoch 1, no expiry)" in r.stdout, r.stdout
        # wrong credentials, unreachable agent, unknown node: clear messages
        bad = tmp_path / "bad.token"
        bad.write_text("not-the-token\n")
        r = dsctl("--agent", a.url, "--token-file", str(bad), "nodes")
        assert r.returncode == 1 and "rejected the admin token" in r.stderr, r.stderr
        assert str(bad) in r.stderr
        r = dsctl("--agent", "http://127.0.0.1:1", "--data-dir", data, "nodes")
        assert r.returncode == 1 and "cannot reach the agent at http://127.0.0.1:1" in r.stderr
        r = dsctl("--agent", a.url, "--data-dir", data, "nodes", "nosuch")
        assert r.returncode == 1 and "no node named 'nosuch'" in r.stderr
        # the agent-only route refuses the admin token
        st, body = a.get("/v1/cluster/election", "POST", b"{}",
                         {"Authorization": f"Bearer {(a.data_dir / 'admin.token').read_text().strip()}"})
        assert st in (401, 403), body
    finally:
        assert a.stop() == 0, agent_log(a)[-2000:]
    # restarted on the same store: still the head of epoch 1
    a = start_agent(tmp_path, "--name", "solo", "--threads", "1", "--kv-cache-mb", "8")
    try:
        r = dsctl("--agent", a.url, "--data-dir", str(a.data_dir), "cluster", "status", "--json")
        st = json.loads(r.stdout)
        assert st["head_epoch"] == 1 and st["epoch"] == 1, st
    finally:
        assert a.stop() == 0


# ------------------------------------------------------------- shard plans --

def seed_plan(db_path, rng, epoch):
    """Writes a random plan straight into an agent's SQLite file (as the head
    will once it plans): tp x pp x ep ranks on the nodes of its nodes table.
    Returns the plan's version."""
    db = sqlite3.connect(str(db_path), timeout=10)
    try:
        nodes = [r[0] for r in db.execute("SELECT id FROM nodes ORDER BY id")]
        tp, pp, ep = rng.choice([1, 2]), rng.choice([1, 2, 3]), rng.choice([1, 2])
        S, W = tp * ep, tp * pp * ep
        doc = {"why": f"random plan {rng.randrange(10**6)}", "tp": tp}
        cur = db.execute(
            "INSERT INTO plans (epoch, created, head_id, model, tp, pp, ep, world_size, max_ctx, "
            "max_seqs, status, status_at, reason, document) "
            "VALUES (?, ?, NULL, ?, ?, ?, ?, ?, ?, ?, 'planned', ?, NULL, ?)",
            (epoch, 1700000000, f"/models/m{rng.randrange(1000)}", tp, pp, ep, W,
             rng.randrange(1, 65536), rng.randrange(1, 64), 1700000000, json.dumps(doc)))
        pid = cur.lastrowid
        for r in range(W):
            env = {"NCCL_IB_HCA": f"=mlx5_{rng.randrange(8)}:1", "RANK": str(r)}
            db.execute("INSERT INTO plan_ranks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (pid, r, rng.choice(nodes), None, rng.randrange(-1, 8), r // S, r % tp,
                        (r % S) // tp, (r // S) * 7, 7, ((r % S) // tp) * 4, 4,
                        rng.randrange(1 << 40), rng.randrange(1 << 30), json.dumps(env)))
        db.execute("INSERT INTO comm_groups VALUES (?, 'world', ?)", (pid, json.dumps(list(range(W)))))
        for st in range(pp):
            db.execute("INSERT INTO comm_groups VALUES (?, ?, ?)",
                       (pid, f"stage{st}", json.dumps(list(range(st * S, st * S + S)))))
        db.commit()
        return pid
    finally:
        db.close()


def plan_rows(db_path, pid):
    """The plan's rows as GET /v1/cluster/plan names them (JSON columns parsed)."""
    db = sqlite3.connect(str(db_path), timeout=10)
    db.row_factory = sqlite3.Row
    try:
        p = dict(db.execute("SELECT * FROM plans WHERE id = ?", (pid,)).fetchone())
        p["version"] = p.pop("id")
        p["document"] = json.loads(p["document"])
        ranks = []
        for r in db.execute("SELECT * FROM plan_ranks WHERE plan_id = ? ORDER BY rank", (pid,)):
            r = dict(r)
            del r["plan_id"]
            r["env"] = json.loads(r["env"])
            ranks.append(r)
        groups = [{"name": g["name"], "ranks": json.loads(g["ranks"])} for g in
                  db.execute("SELECT * FROM comm_groups WHERE plan_id = ? ORDER BY rowid", (pid,))]
        return p, ranks, groups
    finally:
        db.close()


def check_plan_doc(doc, db_path, pid):
    p, ranks, groups = plan_rows(db_path, pid)
    for k, v in p.items():
        assert doc.get(k) == v, (k, doc.get(k), v)
    assert [{k: x.get(k) for k in r} for x, r in zip(doc["ranks"], ranks)] == ranks
    assert len(doc["ranks"]) == len(ranks) == p["world_size"]
    assert doc["comm_groups"] == groups


def test_plan_show_matches_the_heads_sqlite(tmp_path, rng):
    a = start_agent(tmp_path, "--name", "solo", "--threads", "1", "--kv-cache-mb", "8")
    try:
        base = ["--agent", a.url, "--data-dir", str(a.data_dir)]
        r = dsctl(*base, "plan", "show")
        assert r.returncode == 1 and "404" in r.stderr and "no plan yet" in r.stderr, r.stderr
        db = a.data_dir / "dsagent.db"
        seed_plan(db, rng, 1)
        pid = seed_plan(db, rng, 1)     # the newest row is the current plan
        r = dsctl(*base, "plan", "show", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["source"] == "head" and doc["version"] == pid
        check_plan_doc(doc, db, pid)
        r = dsctl(*base, "plan", "show")
        assert r.returncode == 0, r.stderr
        assert re.search(rf"^plan v{pid} \(epoch 1\): planned since ", r.stdout, re.M), r.stdout
        assert f"= {doc['world_size']}" in r.stdout
        assert len(re.findall(r"^\d+\s+[0-9a-f]{32}\s+(cpu|gpu\d)\s", r.stdout, re.M)) == \
            doc["world_size"], r.stdout
        assert "NCCL_IB_HCA=" + doc["ranks"][0]["env"]["NCCL_IB_HCA"] in r.stdout
    finally:
        assert a.stop() == 0, agent_log(a)[-2000:]


def sql1(db_path, sql, args=()):
    """The first column of the first row of a query on an agent's SQLite file."""
    db = sqlite3.connect(str(db_path), timeout=10)
    try:
        return db.execute(sql, args).fetchone()[0]
    finally:
        db.close()


def test_the_head_plans_and_stores_the_plan(tmp_path, tiny_deepseek):
    """POST /v1/cluster/plan: the head plans the tiny V3 over its record (one
    CPU node here), writes it with its epoch, and GET / dsctl plan show read
    it back; bad requests are named and change nothing."""
    a = start_agent(tmp_path, "--name", "solo", "--threads", "1", "--kv-cache-mb", "8")
    try:
        tok = (a.data_dir / "admin.token").read_text().strip()
        hdr = {"Authorization": f"Bearer {tok}", "Content-Type": "application/json"}

        def post(body):
            return a.get("/v1/cluster/plan", "POST", json.dumps(body).encode(), hdr)

        st, doc = post({"model": str(tiny_deepseek["v3"])})
        assert st == 200, doc
        assert doc["fits"] is True and doc["source"] == "head" and doc["epoch"] == 1
        v1 = doc["version"]
        db = a.data_dir / "dsagent.db"
        p, ranks, groups = plan_rows(db, v1)
        self_id = sql1(db, "SELECT id FROM nodes WHERE name = ?", ("solo",))
        assert (p["tp"], p["pp"], p["ep"], p["world_size"]) == (1, 1, 1, 1)
        assert p["epoch"] == 1 and p["status"] == "planned" and p["head_id"] == self_id
        assert p["model"] == str(tiny_deepseek["v3"]) and p["document"]["ranks"] == doc["ranks"]
        assert [r["node_id"] for r in ranks] == [self_id] and ranks[0]["device"] == -1  # CPU
        assert ranks[0]["layer_first"] == 0 and ranks[0]["layer_count"] == 3  # the tiny V3's layers
        assert ranks[0]["env"] == doc["nodes"][0]["env"]
        assert [g["name"] for g in groups] == ["world", "stage0", "tp0.0"]
        r = dsctl("--agent", a.url, "--data-dir", str(a.data_dir), "plan", "show", "--json")
        assert r.returncode == 0, r.stderr
        check_plan_doc(json.loads(r.stdout), db, v1)
        # bad requests: named, nothing written
        for body, code, want in [
            ({}, 400, "model"),
            ({"model": str(tmp_path / "nope")}, 404, "nope"),
            ({"model": str(tiny_deepseek["v3"]), "tp": 3}, 400, "tp"),
            ({"model": str(tiny_deepseek["v3"]), "mem_fraction": 2}, 400, "mem_fraction"),
        ]:
            st, err = post(body)
            assert st == code and want in err["error"]["message"], (body, st, err)
        # a plan that does not fit: 422 with the shortfall in bytes, nothing written
        st, err = post({"model": str(tiny_deepseek["v3"]), "mem_fraction": 0.01})
        assert st == 422, err
        assert err["error"]["code"] == "does_not_fit" and err["plan"]["fits"] is False
        assert err["plan"]["shortfall"]["bytes"] > 0
        assert sql1(db, "SELECT MAX(id) FROM plans") == v1
        # a second plan supersedes the first
        st, doc = post({"model": str(tiny_deepseek["v3"]), "max_ctx": 64})
        assert st == 200 and doc["version"] > v1, doc
        assert sql1(db, "SELECT status FROM plans WHERE id = ?", (v1,)) == "superseded"
    finally:
        assert a.stop() == 0, agent_log(a)[-2000:]


# ------------------------------------------------------- fixture inventories --

def first_diff(a, b, path="$"):
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(set(a) ^ set(b))} differ"
        for k in a:
            d = first_diff(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, bool) or isinstance(b, bool):
        return None if a is b else f"{path}: {a!r} != {b!r}"
    return None if a == b else f"{path}: {a!r} != {b!r}"


def digest_of(doc):
    import copy
    import hashlib
    d = copy.deepcopy(doc)
    for g in d["gpus"]:
        g.pop("health", None)
    text = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(text.encode(), digest_size=32).hexdigest()


HEALTH = ["temperature_c", "power_mw", "memory_used_bytes", "ecc_uncorrected_volatile",
          "ecc_uncorrected_aggregate", "retired_pages_sbe", "retired_pages_dbe",
          "remapped_rows_correctable", "remapped_rows_uncorrectable", "remapped_rows_pending",
          "remapped_rows_failed"]
BOOL_HEALTH = {"remapped_rows_pending", "remapped_rows_failed"}


def sql_rows(db, sql, args):
    cur = db.execute(sql, args)
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def b(v):
    return None if v is None else int(v)


def check_sqlite(db, node_id, exp):
    """The head's tables hold exactly the expected inventory of node_id."""
    row, = sql_rows(db, "SELECT * FROM nodes WHERE id = ?", (node_id,))
    host, comp, src = exp["host"], exp["compute"], exp["gpu_source"]
    assert (row["hostname"], row["cpu_model"], row["cpus"], row["sockets"], row["memory_bytes"]) == \
        (host["hostname"], host["cpu_model"], host["cpus"], host["sockets"], host["memory_bytes"])
    assert (row["compute_kind"], row["ranks"]) == (comp["kind"], comp["ranks"])
    assert (row["gpu_source"], row["driver_version"], row["cuda_driver_version"]) == \
        (src["kind"], src["driver_version"], src["cuda_driver_version"])
    assert row["digest"] == digest_of(exp)
    d = first_diff(json.loads(row["inventory"]), exp)
    assert d is None, d
    gpus = sql_rows(db, "SELECT * FROM gpus WHERE node_id = ? ORDER BY idx", (node_id,))
    want = []
    for g in exp["gpus"]:
        w = {"idx": g["index"], "nvml_index": g["nvml_index"], "uuid": g["uuid"], "name": g["name"],
             "bus_id": g["bus_id"], "numa_node": g["numa_node"],
             "compute_capability": g["compute_capability"],
             "memory_total_bytes": g["memory_total_bytes"], "nvlinks": g["nvlinks"],
             "nvswitch": b(g["nvswitch"])}
        for k in HEALTH:
            v = g["health"][k]
            w[k] = b(v) if k in BOOL_HEALTH else v
        want.append(w)
    assert [{k: r[k] for k in w} for r, w in zip(gpus, want)] == want and len(gpus) == len(want)
    ports = sql_rows(db, "SELECT * FROM ib_ports WHERE node_id = ?", (node_id,))
    key = {(p["device"], p["port"]): p for p in ports}
    assert len(key) == len(exp["ib_ports"])
    for p in exp["ib_ports"]:
        r = key[(p["device"], p["port"])]
        got = {k: r[k] for k in p}
        assert got == {**p, "usable": b(p["usable"])}, (got, p)
    nics = sql_rows(db, "SELECT * FROM nics WHERE node_id = ? ORDER BY pos", (node_id,))
    assert [{"name": r["name"], "ipv4": json.loads(r["ipv4"]), "ipv6": json.loads(r["ipv6"])}
            for r in nics] == exp["nics"]
    links = sql_rows(db, "SELECT a, b, level, nvlinks, nvswitch, source FROM links "
                         "WHERE node_id = ? ORDER BY a, b", (node_id,))
    assert links == [{**lk, "nvswitch": b(lk["nvswitch"])} for lk in exp["gpu_links"]]
    gn = sql_rows(db, "SELECT gpu, nic, level, source FROM gpu_nic WHERE node_id = ?",
                  (node_id,))
    assert sorted(gn, key=lambda e: (e["gpu"], e["nic"])) == \
        sorted(exp["gpu_nic"], key=lambda e: (e["gpu"], e["nic"]))


def test_fixture_inventories_in_dsctl_and_sqlite(tmp_path):
    assert MODEL.exists(), "models/default.gguf is missing: `make model` fetches it"
    key = make_key(tmp_path)
    seed = free_port()
    fixtures = []
    for kind, name in (("h100", "h100"), ("roce", "roce"), ("noib", "noib"), ("nonvml", "nonvml")):
        root = tmp_path / f"root-{kind}"
        node = sr.build(kind, root)
        if kind == "h100":
            args, gpus = ["--fake-gpus", "8xH100-80GB:nvswitch"], sr.FakeSpec("8xH100-80GB:nvswitch")
        elif kind == "roce":
            args, gpus = ["--fake-gpus", "2xA100-80GB:pcie"], sr.FakeSpec("2xA100-80GB:pcie")
        elif kind == "noib":
            args, gpus = ["--fake-gpus", "0"], sr.FakeSpec("0")
        else:
            missing = root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
            args, gpus = ["--nvml-lib", str(missing)], sr.NoNvml(f"absent: {missing} not found")
        fixtures.append((name, ["--sysroot", str(root), *args], sr.expected(node, gpus)))
    nodes = []
    try:
        for i, (name, args, _) in enumerate(fixtures):
            nodes.append(Node(tmp_path / name, name, key, seed, expect=4,
                              gossip_port=seed if i == 0 else 0, extra=args))
        for n in nodes:
            n.wait_listening()
        t0 = time.monotonic()
        head_id, epoch = None, None

        def inventories():
            ok, hv = agreed(nodes)
            if not ok:
                return False, hv
            r = dsctl("--agent", nodes[-1].url, "--data-dir", str(nodes[-1].data), "nodes",
                      "--json")
            if r.returncode != 0:
                return False, r.stderr
            doc = json.loads(r.stdout)
            have = {n["name"]: n["inventory"] is not None for n in doc["nodes"]}
            # roles come from each member's gossip metadata: they follow the election
            roles = sorted(n["role"] for n in doc["nodes"])
            return doc["source"] == "head" and all(have.values()) and len(have) == 4 and \
                roles == ["follower"] * 3 + ["head"], (hv, doc)

        wait_for(inventories, 20, "a head with every inventory", step=0.2)
        print(f"fixtures: head and 4 inventories after {time.monotonic() - t0:.2f} s")
        ok, (head_id, epoch) = agreed(nodes)
        # dsctl nodes --json (asked of a follower: forwarded to the head)
        asker = next(n for n in nodes if n.node_id != head_id)
        r = dsctl("--agent", asker.url, "--data-dir", str(asker.data), "nodes", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["source"] == "head" and doc["via"] == asker.name and doc["epoch"] == epoch
        by_name = {n["name"]: n for n in doc["nodes"]}
        ids = {}
        for (name, _, exp), n in zip(fixtures, nodes):
            got = by_name[name]
            ids[name] = got["id"]
            assert got["id"] == n.node_id and got["status"] == "alive"
            assert got["role"] == ("head" if n.node_id == head_id else "follower")
            d = first_diff(got["inventory"], exp)
            assert d is None, f"{name}: {d}"
            assert got["digest"] == digest_of(exp)
        s = by_name["h100"]["summary"]
        assert s == {"gpus": 8, "gpu_memory_total_bytes": 8 * (80 << 30),
                     "gpu_memory_used_bytes": 0, "max_temperature_c": 37,
                     "ecc_uncorrected_volatile": 0, "ecc_uncorrected_aggregate": 0,
                     "ib_ports_up": 7, "ib_ports_total": 8, "ib_rate_gbps_min": 400,
                     "ib_rate_gbps_max": 400, "compute": "gpu", "ranks": 8}
        assert by_name["nonvml"]["summary"]["gpus"] == 0
        # the text views
        r = dsctl("--agent", asker.url, "--data-dir", str(asker.data), "nodes")
        assert r.returncode == 0, r.stderr
        line = next(x for x in r.stdout.splitlines() if x.startswith("h100"))
        assert re.search(r"alive\s+\S+\s+8\s+0\.0/640\.0\s+37C\s+0/0\s+7/8 @400G\s+\S+", line), line
        assert "head: " in r.stdout
        r = dsctl("--agent", asker.url, "--data-dir", str(asker.data), "nodes", "h100")
        assert r.returncode == 0, r.stderr
        assert re.search(r"^\s+GPU0\s+X\s+NV18(\s+NV18){6}\s+PIX\s+PHB\s+NODE", r.stdout, re.M), r.stdout
        assert re.search(r"^\s+7\s+NVIDIA H100 80GB\s+0000:78:00.0\s+1\s+0.0/80.0\s+37C\s+107\s+0/0\s+"
                         r"18 \(NVSwitch\)$", r.stdout, re.M), r.stdout
        assert re.search(r"^\s+mlx5_5\s+1\s+InfiniBand\s+DOWN\s+\S+.*\sno$", r.stdout, re.M)
        r = dsctl("--agent", asker.url, "--data-dir", str(asker.data), "nodes", "roce", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["name"] == "roce"
        # the head's SQLite file holds every node; each node's file its own
        head = next(n for n in nodes if n.node_id == head_id)
        db = sqlite3.connect(str(head.data / "dsagent.db"), timeout=10)
        try:
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            for name, _, exp in fixtures:
                check_sqlite(db, ids[name], exp)
            assert db.execute("SELECT COUNT(*) FROM nodes").fetchone()[0] == 4
        finally:
            db.close()
        for (name, _, exp), n in zip(fixtures, nodes):
            db = sqlite3.connect(str(n.data / "dsagent.db"), timeout=10)
            try:
                check_sqlite(db, n.node_id, exp)
            finally:
                db.close()
    finally:
        codes = {n.name: n.kill(signal.SIGTERM) for n in nodes}
    assert all(c == 0 for c in codes.values()), (codes, [n.err.read_text()[-2000:] for n in nodes])


# ---------------------------------------------------------- five agents --

@pytest.fixture(scope="module")
def five(tmp_path_factory):
    assert MODEL.exists(), "models/default.gguf is missing: `make model` fetches it"
    tmp = tmp_path_factory.mktemp("election")
    key = make_key(tmp)
    seed = free_port()
    names = ["a", "b", "c", "d", "e"]
    nodes, order, last_start = start_shuffled(      # "a" is the seed
        names, lambda name: Node(tmp / name, name, key, seed, expect=5,
                                 gossip_port=seed if name == "a" else 0), 0.5)
    ns = [nodes[x] for x in names]
    yield {"nodes": ns, "last_start": last_start, "order": order}
    codes = {n.name: n.kill(signal.SIGTERM) for n in ns}
    assert all(c == 0 for c in codes.values()), (codes, [n.err.read_text()[-2000:] for n in ns])


def test_five_agents_elect_one_head(five):
    nodes = five["nodes"]
    t = wait_for(lambda: agreed(nodes), CONVERGE_S + 10, "one head everywhere")
    took = t - five["last_start"]
    ok, (head, epoch) = agreed(nodes)
    print(f"start order {five['order']}: head {head[:8]} epoch {epoch} agreed "
          f"{took:.2f} s after the last start")
    assert took <= CONVERGE_S, f"{took:.2f} s > {CONVERGE_S} s"
    states = [n.state() for n in nodes]
    lists = [sorted((m["id"], m["name"]) for m in s["members"]) for s in states]
    assert all(lst == lists[0] for lst in lists) and len(lists[0]) == 5
    assert all(s["quorum"] == 3 and s["expect"] == 5 for s in states)
    # the head won with a majority: its own record says how many votes
    hnode = next(n for n in nodes if n.node_id == head)
    other = next(n for n in nodes if n is not hnode)

    def roles_published():         # each member's role travels in its gossip metadata
        roles = sorted(m["role"] for m in other.state()["members"])
        return roles == ["follower"] * 4 + ["head"], roles

    wait_for(roles_published, 5, "every role in the metadata")
    r = dsctl("--agent", other.url, "--data-dir", str(other.data), "cluster", "status")
    assert r.returncode == 0, r.stderr
    assert re.search(rf"^head:    {hnode.name} \(epoch {epoch}, lease \d+ ms left here\)$",
                     r.stdout, re.M), r.stdout
    assert re.search(r"^members: 5 alive, 5 known \(not left\); expect 5, quorum 3$", r.stdout,
                     re.M), r.stdout
    assert re.search(rf"^{other.name}\*\s+[0-9a-f]{{12}}\s+127\.0\.0\.1:\d+\s+alive\s+follower\s+"
                     rf"{epoch}\s+yes\s+0$", r.stdout, re.M), r.stdout
    row = next(e for e in hnode.state()["elections"] if e["epoch"] == epoch)
    assert row["outcome"] == "won" and row["votes"] >= 3 and row["quorum"] == 3


def test_plan_show_from_a_follower_is_forwarded_to_the_head(five, rng):
    nodes = five["nodes"]
    wait_for(lambda: agreed(nodes), 15, "one head everywhere")
    ok, (head, epoch) = agreed(nodes)
    hnode = next(n for n in nodes if n.node_id == head)
    other = next(n for n in nodes if n is not hnode)
    pid = seed_plan(hnode.data / "dsagent.db", rng, epoch)
    r = dsctl("--agent", other.url, "--data-dir", str(other.data), "plan", "show", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["source"] == "head" and doc["via"] == other.name
    assert doc["answered_by"] == hnode.name and doc["version"] == pid
    check_plan_doc(doc, hnode.data / "dsagent.db", pid)


def test_head_killed_new_head_no_preemption(five):
    nodes = five["nodes"]
    wait_for(lambda: agreed(nodes), 15, "one head everywhere")
    ok, (old_head, old_epoch) = agreed(nodes)
    victim = next(n for n in nodes if n.node_id == old_head)
    others = [n for n in nodes if n is not victim]
    victim.kill(signal.SIGKILL)
    t_kill = time.monotonic()

    def new_head():
        view = heads(others)
        hs = {(h, e) for has, h, e, _, _ in view.values() if has}
        if len(hs) != 1 or not all(v[0] for v in view.values()):
            return False, view
        (h, e), = hs
        return h != old_head and e > old_epoch, view

    t = wait_for(new_head, FAILOVER_S + 10, "a new head")
    took = t - t_kill
    _, view = new_head()
    new_id, new_epoch = next((h, e) for _, h, e, _, _ in view.values())
    print(f"head {victim.name} SIGKILLed: new head {new_id[:8]} epoch {new_epoch} after {took:.2f} s")
    assert took <= FAILOVER_S, f"{took:.2f} s > {FAILOVER_S} s"
    # the old head comes back: a follower of the new head, whatever its rank
    victim.start()
    victim.wait_listening()
    t_back = time.monotonic()

    def rejoined():
        ok, what = agreed(nodes)
        return ok and what == (new_id, new_epoch), what

    t = wait_for(rejoined, 15, "the old head rejoins as follower")
    print(f"old head back as follower after {t - t_back:.2f} s")
    time.sleep(2 * LEASE_MS / 1000)         # several leases: nobody deposes the head
    ok, what = agreed(nodes)
    assert ok and what == (new_id, new_epoch), what
    assert victim.state()["role"] == "follower"
    # its store survived kill -9 and still knows the epoch it won
    db = sqlite3.connect(str(victim.data / "dsagent.db"), timeout=10)
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("SELECT head_id FROM elections WHERE epoch = ?",
                          (old_epoch,)).fetchone()[0] == old_head
    finally:
        db.close()

    def same_history():
        hist = {n.name: n.elections() for n in nodes}
        first = next(iter(hist.values()))
        return all(h == first for h in hist.values()) and \
            (old_epoch, old_head) in first and (new_epoch, new_id) in first, hist

    wait_for(same_history, 10, "the same epoch history in every store")
    hist = nodes[0].elections()
    assert [e for e, _ in hist] == sorted({e for e, _ in hist})


def test_partition_only_majority_has_head(five):
    nodes = five["nodes"]
    wait_for(lambda: agreed(nodes), 15, "one head everywhere")
    ok, (head, epoch) = agreed(nodes)
    hnode = next(n for n in nodes if n.node_id == head)
    minority = [hnode] + [n for n in nodes if n is not hnode][:1]
    majority = [n for n in nodes if n not in minority]
    before = {n.name: n.state()["epoch"] for n in nodes}
    for n in minority:                  # cut in and out: one side is enough
        n.drop(",".join(m.name for m in majority))
    t_cut = time.monotonic()

    def split():
        mn, mj = heads(minority), heads(majority)
        hs = {(h, e) for has, h, e, _, _ in mj.values() if has}
        ok = not any(v[0] for v in mn.values()) and len(hs) == 1 and \
            all(v[0] for v in mj.values())
        return ok and next(iter(hs))[1] > epoch, (mn, mj)

    t = wait_for(split, FAILOVER_S + 10, "a head on the majority side only")
    _, (mn, mj) = split()
    new_head, new_epoch = next((h, e) for _, h, e, _, _ in mj.values())
    print(f"partition {[n.name for n in minority]} | {[n.name for n in majority]}: majority "
          f"head {new_head[:8]} epoch {new_epoch} after {t - t_cut:.2f} s")
    assert new_head not in {n.node_id for n in minority}
    # the minority never elects and does not even raise its epoch (pre-vote)
    minority_epochs = {n.name: n.state()["epoch"] for n in minority}
    for _ in range(10):
        time.sleep(0.2)
        mn = heads(minority)
        assert not any(v[0] for v in mn.values()), mn
        assert not any(v[4] == "head" for v in mn.values()), mn
    assert {n.name: n.state()["epoch"] for n in minority} == minority_epochs
    reasons = [n.state()["why"] for n in minority]
    print(f"minority says: {reasons}")
    for n in minority:
        n.drop("")
    t_heal = time.monotonic()
    t = wait_for(lambda: agreed(nodes), 15, "one head after healing")
    ok, (h2, e2) = agreed(nodes)
    print(f"healed: head {h2[:8]} epoch {e2} everywhere after {t - t_heal:.2f} s")
    assert (h2, e2) == (new_head, new_epoch), "the healed minority deposed the head"
    after = {n.name: n.state()["epoch"] for n in nodes}
    assert all(after[k] >= before[k] for k in before), (before, after)
    # one head per epoch in every store, and the same history everywhere
    hists = {n.name: n.elections() for n in nodes}
    wait_for(lambda: (len({tuple(n.elections()) for n in nodes}) == 1, hists), 10,
             "the same epoch history")

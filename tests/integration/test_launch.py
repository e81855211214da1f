"""Rank processes of a plan on one node (agent/launch, docs/cluster.md "Rank
processes on a node"): POST /v1/ranks starts `dsagent worker` ranks with the
plan's options and environment, GET lists them, DELETE stops them.

Checked on real processes: the rank is this agent's own binary with the
options given (/proc/PID/exe, cmdline) and the agent's environment plus the
plan's variables (/proc/PID/environ), stderr goes to DATA_DIR/ranks/; bad
requests (duplicate rank, bad variable name, bad job id, an epoch the node
has not heard of) are refused by name and leave the running rank alone; a
new job replaces the old one; DELETE stops the rank (state, signal); ranks
die with their agent, also when it is killed with SIGKILL (PR_SET_PDEATHSIG
from the launcher's long-lived spawner thread).

The rank started here is rank 1 of a tp 2 plan whose store is a socket
that accepts and never answers: it waits in the rendezvous, which keeps it
alive for the checks (its comm timeout is 60 s).
"""
import json
import os
import signal
import socket
import time

from conftest import binary, start_agent


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def call(a, method, body=None):
    tok = (a.data_dir / "admin.token").read_text().strip()
    hdr = {"Authorization": f"Bearer {tok}", "Content-Type": "application/json"}
    return a.get("/v1/ranks", method, json.dumps(body).encode() if body is not None else None, hdr)


def rank_req(job, model, store_port, epoch=1, rank=1, env=None):
    return {"job": job, "epoch": epoch, "ranks": [{
        "rank": rank,
        "args": ["--model", str(model), "--tp", "2", "--rank", str(rank), "--threads", "1",
                 "--store", f"127.0.0.1:{store_port}", "--job", job, "--log-level", "info"],
        "env": env if env is not None else {"NCCL_IB_DISABLE": "1", "DS_TEST_MARK": job}}]}


def test_ranks_start_list_stop_and_die_with_the_agent(tmp_path, tiny_deepseek):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    a = start_agent(tmp_path, "--name", "solo", "--threads", "1", "--kv-cache-mb", "8")
    pids = []
    try:
        st, doc = call(a, "GET")
        assert st == 200 and doc["job"] is None and doc["ranks"] == [], doc
        st, doc = call(a, "POST", rank_req("t1", tiny_deepseek["v3"], port))
        assert st == 200, doc
        assert doc["job"] == "t1" and doc["epoch"] == 1 and len(doc["ranks"]) == 1, doc
        r = doc["ranks"][0]
        assert r["rank"] == 1 and r["state"] == "running", r
        pid = r["pid"]
        pids.append(pid)
        # the agent's binary, our options, the agent's environment plus the
        # plan's (once the child has exec'd: the answer may come first)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:-1]
            if argv[1:2] == [b"worker"]:
                break
            time.sleep(0.02)
        assert os.readlink(f"/proc/{pid}/exe") == os.path.realpath(binary("dsagent"))
        assert [x.decode() for x in argv[1:]] == ["worker"] + rank_req(
            "t1", tiny_deepseek["v3"], port)["ranks"][0]["args"]
        env = dict(x.decode().split("=", 1) for x in
                   open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in x)
        assert env["DS_TEST_MARK"] == "t1" and env["NCCL_IB_DISABLE"] == "1"
        assert env.get("PATH") == os.environ.get("PATH")
        assert r["log"] == str(a.data_dir / "ranks" / "t1.rank1.log")
        # bad requests: named, and the running rank is left alone
        bad = [
            ({**rank_req("t2", tiny_deepseek["v3"], port),
              "ranks": rank_req("t2", tiny_deepseek["v3"], port)["ranks"] * 2},
             400, "rank 1 appears twice"),
            (rank_req("t2", tiny_deepseek["v3"], port, env={"1BAD": "x"}), 400, "variable '1BAD'"),
            (rank_req("no/slash", tiny_deepseek["v3"], port), 400, "job id 'no/slash'"),
            (rank_req("t2", tiny_deepseek["v3"], port, epoch=5), 503, "epoch"),
            ({"job": "t2"}, 400, "epoch"),
        ]
        for body, code, want in bad:
            st, err = call(a, "POST", body)
            assert st == code and want in err["error"]["message"], (st, err)
        st, doc = call(a, "GET")
        assert doc["job"] == "t1" and doc["ranks"][0]["pid"] == pid
        assert doc["ranks"][0]["state"] == "running" and alive(pid)
        # DELETE stops it
        st, doc = call(a, "DELETE")
        assert st == 200 and doc["ranks"][0]["state"] in ("killed", "exited"), doc
        assert doc["ranks"][0].get("signal") == signal.SIGTERM or \
            doc["ranks"][0].get("exit_code") is not None, doc
        assert wait_gone(pid, 5)
        assert (a.data_dir / "ranks" / "t1.rank1.log").exists()
        # a new job replaces the running one
        st, doc = call(a, "POST", rank_req("t2", tiny_deepseek["v3"], port))
        assert st == 200, doc
        p2 = doc["ranks"][0]["pid"]
        pids.append(p2)
        st, doc = call(a, "POST", rank_req("t3", tiny_deepseek["v3"], port))
        assert st == 200 and doc["job"] == "t3", doc
        p3 = doc["ranks"][0]["pid"]
        pids.append(p3)
        assert wait_gone(p2, 5) and alive(p3)
        # the rank outlives the HTTP request that started it (its connection's
        # thread ended long ago), and dies with the agent, even under SIGKILL
        time.sleep(0.5)
        assert alive(p3)
        a.stop(signal.SIGKILL)
        assert wait_gone(p3, 10), "a rank outlived its agent"
    finally:
        if a.alive():
            a.stop()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        silent.close()

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
from the launcher's long-lived spawner thread).  A rank's "files" are
written (0600, the exact bytes) and named by their variable in its
environment; bad entries are refused by name with nothing written.

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


def wait_exec(pid, timeout=20):
    """The child's environment once it has exec'd the worker."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:-1]
        if argv[1:2] == [b"worker"]:
            break
        time.sleep(0.02)
    pairs = [x.decode().split("=", 1) for x in
             open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in x]
    names = [k for k, _ in pairs]
    assert len(names) == len(set(names)), "a variable twice in the environment"
    return dict(pairs)


def test_rank_files(tmp_path, tiny_deepseek):
    """A rank's "files" {"VAR": content}: each is written, mode 0600, to
    DATA_DIR/ranks/<job>.<var>.<xml|txt> before the rank starts, and VAR
    names it in the rank's environment (over the agent's own VAR).  Bad
    entries are refused (400, named) and nothing is written or started."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    a = start_agent(tmp_path, "--name", "files", "--threads", "1", "--kv-cache-mb", "8",
                    env={"NCCL_TOPO_FILE": "/the/agent/own/value"})
    pids = []
    ranks_dir = a.data_dir / "ranks"
    model = tiny_deepseek["v3"]
    xml = ('  <system version="1">\n  <cpu numaid="0" affinity="0000ffff">\n'
           '    <pci busid="0000:08:00.0" class="0x030200"/>\n  </cpu>\n</system>\n')
    text = "plain text, not XML\nsecond line é\n"
    try:
        body = rank_req("f1", model, port)
        body["ranks"][0]["files"] = {"NCCL_TOPO_FILE": xml, "DS_Note_File": text}
        st, doc = call(a, "POST", body)
        assert st == 200, doc
        pid = doc["ranks"][0]["pid"]
        pids.append(pid)
        want = {"NCCL_TOPO_FILE": (ranks_dir / "f1.nccl_topo_file.xml", xml),
                "DS_Note_File": (ranks_dir / "f1.ds_note_file.txt", text)}
        assert doc["files"] == {k: str(p) for k, (p, _) in want.items()}, doc
        env = wait_exec(pid)
        for var, (path, content) in want.items():
            assert env[var] == str(path), (var, env.get(var))
            assert os.stat(path).st_mode & 0o777 == 0o600
            assert path.read_bytes() == content.encode()
        assert env["DS_TEST_MARK"] == "f1"  # "env" still applies
        # refused: nothing started, nothing written, the running rank left alone
        big = "x" * ((1 << 20) + 1)

        def with_files(files, env=None, job="bad"):
            b = rank_req(job, model, port, env=env)
            b["ranks"][0]["files"] = files
            return b
        two = rank_req("bad", model, port)
        two["ranks"].append({**two["ranks"][0], "rank": 2})
        two["ranks"][0]["files"] = {"NCCL_TOPO_FILE": xml}
        two["ranks"][1]["files"] = {"NCCL_TOPO_FILE": xml + " "}
        many = rank_req("bad", model, port)
        many["ranks"].append({**many["ranks"][0], "rank": 2})
        many["ranks"][0]["files"] = {f"A{i}": "x" for i in range(3)}
        many["ranks"][1]["files"] = {f"B{i}": "x" for i in range(3)}
        bad = [
            (with_files(["NCCL_TOPO_FILE", xml]), '"files" must be an object'),
            (many, "rank 2: the job's ranks name more than 4 files"),
            (with_files({"1BAD": xml}), "'1BAD' is not a variable name"),
            (with_files({"NCCL_TOPO_FILE": 7}), "NCCL_TOPO_FILE must be a string"),
            (with_files({"NCCL_TOPO_FILE": xml}, env={"NCCL_TOPO_FILE": "/x"}),
             'NCCL_TOPO_FILE is both in "env" and in "files"'),
            (with_files({f"F{i}": "x" for i in range(5)}), "5 files, more than 4"),
            (two, "rank 2: files: NCCL_TOPO_FILE differs from rank 1's"),
        ]
        for body, want_msg in bad:
            st, err = call(a, "POST", body)
            assert st == 400 and want_msg in err["error"]["message"], (st, err)
        # a file past 1 MiB cannot come over the control API: its body cap
        # answers first (the launcher's own cap: tests/unit/test_launch_files.c)
        st, err = call(a, "POST", with_files({"NCCL_TOPO_FILE": big}))
        assert st == 413 and "larger than the limit" in err["error"]["message"], (st, err)
        assert not list(ranks_dir.glob("bad.*"))
        st, doc = call(a, "GET")
        assert doc["job"] == "f1" and doc["ranks"][0]["state"] == "running" and alive(pid)
        # the ranks of a job share one file per variable
        two = rank_req("f2", model, port)
        two["ranks"].append({**two["ranks"][0], "rank": 2})
        for r in two["ranks"]:
            r["files"] = {"NCCL_TOPO_FILE": xml}
        st, doc = call(a, "POST", two)
        assert st == 200 and len(doc["ranks"]) == 2, doc
        pids += [r["pid"] for r in doc["ranks"]]
        path = ranks_dir / "f2.nccl_topo_file.xml"
        for r in doc["ranks"]:
            assert wait_exec(r["pid"])["NCCL_TOPO_FILE"] == str(path)
        assert path.read_text() == xml
        assert wait_gone(pid, 5)  # f1 was replaced
    finally:
        if a.alive():
            a.stop()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        silent.close()

"""The OpenAI API over a distributed model on one machine: `dsagent --tp 2`
(and --pp 2) serves the default GGUF model through rank processes of its own
binary (engine/driver.c, agent/api/serve.c), and the official `openai` SDK
gets the same greedy text and tokens as from a one-rank agent serving the
same file.  The ranks go with the agent when it stops."""
import json
import os
import subprocess
import time

import openai
import pytest

from conftest import ROOT, binary, start_agent

MODEL = ROOT / "models" / "default.gguf"
pytestmark = pytest.mark.skipif(not MODEL.exists(), reason="models/default.gguf missing: make model")

PROMPT = "the quick brown fox"


def ranks_of(pid):
    """pids of the `dsagent worker` children of pid."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = open(f"/proc/{d}/stat").read().split()
                cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if int(st[3]) == pid and b"worker" in cmd and st[2] != "Z":
                out.append(int(d))
    return out


def serve(tmp, model, *plan):
    a = start_agent(tmp, "--model", str(model), "--threads", "1", "--max-running", "4",
                    "--ctx", "128", *plan)
    a.wait_serving(timeout=120)
    r = subprocess.run([binary("dsctl"), "--agent", a.url, "--data-dir", str(a.data_dir),
                        "--json", "keys", "create", "t"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    a.key = json.loads(r.stdout)["key"]
    return a


def complete(a):
    c = openai.OpenAI(base_url=a.api_url + "/v1", api_key=a.key, max_retries=0, timeout=120)
    r = c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=12,
                             temperature=0, extra_body={"ignore_eos": True}, logprobs=1)
    return r.choices[0].text, r.choices[0].logprobs.tokens, r.usage.completion_tokens


@pytest.mark.parametrize("plan", [("--tp", "2"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_plan_serves_the_one_rank_text(tmp_path, plan):
    one = serve(tmp_path / "one", MODEL)
    try:
        want = complete(one)
    finally:
        assert one.stop() == 0
    a = serve(tmp_path / "plan", MODEL, *plan)
    try:
        ranks = ranks_of(a.proc.pid)
        assert len(ranks) == 2, ranks
        got = complete(a)
        print(f"{plan}: {got[0]!r}")
        assert got == want and got[2] == 12 and len(got[1]) == 12
    finally:
        assert a.stop() == 0, a.log_tail()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in ranks if os.path.exists(f"/proc/{p}")], "ranks outlived the agent"

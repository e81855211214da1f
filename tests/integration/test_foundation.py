"""The plumbing end to end: dsagent serves its control API over real HTTP,
dsctl reads it with libcurl, configuration flows from one table, bad input
gets clear errors, and signals stop the agent cleanly."""
import json
import signal
import socket
import subprocess

from conftest import binary, start_agent


def run(*cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, **kw)


def test_health_over_http(agent):
    status, body = agent.get("/health")
    assert status == 200
    assert body["status"] == "ok"
    assert body["name"] == "node-a"
    assert body["backend"] == "cpu"
    assert body["uptime_s"] >= 0


def test_dsctl_health_json_and_text(agent):
    r = run(binary("dsctl"), "--agent", agent.url, "health", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["name"] == "node-a" and doc["status"] == "ok"
    r = run(binary("dsctl"), "health", env={"DSCTL_AGENT": agent.url, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("node-a: ok (dsagent ")


def test_dsctl_says_when_agent_is_unreachable():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    r = run(binary("dsctl"), "--agent", f"http://127.0.0.1:{port}", "health")
    assert r.returncode == 1
    assert "cannot reach the agent" in r.stderr and str(port) in r.stderr


def test_dsctl_unknown_command_and_flag():
    r = run(binary("dsctl"), "frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr
    r = run(binary("dsctl"), "--colour", "health")
    assert r.returncode == 2 and "--colour" in r.stderr


def test_errors_have_openai_shape(agent):
    status, body = agent.get("/nope")
    assert status == 404
    assert body["error"]["code"] == "not_found" and "/nope" in body["error"]["message"]
    status, body = agent.get("/health", method="DELETE")
    assert status == 405 and "DELETE" in body["error"]["message"]
    status, body = agent.get("/health", method="POST", body=b"x" * (2 << 20),
                             headers={"Content-Type": "application/json"})
    assert status == 413 and "larger than the limit" in body["error"]["message"]
    # the agent keeps serving after bad requests
    assert agent.get("/health")[0] == 200


def test_config_precedence_file_env_flag(tmp_path):
    conf = tmp_path / "agent.conf"
    conf.write_text("# test config\nname = from-file\ncontrol-port = 7999\nlog-level = warn\n")
    r = run(binary("dsagent"), "--config", str(conf), "--control-port", "7998", "--print-config",
            env={"DSAGENT_LOG_LEVEL": "error"})
    assert r.returncode == 0, r.stderr
    cfg = dict(line.split(" = ", 1) for line in r.stdout.splitlines())
    assert cfg["name"] == "from-file"      # file over default
    assert cfg["log-level"] == "error"     # environment over file
    assert cfg["control-port"] == "7998"      # flag over everything
    assert cfg["backend"] == "auto"        # default


def test_bad_flags_are_named(tmp_path):
    r = run(binary("dsagent"), "--control-port", "99999")
    assert r.returncode == 2 and "--control-port=99999" in r.stderr and "range" in r.stderr
    r = run(binary("dsagent"), "--no-such-flag")
    assert r.returncode == 2 and "--no-such-flag" in r.stderr
    bad = tmp_path / "bad.conf"
    bad.write_text("name = x\nthis line has no equals sign\n")
    r = run(binary("dsagent"), "--config", str(bad), "--print-config")
    assert r.returncode == 2 and f"{bad}:2" in r.stderr
    r = run(binary("dsagent"), "--backend", "tpu", "--control-port", "0")
    assert r.returncode == 1 and "unknown backend 'tpu'" in r.stderr


def test_port_in_use_is_reported(agent, tmp_path):
    r = run(binary("dsagent"), "--control-port", str(agent.port), "--backend", "cpu",
            "--data-dir", str(tmp_path))
    assert r.returncode == 1 and f":{agent.port}" in r.stderr and "cannot listen" in r.stderr


def test_sigterm_and_sigint_stop_cleanly(tmp_path):
    for sig in (signal.SIGTERM, signal.SIGINT):
        a = start_agent(tmp_path)
        assert a.get("/health")[0] == 200
        assert a.stop(sig) == 0


def test_dsrun_lists_backends():
    r = run(binary("dsrun"), "--backends")
    assert r.returncode == 0
    assert any(line.startswith("cpu") and "usable" in line for line in r.stdout.splitlines())
    assert "cpu isa: detected" in r.stdout


def test_example_config_loads():
    from conftest import ROOT
    r = run(binary("dsagent"), "--config", str(ROOT / "examples/dsagent.conf"),
            "--print-config")
    assert r.returncode == 0, r.stderr
    cfg = dict(line.split(" = ", 1) for line in r.stdout.splitlines())
    assert cfg["bind"] == "127.0.0.1" and cfg["backend"] == "auto"

"""Named API keys end to end: a real dsagent (control API with the admin
token, SQLite store, key service) driven by `dsctl keys` and raw HTTP.

The key text is printed once by `dsctl keys create` and must never appear in
`keys list`, in the agent's files or in its logs; the admin token and the key
secret are private files; keys survive a restart."""
import json
import os
import re
import socket
import sqlite3
import stat
import subprocess

from conftest import binary, start_agent

KEY_RE = re.compile(r"^dsk-[A-Za-z0-9_-]{43}$")


def run(*cmd, env=None, **kw):
    full = {k: v for k, v in os.environ.items() if not k.startswith("DSCTL_")}
    full.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=full, **kw)


def dsctl(agent, *args, env=None):
    return run(binary("dsctl"), "--agent", agent.url, "--data-dir", str(agent.data_dir), *args,
               env=env)


def create(agent, name, *flags):
    r = dsctl(agent, "keys", "create", name, "--json", *flags)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"id", "name", "key"} and doc["name"] == name
    assert KEY_RE.match(doc["key"]), doc["key"]
    return doc


def list_json(agent):
    r = dsctl(agent, "keys", "list", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"data"}
    return {k["id"]: k for k in doc["data"]}


def admin_headers(agent, token=None):
    if token is None:
        token = (agent.data_dir / "admin.token").read_text().strip()
    return {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def files_contain(directory, needle):
    hits = []
    for p in directory.iterdir():
        if p.is_file() and needle.encode() in p.read_bytes():
            hits.append(p.name)
    return hits


def test_create_list_revoke(tmp_path):
    agent = start_agent(tmp_path, "--name", "keys-node")
    try:
        # text: a one-line warning, then the key alone on the last line
        r = dsctl(agent, "keys", "create", "ci-bot")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.strip().splitlines()
        assert len(lines) == 2 and "shown again" in lines[0] and "'ci-bot'" in lines[0]
        key1 = lines[1]
        assert KEY_RE.match(key1)
        doc = create(agent, "limited.one", "--rpm", "7", "--tpm", "900",
                     "--max-concurrency", "3", "--expires", "5")
        key2 = doc["key"]
        assert key1 != key2

        keys = list_json(agent)
        assert len(keys) == 2
        k2 = keys[doc["id"]]
        assert k2["name"] == "limited.one" and k2["prefix"] == key2[4:12]
        assert (k2["rpm"], k2["tpm"], k2["max_concurrency"]) == (7, 900, 3)
        assert k2["expires"] == k2["created"] + 5 * 86400
        assert k2["requests"] == 0 and k2["last_used"] is None and k2["revoked"] is False
        k1 = next(k for k in keys.values() if k["name"] == "ci-bot")
        assert k1["rpm"] is None and k1["expires"] is None

        # usage counters come from key_usage (written by the OpenAI routes);
        # add rows on two days next to the running agent and read them back
        db = sqlite3.connect(agent.data_dir / "dsagent.db", timeout=10)
        db.executemany("INSERT INTO key_usage VALUES (?, ?, ?, ?, ?)",
                       [(doc["id"], "2026-01-01", 3, 120, 45), (doc["id"], "2026-01-02", 2, 30, 5)])
        db.commit()
        db.close()
        k2 = list_json(agent)[doc["id"]]
        assert (k2["requests"], k2["prompt_tokens"], k2["completion_tokens"]) == (5, 150, 50)

        r = dsctl(agent, "keys", "list")
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert key1 not in out and key2 not in out
        assert key1[4:] not in out and key2[4:] not in out
        head = out.splitlines()[0].split()
        assert head[:3] == ["ID", "NAME", "PREFIX"] and "REQUESTS" in head and "RPM" in head
        row = next(line for line in out.splitlines() if "limited.one" in line)
        cells = row.split()
        assert f"dsk-{key2[4:12]}" in cells
        for value in ("5", "150", "50", "7", "900", "3"):
            assert value in cells, (value, row)
        # columns line up: every row starts its NAME column at the same offset
        starts = {line.index(name) for line, name in
                  zip(out.splitlines(), ["NAME", "ci-bot", "limited.one"])}
        assert len(starts) == 1

        # revoke: immediate, idempotent, unknown id named
        r = dsctl(agent, "keys", "revoke", str(doc["id"]))
        assert r.returncode == 0 and f"revoked key {doc['id']}" in r.stdout, r.stderr
        assert list_json(agent)[doc["id"]]["revoked"] is True
        r = dsctl(agent, "keys", "revoke", str(doc["id"]), "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["revoked"] is True
        r = dsctl(agent, "keys", "revoke", "999")
        assert r.returncode == 1 and "no key with id 999" in r.stderr
        r = dsctl(agent, "keys", "revoke", "abc")
        assert r.returncode == 2 and "'abc'" in r.stderr
        # the name of a revoked key is free again; an active name is not
        create(agent, "limited.one")
        r = dsctl(agent, "keys", "create", "ci-bot")
        assert r.returncode == 1 and "already exists" in r.stderr
        r = dsctl(agent, "keys", "create", "no spaces")
        assert r.returncode == 1 and "'name'" in r.stderr
        r = dsctl(agent, "keys", "create", "x", "--rpm", "many")
        assert r.returncode == 2 and "--rpm" in r.stderr
    finally:
        assert agent.stop() == 0
    # private files, and the key text nowhere on disk or in the logs
    data = agent.data_dir
    for name in ("admin.token", "keys.secret", "dsagent.db"):
        assert mode(data / name) == 0o600, name
    assert len((data / "keys.secret").read_bytes()) == 32
    for key in (key1, key2):
        assert files_contain(data, key[4:]) == []
    log = agent.log()
    assert key1[4:] not in log and key2[4:] not in log
    token = (data / "admin.token").read_text().strip()
    assert token not in log and str(data / "admin.token") in log


def test_admin_token_guards_key_routes(tmp_path):
    agent = start_agent(tmp_path)
    try:
        token = (agent.data_dir / "admin.token").read_text().strip()
        assert re.match(r"^[A-Za-z0-9_-]{43}$", token)
        # no token, wrong token, an API key instead of the admin token: 401
        status, body = agent.get("/v1/keys")
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert body["error"]["code"] == "missing_admin_token"
        status, body = agent.get("/v1/keys", headers=admin_headers(agent, token[:-1] + "x"))
        assert status == 401 and body["error"]["code"] == "invalid_admin_token"
        status, body = agent.get("/v1/keys", method="POST", body=b'{"name":"x"}',
                                 headers={"Authorization": "Basic " + token})
        assert status == 401
        doc = create(agent, "api-user")
        status, _ = agent.get("/v1/keys", headers=admin_headers(agent, doc["key"]))
        assert status == 401
        status, _ = agent.get(f"/v1/keys/{doc['id']}", method="DELETE")
        assert status == 401
        assert list_json(agent)[doc["id"]]["revoked"] is False
        # the scheme is case-insensitive; the health route stays public
        status, body = agent.get("/v1/keys", headers={"Authorization": "bearer " + token})
        assert status == 200 and len(body["data"]) == 1
        assert agent.get("/health")[0] == 200

        # POST /v1/keys validates types and names the field; unknown fields ignored
        h = admin_headers(agent)
        cases = [({"name": 5}, "name"), ({}, "name"), ({"name": "a b"}, "name"),
                 ({"name": "x", "rpm": -1}, "rpm"), ({"name": "x", "tpm": "ten"}, "tpm"),
                 ({"name": "x", "expires_days": 1.5}, "expires_days"),
                 ({"name": "x", "max_concurrency": True}, "max_concurrency")]
        for req, field in cases:
            status, body = agent.get("/v1/keys", method="POST", body=json.dumps(req).encode(),
                                     headers=h)
            assert status == 400 and body["error"]["param"] == field, (req, body)
        status, body = agent.get("/v1/keys", method="POST", body=b"[1,2", headers=h)
        assert status == 400
        status, body = agent.get("/v1/keys", method="POST", body=b"[1,2]", headers=h)
        assert status == 400
        status, body = agent.get("/v1/keys", method="POST", headers=h,
                                 body=b'{"name":"y","rpm":null,"colour":"red"}')
        assert status == 201 and KEY_RE.match(body["key"]) and body["rpm"] is None
        assert body["prefix"] == body["key"][4:12]
        status, body = agent.get("/v1/keys/abc", method="DELETE", headers=h)
        assert status == 400 and body["error"]["param"] == "id"
        status, body = agent.get("/v1/keys/424242", method="DELETE", headers=h)
        assert status == 404
        status, body = agent.get("/v1/keys/1", headers=h)
        assert status == 405

        # dsctl: a wrong token names its source; an unreadable file is named
        bad = tmp_path / "wrong.token"
        bad.write_text("not-the-token\n")
        r = dsctl(agent, "--token-file", str(bad), "keys", "list")
        assert r.returncode == 1
        assert "rejected the admin token" in r.stderr and str(bad) in r.stderr
        r = dsctl(agent, "keys", "list", env={"DSCTL_TOKEN": "nope"})
        assert r.returncode == 1 and "$DSCTL_TOKEN" in r.stderr
        missing = tmp_path / "missing.token"
        r = dsctl(agent, "--token-file", str(missing), "keys", "list")
        assert r.returncode == 1 and str(missing) in r.stderr and "cannot read" in r.stderr
        r = run(binary("dsctl"), "--agent", agent.url, "--data-dir", str(tmp_path / "nowhere"),
                "keys", "list")
        assert r.returncode == 1 and str(tmp_path / "nowhere" / "admin.token") in r.stderr
    finally:
        agent.stop()


def test_restart_keeps_keys_and_secrets(tmp_path):
    agent = start_agent(tmp_path)
    try:
        a = create(agent, "kept")
        b = create(agent, "dropped", "--rpm", "5")
        assert dsctl(agent, "keys", "revoke", str(b["id"])).returncode == 0
    finally:
        assert agent.stop() == 0
    token = (agent.data_dir / "admin.token").read_bytes()
    secret = (agent.data_dir / "keys.secret").read_bytes()

    agent = start_agent(tmp_path)
    try:
        assert (agent.data_dir / "admin.token").read_bytes() == token
        assert (agent.data_dir / "keys.secret").read_bytes() == secret
        keys = list_json(agent)
        assert keys[a["id"]]["name"] == "kept" and keys[a["id"]]["revoked"] is False
        assert keys[b["id"]]["revoked"] is True and keys[b["id"]]["rpm"] == 5
        c = create(agent, "after-restart")
        assert c["id"] > b["id"]
        with sqlite3.connect(agent.data_dir / "dsagent.db", timeout=10) as db:
            assert db.execute("PRAGMA user_version").fetchone()[0] >= 1
            kinds = [k for (k,) in db.execute("SELECT kind FROM events ORDER BY id")]
        assert kinds == ["key.created", "key.created", "key.revoked", "key.created"]
    finally:
        agent.stop()


def test_agent_and_token_precedence(tmp_path):
    agent = start_agent(tmp_path)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()  # nothing listens there now
    try:
        token = (agent.data_dir / "admin.token").read_text().strip()
        tfile = tmp_path / "t.token"
        tfile.write_text(token + "\n")
        wrong = tmp_path / "w.token"
        wrong.write_text("wrong\n")
        base = [binary("dsctl"), "keys", "list", "--json"]
        # --agent beats $DSCTL_AGENT
        r = run(*base, "--agent", agent.url, "--token-file", str(tfile),
                env={"DSCTL_AGENT": dead})
        assert r.returncode == 0, r.stderr
        # $DSCTL_AGENT is used when there is no flag, and named when unreachable
        r = run(*base, "--token-file", str(tfile), env={"DSCTL_AGENT": agent.url})
        assert r.returncode == 0, r.stderr
        r = run(*base, "--token-file", str(tfile), env={"DSCTL_AGENT": dead})
        assert r.returncode == 1 and "cannot reach the agent" in r.stderr and dead in r.stderr
        # --token-file beats $DSCTL_TOKEN, which beats --data-dir
        r = run(*base, "--agent", agent.url, "--token-file", str(tfile),
                env={"DSCTL_TOKEN": "wrong"})
        assert r.returncode == 0, r.stderr
        r = run(*base, "--agent", agent.url, "--token-file", str(wrong),
                env={"DSCTL_TOKEN": token})
        assert r.returncode == 1 and str(wrong) in r.stderr
        r = run(*base, "--agent", agent.url, "--data-dir", str(tmp_path / "nowhere"),
                env={"DSCTL_TOKEN": token})
        assert r.returncode == 0, r.stderr
        r = run(*base, "--agent", agent.url, "--data-dir", str(agent.data_dir),
                env={"DSCTL_TOKEN": "wrong"})
        assert r.returncode == 1 and "$DSCTL_TOKEN" in r.stderr
        # with neither, admin.token of --data-dir (flag or $DSCTL_DATA_DIR)
        r = run(*base, "--agent", agent.url, "--data-dir", str(agent.data_dir))
        assert r.returncode == 0, r.stderr
        r = run(*base, "--agent", agent.url, env={"DSCTL_DATA_DIR": str(agent.data_dir)})
        assert r.returncode == 0, r.stderr
        # global flags after the subcommand work too
        r = run(binary("dsctl"), "keys", "list", "--agent", agent.url, "--token-file",
                str(tfile), "--json")
        assert r.returncode == 0 and json.loads(r.stdout) == {"data": []}
    finally:
        agent.stop()


def test_agent_refuses_readable_secrets(tmp_path):
    agent = start_agent(tmp_path)
    agent.stop()
    data = agent.data_dir
    for name in ("admin.token", "keys.secret"):
        os.chmod(data / name, 0o644)
        r = run(binary("dsagent"), "--control-port", "0", "--api-port", "0", "--backend", "cpu",
                "--data-dir", str(data))
        assert r.returncode == 1, r.stderr
        assert str(data / name) in r.stderr and "chmod 600" in r.stderr
        os.chmod(data / name, 0o600)

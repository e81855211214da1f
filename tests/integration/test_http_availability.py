"""A peer with no credentials cannot take an HTTP port of dsagent offline
(agent/api/http.c; docs/serving.md, "Timeouts and limits of the HTTP
servers"), and a client that half-closes its socket still gets its answer.

- 1,000 slow connections (half a request header, one more byte a second) on
  the API port, and on the control port: a normal client from the same
  address is served within 1 s (the API's routes, dsctl-like admin requests,
  dsctl itself); libmicrohttpd prints no raw lines of its own;
- 100 stalled unauthenticated 2 MiB POSTs: each gets its 401 while its body
  is still incomplete, and the agent's RSS grows by a few MiB, not 200; the
  control API's admin token and cluster credential are checked the same way;
- the per-address limit (default 256): the 257th connection of an address
  whose connections are all busy uploading is refused, another address is
  served; the body budget (--http-max-body-total-mb): 503 + Retry-After
  before the body is read, served again once the budget is free;
- the header deadline (default 10 s) closes a trickling connection with a
  408; the keep-alive timeout (default 5 s) closes an idle connection;
- a request followed by shutdown(SHUT_WR) gets its whole answer, streamed or
  not.

Agents start through conftest.start_agent with the default model
(models/default.gguf: skipped when it is missing); source addresses of the
test's sockets are other loopback addresses (127.0.0.0/8).  The test raises
its own descriptor limit to the hard one (1,000 sockets must fit).
"""
import http.client
import json
import re
import resource
import select
import socket
import subprocess
import threading
import time

import pytest

from conftest import ROOT, binary, start_agent

MODEL = ROOT / "models" / "default.gguf"
pytestmark = pytest.mark.skipif(not MODEL.exists(),
                                reason="models/default.gguf is missing (`make model`)")

N_SLOW = 1000
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z level=\w+ mod=")


@pytest.fixture(autouse=True, scope="module")
def _nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < N_SLOW + 500:
        pytest.skip(f"the hard descriptor limit ({hard}) is below {N_SLOW + 500}")
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def agent_serving(tmp_path, *args):
    a = start_agent(tmp_path, "--threads", "2", *args)
    a.wait_serving(60)
    return a


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def raw_lines(agent):
    """Lines of the agent's stderr that are not records of its log."""
    return [ln for ln in agent.log().splitlines() if ln.strip() and not LOG_LINE.match(ln)]


def connect(port, src="127.0.0.1", timeout=10):
    return socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                    source_address=(src, 0))


def try_send(s, data):
    try:
        s.sendall(data)
        return True
    except OSError:
        return False


def read_until_closed(s, timeout):
    """Everything the peer sends until it closes (or timeout s pass):
    (bytes, closed)."""
    s.settimeout(0.2)
    got, end = b"", time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            b = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return got, True
        if not b:
            return got, True
        got += b
    return got, False


class Slow:
    """n connections from src that send half a request header and then one
    more header byte each every second (a thread), never finishing it."""

    def __init__(self, port, n, src="127.0.0.1"):
        self.socks = []
        for _ in range(n):
            s = connect(port, src)
            try_send(s, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            s.setblocking(False)
            self.socks.append(s)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _trickle(self):
        while not self.stop.wait(1.0):
            for s in self.socks:
                try:
                    s.send(b"a")
                except OSError:
                    pass

    def close(self):
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()


def timed(port, method, path, body=None, headers=None, src="127.0.0.1"):
    """(status, parsed body, seconds) of one request on a new connection."""
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(src, 0))
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        data = r.read()
    finally:
        c.close()
    took = time.monotonic() - t0
    try:
        return r.status, json.loads(data), took
    except ValueError:
        return r.status, data, took


def dsctl(agent, *args, timeout=30):
    return subprocess.run([binary("dsctl"), "--agent", agent.url, "--data-dir",
                           str(agent.data_dir), *args],
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------- slow connections --

def test_api_serves_a_client_while_1000_slow_connections_are_open(tmp_path):
    a = agent_serving(tmp_path)
    try:
        r = dsctl(a, "keys", "create", "bench", "--json")
        assert r.returncode == 0, r.stderr
        key = json.loads(r.stdout)["key"]
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        slow = Slow(a.api_port, N_SLOW)
        try:
            time.sleep(2.5)  # two trickle rounds: every slow connection is in
            for _ in range(3):
                st, doc, took = timed(a.api_port, "GET", "/health")
                assert st == 200 and took < 1.0, (st, doc, took)
                st, doc, took = timed(a.api_port, "GET", "/v1/models")
                assert st == 200 and doc["data"][0]["id"] == "default" and took < 1.0, \
                    (st, took)
                st, doc, took = timed(a.api_port, "POST", "/tokenize",
                                      json.dumps({"prompt": "Hello there"}), auth)
                assert st == 200 and doc["count"] > 0 and took < 1.0, (st, doc, took)
                time.sleep(0.5)
            st, doc, _ = timed(a.api_port, "POST", "/v1/completions",
                               json.dumps({"prompt": "Hi", "max_tokens": 2}), auth)
            assert st == 200 and doc["usage"]["completion_tokens"] == 2, doc
        finally:
            slow.close()
        assert a.alive()
        assert "connections closed to make room" in a.log()
        assert raw_lines(a) == [], raw_lines(a)[:5]
    finally:
        a.stop()


def test_control_serves_dsctl_while_1000_slow_connections_are_open(tmp_path):
    a = agent_serving(tmp_path)
    try:
        admin = {"Authorization": f"Bearer {a.token()}", "Content-Type": "application/json"}
        slow = Slow(a.control_port, N_SLOW)
        try:
            time.sleep(2.5)
            for i in range(3):
                st, doc, took = timed(a.control_port, "GET", "/health")
                assert st == 200 and took < 1.0, (st, doc, took)
                st, doc, took = timed(a.control_port, "POST", "/v1/keys",
                                      json.dumps({"name": f"k{i}"}), admin)
                assert st == 201 and doc["key"].startswith("dsk-") and took < 1.0, \
                    (st, doc, took)
                st, doc, took = timed(a.control_port, "GET", "/v1/keys", headers=admin)
                assert st == 200 and len(doc["data"]) == i + 1 and took < 1.0, (st, took)
                time.sleep(0.5)
            r = dsctl(a, "keys", "list")
            assert r.returncode == 0 and "k2" in r.stdout, r.stderr
        finally:
            slow.close()
        assert a.alive()
        assert raw_lines(a) == [], raw_lines(a)[:5]
    finally:
        a.stop()


# ------------------------------------------- bodies: auth first, a budget --

def test_stalled_unauthenticated_posts_get_401_before_their_body(tmp_path):
    a = agent_serving(tmp_path)  # auth on, no key: every POST is refused
    n, size, sent_first = 100, 2 << 20, 64 << 10
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size)
    socks = []
    try:
        time.sleep(0.5)
        before = rss_kib(a.pid)
        for _ in range(n):
            s = connect(a.api_port)
            try_send(s, head + b" " * sent_first)
            socks.append(s)
        # every one is answered while its body is still incomplete
        answers = {s: b"" for s in socks}
        end = time.monotonic() + 10
        while time.monotonic() < end and any(b"\r\n\r\n" not in v for v in answers.values()):
            ready, _, _ = select.select([s for s, v in answers.items()
                                         if b"\r\n\r\n" not in v], [], [], 0.2)
            for s in ready:
                try:
                    answers[s] += s.recv(65536)
                except OSError:
                    answers[s] += b"\r\n\r\n(reset)"
        statuses = [v.split(b"\r\n", 1)[0] for v in answers.values()]
        assert all(st.startswith(b"HTTP/1.1 401") for st in statuses), statuses[:3]
        # the rest of each body (the server no longer reads: errors are expected)
        for s in socks:
            s.settimeout(0.5)
            try_send(s, b" " * (size - sent_first - 1))
        time.sleep(0.5)
        grown = (rss_kib(a.pid) - before) / 1024
        assert grown < 32, f"RSS grew by {grown:.0f} MiB for {n} stalled unauthenticated posts"
        assert a.alive()
    finally:
        for s in socks:
            s.close()
        a.stop()


@pytest.mark.parametrize("path,auth,code", [
    ("/v1/keys", None, b"missing_admin_token"),
    ("/v1/keys", "Bearer not-the-token", b"invalid_admin_token"),
    ("/v1/ranks", "Bearer not-the-token", b"invalid_admin_token"),
    ("/v1/ranks", "DSCluster " + "0" * 32 + ".1.0000000000000000." + "0" * 64,
     b"no_cluster_key"),
], ids=["keys-no-token", "keys-bad-token", "ranks-bad-token", "ranks-cluster-cred"])
def test_control_refuses_before_the_body(tmp_path, path, auth, code):
    a = agent_serving(tmp_path)
    try:
        s = connect(a.control_port)
        s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  % path.encode() + (b"Authorization: %s\r\n" % auth.encode() if auth else b"")
                  + b"Content-Length: 900000\r\n\r\n{")
        got, closed = read_until_closed(s, 5)
        s.close()
        assert got.startswith(b"HTTP/1.1 401") and code in got and closed, got[:300]
    finally:
        a.stop()


def test_cluster_credential_form_and_time_before_the_body(tmp_path):
    """With a cluster key, a DSCluster credential's MAC covers the body: its
    form and time are checked before the body, the MAC after it."""
    key = tmp_path / "cluster.key"
    r = subprocess.run([binary("dsctl"), "cluster", "init", "--key-file", str(key)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    a = agent_serving(tmp_path, "--model", str(MODEL), "--cluster-key", str(key),
                      "--gossip-bind", "127.0.0.1", "--gossip-port", "0")
    try:
        def post(cred, body):
            s = connect(a.control_port)
            s.sendall(b"POST /v1/ranks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                      b"application/json\r\nAuthorization: DSCluster %s\r\n"
                      b"Content-Length: 1000\r\n\r\n" % cred + body)
            got, _ = read_until_closed(s, 3)
            s.close()
            return got
        stale = b"0" * 32 + b".1000.0000000000000000." + b"0" * 64
        got = post(stale, b"{")
        assert got.startswith(b"HTTP/1.1 401") and b"clock" in got, got[:300]
        now = b"%d" % int(time.time() * 1000)
        forged = b"0" * 32 + b"." + now + b".0000000000000000." + b"0" * 64
        assert post(forged, b"{") == b""  # well formed and on time: its body is awaited
        got = post(forged, b"{" + b" " * 998 + b"}")
        assert got.startswith(b"HTTP/1.1 401") and b"does not verify" in got, got[:300]
    finally:
        a.stop()


def test_body_budget_503_before_the_body_then_served(tmp_path):
    a = agent_serving(tmp_path, "--insecure-no-auth", "--http-max-body-total-mb", "1")
    size = 600 << 10
    head = (b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size)
    try:
        first = connect(a.api_port)
        first.sendall(head + b" " * 1000)  # holds 600 KiB of the 1 MiB budget
        time.sleep(0.3)
        second = connect(a.api_port)
        second.sendall(head)
        got, closed = read_until_closed(second, 5)
        assert got.startswith(b"HTTP/1.1 503") and closed, got[:200]
        assert b"retry-after: 1" in got.lower() and b"server_busy" in got
        second.close()
        first.close()  # its reservation goes with it
        time.sleep(0.3)
        body = json.dumps({"prompt": "x" * (size - 100)})
        st, doc, _ = timed(a.api_port, "POST", "/tokenize", body,
                           {"Content-Type": "application/json"})
        assert st == 200 and doc["count"] > 0, (st, doc)
    finally:
        a.stop()


# --------------------------------------------------------- per-address limit --

def test_per_address_limit_refuses_the_257th_busy_connection(tmp_path):
    a = agent_serving(tmp_path, "--insecure-no-auth")
    busy = []
    try:
        head = (b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        for _ in range(256):  # each one is uploading its body: nothing to evict
            s = connect(a.api_port, "127.0.0.3")
            s.sendall(head)
            busy.append(s)
        time.sleep(1.0)
        extra = connect(a.api_port, "127.0.0.3")
        try_send(extra, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        got, closed = read_until_closed(extra, 5)
        extra.close()
        assert closed and got == b"", got[:200]
        st, _, took = timed(a.api_port, "GET", "/health", src="127.0.0.4")
        assert st == 200 and took < 1.0
        for s in busy[:8]:  # finished uploads free their slots
            s.sendall(b"}" + b" " * 98)
        for s in busy[:8]:
            got, _ = read_until_closed(s, 0.5)
            assert got.startswith(b"HTTP/1.1 400"), got[:100]  # "{}" has no prompt
        st, _, _ = timed(a.api_port, "GET", "/health", src="127.0.0.3")
        assert st == 200
        assert "their address is at its connection limit" in a.log()
    finally:
        for s in busy:
            s.close()
        a.stop()


# ------------------------------------------------------------- deadlines --

def test_header_deadline_closes_a_trickling_connection(tmp_path):
    a = agent_serving(tmp_path)
    try:
        s = connect(a.api_port)
        t0 = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        s.setblocking(False)
        got, closed_at = b"", None
        while time.monotonic() - t0 < 16:
            try:
                s.send(b"a")
            except OSError:
                pass
            r, _, _ = select.select([s], [], [], 0.5)
            if r:
                try:
                    b = s.recv(65536)
                except ConnectionResetError:
                    b = b""
                got += b
                if not b:
                    closed_at = time.monotonic() - t0
                    break
        s.close()
        assert closed_at is not None, "the trickling connection was still open after 16 s"
        assert 9.0 <= closed_at <= 14.0, closed_at
        assert got.startswith(b"HTTP/1.1 408") and b"request_timeout" in got, got[:200]
        # a client that sends its headers in time is served
        st, _, _ = timed(a.api_port, "GET", "/health")
        assert st == 200
    finally:
        a.stop()


def test_keepalive_timeout_closes_an_idle_connection(tmp_path):
    a = agent_serving(tmp_path)
    try:
        s = connect(a.api_port)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        t0 = time.monotonic()
        got = b""
        while b'{"status":"ok"}' not in got:
            b = s.recv(4096)
            assert b, got
            got += b
        rest, closed = read_until_closed(s, 10)
        took = time.monotonic() - t0
        s.close()
        assert closed and rest == b"", "an idle keep-alive connection stayed open 10 s"
        assert 4.0 <= took <= 8.0, took
    finally:
        a.stop()


# ------------------------------------------------------------ half-close --

def half_closed_request(port, body):
    s = connect(port, timeout=60)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    s.shutdown(socket.SHUT_WR)
    got, closed = read_until_closed(s, 60)
    s.close()
    assert closed, got[:300]
    # interim 1xx answers may come first; the last status line is the answer
    while re.match(rb"HTTP/1\.1 1\d\d ", got):
        got = got.split(b"\r\n\r\n", 1)[1]
    head, _, payload = got.partition(b"\r\n\r\n")
    return head, payload


def test_half_closed_client_gets_its_whole_answer(tmp_path):
    a = agent_serving(tmp_path, "--insecure-no-auth")
    try:
        head, payload = half_closed_request(a.api_port, {
            "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True})
        assert head.startswith(b"HTTP/1.1 200"), head
        doc = json.loads(payload)
        assert doc["usage"]["completion_tokens"] == 24
        assert doc["choices"][0]["finish_reason"] == "length"
    finally:
        a.stop()


def dechunk(payload):
    """The body of a chunked transfer."""
    out = b""
    while payload:
        size, _, payload = payload.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            break
        out, payload = out + payload[:n], payload[n + 2:]
    return out


def test_half_closed_client_gets_its_whole_stream(tmp_path):
    a = agent_serving(tmp_path, "--insecure-no-auth")
    try:
        # two choices: the reader polls the socket between engine steps (10 ms
        # waits), so the client's FIN is seen while tokens still come
        head, payload = half_closed_request(a.api_port, {
            "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}})
        assert head.startswith(b"HTTP/1.1 200"), head
        events = re.findall(rb"data: (.*?)\n\n", dechunk(payload))
        assert events and events[-1] == b"[DONE]", payload[-300:]
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 48
        finished = {c["index"]: c["finish_reason"] for e in events[:-2]
                    for c in json.loads(e)["choices"] if c["finish_reason"]}
        assert finished == {0: "length", 1: "length"}
    finally:
        a.stop()

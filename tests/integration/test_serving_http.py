"""The OpenAI API of dsagent over raw HTTP (sockets and http.client only):
what a byte-exact client, a hostile client and a monitoring system see.

- SSE framing of chat and completions streams, byte for byte: chunked
  transfer with a valid chunk framing, text/event-stream, every event exactly
  `data: ` + compact one-line JSON + a blank line, `data: [DONE]` last; the
  same id/created/model in every chunk, the role chunk first (per choice),
  finish_reason null until the last chunk of a choice, the usage chunk
  (choices []) only with stream_options.include_usage;
- bad input: malformed JSON, 10 MB bodies, 1,000-deep nesting, invalid UTF-8,
  wrong Content-Type, header injection, huge headers, unknown routes and
  methods, unknown models, context overflow: the right 4xx in the nested
  error shape, and after every one the server still answers /health 200;
- X-Request-Id passthrough, /health, /v1/models, /metrics (vLLM names, counters
  that move by exactly a request's tokens), /tokenize + /detokenize;
- a client that disconnects mid-generation frees its slot and KV pages
  within 2 s;
- API keys: 401 in the OpenAI shape without a key, exempt routes stay open.

Each server runs from its own temporary data directory on loopback with
--api-port 0; stdout/stderr go to files (a pipe nobody reads would stall the
server's logging)."""
import http.client
import json
import re
import signal
import socket
import subprocess
import time

import pytest

from conftest import ROOT, binary
from tests.fixtures.agent import AgentProcess

MODEL = ROOT / "models" / "default.gguf"


# ---------------------------------------------------------------- servers --

class Server:
    """A dsagent on 127.0.0.1 with ephemeral ports; .api_port, .control_port,
    .model (served name), .proc, .data_dir."""

    def __init__(self, tmp, *args):
        assert MODEL.exists(), "models/default.gguf is missing: `make model` fetches it"
        tmp.mkdir(parents=True, exist_ok=True)
        self.data_dir = tmp / "data"
        self.data_dir.mkdir(exist_ok=True)
        cmd = ["--bind", "127.0.0.1", "--control-port", "0",
               "--api-port", "0", "--data-dir", str(self.data_dir), "--backend", "cpu",
               "--threads", "2", "--model", str(MODEL), *args]
        self.agent = AgentProcess(binary("dsagent"), cmd, log_dir=tmp)
        self.proc, self.out_path, self.err_path = self.agent.proc, self.agent.out_path, self.agent.err_path
        try:
            self.agent.wait_listening(60)
            self.model = self.agent.wait_serving(60)
        except RuntimeError:
            self.agent.stop(signal.SIGKILL)
            raise
        self.control_port, self.api_port = self.agent.control_port, self.agent.api_port

    @property
    def pid(self):
        return self.proc.pid

    def stop(self, timeout=20):
        """SIGTERM; returns the exit status (killed after timeout)."""
        return self.agent.stop(signal.SIGTERM, timeout)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serving-http"), "--insecure-no-auth")
    yield s
    rc = s.stop()
    assert rc == 0, f"dsagent exited with {rc}: {s.err_path.read_text()[-2000:]}"


# ------------------------------------------------------------ HTTP helpers --

def call(srv, method, path, body=None, headers=None, conn=None, timeout=120):
    """One request with http.client; returns (status, headers {lower: value},
    raw body bytes, parsed JSON or None)."""
    headers = dict(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    c = conn or http.client.HTTPConnection("127.0.0.1", srv.api_port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=headers)
        r = c.getresponse()
        data = r.read()
        hdrs = {k.lower(): v for k, v in r.getheaders()}
        status = r.status
    finally:
        if conn is None:
            c.close()
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    return status, hdrs, data, doc


def alive(srv):
    """The server still runs and answers /health 200 on a fresh connection."""
    assert srv.proc.poll() is None, f"dsagent died: {srv.err_path.read_text()[-2000:]}"
    status, _, data, doc = call(srv, "GET", "/health", timeout=10)
    assert status == 200 and doc == {"status": "ok"}, (status, data)


def read_all(sock):
    out = bytearray()
    while True:
        b = sock.recv(65536)
        if not b:
            return bytes(out)
        out += b


def dechunk(body):
    """Strict chunked-transfer decoder: every chunk is HEX CRLF data CRLF,
    the last one 0 CRLF CRLF with nothing after; returns (data, chunk sizes)."""
    out, sizes, pos = bytearray(), [], 0
    while True:
        eol = body.find(b"\r\n", pos)
        assert eol > pos, f"bad chunk-size line at byte {pos}: {body[pos:pos + 40]!r}"
        size_text = body[pos:eol]
        assert re.fullmatch(rb"[0-9a-fA-F]+", size_text), f"chunk size {size_text!r}"
        size = int(size_text, 16)
        pos = eol + 2
        if size == 0:
            assert body[pos:] == b"\r\n", f"after the last chunk: {body[pos:pos + 40]!r}"
            return bytes(out), sizes
        out += body[pos:pos + size]
        sizes.append(size)
        pos += size
        assert body[pos:pos + 2] == b"\r\n", f"chunk of {size} bytes not followed by CRLF"
        pos += 2


def parse_response(raw):
    """(status, [(name, value)] as str, body bytes, chunked?) of a whole HTTP/1.1 response."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep, f"no end of headers in {raw[:200]!r}"
    lines = head.split(b"\r\n")
    m = re.match(rb"HTTP/1\.[01] (\d{3}) ", lines[0] + b" ")
    assert m, f"status line {lines[0]!r}"
    headers = []
    for line in lines[1:]:
        assert b"\n" not in line and b"\r" not in line and b"\0" not in line, line
        name, colon, value = line.partition(b":")
        assert colon and re.fullmatch(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name), \
            f"malformed response header line {line!r}"
        headers.append((name.decode("latin-1"), value.strip().decode("latin-1")))
    hmap = {n.lower(): v for n, v in headers}
    chunked = hmap.get("transfer-encoding", "").lower() == "chunked"
    if chunked:
        body, _ = dechunk(body)
    elif "content-length" in hmap:
        assert len(body) == int(hmap["content-length"]), "body length != Content-Length"
    return int(m.group(1)), headers, body, chunked


def raw_request(srv, data, timeout=60):
    """Sends the bytes of one request (which should say Connection: close) and
    reads the whole response until the server closes."""
    with socket.create_connection(("127.0.0.1", srv.api_port), timeout=timeout) as s:
        s.sendall(data)
        return read_all(s)


def build_request(srv, method, path, body=b"", headers=(), content_type=b"application/json"):
    """Request bytes with Host, Content-Type (unless None), Content-Length and
    Connection: close; headers are raw (name, value) byte pairs sent as given."""
    if isinstance(path, str):
        path = path.encode()
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    h = b"%s %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % (method.encode(), path, srv.api_port)
    if content_type is not None:
        h += b"Content-Type: " + content_type + b"\r\n"
    for name, value in headers:
        h += name + b": " + value + b"\r\n"
    if body or method == "POST":
        h += b"Content-Length: %d\r\n" % len(body)
    return h + b"Connection: close\r\n\r\n" + body


def assert_error(status, doc, want_status, typ=None, code=None, param=...):
    """The nested OpenAI error shape with the expected status."""
    assert status == want_status, (status, doc)
    assert isinstance(doc, dict) and list(doc) == ["error"], doc
    e = doc["error"]
    assert {"message", "type", "param", "code"} <= set(e), e
    assert isinstance(e["message"], str) and e["message"], e
    assert isinstance(e["type"], str) and e["type"], e
    assert e["param"] is None or isinstance(e["param"], str), e
    assert e["code"] is None or isinstance(e["code"], str), e
    if typ is not None:
        assert e["type"] == typ, e
    if code is not None:
        assert e["code"] == code, e
    if param is not ...:
        assert e["param"] == param, e
    return e


# ------------------------------------------------------------ SSE helpers --

_UESC = re.compile(r"\\u([0-9A-Fa-f]{4})")


def check_compact(payload):
    """payload (bytes after `data: `) is one line of compact JSON: it equals
    Python's separators=(",", ":"), ensure_ascii=False dump of itself (hex
    digits of \\u escapes compared case-insensitively)."""
    assert b"\n" not in payload and b"\r" not in payload, payload
    text = payload.decode("utf-8")  # strict: invalid UTF-8 raises
    obj = json.loads(text)
    canon = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    norm = _UESC.sub(lambda m: "\\u" + m.group(1).lower(), text)
    assert norm == canon, f"not compact JSON:\n{text}\n{canon}"
    return obj


def sse_events(body):
    """Splits an SSE body into payloads, asserting the exact framing:
    `data: X\\n\\n` repeated, `data: [DONE]\\n\\n` last, nothing else."""
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    parts = body.split(b"\n\n")
    assert parts[-1] == b"", "bytes after the last blank line"
    events = []
    for p in parts[:-1]:
        assert p.startswith(b"data: "), f"event without the 'data: ' prefix: {p[:80]!r}"
        assert b"\n" not in p, f"multi-line event: {p[:120]!r}"
        events.append(p[len(b"data: "):])
    assert events[-1] == b"[DONE]" and b"[DONE]" not in events[:-1]
    return [check_compact(e) for e in events[:-1]]


def stream(srv, path, body, headers=()):
    """A streaming request over a raw socket: (status, headers, chunk sizes,
    parsed events).  The chunked framing is checked strictly."""
    raw = raw_request(srv, build_request(srv, "POST", path, body, headers))
    status, hdrs, _, chunked = parse_response(raw)
    assert status == 200, raw[:500]
    assert chunked, f"stream without chunked transfer: {hdrs}"
    hmap = {n.lower(): v for n, v in hdrs}
    assert "content-length" not in hmap
    assert hmap["content-type"].split(";")[0].strip() == "text/event-stream", hmap
    body_bytes, sizes = dechunk(raw.partition(b"\r\n\r\n")[2])
    return hmap, sizes, sse_events(body_bytes)


def check_stream(events, chat, n, max_tokens, include_usage):
    """The chunk invariants of C5-C9; returns (text per choice, usage or None)."""
    assert events, "no events before [DONE]"
    first = events[0]
    obj = "chat.completion.chunk" if chat else "text_completion"
    prefix = "chatcmpl-" if chat else "cmpl-"
    assert first["id"].startswith(prefix) and first["object"] == obj, first
    assert isinstance(first["created"], int) and abs(first["created"] - time.time()) < 600
    for ev in events:
        assert "error" not in ev, ev
        for k in ("id", "object", "created", "model"):
            assert ev[k] == first[k], (k, ev, first)
    usage_events = [i for i, ev in enumerate(events) if ev.get("usage") is not None]
    choice_events = [ev for ev in events if ev["choices"]]
    texts, seen, finished = [""] * n, [0] * n, [None] * n
    for ev in choice_events:
        for ch in ev["choices"]:
            i = ch["index"]
            assert 0 <= i < n, ch
            assert finished[i] is None, f"chunk for choice {i} after its finish: {ch}"
            assert "logprobs" in ch and ch["logprobs"] is None, ch
            assert "finish_reason" in ch, ch
            if chat:
                d = ch["delta"]
                if seen[i] == 0:  # C7: the role chunk first
                    assert d == {"role": "assistant", "content": ""}, ch
                else:
                    assert "role" not in d, ch
                    assert set(d) <= {"content", "reasoning_content"}, ch
                texts[i] += d.get("content", "")
            else:
                assert isinstance(ch["text"], str), ch
                texts[i] += ch["text"]
            seen[i] += 1
            if ch["finish_reason"] is not None:  # C8
                assert ch["finish_reason"] in ("stop", "length"), ch
                finished[i] = ch["finish_reason"]
    assert all(f is not None for f in finished), f"choices without a finish chunk: {finished}"
    if include_usage:  # C9
        assert usage_events == [len(events) - 1], "the usage chunk must be last, once"
        u = events[-1]
        assert u["choices"] == [], u
        usage = u["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if max_tokens is not None:
            assert usage["completion_tokens"] == n * max_tokens, usage
            assert finished == ["length"] * n
        return texts, usage
    assert usage_events == [], "usage chunk without stream_options.include_usage"
    assert all(ev["choices"] for ev in events), "a chunk with empty choices"
    return texts, None


CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


# ================================================================== tests ==

def test_health_and_models(srv):
    status, hdrs, _, doc = call(srv, "GET", "/health")
    assert status == 200 and doc == {"status": "ok"}
    assert hdrs["content-type"].startswith("application/json")
    status, _, _, doc = call(srv, "GET", "/v1/models")
    assert status == 200 and doc["object"] == "list" and doc["data"], doc
    for m in doc["data"]:
        assert m["object"] == "model" and isinstance(m["id"], str) and m["id"]
        assert isinstance(m["created"], int) and isinstance(m["owned_by"], str), m
    assert doc["data"][0]["id"] == srv.model


@pytest.mark.parametrize("chat,n,usage_opt", [
    (True, 1, True), (True, 2, False), (True, 1, None),
    (False, 2, True), (False, 1, None),
], ids=["chat-usage", "chat-n2-nousage", "chat-noopts", "cmpl-n2-usage", "cmpl-noopts"])
def test_sse_framing(srv, chat, n, usage_opt):
    max_tokens = 10
    body = {"model": srv.model, "stream": True, "max_tokens": max_tokens, "n": n,
            "temperature": 0 if n == 1 else 0.8, "seed": 11, "ignore_eos": True}
    if chat:
        body["messages"] = CHAT
    else:
        body["prompt"] = "The three primary colours are"
    if usage_opt is not None:
        body["stream_options"] = {"include_usage": usage_opt}
    rid = f"sse-test-{int(chat)}-{n}-{usage_opt}"
    hmap, sizes, events = stream(srv, "/v1/chat/completions" if chat else "/v1/completions",
                                 body, headers=[(b"X-Request-Id", rid.encode())])
    assert hmap.get("x-request-id") == rid
    texts, usage = check_stream(events, chat, n, max_tokens, bool(usage_opt))
    assert all(t for t in texts), texts
    assert events[0]["model"] == srv.model
    assert len(sizes) >= 2  # streamed in pieces, not one buffered body
    if n == 1 and body["temperature"] == 0:
        # greedy stream == greedy non-stream, and the usage agrees
        body2 = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        status, _, _, doc = call(srv, "POST", "/v1/chat/completions" if chat else "/v1/completions",
                                 body2)
        assert status == 200, doc
        whole = doc["choices"][0]["message"]["content"] if chat else doc["choices"][0]["text"]
        assert whole == texts[0]
        assert doc["usage"]["completion_tokens"] == max_tokens
        if usage:
            assert usage == {k: doc["usage"][k] for k in usage}
    alive(srv)


def test_keepalive_connection_serves_many(srv):
    """Non-stream, stream and error responses on one keep-alive connection."""
    c = http.client.HTTPConnection("127.0.0.1", srv.api_port, timeout=60)
    try:
        for i in range(2):
            status, _, _, doc = call(srv, "POST", "/v1/completions",
                                     {"prompt": "Hello", "max_tokens": 3}, conn=c)
            assert status == 200 and doc["usage"]["completion_tokens"] <= 3
            status, _, data, _ = call(srv, "POST", "/v1/completions",
                                      {"prompt": "Hello", "max_tokens": 3, "stream": True}, conn=c)
            assert status == 200 and data.endswith(b"data: [DONE]\n\n")
            status, _, _, doc = call(srv, "POST", "/v1/completions", b"{nope", conn=c,
                                     headers={"Content-Type": "application/json"})
            assert_error(status, doc, 400, "invalid_request_error")
    finally:
        c.close()
    alive(srv)


def test_chunked_request_body(srv):
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    c = http.client.HTTPConnection("127.0.0.1", srv.api_port, timeout=60)
    try:
        c.request("POST", "/v1/completions", body=iter([body[:7], body[7:]]),
                  headers={"Content-Type": "application/json"}, encode_chunked=True)
        r = c.getresponse()
        doc = json.loads(r.read())
    finally:
        c.close()
    assert r.status == 200 and doc["object"] == "text_completion", doc
    alive(srv)


@pytest.mark.parametrize("body", [
    b"{", b'{"prompt": "x",}', b'{"prompt": \'x\'}', b"", b" ", b"nul", b"[]", b'"x"', b"42",
    b'{"prompt":"a"} trailing', b'\xef\xbb\xbf{"prompt":"a"}', b'{"prompt":"a", "max_tokens": NaN}',
], ids=lambda b: repr(b)[:24])
def test_malformed_json_400(srv, body):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        status, _, _, doc = call(srv, "POST", path, body,
                                 headers={"Content-Type": "application/json"})
        assert_error(status, doc, 400, "invalid_request_error", "invalid_json")
        alive(srv)


def test_10mb_body_413_and_server_keeps_serving(srv):
    body = b'{"prompt":"' + b"a" * (10 << 20) + b'"}'
    c = http.client.HTTPConnection("127.0.0.1", srv.api_port, timeout=60)
    try:
        status, _, _, doc = call(srv, "POST", "/v1/completions", body, conn=c,
                                 headers={"Content-Type": "application/json"})
        assert_error(status, doc, 413, "invalid_request_error")
        # the upload was drained: the same connection still works
        status, _, _, doc = call(srv, "GET", "/health", conn=c)
        assert status == 200 and doc == {"status": "ok"}
    finally:
        c.close()
    alive(srv)
    status, _, _, doc = call(srv, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200, doc


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deep_nesting_400(srv, depth):
    for body in ("[" * depth + "]" * depth,
                 '{"a":' * depth + "1" + "}" * depth,
                 '{"prompt":"x","m":' + '[{"a":' * (depth // 2) + "1" + "}]" * (depth // 2) + "}"):
        status, _, _, doc = call(srv, "POST", "/v1/chat/completions", body.encode(),
                                 headers={"Content-Type": "application/json"})
        assert_error(status, doc, 400, "invalid_request_error")
        alive(srv)


@pytest.mark.parametrize("bad", [
    b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\x80", b"\xf4\x90\x80\x80",
    b"\xf8\x88\x80\x80\x80", b"\\u0000", b"\\ud800",
], ids=lambda b: b.hex())
def test_invalid_utf8_400(srv, bad):
    for body in (b'{"prompt":"a' + bad + b'b","max_tokens":1}',
                 b'{"messages":[{"role":"user","content":"' + bad + b'"}],"max_tokens":1}',
                 b'{"prompt":"a","max_tokens":1,"x' + bad + b'":1}'):
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        status, _, _, doc = call(srv, "POST", path, body,
                                 headers={"Content-Type": "application/json"})
        assert_error(status, doc, 400, "invalid_request_error")
        alive(srv)


def test_content_type(srv):
    body = {"prompt": "Hi", "max_tokens": 1}
    for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
               "text/json"):
        status, _, _, doc = call(srv, "POST", "/v1/completions", json.dumps(body).encode(),
                                 headers={"Content-Type": ct})
        assert_error(status, doc, 415, "invalid_request_error")
        assert ct.split(";")[0] in doc["error"]["message"]
        alive(srv)
    for ct in ("application/json; charset=utf-8", "Application/JSON"):
        status, _, _, doc = call(srv, "POST", "/v1/completions", json.dumps(body).encode(),
                                 headers={"Content-Type": ct})
        assert status == 200, (ct, doc)


def test_error_messages_quoting_non_utf8_client_bytes(srv):
    body = b'{"prompt":"Hi","max_tokens":1}'
    failures = []
    # valid JSON whose quoted text gets cut inside a 2-byte character
    for path, doc, want in (("/v1/completions", {"model": "a" * 199 + "\u00e9", "prompt": "x"}, 404),
                            ("/v1/chat/completions",
                             {"messages": [{"role": "\u00e9" * 600, "content": "x"}]}, 400)):
        status, _, data, _ = call(srv, "POST", path, doc)
        if status != want:
            failures.append((path, status, data[:120]))
        alive(srv)
    for ct, want in ((b"text/\xff", 415), (b"x" * 63 + "é".encode(), 415)):
        raw = raw_request(srv, build_request(srv, "POST", "/v1/completions", body,
                                             content_type=ct))
        status, _, data, _ = parse_response(raw)
        if status != want:
            failures.append((ct, status, data[:120]))
        alive(srv)
    for path in (b"/\xff", b"/%ff", b"/v1/%c3"):
        raw = raw_request(srv, build_request(srv, "GET", path, content_type=None))
        status, _, data, _ = parse_response(raw)
        if status != 404:
            failures.append((path, status, data[:120]))
        alive(srv)
    assert not failures, failures


def test_bad_content_length_and_pipelining(srv):
    body = b'{"prompt":"Hi","max_tokens":1}'
    for cl in (b"-5", b"99999999999999999999", b"abc", b"1, 2", b"0x10"):
        req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + cl + b"\r\nConnection: close\r\n\r\n" + body)
        raw = raw_request(srv, req)
        # libmicrohttpd answers these itself (HTML body): only the status is ours to check
        m = re.match(rb"HTTP/1\.1 (\d{3}) ", raw)
        assert m and 400 <= int(m.group(1)) < 500, raw[:200]
        alive(srv)
    # two pipelined requests and a third that closes: three answers in order
    one = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
          b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    raw = raw_request(srv, one + one + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert raw.count(b"HTTP/1.1 200 OK\r\n") == 3 and raw.endswith(b'{"status":"ok"}'), raw[-300:]


def test_http10_stream_is_close_delimited(srv):
    body = json.dumps({"prompt": "Hi", "max_tokens": 4, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}).encode()
    raw = raw_request(srv, b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    status, headers, data, chunked = parse_response(raw)
    assert status == 200 and not chunked  # HTTP/1.0 has no chunked coding
    check_stream(sse_events(data), False, 1, 4, True)
    alive(srv)


def test_unknown_route_404_wrong_method_405(srv):
    for method, path in (("GET", "/v1/nope"), ("POST", "/v2/chat/completions"),
                         ("GET", "/v1/models/"), ("GET", "/v1"), ("GET", "/v1/chat/completions/x")):
        status, _, _, doc = call(srv, method, path)
        e = assert_error(status, doc, 404, code="not_found")
        assert path in e["message"]
        alive(srv)
    for method, path in (("GET", "/v1/chat/completions"), ("POST", "/v1/models"),
                         ("DELETE", "/health"), ("PUT", "/v1/completions"), ("GET", "/tokenize")):
        status, _, _, doc = call(srv, method, path)
        e = assert_error(status, doc, 405, code="method_not_allowed")
        assert method in e["message"]
        alive(srv)


def test_options_preflight_unauthenticated(srv):
    status, _, data, _ = call(srv, "OPTIONS", "/v1/chat/completions")
    assert status == 204 and data == b""
    alive(srv)


INJECTIONS = {
    "bare-cr": b"abc\rInjected: yes",
    "bare-lf": b"abc\nInjected: yes",
    "obs-fold": b"abc\r\n Injected: yes",
    "percent": b"abc%0d%0aInjected:%20yes",
    "nul": b"abc\x00Injected: yes",
    "u2028": "abc\u2028Injected: yes".encode(),
    "latin1-crlf": b"abc\xc4\x8d\xc4\x8aInjected: yes",
    "json-escape": b"abc\\r\\nInjected: yes",
    "long": b"r" * 5000,
}


@pytest.mark.parametrize("name", list(INJECTIONS))
def test_header_injection(srv, name):
    value = INJECTIONS[name]
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": True}),
                       ("/v1/nope", {})):
        raw = raw_request(srv, build_request(srv, "POST", path, body,
                                             headers=[(b"X-Request-Id", value)]))
        status, headers, data, _ = parse_response(raw)
        assert status < 500, (status, data[:300])
        names = [n.lower() for n, _ in headers]
        assert "injected" not in names, headers
        assert not any("injected" in v.lower() and n.lower() != "x-request-id"
                       for n, v in headers), headers
        rids = [v for n, v in headers if n.lower() == "x-request-id"]
        if status < 400 or path == "/v1/nope":
            assert len(rids) <= 1, headers
        for rid in rids:  # sane: visible ASCII, no spaces, bounded
            assert re.fullmatch(r"[\x21-\x7e]{1,128}", rid), rid
        alive(srv)


def test_huge_headers_4xx(srv):
    body = {"prompt": "Hi", "max_tokens": 1}
    for headers in ([(b"X-Junk", b"a" * 100_000)],
                    [(b"X-H%d" % i, b"v") for i in range(3000)],
                    [(b"Authorization", b"Bearer " + b"k" * 60_000)],
                    [(b"X-Request-Id", b"i" * 70_000)]):
        raw = raw_request(srv, build_request(srv, "POST", "/v1/completions", body,
                                             headers=headers))
        status, _, _, _ = parse_response(raw)
        assert 400 <= status < 500, status
        alive(srv)


def test_request_id_passthrough(srv):
    body = {"prompt": "Hi", "max_tokens": 1}
    for rid in ("bench-0123abcd-7", "A" * 128, "x.y_z:1/2@3"):
        status, hdrs, _, doc = call(srv, "POST", "/v1/completions", body,
                                    headers={"X-Request-Id": rid})
        assert status == 200 and hdrs["x-request-id"] == rid, hdrs
        assert rid in doc["id"]
        # error responses carry it too
        status, hdrs, _, doc = call(srv, "POST", "/v1/completions", {"prompt": 5},
                                    headers={"X-Request-Id": rid})
        assert status == 400 and hdrs["x-request-id"] == rid, hdrs
    for bad in ("A" * 129, "has space", "tab\there"):
        status, hdrs, _, doc = call(srv, "POST", "/v1/completions", body,
                                    headers={"X-Request-Id": bad})
        assert status == 200 and hdrs["x-request-id"] != bad, hdrs
        assert re.fullmatch(r"cmpl-[0-9a-f]{24}", hdrs["x-request-id"]), hdrs
        assert doc["id"] == hdrs["x-request-id"]
    # without one the server makes one, different each time
    ids = {call(srv, "POST", "/v1/chat/completions",
                {"messages": CHAT, "max_tokens": 1})[1]["x-request-id"] for _ in range(2)}
    assert len(ids) == 2 and all(re.fullmatch(r"chatcmpl-[0-9a-f]{24}", i) for i in ids), ids
    alive(srv)


def test_unknown_model_404(srv):
    for path, body in (("/v1/chat/completions", {"messages": CHAT}),
                       ("/v1/completions", {"prompt": "Hi"}), ("/tokenize", {"prompt": "Hi"})):
        for stream in (False, True):
            status, _, _, doc = call(srv, "POST", path,
                                     {**body, "model": "no-such-model", "stream": stream})
            e = assert_error(status, doc, 404, "not_found_error", "model_not_found", "model")
            assert "no-such-model" in e["message"]
            alive(srv)
    # a missing or null model is the default one
    status, _, _, doc = call(srv, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1,
                                                             "model": None})
    assert status == 200 and doc["model"] == srv.model


def n_tokens(srv, text):
    status, _, _, doc = call(srv, "POST", "/tokenize", {"prompt": text})
    assert status == 200, doc
    return doc["count"]


def test_context_overflow_400(srv):
    _, _, _, models = call(srv, "GET", "/v1/models")
    n_ctx = models["data"][0]["max_model_len"]
    long_text = " ".join(f"word{i} and" for i in range(n_ctx))  # well past n_ctx tokens
    n_long = n_tokens(srv, long_text)
    assert n_long > n_ctx
    cases = [("/v1/completions", {"prompt": long_text, "max_tokens": 4}, n_long),
             ("/v1/completions", {"prompt": "Hi there", "max_tokens": n_ctx},
              n_tokens(srv, "Hi there")),
             ("/v1/chat/completions",
              {"messages": [{"role": "user", "content": long_text}], "max_tokens": 4}, None),
             ("/v1/chat/completions", {"messages": CHAT, "max_tokens": n_ctx + 5}, None)]
    for path, body, n_prompt in cases:
        for stream in (False, True):
            status, _, _, doc = call(srv, "POST", path, {**body, "stream": stream})
            e = assert_error(status, doc, 400, "invalid_request_error", "context_length_exceeded")
            assert isinstance(e["n_prompt_tokens"], int) and e["n_ctx"] == n_ctx, e
            if n_prompt is not None:
                assert e["n_prompt_tokens"] == n_prompt, e
            nums = {int(x) for x in re.findall(r"\d+", e["message"])}
            assert n_ctx in nums and e["n_prompt_tokens"] in nums, e["message"]
            assert f"maximum context length is {n_ctx} tokens" in e["message"]
            alive(srv)


METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def metrics(srv):
    """{(name, labels text): value} of /metrics, plus the raw text."""
    status, hdrs, data, _ = call(srv, "GET", "/metrics", timeout=10)
    assert status == 200 and hdrs["content-type"].startswith("text/plain"), hdrs
    out, text = {}, data.decode()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = METRIC_LINE.match(line)
        assert m, f"bad exposition line {line!r}"
        out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out, text


def mval(ms, name, **labels):
    """Sum of the series of a metric whose labels include `labels`."""
    tot, found = 0.0, False
    for (n, lab), v in ms.items():
        if n == name and all(f'{k}="{val}"' in lab for k, val in labels.items()):
            tot, found = tot + v, True
    assert found, f"metric {name} {labels} not exported"
    return tot


def test_metrics(srv):
    assert wait_idle(srv, 30)[0] is not None, "server not idle before the test"
    time.sleep(0.2)  # the previous stream's bookkeeping runs after its last byte
    before, text = metrics(srv)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total"):
        assert f"# TYPE {name} " in text, name
        mval(before, name)
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds"):
        assert f"# TYPE vllm:{h} histogram" in text
        assert f'vllm:{h}_bucket{{le="+Inf"' in text
        assert mval(before, f"vllm:{h}_count") == mval(before, f"vllm:{h}_bucket", le="+Inf")
    assert f'model_name="{srv.model}"' in text
    status, _, _, doc = call(srv, "POST", "/v1/completions",
                             {"prompt": "Counting: one, two,", "max_tokens": 7,
                              "ignore_eos": True})
    assert status == 200
    after, _ = metrics(srv)
    d = lambda name, **kw: mval(after, name, **kw) - mval(before, name, **kw)  # noqa: E731
    assert d("vllm:prompt_tokens_total") == doc["usage"]["prompt_tokens"]
    assert d("vllm:generation_tokens_total") == doc["usage"]["completion_tokens"] == 7
    assert d("vllm:request_success_total", finished_reason="length") == 1
    assert d("vllm:time_to_first_token_seconds_count") == 1
    assert d("vllm:e2e_request_latency_seconds_count") == 1
    assert d("vllm:inter_token_latency_seconds_count") >= 1
    assert d("vllm:e2e_request_latency_seconds_sum") > 0
    assert mval(after, "vllm:num_requests_running") == 0
    assert mval(after, "vllm:kv_cache_usage_perc") == 0


def test_tokenize_detokenize_roundtrip(srv):
    texts = ["Hello, world!", "  leading and trailing spaces  ", "naïve café — déjà vu",
             "日本語のテキスト", "emoji 🌍🚀 and ZWJ 👩\u200d💻", "tabs\tand\nnewlines\r\n",
             "def f(x):\n    return x ** 2  # code", "1234567890 3.14159 -42"]
    for text in texts:
        status, _, _, doc = call(srv, "POST", "/tokenize",
                                 {"prompt": text, "add_special_tokens": False})
        assert status == 200 and doc["count"] == len(doc["tokens"]) > 0, doc
        assert all(isinstance(t, int) and t >= 0 for t in doc["tokens"])
        status, _, _, back = call(srv, "POST", "/detokenize", {"tokens": doc["tokens"]})
        assert status == 200 and back["prompt"] == text, (text, back)
    status, _, _, doc = call(srv, "POST", "/detokenize", {"tokens": [1, 10 ** 9]})
    assert_error(status, doc, 400, "invalid_request_error", param="tokens")
    alive(srv)
    status, _, _, doc = call(srv, "POST", "/detokenize", {"tokens": "1 2"})
    assert_error(status, doc, 400, "invalid_request_error", param="tokens")
    alive(srv)
    status, _, _, doc = call(srv, "POST", "/tokenize", {"prompt": 7})
    assert_error(status, doc, 400, "invalid_request_error", param="prompt")
    alive(srv)


def wait_idle(srv, timeout):
    """Polls /metrics until nothing runs and no KV page is used; returns
    (seconds waited, last metrics)."""
    t0 = time.time()
    while True:
        ms, _ = metrics(srv)
        if (mval(ms, "vllm:num_requests_running") == 0
                and mval(ms, "vllm:num_requests_waiting") == 0
                and mval(ms, "vllm:kv_cache_usage_perc") == 0):
            return time.time() - t0, ms
        if time.time() - t0 > timeout:
            return None, ms
        time.sleep(0.05)


def start_long_generation(srv, chat, stream, n_events=4):
    """Opens a socket with a 2000-token request and waits until it is running
    (n_events SSE events read for a stream); returns the socket."""
    body = {"max_tokens": 2000, "ignore_eos": True, "stream": stream, "temperature": 0.7}
    if chat:
        body["messages"] = [{"role": "user", "content": "Tell me a very long story."}]
    else:
        body["prompt"] = "Once upon a time"
    s = socket.create_connection(("127.0.0.1", srv.api_port), timeout=30)
    s.sendall(build_request(srv, "POST", "/v1/chat/completions" if chat else "/v1/completions",
                            body))
    if stream:
        got = b""
        while got.count(b"data: ") < n_events:
            b = s.recv(4096)
            assert b, got
            got += b
        assert b"200 OK" in got.split(b"\r\n", 1)[0]
    else:
        t0 = time.time()
        while time.time() - t0 < 10:  # admitted and generating
            ms, _ = metrics(srv)
            if mval(ms, "vllm:kv_cache_usage_perc") > 0:
                break
            time.sleep(0.05)
        time.sleep(0.3)
    ms, _ = metrics(srv)
    assert mval(ms, "vllm:num_requests_running") == 1
    assert mval(ms, "vllm:kv_cache_usage_perc") > 0
    return s


def check_disconnect_frees(srv, chat, stream):
    assert wait_idle(srv, 30)[0] is not None, "server not idle before the test"
    time.sleep(0.2)  # the previous stream's bookkeeping runs after its last byte
    before, _ = metrics(srv)
    s = start_long_generation(srv, chat, stream)
    s.close()
    waited, after = wait_idle(srv, 2.0)
    assert waited is not None, (
        "2 s after the client left: running=%g kv=%g" % (
            mval(after, "vllm:num_requests_running"), mval(after, "vllm:kv_cache_usage_perc")))
    d = lambda name, **kw: mval(after, name, **kw) - mval(before, name, **kw)  # noqa: E731
    assert d("vllm:request_success_total", finished_reason="abort") == 1
    assert d("vllm:request_success_total", finished_reason="length") == 0
    assert d("vllm:generation_tokens_total") < 2000


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_client_disconnect_mid_stream_frees_slot(srv, chat):
    check_disconnect_frees(srv, chat, stream=True)
    alive(srv)


def test_client_disconnect_non_stream_frees_slot(tmp_path):
    s = Server(tmp_path, "--insecure-no-auth")  # its own server: the leftover run dies with it
    try:
        check_disconnect_frees(s, chat=False, stream=False)
    finally:
        s.proc.kill()
        s.stop()


# ---------------------------------------------------------------- API keys --

def create_key(s, name):
    """A new API key from `dsctl keys create NAME --json` (admin token read
    from the agent's data directory)."""
    r = subprocess.run([binary("dsctl"), "--agent", f"http://127.0.0.1:{s.control_port}",
                        "--data-dir", str(s.data_dir), "keys", "create", name, "--json"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["key"]


@pytest.fixture(scope="module")
def auth_srv(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serving-auth"))
    s.key = create_key(s, "http-test")
    yield s
    rc = s.stop()
    assert rc == 0, f"dsagent exited with {rc}: {s.err_path.read_text()[-2000:]}"


def test_auth_required_with_openai_shape(auth_srv):
    s = auth_srv
    body = {"prompt": "Hi", "max_tokens": 2}
    for auth in (None, "", "Bearer", "Bearer wrong-key", "Basic dXNlcjpwYXNz",
                 "Bearer " + s.key[:-1], "Bearer " + s.key + "x"):
        headers = {} if auth is None else {"Authorization": auth}
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            status, hdrs, _, doc = call(s, "POST", path, body, headers=headers)
            assert_error(status, doc, 401, "authentication_error")
            assert hdrs.get("www-authenticate", "").lower().startswith("bearer"), hdrs
            alive(s)
    # a non-UTF-8 key is refused as well, not a server error
    raw = raw_request(s, build_request(s, "POST", "/v1/completions", body,
                                       headers=[(b"Authorization", b"Bearer \xff\xfe")]))
    assert parse_response(raw)[0] == 401
    alive(s)


def test_auth_exempt_routes_and_good_key(auth_srv):
    s = auth_srv
    for path in ("/health", "/v1/models", "/metrics"):
        assert call(s, "GET", path)[0] == 200, path
    assert call(s, "OPTIONS", "/v1/completions")[0] == 204
    hdrs = [(b"Authorization", b"Bearer " + s.key.encode())]
    hmap, _, events = stream(s, "/v1/chat/completions",
                             {"messages": CHAT, "max_tokens": 4, "stream": True, "ignore_eos": True,
                              "stream_options": {"include_usage": True}}, headers=hdrs)
    check_stream(events, True, 1, 4, True)
    status, _, _, doc = call(s, "POST", "/tokenize", {"prompt": "Hi"},
                             headers={"Authorization": "Bearer " + s.key})
    assert status == 200 and doc["count"] >= 1

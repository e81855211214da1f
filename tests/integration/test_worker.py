"""`dsagent worker`, the rank process, driven as a real process over its
framed stdin/stdout protocol (engine/rankproto.h, worker/worker.h).

The test is the launcher: it lays out the KV pages of each sequence itself
(block tables with pages out of order, so the worker must follow them),
sends a prefill step and then decode steps, and compares the logits with
`dsrun --dump-logits` on the same tokens (one prefill of the whole prompt).
The prefill step runs the same code on the same batch as dsrun's prefill of
the same tokens: its rows must be bit-identical.  Decode steps take the
engine's one-token paths (matrix-vector kernels, absorbed MLA) and batches of
another size split the work differently, so those rows agree with dsrun's
rows of the whole prompt to float32 rounding (DECODE_RTOL), far below any
real difference.

Also: malformed frames get an ERROR reply naming the problem and the worker
goes on; a bad header or a frame cut by the end of input is fatal (exit 1);
STOP and a clean end of input exit 0; STATS answers with this rank's
record; --world-size that disagrees with the plan is refused, and so is a
plan of more ranks without --store.
"""
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, binary

sys.path.insert(0, str(ROOT))
from tests.fixtures import tiny_models  # noqa: E402
from tests.fixtures.tiny_llama import write_hf  # noqa: E402

MAGIC = 0x4B575344  # "DSWK"
VERSION = 2
STEP, STOP, READY, LOGITS, ERROR, STATS, STATS_REPLY = 1, 2, 3, 4, 5, 6, 7
WANT = 1
TIMEOUT = 300  # the machine is shared and loaded: generous
DECODE_RTOL = 1e-5
PAGE = 4       # small pages so a sequence spans several, out of order
N_PAGES = 16
N_PROMPT = 10
N_PREFILL = 7  # then N_PROMPT - N_PREFILL decode steps

ERR_NAMES = {-1: "EINVAL", -4: "ENOTFOUND", -5: "EFORMAT", -7: "ERANGE"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("worker_models")
    out = {"v3": tiny_models.write_model("v3", d / "v3")}
    out["llama"] = write_hf(d / "llama")[0]
    return out


def header(kind, length, ident=0, magic=MAGIC, version=VERSION):
    return struct.pack("<IHHII", magic, version, kind, ident, length)


def step_payload(tokens, pos, seq, tables, want=None):
    n_seq, max_blocks = len(tables), len(tables[0])
    flags = WANT if want is not None else 0
    p = struct.pack("<iiiI", len(tokens), n_seq, max_blocks, flags)
    p += struct.pack(f"<{len(tokens)}i", *tokens)
    p += struct.pack(f"<{len(pos)}i", *pos)
    p += struct.pack(f"<{len(seq)}i", *seq)
    if want is not None:
        w = bytes(want)
        p += w + b"\0" * (-len(w) % 4)
    p += struct.pack(f"<{n_seq * max_blocks}i", *[x for row in tables for x in row])
    return p


class Worker:
    def __init__(self, model, tmp_path, *args):
        self.err = open(tmp_path / "worker.stderr", "w+")
        cmd = [binary("dsagent"), "worker", "--model", str(model), "--backend", "cpu",
               "--threads", "2", "--page-size", str(PAGE), "--n-pages", str(N_PAGES),
               "--max-ctx", "64", "--max-seqs", "4", *map(str, args)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, cwd=ROOT)
        self.ready = None

    def log(self):
        self.err.flush()
        self.err.seek(0)
        return self.err.read()

    def read_exact(self, n):
        data = self.proc.stdout.read(n)
        assert data is not None and len(data) == n, \
            f"worker stdout ended after {len(data or b'')} of {n} bytes; log:\n{self.log()}"
        return data

    def read_frame(self):
        magic, version, kind, ident, length = struct.unpack("<IHHII", self.read_exact(16))
        assert magic == MAGIC and version == VERSION, f"bad reply header; log:\n{self.log()}"
        return kind, ident, self.read_exact(length)

    def wait_ready(self):
        kind, ident, payload = self.read_frame()
        assert kind == READY, f"first frame is kind {kind}: {payload!r}; log:\n{self.log()}"
        names = ("rank", "world_size", "vocab", "max_batch_tokens", "max_ctx", "page_size",
                 "n_pages", "max_seqs", "max_blocks", "max_payload")
        assert len(payload) == 124, len(payload)
        self.ready = dict(zip(names, struct.unpack("<10i", payload[:40])))
        n_eos = struct.unpack("<i", payload[40:44])[0]
        self.ready["eos"] = list(struct.unpack("<8i", payload[44:76])[:n_eos])
        self.ready["arch"] = payload[76:108].rstrip(b"\0").decode()
        self.ready["backend"] = payload[108:124].rstrip(b"\0").decode()
        return self.ready

    def send(self, data):
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def step(self, ident, **kw):
        """Sends one STEP; returns ("logits", array) or ("error", name, message)."""
        p = step_payload(**kw)
        self.send(header(STEP, len(p), ident) + p)
        return self.reply(ident)

    def reply(self, ident):
        kind, got_id, payload = self.read_frame()
        assert got_id == ident
        if kind == ERROR:
            code = struct.unpack("<i", payload[:4])[0]
            return "error", ERR_NAMES.get(code, code), payload[4:].decode()
        assert kind == LOGITS, f"reply kind {kind}"
        rows, vocab = struct.unpack("<ii", payload[:8])
        assert len(payload) == 8 + rows * vocab * 4
        return "logits", np.frombuffer(payload[8:], dtype="<f4").reshape(rows, vocab)

    def finish(self, close=True):
        if close:
            self.proc.stdin.close()
        try:
            rc = self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"worker did not exit; log:\n{self.log()}")
        rest = self.proc.stdout.read()
        self.proc.stdout.close()
        return rc, rest


@pytest.fixture
def worker(models, tmp_path):
    started = []

    def start(kind="llama", *args):
        w = Worker(models[kind], tmp_path, *args)
        started.append(w)
        return w
    yield start
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()
        w.err.close()


def dump_logits(model, ids, out_file, vocab):
    r = subprocess.run([binary("dsrun"), "-m", str(model), "--threads", "2", "--tokens",
                        ",".join(map(str, ids)), "--dump-logits", str(out_file)],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    return np.fromfile(out_file, dtype="<f4").reshape(len(ids), vocab)


def prompt(vocab, n, seed):
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(2, vocab, n)]


def rowrel(a, b):
    return np.max(np.abs(a - b), axis=-1) / np.max(np.abs(b), axis=-1)


@pytest.mark.parametrize("kind", ["llama", "v3"])
def test_prefill_then_decode_matches_dsrun(worker, models, kind, tmp_path):
    w = worker(kind)
    info = w.wait_ready()
    assert info["rank"] == 0 and info["world_size"] == 1
    assert info["page_size"] == PAGE and info["n_pages"] == N_PAGES
    V = info["vocab"]
    ids = prompt(V, N_PROMPT, seed=7)
    # the prefill step is dsrun's prefill of the same tokens; the decode rows
    # are dsrun's rows of the whole prompt
    want_prefill = dump_logits(models[kind], ids[:N_PREFILL], tmp_path / "pre.f32", V)
    want = dump_logits(models[kind], ids, tmp_path / "all.f32", V)

    pages = [9, 2, 14]  # positions 0-3, 4-7, 8-11: out of order on purpose
    mb = info["max_blocks"]
    table = [pages + [0] * (mb - len(pages))]
    kind_, got = w.step(1, tokens=ids[:N_PREFILL], pos=list(range(N_PREFILL)),
                        seq=[0] * N_PREFILL, tables=table)
    assert kind_ == "logits", got
    assert got.shape == (N_PREFILL, V)
    assert np.array_equal(got, want_prefill), \
        f"prefill rows differ from dsrun by {rowrel(got, want_prefill).max():.3e}"

    for i in range(N_PREFILL, N_PROMPT):
        kind_, got = w.step(100 + i, tokens=[ids[i]], pos=[i], seq=[0], tables=table, want=[1])
        assert kind_ == "logits", got
        rel = rowrel(got[0], want[i])
        assert rel < DECODE_RTOL, f"decode position {i}: {rel:.3e} from dsrun"
    w.send(header(STOP, 0))
    rc, rest = w.finish(close=False)
    assert rc == 0 and rest == b"", w.log()
    log = w.log()
    assert "msg=\"ready\" rank=0 world_size=1" in log and "backend=cpu" in log, log


def test_two_sequences_in_one_step_and_want_logits(worker, models, tmp_path):
    """Two sequences prefilled together (seq ids, block-table rows), only the
    last token of each wanting logits; each matches dsrun alone on its prompt."""
    w = worker("llama")
    V = w.wait_ready()["vocab"]
    a, b = prompt(V, 6, seed=1), prompt(V, 5, seed=2)
    mb = w.ready["max_blocks"]
    tables = [[3, 5] + [0] * (mb - 2), [11, 1] + [0] * (mb - 2)]
    kind_, got = w.step(5, tokens=a + b, pos=list(range(6)) + list(range(5)),
                        seq=[0] * 6 + [1] * 5, tables=tables,
                        want=[0] * 5 + [1] + [0] * 4 + [1])
    assert kind_ == "logits", got
    assert got.shape == (2, V)
    ra = dump_logits(models["llama"], a, tmp_path / "a.f32", V)[-1]
    rb = dump_logits(models["llama"], b, tmp_path / "b.f32", V)[-1]
    assert rowrel(got[0], ra) < DECODE_RTOL and rowrel(got[1], rb) < DECODE_RTOL
    rc, _ = w.finish()
    assert rc == 0, w.log()


def test_bad_steps_get_errors_and_the_worker_goes_on(worker):
    w = worker("llama")
    info = w.wait_ready()
    V, mb = info["vocab"], info["max_blocks"]
    table = [[0] * mb]

    # payload shorter than its counts say
    p = step_payload(tokens=[1, 2], pos=[0, 1], seq=[0, 0], tables=table)[:-4]
    w.send(header(STEP, len(p), 7) + p)
    r = w.reply(7)
    assert r[0] == "error" and r[1] == "EFORMAT" and "STEP payload is" in r[2], r
    # counts over the limits READY announced
    r = w.step(8, tokens=[1], pos=[0], seq=[0], tables=[[0] * (mb + 1)])
    assert r[0] == "error" and "max_blocks" in r[2] and str(mb) in r[2], r
    # what the model refuses: a token past the vocabulary, a page past the cache
    r = w.step(9, tokens=[V], pos=[0], seq=[0], tables=table)
    assert r[0] == "error" and f"token id {V}" in r[2], r
    r = w.step(10, tokens=[1], pos=[0], seq=[0], tables=[[N_PAGES] + [0] * (mb - 1)])
    assert r[0] == "error" and f"page {N_PAGES}" in r[2], r
    # a kind the worker does not take
    w.send(header(LOGITS, 3, 11) + b"abc")
    r = w.reply(11)
    assert r[0] == "error" and "kind 4" in r[2], r
    # IDLE is between ranks only: from the launcher it is refused too
    w.send(header(8, 0, 13))
    r = w.reply(13)
    assert r[0] == "error" and "kind 8 (IDLE)" in r[2], r
    # and a good step still works
    r = w.step(12, tokens=[1, 2, 3], pos=[0, 1, 2], seq=[0, 0, 0], tables=table)
    assert r[0] == "logits" and r[1].shape == (3, V), r
    rc, _ = w.finish()
    assert rc == 0, w.log()
    assert "step refused" in w.log()


@pytest.mark.parametrize("case", ["magic", "version", "too_long"])
def test_bad_header_is_fatal(worker, case):
    w = worker("llama")
    w.wait_ready()
    if case == "magic":
        w.send(b"GET / HTTP/1.1\r\n")
        want = "bad frame magic"
    elif case == "version":
        w.send(header(STEP, 0, 3, version=9))
        want = "protocol version 9"
    else:
        w.send(header(STEP, w.ready["max_payload"] + 1, 3))
        want = f"the limit is {w.ready['max_payload']}"
    kind, _, payload = w.read_frame()
    assert kind == ERROR and want in payload[4:].decode(), payload
    rc, _ = w.finish()
    assert rc == 1


@pytest.mark.parametrize("cut", ["header", "payload"])
def test_end_of_input_inside_a_frame_exits_nonzero(worker, cut):
    w = worker("llama")
    w.wait_ready()
    if cut == "header":
        w.send(header(STEP, 40, 5)[:9])
        want = "truncated frame header: 9 of 16 bytes"
    else:
        w.send(header(STEP, 100, 5) + b"\1" * 10)
        want = "truncated STEP frame: 10 of 100 payload bytes"
    rc, rest = w.finish()
    assert rc == 1, w.log()
    magic, version, kind, ident, length = struct.unpack("<IHHII", rest[:16])
    assert kind == ERROR and want in rest[20:16 + length].decode(), rest
    assert want in w.log()


def test_clean_end_of_input_exits_zero(worker):
    w = worker("llama")
    w.wait_ready()
    rc, rest = w.finish()
    assert rc == 0 and rest == b"", w.log()


def test_stats_answers_with_this_ranks_record(worker):
    w = worker("llama")
    info = w.wait_ready()
    assert info["backend"] == "cpu" and info["arch"] == "llama" and info["eos"], info
    w.send(header(STATS, 0, 21))
    kind, ident, payload = w.read_frame()
    assert kind == STATS_REPLY and ident == 21, payload
    n, rec = struct.unpack("<ii", payload[:8])
    assert n == 1 and rec == 40 and len(payload) == 8 + 40
    rank, _, wb, xb, rss, comm = struct.unpack("<iiQQQd", payload[8:])
    assert rank == 0 and wb > 0 and xb > 0 and rss >= wb // 2 and comm == 0.0
    rc, _ = w.finish()
    assert rc == 0, w.log()


@pytest.mark.parametrize("args,want", [
    (["--world-size", "2", "--rank", "1"], "--world-size 2 does not match the plan"),
    (["--tp", "2", "--world-size", "3"], "--tp 2 x --pp 1 x --ep 1 = 2 ranks"),
    (["--tp", "2", "--rank", "2"], "--rank 2 is outside 0..1"),
    (["--pp", "2"], "need --store HOST:PORT"),
    (["--comm-spin", "yes"], "--comm-spin must be auto, on or off, got 'yes'"),
])
def test_bad_plans_are_refused(models, args, want):
    r = subprocess.run([binary("dsagent"), "worker", "--model", str(models["llama"]), *args],
                       capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and r.stdout == ""
    assert want in r.stderr, r.stderr


def test_missing_model_is_an_error_frame(tmp_path):
    missing = tmp_path / "nope"
    r = subprocess.run([binary("dsagent"), "worker", "--model", str(missing), "--backend", "cpu"],
                       capture_output=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert r.returncode == 1
    magic, version, kind, ident, length = struct.unpack("<IHHII", r.stdout[:16])
    assert kind == ERROR and str(missing) in r.stdout[20:16 + length].decode()
    assert str(missing) in r.stderr.decode()


def test_help_lists_the_options():
    r = subprocess.run([binary("dsagent"), "worker", "--help"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0
    for opt in ("--model", "--backend", "--threads", "--rank", "--world-size", "--tp", "--pp",
                "--ep", "--store", "--job", "--host", "--comm-timeout-ms", "--comm-spin",
                "--local-ranks",
                "--max-batch-tokens", "--max-ctx", "--page-size", "--n-pages"):
        assert opt in r.stdout

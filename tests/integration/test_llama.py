"""The llama-family graph against an independent numpy forward pass: a tiny
Hugging Face checkpoint (half-split RoPE, untied and tied heads) and the same
weights as a GGUF file (adjacent-pair RoPE, ggml shapes), through
`dsrun --dump-logits`.  Tolerance: max |a-b| / max |b| per position < 1e-4
(f32 engine vs f64 reference), with the KV cache in halves (the default:
the reference rounds its keys and values to halves too) and in f32."""
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, binary

sys.path.insert(0, str(ROOT))
from tests.fixtures.tiny_llama import write_gguf, write_hf  # noqa: E402
from tests.reference.llama_numpy import forward  # noqa: E402

IDS = [1, 17, 250, 3, 99, 42, 42, 7, 150, 299, 0, 12, 64, 5, 88, 200, 31, 2, 140, 77]


def dump(model, ids, tmp_path, vocab, kv=None):
    out = tmp_path / "logits.bin"
    r = subprocess.run([binary("dsrun"), "-m", str(model), "--tokens", ",".join(map(str, ids)),
                        "--dump-logits", str(out)] + (["--kv-cache-dtype", kv] if kv else []),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return np.fromfile(out, dtype="<f4").reshape(len(ids), vocab)


def rel_err(got, want):
    return (np.abs(got - want).max(-1) / np.abs(want).max(-1)).max()


@pytest.mark.parametrize("tied", [False, True])
def test_hf_llama_matches_reference(tmp_path, tied):
    d, cfg, w = write_hf(tmp_path / "hf", tie_word_embeddings=tied)
    got = dump(d, IDS, tmp_path, cfg["vocab_size"])
    assert rel_err(got, forward(cfg, w, IDS, kv_f16=True)) < 1e-4


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_gguf_llama_matches_reference(tmp_path, kv):
    d, cfg, w = write_hf(tmp_path / "hf")
    g = write_gguf(tmp_path / "tiny.gguf", cfg, w)
    got = dump(g, IDS, tmp_path, cfg["vocab_size"], kv)
    assert rel_err(got, forward(cfg, w, IDS, kv_f16=kv == "f16")) < 1e-4


def test_kv_cache_in_halves_is_not_the_f32_result(tmp_path):
    """The f16 cache really holds halves: its logits differ from the f32
    cache's by far more than the f32 run's error against its reference,
    and each matches only its own reference."""
    d, cfg, w = write_hf(tmp_path / "hf")
    g = write_gguf(tmp_path / "tiny.gguf", cfg, w)
    f32, f16 = (dump(g, IDS, tmp_path, cfg["vocab_size"], kv) for kv in ("f32", "f16"))
    exact = rel_err(f32, forward(cfg, w, IDS))
    assert rel_err(f16, f32) > 10 * exact
    assert rel_err(f16, forward(cfg, w, IDS)) > 10 * rel_err(f16, forward(cfg, w, IDS, kv_f16=True))


def test_gguf_llama_f16_weights(tmp_path):
    d, cfg, w = write_hf(tmp_path / "hf")
    g = write_gguf(tmp_path / "tiny16.gguf", cfg, w, dtype="F16")
    w16 = {k: (v.astype(np.float16).astype(np.float32) if v.ndim == 2 else v) for k, v in w.items()}
    got = dump(g, IDS, tmp_path, cfg["vocab_size"])
    assert rel_err(got, forward(cfg, w16, IDS, kv_f16=True)) < 1e-4


def test_kv_cache_dtype_errors_are_named(tmp_path):
    d, cfg, w = write_hf(tmp_path / "hf")
    r = subprocess.run([binary("dsrun"), "-m", str(d), "--tokens", "1,2", "--kv-cache-dtype", "fp8"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "kv cache dtype must be auto, f16 or f32, got 'fp8'" in r.stderr


def test_hf_llama_rejects_unsupported_fields(tmp_path):
    d, cfg, w = write_hf(tmp_path / "bad", hidden_act="gelu")
    r = subprocess.run([binary("dsrun"), "-m", str(d), "--tokens", "1,2"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "gelu" in r.stderr


def test_gguf_end_of_turn_token_stops_generation(tmp_path):
    import json
    d, cfg, w = write_hf(tmp_path / "hf")
    g = write_gguf(tmp_path / "a.gguf", cfg, w)
    base = ["--tokens", "1,17,250,3", "-n", "12", "--temp", "0", "--ids", "--ignore-eos"]
    run = lambda m, *extra: subprocess.run([binary("dsrun"), "-m", str(m), *base, *extra],  # noqa: E731
                                           capture_output=True, text=True, timeout=60)
    full = json.loads(run(g).stdout)
    assert len(full) == 12
    stop = full[4]
    g2 = write_gguf(tmp_path / "b.gguf", cfg, w, eot=stop)
    r = subprocess.run([binary("dsrun"), "-m", str(g2), "--tokens", "1,17,250,3", "-n", "12",
                        "--temp", "0", "--ids"], capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout) == full[:full.index(stop) + 1]

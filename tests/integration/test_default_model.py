"""The embedded default model end to end: SmolLM2-135M-Instruct Q4_1
(models/default.gguf, fetched by `make deps` / `make model`).

- chat answers that can be checked (greedy, through the GGUF's own template);
- the GGUF tokenizer equals HF `tokenizers` built from the same metadata
  (vocabulary, merges, token types, the "smollm" pre-tokenizer) on the
  >= 1,000-string corpus of test_tokenizer.py, and round-trips UTF-8;
- prompt logits against an independent float64 forward pass of the
  dequantized weights (gguf's own dequantizer, q/k rows un-permuted back to
  the Hugging Face layout)."""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, binary

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_gguf_tokenizer import compare_encodings, corpus, hf_json_from_meta  # noqa: E402
from tests.reference.llama_numpy import forward  # noqa: E402

MODEL = ROOT / "models" / "default.gguf"


@pytest.fixture(scope="module")
def model():
    assert MODEL.exists(), "models/default.gguf is missing: `make deps` (or `make model`) fetches it"
    return MODEL


def chat(model, text, n=32):
    r = subprocess.run([binary("dsrun"), "-m", str(model), "--chat", text, "-n", str(n), "--temp", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_capital_of_france(model):
    assert "Paris" in chat(model, "What is the capital of France?")


def test_days_in_a_week(model):
    out = chat(model, "How many days are in a week?")
    assert "7" in out or "seven" in out.lower(), out


def gguf_meta(path):
    import gguf
    r = gguf.GGUFReader(str(path))

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    types = [int(r.fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in r.fields["tokenizer.ggml.token_type"].data]
    return r, strings("tokenizer.ggml.tokens"), types, strings("tokenizer.ggml.merges")


def test_tokenizer_matches_hf_on_the_real_vocabulary(model):
    from tokenizers import Tokenizer
    r, tokens, types, merges = gguf_meta(model)
    assert r.fields["tokenizer.ggml.pre"].contents() == "smollm"
    ref = Tokenizer.from_str(json.dumps(hf_json_from_meta(tokens, types, merges, "smollm")))
    texts = list(corpus())
    assert len(texts) >= 1000
    ids = compare_encodings(model, ref, texts)
    assert ref.decode(ids[0], skip_special_tokens=False) == texts[0]
    # round trip through dsrun itself on a few awkward strings
    for s in ["naïve café — 東京 🙂 \t\n  x", "<|im_start|>user\nhi<|im_end|>", "1234567 3.14"]:
        got = subprocess.run([binary("dsrun"), "-m", str(model), "--tokenize", s], capture_output=True,
                             text=True, timeout=60)
        back = subprocess.run([binary("dsrun"), "-m", str(model), "--detokenize",
                               ",".join(map(str, json.loads(got.stdout)))], capture_output=True,
                              text=True, timeout=60)
        assert back.stdout[:-1] == s


def reference_weights(r):
    import gguf
    f = lambda k: r.fields[k].contents()  # noqa: E731
    cfg = dict(hidden_size=f("llama.embedding_length"), num_attention_heads=f("llama.attention.head_count"),
               num_key_value_heads=f("llama.attention.head_count_kv"), num_hidden_layers=f("llama.block_count"),
               rms_norm_eps=f("llama.attention.layer_norm_rms_epsilon"),
               rope_theta=f("llama.rope.freq_base"), tie_word_embeddings=True)
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    sub = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
           "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}
    w = {}
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape)]
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if t.name == "token_embd.weight":
            w["model.embed_tokens.weight"] = a
        elif t.name == "output_norm.weight":
            w["model.norm.weight"] = a
        else:
            _, layer, rest = t.name.split(".", 2)
            key = rest[: -len(".weight")]
            if key in ("attn_q", "attn_k"):  # adjacent pairs back to HF's half-split rows
                n = h if key == "attn_q" else kv
                a = a.reshape(n, a.shape[0] // n // 2, 2, a.shape[1]).swapaxes(1, 2).reshape(a.shape)
            w[f"model.layers.{layer}.{sub[key]}.weight"] = a
    return cfg, w


def test_logits_match_dequantized_reference(model, tmp_path):
    import gguf
    cfg, w = reference_weights(gguf.GGUFReader(str(model)))
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198, 1, 4093, 198, 1780, 314, 260]
    out = tmp_path / "l.bin"
    r = subprocess.run([binary("dsrun"), "-m", str(model), "--tokens", ",".join(map(str, ids)),
                        "--dump-logits", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = np.fromfile(out, dtype="<f4").reshape(len(ids), -1)
    want = forward(cfg, w, ids, kv_f16=True)  # the default cache holds K/V in halves
    rel = np.abs(got - want).max(-1) / np.abs(want).max(-1)
    # activations are quantized on the fly for the integer block products
    # (two 8-bit levels per block); the f64 reference uses exact activations
    assert rel.max() < 5e-3, rel

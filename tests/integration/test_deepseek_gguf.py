"""DeepSeek from GGUF: llama.cpp's "deepseek2" files through `dsrun`, against
the independent float64 numpy reference (tests/reference/deepseek_numpy.py)
and against the same checkpoint loaded from safetensors.

Every GGUF is written here by tests/fixtures/tiny_deepseek_gguf.py from a
tiny Hugging Face checkpoint of tests/fixtures/tiny_models.py, as llama.cpp's
converter writes the real ones: both kv_b forms ("split": attn_k_b + attn_v_b
of current converters; "kv_b": attn_kv_b of older ones), stacked experts,
F32 / F16 / BF16 / Q8_0.

Checkpoints: "v3" (q LoRA, sigmoid/noaux_tc routing with bias and groups,
YaRN) and "v2-lite" (plain q_proj, softmax/greedy, 2 shared experts, YaRN
mscale 0.707).  A GGUF has no key for YaRN's `mscale` (only
yarn_log_multiplier = 0.1 * mscale_all_dim), and llama.cpp uses the cos/sin
amplitude 1, i.e. mscale = mscale_all_dim as in every released DeepSeek
config; the "v3" checkpoint here therefore has mscale = mscale_all_dim = 0.6
(tiny_models' own v3 has mscale 1.0, used by test_yarn_mscale_follows_llama_cpp).

Metric: per position max |engine - reference| / max |reference|.
Tolerances:
  F32, F16, BF16 GGUF vs the reference on the values the file stores: 1e-4
    (f32 engine vs f64 reference, as test_engine_numerics);
  BF16 GGUF vs the safetensors (BF16) model through the engine: 1e-6 (same
    values, same kernels; measured 0);
  Q8_0 GGUF vs the reference on the file's dequantized values: 2e-3.  The
    engine, like ggml, quantizes activations to Q8_0 blocks inside each Q8_0
    product; that alone measured 2e-4 .. 7e-4 on these models (both kv_b
    forms, naive and absorbed attention, several prompts).
    Against the original BF16 weights the Q8_0 file itself is 0.1 .. 1.0 off
    (weights rounded to 8 bits flip expert choices of the tiny routers); the
    engine must add no more than 2e-3 to the file's own error.
Routing is discontinuous, so prompts are drawn until every routing decision
of the reference in use has a margin >= MIN_ROUTE_MARGIN (F32: 3e-4 as in
test_engine_numerics; Q8_0: 5e-4 on the reference of the stored values,
whose logits the engine's activation rounding moves by < 1e-3 relative; the
routers themselves are F32 in the file).
"""
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, binary

sys.path.insert(0, str(ROOT))
from tests.fixtures import tiny_deepseek_gguf as tg  # noqa: E402
from tests.fixtures import tiny_models  # noqa: E402
from tests.reference import deepseek_numpy as ref  # noqa: E402
from tests.fixtures.shared import SHARED_DATA, needs_shared_data  # noqa: E402

gguf = pytest.importorskip("gguf")

LOGIT_RTOL = 1e-4
BF16_SAME_RTOL = 1e-6
Q8_RTOL = 2e-3
MIN_ROUTE_MARGIN = {"F32": 3e-4, "F16": 3e-4, "BF16": 3e-4, "Q8_0": 5e-4}
N_PROMPT = 40   # > original_max_position_embeddings (16): YaRN's ramp matters
N_GEN = 8

V3_RS = dict(tiny_models.SIZES["v3"]["rope_scaling"], mscale=0.6, mscale_all_dim=0.6)
OVERRIDES = {
    "v3": dict(rope_scaling=V3_RS),
    "v2-lite": {},
    "v3-q8": dict(tg.Q8_OVERRIDES["v3"], rope_scaling=V3_RS),
    "v2-lite-q8": dict(tg.Q8_OVERRIDES["v2-lite"]),
}
TOKJSON_CFG = SHARED_DATA / "deepseek-v3" / "tokenizer_config.json"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds_gguf_hf")
    return {k: tiny_models.write_model(k.replace("-q8", ""), d / k, overrides=ov)
            for k, ov in OVERRIDES.items()}


def dsrun(*args):
    return subprocess.run([binary("dsrun"), *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def vocab(model_dir):
    return json.loads((pathlib.Path(model_dir) / "config.json").read_text())["vocab_size"]


def dump(model, ids, out, V, *extra):
    r = dsrun("-m", model, "--tokens", ",".join(map(str, ids)), "--dump-logits", out, *extra)
    assert r.returncode == 0, f"dsrun -m {model} failed ({r.returncode}): {r.stderr}"
    raw = pathlib.Path(out).read_bytes()
    assert len(raw) == len(ids) * V * 4, (len(raw), len(ids), V)
    return np.frombuffer(raw, dtype="<f4").reshape(len(ids), V).astype(np.float64)


def rowrel(a, b):
    return np.max(np.abs(a - b), axis=-1) / np.max(np.abs(b), axis=-1)


def pick_prompt(model_dir, margin):
    """Seeded random ids (BOS first, the last id included) whose reference
    routing has no near-tie; -> (ids, reference logits)."""
    m = ref.load(model_dir)
    V = m.cfg["vocab_size"]
    for seed in range(100):
        rng = np.random.default_rng(2000 + seed)
        ids = rng.integers(0, V, N_PROMPT)
        ids[0] = m.cfg.get("bos_token_id", 0)
        ids[rng.integers(1, N_PROMPT)] = V - 1
        stats = {}
        logits = m.forward(ids, stats=stats)
        if np.concatenate(stats["route_margin"]).min() >= margin:
            return [int(i) for i in ids], logits
    pytest.fail(f"{model_dir}: no prompt with routing margins >= {margin}")


def convert(hf_dir, tmp_path, form, dtype, **kw):
    return tg.convert(hf_dir, tmp_path / f"tiny-{form}-{dtype}.gguf", form, dtype, **kw)


# ------------------------------------------------------------------ numerics

@pytest.mark.parametrize("form", tg.KV_FORMS)
@pytest.mark.parametrize("kind,dtype", [("v3", "F32"), ("v2-lite", "F32"), ("v3", "F16"),
                                        ("v2-lite", "BF16"), ("v3-q8", "Q8_0"),
                                        ("v2-lite-q8", "Q8_0")])
def test_logits_match_reference(hf, tmp_path, kind, dtype, form):
    conv = convert(hf[kind], tmp_path, form, dtype)
    want_types = {"F32"} | ({dtype} if dtype != "F32" else set())
    assert set(conv.types.values()) == want_types, conv.types   # every weight took dtype
    assert any(".attn_k_b." in n for n in conv.types) == (form == "split")
    stored = tg.write_values_as_hf(conv, tmp_path / "stored")
    ids, want = pick_prompt(stored, MIN_ROUTE_MARGIN[dtype])
    tol = Q8_RTOL if dtype == "Q8_0" else LOGIT_RTOL
    for attn in ("naive", "absorbed"):   # the MLA forms read kv_b resp. W_UK^T / W_UV
        got = dump(conv.path, ids, tmp_path / "logits.f32", vocab(stored), "--attn", attn)
        assert np.all(np.isfinite(got))
        rel = rowrel(got, want)
        print(f"{kind} {form} {dtype} {attn}: engine vs reference on the stored values "
              f"{rel.max():.2e}")
        assert rel.max() < tol, (f"{kind} {form} {dtype} {attn}: position {int(np.argmax(rel))} "
                                 f"differs by {rel.max():.3e} (tolerance {tol})")
    if dtype == "Q8_0":   # against the original weights: no more than the file's own error
        orig = ref.forward(hf[kind], ids)
        file_err, engine_err = rowrel(want, orig).max(), rowrel(got, orig).max()
        print(f"  vs the original weights: file {file_err:.2e}, engine {engine_err:.2e}")
        assert engine_err <= file_err + Q8_RTOL, (engine_err, file_err)


@pytest.mark.parametrize("form", tg.KV_FORMS)
@pytest.mark.parametrize("kind", ("v3", "v2-lite"))
def test_bf16_gguf_equals_safetensors_model(hf, tmp_path, kind, form):
    """The BF16 checkpoint and its BF16 GGUF hold the same values: the engine
    gives the same logits whichever file it reads."""
    conv = convert(hf[kind], tmp_path, form, "BF16")
    V = vocab(hf[kind])
    ids, _ = pick_prompt(hf[kind], MIN_ROUTE_MARGIN["BF16"])
    a = dump(conv.path, ids, tmp_path / "gguf.f32", V)
    b = dump(hf[kind], ids, tmp_path / "st.f32", V)
    assert rowrel(a, b).max() < BF16_SAME_RTOL, rowrel(a, b).max()


@pytest.mark.parametrize("form", tg.KV_FORMS)
@pytest.mark.parametrize("kind", ("v3", "v2-lite"))
def test_greedy_ids_equal_safetensors_model(hf, tmp_path, kind, form):
    conv = convert(hf[kind], tmp_path, form, "F32")
    ids, _ = pick_prompt(hf[kind], MIN_ROUTE_MARGIN["F32"])
    args = ("--tokens", ",".join(map(str, ids)), "-n", N_GEN, "--temp", 0, "--ids", "--ignore-eos")
    r1, r2 = dsrun("-m", conv.path, *args), dsrun("-m", hf[kind], *args)
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    g1, g2 = json.loads(r1.stdout.strip().splitlines()[-1]), json.loads(r2.stdout.strip().splitlines()[-1])
    assert len(g1) == N_GEN and g1 == g2, (g1, g2)


def test_yarn_mscale_follows_llama_cpp(tmp_path):
    """tiny_models' own v3 has mscale 1.0 != mscale_all_dim 0.6.  The GGUF keeps
    only yarn_log_multiplier = 0.1 * 0.6; the engine reads mscale_all_dim = 0.6
    back and, as llama.cpp, uses mscale = mscale_all_dim (cos/sin amplitude 1)."""
    d = tiny_models.write_model("v3", tmp_path / "v3")
    conv = convert(d, tmp_path, "split", "F32")
    assert conv.keys["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.06)
    same = tg.write_values_as_hf(conv, tmp_path / "as-llama-cpp")
    cfg = json.loads((same / "config.json").read_text())
    cfg["rope_scaling"]["mscale"] = cfg["rope_scaling"]["mscale_all_dim"]
    (same / "config.json").write_text(json.dumps(cfg))
    ids, want = pick_prompt(same, MIN_ROUTE_MARGIN["F32"])
    got = dump(conv.path, ids, tmp_path / "l.f32", cfg["vocab_size"])
    assert rowrel(got, want).max() < LOGIT_RTOL
    hf_cfg = ref.forward(d, ids)   # the checkpoint's own amplitude m(8, 1) / m(8, 0.6)
    assert rowrel(got, hf_cfg).max() > 1e-2


# ------------------------------------------------------------------ tokenizer and chat

def _byte_chars():
    """GPT-2's byte -> printable character table (byte-level BPE)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


@needs_shared_data("deepseek-v3/tokenizer_config.json")
def test_tokenizer_and_chat_template_from_metadata(hf, tmp_path):
    """tokenizer.ggml.* (pre "deepseek-v3") and tokenizer.chat_template (the
    real V3 template) of a deepseek2 GGUF drive `dsrun --chat`."""
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    tokens = specials + _byte_chars() + ["<｜User｜>", "<｜Assistant｜>", "Hi"]
    types = [3, 3] + [1] * 256 + [3, 3, 1]
    tok = dict(pre="deepseek-v3", tokens=tokens, types=types, merges=["H i"],
               chat_template=json.loads(TOKJSON_CFG.read_text())["chat_template"])
    conv = convert(hf["v3"], tmp_path, "split", "F32", tokenizer=tok)
    user, asst, hi = len(tokens) - 3, len(tokens) - 2, len(tokens) - 1
    r = dsrun("-m", conv.path, "--chat", "Hi", "-n", 3, "--temp", 0, "--ids", "--ignore-eos",
              "--show-prompt")
    assert r.returncode == 0, r.stderr
    prompt = json.loads(re.search(r"^\[[\d,]*\]$", r.stderr, re.M).group(0))
    assert prompt == [0, user, hi, asst], prompt
    assert len(json.loads(r.stdout.strip().splitlines()[-1])) == 3


def _dsllm_patterns():
    """llama.cpp's DEEPSEEK_LLM pattern list (the pre-tokenizer of V2 / V2-Lite
    files), kept once in test_pretok_deepseek_llm.py."""
    from test_pretok_deepseek_llm import PATTERNS
    return PATTERNS


DSLLM_TEXTS = ["Hi there, world!\n\nHi", "  Hello  \n\n  ", "数字 12345 和 中文。123",
               "Καλημέρα κόσμε, Ωmega!", "한국어 ＦＵＬＬ　ｗｉｄｔｈ！  ", "tabs\tand   spaces   ",
               "emoji 😀 x² = ٣٤", "Hi\r\nthere ...\n", "e\u0301t\u00e9 \u1f7d \u212aelvin"]


def test_v2_lite_text_tokenization_matches_hf(hf, tmp_path):
    """A V2-Lite GGUF (tokenizer.ggml.pre "deepseek-llm") tokenizes text: the
    ids of `dsrun --tokenize` equal HF `tokenizers` on a tokenizer.json with
    the same vocab and merges and the six deepseek-llm Split patterns.  The
    merges join bytes across the pieces' borders too (", ", "\n\n", "! "), so
    a wrong split shows up as different ids."""
    from tokenizers import Tokenizer
    byte_chars = _byte_chars()
    to_bl = lambda text: "".join(byte_chars[b] for b in text.encode())  # noqa: E731
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    tokens, merges = specials + byte_chars, []
    for word in ["Hi", " there", ", ", " world", "\n\n", "!\n", "! ", "123", "45", "中文",
                 "数字", " Κα", "  ", "   ", "한국", " 中", "Ｌ", "spaces", " \t"]:
        w = to_bl(word)
        cur = w[0]
        for c in w[1:]:
            if cur + c not in tokens:
                merges.append(f"{cur} {c}")
                tokens.append(cur + c)
            cur += c
    types = [3, 3] + [1] * (len(tokens) - 2)
    conv = convert(hf["v2-lite"], tmp_path, "split", "F32",
                   tokenizer=dict(pre="deepseek-llm", tokens=tokens, types=types, merges=merges))
    tj = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, t in enumerate(specials)],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
            for p in _dsllm_patterns()] + [
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges}}
    ref = Tokenizer.from_str(json.dumps(tj))
    merged = 0
    for text in DSLLM_TEXTS:
        r = dsrun("-m", conv.path, "--tokenize", text)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout.strip().splitlines()[-1])
        want = ref.encode(text, add_special_tokens=False).ids
        assert got == want, (text, got, want)
        merged += sum(i >= 2 + 256 for i in got)
    assert merged >= 10, merged   # the merges are exercised


# ------------------------------------------------------------------ errors

def _fails(path, *needles):
    r = dsrun("-m", path, "--tokens", "0,5,7", "--dump-logits", path.parent / "x.f32")
    assert r.returncode != 0
    for n in needles:
        assert n in r.stderr, (n, r.stderr)
    return r.stderr


@pytest.mark.parametrize("name", ["blk.2.ffn_up_exps.weight", "blk.1.attn_kv_a_mqa.weight",
                                  "output.weight", "blk.0.ffn_norm.weight"])
def test_missing_tensor_is_named(hf, tmp_path, name):
    conv = convert(hf["v3"], tmp_path, "split", "F32", drop_tensors={name})
    _fails(conv.path, name, str(conv.path))


def test_missing_kv_b_names_both_forms(hf, tmp_path):
    conv = convert(hf["v2-lite"], tmp_path, "split", "F32", drop_tensors={"blk.1.attn_k_b.weight"})
    _fails(conv.path, "blk.1.attn_kv_b.weight", "blk.1.attn_k_b.weight")


@pytest.mark.parametrize("name,edit,good,bad", [
    # attn_k_b of v3 [H][kv_lora][nope] = [4][48][24]: one latent row short
    ("blk.1.attn_k_b.weight", lambda a: a[:, :-1, :], "[4, 48, 24]", "[4, 47, 24]"),
    # ffn_down_exps of v3 [E][D][moe_inter] = [16][96][40]: one expert short
    ("blk.2.ffn_down_exps.weight", lambda a: a[:-1], "[16, 96, 40]", "[15, 96, 40]"),
])
def test_wrong_shape_names_tensor_and_shapes(hf, tmp_path, name, edit, good, bad):
    conv = convert(hf["v3"], tmp_path, "split", "F32", edit_tensors={name: edit})
    err = _fails(conv.path, name)
    nums = lambda s: re.escape(s).replace(r",\ ", r"\D{1,4}").replace(r"\[", "").replace(r"\]", "")  # noqa: E731
    assert re.search(nums(good), err) and re.search(nums(bad), err), err


def test_missing_and_unsupported_keys_are_named(hf, tmp_path):
    conv = convert(hf["v3"], tmp_path, "split", "F32", drop_keys={"deepseek2.attention.kv_lora_rank"})
    _fails(conv.path, "deepseek2.attention.kv_lora_rank")
    conv = convert(hf["v3"], tmp_path, "split", "F32",
                   set_keys={"deepseek2.expert_gating_func": (3, gguf.GGUFValueType.UINT32)})
    _fails(conv.path, "deepseek2.expert_gating_func", "3")

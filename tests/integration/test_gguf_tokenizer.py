"""The GGUF reader (engine/gguf.c), the tokenizer built from GGUF metadata
(engine/tok_gguf.c) and the ChatML / SmolLM2 / Llama 3 chat templates
(engine/chat.c), through tests/tools/gguf_tool.c.

Every GGUF file is written here with the PyPI `gguf` package's GGUFWriter:
- small files with every metadata value type, arrays, nested arrays and
  tensors of many ggml types: the C dump is compared with the values written
  and with gguf's own GGUFReader;
- files whose tokenizer is the real DeepSeek-V3 vocabulary
  (../shared/data/deepseek-v3/tokenizer.json: 128,815 tokens, 127,741
  merges, control and user-defined tokens) under several
  tokenizer.ggml.pre names.  For each, a tokenizer.json for HF `tokenizers`
  is built from the same GGUF metadata (vocab, merges, added tokens from the
  token types, the pre-tokenizer that the pre name stands for in llama.cpp,
  ByteLevel decoder) and the ids are compared on >= 1,000 strings (the corpus
  of test_tokenizer.py), plus UTF-8 round trips;
- chat templates: SmolLM2's and Llama 3's template texts (fixtures below) are
  rendered with jinja2 and compared byte for byte with the C rendering chosen
  by recognising the GGUF's tokenizer.chat_template.
"""
import functools
import json
import random
import subprocess

import numpy as np
import pytest

from conftest import binary
from tests.fixtures.shared import SHARED_DATA, needs_shared_data

gguf = pytest.importorskip("gguf")

TOKJSON = SHARED_DATA / "deepseek-v3" / "tokenizer.json"
need_vocab = needs_shared_data("deepseek-v3/tokenizer.json")

# SmolLM2-135M-Instruct's tokenizer.chat_template (a short public template).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

# Meta-Llama-3-8B-Instruct's chat template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


# ---- running the tool -----------------------------------------------------------

def run_tool(*args, inp=None):
    return subprocess.run([binary("tests/gguf_tool"), *map(str, args)], input=inp,
                          capture_output=True, text=True, timeout=120)


def dump(path):
    r = run_tool("dump", path)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def tok_requests(path, requests):
    inp = "".join(json.dumps(q, ensure_ascii=True) + "\n" for q in requests)
    r = run_tool("tok", path, inp=inp)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")[:-1]  # not splitlines(): U+2028 may appear raw
    assert len(lines) == len(requests), r.stderr[-2000:]
    return [json.loads(x) for x in lines]


def fnv(data):
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


# ---- the reader -------------------------------------------------------------------

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


def f32(x):
    return float(np.float32(x))


def scalar_kvs(rng):
    return [
        ("t.u8", V.UINT8, rng.randrange(128, 256)), ("t.i8", V.INT8, -rng.randrange(1, 128)),
        ("t.u16", V.UINT16, rng.randrange(1 << 15, 1 << 16)),
        ("t.i16", V.INT16, -rng.randrange(1, 1 << 15)),
        ("t.u32", V.UINT32, rng.randrange(1 << 31, 1 << 32)),
        ("t.i32", V.INT32, -rng.randrange(1, 1 << 31)),
        ("t.f32", V.FLOAT32, f32(rng.uniform(-1e6, 1e6))),
        ("t.u64", V.UINT64, rng.randrange(1 << 63, 1 << 64)),
        ("t.i64", V.INT64, -rng.randrange(1, 1 << 63)),
        ("t.f64", V.FLOAT64, rng.uniform(-1, 1) * 1e300),
        ("t.bool", V.BOOL, True), ("t.false", V.BOOL, False),
        ("t.str", V.STRING, "héllo wörld ✓ " + str(rng.random())),
    ]


def array_kvs(rng):
    def ints(lo, hi, n):
        return [rng.randrange(lo, hi) for _ in range(n)]
    return [
        ("a.u8", V.UINT8, ints(0, 256, 9)), ("a.i8", V.INT8, ints(-128, 128, 4)),
        ("a.u16", V.UINT16, ints(0, 1 << 16, 5)), ("a.i16", V.INT16, ints(-(1 << 15), 1 << 15, 3)),
        ("a.u32", V.UINT32, ints(0, 1 << 32, 6)), ("a.i32", V.INT32, ints(-(1 << 31), 1 << 31, 7)),
        ("a.u64", V.UINT64, ints(0, 1 << 64, 3)), ("a.i64", V.INT64, ints(-(1 << 63), 1 << 63, 3)),
        ("a.f32", V.FLOAT32, [f32(rng.uniform(-5, 5)) for _ in range(5)]),
        ("a.f64", V.FLOAT64, [rng.uniform(-5, 5) for _ in range(4)]),
        ("a.bool", V.BOOL, [rng.random() < 0.5 for _ in range(6)]),
        ("a.str", V.STRING, ["x", "", "中文", "a b\nc"]),
    ]


TENSORS = [  # name, ggml type, shape in ggml order (ne), bytes
    ("tok.f32", Q.F32, [5, 3]), ("v.f16", Q.F16, [7]), ("x.bf16", Q.BF16, [4, 2, 2]),
    ("blk.0.q8", Q.Q8_0, [64, 2]), ("blk.0.q4_0", Q.Q4_0, [32, 3]), ("blk.0.q4_1", Q.Q4_1, [96]),
    ("blk.0.q4k", Q.Q4_K, [256, 2]), ("blk.0.q5k", Q.Q5_K, [512]), ("blk.0.q6k", Q.Q6_K, [256, 1, 2]),
    ("u.q5_0", Q.Q5_0, [32, 2]), ("u.iq4", Q.IQ4_NL, [64]), ("u.i32", Q.I32, [4, 4]),
]
SUPPORTED = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}


def write_reader_fixture(path, rng, alignment=None):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    kvs = scalar_kvs(rng) + array_kvs(rng)
    for key, vt, val in kvs:
        if isinstance(val, list):
            w.add_key_value(key, val, V.ARRAY, sub_type=vt)
        else:
            w.add_key_value(key, val, vt)
    nested = [["p", "q"], ["r"], ["s", "t", "u"]]
    w.add_key_value("a.nested", nested, V.ARRAY)
    datas = {}
    for name, qt, ne in TENSORS:
        block, nbytes = gguf.GGML_QUANT_SIZES[qt]
        rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
        row_bytes = ne[0] // block * nbytes
        raw = np.frombuffer(rng.randbytes(rows * row_bytes), dtype=np.uint8)
        datas[name] = raw.tobytes()
        w.add_tensor(name, raw.reshape(list(reversed(ne[1:])) + [row_bytes]), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return kvs, nested, datas


def expected_json_value(vt, val):
    if isinstance(val, list):
        return [expected_json_value(vt, x) for x in val]
    if vt == V.UINT64 and val >= 1 << 63:
        return f"u64:{val}"
    return val


@pytest.mark.parametrize("alignment", [None, 64, 8])
def test_dump_matches_written_values_and_gguf_reader(tmp_path, alignment):
    rng = random.Random(1000 + (alignment or 0))
    path = tmp_path / "every.gguf"
    kvs, nested, datas = write_reader_fixture(path, rng, alignment)
    d = dump(path)
    assert d["version"] == 3 and d["alignment"] == (alignment or 32)
    got = {kv["key"]: kv for kv in d["kv"]}
    assert len(got) == len(d["kv"])
    for key, vt, val in kvs:
        want_type = "array" if isinstance(val, list) else gguf.GGUFValueType(vt).name
        assert got[key]["type"] in (want_type, {"UINT8": "u8", "INT8": "i8", "UINT16": "u16",
                                                "INT16": "i16", "UINT32": "u32", "INT32": "i32",
                                                "FLOAT32": "f32", "UINT64": "u64", "INT64": "i64",
                                                "FLOAT64": "f64", "BOOL": "bool",
                                                "STRING": "string"}.get(want_type)), key
        assert got[key]["value"] == expected_json_value(vt, val), key
    assert got["a.nested"]["value"] == nested
    assert got["general.architecture"]["value"] == "llama"

    # the same file through gguf's own reader
    r = gguf.GGUFReader(str(path))
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert keys == [kv["key"] for kv in d["kv"]]
    for key in keys:
        f = r.fields[key]
        if V.ARRAY in f.types[1:]:
            continue  # nested: GGUFReader.contents() does not flatten these
        want = f.contents()
        if f.types[0] == V.FLOAT32 or (f.types[0] == V.ARRAY and f.types[-1] == V.FLOAT32):
            want = [f32(x) for x in want] if isinstance(want, list) else f32(want)
        vt = f.types[-1]
        assert got[key]["value"] == expected_json_value(vt, want), key
    assert len(r.tensors) == len(d["tensors"]) == len(TENSORS)
    for rt, ct, (name, qt, ne) in zip(r.tensors, d["tensors"], TENSORS):
        assert rt.name == ct["name"] == name
        assert rt.tensor_type == qt and ct["ggml_type"] == int(qt) and ct["type"] == qt.name
        assert ct["dtype_supported"] == (qt in SUPPORTED)
        assert list(rt.shape) == ct["ne"] == ne
        assert ct["shape"] == list(reversed(ne))
        assert rt.data_offset == d["data_offset"] + ct["offset"]
        assert ct["offset"] % (alignment or 32) == 0
        assert rt.n_bytes == ct["nbytes"] == len(datas[name])
        assert ct["fnv"] == fnv(datas[name]) == fnv(np.asarray(rt.data).tobytes())


def test_version2_and_corrupt_files(tmp_path):
    rng = random.Random(5)
    path = tmp_path / "v.gguf"
    write_reader_fixture(path, rng)
    data = bytearray(path.read_bytes())
    data[4:8] = (2).to_bytes(4, "little")
    p2 = tmp_path / "v2.gguf"
    p2.write_bytes(bytes(data))
    assert dump(p2)["version"] == 2
    cases = []
    for n in sorted(set([0, 3, 7, 20, 23, 100, 500, len(data) // 2, len(data) - 1] +
                        [rng.randrange(len(data)) for _ in range(20)])):
        cases.append((bytes(data[:n]), "truncated"))
    cases.append((b"GGML" + bytes(data[4:]), "not a GGUF file"))
    cases.append((bytes(data[:4]) + (1).to_bytes(4, "little") + bytes(data[8:]),
                  "version 1 is not supported"))
    for i, (blob, want) in enumerate(cases):
        p = tmp_path / f"bad{i}.gguf"
        p.write_bytes(blob)
        r = run_tool("open", p)
        assert r.returncode == 1 and want in r.stderr and str(p) in r.stderr, (len(blob), r.stderr)


# ---- tokenizer metadata and its HF twin ---------------------------------------------

@functools.lru_cache(maxsize=None)
def deepseek_meta():
    """tokens, token types, merges of the real DeepSeek-V3 tokenizer, as a GGUF
    converter writes them: special added tokens are control, the others
    user-defined."""
    d = json.loads(TOKJSON.read_text())
    vocab = d["model"]["vocab"]
    n = max(max(vocab.values()), max(a["id"] for a in d["added_tokens"])) + 1
    tokens, types = [None] * n, [NORMAL] * n
    for t, i in vocab.items():
        tokens[i] = t
    for a in d["added_tokens"]:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = CONTROL if a["special"] else USER_DEFINED
    assert None not in tokens
    return tuple(tokens), tuple(types), tuple(d["model"]["merges"]), d["pre_tokenizer"]


def pre_tokenizer_for(pre):
    """The HF pre-tokenizer that llama.cpp's tokenizer.ggml.pre name stands for."""
    def bytelevel(use_regex):
        return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                "use_regex": use_regex}

    def split(regex):
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            bytelevel(False)]}
    if pre == "deepseek-v3":
        return deepseek_meta()[3]
    if pre == "smollm":  # SmolLM2's tokenizer.json: digits one by one, then GPT-2
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, bytelevel(True)]}
    if pre in ("gpt2", "gpt-2"):
        return bytelevel(True)
    if pre == "llama-bpe":
        return split(LLAMA3_RE)
    if pre == "qwen2":
        return split(QWEN2_RE)
    raise KeyError(pre)


def hf_json_from_meta(tokens, types, merges, pre):
    """A tokenizer.json equivalent to GGUF tokenizer metadata."""
    vocab = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if t and ty != 5:
            vocab.setdefault(t, i)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": ty == CONTROL}
             for i, (t, ty) in enumerate(zip(tokens, types)) if t and ty in (CONTROL, USER_DEFINED)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": pre_tokenizer_for(pre), "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": pre == "llama-bpe",
                  "vocab": vocab, "merges": list(merges)},
    }


def write_tok_gguf(path, tokens, types, merges, pre, model="gpt2", bos=None, eos=None,
                   add_bos=None, template=None):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(list(tokens))
    w.add_token_types(list(types))
    w.add_token_merges(list(merges))
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template:
        w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@functools.lru_cache(maxsize=None)
def hf_for(pre, extra=()):
    from tokenizers import Tokenizer
    tokens, types, merges, _ = deepseek_meta()
    tokens, types = tokens + tuple(t for t, _ in extra), types + tuple(ty for _, ty in extra)
    return Tokenizer.from_str(json.dumps(hf_json_from_meta(tokens, types, merges, pre)))


@functools.lru_cache(maxsize=None)
def corpus():
    from test_tokenizer import corpus as tokenizer_corpus
    return tuple(tokenizer_corpus())


def ds_gguf(tmp_path, pre, **kw):
    tokens, types, merges, _ = deepseek_meta()
    path = tmp_path / f"ds-{pre}.gguf"
    write_tok_gguf(path, tokens, types, merges, pre, bos=0, eos=1, **kw)
    return path


def compare_encodings(path, ref, texts, special=True):
    answers = tok_requests(path, [{"text": s, "special": special} for s in texts])
    bad = []
    for s, got in zip(texts, answers):
        want = ref.encode(s, add_special_tokens=False).ids
        if got != want:
            bad.append((s, got, want))
    assert not bad, f"{len(bad)} of {len(texts)} differ; first: {bad[:3]!r}"
    return answers


@need_vocab
@pytest.mark.parametrize("pre", ["deepseek-v3", "smollm"])
def test_tokenizer_matches_hf_on_corpus(tmp_path, pre):
    path = ds_gguf(tmp_path, pre)
    texts = list(corpus())
    assert len(texts) >= 1000
    enc = compare_encodings(path, hf_for(pre), texts)
    # UTF-8 round trip, raw and streamed
    dec = tok_requests(path, [{"ids": ids} for ids in enc])
    for s, d in zip(texts, dec):
        assert bytes.fromhex(d["hex"]).decode("utf-8") == s
        assert d["stream"] == s


@need_vocab
@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_other_pre_names_match_hf(tmp_path, pre):
    path = ds_gguf(tmp_path, pre)
    rng = random.Random(17)
    texts = rng.sample(list(corpus()), 300) + [" 1234567", "x²³", "I'M it'S", "\n\n  a\r\n"]
    compare_encodings(path, hf_for(pre), texts)


@need_vocab
def test_specials_decoding_and_info(tmp_path):
    path = ds_gguf(tmp_path, "deepseek-v3", add_bos=True)
    ref = hf_for("deepseek-v3")
    tokens, types, _, _ = deepseek_meta()
    ctl = [i for i, t in enumerate(types) if t == CONTROL][:40]
    user = [i for i, t in enumerate(types) if t == USER_DEFINED]
    assert ctl and user
    rng = random.Random(23)
    texts = ["".join(rng.choice([tokens[i], " x", "中", "\n"]) for _ in range(6))
             for i in rng.sample(ctl + user, 30) for _ in range(2)]
    compare_encodings(path, ref, texts)
    compare_encodings(path, hf_for("deepseek-v3"), [tokens[i] for i in user], special=True)
    seqs = [[rng.randrange(len(tokens)) for _ in range(rng.randint(1, 20))] for _ in range(100)]
    seqs += [[0, ctl[5], 1000, user[0], 1]]
    answers = tok_requests(path, [{"ids": s, "skip_special": k} for s in seqs for k in (False, True)])
    for i, s in enumerate(seqs):
        for k in (False, True):
            got = answers[2 * i + int(k)]
            assert got["stream"] == ref.decode(s, skip_special_tokens=k), (s, k)
    (info,) = tok_requests(path, [{"info": True}])
    assert info["vocab_size"] == len(tokens) and info["bos"] == 0 and info["eos"] == 1
    assert info["add_bos"] and info["model"] == "gpt2" and info["pre"] == "deepseek-v3"
    a, b = tok_requests(path, [{"text": "Hi", "bos": True}, {"text": "Hi"}])
    assert a == [0] + b
    # the big arrays read back exactly (C reader against the values written)
    d = dump(path)
    kv = {x["key"]: x["value"] for x in d["kv"]}
    assert kv["tokenizer.ggml.tokens"] == list(tokens)
    assert kv["tokenizer.ggml.token_type"] == list(types)
    assert kv["tokenizer.ggml.merges"] == list(deepseek_meta()[2])


def test_unsupported_tokenizers_are_named(tmp_path):
    tokens = [chr(c) for c in range(33, 127)] + ["ab"]
    types = [NORMAL] * len(tokens)
    cases = [("llama", "smollm", '"llama" (SentencePiece) is not supported'),
             ("gpt2", "falcon", "pre-tokenizer 'falcon' is not supported (known: deepseek-llm, deepseek-v3, "
                                "gpt-2, gpt2, llama-bpe, llama3, qwen2, smollm)"),
             ("gpt2", None, "tokenizer.ggml.pre is missing")]
    for i, (model, pre, want) in enumerate(cases):
        p = tmp_path / f"u{i}.gguf"
        write_tok_gguf(p, tokens, types, ["a b"], pre, model=model)
        r = run_tool("tok", p, inp="")
        assert r.returncode == 1 and want in r.stderr and str(p) in r.stderr, r.stderr
    p = tmp_path / "ok.gguf"
    write_tok_gguf(p, tokens, types, ["a b"], "gpt2")
    assert tok_requests(p, [{"text": "ab!"}]) == [[len(tokens) - 1, 0]]


# ---- chat templates against jinja2 ----------------------------------------------------

CHAT_EXTRA = (("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL), ("<|begin_of_text|>", CONTROL),
              ("<|start_header_id|>", CONTROL), ("<|end_header_id|>", CONTROL),
              ("<|eot_id|>", CONTROL))


def random_conversation(rng, texts):
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": rng.choice(texts)})
    for _ in range(rng.randint(0, 4)):
        msgs.append({"role": "user", "content": rng.choice(texts)})
        if rng.random() < 0.1:
            msgs.append({"role": "system", "content": rng.choice(texts)})
        if rng.random() < 0.15:
            msgs.append({"role": "tool", "content": rng.choice(texts)})
        msgs.append({"role": "assistant", "content": rng.choice(texts)})
    if rng.random() < 0.6:
        msgs.append({"role": "user", "content": rng.choice(texts)})
    return msgs


@need_vocab
@pytest.mark.parametrize("name,template", [("smollm2", SMOLLM2_TEMPLATE), ("llama3", LLAMA3_TEMPLATE)],
                         ids=["smollm2", "llama3"])
def test_chat_matches_jinja2(tmp_path, name, template):
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    tokens, types, merges, _ = deepseek_meta()
    n = len(tokens)
    extra_tokens = [t for t, _ in CHAT_EXTRA]
    bos = n + extra_tokens.index("<|begin_of_text|>" if name == "llama3" else "<|im_start|>")
    path = tmp_path / f"chat-{name}.gguf"
    write_tok_gguf(path, tokens + tuple(extra_tokens), types + tuple(t for _, t in CHAT_EXTRA),
                   merges, "deepseek-v3", bos=bos, eos=n + 1, add_bos=name == "llama3",
                   template=template)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    tmpl = env.from_string(template)
    rng = random.Random(31 if name == "llama3" else 37)
    texts = [s for s in corpus() if "<|" not in s and "<｜" not in s][:500]
    texts += ["", "  padded  ", "\n\nlines\n\n", "\u3000ideographic\u00a0", "\t"]
    convs = [(random_conversation(rng, texts), rng.random() < 0.7) for _ in range(150)]
    convs += [([], True), ([], False), ([{"role": "user", "content": "hi"}], True)]
    answers = tok_requests(path, [{"chat": m, "gen": g} for m, g in convs])
    ref = hf_for("deepseek-v3", CHAT_EXTRA)
    for (msgs, gen), a in zip(convs, answers):
        assert "error" not in a, a
        want = tmpl.render(messages=msgs, add_generation_prompt=gen, bos_token="<|begin_of_text|>")
        assert a["template"] == name
        assert a["text"] == want, msgs
        assert a["ids"] == ref.encode(a["text"], add_special_tokens=False).ids
    # the markers are single ids
    a = answers[-1]
    marker = "<|im_start|>" if name == "smollm2" else "<|start_header_id|>"
    assert n + extra_tokens.index(marker) in a["ids"]

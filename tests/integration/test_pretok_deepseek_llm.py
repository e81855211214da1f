"""The "deepseek-llm" pre-tokenizer (DeepSeek LLM / V2 / V2-Lite; GGUF
tokenizer.ggml.pre "deepseek-llm") against Hugging Face `tokenizers`.

The reference is `pre_tokenizers.Sequence([Split(Regex(p), "isolated") for p
in PATTERNS])` run by HF's own regex engine (Oniguruma) on the pattern texts
below, which are llama.cpp's DEEPSEEK_LLM list (non-ASCII written as \\u
escapes so that no editor NFC-normalizes them: U+1F7D, U+1FBE, U+1FD3,
U+1FDB, U+2126, U+212A would otherwise turn into other code points).  Ours is
tok_pretokenize() with tok_pretok_preset("deepseek-llm") through
tests/tools/tok_tool ({"pretok": s, "preset": "deepseek-llm"}).

Compared, for ~1,300 strings: the list of (piece text, (start, end)) where
start/end are code point offsets into the string (HF's offsets; ours are
accumulated from our pieces, which must also concatenate back to the input).
The strings: fixed edge cases (CR/LF runs, whitespace at both ends, "$"
before "\\n" inside a piece, the ideographic space that is both \\s and in the
punctuation class), every endpoint of every range of the letter class
(parsed here from the regex text) with its neighbours, and seeded random
mixes of ASCII, punctuation, many kinds of whitespace, Latin with accents,
Greek (extended), Cyrillic, Armenian, Georgian, Cherokee, CJK, kana, Hangul,
fullwidth forms, digits of several scripts, marks and emoji.
"""
import json
import random
import subprocess

import pytest

from conftest import binary

tokenizers = pytest.importorskip("tokenizers")

PATTERNS = [
    "[\r\n]",
    "\\s?[A-Za-z\u00B5\u00C0-\u00D6\u00D8-\u00F6\u00F8-\u01BA\u01BC-\u01BF\u01C4-\u0293"
    "\u0295-\u02AF\u0370-\u0373\u0376\u0377\u037B-\u037D\u037F\u0386\u0388-\u038A\u038C"
    "\u038E-\u03A1\u03A3-\u03F5\u03F7-\u0481\u048A-\u052F\u0531-\u0556\u10A0-\u10C5"
    "\u13A0-\u13F5\u13F8-\u13FD\u1C90-\u1CBA\u1CBD-\u1CBF\u1D00-\u1D2B\u1D6B-\u1D77"
    "\u1D79-\u1D9A\u1E00-\u1F15\u1F18-\u1F1D\u1F20-\u1F45\u1F48-\u1F4D\u1F50-\u1F57"
    "\u1F59\u1F5B\u1F5D\u1F5F-\u1F7D\u1F80-\u1FB4\u1FB6-\u1FBC\u1FBE\u1FC2-\u1FC4"
    "\u1FC6-\u1FCC\u1FD0-\u1FD3\u1FD6-\u1FDB\u1FE0-\u1FEC\u1FF2-\u1FF4\u1FF6-\u1FFC"
    "\u2102\u2107\u210A-\u2113\u2115\u2119-\u211D\u2124\u2126\u2128\u212A-\u212D"
    "\u212F-\u2134\u2139\u213C-\u213F\u2145-\u2149\u214E\u2183\u2184\u2C00-\u2C7B"
    "\u2C7E-\u2CE4\u2CEB-\u2CEE\u2CF2\u2CF3\uA640-\uA66D\uA680-\uA69B\uA722-\uA76F"
    "\uA771-\uA787\uA78B-\uA78E\uAB70-\uABBF\uFB00-\uFB06\uFB13-\uFB17\uFF21-\uFF3A"
    "\uFF41-\uFF5A\U00010400-\U0001044F\U000104B0-\U000104D3\U000104D8-\U000104FB"
    "\U00010C80-\U00010CB2\U00010CC0-\U00010CF2\U000118A0-\U000118DF"
    "\U0001E900-\U0001E943]+",
    "\\s?[!-/:-~\uFF01-\uFF0F\uFF1A-\uFF5E\u2018-\u201F\u3000-\u3002]+",
    "\\s+$",
    "[\u4E00-\u9FA5\u0800-\u4E00\uAC00-\uD7FF]+",
    "\\p{N}+",
]

WS = [" ", "  ", "\t", "\n", "\r", "\r\n", "\n\n", "\x0b", "\x0c", "\x85", "\xa0", "\u1680",
      "\u2003", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", " \u3000", "\u3000 "]
POOLS = {
    "ascii": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "punct": "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "latin": "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßĀāĂăŁłŒœŠšŸŽžƀƻǅǆɐʔʕʰ",
    "greek": "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔΩάέήίόύώϐϑϕ\u1f00\u1f7d\u1fbe\u1fd3\u1fdb\u1fe5\u0374\u0375",
    "cyr_etc": "абвгдежзийклмнопрстуфхцчшщъыьэюяЁЖЯԱԲԳաբգ\u10a0\u10d0\u13a0\uab70",
    "letterlike": "\u2102\u2107\u210e\u2115\u2124\u2126\u2127\u2128\u212a\u212b\u212e\u2132\u2135",
    "cjk": "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
    "kana": "あいうえおかきくけこアイウエオカキクケコー・",
    "hangul": "가나다라마바사아자차카타파하한국어\u3131\u314f",
    "fullwidth": "ＡＢＣａｂｃ！？（）＠［］～０１２：；、。「」『』",
    "quotes": "\u2018\u2019\u201a\u201b\u201c\u201d\u201e\u201f\u2013\u2014\u2026\u3001\u3002\u3003",
    "digits": "0123456789٠١٢٣٤٥٦٧٨٩०१२३४५६७८९０１２³²¹½ⅠⅡⅫ〇〡〢",
    "marks": "\u0301\u0308\u0327\u064e\u093f\u0e31\u302a",
    "emoji": "😀🎉👍🏽❤️🚀🤖\u200d\u2764\ufe0f",
    "other": "\u0627\u0644\u0639\u0631\u0628\u064a\u05d0\u05d1\u0915\u0916\u0e01\u0e02\u0800"
             "\u3041\ud7ff\uffff\U00010000\U0001e900\U0001e943\U0001e944\U00010cb3",
}

EDGE = [
    "", " ", "\n", "\r\n", "\n\n\n", "a\n", "a\r\nb", " \n ", "abc", " abc", "  abc", "abc  ",
    "Hello, world!", "Hello world", "  Hello  world  ", "x  \n  y", "a  \n\n b", "a \n b  ",
    "  5  ", "12345 67890", "3.14159", "a1b2c3", "\u3000abc", "\u3000\u3000!", "abc\u3000",
    "abc \u3000", "\u3000。", "中文。English", "한국어 텍스트", "ＦＵＬＬ　ｗｉｄｔｈ！",
    "ώ\u1f7d\u03ce", "Ω\u2126\u03a9", "K\u212aK", "\u1fbeι", "\u1fd3ΐ", "\u1fdb\u038a",
    "\t\ttab", "tab\t\t", "x\u00a0y", "x\u2028y", "\u2029", "\x85a", "end \x85",
    "你好，世界！", "it's don't", "e\u0301t\u00e9", "😀 😀", "a😀b", "  😀  ",
    "١٢٣ ٤٥", "ⅫⅠ", "x²+y²", "«quoted»", "\u201chi\u201d", "--flag=value", "a/b\\c",
    "def f(x):\n    return x ** 2  # square\n",
]


def letter_class_endpoints():
    """Every range endpoint of pattern 2's class and its neighbours, read from
    the regex text itself (not from the C table under test)."""
    body = PATTERNS[1][PATTERNS[1].index("[") + 1:PATTERNS[1].rindex("]")]
    cps, i = set(), 0
    while i < len(body):
        if i + 2 < len(body) and body[i + 1] == "-":
            lo, hi = ord(body[i]), ord(body[i + 2])
            i += 3
        else:
            lo = hi = ord(body[i])
            i += 1
        assert lo <= hi, (hex(lo), hex(hi))
        cps |= {lo - 1, lo, lo + 1, hi - 1, hi, hi + 1}
    return sorted(c for c in cps if 0 < c < 0x110000 and not 0xD800 <= c <= 0xDFFF)


def corpus():
    rng = random.Random(20240617)
    texts = list(EDGE)
    ends = [chr(c) for c in letter_class_endpoints()]
    for k in range(0, len(ends), 3):   # endpoints in small mixed groups
        texts.append(" ".join(ends[k:k + 3]) + rng.choice(["", " ", "!", "1", "\n"]))
        texts.append("".join(ends[k:k + 3]))
    names = list(POOLS)
    for _ in range(1000):
        parts = []
        for _ in range(rng.randint(1, 10)):
            r = rng.random()
            if r < 0.25:
                parts.append(rng.choice(WS))
            else:
                pool = POOLS[rng.choice(names)]
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        texts.append("".join(parts))
    return texts


def hf_pretok():
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), "isolated") for p in PATTERNS])


def tiny_tokenizer_json(path):
    """Any loadable tokenizer.json: tok_tool needs one to start; the
    "pretok" requests below do not use it."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    d = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
         "normalizer": None,
         "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                           "use_regex": True},
         "post_processor": None,
         "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                     "use_regex": True},
         "model": {"type": "BPE", "dropout": None, "unk_token": None,
                   "continuing_subword_prefix": None, "end_of_word_suffix": None,
                   "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                   "vocab": {c: i for i, c in enumerate(chars)}, "merges": []}}
    path.write_text(json.dumps(d))
    return path


def our_pieces(tmp_path, texts):
    tj = tiny_tokenizer_json(tmp_path / "tokenizer.json")
    inp = "".join(json.dumps({"pretok": s, "preset": "deepseek-llm"}, ensure_ascii=True) + "\n"
                  for s in texts if s)
    r = subprocess.run([binary("tests/tok_tool"), str(tj)], input=inp, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")[:-1]   # not splitlines(): U+2028 etc. appear raw
    answers = iter(json.loads(x) for x in lines)
    out = {s: (next(answers) if s else []) for s in texts}
    assert next(answers, None) is None, "more answers than requests"
    return out


def with_offsets(pieces):
    out, at = [], 0
    for p in pieces:
        assert isinstance(p, str), p   # an {"error": ...} answer is not a list of str
        out.append((p, (at, at + len(p))))
        at += len(p)
    return out


def test_pieces_and_offsets_match_hf(tmp_path):
    texts = corpus()
    assert len(texts) >= 1000
    ref = hf_pretok()
    ours = our_pieces(tmp_path, texts)
    bad = []
    for s in texts:
        got = with_offsets(ours[s])
        assert "".join(ours[s]) == s, (s, ours[s])
        want = [(p, tuple(o)) for p, o in ref.pre_tokenize_str(s)]
        if got != want:
            bad.append((s, got, want))
    assert not bad, f"{len(bad)} of {len(texts)} differ; first: {bad[0]!r}"


def test_long_whitespace_runs_stay_linear(tmp_path):
    """\\s+$ fails at every position of a run that neither reaches the end nor
    holds a "\\n": such runs must not be rescanned per position (the
    reference does rescan them: it is compared on short runs only)."""
    import time

    def runs(n):
        return [" " * n + "5", "5" + " " * n + "5 ", "\u3000" * n + "1", " " * n,
                "x" + " \n" * n + " y"]
    ref = hf_pretok()
    short = runs(1500)
    ours = our_pieces(tmp_path, short)
    for s in short:
        assert with_offsets(ours[s]) == [(p, tuple(o)) for p, o in ref.pre_tokenize_str(s)]
    n = 400_000   # quadratic rescanning would be ~1e11 steps here
    t0 = time.perf_counter()
    ours = our_pieces(tmp_path, runs(n))
    dt = time.perf_counter() - t0
    assert "".join(ours[" " * n + "5"]) == " " * n + "5"
    assert dt < 5, f"{dt:.1f} s for runs of {n}"


def test_preset_is_known_by_name(tmp_path):
    """An unknown preset is refused and the message lists deepseek-llm."""
    tj = tiny_tokenizer_json(tmp_path / "tokenizer.json")
    r = subprocess.run([binary("tests/tok_tool"), str(tj)],
                       input=json.dumps({"pretok": "x", "preset": "deepseek-nope"}) + "\n",
                       capture_output=True, text=True, timeout=60)
    err = json.loads(r.stdout)["error"]
    assert "deepseek-nope" in err and "deepseek-llm" in err, err


def test_ws_eol_alone_follows_dollar_before_newline(tmp_path):
    """In the preset "\\s+$" never sees a "\\n" inside a piece (pattern 1
    isolates them), but as a pattern of its own in a tokenizer.json "$" also
    matches before "\\n" (Oniguruma, Ruby syntax).  Compared as ids: vocab =
    bytes + every pair of whitespace bytes, so a piece border moved between
    two whitespace characters changes the ids."""
    from tokenizers import Tokenizer
    tj = json.loads(tiny_tokenizer_json(tmp_path / "base.json").read_text())
    vocab = tj["model"]["vocab"]
    ws = ["\u0120", "\u010a", "\u0109", "\u010d"]   # space, \n, \t, \r in the byte alphabet
    for a in ws:
        for b in ws:
            tj["model"]["merges"].append(f"{a} {b}")
            vocab[a + b] = len(vocab)
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": PATTERNS[3]}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tj))
    ref = Tokenizer.from_file(str(path))
    rng = random.Random(7)
    texts = ["a  \n\n b", "a \n b  ", "x \t\n\t y", " \n", "\n ", "a\r\n\r\nb"]
    texts += ["".join(rng.choice("ab \n\t\r") for _ in range(rng.randint(1, 12)))
              for _ in range(300)]
    inp = "".join(json.dumps({"text": s}) + "\n" for s in texts)
    r = subprocess.run([binary("tests/tok_tool"), str(path)], input=inp, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = [json.loads(x) for x in r.stdout.split("\n")[:-1]]
    assert len(got) == len(texts)
    for s, g in zip(texts, got):
        assert g == ref.encode(s, add_special_tokens=False).ids, s

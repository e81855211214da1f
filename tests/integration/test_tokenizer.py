"""The C tokenizer (engine/tok.c) against Hugging Face `tokenizers` on the real
DeepSeek-V3 tokenizer.json, and the chat renderer (engine/chat.c) against the
spec's examples and the real chat_template rendered by jinja2.

tests/tools/tok_tool.c is run once per batch: one JSON request per line on
stdin, one answer per line on stdout.  The corpus is generated here,
deterministically (fixed seeds), >= 1,000 strings of many kinds.
"""
import functools
import json
import random
import subprocess
import sys
import time
import unicodedata

import pytest

from conftest import ROOT, binary
from tests.fixtures.shared import SHARED_DATA, needs_shared_data

TOKDIR = SHARED_DATA / "deepseek-v3"
TOKJSON = TOKDIR / "tokenizer.json"
TOKCFG = TOKDIR / "tokenizer_config.json"

pytestmark = needs_shared_data("deepseek-v3/tokenizer.json")


# ---- running the tool ---------------------------------------------------------

def tool(requests, tokjson=TOKJSON, cfg=TOKCFG, args=()):
    """Sends requests (dicts) to tok_tool; returns (answers, stderr)."""
    cmd = [binary("tests/tok_tool"), *args, str(tokjson)] + ([str(cfg)] if cfg else [])
    inp = "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in requests)
    r = subprocess.run(cmd, input=inp, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")[:-1]  # not splitlines(): U+2028 etc. may appear raw
    assert len(lines) == len(requests), (len(lines), len(requests), r.stderr[-2000:])
    return [json.loads(x) for x in lines], r.stderr


@functools.lru_cache(maxsize=None)
def hf(path=TOKJSON):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))


def hf_from_dict(d):
    from tokenizers import Tokenizer
    return Tokenizer.from_str(json.dumps(d))


def oracle_unicode_major():
    """Unicode major version the reference regex engine knows (probe by letters)."""
    from tokenizers import Regex, pre_tokenizers
    pt = pre_tokenizers.Split(Regex(r"\p{L}+"), behavior="isolated")
    probes = [(16, 0x10D4A), (15, 0x1E030), (14, 0x1DF00)]  # Garay, Cyrillic mod., Latin ext
    for major, cp in probes:
        if len(pt.pre_tokenize_str("a" + chr(cp) + "b")) == 1:
            return major
    return 0


# ---- the corpus ----------------------------------------------------------------

WORDS = ("the quick brown fox jumps over lazy dog time person year way day thing man world "
         "life hand part child eye woman place work week case point government company "
         "number group problem fact be have do say get make go know take see come think "
         "look want give use find tell ask seem feel try leave call good new first last "
         "long great little own other old right big high different small large next early "
         "young important few public bad same able tokenization encoder Mixture-of-Experts "
         "DeepSeek transformer's naïve café résumé coöperate façade jalapeño").split()
CONTRACTIONS = ["don't", "I'M", "we'll", "y'all", "rock'n'roll", "it's", "They're", "you've",
                "she'd", "I'm", "O'Neil", "'tis", "can't've", "WE'LL", "ma'am", "’twas", "isn’t"]
CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "const add = (a, b) => a + b;\nconsole.log(`sum=${add(1, 2)}`);",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}",
    "func (s *Server) Handle(w http.ResponseWriter, r *http.Request) error {\n\treturn nil\n}",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
    "<div class=\"row\"><a href=\"/x?y=1&z=2\">link</a></div>\r\n",
    "#include <stdio.h>\nint main(void){printf(\"%d\\n\",42);return 0;}",
    "if [ -f \"$HOME/.bashrc\" ]; then . ~/.bashrc; fi\n",
    "x = {'a': [1, 2.5, -3e10], \"b\": None}\nprint(x['a'][::-1])",
    "public static void main(String[] args) throws IOException {}",
    "    \t  mixed indentation\n\t\tline two  \n",
    "a:=b; c+=d; e->f; g::h; i<<=2; j>>>=3; k!==l; m??n; o?.p",
    "@decorator\nclass Foo(Bar, metaclass=Meta):\n    __slots__ = ('x',)\n",
    "matrix = [[1,2,3],[4,5,6]]\r\nresult = np.dot(A, B.T)\r\n",
]
CJK = ["你好，世界！", "我们今天去北京吧。", "深度求索人工智能", "龘龍龟龥龦", "繁體中文與简体中文",
       "東京タワーへ行きましょう", "ひらがなとカタカナ、漢字", "ｶﾀｶﾅ半角", "ラーメン・ギョーザ",
       "日本語の文章です。", "한국어 문장입니다", "안녕하세요, 세계!", "ㄱㄴㄷ ㅏㅑ", "丁丂七丄〇々〆",
       "中文123数字４５６", "（全角括号）【标题】《书名》", "㍿㌔㌢", "𠀀𠀁𪚥𰀀"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵🇺🇸🇩🇪", "#️⃣", "1️⃣", "❤️", "🧑🏿‍🚀", "🫠", "☕️",
         "👩‍❤️‍💋‍👨", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "✊🏻✊🏼✊🏽", "🙂🙃"]
COMBINING = ["e\u0301", "a\u0308\u0304", "Z\u0351\u0300\u0311\u0322a\u0328\u0346l\u034dg\u0353o",
             "नमस्ते दुनिया", "สวัสดีครับ", "Tiếng Việt có dấu", "Tie\u0302\u0301ng Vie\u0323\u0302t",
             "\u0301leading mark", "ক্ষ", "ﷺ", "Å vs A\u030a", "ğ̆̆", "\u0903\u093e"]
RTL = ["مرحبا بالعالم", "שָׁלוֹם עוֹלָם", "العربية 123 English", "فارسی ۱۲۳۴", "ע״ב ג׳",
       "\u202eRLO override\u202c", "اللُّغَةُ", "ܫܠܡܐ", "ދިވެހި"]
WHITESPACE = ["  ", "\t", "\r\n", "\n\n\n", " \n ", "a  b", "a\t\tb", "trailing   ", "   leading",
              "x\r\ny", "x\r\r\ny", "\u00a0nbsp\u00a0", "ideo\u3000space", "ls\u2028ps\u2029",
              "\x0b\x0c", "nel\x85x", " \t \n \t ", "end\n", "a \nb", "a\n b", "  \n\n  x  ",
              "\u2003em\u2009thin\u200bzw", "\u180e\ufeffx"]
PUNCT = ["!!!", "?!...", "—", "«guillemets»", "()[]{}", "...", " .\n", "!!\n\n", ", ;\r\n",
         "“quotes” ‘single’", "¿Qué? ¡Sí!", "#$%&*+", "--->", "<<<>>>", "~~~", "’s", "'s'", "\"'\"",
         "...\n\n\n", "。、！？", "†‡§¶", "±×÷≠≤≥", "€£¥₹₿", "«»‹›", "!a", "(abc)", "[x]y", ".NET",
         "-verbose", "_private", "@user", "#tag", "$var", "%d", "&amp;", "*ptr", "/usr/bin", "\\n"]
URLS = ["https://example.com/path/to/page?query=1&b=two#frag", "http://127.0.0.1:8080/v1/chat",
        "mailto:someone@example.org", "ftp://files.example.net/pub/file.tar.gz",
        "www.deepseek.com", "user@mail.example.co.uk", "C:\\Program Files\\App\\app.exe",
        "/home/user/.config/app/settings.json", "git@github.com:org/repo.git"]
MARKDOWN = ["# Title\n\nSome *italic* and **bold** text.\n",
            "- item one\n- item two\n  - nested\n", "1. first\n2. second\n",
            "```python\nprint('hi')\n```\n", "| a | b |\n|---|---|\n| 1 | 2 |\n",
            "> quote line\n> another\n", "[link](https://x.y/z) and ![img](a.png)",
            "`inline code` and ~~strike~~", "---\n\n***\n", "Term\n: definition\n"]
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<|EOT|>", "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>", "<｜place▁holder▁no▁42｜>",
            "<｜fim▁hole｜>", "<｜▁pad▁｜>", "<think>", "</think>", "<｜User", "User｜>",
            "<｜User｜｜>", "<<｜User｜>>", "<｜place▁holder▁no▁797｜>", "<｜tool▁outputs▁end｜>"]


def numbers(rng):
    out = []
    for n in range(1, 41):
        out.append("".join(rng.choice("0123456789") for _ in range(n)))
    out += ["3.14159", "-42", "1,234,567.89", "1e-9", "0x1F", "v1.2.3", "2024-12-26", "12:30:45",
            "abc123def", "a1b2c3", "１２３", "٠١٢٣٤٥", "१२३", "²³¹", "½¾", "Ⅻⅻ", "①②③", "𝟘𝟙𝟚",
            "10⁻³", "1 000 000", "99.9%", "$1,000", "#1", "x²+y²", "3rd 2nd 1st"]
    return out


def prose(rng):
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 25))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words) + 1), rng.choice(CONTRACTIONS))
    s = " ".join(words)
    s = s[0].upper() + s[1:] + rng.choice([".", "!", "?", "...", ";", "", ":\n", ".\n\n"])
    return s


def random_code_point(rng):
    while True:
        plane = rng.choice([0, 0, 0, 1, 1, 2, 3, 4, 9, 14, 15, 16])
        cp = plane * 0x10000 + rng.randrange(0x10000)
        if 0xD800 <= cp <= 0xDFFF:
            continue
        # Keep what every Unicode version since 14.0 classifies alike: code points
        # assigned in this Python's tables, or in planes 4..13 (unassigned), or
        # noncharacters; new assignments may differ from the reference's version.
        if unicodedata.category(chr(cp)) != "Cn" or 4 <= plane <= 13 or (cp & 0xFFFE) == 0xFFFE:
            return chr(cp)


@functools.lru_cache(maxsize=None)
def _corpus():
    rng = random.Random(20250611)
    pools = {
        "prose": [prose(rng) for _ in range(150)],
        "contractions": CONTRACTIONS + [c.upper() for c in CONTRACTIONS],
        "code": CODE,
        "numbers": numbers(rng),
        "cjk": CJK,
        "emoji": EMOJI,
        "combining": COMBINING,
        "rtl": RTL,
        "whitespace": WHITESPACE,
        "punct": PUNCT,
        "urls": URLS,
        "markdown": MARKDOWN,
        "specials": SPECIALS,
    }
    out = []
    for name, pool in pools.items():
        out += pool
    # specials embedded in text
    for _ in range(60):
        parts = [rng.choice(SPECIALS), rng.choice(WORDS), rng.choice(PUNCT), " ", "\n",
                 rng.choice(CJK), rng.choice(EMOJI)]
        rng.shuffle(parts)
        out.append("".join(parts[:rng.randint(2, 7)]))
    # random code points from many planes
    for _ in range(150):
        out.append("".join(random_code_point(rng) for _ in range(rng.randint(1, 12))))
    # random concatenations of fragments of every kind (interaction of the splits)
    all_frags = [f for pool in pools.values() for f in pool]
    seps = ["", " ", "  ", "\n", "\t", "\r\n", " \n", "\u3000", "-", "'", "\u0301"]
    for _ in range(450):
        k = rng.randint(2, 8)
        out.append("".join(rng.choice(all_frags) + rng.choice(seps) for _ in range(k)))
    # short random strings over a small alphabet that stresses the patterns
    alpha = ["a", "Z", "1", "2", " ", "  ", "\n", "\r", "\t", "'", "s", "!", "(", ".", "é", "\u0301",
             "中", "か", "ア", "😀", "١", "\u00a0", "_", "<", "｜", "▁", "ー", "〇", "々"]
    for _ in range(250):
        out.append("".join(rng.choice(alpha) for _ in range(rng.randint(1, 16))))
    # lengths: empty, long words, long runs
    out += ["", "a", " ", "\n", "x" * 1000, "9" * 301, " " * 200, "\n" * 50 + "x",
            "ab" * 300, "é" * 257, "中" * 500, "😀" * 100, "- " * 200]
    return tuple(out)


def corpus():
    return list(_corpus())


# ---- encoding -------------------------------------------------------------------

def test_encode_matches_hf_on_corpus():
    texts = corpus()
    assert len(texts) >= 1000
    ref = hf()
    answers, _ = tool([{"text": s} for s in texts])
    bad = []
    for s, got in zip(texts, answers):
        want = ref.encode(s, add_special_tokens=False).ids
        if got != want:
            bad.append((s, got, want))
    assert not bad, f"{len(bad)} of {len(texts)} differ; first: {bad[:3]!r}"


def test_decode_round_trips_corpus():
    texts = corpus()
    enc, _ = tool([{"text": s} for s in texts])
    dec, _ = tool([{"ids": ids} for ids in enc])
    for s, ids, d in zip(texts, enc, dec):
        assert bytes.fromhex(d["hex"]).decode("utf-8") == s, (s, ids)
        assert d["stream"] == s, (s, ids)


def test_decode_matches_hf_including_special_skipping():
    rng = random.Random(7)
    ref = hf()
    seqs = [[rng.randrange(128815) for _ in range(rng.randint(1, 30))]
            for _ in range(200)]
    seqs += [[0, 128803, 19923, 3, 128804, 1], [128805, 128000, 90]]
    answers, _ = tool([{"ids": s, "skip_special": skip} for s in seqs for skip in (False, True)])
    i = 0
    for s in seqs:
        for skip in (False, True):
            got = answers[i]
            i += 1
            want = ref.decode(s, skip_special_tokens=skip)
            # HF replaces invalid UTF-8 like the streaming decoder does
            assert got["stream"] == want, (s, skip)
            assert bytes.fromhex(got["hex"]).decode("utf-8", "replace") == want, (s, skip)


def test_parse_special_off_tokenizes_markers_as_text():
    d = json.loads(TOKJSON.read_text())
    d["added_tokens"] = []
    ref = hf_from_dict(d)  # the same model with no added tokens: pure BPE reference
    texts = [s for s in corpus() if "<" in s or "｜" in s][:300] + SPECIALS
    answers, _ = tool([{"text": s, "special": False} for s in texts])
    for s, got in zip(texts, answers):
        assert got == ref.encode(s, add_special_tokens=False).ids, s
    # and with parsing on, the markers are single ids
    answers, _ = tool([{"text": "<｜User｜>", "special": True}, {"text": "<｜User｜>", "special": False}])
    assert answers[0] == [128803]
    assert 128803 not in answers[1] and len(answers[1]) > 1


def test_bos_from_config_and_info():
    answers, _ = tool([{"info": True}, {"text": "Hi", "bos": True}, {"text": "Hi"}])
    assert answers[0]["vocab_size"] == 128815
    assert answers[0]["bos"] == 0 and answers[0]["eos"] == 1
    assert answers[1] == [0] + answers[2]
    answers, _ = tool([{"info": True}], cfg=None)
    assert answers[0]["bos"] == -1 and answers[0]["eos"] == -1


def test_newer_unicode_letters_when_reference_knows_them():
    # Our tables are Unicode 16.0; compare characters first assigned in 15.0 and
    # 16.0 only when the reference regex engine is at least as new.
    major = oracle_unicode_major()
    texts = []
    if major >= 15:
        texts += ["ab\U0001E030cd", "x\U00031350\U00031351 y", "\U00011F04\U00011F05 1"]
    if major >= 16:
        texts += ["q\U00010D4A\U00010D4Bz", " \U00011380\U00011381.", "\U0001CC00\U0001CC01"]
    if not texts:
        pytest.skip(f"reference knows Unicode {major} only")
    ref = hf()
    answers, _ = tool([{"text": s} for s in texts])
    for s, got in zip(texts, answers):
        assert got == ref.encode(s, add_special_tokens=False).ids, ascii(s)


def test_load_and_encode_speed():
    rng = random.Random(3)
    frags = [f for f in corpus() if f]
    text = []
    size = 0
    while size < 1 << 20:
        f = rng.choice(frags)
        text.append(f)
        size += len(f.encode())
    text = "".join(text)
    t0 = time.monotonic()
    answers, err = tool([{"text": text}], args=("--time",))
    wall = time.monotonic() - t0
    fields = dict(kv.split("=") for kv in err.split())
    load_s, enc_s = float(fields["load_s"]), float(fields["encode_s"])
    assert load_s < 0.9, f"tokenizer.json load took {load_s:.2f}s"
    assert enc_s < 0.9, f"encoding 1 MiB took {enc_s:.2f}s"
    assert answers[0] == hf().encode(text, add_special_tokens=False).ids
    assert wall < 10
    # long runs must stay linear (a bounded quantifier once rescanned its run)
    runs = ["7" * (1 << 19), " " * (1 << 19) + "x", "a" * (1 << 19), "\t\n" * (1 << 18)]
    answers, err = tool([{"text": s} for s in runs], args=("--time",))
    enc_s = float(dict(kv.split("=") for kv in err.split())["encode_s"])
    assert enc_s < 1.5, f"encoding 2 MiB of long runs took {enc_s:.2f}s"
    assert answers[0] == hf().encode(runs[0], add_special_tokens=False).ids


# ---- other pre-tokenizers and added-token flags, same vocab --------------------

def modified(tmp_path, name, fn):
    d = json.loads(TOKJSON.read_text())
    fn(d)
    p = tmp_path / name
    p.write_text(json.dumps(d, ensure_ascii=False))
    return p, hf_from_dict(d)


LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def split_then_bytelevel(pattern):
    def fn(d):
        d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    return fn


@pytest.mark.parametrize("name,fn", [
    ("gpt2", lambda d: d.__setitem__("pre_tokenizer", {
        "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True})),
    ("llama3", split_then_bytelevel(LLAMA3)),
    ("qwen2", split_then_bytelevel(QWEN2)),
])
def test_other_pretokenizers_match_hf(tmp_path, name, fn):
    path, ref = modified(tmp_path, f"{name}.json", fn)
    rng = random.Random(11)
    texts = rng.sample(corpus(), 400) + ["I'M HERE", "it'S", "'ſ 'Ll", "don't'll'VE", "a'b", "''s",
                                     "'ſa", "'Sa", "'LLama", "x'REd", "'\u212aa"]
    answers, _ = tool([{"text": s} for s in texts], tokjson=path, cfg=None)
    for s, got in zip(texts, answers):
        assert got == ref.encode(s, add_special_tokens=False).ids, (name, s)


def test_merges_as_pairs_and_added_token_flags(tmp_path):
    def fn(d):
        d["model"]["merges"] = [m.split(" ") for m in d["model"]["merges"]]
        extra = [("[L]", dict(lstrip=True)), ("[R]", dict(rstrip=True)),
                 ("[LR]", dict(lstrip=True, rstrip=True)), ("[W]", dict(single_word=True)),
                 ("<｜User｜>x", dict(normalized=True))]
        for i, (content, flags) in enumerate(extra):
            d["added_tokens"].append({"id": 128815 + i, "content": content, "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False,
                                      "special": True, **flags})
    path, ref = modified(tmp_path, "flags.json", fn)
    texts = ["a [L] b", "a   [L]b", "[L]", "  [L]  ", "a [R]   b", "a[R]\n\nb", "x \t[LR]\t y",
             "[W] a", "a[W]b", "a [W] b", "1[W]", "[W][W]", "é[W]", " [W]", "<｜User｜>x y",
             "<｜User｜>y", "[L][R][LR]", "\u3000[L]\u3000", "a\u00a0[R]\u00a0b"]
    answers, _ = tool([{"text": s} for s in texts], tokjson=path, cfg=None)
    for s, got in zip(texts, answers):
        assert got == ref.encode(s, add_special_tokens=False).ids, s


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["pre_tokenizer"]["pretokenizers"][0]["pattern"].__setitem__("Regex", r"\p{N}{1,4}"),
     r'Split pattern not supported: "\p{N}{1,4}"'),
    (lambda d: d.__setitem__("normalizer", {"type": "NFC"}), "normalizer 'NFC' is not supported"),
    (lambda d: d["model"].__setitem__("type", "Unigram"), "model type 'Unigram' is not supported"),
    (lambda d: d["pre_tokenizer"]["pretokenizers"][0].__setitem__("behavior", "Removed"),
     "behavior 'Removed' is not supported"),
    (lambda d: d.__setitem__("decoder", {"type": "WordPiece"}), "decoder 'WordPiece' is not supported"),
    (lambda d: d["model"]["merges"].__setitem__(5, "Ġ zzzqqq"), 'token "zzzqqq" is not in the vocab'),
])
def test_unsupported_files_are_rejected_clearly(tmp_path, mutate, message):
    d = json.loads(TOKJSON.read_text())
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d, ensure_ascii=False))
    r = subprocess.run([binary("tests/tok_tool"), str(p)], input="", capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert message in r.stderr, r.stderr


# ---- chat templates -----------------------------------------------------------------

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"


def chat(requests):
    answers, _ = tool(requests)
    for a in answers:
        assert "error" not in a, a
    return answers


def check_ids(ref, answer):
    ids = answer["ids"]
    assert ids == ref.encode(answer["text"], add_special_tokens=False).ids
    assert ids[0] == 0 and ids.count(0) == 1  # BOS once: rendered, not added again


def test_chat_spec_examples_byte_exact():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    v3, r1, auto = chat([{"chat": msgs, "template": "deepseek-v3"},
                         {"chat": msgs, "template": "deepseek-r1"},
                         {"chat": msgs}])
    assert v3["text"] == f"{BOS}S{U}U1{A}A1{EOS}{U}U2{A}"
    assert r1["text"] == f"{BOS}S{U}U1{A}A1{EOS}{U}U2{A}<think>\n"
    assert auto["template"] == "deepseek-v3" and auto["text"] == v3["text"]
    ref = hf()
    for a in (v3, r1):
        check_ids(ref, a)


def test_chat_r1_drops_reasoning_and_tools_render():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "<think>\nplan</think>mid</think>\n\nanswer"},
            {"role": "user", "content": "q2"}]
    r1, v3 = chat([{"chat": msgs, "template": "deepseek-r1"}, {"chat": msgs, "template": "deepseek-v3"}])
    assert r1["text"] == f"{BOS}{U}q{A}\n\nanswer{EOS}{U}q2{A}<think>\n"
    assert v3["text"] == f"{BOS}{U}q{A}<think>\nplan</think>mid</think>\n\nanswer{EOS}{U}q2{A}"
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
             {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    msgs = [{"role": "system", "content": "tools!"}, {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "content": "18C"}, {"role": "tool", "content": "12:00"},
            {"role": "assistant", "content": "It is 18C."}, {"role": "user", "content": "thanks"}]
    (t,) = chat([{"chat": msgs}])
    assert t["text"] == (
        f"{BOS}tools!{U}weather?{A}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        "get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>"
        "function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        f"{EOS}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18C<｜tool▁output▁end｜>\n"
        "<｜tool▁output▁begin｜>12:00<｜tool▁output▁end｜><｜tool▁outputs▁end｜>It is 18C."
        f"{EOS}{U}thanks{A}")
    check_ids(hf(), t)


def random_conversation(rng, texts):
    msgs = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": rng.choice(texts)})
    used_tool = False
    for turn in range(rng.randint(1, 4)):
        msgs.append({"role": "user", "content": rng.choice(texts)})
        if rng.random() < 0.15:
            msgs.append({"role": "system", "content": rng.choice(texts)})
        if not used_tool and rng.random() < 0.3:
            # one run of tool outputs (the hub template's state never resets, so
            # only one run is comparable), then an assistant turn or the end
            used_tool = True
            for _ in range(rng.randint(1, 3)):
                msgs.append({"role": "tool", "content": rng.choice(texts)})
            if rng.random() < 0.3:
                return msgs
        msgs.append({"role": "assistant", "content": rng.choice(texts)})
    if rng.random() < 0.5:
        msgs.append({"role": "user", "content": rng.choice(texts)})
    return msgs


def test_chat_matches_the_real_template_rendered_by_jinja2():
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    cfg = json.loads(TOKCFG.read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    tmpl = env.from_string(cfg["chat_template"])
    rng = random.Random(99)
    # a content holding an added token's text is plain text in our prompt, not
    # that token (test_control_tokens.py); HF's whole-text encoding would match it
    ref = hf()
    added = [t.content for t in ref.get_added_tokens_decoder().values()]
    texts = [s for s in corpus() if s and not any(a in s for a in added)][:400] + ["", "plain"]
    convs = [(random_conversation(rng, texts), rng.random() < 0.7) for _ in range(150)]
    answers = chat([{"chat": m, "gen": g} for m, g in convs])
    for (msgs, gen), a in zip(convs, answers):
        want = tmpl.render(messages=msgs, add_generation_prompt=gen, bos_token=BOS)
        assert a["template"] == "deepseek-v3"
        assert a["text"] == want, msgs
        check_ids(ref, a)


def test_pretokenizer_pieces_match_hf():
    # Split cascade alone (tok_pretokenize), against HF's pre_tokenizer; HF
    # returns pieces in the byte-level alphabet, so map ours the same way.
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in bs}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    pt = hf().pre_tokenizer
    texts = [s for s in corpus() if s][:600]
    answers, _ = tool([{"pretok": s} for s in texts])
    for s, got in zip(texts, answers):
        mapped = ["".join(table[b] for b in p.encode()) for p in got]
        assert mapped == [p for p, _ in pt.pre_tokenize_str(s)], s


def test_generated_unicode_table_is_reproducible(tmp_path):
    ud2 = pytest.importorskip("unicodedata2")
    committed = (ROOT / "engine" / "unicode_tables.c").read_text()
    if f'"{ud2.unidata_version}"' not in committed:
        pytest.skip(f"installed unicodedata2 is Unicode {ud2.unidata_version}")
    out = tmp_path / "t.c"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_unicode.py"), "--module", "unicodedata2",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    assert out.read_text() == committed

"""dsrun's text paths end to end: tokenize/detokenize with the real DeepSeek-V3
tokenizer (a directory with only tokenizer files), chat templating without a
double BOS, generation with stop ids and seeds, on a tiny V3 checkpoint whose
vocabulary is the real tokenizer's size."""
import json
import pathlib
import shutil
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from conftest import ROOT, binary

sys.path.insert(0, str(ROOT))
from tests.fixtures.tiny_models import write_model  # noqa: E402
from tests.fixtures.shared import SHARED_DATA, shared_data  # noqa: E402

TOKDIR = SHARED_DATA / "deepseek-v3"


def dsrun(*args):
    return subprocess.run([binary("dsrun"), *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def hf():
    return Tokenizer.from_file(str(shared_data("deepseek-v3/tokenizer.json")))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """Tiny V3 weights with the real vocabulary size and tokenizer files."""
    shared_data("deepseek-v3/tokenizer_config.json")
    d = write_model("v3", tmp_path_factory.mktemp("v3tok") / "m",
                    overrides={"vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKDIR / f, d / f)
    return d


@pytest.mark.parametrize("text", ["Hello, world!", "你好，世界 — こんにちは 🙂🙂",
                                  "def f(x):\n\treturn x**2  # 12345678",
                                  "<｜User｜>hi<｜Assistant｜>"])
def test_tokenize_matches_hf_and_round_trips(hf, text):
    r = dsrun("-m", TOKDIR, "--tokenize", text)
    assert r.returncode == 0, r.stderr
    ids = json.loads(r.stdout)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    r = dsrun("-m", TOKDIR, "--detokenize", ",".join(map(str, ids)))
    assert r.returncode == 0, r.stderr
    assert r.stdout[:-1] == text  # dsrun ends the text with one newline


def test_detokenize_rejects_out_of_range_id():
    shared_data("deepseek-v3/tokenizer.json")
    r = dsrun("-m", TOKDIR, "--detokenize", "5,999999")
    assert r.returncode != 0 and "999999" in r.stderr


def shown_prompt(stderr):
    """The ids --show-prompt printed: the JSON list line among the log lines
    (a build with the CUDA backend also logs why it runs on the cpu)."""
    lines = [l for l in stderr.splitlines() if l.startswith("[")]
    assert len(lines) == 1, stderr
    return json.loads(lines[0])


def test_chat_prompt_has_one_bos_and_template(chat_model, hf):
    r = dsrun("-m", chat_model, "--chat", "What is 2+2?", "--system", "Be brief.", "-n", "4",
              "--temp", "0", "--show-prompt")
    assert r.returncode == 0, r.stderr
    prompt = shown_prompt(r.stderr)
    want = "<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2+2?<｜Assistant｜>"
    assert prompt == hf.encode(want, add_special_tokens=False).ids
    assert prompt.count(0) == 1 and prompt[0] == 0


def test_raw_prompt_gets_bos_and_generates_text(chat_model, hf):
    r = dsrun("-m", chat_model, "-p", "The capital of France is", "-n", "6", "--temp", "0",
              "--show-prompt", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    prompt = shown_prompt(r.stderr)
    assert prompt == [0] + hf.encode("The capital of France is", add_special_tokens=False).ids
    ids = dsrun("-m", chat_model, "--tokens", ",".join(map(str, prompt)), "-n", "6", "--temp", "0",
                "--ids", "--ignore-eos")
    gen = json.loads(ids.stdout)
    assert len(gen) == 6
    assert r.stdout == hf.decode(gen, skip_special_tokens=False) + "\n"


def test_stop_ids_and_seed(tmp_path):
    d = write_model("v3", tmp_path / "v3")
    base = ["-m", d, "--tokens", "1,2,3,4,5", "-n", "12", "--ids"]
    greedy = json.loads(dsrun(*base, "--temp", "0").stdout)
    assert len(greedy) == 12
    stopped = json.loads(dsrun(*base, "--temp", "0", "--stop-ids", str(greedy[4])).stdout)
    assert stopped == greedy[:greedy.index(greedy[4]) + 1]
    a = json.loads(dsrun(*base, "--temp", "1.0", "--seed", "11").stdout)
    b = json.loads(dsrun(*base, "--temp", "1.0", "--seed", "11").stdout)
    c = json.loads(dsrun(*base, "--temp", "1.0", "--seed", "12").stdout)
    assert a == b and a != c


def test_bad_usage_is_named(tmp_path):
    r = dsrun("-m", tmp_path, "--tokens", "1,x")
    assert r.returncode != 0 and "token ids" in r.stderr
    r = dsrun("--tokens", "1")
    assert r.returncode == 2 and "-m MODEL is required: a checkpoint directory or a .gguf file" in r.stderr
    r = dsrun("-m", tmp_path, "--tokens", "1", "--attn", "fancy")
    assert r.returncode != 0 and "fancy" in r.stderr


def test_bench_json_and_the_interleaved_memory_probe(tmp_path):
    d = write_model("v3", tmp_path / "v3")
    base = ["-m", d, "--bench", "--prompt-len", "9", "-n", "4", "--threads", "2", "--json"]
    r = dsrun(*base)
    assert r.returncode == 0, r.stderr
    plain = json.loads(r.stdout)
    assert set(plain) == {"prefill_tok_s", "decode_tok_s", "peak_rss_bytes"}
    assert plain["prefill_tok_s"] > 0 and plain["decode_tok_s"] > 0
    assert plain["peak_rss_bytes"] > 1 << 20
    r = dsrun(*base, "--membw")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"prefill_tok_s", "decode_tok_s", "peak_rss_bytes", "membw"}
    bw = out["membw"]
    assert set(bw) == {"steps", "decode_tok_s", "read_bytes_s", "triad_bytes_s",
                       "fp8_hot_bytes_s", "bf16_hot_bytes_s"}
    assert bw["steps"] == 4 and bw["decode_tok_s"] > 0
    # any machine moves more than 100 MB/s; the probe's own buffers (224 MB)
    # are not in the reported peak
    assert bw["read_bytes_s"] > 1e8 and bw["triad_bytes_s"] > 1e8
    assert bw["fp8_hot_bytes_s"] > 1e8 and bw["bf16_hot_bytes_s"] > 1e8
    assert out["peak_rss_bytes"] < plain["peak_rss_bytes"] + (64 << 20)
    r = dsrun("-m", d, "--tokens", "1,2", "--membw")
    assert r.returncode != 0 and "--membw is a --bench option" in r.stderr
    r = dsrun("-m", d, "--bench", "-n", "0", "--membw")
    assert r.returncode != 0 and "--membw needs -n" in r.stderr


def test_bench_profile_says_where_a_step_goes(tmp_path):
    """--profile decodes -n more steps with every backend call timed: one
    row per kind of call, costliest first, inside the stretch's wall time;
    per step one lm_head product and one absorbed MLA per layer."""
    d = write_model("v3-fp8", tmp_path / "v3f")
    cfg = json.loads((d / "config.json").read_text())
    layers, vocab, hidden = cfg["num_hidden_layers"], cfg["vocab_size"], cfg["hidden_size"]
    base = ["-m", d, "--bench", "--prompt-len", "9", "-n", "4", "--threads", "2"]
    r = dsrun(*base, "--profile", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"prefill_tok_s", "decode_tok_s", "peak_rss_bytes", "profile"}
    p = out["profile"]
    assert p["steps"] == 4 and p["seconds"] > 0 and p["dropped"] == 0
    rows = p["calls"]
    secs = [c["seconds"] for c in rows]
    assert secs == sorted(secs, reverse=True) and sum(secs) <= p["seconds"]
    calls = {c["call"]: c for c in rows}
    assert calls["mla_attn"]["calls"] == 4 * layers
    assert calls[f"matmul bf16 {vocab}x{hidden}"]["calls"] == 4  # lm_head: BF16 in FP8 checkpoints
    assert calls[f"matmul bf16 {vocab}x{hidden}"]["weight_bytes"] == 4 * vocab * hidden * 2
    for c in rows:
        assert (c["weight_bytes"] > 0) == c["call"].startswith("matmul"), c
    r = dsrun(*base, "--profile")
    assert r.returncode == 0, r.stderr
    text = r.stdout[r.stdout.index("profile: 4 steps of"):].splitlines()
    assert "share" in text[1] and len(text) == 2 + len(rows)
    assert any(line.endswith(" mla_attn") for line in text[2:])
    r = dsrun("-m", d, "--tokens", "1,2", "--profile")
    assert r.returncode != 0 and "--profile is a --bench option" in r.stderr
    r = dsrun("-m", d, "--bench", "-n", "0", "--profile")
    assert r.returncode != 0 and "--profile needs -n" in r.stderr


def test_huge_page_copy_and_mmap_give_the_same_logits(tmp_path):
    """The cpu backend copies safetensors weights into huge pages unless
    --mmap; the bytes and so the logits are the same either way."""
    d = write_model("v3-fp8", tmp_path / "v3f")
    outs = []
    for extra in ([], ["--mmap"]):
        f = tmp_path / f"logits{len(extra)}.bin"
        r = dsrun("-m", d, "--tokens", "5,9,2,7,3", "--dump-logits", f, *extra)
        assert r.returncode == 0, r.stderr
        outs.append(f.read_bytes())
    assert len(outs[0]) > 0 and outs[0] == outs[1]

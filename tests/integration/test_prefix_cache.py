"""Automatic prefix caching (engine/kv.h, engine/sched.h, docs/serving.md
"Prefix caching") through real dsagent processes on the default model and
the official `openai` SDK.

One agent runs with the cache (the default), one with
--no-enable-prefix-caching; greedy outputs must be identical between them
(the rows a cached page holds are the rows a fresh prefill writes), the
cache's counters (vllm:prefix_cache_queries_total / _hits_total, in tokens)
must show the reuse, and the second turn of a chat whose shared history is
about 1,500 tokens must reach its first token in at most 0.2x the first
turn's time.  A third agent with a small KV cache checks that eviction
leaves every answer unchanged."""
import concurrent.futures
import json
import random
import re
import time
import urllib.request

import openai
import pytest

from conftest import ROOT, start_agent

MODEL = ROOT / "models" / "default.gguf"
pytestmark = pytest.mark.skipif(not MODEL.exists(), reason="models/default.gguf missing: make model")

PAGE = 16  # --page-size (the default)
WORDS = ("river mountain lantern copper whisper orchard glacier harbor velvet meadow "
         "compass thunder saffron pillar quartz ember falcon willow marble canyon "
         "violet anchor prairie cobalt beacon tundra juniper lagoon granite sparrow "
         "amber citadel fjord hazel ivory jasmine kettle lumber nectar oasis pepper "
         "quiver rustic summit tango umbra vortex walnut yonder zephyr").split()
VERBS = ("carries finds paints measures remembers hides follows builds answers counts "
         "borrows gathers mends sings trades watches").split()


def prose(seed, n_sentences):
    """Deterministic varied sentences (different words and numbers, so the
    tokens differ page to page)."""
    rng = random.Random(seed)
    out = []
    for i in range(n_sentences):
        w = rng.sample(WORDS, 5)
        out.append(f"The {w[0]} {rng.choice(VERBS)} {rng.randint(2, 999)} {w[1]}s near the "
                   f"{w[2]} while a {w[3]} {rng.choice(VERBS)} the {w[4]}.")
    return " ".join(out)


def client(agent):
    return openai.OpenAI(base_url=agent.api_url + "/v1", api_key="none", max_retries=0,
                         timeout=300)


def metrics(agent):
    with urllib.request.urlopen(agent.api_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r"^(vllm:prefix_cache_\w+|vllm:gpu_prefix_cache_hit_rate)\{[^}]*\} (\S+)$",
                         text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def tokenize(agent, messages):
    req = urllib.request.Request(agent.api_url + "/tokenize", method="POST",
                                 data=json.dumps({"messages": messages}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["tokens"]


def common_full_pages(a, b):
    """Tokens in the full pages two id lists share from their start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // PAGE * PAGE


def ask(agent, messages, max_tokens=16):
    """(content, seconds to the first streamed token) of a greedy chat call."""
    t0 = time.monotonic()
    ttft, parts = None, []
    stream = client(agent).chat.completions.create(
        model=agent.model, messages=messages, max_tokens=max_tokens, temperature=0,
        stream=True)
    for ev in stream:
        if ev.choices and ev.choices[0].delta.content:
            if ttft is None:
                ttft = time.monotonic() - t0
            parts.append(ev.choices[0].delta.content)
    return "".join(parts), ttft


def serve(tmp_path_factory, name, *args):
    a = start_agent(tmp_path_factory.mktemp(name), "--insecure-no-auth", "--threads", "2",
                    *args)
    a.wait_serving(timeout=120)
    return a


@pytest.fixture(scope="module")
def on(tmp_path_factory):
    a = serve(tmp_path_factory, "pc-on")
    yield a
    assert a.stop() == 0


@pytest.fixture(scope="module")
def off(tmp_path_factory):
    a = serve(tmp_path_factory, "pc-off", "--no-enable-prefix-caching")
    yield a
    assert a.stop() == 0


def history(seed):
    """About 1,500 tokens of shared history."""
    return ("Here are my travel notes; I will ask about them.\n\n" + prose(seed, 75))


def chat_turns(agent, seed, questions):
    """A chat of len(questions) turns over the same history: per turn (answer,
    ttft, prompt ids, hits counted during the turn)."""
    msgs = [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": history(seed) + "\n\n" + questions[0]}]
    out = []
    for i, q in enumerate(questions):
        if i:
            msgs.append({"role": "user", "content": q})
        before = metrics(agent)
        ids = tokenize(agent, msgs)
        answer, ttft = ask(agent, msgs)
        after = metrics(agent)
        out.append((answer, ttft, ids,
                    after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]))
        msgs.append({"role": "assistant", "content": answer})
    return out


QUESTIONS = ["Which river is mentioned first?", "And which metal?", "Name one bird."]


def test_chat_turns_reuse_history_and_answer_the_same(on, off):
    got_on = chat_turns(on, 1, QUESTIONS)
    got_off = chat_turns(off, 1, QUESTIONS)
    assert 1300 <= len(got_on[0][2]) <= 1800, len(got_on[0][2])  # ~1,500 shared tokens
    for t, (a, b) in enumerate(zip(got_on, got_off)):
        assert a[0] == b[0], f"turn {t + 1}: cached {a[0]!r} != uncached {b[0]!r}"
        assert a[0], f"turn {t + 1}: empty answer"
    # turns 2 and 3 find at least the full pages they share with the turn before
    for t in (1, 2):
        shared = common_full_pages(got_on[t - 1][2], got_on[t][2])
        assert shared >= 1300, shared
        assert got_on[t][3] >= shared, (t + 1, got_on[t][3], shared)
    assert got_off[1][3] == got_off[2][3] == 0
    m_on, m_off = metrics(on), metrics(off)
    assert m_off["vllm:prefix_cache_hits_total"] == 0
    assert m_on["vllm:prefix_cache_queries_total"] >= sum(len(x[2]) for x in got_on)
    assert 0 < m_on["vllm:gpu_prefix_cache_hit_rate"] <= 1


def test_second_turn_ttft_is_a_fifth_of_the_first(on):
    """The acceptance figure: best of three chats (a loaded CI machine can
    stall any one call); tests/bench/bench_prefix_cache.py measures it."""
    ratios = []
    for seed in (11, 12, 13):
        turns = chat_turns(on, seed, QUESTIONS[:2])
        ratios.append(turns[1][1] / turns[0][1])
        if ratios[-1] <= 0.2:
            break
    assert min(ratios) <= 0.2, ratios


def test_shared_system_prompt_across_users(on, off):
    system = "You are the archivist of a seaside town. " + prose(21, 20)
    users = [[{"role": "system", "content": system},
              {"role": "user", "content": "Alice asks: what is the oldest building?"}],
             [{"role": "system", "content": system},
              {"role": "user", "content": "Bob asks: where can I buy bread?"}]]
    before = metrics(on)
    first, _ = ask(on, users[0])
    mid = metrics(on)
    second, _ = ask(on, users[1])
    after = metrics(on)
    shared = common_full_pages(tokenize(on, users[0]), tokenize(on, users[1]))
    assert shared >= 300, shared
    assert mid["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == 0
    assert after["vllm:prefix_cache_hits_total"] - mid["vllm:prefix_cache_hits_total"] >= shared
    assert [first, second] == [ask(off, u)[0] for u in users]


def test_same_prefix_at_once_equals_one_by_one(on, off):
    base = "Read this log and answer briefly. " + prose(31, 25)
    msgs = [[{"role": "user", "content": base + f"\n\nQuestion {i}: which number comes "
                                                 f"{['first', 'second', 'third', 'last'][i]}?"}]
            for i in range(4)]
    before = metrics(on)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        together = list(ex.map(lambda m: ask(on, m)[0], msgs))
    after = metrics(on)
    alone = [ask(off, m)[0] for m in msgs]
    assert together == alone
    # whatever the interleaving, the cache stays consistent: a later request
    # for the same prefix hits, and answers the same
    assert ask(on, msgs[0])[0] == alone[0]
    assert metrics(on)["vllm:prefix_cache_hits_total"] > after["vllm:prefix_cache_hits_total"]
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]


def test_eviction_keeps_answers_right(tmp_path_factory, off):
    """A cache of 32 pages (one context of 512: the floor under --kv-cache-mb):
    every new prompt evicts older cached pages; later requests still succeed
    and answer as without the cache."""
    small = serve(tmp_path_factory, "pc-small", "--kv-cache-mb", "1", "--ctx", "512",
                  "--max-running", "2")
    try:
        pages = int(re.search(r"kv_pages=(\d+)", small.log()).group(1))
        assert 16 <= pages <= 64, pages
        prompts = [[{"role": "user", "content": f"Note {i}: " + prose(40 + i, 6) +
                     " Summarise the note in five words."}] for i in range(8)]
        sizes = [len(tokenize(small, p)) for p in prompts]
        assert sum(sizes) > 2 * pages * PAGE, (sizes, pages)  # far more than the cache holds
        assert max(sizes) + 16 < pages * PAGE // 2, (sizes, pages)
        want = [ask(off, p)[0] for p in prompts]
        got = [ask(small, p)[0] for p in prompts]
        assert got == want
        # the last prompt is still cached; the first was pushed out
        before = metrics(small)
        assert ask(small, prompts[-1])[0] == want[-1]
        mid = metrics(small)
        assert ask(small, prompts[0])[0] == want[0]
        after = metrics(small)
        hit_last = mid["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
        hit_first = after["vllm:prefix_cache_hits_total"] - mid["vllm:prefix_cache_hits_total"]
        assert hit_last >= (sizes[-1] - 1) // PAGE * PAGE, (hit_last, sizes[-1])
        assert hit_first < (sizes[0] - 1) // PAGE * PAGE, (hit_first, sizes[0])
        # every prompt again, in the other order: the answers do not change
        assert [ask(small, p)[0] for p in reversed(prompts)] == list(reversed(want))
        assert "AddressSanitizer" not in small.log()
    finally:
        assert small.stop() == 0


def test_preempted_request_resumes_from_its_cached_pages(tmp_path_factory, off):
    """Two long generations in a 32-page cache: the newer one is preempted
    (recompute), finds its own prompt pages still cached when it resumes, and
    both answer exactly as without the cache."""
    small = serve(tmp_path_factory, "pc-preempt", "--kv-cache-mb", "1", "--ctx", "512",
                  "--max-running", "2")
    try:
        prompts = [f"Story {i}: " + prose(60 + i, 7) for i in range(2)]

        def gen(agent, p):
            r = client(agent).completions.create(model=agent.model, prompt=p, max_tokens=200,
                                                 temperature=0, extra_body={"ignore_eos": True})
            return r.choices[0].text

        def preemptions(agent):
            with urllib.request.urlopen(agent.api_url + "/metrics", timeout=10) as r:
                m = re.search(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", r.read().decode(),
                              re.M)
            return float(m.group(1))

        before = metrics(small)
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            got = list(ex.map(lambda p: gen(small, p), prompts))
        after = metrics(small)
        assert preemptions(small) >= 1
        assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] > 0
        assert got == [gen(off, p) for p in prompts]
    finally:
        assert small.stop() == 0


def test_rank_processes_reuse_pages_too(tmp_path_factory, off):
    """--tp 2: the driver's page bookkeeping drives the ranks' caches through
    each step's block tables, so the cache works with no new protocol."""
    tp = serve(tmp_path_factory, "pc-tp2", "--tp", "2")
    try:
        msgs = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "Notes: " + prose(70, 20) + " Which metal?"}]
        first, _ = ask(tp, msgs)
        msgs += [{"role": "assistant", "content": first},
                 {"role": "user", "content": "And which bird?"}]
        before = metrics(tp)
        second, _ = ask(tp, msgs)
        after = metrics(tp)
        shared = common_full_pages(tokenize(tp, msgs[:2]), tokenize(tp, msgs))
        assert shared >= 300, shared
        assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] \
            >= shared
        assert [first, second] == [ask(off, msgs[:2])[0], ask(off, msgs)[0]]
    finally:
        assert tp.stop() == 0

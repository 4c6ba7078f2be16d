"""End-to-end tests of the sampling and output parameters of the OpenAI-compatible server.

Covers logit_bias, min_tokens, penalties, seeded sampling (alone, batched and
with ``n``), logprobs (chat and completions, streamed and not), ``echo``,
``stream_options``, ``n > 1`` streaming, and a table of invalid requests. One
live ``pagedllm serve`` (see ``conftest.py``) serves every test; outputs are
kept short because the model runs on CPU.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter

import httpx
import openai
import pytest

MODEL_NAME = "smollm2"  # --served-model-name in conftest.py
STORY_PROMPT = "Once upon a time, in a small village by the sea, there lived"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]  # greedy: ends with EOS at 8 tokens
YES_NO = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]  # greedy: "No." then EOS
FORCED_ID = 3256   # an arbitrary vocabulary id ("RE" in SmolLM2's vocabulary; its text is looked up, not assumed)
THE_ID, IS_ID = 504, 314  # "The", " is": the alternating prompt [504, 314] * 6 makes greedy continue "The is ..."
LP_TOL = 1e-4      # logprobs of one position under different batch shapes / prefix-cache hits


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    # no retries: a 5xx must fail the test at once, not be retried away
    return openai.OpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0, timeout=120)


# ---- helpers -------------------------------------------------------------------------


def post(server_url: str, path: str, body: dict) -> dict:
    """POST a JSON body, assert 200 and return the parsed response."""
    r = httpx.post(server_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def sse(server_url: str, path: str, body: dict) -> list[dict]:
    """POST a streaming request and return its parsed ``data:`` events (``[DONE]`` checked and dropped)."""
    with httpx.stream("POST", server_url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    assert lines.count("data: [DONE]") == 1
    assert all(ln.startswith("data: ") for ln in lines)
    events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert not [e for e in events if "error" in e], events
    return events


def stats(server_url) -> dict:
    r = httpx.get(server_url + "/stats", timeout=10)
    assert r.status_code == 200
    return r.json()


def wait_idle(server_url, timeout: float = 5.0) -> dict:
    """Poll ``/stats`` until no request runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(server_url)
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_blocks"]:
            return s
        if time.monotonic() > deadline:
            pytest.fail(f"engine not idle within {timeout} s: {s}")
        time.sleep(0.1)


def token_text(client, token_id: int) -> str:
    """The text of one vocabulary id, via an echo-only completion of the one-token prompt."""
    r = client.completions.create(model=MODEL_NAME, prompt=[token_id], echo=True, max_tokens=0)
    assert r.usage.prompt_tokens == 1 and r.usage.completion_tokens == 0
    return r.choices[0].text


def cmpl_stream_logprobs(events: list[dict], index: int = 0) -> tuple[str, dict]:
    """Concatenate a streamed completion choice's text and logprobs lists."""
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        for c in e["choices"]:
            if c["index"] != index:
                continue
            text += c["text"]
            if c["logprobs"] is not None:
                for k in lp:
                    lp[k] += c["logprobs"][k]
    return text, lp


def chat_stream_content(events: list[dict], index: int = 0) -> tuple[str, list[dict]]:
    """Concatenate a streamed chat choice's content and logprobs entries."""
    text, entries = "", []
    for e in events:
        for c in e["choices"]:
            if c["index"] != index:
                continue
            text += c["delta"].get("content") or ""
            if c.get("logprobs"):
                entries += c["logprobs"]["content"]
    return text, entries


def require(cond: bool, msg: str) -> None:
    """A precondition on the model's output the test relies on; fails the test with a clear message when unmet."""
    if not cond:
        pytest.fail(f"precondition not met: {msg}")


def assert_lp_close(a: float | None, b: float | None, tol: float = LP_TOL) -> None:
    assert (a is None) == (b is None), (a, b)
    if a is not None:
        assert abs(a - b) <= tol, (a, b)


def first_divergence(a: list[str], b: list[str]) -> int:
    """Index of the first differing entry of two token lists (both must differ somewhere)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    assert len(a) != len(b), "the outputs are identical"
    return min(len(a), len(b))


# ---- logit_bias ----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_token_completions(client, temperature):
    """A +100 logit_bias on one token id makes every generated completion token that token."""
    forced = token_text(client, FORCED_ID)
    assert forced
    r = client.completions.create(model=MODEL_NAME, prompt=STORY_PROMPT, max_tokens=6, temperature=temperature,
                                  seed=7, logprobs=0, logit_bias={str(FORCED_ID): 100},
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.logprobs.tokens == [forced] * 6
    assert c.text == forced * 6
    assert c.finish_reason == "length" and r.usage.completion_tokens == 6
    # logprobs are the raw model's: the forced token is not likely after the story prompt
    assert c.logprobs.token_logprobs[0] < -1.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_token_chat(client, temperature):
    """A +100 logit_bias forces every chat token too (checked through the logprobs entries)."""
    forced = token_text(client, FORCED_ID)
    r = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=5, temperature=temperature,
                                       seed=11, logprobs=True, logit_bias={str(FORCED_ID): 100},
                                       extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert [e.token for e in c.logprobs.content] == [forced] * 5
    assert c.message.content == forced * 5 and r.usage.completion_tokens == 5


def test_logit_bias_bans_tokens(client):
    """A -100 logit_bias bans tokens greedy decoding would otherwise pick; raw logprobs still rank them first."""
    the, is_ = token_text(client, THE_ID), token_text(client, IS_ID)
    prompt = [THE_ID, IS_ID] * 6
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    assert plain.choices[0].logprobs.tokens == [the, is_, the, is_]  # the pattern continues
    banned = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                                       logit_bias={str(THE_ID): -100, str(IS_ID): -100})
    lp = banned.choices[0].logprobs
    assert the not in lp.tokens and is_ not in lp.tokens
    # position 0 has the same context in both runs: the raw distribution is the same, its top-1 is "The"
    top0 = lp.top_logprobs[0]
    assert max(top0, key=top0.get) == the
    assert_lp_close(top0[the], plain.choices[0].logprobs.token_logprobs[0])


# ---- min_tokens ----------------------------------------------------------------------------


def test_min_tokens_suppresses_eos(client):
    """min_tokens=20 keeps a greedy chat going past the EOS where it stopped at a few tokens."""
    plain = client.chat.completions.create(model=MODEL_NAME, messages=YES_NO, max_tokens=25, temperature=0)
    assert plain.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens < 20
    r = client.chat.completions.create(model=MODEL_NAME, messages=YES_NO, max_tokens=25, temperature=0,
                                       extra_body={"min_tokens": 20})
    assert r.usage.completion_tokens >= 20
    assert r.choices[0].finish_reason in ("stop", "length")
    # banning EOS changes nothing before the step where EOS was the argmax
    assert r.choices[0].message.content.startswith(plain.choices[0].message.content)
    assert len(r.choices[0].message.content) > len(plain.choices[0].message.content)


def test_min_tokens_completions_with_logprobs(client):
    """min_tokens on completions: no finish before min_tokens, and one logprobs entry per token."""
    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is Paris.", max_tokens=12,
                                  temperature=0, logprobs=0, extra_body={"min_tokens": 12})
    c = r.choices[0]
    assert r.usage.completion_tokens == 12 and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == 12 and "".join(c.logprobs.tokens) == c.text


# ---- penalties -------------------------------------------------------------------------------

REPEAT_PROMPT = "one one one one one one"


def _greedy(client, prompt: str, max_tokens: int = 16, echo: bool = False, **extra):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     logprobs=0, echo=echo, extra_body=extra or None).choices[0]


@pytest.fixture(scope="module")
def plain_repeat(client):
    """Plain greedy continuation of the repetitive prompt (it repeats itself)."""
    c = _greedy(client, REPEAT_PROMPT)
    assert Counter(c.logprobs.tokens).most_common(1)[0][1] >= 5, c.text  # the model loops
    return c


def test_neutral_penalties_equal_plain_greedy(client, plain_repeat):
    """repetition_penalty=1, presence_penalty=0, frequency_penalty=0 change nothing."""
    c = _greedy(client, REPEAT_PROMPT, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    assert c.text == plain_repeat.text
    assert c.logprobs.tokens == plain_repeat.logprobs.tokens
    for a, b in zip(c.logprobs.token_logprobs, plain_repeat.logprobs.token_logprobs):
        assert_lp_close(a, b)


def test_frequency_penalty_reduces_repetition(client, plain_repeat):
    """frequency_penalty=2 diverges from greedy where the greedy token was already generated more often."""
    c = _greedy(client, REPEAT_PROMPT, frequency_penalty=2.0)
    plain_toks, toks = plain_repeat.logprobs.tokens, c.logprobs.tokens
    assert c.text != plain_repeat.text
    assert Counter(toks).most_common(1)[0][1] < Counter(plain_toks).most_common(1)[0][1]
    d = first_divergence(plain_toks, toks)
    prefix = Counter(toks[:d])
    # greedy g had the higher raw logprob; p won only if g had been penalised more: count(g) > count(p)
    g, p = plain_toks[d], toks[d]
    assert prefix[g] > prefix[p], (d, g, p, toks[:d])
    # logprobs are raw: identical prefix, identical logprobs (penalties do not show in them)
    for a, b in zip(c.logprobs.token_logprobs[:d], plain_repeat.logprobs.token_logprobs[:d]):
        assert_lp_close(a, b)
    # ... and at the divergence the greedy token was the raw favourite
    assert c.logprobs.token_logprobs[d] <= plain_repeat.logprobs.token_logprobs[d]


def test_presence_penalty_direction(client, plain_repeat):
    """presence_penalty=2 diverges where the greedy token was already present and the chosen one was not."""
    c = _greedy(client, REPEAT_PROMPT, presence_penalty=2.0)
    plain_toks, toks = plain_repeat.logprobs.tokens, c.logprobs.tokens
    assert c.text != plain_repeat.text
    d = first_divergence(plain_toks, toks)
    g, p = plain_toks[d], toks[d]
    assert g in toks[:d] and p not in toks[:d], (d, g, p, toks[:d])


def test_repetition_penalty_direction(client, plain_repeat):
    """repetition_penalty=1.5 diverges where the greedy token was in the prompt or output, and repeats less."""
    c = _greedy(client, REPEAT_PROMPT, echo=True, repetition_penalty=1.5)
    n_prompt = len(c.logprobs.tokens) - 16
    prompt_toks, toks = c.logprobs.tokens[:n_prompt], c.logprobs.tokens[n_prompt:]
    assert "".join(prompt_toks) == REPEAT_PROMPT
    plain_toks = plain_repeat.logprobs.tokens
    assert toks != plain_toks
    assert Counter(toks).most_common(1)[0][1] < Counter(plain_toks).most_common(1)[0][1]
    d = first_divergence(plain_toks, toks)
    assert plain_toks[d] in prompt_toks + toks[:d], (d, plain_toks[d], toks[:d])


def test_negative_frequency_penalty_does_not_reduce_repetition(client, plain_repeat):
    """frequency_penalty=-2 rewards repeats: the most common token occurs at least as often as in plain greedy."""
    c = _greedy(client, REPEAT_PROMPT, frequency_penalty=-2.0)
    assert Counter(c.logprobs.tokens).most_common(1)[0][1] >= Counter(plain_repeat.logprobs.tokens).most_common(1)[0][1]


# ---- seeded sampling ---------------------------------------------------------------------------

SEEDED = dict(prompt="Once upon a time", temperature=1.0, seed=1234, max_tokens=24)


def test_seed_reproducible_despite_batch(server_url, client):
    """A seeded request samples the same text alone and batched with four other running requests."""
    alone = client.completions.create(model=MODEL_NAME, **SEEDED).choices[0].text
    other_seed = client.completions.create(model=MODEL_NAME, **{**SEEDED, "seed": 4321}).choices[0].text
    assert other_seed != alone  # the seed matters
    before = wait_idle(server_url)

    async def run():
        async with openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0, timeout=120) as ac:
            others = [asyncio.create_task(ac.completions.create(
                model=MODEL_NAME, prompt=p, max_tokens=32, temperature=t, extra_body={"ignore_eos": True}))
                for p, t in [("The weather today", 0.0), ("def fibonacci(n):", 1.0),
                             ("My favourite food is", 0.0), ("In 1492,", 1.0)]]
            await asyncio.sleep(0.3)  # the others are running when the seeded request arrives
            seeded = await ac.completions.create(model=MODEL_NAME, **SEEDED)
            return seeded, await asyncio.gather(*others)

    seeded, others = asyncio.run(run())
    assert seeded.choices[0].text == alone
    assert all(o.usage.completion_tokens == 32 for o in others)
    after = wait_idle(server_url)
    generated = after["num_generation_tokens"] - before["num_generation_tokens"]
    assert generated == 4 * 32 + seeded.usage.completion_tokens
    assert after["num_steps"] - before["num_steps"] < generated  # they really shared steps


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_n_with_seed_equals_separate_seeds(client, endpoint):
    """With n=3 and seed s, sample j equals a separate n=1 request with seed s+j."""
    if endpoint == "chat":
        def make(n, seed):
            r = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, temperature=1.0, max_tokens=10,
                                               n=n, seed=seed)
            return r, [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    else:
        def make(n, seed):
            r = client.completions.create(model=MODEL_NAME, prompt=STORY_PROMPT, temperature=1.0, max_tokens=10,
                                          n=n, seed=seed)
            return r, [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    r, texts = make(3, 1234)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len(set(texts)) > 1  # different seeds, different samples
    for j in range(3):
        assert make(1, 1234 + j)[1] == [texts[j]], j


# ---- logprobs -------------------------------------------------------------------------------


def _check_chat_entries(entries, content: str, k: int, greedy: bool) -> None:
    assert "".join(e["token"] for e in entries) == content
    for e in entries:
        assert e["logprob"] <= 0 and e["bytes"] == list(e["token"].encode())
        tops = e["top_logprobs"]
        assert len(tops) == k
        assert all(t["logprob"] <= 0 and t["bytes"] == list(t["token"].encode()) for t in tops)
        lps = [t["logprob"] for t in tops]
        assert lps == sorted(lps, reverse=True)
        assert sum(math.exp(x) for x in lps) <= 1 + 1e-4
        match = [t for t in tops if t["token"] == e["token"]]
        if greedy:
            assert tops[0]["token"] == e["token"] and tops[0]["logprob"] == e["logprob"]
        if match:
            assert match[0]["logprob"] == e["logprob"]
        else:
            assert e["logprob"] <= tops[-1]["logprob"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_logprobs_values(server_url, temperature):
    """Chat logprobs with top_logprobs=3: one entry per token, 3 sorted alternatives, consistent with the sample."""
    body = {"messages": QUESTION, "temperature": temperature, "seed": 5, "max_tokens": 12, "logprobs": True,
            "top_logprobs": 3}
    r = post(server_url, "/v1/chat/completions", body)
    c = r["choices"][0]
    entries = c["logprobs"]["content"]
    assert len(entries) == r["usage"]["completion_tokens"]
    assert c["logprobs"]["refusal"] is None
    _check_chat_entries(entries, c["message"]["content"], 3, greedy=temperature == 0)


def test_chat_top_logprobs_zero(client):
    """logprobs=true with top_logprobs 0 (or omitted) gives the sampled tokens' logprobs and no alternatives."""
    for extra in ({"top_logprobs": 0}, {}):
        r = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, temperature=0, max_tokens=4,
                                           logprobs=True, **extra)
        content = r.choices[0].logprobs.content
        assert len(content) == 4 and all(e.top_logprobs == [] and e.logprob <= 0 for e in content)
        assert "".join(e.token for e in content) == r.choices[0].message.content


def test_chat_no_logprobs_by_default(client):
    """Without logprobs the choice's logprobs is null."""
    r = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, temperature=0, max_tokens=2)
    assert r.choices[0].logprobs is None


def test_chat_stream_logprobs_match_non_stream(server_url):
    """Streamed chat logprobs, concatenated over chunks, equal the non-streamed ones entry by entry."""
    body = {"messages": QUESTION, "temperature": 0, "max_tokens": 12, "logprobs": True, "top_logprobs": 3}
    full = post(server_url, "/v1/chat/completions", body)
    events = sse(server_url, "/v1/chat/completions", body)
    text, entries = chat_stream_content(events)
    ref = full["choices"][0]["logprobs"]["content"]
    assert text == full["choices"][0]["message"]["content"]
    assert len(entries) == len(ref)
    for a, b in zip(entries, ref):
        assert a["token"] == b["token"] and a["bytes"] == b["bytes"]
        assert_lp_close(a["logprob"], b["logprob"])
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        for ta, tb in zip(a["top_logprobs"], b["top_logprobs"]):
            assert_lp_close(ta["logprob"], tb["logprob"])
    _check_chat_entries(entries, text, 3, greedy=True)


def _check_cmpl_logprobs(lp: dict, text: str, k: int, start: int = 0) -> None:
    """Invariants of a completions logprobs object (generated tokens only, from index ``start``)."""
    toks = lp["tokens"]
    assert len(toks) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert "".join(toks) == text
    for i in range(len(toks)):
        assert lp["text_offset"][i] == len("".join(toks[:i])), i
    for i in range(start, len(toks)):
        top, own = lp["top_logprobs"][i], lp["token_logprobs"][i]
        assert isinstance(own, float) and own <= 0
        assert len(top) <= k + 1 and toks[i] in top and top[toks[i]] == own
        assert sum(math.exp(x) for x in top.values()) <= 1 + 1e-4


def test_completion_logprobs_values(client):
    """Completions logprobs=2 (greedy): tokens join to the text, offsets, top dicts hold the top-1 sampled token."""
    r = client.completions.create(model=MODEL_NAME, prompt=STORY_PROMPT, temperature=0, max_tokens=10, logprobs=2)
    lp = r.choices[0].logprobs.model_dump()
    _check_cmpl_logprobs(lp, r.choices[0].text, 2)
    assert len(lp["tokens"]) == r.usage.completion_tokens == 10
    for tok, own, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert max(top.values()) == own  # greedy: the sampled token is the most likely one
        assert len(top) == 2  # the sampled token is one of the top 2: no extra entry


def test_completion_stream_logprobs_match_non_stream(server_url):
    """Streamed completions logprobs (offsets continuing across chunks) equal the non-streamed ones."""
    body = {"prompt": STORY_PROMPT, "temperature": 0, "max_tokens": 12, "logprobs": 2}
    full = post(server_url, "/v1/completions", body)["choices"][0]
    text, lp = cmpl_stream_logprobs(sse(server_url, "/v1/completions", body))
    ref = full["logprobs"]
    assert text == full["text"]
    assert lp["tokens"] == ref["tokens"] and lp["text_offset"] == ref["text_offset"]
    for a, b in zip(lp["token_logprobs"], ref["token_logprobs"]):
        assert_lp_close(a, b)
    for a, b in zip(lp["top_logprobs"], ref["top_logprobs"]):
        assert set(a) == set(b)
        for key in a:
            assert_lp_close(a[key], b[key])
    _check_cmpl_logprobs(lp, text, 2)


def test_completion_stream_text_offset_with_unmatched_stop(server_url, client):
    """A stop string that never matches leaves streamed text_offset equal to the non-streamed one."""
    plain = client.completions.create(model=MODEL_NAME, prompt=STORY_PROMPT, temperature=0, max_tokens=6,
                                      logprobs=0).choices[0]
    first = plain.logprobs.tokens[0]
    require(len(plain.logprobs.tokens) == 6 and first[-1:].isalpha(), f"first token {first!r}")
    stop = first[-1] + "@@@"  # the first token's last letter starts it, so it is held back; never matches
    body = {"prompt": STORY_PROMPT, "temperature": 0, "max_tokens": 6, "logprobs": 0, "stop": [stop]}
    full = post(server_url, "/v1/completions", body)["choices"][0]
    require(full["finish_reason"] == "length" and full["text"] == plain.text, "the stop string matched")
    assert full["logprobs"]["text_offset"] == plain.logprobs.text_offset
    text, lp = cmpl_stream_logprobs(sse(server_url, "/v1/completions", body))
    assert text == full["text"] and lp["tokens"] == full["logprobs"]["tokens"]
    assert lp["text_offset"] == full["logprobs"]["text_offset"], (lp["tokens"], lp["text_offset"])


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_logprobs_with_matched_stop_string(server_url, client, endpoint):
    """With a stop string spanning tokens, streamed logprob tokens join to the streamed text, as non-streamed."""
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": QUESTION, "logprobs": True}
        words = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, temperature=0,
                                               max_tokens=12).choices[0].message.content.split()
    else:
        path, body = "/v1/completions", {"prompt": STORY_PROMPT, "logprobs": 0}
        words = client.completions.create(model=MODEL_NAME, prompt=STORY_PROMPT, temperature=0,
                                          max_tokens=12).choices[0].text.split()
    require(len(words) >= 6 and len(words[3]) >= 3, f"unexpected output {words}")
    stop = words[3][2:] + " " + words[4]  # from mid-word to the next word: spans tokens
    body.update(temperature=0, max_tokens=12, stop=[stop])
    full = post(server_url, path, body)["choices"][0]
    if endpoint == "chat":
        ref_text, ref_tokens = full["message"]["content"], [e["token"] for e in full["logprobs"]["content"]]
        text, entries = chat_stream_content(sse(server_url, path, body))
        tokens = [e["token"] for e in entries]
    else:
        ref_text, ref_tokens = full["text"], full["logprobs"]["tokens"]
        text, lp = cmpl_stream_logprobs(sse(server_url, path, body))
        tokens = lp["tokens"]
    require(full["finish_reason"] == "stop" and stop not in ref_text, f"stop {stop!r} did not match")
    assert "".join(ref_tokens) == ref_text  # non-streamed: consistent
    assert text == ref_text
    assert "".join(tokens) == text, tokens
    assert tokens == ref_tokens


def test_stop_token_ids_and_include_stop_str(client):
    """stop_token_ids end the output unshown; include_stop_str_in_output keeps a stop string; min_tokens delays them."""
    prompt, the, is_ = [THE_ID, IS_ID] * 6, token_text(client, THE_ID), token_text(client, IS_ID)

    def run(**extra):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
                                      extra_body=extra)
        return r.choices[0], r.usage.completion_tokens

    c, n = run(stop_token_ids=[IS_ID])
    assert c.text == the and c.finish_reason == "stop" and n == 2  # the stop token is generated, not shown
    c, n = run(stop=[is_])
    assert c.text == the and c.finish_reason == "stop"
    c, n = run(stop=[is_], include_stop_str_in_output=True)
    assert c.text == the + is_ and c.finish_reason == "stop"
    c, n = run(stop_token_ids=[IS_ID], min_tokens=3)  # banned below min_tokens: the pattern breaks
    assert n >= 3 and is_ not in c.logprobs.tokens[:3]


def test_max_completion_tokens_wins(client):
    """max_completion_tokens takes precedence over max_tokens."""
    r = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, temperature=0, max_tokens=6,
                                       max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra", [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}])
def test_truncation_to_one_token_is_greedy(client, extra):
    """top_k=1, min_p=1 or a tiny top_p keep only the top token: unseeded sampling at temperature 1.5 is greedy."""
    greedy = client.completions.create(model=MODEL_NAME, prompt=STORY_PROMPT, temperature=0, max_tokens=8)
    r = client.completions.create(model=MODEL_NAME, prompt=STORY_PROMPT, temperature=1.5, max_tokens=8,
                                  extra_body=extra)
    assert r.choices[0].text == greedy.choices[0].text


def test_logprobs_are_raw(client):
    """Logprobs are the model's raw log-softmax: temperature, penalties and bias do not change them."""
    base = client.completions.create(model=MODEL_NAME, prompt=STORY_PROMPT, temperature=0, max_tokens=1,
                                     logprobs=5).choices[0].logprobs.top_logprobs[0]
    for kw, extra in [({"temperature": 1.7, "seed": 3}, None), ({"temperature": 0}, {"frequency_penalty": 2.0}),
                      ({"temperature": 0.5, "seed": 9}, {"top_k": 2, "repetition_penalty": 1.8}),
                      ({"temperature": 0, "logit_bias": {str(FORCED_ID): 100}}, None)]:
        top = client.completions.create(model=MODEL_NAME, prompt=STORY_PROMPT, max_tokens=1, logprobs=5,
                                        extra_body=extra, **kw).choices[0].logprobs.top_logprobs[0]
        ranked = sorted(top, key=top.get, reverse=True)[:5]
        assert ranked == sorted(base, key=base.get, reverse=True)[:5], kw
        for t in ranked:
            assert_lp_close(top[t], base[t])


# ---- echo ------------------------------------------------------------------------------------

ECHO_PROMPT = "The quick brown fox jumps over"


def test_echo_with_logprobs(client):
    """echo + logprobs=1: prompt tokens first (the first with null logprobs), then the generated ones."""
    r = client.completions.create(model=MODEL_NAME, prompt=ECHO_PROMPT, echo=True, logprobs=1, max_tokens=3,
                                  temperature=0)
    c = r.choices[0]
    lp = c.logprobs.model_dump()
    toks = lp["tokens"]
    assert c.text.startswith(ECHO_PROMPT)
    assert "".join(toks) == c.text
    n_prompt = len(toks) - r.usage.completion_tokens
    assert r.usage.completion_tokens == 3 and n_prompt == r.usage.prompt_tokens
    assert "".join(toks[:n_prompt]) == ECHO_PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(isinstance(t, dict) for t in lp["top_logprobs"][1:])
    _check_cmpl_logprobs(lp, c.text, 1, start=1)
    # the generated part equals a request without echo
    plain = client.completions.create(model=MODEL_NAME, prompt=ECHO_PROMPT, logprobs=1, max_tokens=3, temperature=0)
    p = plain.choices[0]
    assert c.text == ECHO_PROMPT + p.text and toks[n_prompt:] == p.logprobs.tokens
    for a, b in zip(lp["token_logprobs"][n_prompt:], p.logprobs.token_logprobs):
        assert_lp_close(a, b)


def test_echo_max_tokens_zero(client):
    """echo with max_tokens=0 returns only the prompt (and its logprobs), no completion tokens."""
    r = client.completions.create(model=MODEL_NAME, prompt=ECHO_PROMPT, echo=True, max_tokens=0)
    assert r.choices[0].text == ECHO_PROMPT and r.usage.completion_tokens == 0
    assert r.usage.total_tokens == r.usage.prompt_tokens > 0
    r2 = client.completions.create(model=MODEL_NAME, prompt=ECHO_PROMPT, echo=True, max_tokens=0, logprobs=1)
    lp = r2.choices[0].logprobs
    assert r2.choices[0].text == ECHO_PROMPT and r2.usage.completion_tokens == 0
    assert "".join(lp.tokens) == ECHO_PROMPT and len(lp.tokens) == r.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]


def test_echo_streamed(server_url):
    """Streamed echo: the first chunk starts with the prompt; text and logprobs equal the non-streamed response."""
    body = {"prompt": ECHO_PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    full = post(server_url, "/v1/completions", body)["choices"][0]
    events = sse(server_url, "/v1/completions", body)
    assert events[0]["choices"][0]["text"].startswith(ECHO_PROMPT)
    text, lp = cmpl_stream_logprobs(events)
    assert text == full["text"]
    ref = full["logprobs"]
    assert lp["tokens"] == ref["tokens"] and lp["text_offset"] == ref["text_offset"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for a, b in zip(lp["token_logprobs"], ref["token_logprobs"]):
        assert_lp_close(a, b)
    # without logprobs too, and echo-only streams the prompt alone
    events = sse(server_url, "/v1/completions", {"prompt": ECHO_PROMPT, "echo": True, "max_tokens": 0})
    assert "".join(c["text"] for e in events for c in e["choices"]) == ECHO_PROMPT
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]


# ---- stream_options ---------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_include_usage(server_url, endpoint):
    """include_usage: one usage chunk, last, with no choices, counting exactly the streamed tokens."""
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": QUESTION, "logprobs": True}
    else:
        path, body = "/v1/completions", {"prompt": STORY_PROMPT, "logprobs": 0}
    body.update(temperature=0, max_tokens=10)
    full = post(server_url, path, body)
    events = sse(server_url, path, {**body, "stream_options": {"include_usage": True}})
    with_usage = [e for e in events if e.get("usage") is not None]
    assert len(with_usage) == 1 and with_usage[0] is events[-1]
    assert events[-1]["choices"] == []
    assert all(e["choices"] for e in events[:-1])
    if endpoint == "chat":
        n_streamed = len(chat_stream_content(events)[1])
    else:
        n_streamed = len(cmpl_stream_logprobs(events)[1]["tokens"])
    u = events[-1]["usage"]
    assert u["completion_tokens"] == n_streamed == full["usage"]["completion_tokens"]
    assert u["prompt_tokens"] == full["usage"]["prompt_tokens"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}])
def test_stream_without_usage(server_url, endpoint, options):
    """stream_options absent, {} or include_usage false: no chunk carries a usage object."""
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": QUESTION}
    else:
        path, body = "/v1/completions", {"prompt": STORY_PROMPT}
    body.update(temperature=0, max_tokens=3)
    if options is not None:
        body["stream_options"] = options
    events = sse(server_url, path, body)
    assert events and all(e.get("usage") is None for e in events)
    assert all(e["choices"] for e in events)


def test_stream_include_usage_n2(server_url):
    """include_usage with n=2 counts both samples' tokens."""
    body = {"prompt": STORY_PROMPT, "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 5, "logprobs": 0,
            "stream_options": {"include_usage": True}}
    events = sse(server_url, "/v1/completions", body)
    n_tokens = sum(len(cmpl_stream_logprobs(events, i)[1]["tokens"]) for i in range(2))
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == n_tokens == 10


# ---- n > 1 --------------------------------------------------------------------------------------


def _check_finish_once(events: list[dict], num: int) -> None:
    """Each index 0..num-1 gets exactly one non-null finish_reason and no chunk after it."""
    finished: set[int] = set()
    seen: set[int] = set()
    for e in events:
        for c in e["choices"]:
            i = c["index"]
            assert 0 <= i < num, i
            assert i not in finished, f"chunk for choice {i} after its finish"
            seen.add(i)
            if c["finish_reason"] is not None:
                finished.add(i)
    assert seen == finished == set(range(num))


def test_chat_n3_stream(server_url):
    """Chat n=3 streamed: role first, one finish per choice, texts equal the non-streamed seeded run."""
    body = {"messages": QUESTION, "n": 3, "temperature": 1.0, "seed": 21, "max_tokens": 8, "logprobs": True}
    full = post(server_url, "/v1/chat/completions", body)
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    per_choice = [len(c["logprobs"]["content"]) for c in full["choices"]]
    assert full["usage"]["completion_tokens"] == sum(per_choice)
    events = sse(server_url, "/v1/chat/completions", body)
    _check_finish_once(events, 3)
    for i in range(3):
        first = next(c for e in events for c in e["choices"] if c["index"] == i)
        assert first["delta"].get("role") == "assistant"
        text, entries = chat_stream_content(events, i)
        assert text == full["choices"][i]["message"]["content"]
        assert len(entries) == per_choice[i]


def test_completion_n3_stream(server_url):
    """Completions n=3 streamed: one finish per choice; texts and token counts equal the non-streamed run."""
    body = {"prompt": STORY_PROMPT, "n": 3, "temperature": 1.0, "seed": 8, "max_tokens": 6, "logprobs": 0}
    full = post(server_url, "/v1/completions", body)
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    assert full["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in full["choices"])
    events = sse(server_url, "/v1/completions", body)
    _check_finish_once(events, 3)
    for i in range(3):
        text, lp = cmpl_stream_logprobs(events, i)
        assert text == full["choices"][i]["text"] and lp["tokens"] == full["choices"][i]["logprobs"]["tokens"]


def test_completion_two_prompts_n2(server_url, client):
    """2 prompts x n=2: choice i*n+j is sample j (seed+j) of prompt i, streamed and not."""
    prompts = ["The weather today is", "My favourite animal is"]
    body = {"prompt": prompts, "n": 2, "temperature": 1.0, "seed": 100, "max_tokens": 5, "echo": True}
    full = post(server_url, "/v1/completions", body)
    assert [c["index"] for c in full["choices"]] == [0, 1, 2, 3]
    for i in range(2):
        for j in range(2):
            text = full["choices"][i * 2 + j]["text"]
            assert text.startswith(prompts[i])
            alone = client.completions.create(model=MODEL_NAME, prompt=prompts[i], temperature=1.0, seed=100 + j,
                                              max_tokens=5).choices[0].text
            assert text == prompts[i] + alone, (i, j)
    counts = post(server_url, "/v1/completions", {**body, "echo": False, "logprobs": 0})
    assert counts["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in counts["choices"])
    single = [post(server_url, "/v1/completions", {"prompt": p, "max_tokens": 1})["usage"]["prompt_tokens"]
              for p in prompts]
    assert counts["usage"]["prompt_tokens"] == sum(single)  # each prompt counted once, not once per sample
    events = sse(server_url, "/v1/completions", body)
    _check_finish_once(events, 4)
    for k in range(4):
        assert cmpl_stream_logprobs(events, k)[0] == full["choices"][k]["text"]


# ---- validation -----------------------------------------------------------------------------

CHAT_BASE = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
CMPL_BASE = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
DROP = object()  # an override value that removes the field

# id -> (endpoint, overrides, expected status, expected param)
INVALID = {
    "temperature_negative": ("chat", {"temperature": -1}, 400, "temperature"),
    "temperature_string": ("chat", {"temperature": "hot"}, 400, "temperature"),
    "top_p_zero": ("chat", {"top_p": 0}, 400, "top_p"),
    "top_p_above_one": ("cmpl", {"top_p": 1.5}, 400, "top_p"),
    "n_zero": ("chat", {"n": 0}, 400, "n"),
    "n_1000": ("chat", {"n": 1000}, 400, "n"),
    "n_129_cmpl": ("cmpl", {"n": 129}, 400, "n"),
    "n_string": ("cmpl", {"n": "two"}, 400, "n"),
    "top_logprobs_21": ("chat", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    "top_logprobs_negative": ("chat", {"logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    "top_logprobs_without_logprobs": ("chat", {"top_logprobs": 2}, 400, "top_logprobs"),
    "chat_logprobs_not_bool": ("chat", {"logprobs": 5}, 400, "logprobs"),
    "cmpl_logprobs_21": ("cmpl", {"logprobs": 21}, 400, "logprobs"),
    "cmpl_logprobs_negative": ("cmpl", {"logprobs": -1}, 400, "logprobs"),
    "presence_penalty_3": ("chat", {"presence_penalty": 3}, 400, "presence_penalty"),
    "frequency_penalty_-2.5": ("cmpl", {"frequency_penalty": -2.5}, 400, "frequency_penalty"),
    "repetition_penalty_0": ("chat", {"repetition_penalty": 0}, 400, "repetition_penalty"),
    "repetition_penalty_negative": ("cmpl", {"repetition_penalty": -1}, 400, "repetition_penalty"),
    "logit_bias_101": ("chat", {"logit_bias": {"5": 101}}, 400, "logit_bias"),
    "logit_bias_-101": ("cmpl", {"logit_bias": {"5": -101}}, 400, "logit_bias"),
    "logit_bias_key_abc": ("chat", {"logit_bias": {"abc": 1}}, 400, "logit_bias"),
    "logit_bias_key_out_of_vocab": ("chat", {"logit_bias": {"999999": 1}}, 400, "logit_bias"),
    "logit_bias_key_negative": ("cmpl", {"logit_bias": {"-1": 1}}, 400, "logit_bias"),
    "logit_bias_value_string": ("chat", {"logit_bias": {"5": "x"}}, 400, "logit_bias"),
    "max_tokens_negative_chat": ("chat", {"max_tokens": -1}, 400, "max_tokens"),
    "max_tokens_negative_cmpl": ("cmpl", {"max_tokens": -1}, 400, "max_tokens"),
    "max_tokens_zero_chat": ("chat", {"max_tokens": 0}, 400, "max_tokens"),
    "max_completion_tokens_string": ("chat", {"max_completion_tokens": "x"}, 400, "max_completion_tokens"),
    "min_tokens_above_max_tokens": ("chat", {"min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    "min_tokens_negative": ("cmpl", {"min_tokens": -1}, 400, "min_tokens"),
    "stop_number": ("chat", {"stop": 5}, 400, "stop"),
    "stop_list_with_number": ("cmpl", {"stop": ["a", 5]}, 400, "stop[1]"),
    "stop_token_ids_string": ("chat", {"stop_token_ids": ["a"]}, 400, "stop_token_ids[0]"),
    "seed_string": ("chat", {"seed": "x"}, 400, "seed"),
    "ignore_eos_not_bool": ("chat", {"ignore_eos": "maybe"}, 400, "ignore_eos"),
    "echo_not_bool": ("cmpl", {"echo": "maybe"}, 400, "echo"),
    "messages_empty": ("chat", {"messages": []}, 400, "messages"),
    "role_wizard": ("chat", {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages[0].role"),
    "content_number": ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    "second_message_role_missing": ("chat", {"messages": [{"role": "user", "content": "Hi"}, {"content": "x"}]},
                                    400, "messages[1].role"),
    "messages_missing": ("chat", {"messages": DROP}, 400, "messages"),
    "prompt_missing": ("cmpl", {"prompt": DROP}, 400, "prompt"),
    "prompt_empty_list": ("cmpl", {"prompt": []}, 400, "prompt"),
    "prompt_empty_token_list": ("cmpl", {"prompt": [[]]}, 400, "prompt"),
    "prompt_token_out_of_vocab": ("cmpl", {"prompt": [999999]}, 400, "prompt"),
    "stream_options_without_stream_chat": ("chat", {"stream_options": {"include_usage": True}}, 400,
                                           "stream_options"),
    "stream_options_with_stream_false_cmpl": ("cmpl", {"stream": False, "stream_options": {"include_usage": True}},
                                              400, "stream_options"),
    "top_k_-5": ("chat", {"top_k": -5}, 400, "top_k"),
    "min_p_2": ("chat", {"min_p": 2}, 400, "min_p"),
    "min_p_negative": ("cmpl", {"min_p": -0.1}, 400, "min_p"),
    "model_not_string": ("chat", {"model": 123}, 400, "model"),
    "unknown_model_chat": ("chat", {"model": "gpt-17"}, 404, "model"),
    "unknown_model_cmpl": ("cmpl", {"model": "gpt-17"}, 404, "model"),
    "prompt_plus_max_tokens_too_long": ("cmpl", {"prompt": [THE_ID] * 1000, "max_tokens": 1100}, 400, "max_tokens"),
}


def _send(server_url: str, endpoint: str, overrides: dict) -> httpx.Response:
    body = dict(CHAT_BASE if endpoint == "chat" else CMPL_BASE)
    for k, v in overrides.items():
        if v is DROP:
            body.pop(k, None)
        else:
            body[k] = v
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return httpx.post(server_url + path, json=body, timeout=60)


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_request(server_url, case):
    """Each malformed or out-of-range request gets its status and an OpenAI error body naming the field."""
    endpoint, overrides, status, param = INVALID[case]
    r = _send(server_url, endpoint, overrides)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error" and err["code"]
    assert err["param"] == param, err
    if status == 400:
        assert param.split("[")[0].split(".")[0] in err["message"], err
    if case == "prompt_plus_max_tokens_too_long":
        assert err["code"] == "context_length_exceeded"
        for number in ("2048", "1000", "1100"):
            assert number in err["message"], err
    if case.startswith("unknown_model"):
        assert "gpt-17" in err["message"] and err["code"] == "model_not_found"


@pytest.mark.parametrize("raw", ['{"prompt": "Hi", "max_tokens": 2', "{'prompt': 'Hi'}", "null"])
def test_invalid_json_completions(server_url, raw):
    """A malformed or non-object JSON body on /v1/completions is a 400 with a null param."""
    r = httpx.post(server_url + "/v1/completions", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] is None


def test_chat_max_tokens_too_long_message(client, max_model_len):
    """A chat prompt + max_tokens over the limit names max_tokens and quotes the limit and both token counts."""
    n_prompt = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=1,
                                              temperature=0).usage.prompt_tokens
    max_tokens = max_model_len - n_prompt + 1
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=max_tokens)
    e = ei.value
    assert e.param == "max_tokens" and e.code == "context_length_exceeded"
    msg = e.body["message"]
    assert str(max_model_len) in msg and str(n_prompt) in msg and str(max_tokens) in msg
    # exactly at the limit is fine
    r = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=max_tokens - 1,
                                       temperature=0)
    assert r.choices[0].finish_reason == "stop"


def test_max_completion_tokens_error_names_field(server_url):
    """An invalid max_completion_tokens is reported with param max_completion_tokens (the field sent)."""
    r = _send(server_url, "chat", {"max_tokens": DROP, "max_completion_tokens": 0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_completion_tokens", r.json()


def test_server_sound_after_invalid_requests(server_url, client):
    """After the invalid requests a normal request succeeds and the engine holds no request and no KV block."""
    r = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].message.content
    s = wait_idle(server_url, timeout=5.0)
    assert s["num_running"] == 0 and s["num_free_blocks"] == s["num_blocks"]

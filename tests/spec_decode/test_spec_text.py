"""Speculation never changes the text: for prompts full of multi-byte characters (so drafts are
proposed inside them) and caps falling anywhere, including inside a character, the text with
n-gram and with suffix speculation equals the text without it, byte for byte, and the streamed
deltas join to it (issue 36: a cap inside a character turned one emoji into U+FFFD)."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = [
    "Emoji meanings: 🔥 means fire, 👋 means hello, 😀 means",
    "Repeat after me: 🌱🌱🌱🌱 東京 東京 東京 🌱🌱🌱🌱 東京 東京",
    "Liste: café, naïve, résumé, déjà vu, café, naïve, résumé, déjà vu, café,",
    "日本語の文: 今日は良い天気です。今日は良い天気です。今日は",
]


def _requests(tok) -> list[tuple[list[int], int]]:
    """(prompt ids, cap) pairs: every cap 1..28 on the first prompt (the issue's), random caps on the others."""
    rng = random.Random(36)
    ids = [tok.encode(p) for p in PROMPTS]
    out = [(ids[0], cap) for cap in range(1, 29)]
    out += [(p, rng.randint(1, 40)) for p in ids[1:] for _ in range(6)]
    return out


def _streamed(eng, requests) -> list[str]:
    """The joined streamed deltas of every request, all run together through ``eng``."""
    for i, (prompt, cap) in enumerate(requests):
        eng.add_request(f"r{i}", prompt,
                        SamplingParams(temperature=0, max_tokens=cap, ignore_eos=True))
    streamed = [""] * len(requests)
    while eng.has_unfinished_requests():
        for out in eng.step(delta=True):
            streamed[int(out.request_id[1:])] += out.outputs[0].text
    return streamed


@pytest.fixture(scope="module")
def plain_texts(smollm2_dir, smollm2_tokenizer):
    reqs = _requests(smollm2_tokenizer)
    llm = LLM(str(smollm2_dir), num_kv_blocks=512)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                        [SamplingParams(temperature=0, max_tokens=c, ignore_eos=True) for _, c in reqs], use_tqdm=False)
    del llm
    return reqs, [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_never_changes_the_text(plain_texts, smollm2_dir, assert_no_leaks, method):
    reqs, want = plain_texts
    assert any("\ufffd" in t for t in want)  # some caps do fall inside a character
    llm = LLM(str(smollm2_dir), num_kv_blocks=512,
              speculative_config={"method": method, "num_speculative_tokens": 4, "dynamic": False,
                                  "prompt_lookup_min": 1} if method == "ngram" else
              {"method": method, "num_speculative_tokens": 4, "dynamic": False})
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                        [SamplingParams(temperature=0, max_tokens=c, ignore_eos=True) for _, c in reqs], use_tqdm=False)
    got = [o.outputs[0].text for o in outs]
    bad = [(i, reqs[i][1], g, w) for i, (g, w) in enumerate(zip(got, want)) if g.encode() != w.encode()]
    assert not bad, bad[:3]
    streamed = _streamed(llm.llm_engine, reqs)
    bad = [(i, s, w) for i, (s, w) in enumerate(zip(streamed, want)) if s != w]
    assert not bad, bad[:3]
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_accepted_tokens > 20, stats  # drafts were kept, several tokens a step
    assert_no_leaks(llm.llm_engine)

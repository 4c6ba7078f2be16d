"""Async scheduling: the same tokens as the synchronous loop, with step N+1 issued before step N's tokens.

Each workload runs twice on SmolLM2, ``async_scheduling`` on and off, and the
outputs must be identical token for token: greedy and seeded sampling, stop
strings, stop token ids, EOS, max_tokens, penalties, logprobs, preemption
(a KV pool too small for the batch), aborts, and prefix-cache hits. The async
runs must really overlap (some step took a token sampled by the step before it),
and they must end with no KV block or runner slot held.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

TEXT = ("The lighthouse keeper climbed the stairs every evening, counting the steps as his father had, "
        "and wrote the weather into a ledger that nobody read. One winter a ship")


def _engine_args(async_on: bool, **kw) -> dict:
    return dict(async_scheduling=async_on, num_threads=2, **kw)


def _watch_feeds(llm) -> list[int]:
    """Count, per step, the inputs the runner took from the previous step's samples."""
    runner = llm.engine.runner
    fed: list[int] = []
    orig = runner._prepare

    def prepare(so):
        step = orig(so)
        fed.append(int(step.pending_idx.numel()))
        return step
    runner._prepare = prepare
    return fed


def _run(smollm2_dir, async_on: bool, prompts, params, **kw):
    llm = LLM(str(smollm2_dir), **_engine_args(async_on, **kw))
    fed = _watch_feeds(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.step()  # hand the runner the last finished ids
    return llm, fed, [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                       o.outputs[0].stop_reason) for o in outs], outs


def _mixed_workload(tok):
    ids = tok.encode(TEXT)
    prompts = [ids[:5], ids[:17], ids[3:40], ids, ids[10:11], ids[:33], ids[2:29], ids[:16]]
    # stop strings / token ids taken from the greedy continuation, so they really fire
    params = [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0, max_tokens=40, stop=[" the"]),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0.8, seed=11, max_tokens=30),
        SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.7, presence_penalty=0.3,
                       repetition_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=20, logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=5, max_tokens=25, min_tokens=10),
        SamplingParams(temperature=0, max_tokens=1),
    ]
    return prompts, params


@pytest.fixture(scope="module")
def mixed_results(smollm2_dir, smollm2_tokenizer):
    prompts, params = _mixed_workload(smollm2_tokenizer)
    return {on: _run(smollm2_dir, on, prompts, params) for on in (True, False)}


def test_async_matches_sync_on_mixed_workload(mixed_results, assert_no_leaks):
    llm_on, fed_on, on, outs_on = mixed_results[True]
    llm_off, fed_off, off, outs_off = mixed_results[False]
    assert on == off
    assert sum(fed_on) > 50 and sum(fed_off) == 0  # async really fed sampled tokens forward
    # the workload exercised what it should: a stop string, a 1-token request, max_tokens
    reasons = [r[2] for r in on]
    assert on[1][3] == " the" and reasons[1] == "stop" and len(on[7][0]) == 1 and reasons[2] == "length"
    for a, b in zip(outs_on[5].outputs[0].logprobs, outs_off[5].outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    for llm in (llm_on, llm_off):
        assert_no_leaks(llm.engine)


def test_stop_token_found_late_is_discarded(smollm2_dir, smollm2_tokenizer, assert_no_leaks):
    """A stop token id ends the output at the same place in both modes; the extra token never shows."""
    ids = smollm2_tokenizer.encode(TEXT)
    _, _, plain, _ = _run(smollm2_dir, False, [ids[:12]], SamplingParams(temperature=0, max_tokens=12))
    stop_at = plain[0][0][4]  # the 5th greedy token
    results = {}
    for on in (True, False):
        llm, _, res, _ = _run(smollm2_dir, on, [ids[:12]],
                              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))
        results[on] = res
        assert res[0][0][-1] == stop_at and len(res[0][0]) == plain[0][0].index(stop_at) + 1
        assert llm.engine.get_stats()["num_generation_tokens"] == len(res[0][0])
        assert_no_leaks(llm.engine)
    assert results[True] == results[False]


def test_preemption_and_prefix_caching_match(smollm2_dir, smollm2_tokenizer, assert_no_leaks):
    """A pool of 24 blocks x 16 tokens cannot hold 8 sequences of ~70 tokens: requests get preempted."""
    ids = smollm2_tokenizer.encode(TEXT)
    prompts = [ids[:20 + i] for i in range(8)] + [ids[:20]] * 2  # shared prefixes hit the cache
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    res = {}
    for on in (True, False):
        llm, fed, out, _ = _run(smollm2_dir, on, prompts, params, num_kv_blocks=24)
        stats = llm.engine.get_stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
        res[on] = out
        assert_no_leaks(llm.engine)
    assert res[True] == res[False]


def test_aborts_mid_flight(smollm2_dir, smollm2_tokenizer, assert_no_leaks):
    """Aborting requests between steps (one step in flight) frees everything; the rest are unchanged."""
    ids = smollm2_tokenizer.encode(TEXT)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    res = {}
    for on in (True, False):
        llm = LLM(str(smollm2_dir), **_engine_args(on))
        eng = llm.engine
        for i in range(6):
            eng.add_request(f"r{i}", ids[:8 + 3 * i], params)
        done, steps = {}, 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
            steps += 1
            if steps == 4:
                eng.abort_request(["r1", "r4"])
        eng.step()
        assert set(done) == {"r0", "r2", "r3", "r5"} and all(len(t) == 20 for t in done.values())
        res[on] = done
        assert_no_leaks(eng)
    assert res[True] == res[False]

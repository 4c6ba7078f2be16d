"""Shared helpers of the speculative-decoding tests."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams


@pytest.fixture
def spec_soak(assert_no_leaks):
    """``spec_soak(eng, rng, rounds, requests, max_tokens, abort_at)``: rounds of mixed greedy and
    sampled requests (stop tokens, logprobs; the first three aborted at step ``abort_at``) through an
    engine with speculation; after each round every KV block is back in its pool."""

    def run(eng, rng, rounds: int, requests: int, max_tokens: int, abort_at: int) -> None:
        for round_ in range(rounds):
            ids = []
            for i in range(requests):
                head = [rng.randint(100, 40000) for _ in range(rng.randint(2, 10))]
                sp = SamplingParams(temperature=rng.choice([0, 0.7]), max_tokens=rng.randint(1, max_tokens),
                                    ignore_eos=True, logprobs=rng.choice([None, 2]), seed=i, stop_token_ids=[head[0]])
                rid = f"r{round_}-{i}"
                eng.add_request(rid, head * 3, sp)
                ids.append(rid)
            steps = 0
            while eng.has_unfinished_requests():
                for out in eng.step():
                    c = out.outputs[0]
                    if c.logprobs is not None:
                        assert len(c.logprobs) == len(c.token_ids)
                steps += 1
                if steps == abort_at:
                    eng.abort_request(ids[:3])
            assert_no_leaks(eng)
        assert eng.get_stats().spec_num_draft_tokens > 0

    return run

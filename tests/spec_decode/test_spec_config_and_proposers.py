"""Speculative decoding's configuration, proposers and depth rule, without a model."""

from __future__ import annotations

import pytest

from pagedllm.config import EngineArgs
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.depth import DRAFT_COST_MARGIN, PROBE_EVERY, DepthController
from pagedllm.spec_decode.proposers import NgramProposer, ProposeItem, SuffixProposer


def test_config_parses_vllm_shapes():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 3, 3)
    assert SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 2}).dynamic is True
    assert EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).speculative_config.method == "ngram"
    assert EngineArgs().speculative_config is None
    # vLLM's inference: a model without a method is a draft model
    cfg = SpeculativeConfig.parse({"model": "some/draft", "num_speculative_tokens": 2})
    assert (cfg.method, cfg.model, cfg.quantization, cfg.draft_num_kv_blocks) == ("draft_model", "some/draft", "auto", None)


@pytest.mark.parametrize("value, words", [
    ("{not json", "not valid JSON"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key(s) ['typo']"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 2}, "min_token_prob"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "d"}, "apply to method 'draft_model' only"),
    ({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "not served by pagedllm"),
    ({"model": "d", "num_speculative_tokens": 2, "draft_num_kv_blocks": 0}, "draft_num_kv_blocks must be"),
    ({"model": "d", "num_speculative_tokens": 2, "quantization": "fp8"}, "speculative_config.quantization"),
    ([1, 2], "must be a JSON object"),
])
def test_config_refuses_with_the_key_named(value, words):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.parse(value)
    assert words in str(e.value)


def test_ngram_takes_the_latest_match_of_the_longest_ngram():
    p = NgramProposer(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7]
    assert p.propose([ProposeItem("a", toks, 2, 3)]) == {"a": [2, 5, 6]}  # latest "5 6 7" is at 4
    assert p.propose([ProposeItem("a", [1, 2, 3, 4], 2, 3)]) == {}          # nothing recurs
    assert NgramProposer(2, 2).propose_one(__import__("numpy").array([9, 4, 8, 4]), 2) == []  # only a 1-gram recurs
    assert NgramProposer(1, 1).propose_one(__import__("numpy").array([9, 4, 8, 4]), 2) == [8, 4]


def test_suffix_follows_the_most_frequent_continuation_and_learns_from_finished_requests():
    s = SuffixProposer(max_depth=8, max_cached_requests=1, min_token_prob=0.4)
    own = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2]
    assert s.propose([ProposeItem("a", own, 4, 3)]) == {"a": [3, 9, 1]}  # "3" then 9 (2 of 3) beats 8
    s.finish("a", own, 4)
    # a new request reuses the finished one's output
    # ("9 1 2" was followed by 3 twice; after "9 1 2 3" came 9 once and 8 once: a tie, the lower id wins)
    assert s.propose([ProposeItem("b", [7, 7, 9, 1, 2], 5, 2)])["b"] == [3, 8]
    # below min_token_prob: no guess
    t = SuffixProposer(max_depth=8, max_cached_requests=0, min_token_prob=0.9)
    assert t.propose([ProposeItem("c", [4, 5, 4, 6, 4], 1, 2)]) == {}
    # the oldest kept request is dropped past max_cached_requests
    s.finish("b", [7, 7, 9, 1, 2, 40, 41], 5)
    assert list(s._kept) == ["b"]
    assert (2, 3) not in s._global.counts and s._global.counts[(1, 2)] == {40: 1}


def test_depth_rule_turns_down_when_drafts_fail_or_steps_are_costly():
    d = DepthController(max_k=5)
    assert d.depth("r", 1) > 0  # prior acceptance on an unmeasured (memory-bound) device
    for _ in range(10):
        d.record("r", 5, 0)
    assert d.depth("r", 1) == 0  # its drafts keep failing
    for _ in range(10):
        d.record("r", 5, 5)
    assert d.depth("r", 1) == 5
    # a device where a 2-token step costs 3 single ones: nothing is worth it, and no probes either
    c = DepthController(max_k=5)
    for _ in range(3):
        c.observe(1, 0.010)
        c.observe(2, 0.030)
        c.observe(6, 0.070)
    for _ in range(10):
        c.record("r", 5, 5)
    assert [c.depth("r", 1) for _ in range(3 * PROBE_EVERY)] == [0] * (3 * PROBE_EVERY)
    # memory-bound: a 6-token step costs 1.1 single ones; a big batch makes even that too dear
    m = DepthController(max_k=5)
    for t, y in ((1, 0.010), (6, 0.011), (16, 0.030), (21, 0.040)):
        for _ in range(2):
            m.observe(t, y)
    m.alpha["r"] = 0.5
    assert m.depth("r", 1) >= 3
    assert m.depth("r", 16) == 0


def test_sitting_a_step_out_costs_a_token_beside_other_decodes():
    """Under async scheduling a request with a step in flight drafts by sitting one step out: beside
    other decodes (c16, t(T) linear as on a compute-bound CPU) a probe that would barely pay with
    full acceptance (its cost margin included) is not worth that token; alone the skipped step
    costs none."""
    d = DepthController(max_k=5)
    for t in (1, 16, 21):
        for _ in range(2):
            d.observe(t, 0.013 + 0.002 * t)  # 15 ms at 1, 45 ms at 16: 5 full drafts pay 2.7%
    probes = [d.depth("r", 16) for _ in range(PROBE_EVERY)]
    assert probes.count(5) == 1  # without a sit-out it probes once per PROBE_EVERY steps
    assert [d.depth("s", 16, sit_out=True) for _ in range(3 * PROBE_EVERY)] == [0] * (3 * PROBE_EVERY)
    d.alpha["a"] = 0.95
    assert d.depth("a", 1, sit_out=True) == d.depth("a", 1) > 0


def test_async_drafting_costs_the_step_after_the_drafts():
    """Under async scheduling a request with drafts in step N misses step N + 1: beside other
    decodes its drafts must earn that token too (and a sit-out's), alone they need not; with
    synchronous scheduling nothing is skipped."""
    sync, asyn = DepthController(max_k=5), DepthController(max_k=5, async_scheduling=True)
    for d in (sync, asyn):
        for t in (1, 16, 21):
            for _ in range(2):
                d.observe(t, 0.010 + 0.001 * t)  # 26 ms at 16 tokens, 31 ms at 21: 4 kept drafts pay 10%
        d.alpha["r"] = 0.9
    assert [d.skipped_steps(16, False) for d in (sync, asyn)] == [0, 1]
    assert asyn.skipped_steps(16, True) == 2 and asyn.skipped_steps(1, True) == 0
    assert sync.depth("r", 16) > 0
    assert asyn.depth("r", 16) < sync.depth("r", 16)
    assert asyn.depth("r", 16, sit_out=True) == 0
    assert asyn.depth("r", 1) == sync.depth("r", 1) > 0


def test_drafts_near_break_even_are_not_planned():
    """Float32 SmolLM2 at 16 concurrent requests: a 33-token step cost 1.9x a 16-token one and
    drafts planned on a predicted gain of a few percent ran at 0.89x; the drafts' extra time counts
    ``DRAFT_COST_MARGIN`` times, so those are not planned, while batch 1 still drafts fully."""
    d = DepthController(max_k=5)
    for t, y in ((1, 0.0132), (6, 0.027), (16, 0.031), (33, 0.0594)):
        for _ in range(2):
            d.observe(t, y)
    d.alpha["r"] = 0.96
    assert d.depth("r", 16) == 0
    assert d.depth("r", 1) == 5
    assert DRAFT_COST_MARGIN > 1


def test_depth_counts_the_drafts_already_planned_in_the_step():
    """16 decodes on a memory-bound device: the first requests get drafts, and once the step's
    measured cost grows the later ones get none (each request sees the others' drafts)."""
    d = DepthController(max_k=5)
    for t, y in ((1, 0.010), (6, 0.011), (16, 0.012), (17, 0.0121), (40, 0.030)):
        for _ in range(2):
            d.observe(t, y)
    d.begin_step()
    ks = []
    for i in range(16):
        d.alpha[f"r{i}"] = 0.9
        k = d.depth(f"r{i}", 16)
        d.planned(f"r{i}", k)
        ks.append(k)
    assert ks[0] > 0 and ks[-1] == 0 and sum(ks) < 16


def test_depth_estimate_has_no_side_effects_and_a_draft_models_cost_counts():
    """``estimate`` (what a batched proposer drafts ahead) is the first request's depth without
    counting toward a probe; a model proposer's seconds per forward make deep drafts dearer."""
    d = DepthController(max_k=5)
    for t, y in ((1, 0.010), (6, 0.011)):
        for _ in range(2):
            d.observe(t, y)
    d.alpha["r"] = 0.8
    d.begin_step()
    assert d.estimate("r", 1) == d.depth("r", 1) == 5
    d.alpha["z"] = 0.0
    for _ in range(3 * PROBE_EVERY):
        assert d.estimate("z", 1) == 0
    assert d._since_probe.get("z", 0) == 0  # estimates never count toward the probe
    d.proposer_step_s = 0.004  # each draft forward costs 40% of a target step: fewer drafts pay
    assert 0 < d.depth("r", 1) < 5
    d.proposer_step_s = 0.05   # dearer than any gain
    assert d.depth("r", 1) == 0 and d.estimate("r", 1) == 0
    assert DepthController(max_k=3, dynamic=False).estimate("r", 64) == 3

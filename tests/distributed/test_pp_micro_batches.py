"""Pipeline micro-batches (GPipe inside a step): the metadata slicing, the cut into whole requests,
PP=2 x 2 and PP=3 x 3 micro-batches giving PP=1's greedy tokens (several prompts of different
lengths, chunked prefill, one request), and rank 0's recorded events showing the micro-batches
interleaved with their sends (counted, not timed).

The engines start one or two worker processes beside the test process: tiny models, one thread per
rank, short generations (the machine's cores are shared).
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.metadata import AttentionBatch, slice_batch
from pagedllm.attention.torch_paged import TorchPagedBackend
from pagedllm.config import EngineArgs
from pagedllm.distributed.micro_batch import split_requests
from pagedllm.models.layers import pipeline

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
# different lengths; with max_num_batched_tokens=24 the two long ones are prefilled in chunks
PROMPTS = [[1, 520, 3012, 314, 260, 1142], [1, 9182, 28, 451, 5035, 29, 7, 441, 33, 2847, 355, 1903] * 3,
           list(range(100, 140)), [1, 77, 4051]]
CHUNKED = dict(max_num_batched_tokens=24, num_kv_blocks=64, num_threads=1)


def _children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pagedllm-tp")]


def _batch() -> AttentionBatch:
    """Four requests (a 5-token prefill chunk after 3 cached, two decodes, a fresh 4-token prompt)
    over block size 4, block table rows 3, 0, 2, 1."""
    bs = 4
    table = np.arange(4 * 5, dtype=np.int64).reshape(4, 5)[::-1].copy()
    n = np.array([5, 1, 1, 4])
    computed = np.array([3, 6, 9, 0])
    rows = np.array([3, 0, 2, 1])
    qsl = np.concatenate([[0], np.cumsum(n)])
    pos = np.concatenate([np.arange(c, c + k) for c, k in zip(computed, n)])
    row = np.repeat(rows, n)
    return AttentionBatch(query_start_loc=qsl, num_computed=computed, seq_lens=computed + n,
                          slot_mapping=table[row, pos // bs] * bs + pos % bs, block_table=table, rows=rows,
                          block_size=bs)


def test_slice_batch_keeps_each_requests_layout():
    b = _batch()
    s = slice_batch(b, 1, 3)
    assert s.query_start_loc.tolist() == [0, 1, 2]
    assert s.slot_mapping.tolist() == b.slot_mapping[5:7].tolist()
    assert (s.num_computed.tolist(), s.seq_lens.tolist(), s.rows.tolist()) == ([6, 9], [7, 10], [0, 2])
    assert s.block_table is b.block_table and s.block_size == 4
    with pytest.raises(ValueError, match="outside the batch's 4 requests"):
        slice_batch(b, 2, 5)
    with pytest.raises(ValueError, match="empty"):
        slice_batch(b, 2, 2)


def test_attention_over_sliced_metadata_equals_the_whole_step():
    """The torch backend's output for the whole step equals its outputs per micro-batch, concatenated."""
    torch.manual_seed(0)
    b, backend = _batch(), TorchPagedBackend(torch.device("cpu"))
    heads, kvh, d, t = 4, 2, 8, int(b.query_start_loc[-1])
    cache = (torch.randn(kvh, 20, 4, d), torch.randn(kvh, 20, 4, d))  # [KVH, blocks, block size, D]
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
    whole = backend.forward(q, k, v, cache, backend.build_metadata(b), d ** -0.5)
    parts = []
    for a, e in split_requests(b.query_start_loc, 3):
        t0, t1 = int(b.query_start_loc[a]), int(b.query_start_loc[e])
        meta = backend.build_metadata(slice_batch(b, a, e))
        parts.append(backend.forward(q[t0:t1], k[t0:t1], v[t0:t1], cache, meta, d ** -0.5))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-6)


def test_split_requests_whole_requests_balanced_by_tokens():
    qsl = np.array([0, 5, 6, 7, 11])
    assert split_requests(qsl, 2) == [(0, 1), (1, 4)]        # 5 | 6 tokens
    assert split_requests(qsl, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert split_requests(qsl, 9) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # at most one per request
    assert split_requests(np.array([0, 30]), 2) == [(0, 1)]   # one request stays whole
    assert split_requests(np.array([0, 1, 40, 41]), 3) == [(0, 1), (1, 2), (2, 3)]  # never empty
    with pytest.raises(ValueError, match="into 0 micro-batches"):
        split_requests(qsl, 0)


def test_micro_batches_flag_validated():
    assert EngineArgs(pipeline_parallel_size=2).pipeline_micro_batches == 0
    with pytest.raises(ValueError, match="--pipeline-micro-batches must be >= 0"):
        EngineArgs(pipeline_parallel_size=2, pipeline_micro_batches=-1)


def _generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _hf_loader(path):
    """A loader of the transformers model at ``path`` in float32 (the near-tie rule's oracle)."""
    def hf():
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """PP=1's greedy tokens of the tiny Llama (3 layers) for the batch and for the first prompt alone."""
    llm = LLM(str(tiny_model_dir("llama")), **CHUNKED)
    try:
        return _generate(llm, PROMPTS), _generate(llm, PROMPTS[:1])
    finally:
        llm.engine.shutdown()


def _check(got, want, prompts, path, greedy_ref, what):
    hf = _hf_loader(path)
    for k, (g, w) in enumerate(zip(got, want)):
        greedy_ref.assert_same_greedy(g, w, prompts[k], hf, f"{what} prompt {k}")


def test_pp2_two_micro_batches_interleave_and_match_pp1(tiny_model_dir, reference, greedy_ref, monkeypatch):
    """Rank 0 (stage 0, in this process) records its events: in every step of several requests it
    starts micro-batch 1 with micro-batch 0's send still in flight, and receives both back."""
    from pagedllm.core import scheduler
    path = tiny_model_dir("llama")
    trace: list = []
    monkeypatch.setattr(pipeline, "PIPELINE_TRACE", trace)
    # split the requests between the steps in flight for these short prompts and their decodes too
    monkeypatch.setattr(scheduler, "PIPELINE_SPLIT_MIN_TOKENS", 0)
    llm = LLM(str(path), pipeline_parallel_size=2, pipeline_micro_batches=2, **CHUNKED)
    try:
        batch = _generate(llm, PROMPTS)
        batch_events = list(trace)
        trace.clear()
        single = _generate(llm, PROMPTS[:1])
        single_events = list(trace)
    finally:
        llm.engine.shutdown()
    assert _children() == []
    _check(batch, reference[0], PROMPTS, path, greedy_ref, "PP=2 x 2 micro-batches")
    _check(single, reference[1], PROMPTS[:1], path, greedy_ref, "PP=2 x 2, one request")

    steps = [e[:2] for e in batch_events if e[0] in ("launch", "finish")]
    batch_events = [e for e in batch_events if e[0] not in ("launch", "finish")]
    single_events = [e for e in single_events if e[0] not in ("launch", "finish")]
    # several steps in flight: step s + 1 is launched before step s finishes, in most steps
    launched_early = [s for s in range(len(steps) // 2 - 1)
                      if steps.index(("launch", s + 1)) < steps.index(("finish", s))]
    assert len(launched_early) >= MAX_NEW // 2, steps
    computes = [(k, flying) for ev, k, flying in batch_events if ev == "compute"]
    split = [c for c in computes if c[0] == 1]
    # each step holds half of the four requests until the last ones finish: most steps are split
    assert len(split) >= MAX_NEW - 1
    assert all(flying == 1 for _, flying in split)  # micro-batch 0 still being sent while 1 computes
    assert max(k for k, _ in computes) == 1
    assert sum(ev == "receive" for ev, _, _ in batch_events) == len(computes)
    # per step: compute 0, send 0, compute 1, send 1 (then the next step's, or the two returns)
    i = batch_events.index(("compute", 1, 1))
    assert [e[:2] for e in batch_events[i - 2:i + 2]] == [("compute", 0), ("send", 0), ("compute", 1), ("send", 1)]
    # one request is one micro-batch
    assert {k for ev, k, _ in single_events} == {0} and len(single_events) == 3 * MAX_NEW


def test_pp2_one_micro_batch_is_the_sequential_step(tiny_model_dir, reference, greedy_ref, monkeypatch):
    path = tiny_model_dir("llama")
    trace: list = []
    monkeypatch.setattr(pipeline, "PIPELINE_TRACE", trace)
    llm = LLM(str(path), pipeline_parallel_size=2, pipeline_micro_batches=1, **CHUNKED)
    try:
        got = _generate(llm, PROMPTS)
    finally:
        llm.engine.shutdown()
    _check(got, reference[0], PROMPTS, path, greedy_ref, "PP=2 x 1 micro-batch")
    assert {k for ev, k, _ in trace if ev not in ("launch", "finish")} == {0}


def test_pp2_without_async_scheduling_drains_every_step(tiny_model_dir, reference, greedy_ref, monkeypatch):
    """Synchronous scheduling keeps one step in flight: every launch is finished before the next."""
    path = tiny_model_dir("llama")
    trace: list = []
    monkeypatch.setattr(pipeline, "PIPELINE_TRACE", trace)
    llm = LLM(str(path), pipeline_parallel_size=2, async_scheduling=False, **CHUNKED)
    try:
        assert not llm.engine.core.scheduler.pipeline_overlap
        got = _generate(llm, PROMPTS)
    finally:
        llm.engine.shutdown()
    _check(got, reference[0], PROMPTS, path, greedy_ref, "PP=2, synchronous")
    steps = [e[:2] for e in trace if e[0] in ("launch", "finish")]
    assert len(steps) >= 2 * MAX_NEW
    assert steps == [(ev, i // 2) for i, ev in enumerate(["launch", "finish"] * (len(steps) // 2))]


def test_pp3_three_micro_batches_match_pp1(tiny_model_dir, reference, greedy_ref):
    """Three stages of one layer each; three micro-batches (0: one per stage) in a ring of three ranks."""
    path = tiny_model_dir("llama")
    llm = LLM(str(path), pipeline_parallel_size=3, **CHUNKED)
    try:
        assert len(llm.engine.core.runner.model.layers) == 1
        batch, single = _generate(llm, PROMPTS), _generate(llm, PROMPTS[:1])
    finally:
        llm.engine.shutdown()
    assert _children() == []
    _check(batch, reference[0], PROMPTS, path, greedy_ref, "PP=3 x 3 micro-batches")
    _check(single, reference[1], PROMPTS[:1], path, greedy_ref, "PP=3 x 3, one request")


def test_pp2_micro_batches_with_ngram_drafts_match_pp1(tiny_model_dir):
    """Draft tokens give a request several logits rows; each micro-batch returns its own, in order."""
    path = tiny_model_dir("llama")
    prompts = [PROMPTS[1], [5, 6, 7, 8] * 8, PROMPTS[0]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "dynamic": False, "prompt_lookup_min": 1}
    ref = LLM(str(path), **CHUNKED)
    try:
        want = _generate(ref, prompts)
    finally:
        ref.engine.shutdown()
    llm = LLM(str(path), pipeline_parallel_size=2, speculative_config=spec, **CHUNKED)
    try:
        got = _generate(llm, prompts)
        stats = llm.engine.get_stats()
        assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0, stats
    finally:
        llm.engine.shutdown()
    assert got == want

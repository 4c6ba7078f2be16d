"""Decode CUDA graphs (``worker/device/cuda_graphs.py``) checked on the CPU through Triton's interpreter.

The capture is injected: ``CallCapture`` replays a bucket by calling the forward it
captured, over the same static buffers and metadata, so a replay reads only what a
real graph would (and with the grid frozen at capture). Checked here:

- greedy tokens with graphs equal the eager path's, over decode batches that hit
  several buckets, need padding, or exceed the largest bucket (eager);
- which steps replay: exactly the decode-only ones with a bucket;
- a padded row writes no KV slot and does not change the real rows' logits;
- ``enforce_eager=True`` captures nothing.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention import triton_paged
from pagedllm.attention.triton_paged import TritonMetadata
from pagedllm.worker import model_runner
from pagedllm.worker.device import cuda_graphs

PROMPTS = [list(range(5, 31)), list(range(7, 12)), list(range(40, 49)), [3, 4, 5]]
MAX_TOKENS = [7, 5, 3, 2]  # decode batches of 4 (above the largest bucket), 3, 2 (padded to 3), 1


def _llm(tiny_model_dir, **kw) -> LLM:
    return LLM(str(tiny_model_dir("llama")), attention_backend="triton", num_kv_blocks=48, max_model_len=96,
               max_num_batched_tokens=24, max_num_seqs=4, **kw)


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    """Greedy generations with graphs (buckets 1 and 3) and with ``enforce_eager``; each run's
    captures and per-forward records ``(graph, tokens, sampled requests)``."""
    mp = pytest.MonkeyPatch()
    mp.setattr(triton_paged, "SPLIT_TOKENS", 16)  # several decode splits on short contexts
    records: list[tuple[bool, int, int]] = []
    forward = model_runner.ModelRunner._forward

    def recorded(self, step):
        records.append((step.graph, int(step.input_ids.shape[0]), len(step.sample_ids)))
        return forward(self, step)

    mp.setattr(model_runner.ModelRunner, "_forward", recorded)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    out = {}
    try:
        for name, kw in (("graphs", dict(cuda_graph_sizes=[1, 3])), ("eager", dict(enforce_eager=True))):
            capture = cuda_graphs.CallCapture()
            mp.setattr(cuda_graphs, "capture_for", lambda device, c=capture: c)
            records.clear()
            llm = _llm(tiny_model_dir, **kw)
            toks = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            out[name] = dict(llm=llm, tokens=toks, capture=capture, records=list(records))
    finally:
        mp.undo()
    return out


def test_graph_tokens_equal_eager(runs):
    g, e = runs["graphs"], runs["eager"]
    assert [len(t) for t in g["tokens"]] == MAX_TOKENS
    assert g["tokens"] == e["tokens"]
    assert g["capture"].captured == [3, 1]  # largest first
    # bucket 3 replayed for batches of 3 and of 2 (one padded row), bucket 1 for the last request
    assert g["capture"].replays[3] >= 2 and g["capture"].replays[1] >= 1
    graphs = g["llm"].llm_engine.runner.decode_graphs
    assert graphs.num_splits == 6 and graphs.split_len == 16  # from max_model_len 96, not the step


def test_only_decode_steps_with_a_bucket_replay(runs):
    recs = runs["graphs"]["records"]
    for graph, tokens, sampled in recs:
        assert graph == (tokens == sampled and tokens <= 3), (graph, tokens, sampled)
    eager = [r for r in recs if not r[0]]
    assert any(t == s == 4 for _, t, s in eager)  # a decode batch above the largest bucket
    assert any(t != s for _, t, s in eager)  # prefill and mixed steps
    runner = runs["graphs"]["llm"].llm_engine.runner
    assert runner.step_counts["graph"] == len(recs) - len(eager) == sum(runs["graphs"]["capture"].replays.values())
    assert runner.step_counts["eager"] == len(eager)


def test_enforce_eager_captures_nothing(runs):
    e = runs["eager"]
    assert e["capture"].captured == [] and e["capture"].replays == {}
    assert e["llm"].llm_engine.runner.decode_graphs is None
    assert all(not graph for graph, _, _ in e["records"])


def _decode_meta(backend, slots, seq_lens, tables) -> TritonMetadata:
    r = len(slots)
    i64 = dict(dtype=torch.int64)
    lay = backend.step_layout(torch.ones(r, **i64).numpy(), torch.tensor(seq_lens, **i64).numpy(), 16)
    return TritonMetadata(slot_mapping=torch.tensor(slots, **i64), query_start_loc=torch.arange(r + 1),
                          num_computed=torch.tensor(seq_lens, **i64) - 1, seq_lens=torch.tensor(seq_lens, **i64),
                          block_tables=torch.tensor(tables, **i64), decode_req=torch.arange(r),
                          tile_req=torch.zeros(0, **i64), tile_q0=torch.zeros(0, **i64),
                          num_splits=lay.num_splits, split_len=lay.split_len, block_q=backend.block_q)


@torch.inference_mode()
def test_padded_row_writes_no_kv_and_keeps_real_rows(runs):
    runner = runs["graphs"]["llm"].llm_engine.runner
    graphs, caches = runner.decode_graphs, runner.kv_caches
    torch.manual_seed(0)
    for k, v in caches:
        k.normal_()
        v.normal_()
    # a previous batch of 3 left a real slot in row 2; this batch of 2 pads row 2 (bucket 3)
    graphs.slot_mapping[2] = 40 * 16 + 3
    ids, pos = torch.tensor([11, 12]), torch.tensor([20, 5])
    slots, lens, tables = [3 * 16 + 4, 7 * 16 + 5], [21, 6], [[1, 3], [7, 0]]
    before = [(k.clone(), v.clone()) for k, v in caches]
    logits = graphs.run(ids, pos, _decode_meta(runner.attention_backend, slots, lens, tables)).clone()
    assert logits.shape[0] == 2 and torch.isfinite(logits).all()
    for (k0, v0), (k1, v1) in zip(before, caches):
        for c0, c1 in ((k0, k1), (v0, v1)):
            changed = (c0 != c1).any(-1).any(0).flatten().nonzero().flatten().tolist()
            assert changed == slots  # the padded row's stale slot (40 * 16 + 3) untouched
    # the real rows' logits equal the eager forward's over the caches as they were
    for (k, v), (k0, v0) in zip(caches, before):
        k.copy_(k0)
        v.copy_(v0)
    eager = runner.model(ids, pos, caches, _decode_meta(runner.attention_backend, slots, lens, tables),
                         torch.arange(2))
    torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)


def test_default_sizes():
    assert cuda_graphs.default_sizes(1) == [1]
    assert cuda_graphs.default_sizes(4) == [1, 2, 4]
    assert cuda_graphs.default_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert cuda_graphs.default_sizes(32) == [1, 2, 4, 8, 16, 24, 32]


def test_graph_tokens_with_host_inputs(runs, tiny_model_dir, monkeypatch):
    """The host-built metadata (``PAGEDLLM_DEVICE_INPUTS=0``) feeds the graphs as well."""
    monkeypatch.setenv("PAGEDLLM_DEVICE_INPUTS", "0")
    monkeypatch.setattr(triton_paged, "SPLIT_TOKENS", 16)
    capture = cuda_graphs.CallCapture()
    monkeypatch.setattr(cuda_graphs, "capture_for", lambda device: capture)
    llm = _llm(tiny_model_dir, cuda_graph_sizes=[1, 3])
    assert llm.llm_engine.runner.step_inputs.name == "host"
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    toks = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert toks == runs["eager"]["tokens"]
    assert capture.replays[3] >= 2 and capture.replays[1] >= 1

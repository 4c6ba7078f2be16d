"""The persistent batch and the vectorized prepare, checked end to end through a fake model.

The fake model writes each token's (token id, position) into its KV slot and
reads every request's context back through the step's metadata (decode block
tables and prefill gather slots). It asserts the positions come back as 0..L-1 and
answers the token ``(31 * sum(context tokens) + L) % V``, so any wrong input id,
slot mapping, block table or fed-forward token changes the output against a
plain Python reference. Runs with async scheduling on and off, under chunked
prefill, preemption, prefix-cache hits and aborts.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.engine_core import EngineCore
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.core.scheduler_output import NewRequestData, CachedRequestData
from pagedllm.engine.messages import EngineCoreRequest

V = 97
EOS = 1000  # unreachable: requests end by max_tokens


def next_token(seq: list[int]) -> int:
    return (31 * sum(seq) + len(seq)) % V


class ContextModel(torch.nn.Module):
    """One layer, one KV head of width 2 holding (token id, position)."""

    def kv_cache_spec(self):
        return 1, 1, 2

    def forward(self, input_ids, positions, kv_caches, meta, rows):
        k, _ = kv_caches[0]
        flat = k.view(-1, 2)  # one KV head: the head-major cache is [1, blocks, block_size, 2]
        flat[meta.slot_mapping] = torch.stack([input_ids.float(), positions.float()], 1)
        answer = torch.zeros(input_ids.numel(), dtype=torch.int64)
        bs = k.shape[2]
        for i, row in enumerate(meta.decode_token_idx.tolist()):
            n = int(meta.decode_seq_lens[i])
            slots = (meta.decode_block_tables[i].unsqueeze(1) * bs + torch.arange(bs)).flatten()[:n]
            if meta.decode_mask is not None:
                assert meta.decode_mask[i].flatten().tolist() == [j < n for j in range(meta.decode_mask.shape[-1])]
            ctx = flat[slots]
            assert torch.equal(ctx[:, 1], torch.arange(n, dtype=torch.float32))
            answer[row] = (31 * int(ctx[:, 0].sum()) + n) % V
        for p in meta.prefills:
            ctx = flat[p.gather_slots]
            n = ctx.shape[0]
            assert torch.equal(ctx[:, 1], torch.arange(n, dtype=torch.float32))
            toks = ctx[:, 0].long()
            csum = toks.cumsum(0)[p.num_computed:]
            answer[p.q_start:p.q_end] = (31 * csum + torch.arange(p.num_computed + 1, n + 1)) % V
        logits = torch.full((rows.numel(), V), -10.0)
        logits[torch.arange(rows.numel()), answer[rows]] = 10.0
        return logits


def make_core(async_on: bool, num_blocks=14, budget=10, max_seqs=4) -> EngineCore:
    args = EngineArgs(block_size=4, num_kv_blocks=num_blocks, max_num_seqs=max_seqs,
                      max_num_batched_tokens=budget, async_scheduling=async_on)
    return EngineCore(args, None, 64, {EOS}, model=ContextModel())


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        t = next_token(seq)
        out.append(t)
        seq.append(t)
    return out


def drive(core: EngineCore, reqs, abort_at: dict[int, list[str]] | None = None):
    for rid, prompt, mt in reqs:
        core.add_request(EngineCoreRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=mt), mt, 0.0))
    got: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
    step = 0
    while core.has_unfinished_requests():
        for o in core.step():
            got[o.request_id] += o.new_token_ids
        step += 1
        if abort_at and step in abort_at:
            core.finish_requests(abort_at[step])
    core.step()
    return got


@pytest.mark.parametrize("async_on", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_matches_reference(async_on, seed):
    rng = random.Random(seed)
    reqs = []
    base = [rng.randrange(V) for _ in range(40)]
    for i in range(10):
        # half share a prefix (prefix-cache hits), lengths cross block boundaries
        prompt = base[:rng.randrange(4, 30)] if i % 2 else [rng.randrange(V) for _ in range(rng.randrange(1, 25))]
        reqs.append((f"r{i}", prompt, rng.randrange(1, 20)))
    core = make_core(async_on)
    got = drive(core, reqs)
    for rid, prompt, mt in reqs:
        assert got[rid] == reference(prompt, mt), rid
    stats = core.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    assert core.runner.requests == {} and len(core.runner.input_batch) == 0


@pytest.mark.parametrize("async_on", [True, False])
def test_aborts_leave_nothing(async_on):
    reqs = [(f"r{i}", list(range(1 + i, 9 + 2 * i)), 12) for i in range(6)]
    core = make_core(async_on, num_blocks=30)
    got = drive(core, reqs, abort_at={3: ["r1", "r4"], 5: ["r0"]})
    for rid, prompt, mt in reqs:
        want = reference(prompt, mt)
        if rid in ("r1", "r4", "r0"):
            assert got[rid] == want[:len(got[rid])] and len(got[rid]) < mt
        else:
            assert got[rid] == want
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    assert core.runner.requests == {}


def test_slots_are_reused_and_rows_copied():
    b = InputBatch(max_num_reqs=2, max_model_len=16, block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=4)
    s0 = b.add(NewRequestData("a", [5, 6, 7], 3, sp, [3], 0))
    s1 = b.add(NewRequestData("b", [1], 1, sp, [9], 0))
    assert (s0, s1) == (0, 1)
    with pytest.raises(RuntimeError):
        b.add(NewRequestData("c", [1], 1, sp, [2], 0))
    b.update(CachedRequestData("a", [4, 8], 3))
    assert b.block_table[s0, :3].tolist() == [3, 4, 8] and b.num_blocks[s0] == 3
    b.append_tokens(["a", "gone", "b"], [11, 99, 12])
    assert b.token_ids[s0, :4].tolist() == [5, 6, 7, 11] and b.token_ids[s1, :2].tolist() == [1, 12]
    b.remove("a")
    assert b.add(NewRequestData("c", [2, 2], 2, sp, [1], 0)) == s0 and b.num_tokens[s0] == 2
    md = b.sampling_metadata(np.array([s0, s1]), np.array([1]), np.array([0]))
    assert md.output_lens.tolist() == [0, 2] and md.all_greedy

"""The attention backends against dense causal attention, and the one-time backend choice.

One step mixes decodes and prefills (one with a cached prefix) over shuffled
blocks; every backend that runs here must give what plain softmax attention
over each request's whole context gives, with and without a sliding window
and soft-capping.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.selector import PRIORITY, select_attention_backend
from pagedllm.attention.metadata import AttentionBatch
from pagedllm.attention.torch_paged import TorchPagedBackend
from pagedllm.kernels import cpu as cpu_kernels

KVH, H, D, BS, NB = 2, 6, 32, 8, 48
# (context length after the step, tokens computed this step): decodes, a fresh and a chunked prefill
REQS = [(1, 1), (19, 1), (16, 1), (13, 13), (30, 7)]


def _backends() -> list[str]:
    return ["torch"] + (["cpu_kernels"] if cpu_kernels.applies("cpu", torch.float32) else [])


def _step(g: torch.Generator):
    """A step's ``AttentionBatch``, its new K/V, queries, and each request's whole context K/V."""
    perm = torch.randperm(NB, generator=g).tolist()
    table = np.zeros((len(REQS), NB), dtype=np.int64)
    qsl, slots, ctx = [0], [], []
    for i, (seq, n) in enumerate(REQS):
        blocks = [perm.pop() for _ in range(-(-seq // BS))]
        table[i, :len(blocks)] = blocks
        slots += [blocks[p // BS] * BS + p % BS for p in range(seq - n, seq)]
        qsl.append(qsl[-1] + n)
        ctx.append((torch.randn(seq, KVH, D, generator=g), torch.randn(seq, KVH, D, generator=g)))
    lens = np.array([s for s, _ in REQS], dtype=np.int64)
    batch = AttentionBatch(query_start_loc=np.array(qsl, dtype=np.int64),
                           num_computed=lens - np.array([n for _, n in REQS]), seq_lens=lens,
                           slot_mapping=np.array(slots, dtype=np.int64), block_table=table,
                           rows=np.arange(len(REQS), dtype=np.int64), block_size=BS)
    return batch, torch.randn(qsl[-1], H, D, generator=g), ctx


def _dense(q, k, v, scale, window, softcap, sinks=None):
    """Causal attention of the last ``len(q)`` positions of a context ``k``/``v`` ``[S, KVH, D]``
    (``sinks`` ``[H]``: one more logit per head in each softmax, with no value: gpt-oss)."""
    n, s = q.shape[0], k.shape[0]
    kk, vv = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    qpos, kpos = torch.arange(s - n, s).unsqueeze(1), torch.arange(s).unsqueeze(0)
    keep = kpos <= qpos
    if window:
        keep &= kpos > qpos - window
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        col = sinks.view(H, 1, 1).expand(H, n, 1)
        return torch.einsum("hqk,khd->qhd", torch.cat([scores, col], -1).softmax(-1)[..., :-1], vv)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


@pytest.mark.parametrize("name", _backends())
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (5, None, False), (None, 20.0, False),
                                                  (None, None, True), (5, None, True)])
def test_backend_matches_dense_attention(name, window, softcap, sinks):
    g = torch.Generator().manual_seed(3)
    sinks = torch.randn(H, generator=g) * 2 if sinks else None
    batch, q, ctx = _step(g)
    backend = select_attention_backend("cpu", torch.float32, name)
    cache = (torch.zeros(KVH, NB, BS, D), torch.zeros(KVH, NB, BS, D))
    for i, (seq, n) in enumerate(REQS):  # the cached prefix of every request, written slot by slot
        for p in range(seq - n):
            blk = int(batch.block_table[i, p // BS])
            cache[0][:, blk, p % BS], cache[1][:, blk, p % BS] = ctx[i][0][p], ctx[i][1][p]
    new_k = torch.cat([k[s - n:] for (k, _), (s, n) in zip(ctx, REQS)])
    new_v = torch.cat([v[s - n:] for (_, v), (s, n) in zip(ctx, REQS)])
    meta = backend.build_metadata(batch)
    out = backend.forward(q, new_k, new_v, cache, meta, 0.2, sliding_window=window, softcap=softcap, sinks=sinks)
    qsl = batch.query_start_loc
    for i, (k, v) in enumerate(ctx):
        expect = _dense(q[qsl[i]:qsl[i + 1]], k, v, 0.2, window, softcap, sinks)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], expect, rtol=1e-5, atol=1e-5)


def test_selection_is_made_once_from_device_and_dtype():
    chosen = select_attention_backend("cpu", torch.float32)
    assert chosen.name == ("cpu_kernels" if cpu_kernels.applies("cpu", torch.float32) else "torch")
    assert chosen.uses_cpu_kernels is cpu_kernels.applies("cpu", torch.float32)
    assert isinstance(select_attention_backend("cpu", torch.bfloat16), TorchPagedBackend)
    assert PRIORITY[-1] == "torch"  # the reference runs anywhere: selection never comes back empty
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention_backend("cpu", torch.float32, "flash")
    with pytest.raises(ValueError, match="cannot run"):
        select_attention_backend("cpu", torch.bfloat16, "cpu_kernels")


def test_metadata_does_not_alias_the_block_table():
    """The runner may change its block table while a step built from it still runs."""
    batch, _, _ = _step(torch.Generator().manual_seed(4))
    for name in _backends():
        meta = select_attention_backend("cpu", torch.float32, name).build_metadata(batch)
        before = meta.decode_block_tables.clone(), [p.gather_slots.clone() for p in meta.prefills]
        batch.block_table[:] = 0
        assert torch.equal(meta.decode_block_tables, before[0])
        assert all(torch.equal(p.gather_slots, s) for p, s in zip(meta.prefills, before[1]))
        batch, _, _ = _step(torch.Generator().manual_seed(4))

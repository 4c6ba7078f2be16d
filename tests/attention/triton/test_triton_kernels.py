"""The Triton attention kernels against the torch reference backend, through Triton's interpreter.

Each case is one randomized step over a shuffled paged cache: a ragged mix of
decodes (contexts crossing many blocks, split-K with many splits), fresh
prefills and chunked prefills behind a cached prefix (a prefix-cache hit looks
the same to attention), for block sizes 16 and 32, GQA ratios 1, 3 and 8, with
and without a sliding window and soft-capping. The Triton backend's K/V write
and attention must equal ``TorchPagedBackend``'s. Shapes are tiny: the
interpreter runs every program instance in Python.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.selector import select_attention_backend
from pagedllm.attention.metadata import AttentionBatch

D = 16


def _random_step(seed: int, bs: int, num_blocks: int = 40):
    """A random step: ``(batch, new_k, new_v, cache_prefix_k, cache_prefix_v, kinds)``.

    Requests: 2-3 decodes with contexts of 1..6 blocks, a fresh prefill, a chunked prefill
    (or prefix hit) of a few tokens behind a cached prefix of 1..3 blocks.
    """
    rng = np.random.default_rng(seed)
    reqs = []  # (seq_len after the step, tokens this step)
    for _ in range(int(rng.integers(2, 4))):
        reqs.append((int(rng.integers(1, 6 * bs)), 1))
    n = int(rng.integers(2, 20))
    reqs.append((n, n))
    cached, n = int(rng.integers(1, 3 * bs)), int(rng.integers(2, 20))
    reqs.append((cached + n, n))
    order = rng.permutation(len(reqs))
    reqs = [reqs[i] for i in order]
    perm = rng.permutation(num_blocks).tolist()
    max_blocks = max(-(-s // bs) for s, _ in reqs)
    table = np.zeros((len(reqs) + 2, max_blocks + 3), dtype=np.int64)  # spare rows and columns
    rows = rng.permutation(len(reqs) + 2)[:len(reqs)].astype(np.int64)
    qsl, slots, prefix_slots = [0], [], []
    for i, (seq, n) in enumerate(reqs):
        blocks = [perm.pop() for _ in range(-(-seq // bs))]
        table[rows[i], :len(blocks)] = blocks
        pos = [blocks[p // bs] * bs + p % bs for p in range(seq)]
        prefix_slots.append(pos[:seq - n])
        slots += pos[seq - n:]
        qsl.append(qsl[-1] + n)
    lens = np.array([s for s, _ in reqs], dtype=np.int64)
    batch = AttentionBatch(query_start_loc=np.array(qsl, dtype=np.int64),
                           num_computed=lens - np.array([n for _, n in reqs], dtype=np.int64), seq_lens=lens,
                           slot_mapping=np.array(slots, dtype=np.int64), block_table=table, rows=rows, block_size=bs)
    return batch, prefix_slots


def _run(name: str, batch, prefix_slots, kvh, ratio, bs, dtype, window, softcap, seed, split_tokens=None,
         sinks: bool = False):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 40
    t = int(batch.query_start_loc[-1])
    cache = (torch.zeros(kvh, num_blocks, bs, D), torch.zeros(kvh, num_blocks, bs, D))
    flat = [c.view(kvh, -1, D) for c in cache]
    for slots in prefix_slots:  # the cached prefixes
        idx = torch.tensor(slots, dtype=torch.int64)
        for f in flat:
            f[:, idx] = torch.randn(kvh, len(slots), D, generator=g)
    cache = tuple(c.to(dtype) for c in cache)
    q = torch.randn(t, kvh * ratio, D, generator=g).to(dtype)
    k = torch.randn(t, kvh, D, generator=g).to(dtype)
    v = torch.randn(t, kvh, D, generator=g).to(dtype)
    backend = select_attention_backend("cpu", dtype, name)
    if split_tokens is not None:
        backend.split_tokens = split_tokens
    meta = backend.build_metadata(batch)
    sink = torch.randn(kvh * ratio, generator=g) * 2 if sinks else None  # gpt-oss's per-head sinks
    out = backend.forward(q, k, v, cache, meta, D ** -0.5, sliding_window=window, softcap=softcap, sinks=sink)
    return out, cache, meta


CASES = [  # (seed, block size, kv heads, GQA ratio, sliding window, softcap, attention sinks)
    (0, 16, 2, 1, None, None, False),
    (1, 32, 1, 3, None, None, False),
    (2, 16, 1, 8, None, None, False),
    (3, 16, 2, 3, 7, None, False),
    (4, 32, 1, 8, 20, None, False),
    (5, 16, 1, 1, None, 5.0, False),
    (6, 32, 2, 3, 11, 8.0, False),
    (7, 16, 2, 4, None, None, True),   # gpt-oss: sinks in full layers and in windowed ones
    (8, 16, 1, 8, 9, None, True),
]


@pytest.mark.parametrize("seed,bs,kvh,ratio,window,softcap,sinks", CASES)
def test_triton_backend_equals_torch_reference(seed, bs, kvh, ratio, window, softcap, sinks):
    batch, prefix = _random_step(seed, bs)
    # split_tokens of one block: a decode over n blocks runs n splits merged by the reduction
    got, got_cache, meta = _run("triton", batch, prefix, kvh, ratio, bs, torch.float32, window, softcap, seed,
                                split_tokens=bs, sinks=sinks)
    want, want_cache, _ = _run("torch", batch, prefix, kvh, ratio, bs, torch.float32, window, softcap, seed,
                               sinks=sinks)
    assert meta.num_splits > 1 and meta.decode_req.numel() >= 2 and meta.tile_req.numel() >= 2
    assert torch.equal(got_cache[0], want_cache[0]) and torch.equal(got_cache[1], want_cache[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_one_split_and_many_splits_agree():
    """Split-K is only a schedule: one split per context and one per block give the same output."""
    batch, prefix = _random_step(11, 16)
    one, _, m1 = _run("triton", batch, prefix, 2, 2, 16, torch.float32, None, None, 11, split_tokens=1 << 20)
    many, _, m2 = _run("triton", batch, prefix, 2, 2, 16, torch.float32, None, None, 11, split_tokens=16)
    assert m1.num_splits == 1 and m2.num_splits > 2
    torch.testing.assert_close(one, many, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches(dtype):
    """float16 / bfloat16 caches and outputs (the interpreter multiplies in float32; the tensor-core
    products of the GPU are checked by tests/gpu)."""
    batch, prefix = _random_step(12, 16)
    got, _, _ = _run("triton", batch, prefix, 1, 3, 16, dtype, 9, None, 12, split_tokens=32)
    want, _, _ = _run("torch", batch, prefix, 1, 3, 16, torch.float32, 9, None, 12)
    assert got.dtype == dtype
    tol = 2e-2 if dtype == torch.float16 else 5e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_padded_slots_are_not_written():
    """A slot of -1 (a padded token, as a captured CUDA graph's spare rows) leaves the cache alone."""
    from pagedllm.attention import triton_kernels
    kc, vc = torch.zeros(2, 4, 16, D), torch.zeros(2, 4, 16, D)
    k, v = torch.randn(3, 2, D), torch.randn(3, 2, D)
    triton_kernels.write_kv(k, v, kc, vc, torch.tensor([5, -1, 17]))
    assert torch.equal(kc[:, 0, 5], k[0]) and torch.equal(vc[:, 1, 1], v[2])
    assert int((kc != 0).any(-1).sum()) == 4 and int((vc != 0).any(-1).sum()) == 4


def test_metadata_is_one_device_buffer_and_does_not_alias_the_table():
    batch, _ = _random_step(13, 16)
    backend = select_attention_backend("cpu", torch.float32, "triton")
    meta = backend.build_metadata(batch)
    before = meta.block_tables.clone()
    batch.block_table[:] = 0
    assert torch.equal(meta.block_tables, before)
    base = meta.slot_mapping.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in (meta.block_tables, meta.decode_req, meta.tile_q0))


@pytest.mark.parametrize("seed,window", [(9, None), (10, 6)])
def test_bidirectional_spans_equal_torch_reference(seed, window):
    """Gemma 3's image spans (issue 41): inside a span a query also sees the span's later keys (the
    window still bounds it), one span from a prefill's start, one that began in the cached prefix
    (a prefix-cache hit that ends inside an image); Triton equals the torch reference."""
    batch, prefix = _random_step(seed, 16)
    qsl = batch.query_start_loc
    spans = []
    for i in range(len(qsl) - 1):
        start, end = int(batch.num_computed[i]), int(batch.seq_lens[i])
        if end - start < 2:
            spans.append(())
        elif start == 0:
            spans.append(((1, end - 1),))
        else:
            spans.append(((start - 1, start + (end - start) // 2),))
    batch.bidirectional = spans
    got, _, meta = _run("triton", batch, prefix, 2, 3, 16, torch.float32, window, None, seed, split_tokens=16)
    want, _, _ = _run("torch", batch, prefix, 2, 3, 16, torch.float32, window, None, seed)
    plain = _run("torch", AttentionBatch(**{**batch.__dict__, "bidirectional": None}), prefix, 2, 3, 16,
                 torch.float32, window, None, seed)[0]
    assert meta.spans is not None and not torch.allclose(want, plain, atol=1e-3)  # the spans change the outputs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

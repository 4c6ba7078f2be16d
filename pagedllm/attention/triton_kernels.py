"""Triton kernels of the paged attention backend (``attention/triton_paged.py``).

Three kernels over the head-major paged cache ``[KVH, num_blocks, block_size, D]``:

- ``write_kv``: each token's K/V into its cache slot (vLLM's ``reshape_and_cache``).
- ``decode_attention``: one-token requests, split-K over the context (flash-decoding,
  Dao et al. 2023: every split computes a partial softmax over its share of the
  context blocks, read through the block table as in Kwon et al. 2023 / vLLM's
  paged attention v2), then a reduction kernel merges the splits by their
  log-sum-exp.
- ``prefill_attention``: multi-token requests (chunked prefill, prefix-cache hits,
  a decode with its drafts): tiles of query tokens of several requests in one
  launch, causal within each request, every key read through the block table
  (earlier chunks and cached prefixes included); FlashAttention-2's online softmax
  (Dao 2023) with the query heads of one KV group packed into the tile's rows
  (as vLLM's unified Triton attention), so GQA reads each K/V block once per group.

Every kernel handles grouped-query attention, a sliding window (a query at
position ``i`` sees keys ``j > i - window``), logit soft-capping
(``softcap * tanh(s / softcap)``), per-head attention sinks (gpt-oss: one more logit
per head in every softmax, with no value; in the decode reduction's denominator)
and any scale. Scores and the softmax run in
float32 whatever the cache dtype (float16, bfloat16, float32). Under
``TRITON_INTERPRET=1`` (set before this module is imported) the same kernels
run on CPU tensors through Triton's interpreter. Importing this module needs
``triton``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import pagedllm.envs as envs


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _dot_f32(dtype: torch.dtype) -> bool:
    """Run the kernels' matrix products in float32 (IEEE): for float32 caches, and for every dtype
    under the interpreter, whose ``tl.dot`` mishandles bfloat16 (float16/bfloat16 use the tensor
    cores on the GPU, accumulating in float32)."""
    return dtype == torch.float32 or envs.TRITON_INTERPRET


@triton.jit
def _write_kv_kernel(key, value, key_cache, value_cache, slot_mapping,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cb, stride_ct,
                     num_kv_heads, head_dim,
                     BLOCK_SIZE: tl.constexpr, HEADS_P: tl.constexpr, D_P: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, D_P)[None, :]
    m = (h < num_kv_heads) & (d < head_dim)
    m = m & (tl.zeros([HEADS_P, D_P], tl.int64) + slot >= 0)  # slot -1: a padded token, not written
    dst = h * stride_ch + blk * stride_cb + off * stride_ct + d
    k = tl.load(key + t * stride_kt + h * stride_kh + d, mask=m)
    tl.store(key_cache + dst, k, mask=m)
    v = tl.load(value + t * stride_vt + h * stride_vh + d, mask=m)
    tl.store(value_cache + dst, v, mask=m)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Copy ``key``/``value`` ``[T, KVH, D]`` into the caches at ``slot_mapping``.

    Args:
        key, value: ``[T, KVH, D]``, the caches' dtype, last dim contiguous.
        key_cache, value_cache: ``[KVH, num_blocks, block_size, D]``, same strides, last dim contiguous.
        slot_mapping: ``[T]`` int64 slot ``block_id * block_size + offset`` of each token; a
            negative slot (a padded token) is skipped.
    """
    t, kvh, d = key.shape
    if t == 0:
        return
    _write_kv_kernel[(t,)](key, value, key_cache, value_cache, slot_mapping,
                           key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                           key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), kvh, d,
                           BLOCK_SIZE=key_cache.shape[2], HEADS_P=_pow2(kvh), D_P=_pow2(d))


@triton.jit
def _scores(q, k, scale, softcap, USE_SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr):
    """``[M, N]`` float32 scaled (and soft-capped) scores of ``q`` ``[M, D]`` against ``k`` ``[N, D]``."""
    if DOT_F32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if USE_SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    return s


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_F32: tl.constexpr):
    """One FlashAttention-2 update with masked scores ``s`` ``[M, N]`` (-inf: unseen) and ``v`` ``[N, D]``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, decode_req,
                   part_out, part_lse, scale, softcap, window,
                   stride_qt, stride_qh, stride_bt, stride_ch, stride_cb, stride_ct,
                   num_heads, head_dim, group, split_len, num_splits,
                   BLOCK_SIZE: tl.constexpr, G_P: tl.constexpr, D_P: tl.constexpr,
                   USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_F32: tl.constexpr):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    r = tl.load(decode_req + i).to(tl.int64)
    row = tl.load(query_start_loc + r).to(tl.int64)
    seq_len = tl.load(seq_lens + r).to(tl.int32)
    g = tl.arange(0, G_P)
    d = tl.arange(0, D_P)
    dmask = d < head_dim
    heads = kvh * group + g
    q = tl.load(query + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=(g < group)[:, None] & dmask[None, :], other=0.0)
    start = split * split_len
    end = tl.minimum(seq_len, start + split_len)
    if USE_WINDOW:  # the token at seq_len - 1 sees keys j >= seq_len - window
        start = tl.maximum(start, seq_len - window)
    m_i = tl.full([G_P], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P], tl.float32)
    acc = tl.zeros([G_P, D_P], tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    for b in range(start // BLOCK_SIZE, tl.cdiv(end, BLOCK_SIZE)):
        phys = tl.load(block_tables + r * stride_bt + b).to(tl.int64)
        kpos = b * BLOCK_SIZE + offs
        kmask = (kpos >= start) & (kpos < end)
        base = kvh * stride_ch + phys * stride_cb + offs[:, None] * stride_ct + d[None, :]
        lmask = kmask[:, None] & dmask[None, :]
        k = tl.load(key_cache + base, mask=lmask, other=0.0)
        v = tl.load(value_cache + base, mask=lmask, other=0.0)
        s = _scores(q, k, scale, softcap, USE_SOFTCAP, DOT_F32)
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_F32)
    has = l_i > 0
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    hm = g < group
    part = (i * num_heads + heads) * num_splits + split  # [G_P] rows of [Dn, H, S]
    tl.store(part_lse + part, lse, mask=hm)
    tl.store(part_out + part[:, None] * D_P + d[None, :], o, mask=hm[:, None])


@triton.jit
def _reduce_kernel(part_out, part_lse, out, query_start_loc, decode_req, sinks, stride_ot, stride_oh,
                   num_heads, head_dim, num_splits, S_P: tl.constexpr, D_P: tl.constexpr, USE_SINKS: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.load(decode_req + i).to(tl.int64)
    row = tl.load(query_start_loc + r).to(tl.int64)
    s = tl.arange(0, S_P)
    d = tl.arange(0, D_P)
    base = (i * num_heads + h) * num_splits
    lse = tl.load(part_lse + base + s, mask=s < num_splits, other=float("-inf"))
    mx = tl.max(lse, 0)
    if USE_SINKS:  # the head's sink is one more logit with no value: in the denominator only
        sink = tl.load(sinks + h).to(tl.float32)
        mx = tl.maximum(mx, sink)
    mx = tl.where(mx > float("-inf"), mx, 0.0)  # an empty context (a CUDA graph's padded row): output 0
    w = tl.exp(lse - mx)  # an empty split has lse -inf: weight 0
    tot = tl.sum(w, 0)
    if USE_SINKS:
        tot = tot + tl.exp(sink - mx)
    w = w / tl.where(tot > 0, tot, 1.0)
    o = tl.load(part_out + (base + s)[:, None] * D_P + d[None, :], mask=(s < num_splits)[:, None], other=0.0)
    res = tl.sum(w[:, None] * o, 0)
    tl.store(out + row * stride_ot + h * stride_oh + d, res.to(out.dtype.element_ty), mask=d < head_dim)


def decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     decode_req: torch.Tensor, num_splits: int, split_len: int, scale: float,
                     sliding_window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> None:
    """Split-K paged decode attention (flash-decoding over vLLM's paged layout), then the reduction
    (which adds the per-head sinks to each softmax's denominator).

    Args:
        out: ``[T, H, D]``; row ``query_start_loc[r]`` of every decode request ``r`` is written.
        query: ``[T, H, D]``, last dim contiguous.
        key_cache, value_cache: ``[KVH, num_blocks, block_size, D]``, contexts already written.
        block_tables: ``[R, nblk]`` int64 block ids of the step's requests.
        seq_lens: ``[R]`` int64 context lengths (the decode token included).
        query_start_loc: ``[R + 1]`` int64 first row of each request.
        decode_req: ``[Dn]`` int64 indices (into ``R``) of the one-token requests.
        num_splits: splits per context (the grid's third dimension); ``split_len``: tokens per
            split, a multiple of ``block_size`` with ``num_splits * split_len >= max seq_len``.
        scale, sliding_window, softcap, sinks: as ``AttentionBackend.forward`` (``sinks`` ``[H]``
            float32 on the device, or ``None``).
    """
    n = decode_req.shape[0]
    if n == 0:
        return
    num_heads, d = query.shape[1:]
    kvh, _, bs, _ = key_cache.shape
    group = num_heads // kvh
    d_p = _pow2(max(d, 16))
    part_out = torch.empty((n, num_heads, num_splits, d_p), dtype=torch.float32, device=query.device)
    part_lse = torch.empty((n, num_heads, num_splits), dtype=torch.float32, device=query.device)
    _decode_kernel[(n, kvh, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, decode_req, part_out, part_lse,
        float(scale), float(softcap or 1.0), int(sliding_window or 0),
        query.stride(0), query.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_heads, d, group, split_len, num_splits,
        BLOCK_SIZE=bs, G_P=_pow2(max(group, 16)), D_P=d_p, USE_SOFTCAP=softcap is not None,
        USE_WINDOW=sliding_window is not None, DOT_F32=_dot_f32(query.dtype))
    _reduce_kernel[(n, num_heads)](part_out, part_lse, out, query_start_loc, decode_req,
                                   part_lse if sinks is None else sinks,  # not read without sinks
                                   out.stride(0), out.stride(1), num_heads, d, num_splits,
                                   S_P=_pow2(num_splits), D_P=d_p, USE_SINKS=sinks is not None)


@triton.jit
def _prefill_kernel(query, out, key_cache, value_cache, block_tables, seq_lens, num_computed, query_start_loc,
                    tile_req, tile_q0, sinks, span_lo, span_hi, scale, softcap, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_ch, stride_cb, stride_ct,
                    head_dim, group,
                    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, G_P: tl.constexpr, D_P: tl.constexpr,
                    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
                    USE_SINKS: tl.constexpr, USE_SPANS: tl.constexpr):
    j = tl.program_id(0)
    kvh = tl.program_id(1)
    r = tl.load(tile_req + j).to(tl.int64)
    q0 = tl.load(tile_q0 + j).to(tl.int32)
    qs = tl.load(query_start_loc + r).to(tl.int64)
    nq = (tl.load(query_start_loc + r + 1) - qs).to(tl.int32)
    ctx = tl.load(num_computed + r).to(tl.int32)
    seq_len = tl.load(seq_lens + r).to(tl.int32)
    mm = tl.arange(0, BLOCK_Q * G_P)  # row = (token, head of the KV group)
    tok = q0 + mm // G_P
    g = mm % G_P
    row_ok = (tok < nq) & (g < group)
    qpos = ctx + tok  # absolute positions
    d = tl.arange(0, D_P)
    dmask = d < head_dim
    heads = kvh * group + g
    qmask = row_ok[:, None] & dmask[None, :]
    q = tl.load(query + (qs + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=qmask, other=0.0)
    hi = tl.minimum(seq_len, ctx + q0 + BLOCK_Q)  # keys up to the tile's last query
    if USE_SPANS:  # a query inside an image span [slo, shi) sees the span's later keys too
        slo = tl.load(span_lo + qs + tok, mask=row_ok, other=0).to(tl.int32)
        shi = tl.load(span_hi + qs + tok, mask=row_ok, other=0).to(tl.int32)
        hi = tl.minimum(seq_len, tl.maximum(hi, tl.max(shi, axis=0)))
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, ctx + q0 - window + 1)
    m_i = tl.full([BLOCK_Q * G_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_P, D_P], tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    for b in range(lo // BLOCK_SIZE, tl.cdiv(hi, BLOCK_SIZE)):
        phys = tl.load(block_tables + r * stride_bt + b).to(tl.int64)
        kpos = b * BLOCK_SIZE + offs
        kmask = kpos < hi
        base = kvh * stride_ch + phys * stride_cb + offs[:, None] * stride_ct + d[None, :]
        lmask = kmask[:, None] & dmask[None, :]
        k = tl.load(key_cache + base, mask=lmask, other=0.0)
        v = tl.load(value_cache + base, mask=lmask, other=0.0)
        s = _scores(q, k, scale, softcap, USE_SOFTCAP, DOT_F32)
        vis = kpos[None, :] <= qpos[:, None]
        if USE_SPANS:
            vis = vis | ((kpos[None, :] >= slo[:, None]) & (kpos[None, :] < shi[:, None]))
        vis = kmask[None, :] & vis
        if USE_WINDOW:
            vis = vis & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_F32)
    if USE_SINKS:  # one more logit per head with no value: rescale to the larger max, add to l
        sink = tl.load(sinks + heads, mask=row_ok, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out + (qs + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out.dtype.element_ty), mask=qmask)


# query tokens per prefill tile; a tile's rows are these tokens times the KV group's query heads
# (padded to a power of two), at least 16 as ``tl.dot`` wants on the GPU
PREFILL_BLOCK_Q = 16


def prefill_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, num_computed: torch.Tensor,
                      query_start_loc: torch.Tensor, tile_req: torch.Tensor, tile_q0: torch.Tensor,
                      block_q: int, scale: float, sliding_window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None,
                      spans: torch.Tensor | None = None) -> None:
    """Causal paged attention of every multi-token request of the step, in one launch; a token
    inside a bidirectional span (an image of Gemma 3) also sees the span's later keys, the sliding
    window still bounding it (``torch_paged.prefill_attention``'s masks).

    Args:
        out: ``[T, H, D]``; the rows of the tiles' requests are written.
        query: ``[T, H, D]``, last dim contiguous.
        key_cache, value_cache: ``[KVH, num_blocks, block_size, D]``, the step's K/V already written.
        block_tables: ``[R, nblk]`` int64; seq_lens, num_computed: ``[R]`` int64 tokens after /
            before this step; query_start_loc: ``[R + 1]`` int64.
        tile_req, tile_q0: ``[N]`` int64 request and first local query token of each tile of
            ``block_q`` tokens (``PREFILL_BLOCK_Q``).
        scale, sliding_window, softcap, sinks: as ``decode_attention``.
        spans: ``[2, T]`` int64 first and end position of each token's span (``0, 0``: none), or ``None``.
    """
    n = tile_req.shape[0]
    if n == 0:
        return
    num_heads, d = query.shape[1:]
    kvh, _, bs, _ = key_cache.shape
    group = num_heads // kvh
    _prefill_kernel[(n, kvh)](
        query, out, key_cache, value_cache, block_tables, seq_lens, num_computed, query_start_loc, tile_req, tile_q0,
        seq_lens if sinks is None else sinks,  # not read without sinks
        seq_lens if spans is None else spans[0], seq_lens if spans is None else spans[1],  # read only with spans
        float(scale), float(softcap or 1.0), int(sliding_window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), d, group,
        BLOCK_SIZE=bs, BLOCK_Q=block_q, G_P=_pow2(group), D_P=_pow2(max(d, 16)),
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
        DOT_F32=_dot_f32(query.dtype), USE_SINKS=sinks is not None, USE_SPANS=spans is not None)

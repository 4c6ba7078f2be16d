"""The reference paged attention backend, in plain PyTorch (runs on any device, tuned for CPU).

K/V live in per-layer tensors ``[num_kv_heads, num_blocks, block_size, head_dim]``
(head-major, so a gathered context is already ``[KVH, tokens, D]`` and needs no
transpose copy). Each step writes the new tokens' K/V through the slot mapping,
then reads the contexts: all one-token (decode) requests together, gathering
whole blocks through their block tables (masked past each request's length),
and each multi-token (prefill) request through its slots, with one causal call
each. The CPU-kernel backend (``attention/cpu_kernels.py``) reuses
``prefill_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, KVCache
from pagedllm.attention.metadata import AttentionBatch, AttentionMetadata, paged_fields


@dataclass
class TorchPagedMetadata(AttentionMetadata):
    """``AttentionMetadata`` plus the torch decode path's mask.

    Attributes:
        decode_mask: ``[num_decodes, 1, 1, nblk * block_size]`` bool, True where a position is
            inside its request's context; ``None`` when every decode fills all ``nblk`` blocks.
    """

    decode_mask: torch.Tensor | None = None


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots
    (caches ``[num_kv_heads, num_blocks, block_size, head_dim]``)."""
    kvh, d = key.shape[-2:]
    key_cache.view(kvh, -1, d).index_copy_(1, slot_mapping, key.transpose(0, 1))
    value_cache.view(kvh, -1, d).index_copy_(1, slot_mapping, value.transpose(0, 1))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None, causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of ``q`` ``[B, H, n, D]`` over ``k``/``v`` ``[B, KVH, S, D]``; ``mask`` True = attend.

    With ``softcap`` (Gemma 2) the scores are ``softcap * tanh(scores / softcap)``, and with
    ``sinks`` (``[H]``, gpt-oss) each softmax gains one more logit with no value: SDPA does
    neither, so those cases run the attention out in matmuls.
    """
    gqa = q.shape[1] != k.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal and mask is None:
        n, s = scores.shape[-2:]
        mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(diagonal=s - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return scores.softmax(-1) @ v
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return probs @ v


# From this many decodes up, plain matmuls + softmax beat SDPA's CPU flash kernel on one query row
# per head (measured on 2 AVX2 cores: 64 decodes x 200 keys, 1.2 ms against 2.5 ms; at 1-16 decodes SDPA wins).
_MATMUL_DECODE_MIN_BATCH = 32


def _per_head(rows: torch.Tensor, kvh: int, rows_per_head: int) -> torch.Tensor:
    """``[kvh * n]`` int64 indices of ``rows`` in every head of a head-major cache flattened to
    ``[kvh * rows_per_head, ...]``: gathering along dim 0 copies whole rows and is about 2.5x
    faster on CPU than ``index_select`` along dim 1."""
    return (torch.arange(kvh, device=rows.device).unsqueeze(1) * rows_per_head + rows).view(-1)


def _attend_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
    """Softmax attention of ``q`` ``[N, H, G, D]`` over ``k``/``v`` ``[N, H, L, D]`` in matmuls;
    ``mask`` broadcastable to ``[N, H, G, L]``, True = attend."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v)


def decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     meta: TorchPagedMetadata, scale: float, sliding_window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """Attention of every one-token request over its paged context, in torch ops.

    Args:
        out: ``[T, H, D]``; rows ``meta.decode_token_idx`` are written.
        query: ``[T, H, D]``.
        key_cache, value_cache: ``[KVH, num_blocks, block_size, D]``, contexts already written.
        meta: the step's metadata (decode rows, block tables, lengths, mask).
        scale, sliding_window, softcap, sinks: as in ``AttentionBackend.forward``.
    """
    # gather whole blocks (one contiguous block_size x D copy per table entry and head, 16x
    # fewer index entries than gathering slots); positions past a request's length are masked.
    # Decodes are laid out [KVH, B, ...]: the gathered K/V need no transpose, and for SDPA the
    # KV heads act as the batch and the requests as heads
    num_heads, d = query.shape[1:]
    kvh, bs = key_cache.shape[0], key_cache.shape[2]
    b, nblk = meta.decode_block_tables.shape
    length = nblk * bs
    idx = _per_head(meta.decode_block_tables.view(-1), kvh, key_cache.shape[1])
    k = key_cache.view(-1, bs, d).index_select(0, idx).view(kvh, b, length, d)  # [KVH, B, L, D]
    v = value_cache.view(-1, bs, d).index_select(0, idx).view(kvh, b, length, d)
    mask = meta.decode_mask                                                  # [B, 1, 1, L]
    if sliding_window is not None and length > sliding_window:
        # the decode token sits at position seq_len - 1: it sees keys j >= seq_len - window
        first = (meta.decode_seq_lens - sliding_window).view(b, 1, 1, 1)
        inside = torch.arange(length, device=query.device).view(1, 1, 1, length) >= first
        mask = inside if mask is None else mask & inside
    q = query.index_select(0, meta.decode_token_idx)
    if softcap is None and sinks is None:
        # one query row per head of a KV group: no K/V expansion for grouped-query attention
        q = q.view(b, kvh, num_heads // kvh, d).transpose(0, 1)           # [KVH, B, G, D]
        m = None if mask is None else mask.view(1, b, 1, length)
        if b >= _MATMUL_DECODE_MIN_BATCH:
            o = _attend_matmul(q, k, v, m, scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)
        o = o.transpose(0, 1)                                               # [B, KVH, G, D]
    else:
        o = _attend(q.view(b, num_heads, 1, d), k.transpose(0, 1), v.transpose(0, 1), mask, scale, softcap,
                    sinks=sinks)
    out.index_copy_(0, meta.decode_token_idx, o.reshape(b, num_heads, d))


def prefill_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """Causal attention of each multi-token request over its context, gathered through its slots;
    within a ``PrefillSeq.bidirectional`` span (an image of Gemma 3) queries see the span's later keys
    too, and a sliding window still bounds them (``transformers``' Gemma 3 masks: full layers causal
    OR same image, sliding layers AND the window).

    Args:
        out: ``[T, H, D]``; each prefill's rows ``q_start:q_end`` are written.
        query: ``[T, H, D]``.
        key_cache, value_cache: ``[KVH, num_blocks, block_size, D]``, contexts already written.
        meta: the step's metadata (``prefills``).
        scale, sliding_window, softcap, sinks: as in ``AttentionBackend.forward``.
    """
    kvh, d = key_cache.shape[0], key_cache.shape[-1]
    k_flat = key_cache.view(-1, d)                     # [KVH * num_slots, D]
    v_flat = value_cache.view(-1, d)
    rows_per_head = k_flat.shape[0] // kvh
    for p in meta.prefills:
        q = query[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)                 # [1, H, n, D]
        idx = _per_head(p.gather_slots, kvh, rows_per_head)
        k = k_flat.index_select(0, idx).view(1, kvh, -1, d)                        # [1, KVH, S, D]
        v = v_flat.index_select(0, idx).view(1, kvh, -1, d)
        n, s = q.shape[2], k.shape[2]
        mask = None
        if p.num_computed != 0 or (sliding_window is not None and s > sliding_window) or p.bidirectional:
            # query i sits at absolute position s - n + i and sees keys up to that position
            qpos = torch.arange(s - n, s, device=q.device).unsqueeze(1)
            kpos = torch.arange(s, device=q.device).unsqueeze(0)
            mask = kpos <= qpos
            for lo, hi in p.bidirectional:
                mask |= (qpos >= lo) & (qpos < hi) & (kpos >= lo) & (kpos < hi)
            if sliding_window is not None:
                mask &= kpos > qpos - sliding_window
        o = _attend(q, k, v, mask, scale, softcap, causal=True, sinks=sinks)
        out[p.q_start:p.q_end] = o.squeeze(0).transpose(0, 1)


class TorchPagedBackend(AttentionBackend):
    """The reference backend: torch ops only, any device and dtype (the choice when the C CPU
    kernels are off or do not apply). Metadata: ``TorchPagedMetadata``."""

    name = "torch"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        """Always True: plain torch ops run on every device and dtype."""
        return True

    def build_metadata(self, batch: AttentionBatch) -> TorchPagedMetadata:
        """Shared paged fields plus the decode mask over the gathered blocks (see ``TorchPagedMetadata``)."""
        fields = paged_fields(batch, self.device)
        qsl = batch.query_start_loc
        dec_len = batch.seq_lens[qsl[1:] - qsl[:-1] == 1]
        width = fields["decode_block_tables"].shape[1] * batch.block_size
        dec_mask = np.arange(width, dtype=np.int64)[None, :] < dec_len[:, None]
        mask = None if dec_mask.all() else torch.from_numpy(dec_mask).to(self.device).view(dec_len.size, 1, 1, width)
        return TorchPagedMetadata(**fields, decode_mask=mask)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
                 metadata: AttentionMetadata) -> None:
        """Scatter the step's K/V into their slots with ``index_copy_``."""
        write_kv(kv_cache[0], kv_cache[1], key, value, metadata.slot_mapping)

    def attend(self, query: torch.Tensor, kv_cache: KVCache, metadata: TorchPagedMetadata, scale: float,
               sliding_window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decodes together (gathered blocks), then each prefill (gathered slots); see the module doc."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if metadata.decode_token_idx.numel():
            decode_attention(out, query, kv_cache[0], kv_cache[1], metadata, scale, sliding_window, softcap, sinks)
        prefill_attention(out, query, kv_cache[0], kv_cache[1], metadata, scale, sliding_window, softcap, sinks)
        return out

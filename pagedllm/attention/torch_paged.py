"""Reference paged attention in plain PyTorch (runs on any device, tuned for CPU).

K/V live in per-layer tensors ``[num_kv_heads, num_blocks, block_size, head_dim]``
(head-major, so a gathered context is already ``[KVH, tokens, D]`` and needs no
transpose copy). Each step writes the new tokens' K/V through the slot mapping,
then reads the contexts: all one-token (decode) requests together, gathering
whole blocks through their block tables, and each multi-token (prefill) request
through its slots, with one causal call each.

On CPU in float32, when the C kernels are built (``pagedllm.kernels.cpu``), the
K/V write and the decode attention run there instead: the decode kernel reads
each context straight through its block table, with no gathered copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels import cpu as cpu_kernels


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots
    (caches ``[num_kv_heads, num_blocks, block_size, head_dim]``)."""
    kvh, d = key.shape[-2:]
    key_cache.view(kvh, -1, d).index_copy_(1, slot_mapping, key.transpose(0, 1))
    value_cache.view(kvh, -1, d).index_copy_(1, slot_mapping, value.transpose(0, 1))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None, causal: bool = False) -> torch.Tensor:
    """SDPA of ``q`` ``[B, H, n, D]`` over ``k``/``v`` ``[B, KVH, S, D]``; ``mask`` True = attend.

    With ``softcap`` (Gemma 2) the scores are ``softcap * tanh(scores / softcap)``,
    which SDPA cannot do, so that case runs the attention out in matmuls.
    """
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if causal and mask is None:
        n, s = scores.shape[-2:]
        mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(diagonal=s - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


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


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the step's tokens over their paged context.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` for the new tokens.
        key_cache, value_cache: ``[num_kv_heads, num_blocks, block_size, head_dim]``, same dtype.
        meta: the step's metadata.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: a query at position ``i`` sees keys ``j > i - sliding_window`` only
            (Mistral, Gemma local layers; transformers' definition); ``None`` for full context.
        softcap: attention logit soft-capping (Gemma 2), or ``None``.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` attention output.
    """
    fast = (cpu_kernels.usable(query) and key_cache.is_contiguous() and query.stride(2) == 1
            and key.stride(2) == 1 and value.stride(2) == 1 and meta.decode_seq_lens is not None)
    if fast:
        cpu_kernels.write_kv(key_cache, value_cache, key, value, meta.slot_mapping)
    else:
        write_kv(key_cache, value_cache, key, value, meta.slot_mapping)
    num_heads, d = query.shape[1:]
    kvh = key.shape[1]
    k_flat = key_cache.view(kvh, -1, d)
    v_flat = value_cache.view(kvh, -1, d)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if fast and meta.decode_token_idx.numel():
        cpu_kernels.decode_attention(out, query, meta.decode_token_idx, meta.decode_block_tables,
                                     meta.decode_seq_lens, key_cache, value_cache, scale, sliding_window, softcap)
    elif meta.decode_token_idx.numel():
        # gather whole blocks (one contiguous block_size x D copy per table entry and head, 16x
        # fewer index entries than gathering slots); positions past a request's length are masked.
        # Decodes are laid out [KVH, B, ...]: the gathered K/V need no transpose, and for SDPA the
        # KV heads act as the batch and the requests as heads
        b, nblk = meta.decode_block_tables.shape
        length = nblk * key_cache.shape[2]
        idx = _per_head(meta.decode_block_tables.view(-1), kvh, key_cache.shape[1])
        k = key_cache.view(-1, key_cache.shape[2], d).index_select(0, idx).view(kvh, b, length, d)  # [KVH, B, L, D]
        v = value_cache.view(-1, key_cache.shape[2], d).index_select(0, idx).view(kvh, b, length, d)
        mask = meta.decode_mask                                            # [B, 1, 1, L]
        if sliding_window is not None and length > sliding_window:
            # the decode token sits at position seq_len - 1: it sees keys j >= seq_len - window
            first = (meta.decode_seq_lens - sliding_window).view(b, 1, 1, 1)
            inside = torch.arange(length, device=query.device).view(1, 1, 1, length) >= first
            mask = inside if mask is None else mask & inside
        q = query.index_select(0, meta.decode_token_idx)
        if softcap is None:
            # one query row per head of a KV group: no K/V expansion for grouped-query attention
            q = q.view(b, kvh, num_heads // kvh, d).transpose(0, 1)           # [KVH, B, G, D]
            m = None if mask is None else mask.view(1, b, 1, length)
            if b >= _MATMUL_DECODE_MIN_BATCH:
                o = _attend_matmul(q, k, v, m, scale)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)
            o = o.transpose(0, 1)                                           # [B, KVH, G, D]
        else:
            o = _attend(q.view(b, num_heads, 1, d), k.transpose(0, 1), v.transpose(0, 1), mask, scale, softcap)
        out.index_copy_(0, meta.decode_token_idx, o.reshape(b, num_heads, d))
    for p in meta.prefills:
        q = query[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)                 # [1, H, n, D]
        idx = _per_head(p.gather_slots, kvh, k_flat.shape[1])
        k = k_flat.view(-1, d).index_select(0, idx).view(1, kvh, -1, d)          # [1, KVH, S, D]
        v = v_flat.view(-1, d).index_select(0, idx).view(1, kvh, -1, d)
        n, s = q.shape[2], k.shape[2]
        mask = None
        if p.num_computed != 0 or (sliding_window is not None and s > sliding_window):
            # query i sits at absolute position s - n + i and sees keys up to that position
            qpos = torch.arange(s - n, s, device=q.device).unsqueeze(1)
            kpos = torch.arange(s, device=q.device).unsqueeze(0)
            mask = kpos <= qpos
            if sliding_window is not None:
                mask &= kpos > qpos - sliding_window
        o = _attend(q, k, v, mask, scale, softcap, causal=True)
        out[p.q_start:p.q_end] = o.squeeze(0).transpose(0, 1)
    return out

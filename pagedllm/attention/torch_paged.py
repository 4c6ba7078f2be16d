"""Reference paged attention in plain PyTorch (runs on any device, tuned for CPU).

K/V live in per-layer tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Each step writes the new tokens' K/V through the slot mapping, then reads each
request's context through its slots (derived from its block table) and runs
scaled dot-product attention: one batched call for all one-token (decode)
requests, and one causal call per multi-token (prefill) request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots."""
    kvh, d = key.shape[-2:]
    key_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, value)


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


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the step's tokens over their paged context.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` for the new tokens.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype.
        meta: the step's metadata.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: a query at position ``i`` sees keys ``j > i - sliding_window`` only
            (Mistral, Gemma local layers; transformers' definition); ``None`` for full context.
        softcap: attention logit soft-capping (Gemma 2), or ``None``.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` attention output.
    """
    write_kv(key_cache, value_cache, key, value, meta.slot_mapping)
    num_heads, d = query.shape[1:]
    kvh = key.shape[1]
    k_flat = key_cache.view(-1, kvh, d)
    v_flat = value_cache.view(-1, kvh, d)
    out = torch.empty_like(query)
    if meta.decode_token_idx.numel():
        # index_select copies whole rows; advanced indexing is ~3x slower on CPU
        b, length = meta.decode_slots.shape
        flat = meta.decode_slots.view(-1)
        k = k_flat.index_select(0, flat).view(b, length, kvh, d).transpose(1, 2)   # [B, KVH, L, D]
        v = v_flat.index_select(0, flat).view(b, length, kvh, d).transpose(1, 2)
        mask = meta.decode_mask
        if sliding_window is not None and length > sliding_window:
            # the decode token sits at position seq_len - 1: it sees keys j >= seq_len - window
            first = (meta.decode_seq_lens - sliding_window).view(b, 1, 1, 1)
            inside = torch.arange(length, device=query.device).view(1, 1, 1, length) >= first
            mask = inside if mask is None else mask & inside
        if softcap is None:
            # one query row per head of a KV group: no K/V expansion for grouped-query attention
            q = query.index_select(0, meta.decode_token_idx).view(b, kvh, num_heads // kvh, d)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            q = query.index_select(0, meta.decode_token_idx).view(b, num_heads, 1, d)
            o = _attend(q, k, v, mask, scale, softcap)
        out.index_copy_(0, meta.decode_token_idx, o.reshape(b, num_heads, d))
    for p in meta.prefills:
        q = query[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)                 # [1, H, n, D]
        k = k_flat.index_select(0, p.gather_slots).transpose(0, 1).unsqueeze(0)    # [1, KVH, S, D]
        v = v_flat.index_select(0, p.gather_slots).transpose(0, 1).unsqueeze(0)
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

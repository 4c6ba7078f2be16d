"""The experts of a mixture of experts on the GPU: two Triton kernels over the module's own tensors
(issue 40, the device path; ``moe.experts_forward`` calls ``experts`` for CUDA tensors).

Steps, for ``T`` tokens with ``k`` experts each (``P = T * k`` (token, expert) pairs):

1. ``align``: the pairs sorted by expert (stable), each expert's run padded to a multiple of
   ``BLOCK_M`` so that a tile of rows belongs to one expert; ``block_expert`` names each tile's
   expert (-1 for tiles past the last). Sizes are bounds known before the step (``P`` and the
   expert count), so nothing is read back to the host (CUDA graphs can hold it).
2. ``_gate_up_kernel``: per tile of rows and of ``BLOCK_N`` intermediate columns, the tokens' hidden
   states times that expert's gate and up columns (one pass over ``H``, both accumulators in
   float32), biases added, the gating applied (SiLU, tanh-GELU, or gpt-oss's clamped SwiGLU):
   ``[P_padded, I]``.
3. ``_down_kernel``: those rows times the expert's down weight, bias added, times the pair's routing
   weight, stored at the pair's own row ``[P, H]``; the ``k`` rows of a token are summed after.

The weight layout is read through strides, so transformers' tensors are used in place: concatenated
``[E, 2I, H]`` gate|up or gpt-oss's transposed ``[E, H, 2I]`` with gate and up interleaved (gate
column ``n`` at ``n * gate_step + gate_off``, up at ``n * gate_step + up_off``); down ``[E, H, I]`` or
transposed ``[E, I, H]``. Any float dtype; products accumulate in float32. Under
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (the tests).

Source: the grouped-GEMM shape of vLLM's fused MoE (``moe_align_block_size`` then one kernel per
projection; its documentation), written here for transformers 5's experts layouts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import pagedllm.envs as envs

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}  # DeviceExperts.activation -> ACT
BLOCK_M = 16


@triton.jit
def _gate(g, u, ACT: tl.constexpr):
    if ACT == 0:
        return g * tl.sigmoid(g) * u
    elif ACT == 1:  # tanh-GELU, tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (2.0 * tl.sigmoid(2.0 * z)) * u
    else:  # gpt-oss: gate clamped above at 7, up to [-7, 7], sigmoid(1.702 g)
        gc = tl.minimum(g, 7.0)
        uc = tl.minimum(tl.maximum(u, -7.0), 7.0)
        return (uc + 1.0) * gc * tl.sigmoid(1.702 * gc)


@triton.jit
def _gate_up_kernel(x, w, bias, sorted_pair, block_expert, out,
                    num_pairs, top_k, H, I, s_xt, s_we, s_wn, s_wk, s_be, s_ot,
                    gate_step, gate_off, up_off,
                    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, F32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pair + rows)
        valid = pair < num_pairs
        tok = (tl.where(valid, pair, 0) // top_k).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < I
        col_g = (n * gate_step + gate_off).to(tl.int64)
        col_u = (n * gate_step + up_off).to(tl.int64)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        wbase = w + e * s_we
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < H
            a = tl.load(x + tok[:, None] * s_xt + kk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & nmask[None, :]
            wg = tl.load(wbase + col_g[None, :] * s_wn + kk[:, None] * s_wk, mask=wmask, other=0.0)
            wu = tl.load(wbase + col_u[None, :] * s_wn + kk[:, None] * s_wk, mask=wmask, other=0.0)
            if F32:
                acc_g += tl.dot(a.to(tl.float32), wg.to(tl.float32), input_precision="ieee")
                acc_u += tl.dot(a.to(tl.float32), wu.to(tl.float32), input_precision="ieee")
            else:
                acc_g += tl.dot(a, wg.to(a.dtype))
                acc_u += tl.dot(a, wu.to(a.dtype))
        if HAS_BIAS:
            acc_g += tl.load(bias + e * s_be + col_g, mask=nmask, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bias + e * s_be + col_u, mask=nmask, other=0.0).to(tl.float32)[None, :]
        h = _gate(acc_g, acc_u, ACT)
        tl.store(out + rows[:, None].to(tl.int64) * s_ot + n[None, :], h.to(out.dtype.element_ty),
                 mask=valid[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(a, w, bias, sorted_pair, block_expert, route_w, out,
                 num_pairs, H, I, s_at, s_we, s_wn, s_wk, s_be, s_ot,
                 HAS_BIAS: tl.constexpr, F32: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pair + rows)
        valid = pair < num_pairs
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < H
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        wbase = w + e * s_we
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < I
            x = tl.load(a + rows[:, None].to(tl.int64) * s_at + kk[None, :], mask=valid[:, None] & kmask[None, :],
                        other=0.0)
            wt = tl.load(wbase + n[None, :].to(tl.int64) * s_wn + kk[:, None] * s_wk,
                         mask=kmask[:, None] & nmask[None, :], other=0.0)
            if F32:
                acc += tl.dot(x.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, wt.to(x.dtype))
        if HAS_BIAS:
            acc += tl.load(bias + e * s_be + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        rw = tl.load(route_w + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
        tl.store(out + tl.where(valid, pair, 0)[:, None].to(tl.int64) * s_ot + n[None, :],
                 acc.to(out.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


def align(top_k_index: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Group (token, expert) pairs by expert in tiles of ``block_m`` rows.

    Args:
        top_k_index: ``[T, k]`` integer expert ids; an id outside ``0..num_experts-1`` (another
            expert-parallel rank's) is left out.
    Returns:
        ``(sorted_pair, block_expert)``: int32 ``[B * block_m]`` pair indices (``t * k + j``; ``P``
        marks padding) and int32 ``[B]`` each tile's expert (-1 past the last), with the bound
        ``B = ceil(P / block_m) + min(E, P)`` (no host read).
    """
    flat = top_k_index.reshape(-1).long()
    p, dev = flat.numel(), flat.device
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    starts = torch.cumsum(counts, 0) - counts
    n_blocks = -(-p // block_m) + min(num_experts, p)
    sk = key[order]
    ok = sk < num_experts
    e_of = torch.where(ok, sk, torch.zeros_like(sk))
    dest = (tile_end - tiles)[e_of] * block_m + torch.arange(p, device=dev) - starts[e_of]
    dest = torch.where(ok, dest, torch.full_like(dest, n_blocks * block_m))  # a spare row, cut below
    sorted_pair = torch.full((n_blocks * block_m + 1,), p, dtype=torch.int32, device=dev)
    sorted_pair[dest] = order.to(torch.int32)
    block = torch.arange(n_blocks, device=dev)
    expert = torch.searchsorted(tile_end, block, right=True)
    block_expert = torch.where(expert < num_experts, expert, torch.full_like(expert, -1)).to(torch.int32)
    return sorted_pair[:-1].contiguous(), block_expert


def _w_strides(w: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """(expert, output column, input) strides of a ``[E, out, in]`` (or transposed) weight."""
    return (w.stride(0), w.stride(2), w.stride(1)) if transposed else (w.stride(0), w.stride(1), w.stride(2))


def experts(spec, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The weighted sum of each token's top-k experts' gated MLPs.

    Args:
        spec: a ``models.moe.DeviceExperts`` (its weights, biases, layout and gating; not imported
            here: ``moe`` imports this module).
        hidden_states: ``[T, H]`` (any float dtype; the output has it).
        top_k_index: ``[T, k]`` expert ids (ids outside ``0..E-1`` contribute nothing).
        top_k_weights: ``[T, k]`` routing weights.
    Returns:
        ``[T, H]``.
    Raises:
        KeyError: an activation the kernel does not compute.
    """
    x = hidden_states.contiguous()
    t, h = x.shape
    k = top_k_index.shape[-1]
    num_experts, inter = spec.gate_up.shape[0], spec.intermediate
    p = t * k
    if p == 0:
        return torch.zeros_like(x)
    sorted_pair, block_expert = align(top_k_index, num_experts)
    f32 = x.dtype == torch.float32 or envs.TRITON_INTERPRET
    act = torch.empty((sorted_pair.numel(), inter), dtype=x.dtype, device=x.device)
    bn_i, bn_h, bk = min(64, triton.next_power_of_2(inter)), min(64, triton.next_power_of_2(h)), 32
    gu_b, dn_b = spec.gate_up_bias, spec.down_bias
    step, goff, uoff = (2, 0, 1) if spec.interleaved else (1, 0, inter)
    _gate_up_kernel[(block_expert.numel(), triton.cdiv(inter, bn_i))](
        x, spec.gate_up, gu_b if gu_b is not None else x, sorted_pair, block_expert, act,
        p, k, h, inter, x.stride(0), *_w_strides(spec.gate_up, spec.transposed),
        gu_b.stride(0) if gu_b is not None else 0, act.stride(0), step, goff, uoff,
        ACT=ACTIVATIONS[spec.activation], HAS_BIAS=gu_b is not None, F32=f32,
        BLOCK_M=BLOCK_M, BLOCK_N=bn_i, BLOCK_K=bk)
    out = torch.empty((p, h), dtype=x.dtype, device=x.device)
    weights = top_k_weights.reshape(-1).contiguous()
    _down_kernel[(block_expert.numel(), triton.cdiv(h, bn_h))](
        act, spec.down, dn_b if dn_b is not None else x, sorted_pair, block_expert, weights, out,
        p, h, inter, act.stride(0), *_w_strides(spec.down, spec.transposed),
        dn_b.stride(0) if dn_b is not None else 0, out.stride(0),
        HAS_BIAS=dn_b is not None, F32=f32, BLOCK_M=BLOCK_M, BLOCK_N=bn_h, BLOCK_K=bk)
    # a pair routed to no expert here (another rank's) keeps its row unwritten: zero it
    written = (top_k_index.reshape(-1) >= 0) & (top_k_index.reshape(-1) < num_experts)
    out = torch.where(written[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.view(t, k, h).sum(1, dtype=torch.float32).to(x.dtype)

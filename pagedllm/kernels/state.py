"""Wrappers of the hybrid-model state kernels (``state_kernels.c``, built with the CPU kernels).

``native_mixers()`` says whether the mixers use them (float32 CPU tensors only; callers check the
tensors): the CPU kernels are available and ``PAGEDLLM_NATIVE_MIXERS`` is not ``0`` (the
benchmark's switch, ``benchmarks/hybrid_mixers.py``). Results equal the torch mixers' within
float rounding.
"""

from __future__ import annotations

import os

import torch

from pagedllm.kernels import cpu

MAX_CONV_WIDTH = 16  # state_kernels.c CONV_MAX_WIDTH


def native_mixers() -> bool:
    """True when the mixers run the C kernels (read per call: cheap, and tests flip it)."""
    return os.environ.get("PAGEDLLM_NATIVE_MIXERS", "1") != "0" and cpu.available()


def applies(*tensors: torch.Tensor) -> bool:
    """``native_mixers()`` and every tensor is float32 on the CPU."""
    return native_mixers() and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def causal_conv(x: torch.Tensor, qsl: torch.Tensor, init_slots: torch.Tensor, dest_slots: torch.Tensor,
                cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool,
                checkpoints: list[tuple[int, int, int]] = ()) -> torch.Tensor:
    """Depthwise causal convolution of each request's segment, continuing from its carried inputs.

    Args:
        x: ``[T, C]`` float32; qsl: ``[R + 1]`` int64 segment starts; init_slots: ``[R]`` int64
            slot each request's carried inputs are read from (-1: zeros); dest_slots: ``[R]`` int64
            slot its new carried inputs (the last ``width``) are written to.
        cache: ``[S, C, width]`` float32, contiguous, oldest input first (updated in place).
        weight: ``[C, width + 1]``; bias: ``[C]`` or ``None``; silu: apply SiLU to the output.
        checkpoints: ``(request, offset, slot)`` sorted by request then offset (``StateBatch``):
            the carried inputs after ``offset`` tokens of the request's segment also go to ``slot``.
    Returns:
        ``[T, C]`` float32 (as ``short_conv.causal_conv_step``, then SiLU when asked).
    Raises:
        ValueError: ``width`` above ``MAX_CONV_WIDTH``.
    """
    width = cache.shape[-1]
    if width > MAX_CONV_WIDTH:
        raise ValueError(f"convolution width {width} is above {MAX_CONV_WIDTH}")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    idx = [t.to(torch.int64).contiguous() for t in (qsl, init_slots, dest_slots)]
    nreq = idx[1].numel()
    if checkpoints:
        counts = torch.bincount(torch.tensor([r for r, _, _ in checkpoints], dtype=torch.int64), minlength=nreq)
        ck_start = torch.zeros(nreq + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=ck_start[1:])
        ck_off = torch.tensor([k for _, k, _ in checkpoints], dtype=torch.int64)
        ck_slot = torch.tensor([s for _, _, s in checkpoints], dtype=torch.int64)
    else:  # every request's checkpoint range is empty: the kernel reads only ck_start
        ck_start = ck_off = ck_slot = torch.zeros(nreq + 1, dtype=torch.int64)
    cpu._lib.pl_causal_conv(x.data_ptr(), idx[0].data_ptr(), idx[1].data_ptr(), idx[2].data_ptr(), cache.data_ptr(),
                            weight.data_ptr(), None if bias is None else bias.contiguous().data_ptr(), out.data_ptr(),
                            ck_start.data_ptr(), ck_off.data_ptr(), ck_slot.data_ptr(), nreq, x.shape[1], width,
                            int(silu), torch.get_num_threads())
    return out


def ssd_decode(state: torch.Tensor, init_slots: torch.Tensor, dest_slots: torch.Tensor, x: torch.Tensor,
               dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
               dt_bias: torch.Tensor) -> torch.Tensor:
    """Mamba-2's recurrent update of one token per request (``mamba2_selective_state_update``).

    Args:
        state: ``[S, nh, hd, ns]`` float32 contiguous; slots ``init_slots`` ``[B]`` int64 are read
            (-1: zeros) and ``dest_slots`` ``[B]`` written with the new state.
        x: ``[B, nh * hd]``; dt: ``[B, nh]`` (before ``dt_bias`` and softplus); A: ``[nh]``
            (``-exp(A_log)``); B, C: ``[B, ng * ns]``; D, dt_bias: ``[nh]``.
    Returns:
        ``[B, nh * hd]`` float32 ``y = state . C + D x``.
    """
    nb, nh, hd, ns = x.shape[0], state.shape[1], state.shape[2], state.shape[3]
    ng = B.shape[1] // ns
    args = [t.contiguous() for t in (x, dt, A, B, C, D, dt_bias)]
    idx = [t.to(torch.int64).contiguous() for t in (init_slots, dest_slots)]
    y = torch.empty(nb, nh * hd, dtype=torch.float32)
    cpu._lib.pl_ssd_decode(state.data_ptr(), idx[0].data_ptr(), idx[1].data_ptr(), *(t.data_ptr() for t in args),
                           y.data_ptr(), nb, nh, hd, ns, ng, torch.get_num_threads())
    return y

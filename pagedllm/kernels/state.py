"""Wrappers of the hybrid-model state kernels (``state_kernels.c``, built with the CPU kernels).

``native_mixers()`` says whether the mixers use them (float32 CPU tensors only; callers check the
tensors): the CPU kernels are available and ``PAGEDLLM_NATIVE_MIXERS`` is not ``0`` (the
benchmark's switch, ``benchmarks/hybrid_mixers.py``). Results equal the torch mixers' within
float rounding.
"""

from __future__ import annotations

import torch

import pagedllm.envs as envs
from pagedllm.kernels import cpu

MAX_CONV_WIDTH = 16  # state_kernels.c CONV_MAX_WIDTH


def native_mixers() -> bool:
    """True when the mixers run the C kernels (read per call: cheap, and tests flip it)."""
    return envs.PAGEDLLM_NATIVE_MIXERS and cpu.available()


def applies(*tensors: torch.Tensor) -> bool:
    """``native_mixers()`` and every tensor is float32 on the CPU."""
    return native_mixers() and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def causal_conv(x: torch.Tensor, qsl: torch.Tensor, init_slots: torch.Tensor, dest_slots: torch.Tensor,
                cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool,
                checkpoints: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Depthwise causal convolution of each request's segment, continuing from its carried inputs.

    Args:
        x: ``[T, C]`` float32; qsl: ``[R + 1]`` int64 segment starts; init_slots: ``[R]`` int64
            slot each request's carried inputs are read from (-1: zeros); dest_slots: ``[R]`` int64
            slot its new carried inputs (the last ``width``) are written to.
        cache: ``[S, C, width]`` float32, contiguous, oldest input first (updated in place).
        weight: ``[C, width + 1]``; bias: ``[C]`` or ``None``; silu: apply SiLU to the output.
        checkpoints: ``StateBatch.checkpoint_arrays()``: the carried inputs after ``offset`` tokens
            of a request's segment also go to its checkpoint's ``slot``.
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
    ck_start, ck_off, ck_slot = checkpoints
    cpu._lib.pl_causal_conv(x.data_ptr(), idx[0].data_ptr(), idx[1].data_ptr(), idx[2].data_ptr(), cache.data_ptr(),
                            weight.data_ptr(), None if bias is None else bias.contiguous().data_ptr(), out.data_ptr(),
                            ck_start.data_ptr(), ck_off.data_ptr(), ck_slot.data_ptr(), nreq, x.shape[1], width,
                            int(silu), torch.get_num_threads())
    return out


def ssd_scan(state: torch.Tensor, qsl: torch.Tensor, init_slots: torch.Tensor, dest_slots: torch.Tensor,
             x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
             dt_bias: torch.Tensor, dt_limits: list[tuple[float, float]],
             checkpoints: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mamba-2's SSM over each request's segment in its recurrent form (per token, as
    ``mamba2_selective_state_update``; the chunked scan's result up to float rounding).

    Args:
        state: ``[S, nh, hd, ns]`` float32 contiguous; slots ``init_slots`` ``[R]`` int64 are read
            (-1: zeros) and ``dest_slots`` ``[R]`` written with each request's state after its segment.
        qsl: ``[R + 1]`` int64 segment starts in the flattened rows.
        x: ``[T, nh * hd]``; dt: ``[T, nh]`` (before ``dt_bias`` and softplus); A: ``[nh]``
            (``-exp(A_log)``); B, C: ``[T, ng * ns]``; D, dt_bias: ``[nh]``.
        dt_limits: per request, the clamp of its softplus'd ``dt`` (transformers clamps prefill
            chunks to the layer's ``time_step_limit`` and not the decode update).
        checkpoints: as in ``causal_conv``: the state after ``offset`` tokens also goes to ``slot``.
    Returns:
        ``[T, nh * hd]`` float32 ``y = state . C + D x``.
    """
    t, nh, hd, ns = x.shape[0], state.shape[1], state.shape[2], state.shape[3]
    ng = B.shape[1] // ns
    args = [a.float().contiguous() for a in (x, dt, A, B, C, D, dt_bias)]
    idx = [i.to(torch.int64).contiguous() for i in (init_slots, dest_slots, qsl)]
    ck_start, ck_off, ck_slot = checkpoints
    nreq = idx[0].numel()
    lims = torch.tensor(dt_limits, dtype=torch.float32).reshape(nreq, 2).contiguous()
    y = torch.empty(t, nh * hd, dtype=torch.float32)
    cpu._lib.pl_ssd_scan(state.data_ptr(), idx[0].data_ptr(), idx[1].data_ptr(), idx[2].data_ptr(),
                         *(a.data_ptr() for a in args), lims.data_ptr(), y.data_ptr(), ck_start.data_ptr(),
                         ck_off.data_ptr(), ck_slot.data_ptr(), nreq, nh, hd, ns, ng, torch.get_num_threads())
    return y

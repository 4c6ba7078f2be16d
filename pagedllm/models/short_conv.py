"""Gated short convolution (LFM2) over pagedllm's flattened batch, continuing each request's state.

``causal_conv_step`` is the depthwise causal convolution that LFM2's short-conv layers and
Mamba-2's input convolution share: each request's segment continues from the last
``kernel - 1`` inputs carried in its state slot (``attention/state.py``).

Source: transformers' ``models/lfm2/modeling_lfm2.py`` (``Lfm2ShortConv``: ``in_proj -> B, C, x``;
``C * causal_conv1d(B * x)``; ``out_proj``; the cached state is the convolution's last
``conv_L_cache - 1`` inputs per channel).
"""

from __future__ import annotations

import torch

from pagedllm.attention.state import StateBatch
from pagedllm.kernels import state as state_kernels


def causal_conv_step(x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     batch: StateBatch, silu: bool = False) -> torch.Tensor:
    """Depthwise causal convolution of every request's segment, continuing from its carried inputs.

    Token ``t`` of a request gets ``sum_k weight[:, k] * in[t - K + 1 + k]`` (``K = width + 1`` taps)
    where inputs before the segment come from the request's state (zero for a request starting now),
    as ``torch.nn.functional.conv1d`` with ``padding=K - 1`` on the whole sequence.

    Args:
        x: ``[T, C]`` inputs of the flattened batch.
        cache: ``[num_slots, C, width]`` carried inputs per slot, oldest first; the scheduled
            requests' slots are overwritten with their last ``width`` inputs, and each of the
            step's checkpoint slots (``batch.checkpoints``) with the ``width`` inputs before its
            boundary (read from the same extended buffer, so no extra pass).
        weight: ``[C, width + 1]`` taps; bias: ``[C]`` or ``None``.
        batch: the step's ``StateBatch``.
        silu: apply SiLU to the result (Mamba-2's input convolution).
    Returns:
        ``[T, C]`` in ``x``'s dtype.

    float32 CPU tensors take the C kernel (``kernels/state.py``: one pass per request and block
    of channels, checkpoints included); other devices and dtypes the torch ops below.
    """
    if state_kernels.applies(x, cache, weight) and cache.shape[-1] <= state_kernels.MAX_CONV_WIDTH:
        return state_kernels.causal_conv(x, batch.query_start_loc, batch.initial_index(), batch.state_slots, cache,
                                         weight, bias, silu, batch.checkpoint_arrays())
    width = cache.shape[-1]
    token_rows, state_rows, last_rows = batch.conv_index(width)
    ext = x.new_empty(x.shape[0] + batch.num_reqs * width, x.shape[1])
    ext[state_rows] = batch.initial(cache).transpose(1, 2).to(x.dtype)
    ext[token_rows] = x
    out = ext[token_rows - width] * weight[:, 0]
    for k in range(1, width + 1):
        out = out + ext[token_rows - width + k] * weight[:, k]
    if bias is not None:
        out = out + bias
    if batch.checkpoints:
        rows, slots = batch.conv_checkpoint_rows(width)
        cache[slots] = ext[rows].transpose(1, 2).to(cache.dtype)
    cache[batch.state_slots] = ext[last_rows].transpose(1, 2).to(cache.dtype)
    return torch.nn.functional.silu(out) if silu else out


def lfm2_short_conv_forward(self, hidden_states: torch.Tensor, past_key_values=None, attention_mask=None,
                             **kwargs) -> torch.Tensor:
    """``Lfm2ShortConv.forward`` over pagedllm's flattened batch: ``[1, T, H] -> [1, T, H]``.

    Bound to an ``Lfm2ShortConv`` module by ``hybrid.install_mixers``; reads the step's
    ``StateBatch`` from ``self._pagedllm_state()`` and the layer's one state tensor
    ``[num_slots, H, conv_L_cache - 1]``.
    """
    batch = self._pagedllm_state()
    x = hidden_states[0]
    b, c, v = self.in_proj(x).chunk(3, dim=-1)
    y = causal_conv_step(b * v, batch.caches[self.layer_idx][0], self.conv.weight[:, 0, :], self.conv.bias, batch)
    return self.out_proj(c * y).unsqueeze(0)

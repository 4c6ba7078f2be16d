"""State-carrying mixer layers of hybrid models, run by the Transformers backend with pagedllm's state slots.

A hybrid model interleaves attention layers (served from the paged KV cache by
``transformers_backend.paged_attention_forward``) with mixers whose per-request
state is fixed-size: LFM2's gated short convolution so far. ``transformers``
runs such a mixer on one padded sequence batch with its own cache object; in
pagedllm the step is one flattened batch of many requests at different points
(prefill chunks and decodes together), so the mixer module's ``forward`` is
replaced by one that runs every request's segment from its state slot
(``attention/state.py``'s ``StateBatch``) and writes the new state back. The
module's own weights are used as they are (``in_proj``, ``conv``, ``out_proj``).

Sources: transformers' ``models/lfm2/modeling_lfm2.py`` (``Lfm2ShortConv``:
``in_proj -> B, C, x``; ``C * causal_conv1d(B * x)``; ``out_proj``; the cached
state is the last ``conv_L_cache - 1`` inputs of the convolution per channel).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from pagedllm.attention.state import StateBatch


def causal_conv_step(x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     batch: StateBatch) -> torch.Tensor:
    """Depthwise causal convolution of every request's segment, continuing from its carried inputs.

    Token ``t`` of a request gets ``sum_k weight[:, k] * in[t - K + 1 + k]`` (``K = width + 1`` taps)
    where inputs before the segment come from the request's state (zero for a request starting now),
    as ``torch.nn.functional.conv1d`` with ``padding=K - 1`` on the whole sequence.

    Args:
        x: ``[T, C]`` inputs of the flattened batch.
        cache: ``[num_slots, C, width]`` carried inputs per slot, oldest first; the scheduled
            requests' slots are overwritten with their last ``width`` inputs.
        weight: ``[C, width + 1]`` taps; bias: ``[C]`` or ``None``.
        batch: the step's ``StateBatch``.
    Returns:
        ``[T, C]`` in ``x``'s dtype.
    """
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
    cache[batch.state_slots] = ext[last_rows].transpose(1, 2).to(cache.dtype)
    return out


def _lfm2_short_conv_forward(self, hidden_states: torch.Tensor, past_key_values=None, attention_mask=None,
                             **kwargs) -> torch.Tensor:
    """``Lfm2ShortConv.forward`` over pagedllm's flattened batch: ``[1, T, H] -> [1, T, H]``."""
    batch = self._pagedllm_state()
    x = hidden_states[0]
    b, c, v = self.in_proj(x).chunk(3, dim=-1)
    y = causal_conv_step(b * v, batch.caches[self.layer_idx][0], self.conv.weight[:, 0, :], self.conv.bias, batch)
    return self.out_proj(c * y).unsqueeze(0)


@dataclass(frozen=True)
class HybridFamily:
    """How pagedllm serves one hybrid architecture's state layers.

    Attributes:
        state_layer_types: ``layer_types`` entries whose layers carry fixed-size state.
        module_class: name of the ``transformers`` mixer module whose ``forward`` is replaced.
        forward: the replacement (reads ``self._pagedllm_state()``, a ``StateBatch``).
        state_shapes: ``config -> per-slot shapes`` of one state layer's tensors.
    """

    state_layer_types: frozenset[str]
    module_class: str
    forward: Callable
    state_shapes: Callable


HYBRID_FAMILIES = {
    "lfm2": HybridFamily(frozenset({"conv"}), "Lfm2ShortConv", _lfm2_short_conv_forward,
                         lambda cfg: [(cfg.hidden_size, cfg.conv_L_cache - 1)]),
}


def hybrid_family(config) -> HybridFamily | None:
    """The ``HybridFamily`` of a text config (by ``model_type``), or ``None`` for other models."""
    return HYBRID_FAMILIES.get(getattr(config, "model_type", None))


def state_layer_indices(config) -> list[int]:
    """Indices of the layers of ``config`` that carry state (empty for an attention-only model)."""
    fam = hybrid_family(config)
    types_ = getattr(config, "layer_types", None) or ()
    return [i for i, t in enumerate(types_) if fam is not None and t in fam.state_layer_types]


def state_cache_spec(config) -> dict[int, list[tuple[int, ...]]]:
    """Layer index -> per-slot shapes of its state tensors (``{}``: no state)."""
    fam = hybrid_family(config)
    return {i: fam.state_shapes(config) for i in state_layer_indices(config)}


def install_mixers(hf: nn.Module, config, get_state: Callable[[], StateBatch]) -> int:
    """Replace the ``forward`` of every state mixer of ``hf`` by pagedllm's; returns how many.

    Args:
        hf: the loaded ``transformers`` model.
        config: its text config.
        get_state: returns the running step's ``StateBatch`` (raises outside a step).
    Raises:
        ValueError: the number of mixer modules found differs from the state layers of ``config``.
    """
    fam = hybrid_family(config)
    if fam is None:
        return 0
    n = 0
    for mod in hf.modules():
        if type(mod).__name__ == fam.module_class:
            mod.forward = types.MethodType(fam.forward, mod)
            mod._pagedllm_state = get_state
            n += 1
    want = len(state_layer_indices(config))
    if n != want:
        raise ValueError(f"{type(hf).__name__}: found {n} {fam.module_class} modules, config has {want} state layers")
    return n

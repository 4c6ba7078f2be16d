"""State-carrying mixer layers of hybrid models, run by the Transformers backend with pagedllm's state slots.

A hybrid model interleaves attention layers (served from the paged KV cache by
``transformers_backend.paged_attention_forward``) with mixers whose per-request
state is fixed-size: LFM2's gated short convolution (``short_conv.py``), Granite 4's
and Bamba's Mamba-2 (``mamba2.py``) and Jamba's Mamba-1 (``mamba1.py``). ``transformers``
runs such a mixer on one padded sequence batch with its own cache object; in
pagedllm the step is one flattened batch of many requests at different points
(prefill chunks and decodes together), so the mixer module's ``forward`` is
replaced by one that runs every request's segment from its state slot
(``attention/state.py``'s ``StateBatch``) and writes the new state back. The
module's own weights are used as they are.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from pagedllm.attention.state import StateBatch
from pagedllm.models.mamba1 import jamba_mamba_forward
from pagedllm.models.mamba2 import granite_mamba_forward
from pagedllm.models.short_conv import lfm2_short_conv_forward


@dataclass(frozen=True)
class HybridFamily:
    """How pagedllm serves one hybrid architecture's state layers.

    Attributes:
        state_layer_types: ``layer_types`` entries whose layers carry fixed-size state.
        module_class: name of the ``transformers`` mixer module whose ``forward`` is replaced.
        forward: the replacement (reads ``self._pagedllm_state()``, a ``StateBatch``).
        state_shapes: ``config -> per-slot shapes`` of one state layer's tensors.
        layer_types: ``config -> [num_layers]`` kind of each layer, matched against
            ``state_layer_types`` (default: the config's ``layer_types``).
        vouches_attention: the family's attention modules call transformers' attention interface
            with the layer's own Q/K/V and ``layer_idx`` (read in its modeling file, checked by
            ``tests/models/test_hybrid.py``) though its model class leaves
            ``_supports_attention_backend`` False (Jamba, Bamba, Nemotron-H).
        plain_layer_types: kinds of layers with neither attention nor state (Nemotron-H's ``mlp``
            and ``moe`` blocks): they get no KV layer.
    """

    state_layer_types: frozenset[str]
    module_class: str
    forward: Callable
    state_shapes: Callable
    layer_types: Callable = lambda cfg: getattr(cfg, "layer_types", None) or ()
    vouches_attention: bool = False
    plain_layer_types: frozenset[str] = frozenset()


def _mamba2_shapes(cfg) -> list[tuple[int, ...]]:
    """A Mamba-2 layer's state: ``[conv_dim, d_conv - 1]`` convolution inputs, ``[heads, d_head, d_state]`` SSM."""
    inner = int(cfg.mamba_expand * cfg.hidden_size)
    conv_dim = inner + 2 * cfg.mamba_n_groups * cfg.mamba_d_state
    return [(conv_dim, cfg.mamba_d_conv - 1), (cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state)]


def _nemotron_h_shapes(cfg) -> list[tuple[int, ...]]:
    """Nemotron-H's Mamba-2 state (its config's names): ``[conv_dim, conv_kernel - 1]``, ``[heads, d_head, d_state]``."""
    inner = cfg.mamba_num_heads * cfg.mamba_head_dim
    return [(inner + 2 * cfg.n_groups * cfg.ssm_state_size, cfg.conv_kernel - 1),
            (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size)]


def _mamba1_shapes(cfg) -> list[tuple[int, ...]]:
    """A Mamba-1 layer's state: ``[intermediate, d_conv - 1]`` convolution inputs, ``[intermediate, d_state]`` SSM."""
    inner = int(cfg.mamba_expand * cfg.hidden_size)
    return [(inner, cfg.mamba_d_conv - 1), (inner, cfg.mamba_d_state)]


def _jamba_layer_types(cfg) -> list[str]:
    """Jamba's layer kinds, ``"mamba"`` or ``"full_attention"``, from ``layers_block_type`` (set by
    ``attn_layer_period`` / ``attn_layer_offset``; every ``transformers`` version's ``JambaConfig`` has it,
    not all have ``layer_types``)."""
    return ["mamba" if t == "mamba" else "full_attention" for t in cfg.layers_block_type]


HYBRID_FAMILIES = {
    "lfm2": HybridFamily(frozenset({"conv"}), "Lfm2ShortConv", lfm2_short_conv_forward,
                         lambda cfg: [(cfg.hidden_size, cfg.conv_L_cache - 1)]),
    "lfm2_moe": HybridFamily(frozenset({"conv"}), "Lfm2MoeShortConv", lfm2_short_conv_forward,
                             lambda cfg: [(cfg.hidden_size, cfg.conv_L_cache - 1)]),
    "granitemoehybrid": HybridFamily(frozenset({"linear_attention"}), "GraniteMoeHybridMambaLayer",
                                     granite_mamba_forward, _mamba2_shapes),
    # Bamba's mixer is the module Granite 4's hybrid was derived from: same weights, same forward
    "bamba": HybridFamily(frozenset({"linear_attention"}), "BambaMixer", granite_mamba_forward, _mamba2_shapes,
                          vouches_attention=True),
    # Nemotron-H: one mixer per block (Mamba-2 as Granite 4's, attention, MLP or experts)
    "nemotron_h": HybridFamily(frozenset({"linear_attention"}), "NemotronHMamba2Mixer", granite_mamba_forward,
                               _nemotron_h_shapes, vouches_attention=True, plain_layer_types=frozenset({"mlp", "moe"})),
    "jamba": HybridFamily(frozenset({"mamba"}), "JambaMambaMixer", jamba_mamba_forward, _mamba1_shapes,
                          layer_types=_jamba_layer_types, vouches_attention=True),
}


def hybrid_family(config) -> HybridFamily | None:
    """The ``HybridFamily`` of a text config (by ``model_type``), or ``None`` for other models."""
    return HYBRID_FAMILIES.get(getattr(config, "model_type", None))


def layer_kinds(config) -> list[str]:
    """Each layer's kind (``layer_types`` spelling), by the config's hybrid family where it has one."""
    fam = hybrid_family(config)
    return list(fam.layer_types(config) if fam is not None else getattr(config, "layer_types", None) or ())


def state_layer_indices(config) -> list[int]:
    """Indices of the layers of ``config`` that carry state (empty for an attention-only model)."""
    fam = hybrid_family(config)
    if fam is None:
        return []
    return [i for i, t in enumerate(fam.layer_types(config)) if t in fam.state_layer_types]


def attention_layer_indices(config) -> list[int]:
    """Indices of the layers of ``config`` that get a paged KV layer: all but the state layers and
    the family's plain (attention-free, stateless) layers."""
    fam = hybrid_family(config)
    if fam is None:
        return list(range(config.num_hidden_layers))
    kinds = list(fam.layer_types(config)) or [""] * config.num_hidden_layers
    return [i for i, t in enumerate(kinds) if t not in fam.state_layer_types | fam.plain_layer_types]


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

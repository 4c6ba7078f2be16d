"""Rotary position embedding (Su et al. 2021, RoFormer) with precomputed cos/sin tables.

The inverse frequencies come from ``transformers.modeling_rope_utils`` so every
``rope_scaling`` type a Llama-family config names (linear, dynamic, yarn,
llama3, longrope) matches Hugging Face ``transformers`` exactly (rotate-half
convention, as its ``apply_rotary_pos_emb``).

A step's rotary input is one type, ``RotaryStep``, made once per step by
``prepare`` and shared by all layers; ``rotate`` turns the fused q/k heads.
``RotaryEmbedding`` rotates in torch ops (``prepare`` gathers the step's
cos/sin rows); ``CpuRotaryEmbedding`` rotates in place in the C kernel, which
reads the tables at the positions itself. ``build_rotary`` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels import cpu as kernels


@dataclass
class RotaryStep:
    """The rotary input of one step.

    Attributes:
        positions: ``[T]`` int64 absolute positions of the flattened batch.
        cos, sin: ``[T, 1, D]`` table rows at ``positions`` in the compute dtype (torch
            implementation), or ``None`` (the CPU kernel reads the tables itself).
    """

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary embedding in torch ops.

    Args:
        config: a ``transformers`` config (``rope_parameters`` or ``rope_theta``).
        head_dim: ``D``, the rotated width of each head.
        max_positions: rows of the cos/sin tables.
    """

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        self._inv_freq, self._scaling, self._max_positions = inv_freq, scaling, max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build(torch.device("cpu"))

    def build(self, device: torch.device) -> None:
        """(Re)compute the ``[max_positions, D]`` float32 cos/sin tables on ``device``.

        Called again after the model is materialized from the meta device.
        """
        pos = torch.arange(self._max_positions, dtype=torch.float, device="cpu")
        freqs = torch.outer(pos, self._inv_freq.to("cpu", torch.float))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self._scaling).to(device)
        self.sin = (emb.sin() * self._scaling).to(device)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        """The step's ``RotaryStep`` for ``positions`` ``[T]`` int64: the cos/sin rows, gathered
        once and shared by all layers, in ``dtype``."""
        return RotaryStep(positions, self.cos[positions].unsqueeze(1).to(dtype),
                          self.sin[positions].unsqueeze(1).to(dtype))

    def rotate(self, qkv: torch.Tensor, num_heads: int, head_dim: int, step: RotaryStep) -> torch.Tensor:
        """Rotate the first ``num_heads`` heads of each row of ``qkv`` ``[T, >= num_heads * D]``
        (q and k heads, adjacent in the fused projection) by ``step``; returns them rotated,
        ``[T, num_heads, D]`` (a new tensor here; ``qkv`` is left as it is)."""
        qk = qkv[:, :num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
        return qk * step.cos + _rotate_half(qk) * step.sin


class CpuRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` through the C kernel (float32 CPU tensors; same arguments)."""

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        """Only the positions: the kernel reads the table rows itself."""
        return RotaryStep(positions)

    def rotate(self, qkv: torch.Tensor, num_heads: int, head_dim: int, step: RotaryStep) -> torch.Tensor:
        """As ``RotaryEmbedding.rotate``, but in place: the returned ``[T, num_heads, D]`` is a view
        of ``qkv``, whose rows may be strided (columns contiguous)."""
        kernels.rope_(qkv, num_heads, head_dim, step.positions, self.cos, self.sin)
        return qkv[:, :num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)


def build_rotary(config, head_dim: int, max_positions: int, cpu_kernels: bool) -> RotaryEmbedding:
    """``CpuRotaryEmbedding`` when ``cpu_kernels`` (see ``kernels.applies``), else ``RotaryEmbedding``."""
    return (CpuRotaryEmbedding if cpu_kernels else RotaryEmbedding)(config, head_dim, max_positions)

"""``torch.compile`` of the pure-torch pieces between attention calls (vLLM's piecewise compile).

A decoder layer's RMSNorm (with its residual add), SwiGLU activation and rotary embedding are
chains of small element-wise and reduction ops: eager, each op is a kernel launch and a pass
over memory; compiled by inductor they become one fused kernel each (Triton on a GPU, C++ on
the CPU). The matrix products and the paged attention stay as they are (cuBLAS / our kernels):
nothing to fuse there, and the attention backend's kernels are not traceable in one graph.

Each piece is one free function compiled once per process with dynamic shapes (the token count
varies per step), so every layer shares the same compiled code (a compiled bound method would
guard on ``self`` and recompile per layer). ``compile_model`` swaps the class of a model's torch
modules for the compiled one; modules already on the C CPU kernels are left alone (one pass
each already). Where it pays: ``benchmarks/compile_ops.py``.

Raises nothing at swap time; the first call of a piece compiles it (seconds; needs a C compiler
on the CPU, Triton on a GPU).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.activation import SiluAndMul
from pagedllm.models.layers.norm import RMSNorm
from pagedllm.models.layers.rotary import RotaryEmbedding, RotaryStep, _rotate_half

logger = logging.getLogger(__name__)
_COMPILED: dict = {}


def compiled(fn):
    """``fn`` through ``torch.compile(dynamic=True, fullgraph=True)``, built once per process."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _COMPILED[fn]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm`` of ``x`` ``[T, H]`` with ``weight`` ``[H]`` (float32 inside, as transformers)."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(rms_norm(residual + x), residual + x)``, ``[T, H]`` each."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate then up) -> ``[T, I]`` ``silu(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``qk`` ``[T, N, D]`` rotated by the step's ``cos`` / ``sin`` rows ``[T, 1, D]`` (a new tensor)."""
    return qk * cos + _rotate_half(qk) * sin


class CompiledRMSNorm(RMSNorm):
    """``RMSNorm`` through the compiled ``rms_norm`` / ``add_rms_norm`` (same arguments and results)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """As ``RMSNorm.forward``."""
        if residual is None:
            return compiled(rms_norm)(x, self.weight, self.eps)
        return compiled(add_rms_norm)(x, residual, self.weight, self.eps)


class CompiledSiluAndMul(SiluAndMul):
    """``SiluAndMul`` through the compiled ``silu_and_mul``."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """As ``SiluAndMul.forward``."""
        return compiled(silu_and_mul)(gate_up)


class CompiledRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose rotation is the compiled ``rope``."""

    def rotate(self, qkv: torch.Tensor, num_heads: int, head_dim: int, step: RotaryStep) -> torch.Tensor:
        """As ``RotaryEmbedding.rotate``."""
        qk = qkv[:, :num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
        return compiled(rope)(qk, step.cos, step.sin)


SWAPS = {RMSNorm: CompiledRMSNorm, SiluAndMul: CompiledSiluAndMul, RotaryEmbedding: CompiledRotaryEmbedding}


def compile_model(model: nn.Module) -> int:
    """Swap every torch-op norm, activation and rotary module of ``model`` (exact classes only:
    the C-kernel subclasses stay) for its compiled twin; returns how many were swapped.

    Only pagedllm's native models have these modules: a Transformers-backend model (its own
    modules) or a model on the C kernels gets none swapped, which is logged."""
    n = 0
    for m in model.modules():
        twin = SWAPS.get(type(m))
        if twin is not None:
            m.__class__ = twin
            n += 1
    if n == 0:
        logger.info("compilation_config: %s has no torch-op norms, activations or rotary of pagedllm's to "
                    "compile (Transformers-backend models and the C CPU kernels run as they are)", type(model).__name__)
    return n


def resolve_compilation(config, device: str, enforce_eager: bool) -> bool:
    """Whether to compile the pieces (``compile_model``), from vLLM's ``compilation_config``.

    Args:
        config: ``None`` (auto: on for a CUDA device unless ``enforce_eager``; off on the CPU,
            where the C kernels already do each piece in one pass: ``benchmarks/compile_ops.py``),
            an optimization level (vLLM's ``-O``: 0 off, 1-3 on), its string form, a JSON object
            string, or a dict with ``level`` or ``mode`` (vLLM's names; same meaning).
        device: the engine's device; enforce_eager: vLLM's switch, which also turns compiling off
            when ``config`` is ``None``.
    Raises:
        ValueError: a key other than ``level`` / ``mode`` (or both, differing), or a level that is
            not an integer in 0-3 (``True`` and ``3.7`` included).
    """
    if config is None:
        return str(device).startswith("cuda") and not enforce_eager
    if isinstance(config, str):
        import json
        config = json.loads(config) if config.strip().startswith("{") else int(config)
    if isinstance(config, dict):
        unknown = sorted(set(config) - {"level", "mode"})
        if unknown:
            raise ValueError(f"compilation_config: unsupported keys {unknown} (pagedllm takes 'level' or 'mode')")
        if "level" in config and "mode" in config and config["level"] != config["mode"]:
            raise ValueError(f"compilation_config: 'level' {config['level']!r} and 'mode' {config['mode']!r} differ")
        config = config.get("level", config.get("mode", 0))
    if isinstance(config, bool) or not isinstance(config, int) or not 0 <= config <= 3:
        raise ValueError(f"compilation_config: level {config!r} is not an integer in 0-3")
    return config > 0

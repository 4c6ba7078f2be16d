"""SwiGLU's activation, ``silu(gate) * up`` (Shazeer 2020), on a fused ``[T, 2I]`` gate/up output.

``SiluAndMul`` is the torch implementation; ``CpuSiluAndMul`` runs the C kernel
(``pagedllm.kernels.cpu.silu_mul``) in one pass. ``build_silu_and_mul`` picks one
when the model is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as kernels


class SiluAndMul(nn.Module):
    """``[T, 2I]`` (gate then up) -> ``[T, I]`` ``silu(gate) * up``, same dtype, in torch ops."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up`` ``[T, 2I]`` -> ``[T, I]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuSiluAndMul(SiluAndMul):
    """``SiluAndMul`` through the C kernel (float32 CPU tensors)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up`` ``[T, 2I]`` float32 -> ``[T, I]``."""
        return kernels.silu_mul(gate_up.contiguous())


def build_silu_and_mul(cpu_kernels: bool) -> SiluAndMul:
    """``CpuSiluAndMul`` when ``cpu_kernels`` (see ``kernels.applies``), else ``SiluAndMul``."""
    return CpuSiluAndMul() if cpu_kernels else SiluAndMul()

"""RMSNorm (Zhang & Sennrich 2019), optionally fused with the residual add.

Computed in float32 like Hugging Face ``transformers``' ``LlamaRMSNorm``.
``RMSNorm`` is the torch implementation; ``CpuRMSNorm`` runs the C kernel
(``pagedllm.kernels.cpu.rms_norm``), which also adds the residual in place in
the same pass. ``build_rms_norm`` picks one when the model is built.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import cpu as kernels


class RMSNorm(nn.Module):
    """Root-mean-square norm in torch ops.

    Args:
        hidden_size: width ``H`` of the normalized rows; ``weight`` is ``[H]``.
        eps: added to the mean square before the reciprocal square root.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x`` ``[T, H]`` -> normalized ``[T, H]``, same dtype.

        With ``residual`` ``[T, H]``: returns ``(norm(residual + x), residual + x)``.
        """
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual


class CpuRMSNorm(RMSNorm):
    """``RMSNorm`` through the C kernel (float32 CPU tensors; same arguments and results).

    With ``residual`` the sum ``residual + x`` is written into ``residual`` in place (the
    caller's residual stream), and that tensor is returned as the new residual.
    """

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x`` ``[T, H]`` (and ``residual`` ``[T, H]``) float32 -> as ``RMSNorm.forward``."""
        # the kernel walks whole rows: make the (already contiguous in the models) inputs so
        x = x.contiguous()
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        residual = residual.contiguous()
        return kernels.rms_norm(x, self.weight, self.eps, residual), residual


def build_rms_norm(hidden_size: int, eps: float, cpu_kernels: bool) -> RMSNorm:
    """``CpuRMSNorm`` when ``cpu_kernels`` (see ``kernels.applies``), else ``RMSNorm``."""
    return (CpuRMSNorm if cpu_kernels else RMSNorm)(hidden_size, eps)

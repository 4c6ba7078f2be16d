"""The Transformers backend's RMSNorms on the C kernel (issue 39, item 4: a piece done in Python per
layer moved into our layers, not the whole family).

A ``transformers`` decoder layer runs its RMSNorms as five or six small torch ops each (Gemma 3 has
six norms per layer: 109 calls a decoded token, about 5 ms of its 32 on 2 cores, measured). Each norm
module whose class is an RMSNorm is replaced by ``KernelRMSNorm`` (one ``kernels.cpu.rms_norm`` call
over the rows), but only after checking, on a random input, that the kernel reproduces the module:
with the module's weight as it is (Llama, Qwen, Mistral) or plus one (Gemma keeps ``w`` and scales by
``1 + w``). A norm that matches neither (a variant we have not seen) keeps its own code.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from pagedllm.kernels import cpu as kernels

MATCH_ATOL = 1e-5  # on unit-scale rows; a wrong formula is off by ~0.1 or more


class KernelRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension, by the C kernel.

    Args:
        weight: ``[H]`` float32, the effective scale (for Gemma ``1 + w``).
        eps: added to the mean square.
    Shapes: ``x`` ``[..., H]`` float32 -> ``[..., H]`` float32.
    """

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().float().contiguous(), persistent=False)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., H]`` (rows flattened for the kernel)."""
        h = self.weight.shape[0]
        return kernels.rms_norm(x.reshape(-1, h).contiguous(), self.weight, self.eps).view(x.shape)


def _eps(module: nn.Module) -> float | None:
    for name in ("eps", "variance_epsilon", "epsilon"):
        v = getattr(module, name, None)
        if isinstance(v, float):
            return v
    return None


def _kernel_twin(module: nn.Module) -> KernelRMSNorm | None:
    """A ``KernelRMSNorm`` that computes what ``module`` does on float32 rows, or ``None`` (also for
    a norm whose ``forward`` takes more than the rows, e.g. a gated one)."""
    w, eps = getattr(module, "weight", None), _eps(module)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.dtype != torch.float32 or eps is None:
        return None
    if len(inspect.signature(module.forward).parameters) != 1:
        return None
    x = torch.randn(3, w.shape[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        try:
            want = module(x)
        except Exception:  # a norm with other arguments or shapes keeps its own code
            return None
        for scale in (w, 1.0 + w):
            twin = KernelRMSNorm(scale, eps)
            if want.shape == x.shape and torch.allclose(twin(x), want, rtol=0, atol=MATCH_ATOL):
                return twin
    return None


def install_kernel_norms(model: nn.Module) -> tuple[int, int]:
    """Replace every RMSNorm module of ``model`` that the kernel reproduces (in place).

    Returns:
        ``(replaced, kept)``: norm modules swapped for ``KernelRMSNorm``, and RMSNorm modules left
        as they are (no match).
    """
    replaced = kept = 0
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if "RMSNorm" not in type(child).__name__ or isinstance(child, KernelRMSNorm):
                continue
            twin = _kernel_twin(child)
            if twin is None:
                kept += 1
                continue
            setattr(owner, name, twin)
            replaced += 1
    return replaced, kept

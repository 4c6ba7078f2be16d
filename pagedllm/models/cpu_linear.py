"""Small-batch linear layers through oneDNN with prepacked weights (CPU, float32).

On these AVX2 cores the default float32 ``F.linear`` (MKL sgemm) is slow for the
few-row products of decode steps: a 576 x 3072 weight times 1 to 64 rows ran
1.2 to 2.9x faster through oneDNN's inner product with the weight reordered
once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the
same prepacking PyTorch's inductor uses), while for prefill-sized inputs (a
few hundred rows) MKL is as fast or faster. So each layer keeps its ordinary
weight and a packed copy, and picks by the number of rows. The packed copy costs
the weights' size again in memory. ``PAGEDLLM_CPU_PREPACK=0`` turns it off.

Results differ from ``F.linear`` by float rounding only (a different
summation order), like any change of BLAS kernel.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)

MAX_ROWS = 64  # inputs with more rows than this use F.linear (MKL)


def prepack_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when oneDNN prepacking applies: CPU, float32, oneDNN built in, not disabled by the environment."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and os.environ.get("PAGEDLLM_CPU_PREPACK", "1") == "1")


class PackedLinear(nn.Module):
    """``y = x W^T + b`` that runs inputs of at most ``MAX_ROWS`` rows through oneDNN.

    A single row goes to ``pagedllm.kernels.cpu.gemv`` when the C kernels are built.

    Args:
        weight: ``[out, in]`` float32 (kept, and used for larger inputs).
        bias: ``[out]`` float32 or ``None``.
    Shapes: ``x`` ``[rows, in]`` -> ``[rows, out]``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), MAX_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, in]`` -> ``[rows, out]``."""
        if x.dim() == 2 and x.shape[0] == 1 and cpu_kernels.usable(x) and x.is_contiguous():
            return cpu_kernels.gemv(x, self.weight, self.bias)  # batch-1 decode: our streaming kernel
        if x.dim() == 2 and x.shape[0] <= MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``model`` with a ``PackedLinear`` (in place).

    Returns:
        How many layers were replaced.
    """
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child.weight, child.bias))
                count += 1
    return count

"""Linear layers through oneDNN with prepacked weights (CPU, float32).

On this machine (2 AMD EPYC cores with AVX-512) the default float32 ``F.linear``
(MKL sgemm) is slow: oneDNN's inner product with the weight reordered once into
its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the same
prepacking PyTorch's inductor uses) was 1.2 to 2.9x faster for the 1 to 64 rows
of decode steps, and 1.3 to 1.8x faster for prefill-sized inputs (128 to 1024
rows of SmolLM2's shapes: 180-196 GFLOP/s against MKL's 102-148). So every
2-D input goes through the packed weight, except a single row, which goes to
our own streaming matrix-vector kernel (``pagedllm.kernels.cpu.gemv``) when the
C kernels are built. The packed copy costs the weights' size again in memory.
``PAGEDLLM_CPU_PREPACK=0`` turns packing off.

Results differ from ``F.linear`` by float rounding only (a different
summation order), like any change of BLAS kernel.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

import pagedllm.envs as envs
from pagedllm.kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)

PACK_BATCH_HINT = 64  # the row count oneDNN picks its packed layout for; any row count may use it


EXACT_ROWS = 128  # up to here every row count gets its own oneDNN primitive (decode batches: no padding)


def row_bucket(rows: int) -> int:
    """The row count a oneDNN product of ``rows`` input rows runs at: ``rows`` up to ``EXACT_ROWS``,
    above it rounded up to one of 8 buckets per power of two (at most 1/8 of the rows padded).

    Why: oneDNN builds and caches one primitive (JIT code and buffers) per input shape, up to 1,024
    of them; prefill steps of every length from 129 rows up filled that cache, and the engine core
    grew by ~17 MiB per round of normal traffic on the AVX2 build (issue 35's soak: 1.16x after a
    burst). With buckets the shapes a server sees are few and all met during warm-up."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, k]`` with zero rows appended up to ``row_bucket(rows)`` (``x`` itself when none)."""
    rows = x.shape[0]
    extra = row_bucket(rows) - rows
    return x if extra == 0 else torch.cat([x, x.new_zeros(extra, x.shape[1])])


def prepack_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when oneDNN prepacking applies: CPU, float32, oneDNN built in, not disabled by the environment."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and envs.PAGEDLLM_CPU_PREPACK)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` that runs 2-D inputs through oneDNN's prepacked weight.

    A single row goes to ``pagedllm.kernels.cpu.gemv`` when the C kernels are built (decided
    here, at construction: packing, like the kernels, applies to float32 CPU weights only).

    Args:
        weight: ``[out, in]`` float32 (kept: the batch-1 kernel and other shapes use it).
        bias: ``[out]`` float32 or ``None``.
    Shapes: ``x`` ``[..., in]`` -> ``[..., out]``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        self.gemv = cpu_kernels.applies(weight.device, weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in]`` -> ``[..., out]`` (leading dimensions are flattened into rows)."""
        if x.dim() != 2:
            if x.numel() == 0:
                return F.linear(x, self.weight, self.bias)
            return self.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        if x.shape[0] == 1 and self.gemv and x.is_contiguous():
            return cpu_kernels.gemv(x, self.weight, self.bias)  # batch-1 decode: our streaming kernel
        if x.shape[0] == 0:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        return torch.ops.mkldnn._linear_pointwise(pad_rows(x), self.packed, self.bias, "none", [], "")[:rows]


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

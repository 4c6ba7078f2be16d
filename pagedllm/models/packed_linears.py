"""Packed linears for the GGUF formats the tile layouts of ``GGUFLinear`` do not hold as they are
(issue 39): Q2_K's per-16 mins (``MinsLinear``) and F16 / BF16 weights kept 16-bit (``HalfLinear``);
``packed_linear`` picks the module for a ``gguf_blocks.repack`` result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.models.cpu_linear import pad_rows
from pagedllm.models.quant_linear import CHUNK, GGUFLinear, scratch_buffer, transient_matmul


class MinsLinear(nn.Module):
    """A packed weight with one scale and one min per 16 weights (GGUF Q2_K, ``gguf_blocks``'s
    ``S8HM``): ``y = x (Q D)^T + S(x) (MQ MD)^T (+ b)``, two ``S8H`` products: the quants times their
    scales, and the 16-weight group sums ``S(x)`` of the input times the mins matrix. Exact: the
    kernels' layouts hold one min per 32 weights, Q2_K's mins change every 16.

    Args:
        packed: ``{"qs", "d", "mq", "md"}`` (``gguf_blocks.repack``); n, k: output and input features;
        bias: ``[n]`` float32 or ``None``; kind: the GGUF format.
    Shapes: ``x`` ``[..., k]`` float32 -> ``[..., n]`` float32.
    """

    weight = None

    def __init__(self, packed: dict[str, torch.Tensor], n: int, k: int, bias: torch.Tensor | None = None,
                 kind: str = "Q2_K") -> None:
        super().__init__()
        self.kind, self.layout = kind, "S8HM"
        self.out_features, self.in_features, self.groups = n, k, k // 16
        self.quants = GGUFLinear("S8H", {"qs": packed["qs"], "d": packed["d"]}, n, k, bias, kind)
        self.mins = GGUFLinear("S8H", {"qs": packed["mq"], "d": packed["md"]}, n, packed["mq"].shape[1], None, kind)

    @property
    def bias(self) -> torch.Tensor | None:
        """``[n]`` float32 or ``None`` (held by the quants' product)."""
        return self.quants.bias

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight (both products)."""
        return self.quants.nbytes + self.mins.nbytes

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the float32 weight, ``[R, k]``."""
        mins = self.mins.rows(ids)[:, :self.groups]
        return self.quants.rows(ids) + mins.repeat_interleave(16, dim=1)

    def dequantize(self) -> torch.Tensor:
        """The ``[n, k]`` float32 weight."""
        return self.rows(torch.arange(self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` -> ``[..., n]``."""
        sums = x.reshape(*x.shape[:-1], self.groups, 16).sum(-1)
        sums = F.pad(sums, (0, self.mins.in_features - self.groups))
        return self.quants(x).add_(self.mins(sums))


class HalfLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` kept in the GGUF's 16-bit floats (F16 or BF16), half the bytes of
    float32, every weight exact. Up to 16 rows: the C kernel converts each weight row once into
    float32 and multiplies all the rows by it (``kernels.cpu.gemm16``); prefill-sized inputs: row
    chunks converted into a reused float32 buffer and multiplied by oneDNN, as ``GGUFLinear`` does.

    Args:
        weight: ``[n, k]`` ``torch.float16`` or ``torch.bfloat16``, contiguous.
        bias: ``[n]`` float32 or ``None``; kind: ``"F16"`` or ``"BF16"``.
    Shapes: ``x`` ``[..., k]`` float32 -> ``[..., n]`` float32.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kind: str = "F16") -> None:
        super().__init__()
        self.half, self.bias, self.kind, self.layout = weight.contiguous(), bias, kind, kind
        self.out_features, self.in_features = weight.shape

    weight = None  # no float32 weight (the decode stack keeps these layers' own path)

    @property
    def nbytes(self) -> int:
        """Bytes of the 16-bit weight."""
        return self.half.numel() * 2

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the float32 weight, ``[R, k]``."""
        return self.half.index_select(0, ids).float()

    def dequantize(self) -> torch.Tensor:
        """The ``[n, k]`` float32 weight."""
        return self.half.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` -> ``[..., n]``."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if x.shape[0] <= cpu_kernels.QGEMM_MAX_ROWS:
            y = cpu_kernels.gemm16(x.contiguous(), self.half, self.bias)
        else:
            y = self._prefill(pad_rows(x))[:x.shape[0]]
        return y.view(*shape[:-1], self.out_features)

    def _prefill(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, k]`` -> ``[rows, n]``: weight row chunks converted to float32, oneDNN products."""
        n, k = self.out_features, self.in_features
        step = max(16, CHUNK // k)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            w = scratch_buffer((n1 - n0) * k).view(n1 - n0, k).copy_(self.half[n0:n1])
            y[:, n0:n1] = transient_matmul(x, w, None if self.bias is None else self.bias[n0:n1])
        return y


def packed_linear(layout: str, packed: dict[str, torch.Tensor], n: int, k: int, bias: torch.Tensor | None = None,
                  kind: str | None = None) -> nn.Module:
    """The packed linear module of a ``gguf_blocks.repack`` result (same arguments as ``GGUFLinear``):
    ``MinsLinear`` for ``S8HM`` (Q2_K), ``HalfLinear`` for ``F16`` / ``BF16``, else ``GGUFLinear``."""
    if layout == "S8HM":
        return MinsLinear(packed, n, k, bias, kind or "Q2_K")
    if layout in ("F16", "BF16"):
        return HalfLinear(packed["w"], bias, layout)
    return GGUFLinear(layout, packed, n, k, bias, kind)

"""Linear layers that keep quantized weights packed in memory: a GGUF file's blocks
(``gguf_blocks.GGUF_LAYOUT``: Q4_0 ... Q6_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4; Q2_K and F16 / BF16 in
``packed_linears``) or int8 per output channel.

A GGUF-born model (its converted directory records the source file in ``gguf_source.json``)
served with ``quantization`` ``auto`` or ``gguf`` replaces each linear layer whose GGUF tensors
decode into one kernel layout (``gguf_blocks``) with a ``GGUFLinear``; ``int8`` quantizes any
float model's linear layers per output channel into the same layout as Q8_0. The blocks are
repacked once at load (rows in the order our fused layers use, then into tiles of 16 rows:
``gguf_blocks.to_tiles``) and multiplied by the C kernels (``kernels.cpu.qgemm``,
``quant_kernels.c``). Two ways, chosen per process (``kernels.cpu.int8_activations``):

* int8 activations (default where the kernels' build is AVX2 or above: AVX-512 VNNI, AVX-VNNI or
  AVX2's vpmaddubsw): every product of up to ``int8_max_rows()`` rows (all of them on AVX-512
  VNNI; 128 on AVX2 and AVX-VNNI, 256 where AMX is usable: longer prefill chunks are faster as
  below there) quantizes its
  input rows to int8 per 32-block in two levels (value and rounding residual) and multiplies the
  packed bytes with byte dot products; such a row's result does not depend on its batch; logprobs
  within about 0.001 of float32. On AVX2 and AVX-VNNI, products of ``ONE_LEVEL_ROWS`` (64) rows
  or more (prefill chunks, big batches; every length: 2x the two-level kernels there, 2.3x the
  dequantized product at 512 rows) keep one level only (``kernels.cpu.one_level``: llama.cpp's
  activation precision; SmolLM2's perplexity 26.72 against 26.56);
* float32 activations (``PAGEDLLM_INT8_ACTIVATIONS=0``, and the ``generic`` build): up to
  ``QGEMM_MAX_ROWS`` input rows multiply the packed tiles widened to float32 in registers, more rows
  multiply a float32 dequantization of the weight (the copy lives only during the call); outputs
  equal gguf's dequantization followed by a float32 matmul up to rounding.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.kernels.cpu_features import prefill_dtype
from pagedllm.models.cpu_linear import pad_rows
from pagedllm.models.gguf_blocks import TILE, to_tiles

logger = logging.getLogger(__name__)

SOURCE_FILE = "gguf_source.json"  # written into a converted directory: the GGUF it came from


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted directory came from, when it still exists (else ``None``)."""
    p = Path(model_dir) / SOURCE_FILE
    try:
        src = Path(json.loads(p.read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return src if src.is_file() else None


class GGUFLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` kept as packed GGUF blocks.

    Args:
        layout: a ``gguf_blocks`` layout name (``U4M``, ``S8``, ``U4``, ``S8H``, ``S8M``).
        packed: ``repack``'s arrays (rows already in this layer's order).
        n, k: output and input features.
        bias: ``[n]`` float32 or ``None``.
        kind: what the weights came from (``Q4_K``, ``Q5_0+Q8_0``, ``int8``), for logs and ``/stats``.
    Shapes: ``x`` ``[..., k]`` float32 -> ``[..., n]`` float32.
    """

    def __init__(self, layout: str, packed: dict[str, torch.Tensor], n: int, k: int,
                 bias: torch.Tensor | None = None, kind: str | None = None) -> None:
        super().__init__()
        self.layout, self.kind = layout, kind or layout
        tile_layout, tiles = to_tiles(layout, packed, n, k, six_bit=cpu_kernels.six_bit_tiles())
        self.fmt = cpu_kernels.QUANT_LAYOUTS[tile_layout]
        self.qs, self.d, self.m = tiles["qs"], tiles["d"], tiles.get("m")
        self.out_features, self.in_features = n, k
        self.bias = bias
        self.prefill_dtype = prefill_dtype()  # bfloat16 where AMX is usable

    weight = None  # no float32 weight: the batch-1 decode stack reads the packed arrays (decode_stack.matmul_entry)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``[n, k]`` float32 weight (into ``out`` when given)."""
        return cpu_kernels.qdequant(self.fmt, self.qs, self.d, self.m, self.out_features, self.in_features, out)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (``[R]`` int64) of the float32 weight, ``[R, k]``, dequantizing only them."""
        return cpu_kernels.qdequant_rows(self.fmt, self.qs, self.d, self.m, ids, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` -> ``[..., n]`` (leading dimensions flattened into rows)."""
        shape = x.shape
        if len(shape) != 2:  # the Transformers backend's [1, T, k]; no second call (per-token Python)
            x = x.reshape(-1, shape[-1])
        rows = x.shape[0]
        if (rows <= cpu_kernels.QGEMM_MAX_ROWS or cpu_kernels.one_level(rows)
                or (cpu_kernels.int8_activations() and rows <= cpu_kernels.int8_max_rows())):
            y = cpu_kernels.qgemm(self.fmt, x.contiguous(), self.qs, self.d, self.m, self.bias, self.out_features)
        else:
            # prefill: dequantize row chunks of at most _CHUNK floats into a reused buffer, multiply each;
            # the rows padded to a few bucket sizes (cpu_linear.row_bucket: oneDNN caches a primitive per shape)
            padded = pad_rows(x)
            y = self._forward_dequantized(padded)
            y = y if padded is x else y[:rows]
        return y if len(shape) == 2 else y.view(*shape[:-1], self.out_features)

    def _forward_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, k]`` -> ``[rows, n]`` through the dequantized weight (prefill-sized inputs)."""
        if self.prefill_dtype != torch.float32:
            return self._forward_low_precision(x)
        n, k = self.out_features, self.in_features
        step = max(TILE, CHUNK // k // TILE * TILE)
        if step >= n:
            return transient_matmul(x, self.dequantize(scratch_buffer(n * k).view(n, k)), self.bias)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            bias = None if self.bias is None else self.bias[n0:n1]
            y[:, n0:n1] = transient_matmul(x, self._dequantize_rows(n0, n1), bias)
        return y

    def _dequantize_rows(self, n0: int, n1: int) -> torch.Tensor:
        """Rows ``n0:n1`` (``n0`` a multiple of ``TILE``) of the float32 weight, in the calling thread's
        reused buffer."""
        k, t = self.in_features, n0 // TILE
        return cpu_kernels.qdequant(self.fmt, self.qs[t:], self.d[t:], None if self.m is None else self.m[t:],
                                    n1 - n0, k, scratch_buffer((n1 - n0) * k).view(n1 - n0, k))

    def _forward_low_precision(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill in ``prefill_dtype`` (bfloat16 through oneDNN's AMX kernels): weight row chunks
        dequantized, converted, multiplied with the converted input; float32 out."""
        n, k = self.out_features, self.in_features
        xl = x.to(self.prefill_dtype)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        step = max(TILE, CHUNK // k // TILE * TILE)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            y[:, n0:n1] = F.linear(xl, self._dequantize_rows(n0, n1).to(self.prefill_dtype)).float()
        return y if self.bias is None else y.add_(self.bias)


def transient_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x w^T + b`` for a weight that exists only for this call: oneDNN's inner product on the plain
    layout (1.3-1.5x MKL's sgemm behind ``F.linear`` for 32-512 rows of SmolLM2's shapes, within 15%
    of a prepacked weight), ``F.linear`` where oneDNN is not built in."""
    if _ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return F.linear(x, w, bias)


_ONEDNN = torch.backends.mkldnn.is_available()
CHUNK = 1 << 22  # floats (16 MiB) of dequantized weight at a time


_local = threading.local()


def scratch_buffer(numel: int) -> torch.Tensor:
    """A float32 buffer of ``numel`` for a dequantized weight, reused by every layer the calling thread
    runs (a fresh multi-MB tensor per call page-faults its memory in again: ten times the dequant time)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _local.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


class PackedEmbedding(nn.Module):
    """A token embedding table kept as packed blocks (the GGUF's ``token_embd``): a lookup gathers the
    rows' blocks and dequantizes only them.

    Args:
        table: a ``GGUFLinear`` over the ``[vocab, hidden]`` table (the tied LM head shares it).
    Shapes: ``ids`` ``[T]`` int64 -> ``[T, hidden]`` float32, equal to the dequantized table's rows.
    """

    def __init__(self, table: GGUFLinear) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` -> ``[T, hidden]``."""
        return self.table.rows(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)


def quantized_kernels() -> str:
    """What multiplies packed weights on this CPU, for ``/stats`` and the start-up log: the activation
    path and the kernels' instruction-set build (``kernels.cpu.isa``, chosen at run time)."""
    isa = cpu_kernels.isa()
    if cpu_kernels.int8_activations():
        rows, most = cpu_kernels.int8_max_rows(), "float32" if prefill_dtype() == torch.float32 else "bfloat16 (AMX)"
        span = "every row" if rows >= 1 << 31 else f"1-{rows} rows"
        rest = "" if rows >= 1 << 31 else f"; more: dequantized chunks, oneDNN {most}"
        if cpu_kernels.one_level(1 << 20):
            span, rest = "every row", f"; one level from {cpu_kernels.ONE_LEVEL_ROWS} rows"
        return f"{span}: int8 activations x packed tiles ({isa}: {cpu_kernels.ISA_DOT[isa]}){rest}"
    big = "bfloat16 (AMX)" if prefill_dtype() == torch.bfloat16 else "float32"
    return f"1-16 rows: float32 activations x packed tiles ({isa} build); prefill: dequantized chunks, oneDNN {big}"

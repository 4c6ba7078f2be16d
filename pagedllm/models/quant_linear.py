"""Linear layers that keep quantized weights packed in memory: a GGUF file's blocks
(``gguf_blocks.GGUF_LAYOUT``: Q4_0 ... Q6_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4) or int8 per output channel.

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
  within about 0.001 of float32;
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

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.kernels.cpu_features import prefill_dtype
from pagedllm.models.cpu_linear import pad_rows
from pagedllm.models.gguf_blocks import GGUF_LAYOUT, TILE, quantize_int8, repack, to_tiles, unpermute_rows

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
        tile_layout, tiles = to_tiles(layout, packed, n, k)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` -> ``[..., n]`` (leading dimensions flattened into rows)."""
        shape = x.shape
        if len(shape) != 2:  # the Transformers backend's [1, T, k]; no second call (per-token Python)
            x = x.reshape(-1, shape[-1])
        rows = x.shape[0]
        if rows <= cpu_kernels.QGEMM_MAX_ROWS or (cpu_kernels.int8_activations() and rows <= cpu_kernels.int8_max_rows()):
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
        step = max(TILE, _CHUNK // k // TILE * TILE)
        if step >= n:
            return _matmul(x, self.dequantize(_scratch(n * k).view(n, k)), self.bias)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            y[:, n0:n1] = _matmul(x, self._dequantize_rows(n0, n1), None if self.bias is None else self.bias[n0:n1])
        return y

    def _dequantize_rows(self, n0: int, n1: int) -> torch.Tensor:
        """Rows ``n0:n1`` (``n0`` a multiple of ``TILE``) of the float32 weight, in the calling thread's
        reused buffer."""
        k, t = self.in_features, n0 // TILE
        return cpu_kernels.qdequant(self.fmt, self.qs[t:], self.d[t:], None if self.m is None else self.m[t:],
                                    n1 - n0, k, _scratch((n1 - n0) * k).view(n1 - n0, k))

    def _forward_low_precision(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill in ``prefill_dtype`` (bfloat16 through oneDNN's AMX kernels): weight row chunks
        dequantized, converted, multiplied with the converted input; float32 out."""
        n, k = self.out_features, self.in_features
        xl = x.to(self.prefill_dtype)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        step = max(TILE, _CHUNK // k // TILE * TILE)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            y[:, n0:n1] = F.linear(xl, self._dequantize_rows(n0, n1).to(self.prefill_dtype)).float()
        return y if self.bias is None else y.add_(self.bias)


def _matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x w^T + b`` for a weight that exists only for this call: oneDNN's inner product on the plain
    layout (1.3-1.5x MKL's sgemm behind ``F.linear`` for 32-512 rows of SmolLM2's shapes, within 15%
    of a prepacked weight), ``F.linear`` where oneDNN is not built in."""
    if _ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return F.linear(x, w, bias)


_ONEDNN = torch.backends.mkldnn.is_available()
_CHUNK = 1 << 22  # floats (16 MiB) of dequantized weight at a time


_local = threading.local()


def _scratch(numel: int) -> torch.Tensor:
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
        t = self.table
        out = cpu_kernels.qdequant_rows(t.fmt, t.qs, t.d, t.m, ids.reshape(-1), self.embedding_dim)
        return out.view(*ids.shape, self.embedding_dim)


def quantized_kernels() -> str:
    """What multiplies packed weights on this CPU, for ``/stats`` and the start-up log: the activation
    path and the kernels' instruction-set build (``kernels.cpu.isa``, chosen at run time)."""
    isa = cpu_kernels.isa()
    if cpu_kernels.int8_activations():
        rows, most = cpu_kernels.int8_max_rows(), "float32" if prefill_dtype() == torch.float32 else "bfloat16 (AMX)"
        span = "every row" if rows >= 1 << 31 else f"1-{rows} rows"
        rest = "" if rows >= 1 << 31 else f"; more: dequantized chunks, oneDNN {most}"
        return f"{span}: int8 activations x packed tiles ({isa}: {cpu_kernels.ISA_DOT[isa]}){rest}"
    big = "bfloat16 (AMX)" if prefill_dtype() == torch.bfloat16 else "float32"
    return f"1-16 rows: float32 activations x packed tiles ({isa} build); prefill: dequantized chunks, oneDNN {big}"


def _cat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.cat([p[key] for p in parts], 0) for key in parts[0]}


def _count(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def _fused_layers(model, config):
    """``(owner, attribute, [(GGUF tensor name, heads to un-permute or None), ...])`` for every linear
    layer of the native Llama/Qwen2 model, in the order of its fused rows."""
    h, kvh = config.num_attention_heads, config.num_key_value_heads
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        yield layer.self_attn, "qkv_proj", [(b + "attn_q.weight", h), (b + "attn_k.weight", kvh),
                                            (b + "attn_v.weight", None)]
        yield layer.self_attn, "o_proj", [(b + "attn_output.weight", None)]
        yield layer.mlp, "gate_up_proj", [(b + "ffn_gate.weight", None), (b + "ffn_up.weight", None)]
        yield layer.mlp, "down_proj", [(b + "ffn_down.weight", None)]


def quantize_from_gguf(model, gguf_path: Path, config) -> dict[str, int]:
    """Replace the native Llama/Qwen2 model's linear layers (and tied LM head) by ``GGUFLinear``
    where their GGUF tensors decode into one kernel layout.

    Args:
        model: ``models.llama.LlamaForCausalLM`` with float32 weights loaded.
        gguf_path: the GGUF file the model was converted from.
        config: its Hugging Face config (head counts, for the q/k row order).
    Returns:
        ``{GGUF formats: layers}`` of the replaced layers (``"Q5_0+Q8_0"`` for a fused layer of two;
        ``float32`` counts the ones kept).
    """
    from pagedllm.models.gguf_index import read_tensor_index
    arch, tensors = read_tensor_index(gguf_path)  # no metadata parse (gguf's reader: seconds, ~450 MB)
    counts: dict[str, int] = {}

    def rows_of(t) -> tuple[int, int]:
        k, n = (int(s) for s in t.shape[:2])  # GGUF lists dims innermost first
        return n, k

    def packed(name: str, unpermute_heads: int | None = None):
        t = tensors[name]
        kind = t.tensor_type.name
        if kind not in GGUF_LAYOUT:
            return kind, None, None
        n, k = rows_of(t)
        layout, p = repack(kind, t.data, n, k)
        if unpermute_heads is not None and arch == "llama":  # llama.cpp permutes q/k rows for its rotary
            order = torch.from_numpy(unpermute_rows(np.arange(n)[:, None], unpermute_heads)[:, 0].copy())
            p = {key: v.index_select(0, order) for key, v in p.items()}
        return kind, layout, p

    for owner, attr, names in _fused_layers(model, config):
        old = getattr(owner, attr)
        parts = [packed(nm, heads) for nm, heads in names]
        layouts = {layout for _, layout, _ in parts}
        if len(layouts) != 1 or None in layouts:  # a float tensor, or layouts that do not concatenate
            _count(counts, "float32")
            continue
        kind = "+".join(sorted({kind for kind, _, _ in parts}))
        bias = getattr(old, "bias", None)
        setattr(owner, attr, GGUFLinear(layouts.pop(), _cat([p for _, _, p in parts]), old.weight.shape[0],
                                        old.weight.shape[1], None if bias is None else bias.detach(), kind))
        _count(counts, kind)
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    kind, layout, p = packed(head)
    if p is not None:
        n, k = rows_of(tensors[head])
        model.packed_head = GGUFLinear(layout, p, n, k, kind=kind)
        model.lm_head = None  # its float32 copy: the packed head serves every logit
        _count(counts, kind)
    # the embedding table: shared with a tied head, else packed on its own (float32 when its format is not)
    table = model.packed_head if head == "token_embd.weight" else None
    if table is None:
        kind, layout, p = packed("token_embd.weight")
        if p is not None:
            n, k = rows_of(tensors["token_embd.weight"])
            table = GGUFLinear(layout, p, n, k, kind=kind)
    if table is not None:
        model.embed_tokens = PackedEmbedding(table)
    return counts


def quantize_int8_layers(model, config) -> dict[str, int]:
    """``--quantization int8``: every linear layer of the native model (and the LM head) whose input
    features divide by 32 becomes an int8 ``GGUFLinear`` (per-output-channel symmetric scales).

    Returns:
        ``{"int8": layers, "float32": layers kept}``.
    """
    counts: dict[str, int] = {}
    for owner, attr, _ in _fused_layers(model, config):
        old = getattr(owner, attr)
        n, k = old.weight.shape
        if k % 32:
            _count(counts, "float32")
            continue
        bias = getattr(old, "bias", None)
        setattr(owner, attr, GGUFLinear("S8", quantize_int8(old.weight), n, k,
                                        None if bias is None else bias.detach(), "int8"))
        _count(counts, "int8")
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if head.shape[1] % 32 == 0:
        model.packed_head = GGUFLinear("S8", quantize_int8(head), head.shape[0], head.shape[1], kind="int8")
        _count(counts, "int8")
    return counts

"""Linear layers that keep a GGUF file's quantized blocks (Q4_0, Q4_1, Q8_0) packed in memory.

A GGUF-born model (its converted directory records the source file in ``gguf_source.json``)
served with ``quantization`` ``auto`` or ``gguf`` replaces each linear layer whose GGUF tensors
share one of these formats with a ``GGUFLinear``: the blocks are repacked once at load (quants,
scales and mins apart, rows in the order our fused layers use) and multiplied by the C kernels
(``kernels.cpu.qgemm``): up to ``QGEMM_MAX_ROWS`` input rows read the packed bytes directly
(decode reads about a quarter of the float32 bytes for Q4_1), more rows multiply a float32
dequantization of the weight (prefill is compute-bound; the float32 copy lives only during the
call). Activations stay float32, so outputs equal gguf's dequantization followed by a float32
matmul up to rounding. Other formats (the K-quants) keep the float32 path for now.

Block layouts follow ``gguf.quants`` (llama.cpp's ``ggml-common.h``): Q4_0 is an fp16 scale and
16 bytes of nibbles per 32 weights, ``w = (q - 8) d``; Q4_1 adds an fp16 min, ``w = q d + m``;
Q8_0 is an fp16 scale and 32 int8, ``w = q d``. In each nibble byte ``j`` the low half is weight
``j`` and the high half weight ``j + 16``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)

SOURCE_FILE = "gguf_source.json"  # written into a converted directory: the GGUF it came from
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted directory came from, when it still exists (else ``None``)."""
    p = Path(model_dir) / SOURCE_FILE
    try:
        src = Path(json.loads(p.read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return src if src.is_file() else None


def repack(kind: str, raw: np.ndarray, n: int, k: int) -> dict[str, torch.Tensor]:
    """Split GGUF blocks into the kernels' arrays.

    Args:
        kind: ``Q4_0``, ``Q4_1`` or ``Q8_0``.
        raw: the tensor's bytes, ``n * k / 32`` blocks (uint8, any shape).
        n, k: rows (output features) and columns (input features, a multiple of 32).
    Returns:
        ``{"qs": [n, k/2] uint8 or [n, k] int8, "d": [n, k/32] float32, "m": [n, k/32] float32 (Q4_1)}``.
    Raises:
        ValueError: a size that does not match the format.
    """
    nb = k // 32
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if k % 32 or blocks.size != n * nb * _BLOCK_BYTES[kind]:
        raise ValueError(f"{kind} tensor of {blocks.size} bytes is not [{n}, {k}]")
    blocks = blocks.reshape(n, nb, _BLOCK_BYTES[kind])
    out = {"d": torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16).astype(np.float32).reshape(n, nb))}
    if kind == "Q4_1":
        out["m"] = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, nb))
        out["qs"] = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 4:]).reshape(n, nb * 16))
    elif kind == "Q4_0":
        out["qs"] = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).reshape(n, nb * 16))
    else:
        out["qs"] = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, nb * 32))
    return out


class GGUFLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` kept as packed GGUF blocks.

    Args:
        kind: ``Q4_0``, ``Q4_1`` or ``Q8_0``.
        packed: ``repack``'s arrays (rows already in this layer's order).
        n, k: output and input features.
        bias: ``[n]`` float32 or ``None``.
    Shapes: ``x`` ``[..., k]`` float32 -> ``[..., n]`` float32.
    """

    def __init__(self, kind: str, packed: dict[str, torch.Tensor], n: int, k: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.kind, self.fmt = kind, cpu_kernels.QUANT_FORMATS[kind]
        self.qs, self.d, self.m = packed["qs"], packed["d"], packed.get("m")
        self.out_features, self.in_features = n, k
        self.bias = bias

    weight = None  # no float32 weight: the batch-1 decode stack reads ``stack_descriptor`` instead

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The ``[n, k]`` float32 weight."""
        return cpu_kernels.qdequant(self.fmt, self.qs, self.d, self.m, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` -> ``[..., n]`` (leading dimensions flattened into rows)."""
        if x.dim() != 2:
            return self.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        if x.shape[0] <= cpu_kernels.QGEMM_MAX_ROWS:
            return cpu_kernels.qgemm(self.fmt, x.contiguous(), self.qs, self.d, self.m, self.bias, self.out_features)
        return F.linear(x, self.dequantize(), self.bias)


def stack_descriptor(modules) -> torch.Tensor | None:
    """The ``quant`` column of ``kernels.cpu.stack_table`` for one layer's qkv, o, gate_up and down
    modules: ``None`` when none is a ``GGUFLinear``, else int64 ``[16]`` of ``{fmt, qs, d, m}``."""
    if not any(isinstance(m, GGUFLinear) for m in modules):
        return None
    out = []
    for m in modules:
        if isinstance(m, GGUFLinear):
            out += [m.fmt, m.qs.data_ptr(), m.d.data_ptr(), 0 if m.m is None else m.m.data_ptr()]
        else:
            out += [-1, 0, 0, 0]
    return torch.tensor(out, dtype=torch.int64)


def _cat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.cat([p[key] for p in parts], 0) for key in parts[0]}


def quantize_from_gguf(model, gguf_path: Path, config) -> dict[str, int]:
    """Replace the native Llama/Qwen2 model's linear layers (and tied LM head) by ``GGUFLinear``
    where their GGUF tensors are all in one supported format.

    Args:
        model: ``models.llama.LlamaForCausalLM`` with float32 weights loaded.
        gguf_path: the GGUF file the model was converted from.
        config: its Hugging Face config (head counts, for the q/k row order).
    Returns:
        ``{format: layers}`` of the replaced layers (``float32`` counts the ones kept).
    """
    from gguf import GGUFReader

    from pagedllm.models.loader import _unpermute
    reader = GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    tensors = {t.name: t for t in reader.tensors}
    counts: dict[str, int] = {}

    def rows_of(t) -> tuple[int, int]:
        k, n = (int(s) for s in t.shape[:2])  # GGUF lists dims innermost first
        return n, k

    def packed(name: str, unpermute_heads: int | None = None):
        t = tensors[name]
        kind = t.tensor_type.name
        if kind not in _BLOCK_BYTES:
            return None, kind
        n, k = rows_of(t)
        p = repack(kind, t.data, n, k)
        if unpermute_heads is not None and arch == "llama":  # llama.cpp permutes q/k rows for its rotary
            order = torch.from_numpy(_unpermute(np.arange(n)[:, None], unpermute_heads)[:, 0].copy())
            p = {key: v.index_select(0, order) for key, v in p.items()}
        return p, kind

    def replace(owner, attr: str, names: list[tuple[str, int | None]]) -> None:
        old = getattr(owner, attr)
        parts = [packed(nm, heads) for nm, heads in names]
        kinds = {kind for _, kind in parts}
        if len(kinds) != 1 or parts[0][0] is None:
            counts["float32"] = counts.get("float32", 0) + 1
            return
        kind = kinds.pop()
        bias = getattr(old, "bias", None)
        new = GGUFLinear(kind, _cat([p for p, _ in parts]), old.weight.shape[0], old.weight.shape[1],
                         None if bias is None else bias.detach())
        setattr(owner, attr, new)
        counts[kind] = counts.get(kind, 0) + 1

    h, kvh = config.num_attention_heads, config.num_key_value_heads
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        replace(layer.self_attn, "qkv_proj", [(b + "attn_q.weight", h), (b + "attn_k.weight", kvh),
                                              (b + "attn_v.weight", None)])
        replace(layer.self_attn, "o_proj", [(b + "attn_output.weight", None)])
        replace(layer.mlp, "gate_up_proj", [(b + "ffn_gate.weight", None), (b + "ffn_up.weight", None)])
        replace(layer.mlp, "down_proj", [(b + "ffn_down.weight", None)])
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    p, kind = packed(head)
    if p is not None:
        n, k = rows_of(tensors[head])
        model.packed_head = GGUFLinear(kind, p, n, k)
        counts[kind] = counts.get(kind, 0) + 1
    return counts

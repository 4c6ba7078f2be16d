"""GGUF blocks (and ``--quantization int8``) for the native Llama/Qwen2 model: its fused linear
layers, LM head and embedding replaced by packed ones after load (``models/load.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pagedllm.models.gguf_blocks import GGUF_LAYOUT, quantize_int8, repack, unpermute_rows
from pagedllm.models.packed_linears import packed_linear
from pagedllm.models.quant_linear import GGUFLinear, PackedEmbedding


def _cat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Row layouts' arrays stacked part after part; the keys every part has (Q6_K's extra ``sc`` and
    ``dsup`` only where all parts are Q6_K: ``gguf_blocks.to_tiles``)."""
    return {key: torch.cat([p[key] for p in parts], 0) for key in parts[0] if all(key in p for p in parts)}


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
        setattr(owner, attr, packed_linear(layouts.pop(), _cat([p for _, _, p in parts]), old.weight.shape[0],
                                           old.weight.shape[1], None if bias is None else bias.detach(), kind))
        _count(counts, kind)
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    kind, layout, p = packed(head)
    if p is not None:
        n, k = rows_of(tensors[head])
        model.packed_head = packed_linear(layout, p, n, k, kind=kind)
        model.lm_head = None  # its float32 copy: the packed head serves every logit
        _count(counts, kind)
    # the embedding table: shared with a tied head, else packed on its own (float32 when its format is not)
    table = model.packed_head if head == "token_embd.weight" else None
    if table is None:
        kind, layout, p = packed("token_embd.weight")
        if p is not None:
            n, k = rows_of(tensors["token_embd.weight"])
            table = packed_linear(layout, p, n, k, kind=kind)
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

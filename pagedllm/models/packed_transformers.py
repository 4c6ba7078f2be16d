"""Packed weights for a ``transformers`` model: its linear layers, token embedding and LM head served
from a GGUF file's blocks (``quantization="gguf"``) or from int8 per output channel (``"int8"``), by
the same ``GGUFLinear`` and C kernels as the native models (``models/quant_linear.py``).

The model is built with its parameters on the meta device (``transformers_tp_load.parameters_on_meta``),
so no float32 copy of a packed layer ever exists: each ``nn.Linear`` is named in GGUF terms through
``gguf``'s own tensor-name tables (``gguf.get_tensor_name_map``: ``model.layers.3.self_attn.q_proj``
-> ``blk.3.attn_q``) and replaced by its tensor's blocks, repacked once; the parameters left (norms,
float tensors) are then read from the converted directory (``load_sharded``). Whatever
``transformers``' GGUF loader did to a tensor when it wrote that directory (llama.cpp permutes the q/k
rows of Llama-family files; other families reorder or rescale tensors), the packed layer must equal
the float32 tensor it stands for: sampled rows of both are compared (the float rows read lazily from
the safetensors), the rows un-permuted where that makes them equal, and a layer that still differs is
left to be loaded in float32 (counted as ``float32 (differs)``), so a family we have not seen is
served correctly, only less packed. ``int8`` reads each linear's float32 weight alone, quantizes it
and drops it.

The token embedding stays packed too (a lookup dequantizes only its rows; Gemma's scaled embedding
keeps its scale), and a tied LM head shares the embedding's blocks.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedllm.models.gguf_blocks import GGUF_LAYOUT, quantize_int8, repack, unpermute_rows
from pagedllm.models.packed_linears import packed_linear
from pagedllm.models.quant_linear import GGUFLinear, PackedEmbedding

logger = logging.getLogger(__name__)

SAMPLE_ROWS = 512   # rows of each weight compared against the float32 one it replaces
MATCH_RTOL = 1e-4   # max |packed - float| over max |float| of those rows (a misordered row is ~1)
DIFFERS = "float32 (differs)"


class ScaledPackedEmbedding(PackedEmbedding):
    """``PackedEmbedding`` times a constant (Gemma's ``embed_scale``: ``sqrt(hidden)``).

    Args:
        table: a ``GGUFLinear`` over the ``[vocab, hidden]`` table.
        scale: the float32 scalar tensor the original embedding multiplied by.
    Shapes: ``ids`` ``[...]`` int64 -> ``[..., hidden]`` float32.
    """

    def __init__(self, table: GGUFLinear, scale: torch.Tensor) -> None:
        super().__init__(table)
        self.register_buffer("embed_scale", scale.detach().float().clone(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``[...]`` -> ``[..., hidden]``: the dequantized rows times the scale."""
        return super().forward(ids) * self.embed_scale


class Checkpoint:
    """Lazy, by-name reads of a directory's ``*.safetensors`` tensors, and of the expert weights its
    conversion left in the GGUF file (``gguf_experts``) (a context manager).

    Args:
        model_dir: the converted (or Hugging Face) directory.
    """

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        from pagedllm.models.gguf_experts import GGUFExperts
        self._stack = ExitStack()
        self._where = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            fh = self._stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            self._where.update((k, fh) for k in fh.keys())
        experts = GGUFExperts(model_dir)  # expert weights a conversion left in the GGUF file
        self._where.update((k, experts) for k in experts.entries)

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def whole(self, key: str) -> torch.Tensor:
        """The tensor ``key``, read whole into memory of its own (float32; safetensors' tensors are
        views of the file's mapping, which a kept bias would hold resident for the process's life)."""
        return self._where[key].get_tensor(key).to(torch.float32, copy=True)

    def sample(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row ids int64 [R], float32 rows [R, k])``: every row up to ``SAMPLE_ROWS``, else eight
        contiguous runs spread over the tensor (a lazy slice reads only those)."""
        sl = self._where[key].get_slice(key)
        n = sl.get_shape()[0]
        if n <= SAMPLE_ROWS:
            return torch.arange(n), sl[:].float()
        run = SAMPLE_ROWS // 8
        starts = np.linspace(0, n - run, 8).round().astype(np.int64)
        ids = torch.from_numpy(np.concatenate([np.arange(a, a + run) for a in starts]))
        return ids, torch.cat([sl[int(a):int(a) + run].float() for a in starts])

    def has_experts(self, qual: str) -> bool:
        """Whether the experts module ``qual``'s weights are here, fused (``gate_up_proj``) or per expert
        (``qual.0.gate_proj.weight``: how ``save_pretrained`` writes them)."""
        return f"{qual}.gate_up_proj" in self._where or f"{qual}.0.gate_proj.weight" in self._where

    def expert_sample(self, qual: str, name: str, expert: int,
                      interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row ids, float32 rows)`` of expert ``expert``'s ``name`` (``gate_up_proj``: gate rows then up
        rows, or ``down_proj``): up to ``SAMPLE_ROWS`` rows spread over it. ``interleaved``: the
        checkpoint holds gpt-oss's layout (``[H, 2I]`` gate/up alternating, ``[I, H]`` down), turned
        into ours first."""
        if f"{qual}.{name}" in self._where:
            sl = self._where[f"{qual}.{name}"].get_slice(f"{qual}.{name}")
            w = sl[expert:expert + 1][0]
            if interleaved:
                w = torch.cat([w[:, 0::2].t(), w[:, 1::2].t()]) if name == "gate_up_proj" else w.t()
        else:
            parts = ("gate_proj", "up_proj") if name == "gate_up_proj" else ("down_proj",)
            w = torch.cat([self._where[k].get_tensor(k) for k in (f"{qual}.{expert}.{p}.weight" for p in parts)])
        ids = torch.linspace(0, w.shape[0] - 1, min(w.shape[0], SAMPLE_ROWS)).round().long().unique()
        return ids, w.index_select(0, ids).float()


def _matches(lin: GGUFLinear, ids: torch.Tensor, want: torch.Tensor) -> bool:
    """Rows ``ids`` of ``lin`` equal ``want`` (float32 ``[R, k]``) within ``MATCH_RTOL``."""
    got = lin.rows(ids)
    return bool((got - want).abs().max() <= MATCH_RTOL * want.abs().max().clamp_min(1e-30))


def _packed_like(tensor, shape: tuple[int, int], sample: tuple[torch.Tensor, torch.Tensor],
                 bias: torch.Tensor | None, heads: tuple[int, ...]):
    """A ``GGUFLinear`` of the GGUF ``tensor`` (``gguf_index.GGUFTensor``) for a float weight of
    ``shape`` ``[n, k]`` whose sampled rows are ``sample`` (``Checkpoint.sample``), equal to them as
    it is or with its rows un-permuted for one of ``heads``; else ``None``."""
    kind = tensor.tensor_type.name
    n, k = shape
    if kind not in GGUF_LAYOUT or tuple(int(s) for s in tensor.shape[:2]) != (k, n):
        return None
    layout, packed = repack(kind, tensor.data, n, k)
    lin = packed_linear(layout, packed, n, k, bias, kind)
    if _matches(lin, *sample):
        return lin
    for h in heads:
        if h and n % (2 * h) == 0:
            order = torch.from_numpy(unpermute_rows(np.arange(n)[:, None], h)[:, 0].copy())
            lin = packed_linear(layout, {key: v.index_select(0, order) for key, v in packed.items()}, n, k, bias, kind)
            if _matches(lin, *sample):
                return lin
    return None


def _linears(hf: nn.Module, skip: nn.Module | None):
    """``(qualified name, owner, attribute, nn.Linear)`` of every plain linear layer but ``skip``."""
    for owner_name, owner in hf.named_modules():
        for attr, child in owner.named_children():
            if type(child) is nn.Linear and child is not skip:
                yield (f"{owner_name}.{attr}" if owner_name else attr), owner, attr, child


def _name_map(arch: str, n_blocks: int):
    """``gguf``'s table from Hugging Face module names to GGUF tensor names for ``arch``, or ``None``."""
    import gguf
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    return gguf.get_tensor_name_map(by_name[arch], n_blocks) if arch in by_name else None


def _count(counts: dict[str, int], nbytes: dict[str, int], kind: str, size: int) -> None:
    counts[kind] = counts.get(kind, 0) + 1
    nbytes[kind] = nbytes.get(kind, 0) + size


def _float_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _qualified(hf: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in hf.named_modules() if m is module)


def _bias(ckpt: Checkpoint, qual: str, lin: nn.Linear) -> torch.Tensor | None:
    return None if lin.bias is None else ckpt.whole(f"{qual}.bias")


def pack_from_gguf(hf: nn.Module, model_dir: str | Path, gguf_path: Path, text_config) -> tuple[dict, dict]:
    """Replace the linear layers, token embedding and LM head of ``hf`` (built with its parameters on
    the meta device) by the GGUF file's packed blocks wherever those equal the converted directory's
    float32 tensors (in place); the parameters left stay on meta for ``load_sharded``.

    Args:
        hf: a ``transformers`` causal LM of ``model_dir``'s config, parameters on meta.
        model_dir: the directory converted from ``gguf_path`` (its safetensors are read lazily).
        gguf_path: the GGUF file (``quant_linear.gguf_source``).
        text_config: its text config (head counts, for un-permuting q/k rows; layer count).
    Returns:
        ``({format: layers}, {format: bytes held})``; ``float32`` counts layers whose tensor is not
        a packed format (or not in the file), ``float32 (differs)`` those whose blocks do not equal
        the converted tensor.
    """
    from pagedllm.models.gguf_index import read_tensor_index
    arch, tensors = read_tensor_index(gguf_path)
    names = _name_map(arch, text_config.num_hidden_layers)
    heads = (text_config.num_attention_heads, getattr(text_config, "num_key_value_heads", 0) or 0)
    counts: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    emb, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    with Checkpoint(model_dir) as ckpt:
        for qual, owner, attr, lin in list(_linears(hf, head)):
            # an image-text model's language model under model.language_model (Gemma 3): gguf's map has model.*
            base = names.get_name(qual.replace("model.language_model.", "model.", 1)) if names is not None else None
            t = tensors.get(f"{base}.weight") if base else None
            new = None
            if t is not None and f"{qual}.weight" in ckpt:
                new = _packed_like(t, tuple(lin.weight.shape), ckpt.sample(f"{qual}.weight"),
                                   _bias(ckpt, qual, lin), heads)
            if new is None:
                kind = DIFFERS if t is not None and t.tensor_type.name in GGUF_LAYOUT else "float32"
                _count(counts, nbytes, kind, _float_bytes(lin))
                continue
            setattr(owner, attr, new)
            _count(counts, nbytes, new.kind, new.nbytes)
        for qual, mod in hf.named_modules():
            if getattr(mod, "is_concatenated", None) is not None:
                _pack_experts(qual, mod, ckpt, tensors, counts, nbytes)
        table = _pack_embedding(hf, ckpt, emb, tensors.get("token_embd.weight"), counts, nbytes)
        _pack_head(hf, ckpt, emb, head, table, tensors.get("output.weight"), counts, nbytes)
    return counts, nbytes


def _pack_experts(qual: str, mod: nn.Module, ckpt: Checkpoint, tensors, counts, nbytes) -> None:
    """Serve an experts module (``[E, 2I, H]`` / ``[E, H, I]``, ``moe.default_layout``; or gpt-oss's
    interleaved, biased one, ``moe.interleaved_layout``) from the GGUF's ``blk.N.ffn_{gate,up,down}_exps``
    blocks, one packed gate|up and down per expert (``moe.ExpertWeights``; biases from the converted
    checkpoint, de-interleaved), checked on the first and last experts against the converted tensors;
    its float parameters are dropped (never read). Otherwise it stays float32."""
    import re

    from pagedllm.models.moe import ExpertWeights, default_layout, expert_activation, interleaved_layout
    layer = re.search(r"layers\.(\d+)\.", qual + ".")
    gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    b = f"blk.{layer.group(1)}." if layer else ""
    gate, up, down = (tensors.get(f"{b}ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
    interleaved = interleaved_layout(mod)
    ok = (layer and (default_layout(mod) or interleaved) and isinstance(gu, torch.Tensor) and gu.dim() == 3
          and (interleaved or getattr(mod, "gate_up_proj_bias", None) is None) and None not in (gate, up, down)
          and gate.tensor_type == up.tensor_type and gate.tensor_type.name in GGUF_LAYOUT
          and down.tensor_type.name in GGUF_LAYOUT and ckpt.has_experts(qual))
    weights = None
    if ok:
        e_count = gu.shape[0]
        i, h = (gu.shape[2] // 2, gu.shape[1]) if interleaved else (gu.shape[1] // 2, gu.shape[2])
        gb, db = _expert_biases(ckpt, qual) if interleaved else (None, None)
        g_per, d_per = gate.data.size // e_count, down.data.size // e_count
        gate_up, downs = [], []
        for e in range(e_count):
            (lg, pg), (_, pu) = (repack(gate.tensor_type.name, t.data[e * g_per:(e + 1) * g_per], i, h)
                                 for t in (gate, up))
            gate_up.append(packed_linear(lg, {k: torch.cat([pg[k], pu[k]]) for k in pg}, 2 * i, h,
                                         None if gb is None else gb[e]))
            ld, pd = repack(down.tensor_type.name, down.data[e * d_per:(e + 1) * d_per], h, i)
            downs.append(packed_linear(ld, pd, h, i, None if db is None else db[e]))
        if all(_matches(lins[e], *ckpt.expert_sample(qual, name, e, interleaved))
               for e in (0, e_count - 1) for lins, name in ((gate_up, "gate_up_proj"), (downs, "down_proj"))):
            kind = "+".join(sorted({gate.tensor_type.name, down.tensor_type.name}))
            weights = ExpertWeights(gate_up, downs, i, "swiglu_oai" if interleaved else expert_activation(mod), kind)
    if weights is None:
        _count(counts, nbytes, DIFFERS if ok else "float32", _float_bytes(mod))
        return
    mod.pagedllm_experts = weights
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        if name in mod._parameters:
            mod._parameters[name] = None  # served from the blocks only
    _count(counts, nbytes, f"experts {weights.kind}", weights.nbytes)


def _expert_biases(ckpt: Checkpoint, qual: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's expert biases from the converted checkpoint: ``[E, 2I]`` gate then up (de-interleaved)
    and ``[E, H]`` down, float32 copies of their own."""
    gb = ckpt.whole(f"{qual}.gate_up_proj_bias")
    return torch.cat([gb[:, 0::2], gb[:, 1::2]], 1).contiguous(), ckpt.whole(f"{qual}.down_proj_bias")


def _pack_embedding(hf, ckpt: Checkpoint, emb, tensor, counts, nbytes) -> GGUFLinear | None:
    """Serve ``emb`` (an ``nn.Embedding``, possibly scaled) from ``token_embd``'s blocks; the table, or
    ``None`` where it stays float32."""
    if not isinstance(emb, nn.Embedding) or tensor is None:
        return None
    key = f"{_qualified(hf, emb)}.weight"
    scale = getattr(emb, "embed_scale", None)
    plain = type(emb) is nn.Embedding
    table = None
    if key in ckpt and (plain or isinstance(scale, torch.Tensor)):
        table = _packed_like(tensor, tuple(emb.weight.shape), ckpt.sample(key), None, ())
    if table is None:
        _count(counts, nbytes, DIFFERS if key in ckpt else "float32", _float_bytes(emb))
        return None
    hf.set_input_embeddings(PackedEmbedding(table) if plain else ScaledPackedEmbedding(table, scale))
    _count(counts, nbytes, table.kind, table.nbytes)
    return table


def _pack_head(hf, ckpt: Checkpoint, emb, head, table, tensor, counts, nbytes) -> None:
    """Serve the LM head from ``output``'s blocks, or from the embedding's when the two are tied."""
    if type(head) is not nn.Linear:
        return
    qual = _qualified(hf, head)
    tied = isinstance(emb, nn.Embedding) and head.weight is emb.weight
    new = table if tied else None
    if not tied and tensor is not None and f"{qual}.weight" in ckpt:
        new = _packed_like(tensor, tuple(head.weight.shape), ckpt.sample(f"{qual}.weight"), _bias(ckpt, qual, head), ())
    if new is None:
        _count(counts, nbytes, "float32", _float_bytes(head))
        return
    hf.set_output_embeddings(new)
    if not tied:
        _count(counts, nbytes, new.kind, new.nbytes)


def pack_int8(hf: nn.Module, model_dir: str | Path) -> tuple[dict[str, int], dict[str, int]]:
    """``--quantization int8`` for a ``transformers`` model built with its parameters on meta: every
    plain linear layer (LM head included) whose input features divide by 32 becomes an int8
    ``GGUFLinear`` (symmetric per output channel, ``gguf_blocks.quantize_int8``), each float32 weight
    read alone from ``model_dir`` and dropped once quantized; in place.

    Returns:
        ``({"int8" | "float32": layers}, {same: bytes held})``.
    """
    counts: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    emb = hf.get_input_embeddings()
    emb_key = f"{_qualified(hf, emb)}.weight" if emb is not None else None
    with Checkpoint(model_dir) as ckpt:
        for qual, owner, attr, lin in list(_linears(hf, None)):
            n, k = lin.weight.shape
            key = f"{qual}.weight"
            if key not in ckpt and emb is not None and lin.weight is getattr(emb, "weight", None):
                key = emb_key  # a tied head: the checkpoint stores the table once
            if k % 32 or key not in ckpt:
                _count(counts, nbytes, "float32", _float_bytes(lin))
                continue
            new = GGUFLinear("S8", quantize_int8(ckpt.whole(key)), n, k, _bias(ckpt, qual, lin), "int8")
            setattr(owner, attr, new)
            _count(counts, nbytes, "int8", new.nbytes)
    return counts, nbytes


def describe(counts: dict[str, int], nbytes: dict[str, int]) -> str:
    """One log line's worth: ``Q5_0: 81 layers, 95.1 MiB; ...; 280.3 MiB of weights in these layers``."""
    parts = [f"{k}: {counts[k]} layer{'s' * (counts[k] != 1)}, {nbytes.get(k, 0) / 2**20:.1f} MiB"
             for k in sorted(counts)]
    return "; ".join(parts + [f"{sum(nbytes.values()) / 2**20:.1f} MiB of weights in these layers"])

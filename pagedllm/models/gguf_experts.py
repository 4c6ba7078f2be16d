"""Expert weights left in the GGUF file: a converted directory holds no float32 copy of them.

A mixture of experts is mostly its experts (Qwen3-30B-A3B: 29 of its 30.5B parameters), so writing
them dequantized next to the file (``loader``'s conversion) would take four to eight times the file
on disk and, while converting, in memory. The family tables (``gguf_moe``, ``gguf_gpt_oss``) instead
list, per fused expert parameter, the file's stacked tensors and how they combine (``MANIFEST`` in
the converted directory). Whoever reads a parameter of the converted model then finds the experts
here by the parameter's name, as lazy slices over the experts dimension that dequantize only the
experts asked for: ``transformers_tp_load.load_sharded`` (float32 serving, an expert-parallel
rank's range) and ``packed_transformers`` (which serves the blocks themselves and checks two
experts against these slices).

Layouts (``ExpertSlice``): ``cat``, gate then up along the rows (``[E, I, H]`` twice -> ``[E, 2I, H]``);
``cat_interleaved_t``, gpt-oss's ``[E, H, 2I]`` with gate and up columns alternating; ``t``, the last
two dims swapped (gpt-oss's down, ``[E, H, I]`` -> ``[E, I, H]``); ``as_is``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

MANIFEST = "gguf_experts.json"
LAYOUTS = ("cat", "cat_interleaved_t", "t", "as_is")


def write_manifest(out: Path, entries: dict[str, dict]) -> None:
    """Record ``{parameter name: {"tensors": [GGUF names], "layout": one of LAYOUTS}}`` in ``out``."""
    (Path(out) / MANIFEST).write_text(json.dumps(entries, indent=1, sort_keys=True))


def read_manifest(model_dir: str | Path) -> dict[str, dict]:
    """The directory's manifest, or ``{}`` (a directory whose experts, if any, are in its safetensors)."""
    p = Path(model_dir) / MANIFEST
    return json.loads(p.read_text()) if p.is_file() else {}


def _rows(t, e0: int, e1: int) -> np.ndarray:
    """Experts ``e0 .. e1 - 1`` of the stacked GGUF tensor ``t`` (``gguf_index.GGUFTensor``), float32
    ``[e1 - e0, *per-expert shape]`` (numpy order)."""
    from gguf.quants import dequantize
    shape = tuple(int(d) for d in reversed(t.shape))
    per = t.data.size // shape[0]
    x = dequantize(np.asarray(t.data[e0 * per:e1 * per]), t.tensor_type)
    return np.asarray(x, dtype=np.float32).reshape(e1 - e0, *shape[1:])


class ExpertSlice:
    """A fused expert parameter read lazily from its GGUF tensors, indexed over the experts
    (safetensors' ``get_slice`` shape: ``get_shape()``, ``[a:b]``, ``[:]``, ``[e]``).

    Args:
        tensors: its stacked ``gguf_index.GGUFTensor`` (two for ``cat`` layouts, else one).
        layout: one of ``LAYOUTS``.
    Raises:
        ValueError: an unknown layout or a tensor count it does not take.
    """

    def __init__(self, tensors: list, layout: str) -> None:
        if layout not in LAYOUTS or len(tensors) != (2 if layout.startswith("cat") else 1):
            raise ValueError(f"expert layout {layout!r} with {len(tensors)} tensors")
        self.tensors, self.layout = tensors, layout

    def get_shape(self) -> list[int]:
        """The parameter's shape (``[E, ...]``)."""
        e, *rest = (int(d) for d in reversed(self.tensors[0].shape))
        if self.layout == "cat":
            return [e, 2 * rest[0], rest[1]]
        if self.layout == "cat_interleaved_t":
            return [e, rest[1], 2 * rest[0]]
        return [e, rest[1], rest[0]] if self.layout == "t" else [e, *rest]

    def __getitem__(self, index) -> torch.Tensor:
        """Experts ``index`` (a slice with step 1, or an int) as float32."""
        total = self.get_shape()[0]
        if isinstance(index, int):
            return self[index:index + 1][0]
        start, stop, step = index.indices(total)
        if step != 1:
            raise IndexError("expert slices are contiguous")
        parts = [_rows(t, start, stop) for t in self.tensors]
        if self.layout == "cat":
            out = np.concatenate(parts, axis=1)
        elif self.layout == "cat_interleaved_t":
            g, u = parts[0].transpose(0, 2, 1), parts[1].transpose(0, 2, 1)
            out = np.empty((*g.shape[:2], 2 * g.shape[2]), dtype=np.float32)
            out[..., 0::2], out[..., 1::2] = g, u
        else:
            out = parts[0].transpose(0, 2, 1) if self.layout == "t" else parts[0]
        return torch.from_numpy(np.ascontiguousarray(out))


class GGUFExperts:
    """The expert parameters a converted directory left in its GGUF, by parameter name.

    Args:
        model_dir: the converted directory (its ``MANIFEST`` and the source it records).
    Raises:
        ValueError: the directory lists experts but its GGUF file is gone or lacks a listed tensor.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.entries = read_manifest(model_dir)
        self.tensors = {}
        if self.entries:
            from pagedllm.models.gguf_index import read_tensor_index
            from pagedllm.models.quant_linear import gguf_source
            src = gguf_source(model_dir)
            if src is None:
                raise ValueError(f"{model_dir} keeps its experts in the GGUF file it was converted from, "
                                 "which is no longer where it was: convert the file again")
            _, self.tensors = read_tensor_index(src)
            missing = [n for e in self.entries.values() for n in e["tensors"] if n not in self.tensors]
            if missing:
                raise ValueError(f"{src} lacks the expert tensors {missing[:4]}")

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __bool__(self) -> bool:
        return bool(self.entries)

    def get_slice(self, name: str) -> ExpertSlice:
        """The lazy slice of parameter ``name``."""
        e = self.entries[name]
        return ExpertSlice([self.tensors[n] for n in e["tensors"]], e["layout"])

    def get_tensor(self, name: str) -> torch.Tensor:
        """Parameter ``name`` whole (float32)."""
        return self.get_slice(name)[:]


def load_into(model: torch.nn.Module, model_dir: str | Path) -> int:
    """Copy the expert parameters ``model_dir`` left in its GGUF into ``model`` (a ``transformers``
    model loaded from that directory by ``from_pretrained``, which finds no tensor for them);
    returns how many were filled.

    Raises:
        ValueError: as ``GGUFExperts``, or a listed parameter ``model`` does not have.
    """
    experts = GGUFExperts(model_dir)
    params = dict(model.named_parameters())
    for name in experts.entries:
        if name not in params:
            raise ValueError(f"{type(model).__name__} has no parameter {name!r}")
        with torch.no_grad():
            params[name].copy_(experts.get_tensor(name))
    return len(experts.entries)

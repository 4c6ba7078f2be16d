"""Read a PEFT LoRA adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``.

Follows PEFT's LoRA (Hu et al. 2021) as ``peft`` saves it: per adapted linear ``W`` of a decoder
layer, ``lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``; the layer computes
``W x + scaling * B (A x)`` with ``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
rsLoRA (``use_rslora``, Kalajdzievski 2023). What this engine cannot apply exactly is refused with
a ``ValueError`` naming it: ``modules_to_save``, DoRA, trained biases, per-module rank or alpha
patterns, ``fan_in_fan_out``, targets other than the decoder's projections, a rank above
``max_lora_rank``, a missing or unreadable file.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the decoder projections an adapter may target (Llama / Qwen2 names)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter's float32 matrices, keyed by decoder layer and projection.

    Attributes:
        rank: ``r``.
        scaling: ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA); multiplies ``B (A x)``.
        weights: ``(layer index, projection name) -> (A [r, in], B [out, r])`` float32 tensors.
        path: the directory it was read from.
    """

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    path: str

    @property
    def nbytes(self) -> int:
        """Bytes the matrices take."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _bad(path: Path, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {what}")


def read_adapter_config(path: str | Path, max_lora_rank: int) -> tuple[int, float, list[str]]:
    """Check ``adapter_config.json``: ``(rank, scaling, target module names)``.

    Raises:
        ValueError: no such directory, a missing or unparsable config or weights file, another
            PEFT type than LORA, ``modules_to_save``, DoRA, ``bias`` other than ``none``, rank or
            alpha patterns, ``fan_in_fan_out``, an unknown target module, or ``r`` above ``max_lora_rank``.
    """
    path = Path(path)
    if not path.is_dir():
        raise _bad(path, "no such directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise _bad(path, f"missing file {name}")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise _bad(path, f"{CONFIG_FILE} is not readable JSON ({e})") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise _bad(path, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("modules_to_save"):
        raise _bad(path, f"modules_to_save {cfg['modules_to_save']!r} is not supported")
    if cfg.get("use_dora"):
        raise _bad(path, "use_dora (DoRA) is not supported")
    if cfg.get("bias", "none") != "none":
        raise _bad(path, f"bias {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise _bad(path, "rank_pattern / alpha_pattern (per-module ranks) are not supported")
    if cfg.get("fan_in_fan_out"):
        raise _bad(path, "fan_in_fan_out is not supported")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(t for t in targets if t not in TARGET_MODULES)
    if unknown or not targets:
        raise _bad(path, f"unknown target modules {unknown or targets!r}; supported: {', '.join(TARGET_MODULES)}")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _bad(path, f"r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise _bad(path, f"rank r={rank} is above max_lora_rank={max_lora_rank}")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, scaling, targets


def load_peft_adapter(path: str | Path, max_lora_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA directory (``read_adapter_config``, then the tensors).

    Returns:
        The adapter, its matrices float32 on the CPU.
    Raises:
        ValueError: as ``read_adapter_config``; an unreadable safetensors file; a tensor that is not
            a decoder projection's ``lora_A`` / ``lora_B``, a projection outside ``target_modules``,
            an ``A`` without its ``B``, or shapes that disagree with ``r``.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(path)
    rank, scaling, targets = read_adapter_config(path, max_lora_rank)
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (OSError, SafetensorError) as e:
        raise _bad(path, f"{WEIGHTS_FILE} is not readable ({e})") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise _bad(path, f"tensor {key!r} is not a decoder projection's lora_A / lora_B")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in targets:
            raise _bad(path, f"tensor {key!r}: module {module!r} is not among target_modules")
        halves.setdefault((layer, module), {})[half] = t.float().contiguous()
    weights = {}
    for (layer, module), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise _bad(path, f"layer {layer} {module}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise _bad(path, f"layer {layer} {module}: shapes A {tuple(a.shape)}, B {tuple(b.shape)} "
                       f"disagree with r={rank}")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise _bad(path, f"{WEIGHTS_FILE} holds no LoRA tensors")
    return LoRAAdapter(rank, scaling, weights, str(path))


def check_shapes(adapter: LoRAAdapter, shapes: dict[str, tuple[int, int]], num_layers: int) -> None:
    """Check an adapter against the base model: each projection's ``(out, in)`` and the layer count.

    Args:
        shapes: projection name -> ``(out_features, in_features)`` of the base model.
    Raises:
        ValueError: a layer index past ``num_layers``, a projection the base model has no linear for
            (``shapes`` lacks it: an MoE model's experts), or a matrix whose shape does not fit.
    """
    for (layer, module), (a, b) in adapter.weights.items():
        if layer >= num_layers:
            raise _bad(Path(adapter.path), f"layer {layer} is past the model's {num_layers} layers")
        if module not in shapes:
            raise _bad(Path(adapter.path), f"target module {module!r} is not a linear the base model serves "
                       f"adapters on (it has {sorted(shapes)})")
        out, inp = shapes[module]
        if a.shape[1] != inp or b.shape[0] != out:
            raise _bad(Path(adapter.path), f"layer {layer} {module}: A {tuple(a.shape)} / B {tuple(b.shape)} do "
                       f"not fit the base model's [{out}, {inp}] (another base model?)")

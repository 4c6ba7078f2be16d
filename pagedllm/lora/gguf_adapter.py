"""Read a llama.cpp LoRA adapter GGUF file (what ``convert_lora_to_gguf.py`` writes), and pick the reader.

The file, as llama.cpp's converter writes it and ``src/llama-adapter.cpp`` reads it: ``general.type``
``"adapter"``, ``adapter.type`` ``"lora"``, ``adapter.lora.alpha`` (float32), ``general.architecture``;
per adapted projection ``blk.{i}.{attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down}.weight``
two tensors ``.lora_a`` (GGML ``ne = [in, r]``, i.e. PEFT's ``A [r, in]``) and ``.lora_b``
(``ne = [r, out]``: ``B [out, r]``). llama.cpp computes ``W x + scale * B (A x)`` with
``scale = user_scale * alpha / r`` (``r = ne[0]`` of ``lora_b``), or ``user_scale`` when ``alpha`` is 0
(``llama_adapter_lora_weight::get_scale``); the user scale is 1 here.

For a ``llama`` file the converter applies the same rope row permutation to ``lora_b`` of ``attn_q`` and
``attn_k`` as to the base weights (``LlamaModel.permute``: per head, rows ``(2, d/2)`` become
``(d/2, 2)``); this engine's models keep the Hugging Face row order, so the permutation is undone here,
with ``num_attention_heads`` for q and ``num_key_value_heads`` for k. ``qwen2`` files are not permuted.
What cannot be applied exactly is refused with a ``ValueError`` naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from pagedllm.lora.peft_reader import LoRAAdapter, load_peft_adapter

# GGUF tensor base name -> this engine's projection name
GGUF_PROJECTIONS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                    "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# general.architecture -> whether the converter permuted q/k rows for rope (LlamaModel.undo_permute)
ARCH_PERMUTES_QK = {"llama": True, "qwen2": False}
# transformers model_type -> the GGUF architecture llama.cpp converts it to
MODEL_TYPE_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_NAME = re.compile(r"^blk\.(\d+)\.(\w+?)\.weight\.lora_([ab])$")


def _bad(path: Path, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {what}")


def _field_str(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None else str(field.contents())


def _read_header(reader, path: Path) -> tuple[str, float]:
    """``(general.architecture, adapter.lora.alpha)`` after checking the adapter keys.

    Raises:
        ValueError: ``general.type`` is not ``adapter``, ``adapter.type`` is not ``lora``, an aLoRA
            (``adapter.alora.invocation_tokens``), or an architecture outside ``ARCH_PERMUTES_QK``.
    """
    if (gtype := _field_str(reader, "general.type")) != "adapter":
        raise _bad(path, f"general.type is {gtype!r}, not 'adapter' (a model GGUF, not a LoRA adapter?)")
    if (atype := _field_str(reader, "adapter.type")) != "lora":
        raise _bad(path, f"adapter.type is {atype!r}, not 'lora'")
    if "adapter.alora.invocation_tokens" in reader.fields:
        raise _bad(path, "activated LoRA (adapter.alora.invocation_tokens) is not supported")
    arch = _field_str(reader, "general.architecture")
    if arch not in ARCH_PERMUTES_QK:
        raise _bad(path, f"general.architecture {arch!r} is not supported ({', '.join(ARCH_PERMUTES_QK)})")
    field = reader.fields.get("adapter.lora.alpha")
    alpha = 0.0 if field is None else float(field.contents())  # llama.cpp: absent reads as 0
    return arch, alpha


def _tensor_f32(t, path: Path) -> torch.Tensor:
    """A GGUF tensor as float32 ``[ne[1], ne[0]]`` (F32, F16, BF16, Q8_0 dequantized).

    Raises:
        ValueError: not 2-D, or another GGML type.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q
    if len(t.shape) != 2:
        raise _bad(path, f"tensor {t.name!r} has {len(t.shape)} dimensions, not 2")
    if t.tensor_type not in (Q.F32, Q.F16, Q.BF16, Q.Q8_0):
        raise _bad(path, f"tensor {t.name!r}: type {t.tensor_type.name} is not supported (F32, F16, BF16, Q8_0)")
    data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    cols, rows = (int(n) for n in t.shape)
    return torch.from_numpy(np.array(data, dtype=np.float32).reshape(rows, cols))  # a copy: off the mmap


def unpermute_rope_rows(b: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``LlamaModel.permute`` on the rows of ``b`` ``[out, r]`` (float32).

    The converter maps row ``(head, half, i)`` (Hugging Face order, ``half`` in 0..1, ``i < d/2``) to
    ``(head, i, half)``; this maps it back.

    Raises:
        ValueError: ``out`` not a multiple of ``2 * n_head``.
    """
    out = b.shape[0]
    if n_head < 1 or out % (2 * n_head):
        raise ValueError(f"{out} rows do not split into {n_head} heads of two rope halves")
    return b.reshape(n_head, out // n_head // 2, 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape).contiguous()


def _pairs(reader, path: Path) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """``(layer, projection) -> {"a": A, "b": B}`` float32 from the file's tensors.

    Raises:
        ValueError: a tensor that is not a decoder projection's ``lora_a`` / ``lora_b`` (e.g.
            ``token_embd``, ``output``, norms), or one that does not read.
    """
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        m = _NAME.match(t.name)
        if m is None or m.group(2) not in GGUF_PROJECTIONS:
            module = t.name.split(".weight")[0]
            raise _bad(path, f"tensor {t.name!r}: module {module!r} is not supported; only the decoder "
                       f"projections {', '.join(GGUF_PROJECTIONS)} may be adapted")
        key = (int(m.group(1)), GGUF_PROJECTIONS[m.group(2)])
        halves.setdefault(key, {})[m.group(3)] = _tensor_f32(t, path)
    return halves


def load_gguf_adapter(path: str | Path, max_lora_rank: int, num_heads: int, num_kv_heads: int,
                      model_type: str | None = None) -> LoRAAdapter:
    """Read and check a llama.cpp LoRA GGUF file; q/k ``B`` rows back in Hugging Face order.

    Args:
        num_heads, num_kv_heads: the base model's attention and key-value head counts (to undo the
            rope permutation of a ``llama`` file).
        model_type: the base model's ``transformers`` ``model_type``; when known (``MODEL_TYPE_ARCH``)
            it must match the file's ``general.architecture``.
    Returns:
        The adapter: ``A [r, in]``, ``B [out, r]`` float32 on the CPU, ``scaling = alpha / r``
        (1.0 when alpha is 0).
    Raises:
        ValueError: no such file or not a GGUF; as ``_read_header`` and ``_pairs``; an architecture
            other than the base model's; a missing ``lora_a`` or ``lora_b``; shapes whose ranks
            disagree (within a pair or across projections); a rank above ``max_lora_rank``; no tensors.
    """
    from gguf import GGUFReader
    path = Path(path)
    if not path.is_file():
        raise _bad(path, "no such file")
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise _bad(path, f"not a readable GGUF file ({e})") from None
    arch, alpha = _read_header(reader, path)
    if model_type in MODEL_TYPE_ARCH and MODEL_TYPE_ARCH[model_type] != arch:
        raise _bad(path, f"an adapter of a {arch!r} model, the base model is {model_type!r}")
    weights, ranks = {}, set()
    for (layer, module), ab in sorted(_pairs(reader, path).items()):
        if set(ab) != {"a", "b"}:
            missing = "lora_b" if "a" in ab else "lora_a"
            raise _bad(path, f"layer {layer} {module}: {missing} is missing")
        a, b = ab["a"], ab["b"]
        if a.shape[0] != b.shape[1]:
            raise _bad(path, f"layer {layer} {module}: shapes A {tuple(a.shape)}, B {tuple(b.shape)} "
                       "disagree on the rank")
        ranks.add(a.shape[0])
        if ARCH_PERMUTES_QK[arch] and module in ("q_proj", "k_proj"):
            heads = num_heads if module == "q_proj" else num_kv_heads
            try:
                b = unpermute_rope_rows(b, heads)
            except ValueError as e:
                raise _bad(path, f"layer {layer} {module}: {e}") from None
        weights[(layer, module)] = (a, b)
    if not weights:
        raise _bad(path, "holds no LoRA tensors")
    if len(ranks) > 1:
        raise _bad(path, f"projections of different ranks {sorted(ranks)} are not supported")
    rank = ranks.pop()
    if rank > max_lora_rank:
        raise _bad(path, f"rank r={rank} is above max_lora_rank={max_lora_rank}")
    return LoRAAdapter(rank, alpha / rank if alpha else 1.0, weights, str(path))


def load_adapter(path: str | Path, max_lora_rank: int, text_config) -> LoRAAdapter:
    """Read an adapter: a ``.gguf`` file with ``load_gguf_adapter``, otherwise a PEFT directory
    (``peft_reader.load_peft_adapter``).

    Args:
        text_config: the base model's ``transformers`` text config (head counts, ``model_type``).
    Raises:
        ValueError: as the reader picked.
    """
    if str(path).lower().endswith(".gguf"):
        heads = text_config.num_attention_heads
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        return load_gguf_adapter(path, max_lora_rank, heads, kv_heads, getattr(text_config, "model_type", None))
    return load_peft_adapter(path, max_lora_rank)

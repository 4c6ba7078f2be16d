"""Mixture-of-experts GGUF files that ``transformers``' GGUF reader does not read, converted by a table of
ours: Mixtral (llama.cpp writes it as a ``llama`` file with ``llama.expert_count``), OLMoE (``olmoe``)
and Granite MoE (``granitemoe``). ``loader`` writes the config and float32 tensors here; then
``packed_transformers`` serves the experts from the file's blocks as for Qwen3-MoE.

llama.cpp's ``convert_hf_to_gguf.py`` stacks each layer's experts into ``ffn_{gate,up,down}_exps``
(``[E, I, H]``, ``[E, I, H]``, ``[E, H, I]``, numpy order), the router into ``ffn_gate_inp`` ``[E, H]``,
and permutes the q/k rows of the Llama-derived families (Mixtral, Granite) for its interleaved
rotary; ``transformers`` 5 holds the experts fused (``gate_up_proj`` ``[E, 2I, H]`` gate then up,
``down_proj`` ``[E, H, I]``) and rotates halves. So: gate and up are concatenated, q/k rows
un-permuted (``gguf_blocks.unpermute_rows``), names placed by ``FAMILIES``; Granite's four
multipliers come from the ``*_scale`` keys. ``ffn_gate_up_exps`` (newer files' fused tensor) is read
as it is.

Source: llama.cpp's ``conversion/{llama,olmo,granite}.py`` and gguf-py's tensor and key names (read,
not copied); transformers' ``MixtralConfig`` / ``OlmoeConfig`` / ``GraniteMoeConfig`` and their
modeling files for the parameter names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class MoEFamily:
    """How one family's GGUF maps onto its ``transformers`` class.

    Attributes:
        config: the ``transformers`` config class name; architecture: its causal LM class name.
        moe: the layer's MoE submodule (``mlp``, ``block_sparse_moe``); router: its router's name.
        permuted: llama.cpp permuted the q/k rows (Llama-derived converters).
        layer: extra ``blk.N.`` tensors -> parameter under ``model.layers.N.``.
        keys: GGUF key (after ``<arch>.``) -> config field, beyond the common ones (Granite's
            multipliers, the Qwen families' expert widths).
        fixed: config fields the file does not carry but llama.cpp's graph of the family assumes
            (Qwen3-MoE renormalizes its top-k weights).
        experts_field: the config's name for the expert count.
    """

    config: str
    architecture: str
    moe: str
    router: str
    permuted: bool
    layer: dict = field(default_factory=dict)
    keys: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)
    experts_field: str = "num_local_experts"


_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_QWEN_WIDTHS = {"feed_forward_length": "intermediate_size", "expert_feed_forward_length": "moe_intermediate_size"}
FAMILIES = {
    "llama": MoEFamily("MixtralConfig", "MixtralForCausalLM", "mlp", "gate", True),
    "olmoe": MoEFamily("OlmoeConfig", "OlmoeForCausalLM", "mlp", "gate", False, _QK_NORM, experts_field="num_experts"),
    "granitemoe": MoEFamily("GraniteMoeConfig", "GraniteMoeForCausalLM", "block_sparse_moe", "router", True,
                            keys={"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                                  "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"}),
    "qwen3moe": MoEFamily("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "mlp", "gate", False, _QK_NORM, _QWEN_WIDTHS,
                          {"norm_topk_prob": True}, "num_experts"),
    "qwen2moe": MoEFamily("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "mlp", "gate", False, {
        "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
        **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")},
        **{f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}},
        {**_QWEN_WIDTHS, "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
        {"norm_topk_prob": False}, "num_experts"),
}
TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          **{f"attn_{g}.weight": f"self_attn.{h}_proj.weight"
             for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))}}
_EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_up_exps.weight")


def is_moe_file(reader, arch: str | None) -> bool:
    """Whether ``reader``'s file is one this table converts (a ``llama`` file only with experts)."""
    if arch not in FAMILIES:
        return False
    count = reader.fields.get(f"{arch}.expert_count")
    return count is not None and int(count.contents()) > 0


def meta(reader, key: str, default=None):
    """The value of GGUF key ``key``, or ``default``."""
    f = reader.fields.get(key)
    return f.contents() if f is not None else default


def tensor_array(t) -> np.ndarray:
    """A GGUF tensor dequantized to float32, numpy shape (outermost first)."""
    from gguf.quants import dequantize
    shape = tuple(int(d) for d in reversed(t.shape))
    return np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def config_from_gguf(reader, arch: str):
    """The family's ``transformers`` config from the file's ``<arch>.*`` keys.

    Raises:
        ValueError: a key every such file has is missing (named).
    """
    import transformers
    fam = FAMILIES[arch]
    need = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
            "attention.head_count": "num_attention_heads", "expert_count": "num_local_experts",
            "expert_used_count": "num_experts_per_tok"}
    kw = {}
    for key, name in need.items():
        if (value := meta(reader, f"{arch}.{key}")) is None:
            raise ValueError(f"{arch} mixture-of-experts GGUF without {arch}.{key}")
        kw[name] = int(value)
    kw[fam.experts_field] = kw.pop("num_local_experts")
    kw["intermediate_size"] = int(meta(reader, f"{arch}.expert_feed_forward_length",
                                       meta(reader, f"{arch}.feed_forward_length")))
    kw["num_key_value_heads"] = int(meta(reader, f"{arch}.attention.head_count_kv", kw["num_attention_heads"]))
    if (head_dim := meta(reader, f"{arch}.attention.key_length")) is not None:
        kw["head_dim"] = int(head_dim)
    for key, name in fam.keys.items():  # widths are ints; multipliers float32, shortest repr (0.2, not 0.2000000029)
        if (value := meta(reader, f"{arch}.{key}")) is not None:
            kw[name] = int(value) if name.endswith("_size") else float(str(np.float32(value)))
    eps = np.float32(meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))
    tokens = {k: int(meta(reader, f"tokenizer.ggml.{k}_token_id"))
              for k in ("bos", "eos", "padding") if f"tokenizer.ggml.{k}_token_id" in reader.fields}
    names = {t.name for t in reader.tensors}
    return getattr(transformers, fam.config)(
        **kw, **fam.fixed, vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        max_position_embeddings=int(meta(reader, f"{arch}.context_length", 4096)),
        rms_norm_eps=float(str(eps)), tie_word_embeddings="output.weight" not in names,
        rope_parameters={"rope_type": "default", "rope_theta": float(meta(reader, f"{arch}.rope.freq_base", 10000.0))},
        bos_token_id=tokens.get("bos"), eos_token_id=tokens.get("eos"),
        pad_token_id=tokens.get("padding", tokens.get("eos")), architectures=[fam.architecture], dtype="float32")


def _experts(layer: int, by_name: dict, prefix: str) -> dict[str, dict]:
    """Layer ``layer``'s fused expert parameters as ``gguf_experts`` manifest entries."""
    b = f"blk.{layer}."
    fused = b + "ffn_gate_up_exps.weight"
    gate_up = ({"tensors": [fused], "layout": "as_is"} if fused in by_name else
               {"tensors": [b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"], "layout": "cat"})
    return {prefix + "gate_up_proj": gate_up,
            prefix + "down_proj": {"tensors": [b + "ffn_down_exps.weight"], "layout": "as_is"}}


def save_checked(config, tensors: dict[str, np.ndarray], experts: dict[str, dict], gguf_path: Path,
                 out: Path) -> None:
    """Write ``tensors`` as ``out/model.safetensors``, ``experts`` as the ``gguf_experts`` manifest
    (those stay in the file) and ``config`` as ``out/config.json`` when together they fill the
    config's causal LM exactly (a tensor of the parameter's size in another shape, as Qwen2-MoE's
    ``[H]`` shared-expert gate for ``[1, H]``, is reshaped).

    Raises:
        ValueError: a parameter nothing fills, or a tensor the model has no place for (named).
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from pagedllm.models.gguf_experts import write_manifest
    with torch.device("meta"):
        want = dict(AutoModelForCausalLM.from_config(config).state_dict())
    if config.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    have = set(tensors) | set(experts)
    if have != set(want):
        raise ValueError(f"GGUF {gguf_path} does not fill {config.architectures[0]}: missing "
                         f"{sorted(set(want) - have)[:8]}, unexpected {sorted(have - set(want))[:8]}")
    save_file({k: torch.from_numpy(np.ascontiguousarray(v).reshape(want[k].shape)) for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    write_manifest(out, experts)
    config.save_pretrained(out)


def write_model(reader, arch: str, gguf_path: Path, out: Path):
    """Write ``config.json`` and float32 ``model.safetensors`` of a MoE GGUF of ``arch`` (``FAMILIES``)
    into ``out``; returns the config (the caller writes the tokenizer files).

    Raises:
        ValueError: a tensor the table does not place, or a parameter no tensor fills (named).
    """
    from pagedllm.models.gguf_blocks import unpermute_rows
    fam = FAMILIES[arch]
    config = config_from_gguf(reader, arch)
    by_name = {t.name: t for t in reader.tensors}
    layer_names = {**_LAYER, **fam.layer, "ffn_gate_inp.weight": f"{fam.moe}.{fam.router}.weight"}
    heads = {"attn_q.weight": config.num_attention_heads, "attn_k.weight": config.num_key_value_heads}
    tensors: dict[str, np.ndarray] = {}
    for name, t in by_name.items():
        if name in TOP:
            tensors[TOP[name]] = tensor_array(t)
            continue
        layer, _, rest = name.removeprefix("blk.").partition(".")
        if rest in layer_names:
            w = tensor_array(t)
            if fam.permuted and rest in heads:
                w = unpermute_rows(w, heads[rest])
            tensors[f"model.layers.{layer}.{layer_names[rest]}"] = w
        elif not (name.startswith("blk.") and rest in _EXPERTS):
            raise ValueError(f"{arch} GGUF {gguf_path}: tensor {name!r} is not one pagedllm places")
    experts = {}
    for layer in range(config.num_hidden_layers):
        if f"blk.{layer}.ffn_down_exps.weight" in by_name:  # a dense layer (mlp_only_layers) has none
            experts.update(_experts(layer, by_name, f"model.layers.{layer}.{fam.moe}.experts."))
    save_checked(config, tensors, experts, gguf_path, out)
    return config


def stale_conversion(target: Path) -> bool:
    """Whether ``target`` is an earlier pagedllm's conversion of a mixture-of-experts GGUF that a family
    table now converts (``FAMILIES``, ``gguf_gpt_oss``): it wrote the experts in float32 (four to eight
    times the file); ``loader`` converts it again."""
    import json

    from pagedllm.models.gguf_experts import MANIFEST
    try:
        archs = json.loads((Path(target) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    tables = {f.architecture for f in FAMILIES.values()} | {"GptOssForCausalLM"}
    return bool(set(archs) & tables) and not (Path(target) / MANIFEST).is_file()

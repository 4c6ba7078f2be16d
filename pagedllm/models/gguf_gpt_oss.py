"""gpt-oss GGUF files (llama.cpp's ``gpt-oss`` architecture) converted by a table of ours.

``transformers`` lists ``gpt_oss`` among its GGUF architectures, but its reader expects expert tensors
named ``ffn_{gate,up,down}_projs`` and writes them per expert, while llama.cpp's
``convert_hf_to_gguf.py`` writes ``ffn_{gate,up,down}_exps`` stacked over the experts and the
model class holds them fused; it also maps neither the head size nor the sliding window from the
keys llama.cpp writes. So the config is read from the file's keys here (``config_from_gguf``) and
the tensors are placed by ``TENSORS`` and ``_experts``:

- ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` -> ``experts.gate_up_proj`` ``[E, H, 2I]`` with gate
  and up interleaved (column ``2j`` gate ``j``, ``2j + 1`` up ``j``; the inverse of llama.cpp's split),
  their biases ``[E, I]`` -> ``gate_up_proj_bias`` ``[E, 2I]`` the same way;
- ``ffn_down_exps`` ``[E, H, I]`` -> ``experts.down_proj`` ``[E, I, H]`` (transposed), bias as it is.

The expert weights stay in the file: the two layouts above are ``gguf_experts``' ``cat_interleaved_t``
and ``t``, listed in the converted directory's manifest; the biases are written in float32.

Source: llama.cpp's ``conversion/gpt_oss.py`` and ``gguf-py`` tensor names (read, not copied);
transformers' ``GptOssConfig`` and modeling file for the parameter names.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedllm.models.gguf_moe import save_checked, tensor_array

ARCH = "gpt-oss"
# GGUF tensor (after "blk.N.") -> parameter of model.layers.N; the experts are placed by _experts
TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
    **{f"attn_{g}.{p}": f"self_attn.{h}_proj.{p}" for g, h in (("q", "q"), ("k", "k"), ("v", "v"),
                                                              ("output", "o")) for p in ("weight", "bias")},
}
TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}


def _field(reader, key: str, default=None):
    f = reader.fields.get(f"{ARCH}.{key}")
    return f.contents() if f is not None else default


def config_from_gguf(reader):
    """A ``transformers.GptOssConfig`` from the file's ``gpt-oss.*`` keys.

    Raises:
        ValueError: a key every gpt-oss file has is missing (the message names it).
    """
    from transformers import GptOssConfig
    need = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
            "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
            "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"}
    kw = {}
    for key, name in need.items():
        if (value := _field(reader, key)) is None:
            raise ValueError(f"gpt-oss GGUF without {ARCH}.{key}")
        kw[name] = int(value)
    width = _field(reader, "expert_feed_forward_length", _field(reader, "feed_forward_length"))
    hidden = kw["hidden_size"]
    rope = {"rope_type": "default", "rope_theta": float(_field(reader, "rope.freq_base", 150000.0))}
    if _field(reader, "rope.scaling.type") == "yarn":  # gpt-oss's YaRN (beta_fast / beta_slow as its config's)
        rope.update(rope_type="yarn", factor=float(_field(reader, "rope.scaling.factor", 32.0)), beta_fast=32.0,
                    beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=int(_field(reader, "rope.scaling.original_context_length", 4096)))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    eps = float(np.float32(_field(reader, "attention.layer_norm_rms_epsilon", 1e-5)))
    token = {k: int(reader.fields[f"tokenizer.ggml.{k}_token_id"].contents())
             for k in ("bos", "eos", "padding") if f"tokenizer.ggml.{k}_token_id" in reader.fields}
    return GptOssConfig(**kw, intermediate_size=int(width), vocab_size=vocab,
                        head_dim=int(_field(reader, "attention.key_length", hidden // kw["num_attention_heads"])),
                        sliding_window=int(_field(reader, "attention.sliding_window", 128)),
                        max_position_embeddings=int(_field(reader, "context_length", 131072)),
                        rms_norm_eps=float(str(eps)), rope_parameters=rope,
                        tie_word_embeddings="output.weight" not in names, bos_token_id=token.get("bos"),
                        eos_token_id=token.get("eos"), pad_token_id=token.get("padding", token.get("eos")),
                        architectures=["GptOssForCausalLM"], dtype="float32")


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``[..., I]`` gate and up -> ``[..., 2I]`` with gate ``j`` at ``2j`` and up ``j`` at ``2j + 1``."""
    out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), dtype=np.float32)
    out[..., 0::2], out[..., 1::2] = gate, up
    return out


def _experts(layer: int, by_name: dict) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """Layer ``layer``'s fused expert parameters: the biases (float32, small) and the weights as
    ``gguf_experts`` manifest entries (left in the file)."""
    b, p = f"blk.{layer}.", f"model.layers.{layer}.mlp.experts."
    manifest = {p + "gate_up_proj": {"tensors": [b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"],
                                     "layout": "cat_interleaved_t"},
                p + "down_proj": {"tensors": [b + "ffn_down_exps.weight"], "layout": "t"}}
    biases = {}
    if b + "ffn_gate_exps.bias" in by_name:
        biases[p + "gate_up_proj_bias"] = _interleave(tensor_array(by_name[b + "ffn_gate_exps.bias"]),
                                                      tensor_array(by_name[b + "ffn_up_exps.bias"]))
        biases[p + "down_proj_bias"] = tensor_array(by_name[b + "ffn_down_exps.bias"])
    return biases, manifest


def write_model(reader, gguf_path: Path, out: Path) -> object:
    """Write ``config.json`` and float32 ``model.safetensors`` of a gpt-oss GGUF into ``out``; returns
    the config (the caller writes the tokenizer files).

    Raises:
        ValueError: a tensor the table does not place, or a parameter no tensor fills (named).
    """
    config = config_from_gguf(reader)
    by_name = {t.name: t for t in reader.tensors}
    tensors: dict[str, np.ndarray] = {}
    for name, t in by_name.items():
        if name in TOP:
            tensors[TOP[name]] = tensor_array(t)
            continue
        layer, _, rest = name.removeprefix("blk.").partition(".")
        if rest in TENSORS:
            tensors[f"model.layers.{layer}.{TENSORS[rest]}"] = tensor_array(t)
        elif not (name.startswith("blk.") and rest.startswith(("ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps."))):
            raise ValueError(f"gpt-oss GGUF {gguf_path}: tensor {name!r} is not one pagedllm places")
    experts = {}
    for layer in range(config.num_hidden_layers):
        biases, manifest = _experts(layer, by_name)
        tensors.update(biases)
        experts.update(manifest)
    save_checked(config, tensors, experts, gguf_path, out)
    return config

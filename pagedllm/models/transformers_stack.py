"""Batch-1 decode of Transformers-backend models in one C call (issue 39, item 4: native where it pays).

Through the backend a decoded token runs every layer's ``transformers`` modules in Python: seven
linear calls, norms, rotary, attention, residual adds, ~100 small operations a layer. On 2 cores that
cost Qwen2.5-Coder-0.5B a quarter of its decode speed against the native path, which runs the stack
in one C call (``kernels.cpu.decode_stack``). The decoder layers of the families below have the
same shape (pre-norm attention and gated MLP, optional q/k head norms and Gemma's sandwich norms), so
their batch-1 steps run that C call over the module's own weights: packed ``GGUFLinear`` or float32.

Which families, and where each keeps its pieces, is a table of ours keyed by the decoder layer's
class (a layer class we have not read keeps the ``transformers`` path). A model qualifies only when
every norm is a ``transformers_norms.KernelRMSNorm`` (its effective weight checked against the
module), the activation is checked numerically (SiLU or tanh-GELU), every rotary table is full-width
and every layer holds attention; anything else keeps the per-layer path. Embedding, final norm, LM
head and final logit soft-capping stay the module's own.

Source: the decoder layers of transformers 5's ``modeling_llama``, ``_mistral``, ``_qwen2``,
``_qwen3``, ``_phi3``, ``_gemma3``, ``_qwen3_moe``, ``_mixtral`` and ``_gpt_oss`` (biased router, attention
sinks, half-width rotary tables).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.models.decode_stack import DecodeStack, activation_of, matmul_entry
from pagedllm.models.transformers_norms import KernelRMSNorm


@dataclass(frozen=True)
class StackFamily:
    """Where a decoder layer keeps what the C stack needs.

    Args:
        norms: stack norm name (``kernels.cpu.STACK_NORMS``) -> attribute path on the layer; the
            optional ones (q/k head norms) may be missing.
        matmuls: stack product name (``kernels.cpu.STACK_MATMULS``) -> attribute path.
        act: attribute path of the MLP's activation module.
        window_in_config: the sliding window is the config's for every layer (Mistral, Phi-3),
            not the attention module's ``sliding_window``.
    """

    norms: dict[str, str]
    matmuls: dict[str, str]
    act: str = "mlp.act_fn"
    window_in_config: bool = False
    moe: bool = False  # ``mlp`` may be a softmax-routed mixture of experts (``gate`` router, ``experts``)
    half_rotary: bool = False  # the rotary module returns cos / sin for half a head (gpt-oss): doubled here
    sinks: str | None = None  # attribute path of the attention-sink logits (gpt-oss)


_PRE_NORM = {"in_norm": "input_layernorm", "pre_ff_norm": "post_attention_layernorm",
             "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
_SPLIT = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
          "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_LLAMA = StackFamily(_PRE_NORM, _SPLIT)
FAMILIES: dict[str, StackFamily] = {
    "LlamaDecoderLayer": _LLAMA,
    "Qwen2DecoderLayer": _LLAMA,
    "Qwen3DecoderLayer": _LLAMA,
    "MistralDecoderLayer": StackFamily(_PRE_NORM, _SPLIT, window_in_config=True),
    "Phi3DecoderLayer": StackFamily(_PRE_NORM, {"q": "self_attn.qkv_proj", "o": "self_attn.o_proj",
                                                "gate": "mlp.gate_up_proj", "down": "mlp.down_proj"},
                                    act="mlp.activation_fn", window_in_config=True),
    "Qwen3MoeDecoderLayer": StackFamily(_PRE_NORM, _SPLIT, moe=True),
    "MixtralDecoderLayer": StackFamily(_PRE_NORM, _SPLIT, window_in_config=True, moe=True),
    "Gemma3DecoderLayer": StackFamily({"in_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                                       "pre_ff_norm": "pre_feedforward_layernorm",
                                       "post_ff_norm": "post_feedforward_layernorm", "q_norm": "self_attn.q_norm",
                                       "k_norm": "self_attn.k_norm"}, _SPLIT),
    "GptOssDecoderLayer": StackFamily(_PRE_NORM, _SPLIT, moe=True, half_rotary=True, sinks="self_attn.sinks"),
}
_MOE_BLOCKS = ("SparseMoeBlock", "GptOssMLP")  # the MLP classes (name endings) whose routers moe_routing reads
_REQUIRED_NORMS = ("in_norm", "pre_ff_norm")
_ATTENTION = ("q", "k", "v", "o")


def moe_routing(mlp: nn.Module) -> tuple | None:
    """``(router weight [E, H], router bias [E] or None, top_k, renormalize)`` of a mixture-of-experts
    MLP whose router (``gate``, or gpt-oss's ``router``) the C stack reproduces (softmax over the
    experts' logits, the top k, optionally renormalized; gpt-oss's softmax over its top-k logits is
    the renormalized one: checked on a random input against the module's own router) and whose
    experts run on the experts kernel (``moe.ExpertWeights``); else ``None``."""
    gate, experts = getattr(mlp, "gate", None) or getattr(mlp, "router", None), getattr(mlp, "experts", None)
    w, k, b = getattr(gate, "weight", None), getattr(gate, "top_k", None), getattr(gate, "bias", None)
    if not (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32 and isinstance(k, int)
            and (b is None or (isinstance(b, torch.Tensor) and b.dtype == torch.float32))
            and getattr(experts, "pagedllm_experts", None) and type(mlp).__name__.endswith(_MOE_BLOCKS)):
        return None
    x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, scores, index = gate(x)
        top, idx = torch.topk(torch.softmax(x @ w.T + (0 if b is None else b), dim=-1), k, dim=-1)
    for renorm in (True, False):
        want = top / top.sum(-1, keepdim=True) if renorm else top
        if torch.equal(idx, index) and torch.allclose(want, scores.float(), rtol=0, atol=1e-6):
            return w.detach(), None if b is None else b.detach(), k, renorm
    return None


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


class TransformersDecodeStack:
    """The batch-1 C stack over a ``transformers`` causal LM's decoder (see the module docstring).

    Args:
        hf: the causal LM (``model.embed_tokens`` / ``layers`` / ``norm`` / ``rotary_emb``, ``lm_head``).
        family: its layers' ``StackFamily``.
        rope_kinds: the rotary module's layer types (``[None]``: one table for every layer).
        dims: ``DecodeStack``'s ``(heads, KV heads, head_dim, intermediate, eps, scale, act, softcap)``.
    """

    def __init__(self, hf: nn.Module, family: StackFamily, rope_kinds: list, dims: tuple) -> None:
        self.hf, self.inner, self.family, self.rope_kinds = hf, hf.model, family, rope_kinds
        cfg = hf.config
        types = getattr(cfg, "layer_types", None)
        self.layer_rope = [rope_kinds.index(types[i]) if rope_kinds != [None] else 0
                           for i in range(len(self.inner.layers))]
        self.windows = [self._window(layer) for layer in self.inner.layers]
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.stack = DecodeStack(self._rows, lambda kv: (kv[0][0].data_ptr(), id(self.inner.layers[0])), dims)

    def _window(self, layer: nn.Module) -> int:
        w = (getattr(self.hf.config, "sliding_window", None) if self.family.window_in_config
             else getattr(layer.self_attn, "sliding_window", None))
        return int(w or 0)

    def _rows(self, kv_caches) -> list[dict]:
        rows = []
        for i, (layer, (kc, vc)) in enumerate(zip(self.inner.layers, kv_caches)):
            row = {n: None for n in ("in_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm")}
            row.update({n: _get(layer, path).weight for n, path in self.family.norms.items()
                        if _get(layer, path) is not None})
            moe = self.family.moe and moe_routing(layer.mlp)
            names = _ATTENTION if moe else tuple(self.family.matmuls)
            row.update({"key_cache": kc, "value_cache": vc, "rope": self.layer_rope[i], "window": self.windows[i],
                        "matmuls": {n: matmul_entry(_get(layer, self.family.matmuls[n])) for n in names}})
            if moe:
                router, bias, top_k, renorm = moe
                w = layer.mlp.experts.pagedllm_experts
                row["moe"] = (router, w.table, top_k, renorm, w.chosen, w.intermediate, bias)
            if self.family.sinks:
                row["sinks"] = _get(layer, self.family.sinks).detach()
            rows.append(row)
        return rows

    def rotary(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[R, T, head_dim]`` cos and sin at ``positions`` ``[T]`` from the model's rotary module
        (its own scaling: YaRN, longrope, dynamic), one per rotary kind."""
        pos = positions.unsqueeze(0)
        pairs = [self.inner.rotary_emb(x, pos) if k is None else self.inner.rotary_emb(x, pos, k)
                 for k in self.rope_kinds]
        if self.family.half_rotary:  # first half x cos - second half x sin: rotate-half with cos, sin doubled
            pairs = [(torch.cat([c, c], -1), torch.cat([s, s], -1)) for c, s in pairs]
        return torch.cat([c for c, _ in pairs]).float(), torch.cat([s for _, s in pairs]).float()

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, logits_indices: torch.Tensor,
               block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        """``[R, vocab]`` float32 logits of the step's last ``T`` tokens of one sequence
        (``input_ids``, ``positions`` ``[T]`` int64); their K/V are written to the cache.

        Raises:
            MemoryError: as ``kernels.cpu.decode_stack``.
        """
        x = self.inner.embed_tokens(input_ids.unsqueeze(0))
        cos, sin = self.rotary(x, positions)
        x = x[0].float().contiguous()
        residual = self.stack.run(x, kv_caches, cos, sin, block_table, seq_len)
        h = self.inner.norm((residual + x).index_select(0, logits_indices))
        logits = self.hf.lm_head(h).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def plan_decode_stack(hf: nn.Module, heads: tuple[int, int, int]) -> TransformersDecodeStack | None:
    """The C decode stack for ``hf`` when its decoder qualifies (module docstring), else ``None``.

    Args:
        hf: a loaded ``transformers`` causal LM, its norms already swapped (``install_kernel_norms``).
        heads: ``(query heads, KV heads, head_dim)``.
    """
    inner = getattr(hf, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not len(layers) or getattr(inner, "rotary_emb", None) is None:
        return None
    family = FAMILIES.get(type(layers[0]).__name__)
    if family is None or any(type(layer) is not type(layers[0]) for layer in layers):
        return None
    cfg = hf.config
    if getattr(cfg, "attn_logit_softcapping", None) or not isinstance(getattr(inner, "norm", None), KernelRMSNorm):
        return None
    eps, scales, acts, inters = {inner.norm.eps}, set(), set(), set()
    for layer in layers:
        for name, path in family.norms.items():
            norm = _get(layer, path)
            if norm is None and name not in _REQUIRED_NORMS:
                continue
            if not isinstance(norm, KernelRMSNorm):
                return None
            eps.add(norm.eps)
        moe = family.moe and getattr(layer.mlp, "experts", None) is not None
        routing = moe_routing(layer.mlp) if moe else None
        if moe and routing is None:
            return None
        names = _ATTENTION if moe else tuple(family.matmuls)
        if any(matmul_entry(_get(layer, family.matmuls[n])) is None for n in names):
            return None
        scales.add(getattr(layer.self_attn, "scaling", None))
        if moe:
            acts.add(layer.mlp.experts.pagedllm_experts.activation)
        else:
            act, down = _get(layer, family.act), _get(layer, family.matmuls["down"])
            acts.add(activation_of(act) if isinstance(act, nn.Module) else None)
            inters.add(getattr(down, "in_features", None) or down.weight.shape[1])
    if len(eps) != 1 or len(scales) != 1 or None in scales or len(acts) != 1 or None in acts:
        return None
    rope_kinds = [None]
    if "layer_type" in inspect.signature(inner.rotary_emb.forward).parameters:
        rope_kinds = sorted(set(cfg.layer_types))
    nh, kvh, hd = heads
    probe = torch.zeros(1, 1, cfg.hidden_size)
    with torch.no_grad():
        cos = inner.rotary_emb(probe, torch.zeros(1, 1, dtype=torch.long), *([rope_kinds[0]] * (rope_kinds != [None])))[0]
    if cos.shape[-1] * (2 if family.half_rotary else 1) != hd:  # partial rotary: the C stack rotates whole heads
        return None
    if len(inters) > 1:  # one width for the dense MLPs (the experts carry their own)
        return None
    inter = inters.pop() if inters else 1
    return TransformersDecodeStack(hf, family, rope_kinds, (nh, kvh, hd, int(inter), eps.pop(), float(scales.pop()),
                                                            acts.pop(), None))

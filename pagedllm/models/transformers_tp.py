"""Tensor parallelism for the Transformers backend, driven by the model's own ``tp_plan``.

A ``transformers`` config names how its base model splits over ranks in ``base_model_tp_plan``
(``{"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise", ...}``; see
transformers' "Tensor parallelism" documentation), and the causal-LM class names its head in
``_tp_plan`` (``{"lm_head": "colwise_gather_output"}``). pagedllm reads those plans and shards the
loaded modules itself with the Megatron-LM layers of ``layers/parallel.py`` (Shoeybi et al. 2019):

- ``colwise`` ``nn.Linear``: this rank's output rows (``ColumnParallelLinear``, no communication);
- ``rowwise`` ``nn.Linear``: this rank's input columns, one all-reduce, bias after it
  (``RowParallelLinear``);
- ``replicate`` / ``replicated_with_grad_allreduce``: kept whole (the gradient all-reduce is a
  training concern);
- the head (``colwise_gather_output``): this rank's vocabulary rows, gathered on rank 0
  (``ParallelLogits``); the embedding stays whole (the plans of these models do not split it).

Why not ``from_pretrained(tp_plan="auto")``: transformers splits K/V projections evenly by
width (refusing KV heads that do not divide by the ranks) and hands DTensors around, while
pagedllm's paged attention wants whole heads per rank, a KV head replicated when there are fewer
KV heads than ranks, and plain local tensors. So inside an attention module (``_is_attention``: a
module with a ``head_dim``, ``head_size`` or ``layer_idx``) the split follows ``head_shard``: Q rows and the output projection's input columns
by this rank's query heads, K/V rows by its KV heads. Elsewhere (the MLP) a width splits into
``balanced_split`` ranges, the same for a colwise layer's output and the rowwise layer reading it.

Mixture-of-experts layers (``moe_tp_experts``: transformers slices every expert's width) are split
by expert instead, with ``--enable-expert-parallel`` (vLLM's flag): a rank holds a contiguous range
of whole experts (``moe.shard_experts``), computes the routed tokens' pairs that fall in it and one
all-reduce sums the ranks' parts; the router and any shared expert stay whole on every rank (the
plans do not split them), so each rank adds the same shared output once. Slicing experts by width
is not done: without the flag such a plan is refused naming it.

Any other style (fused or packed projections, gathered attention, sharded embeddings)
is refused naming ``--tensor-parallel-size`` and the model type, as is a config without a plan.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagedllm.models.hf_config import num_kv_heads
from pagedllm.models.layers.parallel import (ColumnParallelLinear, HeadShard, ParallelLMHead, ParallelLogits,
                                             RowParallelLinear, balanced_split, head_shard)

SHARDED_STYLES = frozenset({"colwise", "rowwise"})
WHOLE_STYLES = frozenset({"replicate", "replicated_with_grad_allreduce"})
# the experts module's style and its 3-D parameters' (never modules: not matched by name)
EXPERT_STYLES = frozenset({"moe_tp_experts", "packed_colwise"})
# attention attributes some transformers models read in forward; set to this rank's counts
_Q_ATTRS = ("num_heads", "num_attention_heads")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads")


def tensor_parallel_plan(config, tp_size: int, expert_parallel: bool = False) -> dict[str, str]:
    """The text config's ``base_model_tp_plan`` if pagedllm can serve it at ``tp_size`` ranks.

    Args:
        config: the model's (text) ``transformers`` config.
        tp_size: ranks in the tensor-parallel group.
        expert_parallel: ``--enable-expert-parallel``: experts modules are split by expert.
    Returns:
        ``{module pattern ("layers.*.mlp.up_proj"): style}``.
    Raises:
        ValueError: no plan, a hybrid model (its state layers are not split), or a style other
            than ``colwise``/``rowwise``/replicated (experts: with ``expert_parallel`` only; fewer
            experts than ranks); the message names ``--tensor-parallel-size`` and the model type.
    """
    from pagedllm.models.hybrid import hybrid_family
    what = f"--tensor-parallel-size {tp_size} with --model-impl transformers: model_type {config.model_type!r}"
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"{what} has no tensor-parallel plan (base_model_tp_plan) in transformers "
                         f"{__import__('transformers').__version__}; serve it with --tensor-parallel-size 1")
    if hybrid_family(config) is not None:
        raise ValueError(f"{what} is a hybrid model; its state layers are not split over ranks")
    experts = {s for s in plan.values() if s in EXPERT_STYLES}
    if experts and not expert_parallel:
        raise ValueError(f"{what} is a mixture of experts: its experts are split across ranks with "
                         "--enable-expert-parallel (whole experts per rank); slicing every expert is not done")
    if experts and _num_experts(config) < tp_size:
        raise ValueError(f"{what}: {_num_experts(config)} experts cannot be split over {tp_size} ranks")
    other = sorted({s for s in plan.values() if s not in SHARDED_STYLES | WHOLE_STYLES | EXPERT_STYLES})
    if other:
        raise ValueError(f"{what} has tensor-parallel styles {other}; pagedllm splits only plain "
                         f"'colwise'/'rowwise' linear layers (whole heads per rank)")
    return dict(plan)


def _num_experts(config) -> int:
    """Routed experts of a MoE config (``num_experts`` or ``num_local_experts``), 0 for none."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)


def _pattern(name: str) -> str:
    """``layers.3.mlp.up_proj`` -> ``layers.*.mlp.up_proj`` (the plan's key form)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)


def _ranges(shard: HeadShard, head_dim: int) -> dict[str, tuple[int, int]]:
    """``{"q": (first row, rows), "kv": ...}`` of an attention module's projections on this rank."""
    return {"q": (shard.q_start * head_dim, shard.q_heads * head_dim),
            "kv": (shard.kv_start * head_dim, shard.kv_heads * head_dim)}


def _attention_range(name: str, width: int, style: str, ranges: dict, q_width: int, kv_width: int):
    """This rank's ``(start, count)`` of a projection inside an attention module.

    Raises:
        ValueError: the width is neither the query heads' (nor, colwise, the KV heads') width, so
            the layer is a fused projection pagedllm cannot cut into whole heads.
    """
    if width == q_width:
        return ranges["q"]
    if style == "colwise" and width == kv_width:
        return ranges["kv"]
    raise ValueError(f"--tensor-parallel-size: {name} ({style}, width {width}) is not a per-head Q, K, V or "
                     f"output projection (query width {q_width}, KV width {kv_width}); fused projections "
                     "are not split")


def _is_attention(mod: nn.Module) -> bool:
    """Whether ``mod`` looks like an attention module. Broad on purpose: a layer taken for an
    attention projection that is none is refused (``_attention_range``), while an attention
    projection split as an MLP width could cut a head silently."""
    return any(hasattr(mod, a) for a in ("head_dim", "head_size", "layer_idx"))


def _split_linear(lin: nn.Linear, style: str, span: tuple[int, int]) -> nn.Module:
    """The local replacement of ``lin``: its rows ``span`` (colwise) or columns ``span`` (rowwise).

    ``lin.weight`` ``[out, in]`` (any float dtype and device; kept). Raises ValueError for a
    module that is not an ``nn.Linear``.
    """
    if type(lin) is not nn.Linear:
        raise ValueError(f"--tensor-parallel-size: {type(lin).__name__} is planned {style!r}; only nn.Linear "
                         "layers are split")
    w, b = lin.weight, lin.bias
    if style == "colwise":
        new = ColumnParallelLinear(lin.in_features, {"w": span}, b is not None)
    else:
        new = RowParallelLinear(span, lin.out_features, b is not None)
    new = new.to(device=w.device, dtype=w.dtype)
    new.load("weight", w.data, "w")
    if b is not None:
        new.load("bias", b.data, "w")
    return new


class GatheredLMHead(nn.Module):
    """An LM head split by vocabulary rows whose logits are gathered on rank 0.

    Shapes:
        ``x`` ``[..., hidden]`` -> ``[..., vocab]`` on rank 0 and ``[..., 0]`` on the other
        ranks (one gather of ``[..., ceil(vocab / tp)]`` per call), the weight's dtype.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        vocab, hidden = weight.shape
        self.table = ParallelLMHead(vocab, hidden).to(device=weight.device, dtype=weight.dtype)
        self.table.load("weight", weight.data)
        self._logits = ParallelLogits(self.table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., vocab]`` (rank 0) or ``[..., 0]``."""
        out = self._logits(x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], out.shape[-1])


def shard_transformers_model(hf: nn.Module, config, tp_size: int, rank: int,
                             expert_parallel: bool = False) -> HeadShard:
    """Split a loaded ``transformers`` causal LM in place: this rank keeps its slices only.

    Args:
        hf: the causal LM (``hf.base_model`` is what ``base_model_tp_plan`` describes).
        config: its text config (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``).
        tp_size, rank: the tensor-parallel group's size and this process's rank in it.
        expert_parallel: split experts modules by expert (``moe.shard_experts``).
    Returns:
        This rank's heads (``HeadShard``): the paged KV cache holds ``kv_heads`` heads per layer
        (all heads when the plan splits no attention projection, as Granite MoE's).
    Raises:
        ValueError: see ``tensor_parallel_plan`` and ``head_shard``; a planned layer that is not a
            per-head attention projection or an ``nn.Linear``; a plan that matches no module.
    """
    plan = tensor_parallel_plan(config, tp_size, expert_parallel)
    heads, kv_heads = config.num_attention_heads, num_kv_heads(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    shard = head_shard(heads, kv_heads, tp_size, rank)
    ranges = _ranges(shard, head_dim)
    base = hf.base_model
    matched = split_heads = 0
    for name, mod in list(base.named_modules()):
        style = plan.get(_pattern(name))
        if style is None or style in WHOLE_STYLES:
            continue
        if style in EXPERT_STYLES:
            from pagedllm.models.moe import shard_experts
            shard_experts(mod, tp_size, rank)
            matched += 1
            continue
        parent_name, _, child = name.rpartition(".")
        parent = base.get_submodule(parent_name)
        width = mod.out_features if style == "colwise" else mod.in_features
        if _is_attention(parent):  # whole heads
            span = _attention_range(name, width, style, ranges, heads * head_dim, kv_heads * head_dim)
            split_heads += 1
        else:
            span = balanced_split(width, tp_size, rank)
        setattr(parent, child, _split_linear(mod, style, span))
        matched += 1
    if not matched:
        raise ValueError(f"--tensor-parallel-size {tp_size}: the tensor-parallel plan of model_type "
                         f"{config.model_type!r} matched no module of {type(hf).__name__}")
    if not split_heads:  # attention replicated on every rank: its KV cache holds every head
        shard = HeadShard(0, heads, 0, kv_heads)
    _set_local_head_counts(base, shard)
    _split_head(hf)
    return shard


def _set_local_head_counts(base: nn.Module, shard: HeadShard) -> None:
    """Attention modules that keep head counts get this rank's (some models reshape by them)."""
    for mod in base.modules():
        if not _is_attention(mod):
            continue
        for attr in _Q_ATTRS:
            if isinstance(getattr(mod, attr, None), int):
                setattr(mod, attr, shard.q_heads)
        for attr in _KV_ATTRS:
            if isinstance(getattr(mod, attr, None), int):
                setattr(mod, attr, shard.kv_heads)
        if isinstance(getattr(mod, "num_key_value_groups", None), int):
            mod.num_key_value_groups = shard.q_heads // shard.kv_heads


def _split_head(hf: nn.Module) -> None:
    """Split ``hf.lm_head`` by vocabulary when the class plans it ``colwise_gather_output`` (a
    bias-free ``nn.Linear``); otherwise every rank keeps the whole head."""
    plan = getattr(hf, "_tp_plan", None) or getattr(type(hf), "_tp_plan", None) or {}
    head = getattr(hf, "lm_head", None)
    if plan.get("lm_head") == "colwise_gather_output" and type(head) is nn.Linear and head.bias is None:
        hf.lm_head = GatheredLMHead(head.weight)

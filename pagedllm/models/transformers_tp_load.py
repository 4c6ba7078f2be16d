"""Sharded loading for the Transformers backend's tensor parallelism: a rank reads only its slices.

``from_pretrained`` reads every tensor whole, so a rank of a TP group would hold the whole
checkpoint in memory before ``transformers_tp.shard_transformers_model`` drops the other ranks'
slices. Instead (the same order as the native models' loader, ``load.load_model``):

1. build the model from its config with every *parameter* on the meta device
   (``parameters_on_meta``); buffers are built for real, because they are computed at
   construction (rotary frequency tables) and are not in the checkpoint;
2. split it by its ``tp_plan`` (``shard_transformers_model``; on meta tensors that only sets shapes);
3. materialize each parameter on the device and fill it from safetensors (``load_sharded``): a
   split layer through its ``load``, which reads its rows or columns through a lazy
   ``safe_open(...).get_slice``; every other parameter whole.

Elements read = elements held (``tests/distributed/test_transformers_tp.py``).
"""

from __future__ import annotations

import re
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn

from pagedllm.models.layers.parallel import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                             VocabParallelEmbedding)


@contextmanager
def parameters_on_meta():
    """While open, ``nn.Module`` parameters are registered on the meta device (no memory, no
    initialization work); buffers are created as usual. Not thread-safe (patches
    ``nn.Module.register_parameter``), which loading on the engine's one execution thread allows."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _checkpoint_name(module_name: str, param: str, module: nn.Module) -> str:
    """The checkpoint key of ``module``'s ``param``: its own name, except that the vocabulary-split
    head (``transformers_tp.GatheredLMHead``) keeps its table one level down (``lm_head.table``)."""
    name = f"{module_name}.{param}" if module_name else param
    return name.replace(".table.", ".") if isinstance(module, ParallelLMHead) else name


class CheckpointTensors:
    """The tensors of a checkpoint's ``*.safetensors`` files by the names the model's parameters have:
    each key renamed by ``transformers``' checkpoint conversion rules of its ``model_type``
    (``WeightRenaming``: Mixtral's ``block_sparse_moe`` -> ``mlp``, Granite MoE's ``input_linear`` ->
    ``experts.gate_up_proj``); ``mergers`` are its rules that stack per-expert tensors
    (``WeightConverter`` of ``MergeModulelist``, then ``Concatenate``) as ``(sources, target)``.

    Source: transformers 5's ``conversion_mapping.py`` (the rules are read from it, not copied).
    """

    def __init__(self, handles: dict[str, object], model_type: str | None, experts=None) -> None:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        rules = list(get_checkpoint_conversion_mapping(model_type) or []) if model_type else []
        renames = [(a, b) for r in rules if type(r).__name__ == "WeightRenaming"
                   for a, b in zip(r.source_patterns, r.target_patterns)]
        self.mergers = [(list(r.source_patterns), r.target_patterns[0]) for r in rules
                        if type(r).__name__ == "WeightConverter" and len(r.target_patterns) == 1
                        and {type(o).__name__ for o in r.operations} <= {"MergeModulelist", "Concatenate"}]
        if not self.mergers:  # save_pretrained's per-expert form without a rule for it
            self.mergers = [([".experts.*.gate_proj.weight", ".experts.*.up_proj.weight"], ".experts.gate_up_proj"),
                            ([".experts.*.down_proj.weight"], ".experts.down_proj")]
        self._where: dict[str, tuple[object, str]] = {}
        for key, fh in handles.items():
            name = key
            for a, b in renames:
                name = re.sub(a, b, name)
            self._where[name] = (fh, key)
        for name in (experts.entries if experts else ()):  # gguf_experts: left in the GGUF file
            self._where.setdefault(name, (experts, name))

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get_slice(self, name: str):
        """A lazy slice (safetensors', or ``gguf_experts.ExpertSlice``) of the tensor the parameter
        ``name`` reads."""
        fh, key = self._where[name]
        return fh.get_slice(key)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor the parameter ``name`` reads."""
        fh, key = self._where[name]
        return fh.get_tensor(key)


def _stack_experts(p: torch.Tensor, key: str, where: CheckpointTensors, first: int = 0) -> nn.Parameter | None:
    """A fused experts tensor (``experts.gate_up_proj`` ``[E, 2I, H]``: each expert's gate rows then up
    rows; ``experts.down_proj`` ``[E, H, I]``) from a checkpoint that stores it per expert
    (``experts.0.gate_proj.weight``, as ``save_pretrained`` writes it; Mixtral's ``w1`` / ``w3`` / ``w2``),
    or ``None`` if it does not; ``first``: the checkpoint's expert in row 0 (an expert-parallel rank's
    range, ``moe.shard_experts``)."""
    for sources, target in where.mergers:
        if not key.endswith(target) or p.dim() != 3:
            continue
        prefix = key[:len(key) - len(target)]
        names = [[prefix + s.replace("*", str(first + e)) for s in sources] for e in range(p.shape[0])]
        if all(n in where for n in names[0]):
            out = torch.empty(p.shape, dtype=p.dtype)
            for e, parts in enumerate(names):
                out[e] = torch.cat([where.get_tensor(n) for n in parts])
            return nn.Parameter(out, requires_grad=False)
    return None


def load_sharded(hf: nn.Module, model_dir: str | Path, device: torch.device) -> None:
    """Materialize every meta parameter of the split model ``hf`` on ``device`` and fill it from the
    ``*.safetensors`` files of ``model_dir``, reading only this rank's slices of split layers.

    A parameter shared by two modules (tied embeddings left whole) is materialized once. A tied head
    absent from the checkpoint reads the input embedding's tensor.

    Expert parameters a GGUF conversion left in its file (``gguf_experts``) are read from there.

    Raises:
        ValueError: a parameter has no tensor in the checkpoint (the message names it).
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    embed = hf.get_input_embeddings()
    embed_name = next(n for n, m in hf.named_modules() if m is embed) + ".weight"
    from safetensors import safe_open
    with ExitStack() as stack:
        handles = {}
        for f in files:
            fh = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            handles.update((k, fh) for k in fh.keys())
        from pagedllm.models.gguf_experts import GGUFExperts
        where = CheckpointTensors(handles, getattr(hf.config, "model_type", None), GGUFExperts(model_dir))
        done: dict[int, nn.Parameter] = {}
        for module_name, module in hf.named_modules():
            for param_name, p in list(module.named_parameters(recurse=False)):
                if p.device.type != "meta":
                    continue
                if id(p) in done:
                    module._parameters[param_name] = done[id(p)]
                    continue
                key = _checkpoint_name(module_name, param_name, module)
                if key not in where and key.endswith("lm_head.weight") and embed_name in where:
                    key = embed_name  # tied head: the checkpoint stores the table once
                ep = getattr(module, "pagedllm_ep", None)  # (first expert, experts, all) on this rank
                first = ep[0] if ep is not None else 0
                if key not in where and (stacked := _stack_experts(p, key, where, first)) is not None:
                    module._parameters[param_name] = done[id(p)] = stacked.to(device)
                    continue
                if key not in where:
                    raise ValueError(f"--tensor-parallel-size: the checkpoint in {model_dir} has no tensor "
                                     f"{key!r} for the Transformers backend's {type(hf).__name__}")
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False)
                module._parameters[param_name] = done[id(p)] = new
                source = where.get_slice(key)
                if isinstance(module, ColumnParallelLinear):
                    module.load(param_name, source, "w")
                elif isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
                    module.load(param_name, source)
                elif ep is not None and p.dim() and source.get_shape()[0] == ep[2]:  # this rank's experts
                    new.data.copy_(source[first:first + p.shape[0]])
                else:
                    new.data.copy_(source[:])

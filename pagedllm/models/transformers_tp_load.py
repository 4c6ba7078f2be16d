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


def _stack_experts(p: torch.Tensor, key: str, where: dict) -> nn.Parameter | None:
    """A fused experts tensor (``experts.gate_up_proj`` ``[E, 2I, H]``: each expert's gate rows then up
    rows; ``experts.down_proj`` ``[E, H, I]``) from a checkpoint that stores it per expert
    (``experts.0.gate_proj.weight``, as ``save_pretrained`` writes it), or ``None`` if it does not."""
    prefix, _, name = key.rpartition(".")
    parts = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}.get(name)
    if parts is None or p.dim() != 3 or f"{prefix}.0.{parts[0]}.weight" not in where:
        return None
    out = torch.empty(p.shape, dtype=p.dtype)
    for e in range(p.shape[0]):
        out[e] = torch.cat([where[k].get_tensor(k) for k in (f"{prefix}.{e}.{q}.weight" for q in parts)])
    return nn.Parameter(out, requires_grad=False)


def load_sharded(hf: nn.Module, model_dir: str | Path, device: torch.device) -> None:
    """Materialize every meta parameter of the split model ``hf`` on ``device`` and fill it from the
    ``*.safetensors`` files of ``model_dir``, reading only this rank's slices of split layers.

    A parameter shared by two modules (tied embeddings left whole) is materialized once. A tied head
    absent from the checkpoint reads the input embedding's tensor.

    Raises:
        ValueError: a parameter has no tensor in the checkpoint (the message names it).
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    embed = hf.get_input_embeddings()
    embed_name = next(n for n, m in hf.named_modules() if m is embed) + ".weight"
    from safetensors import safe_open
    with ExitStack() as stack:
        where = {}
        for f in files:
            fh = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            where.update((k, fh) for k in fh.keys())
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
                if key not in where and (stacked := _stack_experts(p, key, where)) is not None:
                    module._parameters[param_name] = done[id(p)] = stacked.to(device)
                    continue
                if key not in where:
                    raise ValueError(f"--tensor-parallel-size: the checkpoint in {model_dir} has no tensor "
                                     f"{key!r} for the Transformers backend's {type(hf).__name__}")
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False)
                module._parameters[param_name] = done[id(p)] = new
                source = where[key].get_slice(key)
                if isinstance(module, ColumnParallelLinear):
                    module.load(param_name, source, "w")
                elif isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
                    module.load(param_name, source)
                else:
                    new.data.copy_(source[:])

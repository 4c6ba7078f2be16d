"""Pipeline parallelism: the decoder layers split into stages, one per rank (GPipe, Huang et al. 2019,
without micro-batches; shaped as vLLM's ``make_layers`` / ``IntermediateTensors``).

Stage ``r`` holds layers ``[first, last)`` (``stage_layers``; earlier stages take the extra layer
when the split is uneven), stage 0 the embedding, the last stage the final norm and the LM head
(and the embedding too when tied). Per step, stage ``r`` receives the hidden state and residual
``[2, T, hidden]`` from stage ``r - 1``, runs its layers and sends them on; the last stage
computes the ``[R, vocab]`` float32 logits of the requested rows and sends them back to rank 0,
which samples (and broadcasts the tokens, as in tensor parallelism). Every stage keeps the KV
cache of its own layers only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.distributed.parallel_state import get_pp_rank, get_pp_size, pp_recv, pp_send


def stage_layers(num_layers: int) -> tuple[int, int]:
    """``(first, end)`` global layer indices of this rank's stage (``(0, num_layers)`` without a pipeline).

    Raises:
        ValueError: fewer layers than stages (the message names ``--pipeline-parallel-size``).
    """
    size, rank = get_pp_size(), get_pp_rank()
    if num_layers < size:
        raise ValueError(f"--pipeline-parallel-size {size} needs at least one layer per stage; "
                         f"the model has {num_layers}")
    base, extra = divmod(num_layers, size)
    first = rank * base + min(rank, extra)
    return first, first + base + (rank < extra)


def stage_roles(tied: bool) -> tuple[bool, bool, bool]:
    """``(holds the embedding, is the first stage, is the last stage)`` of this rank."""
    rank, size = get_pp_rank(), get_pp_size()
    first, last = rank == 0, rank == size - 1
    return first or (last and tied), first, last


def stage_weights(model, weights):
    """Keep the checkpoint tensors of this stage, renamed to its local layer indices.

    Args:
        model: a ``LlamaForCausalLM`` built for this stage (``first_layer``, ``layers``,
            ``embed_tokens`` / ``norm`` / ``lm_head`` ``None`` where the stage has none).
        weights: ``(name, tensor or safetensors slice)``; a kept slice is read whole here.
    Yields:
        ``(name, tensor)`` with ``layers.<local index>`` names.
    """
    n = len(model.layers)
    for name, source in weights:
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers":
            i = int(parts[1]) - model.first_layer
            if not 0 <= i < n:
                continue
            parts[1] = str(i)
        elif parts[0] == "embed_tokens" and model.embed_tokens is None:
            continue
        elif parts[0] in ("norm", "lm_head") and not model.is_last_stage:
            continue
        yield ".".join(parts), source if isinstance(source, torch.Tensor) else source[:]


def pipeline_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                     logits_indices: torch.Tensor) -> torch.Tensor:
    """One step of this stage (``LlamaForCausalLM.forward``'s arguments; ``kv_caches``: this stage's layers).

    Returns:
        ``[R, vocab]`` float32 logits on rank 0; ``[R, 0]`` on the other stages.
    """
    rank, size = get_pp_rank(), get_pp_size()
    t, hidden, dev = input_ids.shape[0], model.config.hidden_size, input_ids.device
    dtype = model.layers[0].input_layernorm.weight.dtype
    if rank == 0:
        x, residual = model.embed_tokens(input_ids), None
    else:
        x, residual = pp_recv((2, t, hidden), dtype, rank - 1, dev).unbind(0)
    rope = model.rotary.prepare(positions, x.dtype)
    for layer, kv in zip(model.layers, kv_caches):
        x, residual = layer(rope, x, residual, kv, meta)
    r = logits_indices.shape[0]
    if rank < size - 1:
        pp_send(torch.stack((x, residual)), rank + 1)
        if rank == 0:
            return pp_recv((r, model.config.vocab_size), torch.float32, size - 1, dev)
        return x.new_empty(r, 0)
    x, _ = model.norm(x.index_select(0, logits_indices), residual.index_select(0, logits_indices))
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    logits = F.linear(x, w).float()
    if rank == 0:
        return logits
    pp_send(logits, 0)
    return logits.new_empty(r, 0)

"""Pipeline parallelism: the decoder layers split into stages, one per rank (GPipe, Huang et al. 2019,
without micro-batches; shaped as vLLM's ``make_layers`` / ``IntermediateTensors``).

Stage ``r`` holds layers ``[first, end)`` (``stage_layers``; earlier stages take the extra layer
when the split is uneven); rank 0 also holds both ends, the embedding and the final norm with the
LM head, so the pipeline is a ring: per step, each stage receives the residual stream
``[T, hidden]`` from the stage before, runs its layers and sends it on; the last stage sends only
the ``[R, hidden]`` rows whose logits are needed back to rank 0, which computes the logits and
samples (and broadcasts the tokens, as in tensor parallelism). Per token that is one hidden row
per stage boundary, not a row of logits. Every stage keeps the KV cache of its own layers only.

With tensor parallelism inside each stage (Narayanan et al. 2021, section 2.3) a "stage" is a TP
group: its ranks all-reduce inside the group, so after each row-parallel layer every rank of the
stage holds the whole residual stream, and each sends it on to the rank at its own TP position in
the next stage (``pp_send``/``pp_recv`` address stages, ``parallel_state.pp_peer`` the rank). The
ring closes at stage 0, whose TP group holds the vocabulary-parallel embedding and LM head:
the last stage's ranks send the ``[R, hidden]`` rows back to their stage-0 peers, which compute
their vocabulary rows' logits, gathered on rank 0 (``ParallelLogits``). Sending the full hidden
state from every TP rank costs ``tp`` times the bytes of vLLM's scattered send plus all-gather,
and saves a collective per boundary; for a tied embedding it also keeps one copy of the table.
"""

from __future__ import annotations

import torch

from pagedllm.distributed.parallel_state import get_pp_rank, get_pp_size, get_tp_size, pp_recv, pp_send


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


def holds_ends() -> bool:
    """Whether this rank holds the embedding, the final norm and the LM head (rank 0 does)."""
    return get_pp_rank() == 0


def stage_weights(model, weights):
    """Keep the checkpoint tensors of this stage, renamed to its local layer indices.

    Args:
        model: a ``LlamaForCausalLM`` built for this stage (``first_layer``, ``layers``;
            ``embed_tokens``, ``norm`` and ``lm_head`` only on rank 0).
        weights: ``(name, tensor or safetensors slice)``; without tensor parallelism a kept slice is
            read whole here, with it the slice stays lazy (each TP rank reads only its part).
    Yields:
        ``(name, tensor or slice)`` with ``layers.<local index>`` names.
    """
    n, ends, lazy = len(model.layers), holds_ends(), get_tp_size() > 1
    for name, source in weights:
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers":
            i = int(parts[1]) - model.first_layer
            if not 0 <= i < n:
                continue
            parts[1] = str(i)
        elif parts[0] in ("embed_tokens", "norm", "lm_head") and not ends:
            continue
        yield ".".join(parts), source if lazy or isinstance(source, torch.Tensor) else source[:]


def pipeline_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                     logits_indices: torch.Tensor) -> torch.Tensor:
    """One step of this stage (``LlamaForCausalLM.forward``'s arguments; ``kv_caches``: this stage's layers).

    Rank 0 embeds, runs its layers and sends the hidden state ``[T, hidden]`` (the residual stream,
    ``x + residual``) on; each stage runs its layers on it (a stage's first layer takes it as a
    first layer takes the embeddings); the last sends the ``[R, hidden]`` rows of
    ``logits_indices`` back to rank 0, which applies the final norm and the LM head. With tensor
    parallelism every rank does this at its TP position; stage 0's TP group computes the logits
    (``LlamaForCausalLM._logits``: vocabulary-parallel, gathered on rank 0).

    Returns:
        ``[R, vocab]`` float32 logits on rank 0; ``[R, 0]`` on every other rank.
    """
    rank, size = get_pp_rank(), get_pp_size()
    t, hidden, dev = input_ids.shape[0], model.config.hidden_size, input_ids.device
    dtype = model.layers[0].input_layernorm.weight.dtype
    x = model.embed_tokens(input_ids) if rank == 0 else pp_recv((t, hidden), dtype, rank - 1, dev)
    residual = None
    rope = model.rotary.prepare(positions, x.dtype)
    for layer, kv in zip(model.layers, kv_caches):
        x, residual = layer(rope, x, residual, kv, meta)
    stream = x + residual
    if rank < size - 1:
        pp_send(stream, rank + 1)
    else:
        pp_send(stream.index_select(0, logits_indices), 0)
    if rank != 0:
        return x.new_empty(logits_indices.shape[0], 0)
    rows = pp_recv((logits_indices.shape[0], hidden), dtype, size - 1, dev)
    return model._logits(model.norm(rows))

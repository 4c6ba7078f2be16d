"""Pipeline parallelism: the decoder layers split into stages, one per rank (GPipe, Huang et al. 2019,
micro-batched inside each step; shaped as vLLM's ``make_layers`` / ``IntermediateTensors``).

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

Micro-batches (GPipe's, for a forward only): the step's requests are cut into ``M`` runs of whole
requests (``distributed/micro_batch.py``, ``--pipeline-micro-batches``) and each stage takes them
in turn: stage 0 runs micro-batch 0's layers, starts sending it (``pp_isend``, non-blocking) and
goes on with micro-batch 1 while stage 1 runs micro-batch 0, and so on; a stage posts the receive
of micro-batch ``k + 1`` before computing ``k``. Every send is waited before the step returns (its
buffer is then free). Rank 0 receives each micro-batch's ``[R_k, hidden]`` final rows from the
last stage, puts them back in ``logits_indices`` order and runs the norm and LM head once. With
``S`` stages and ``M`` micro-batches a step's pipeline is busy ``M / (M + S - 1)`` of the time
instead of ``1 / S``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.distributed.micro_batch import MicroBatch, micro_batches_of
from pagedllm.distributed.parallel_state import get_pp_rank, get_pp_size, get_tp_size, pp_irecv, pp_isend, pp_wait

# when a list, each stage call appends ``(event, micro-batch, sends in flight)`` to it, and each
# launch / finish ``("launch" or "finish", step number, 0)`` (tests)
PIPELINE_TRACE: list[tuple[str, int, int]] | None = None


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


def _trace(event: str, k: int, in_flight: int) -> None:
    """Record a pipeline event while ``PIPELINE_TRACE`` is a list (a test counts them)."""
    if PIPELINE_TRACE is not None:
        PIPELINE_TRACE.append((event, k, in_flight))


def _run_layers(model, x: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
    """This stage's layers on ``x`` ``[t, hidden]`` (embeddings or the previous stage's stream);
    returns the residual stream ``[t, hidden]`` (``x + residual`` after the last layer)."""
    residual = None
    rope = model.rotary.prepare(positions, x.dtype)
    for layer, kv in zip(model.layers, kv_caches):
        x, residual = layer(rope, x, residual, kv, meta)
    return x + residual


def _logits_rows(mbs: list[MicroBatch], logits_indices: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per micro-batch ``(positions in logits_indices, rows local to the micro-batch)``, int64 each:
    where its logits go in the step's ``[R, vocab]`` and which of its rows the last stage sends."""
    out = []
    for mb in mbs:
        pick = torch.nonzero((logits_indices >= mb.start) & (logits_indices < mb.end)).flatten()
        out.append((pick, logits_indices.index_select(0, pick) - mb.start))
    return out


# tags of one step's messages: ``step slot * TAG_STRIDE + micro-batch`` (the slot cycles, so two
# steps in flight never share a tag whatever order the transport matches messages in)
TAG_STRIDE, TAG_SLOTS = 1024, 4


@dataclass
class LaunchedStep:
    """A pipelined step this stage has issued but whose logits it has not taken yet.

    Attributes:
        sends: ``(buffer, work)`` per send in flight (each buffer lives until its wait).
        back: rank 0 only: ``(tensor, work)`` per micro-batch, its final rows from the last stage.
        rows: per micro-batch ``(positions in logits_indices, local rows)`` (``_logits_rows``).
        num_rows: ``R``, the step's logits rows.
        dtype, device: of the residual stream.
        seq: this stage's launch count before it (the step's number, the same on every rank).
    """

    sends: list
    back: list
    rows: list
    num_rows: int
    dtype: torch.dtype
    device: torch.device
    seq: int


def pipeline_launch(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                    logits_indices: torch.Tensor) -> LaunchedStep:
    """Issue one step on this stage, micro-batch by micro-batch, without waiting for its logits
    (``LlamaForCausalLM.forward``'s arguments; ``kv_caches``: this stage's layers; ``meta``: a
    ``MicroBatchedMetadata`` or one backend metadata).

    Rank 0 embeds each micro-batch, runs its layers and sends the hidden state ``[t_k, hidden]``
    (the residual stream) on; each stage runs its layers on it (a stage's first layer takes it as a
    first layer takes the embeddings); the last sends micro-batch ``k``'s rows of
    ``logits_indices`` back to rank 0. With tensor parallelism every rank does this at its TP
    position (``model.pp_launches`` counts the launches). Sends are non-blocking (``pp_isend``) and waited in ``pipeline_finish``, so rank 0 can
    issue the next step's first stage while the other stages still run this one (several steps in
    flight: ``ModelRunner`` with ``pipeline_overlap``). Every rank launches and finishes the same
    steps in the same order; each launch takes the next tag slot (``TAG_STRIDE``).

    Raises:
        RuntimeError: a peer's send or receive failed (``torch.distributed``; a dead rank).
    """
    rank, size = get_pp_rank(), get_pp_size()
    hidden, dev = model.config.hidden_size, input_ids.device
    dtype = model.layers[0].input_layernorm.weight.dtype
    seq = model.pp_launches
    model.pp_launches += 1
    base = TAG_STRIDE * (seq % TAG_SLOTS)
    _trace("launch", seq, 0)
    mbs = micro_batches_of(meta, input_ids.shape[0])
    rows = _logits_rows(mbs, logits_indices)
    # rank 0 posts the returns first: the last stage's sends complete as soon as they are made
    back = [pp_irecv((pick.shape[0], hidden), dtype, size - 1, dev, tag=base + k) for k, (pick, _) in enumerate(rows)] \
        if rank == 0 else []
    recv = pp_irecv((mbs[0].end - mbs[0].start, hidden), dtype, rank - 1, dev, tag=base) if rank > 0 else None
    sends = []
    for k, mb in enumerate(mbs):
        if rank == 0:
            x = model.embed_tokens(input_ids[mb.start:mb.end])
        else:
            x, work = recv
            pp_wait(work)
            if k + 1 < len(mbs):  # the next micro-batch arrives while this one computes
                nxt = mbs[k + 1]
                recv = pp_irecv((nxt.end - nxt.start, hidden), dtype, rank - 1, dev, tag=base + k + 1)
        _trace("compute", k, len(sends))
        stream = _run_layers(model, x, positions[mb.start:mb.end], kv_caches, mb.meta)
        out = stream if rank < size - 1 else stream.index_select(0, rows[k][1])
        sends.append((out, pp_isend(out, (rank + 1) % size, tag=base + k)))
        _trace("send", k, len(sends))
    return LaunchedStep(sends, back, rows, logits_indices.shape[0], dtype, dev, seq)


def pipeline_finish(model, launched: LaunchedStep) -> torch.Tensor:
    """Wait for a launched step's sends and, on rank 0, its final rows; apply the final norm and the
    LM head to them (stage 0's TP group computes the logits: ``LlamaForCausalLM._logits``,
    vocabulary-parallel, gathered on rank 0).

    Returns:
        ``[R, vocab]`` float32 logits on rank 0, in ``logits_indices`` order; ``[R, 0]`` on every other rank.
    Raises:
        RuntimeError: a peer's send or receive failed.
    """
    _trace("finish", launched.seq, 0)
    for _, work in launched.sends:
        pp_wait(work)
    if get_pp_rank() != 0:
        return torch.empty(launched.num_rows, 0, dtype=torch.float32, device=launched.device)
    final = torch.empty(launched.num_rows, model.config.hidden_size, dtype=launched.dtype, device=launched.device)
    for k, ((part, work), (pick, _)) in enumerate(zip(launched.back, launched.rows)):
        pp_wait(work)
        _trace("receive", k, 0)
        final.index_copy_(0, pick, part)
    return model._logits(model.norm(final))


def pipeline_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                     logits_indices: torch.Tensor) -> torch.Tensor:
    """One whole step of this stage: ``pipeline_finish(pipeline_launch(...))``.

    Returns:
        ``[R, vocab]`` float32 logits on rank 0, in ``logits_indices`` order; ``[R, 0]`` on every other rank.
    Raises:
        RuntimeError: a peer's send or receive failed (``torch.distributed``; a dead rank).
    """
    return pipeline_finish(model, pipeline_launch(model, input_ids, positions, kv_caches, meta, logits_indices))

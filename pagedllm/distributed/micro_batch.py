"""A pipelined step's micro-batches: its requests cut into contiguous groups, each with its own
attention metadata (GPipe, Huang et al. 2019, section 2; for inference as in Narayanan et al. 2021,
section 2.2, without a backward pass).

The runner describes a step once as an ``AttentionBatch``; with a pipeline of several stages
``step_metadata`` cuts its requests into at most ``get_pp_micro_batches()`` runs of whole requests
(a request is never split: its attention needs all its query rows in one call), balanced by tokens,
and asks the backend for each run's metadata (``attention.metadata.slice_batch``). Every rank
applies the same ``SchedulerOutput`` to the same batch, so every rank cuts the step the same way
without talking. ``pipeline_forward`` (``models/layers/pipeline.py``) then runs the pieces as a
pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedllm.attention.metadata import AttentionBatch, slice_batch
from pagedllm.distributed.parallel_state import get_pp_micro_batches


@dataclass
class MicroBatch:
    """One micro-batch of a step.

    Attributes:
        start, end: its rows ``[start, end)`` of the step's flattened batch (tokens).
        meta: the attention backend's metadata of just these rows (rows renumbered from 0).
    """

    start: int
    end: int
    meta: object


@dataclass
class MicroBatchedMetadata:
    """A step's metadata when it runs as several micro-batches (what the model gets as ``meta``).

    Attributes:
        micro_batches: in request order; their row ranges tile ``[0, T)``.
    """

    micro_batches: list[MicroBatch]


def split_requests(query_start_loc: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """Cut ``R`` requests into ``min(parts, R)`` non-empty runs ``[(first, end), ...]`` of whole
    requests, each boundary at the request boundary nearest to an equal share of the tokens.

    Args:
        query_start_loc: ``[R + 1]`` int64 cumulative query lengths.
        parts: micro-batches wanted (>= 1).
    Raises:
        ValueError: ``parts`` below 1 or no requests.
    """
    r = query_start_loc.shape[0] - 1
    if parts < 1 or r < 1:
        raise ValueError(f"cannot cut {r} requests into {parts} micro-batches")
    m = min(parts, r)
    total = float(query_start_loc[-1])
    cuts = [0]
    for k in range(1, m):
        c = int(np.abs(query_start_loc - total * k / m).argmin())  # nearest request boundary
        # at least one request in this run and in each run left
        cuts.append(min(max(c, cuts[-1] + 1), r - (m - k)))
    cuts.append(r)
    return list(zip(cuts[:-1], cuts[1:]))


def step_metadata(backend, batch: AttentionBatch):
    """The step's metadata: ``backend.build_metadata(batch)`` when it runs whole (no pipeline,
    ``--pipeline-micro-batches 1``, or one request), else a ``MicroBatchedMetadata`` whose pieces
    each have the backend's metadata of their requests.
    """
    parts = get_pp_micro_batches()
    if parts == 1 or batch.seq_lens.shape[0] == 1:
        return backend.build_metadata(batch)
    qsl = batch.query_start_loc
    return MicroBatchedMetadata([MicroBatch(int(qsl[a]), int(qsl[b]), backend.build_metadata(slice_batch(batch, a, b)))
                                 for a, b in split_requests(qsl, parts)])


def micro_batches_of(meta, num_tokens: int) -> list[MicroBatch]:
    """The step's micro-batches: those of a ``MicroBatchedMetadata``, else the whole step as one."""
    if isinstance(meta, MicroBatchedMetadata):
        return meta.micro_batches
    return [MicroBatch(0, num_tokens, meta)]

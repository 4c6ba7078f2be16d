"""Pooling in the runner: which rows of a step a pooling request needs, and how they become one vector.

A pooling request whose prompt is computed this step needs its final hidden states
(after the model's last norm): ``CLS`` the first row, ``LAST`` the last, ``MEAN`` all of them
(Reimers & Gurevych 2019). ``CLS`` and ``MEAN`` need the whole prompt in this step (encoder
models get it so; a causal LM pools ``LAST`` only, see ``PoolingParams.resolved``). Then,
as vLLM's pooler: optional Matryoshka truncation to ``dimensions``, then L2 normalization. A
cross-encoder's rows are its classifier's logits (``EncoderModel.forward``), which take the
model's activation instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.pooling_params import PoolingParams


@dataclass
class PoolingSpan:
    """One pooling request of a step.

    Attributes:
        req_id: its request id.
        first, count: its rows among the hidden states handed to ``pool`` (``count`` rows from ``first``).
        params: its resolved ``PoolingParams``.
    """

    req_id: str
    first: int
    count: int
    params: PoolingParams


def hidden_rows(req_ids: list[str], params: list[PoolingParams], q_start: np.ndarray, q_end: np.ndarray,
                num_computed: np.ndarray) -> tuple[np.ndarray, list[PoolingSpan]]:
    """The rows of the flattened batch whose hidden states the step's pooling requests need.

    Args:
        req_ids, params: the pooling requests that finish their prompt this step.
        q_start, q_end: ``[P]`` int64 their rows in the flattened batch.
        num_computed: ``[P]`` int64 tokens each had computed before this step.
    Returns:
        ``([N] int64 rows, spans)`` with each request's rows at ``span.first`` in that order.
    Raises:
        ValueError: ``CLS`` or ``MEAN`` for a prompt not computed whole in this step.
    """
    rows, spans, n = [], [], 0
    for rid, p, a, b, c in zip(req_ids, params, q_start.tolist(), q_end.tolist(), num_computed.tolist()):
        if p.pooling_type == "LAST":
            r = np.array([b - 1], dtype=np.int64)
        elif c != 0:
            raise ValueError(f"{p.pooling_type} pooling needs the whole prompt in one step ({rid} had {c} "
                             "tokens computed before)")
        else:
            r = np.array([a], dtype=np.int64) if p.pooling_type == "CLS" else np.arange(a, b, dtype=np.int64)
        rows.append(r)
        spans.append(PoolingSpan(rid, n, len(r), p))
        n += len(r)
    return (np.concatenate(rows) if rows else np.zeros(0, np.int64)), spans


def token_type_rows(params: list, qsl: np.ndarray) -> torch.Tensor | None:
    """The step's token types for an encoder: 1 from each cross-encoder pair's second text on.

    Args:
        params: ``[R]`` the step's requests' ``PoolingParams`` (each prompt whole in the step).
        qsl: ``[R + 1]`` int64 their cumulative row counts.
    Returns:
        ``[T]`` int64 token types (BERT's ``token_type_ids`` on the flattened batch), or ``None``
        when no request is a pair (all 0).
    """
    starts = [(i, p.token_type_start) for i, p in enumerate(params)
              if p is not None and p.token_type_start is not None]
    if not starts:
        return None
    types = np.zeros(int(qsl[-1]), dtype=np.int64)
    for i, first in starts:
        types[qsl[i] + first:qsl[i + 1]] = 1
    return torch.from_numpy(types)


def pool(hidden: torch.Tensor, spans: list[PoolingSpan]) -> dict[str, list[float]]:
    """Each span's vector.

    Args:
        hidden: ``[N, H]`` float32 final hidden states of the rows ``hidden_rows`` chose.
        spans: the requests and their rows.
    Returns:
        request id -> the pooled vector (``dimensions`` or ``H`` Python floats of float32 values).
    """
    out = {}
    for s in spans:
        h = hidden[s.first:s.first + s.count]
        v = h[0] if s.params.pooling_type in ("CLS", "LAST") else h.mean(0)
        if s.params.dimensions is not None:
            v = v[:s.params.dimensions]
        if s.params.normalize:
            v = F.normalize(v, p=2, dim=0)
        if s.params.activation == "sigmoid":  # a cross-encoder's logits (vLLM's and CrossEncoder's activation)
            v = v.sigmoid()
        elif s.params.activation == "softmax":
            v = v.softmax(0)
        out[s.req_id] = v.float().tolist()
    return out

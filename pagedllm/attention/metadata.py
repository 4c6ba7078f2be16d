"""What every paged attention backend gets from the runner, and the metadata they share.

The runner describes a step once, backend-neutrally, as an ``AttentionBatch``
(numpy arrays of the flattened batch and the persistent block table). The
chosen backend turns it into its own metadata with ``build_metadata``; that
object is built once per step and shared by all layers. ``AttentionMetadata``
holds the fields both CPU backends read (and the fused batch-1 decode stack of
``models/llama.py``); a backend adds its private layout in a subclass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionBatch:
    """One step's flattened batch as attention sees it (built by the model runner).

    ``R`` requests are scheduled, with ``T`` tokens in all; request ``i`` owns rows
    ``query_start_loc[i]:query_start_loc[i + 1]`` of the flattened batch.

    Attributes:
        query_start_loc: ``[R + 1]`` int64 cumulative query lengths (rows).
        num_computed: ``[R]`` int64 tokens already in the cache before this step.
        seq_lens: ``[R]`` int64 context lengths after this step (tokens).
        slot_mapping: ``[T]`` int64 cache slot (``block_id * block_size + offset``) that each
            token's K/V is written to.
        block_table: the runner's persistent ``[max_num_reqs, max_blocks_per_req]`` int64 block
            table; only read (a backend copies the rows it needs at ``build_metadata``).
        rows: ``[R]`` int64 row of ``block_table`` of each request.
        block_size: tokens per KV block.
        bidirectional: per request, the ``(start, end)`` positions of the images whose tokens attend
            to each other both ways (Gemma 3's image-prefix attention, issue 41), or ``None``: causal
            everywhere. Only prefills read it: an image is never split across steps.
    """

    query_start_loc: np.ndarray
    num_computed: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    block_table: np.ndarray
    rows: np.ndarray
    block_size: int
    bidirectional: list[tuple[tuple[int, int], ...]] | None = None


@dataclass
class PrefillSeq:
    """One request computing more than one token this step.

    Attributes:
        q_start, q_end: its rows in the flattened batch (tokens).
        num_computed: tokens already cached before this step.
        gather_slots: ``[seq_len]`` int64 cache slots of all its tokens, in order.
        bidirectional: ``(start, end)`` positions of the spans (images) within which queries also
            see later keys (``AttentionBatch.bidirectional``); empty: causal.
    """

    q_start: int
    q_end: int
    num_computed: int
    gather_slots: torch.Tensor
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass
class AttentionMetadata:
    """The step's paged layout that the CPU backends share, on the model's device.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, the cache slot each scheduled token's K/V is written to.
        decode_token_idx: ``[num_decodes]`` int64 rows of one-token requests.
        decode_block_tables: ``[num_decodes, nblk]`` int64 contiguous block tables of the decodes,
            cut to the longest one's ``nblk`` blocks (entries past a table's end are any valid block id).
        decode_seq_lens: ``[num_decodes]`` int64 context lengths of the decodes, this token included.
        prefills: requests with more than one query token.
    """

    slot_mapping: torch.Tensor
    decode_token_idx: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefills: list[PrefillSeq]


def paged_fields(batch: AttentionBatch, device: torch.device) -> dict:
    """The ``AttentionMetadata`` fields of ``batch`` as keyword arguments, tensors on ``device``.

    Decodes are the requests with one query token; every other request is a ``PrefillSeq``
    whose ``gather_slots`` list its whole context. Every tensor is a fresh copy of the
    batch's arrays, so the runner may change its slots while this step still runs.
    """
    bs, qsl = batch.block_size, batch.query_start_loc
    n = qsl[1:] - qsl[:-1]
    dec = np.flatnonzero(n == 1)
    dec_len = batch.seq_lens[dec]
    nblk = -(-int(dec_len.max()) // bs) if dec.size else 0
    dec_tables = batch.block_table[batch.rows[dec], :nblk]                      # [D, nblk], a copy
    prefills = []
    for i in np.flatnonzero(n > 1).tolist():
        ar = np.arange(batch.seq_lens[i], dtype=np.int64)
        gather = batch.block_table[batch.rows[i], ar // bs] * bs + ar % bs
        prefills.append(PrefillSeq(int(qsl[i]), int(qsl[i + 1]), int(batch.num_computed[i]),
                                   torch.from_numpy(gather).to(device),
                                   tuple(batch.bidirectional[i]) if batch.bidirectional is not None else ()))
    return dict(slot_mapping=torch.from_numpy(batch.slot_mapping).to(device),
                decode_token_idx=torch.from_numpy(qsl[dec]).to(device),
                decode_block_tables=torch.from_numpy(dec_tables).to(device),
                decode_seq_lens=torch.from_numpy(dec_len).to(device),
                prefills=prefills)


def slice_batch(batch: AttentionBatch, start: int, end: int) -> AttentionBatch:
    """Requests ``[start, end)`` of ``batch`` as a batch of their own (a pipeline micro-batch).

    Its rows are renumbered from 0: ``query_start_loc`` ``[end - start + 1]`` int64 starts at 0 and
    ``slot_mapping`` keeps only those requests' ``qsl[end] - qsl[start]`` tokens; ``num_computed``,
    ``seq_lens`` and ``rows`` (block table rows) are the requests' entries; the persistent
    ``block_table`` is shared, not copied (a backend reads only the rows named). Views, no copies.

    Raises:
        ValueError: an empty or out-of-range request range.
    """
    r = batch.seq_lens.shape[0]
    if not 0 <= start < end <= r:
        raise ValueError(f"request range [{start}, {end}) is empty or outside the batch's {r} requests")
    qsl = batch.query_start_loc
    t0, t1 = int(qsl[start]), int(qsl[end])
    return AttentionBatch(query_start_loc=qsl[start:end + 1] - t0, num_computed=batch.num_computed[start:end],
                          seq_lens=batch.seq_lens[start:end], slot_mapping=batch.slot_mapping[t0:t1],
                          block_table=batch.block_table, rows=batch.rows[start:end], block_size=batch.block_size,
                          bidirectional=None if batch.bidirectional is None else batch.bidirectional[start:end])

"""Per-step attention metadata: how the flattened batch maps onto the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSeq:
    """One request computing more than one token this step.

    Attributes:
        q_start, q_end: its rows in the flattened batch (tokens).
        num_computed: tokens already cached before this step.
        gather_slots: ``[seq_len]`` int64 cache slots of all its tokens, in order.
    """

    q_start: int
    q_end: int
    num_computed: int
    gather_slots: torch.Tensor


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, cache slot (block_id * block_size + offset)
            that each scheduled token's K/V is written to.
        block_tables: ``[num_reqs, max_blocks]`` int32, padded with 0.
        query_start_loc: ``[num_reqs + 1]`` int32 cumulative query lengths.
        seq_lens: ``[num_reqs]`` int32 context lengths after this step (tokens).
        decode_token_idx: ``[num_decodes]`` int64 rows of one-token requests.
        decode_block_tables: ``[num_decodes, nblk]`` int64 block tables of the decodes, cut to
            the longest one's ``nblk`` blocks (entries past a table's end are any valid block id).
        decode_mask: ``[num_decodes, 1, 1, nblk * block_size]`` bool, True where a position is
            inside its request's context; ``None`` when every decode fills all ``nblk`` blocks.
        prefills: requests with more than one query token.
        decode_seq_lens: ``[num_decodes]`` int64 context lengths of the decodes (for sliding windows).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    decode_token_idx: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSeq]
    decode_seq_lens: torch.Tensor | None = None

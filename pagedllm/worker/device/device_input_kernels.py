"""Triton kernels of ``worker/device/device_inputs.py``: the step's flattened inputs built on the device.

Two kernels over the device copies of the persistent batch (``[max_num_reqs, width]``
int32 token ids, ``[max_num_reqs]`` int32 computed-token counts, ``[max_num_reqs,
max_blocks]`` int32 block table):

- ``scatter_``: a step's diffs (new requests' rows, appended tokens, new block ids,
  corrected counts) written into a table at flat indices.
- ``prepare_inputs``: one program per scheduled request builds its query start,
  context lengths, its rows of ``input_ids``, ``positions`` and ``slot_mapping`` and its
  block-table row for the attention kernels, taking a placeholder's token from the
  previous step's sampled ids (async scheduling), and advances its computed count.

Follows the input preparation of vLLM's Model Runner V2 (a step's inputs gathered by
kernels from persistent device state and the step's request indices) in spirit; the
code and layout are ours. Offsets are computed in int64 (a table's flat index passes
2**31 for long contexts and many slots). Importing this module needs ``triton``; under
``TRITON_INTERPRET=1`` (set before the import) the kernels run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SCATTER_BLOCK = 256  # diff entries per program
TOKEN_BLOCK = 64  # query tokens per loop iteration of a request's program
TABLE_BLOCK = 64  # block-table entries per loop iteration


@triton.jit
def _scatter_kernel(dst, idx, val, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    i = tl.load(idx + offs, mask=m, other=0).to(tl.int64)
    v = tl.load(val + offs, mask=m, other=0)
    tl.store(dst + i, v.to(dst.dtype.element_ty), mask=m)


def scatter_(dst: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, count: int) -> None:
    """``dst.view(-1)[idx[:count]] = val[:count]`` in one launch (none when ``count`` is 0).

    Args:
        dst: a contiguous table (int32); written in place.
        idx: ``[count]`` int64 flat indices into ``dst`` (distinct).
        val: ``[count]`` int64 values, cast to ``dst``'s dtype.
        count: the number of entries, a host int (so nothing is read from the device).
    """
    if count:
        _scatter_kernel[(triton.cdiv(count, SCATTER_BLOCK),)](dst, idx, val, count, BLOCK=SCATTER_BLOCK)


@triton.jit
def _prepare_kernel(rows, num_sched, pend_src, prev_sampled, token_ids, num_computed, block_table,
                    input_ids, positions, slot_mapping, query_start_loc, computed_out, seq_lens, tables_out,
                    nblk, stride_tok, stride_bt,
                    BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_B: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows + i).to(tl.int64)
    n = tl.load(num_sched + i).to(tl.int64)
    # this request's first query row: the scheduled counts of the requests before it
    r = tl.arange(0, BLOCK_R)
    q0 = tl.sum(tl.load(num_sched + r, mask=r < i, other=0).to(tl.int64), 0)
    start = tl.load(num_computed + row).to(tl.int64)
    end = start + n
    if i == 0:
        tl.store(query_start_loc, q0 * 0)
    tl.store(query_start_loc + i + 1, q0 + n)
    tl.store(computed_out + i, start)
    tl.store(seq_lens + i, end)
    # one program per request, and a step's rows are distinct: this read-then-write is race-free
    tl.store(num_computed + row, end.to(num_computed.dtype.element_ty))
    src = tl.load(pend_src + i).to(tl.int64)  # -1: the last token is known (in the token table)
    tok_row = token_ids + row * stride_tok
    bt_row = block_table + row * stride_bt
    for j in range(0, n.to(tl.int32), BLOCK_T):
        k = j + tl.arange(0, BLOCK_T)
        m = k < n
        pos = start + k
        tok = tl.load(tok_row + pos, mask=m, other=0).to(tl.int64)
        srcs = k * 0 + src  # as a vector: a scalar in the mask has an odd dtype under the interpreter
        pending = m & (pos == end - 1) & (srcs >= 0)
        prev = tl.load(prev_sampled + tl.maximum(srcs, 0), mask=pending, other=0).to(tl.int64)
        tok = tl.where(pending, prev, tok)
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=m, other=0).to(tl.int64)
        tl.store(input_ids + q0 + k, tok, mask=m)
        tl.store(positions + q0 + k, pos, mask=m)
        tl.store(slot_mapping + q0 + k, blk * BLOCK_SIZE + pos % BLOCK_SIZE, mask=m)
    # the attention kernels' copy of this request's block-table row, 0 (a valid id) past its context
    own = (end + BLOCK_SIZE - 1) // BLOCK_SIZE
    for b in range(0, nblk, BLOCK_B):
        c = b + tl.arange(0, BLOCK_B)
        ids = tl.load(bt_row + c, mask=c < own, other=0).to(tl.int64)
        tl.store(tables_out + i * nblk + c, ids, mask=c < nblk)


def prepare_inputs(rows: torch.Tensor, num_sched: torch.Tensor, pend_src: torch.Tensor, prev_sampled: torch.Tensor,
                   token_ids: torch.Tensor, num_computed: torch.Tensor, block_table: torch.Tensor,
                   out: torch.Tensor, num_reqs: int, num_tokens: int, nblk: int, block_size: int) -> None:
    """Build one step's flattened inputs on the device (one launch, grid ``(R,)``).

    Args:
        rows: ``[R]`` int64 batch slot of each scheduled request (distinct).
        num_sched: ``[R]`` int64 tokens scheduled for each (>= 1).
        pend_src: ``[R]`` int64 row in ``prev_sampled`` of a request whose last scheduled token
            is the previous step's sample (a placeholder), else -1.
        prev_sampled: ``[S]`` int64 the previous step's sampled ids (any 1-element tensor when no
            request has a placeholder).
        token_ids: ``[max_num_reqs, width]`` int32 token table (read).
        num_computed: ``[max_num_reqs]`` int32 tokens cached per slot; each scheduled slot's entry
            is advanced by its ``num_sched`` (so the next step starts where this one ends).
        block_table: ``[max_num_reqs, max_blocks]`` int32 (read).
        out: int64 buffer of ``3 T + 3 R + 1 + R * nblk`` entries, written as consecutive
            ``input_ids [T] | positions [T] | slot_mapping [T] | query_start_loc [R + 1] |
            num_computed [R] (before the step) | seq_lens [R] (after it) | block_tables [R, nblk]``.
        num_reqs, num_tokens: ``R`` and ``T = sum(num_sched)`` (host ints).
        nblk: block-table columns kept per request (covers the longest context).
        block_size: tokens per KV block.
    Raises:
        ValueError: ``out`` has the wrong size.
    """
    size = 3 * num_tokens + 3 * num_reqs + 1 + num_reqs * nblk
    if out.numel() != size:
        raise ValueError(f"prepare_inputs: out has {out.numel()} entries, expected {size}")
    if not num_reqs:
        return
    t, r = num_tokens, num_reqs
    views, at = [], 0
    for size in (t, t, t, r + 1, r, r, r * nblk):
        views.append(out[at:at + size])
        at += size
    _prepare_kernel[(r,)](rows, num_sched, pend_src, prev_sampled, token_ids, num_computed, block_table, *views,
                          nblk, token_ids.stride(0), block_table.stride(0), BLOCK_SIZE=block_size,
                          BLOCK_R=triton.next_power_of_2(r), BLOCK_T=TOKEN_BLOCK, BLOCK_B=TABLE_BLOCK)

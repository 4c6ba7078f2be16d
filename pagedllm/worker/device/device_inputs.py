"""Device-side input preparation of the Triton (GPU) path: the persistent batch mirrored on the device.

The host path (``step_inputs.HostInputs.gather``) gathers a step's ``input_ids``,
``positions`` and ``slot_mapping`` (``T`` entries each) in numpy and copies
them, with the step's block-table rows, every step. Here the token ids,
computed-token counts and block table of every batch slot live in device
tensors, and each step sends only

- its ``R`` scheduled slots, token counts and placeholder sources,
- the diffs since the device copies were last brought up to date: a new (or
  re-admitted) request's tokens from its first computed one, tokens appended
  since (one per decode step), draft tokens, new block ids, and a slot's
  computed count where it differs from what the device advanced it to (a new
  request, a prefix hit, rejected drafts),
- the attention backend's host-side layout (decode list, prefill tiles),

in one pinned, non-blocking transfer (``worker/upload.py``), and kernels
(``worker/device/device_input_kernels.py``) build the flattened inputs, query start
locations, context lengths and block-table rows on the device. A request whose
last scheduled token is still being sampled by the previous step (async
scheduling) takes it from that step's sampled ids, which never left the
device.

Threads: ``prepare`` (the host half) runs where the runner prepares steps, while the
previous step may still run; ``materialize`` (every write to the device copies, and
the kernels) runs on the execution thread at the start of the step, so the device
copies change in step order only. The host mirrors (``_len``, ``_nblocks``,
``_computed``) record what the device copies will hold once every prepared step has
run, which is what the next step's diffs are taken against.

Follows the idea of vLLM's Model Runner V2 (persistent device state, inputs built by
kernels from the step's request indices); the code is ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.triton_paged import StepLayout, TritonMetadata, TritonPagedBackend
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.upload import to_device


@dataclass
class DeviceStepPlan:
    """One step's host-decided part, already on the device (views of one transfer).

    ``R`` requests, ``T`` tokens; ``C``, ``K``, ``B``: diff entries of the computed counts,
    token table and block table.

    Attributes:
        rows, num_sched, pend_src: ``[R]`` int64 batch slots, scheduled tokens, and the previous
            step's sample row of a request whose last token is a placeholder (-1: none).
        computed_idx, computed_val: ``[C]`` int64 slots and their computed-token counts.
        token_idx, token_val: ``[K]`` int64 flat indices into the token table and the token ids.
        block_idx, block_val: ``[B]`` int64 flat indices into the block table and the block ids.
        decode_req, tile_req, tile_q0: the attention layout's device copies (``StepLayout``).
        layout: the host-side layout (split-K grid, block-table width).
        counts: ``(R, T, C, K, B)`` as host ints; has_pending: some request has a placeholder.
    """

    rows: torch.Tensor
    num_sched: torch.Tensor
    pend_src: torch.Tensor
    computed_idx: torch.Tensor
    computed_val: torch.Tensor
    token_idx: torch.Tensor
    token_val: torch.Tensor
    block_idx: torch.Tensor
    block_val: torch.Tensor
    decode_req: torch.Tensor
    tile_req: torch.Tensor
    tile_q0: torch.Tensor
    layout: StepLayout
    counts: tuple[int, int, int, int, int]
    has_pending: bool


def _ranges(slots: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(slot, column)`` pairs of every column in ``[lo, hi)`` of each slot (empty where ``hi <= lo``)."""
    cnt = np.maximum(hi - lo, 0)
    total = int(cnt.sum())
    starts = np.cumsum(cnt) - cnt
    cols = np.arange(total, dtype=np.int64) - np.repeat(starts - lo, cnt)
    return np.repeat(slots, cnt), cols


class DeviceInputs:
    """Device copies of an ``InputBatch`` and the step's input preparation on the device.

    Args:
        batch: the runner's persistent batch (the host truth the copies follow).
        backend: the Triton attention backend (its ``step_layout`` decides decodes and tiles).
        device: the model's device (CUDA, or the CPU under ``TRITON_INTERPRET=1``).
    Attributes:
        token_ids: ``[max_num_reqs, width]`` int32; num_computed: ``[max_num_reqs]`` int32;
            block_table: ``[max_num_reqs, max_blocks]`` int32: the device copies (entries a step
            does not read may be stale).
    """

    def __init__(self, batch: InputBatch, backend: TritonPagedBackend, device: torch.device) -> None:
        from pagedllm.worker.device import device_input_kernels  # imports triton: TRITON_INTERPRET is read now
        self._k = device_input_kernels
        self.batch, self.backend, self.device = batch, backend, torch.device(device)
        slots = batch.max_num_reqs
        self.token_ids = torch.zeros(batch.token_ids.shape, dtype=torch.int32, device=self.device)
        self.num_computed = torch.zeros(slots, dtype=torch.int32, device=self.device)
        self.block_table = torch.zeros(batch.block_table.shape, dtype=torch.int32, device=self.device)
        self._no_prev = torch.zeros(1, dtype=torch.int64, device=self.device)
        # host mirrors of the device copies (after every prepared step has run)
        self._generation = np.zeros(slots, dtype=np.int64)  # the batch's generation each slot was synced at
        self._len = np.zeros(slots, dtype=np.int64)         # tokens [.., _len) are valid from the first read one
        self._nblocks = np.zeros(slots, dtype=np.int64)     # block-table entries [0, _nblocks) are valid
        self._computed = np.full(slots, -1, dtype=np.int64)  # the device's computed count (-1: unknown)

    def prepare(self, slots: np.ndarray, num_sched: np.ndarray, start: np.ndarray, end: np.ndarray,
                spec: np.ndarray, pend: np.ndarray, pending_src: np.ndarray,
                extra: list[np.ndarray] = ()) -> tuple[DeviceStepPlan, list[torch.Tensor]]:
        """The host half of a step: diffs and layout, sent in one transfer (no device read).

        Args:
            slots: ``[R]`` int64 batch slots of the scheduled requests (distinct);
            num_sched: ``[R]`` int64 tokens scheduled for each (>= 1);
            start, end: ``[R]`` int64 tokens computed before / after the step (the scheduler's);
            spec: ``[R]`` int64 draft tokens written after each request's known tokens;
            pend: ``[P]`` indices (into ``R``) of requests whose last scheduled token is the
                previous step's sample, and ``pending_src``: ``[P]`` int64 its row there.
            extra: more int64 host arrays to send in the same transfer (the logits rows).
        Returns:
            The plan ``materialize`` runs, and ``extra``'s device copies in order.
        Raises:
            ValueError: from the backend's ``step_layout``.
        """
        b = self.batch
        stale = slots[b.generation[slots] != self._generation[slots]]
        self._generation[stale] = b.generation[stale]
        self._len[stale] = 0
        self._nblocks[stale] = 0
        self._computed[stale] = -1
        fix = np.flatnonzero(self._computed[slots] != start)
        computed_idx, computed_val = slots[fix], start[fix]
        self._computed[slots] = end
        # tokens the step reads that the device lacks: from the first computed one (earlier ones are
        # never read again without a re-add) to the known ones and drafts; a placeholder comes from
        # the previous step's samples
        known = b.num_tokens[slots]
        hi = np.minimum(end, known + spec)
        tok_slot, tok_col = _ranges(slots, np.maximum(self._len[slots], start), hi)
        token_val = b.token_ids[tok_slot, tok_col]
        self._len[slots] = np.maximum(self._len[slots], np.minimum(hi, known))  # drafts are sent again
        nb = b.num_blocks[slots]
        blk_slot, blk_col = _ranges(slots, self._nblocks[slots], nb)
        block_val = b.block_table[blk_slot, blk_col]
        self._nblocks[slots] = nb
        layout = self.backend.step_layout(num_sched, end, b.block_size)
        pend_src = np.full(slots.size, -1, dtype=np.int64)
        pend_src[pend] = pending_src
        parts = [slots, num_sched, pend_src, computed_idx, computed_val,
                 tok_slot * b.token_ids.shape[1] + tok_col, token_val,
                 blk_slot * b.block_table.shape[1] + blk_col, block_val,
                 layout.decode_req, layout.tile_req, layout.tile_q0, *extra]
        dev = to_device(parts, self.device)
        plan = DeviceStepPlan(*dev[:12], layout=layout, has_pending=bool(pend.size),
                              counts=(int(slots.size), int(num_sched.sum()), int(fix.size), int(tok_col.size),
                                      int(blk_col.size)))
        return plan, dev[12:]

    def materialize(self, plan: DeviceStepPlan, prev_sampled: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, TritonMetadata]:
        """The device half of a step (on the execution thread): apply the diffs, build the inputs.

        Args:
            plan: from ``prepare``; materialize plans in the order they were prepared, each once.
            prev_sampled: ``[S]`` int64 the previous step's sampled ids on the device (``None``
                when the plan has no placeholder).
        Returns:
            ``input_ids`` ``[T]`` int64, ``positions`` ``[T]`` int64 and the attention metadata, all
            on the device; nothing is read back.
        Raises:
            ValueError: the plan has a placeholder and ``prev_sampled`` is ``None``.
        """
        if plan.has_pending and prev_sampled is None:
            raise ValueError("a placeholder token needs the previous step's sampled ids")
        k = self._k
        r, t, c, kt, kb = plan.counts
        k.scatter_(self.num_computed, plan.computed_idx, plan.computed_val, c)
        k.scatter_(self.token_ids, plan.token_idx, plan.token_val, kt)
        k.scatter_(self.block_table, plan.block_idx, plan.block_val, kb)
        nblk = plan.layout.nblk
        out = torch.empty(3 * t + 3 * r + 1 + r * nblk, dtype=torch.int64, device=self.device)
        k.prepare_inputs(plan.rows, plan.num_sched, plan.pend_src,
                         prev_sampled if plan.has_pending else self._no_prev, self.token_ids, self.num_computed,
                         self.block_table, out, r, t, nblk, self.batch.block_size)
        views, at = [], 0
        for size in (t, t, t, r + 1, r, r, r * nblk):
            views.append(out[at:at + size])
            at += size
        lay = plan.layout
        meta = TritonMetadata(slot_mapping=views[2], query_start_loc=views[3], num_computed=views[4],
                              seq_lens=views[5], block_tables=views[6].view(r, nblk), decode_req=plan.decode_req,
                              tile_req=plan.tile_req, tile_q0=plan.tile_q0, num_splits=lay.num_splits,
                              split_len=lay.split_len, block_q=self.backend.block_q)
        return views[0], views[1], meta

"""The runner's recurrent-state tensors of a hybrid model, and each step's ``StateBatch`` over them.

The scheduler's KV cache manager hands each running request a slot
(``core/state_pool.py``); the request's slot arrives with its ``NewRequestData``
and sits in the persistent batch (``InputBatch.state_slot``). This module owns
one tensor per state layer and state kind, ``[num_slots, *shape]`` (request slots, then
the prefix cache's checkpoint slots), and builds the step's view for the model's mixers.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.state import StateBatch


class StateCache:
    """Per-layer state tensors with one slot per running request.

    Args:
        spec: model layer -> per-slot shapes of its state tensors (``model.state_cache_spec()``).
        num_slots: slots (the state pool's ``total_slots``: ``max_num_seqs`` request slots and
            the checkpoint slots).
        dtype, device: of the tensors (the model's).
        draft_slots: ``(request slots, k)``: with speculative decoding, ``k`` more slots per request
            slot after those, where a verification step leaves the state after each of up to ``k``
            drafts (``(0, 0)``: none).
    """

    def __init__(self, spec: dict[int, list[tuple[int, ...]]], num_slots: int, dtype: torch.dtype,
                 device: torch.device, draft_slots: tuple[int, int] = (0, 0)) -> None:
        self.draft_base, (self.num_request_slots, self.draft_k) = num_slots, draft_slots
        num_slots += draft_slots[0] * draft_slots[1]
        self.num_slots = num_slots
        self.device = device
        self.caches = {layer: [torch.zeros((num_slots, *shape), dtype=dtype, device=device) for shape in shapes]
                       for layer, shapes in spec.items()}

    @staticmethod
    def bytes_per_slot(spec: dict[int, list[tuple[int, ...]]], dtype: torch.dtype) -> int:
        """Bytes one slot takes across all state layers."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(int(np.prod(s)) * size for shapes in spec.values() for s in shapes)

    @classmethod
    def for_model(cls, model, num_slots: int, dtype: torch.dtype, device: torch.device,
                  draft_slots: tuple[int, int] = (0, 0)) -> "StateCache | None":
        """The state cache of ``model``, or ``None`` when it has no state layers."""
        spec = model.state_cache_spec() if hasattr(model, "state_cache_spec") else {}
        return cls(spec, num_slots, dtype, device, draft_slots) if spec else None

    def draft_slot(self, slot: int, j: int) -> int:
        """Where request slot ``slot``'s state after its ``j``-th step token (1 ..= k) of a
        verification step is left."""
        return self.draft_base + slot * self.draft_k + j - 1

    def rollback(self, batch: StateBatch, req_id: str, num_kept: int) -> None:
        """After a verification step, set the request's state to the one after its first
        ``num_kept`` tokens of the step (its input token and the accepted drafts), left in its
        draft slots by the mixers (``batch`` is the step's ``StateBatch``)."""
        slot = int(batch.state_slots[batch.req_ids.index(req_id)])
        src = self.draft_slot(slot, num_kept)
        for tensors in self.caches.values():
            for t in tensors:
                t[slot] = t[src]

    def batch(self, state_slots: np.ndarray, start: np.ndarray, qsl: np.ndarray, req_ids: list[str] = (),
              restores: dict[str, int] | None = None,
              checkpoints: dict[str, list[tuple[int, int]]] | None = None,
              drafts: dict[str, list[int]] | None = None) -> StateBatch:
        """The step's ``StateBatch``.

        Args:
            state_slots: ``[R]`` int64 state slot of each scheduled request.
            start: ``[R]`` int64 tokens each has computed before this step (0: its state starts now).
            qsl: ``[R + 1]`` int64 cumulative scheduled tokens.
            req_ids: the ``R`` request ids in row order (needed with ``restores`` / ``checkpoints``).
            restores: request id -> checkpoint slot it starts from (``SchedulerOutput.state_restores``).
            checkpoints: request id -> ``[(boundary in tokens, slot), ...]``
                (``SchedulerOutput.state_checkpoints``).
            drafts: request id -> its draft tokens this step (``SchedulerOutput.spec_token_ids``):
                the state after each of its step's first ``1 ..= len(drafts)`` tokens also goes to
                its draft slots (``draft_slot``), for ``rollback``.
        Raises:
            RuntimeError: a scheduled request holds no state slot (-1), a checkpoint's boundary
                lies outside its request's tokens of this step, or it has more drafts than draft slots.
        """
        if state_slots.size and int(state_slots.min()) < 0:
            raise RuntimeError("a request of a hybrid model was scheduled without a state slot")
        dev = self.device
        initial = None
        if restores:
            init = state_slots.copy()
            for i, rid in enumerate(req_ids):
                init[i] = restores.get(rid, init[i])
            initial = torch.from_numpy(init).to(dev)
        marks = []
        for i, rid in enumerate(req_ids):
            for boundary, slot in sorted((checkpoints or {}).get(rid, ())):
                off = boundary - int(start[i])
                if not 0 < off <= int(qsl[i + 1] - qsl[i]):
                    raise RuntimeError(f"state checkpoint at {boundary} tokens is outside request {rid}'s step")
                marks.append((i, off, slot))
            d = len((drafts or {}).get(rid, ()))
            if d:
                if d > self.draft_k:
                    raise RuntimeError(f"request {rid} has {d} drafts, more than the {self.draft_k} draft state slots")
                marks.extend((i, j, self.draft_slot(int(state_slots[i]), j)) for j in range(1, d + 1))
        return StateBatch(torch.from_numpy(state_slots.copy()).to(dev), torch.from_numpy(start > 0).to(dev),
                          torch.from_numpy(qsl.copy()).to(dev), self.caches, initial, sorted(marks), list(req_ids))

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
    """

    def __init__(self, spec: dict[int, list[tuple[int, ...]]], num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
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
    def for_model(cls, model, num_slots: int, dtype: torch.dtype, device: torch.device) -> "StateCache | None":
        """The state cache of ``model``, or ``None`` when it has no state layers."""
        spec = model.state_cache_spec() if hasattr(model, "state_cache_spec") else {}
        return cls(spec, num_slots, dtype, device) if spec else None

    def batch(self, state_slots: np.ndarray, start: np.ndarray, qsl: np.ndarray, req_ids: list[str] = (),
              restores: dict[str, int] | None = None,
              checkpoints: dict[str, list[tuple[int, int]]] | None = None) -> StateBatch:
        """The step's ``StateBatch``.

        Args:
            state_slots: ``[R]`` int64 state slot of each scheduled request.
            start: ``[R]`` int64 tokens each has computed before this step (0: its state starts now).
            qsl: ``[R + 1]`` int64 cumulative scheduled tokens.
            req_ids: the ``R`` request ids in row order (needed with ``restores`` / ``checkpoints``).
            restores: request id -> checkpoint slot it starts from (``SchedulerOutput.state_restores``).
            checkpoints: request id -> ``[(boundary in tokens, slot), ...]``
                (``SchedulerOutput.state_checkpoints``).
        Raises:
            RuntimeError: a scheduled request holds no state slot (-1), or a checkpoint's boundary
                lies outside its request's tokens of this step.
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
        return StateBatch(torch.from_numpy(state_slots.copy()).to(dev), torch.from_numpy(start > 0).to(dev),
                          torch.from_numpy(qsl.copy()).to(dev), self.caches, initial, marks)

"""A pool of fixed-size recurrent-state slots, one per running request of a hybrid model.

Hybrid models (LFM2's short convolutions, Mamba-2, gated delta nets) keep, per
request and per mixer layer, a state whose size does not grow with the sequence:
a convolution's last ``kernel - 1`` inputs, an SSM's ``[heads, head_dim, d_state]``
matrix. The runner holds those tensors with a leading slot dimension
(``worker/state_cache.py``); this pool hands the slots out. The KV cache manager
owns it next to the block pool, so a request is admitted only when it gets both
its blocks and a slot, and preemption, finishing and aborting give both back
(the design of vLLM's hybrid "mamba" cache groups, with one slot per request
and no prefix checkpoints yet).
"""

from __future__ import annotations


class StatePool:
    """Hands out state slots ``0 .. num_slots - 1``; each is held by at most one request.

    Slots are taken lowest first and freed slots go back to be reused first; a slot's
    tensors are not cleared here (the runner's mixers ignore a slot's old contents when
    its request starts from token 0).

    Args:
        num_slots: slots in the pool (> 0), usually ``max_num_seqs``.
    Raises:
        ValueError: ``num_slots`` < 1.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot
        self._used: set[int] = set()
        self.num_allocations = 0

    @property
    def num_free_slots(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        """Slots held by a request."""
        return len(self._used)

    def usage(self) -> float:
        """Fraction of slots in use, in [0, 1]."""
        return len(self._used) / self.num_slots

    def allocate(self) -> int | None:
        """Take a free slot; ``None`` when every slot is held (nothing changes then)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        self.num_allocations += 1
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back.

        Raises:
            RuntimeError: the slot is not held (a double free or a foreign slot).
        """
        if slot not in self._used:
            raise RuntimeError(f"double free of state slot {slot}")
        self._used.remove(slot)
        self._free.append(slot)

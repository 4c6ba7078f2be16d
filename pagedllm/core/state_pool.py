"""A pool of fixed-size recurrent-state slots: one per running request of a hybrid model, plus
checkpoint slots that keep a cached prefix's state at a block boundary.

Hybrid models (LFM2's short convolutions, Mamba-2, gated delta nets) keep, per
request and per mixer layer, a state whose size does not grow with the sequence:
a convolution's last ``kernel - 1`` inputs, an SSM's ``[heads, head_dim, d_state]``
matrix. The runner holds those tensors with a leading slot dimension
(``worker/state_cache.py``); this pool hands the slots out. The KV cache manager
owns it next to the block pool, so a request is admitted only when it gets both
its blocks and a slot, and preemption, finishing and aborting give both back
(the design of vLLM's hybrid "mamba" cache groups).

With prefix caching, slots ``num_slots .. num_slots + num_checkpoints - 1`` of the same
tensors hold checkpoints: the state of every state layer at the end of a cached full
block (``KVCacheManager``), so a later request that hits the prefix can start from it.
"""

from __future__ import annotations


class StatePool:
    """Hands out request slots ``0 .. num_slots - 1`` and checkpoint slots after them.

    Each slot is held by at most one owner (a request, or a cached block for a checkpoint).
    Slots are taken lowest first and freed slots go back to be reused first; a slot's
    tensors are not cleared here (the runner's mixers ignore a slot's old contents when
    its request starts from token 0, and a checkpoint is written before it can be read).

    Args:
        num_slots: request slots (> 0), usually ``max_num_seqs``.
        num_checkpoints: checkpoint slots (>= 0); 0 when prefix caching is off.
    Raises:
        ValueError: ``num_slots`` < 1 or ``num_checkpoints`` < 0.
    """

    def __init__(self, num_slots: int, num_checkpoints: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if num_checkpoints < 0:
            raise ValueError(f"num_checkpoints must be >= 0, got {num_checkpoints}")
        self.num_slots = num_slots
        self.num_checkpoints = num_checkpoints
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot
        self._used: set[int] = set()
        self._free_ckpt = list(range(num_slots + num_checkpoints - 1, num_slots - 1, -1))
        self._used_ckpt: set[int] = set()
        self.num_allocations = 0

    @property
    def total_slots(self) -> int:
        """Slots of the runner's state tensors: request slots, then checkpoint slots."""
        return self.num_slots + self.num_checkpoints

    @property
    def num_free_slots(self) -> int:
        """Request slots no request holds."""
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        """Request slots held by a request."""
        return len(self._used)

    @property
    def num_free_checkpoints(self) -> int:
        """Checkpoint slots no cached block holds."""
        return len(self._free_ckpt)

    @property
    def num_used_checkpoints(self) -> int:
        """Checkpoint slots held by a cached block."""
        return len(self._used_ckpt)

    def usage(self) -> float:
        """Fraction of request slots in use, in [0, 1]."""
        return len(self._used) / self.num_slots

    def allocate(self) -> int | None:
        """Take a free request slot; ``None`` when every slot is held (nothing changes then)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        self.num_allocations += 1
        return slot

    def free(self, slot: int) -> None:
        """Give a request slot back.

        Raises:
            RuntimeError: the slot is not held (a double free or a foreign slot).
        """
        if slot not in self._used:
            raise RuntimeError(f"double free of state slot {slot}")
        self._used.remove(slot)
        self._free.append(slot)

    def allocate_checkpoint(self) -> int | None:
        """Take a free checkpoint slot (an index into the state tensors); ``None`` when all are held."""
        if not self._free_ckpt:
            return None
        slot = self._free_ckpt.pop()
        self._used_ckpt.add(slot)
        return slot

    def free_checkpoint(self, slot: int) -> None:
        """Give a checkpoint slot back.

        Raises:
            RuntimeError: the slot is not a held checkpoint slot (a double free or a request slot).
        """
        if slot not in self._used_ckpt:
            raise RuntimeError(f"double free of state checkpoint slot {slot}")
        self._used_ckpt.remove(slot)
        self._free_ckpt.append(slot)

"""State checkpoints at block boundaries: prefix caching for hybrid models' recurrent layers.

Attention layers share a cached prefix through its KV blocks; a recurrent layer's state
(``core/state_pool.py``) folds in every token before it, so a request that reuses ``k``
cached blocks also needs the state of every state layer after exactly ``k * block_size``
tokens. Following vLLM's prefix caching for hybrid ("mamba") models, the state at the end
of a full block that gets cached is copied into a checkpoint slot tied to that block:

- the scheduling step that computes a cached block's last token gives the block a slot
  (while slots last; a block cached without one simply cannot end a hit) and tells the runner
  to write the state at that boundary there (``SchedulerOutput.state_checkpoints``);
- a hit is shortened to its last block whose checkpoint is written (scheduled in an earlier
  step: steps run in order, so it has run before the hitting request's first step), and the
  runner starts that request from the checkpoint (``SchedulerOutput.state_restores``);
- the slot is freed when the block loses its hash (``BlockPool.on_evict``: eviction or a
  prefix-cache reset), so every used checkpoint slot belongs to a cached block.

Only the request's own block gets a checkpoint, and only when the boundary lies inside the
step's tokens: an output block whose last token was still being sampled when the step
was scheduled (async scheduling) is cached after its boundary has run, without one.
"""

from __future__ import annotations

from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.state_pool import StatePool


class StateCheckpoints:
    """The checkpoint bookkeeping of ``KVCacheManager`` for a hybrid model with prefix caching.

    Args:
        state_pool: the model's state pool; its checkpoint slots are handed out here.
    Attributes:
        by_block: block id -> checkpoint slot of every cached block that has one.
        step: scheduling steps begun (``begin_step``); a checkpoint made in step ``s`` may end
            hits from step ``s + 1`` on.
    """

    def __init__(self, state_pool: StatePool) -> None:
        self.state_pool = state_pool
        self.by_block: dict[int, int] = {}
        self._made_in: dict[int, int] = {}  # block id -> the step whose run writes its checkpoint
        self._pending: dict[str, list[tuple[int, int, int]]] = {}  # rid -> (boundary, slot, block id)
        self._restores: dict[str, int] = {}
        self.step = 0

    def begin_step(self) -> None:
        """Mark the start of a scheduling step (checkpoints made before it are readable in it)."""
        self.step += 1

    def usable_hit(self, blocks: list[KVCacheBlock]) -> int:
        """How many leading ``blocks`` of a prefix hit may be reused: up to the last one whose
        checkpoint is written by a step before this one (0: none)."""
        for n in range(len(blocks), 0, -1):
            made = self._made_in.get(blocks[n - 1].block_id)
            if made is not None and made < self.step:
                return n
        return 0

    def restore(self, request_id: str, last_hit_block: KVCacheBlock) -> None:
        """Record that the request starts from the checkpoint of its last hit block."""
        self._restores[request_id] = self.by_block[last_hit_block.block_id]

    def checkpoint(self, request_id: str, block: KVCacheBlock, boundary: int) -> None:
        """Give a just-cached block of the request a checkpoint at ``boundary`` tokens, if it has
        none and a slot is free; the request's step writes it (``take``)."""
        if block.block_id in self.by_block:
            return
        slot = self.state_pool.allocate_checkpoint()
        if slot is None:
            return  # bounded: this block cannot end a hit (documented in the module docstring)
        self.by_block[block.block_id] = slot
        self._made_in[block.block_id] = self.step
        self._pending.setdefault(request_id, []).append((boundary, slot, block.block_id))

    def take(self, request_id: str) -> tuple[int, list[tuple[int, int]]]:
        """What the runner does for the request in the step being recorded.

        Returns:
            ``(restore slot or -1, [(boundary in tokens, checkpoint slot), ...])``.
        """
        pending = self._pending.pop(request_id, [])
        return self._restores.pop(request_id, -1), [(b, s) for b, s, _ in pending]

    def forget_request(self, request_id: str) -> None:
        """Drop what a freed request was to do; checkpoints no step will write are released."""
        self._restores.pop(request_id, None)
        for _, slot, block_id in self._pending.pop(request_id, []):
            self.by_block.pop(block_id, None)
            self._made_in.pop(block_id, None)
            self.state_pool.free_checkpoint(slot)

    def on_evict(self, block: KVCacheBlock) -> None:
        """``BlockPool.on_evict``: the block lost its hash, so its checkpoint slot is freed."""
        slot = self.by_block.pop(block.block_id, None)
        if slot is not None:
            self._made_in.pop(block.block_id, None)
            self.state_pool.free_checkpoint(slot)

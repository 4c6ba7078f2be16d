"""Per-request block tables on top of the block pool, with prefix caching."""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.hashing import extend_block_hashes
from pagedllm.core.state_checkpoints import StateCheckpoints
from pagedllm.core.state_pool import StatePool
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


class KVCacheManager:
    """Gives each request the blocks its tokens need, and takes them back.

    A request's block table is the ordered list of its blocks: token ``i``
    lives in block ``table[i // block_size]`` at offset ``i % block_size``.
    With prefix caching, every full block is registered under its content hash
    and a new request starts from the longest run of cached blocks matching
    its prompt (partial blocks are never shared).

    A hybrid model's requests also hold one slot of ``state_pool`` (recurrent state,
    ``core/state_pool.py``) from admission to finish or preemption: ``allocate_slots``
    fails (returns ``None``) when a request that holds no slot cannot get one, and
    ``free`` returns the slot with the blocks. With prefix caching, such a model's cached
    full blocks also get state checkpoints (``core/state_checkpoints.py``): a hit is shortened
    to its last block with one, and the request starts from that checkpoint.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between requests with equal prefixes.
        state_pool: the state slots of a hybrid model, or ``None`` (attention-only model).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 state_pool: StatePool | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.state_pool = state_pool
        self.req_to_state: dict[str, int] = {}
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0     # tokens found
        self.checkpoints: StateCheckpoints | None = None
        if state_pool is not None and enable_prefix_caching:
            self.checkpoints = StateCheckpoints(state_pool)
            self.pool.on_evict = self.checkpoints.on_evict

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (cached free blocks included: they are evictable)."""
        return self.pool.num_free_blocks

    def block_states(self) -> str:
        """One character per block, ``0`` free, ``1`` in use, ``2`` cached and evictable (``BlockPool.states``)."""
        return self.pool.states.decode("ascii")

    def usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]."""
        return self.pool.usage()

    def _hashes(self, request: Request) -> list[bytes]:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt,
                            request.mm_inputs, request.lora_key)
        return request.block_hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that prefixes the request's tokens.

        The hit is capped so the last token is always computed (its logits
        give the next token). A request asking for prompt logprobs gets no hit. For a hybrid
        model the hit ends at its last block with a written state checkpoint. The caller counts the lookup with
        ``record_prefix_query`` once the request is admitted.

        Returns:
            ``(blocks, num_tokens)``: the blocks to reuse and the tokens they cover.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need the logits of every prompt position
        hashes = self._hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for h in hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
        if self.checkpoints is not None:
            blocks = blocks[:self.checkpoints.usable_hit(blocks)]
        return blocks, len(blocks) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Add one admitted lookup to the prefix-cache counters (both in tokens)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``.

        Args:
            request: the request; ``num_computed_tokens`` already counts ``computed_blocks``.
            num_new_tokens: tokens to compute in this step.
            computed_blocks: cached blocks from ``get_computed_blocks`` for a request
                that holds no blocks yet.
        Returns:
            The ids of the blocks newly added to the request's block table
            (cached ones included; possibly empty); ``None`` when the pool lacks
            free blocks, in which case nothing changes.
        """
        computed_blocks = computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        need = cdiv(total, self.block_size) - len(blocks) - len(computed_blocks)
        # cached blocks sitting in the free queue stop being allocatable once taken
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(need, 0) + reclaimed > self.pool.num_free_blocks:
            return None
        if not self._take_state_slot(request.request_id):
            return None
        if computed_blocks and self.checkpoints is not None:
            self.checkpoints.restore(request.request_id, computed_blocks[-1])
        self.pool.touch(computed_blocks)
        new = self.pool.allocate(need) if need > 0 else []
        blocks = self.req_to_blocks.setdefault(request.request_id, blocks)
        blocks.extend(computed_blocks)
        blocks.extend(new)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, blocks, min(total, request.num_tokens))
        return [b.block_id for b in computed_blocks + new]

    def _take_state_slot(self, request_id: str) -> bool:
        """Give the request a state slot if the model has state and it holds none; False when none is free."""
        if self.state_pool is None or request_id in self.req_to_state:
            return True
        slot = self.state_pool.allocate()
        if slot is None:
            return False
        self.req_to_state[request_id] = slot
        return True

    def get_state_slot(self, request_id: str) -> int:
        """The request's state slot, or -1 (no state pool, or the request holds none)."""
        return self.req_to_state.get(request_id, -1)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register the blocks that become full with this step's tokens under their hashes; a
        hybrid model's block whose last token this step computes also gets a state checkpoint."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        hashes = self._hashes(request)
        for i in range(start, end):
            self.pool.cache_block(blocks[i], hashes[i])
            boundary = (i + 1) * self.block_size
            if (self.checkpoints is not None and blocks[i].block_hash is not None
                    and boundary > request.num_computed_tokens):
                self.checkpoints.checkpoint(request.request_id, blocks[i], boundary)
        self.num_cached_blocks[request.request_id] = end

    def begin_step(self) -> None:
        """Called by the scheduler at the start of each step (state checkpoints made in earlier
        steps become usable for hits)."""
        if self.checkpoints is not None:
            self.checkpoints.begin_step()

    def take_state_plan(self, request_id: str) -> tuple[int, list[tuple[int, int]]]:
        """The state work of the request's step being scheduled (``StateCheckpoints.take``):
        ``(slot to start from or -1, [(boundary in tokens, checkpoint slot), ...])``."""
        if self.checkpoints is None:
            return -1, []
        return self.checkpoints.take(request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (empty when it holds none)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def free(self, request: Request) -> None:
        """Return every block of the request to the pool, tail first, and its state slot.

        Tail first means the end of a prefix chain is evicted before its
        start. Safe to call for a request that holds no blocks.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks and self.enable_prefix_caching and self.checkpoints is None:
            # a block that filled while its last token was in flight (async scheduling) is cached now that
            # the token is known: a request that extends this one (the next chat turn, a realtime stream's
            # next request) finds it
            self._cache_full_blocks(request, blocks, min(request.num_computed_tokens, request.num_tokens))
        slot = self.req_to_state.pop(request.request_id, None)
        if slot is not None:
            self.state_pool.free(slot)
        if self.checkpoints is not None:
            self.checkpoints.forget_request(request.request_id)
        self.num_cached_blocks.pop(request.request_id, None)
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request holds (and its state checkpoint); returns how many."""
        return self.pool.reset_prefix_cache()

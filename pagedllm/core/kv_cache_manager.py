"""Per-request block tables on top of the block pool."""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


class KVCacheManager:
    """Gives each request the blocks its tokens need, and takes them back.

    A request's block table is the ordered list of its blocks: token ``i``
    lives in block ``table[i // block_size]`` at offset ``i % block_size``.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now."""
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]."""
        return self.pool.usage()

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``.

        Returns:
            The ids of newly allocated blocks (possibly empty), appended to the
            request's block table; ``None`` when the pool lacks free blocks, in
            which case nothing changes.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
        if need <= 0:
            return []
        if need > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        new = self.pool.allocate(need)
        blocks.extend(new)
        return [b.block_id for b in new]

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (empty when it holds none)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def free(self, request: Request) -> None:
        """Return every block of the request to the pool, tail first.

        Tail first means the end of a prefix chain is evicted before its
        start. Safe to call for a request that holds no blocks.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free(list(reversed(blocks)))

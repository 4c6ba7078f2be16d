"""A pool of fixed-size KV cache blocks with reference counts and an LRU free queue.

The design follows the paged KV cache of PagedAttention (Kwon et al., SOSP
2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention"): KV memory is cut into blocks of ``block_size`` tokens and a
sequence holds a list of block ids (its block table) instead of a contiguous
region.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class KVCacheBlock:
    """Bookkeeping for one physical KV block.

    Attributes:
        block_id: index into the layer KV tensors' first dimension.
        ref_cnt: number of block tables holding this block.
        block_hash: content hash while the block is full and cached, else ``None``.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    """Owns every KV block; hands them out and takes them back.

    Free blocks sit in an LRU queue (``OrderedDict`` keyed by block id, so
    taking from the head, appending to the tail and removing from the middle
    are all O(1)). Blocks are appended to the tail when freed, so the least
    recently used free block is taken first.

    Full blocks can be cached under their content hash (prefix caching). A
    cached block keeps its hash while free, so a later request with the same
    prefix can take it back; it loses the hash only when it is reused for
    other tokens (eviction), which happens least-recently-freed first.

    ``states`` is one ASCII byte per block, kept as blocks change hands (O(1) each): ``FREE``,
    ``USED`` (held by a block table) or ``CACHED`` (free, but still holding a hashed prefix that a
    later request may take back); the web page's block map draws it.

    ``on_evict``, when set, is called with each block as it loses its hash (eviction or a
    prefix-cache reset), so an owner of data tied to the cached block (a hybrid model's state
    checkpoint, ``KVCacheManager``) frees it at the same moment.

    Args:
        num_blocks: total blocks in the pool (> 0).
    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    FREE, USED, CACHED = ord("0"), ord("1"), ord("2")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0
        self.states = bytearray(b"0" * num_blocks)
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no holder (including cached ones that may be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one block table."""
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` free blocks (least recently freed first), each with ref_cnt 1.

        Raises:
            RuntimeError: fewer than ``n`` free blocks; callers check first.
        """
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            self.states[block.block_id] = self.USED
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(block)
            if block.ref_cnt == 0:
                self.states[block.block_id] = self.FREE

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block holding the tokens of ``block_hash``, if still cached."""
        return self.cached.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Record that ``block`` (full, held by a request) holds the tokens of ``block_hash``.

        If another block already caches the same content, the first one stays
        the cached copy and this block stays private.
        """
        if block.block_hash is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            block.block_hash = block_hash

    def reset_prefix_cache(self) -> int:
        """Drop every free block's hash; returns how many were dropped."""
        n = 0
        for block in self._free.values():
            if block.block_hash is not None:
                self._evict(block)
                n += 1
        return n

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Add one holder to each block, taking free ones off the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                self.states[block.block_id] = self.USED
            block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one holder from each block; blocks reaching 0 go to the queue's tail.

        Pass blocks in eviction order: the first ones given are evicted first.

        Raises:
            RuntimeError: a block's ref_cnt is already 0 (a double free).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                self.states[block.block_id] = self.FREE if block.block_hash is None else self.CACHED

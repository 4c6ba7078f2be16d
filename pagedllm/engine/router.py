"""The data-parallel router: which engine-core replica a new request goes to.

The policy of SGLang's cache-aware router and llm-d's KV-cache-aware routing, on the engine's
own prefix-cache keys, counting only the blocks that tell requests apart: a request goes to the
live replica that holds the longest cached prefix of its prompt *beyond the prefix most recent
prompts share*, counted in full KV blocks; with no such match, or a tie, to the one with the
fewest requests in flight (then the one holding more of the shared prefix, then the lowest
index). A replica that would win on its prefix but already has ``balance_abs_threshold`` more
requests in flight than the least loaded one loses to it (SGLang's ``balance_abs_threshold``).

Why "beyond the shared prefix": every chat starts with its template's first block, and often a
long system prompt; on raw prefix length the first replica to see it wins every later request
(issue 35: six concurrent chats all went to one replica while the other idled). The shared part
is the longest prefix of the request that more than half of the last ``window`` distinct prompts
(any replica) start with; a majority rather than all, so that one odd prompt does not turn
routing by the shared prefix back on for a whole window. With fewer than two distinct prompts
seen nothing counts as shared: one earlier prompt cannot tell a system prompt from a
conversation's history. A conversation's next turn still extends its history beyond the shared
part, so it follows its replica; identical prompts are one distinct prompt, so a repeated
prompt keeps to the replica that cached it.

The router cannot see a replica's block pool; it remembers, per replica, the block hashes of
the prompts it sent there (``core/hashing.py``: the hashes the core's prefix cache keys its
blocks by, salt included) in a bounded LRU. A replica that evicted a block is then credited
with a prefix it no longer holds, which costs a recompute there, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.core.hashing import extend_block_hashes


def prompt_block_hashes(prompt_token_ids: list[int], block_size: int, cache_salt: str | None,
                        lora_key: bytes | None = None) -> list[bytes]:
    """The prefix-cache hashes of the prompt's full blocks (``core/hashing.extend_block_hashes``).

    Args:
        prompt_token_ids: the prompt's token ids.
        block_size: tokens per KV block (> 0).
        cache_salt: the request's prefix-cache namespace, or ``None``.
        lora_key: its LoRA adapter's identity (``LoRARequest.cache_key``), or ``None``.
    Returns:
        One 32-byte hash per full block, in prompt order.
    """
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt_token_ids, block_size, cache_salt, (), lora_key)
    return hashes


class PrefixRouter:
    """Picks a replica for each request: longest remembered prefix beyond the shared one, else
    fewest requests in flight (module docstring).

    Args:
        num_replicas: how many replicas (>= 1).
        capacity_blocks: block hashes remembered per replica (>= 1), least recently sent
            forgotten first; the replica's pool size in blocks is a fair value.
        balance_abs_threshold: a prefix match is ignored when its replica has more than this many
            requests in flight beyond the least loaded live replica (>= 0; SGLang's default is 32).
        window: distinct recent prompts (any replica) the shared prefix is measured on (>= 2).
    Raises:
        ValueError: a count out of range.
    """

    def __init__(self, num_replicas: int, capacity_blocks: int, balance_abs_threshold: int = 32,
                 window: int = 32) -> None:
        if num_replicas < 1 or capacity_blocks < 1 or balance_abs_threshold < 0 or window < 2:
            raise ValueError(f"num_replicas and capacity_blocks must be >= 1, balance_abs_threshold >= 0 and "
                             f"window >= 2, got {num_replicas}, {capacity_blocks}, {balance_abs_threshold}, {window}")
        self.capacity_blocks = capacity_blocks
        self.balance_abs_threshold = balance_abs_threshold
        self.window = window
        self._blocks: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        # recent distinct prompts, keyed by their last block's hash (which, chained, names them all)
        self._recent: OrderedDict[bytes, list[bytes]] = OrderedDict()
        self.in_flight = [0] * num_replicas
        self.alive = [True] * num_replicas
        self.routed = [0] * num_replicas  # requests sent to each replica so far
        self.prefix_routed = [0] * num_replicas  # of which sent where a remembered prefix of theirs was

    @property
    def num_replicas(self) -> int:
        """How many replicas, dead ones included."""
        return len(self.alive)

    def matched_blocks(self, replica: int, hashes: list[bytes]) -> int:
        """How many leading blocks of ``hashes`` the router remembers sending to ``replica``."""
        known = self._blocks[replica]
        n = 0
        for h in hashes:
            if h not in known:
                break
            n += 1
        return n

    def shared_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of ``hashes`` more than half of the recent distinct prompts also
        start with (0 with fewer than two seen): the part no replica is chosen for."""
        recent = list(self._recent.values())
        if len(recent) < 2:
            return 0
        quorum = len(recent) // 2 + 1

        def shared(n: int) -> bool:
            # the hashes are chained: an equal block n - 1 means equal blocks before it too
            return sum(1 for p in recent if len(p) >= n and p[n - 1] == hashes[n - 1]) >= quorum

        lo, hi = 0, len(hashes)  # shared(n) only turns false as n grows: bisect for the last true
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if shared(mid) else (lo, mid - 1)
        return lo

    def choose(self, hashes: list[bytes]) -> int:
        """The replica for a request whose prompt has these block hashes (nothing recorded).

        Raises:
            RuntimeError: no replica is alive.
        """
        live = [r for r in range(self.num_replicas) if self.alive[r]]
        if not live:
            raise RuntimeError("no data-parallel replica is alive")
        least = min(self.in_flight[r] for r in live)
        eligible = [r for r in live if self.in_flight[r] - least <= self.balance_abs_threshold]
        shared = self.shared_blocks(hashes)
        matched = {r: self.matched_blocks(r, hashes) for r in eligible}
        # the longest match beyond the shared prefix, then fewest in flight, then the longest
        # match (the shared prefix cached there), then the lowest index
        return min(eligible, key=lambda r: (-max(0, matched[r] - shared), self.in_flight[r], -matched[r], r))

    def route(self, hashes: list[bytes]) -> int:
        """Choose a replica (``choose``), count the request in flight there, remember its blocks
        as cached there and its prompt among the recent ones.

        Raises:
            RuntimeError: no replica is alive.
        """
        r = self.choose(hashes)
        if self.matched_blocks(r, hashes):
            self.prefix_routed[r] += 1
        self.routed[r] += 1
        self.in_flight[r] += 1
        known = self._blocks[r]
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > self.capacity_blocks:
            known.popitem(last=False)
        if hashes:  # a prompt without a full block says nothing of shared prefixes
            self._recent[hashes[-1]] = hashes
            self._recent.move_to_end(hashes[-1])
            while len(self._recent) > self.window:
                self._recent.popitem(last=False)
        return r

    def finished(self, replica: int) -> None:
        """A request routed to ``replica`` finished or was aborted."""
        self.in_flight[replica] = max(0, self.in_flight[replica] - 1)

    def mark_dead(self, replica: int) -> None:
        """Send nothing more to ``replica``; forget what it cached and what it had in flight."""
        self.alive[replica] = False
        self.in_flight[replica] = 0
        self._blocks[replica].clear()

"""Draft proposers: cheap guesses at a request's next tokens, verified by the target model.

One interface, ``Proposer.propose(batch) -> {request id: draft token ids}`` (at most ``k``
each), over the committed tokens only (prompt + output; never a token still being sampled).
``finish(request_id, token_ids, num_prompt_tokens)`` tells a proposer a request has ended.
Optional attributes, read with a default by ``SpecDecoding``: ``batched`` (ask once per step for
every request), ``always_proposes`` (a request with a step in flight would always get drafts),
``step_seconds`` (the proposer's own measured seconds per draft forward, for the depth rule), and
``take_probs(request_id, n)`` (the distributions sampled drafts were drawn from, for verification);
``draft_model.DraftModelProposer`` has all four.

* ``NgramProposer``: prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram``):
  the latest earlier occurrence of the sequence's last ``n`` tokens, ``n`` from
  ``prompt_lookup_max`` down to ``prompt_lookup_min``, proposes the tokens that followed it.
* ``SuffixProposer``: suffix decoding (Oliaro et al. 2024, "SuffixDecoding"): counts of which
  token followed each recent context of up to ``depth`` tokens, over the request's own tokens
  and the outputs of up to ``max_cached_requests`` finished requests (agent loops repeat
  themselves); it follows the most frequent continuation of the longest matching context while
  that continuation's share stays at least ``min_token_prob``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass
class ProposeItem:
    """One request to propose for.

    Attributes:
        request_id: the request.
        token_ids: its committed tokens (prompt + output), in order.
        num_prompt_tokens: how many of them are the prompt.
        k: most draft tokens wanted (>= 1).
        params: the request's ``SamplingParams`` (``None``: treat as greedy); a proposer that
            samples its drafts (``draft_model``) draws from them.
    """

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    k: int
    params: Any = None


class Proposer(Protocol):
    """What the scheduler asks of a proposer."""

    def propose(self, batch: list[ProposeItem]) -> dict[str, list[int]]:
        """Draft token ids per request id (at most ``item.k``; an absent or empty entry: no guess)."""

    def finish(self, request_id: str, token_ids: Sequence[int] = (), num_prompt_tokens: int = 0) -> None:
        """The request ended with these tokens (finished or aborted): drop its state, and keep
        what later requests can reuse."""


class NgramProposer:
    """Prompt lookup over the request's own tokens (see the module docstring).

    Args:
        n_min, n_max: n-gram lengths tried, longest first.
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, batch: list[ProposeItem]) -> dict[str, list[int]]:
        """See ``Proposer.propose``."""
        out = {}
        for item in batch:
            draft = self.propose_one(np.asarray(item.token_ids, dtype=np.int64), item.k)
            if draft:
                out[item.request_id] = draft
        return out

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching
        tail n-gram; ``tokens`` ``[L]`` int64. Empty when no n-gram of an allowed length recurs."""
        length = tokens.shape[0]
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            # windows starting at 0 .. L - n - 1: each has at least one token after it
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []

    def finish(self, request_id: str, token_ids: Sequence[int] = (), num_prompt_tokens: int = 0) -> None:
        """Stateless: nothing to drop."""


class _ContextCounts:
    """Next-token counts per context (a tuple of the up to ``depth`` tokens before it)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.counts: dict[tuple[int, ...], Counter] = {}

    def add(self, tokens: Sequence[int], start: int, sign: int = 1) -> None:
        """Count (``sign`` -1: uncount) every token at index >= ``start`` after each of its contexts."""
        for i in range(max(start, 1), len(tokens)):
            nxt = tokens[i]
            for m in range(1, min(self.depth, i) + 1):
                ctx = tuple(tokens[i - m:i])
                c = self.counts.get(ctx)
                if c is None:
                    if sign < 0:
                        continue
                    c = self.counts[ctx] = Counter()
                c[nxt] += sign
                if c[nxt] <= 0:
                    del c[nxt]
                    if not c:
                        del self.counts[ctx]


class SuffixProposer:
    """Suffix decoding over the request's tokens and earlier requests' outputs (module docstring).

    Args:
        max_depth: longest context plus continuation (vLLM's ``suffix_decoding_max_tree_depth``);
            contexts are at most half of it.
        max_cached_requests: finished requests whose outputs stay indexed (oldest dropped first).
        min_token_prob: smallest share a continuation token needs among its context's counts.
    """

    def __init__(self, max_depth: int, max_cached_requests: int, min_token_prob: float) -> None:
        self.context_len = max(1, max_depth // 2)
        self.min_token_prob = min_token_prob
        self.max_cached = max_cached_requests
        self._own: dict[str, tuple[_ContextCounts, int, int]] = {}  # id -> (counts, tokens indexed, prompt len)
        self._global = _ContextCounts(self.context_len)
        self._kept: OrderedDict[str, tuple[list[int], int]] = OrderedDict()  # indexed outputs, oldest first

    def propose(self, batch: list[ProposeItem]) -> dict[str, list[int]]:
        """See ``Proposer.propose``."""
        out = {}
        for item in batch:
            own, done, _ = self._own.get(item.request_id) or (_ContextCounts(self.context_len), 0, 0)
            own.add(item.token_ids, done)
            self._own[item.request_id] = (own, len(item.token_ids), item.num_prompt_tokens)
            draft = self._follow(own, list(item.token_ids[-self.context_len:]), item.k)
            if draft:
                out[item.request_id] = draft
        return out

    def _follow(self, own: _ContextCounts, tail: list[int], k: int) -> list[int]:
        draft: list[int] = []
        while len(draft) < k:
            nxt = self._next(own, tail)
            if nxt is None:
                break
            draft.append(nxt)
            tail = (tail + [nxt])[-self.context_len:]
        return draft

    def _next(self, own: _ContextCounts, tail: list[int]) -> int | None:
        """The most frequent continuation of the longest context of ``tail`` seen anywhere."""
        for m in range(len(tail), 0, -1):
            ctx = tuple(tail[-m:])
            mine, seen = own.counts.get(ctx), self._global.counts.get(ctx)
            if not mine and not seen:
                continue  # most long contexts were never seen: no Counter built for them
            merged = Counter(mine or ())
            merged.update(seen or {})
            if merged:
                token, count = max(merged.items(), key=lambda kv: (kv[1], -kv[0]))
                return token if count >= self.min_token_prob * sum(merged.values()) else None
        return None

    def finish(self, request_id: str, token_ids: Sequence[int] = (), num_prompt_tokens: int = 0) -> None:
        """Drop the request's own index; index its output (after the prompt's last tokens as
        context) globally, dropping the oldest kept request's past ``max_cached_requests``."""
        self._own.pop(request_id, None)
        if self.max_cached == 0 or len(token_ids) <= num_prompt_tokens:
            return
        first = max(0, num_prompt_tokens - self.context_len)
        seq = list(token_ids[first:])
        self._global.add(seq, num_prompt_tokens - first)
        self._kept[request_id] = (seq, num_prompt_tokens - first)
        while len(self._kept) > self.max_cached:
            _, (old, start) = self._kept.popitem(last=False)
            self._global.add(old, start, sign=-1)

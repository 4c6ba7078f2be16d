"""The Responses API's store: stored responses and the conversations that led to them.

Bounded twice, least recently used out first: at most ``STORE_SIZE`` responses and about
``STORE_BYTES`` of Python heap (estimated by ``estimate_bytes``). A continued conversation shares
its earlier messages with the response it continues (the same dict objects), so each message is
counted once however many stored responses hold it. Each response belongs to an owner (an opaque
string the server derives from the caller's API key, or ``None`` without keys): a lookup by
another owner finds nothing, exactly as an unknown id. Dropping a response (``delete`` or
eviction) drops every reference the store holds; once enough is freed, ``return_freed_memory``
(``malloc_trim``) gives the pages back to the operating system.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any, Callable

from pagedllm.memory import return_freed_memory

STORE_SIZE = 1024  # stored responses kept
# Python heap the store may hold: 1024 chat-sized responses take a few MiB; one long agent
# conversation (a 128k-token context is about 0.5 MB of text) fits many times over
STORE_BYTES = 64 * 2**20
# freed bytes between two malloc_trim calls: a trim costs about a millisecond (more on a large heap),
# so it runs once per this much freed rather than on every eviction of a full store
TRIM_AFTER_BYTES = 8 * 2**20

Owner = str | None


def estimate_bytes(obj: Any) -> int:
    """Heap bytes of a JSON-like value: ``sys.getsizeof`` of every dict, list, key and leaf in it.

    Walks iteratively (a client's deeply nested JSON schema cannot exhaust the stack). Interned
    keys shared between objects are counted each time: an estimate on the high side.

    Args:
        obj: dicts, lists, tuples, strings, numbers, ``None``.

    Returns:
        Bytes (int).
    """
    total, todo = 0, [obj]
    while todo:
        x = todo.pop()
        total += sys.getsizeof(x)
        if isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return total


class _Entry:
    """One stored response: its owner, the response object, its conversation (chat messages), and
    the bytes counted for it alone (the response and the conversation's list, not its messages)."""

    __slots__ = ("owner", "response", "conversation", "own_bytes")

    def __init__(self, owner: Owner, response: dict, conversation: list[dict], own_bytes: int) -> None:
        self.owner, self.response, self.conversation, self.own_bytes = owner, response, conversation, own_bytes


class ResponseStore:
    """Stored responses by id, per owner, bounded in entries and bytes (least recently used out first).

    Args:
        size: most responses kept (``STORE_SIZE``).
        max_bytes: most bytes kept, as ``estimate_bytes`` counts them (``STORE_BYTES``); the response
            just stored is kept even when it alone is larger.
        trim_after: bytes freed between two calls of ``trim`` (``TRIM_AFTER_BYTES``).
        trim: gives freed heap pages back to the system (``pagedllm.memory.return_freed_memory``).

    Not thread-safe: the server calls it from its event loop only.
    """

    def __init__(self, size: int = STORE_SIZE, max_bytes: int = STORE_BYTES, trim_after: int = TRIM_AFTER_BYTES,
                 trim: Callable[[], None] = return_freed_memory) -> None:
        self.size, self.max_bytes, self.trim_after, self._trim = size, max_bytes, trim_after, trim
        self._items: OrderedDict[str, _Entry] = OrderedDict()
        # id(message) -> [stored responses holding it, its bytes]; the ids stay valid because the
        # entries hold the messages alive until the count drops to 0
        self._messages: dict[int, list[int]] = {}
        self.bytes = 0  # counted bytes held now
        self._freed = 0  # counted bytes freed since the last trim

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, conversation: list[dict], owner: Owner = None) -> None:
        """Keep a response (``response["id"]``) and the full conversation that led to and includes it,
        evicting the least recently used responses past ``size`` or ``max_bytes``."""
        rid = response["id"]
        if rid in self._items:  # ids are fresh uuids; a replaced one must not be counted twice
            self._drop(rid)
        own = estimate_bytes(response) + sys.getsizeof(conversation)
        for msg in conversation:
            held = self._messages.get(id(msg))
            if held is None:
                held = self._messages[id(msg)] = [0, estimate_bytes(msg)]
                self.bytes += held[1]
            held[0] += 1
        self._items[rid] = _Entry(owner, response, conversation, own)
        self.bytes += own
        while len(self._items) > self.size or (self.bytes > self.max_bytes and len(self._items) > 1):
            self._drop(next(iter(self._items)))
        self._maybe_trim()

    def get(self, rid: str, owner: Owner = None) -> tuple[dict, list[dict]] | None:
        """``(response, conversation)`` of a response ``owner`` stored (now the most recently used),
        or ``None``: unknown, evicted, deleted, or another owner's."""
        entry = self._items.get(rid)
        if entry is None or entry.owner != owner:
            return None
        self._items.move_to_end(rid)
        return entry.response, entry.conversation

    def delete(self, rid: str, owner: Owner = None) -> bool:
        """Drop a response ``owner`` stored; False when there is none (another owner's included)."""
        entry = self._items.get(rid)
        if entry is None or entry.owner != owner:
            return False
        del entry  # the last reference outside the store goes before the trim
        self._drop(rid)
        self._maybe_trim()
        return True

    def _drop(self, rid: str) -> None:
        """Forget a response and release its messages (the counts of those another response holds stay)."""
        entry = self._items.pop(rid)
        freed = entry.own_bytes
        for msg in entry.conversation:
            held = self._messages[id(msg)]
            held[0] -= 1
            if held[0] == 0:
                del self._messages[id(msg)]
                freed += held[1]
        self.bytes -= freed
        self._freed += freed

    def _maybe_trim(self) -> None:
        if self._freed >= self.trim_after:
            self._freed = 0
            self._trim()

"""The Responses store without a server: bounded in entries and bytes (least recently used out first),
a continued conversation's shared messages counted once, every reference dropped on delete and eviction,
``malloc_trim`` once enough is freed, and responses visible to their owner only."""

from __future__ import annotations

import gc
import weakref

from pagedllm.server.response_store import ResponseStore, estimate_bytes

KB = 1024


class D(dict):
    """A dict that can be weakly referenced (to see that the store let it go)."""


def response(rid: str, text: str = "", **extra) -> dict:
    return D(id=rid, object="response", instructions=text, output=[], metadata={}, **extra)


def msg(text: str) -> dict:
    return D(role="user", content=text)


def test_estimate_counts_texts_and_nesting():
    small = estimate_bytes({"a": "x"})
    assert estimate_bytes({"a": "x" * 100_000}) > small + 99_000
    deep: list = []
    for _ in range(100_000):  # deeper than the recursion limit: walked without recursing
        deep = [deep]
    assert estimate_bytes(deep) > 100_000


def test_bounded_in_bytes_least_recently_used_out():
    store = ResponseStore(size=1000, max_bytes=1024 * KB, trim=lambda: None)
    for i in range(20):  # 20 x 100 KB > 1 MiB
        store.put(response(f"r{i}", "x" * 100 * KB), [msg(f"q{i}")])
        assert store.bytes <= store.max_bytes
    assert store.get("r0") is None and store.get("r19") is not None
    kept = [i for i in range(20) if store.get(f"r{i}") is not None]
    assert 5 <= len(kept) < 11 and kept == list(range(20 - len(kept), 20))
    assert len(store) == len(kept)


def test_get_refreshes_recency():
    store = ResponseStore(size=3, trim=lambda: None)
    for i in range(3):
        store.put(response(f"r{i}"), [])
    assert store.get("r0") is not None  # now the most recently used: r1 goes next
    store.put(response("r3"), [])
    assert store.get("r1") is None and store.get("r0") is not None and len(store) == 3


def test_one_response_larger_than_the_bound_is_kept_alone():
    store = ResponseStore(max_bytes=64 * KB, trim=lambda: None)
    store.put(response("small"), [])
    store.put(response("big", "x" * 200 * KB), [])
    assert store.get("big") is not None and store.get("small") is None and len(store) == 1


def test_continued_conversation_counts_shared_messages_once():
    """Each response of a chain holds the whole conversation so far (the same message dicts): the
    store counts each message once, so 50 turns of 10 KB take about 500 KB, not 50 * 51 / 2 * 10 KB."""
    store = ResponseStore(max_bytes=2048 * KB, trim=lambda: None)
    conversation: list[dict] = []
    for i in range(50):
        conversation = conversation + [msg("x" * 10 * KB)]
        store.put(response(f"r{i}"), conversation)
    assert len(store) == 50 and store.bytes < 700 * KB
    for i in range(49):
        assert store.delete(f"r{i}")
    last = store.bytes
    assert 500 * KB < last < 700 * KB  # the last response still holds every message
    assert store.delete("r49") and store.bytes == 0 and store._messages == {}


def test_delete_and_eviction_drop_every_reference():
    store = ResponseStore(size=2, trim=lambda: None)
    resp, first = response("r0", "x" * KB), msg("hello")
    refs = [weakref.ref(resp), weakref.ref(first)]
    store.put(resp, [first])
    del resp, first
    assert store.delete("r0") and not store.delete("r0")
    gc.collect()
    assert all(r() is None for r in refs), "the store kept a deleted response alive"
    assert store.bytes == 0 and store._messages == {} and len(store) == 0
    evicted = response("r1")
    ref = weakref.ref(evicted)
    store.put(evicted, [msg("a")])
    del evicted
    store.put(response("r2"), [])
    store.put(response("r3"), [])  # r1 out: size 2
    gc.collect()
    assert ref() is None and store.get("r1") is None and len(store) == 2


def test_trim_once_enough_is_freed():
    trims = []
    store = ResponseStore(trim_after=300 * KB, trim=lambda: trims.append(1))
    for i in range(10):
        store.put(response(f"r{i}", "x" * 100 * KB), [])
    assert trims == []  # nothing freed yet
    store.delete("r0")
    store.delete("r1")
    assert trims == []
    store.delete("r2")  # about 300 KB freed since the start
    assert trims == [1]
    store.delete("r3")
    assert trims == [1]


def test_other_owners_find_nothing():
    store = ResponseStore(trim=lambda: None)
    store.put(response("ra"), [msg("a")], owner="alice")
    store.put(response("rn"), [msg("n")])  # no keys: owner None
    assert store.get("ra", "bob") is None and store.get("ra") is None
    assert not store.delete("ra", "bob") and not store.delete("ra")
    assert store.get("ra", "alice") is not None  # still there for its owner
    assert store.get("rn", "alice") is None and store.get("rn") is not None
    assert store.delete("ra", "alice") and store.get("ra", "alice") is None

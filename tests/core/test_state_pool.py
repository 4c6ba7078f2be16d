"""The recurrent-state pool of hybrid models and its place in the KV cache manager."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.state_pool import StatePool
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def _req(rid: str, n: int = 5) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4), {2}, 4)


def test_pool_hands_out_lowest_and_refuses_double_free():
    pool = StatePool(2)
    assert [pool.allocate(), pool.allocate(), pool.allocate()] == [0, 1, None]
    assert pool.num_free_slots == 0 and pool.usage() == 1.0
    pool.free(0)
    assert pool.allocate() == 0
    pool.free(1)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(1)
    with pytest.raises(ValueError):
        StatePool(0)


def test_manager_admits_only_with_a_slot_and_frees_it_with_the_blocks():
    kv = KVCacheManager(16, 4, enable_prefix_caching=False, state_pool=StatePool(2))
    a, b, c = _req("a"), _req("b"), _req("c")
    assert kv.allocate_slots(a, 5) is not None and kv.allocate_slots(b, 5) is not None
    assert kv.get_state_slot("a") == 0 and kv.get_state_slot("b") == 1
    free_blocks = kv.num_free_blocks
    assert kv.allocate_slots(c, 5) is None, "no state slot left: the request must not be admitted"
    assert kv.num_free_blocks == free_blocks and kv.get_state_slot("c") == -1  # nothing changed
    a.num_computed_tokens = 5
    assert kv.allocate_slots(a, 1) is not None and kv.get_state_slot("a") == 0  # keeps its slot
    kv.free(a)
    assert kv.get_state_slot("a") == -1 and kv.state_pool.num_free_slots == 1
    assert kv.allocate_slots(c, 5) is not None and kv.get_state_slot("c") == 0
    kv.free(b)
    kv.free(c)
    kv.free(c)  # a request holding nothing: no error
    assert kv.state_pool.num_free_slots == 2 and kv.num_free_blocks == 16


def test_attention_only_manager_has_no_slots():
    kv = KVCacheManager(4, 4)
    r = _req("r")
    assert kv.allocate_slots(r, 5) is not None and kv.get_state_slot("r") == -1
    kv.free(r)

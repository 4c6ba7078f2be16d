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


# ---------------------------------------------------------------- prefix-cache state checkpoints


def _tokens_req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), {2}, 4)


def _admit(kv: KVCacheManager, req: Request) -> int:
    """Admit ``req`` whole as the scheduler does; returns its hit tokens."""
    blocks, hit = kv.get_computed_blocks(req)
    req.num_computed_tokens = hit
    assert kv.allocate_slots(req, req.num_tokens - hit, blocks) is not None
    return hit


def test_pool_checkpoint_slots_follow_the_request_slots():
    pool = StatePool(2, 2)
    assert pool.total_slots == 4 and pool.num_free_checkpoints == 2
    assert [pool.allocate_checkpoint(), pool.allocate_checkpoint(), pool.allocate_checkpoint()] == [2, 3, None]
    assert pool.allocate() == 0 and pool.num_used_checkpoints == 2
    pool.free_checkpoint(3)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_checkpoint(3)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_checkpoint(0)  # a request slot is not a checkpoint
    with pytest.raises(ValueError):
        StatePool(1, -1)


def test_cached_blocks_get_checkpoints_written_by_the_step_that_computes_their_boundary():
    kv = KVCacheManager(16, 4, state_pool=StatePool(2, 8))
    a = _tokens_req("a", list(range(1, 11)))  # 10 tokens: blocks [0, 4), [4, 8) full
    a.num_computed_tokens = 0
    assert kv.allocate_slots(a, 6) is not None  # a chunk ending mid-block 1: only block 0 is full
    assert kv.take_state_plan("a") == (-1, [(4, 2)])
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 4) is not None
    assert kv.take_state_plan("a") == (-1, [(8, 3)])  # the boundary 8 lies in this step's tokens
    assert kv.take_state_plan("a") == (-1, [])  # taken once
    # in the same step the checkpoints are not written yet: a hit on them is shortened to nothing
    b = _tokens_req("b", list(range(1, 10)) + [99])
    assert _admit(kv, b) == 0 and kv.take_state_plan("b")[0] == -1
    kv.free(b)
    kv.begin_step()
    c = _tokens_req("c", list(range(1, 10)) + [99])
    assert _admit(kv, c) == 8
    assert kv.take_state_plan("c") == (3, [])  # starts from block 1's checkpoint
    assert kv.state_pool.num_used_checkpoints == 2


def test_hit_ends_at_the_last_block_with_a_checkpoint():
    kv = KVCacheManager(16, 4, state_pool=StatePool(2, 1))  # one checkpoint slot only
    a = _tokens_req("a", list(range(1, 14)))
    _admit(kv, a)
    assert kv.take_state_plan("a") == (-1, [(4, 2)])  # blocks 1 and 2 are cached without one
    kv.free(a)
    kv.begin_step()
    b = _tokens_req("b", list(range(1, 14)))
    assert _admit(kv, b) == 4, "blocks 1 and 2 are cached but cannot end a hit"
    assert kv.prefix_cache_hits == 0  # counted by the scheduler on admission
    kv.record_prefix_query(b.num_tokens, 4)
    assert kv.prefix_cache_hits == 4
    kv.free(b)


def test_checkpoints_are_freed_with_their_blocks():
    kv = KVCacheManager(4, 4, state_pool=StatePool(1, 4))
    a = _tokens_req("a", list(range(1, 10)))
    _admit(kv, a)
    kv.take_state_plan("a")
    kv.free(a)
    assert kv.state_pool.num_used_checkpoints == 2  # blocks 0 and 1 stay cached, with checkpoints
    assert kv.reset_prefix_cache() == 2
    assert kv.state_pool.num_used_checkpoints == 0 and kv.checkpoints.by_block == {}
    kv.begin_step()
    b = _tokens_req("b", list(range(1, 10)))
    _admit(kv, b)
    kv.take_state_plan("b")
    kv.free(b)
    kv.begin_step()
    c = _tokens_req("c", list(range(50, 66)))  # takes every block: b's cached blocks are evicted
    _admit(kv, c)
    assert kv.pool.num_evictions >= 2
    # b's two checkpoints went with their blocks, so c's four full blocks got all four slots
    assert sorted(kv.checkpoints.by_block) == [0, 1, 2, 3] and kv.state_pool.num_free_checkpoints == 0
    assert all(kv.pool.blocks[i].block_hash is not None for i in kv.checkpoints.by_block)
    kv.free(c)


def test_a_request_freed_before_its_step_releases_its_unwritten_checkpoints():
    kv = KVCacheManager(8, 4, state_pool=StatePool(1, 4))
    a = _tokens_req("a", list(range(1, 10)))
    _admit(kv, a)  # scheduled, then freed before the plan was taken (never recorded for a step)
    kv.free(a)
    assert kv.state_pool.num_used_checkpoints == 0 and kv.checkpoints.by_block == {}
    kv.begin_step()
    b = _tokens_req("b", list(range(1, 10)))
    assert _admit(kv, b) == 0  # the blocks are cached, but no checkpoint holds their state
    kv.free(b)


def test_no_checkpoints_without_prefix_caching():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False, state_pool=StatePool(1, 0))
    a = _tokens_req("a", list(range(1, 10)))
    _admit(kv, a)
    assert kv.checkpoints is None and kv.take_state_plan("a") == (-1, [])
    kv.free(a)

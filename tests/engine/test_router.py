"""The data-parallel router (``engine/router.py``): longest remembered prefix beyond the shared one,
else least loaded, never a dead replica; and the summed counters of ``engine/dp_stats.py``."""

from __future__ import annotations

import pytest

from pagedllm.core.hashing import extend_block_hashes
from pagedllm.engine.dp_stats import merge_stats
from pagedllm.engine.router import PrefixRouter, prompt_block_hashes
from pagedllm.stats import SchedulerStats, StepTimings


def H(*names: str) -> list[bytes]:
    """Stand-in block hashes."""
    return [n.encode() for n in names]


def test_no_match_goes_to_the_least_loaded_then_lowest_index():
    r = PrefixRouter(3, capacity_blocks=100)
    assert [r.route(H(f"p{i}")) for i in range(3)] == [0, 1, 2]  # all idle: lowest index, each in turn
    r.finished(1)
    assert r.route(H("q")) == 1  # replica 1 has fewest in flight now
    assert r.in_flight == [1, 1, 1]


def test_longest_prefix_wins_over_load():
    r = PrefixRouter(2, capacity_blocks=100, balance_abs_threshold=0)
    assert r.route(H("a")) == 0
    assert r.route(H("a", "b")) == 1  # replica 0 matches but is busier than the threshold allows
    r.balance_abs_threshold = 32
    r.finished(0)
    assert r.in_flight == [0, 1]
    assert (r.matched_blocks(0, H("a", "b", "c")), r.matched_blocks(1, H("a", "b", "c"))) == (1, 2)
    assert r.route(H("a", "b", "c")) == 1  # 2 blocks beat 1, although replica 1 is the busier
    assert r.route(H("a", "z")) == 0  # a tie (1 block each): the less loaded
    assert r.routed == [2, 2] and r.prefix_routed == [1, 1]


def test_first_request_with_a_shared_first_block_prefers_the_match():
    r = PrefixRouter(2, capacity_blocks=100)
    r.route(H("sys", "u1"))  # -> 0
    assert r.route(H("sys", "u2")) == 0  # shares "sys" with replica 0, although 0 is busier


def test_a_match_only_counts_from_the_first_block():
    r = PrefixRouter(2, capacity_blocks=100)
    r.route(H("a", "b"))  # -> 0
    assert r.matched_blocks(0, H("z", "b")) == 0
    assert r.route(H("z", "b")) == 1


def test_balance_threshold_overrides_a_prefix_match():
    r = PrefixRouter(2, capacity_blocks=100, balance_abs_threshold=2)
    for _ in range(3):
        assert r.route(H("hot")) == 0
    assert r.in_flight == [3, 0]
    assert r.route(H("hot")) == 1  # 3 more in flight than replica 1: the match is ignored


def test_dead_replica_is_skipped_and_forgotten():
    r = PrefixRouter(3, capacity_blocks=100)
    assert r.route(H("a", "b")) == 0
    r.mark_dead(0)
    assert r.in_flight[0] == 0 and r.matched_blocks(0, H("a", "b")) == 0
    assert r.route(H("a", "b")) == 1
    assert r.route(H("c")) == 2
    r.mark_dead(1)
    r.mark_dead(2)
    with pytest.raises(RuntimeError, match="no data-parallel replica is alive"):
        r.route(H("a"))


def test_memory_is_bounded_least_recently_sent_first():
    r = PrefixRouter(2, capacity_blocks=3)
    r.route(H("a", "b"))  # -> 0
    r.route(H("z"))  # -> 1
    r.route(H("a", "c", "d"))  # -> 0 (a matches): a, b, c, d; b is the oldest, dropped
    assert r.matched_blocks(0, H("a", "c", "d")) == 3
    assert r.matched_blocks(0, H("a", "b")) == 1


def chain(*names: str) -> list[bytes]:
    """Stand-in block hashes chained as the prefix cache's are: block i names blocks 0..i."""
    return ["|".join(names[:i + 1]).encode() for i in range(len(names))]


def chat(user: int, shared: int = 1, extra: int = 2) -> list[bytes]:
    """A chat prompt: ``shared`` blocks every chat has (template, system prompt), then its own."""
    return chain(*[f"sys{j}" for j in range(shared)], *[f"u{user}.{j}" for j in range(extra)])


@pytest.mark.parametrize("shared", [1, 4])
def test_chats_sharing_their_first_blocks_are_balanced(shared):
    """Issue 35: 32 concurrent chats with one template (and system prompt) split within 60/40
    (the old rule sent all 32 to replica 0: each matched its shared blocks there)."""
    r = PrefixRouter(2, capacity_blocks=10_000)
    got = [r.route(chat(u, shared)) for u in range(32)]
    assert 0.4 <= got.count(0) / 32 <= 0.6, got
    assert r.shared_blocks(chat(99, shared)) == shared
    # and again as chats finish and start, in waves
    for u in range(32, 96):
        r.finished(got[u - 32])
        got.append(r.route(chat(u, shared)))
    assert 0.4 <= got[32:].count(0) / 64 <= 0.6


def test_a_conversations_next_turn_follows_its_history():
    """8 conversations x 4 turns, each turn's prompt extending the last: every turn of a
    conversation goes where its first did, and the conversations split evenly."""
    r = PrefixRouter(2, capacity_blocks=10_000)
    home: dict[int, int] = {}
    for turn in range(4):
        sent = {}
        for c in range(8):  # a turn of every conversation in flight at once
            sent[c] = r.route(chat(c, shared=2, extra=2 + 3 * turn))
            assert home.setdefault(c, sent[c]) == sent[c], (c, turn)
        for rep in sent.values():
            r.finished(rep)
    assert sorted(home.values()) == [0] * 4 + [1] * 4


def test_a_lone_conversation_follows_its_history():
    """A conversation alone: one earlier prompt shares nothing yet, and with its own turns as the
    recent prompts, each turn still reaches past the previous one's blocks."""
    r = PrefixRouter(2, capacity_blocks=100)
    turns = [chat(1, extra=1 + 2 * t) for t in range(4)]
    assert [r.route(t) for t in turns] == [0, 0, 0, 0]  # all kept in flight: 0 is busier, and wins
    assert r.shared_blocks(chat(1, extra=20)) == 4  # turns 2 to 4, three of four, start with 4 blocks
    assert r.route(chat(2, extra=1)) == 1  # another chat: by load


def test_shared_blocks_is_a_majority_of_recent_distinct_prompts():
    r = PrefixRouter(2, capacity_blocks=100, window=4)
    assert r.shared_blocks(chat(0, shared=3)) == 0  # nothing seen
    r.route(chat(0, shared=3))
    r.route(chat(0, shared=3))  # the same prompt again: still one distinct prompt
    assert r.shared_blocks(chat(1, shared=3)) == 0
    r.route(chat(1, shared=3))
    assert r.shared_blocks(chat(2, shared=3)) == 3
    r.route(H("odd"))  # one odd prompt of three: the other two are still a majority
    assert r.shared_blocks(chat(2, shared=3)) == 3
    r.route(H("odd2"))  # window 4: chat 0, chat 1, odd, odd2: two of four is no majority
    assert r.shared_blocks(chat(2, shared=3)) == 0
    r.route([])  # no full block: not remembered as a prompt
    assert len(r._recent) == 4


def test_finished_never_goes_below_zero():
    r = PrefixRouter(1, capacity_blocks=1)
    r.finished(0)
    assert r.in_flight == [0]


@pytest.mark.parametrize("bad", [dict(num_replicas=0, capacity_blocks=1), dict(num_replicas=1, capacity_blocks=0),
                                 dict(num_replicas=1, capacity_blocks=1, balance_abs_threshold=-1),
                                 dict(num_replicas=1, capacity_blocks=1, window=1)])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        PrefixRouter(**bad)


def test_prompt_hashes_are_the_prefix_cache_keys():
    ids = list(range(40))
    want: list[bytes] = []
    extend_block_hashes(want, ids, 16, "salt")
    assert prompt_block_hashes(ids, 16, "salt") == want and len(want) == 2
    assert prompt_block_hashes(ids, 16, None) != want  # the salt is part of the key
    assert prompt_block_hashes(ids[:15], 16, None) == []  # no full block


def test_merge_stats_sums_counters_and_live_gauges():
    a = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_free_blocks=50, num_blocks=100,
                       prefix_cache_queries=64, prefix_cache_hits=32, num_prompt_tokens=100, num_generation_tokens=10,
                       num_steps=5, max_num_running=2, block_states="01", spec_accepted_per_position=[3],
                       step_timings=StepTimings(execute_s=1.0, idle_s=1.0, steps=5))
    b = SchedulerStats(num_running=1, kv_cache_usage=0.25, num_free_blocks=300, num_blocks=400, prefix_cache_hits=16,
                       num_prompt_tokens=50, num_steps=3, max_num_running=4, block_states="2",
                       spec_accepted_per_position=[1, 2], step_timings=StepTimings(execute_s=2.0, steps=3))
    m = merge_stats([a, b], [True, True])
    assert (m.num_running, m.num_waiting, m.num_free_blocks, m.num_blocks) == (3, 1, 350, 500)
    assert m.kv_cache_usage == pytest.approx((0.5 * 100 + 0.25 * 400) / 500)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.num_prompt_tokens, m.num_steps) == (64, 48, 150, 8)
    assert m.max_num_running == 4 and m.block_states == "012" and m.spec_accepted_per_position == [4, 2]
    assert m.step_timings.steps == 8 and m.step_timings.execute_s == pytest.approx(3.0)
    assert m.step_timings.mean_execute_s == pytest.approx(3.0 / 8)
    assert m.step_timings.idle_fraction == pytest.approx(1.0 / 4.0)
    # a dead replica: its counters stay (they must not go down), its gauges and pool leave
    d = merge_stats([a, b], [False, True])
    assert (d.num_running, d.num_blocks, d.num_free_blocks, d.block_states) == (1, 400, 300, "2")
    assert d.num_prompt_tokens == 150 and d.prefix_cache_hits == 48
    assert d.kv_cache_usage == pytest.approx(0.25)

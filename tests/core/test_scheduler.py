"""Scheduler, KV cache manager and block pool, driven by a fake runner (no model)."""

from __future__ import annotations

import logging

import pytest

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

EOS = 2
BS = 4  # block size


def make_sched(num_blocks=64, max_num_seqs=16, budget=64, max_model_len=1024, chunked=True, prefix_caching=False):
    # prompts here share prefixes (range(10, ...)); token counts below assume no cache hits
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len, chunked)


def make_req(rid, prompt_len, max_tokens=8, **params):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
    return Request(str(rid), list(range(10, 10 + prompt_len)), sp, {EOS}, max_tokens, arrival_time=0.0)


class FakeRunner:
    """Mirrors ModelRunner bookkeeping: samples a token for requests whose scheduled tokens reach the end."""

    def __init__(self, sched, token=100):
        self.sched = sched
        self.token = token  # int or callable(request_id, step) -> int
        self.known: dict[str, int] = {}  # rid -> num_computed_tokens as the runner sees it
        self.steps = 0

    def step(self):
        s = self.sched
        so = s.schedule()
        for rid in so.finished_req_ids:
            self.known.pop(rid, None)
        for nr in so.new_reqs:
            assert nr.req_id not in self.known
            assert len(nr.block_ids) * BS >= nr.num_computed_tokens + so.num_scheduled_tokens[nr.req_id]
            self.known[nr.req_id] = nr.num_computed_tokens
        for cr in so.cached_reqs:
            assert self.known[cr.req_id] == cr.num_computed_tokens
        out = ModelRunnerOutput()
        for rid, n in so.num_scheduled_tokens.items():
            req = s.requests[rid]
            self.known[rid] += n
            assert self.known[rid] == req.num_computed_tokens
            # every scheduled token has a KV slot
            assert len(s.kv.get_block_ids(rid)) * BS >= req.num_computed_tokens
            if req.num_computed_tokens == req.num_tokens:
                tok = self.token(rid, self.steps) if callable(self.token) else self.token
                out.sampled_token_ids[rid] = tok
        self.steps += 1
        outs = s.update_from_output(so, out)
        return so, outs


def drain(sched, runner, max_steps=10_000):
    """Step until no request is left; return every scheduler output."""
    plans = []
    while sched.has_unfinished_requests():
        so, _ = runner.step()
        plans.append(so)
        assert len(plans) < max_steps, "scheduler made no progress"
    return plans


def assert_all_free(sched):
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert sched.kv.req_to_blocks == {}
    assert sched.requests == {}
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


# ---------------------------------------------------------------- token budget and ordering

def test_token_budget_respected_every_step():
    s = make_sched(budget=40, num_blocks=200)
    for i, n in enumerate([3, 70, 17, 1, 39, 40, 41, 120]):
        s.add_request(make_req(i, n, max_tokens=6))
    runner = FakeRunner(s)
    plans = drain(s, runner)
    for so in plans:
        assert 0 < so.total_num_scheduled_tokens <= 40
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert len(so.num_scheduled_tokens) <= 16
    # every prompt token and every output token but the last is computed exactly once (no preemption)
    assert sum(so.total_num_scheduled_tokens for so in plans) == sum([3, 70, 17, 1, 39, 40, 41, 120]) + 8 * 5
    assert_all_free(s)


def test_running_requests_are_scheduled_before_waiting():
    s = make_sched(budget=8)
    a, b = make_req("a", 4, max_tokens=20), make_req("b", 4, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    runner = FakeRunner(s)
    runner.step()  # both prefills fit (4 + 4)
    late = make_req("late", 30)
    s.add_request(late)
    so, _ = runner.step()
    order = list(so.num_scheduled_tokens)
    assert order[:2] == ["a", "b"]  # decodes first
    assert so.num_scheduled_tokens["a"] == so.num_scheduled_tokens["b"] == 1
    assert so.num_scheduled_tokens["late"] == 6  # what is left of the budget
    assert [r.request_id for r in s.running] == ["a", "b", "late"]


def test_waiting_is_fifo_and_blocked_head_blocks_the_queue():
    s = make_sched(num_blocks=4, budget=64)  # 16 token slots
    s.add_request(make_req("big", 12, max_tokens=2))
    s.add_request(make_req("small", 2, max_tokens=2))
    s.add_request(make_req("too_big_now", 6, max_tokens=2))
    so = s.schedule()
    # big (3 blocks) and small (1 block) fit; the third must wait for free blocks
    assert list(so.num_scheduled_tokens) == ["big", "small"]
    assert [r.request_id for r in s.waiting] == ["too_big_now"]


def test_chunked_prefill_advances_num_computed_tokens():
    s = make_sched(budget=32)
    req = make_req("r", 100, max_tokens=3)
    s.add_request(req)
    runner = FakeRunner(s)
    seen = []
    for _ in range(4):
        so, outs = runner.step()
        seen.append(req.num_computed_tokens)
        if req.num_computed_tokens < 100:
            assert outs == [] and req.num_output_tokens == 0  # a partial chunk samples nothing
    assert seen == [32, 64, 96, 100]
    assert req.output_token_ids == [100]
    so, _ = runner.step()  # first decode
    assert so.num_scheduled_tokens == {"r": 1} and so.cached_reqs[0].num_computed_tokens == 100


def test_chunks_sent_once_as_new_then_as_diffs():
    s = make_sched(budget=10)
    s.add_request(make_req("r", 25, max_tokens=2))
    runner = FakeRunner(s)
    so1, _ = runner.step()
    assert [n.req_id for n in so1.new_reqs] == ["r"] and so1.cached_reqs == []
    assert so1.new_reqs[0].token_ids == list(range(10, 35)) and so1.new_reqs[0].num_computed_tokens == 0
    assert len(so1.new_reqs[0].block_ids) == 3  # 10 tokens / 4 per block
    so2, _ = runner.step()
    assert so2.new_reqs == [] and so2.cached_reqs[0].num_computed_tokens == 10
    assert len(so2.cached_reqs[0].new_block_ids) == 2  # 20 tokens -> 5 blocks


def test_prefill_without_chunking_waits_for_a_whole_budget():
    s = make_sched(budget=16, chunked=False)
    s.add_request(make_req("a", 4, max_tokens=10))
    s.add_request(make_req("b", 14, max_tokens=2))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 4}  # b does not fit in the remaining 12 and is not split
    assert s.requests["b"].num_computed_tokens == 0


def test_mixed_prefill_and_decode_in_one_step():
    s = make_sched(budget=20)
    s.add_request(make_req("dec", 5, max_tokens=10))
    runner = FakeRunner(s)
    runner.step()
    s.add_request(make_req("pre", 50, max_tokens=2))
    so, outs = runner.step()
    assert so.num_scheduled_tokens == {"dec": 1, "pre": 19}
    assert [o.request_id for o in outs] == ["dec"]  # only the decode sampled
    assert [n.req_id for n in so.new_reqs] == ["pre"] and [c.req_id for c in so.cached_reqs] == ["dec"]


def test_max_num_seqs_cap():
    s = make_sched(max_num_seqs=3, budget=1000)
    for i in range(7):
        s.add_request(make_req(i, 5, max_tokens=4))
    runner = FakeRunner(s)
    plans = drain(s, runner)
    assert all(len(so.num_scheduled_tokens) <= 3 for so in plans)
    assert len(plans[0].num_scheduled_tokens) == 3 and len(s.waiting) == 0
    assert_all_free(s)


def test_max_model_len_caps_output():
    s = make_sched(max_model_len=12)
    req = make_req("r", 8, max_tokens=100)
    s.add_request(req)
    drain(s, FakeRunner(s))
    assert req.num_tokens == 12 and req.status == RequestStatus.FINISHED_LENGTH


# ---------------------------------------------------------------- preemption

def test_preempts_most_recently_admitted_and_logs(caplog):
    # 6 blocks of 4 = 24 slots; three 8-token prompts take 2 blocks each; the 9th token needs a third
    s = make_sched(num_blocks=6, budget=100)
    reqs = [make_req(n, 8, max_tokens=10) for n in ("first", "second", "third")]
    for r in reqs:
        s.add_request(r)
    runner = FakeRunner(s)
    runner.step()  # all three prefilled: 6 blocks used, one output token each
    assert s.kv.num_free_blocks == 0
    with caplog.at_level(logging.INFO, logger="pagedllm.core.scheduler"):
        so, _ = runner.step()  # "first" needs a third block for token 8 -> evict "third"
    assert reqs[2].status == RequestStatus.PREEMPTED and reqs[2].num_computed_tokens == 0
    assert reqs[2].num_preemptions == 1 and s.num_preemptions == 1
    assert s.waiting[0] is reqs[2]
    assert s.kv.get_block_ids("third") == []
    assert "third" not in so.num_scheduled_tokens
    assert list(so.num_scheduled_tokens) == ["first", "second"]
    records = [r for r in caplog.records if r.levelno == logging.INFO and "preempt" in r.getMessage()]
    assert len(records) == 1 and "third" in records[0].getMessage()
    # the runner is told to drop its state next step, and gets the request again in full
    kept_outputs = list(reqs[2].output_token_ids)
    so, _ = runner.step()
    assert "third" in so.finished_req_ids
    plans = drain(s, runner)
    readmit = next(n for so in [so] + plans for n in so.new_reqs if n.req_id == "third")
    assert readmit.token_ids[:9] == reqs[2].prompt_token_ids + kept_outputs
    assert readmit.num_computed_tokens == 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 10 for r in reqs)
    assert_all_free(s)


def test_preempting_itself_when_alone_in_the_back():
    # the last running request cannot grow and no one is behind it: it preempts itself
    s = make_sched(num_blocks=4, budget=100)
    a, b = make_req("a", 8, max_tokens=8), make_req("b", 8, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    runner = FakeRunner(s)
    runner.step()  # 4 blocks used
    so, _ = runner.step()
    assert s.num_preemptions == 1 and b.status == RequestStatus.PREEMPTED
    assert so.num_scheduled_tokens == {"a": 1}
    drain(s, runner)
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert_all_free(s)


def test_heavy_preemption_makes_progress_and_frees_everything():
    s = make_sched(num_blocks=10, budget=16, max_num_seqs=8)
    reqs = [make_req(i, 3 + 5 * i, max_tokens=12) for i in range(6)]
    for r in reqs:
        s.add_request(r)
    plans = drain(s, FakeRunner(s, token=lambda rid, step: 1000 + step))
    assert s.num_preemptions > 0
    assert all(r.num_output_tokens == 12 for r in reqs)
    for so in plans:
        assert so.total_num_scheduled_tokens <= 16
    assert_all_free(s)


# ---------------------------------------------------------------- finishing

def test_finish_requests_frees_blocks_running_and_waiting():
    s = make_sched(num_blocks=8, budget=8, max_num_seqs=1)
    a, b = make_req("a", 10), make_req("b", 5)
    s.add_request(a)
    s.add_request(b)
    runner = FakeRunner(s)
    runner.step()
    assert s.kv.num_free_blocks == 6 and a in s.running and b in s.waiting
    s.finish_requests(["a", "b", "unknown"])
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert a.status.finish_reason == "abort"
    assert not s.has_unfinished_requests()
    assert_all_free(s)
    so = s.schedule()
    assert so.finished_req_ids == {"a"} and so.is_empty  # b never reached the runner
    s.finish_requests(["a"])  # already finished: ignored


def test_finish_requests_with_stop_status():
    s = make_sched()
    s.add_request(make_req("a", 3))
    runner = FakeRunner(s)
    runner.step()
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert_all_free(s)


def test_token_of_request_aborted_during_step_is_dropped():
    s = make_sched()
    req = make_req("a", 3)
    s.add_request(req)
    so = s.schedule()
    s.finish_requests(["a"])
    outs = s.update_from_output(so, ModelRunnerOutput({"a": 5}))
    assert outs == [] and req.output_token_ids == []
    assert_all_free(s)


# ---------------------------------------------------------------- stop conditions

def run_with_tokens(tokens, max_tokens=10, max_model_len=1024, **params):
    """Feed ``tokens`` as the sampled stream of one request; return (request, outputs)."""
    s = make_sched(max_model_len=max_model_len)
    req = make_req("r", 3, max_tokens=max_tokens, **params)
    s.add_request(req)
    it = iter(tokens)
    runner = FakeRunner(s, token=lambda rid, step: next(it))
    outs = []
    while s.has_unfinished_requests():
        outs += runner.step()[1]
    assert_all_free(s)
    return req, outs


def test_eos_stops():
    req, outs = run_with_tokens([5, 6, EOS, 7])
    assert req.output_token_ids == [5, 6, EOS]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None
    assert [o.finish_reason for o in outs[:-1]] == [None, None]


def test_ignore_eos_runs_to_max_tokens():
    req, outs = run_with_tokens([EOS] * 5, max_tokens=5, ignore_eos=True)
    assert req.output_token_ids == [EOS] * 5 and outs[-1].finish_reason == "length"


def test_stop_token_ids():
    req, outs = run_with_tokens([5, 77, 6], stop_token_ids=[77, 78])
    assert req.output_token_ids == [5, 77]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == 77


def test_stop_token_ids_apply_with_ignore_eos():
    req, outs = run_with_tokens([EOS, 77, 6], ignore_eos=True, stop_token_ids=[77])
    assert req.output_token_ids == [EOS, 77] and outs[-1].stop_reason == 77


def test_max_tokens_length():
    req, outs = run_with_tokens(range(300, 400), max_tokens=4)
    assert req.output_token_ids == [300, 301, 302, 303]
    assert outs[-1].finish_reason == "length" and outs[-1].stop_reason is None
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_min_tokens_defers_eos_and_stop_tokens():
    req, outs = run_with_tokens([EOS, 77, 5, EOS], min_tokens=3, stop_token_ids=[77])
    assert req.output_token_ids == [EOS, 77, 5, EOS]
    assert outs[-1].finish_reason == "stop"
    req, _ = run_with_tokens([5, 6, 77], min_tokens=3, stop_token_ids=[77])
    assert req.output_token_ids == [5, 6, 77]  # the 3rd token may stop


# ---------------------------------------------------------------- KV cache manager and block pool

def test_allocate_slots_counts_blocks_and_rolls_back():
    kv = KVCacheManager(5, BS, enable_prefix_caching=False)
    req = make_req("r", 9)
    assert len(kv.allocate_slots(req, 9)) == 3
    req.num_computed_tokens = 9
    assert kv.allocate_slots(req, 3) == []  # 12 tokens still fit in 3 blocks
    assert len(kv.allocate_slots(req, 4)) == 1
    other = make_req("o", 20)
    assert kv.allocate_slots(other, 20) is None  # needs 5, 1 free: nothing changes
    assert kv.num_free_blocks == 1 and "o" not in kv.req_to_blocks
    kv.free(req)
    kv.free(req)  # second free is a no-op
    assert kv.num_free_blocks == 5


def test_block_table_maps_tokens_in_order():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    req = make_req("r", 6)
    ids = kv.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    ids += kv.allocate_slots(req, 5)
    assert kv.get_block_ids("r") == ids and len(ids) == 3 and len(set(ids)) == 3


def test_block_pool_ref_counts_and_double_free():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1) and pool.num_free_blocks == 2 and pool.num_used_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free([a, b])
    assert pool.num_free_blocks == 4 and pool.usage() == 0.0
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])
    with pytest.raises(RuntimeError):
        pool.allocate(5)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_block_pool_touch_revives_a_free_block_and_lru_order():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.free([blocks[2], blocks[0], blocks[1]])  # freed in this order: evicted in this order
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 2
    assert [b.block_id for b in pool.allocate(2)] == [blocks[2].block_id, blocks[1].block_id]


def test_kv_manager_frees_tail_first():
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)
    req = make_req("r", 16)
    ids = kv.allocate_slots(req, 16)
    kv.free(req)
    assert [b.block_id for b in kv.pool.allocate(4)] == list(reversed(ids))


# ---------------------------------------------------------------- several steps in flight (pipeline)

def _sampled(so):
    """A runner output sampling token 100 for every request of step ``so`` that reached its end."""
    return ModelRunnerOutput(sampled_token_ids={rid: 100 for rid in so.num_scheduled_tokens})


def _pipelined(num_blocks: int, budget: int, prompt_len: int) -> Scheduler:
    """A scheduler with two steps in flight holding four waiting requests of ``prompt_len`` tokens."""
    s = Scheduler(KVCacheManager(num_blocks, BS, enable_prefix_caching=False), 16, budget, 1024, True,
                  steps_in_flight=2)
    for i in range(4):
        s.add_request(make_req(i, prompt_len))
    return s


def test_steps_in_flight_split_prompt_work_between_consecutive_steps():
    """Two steps in flight, prompts to compute: step 1 takes half of the requests, step 2 (issued
    before step 1's tokens are back) the other half; with the prompts done, step 3 does not wait for step
    2 (decodes are not split): it decodes all four, "2" and "3" with their tokens in flight."""
    s = _pipelined(256, 2048, 200)
    one = s.schedule()
    two = s.schedule()
    assert sorted(one.num_scheduled_tokens) == ["0", "1"] and sorted(two.num_scheduled_tokens) == ["2", "3"]
    s.update_from_output(one, _sampled(one))
    four = s.schedule()  # "2" and "3" still in flight: their tokens are placeholders
    assert sorted(four.num_scheduled_tokens) == ["0", "1", "2", "3"]
    assert all(n == 1 for n in four.num_scheduled_tokens.values())


def test_steps_in_flight_keep_decodes_together():
    """Decode only (under ``PIPELINE_SPLIT_MIN_TOKENS`` prompt tokens): every step takes every
    request, the tokens in flight as placeholders (the runner finishes the step before first)."""
    s = _pipelined(64, 64, 8)
    one = s.schedule()
    two = s.schedule()
    assert len(one.num_scheduled_tokens) == 4 and two.num_scheduled_tokens == {str(i): 1 for i in range(4)}
    assert all(r.num_output_placeholders == 2 for r in s.running)

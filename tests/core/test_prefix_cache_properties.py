"""Prefix caching under random workloads (hypothesis): scheduler, KV cache manager and block pool.

A state machine adds requests whose prompts share prefixes of random length
with a few base prompts (on block boundaries and one token either side),
steps the scheduler with a fake runner, finishes and aborts requests and
forces preemptions, on a pool small enough that the scheduler preempts too.

The fake runner keeps a simulated paged KV cache: each computed token writes
``(position, token id)`` into its slot through the runner's copy of the block
table (built from the scheduler's diffs, as the real runner does), and every
scheduled request then reads its whole context back. So a cached block handed
to the wrong request, or overwritten while shared, shows up as wrong content.
Tokens are sampled from the last tokens of the context, so equal prompts
produce equal outputs (output blocks are shared too), and every finished
request's output can be predicted from its prompt alone.
"""

from __future__ import annotations

import zlib
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from pagedllm.core.hashing import ROOT_HASH, hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 12  # 48 slots: the longest request (29 + 12 tokens) fits alone, four of them do not
MAX_SEQS = 4
EOS = 2

_B0 = list(range(10, 34))
BASES = [_B0, _B0[:8] + list(range(60, 76)), list(range(200, 224))]  # base 1 shares two blocks with base 0
# prefix lengths: every block boundary up to 16, one token either side, and longer ones
CUTS = [1, 3, 4, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 20, 23, 24]
SUFFIX_TOKENS = [500, 501, 502]  # a small alphabet, so suffixes collide too

STATS: Counter = Counter()  # summed over every example, checked after the run


def next_token(tokens: list[int]) -> int:
    """Deterministic 'model': the next token depends on the last three tokens only."""
    c = zlib.crc32(repr(tokens[-3:]).encode())
    return EOS if c % 19 == 0 else 600 + c % 5


def expected_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t == EOS or len(tokens) >= max_model_len:
            break
    return out


def ref_chain(hashes: list[bytes], tokens: list[int], salt: str | None) -> list[bytes]:
    """Extend ``hashes`` to every full block of ``tokens`` (written here, not taken from the manager)."""
    for i in range(len(hashes), len(tokens) // BS):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block_tokens(parent, tokens[i * BS:(i + 1) * BS], (salt,) if i == 0 and salt else ()))
    return hashes


class SimRunner:
    """The model runner's bookkeeping with a simulated KV cache and a fake model."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv = [[None] * BS for _ in range(NUM_BLOCKS)]  # (position, token) per slot
        self.states: dict[str, dict] = {}

    def slot(self, table: list[int], pos: int):
        return self.kv[table[pos // BS]][pos % BS]

    def step(self) -> None:
        s = self.sched
        so = s.schedule()
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        for nr in so.new_reqs:
            assert nr.req_id not in self.states
            self.states[nr.req_id] = dict(tokens=list(nr.token_ids), table=list(nr.block_ids),
                                          computed=nr.num_computed_tokens)
            STATS["admitted_with_hit"] += nr.num_computed_tokens > 0
        for cr in so.cached_reqs:
            st_ = self.states[cr.req_id]
            assert st_["computed"] == cr.num_computed_tokens
            st_["table"].extend(cr.new_block_ids)
        assert so.total_num_scheduled_tokens <= s.max_num_batched_tokens and len(so.num_scheduled_tokens) <= MAX_SEQS
        # write every scheduled token's K/V first (as the attention layers do), then read
        for rid, n in so.num_scheduled_tokens.items():
            st_, req = self.states[rid], s.requests[rid]
            assert n > 0
            assert st_["table"] == s.kv.get_block_ids(rid), "runner and scheduler block tables differ"
            assert st_["tokens"] == req.all_token_ids
            start = st_["computed"]
            assert start + n == req.num_computed_tokens <= req.num_tokens
            for p in range(start, start + n):
                self.kv[st_["table"][p // BS]][p % BS] = (p, st_["tokens"][p])
        out = ModelRunnerOutput()
        for rid, n in so.num_scheduled_tokens.items():
            st_ = self.states[rid]
            end = st_["computed"] + n
            context = [self.slot(st_["table"], p) for p in range(end)]
            assert context == list(enumerate(st_["tokens"][:end])), f"{rid} reads wrong KV"
            st_["computed"] = end
            if end == len(st_["tokens"]):
                tok = next_token(st_["tokens"])
                st_["tokens"].append(tok)
                out.sampled_token_ids[rid] = tok
        s.update_from_output(so, out)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Chunked prefill through a 16-token budget."""

    BUDGET = 16
    MAX_MODEL_LEN = 48
    CHUNKED = True

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True)
        self.sched = Scheduler(self.kv, MAX_SEQS, self.BUDGET, self.MAX_MODEL_LEN, self.CHUNKED)
        self.runner = SimRunner(self.sched)
        self.reqs: list[Request] = []
        self.forced: set[str] = set()  # requests ended from outside (abort / stop string)
        self.chains: dict[str, list[bytes]] = {}
        self.hash_prefix: dict[bytes, tuple] = {}
        self.num_forced_preemptions = 0

    # ---- operations ----------------------------------------------------------
    @rule(base=st.integers(0, len(BASES) - 1), cut=st.sampled_from(CUTS),
          suffix=st.lists(st.sampled_from(SUFFIX_TOKENS), max_size=5),
          salt=st.sampled_from([None, None, None, "tenant"]), max_tokens=st.integers(1, 12))
    def add(self, base, cut, suffix, salt, max_tokens):
        prompt = BASES[base][:cut] + suffix
        sp = SamplingParams(temperature=0, max_tokens=max_tokens)
        req = Request(f"r{len(self.reqs)}", prompt, sp, {EOS}, max_tokens, arrival_time=0.0, cache_salt=salt)
        self.reqs.append(req)
        self.chains[req.request_id] = []
        self.sched.add_request(req)

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            if not self.sched.has_unfinished_requests():
                return
            self.runner.step()
            self._learn_hashes()
            self.check()

    @precondition(lambda self: self.sched.requests)
    @rule(k=st.integers(0, 100), status=st.sampled_from([RequestStatus.FINISHED_ABORTED,
                                                         RequestStatus.FINISHED_STOPPED]))
    def finish_one(self, k, status):
        rids = sorted(self.sched.requests)
        rid = rids[k % len(rids)]
        self.forced.add(rid)
        self.sched.finish_requests([rid], status)
        assert rid not in self.sched.requests and rid not in self.kv.req_to_blocks

    @precondition(lambda self: self.sched.running)
    @rule()
    def force_preempt(self):
        victim = self.sched.running.pop()
        self.sched._preempt(victim)
        self.num_forced_preemptions += 1

    @rule()
    def reset_prefix_cache(self):
        n_cached_free = sum(1 for b in self.kv.pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        assert self.kv.reset_prefix_cache() == n_cached_free
        assert all(b.block_hash is None for b in self.kv.pool.blocks if b.ref_cnt == 0)

    # ---- invariants -----------------------------------------------------------
    def _learn_hashes(self) -> None:
        """Record the token prefix behind every block hash any request has produced."""
        for req in self.reqs:
            chain = self.chains[req.request_id]
            old = len(chain)
            ref_chain(chain, req.all_token_ids, req.cache_salt)
            for i in range(old, len(chain)):
                prefix = (req.cache_salt or None, tuple(req.all_token_ids[:(i + 1) * BS]))
                assert self.hash_prefix.setdefault(chain[i], prefix) == prefix, "hash collision"

    @invariant()
    def check(self) -> None:
        kv, pool, sched, sim = self.kv, self.kv.pool, self.sched, self.runner
        self._learn_hashes()
        holders: Counter = Counter()
        for rid, table in kv.req_to_blocks.items():
            ids = [b.block_id for b in table]
            assert len(set(ids)) == len(ids), f"{rid} holds a block twice: {ids}"
            holders.update(ids)
            req = sched.requests[rid]
            assert req.status == RequestStatus.RUNNING
            assert len(table) == cdiv(req.num_computed_tokens, BS)
            chain = self.chains[rid]
            for i, b in enumerate(table):
                if b.block_hash is not None:
                    assert (i + 1) * BS <= req.num_computed_tokens, "a block is cached before it is full"
                    assert chain[i] == b.block_hash, f"{rid} block {i} is cached under another prefix's hash"
            for p in range(req.num_computed_tokens):
                assert sim.slot(ids, p) == (p, req.all_token_ids[p]), f"{rid}: KV of position {p} was overwritten"
        for b in pool.blocks:
            assert b.ref_cnt == holders[b.block_id], f"{b}: {holders[b.block_id]} block tables hold it"
        assert set(pool._free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        # the block map the web page draws: in use, free with a cached prefix, or free
        assert bytes(pool.states) == bytes(pool.USED if b.ref_cnt else pool.CACHED if b.block_hash is not None
                                           else pool.FREE for b in pool.blocks)
        assert kv.num_free_blocks + pool.num_used_blocks == NUM_BLOCKS
        assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached)
        for h, b in pool.cached.items():
            assert b.block_hash == h
            # the block (in use or free) still holds the tokens its hash stands for
            _, prefix = self.hash_prefix[h]
            n = len(prefix)
            assert [sim.kv[b.block_id][o] for o in range(BS)] == [(p, prefix[p]) for p in range(n - BS, n)]
        assert set(kv.req_to_blocks) == {r.request_id for r in sched.running}
        assert set(kv.num_cached_blocks) <= set(kv.req_to_blocks)
        for r in sched.waiting:
            assert r.num_computed_tokens == 0 and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert set(sched.requests) == {r.request_id for r in list(sched.waiting) + sched.running}

    def teardown(self) -> None:
        sched, kv = self.sched, self.kv
        for _ in range(2000):
            if not sched.has_unfinished_requests():
                break
            self.runner.step()
            self.check()
        assert not sched.has_unfinished_requests(), "the scheduler made no progress"
        assert kv.num_free_blocks == NUM_BLOCKS and kv.req_to_blocks == {} and kv.num_cached_blocks == {}
        assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
        assert sched.requests == {}
        # outputs are what the fake model predicts: preemption and cache hits change nothing
        for req in self.reqs:
            assert req.is_finished()
            want = expected_output(req.prompt_token_ids, req.max_tokens, self.MAX_MODEL_LEN)
            if req.request_id in self.forced:
                assert req.output_token_ids == want[:req.num_output_tokens]
            else:
                assert req.output_token_ids == want, req.request_id
        natural = sched.num_preemptions - self.num_forced_preemptions
        STATS["examples"] += 1
        STATS["natural_preemptions"] += natural
        STATS["runs_with_natural_preemption"] += natural > 0
        STATS["hit_tokens"] += kv.prefix_cache_hits
        STATS["evictions"] += kv.pool.num_evictions
        assert kv.prefix_cache_hits <= kv.prefix_cache_queries
        assert kv.prefix_cache_hits % BS == 0


class UnchunkedPrefixCacheMachine(PrefixCacheMachine):
    """Whole prompts only, and a context limit that ends some requests before ``max_tokens``.

    The budget holds any whole request (as the engine's ``context_limit`` guarantees).
    """

    BUDGET = 40
    MAX_MODEL_LEN = 36
    CHUNKED = False


@pytest.mark.parametrize("machine", [PrefixCacheMachine, UnchunkedPrefixCacheMachine])
def test_prefix_cache_state_machine(machine):
    STATS.clear()
    run_state_machine_as_test(machine, settings=settings(
        max_examples=150, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    # the workload exercised what it is meant to
    assert STATS["runs_with_natural_preemption"] > 0, STATS
    assert STATS["admitted_with_hit"] > 0 and STATS["hit_tokens"] > 0, STATS
    assert STATS["evictions"] > 0, STATS


# ---------------------------------------------------------------- targeted cases

def _req(rid: str, prompt: list[int], salt: str | None = None, max_tokens: int = 4) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(rid, prompt, sp, {EOS}, max_tokens, arrival_time=0.0, cache_salt=salt)


def _admit(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit the whole prompt as the scheduler does (no budget limit); returns the block ids."""
    blocks, n = kv.get_computed_blocks(req)
    req.num_computed_tokens = n
    assert kv.allocate_slots(req, req.num_tokens - n, blocks) is not None
    kv.record_prefix_query(req.num_tokens, n)
    req.num_computed_tokens = req.num_tokens
    return kv.get_block_ids(req.request_id)


def test_full_hit_is_capped_and_the_last_block_is_recomputed_privately():
    kv = KVCacheManager(NUM_BLOCKS, BS)
    prompt = list(range(100, 108))  # exactly two blocks
    a_ids = _admit(kv, _req("a", prompt))
    hashes = ref_chain([], prompt, None)
    assert [kv.pool.blocks[i].block_hash for i in a_ids] == hashes
    kv.free(_req("a", prompt))
    b = _req("b", prompt)
    blocks, n = kv.get_computed_blocks(b)
    assert n == BS and [x.block_id for x in blocks] == a_ids[:1]  # the last token must be computed
    b_ids = _admit(kv, b)
    assert b_ids[0] == a_ids[0] and b_ids[1] != a_ids[1]
    # the recomputed copy stays private; the first copy remains the cached one (free, evictable)
    assert kv.pool.blocks[b_ids[1]].block_hash is None
    assert kv.pool.get_cached_block(hashes[1]).block_id == a_ids[1] and kv.pool.blocks[a_ids[1]].ref_cnt == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (16, BS)


def test_partial_blocks_are_never_shared():
    kv = KVCacheManager(NUM_BLOCKS, BS)
    prompt = list(range(100, 106))  # one full block and two tokens
    a_ids = _admit(kv, _req("a", prompt))
    b = _req("b", prompt)
    assert kv.get_computed_blocks(b)[1] == BS
    b_ids = _admit(kv, b)
    assert b_ids[0] == a_ids[0] and kv.pool.blocks[a_ids[0]].ref_cnt == 2
    assert b_ids[1] != a_ids[1] and kv.pool.blocks[a_ids[1]].block_hash is None
    assert len(kv.pool.cached) == 1


def test_lru_eviction_takes_the_tail_of_a_freed_chain_first():
    kv = KVCacheManager(NUM_BLOCKS, BS)
    a = _req("a", list(range(100, 112)))  # three blocks
    a_ids = _admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == NUM_BLOCKS and len(kv.pool.cached) == 3
    # ten blocks for other tokens: nine never-used blocks, then the least recently freed: a's last block
    c_ids = _admit(kv, _req("c", list(range(300, 340))))
    assert a_ids[2] in c_ids and not set(a_ids[:2]) & set(c_ids)
    assert kv.pool.num_evictions == 1 and len(kv.pool.cached) == 2 + 10
    assert kv.pool.blocks[a_ids[2]].block_hash == ref_chain([], list(range(300, 340)), None)[c_ids.index(a_ids[2])]
    again = _req("a2", list(range(100, 112)) + [7])
    blocks, n = kv.get_computed_blocks(again)
    assert n == 2 * BS and [x.block_id for x in blocks] == a_ids[:2]


def test_hit_on_free_cached_blocks_counts_them_against_the_pool_and_rolls_back():
    kv = KVCacheManager(4, BS)
    prefix = list(range(100, 108))
    a = _req("a", prefix)
    a_ids = _admit(kv, a)
    kv.free(a)
    big = _req("big", prefix + list(range(200, 209)))  # 17 tokens: 5 blocks > the pool
    blocks, n = kv.get_computed_blocks(big)
    assert n == 2 * BS
    big.num_computed_tokens = n
    assert kv.allocate_slots(big, big.num_tokens - n, blocks) is None
    # nothing changed: the cached blocks are still free and still cached
    assert kv.num_free_blocks == 4 and "big" not in kv.req_to_blocks
    assert all(kv.pool.blocks[i].ref_cnt == 0 and kv.pool.blocks[i].block_hash for i in a_ids)
    fits = _req("fits", prefix + list(range(200, 205)))  # 13 tokens: 2 cached + 2 new blocks
    assert _admit(kv, fits)[:2] == a_ids and kv.num_free_blocks == 0


def test_salts_and_disabled_caching():
    kv = KVCacheManager(NUM_BLOCKS, BS)
    prompt = list(range(100, 109))
    _admit(kv, _req("a", prompt, salt="x"))
    assert kv.get_computed_blocks(_req("b", prompt, salt="y"))[1] == 0
    assert kv.get_computed_blocks(_req("c", prompt))[1] == 0
    assert kv.get_computed_blocks(_req("d", prompt, salt="x"))[1] == 2 * BS
    off = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=False)
    _admit(off, _req("a", prompt))
    assert off.get_computed_blocks(_req("b", prompt)) == ([], 0)
    _admit(off, _req("b", prompt))
    assert off.pool.cached == {} and all(b.block_hash is None for b in off.pool.blocks)
    assert (off.prefix_cache_queries, off.prefix_cache_hits) == (0, 0)

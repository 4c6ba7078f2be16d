"""Soak: a few hundred mixed requests through ``LLMEngine`` on a tiny random model.

Requests share prefixes (cache hits, with and without salts), end by length,
EOS or stop strings, are aborted at random steps (waiting or running), are
rejected as too long, and preempt each other on a small KV pool. The block
pool's bookkeeping is checked as it runs, and at the end the pool, scheduler,
runner and output processor are back where they started.
"""

from __future__ import annotations

import random
from collections import Counter

import torch

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine, PromptTooLongError

N_REQUESTS = 300
BLOCK = 8


def check_pool(eng: LLMEngine) -> None:
    """Reference counts equal block-table membership; the cache index is consistent."""
    kv = eng.kv_cache_manager
    holders: Counter = Counter()
    for table in kv.req_to_blocks.values():
        ids = [b.block_id for b in table]
        assert len(ids) == len(set(ids))
        holders.update(ids)
    assert all(b.ref_cnt == holders[b.block_id] for b in kv.pool.blocks)
    assert kv.num_free_blocks == sum(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert set(kv.req_to_blocks) == {r.request_id for r in eng.scheduler.running}
    assert all(b.block_hash == h for h, b in kv.pool.cached.items())
    sp = kv.state_pool  # a hybrid model's state slots: one per running request, each held once
    if sp is not None:
        slots = list(kv.req_to_state.values())
        assert len(slots) == len(set(slots)) and set(kv.req_to_state) == set(kv.req_to_blocks)
        assert sp.num_used_slots == len(slots) and sp.num_free_slots + sp.num_used_slots == sp.num_slots
        ck = kv.checkpoints  # prefix-cache state checkpoints: each slot held by one still-cached block
        if ck is not None:
            held = list(ck.by_block.values())
            assert len(held) == len(set(held)) == sp.num_used_checkpoints
            assert all(kv.pool.blocks[b].block_hash is not None for b in ck.by_block)
            assert sp.num_free_checkpoints + sp.num_used_checkpoints == sp.num_checkpoints


def random_params(rng: random.Random) -> tuple[str, SamplingParams]:
    mt = rng.randint(1, 24)
    kind = rng.choice(["greedy", "greedy", "seeded", "seeded", "random", "stop", "stop", "min_tokens"])
    if kind == "greedy":
        return kind, SamplingParams(temperature=0, max_tokens=mt, ignore_eos=rng.random() < 0.5)
    if kind == "seeded":
        return kind, SamplingParams(temperature=0.8, seed=rng.randrange(1 << 30), max_tokens=mt, ignore_eos=True)
    if kind == "random":
        return kind, SamplingParams(temperature=1.0, top_k=50, max_tokens=mt)
    if kind == "stop":
        return kind, SamplingParams(temperature=0.9, max_tokens=mt, stop=[rng.choice(["e", "a", "s", " the"])],
                                    include_stop_str_in_output=rng.random() < 0.3)
    return kind, SamplingParams(temperature=0.7, max_tokens=mt, min_tokens=rng.randint(0, mt))


def _hf_loader(path):
    def load():
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load


def test_soak_mixed_requests_leave_no_trace(tiny_model_dir, assert_no_leaks, greedy_ref):
    rng = random.Random(20261130)
    path = tiny_model_dir("llama")
    eng = LLMEngine(EngineArgs(model=str(path), num_kv_blocks=40, block_size=BLOCK, max_num_batched_tokens=64,
                               max_num_seqs=10))
    limit = eng.context_limit
    assert limit == 40 * BLOCK
    bases = [[rng.randrange(3, 49152) for _ in range(160)] for _ in range(3)]

    accepted: dict[str, tuple[list[int], str, SamplingParams, str | None]] = {}
    rejected: Counter = Counter()
    live: set[str] = set()
    aborted: set[str] = set()
    results: dict = {}
    n_added = steps = 0
    while n_added < N_REQUESTS or eng.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3]) if n_added < N_REQUESTS else 0):
            rid = f"q{n_added}"
            n_added += 1
            kind, params = random_params(rng)
            roll = rng.random()
            if roll < 0.04:  # a prompt over the context limit
                prompt = [rng.randrange(3, 49152) for _ in range(limit + rng.randint(0, 8))]
            elif roll < 0.07:  # a prompt that fits, but not with max_tokens
                prompt = [rng.randrange(3, 49152) for _ in range(limit - rng.randint(1, 10))]
                params = SamplingParams(temperature=0, max_tokens=rng.randint(11, 40))
            else:
                cut = rng.choice([rng.randint(1, 130), BLOCK * rng.randint(1, 14) + rng.choice([-1, 0, 1])])
                prompt = rng.choice(bases)[:cut] + [rng.randrange(3, 49152) for _ in range(rng.choice([0, 0, 1, 5]))]
            salt = rng.choice([None] * 6 + ["tenant-1", "tenant-2"])
            try:
                eng.add_request(rid, prompt, params, cache_salt=salt)
            except PromptTooLongError as e:
                assert len(prompt) + (params.max_tokens or 0) > limit
                rejected[e.param] += 1
                assert rid not in eng.scheduler.requests and rid not in eng.output_processor.states
                continue
            accepted[rid] = (prompt, kind, params, salt)
            live.add(rid)
        if live and rng.random() < 0.06:
            rid = rng.choice(sorted(live))
            eng.abort_request([rid])
            live.discard(rid)
            aborted.add(rid)
            assert eng.kv_cache_manager.get_block_ids(rid) == []
        if rng.random() < 0.01:
            eng.abort_request(["no-such-request"])
        for out in eng.step():
            rid = out.request_id
            assert rid in live, f"output for {rid}, which is not live"
            comp = out.outputs[0]
            assert len(comp.token_ids) <= accepted[rid][2].max_tokens
            if out.finished:
                live.discard(rid)
                results[rid] = out
        steps += 1
        if steps % 5 == 0:
            check_pool(eng)
        assert steps < 20_000, "no progress"

    # every accepted request either finished or was aborted, never both
    assert not live and set(results) | aborted == set(accepted) and not set(results) & aborted
    reasons: Counter = Counter()
    for rid, out in results.items():
        prompt, kind, params, _ = accepted[rid]
        comp = out.outputs[0]
        reasons[(kind, comp.finish_reason, type(comp.stop_reason).__name__)] += 1
        assert out.prompt_token_ids == prompt
        if comp.finish_reason == "length":
            assert len(comp.token_ids) == params.max_tokens
        else:
            assert comp.finish_reason == "stop"
            assert len(comp.token_ids) >= max(params.min_tokens, 1)
            if isinstance(comp.stop_reason, str):
                assert kind == "stop" and comp.stop_reason in params.stop
                assert comp.text.endswith(comp.stop_reason) == params.include_stop_str_in_output
            else:
                assert comp.token_ids[-1] in eng.eos_token_ids and not params.ignore_eos
    # the workload did what it is meant to
    stats = eng.get_stats()
    assert len(results) > 200 and len(aborted) >= 5 and rejected["prompt"] and rejected["max_tokens"]
    assert sum(n for (k, _, r), n in reasons.items() if k == "stop" and r == "str") >= 10, reasons
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats

    # one more (empty) step hands the runner the last finished ids
    assert eng.step() == []
    assert eng.runner.requests == {} and eng.scheduler._finished_ids == set()
    assert eng.output_processor.states == {} and eng.scheduler.requests == {}
    assert_no_leaks(eng)
    # only the cache index remains; dropping it restores the pool's starting state
    n_cached = len(eng.kv_cache_manager.pool.cached)
    assert n_cached > 0 and eng.kv_cache_manager.reset_prefix_cache() == n_cached
    assert eng.kv_cache_manager.pool.cached == {}
    assert all(b.block_hash is None and b.ref_cnt == 0 for b in eng.kv_cache_manager.pool.blocks)
    assert eng.kv_cache_manager.num_free_blocks == eng.num_blocks

    # deterministic requests give the same tokens alone on a cold cache as they did in the crowd
    sample = [rid for rid, out in results.items() if accepted[rid][1] in ("greedy", "seeded")][:6]
    assert len(sample) == 6
    for rid in sample:
        prompt, kind, params, salt = accepted[rid]
        eng.add_request(f"again-{rid}", prompt, params, cache_salt=salt)
        alone = []
        while eng.has_unfinished_requests():
            alone = [o for o in eng.step() if o.finished] or alone
        got, want = alone[0].outputs[0].token_ids, results[rid].outputs[0].token_ids
        if kind == "greedy" and params.ignore_eos:
            greedy_ref.assert_same_greedy(got, want, prompt, _hf_loader(path), f"soak {rid}")
        else:
            assert got == want, rid
    assert_no_leaks(eng)

"""Data parallelism (``--data-parallel-size``): two engine cores behind one front end.

Greedy tokens equal one core's; both replicas serve; a repeated long prefix lands on the replica
that cached it (its prefix-cache hit counter rises, the other's does not); a killed replica fails
only its own requests, with a clear error, and the other keeps serving; no process is left behind.
The cores are spawned processes; their test functions live in this importable module.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.cli_args import add_engine_flags, engine_args_from_cli
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.dp_client import DPClient
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.messages import EngineDeadError

PROMPTS = ["The capital of France is", "Once upon a time there was", "def fibonacci(n):", "Hello",
           "Water boils at", "1, 2, 3, 4,", "My favourite colour is", "import numpy as"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
DEADLINE_S = 120.0  # generous: the machine is shared


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (ProcessLookupError, OSError):
        return False


def _gone(pids: list[int]) -> bool:
    """Wait (generously) until none of ``pids`` runs."""
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(_alive(p) for p in pids)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def dp_llm(model):
    llm = LLM(model=model, num_kv_blocks=256, data_parallel_size=2)
    yield llm
    pids = llm.engine.client.pids
    llm.engine.shutdown()
    assert _gone(pids)


def _replicas(engine) -> list[dict]:
    return engine.client.replica_stats()


def _wait_counters(engine, pred) -> list[dict]:
    """Read the cores' messages until ``pred(replica_stats)`` holds (or the deadline passes)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        engine.step()
        reps = _replicas(engine)
        if pred(reps) or time.monotonic() > deadline:
            return reps


def test_args_and_flags():
    assert EngineArgs(data_parallel_size=2).enable_multiprocessing is True  # DP needs core processes
    with pytest.raises(ValueError, match="--no-enable-multiprocessing"):
        EngineArgs(data_parallel_size=2, enable_multiprocessing=False)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=r"--data-parallel-size \(data_parallel_size\) must be an integer >= 1"):
            EngineArgs(data_parallel_size=bad)
    import argparse
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_args_from_cli(p.parse_args(["--data-parallel-size", "3"])).data_parallel_size == 3
    assert engine_args_from_cli(p.parse_args([])).data_parallel_size == 1


def test_greedy_equals_one_core_and_both_replicas_serve(dp_llm, model):
    assert isinstance(dp_llm.engine.client, DPClient) and len(set(dp_llm.engine.client.pids)) == 2
    one = LLM(model=model, num_kv_blocks=256)
    try:
        want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        one.engine.shutdown()
    got = [o.outputs[0].token_ids for o in dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want and all(len(t) == 10 for t in got)
    reps = _wait_counters(dp_llm.engine, lambda rs: sum(r["num_generation_tokens"] for r in rs) == 80)
    assert [r["routed"] for r in reps] == [4, 4]  # short prompts (no full block): by load, in turn
    assert all(r["num_generation_tokens"] == 40 and r["num_prompt_tokens"] > 0 for r in reps)
    st = dp_llm.engine.get_stats()
    assert st.num_generation_tokens == 80 and st.num_blocks == 512
    assert st.num_prompt_tokens == sum(r["num_prompt_tokens"] for r in reps)
    assert dp_llm.engine.client.owner == {}  # every finished request forgotten by the router
    assert dp_llm.engine.client.router.in_flight == [0, 0]


def test_repeated_prefix_lands_on_the_replica_that_cached_it(dp_llm):
    eng = dp_llm.engine
    prefix = " ".join(f"word{i}" for i in range(60))  # many full 16-token blocks
    before = _replicas(eng)
    dp_llm.generate([prefix + " first"], GREEDY, use_tqdm=False)
    after_first = _replicas(eng)
    home = next(i for i in range(2) if after_first[i]["routed"] > before[i]["routed"])
    other = 1 - home
    hits0 = [r["prefix_cache_hits"] for r in after_first]
    for i in range(3):  # one at a time: the cached blocks are there for each
        dp_llm.generate([prefix + f" again {i}"], GREEDY, use_tqdm=False)
    reps = _wait_counters(eng, lambda rs: rs[home]["prefix_cache_hits"] >= hits0[home] + 3 * 64)
    assert reps[home]["routed"] == after_first[home]["routed"] + 3
    assert reps[other]["routed"] == after_first[other]["routed"]
    assert reps[home]["prefix_routed"] >= 3
    assert reps[home]["prefix_cache_hits"] >= hits0[home] + 3 * 64  # at least 4 blocks of 16 hit, each time
    assert reps[other]["prefix_cache_hits"] == hits0[other]
    assert eng.get_stats().prefix_cache_hits == sum(r["prefix_cache_hits"] for r in reps)


def test_killed_replica_fails_its_requests_and_the_other_serves(model):
    eng = LLMEngine(EngineArgs(model=model, num_kv_blocks=256, data_parallel_size=2))
    pids = list(eng.client.pids)
    try:
        eng.add_request("a", PROMPTS[0], LONG)
        eng.add_request("b", PROMPTS[1], LONG)
        assert eng.client.owner == {"a": 0, "b": 1}
        seen: set[str] = set()
        deadline = time.monotonic() + DEADLINE_S
        while seen != {"a", "b"} and time.monotonic() < deadline:  # both are generating
            seen |= {o.request_id for o in eng.step()}
        assert seen == {"a", "b"}
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"data-parallel replica 0 .* died.*failed requests: a\)"):
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline:
                eng.step()
        assert eng.is_alive()  # one replica is left
        assert "a" not in eng.output_processor.states and "b" in eng.output_processor.states
        more: list = []
        deadline = time.monotonic() + DEADLINE_S
        while not more and time.monotonic() < deadline:  # b keeps generating on replica 1
            more = [o for o in eng.step() if o.request_id == "b"]
        assert more
        eng.abort_request(["b"])
        eng.add_request("c", PROMPTS[2], GREEDY)
        eng.add_request("d", PROMPTS[3], GREEDY)
        assert eng.client.owner == {"c": 1, "d": 1}  # the dead replica gets nothing
        done: dict = {}
        deadline = time.monotonic() + DEADLINE_S
        while len(done) < 2 and time.monotonic() < deadline:
            done.update({o.request_id: o for o in eng.step() if o.finished})
        assert sorted(done) == ["c", "d"] and all(len(o.outputs[0].token_ids) == 10 for o in done.values())
        reps = _replicas(eng)
        assert [r["alive"] for r in reps] == [False, True]
        assert "exited with code" in reps[0]["error"] and reps[0]["num_running"] == 0
        assert eng.get_stats().num_blocks == 256  # the dead replica's pool is gone
    finally:
        eng.shutdown()
    assert _gone(pids)


def test_async_requests_spread_and_a_dead_replica_fails_only_its_streams(model):
    eng = LLMEngine(EngineArgs(model=model, num_kv_blocks=256, data_parallel_size=2))
    pids = list(eng.client.pids)
    llm = AsyncLLM(eng)

    async def run() -> None:
        async def collect(i: int, sp: SamplingParams):
            out = []
            async for o in llm.generate(llm.make_request(f"r{i}", PROMPTS[i % len(PROMPTS)], sp)):
                out.extend(o.outputs[0].token_ids)
            return out

        got = await asyncio.wait_for(asyncio.gather(*(collect(i, GREEDY) for i in range(8))), DEADLINE_S)
        assert all(len(t) == 10 for t in got)
        reps = llm.replica_stats()
        assert [r["routed"] for r in reps] == [4, 4] and all(r["num_generation_tokens"] == 40 for r in reps)
        assert llm.get_stats().num_generation_tokens == 80
        # two long streams, one per replica; kill replica 0 once both have produced tokens
        streams = [llm.generate(llm.make_request(f"long{i}", PROMPTS[i], LONG)) for i in range(2)]
        firsts = await asyncio.wait_for(asyncio.gather(*(s.__anext__() for s in streams)), DEADLINE_S)
        assert [f.request_id for f in firsts] == ["long0", "long1"]
        assert llm.client.owner["long0"] == 0 and llm.client.owner["long1"] == 1
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="data-parallel replica 0"):
            await asyncio.wait_for(_drain(streams[0]), DEADLINE_S)
        assert llm.is_healthy
        nxt = await asyncio.wait_for(streams[1].__anext__(), DEADLINE_S)  # the other stream goes on
        assert nxt.request_id == "long1" and not nxt.finished
        await streams[1].aclose()  # aborts it
        assert await asyncio.wait_for(collect(9, GREEDY), DEADLINE_S)  # served by replica 1
        assert llm.replica_stats()[1]["routed"] == 6 and llm.replica_stats()[0]["alive"] is False

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()
    assert _gone(pids)


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_dp2_with_tp2_replicas_each_shard_and_match_one_core(model):
    """DP=2 x TP=2: each replica's core process runs its own tensor-parallel group (one worker
    process each, its own rendezvous); greedy output equals one unsharded core's."""
    one = LLM(model=model, num_kv_blocks=256)
    try:
        want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        one.engine.shutdown()
    llm = LLM(model=model, num_kv_blocks=64, data_parallel_size=2, tensor_parallel_size=2, num_threads=1)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        reps = _wait_counters(llm.engine, lambda rs: sum(r["num_generation_tokens"] for r in rs) == 80)
        pids = llm.engine.client.pids
        workers = _children_of(pids)
    finally:
        llm.engine.shutdown()
    assert got == want
    assert [r["routed"] for r in reps] == [4, 4]
    assert len(workers) >= 2  # a tensor-parallel worker under each replica's core
    assert _gone(pids + workers)


def _children_of(pids: list[int]) -> list[int]:
    """Processes whose parent is one of ``pids`` (read from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) in pids:
                out.append(int(d))
    return out


def test_a_script_that_never_shuts_down_dp_exits(model):
    """An ``LLM(data_parallel_size=2)`` left to the interpreter's exit stops its core processes (a
    script that never called ``shutdown`` hung at exit in multiprocessing's join)."""
    code = ("from pagedllm import LLM, SamplingParams; "
            f"llm = LLM(model={model!r}, num_kv_blocks=64, data_parallel_size=2); "
            "print(len(llm.generate([[1, 520, 3012]], SamplingParams(temperature=0, max_tokens=3), "
            "use_tqdm=False)[0].outputs[0].token_ids))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("3")

"""The engine core in its own process: same tokens as in process, a step loop the front end cannot stall.

The core process is started with ``spawn``; its test functions live in this
importable module, so that works under pytest.
"""

from __future__ import annotations

import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.core_client import EngineDeadError

PROMPTS = ["The capital of France is", "Once upon a time there was", "def fibonacci(n):", "Hello"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def mp_llm():
    llm = LLM(num_kv_blocks=256, enable_multiprocessing=True)
    yield llm
    llm.engine.shutdown()


def wait_idle(engine, timeout_s: float = 60.0) -> dict:
    """Poll the core's counters until nothing runs and every block is free (or time out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        engine.step()  # reads whatever the core sent, counters included
        st = engine.get_stats()
        if (st["num_running"] == 0 and st["num_waiting"] == 0 and st["num_free_blocks"] == st["num_blocks"]) \
                or time.monotonic() > deadline:
            return st


def test_same_tokens_as_in_process(mp_llm):
    """Greedy tokens (with a stop string and max_tokens) equal the in-process engine's."""
    inproc = LLM(num_kv_blocks=256)
    for sp in (GREEDY, SamplingParams(temperature=0, max_tokens=20, stop=["\n"])):
        a = [o.outputs[0].token_ids for o in mp_llm.generate(PROMPTS, sp, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in inproc.generate(PROMPTS, sp, use_tqdm=False)]
        assert a == b
    st = wait_idle(mp_llm.engine)
    assert st["num_free_blocks"] == st["num_blocks"] and st["num_running"] == 0
    # the core process reports whether its steps use the C kernels, as the in-process engine does
    from pagedllm.kernels import cpu as cpu_kernels
    assert st["cpu_kernels"] is inproc.engine.get_stats()["cpu_kernels"] is cpu_kernels.available()


def test_abort_frees_blocks_in_the_core(mp_llm):
    """An aborted request's blocks come back in the core process."""
    eng = mp_llm.engine
    eng.add_request("long", "Tell me a very long story.", SamplingParams(max_tokens=500, ignore_eos=True))
    eng.step()
    eng.abort_request(["long"])
    st = wait_idle(eng)
    assert st["num_free_blocks"] == st["num_blocks"] and st["num_running"] == 0


def test_core_keeps_stepping_while_the_front_end_is_slow(mp_llm):
    """With the front end asleep (reading nothing), the core still runs step after step.

    No wall-clock pace is assumed: the core's own pace is measured first while the front
    end reads, and the front end then sleeps three times as long as 10 such steps took.
    """
    eng = mp_llm.engine
    wait_idle(eng)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("pace", PROMPTS[0], sp)
    steps0, t0 = eng.get_stats()["num_steps"], time.monotonic()
    while eng.has_unfinished_requests():
        eng.step()
    per_step = (time.monotonic() - t0) / max(1, eng.get_stats()["num_steps"] - steps0)
    wait_idle(eng)
    steps0 = eng.get_stats()["num_steps"]
    for i in range(2):
        eng.add_request(f"slow-{i}", PROMPTS[i], sp)
    time.sleep(min(120.0, max(3.0, 30 * per_step)))  # the front end is "busy": nothing read, no step asked for
    outs = eng.step()  # everything the core produced meanwhile arrives at once
    st = eng.get_stats()
    assert st["num_steps"] - steps0 >= 10, "the core waited for the front end"
    assert sum(len(o.outputs[0].token_ids) for o in outs) >= 10
    while eng.has_unfinished_requests():
        eng.step()
    wait_idle(eng)


def test_a_dead_core_is_reported():
    """Killing the core process makes the next read raise EngineDeadError and is_alive() False."""
    llm = LLM(num_kv_blocks=64, enable_multiprocessing=True)
    eng = llm.engine
    try:
        eng.add_request("r", "Hello", SamplingParams(max_tokens=200, ignore_eos=True))
        eng.client.proc.kill()
        eng.client.proc.join(timeout=10)
        with pytest.raises(EngineDeadError):
            for _ in range(50):
                eng.step()
        assert not eng.is_alive()
    finally:
        eng.shutdown()
    assert not eng.client.proc.is_alive()


_ORPHAN_SCRIPT = """
import os, sys
from pagedllm import LLM, SamplingParams
llm = LLM(num_kv_blocks=64, enable_multiprocessing=True)
eng = llm.engine
eng.add_request("r", "Hello", SamplingParams(max_tokens=1000, ignore_eos=True))
for _ in range(3):
    eng.step()
print(eng.client.core_pid, flush=True)
os._exit(1)  # the front end dies without shutting the core down
"""


def test_core_exits_when_the_front_end_dies_mid_work():
    """A busy core whose front end died stops within seconds instead of generating for nobody."""
    import os
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", _ORPHAN_SCRIPT], capture_output=True, text=True, timeout=300)
    pid = int(p.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, 9)
    pytest.fail("the core process kept running after its front end died")

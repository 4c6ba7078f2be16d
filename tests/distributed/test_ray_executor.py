"""The Ray executor: TP=2 with rank 1 as a Ray actor gives TP=1's greedy tokens; a killed actor fails fast.

Starts a local Ray cluster (skipped without Ray: ``pip install 'pagedllm[ray]'``); one module-scoped
engine serves both tests, the local cluster stops at its shutdown.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pagedllm import LLM, SamplingParams

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[1, 520, 3012, 314, 260, 1142], list(range(100, 140))]


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return tiny_model_dir("llama")


def test_ray_tp2_then_killed_actor(path):
    one = LLM(str(path), num_kv_blocks=64, num_threads=1)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    one.engine.shutdown()
    llm = LLM(str(path), num_kv_blocks=64, num_threads=1, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == want
        executor = llm.engine.core.executor
        assert type(executor).__name__ == "RayExecutor" and len(executor.actors) == 1
        (pid,) = executor.pids
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) died"):
            llm.generate([PROMPTS[0]] * 4, SamplingParams(temperature=0, max_tokens=600, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - t0 < 60
        assert not llm.engine.is_alive()
    finally:
        llm.engine.shutdown()
    assert not ray.is_initialized()

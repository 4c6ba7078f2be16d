"""Tensor and pipeline parallelism together (TP=2 x PP=2, four ranks over gloo): the grid's groups,
TP=1's greedy tokens, the shards each rank holds, and a dead worker failing fast.

Each engine here starts three worker processes beside the test process (rank 0), so the tests
keep the tiny models, one thread per rank and short generations: the machine's cores are shared.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.distributed.parallel_state import grid_groups

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[1, 520, 3012, 314, 260, 1142], [1, 9182, 28, 451, 5035, 29, 7, 441, 33, 2847, 355, 1903] * 3,
           list(range(100, 160))]
GRID = dict(tensor_parallel_size=2, pipeline_parallel_size=2)


def _hf_loader(path):
    """A loader of the transformers model at ``path`` in float32 (the near-tie rule's oracle, built only if needed)."""
    def hf():
        import torch
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf


def _children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pagedllm-tp")]


def _generate(path, prompts, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), num_kv_blocks=64, num_threads=1, **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_grid_layout_is_stage_major():
    """Rank = pp_rank * tp + tp_rank: a TP group per stage, a pipeline group per TP position."""
    assert grid_groups(2, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert grid_groups(4, 2) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert grid_groups(1, 3) == ([[0], [1], [2]], [[0, 1, 2]])


def test_grid_flags_accepted_and_other_refusals_kept():
    a = EngineArgs(**GRID)
    assert a.parallel_flags() == "--tensor-parallel-size 2 --pipeline-parallel-size 2"
    assert EngineArgs(data_parallel_size=2, **GRID).data_parallel_size == 2  # each replica a grid
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 --pipeline-parallel-size 2 serves float"):
        EngineArgs(quantization="int8", **GRID)
    with pytest.raises(ValueError, match="uni runs one rank; --tensor-parallel-size 2 --pipeline-parallel-size 2"):
        EngineArgs(distributed_executor_backend="uni", **GRID)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tp2_pp2_greedy_equals_tp1(kind, tiny_model_dir, greedy_ref):
    """llama: layers 2 + 1, untied head; qwen2: layers 2 + 2, tied embeddings and q/k/v bias. Rank 0
    holds stage 0's layers, one of two KV heads, half the vocabulary rows of the embedding/head."""
    path = tiny_model_dir(kind)
    want, llm1 = _generate(path, PROMPTS)
    llm1.engine.shutdown()
    got, llm4 = _generate(path, PROMPTS, **GRID)
    try:
        core = llm4.engine.core
        model = core.runner.model
        attn = model.layers[0].self_attn
        assert len(_children()) == 3
        assert (len(model.layers), attn.num_heads, attn.num_kv_heads) == (2, 2, 1)
        # the KV pool shrinks by both factors: this stage's layers, this rank's KV heads
        assert len(core.runner.kv_caches) == 2 and core.runner.kv_caches[0][0].shape[0] == 1
        assert model.embed_tokens.weight.shape[0] == 49152 // 2 and model.norm is not None
    finally:
        llm4.engine.shutdown()
    assert _children() == []
    hf = _hf_loader(path)
    for k, (g, w) in enumerate(zip(got, want)):
        greedy_ref.assert_same_greedy(g, w, PROMPTS[k], hf, f"{kind} TP=2 x PP=2 prompt {k}")


def test_tp2_pp2_killed_worker_fails_fast_and_leaves_no_process(tiny_model_dir):
    """A rank of the last stage (rank 3: TP rank 1 of stage 1) dies mid-generation."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, num_threads=1, **GRID)
    try:
        workers = {p.name: p for p in _children()}
        assert sorted(workers) == ["pagedllm-tp1", "pagedllm-tp2", "pagedllm-tp3"]
        victim = workers["pagedllm-tp3"]
        long = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
        threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank \d \(pid \d+\) died with exit code"):
            llm.generate([PROMPTS[0]] * 4, long, use_tqdm=False)
        assert time.monotonic() - t0 < 60
        assert not llm.engine.is_alive()
    finally:
        llm.engine.shutdown()
    assert _children() == []


def test_ray_tp2_pp2_greedy_equals_mp(tiny_model_dir, monkeypatch):
    """The same grid with ranks 1..3 as Ray actors (a local cluster; half a CPU per actor so three fit
    a two-core machine's placement group) gives the multiprocess executor's tokens."""
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("PAGEDLLM_RAY_CPUS_PER_WORKER", "0.5")
    path = tiny_model_dir("llama")
    want, llm_mp = _generate(path, PROMPTS[:2], **GRID)
    llm_mp.engine.shutdown()
    got, llm = _generate(path, PROMPTS[:2], distributed_executor_backend="ray", **GRID)
    try:
        executor = llm.engine.core.executor
        assert type(executor).__name__ == "RayExecutor" and len(executor.actors) == 3
    finally:
        llm.engine.shutdown()
    assert not ray.is_initialized()
    assert got == want

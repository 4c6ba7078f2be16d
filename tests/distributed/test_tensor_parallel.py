"""Tensor and pipeline parallelism over gloo: TP=2 and PP=2 give TP=1's greedy tokens; refused settings;
a dead worker fails fast.

Each engine here starts one worker process (rank 1) beside the test process (rank 0), so the
tests keep models tiny and generations short: the machine's cores are shared.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.models.layers.parallel import balanced_split, head_shard

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[1, 520, 3012, 314, 260, 1142], [1, 9182, 28, 451, 5035, 29, 7, 441, 33, 2847, 355, 1903] * 3,
           list(range(100, 160))]


def _hf_loader(path):
    """A loader of the transformers model at ``path`` in float32 (the near-tie rule's oracle, built only if needed)."""
    def hf():
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf


def _children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pagedllm-tp")]


def _children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (read from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _generate(path, prompts, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), num_kv_blocks=64, num_threads=1, **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


# ---------------------------------------------------------------- head and vocabulary splits

def test_head_shard_whole_groups_and_replication():
    # SmolLM2: 9 heads in 3 KV groups over 2 ranks -> 2 groups (6 heads) and 1 group (3 heads)
    s0, s1 = head_shard(9, 3, 2, 0), head_shard(9, 3, 2, 1)
    assert (s0.q_start, s0.q_heads, s0.kv_start, s0.kv_heads) == (0, 6, 0, 2)
    assert (s1.q_start, s1.q_heads, s1.kv_start, s1.kv_heads) == (6, 3, 2, 1)
    # one KV head over 2 ranks: replicated, the 4 query heads split 2 + 2
    a, b = head_shard(4, 1, 2, 0), head_shard(4, 1, 2, 1)
    assert (a.q_start, a.q_heads, a.kv_start, a.kv_heads) == (0, 2, 0, 1)
    assert (b.q_start, b.q_heads, b.kv_start, b.kv_heads) == (2, 2, 0, 1)
    # 2 KV heads over 4 ranks: each replicated twice
    assert [head_shard(8, 2, 4, r).kv_start for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="--tensor-parallel-size 3"):
        head_shard(4, 2, 3, 0)  # fewer KV heads than ranks, and 3 is not a multiple of 2
    assert [balanced_split(10, 3, i) for i in range(3)] == [(0, 4), (4, 3), (7, 3)]


# ---------------------------------------------------------------- flags

@pytest.mark.parametrize("kwargs, flag", [
    (dict(pipeline_parallel_size=2, quantization="gguf"), "--pipeline-parallel-size 2 serves float"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="spark"), "--distributed-executor-backend"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "--distributed-executor-backend uni"),
    (dict(tensor_parallel_size=0), "--tensor-parallel-size"),
    (dict(tensor_parallel_size="2"), r"--tensor-parallel-size \(tensor_parallel_size\) must be an integer"),
    (dict(tensor_parallel_size=2, speculative_config={"method": "draft_model", "model": "x",
                                                      "num_speculative_tokens": 2}), "--tensor-parallel-size"),
])
def test_unimplemented_settings_are_refused(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        EngineArgs(**kwargs)


def test_cli_flags_reach_engine_args():
    import argparse
    from pagedllm.cli_args import add_engine_flags, engine_args_from_cli
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    a = engine_args_from_cli(p.parse_args(["m", "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]))
    assert (a.tensor_parallel_size, a.pipeline_parallel_size, a.distributed_executor_backend) == (2, 1, "mp")


def test_quantized_weights_and_transformers_backend_pp_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="--quantization none"):
        EngineArgs(tensor_parallel_size=2, quantization="int8")
    # found only at load (the architecture's implementation): the worker started is stopped again.
    # The Transformers backend runs tensor parallel (tests/distributed/test_transformers_tp.py), not PP.
    with pytest.raises(ValueError, match="--model-impl transformers runs tensor parallel only"):
        LLM(str(tiny_model_dir("llama")), num_kv_blocks=16, num_threads=1, pipeline_parallel_size=2,
            model_impl="transformers")
    assert _children() == []


# ---------------------------------------------------------------- greedy equivalence

@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_mqa"])
def test_tp2_greedy_equals_tp1(kind, tiny_model_dir, greedy_ref):
    """Bias and tied embeddings (qwen2), and a KV head replicated on both ranks (llama_mqa)."""
    path = tiny_model_dir(kind)
    want, llm1 = _generate(path, PROMPTS)
    llm1.engine.shutdown()
    got, llm2 = _generate(path, PROMPTS, tensor_parallel_size=2)
    try:
        core = llm2.engine.core
        heads = core.runner.model.layers[0].self_attn
        # 2 KV heads: one per rank (the KV pool per rank halves); one KV head: replicated on both
        assert heads.num_kv_heads == 1 and core.runner.kv_caches[0][0].shape[0] == 1
        assert heads.num_heads == 2
        assert len(_children()) == 1
    finally:
        llm2.engine.shutdown()
    assert _children() == []

    hf = _hf_loader(path)

    for k, (g, w) in enumerate(zip(got, want)):
        greedy_ref.assert_same_greedy(g, w, PROMPTS[k], hf, f"{kind} TP=2 prompt {k}")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_pp2_greedy_equals_tp1(kind, tiny_model_dir, greedy_ref):
    """Layers split 2 + 1 (llama: untied head) and 2 + 2 (qwen2: tied embeddings, q/k/v bias)."""
    path = tiny_model_dir(kind)
    want, llm1 = _generate(path, PROMPTS)
    llm1.engine.shutdown()
    got, llm2 = _generate(path, PROMPTS, pipeline_parallel_size=2)
    try:
        model = llm2.engine.core.runner.model  # rank 0: the first layers and both ends
        assert len(model.layers) == 2 and model.norm is not None and model.embed_tokens is not None
        assert len(llm2.engine.core.runner.kv_caches) == 2  # this stage's layers only
    finally:
        llm2.engine.shutdown()
    assert _children() == []

    hf = _hf_loader(path)

    for k, (g, w) in enumerate(zip(got, want)):
        greedy_ref.assert_same_greedy(g, w, PROMPTS[k], hf, f"{kind} PP=2 prompt {k}")


def test_tp2_sync_scheduling_and_sampling_seeded(tiny_model_dir):
    """Without the async overlap too; a seeded sampled request gives TP=1's tokens (rank 0 samples)."""
    path = tiny_model_dir("llama")
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(str(path), num_kv_blocks=64, num_threads=1, tensor_parallel_size=tp, async_scheduling=False)
        try:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], sp, use_tqdm=False)]
        finally:
            llm.engine.shutdown()
    assert outs[1] == outs[2]


def test_tp2_in_core_process(tiny_model_dir):
    """``pagedllm serve``'s shape: the core in its own (daemonic) process starts the worker, and
    exits when the worker dies (the server's ``/health`` reads ``is_alive``)."""
    path = tiny_model_dir("llama")
    want, llm1 = _generate(path, PROMPTS[:2])
    llm1.engine.shutdown()
    got, llm2 = _generate(path, PROMPTS[:2], tensor_parallel_size=2, enable_multiprocessing=True)
    workers = _children_of(llm2.engine.client.proc.pid)
    assert len(workers) == 1 and got == want
    # the worker dies while the engine is idle: the core process notices, reports and exits
    os.kill(workers[0], signal.SIGKILL)
    deadline = time.monotonic() + 15
    while llm2.engine.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not llm2.engine.is_alive()
    llm2.engine.shutdown()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "a worker outlived its core process"


def test_tp2_ngram_speculation_equals_tp1(tiny_model_dir):
    """Draft verification runs on rank 0; the workers record every emitted token from the broadcast."""
    path = tiny_model_dir("llama")
    prompts = [PROMPTS[1], [5, 6, 7, 8] * 8]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "dynamic": False, "prompt_lookup_min": 1}
    want, llm1 = _generate(path, prompts)
    llm1.engine.shutdown()
    got, llm2 = _generate(path, prompts, tensor_parallel_size=2, speculative_config=spec)
    try:
        stats = llm2.engine.get_stats()
        assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0, stats
    finally:
        llm2.engine.shutdown()
    assert got == want


# ---------------------------------------------------------------- failure

def test_killed_worker_fails_fast_and_leaves_no_process(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, num_threads=1, tensor_parallel_size=2)
    (worker,) = _children()
    long = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
    threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) died with exit code -9"):
        llm.generate([PROMPTS[0]] * 4, long, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    llm.engine.shutdown()
    assert _children() == []


def test_a_script_that_never_shuts_down_exits_cleanly(tiny_model_dir):
    """An ``LLM(tensor_parallel_size=2)`` left to the interpreter's exit stops its worker in order
    (``pagedllm generate`` without ``--quantization none`` once exited 134: "terminate called ...")."""
    code = ("import sys; from pagedllm import LLM, SamplingParams; "
            f"llm = LLM({str(tiny_model_dir('llama'))!r}, num_kv_blocks=64, num_threads=1, tensor_parallel_size=2); "
            "print(llm.generate([[1, 520, 3012]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)"
            "[0].outputs[0].token_ids)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "terminate called" not in r.stderr and "died with exit code" not in r.stderr


def test_worker_dying_before_the_rendezvous_fails_start_up_at_once(tiny_model_dir, tmp_path, monkeypatch):
    """A worker that exits before joining the group (here: its interpreter cannot start) fails
    ``LLM(...)`` with its rank named, instead of holding start-up for the rendezvous' 300 s."""
    (tmp_path / "sitecustomize.py").write_text("raise SystemExit(3)\n")  # only spawned children read it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 died while starting \(exit code 1\)"):
        LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, num_threads=1, tensor_parallel_size=2)
    assert time.monotonic() - t0 < 150  # the rendezvous alone would have waited 300 s
    assert _children() == []


def test_a_dropped_tp_llm_stops_its_worker_and_frees_the_group(tiny_model_dir):
    """``del llm`` (no ``shutdown``) stops the worker and leaves the group, so a second
    ``LLM(tensor_parallel_size=2)`` in the same process starts (it found the first group alive)."""
    path = str(tiny_model_dir("llama"))
    llm = LLM(path, num_kv_blocks=64, num_threads=1, tensor_parallel_size=2)
    first = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    del llm
    gc.collect()
    assert _children() == []
    llm = LLM(path, num_kv_blocks=64, num_threads=1, tensor_parallel_size=2)
    try:
        assert llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    finally:
        llm.engine.shutdown()
    assert _children() == []


def test_worker_dying_while_idle_marks_engine_dead(tiny_model_dir):
    """``/health`` reads ``is_alive``: it turns False without a request, and the next request fails."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, num_threads=1, tensor_parallel_size=2)
    try:
        assert llm.engine.is_alive()
        (worker,) = _children()
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(30)  # a loaded machine may take a while to reap it
        assert not llm.engine.is_alive()
        with pytest.raises(RuntimeError, match="worker rank 1"):
            llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert _children() == []


# ---------------------------------------------------------------- the real model

@pytest.mark.parametrize("parallel", ["tp", "pp"])
def test_smollm2_tp2_and_pp2_greedy_equal_tp1(parallel, smollm2_dir, smollm2_tokenizer, hf_smollm2, greedy_ref):
    """TP: SmolLM2's 9 heads in 3 KV groups split 6 + 3 over the two ranks; PP: 15 + 15 layers
    (float32 weights)."""
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
    prompts = [smollm2_tokenizer(t)["input_ids"] for t in texts]
    want, llm1 = _generate(smollm2_dir, prompts, quantization="none")
    llm1.engine.shutdown()
    size = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"}[parallel]
    got, llm2 = _generate(smollm2_dir, prompts, quantization="none", **{size: 2})
    try:
        model = llm2.engine.core.runner.model
        attn = model.layers[0].self_attn
        want_shape = (6, 2, 30) if parallel == "tp" else (9, 3, 15)
        assert (attn.num_heads, attn.num_kv_heads, len(model.layers)) == want_shape
    finally:
        llm2.engine.shutdown()
    for k, (g, w) in enumerate(zip(got, want)):
        greedy_ref.assert_same_greedy(g, w, prompts[k], hf_smollm2, f"smollm2 {parallel}=2 prompt {k}")


# ---------------------------------------------------------------- sharded loading

def test_a_rank_reads_only_its_slices_of_the_checkpoint(tiny_model_dir, monkeypatch, counting_safe_open,
                                                        checkpoint_elements):
    """Rank 1 of 2, built in this process (no group needed to load): every tensor is read through a
    safetensors slice, never whole, and the elements read are this rank's share (whole heads, half
    the MLP and vocabulary; the norms and the replicated KV heads in full)."""
    from pagedllm.distributed import parallel_state
    from pagedllm.models import load
    from pagedllm.models.hf_config import read_hf_config
    from pagedllm.models.load_plan import plan_load
    for key, value in dict(rank=1, world_size=2, tp_rank=1, tp_size=2).items():
        monkeypatch.setitem(parallel_state._STATE, key, value)
    path = tiny_model_dir("llama")
    counting = counting_safe_open
    total = checkpoint_elements(path)
    monkeypatch.setattr(load, "safe_open", counting)
    plan = plan_load(path, read_hf_config(path), torch.float32, "cpu", tensor_parallel_size=2)
    model, _ = load.load_model(path, plan)
    assert counting.whole == []
    held = sum(p.numel() for p in model.parameters())
    assert counting.read == held, (counting.read, held)  # each element this rank holds read once, nothing more
    assert counting.read < 0.6 * total, (counting.read, total)

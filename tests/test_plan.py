"""The engine plan (``pagedllm/plan.py``): every decision made once, from the arguments and the config.

Planning builds nothing (no weights read), so these cases are cheap; that the engine builds what
its plan says is what the rest of the suite checks (greedy tokens, kernels, parallel runs).
"""

from __future__ import annotations

import json

import pytest
import torch

import pagedllm.envs as envs
from pagedllm.config import EngineArgs
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.plan import plan_engine


def test_native_model_on_the_cpu(tiny_model_dir):
    """A float32 Llama on the CPU: native, the C kernels and their build when they are on, float
    weights (no GGUF source), prepacked where oneDNN is, one rank, async scheduling; the plan is
    JSON (what ``/stats`` shows) and one log line."""
    path = tiny_model_dir("llama")
    plan = plan_engine(EngineArgs(model=str(path), kv_cache_memory="32MiB"), path)
    kernels = cpu_kernels.applies("cpu", torch.float32)
    assert (plan.architecture, plan.runner, plan.model.impl) == ("LlamaForCausalLM", "generate", "native")
    assert plan.model.attention_backend == ("cpu_kernels" if kernels else "torch")
    assert plan.model.cpu_kernels is kernels and plan.model.kernel_isa == (cpu_kernels.isa() if kernels else "")
    assert plan.model.quantization == "none" and plan.model.int8_activations is False
    assert plan.model.prepack is (torch.backends.mkldnn.is_available() and envs.PAGEDLLM_CPU_PREPACK)
    assert plan.parallel.executor == "uni" and plan.parallel.tensor_parallel_size == 1
    assert plan.scheduler.async_scheduling is envs.PAGEDLLM_ASYNC_SCHEDULING
    assert plan.scheduler.steps_in_flight == 1 and plan.scheduler.pipeline_overlap is False
    assert plan.cache.kv_cache_bytes == 32 << 20 and plan.cache.state_layers == 0
    assert (plan.compile, plan.cuda_graphs, plan.speculative) == (False, False, "none")
    as_json = json.loads(json.dumps(plan.to_dict()))
    assert as_json["model"]["dtype"] == "float32" and as_json["model"]["device"] == "cpu"
    assert as_json["parallel"]["executor"] == "uni"
    line = plan.describe()
    assert line.startswith("LlamaForCausalLM generate via native; float32 on cpu") and "speculative none" in line


def test_parallel_ranks_plan_torch_ops_and_float_weights(tiny_model_dir):
    """Two tensor-parallel ranks by two stages: torch attention and ops, float weights, no prepacking,
    the mp executor, and a pipeline that keeps two steps in flight with async scheduling."""
    path = tiny_model_dir("llama")
    args = EngineArgs(model=str(path), tensor_parallel_size=2, pipeline_parallel_size=2, async_scheduling=True)
    plan = plan_engine(args, path)
    assert (plan.model.attention_backend, plan.model.cpu_kernels, plan.model.kernel_isa) == ("torch", False, "")
    assert (plan.model.quantization, plan.model.prepack, plan.model.world) == ("none", False, 4)
    assert plan.parallel.executor == "mp"
    assert plan.scheduler.pipeline_overlap is envs.PAGEDLLM_PIPELINE_OVERLAP
    assert plan.scheduler.steps_in_flight == (2 if envs.PAGEDLLM_PIPELINE_OVERLAP else 1)
    sync = plan_engine(EngineArgs(model=str(path), pipeline_parallel_size=2, async_scheduling=False), path)
    assert sync.scheduler.pipeline_overlap is False and sync.scheduler.steps_in_flight == 1


def test_runner_speculation_and_state(tiny_model_dir, tiny_encoders):
    """``--runner pooling`` on a causal LM pools; an encoder is encoder-only and refuses ``generate``
    (the message names the flag); speculation is named with its depth; a hybrid counts its state layers."""
    path = tiny_model_dir("llama")
    assert plan_engine(EngineArgs(model=str(path), runner="pooling"), path).runner == "pooling"
    spec = plan_engine(EngineArgs(model=str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
                       path)
    assert spec.speculative.startswith("ngram x3")
    enc = tiny_encoders["roberta"]
    plan = plan_engine(EngineArgs(model=str(enc)), enc)
    assert plan.runner == "encoder-only" and plan.encoder_only and plan.model.quantization == "none"
    with pytest.raises(ValueError, match="--runner pooling"):
        plan_engine(EngineArgs(model=str(enc), runner="generate"), enc)
    hybrid = tiny_model_dir("lfm2")
    assert plan_engine(EngineArgs(model=str(hybrid)), hybrid).cache.state_layers == 3


def test_refusals_come_from_the_plan(tiny_model_dir):
    """Packed weights where the C kernels do not run (bfloat16 here), or for a hybrid model, are
    refused while planning, before any load; the Transformers backend plans packed weights like the
    native path otherwise."""
    path = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="needs the C CPU kernels"):
        plan_engine(EngineArgs(model=str(path), model_impl="transformers", quantization="int8", dtype="bfloat16"), path)
    plan = plan_engine(EngineArgs(model=str(path), model_impl="transformers", quantization="int8"), path)
    assert (plan.model.impl, plan.model.quantization) == ("transformers", "int8")
    hybrid = tiny_model_dir("lfm2")  # its state mixers read their projections' float weights
    with pytest.raises(ValueError, match="hybrid models"):
        plan_engine(EngineArgs(model=str(hybrid), quantization="int8"), hybrid)

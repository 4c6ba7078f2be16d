"""The engine plan: every decision the engine takes from ``EngineArgs`` and the model's config, made once.

``EngineArgs`` stays flat, as vLLM's is, so every flag keeps vLLM's name; ``plan_engine`` is its
``create_engine_config``: it resolves the arguments and the model's ``config.json`` into one
frozen ``EnginePlan`` grouped as vLLM's configs are (model, cache, scheduler, parallel, device,
speculative). The engine core builds exactly what the plan says: ``load_model`` takes its
``LoadPlan`` (``models/load_plan.py``), every worker rank gets the same one, the scheduler and
runner get the overlap, graph and compile switches from it. Nothing below re-decides them: no
probe of the model, no environment variable read on the way. The plan is logged once at start-up
(``EnginePlan.describe``) and shown by ``/stats`` under ``plan`` (``EnginePlan.to_dict``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

import pagedllm.envs as envs
from pagedllm.config import EngineArgs, parse_size
from pagedllm.models.load_plan import LoadPlan, plan_load


@dataclass(frozen=True)
class CachePlan:
    """KV cache and prefix cache (vLLM's ``CacheConfig``).

    Attributes:
        block_size: tokens per KV block. kv_cache_bytes: the pool's budget in bytes (state included).
        num_kv_blocks: an exact block count, or ``None`` (from ``kv_cache_bytes``).
        prefix_caching: reuse cached full blocks. state_layers: a hybrid model's recurrent-state
            layers (0: attention only; the state pool is then not built).
    """

    block_size: int
    kv_cache_bytes: int
    num_kv_blocks: int | None
    prefix_caching: bool
    state_layers: int


@dataclass(frozen=True)
class SchedulerPlan:
    """Step shape (vLLM's ``SchedulerConfig``).

    Attributes:
        max_num_seqs: requests per step. max_num_batched_tokens: tokens per step.
        chunked_prefill: prompts cut to the budget. async_scheduling: step N+1 prepared while N runs.
        pipeline_overlap: a pipeline keeps several steps in flight. steps_in_flight: steps issued and
            not yet applied (``pipeline_parallel_size`` when the pipeline overlaps, else 1).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    async_scheduling: bool
    pipeline_overlap: bool
    steps_in_flight: int


@dataclass(frozen=True)
class ParallelPlan:
    """Rank grid (vLLM's ``ParallelConfig``): tensor, pipeline and data parallel sizes, the executor
    (``uni``, ``mp``, ``ray``) and the micro-batches a pipelined step is cut into (0: one per stage)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    executor: str
    pipeline_micro_batches: int


@dataclass(frozen=True)
class EnginePlan:
    """Every decision of one engine, frozen (vLLM's ``VllmConfig``, resolved).

    Attributes:
        architecture: the config's first architecture name.
        runner: ``generate``, ``pooling`` (a causal LM pooling its last token) or ``encoder-only``.
        model: what ``load_model`` builds (implementation, dtype, device, attention backend, C kernels,
            weight format, prepacking).
        cache, scheduler, parallel: see their classes.
        compile: ``torch.compile`` of the pieces between attention calls (``models/layers/compiled.py``).
        cuda_graphs: decode steps replay graphs where the device captures them (CUDA): the Triton
            backend, one rank, no recurrent state, not ``enforce_eager``.
        speculative: ``none`` or the method with its draft depth, e.g. ``ngram x4 dynamic``.
    """

    architecture: str
    runner: str
    model: LoadPlan
    cache: CachePlan
    scheduler: SchedulerPlan
    parallel: ParallelPlan
    compile: bool
    cuda_graphs: bool
    speculative: str

    @property
    def encoder_only(self) -> bool:
        """An encoder-only model: no KV cache, pooling only."""
        return self.runner == "encoder-only"

    def to_dict(self) -> dict:
        """The plan as JSON-ready nested dicts (``/stats``'s ``plan``): dtypes and devices as strings."""
        out = dataclasses.asdict(self)
        out["model"] = {k: _plain(v) for k, v in out["model"].items()}
        return out

    def describe(self) -> str:
        """One log line: the choices a user asks about first."""
        m, p, s = self.model, self.parallel, self.scheduler
        ranks = f"tp {p.tensor_parallel_size} x pp {p.pipeline_parallel_size} x dp {p.data_parallel_size} ({p.executor})"
        return (f"{self.architecture} {self.runner} via {m.impl}; {_plain(m.dtype)} on {m.device}; attention "
                f"{m.attention_backend}; CPU kernels {m.kernel_isa or 'off'}; weights {m.quantization}"
                f"{' (int8 activations)' if m.int8_activations else ''}"
                f"{'; float linears oneDNN-prepacked' if m.prepack else ''}; {ranks}; async scheduling "
                f"{'on' if s.async_scheduling else 'off'}{'; pipeline overlap' if s.pipeline_overlap else ''}; "
                f"compile {'on' if self.compile else 'off'}; CUDA graphs {'on' if self.cuda_graphs else 'off'}; "
                f"speculative {self.speculative}; state layers {self.cache.state_layers}")


def _plain(value):
    """A dtype or device as its name (``torch.float32`` -> ``float32``); anything else as it is."""
    return str(value).removeprefix("torch.") if isinstance(value, (torch.dtype, torch.device)) else value


def plan_engine(args: EngineArgs, model_dir: str | Path, config=None) -> EnginePlan:
    """Resolve ``args`` and the model of ``model_dir`` (its ``transformers`` config, read when not
    given) into the engine's plan.

    Raises:
        ModelLoadError: a broken ``config.json``.
        ValueError: a model no implementation serves, ``runner="generate"`` for an encoder-only
            model, or a choice ``plan_load`` refuses (packed weights with several ranks, ...).
    """
    from pagedllm.models.hf_config import read_hf_config
    from pagedllm.models.hybrid import hybrid_family, state_layer_indices
    config = read_hf_config(model_dir) if config is None else config
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    model = plan_load(model_dir, config, args.torch_dtype, args.torch_device, args.model_impl, args.quantization,
                      args.attention_backend, tp, pp, args.enable_expert_parallel)
    if model.encoder_only and args.runner == "generate":
        raise ValueError(f"{getattr(config, 'architectures', None)} is an encoder-only model: it serves pooling "
                         "only (--runner pooling or auto)")
    state_layers = len(state_layer_indices(config)) if hybrid_family(config) is not None else 0
    return _assemble(args, (getattr(config, "architectures", None) or ["?"])[0], model.encoder_only, model,
                     state_layers)


def plan_prebuilt(args: EngineArgs, model) -> EnginePlan:
    """The plan of an engine handed an already built ``model`` (tests): what the model says of itself
    stands in for the config (its attention backend, ``encoder_only``, ``state_cache_spec``)."""
    backend = getattr(model, "attention_backend", None)
    name = backend.name if backend is not None else "torch"
    encoder_only = bool(getattr(model, "encoder_only", False))
    load = LoadPlan("prebuilt", args.torch_dtype, args.torch_device, name,
                    bool(backend is not None and backend.uses_cpu_kernels), "", False, "none", False)
    spec = model.state_cache_spec() if hasattr(model, "state_cache_spec") else {}
    return _assemble(args, type(model).__name__, encoder_only, load, len(spec))


def _assemble(args: EngineArgs, architecture: str, encoder_only: bool, model: LoadPlan,
              state_layers: int) -> EnginePlan:
    """The parts every plan shares, from the arguments and the model half already decided."""
    from pagedllm.models.layers.compiled import resolve_compilation
    runner = "encoder-only" if encoder_only else "pooling" if args.runner == "pooling" else "generate"
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    world = tp * pp
    executor = "uni" if world == 1 else (args.distributed_executor_backend or "mp")
    # a pipeline of the native model keeps several steps in flight (worker/step_issuers.py:
    # OverlappedIssuer); PAGEDLLM_PIPELINE_OVERLAP=0 drains it at every step (the benchmark's baseline)
    overlap = bool(args.async_scheduling and pp > 1 and model.impl == "native" and envs.PAGEDLLM_PIPELINE_OVERLAP)
    spec = args.speculative_config
    speculative = "none" if spec is None else (
        f"{spec.method} x{spec.num_speculative_tokens} {'dynamic' if spec.dynamic else 'fixed'}")
    # the device decides whether it captures (worker/device/cuda_graphs.capture_for: CUDA; a test's stand-in)
    graphs = not args.enforce_eager and world == 1 and model.attention_backend == "triton" and state_layers == 0
    return EnginePlan(
        architecture=architecture, runner=runner, model=model,
        cache=CachePlan(args.block_size, parse_size(args.kv_cache_memory), args.num_kv_blocks,
                        args.enable_prefix_caching, state_layers),
        scheduler=SchedulerPlan(args.max_num_seqs, args.max_num_batched_tokens, args.enable_chunked_prefill,
                                bool(args.async_scheduling), overlap, pp if overlap else 1),
        parallel=ParallelPlan(tp, pp, args.data_parallel_size, executor, args.pipeline_micro_batches),
        compile=resolve_compilation(args.compilation_config, args.device, args.enforce_eager), cuda_graphs=graphs, speculative=speculative)

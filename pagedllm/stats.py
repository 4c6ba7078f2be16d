"""Typed telemetry that crosses rooms: step timings, engine counters, per-request timings.

They are msgspec structs, so that the core process sends them as they are and a renamed
or missing field fails loudly (``AttributeError``, ``KeyError``) instead of reading as a
silent zero. ``SchedulerStats`` and ``StepTimings`` also answer ``stats["name"]`` for code
that reads them as mappings, and ``to_dict()`` gives the JSON of ``GET /stats``.
"""

from __future__ import annotations

from typing import Any

import msgspec



class _Indexable(msgspec.Struct):
    """``struct["field"]`` for a declared field, ``KeyError`` for anything else."""

    def __getitem__(self, key: str) -> Any:
        if key not in self.__struct_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def to_dict(self) -> dict:
        """Plain JSON-ready builtins (nested structs as dicts)."""
        return msgspec.to_builtins(self)


class StepTimings(_Indexable):
    """Seconds spent in each phase of the engine's steps, in total and per step.

    ``idle_s`` is the time the device waited between the end of one execution and the
    start of the next; ``idle_fraction`` is ``idle / (idle + execute + sample)``.
    All times are seconds of ``time.perf_counter``.
    """

    schedule_s: float = 0.0
    prepare_s: float = 0.0
    execute_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    idle_s: float = 0.0
    mean_schedule_s: float = 0.0
    mean_prepare_s: float = 0.0
    mean_execute_s: float = 0.0
    mean_sample_s: float = 0.0
    mean_update_s: float = 0.0
    mean_idle_s: float = 0.0
    steps: int = 0
    idle_fraction: float = 0.0


class SchedulerStats(_Indexable):
    """The engine core's counters after a step (``EngineCore.get_stats``, ``GET /stats``).

    Attributes:
        num_running, num_waiting: requests scheduled / queued now.
        kv_cache_usage: fraction of KV blocks in use, in [0, 1].
        num_free_blocks, num_blocks: KV pool counters, in blocks.
        num_free_state_slots, num_state_slots: a hybrid model's recurrent-state pool
            (``core/state_pool.py``), in slots; 0 and 0 for an attention-only model.
        num_preemptions: preemptions so far.
        prefix_cache_queries, prefix_cache_hits: prefix-cache lookups and hits, in tokens.
        num_prompt_tokens, num_generation_tokens: token totals so far.
        num_computed_tokens: tokens the model has run so far (prompt chunks, decode inputs, draft tokens;
            recomputed ones again: a preempted prompt counts twice).
        num_video_tokens_pruned: video tokens EVS dropped before the language model so far
            (``--video-pruning-rate``; not in ``num_prompt_tokens``).
        num_steps: steps applied so far; max_num_running: most requests in one step.
        cpu_kernels: whether steps use the C CPU kernels.
        weight_kernels: what multiplies the packed weights (``quant_linear.quantized_kernels``),
            empty when none are packed.
        weight_formats: layers per weight format, e.g. ``{"Q4_1": 120, "Q8_0": 1}`` with
            ``quantization="gguf"``; empty when every weight is in the model's dtype.
        expected_rss_mib: the resident memory the core should settle at, MiB: its weights, the KV
            (and state) pool and ~512 MiB for the runtime (``memory.expected_resident_mib``).
        expert_bytes: bytes of the mixture-of-experts layers' expert weights (``models/moe.py``), 0 for
            a dense model.
        experts_chosen: per MoE layer, how many (token, expert) pairs chose each expert so far (the
            routing histogram, for tuning).
        step_timings: the per-phase times.
        core_pid: the core process's pid (``None`` in process).
        block_states: one character per KV block: ``0`` free, ``1`` held by a request, ``2`` free
            but caching a prefix (evictable); the web page's block map.
        spec_num_drafts: verified steps of a request that carried drafts (speculative decoding);
            spec_num_draft_tokens, spec_num_accepted_tokens: their draft tokens and the kept ones;
            spec_accepted_per_position: kept drafts by draft position (0-based; the acceptance at
            position i is ``spec_accepted_per_position[i] / spec_num_drafts``-ish, vLLM's metric).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_free_state_slots: int = 0
    num_state_slots: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_computed_tokens: int = 0
    num_video_tokens_pruned: int = 0
    num_steps: int = 0
    max_num_running: int = 0
    cpu_kernels: bool = False
    weight_formats: dict[str, int] = msgspec.field(default_factory=dict)
    weight_kernels: str = ""
    expected_rss_mib: float = 0.0
    expert_bytes: int = 0
    experts_chosen: list[list[int]] = msgspec.field(default_factory=list)
    step_timings: StepTimings = msgspec.field(default_factory=StepTimings)
    core_pid: int | None = None
    block_states: str = ""
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)


class RequestMetrics(msgspec.Struct):
    """Timings and token counts of one request (``RequestOutput.metrics``, after vLLM's).

    Attributes:
        arrival_time: when the request arrived (seconds since the epoch).
        first_token_time: when its first output token was known (same clock), ``None`` before.
        finished_time: when it finished (same clock), ``None`` while it runs.
        num_prompt_tokens: prompt length in tokens.
        num_generation_tokens: output tokens so far.
        spec_num_draft_tokens, spec_num_accepted_tokens: draft tokens verified for it so far and how
            many were kept (speculative decoding; 0 without it).
    """

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

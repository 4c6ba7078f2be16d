"""Messages from the scheduler to the model runner, and back.

They carry diffs: a new request's data once, then only new block ids and counts.
``TokenLogprobs`` lives here, beside ``ModelRunnerOutput`` that carries it, so that
the core, the worker and the engine share one message type without the core
importing the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption).

    Attributes:
        req_id: request id.
        token_ids: prompt plus already generated tokens.
        num_prompt_tokens: prompt length in tokens.
        sampling_params: sampling settings.
        block_ids: the request's whole block table.
        num_computed_tokens: tokens already in the KV cache before this step.
        pooling_params: set for a pooling request (it samples nothing: its final hidden states are
            pooled once its prompt is computed).
        state_slot: the request's recurrent-state slot (hybrid models, ``core/state_pool.py``), or -1.
        mm_inputs: its images (``multimodal_inputs.MultiModalInput``; empty for text).
        lora_request: its adapter (``lora.request.LoRARequest``), or ``None`` for the base model.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None
    state_slot: int = -1
    mm_inputs: tuple = ()
    lora_request: Any = None


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed.

    Attributes:
        req_id: request id.
        new_block_ids: blocks appended to its block table this step.
        num_computed_tokens: tokens in the KV cache before this step.
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """One step's plan.

    Attributes:
        new_reqs: requests sent in full.
        cached_reqs: requests sent as diffs.
        num_scheduled_tokens: tokens to compute per request id, in batch order.
        total_num_scheduled_tokens: sum of the above (<= the step's token budget).
        finished_req_ids: requests whose runner state can be dropped.
        spec_token_ids: request id -> draft tokens scheduled after its one decode token (they
            count in ``num_scheduled_tokens``; speculative decoding).
        spec_draft_probs: request id -> ``[len(drafts), V]`` float32 tensor, the distributions its
            drafts were drawn from (sampled drafts of a draft model); absent: the drafts are point
            masses (deterministic proposals). Opaque to the scheduler.
        state_restores: request id -> state checkpoint slot its first step starts from (a hybrid
            model's prefix-cache hit; ``core/state_checkpoints.py``).
        state_checkpoints: request id -> ``[(boundary, slot), ...]``: after ``boundary`` tokens
            (absolute, inside this step's tokens) the state of every state layer goes to ``slot``.
        scheduled_encoder_inputs: request id -> indices of its images (``mm_inputs``) whose encoder
            step runs in this step (``core/encoder_cache.py``).
        free_encoder_hashes: image hashes whose encoder outputs the runner drops before this step
            (their requests finished or were preempted).
        free_encoder_after: image hashes whose encoder outputs the runner drops once this step has
            run (its requests compute past their placeholders in it).
    """

    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_draft_probs: dict[str, Any] = field(default_factory=dict)
    state_restores: dict[str, int] = field(default_factory=dict)
    state_checkpoints: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_hashes: list[str] = field(default_factory=list)
    free_encoder_after: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True when no tokens are scheduled."""
        return self.total_num_scheduled_tokens == 0


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled (or prompt) token.

    Attributes:
        token_ids: the token itself first, then the top-k tokens by logprob.
        logprobs: float log-probabilities matching ``token_ids``.
        rank: 1-based rank of the token itself among the vocabulary (1 = most likely).
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class ModelRunnerOutput:
    """What one step produced.

    Attributes:
        sampled_token_ids: request id -> sampled token id, only for requests
            whose scheduled tokens reached the end of their sequence (a partial
            prefill chunk samples nothing).
        logprobs: request id -> logprobs of its sampled token (requests that asked).
        prompt_logprobs: request id -> ``(first, entries)``: logprobs of prompt tokens
            ``first, first + 1, ...`` computed this step (requests with ``prompt_logprobs``).
        accepted_token_ids: request id -> every token emitted for a request that had drafts
            (the kept drafts, then the target's own token; ``sampled_token_ids`` has the last).
        accepted_logprobs: request id -> logprobs of those tokens (requests that asked).
        pooled: request id -> the pooled vector of a pooling request whose prompt this step finished.
        execute_s: seconds the step's forward and sampling took.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)
    execute_s: float = 0.0


@dataclass
class EngineCoreOutput:
    """Per-request result of a step, for the output processor.

    Attributes:
        request_id: request id.
        new_token_ids: tokens generated this step.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or ``None``.
        stop_reason: stop token id that ended the request, if any.
        new_logprobs: logprobs of ``new_token_ids`` (when requested).
        prompt_logprobs: ``(first, entries)`` as ``ModelRunnerOutput.prompt_logprobs``.
        spec_counts: ``(draft tokens, accepted drafts)`` of the request so far, when it has had drafts.
        pooled: a finished pooling request's vector (float32 values), else ``None``.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None
    spec_counts: tuple[int, int] | None = None
    pooled: list[float] | None = None

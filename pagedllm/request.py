"""The engine-core view of a request: token ids and progress counters."""

from __future__ import annotations

import enum
import time

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request inside the scheduler. Values above RUNNING are finished."""

    WAITING = 0
    PREEMPTED = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the request's grammar failed in the core (``stop_reason`` says why)

    @property
    def finished(self) -> bool:
        """True for every FINISHED_* status."""
        return self > RequestStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` for a finished status, else ``None``."""
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(self)


class Request:
    """A request as the scheduler sees it.

    ``num_computed_tokens`` is the one progress counter: tokens whose KV is in
    the cache. Each step moves it toward ``num_tokens`` (prompt + output). A
    preempted request keeps its output tokens and restarts at 0 (recompute).

    Attributes:
        request_id: unique id.
        prompt_token_ids: prompt tokens.
        output_token_ids: generated tokens so far.
        sampling_params: sampling settings.
        eos_token_ids: token ids that count as end of sequence.
        max_tokens: resolved output limit in tokens.
        arrival_time: seconds since the epoch.
        cache_salt: prefix-cache namespace; requests share cached blocks only with equal salts.
        num_output_placeholders: tokens being sampled by steps in flight, not yet known
            (async scheduling schedules the next step before the previous one's tokens arrive).
        structured: the request's ``GrammarState`` (structured outputs), else ``None``.
        pooling_params: set for a pooling request (it finishes when its prompt is computed).
        spec_token_ids: draft tokens scheduled after its decode token by the step in flight
            (empty when none); spec_num_draft_tokens, spec_num_accepted_tokens: its drafts so far
            and how many were kept.
        mm_inputs: its images (``multimodal_inputs.MultiModalInput``, in prompt order; empty for text).
        lora_request: its LoRA adapter (``lora.request.LoRARequest``), or ``None`` for the base model;
            lora_key: that adapter's ``cache_key()`` (prefix-cache identity), or ``None``.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: set[int], max_tokens: int, arrival_time: float | None = None,
                 cache_salt: str | None = None, pooling_params=None, mm_inputs=(), lora_request=None) -> None:
        self.request_id = request_id
        self.pooling_params = pooling_params
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.cache_salt = cache_salt
        self.num_output_placeholders = 0
        self.block_hashes: list[bytes] = []  # hashes of full blocks, filled by the KV cache manager
        self.structured = None
        self.spec_token_ids: list[int] = []
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.mm_inputs = tuple(mm_inputs)
        self.lora_request = lora_request
        # the adapter's identity in the block hashes (computed once: hashes are extended every step)
        self.lora_key: bytes | None = None if lora_request is None else lora_request.cache_key()

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length in tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        """True once the status is one of the FINISHED_* values."""
        return self.status.finished

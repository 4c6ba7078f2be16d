"""The typed messages between the front end and the engine core (msgspec structs).

The same structs travel in process (as objects) and to a core process (msgpack over ZMQ):
``EngineCoreRequest`` is made once by the front end's ``Processor`` and turned into the
scheduler's ``Request`` in exactly one place, ``EngineCore.add_request``.
"""

from __future__ import annotations

import msgspec

from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal_inputs import MultiModalInput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.stats import SchedulerStats


class EngineDeadError(RuntimeError):
    """The engine core (loop or process) has died; no request can be served."""


class EngineCoreRequest(msgspec.Struct, frozen=True, tag="add"):
    """A tokenized, validated request for the core (vLLM's ``EngineCoreRequest``).

    Attributes:
        request_id: unique among live requests.
        prompt_token_ids: the prompt, ids in ``[0, vocab)``, at least one.
        sampling_params: the request's sampling settings (``n == 1``: one choice per request).
        max_tokens: the resolved output limit in tokens (fits the context with the prompt).
        arrival_time: seconds since the epoch.
        cache_salt: prefix-cache namespace (requests share cached blocks only with equal salts).
        pooling_params: set (resolved) for a pooling request: it samples nothing (``max_tokens`` 1)
            and finishes with its pooled vector once the prompt is computed.
        mm_inputs: the prompt's images, their placeholders already in ``prompt_token_ids``.
        lora_request: the LoRA adapter it runs with (checked by the front end), or ``None``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    arrival_time: float
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None
    mm_inputs: list[MultiModalInput] = []
    lora_request: LoRARequest | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)


class FinishRequests(msgspec.Struct, tag="finish"):
    """End requests: ``status`` is a ``RequestStatus`` value (abort, or stopped by a stop string)."""

    request_ids: list[str]
    status: int


class UtilityCall(msgspec.Struct, tag="utility"):
    """Run one of the core's utility methods (``EngineCore.UTILITIES``) and answer with its result."""

    call_id: int
    name: str
    args: list = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the core loop."""


class CoreOutputs(msgspec.Struct, tag="outputs"):
    """One step's results (possibly none) and the core's counters after it."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


class UtilityResult(msgspec.Struct, tag="utility_result"):
    """The answer to a ``UtilityCall``: its result, or the error it raised (``error`` set)."""

    call_id: int
    result: object = None
    error: str | None = None


class CoreReady(msgspec.Struct, tag="ready"):
    """Sent once the model is loaded: the KV pool size in blocks, and the core's pid."""

    num_blocks: int
    pid: int


class CoreFailed(msgspec.Struct, tag="failed"):
    """The core hit an exception and stops; ``load_error``: a model file could not be read
    (``error`` is then the one-line message to show as it is)."""

    error: str
    load_error: bool = False


TO_CORE = EngineCoreRequest | FinishRequests | UtilityCall | Shutdown
FROM_CORE = CoreOutputs | UtilityResult | CoreReady | CoreFailed

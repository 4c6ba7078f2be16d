"""Results handed back to users of the offline API and the server."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.stats import RequestMetrics


@dataclass
class Logprob:
    """One token's log-probability (vLLM's ``Logprob``).

    Attributes:
        logprob: natural-log probability under the model's raw distribution.
        rank: 1-based rank among the vocabulary (1 = most likely).
        decoded_token: the token's text. For a sampled or prompt token this is the
            text it added to the output, so the tokens of an output join to its text.
    """

    logprob: float
    rank: int
    decoded_token: str


# per position: token id -> Logprob; the position's own token first, then the top-k
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: position among the request's outputs (0 while n == 1).
        text: text generated so far (the delta only, when streaming in delta mode).
        token_ids: generated token ids (the new ones only in delta mode).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` (the request's grammar failed in the
            engine; ``stop_reason`` says why) or ``None`` while running.
        stop_reason: the stop string or stop token id that ended the output, if any.
        logprobs: one ``PositionLogprobs`` per entry of ``token_ids`` when requested, else ``None``.
        cumulative_logprob: sum of the generated tokens' logprobs (all of them, also in delta
            mode) when logprobs were requested, else ``None`` (vLLM's field).
        lora_request: the ``LoRARequest`` its request ran with, or ``None``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    lora_request: object = None

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    Attributes:
        request_id: the caller's id.
        prompt: prompt text, if the request had one.
        prompt_token_ids: the prompt as token ids.
        outputs: one ``CompletionOutput`` per sample.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per prompt
            token, ``None`` for the first (it has no context); else ``None``.
        finished: True when every output has finished.
        metrics: a ``RequestMetrics``: arrival, first-token and (once finished) finish
            times in seconds since the epoch, and the prompt and output token counts.
        lora_request: the ``LoRARequest`` it ran with (``LLM.generate``), or ``None``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    lora_request: object = None


@dataclass
class PoolingOutput:
    """The pooled vector of one request (vLLM's ``PoolingOutput`` / ``EmbeddingOutput``).

    Attributes:
        data: the vector, float32 values as Python floats (length: the model's hidden size, or
            ``PoolingParams.dimensions``).
    """

    data: list[float]

    @property
    def embedding(self) -> list[float]:
        """The vector (vLLM's ``EmbeddingOutput.embedding``)."""
        return self.data

    @property
    def hidden_size(self) -> int:
        """Its length."""
        return len(self.data)


@dataclass
class PoolingRequestOutput:
    """A finished pooling request (vLLM's ``PoolingRequestOutput``; ``EmbeddingRequestOutput`` is the
    same shape).

    Attributes:
        request_id: the caller's id.
        outputs: its ``PoolingOutput`` (``outputs.embedding``).
        prompt_token_ids: the input as token ids (after truncation).
        finished: always True (a pooling request has one output).
        metrics: a ``RequestMetrics`` (arrival and finish times; no generated tokens).
        prompt: the input text, when it was a text.
    """

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    metrics: RequestMetrics | None = None
    prompt: str | None = None


EmbeddingRequestOutput = PoolingRequestOutput


@dataclass
class ScoringOutput:
    """One pair's similarity (vLLM's ``ScoringOutput``): ``score`` is the cosine of the two texts'
    embeddings for a bi-encoder, the classifier's (activated) output on the joined pair for a
    cross-encoder."""

    score: float


@dataclass
class ScoringRequestOutput:
    """A scored pair (vLLM's ``ScoringRequestOutput``).

    Attributes:
        request_id: the pair's id.
        outputs: its ``ScoringOutput``.
        prompt_token_ids: the two inputs' token ids, concatenated (a cross-encoder: the pair's one input).
        finished: always True.
    """

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    """A cross-encoder's outputs for one input (vLLM's ``ClassificationOutput``): ``probs``, one per
    label, after the model's activation (softmax over several labels, sigmoid for one)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """How many labels."""
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """A classified input (vLLM's ``ClassificationRequestOutput``).

    Attributes:
        request_id: its id; outputs: its ``ClassificationOutput``; prompt_token_ids: the input's ids.
        finished: always True.
    """

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

"""Sampling parameters with the OpenAI / vLLM names and defaults.

See the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``)
and vLLM's ``SamplingParams``. Validation raises ``ValueError`` whose message
starts with the parameter name, so the server can report it as ``param``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class SamplingParamError(ValueError):
    """An invalid sampling parameter. ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to sample one request's output.

    Attributes:
        n: number of output sequences (only 1 is supported so far).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` times the top one.
        seed: per-request seed; the tokens then do not depend on the batch.
        max_tokens: most tokens to generate (``None``: up to ``max_model_len``).
        min_tokens: tokens to generate before EOS / stop token ids may end the output.
        stop: strings that end the output; the match is not included in the text.
        stop_token_ids: token ids that end the output (kept out of the text).
        ignore_eos: keep generating after the EOS token.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens from the detokenized text.
        logprobs: number of top logprobs per generated token (``None``: none).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    extra_args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Check every field.

        Raises:
            SamplingParamError: with ``param`` set to the offending field.
        """
        def bad(param: str, msg: str) -> None:
            raise SamplingParamError(param, f"{param}: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}")
        if self.n != 1:
            bad("n", "only n=1 is supported")
        if self.temperature is None or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite non-negative number, got {self.temperature}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k is None or not -1 <= self.top_k < 2**31:
            bad("top_k", f"must be -1 (disable), 0 (disable) or a positive int32, got {self.top_k}")
        if math.isnan(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below 1e-5)."""
        return self.temperature < 1e-5

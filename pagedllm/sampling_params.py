"""Sampling parameters with the OpenAI / vLLM names and defaults.

See the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``)
and vLLM's ``SamplingParams``. Validation raises ``ValueError`` whose message
starts with the parameter name, so the server can report it as ``param``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pagedllm.structured_output.params import StructuredOutputError, StructuredOutputsParams

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs; OpenAI's top_logprobs limit
MAX_N = 128        # a bound vLLM lacks: each sample is a request, and n=10**6 would exhaust memory
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1  # what torch.Generator.manual_seed and the msgpack wire take


class SamplingParamError(ValueError):
    """An invalid sampling parameter. ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to sample one request's output.

    Attributes:
        n: number of output sequences; each is sampled as its own request, sharing
            the prompt's KV blocks through the prefix cache. With a ``seed``,
            sample ``i`` uses ``seed + i`` (as vLLM).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` times the top one.
        seed: per-request seed; the tokens then do not depend on the batch.
        presence_penalty: subtracted from the logit of every token already generated,
            in [-2, 2] (OpenAI's definition).
        frequency_penalty: subtracted once per earlier occurrence in the output, in [-2, 2].
        repetition_penalty: CTRL's penalty (Keskar et al. 2019) on tokens of the prompt
            and output: positive logits are divided by it, negative ones multiplied; > 0.
        logit_bias: token id -> bias in [-100, 100] added to the logit before sampling.
        max_tokens: most tokens to generate (``None``: up to ``max_model_len``).
        min_tokens: tokens to generate before EOS / stop token ids may end the output.
        stop: strings that end the output; the match is not included in the text.
        stop_token_ids: token ids that end the output (kept out of the text).
        ignore_eos: keep generating after the EOS token.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens from the detokenized text.
        spaces_between_special_tokens: put spaces around special tokens in the text
            (only tokenizers whose ``decode`` supports it; fast tokenizers ignore it, as in vLLM).
        logprobs: number of top logprobs per generated token (``None``: none; 0: only the
            sampled token's). Logprobs are the model's raw log-softmax, before penalties,
            bias and temperature (vLLM's default ``raw_logprobs`` mode).
        prompt_logprobs: like ``logprobs`` for every prompt token after the first.
            Such requests do not read the prefix cache (a cached prefix has no logits).
        allowed_token_ids: when set, only these tokens can be generated (vLLM's name; EOS is
            not added, as in vLLM).
        truncate_prompt_tokens: keep only the last this many prompt tokens (-1: as many as the
            context holds; vLLM's name); ``None``: no truncation (too long is an error).
        detokenize: produce text; ``False`` gives token ids only (vLLM's name; needed with
            ``skip_tokenizer_init``, and stop strings then cannot apply).
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar
            (``StructuredOutputsParams``, or a dict of its fields); ``None``: free text.
            Logprobs are then those of the constrained distribution (disallowed tokens -inf),
            as in vLLM.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise SamplingParamError("logit_bias", "logit_bias: keys must be token ids and values numbers") from None
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise SamplingParamError("structured_outputs", f"structured_outputs: {e}") from None
            except StructuredOutputError as e:
                raise SamplingParamError(e.param, str(e)) from None
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
        if self.n > MAX_N:
            bad("n", f"must be at most {MAX_N}, got {self.n}")
        if self.temperature is None or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite non-negative number, got {self.temperature}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k is None or not -1 <= self.top_k < 2**31:
            bad("top_k", f"must be -1 (disable), 0 (disable) or a positive int32, got {self.top_k}")
        if math.isnan(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1):
            bad("seed", f"must be in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] so that seed + n - 1 (the last "
                        f"sample's seed) is at most {SEED_MAX}, got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or not -2.0 <= v <= 2.0:
                bad(name, f"must be in [-2, 2], got {v}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}")
        for tok, bias in (self.logit_bias or {}).items():
            if tok < 0:
                bad("logit_bias", f"token ids must be non-negative, got {tok}")
            if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
                bad("logit_bias", f"values must be in [-100, 100], got {bias} for token {tok}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                bad(name, f"must be in [0, {MAX_LOGPROBS}], got {v}")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            bad("allowed_token_ids", "must be a non-empty list of token ids")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens < -1 or self.truncate_prompt_tokens == 0):
            bad("truncate_prompt_tokens", f"must be -1 or at least 1, got {self.truncate_prompt_tokens}")
        if not self.detokenize and self.stop:
            bad("stop", "stop strings need detokenize=True (they are matched in the text)")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            bad("structured_outputs", f"must be a StructuredOutputsParams, got {type(so).__name__}")

    @property
    def has_penalties(self) -> bool:
        """True when any of presence, frequency or repetition penalty is active."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def child(self, index: int) -> "SamplingParams":
        """Parameters of sample ``index`` of an ``n > 1`` request: ``n=1`` and ``seed + index``."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below 1e-5)."""
        return self.temperature < 1e-5

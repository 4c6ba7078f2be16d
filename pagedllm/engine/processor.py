"""The front end's request processor: tokenize, validate and resolve defaults into one
``EngineCoreRequest`` (vLLM's ``Processor``), the only way requests are made.

Runs anywhere (no engine state is touched), so the server calls it on its tokenizer thread.
"""

from __future__ import annotations

import time

from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.sampling_params import SamplingParamError, SamplingParams
from pagedllm.structured_output.params import StructuredOutputError


class PromptTooLongError(SamplingParamError):
    """Prompt plus ``max_tokens`` exceeds the context limit (``param`` is ``max_tokens`` or ``prompt``)."""


class Processor:
    """Turns a prompt and ``SamplingParams`` into an ``EngineCoreRequest``.

    Args:
        tokenizer: the model's ``transformers`` tokenizer.
        vocab_size: the model's vocabulary size (token ids must be below it).
        context_limit: most tokens (prompt + output) one request may reach.
    """

    def __init__(self, tokenizer, vocab_size: int, context_limit: int) -> None:
        self.tokenizer, self.vocab_size, self.context_limit = tokenizer, vocab_size, context_limit
        self._grammar = None  # the grammar backend, built with the first constrained request
        self._valid_grammars: set[str] = set()

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile-check a request's structured-output constraint, so that nothing the core
        cannot compile reaches it (a grammar seen before is not checked again).

        Raises:
            SamplingParamError: ``param`` names the constraint (``structured_outputs.json``, ...).
        """
        so = params.structured_outputs
        if so is None:
            return
        if self.tokenizer is None:
            raise SamplingParamError(so.param, f"{so.param}: structured outputs need a tokenizer (the engine was "
                                     "built with skip_tokenizer_init=True)")
        from pagedllm.structured_output.backend import GuidanceBackend
        try:
            key = so.grammar_key()
        except StructuredOutputError as e:
            raise SamplingParamError(e.param, str(e)) from None
        if key in self._valid_grammars:
            return
        if self._grammar is None:
            try:
                self._grammar = GuidanceBackend(self.tokenizer, self.vocab_size, set())
            except ValueError as e:
                raise SamplingParamError(so.param, f"{so.param}: {e}") from None
        err = self._grammar.validate(so.grammar_spec())
        if err:
            raise SamplingParamError(so.param, f"{so.param}: {err.strip()}")
        if len(self._valid_grammars) > 4096:
            self._valid_grammars.clear()
        self._valid_grammars.add(key)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (special tokens as the tokenizer adds them), or the ids as given."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SamplingParamError("prompt", "prompt: a text prompt needs a tokenizer; this engine was "
                                         "built with skip_tokenizer_init=True (give token ids)")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                arrival_time: float | None = None, cache_salt: str | None = None) -> EngineCoreRequest:
        """Tokenize and validate.

        Raises:
            PromptTooLongError: prompt + max_tokens exceed the context limit (``param`` names which).
            SamplingParamError: an empty prompt, token ids outside the vocabulary (prompt,
                ``logit_bias``, ``stop_token_ids``), ``min_tokens`` above the effective ``max_tokens``,
                or a structured-output constraint that does not compile.
        """
        ids = self.tokenize(prompt)
        vocab = self.vocab_size
        if params.truncate_prompt_tokens is not None:  # keep the end: the question, not the preamble
            keep = self.context_limit - (params.max_tokens or 1) if params.truncate_prompt_tokens == -1 \
                else params.truncate_prompt_tokens
            ids = ids[-max(keep, 1):]
        if not ids:
            raise SamplingParamError("prompt", "prompt: must contain at least one token")
        if min(ids) < 0 or max(ids) >= vocab:
            raise SamplingParamError("prompt", f"prompt: token ids must be in [0, {vocab})")
        bad_bias = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad_bias:
            raise SamplingParamError("logit_bias", f"logit_bias: token ids must be in [0, {vocab}), got {bad_bias[0]}")
        bad_allowed = [t for t in params.allowed_token_ids or () if t >= vocab]
        if bad_allowed:
            raise SamplingParamError("allowed_token_ids", f"allowed_token_ids: token ids must be in [0, {vocab}), "
                                     f"got {bad_allowed[0]}")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise SamplingParamError("stop_token_ids", f"stop_token_ids: token ids must be in [0, {vocab}), "
                                     f"got {bad_stop[0]}")
        limit = self.context_limit
        if len(ids) >= limit:
            asked = "" if params.max_tokens is None else f" and requested max_tokens={params.max_tokens}"
            raise PromptTooLongError("prompt", f"This model's maximum context length is {limit} tokens. "
                                     f"However, your prompt has {len(ids)} tokens{asked}.")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise PromptTooLongError("max_tokens", f"This model's maximum context length is {limit} tokens. "
                                     f"However, you requested {len(ids) + max_tokens} tokens ({len(ids)} in the "
                                     f"prompt, {max_tokens} for max_tokens). Please reduce the length.")
        self.check_structured_outputs(params)
        if self.tokenizer is None and params.stop:
            raise SamplingParamError("stop", "stop: stop strings need a tokenizer (the engine was built with "
                                     "skip_tokenizer_init=True); use stop_token_ids")
        if params.min_tokens > max_tokens:  # without max_tokens the bound is what the context leaves
            raise SamplingParamError("min_tokens", f"min_tokens: must be <= max_tokens={max_tokens} (the "
                                     f"context limit less the prompt when max_tokens is not set), got "
                                     f"{params.min_tokens}")
        arrival = arrival_time if arrival_time is not None else time.time()
        return EngineCoreRequest(request_id, ids, params, max_tokens, arrival, cache_salt)

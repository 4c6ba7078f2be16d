"""Pydantic schemas of the OpenAI Chat Completions and Completions APIs (the parts pagedllm serves).

Field names and defaults follow the OpenAI API reference and vLLM's
OpenAI-compatible server. Fields not listed are ignored, as OpenAI's API ignores
unknown fields sent by newer clients.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.sampling_params import SamplingParams


def random_id(prefix: str) -> str:
    """A unique id such as ``chatcmpl-3f2a...`` (32 hex digits)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    """``stream_options`` of a streamed request."""

    include_usage: bool | None = False


class ContentPart(BaseModel):
    """One part of a multi-part message content; only text parts are served."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as plain text (parts joined)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class _SamplingRequest(BaseModel):
    """Sampling fields shared by both endpoints.

    Ranges are checked by ``SamplingParams``; here only what must never reach the
    engine: NaN/Infinity (Python's JSON parser accepts them) and integers that
    would overflow a 64-bit tensor (``top_k``) and crash the engine loop.
    """

    model_config = ConfigDict(allow_inf_nan=False)
    model: str | None = None
    temperature: float | None = Field(default=None)
    top_p: float | None = None
    top_k: int | None = Field(default=None, le=2**31 - 1)
    min_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, description=(
        "prefix-cache namespace: requests share cached KV blocks only when their salts are equal (vLLM's name)"))

    def _sampling_params(self, max_tokens: int | None, defaults: dict) -> SamplingParams:
        """Build ``SamplingParams``; fields left out take the model's generation_config defaults.

        Raises:
            SamplingParamError: a value is out of range (its ``param`` names the field).
        """
        def pick(name: str, fallback: Any) -> Any:
            v = getattr(self, name)
            return v if v is not None else defaults.get(name, fallback)

        return SamplingParams(n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
                              top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), seed=self.seed,
                              max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        """Sampling parameters; ``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(mt, defaults)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions`` body."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list of strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        """Sampling parameters of the request."""
        return self._sampling_params(self.max_tokens, defaults)


class UsageInfo(BaseModel):
    """Token counts of a response."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def now() -> int:
    """Unix time in whole seconds, as OpenAI's ``created`` fields."""
    return int(time.time())

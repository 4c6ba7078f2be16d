"""OpenAI's chat completions and completions response bodies (split from ``server/protocol.py``, which
keeps the request bodies and re-exports these): choices, messages, stream chunks and deltas, usage.

Source: OpenAI's API reference (the shapes) and vLLM's extensions (``stop_reason``, ``prompt_logprobs``).
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal

from pydantic import BaseModel, model_serializer


class _OmitUnset(BaseModel):
    """A response body whose fields named in ``omit_unless_set`` appear only when given
    (a stream delta names only what changed; ``usage`` rides only on the last chunk)."""

    omit_unless_set: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        data = handler(self)
        return {k: v for k, v in data.items() if k not in self.omit_unless_set or k in self.model_fields_set}


class UsageInfo(BaseModel):
    """Token counts of a response."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt: int, completion: int) -> "UsageInfo":
        """Usage of ``prompt`` prompt tokens and ``completion`` generated tokens."""
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class ChatResponseMessage(_OmitUnset):
    """The assistant ``message`` of a chat choice: ``content`` null when it is only tool calls;
    ``reasoning_content`` when the server splits reasoning out."""

    omit_unless_set: ClassVar[frozenset[str]] = frozenset({"reasoning_content", "tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None


class ChatCompletionChoice(BaseModel):
    """One choice of a chat completion; ``stop_reason`` (vLLM's field) is the stop string or
    stop token id that ended it, if any."""

    index: int
    message: ChatResponseMessage
    logprobs: dict | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_OmitUnset):
    """``POST /v1/chat/completions`` answer (not streamed); ``prompt_logprobs`` (vLLM's) only when asked."""

    omit_unless_set: ClassVar[frozenset[str]] = frozenset({"prompt_logprobs"})
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict | None] | None = None


class DeltaMessageOut(_OmitUnset):
    """The ``delta`` of a chat chunk: only the fields that changed."""

    omit_unless_set: ClassVar[frozenset[str]] = frozenset({"role", "content", "reasoning_content", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None


class ChatChunkChoice(BaseModel):
    """One choice of a chat chunk (``stop_reason`` as in ``ChatCompletionChoice``, on the last chunk)."""

    index: int
    delta: DeltaMessageOut
    logprobs: dict | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_OmitUnset):
    """One server-sent event of a streamed chat completion (``usage`` only on the usage chunk)."""

    omit_unless_set: ClassVar[frozenset[str]] = frozenset({"usage"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(_OmitUnset):
    """One choice of a completion, or of a completion chunk (then ``text`` is the new text);
    ``prompt_logprobs`` (vLLM's) only when asked."""

    omit_unless_set: ClassVar[frozenset[str]] = frozenset({"prompt_logprobs"})
    index: int
    text: str
    logprobs: dict | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict | None] | None = None


class CompletionResponse(_OmitUnset):
    """``POST /v1/completions`` answer, and each streamed chunk of one (chunks carry ``usage``
    only on the usage chunk)."""

    omit_unless_set: ClassVar[frozenset[str]] = frozenset({"usage"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


def now() -> int:
    """Unix time in whole seconds, as OpenAI's ``created`` fields."""
    return int(time.time())

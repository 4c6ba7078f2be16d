"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over the
chat completions handler.

A Messages request is translated into a ``ChatCompletionRequest`` (system prompt, text,
``tool_use`` and ``tool_result`` blocks, tools, ``tool_choice``, sampling fields), run by the same
``OpenAIServingChat`` (so the same engine, parsers and structured outputs), and its answer or
chunk stream translated back: content blocks (``text``, ``tool_use`` with parsed ``input``),
``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``), ``usage``, and the
streaming events ``message_start``, ``content_block_start``, ``content_block_delta``
(``text_delta``, ``input_json_delta``), ``content_block_stop``, ``message_delta``,
``message_stop``. Errors use Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

Follows Anthropic's Messages API reference (the fields listed here; ``image`` and ``document``
blocks, ``thinking`` and server tools are refused with a 400).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedllm.server.errors import APIError, validation_error
from pagedllm.server.guards import MAX_MESSAGES, MAX_STOP_STRINGS, MAX_TOOLS
from pagedllm.server.protocol import Bool, ChatCompletionRequest, Float, Int, RequestBody

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: Bool = False


Block = TextBlock | ToolUseBlock | ToolResultBlock


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: Bool = False


class MessagesRequest(RequestBody):
    """``POST /v1/messages`` body (Anthropic's names)."""

    model_config = ConfigDict(allow_inf_nan=False)
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    max_tokens: Int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: Float | None = Field(default=None, ge=0, le=1)
    top_p: Float | None = None
    top_k: Int | None = None
    stream: Bool = False
    tools: list[AnthropicTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None  # user_id: changes nothing
    thinking: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens`` body: a Messages request without ``max_tokens``."""

    max_tokens: Int = 1


def error_body(status: int, message: str) -> dict:
    """Anthropic's error shape for an HTTP status."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def parse(raw: Any, cls=MessagesRequest) -> MessagesRequest:
    """Validate a raw JSON body.

    Raises:
        APIError: 400 naming the field (answered in Anthropic's shape by the route).
    """
    try:
        req = cls.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e) from None
    if req.thinking is not None and req.thinking.get("type") not in (None, "disabled"):
        raise APIError(400, "thinking: extended thinking is not supported; start the server with "
                       "--reasoning-parser for models that reason", "thinking")
    return req


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The equivalent ``ChatCompletionRequest`` (messages, tools, tool_choice, sampling).

    Raises:
        APIError: 400 for a ``tool_choice`` of type ``tool`` without a name.
    """
    msgs: list[dict] = []
    if req.system:
        msgs.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
            continue
        text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in m.content if isinstance(b, ToolUseBlock)]
        for b in m.content:
            if isinstance(b, ToolResultBlock):  # each result is a tool message, in order
                msgs.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
        if text or calls or m.role == "assistant":
            msg: dict = {"role": m.role, "content": text}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
    body: dict = {"model": req.model, "messages": msgs, "max_tokens": req.max_tokens, "stream": req.stream,
                  "stop": req.stop_sequences, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    tc = req.tool_choice
    if tc is not None:
        if tc.type == "tool" and not tc.name:
            raise APIError(400, "tool_choice.name: required when type is 'tool'", "tool_choice.name")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            tc.type, {"type": "function", "function": {"name": tc.name}})
        body["parallel_tool_calls"] = not tc.disable_parallel_tool_use
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None


def _stop_reason(finish: str | None, stop_reason, called: bool) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` of a chat choice's finish."""
    if called and finish != "length":
        return "tool_use", None
    if finish == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return _STOP.get(finish or "stop", "end_turn"), None


def message_of(chat: dict, model: str) -> dict:
    """An Anthropic ``message`` from a chat completion response dict."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for tc in msg.get("tool_calls") or []:
        try:
            args = json.loads(tc["function"]["arguments"] or "{}")
        except ValueError:  # a call cut by max_tokens: its arguments are not whole
            args = {}
        content.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"], "input": args})
    reason, sequence = _stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(msg.get("tool_calls")))
    usage = chat["usage"]
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_of(chunks, model: str) -> AsyncIterator[str]:
    """Anthropic's streaming events from the chat handler's SSE lines (one choice). Closing this
    closes ``chunks`` (a ``HeldStream``: its engine request is aborted, its admission released)."""
    try:
        async for event in _events_of(chunks, model):
            yield event
    finally:
        await chunks.aclose()


async def _events_of(chunks: AsyncIterator[str], model: str) -> AsyncIterator[str]:
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    yield _event("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}})
    block: tuple[str, int] | None = None  # ("text", -) or ("tool", tool call index)
    index = -1
    finish, usage, called, stop_reason = None, None, False, None
    async for line in chunks:
        if not line.startswith("data: ") or line.startswith("data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            yield _event("error", {"type": "error", "error": {"type": "api_error",
                                                              "message": chunk["error"]["message"]}})
            return
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices", []):
            delta = ch.get("delta", {})
            if delta.get("content"):
                if block is None or block[0] != "text":
                    if block is not None:
                        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                    block = ("text", 0)
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": {"type": "text", "text": ""}})
                yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                     "delta": {"type": "text_delta", "text": delta["content"]}})
            for tc in delta.get("tool_calls") or []:
                called = True
                if block != ("tool", tc["index"]):
                    if block is not None:
                        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                    block = ("tool", tc["index"])
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": {"type": "tool_use", "id": tc["id"],
                                                                           "name": tc["function"]["name"],
                                                                           "input": {}}})
                piece = tc["function"].get("arguments") or ""
                if piece:
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                         "delta": {"type": "input_json_delta", "partial_json": piece}})
            finish = ch.get("finish_reason") or finish
            stop_reason = ch.get("stop_reason") or stop_reason
    if block is not None:
        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
    reason, sequence = _stop_reason(finish, stop_reason, called)
    out_tokens = usage["completion_tokens"] if usage else 0
    yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"output_tokens": out_tokens,
                                             "input_tokens": usage["prompt_tokens"] if usage else 0}})
    yield _event("message_stop", {"type": "message_stop"})

"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over the
chat completions handler.

A Messages request is translated into a ``ChatCompletionRequest`` (system prompt, text,
``tool_use`` and ``tool_result`` blocks, tools, ``tool_choice``, sampling fields), run by the same
``OpenAIServingChat`` (so the same engine, parsers and structured outputs), and its answer or
chunk stream translated back: content blocks (``text``, ``tool_use`` with parsed ``input``),
``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``), ``usage``, and the
streaming events ``message_start``, ``content_block_start``, ``content_block_delta``
(``text_delta``, ``input_json_delta``), ``content_block_stop``, ``message_delta``,
``message_stop``. Errors use Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``
(``errors.APIError.response_for``: the app answers every error under ``/v1/messages`` so).

``output_config.format`` (structured outputs; the beta's ``output_format`` too) becomes the chat
``response_format``, so the text block follows the schema, streamed or not; a final assistant
message is continued (prefill). Follows Anthropic's Messages API reference; the request body, and
which of its fields are served, harmless or refused (a 400 naming them), is
``protocol_anthropic``'s.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from pydantic import ValidationError

from pagedllm.server.errors import APIError, validation_error
from pagedllm.server.protocol import ChatCompletionRequest
from pagedllm.server.protocol_anthropic import (CountTokensRequest, ImageBlock, MessagesRequest, OutputFormat, TextBlock,
                                                ToolResultBlock, ToolUseBlock)
from pagedllm.server.structured import name_fields

__all__ = ["CountTokensRequest", "MessagesRequest", "message_of", "parse", "stream_of", "to_chat"]

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
_EFFORTS = ("low", "medium", "high")  # Anthropic's efforts that chat's reasoning_effort has


def parse(raw: Any, cls=MessagesRequest) -> MessagesRequest:
    """Validate a raw JSON body.

    Raises:
        APIError: 400 naming the field (answered in Anthropic's shape by the route): an invalid
            value, an unknown field, a refused one (``protocol_anthropic``), ``thinking`` other
            than ``disabled``, ``output_config.effort`` beyond ``high``.
    """
    try:
        req = cls.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e) from None
    if req.thinking is not None and req.thinking.type != "disabled":
        raise APIError(400, "thinking: extended thinking is not supported; start the server with "
                       "--reasoning-parser for models that reason", "thinking")
    effort = req.output_config.effort if req.output_config else None
    if effort is not None and effort not in _EFFORTS:
        raise APIError(400, f"output_config.effort: {effort!r} is not supported by pagedllm (chat's "
                       f"reasoning_effort goes up to 'high')", "output_config.effort")
    return req


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _join(a: str | list, b: str | list) -> str | list:
    """Two turns' chat contents as one (text, or parts where either has images)."""
    if isinstance(a, str) and isinstance(b, str):
        return a + b
    return [*_parts(a), *_parts(b)]


def _parts(content: str | list) -> list:
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def _check_images(req: MessagesRequest, text_only: bool, policy=None) -> None:
    """Refuse ``image`` blocks for a text-only model, decode every base64 one once here and check every
    URL one against ``policy`` (``media.MediaPolicy``), so a bad one is a 400 naming its own field (a
    URL source is read with the chat request).

    Raises:
        APIError: 400 naming ``messages[i].content[j]`` (text-only model) or its ``.source``.
    """
    from pagedllm.media import check_url, image_from_url
    for i, m in enumerate(req.messages):
        for j, b in enumerate(m.content if isinstance(m.content, list) else ()):
            if isinstance(b, ImageBlock) and text_only:
                where = f"messages[{i}].content[{j}]"
                raise APIError(400, f"{where}: this model reads text only", where)
            if isinstance(b, ImageBlock):
                where, url = f"messages[{i}].content[{j}].source", b.data_url()
                try:  # a URL is only checked: fetched with the chat request
                    image_from_url(url, where) if url.startswith("data:") else check_url(url, where, policy)
                except ValueError as e:
                    raise APIError(400, str(e), where) from None


def _chat_messages(req: MessagesRequest) -> list[dict]:
    """The conversation in chat messages: a ``tool_result`` is a ``tool`` message, ``tool_use``
    blocks are ``tool_calls``, and consecutive turns of one role are one turn (Anthropic combines
    them), their texts joined as one turn's blocks are."""
    msgs: list[dict] = [{"role": "system", "content": _text(req.system)}] if req.system else []
    for m in req.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        images = [{"type": "image_url", "image_url": {"url": b.data_url()}} for b in blocks if isinstance(b, ImageBlock)]
        if images:  # chat image parts (their placeholders go before the text, as the chat API renders them)
            text = images + [{"type": "text", "text": text}]
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        for b in blocks:
            if isinstance(b, ToolResultBlock):  # each result is a tool message, in order
                # the model is told the call failed: Anthropic's is_error has no chat field of its own
                content = ("Error: " if b.is_error else "") + _text(b.content)
                msgs.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        if not (text or calls or m.role == "assistant"):
            continue
        last = msgs[-1] if msgs else None
        if last is not None and last["role"] == m.role and not last.get("tool_calls"):
            last["content"] = _join(last["content"], text)
            if calls:
                last["tool_calls"] = calls
            continue
        msg: dict = {"role": m.role, "content": text}
        if calls:
            msg["tool_calls"] = calls
        msgs.append(msg)
    return msgs


def _tool_fields(req: MessagesRequest, body: dict) -> None:
    """Set ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the chat ``body``.

    Raises:
        APIError: 400 for a ``tool_choice`` of type ``tool`` without a name or naming no tool of
            ``tools``, of type ``any`` without tools; for ``strict`` tools or
            ``disable_parallel_tool_use`` where calls are not constrained (``auto``).
    """
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    tc = req.tool_choice
    kind = tc.type if tc is not None else ("auto" if req.tools else "none")
    if kind == "auto" and req.tools:
        # a forced call follows its schema (a grammar); a call the model makes freely is only parsed
        strict = next((i for i, t in enumerate(req.tools) if t.strict), None)
        if strict is not None:
            raise APIError(400, f"tools[{strict}].strict: not served with tool_choice 'auto' (calls are parsed, "
                           "not constrained); use tool_choice 'any' or 'tool'", f"tools[{strict}].strict")
        if tc is not None and tc.disable_parallel_tool_use:
            raise APIError(400, "tool_choice.disable_parallel_tool_use: not served with type 'auto' (every call "
                           "the model writes is returned)", "tool_choice.disable_parallel_tool_use")
    if tc is None:
        return
    if tc.type == "tool" and not tc.name:
        raise APIError(400, "tool_choice.name: required when type is 'tool'", "tool_choice.name")
    # checked here, not only by the chat handler, so that count_tokens refuses what /v1/messages refuses
    if tc.type == "tool" and tc.name not in {t.name for t in req.tools or []}:
        raise APIError(400, f"tool_choice.name: tool {tc.name!r} is not among the request's tools",
                       "tool_choice.name")
    if tc.type == "any" and not req.tools:
        raise APIError(400, "tool_choice: type 'any' needs at least one tool in tools", "tool_choice")
    body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
        tc.type, {"type": "function", "function": {"name": tc.name}})
    body["parallel_tool_calls"] = not tc.disable_parallel_tool_use


def _output_format(req: MessagesRequest, prefill: bool) -> tuple[OutputFormat, str] | None:
    """The requested text format and the field it came from (``output_config.format``, or the
    beta's ``output_format``), or ``None``.

    Raises:
        APIError: 400 for both fields at once; for a format with tools the model may call (the
            grammar covers the whole answer, so no call could be made) or with a prefill (the
            prefill is not part of what the grammar constrains).
    """
    fmt = req.output_config.format if req.output_config else None
    field = "output_config.format"
    if req.output_format is not None:
        if fmt is not None:
            raise APIError(400, "output_format: give output_config.format or the beta's output_format, not both",
                           "output_format")
        fmt, field = req.output_format, "output_format"
    if fmt is None:
        return None
    if req.tools and (req.tool_choice is None or req.tool_choice.type != "none"):
        raise APIError(400, f"{field}: not served together with tools the model may call (the format constrains "
                       "the whole answer, so no tool could be called); send tool_choice {\"type\": \"none\"}",
                       field)
    if prefill:
        raise APIError(400, f"{field}: not served with a final assistant message (prefill)", field)
    return fmt, field


def to_chat(req: MessagesRequest, text_only: bool = False, policy=None) -> ChatCompletionRequest:
    """The equivalent ``ChatCompletionRequest`` (messages, tools, tool_choice, sampling, the text
    format as ``response_format``, ``effort`` as ``reasoning_effort``); a final assistant message is
    continued (Anthropic's prefill: ``continue_final_message``).

    ``text_only``: the served model reads no images (its ``image`` blocks are refused here);
    ``policy``: where its image URLs may point (``media.MediaPolicy``; checked here).

    Raises:
        APIError: 400 for the ``tool_choice``, ``strict`` and format conflicts above, and a final
            assistant message holding ``tool_use`` blocks (there is nothing to continue).
    """
    _check_images(req, text_only, policy)
    msgs = _chat_messages(req)
    prefill = req.messages[-1].role == "assistant"
    if prefill and msgs[-1].get("tool_calls"):
        raise APIError(400, f"messages[{len(req.messages) - 1}]: a final assistant message with tool_use blocks "
                       "needs a user message with their tool_result blocks after it",
                       f"messages[{len(req.messages) - 1}]")
    body: dict = {"model": req.model, "messages": msgs, "max_tokens": req.max_tokens, "stream": req.stream,
                  "stop": req.stop_sequences, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    if prefill:
        body.update(continue_final_message=True, add_generation_prompt=False)
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    _tool_fields(req, body)
    fmt = _output_format(req, prefill)
    if fmt is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt[0].json_schema}}
    if req.output_config and req.output_config.effort:
        body["reasoning_effort"] = req.output_config.effort
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None
    # a constraint's errors name this request's fields, not the chat ones they were mapped to
    names = {f"tools[{i}].function.parameters": f"tools[{i}].input_schema" for i in range(len(req.tools or []))}
    if fmt is not None:
        names.update({"response_format.json_schema.schema": f"{fmt[1]}.schema", "response_format": fmt[1]})
    name_fields(chat, names)
    return chat


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

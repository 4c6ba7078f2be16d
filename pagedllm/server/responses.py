"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API over the
chat completions handler.

A Responses request is translated into a ``ChatCompletionRequest``: ``instructions`` become the
system message, ``input`` (text, or message / ``function_call`` / ``function_call_output`` items)
the conversation, after the stored conversation of ``previous_response_id``; ``tools`` (function
tools), ``tool_choice``, ``max_output_tokens``, ``temperature``, ``top_p``, ``parallel_tool_calls``
and ``text.format`` (structured output) map to their chat fields. The answer comes back as output
items (``reasoning`` when a reasoning parser split it, ``message`` with ``output_text``,
``function_call``), or streamed as the Responses events (``response.created``,
``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``..._done``, ``response.completed``).

With ``store`` (the default, as OpenAI's), a response and its conversation are kept in an in-memory
store bounded in entries and bytes (``server/response_store.py``, least recently used out first), so
that ``previous_response_id`` continues it and ``GET`` / ``DELETE`` find it; each stored response
belongs to the caller's owner (per API key with keys) and is found by that owner only. The body and
its checks are in ``server/protocol_responses.py``. Follows OpenAI's Responses API reference.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from pydantic import ValidationError

from pagedllm.server.errors import APIError, validation_error
from pagedllm.server.protocol import ChatCompletionRequest
# the body and the store, re-exported: the routes name them as ``responses.ResponsesRequest`` and so on
from pagedllm.server.protocol_responses import ResponsesRequest  # noqa: F401
from pagedllm.server.response_store import STORE_BYTES, STORE_SIZE, Owner, ResponseStore  # noqa: F401
from pagedllm.server.structured import name_fields


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def parse(raw: Any) -> ResponsesRequest:
    """Validate a raw body.

    Raises:
        APIError: 400 naming the field.
    """
    try:
        return ResponsesRequest.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e) from None


def _content_text(content: Any, where: str) -> str | list[dict]:
    """A message's content as chat content: its text, or chat parts when it has ``input_image`` parts
    (``image_url`` a data URL; decoded here so that a bad one is a 400 naming it).

    Raises:
        APIError: 400 naming a part of another type, an image with a ``file_id`` or a ``detail``
            other than ``auto``, or one that is not a readable data URL.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: expected text or a list of content parts", where)
    out, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            images.append(_image_part(part, f"{where}[{j}]"))
            continue
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}[{j}].type: only text and input_image parts are served, got {kind!r}",
                           f"{where}[{j}].type")
        out.append(str(part.get("text", "")))
    return images + [{"type": "text", "text": "".join(out)}] if images else "".join(out)


def _image_part(part: dict, where: str) -> dict:
    """An ``input_image`` part as a chat ``image_url`` part (checked: see ``_content_text``)."""
    from pagedllm.media import image_from_url
    if part.get("file_id") is not None:
        raise APIError(400, f"{where}.file_id: files are not served; send image_url as a data URL", f"{where}.file_id")
    if part.get("detail") not in (None, "auto"):
        raise APIError(400, f"{where}.detail: only 'auto' (the model's processor sets the resolution)", f"{where}.detail")
    try:
        url = part.get("image_url")
        if not (isinstance(url, str) and not url.startswith("data:")):  # a URL is fetched with the chat request
            image_from_url(url, f"{where}.image_url")
    except ValueError as e:
        raise APIError(400, str(e), f"{where}.image_url") from None
    return {"type": "image_url", "image_url": {"url": part["image_url"]}}


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's own input as chat messages (without instructions or the stored conversation).

    Raises:
        APIError: 400 for an item of an unknown type or role.
    """
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    msgs: list[dict] = []
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role: expected user, assistant, system or developer", f"{where}.role")
            msgs.append({"role": role, "content": _content_text(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output", "")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": out if isinstance(out, str) else json.dumps(out)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise APIError(400, f"{where}.type: unsupported input item {kind!r}", f"{where}.type")
    return msgs


def to_chat(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The equivalent ``ChatCompletionRequest``, and the conversation it renders (for the store)."""
    conversation = history + input_messages(req)
    msgs = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict = {"model": req.model, "messages": msgs, "max_tokens": req.max_output_tokens, "stream": req.stream,
                  "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters}} for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else {
            "type": "function", "function": {"name": req.tool_choice.name}}
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else
                                   {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                                           "schema": fmt.json_schema,
                                                                           "strict": fmt.strict}})
    if req.reasoning and req.reasoning.get("effort"):
        body["reasoning_effort"] = req.reasoning["effort"]
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None
    # a constraint's errors name this request's fields, not the chat ones they were mapped to
    name_fields(chat, {"response_format.json_schema.schema": "text.format.schema", "response_format": "text.format",
                       **{f"tools[{i}].function.parameters": f"tools[{i}].parameters"
                          for i in range(len(req.tools or []))}})
    return chat, conversation


def _message_item(text: str) -> dict:
    return {"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed"}


def response_object(req: ResponsesRequest, rid: str, model: str, output: list[dict], usage: dict | None,
                    finish: str | None, status: str = "completed") -> dict:
    """The ``response`` object (OpenAI's fields)."""
    incomplete = finish == "length"
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
        {"type": "text"}
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "instructions": req.instructions, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "store": req.store,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
            else req.tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "text": {"format": fmt},
            "metadata": req.metadata or {}, "truncation": "disabled",
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}}}


def _assistant_turn(output: list[dict]) -> list[dict]:
    """The chat messages of a response's output (kept for ``previous_response_id``)."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    msg: dict = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def output_of(chat: dict) -> tuple[list[dict], str | None]:
    """Output items from a chat completion response dict, and its finish reason."""
    choice = chat["choices"][0]
    msg = choice["message"]
    out: list[dict] = []
    if msg.get("reasoning_content"):
        out.append(_reasoning_item(msg["reasoning_content"]))
    if msg.get("content"):
        out.append(_message_item(msg["content"]))
    for tc in msg.get("tool_calls") or []:
        out.append(_call_item(tc["id"], tc["function"]["name"], tc["function"]["arguments"]))
    return out, choice["finish_reason"]


def respond(req: ResponsesRequest, chat: dict, conversation: list[dict], model: str, store: ResponseStore,
            owner: Owner = None) -> dict:
    """The non-streamed answer (stored for ``owner`` when ``store``)."""
    output, finish = output_of(chat)
    resp = response_object(req, _id("resp"), model, output, chat["usage"], finish)
    if req.store:
        store.put(resp, conversation + _assistant_turn(output), owner)
    return resp


class _Events:
    """Numbers the streamed events (``sequence_number``) and formats them as SSE."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **data) -> str:
        body = {"type": kind, "sequence_number": self.n, **data}
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


async def stream(req: ResponsesRequest, chunks, conversation: list[dict], model: str,
                 store: ResponseStore, owner: Owner = None) -> AsyncIterator[str]:
    """The Responses events from the chat handler's SSE lines (one choice); the completed response is
    stored for ``owner`` when ``store``. Closing this closes ``chunks`` (a ``HeldStream``: its engine
    request is aborted, its admission released)."""
    try:
        async for event in _events(req, chunks, conversation, model, store, owner):
            yield event
    finally:
        await chunks.aclose()


class _StreamedOutput:
    """The output items of a streamed response, built from the chat chunks as they come, and the
    events that announce them (OpenAI's Responses streaming events): an item is added when its
    first piece comes, gets a delta event per piece, and is done when another item starts or the
    stream ends. Text and reasoning pieces extend the open item of their kind; each tool call
    (by its chat ``index``) is an item of its own."""

    def __init__(self, ev: _Events) -> None:
        self.ev = ev
        self.output: list[dict] = []
        self.open_item: dict | None = None
        self.texts: dict[str, str] = {}  # item id -> its text so far (message and reasoning items)
        self.calls: dict[int, dict] = {}  # chat tool call index -> its function_call item
        self.usage: dict | None = None
        self.finish: str | None = None

    def feed(self, chunk: dict) -> list[str]:
        """The events of one chat completion chunk (its usage and finish reason are kept)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[str] = []
        for ch in chunk.get("choices", []):
            delta = ch.get("delta", {})
            self.finish = ch.get("finish_reason") or self.finish
            for field, kind in (("reasoning_content", "reasoning"), ("content", "message")):
                if delta.get(field):
                    out += self._text_piece(kind, delta[field])
            for tc in delta.get("tool_calls") or []:
                out += self._call_piece(tc)
        return out

    def close_open(self) -> list[str]:
        """The events that finish the item still open at the end of the stream (none if none is)."""
        return [] if self.open_item is None else self._close(self.open_item)

    def _text_piece(self, kind: str, piece: str) -> list[str]:
        out: list[str] = []
        if self.open_item is None or self.open_item["type"] != kind:
            out += self._switch_to(_message_item("") if kind == "message" else _reasoning_item(""))
        self.texts[self.open_item["id"]] += piece
        name = "output_text" if kind == "message" else "reasoning_text"
        out.append(self.ev(f"response.{name}.delta", item_id=self.open_item["id"], output_index=len(self.output) - 1,
                           content_index=0, delta=piece))
        return out

    def _call_piece(self, tc: dict) -> list[str]:
        out: list[str] = []
        if tc["index"] not in self.calls:
            self.calls[tc["index"]] = _call_item(tc["id"], tc["function"]["name"], "")
            out += self._switch_to(self.calls[tc["index"]])
        piece = tc["function"].get("arguments") or ""
        if piece:
            call = self.calls[tc["index"]]
            call["arguments"] += piece
            out.append(self.ev("response.function_call_arguments.delta", item_id=call["id"],
                               output_index=self.output.index(call), delta=piece))
        return out

    def _switch_to(self, item: dict) -> list[str]:
        """Close the open item, if any, and open ``item``."""
        out = self.close_open()
        self.open_item = item
        return out + self._start(item)

    def _start(self, item: dict) -> list[str]:
        self.output.append(item)
        idx = len(self.output) - 1
        shown = dict(item, status="in_progress")
        out = [self.ev("response.output_item.added", output_index=idx, item=shown)]
        if item["type"] in ("message", "reasoning"):
            self.texts[item["id"]] = ""
            part = ({"type": "output_text", "text": "", "annotations": []} if item["type"] == "message"
                    else {"type": "reasoning_text", "text": ""})
            out.append(self.ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                               part=part))
        return out

    def _close(self, item: dict) -> list[str]:
        idx = self.output.index(item)
        out = []
        if item["type"] in ("message", "reasoning"):
            text = self.texts[item["id"]]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            if item["type"] == "message":
                item["content"] = [{"type": "output_text", "text": text, "annotations": []}]
            else:
                item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self.ev(f"response.{kind}.done", item_id=item["id"], output_index=idx, content_index=0,
                               text=text))
            out.append(self.ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                               part=item["content"][0]))
        else:
            out.append(self.ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                               arguments=item["arguments"]))
        item["status"] = "completed"
        out.append(self.ev("response.output_item.done", output_index=idx, item=item))
        return out


async def _events(req: ResponsesRequest, chunks: AsyncIterator[str], conversation: list[dict], model: str,
                  store: ResponseStore, owner: Owner) -> AsyncIterator[str]:
    """``stream``'s events: created and in progress, the output items' (``_StreamedOutput``), then
    completed or incomplete (stored first when ``store``); a chat error chunk ends it with ``error``."""
    ev = _Events()
    rid = _id("resp")
    yield ev("response.created", response=response_object(req, rid, model, [], None, None, "in_progress"))
    yield ev("response.in_progress", response=response_object(req, rid, model, [], None, None, "in_progress"))
    items = _StreamedOutput(ev)
    async for line in chunks:
        if not line.startswith("data: ") or line.startswith("data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            yield ev("error", code=None, message=chunk["error"]["message"], param=None)
            return
        for event in items.feed(chunk):
            yield event
    for event in items.close_open():
        yield event
    resp = response_object(req, rid, model, items.output, items.usage, items.finish)
    if req.store:
        store.put(resp, conversation + _assistant_turn(items.output), owner)
    yield ev("response.completed" if resp["status"] == "completed" else "response.incomplete", response=resp)

"""A bound on how deeply request JSON may nest, checked before any parser recurses into it.

Python's ``json`` module, pydantic, Jinja chat templates, the schema walks and llguidance all
recurse once per level of nesting, so JSON a few hundred to a thousand levels deep ends in a
``RecursionError`` (a 500) somewhere different for each. No real request nests anywhere near
``MAX_JSON_DEPTH`` levels (a JSON schema 30 levels deep is already unusual), so the server refuses
deeper JSON with a 400 naming the field:

* ``JSONDepthMiddleware``: the whole request body, as raw bytes, before Starlette, FastAPI or a
  route parses it (schemas, tool parameters, Responses input items, a whole Messages body);
* ``check_json_texts``: the JSON *texts* a request carries in strings, which are parsed later
  (``guided_json`` and ``structured_outputs.json`` / ``structural_tag`` given as text, tool-call
  ``arguments``); a route calls it on its validated body.

The scan never recurses and never loops in Python over the body: escapes are blanked and strings
masked with ``bytes`` and ``numpy`` operations, and the nesting depth at every byte is one cumulative
sum (the explicit stack reduced to its height); the field is then read off the containers still open
where the depth first passes the bound. Errors use the request path's API shape
(``APIError.response_for``).
"""

from __future__ import annotations

import json
from typing import Iterator

import numpy as np

from pagedllm.server.errors import APIError
from pagedllm.server.guards import replay, send_error

MAX_JSON_DEPTH = 100   # containers ([ or {) open at once; the body's own braces are level 1
_PARAM_PARTS = 4       # a field named by at most this many keys and indices: "tools[0].function.parameters"

_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_QUOTE, _COMMA, _BRACE = ord('"'), ord(","), ord("{")


def _as_bytes(data: bytes | str) -> bytes:
    return data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data


def _depths(data: bytes) -> tuple[bytes, np.ndarray, np.ndarray]:
    """``(blanked, outside, depth)`` of ``data``: the text with escapes blanked (same offsets), whether
    each byte is outside strings, and how many containers are open after each byte."""
    # blank escapes at their own length: an escaped quote never ends a string, offsets stay put
    blanked = data.replace(b"\\\\", b"  ").replace(b'\\"', b"  ")
    codes = np.frombuffer(blanked, dtype=np.uint8)
    outside = (np.cumsum(codes == _QUOTE, dtype=np.int32) & 1) == 0  # a closing quote counts as outside
    step = np.where(outside, _STEP[codes], 0).astype(np.int32)
    return blanked, outside, np.cumsum(step, dtype=np.int32)


def too_deep(data: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``data`` opens more than ``limit`` arrays or objects inside each other.

    Works on any text, valid JSON or not (brackets inside strings do not count), in linear time
    and without recursion.
    """
    data = _as_bytes(data)
    if data.count(b"[") + data.count(b"{") <= limit:  # the common case: cannot be deeper
        return False
    return bool(_depths(data)[2].max() > limit)


def deep_field(data: bytes | str, limit: int = MAX_JSON_DEPTH) -> str | None:
    """The field (``tools[0].function.parameters``, at most ``_PARAM_PARTS`` keys and indices) whose
    value holds the first container past ``limit`` levels; ``None`` when that is the body itself (a
    top-level array) or nothing is too deep.
    """
    data = _as_bytes(data)
    blanked, outside, depth = _depths(data)
    past = np.flatnonzero(depth > limit)
    if not past.size:
        return None
    codes = np.frombuffer(blanked, dtype=np.uint8)
    head = slice(0, past[0] + 1)
    openers = np.flatnonzero(outside[head] & (_STEP[codes[head]] == 1))
    # at each level, the container still open there is the last one opened at that level
    chain = [openers[depth[openers] == level][-1] for level in range(1, min(limit, _PARAM_PARTS) + 2)]
    if codes[chain[0]] != _BRACE:
        return None
    path = ""
    for level, (outer, inner) in enumerate(zip(chain, chain[1:]), start=1):
        if codes[outer] == _BRACE:  # the key is the last string before the value: "key": [
            end = blanked.rfind(b'"', outer, inner)
            start = blanked.rfind(b'"', outer, end) if end > outer else -1
            if start < 0:  # no key (not JSON): name what was found
                break
            key = _key(data[start:end + 1])
            path += f".{key}" if path else key
        else:  # an array: the index is the commas at its own level before the value
            at = slice(outer, inner)
            path += f"[{np.count_nonzero((codes[at] == _COMMA) & outside[at] & (depth[at] == level))}]"
    return path or None


def _key(token: bytes) -> str:
    try:
        return str(json.loads(token))
    except ValueError:
        return token.decode("utf-8", "replace").strip('"')


def depth_error(param: str | None, limit: int = MAX_JSON_DEPTH) -> APIError:
    """The 400 of JSON nested past ``limit`` levels in ``param`` (``None``: the body)."""
    where = param or "the request body"
    return APIError(400, f"{where}: JSON nested more than {limit} levels deep", param, code="invalid_value")


def check_json_text(text: str, param: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse a JSON text nested past ``limit`` levels before anything parses it.

    Raises:
        APIError: 400 naming ``param``.
    """
    if too_deep(text, limit):
        raise depth_error(param, limit)


def _json_texts(body) -> Iterator[tuple[str, str]]:
    """``(param, text)`` of every string of ``body`` that the server later parses as JSON."""
    if isinstance(getattr(body, "guided_json", None), str):
        yield "guided_json", body.guided_json
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        if isinstance(so.json_, str):
            yield "structured_outputs.json", so.json_
        if isinstance(so.structural_tag, str):
            yield "structured_outputs.structural_tag", so.structural_tag
    for i, m in enumerate(getattr(body, "messages", None) or []):
        for j, call in enumerate(getattr(m, "tool_calls", None) or []):
            yield f"messages[{i}].tool_calls[{j}].function.arguments", call.function.arguments
    items = getattr(body, "input", None)
    for i, item in enumerate(items if isinstance(items, list) else []):
        if isinstance(item, dict) and isinstance(item.get("arguments"), str):  # a Responses function_call
            yield f"input[{i}].arguments", item["arguments"]


def check_json_texts(body, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse a validated request (chat, completion, tokenize, Responses) whose JSON texts nest too deep.

    Raises:
        APIError: 400 naming the first such field (``guided_json``, ``messages[1].tool_calls[0].function.arguments``).
    """
    for param, text in _json_texts(body):
        check_json_text(text, param, limit)


AUDIO_UPLOAD_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")


def _is_audio_upload(scope) -> bool:
    """A multipart/form-data body to an audio route (``server.routes_audio``): binary file bytes that
    no JSON parser reads, so they are not scanned (their brackets are no nesting)."""
    if not scope.get("path", "").endswith(AUDIO_UPLOAD_PATHS):
        return False
    ctype = next((v for k, v in scope.get("headers", ()) if k == b"content-type"), b"")
    return ctype.split(b";")[0].strip().lower() == b"multipart/form-data"


class JSONDepthMiddleware:
    """ASGI middleware: a request body nested past ``max_depth`` levels is answered 400, naming the
    field, before any handler reads it.

    Every body is scanned whatever its ``Content-Type`` (FastAPI reads a body without one as JSON,
    and the Messages routes parse theirs themselves), except a multipart upload to an audio route
    (``_is_audio_upload``); an empty one costs nothing. Put it inside the
    body size limit, which bounds what is read here.

    Args:
        app: the wrapped ASGI app.
        max_depth: the deepest nesting accepted (``MAX_JSON_DEPTH``).
    """

    def __init__(self, app, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app, self.max_depth = app, max_depth

    async def __call__(self, scope, receive, send) -> None:
        """Pass the request on with its body, or answer 400 itself."""
        if scope["type"] != "http" or _is_audio_upload(scope):
            await self.app(scope, receive, send)
            return
        messages, chunks = [], []
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":  # the client left: the app sees it as before
                break
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and too_deep(body, self.max_depth):
            await send_error(scope, send, depth_error(deep_field(body, self.max_depth), self.max_depth))
            return
        await self.app(scope, replay(messages, receive), send)

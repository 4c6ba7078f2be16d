"""OpenAI-style error responses.

Body shape follows the OpenAI API: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse


class ErrorJSONResponse(JSONResponse):
    """A JSON response written with ASCII escapes, so that any text (a lone surrogate a client
    sent and an error message repeats) encodes; clients decode the escapes to the same text."""

    def render(self, content: Any) -> bytes:
        """``content`` as compact, ASCII-only JSON bytes."""
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An error to send to the client as an OpenAI error body.

    Args:
        status: HTTP status (400, 401, 404, 503, ...).
        message: human-readable explanation.
        param: the request field at fault, if any.
        type: OpenAI error type (``invalid_request_error``, ...).
        code: short machine-readable code.
        headers: extra response headers (``Retry-After`` of a 503).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """As a FastAPI response."""
        return ErrorJSONResponse(self.body(), status_code=self.status, headers=self.headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}


def _param_path(loc) -> str | None:
    """``("body", "messages", 0, "content", "str")`` -> ``"messages[0].content"``.

    Drops the ``body`` root and the union-member tags pydantic inserts (``str``,
    ``list[ContentPart]``, ``function-after[...]``, model class names), which are
    not request fields; list indices are written OpenAI-style as ``[i]``.
    """
    path = ""
    for i, x in enumerate(loc):
        if i == 0 and x == "body":
            continue
        if isinstance(x, int):
            path += f"[{x}]"
            continue
        x = str(x)
        if x in _TYPE_TAGS or not x.isidentifier() or x[:1].isupper():
            continue
        path += f".{x}" if path else x
    return path or None


def validation_error(exc) -> APIError:
    """Turn a pydantic/FastAPI ``RequestValidationError`` into a 400 naming the bad field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request", code="invalid_request")
    for e in errors:  # found by the schemas' walk over the raw body, which knows the field's path
        if e.get("type") in ("lone_surrogate", "unsupported_field"):
            param = (e.get("ctx") or {}).get("param")
            return APIError(400, f"{param}: {e.get('msg')}", param, code="invalid_value")
    if any(e.get("type") == "json_invalid" for e in errors):
        err = next(e for e in errors if e.get("type") == "json_invalid")
        return APIError(400, f"malformed JSON body: {err.get('msg')}", None, code="invalid_json")
    # a value that fails every member of a union yields one error per member; the
    # deepest one is the most telling (``messages[0].content[0].text`` missing beats
    # ``messages[0].content`` is not a string)
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    kind = str(err.get("type", ""))
    param = _param_path(err.get("loc", ()))
    if param is None:  # the body itself: missing, or not a JSON object
        return APIError(400, "the request body must be a JSON object sent with Content-Type: application/json",
                        None, code="invalid_request")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param, code="missing_required_parameter")
    code = "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"
    return APIError(400, f"{param}: {err.get('msg')}", param, code=code)

"""Error responses, in the shape of the API a path belongs to.

OpenAI's paths answer OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``
(OpenAI API reference, "Error codes"); Anthropic's Messages paths (``/v1/messages`` and below)
answer Anthropic's, ``{"type": "error", "error": {"type", "message"}}``, with the error type of
the HTTP status (Anthropic API reference, "Errors"). ``APIError.response_for`` picks by path, so
every place that answers an error (routes, exception handlers, middlewares) agrees.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

# Anthropic's documented error types by status; any other 4xx is ``invalid_request_error`` (Anthropic
# "may also use this error type for other 4XX status codes"), any other 5xx ``api_error``. A 503 (the
# engine is down or stopping) is the nearest of Anthropic's own, 529 ``overloaded_error``.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATH = "/v1/messages"  # this path and every path below it answer Anthropic's error shape


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

    def anthropic_body(self) -> dict:
        """The JSON body in Anthropic's shape (no ``param`` or ``code``: Anthropic's errors have none)."""
        return anthropic_error_body(self.status, self.message)

    def response(self, anthropic: bool = False) -> JSONResponse:
        """As a FastAPI response, in OpenAI's shape or (``anthropic``) Anthropic's."""
        body = self.anthropic_body() if anthropic else self.body()
        return ErrorJSONResponse(body, status_code=self.status, headers=self.headers)

    def response_for(self, scope) -> JSONResponse:
        """As a response in the shape of the API the request's path belongs to (``uses_anthropic_shape``)."""
        return self.response(anthropic=uses_anthropic_shape(scope))


def anthropic_error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status (``invalid_request_error``, ``not_found_error``, ...)."""
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def uses_anthropic_shape(scope) -> bool:
    """True for a request to ``/v1/messages`` or a path below it (relative to the ASGI ``root_path``,
    as a server mounted under a prefix sees its own paths)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return is_anthropic_path(path)


def is_anthropic_path(path: str) -> bool:
    """True for ``/v1/messages`` and the paths below it (``/v1/messages/count_tokens``)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


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

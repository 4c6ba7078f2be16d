"""The OpenAPI document (``/openapi.json``) as the server answers, not as FastAPI guesses.

FastAPI's document is finished once, on first request, so that:

* the Anthropic routes, which read their own body (to answer errors in Anthropic's shape), list
  their request bodies (``MessagesRequest``, ``CountTokensRequest``);
* no operation lists 422: an invalid request is a 400 with the error body of its API (OpenAI's
  ``{"error": {...}}``, Anthropic's ``{"type": "error", "error": {...}}`` under ``/v1/messages``),
  and every other operation's other errors (401, 404, 413, 429, 500, 503) are its ``default``;
* ``/health`` and ``/ping`` answer 200 or 503 with an empty body, not JSON.

Operation ids are FastAPI's (function, path, method); each route has one method, so they are unique.
Follows the OpenAPI 3.1 specification (responses, ``default``, components).
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagedllm.server.anthropic import CountTokensRequest, MessagesRequest
from pagedllm.server.errors import ANTHROPIC_PATH, is_anthropic_path

PROBE_PATHS = ("/health", "/ping")
_ANTHROPIC_BODIES = {ANTHROPIC_PATH: MessagesRequest, ANTHROPIC_PATH + "/count_tokens": CountTokensRequest}
_REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    """``error`` of OpenAI's error body: ``param`` names the request field at fault."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body (every path but ``/v1/messages``)."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    """``error`` of Anthropic's error body (``invalid_request_error``, ``not_found_error``, ...)."""

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body (``/v1/messages`` and ``/v1/messages/count_tokens``)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def _components() -> dict:
    """JSON schemas of the error bodies and the Anthropic request bodies, by component name."""
    models = [ErrorResponse, AnthropicErrorResponse, *_ANTHROPIC_BODIES.values()]
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    return top["$defs"]


def _json(ref: str, description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=ref)}}}}


def _finish_operation(path: str, op: dict) -> None:
    responses = op.setdefault("responses", {})
    if path in PROBE_PATHS:
        op["responses"] = {"200": {"description": "The engine runs (empty body)."},
                           "503": {"description": "The engine has died (empty body)."}}
        return
    error = "AnthropicErrorResponse" if is_anthropic_path(path) else "ErrorResponse"
    if path in _ANTHROPIC_BODIES:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=_ANTHROPIC_BODIES[path].__name__)}}}}
    if responses.pop("422", None) is not None or path in _ANTHROPIC_BODIES:
        responses["400"] = _json(error, "Invalid request: the message (and OpenAI's `param`) names the field.")
    responses["default"] = _json(error, "Any other error (401, 404, 405, 413, 429, 500, 503).")


def finish_openapi(doc: dict) -> dict:
    """Finish FastAPI's OpenAPI document ``doc`` in place (see the module's docstring); returns it.

    Raises:
        RuntimeError: a component name defined twice with different schemas.
    """
    for path, ops in doc.get("paths", {}).items():
        for op in ops.values():
            _finish_operation(path, op)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in _components().items():
        if name in schemas and schemas[name] != schema:
            raise RuntimeError(f"OpenAPI component {name!r} is defined twice, differently")
        schemas[name] = schema
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 bodies, listed nowhere now
        schemas.pop(unused, None)
    return doc


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` (what ``/openapi.json`` answers) return the finished document, built once."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            try:
                finish_openapi(generate())
            except Exception:
                app.openapi_schema = None  # not half finished: the next request tries again
                raise
        return app.openapi_schema

    app.openapi = openapi

"""The app's exception handlers: every error a route or FastAPI raises, answered in the error shape
of the request path's API (``APIError.response_for``: OpenAI's body, or Anthropic's under
``/v1/messages``).

* ``APIError``: as it says;
* ``RequestValidationError`` (FastAPI's 422): a 400 naming the field (``errors.validation_error``),
  as OpenAI and Anthropic answer an invalid body;
* ``EngineDeadError`` / ``ServerShuttingDownError``: 503;
* Starlette's ``HTTPException`` (unknown path 404, wrong method 405, unreadable body 400): the same
  status; a 405 carries ``Allow`` with every method the path serves (RFC 9110, section 15.5.6).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import iter_route_contexts
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from pagedllm.engine.async_llm import EngineDeadError, ServerShuttingDownError
from pagedllm.server.errors import APIError, validation_error


def allowed_methods(app, scope) -> list[str]:
    """The methods some route of ``app`` serves at the request's path, sorted.

    Starlette's own 405 names only the first route that matches the path, while a path may have
    several (``/health`` has one for GET and one for HEAD).
    """
    methods: set[str] = set()
    # FastAPI (0.163) keeps an included router as one entry of ``app.router.routes``: read the
    # routes it holds through FastAPI's own walk (the one its OpenAPI document is built from)
    for route in iter_route_contexts(app.router.routes):
        if getattr(route, "methods", None) and route.matches(scope)[0] != Match.NONE:
            methods |= route.methods
    return sorted(methods)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response_for(request.scope)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc).response_for(request.scope)


async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
    return APIError(503, str(exc), type="service_unavailable", code="engine_dead").response_for(request.scope)


async def _shutting_down(request: Request, exc: ServerShuttingDownError) -> JSONResponse:
    return APIError(503, str(exc), type="service_unavailable", code="shutting_down").response_for(request.scope)


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(allowed_methods(request.app, request.scope))
    err = APIError(exc.status_code, str(exc.detail), type="invalid_request_error", headers=headers or None)
    return err.response_for(request.scope)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(EngineDeadError, _dead)
    app.add_exception_handler(ServerShuttingDownError, _shutting_down)
    app.add_exception_handler(StarletteHTTPException, _http)

"""The app's middleware stack: request ids, the API key check, CORS and the guards of ``server.guards``.

``install_middleware`` adds them in the one order that works (see its docstring); the request id
and API key middlewares are defined here. Both are pure ASGI rather than ``BaseHTTPMiddleware``,
which would get between the handlers and ``request.is_disconnected()``.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from typing import Sequence

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.datastructures import Headers

from pagedllm.server.errors import APIError
from pagedllm.server.guards import BodySizeLimitMiddleware, CatchAllMiddleware, IdleTrimMiddleware, RejectionCounter
from pagedllm.server.json_depth import JSONDepthMiddleware
from pagedllm.server.webpage import UI_PREFIX

# Paths that stay open with --api-key: each answers from state the server already has, with
# work bounded whatever the request holds (the OpenAPI schema is built once and cached).
# Everything else, /tokenize and /detokenize included (they run the tokenizer and the chat
# template on client input), needs the key; a new route is guarded unless listed here.
OPEN_PATHS = frozenset({"/", "/health", "/ping", "/version", "/metrics", "/stats", "/openapi.json"})


class RequestIdMiddleware:
    """ASGI middleware: every response carries ``x-request-id``, the client's own when it sent
    one (vLLM echoes it the same way), else a fresh uuid4 hex, so a log line and a client's
    report can be matched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        """Pass the request on, adding the header to the response's start."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex
        # echo only what is safe to put back in a header: printable ASCII, bounded
        if len(rid) > 256 or not rid.isascii() or not rid.isprintable():
            rid = uuid.uuid4().hex

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


class APIKeyMiddleware:
    """ASGI middleware: every path but ``OPEN_PATHS`` needs ``Authorization: Bearer <api_key>``.

    Anything else answers 401 with the error body of the path's API (OpenAI's, code
    ``invalid_api_key`` for a wrong key, as OpenAI does; Anthropic's under ``/v1/messages``).
    ``OPEN_PATHS`` and ``OPTIONS`` requests (CORS preflights carry no credentials) pass
    untouched. vLLM guards only ``/v1``; pagedllm guards by default, so that no open route
    can be made to tokenize or render arbitrary input.

    Args:
        app: the wrapped ASGI app.
        api_key: the accepted key, or several (each non-empty). A request let through carries its key's
            sha256 (hex) as ``request.state.api_key_owner``: the owner of the Responses it stores.
    """

    def __init__(self, app, api_key: str | Sequence[str]) -> None:
        self.app = app
        # compare digests in constant time: the key's length and prefix do not leak through timing
        self._digests = [hashlib.sha256(k.encode()).digest() for k in ([api_key] if isinstance(api_key, str)
                                                                         else api_key)]

    @staticmethod
    def _guarded(scope) -> bool:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # a server mounted under a prefix guards its own paths
            path = path[len(root):]
        return path not in OPEN_PATHS and not path.startswith(UI_PREFIX)

    async def __call__(self, scope, receive, send) -> None:
        """Pass the request on, or answer 401 itself."""
        kind = scope["type"]  # a WebSocket (/v1/realtime) needs the key too
        if kind not in ("http", "websocket") or scope.get("method") == "OPTIONS" or not self._guarded(scope):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" and headers.get("x-api-key"):  # Anthropic's SDKs send the key so
            scheme, key = "bearer", headers["x-api-key"]
        if scheme.lower() != "bearer" or not key.strip():
            err = APIError(401, "You didn't provide an API key. You need to provide your API key in an "
                           "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)"
                           " or in an x-api-key header.")
        elif not any([secrets.compare_digest(hashlib.sha256(key.strip().encode()).digest(), d)
                      for d in self._digests]):  # a list: every key is compared, whichever matches
            err = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        else:
            scope.setdefault("state", {})["api_key_owner"] = hashlib.sha256(key.strip().encode()).hexdigest()
            await self.app(scope, receive, send)
            return
        if kind == "websocket":  # closed before accept: the client sees a refused handshake (HTTP 403)
            await send({"type": "websocket.close", "code": 1008, "reason": err.message[:120]})
            return
        resp = err.response_for(scope)
        resp.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750: a 401 names the scheme it wants
        await resp(scope, receive, send)


def install_middleware(app: FastAPI, rejections: RejectionCounter, *, max_request_body_bytes: int,
                       api_key: str | Sequence[str] | None, allowed_origins: Sequence[str],
                       allowed_methods: Sequence[str], allowed_headers: Sequence[str],
                       allow_credentials: bool) -> None:
    """Add the middleware stack to ``app``, innermost first (each ``add_middleware`` wraps the ones before).

    From the outside in: ``RequestIdMiddleware`` (every answer carries the id, 401s and 413s too),
    ``CORSMiddleware`` (401 answers carry CORS headers, so a browser client can read the error,
    and preflights are answered before the key check), ``APIKeyMiddleware`` when ``api_key`` is
    set (an unknown client costs nothing further), ``IdleTrimMiddleware``,
    ``BodySizeLimitMiddleware`` (413 before any handler reads a byte), ``JSONDepthMiddleware``
    (inside the size limit, which bounds what it reads), ``CatchAllMiddleware`` (sees what the
    routes raise).

    Args:
        app: the application.
        rejections: counts the 413s (and the 429s of the admission control) by reason.
        max_request_body_bytes: larger bodies get 413 (``--max-request-body-bytes``).
        api_key: the accepted key or keys; ``None`` or empty: no key check.
        allowed_origins, allowed_methods, allowed_headers, allow_credentials: the CORS policy
            (``CORSMiddleware`` options, vLLM's ``--allowed-*`` flags).
    """
    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(JSONDepthMiddleware)  # inside the size limit, which bounds what it reads
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes, rejections=rejections)
    app.add_middleware(IdleTrimMiddleware)  # idle again after a burst: give the freed heap back
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    # added last, so outermost: 401 answers carry CORS headers too (a browser client
    # can then read the error), and preflights are answered before the key check
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                       allow_headers=list(allowed_headers), allow_credentials=allow_credentials)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer carries the id, 401s and 413s too

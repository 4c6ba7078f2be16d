"""What keeps the server up under hostile input and overload.

* ``BodySizeLimitMiddleware``: a request body over ``--max-request-body-bytes`` is answered 413
  before it is read (by its ``Content-Length``) or as soon as the bytes read pass the limit;
* ``CatchAllMiddleware``: an unexpected exception becomes one log line and a 500 with an error
  body (OpenAI's shape, Anthropic's under ``/v1/messages``), and the keep-alive connection stays
  usable (Starlette's own last-resort handler re-raises, so uvicorn logs the whole traceback and
  closes the connection);
* ``server.json_depth``: JSON nested past ``MAX_JSON_DEPTH`` levels is a 400 before any parser sees it;
* ``find_lone_surrogate``: JSON may carry ``"\\ud800"``, which no tokenizer or UTF-8 encoder takes;
  the request schemas refuse such strings with a 400 naming the field;
* ``AdmissionControl``: a bound on the engine requests in flight (running plus waiting), past
  which a request is refused with 429 and ``Retry-After`` (OpenAI's API answers "The engine is
  currently overloaded" with 429, and its SDK retries that after ``Retry-After``; a 429 also
  tells a load balancer the server is alive, not failing), and a bound on the choices one
  request may fan out to.

All rejections are counted by reason for ``pagedllm:num_requests_rejected_total``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections import Counter
from typing import Any

from pagedllm.memory import return_freed_memory
from pagedllm.server.errors import APIError

logger = logging.getLogger(__name__)

MAX_CHOICES_PER_REQUEST = 128       # prompts x n; each choice is an engine request
# lists whose length costs work on the event loop (validation) or in every step (stop checks);
# generous next to OpenAI's own limits (4 stop strings, 128 tools)
MAX_MESSAGES = 4096
MAX_STOP_STRINGS = 64
MAX_TOOLS = 512
MAX_TOKEN_ID_ENTRIES = 4096          # stop_token_ids, logit_bias
RETRY_AFTER_S = 1


class RejectionCounter:
    """Thread-safe counts of refused requests by reason (``body_too_large``, ``queue_full``, ...)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def inc(self, reason: str, n: int = 1) -> None:
        """Count ``n`` rejections for ``reason``."""
        with self._lock:
            self._counts[reason] += n

    def snapshot(self) -> dict[str, int]:
        """A copy of the counts."""
        with self._lock:
            return dict(self._counts)


async def send_error(scope, send, err: APIError) -> None:
    """Answer ``err`` from an ASGI middleware, in the error shape of the request's path
    (``APIError.response_for``: Anthropic's under ``/v1/messages``, OpenAI's elsewhere)."""
    resp = err.response_for(scope)
    await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


class BodySizeLimitMiddleware:
    """ASGI middleware: answer 413 (code ``request_too_large``) to bodies over ``max_bytes``.

    A ``Content-Length`` over the limit is refused before any byte of the body is read;
    a body without one (chunked) is read up to the limit and refused when it goes past.
    The accepted body is handed to the app unchanged, so the wrapped app never sees
    more than ``max_bytes`` bytes; an audio upload (``defaults.AUDIO_UPLOAD_PATHS``) may take up to
    ``defaults.AUDIO_UPLOAD_BYTES`` (OpenAI's 25 MB) when that is more.

    Args:
        app: the wrapped ASGI app.
        max_bytes: the largest body accepted, in bytes (> 0).
        rejections: counts each refusal as ``body_too_large``.
    """

    def __init__(self, app, max_bytes: int, rejections: RejectionCounter) -> None:
        self.app, self.max_bytes, self.rejections = app, max_bytes, rejections

    def _too_large(self, limit: int) -> APIError:
        self.rejections.inc("body_too_large")
        why = "--max-request-body-bytes" if limit == self.max_bytes else "audio uploads: OpenAI's 25 MB"
        return APIError(413, f"request body too large: the limit is {limit} bytes ({why})", code="request_too_large")

    def _limit(self, scope) -> int:
        from pagedllm.server.defaults import AUDIO_UPLOAD_BYTES, AUDIO_UPLOAD_PATHS
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        return max(self.max_bytes, AUDIO_UPLOAD_BYTES) if path in AUDIO_UPLOAD_PATHS else self.max_bytes

    async def __call__(self, scope, receive, send) -> None:
        """Pass the request on with its body, or answer 413 itself."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        try:
            declared = int(length) if length is not None else None
        except ValueError:
            declared = None
        limit = self._limit(scope)
        if declared is not None and declared > limit:
            await send_error(scope, send, self._too_large(limit))
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left before sending the body
                await self.app(scope, replay([msg], receive), send)
                return
            size += len(msg.get("body", b""))
            if size > limit:
                await send_error(scope, send, self._too_large(limit))
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, replay([body], receive), send)


def replay(messages: list[dict], receive):
    """A ``receive`` that returns ``messages`` first, then defers to the real one (disconnects)."""
    pending = list(messages)

    async def replayed():
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


class CatchAllMiddleware:
    """ASGI middleware: the last stop for exceptions no handler took.

    Logs one line (path and the exception's repr, no traceback) and, when no response
    has started, answers 500 with an error body in the path's API shape. The exception is not
    re-raised, so the server keeps the connection open and does not log a traceback.
    A response already under way (a stream) just ends.

    Args:
        app: the wrapped ASGI app.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        """Run the app; turn an escaped exception into a 500."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(msg) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.error("unhandled error on %s %s: %r", scope.get("method"), scope.get("path"), exc)
            if not started:
                await send_error(scope, send, APIError(500, f"internal error: {type(exc).__name__}",
                                                 type="internal_error", code="internal_error"))


_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(text: str) -> bool:
    """True when ``text`` holds a UTF-16 surrogate code point (U+D800 to U+DFFF), which UTF-8 cannot encode."""
    return _SURROGATE.search(text) is not None


_ESCAPED_SURROGATE = re.compile(r"\\ud[89a-f]")


def may_hold_surrogates(obj: Any) -> bool:
    """A fast, exact-enough pre-check: False when no string in ``obj`` holds any surrogate.

    ``json.dumps`` (C speed) writes every surrogate, lone or paired from a character past
    U+FFFF, as an escape ``\\udXXX``; only bodies with one need the slow walk.
    """
    try:
        return _ESCAPED_SURROGATE.search(json.dumps(obj)) is not None
    except (TypeError, ValueError):  # not plain JSON data: walk it
        return True


def find_lone_surrogate(obj: Any, path: str = "") -> str | None:
    """The field path (``messages[0].content``) of the first string in ``obj`` holding a lone surrogate.

    Walks dicts (keys too), lists and strings as parsed from JSON; ``None`` when there is none.
    """
    if isinstance(obj, str):
        return (path or "body") if has_lone_surrogate(obj) else None
    if isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and has_lone_surrogate(k):
                return path or "body"
            found = find_lone_surrogate(v, sub)
            if found is not None:
                return found
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found = find_lone_surrogate(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


class AdmissionControl:
    """Bounds the engine requests in flight, so overload is answered instead of queued without end.

    A request fanning out to ``k`` engine requests (prompts x ``n``) is admitted only
    while ``in_flight + k <= max_in_flight``, where ``max_in_flight`` is the engine's
    ``max_num_seqs`` (running) plus ``--max-waiting-requests`` (waiting). Counting in the
    front end, at admission and release, is exact and needs no engine round trip.

    Args:
        max_in_flight: the bound (``None``: unbounded).
        rejections: counts refusals as ``queue_full``.
    """

    def __init__(self, max_in_flight: int | None, rejections: RejectionCounter) -> None:
        self.max_in_flight = max_in_flight
        self.rejections = rejections
        self.in_flight = 0

    def admit(self, k: int) -> "_Admission":
        """Reserve ``k`` slots; use as a context manager that releases them.

        Raises:
            APIError: 429 with ``Retry-After`` when the slots are not free; 400 when ``k`` is more
                than the bound itself (no retry could succeed).
        """
        if self.max_in_flight is not None and k > self.max_in_flight:  # could never be admitted: not a retry
            raise APIError(400, f"n: this request asks for {k} choices (prompts x n), more than the {self.max_in_flight} "
                           f"requests this server holds in flight (--max-num-seqs plus --max-waiting-requests)",
                           "n", code="too_many_choices")
        if self.max_in_flight is not None and self.in_flight + k > self.max_in_flight:
            self.rejections.inc("queue_full")
            raise APIError(429, f"The server is overloaded: {self.in_flight} requests are in flight and "
                           f"the limit is {self.max_in_flight} (--max-num-seqs plus --max-waiting-requests). "
                           f"Retry after {RETRY_AFTER_S} s.", type="server_overloaded", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += k
        return _Admission(self, k)


class _Admission:
    """Slots held by one request; released once, on exit or by ``release()``."""

    def __init__(self, control: AdmissionControl, k: int) -> None:
        self._control, self._k = control, k

    def release(self) -> None:
        """Give the slots back (idempotent)."""
        self._control.in_flight -= self._k
        self._k = 0

    def __enter__(self) -> "_Admission":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_choices(num_prompts: int, n: int) -> None:
    """Refuse a request whose prompts x ``n`` passes ``MAX_CHOICES_PER_REQUEST``.

    Raises:
        APIError: 400 naming ``n`` (or ``prompt`` when ``n`` is 1).
    """
    if num_prompts * n > MAX_CHOICES_PER_REQUEST:
        raise APIError(400, f"{'n' if n > 1 else 'prompt'}: a request may ask for at most "
                       f"{MAX_CHOICES_PER_REQUEST} choices (prompts x n), got {num_prompts} x {n} = "
                       f"{num_prompts * n}", "n" if n > 1 else "prompt", code="too_many_choices")


class IdleTrimMiddleware:
    """ASGI middleware: when the last HTTP request in flight ends and none starts for
    ``delay_s``, give the heap's free pages back to the system (``memory.return_freed_memory``, on
    a worker thread), at most once per ``min_interval_s``.

    Why: parsing a few megabytes of hostile JSON, or a burst of hundreds of requests, leaves glibc
    holding the freed pages, and the front end's resident memory stayed at that high-water mark
    when idle (issue 35). The engine core trims itself the same way when it goes idle.

    Args:
        app: the wrapped ASGI app.
        delay_s: idle seconds before trimming.
        min_interval_s: least seconds between two trims.
        trim: the trim function (tests pass a counter).
    """

    def __init__(self, app, delay_s: float = 1.0, min_interval_s: float = 5.0, trim=None) -> None:
        self.app, self.delay_s, self.min_interval_s = app, delay_s, min_interval_s
        self._trim = trim or return_freed_memory
        self.in_flight = 0
        self._last = float("-inf")
        self._timer = None

    async def __call__(self, scope, receive, send) -> None:
        """Count the request while the app answers it; schedule a trim when none is left."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._schedule()

    def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(self.delay_s, self._maybe_trim, loop)

    def _maybe_trim(self, loop) -> None:
        self._timer = None
        if self.in_flight or loop.time() - self._last < self.min_interval_s:
            return
        self._last = loop.time()
        loop.run_in_executor(None, self._trim)

"""How a route answers what a serving handler returns: one place for the "plain / dict / stream" choice.

A handler (``OpenAIServingChat.chat``, ``OpenAIServingCompletion.completion``, the pooling and
score handlers) returns a ``Response`` it built itself (an error, say), a dict (the JSON body) or
an async iterator of server-sent-event lines. ``reply`` awaits it, cancelling it when the client
goes away first, and answers each kind the same way for every API; the Anthropic and Responses
routes pass their own translation of the body or of the events.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5
# proxies (nginx) must pass each event on at once, and nobody may cache a stream
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its generator, so that the engine
    request is aborted at once when the client goes away mid-stream (rather than
    whenever the abandoned generator is garbage-collected)."""

    async def __call__(self, scope, receive, send) -> None:
        """Send the stream as ``StreamingResponse`` does, then close its iterator whatever happened."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def unless_disconnected(request: Request, coro: Awaitable[Any]) -> Any:
    """Await ``coro``; cancel it (aborting its engine requests) if the client disconnects first.

    Args:
        request: the request whose client is watched (polled every ``_DISCONNECT_POLL_S`` seconds).
        coro: the handler's coroutine.

    Returns:
        What ``coro`` returns, or a 499 ``Response`` (which nobody reads) once the client is gone.

    Raises:
        Whatever ``coro`` raises (``APIError`` and the like, answered by the app's handlers).
    """
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                logger.info("client disconnected; aborting %s", request.url.path)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)  # nobody reads it
    finally:
        if not task.done():
            task.cancel()


def _same(x: Any) -> Any:
    return x


async def reply(request: Request, coro: Awaitable[Any], body_of: Callable[[dict], dict] = _same,
                events_of: Callable[[AsyncIterator[str]], AsyncIterator[str]] = _same) -> Response:
    """Answer a serving handler's result: a ``Response`` as it is, a dict as a JSON body, a stream
    of SSE lines as ``text/event-stream`` (``SSEResponse``, uncached and unbuffered by proxies).

    Args:
        request: the route's request (its client's disconnect cancels ``coro``, see
            ``unless_disconnected``).
        coro: the handler's coroutine.
        body_of: turns the handler's dict into the API's body (the Anthropic and Responses
            routes translate the chat completion; by default the dict itself).
        events_of: turns the handler's SSE lines into the API's events (by default the lines).

    Raises:
        Whatever ``coro`` or ``body_of`` raises (``APIError`` and the like).
    """
    result = await unless_disconnected(request, coro)
    if isinstance(result, Response):
        return result
    if isinstance(result, dict):
        return JSONResponse(body_of(result))
    return SSEResponse(events_of(result), media_type="text/event-stream", headers=dict(_SSE_HEADERS))

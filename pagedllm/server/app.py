"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` answers with server-sent events
ending in ``data: [DONE]``), following the OpenAI API reference; and, for
debugging and tests, ``GET /stats`` with the engine counters of
``LLMEngine.get_stats`` as JSON (not part of the OpenAI API).

A request whose client disconnects is aborted, streamed or not, so its KV
blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.server.errors import APIError, validation_error
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest, now
from pagedllm.server.serving import OpenAIServing

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its generator, so that the engine
    request is aborted at once when the client goes away mid-stream (rather than
    whenever the abandoned generator is garbage-collected)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _unless_disconnected(request: Request, coro):
    """Await ``coro``; cancel it (aborting its engine requests) if the client disconnects first."""
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


def build_app(llm: AsyncLLM, model_name: str, chat_template: str | None = None) -> FastAPI:
    """Create the FastAPI application around a running ``AsyncLLM``.

    Args:
        llm: the engine front door.
        model_name: the name clients must use in ``model`` (or omit).
        chat_template: optional Jinja chat template overriding the tokenizer's.
    """
    app = FastAPI(title="pagedllm", version=__import__("pagedllm").__version__)
    serving = OpenAIServing(llm, model_name, chat_template)
    app.state.llm = llm

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return APIError(503, str(exc), type="service_unavailable", code="engine_dead").response()

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {exc!r}", type="internal_error").response()

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine loop runs, 503 once it has died."""
        return Response(status_code=200 if llm.is_healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        """The served model, in the OpenAI ``/v1/models`` list shape (``max_model_len`` in tokens)."""
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "pagedllm", "root": str(llm.engine.model_dir),
                                            "max_model_len": llm.engine.max_model_len}]}

    @app.get("/stats")
    async def stats() -> dict:
        """Debugging aid: the engine counters as of the last step (see ``LLMEngine.get_stats``)."""
        return llm.get_stats()

    async def respond(request: Request, coro):
        result = await _unless_disconnected(request, coro)
        if isinstance(result, Response):
            return result
        if isinstance(result, dict):
            return JSONResponse(result)
        return _SSEResponse(result, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        """OpenAI Chat Completions; SSE when ``stream`` is true. 400/404/503 as OpenAI error bodies."""
        return await respond(request, serving.chat(body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI (legacy) Completions; SSE when ``stream`` is true. 400/404/503 as OpenAI error bodies."""
        return await respond(request, serving.completion(body))

    return app

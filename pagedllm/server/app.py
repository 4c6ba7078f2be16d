"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` answers with server-sent events
ending in ``data: [DONE]``), following the OpenAI API reference.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.server.errors import APIError, validation_error
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest, now
from pagedllm.server.serving import OpenAIServing

logger = logging.getLogger(__name__)


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

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {exc!r}", type="internal_error").response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "pagedllm", "root": str(llm.engine.model_dir),
                                            "max_model_len": llm.engine.max_model_len}]}

    async def respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        return await respond(await serving.chat(body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await respond(await serving.completion(body))

    return app

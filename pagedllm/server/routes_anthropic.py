"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Both run over the chat completions handler (``server/anthropic.py`` translates the request and
the answer, streamed or not). They read their own JSON body rather than have FastAPI validate it,
so that every error they answer, an invalid body included, is in Anthropic's shape
(``{"type": "error", "error": {...}}``, see ``APIError.response_for``), never FastAPI's 422;
``server/openapi.py`` lists their request bodies in the OpenAPI document.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pagedllm.server import anthropic
from pagedllm.server.base import ServingContext
from pagedllm.server.chat import OpenAIServingChat
from pagedllm.server.errors import APIError
from pagedllm.server.replies import reply


async def read_json_body(request: Request) -> Any:
    """The request's body parsed as JSON (any value: ``anthropic.parse`` checks it is an object).

    Raises:
        APIError: 400 when the body is not JSON (answered in the path's API shape).
    """
    try:
        return await request.json()
    except ValueError:
        raise APIError(400, "the request body must be a JSON object") from None


def anthropic_router(ctx: ServingContext, chat_serving: OpenAIServingChat) -> APIRouter:
    """The Messages routes.

    Args:
        ctx: what every handler shares (the served model's name, the tokenizer pool).
        chat_serving: the chat completions handler the messages run on.
    """
    router = APIRouter()
    model_name = ctx.model_name
    text_only = getattr(ctx.llm, "image_placeholder", None) is None

    @router.post("/v1/messages")
    async def messages(request: Request):
        """Anthropic's Messages API over the chat handler (``server/anthropic.py``); SSE with ``stream``."""
        body = anthropic.to_chat(anthropic.parse(await read_json_body(request)), text_only,
                                 getattr(ctx.llm, "media_policy", None))
        return await reply(request, chat_serving.chat(body), lambda result: anthropic.message_of(result, model_name),
                           lambda chunks: anthropic.stream_of(chunks, model_name))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """``{"input_tokens": n}``: the prompt a Messages request would have, rendered as chat renders it."""
        body = anthropic.to_chat(anthropic.parse(await read_json_body(request), anthropic.CountTokensRequest),
                                 text_only, getattr(ctx.llm, "media_policy", None))
        ctx.check_model(body.model)
        ids = await ctx.offload(lambda: chat_serving.prompt_ids(body))
        return JSONResponse({"input_tokens": len(ids)})

    return router

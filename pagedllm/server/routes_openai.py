"""OpenAI's model and text generation routes: ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/chat/completions`` and ``POST /v1/completions``.

Follows the OpenAI API reference: a ``stream: true`` request is answered with server-sent events
ending in ``data: [DONE]``; errors are OpenAI's error body (400 naming the field, 404 for a model
not served, 429 when overloaded, 503 once the engine is gone). A request whose client disconnects
is aborted, streamed or not (``server.replies``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagedllm.server.base import ServingContext
from pagedllm.server.chat import OpenAIServingChat
from pagedllm.server.completions import OpenAIServingCompletion
from pagedllm.server.errors import APIError
from pagedllm.server.json_depth import check_json_texts
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.server.replies import reply


def openai_router(ctx: ServingContext, chat_serving: OpenAIServingChat) -> APIRouter:
    """The models, chat completions and completions routes.

    Args:
        ctx: what every handler shares (the engine, the served model's name, admission control).
        chat_serving: the chat completions handler.
    """
    router = APIRouter()
    completion_serving = OpenAIServingCompletion(ctx)

    @router.get("/v1/models")
    async def models() -> dict:
        """The served model, in the OpenAI ``/v1/models`` list shape (``max_model_len`` in tokens)."""
        return ctx.model_list()

    @router.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict:
        """One model's card (the openai SDK's ``models.retrieve``); 404 for a model not served."""
        cards = ctx.model_list()["data"] if ctx.serves(model_id) else []
        lora = ctx.adapters.get(model_id)  # an adapter's own card; else the base model's (any alias of it)
        card = next((m for m in cards if lora is not None and m["id"] == lora.lora_name), cards[0] if cards else None)
        if card is None:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model", code="model_not_found")
        return card

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        """OpenAI Chat Completions; SSE when ``stream`` is true. 400/404/503 as OpenAI error bodies."""
        check_json_texts(body)
        return await reply(request, chat_serving.chat(body))

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI (legacy) Completions; SSE when ``stream`` is true. 400/404/503 as OpenAI error bodies."""
        check_json_texts(body)
        return await reply(request, completion_serving.completion(body))

    return router

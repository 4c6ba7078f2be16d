"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{response_id}``.

A request runs over the chat completions handler (``server/responses.py`` translates the request
and the answer, streamed or not). Stored responses live in one ``ResponseStore`` per app and
belong to the API key that made them (``request.state.api_key_owner``, set by
``server.middleware.APIKeyMiddleware``): another key neither continues, reads nor deletes them
(404, as for a response that does not exist). Errors are OpenAI's error body.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagedllm.server import responses
from pagedllm.server.base import ServingContext
from pagedllm.server.chat import OpenAIServingChat
from pagedllm.server.errors import APIError
from pagedllm.server.json_depth import check_json_texts
from pagedllm.server.replies import reply
from pagedllm.server.response_store import Owner, ResponseStore


def request_owner(request: Request) -> Owner:
    """The owner of the Responses a request stores and may see: its API key's digest, or ``None``
    without ``--api-key`` (one shared store)."""
    return getattr(request.state, "api_key_owner", None)


def stored_history(store: ResponseStore, body: responses.ResponsesRequest, owner: Owner) -> list[dict]:
    """The stored conversation ``body.previous_response_id`` continues (``[]`` without one).

    Raises:
        APIError: 404 (``param`` ``previous_response_id``) when the owner has no such response.
    """
    if body.previous_response_id is None:
        return []
    found = store.get(body.previous_response_id, owner)
    if found is None:
        raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                       "previous_response_id", code="not_found")
    return found[1]


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response with id '{response_id}' found.", "response_id", code="not_found")


def responses_router(ctx: ServingContext, chat_serving: OpenAIServingChat) -> APIRouter:
    """The Responses routes.

    Args:
        ctx: what every handler shares (the served model's name).
        chat_serving: the chat completions handler the responses run on.
    """
    router = APIRouter()
    response_store = ResponseStore()  # this app's own
    model_name = ctx.model_name

    @router.post("/v1/responses")
    async def create_response(body: responses.ResponsesRequest, request: Request):
        """OpenAI's Responses API over the chat handler (``server/responses.py``); SSE with ``stream``."""
        check_json_texts(body)
        owner = request_owner(request)
        chat_body, conversation = responses.to_chat(body, stored_history(response_store, body, owner))
        return await reply(
            request, chat_serving.chat(chat_body),
            lambda result: responses.respond(body, result, conversation, model_name, response_store, owner),
            lambda chunks: responses.stream(body, chunks, conversation, model_name, response_store, owner))

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict:
        """A stored response (``store`` was true) of the caller's key; 404 otherwise."""
        found = response_store.get(response_id, request_owner(request))
        if found is None:
            raise _not_found(response_id)
        return found[0]

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        """Drop a stored response of the caller's key; 404 when there is none."""
        if not response_store.delete(response_id, request_owner(request)):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router

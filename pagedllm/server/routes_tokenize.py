"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (``server/tokenize.py`` does the work).

Both need the API key when the server has one: they run the tokenizer and the chat template on
client input.
"""

from __future__ import annotations

from fastapi import APIRouter

from pagedllm.server.base import ServingContext
from pagedllm.server.chat import OpenAIServingChat
from pagedllm.server.json_depth import check_json_texts
from pagedllm.server.protocol_extra import DetokenizeRequest, TokenizeRequest
from pagedllm.server.tokenize import OpenAIServingTokenization


def tokenize_router(ctx: ServingContext, chat_serving: OpenAIServingChat) -> APIRouter:
    """The tokenizer routes.

    Args:
        ctx: what every handler shares (the tokenizer, the context limit).
        chat_serving: renders a conversation as ``/v1/chat/completions`` would.
    """
    router = APIRouter()
    tokenization = OpenAIServingTokenization(ctx, chat_serving)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """Token ids of a prompt, or of a conversation rendered as ``/v1/chat/completions`` renders it
        (vLLM's shape; see ``OpenAIServingTokenization.tokenize``)."""
        check_json_texts(body)
        return await tokenization.tokenize(body)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        """``{"prompt": text}`` of token ids, special tokens included (vLLM's shape)."""
        return await tokenization.detokenize(body)

    return router

"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extra endpoints, with vLLM's shapes)."""

from __future__ import annotations

from pagedllm.server.base import ServingContext
from pagedllm.server.chat import OpenAIServingChat
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import ChatCompletionRequest
from pagedllm.server.protocol_extra import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                            TokenizeResponse)


def special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """The ids ``encode(..., add_special_tokens=True)`` puts before and after a text's own ids.

    Found by encoding a probe both ways, because the rendered chat comes back as
    ids and this tokenizer backend has no ``build_inputs_with_special_tokens``.
    """
    bare = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    return [], []  # a post-processor that rewrites the text ids: add nothing rather than guess


class OpenAIServingTokenization:
    """Tokenizes prompts and conversations (rendered as chat completions renders them) and
    decodes token ids, all on the tokenizer thread.

    Args:
        ctx: the shared ``ServingContext``.
        chat: the chat handler, whose template rendering ``/tokenize`` reuses.
    """

    def __init__(self, ctx: ServingContext, chat: OpenAIServingChat) -> None:
        self.ctx, self.chat = ctx, chat
        self.special_prefix, self.special_suffix = special_affixes(ctx.tokenizer)

    async def tokenize(self, body) -> dict:
        """``{"count", "max_model_len", "tokens", "token_strs"}`` of a ``TokenizeRequest``.

        ``count`` and ``max_model_len`` in tokens, ``token_strs`` null unless
        ``return_token_strs``. A text too long to fit the context whatever its tokens is
        refused before tokenizing.

        Raises:
            APIError: 400 for a bad body or a template error, 404 for an unknown model.
            EngineDeadError: the engine has died (answered 503).
        """
        ctx = self.ctx
        ctx.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            chat_body = ChatCompletionRequest(messages=body.messages,
                                              add_generation_prompt=body.add_generation_prompt,
                                              chat_template_kwargs=body.chat_template_kwargs, tools=body.tools)
            ids = await ctx.offload(self.chat.render_chat, chat_body)
            if body.add_special_tokens:
                ids = self.special_prefix + ids + self.special_suffix
        else:
            ids = await ctx.offload(ctx.encode, body.prompt, "prompt", body.add_special_tokens)
        strs = await ctx.offload(ctx.tokenizer.convert_ids_to_tokens, ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids,
                                token_strs=strs).model_dump()

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """``{"prompt": text}`` of token ids, special tokens included.

        Raises:
            APIError: 400 with param ``tokens`` for an id outside the vocabulary, 404 for an
                unknown model.
            EngineDeadError: the engine has died (answered 503).
        """
        ctx = self.ctx
        ctx.check_model(body.model)
        vocab = len(ctx.tokenizer)
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"tokens[{i}]: token id {t} is out of vocabulary (valid ids are 0 to "
                               f"{vocab - 1})", "tokens", code="invalid_value")
        return DetokenizeResponse(prompt=await ctx.offload(ctx.tokenizer.decode, body.tokens)).model_dump()

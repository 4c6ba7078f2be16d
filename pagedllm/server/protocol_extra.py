"""Pydantic schemas of the non-OpenAI endpoints ``POST /tokenize`` and ``POST /detokenize``.

Field names, defaults and response shapes follow vLLM's OpenAI-compatible server,
so that clients written for vLLM work unchanged. Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, Discriminator, Field, Tag

from pagedllm.server.guards import MAX_MESSAGES, MAX_TOOLS
from pagedllm.server.protocol import Bool, ChatMessage, Int, RequestBody, ToolDefinition


class TokenizeCompletionRequest(RequestBody):
    """``POST /tokenize`` body for a plain text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: Bool = Field(default=True, description=(
        "add the tokenizer's special tokens (e.g. BOS), as a completion request does"))
    return_token_strs: Bool = Field(default=False, description="also return each token as a string")


class TokenizeChatRequest(RequestBody):
    """``POST /tokenize`` body for a conversation, rendered with the chat template first."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    add_special_tokens: Bool = Field(default=False, description=(
        "add the tokenizer's special tokens on top of the template's (off, as a chat request does)"))
    return_token_strs: Bool = Field(default=False, description="also return each token as a string")


def _tokenize_kind(v: Any) -> str:
    # choose the schema by the presence of ``messages`` so that a bad body gets the
    # errors of the one schema it meant, not of both (the tags are class names,
    # which the 400 formatter leaves out of the field path)
    if isinstance(v, dict):
        return "TokenizeChatRequest" if "messages" in v else "TokenizeCompletionRequest"
    return "TokenizeChatRequest" if isinstance(v, TokenizeChatRequest) else "TokenizeCompletionRequest"


TokenizeRequest = Annotated[
    Union[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")],
          Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")]],
    Discriminator(_tokenize_kind),
]
"""``POST /tokenize`` body: a chat request when it has ``messages``, else a prompt request."""


class TokenizeResponse(BaseModel):
    """``POST /tokenize`` answer; ``count`` and ``max_model_len`` are in tokens."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    """``POST /detokenize`` body."""

    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(BaseModel):
    """``POST /detokenize`` answer: the decoded text (special tokens kept)."""

    prompt: str

"""Anthropic Messages request bodies (``POST /v1/messages`` and ``/v1/messages/count_tokens``).

Follows Anthropic's Messages API reference and the ``anthropic`` SDK's request types (2.10):
every field of the request is declared, as served, refused or harmless, and any other field is a
400 ("Extra inputs are not permitted", as Anthropic answers one), so none is ignored silently:

* served: ``model``, ``messages`` (``text``, ``tool_use``, ``tool_result`` blocks), ``system``,
  ``max_tokens``, ``stop_sequences``, ``stream``, ``temperature``, ``top_p``, ``top_k``, custom
  ``tools``, ``tool_choice``, ``thinking`` ``disabled``, ``output_config`` (``format``, ``effort``
  up to ``high``) and the beta's ``output_format``;
* harmless (change no answer): ``cache_control`` anywhere (prefix caching is automatic here),
  ``metadata.user_id``, ``service_tier``, ``speed``, ``inference_geo``, ``user_profile_id``,
  ``workspace_id``, a tool's ``eager_input_streaming``;
* refused with a 400 naming them: ``container``, ``mcp_servers``, ``context_management``,
  ``diagnostics``, ``citations``, a tool's ``defer_loading`` / ``input_examples`` / non-direct
  ``allowed_callers`` / server tool ``type``, ``toolset_name``, content blocks other than the
  three above; the checks that need the whole request are ``anthropic.to_chat``'s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from pagedllm.server.guards import MAX_MESSAGES, MAX_STOP_STRINGS, MAX_TOOLS
from pagedllm.server.protocol import Bool, Float, Int, RequestBody


def _unset(value: Any) -> Any:
    # "refused" errors keep pydantic's location, so the 400 names the field wherever it sits
    if value not in (None, False, [], {}, ""):
        raise PydanticCustomError("refused", "not supported by pagedllm (it would change the answer, so it is "
                                  "refused rather than ignored)")
    return value


Refused = Annotated[Any, AfterValidator(_unset)]  # accepted only unset or empty


class _Body(BaseModel):
    # Anthropic answers an unknown field with a 400 ("Extra inputs are not permitted"); so does this
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class CacheControl(_Body):
    """``cache_control``: a prompt-cache breakpoint. Prefix caching is automatic here: changes nothing."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Body):
    """A ``text`` block; ``citations`` (of documents, which are refused) only unset."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Refused = None


class DirectCaller(_Body):
    """A ``tool_use`` block's ``caller``: the model itself (code execution callers are refused)."""

    type: Literal["direct"]


class ToolUseBlock(_Body):
    """An assistant's ``tool_use`` block (a call made in an earlier turn)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: DirectCaller | None = None
    toolset_name: Refused = None


class ToolResultBlock(_Body):
    """A user's ``tool_result`` block; ``is_error`` is marked in the prompt (``anthropic.to_chat``)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: Bool = False
    cache_control: CacheControl | None = None
    toolset_name: Refused = None


class Base64Source(_Body):
    """An image block's ``base64`` source."""

    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(_Body):
    """An image block's ``url`` source (not fetched by this server: a 400 naming it)."""

    type: Literal["url"]
    url: str


class ImageBlock(_Body):
    """A user's ``image`` block, for an image-text model (``anthropic.to_chat``: a chat image part)."""

    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def data_url(self) -> str:
        """The image as a ``data:`` URL (a URL source as it is)."""
        src = self.source
        return src.url if isinstance(src, UrlSource) else f"data:{src.media_type};base64,{src.data}"


class OtherBlock(BaseModel):
    """Any other content block (``document``, ``thinking``, server tool results, ...): refused."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        raise PydanticCustomError("refused", "'{kind}' content blocks are not supported by pagedllm (text, "
                                  "tool_use and tool_result are)", {"kind": str(data.get("type"))})


_BLOCKS = {"text": "TextBlock", "tool_use": "ToolUseBlock", "tool_result": "ToolResultBlock", "image": "ImageBlock"}


def _block_kind(value: Any) -> str | None:
    # capitalized tags: the error path (``errors._param_path``) leaves them out, as class names
    if isinstance(value, dict):
        return _BLOCKS.get(value.get("type"), "OtherBlock")
    return _BLOCKS.get(getattr(value, "type", None))


# picked by ``type``, so the errors of a block are its own, and another type is one 400 naming it
Block = Annotated[Annotated[TextBlock, Tag("TextBlock")] | Annotated[ToolUseBlock, Tag("ToolUseBlock")]
                  | Annotated[ToolResultBlock, Tag("ToolResultBlock")] | Annotated[ImageBlock, Tag("ImageBlock")]
                  | Annotated[OtherBlock, Tag("OtherBlock")],
                  Discriminator(_block_kind)]


class AnthropicMessage(_Body):
    """One turn of ``messages``."""

    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Body):
    """A custom tool. ``strict`` is served where calls are constrained (``anthropic.to_chat``)."""

    type: Literal["custom"] | None = None  # server tools (web search, code execution, ...) are refused
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: Bool = False
    eager_input_streaming: Bool | None = None  # input streams as it is made here either way
    allowed_callers: list[Literal["direct"]] | None = None
    defer_loading: Refused = None  # a tool left out of the prompt until a tool search finds it
    input_examples: Refused = None  # examples Anthropic shows the model


class AnthropicToolChoice(_Body):
    """``tool_choice``: ``auto``, ``any``, ``tool`` (with ``name``) or ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: Bool = False


class Metadata(_Body):
    """``metadata``: ``user_id`` says who asked; changes nothing."""

    user_id: str | None = None


class Thinking(_Body):
    """``thinking``: only ``disabled`` is served (``anthropic.parse`` refuses the others)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Body):
    """``output_config.format`` (or the beta's ``output_format``): the text follows ``schema``."""

    model_config = ConfigDict(populate_by_name=True)
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """``output_config``: the answer's ``format``; ``effort`` becomes chat's ``reasoning_effort``."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(RequestBody):
    """``POST /v1/messages`` body (Anthropic's names)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    max_tokens: Int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: Float | None = Field(default=None, ge=0, le=1)
    top_p: Float | None = None
    top_k: Int | None = Field(default=None, ge=0, le=2**31 - 1)  # Anthropic's minimum 0 (0: no cut-off here)
    stream: Bool = False
    tools: list[AnthropicTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's place for output_config.format
    # harmless: who asked, which capacity or region serves it, cache breakpoints
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    cache_control: CacheControl | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # refused: Anthropic's hosted code containers, MCP connectors, context editing, cache diagnostics
    container: Refused = None
    mcp_servers: Refused = None
    context_management: Refused = None
    diagnostics: Refused = None


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens`` body: a Messages request without ``max_tokens``."""

    max_tokens: Int = 1

"""Pydantic body of ``POST /v1/responses`` (OpenAI's Responses API reference: names, ranges, ``metadata``
rules, ``include`` values), read by ``server/responses.py``. Fields of OpenAI's request that would change
the answer and are not implemented get a 400 naming them; other unknown fields are ignored, as OpenAI's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedllm.server.guards import MAX_MESSAGES, MAX_TOOLS
from pagedllm.server.protocol import Bool, Float, Int, RequestBody

# OpenAI's metadata: at most 16 pairs, string keys of at most 64 characters, string values of at most 512
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
# OpenAI's ``include`` values (openai SDK's ``ResponseIncludable``): none is served (the tools, images and
# encrypted reasoning they name do not exist here; output logprobs are not produced), so each gets a 400
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs")
# fields of OpenAI's request that would change the answer and are not implemented: a 400 naming them
_REFUSED = ("background", "conversation", "prompt", "context_management")


class FunctionTool(BaseModel):
    """A function tool of ``tools`` (``parameters``: a JSON Schema object)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class NamedFunction(BaseModel):
    """``tool_choice`` naming one function."""

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON matching ``schema``."""

    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class TextConfig(BaseModel):
    """``text``: the output's format."""

    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    """``POST /v1/responses`` body (OpenAI's names and ranges: ``temperature`` 0 to 2, ``top_p`` 0 to 1,
    ``top_logprobs`` 0 to 20, ``metadata`` as ``check_metadata`` says).

    Refused with a 400 naming the field, as they would change the answer and are not implemented:
    ``background: true``, ``conversation``, ``prompt``, ``context_management``, any ``include`` value
    (see ``INCLUDABLE``), ``top_logprobs`` above 0. Other unknown fields are ignored, as OpenAI's.
    """

    model_config = ConfigDict(allow_inf_nan=False)
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: Bool = True
    max_output_tokens: Int | None = Field(default=None, ge=1, le=2**31 - 1)
    temperature: Float | None = Field(default=None, ge=0, le=2)
    top_p: Float | None = Field(default=None, ge=0, le=1)
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    text: TextConfig | None = None
    store: Bool = True
    previous_response_id: str | None = None
    stream: Bool = False
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # effort: handed to the template as reasoning_effort
    truncation: Literal["disabled"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in _REFUSED:
                if data.get(name) not in (None, False, "", [], {}):
                    raise PydanticCustomError("unsupported_field", "not supported by pagedllm (it would change "
                                              "the answer, so it is refused rather than ignored)", {"param": name})
        return data

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        if v:  # in range (checked first) but not served
            raise PydanticCustomError("top_logprobs_refused", "output logprobs are not served by pagedllm's "
                                      "Responses API (send 0 or leave it out)")
        return v

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, v: Any) -> Any:
        check_metadata(v)
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        for name in v or []:
            why = ("is not served by pagedllm (it returns none of the extra include data)" if name in INCLUDABLE
                   else "is not one of OpenAI's include values")
            raise PydanticCustomError("include_refused", "{name} {why}", {"name": repr(name), "why": why})
        return v


def check_metadata(v: Any) -> None:
    """OpenAI's rules for ``metadata``: at most ``METADATA_PAIRS`` pairs, string keys of at most
    ``METADATA_KEY_CHARS`` characters, string values of at most ``METADATA_VALUE_CHARS`` (the openai
    SDK's ``Metadata`` docs). ``None`` passes.

    Raises:
        PydanticCustomError: ``invalid_metadata``, read as a 400 naming ``metadata``.
    """
    if v is None:
        return
    if not isinstance(v, dict):
        raise PydanticCustomError("invalid_metadata", "must be an object of string keys and string values")
    if len(v) > METADATA_PAIRS:
        raise PydanticCustomError("invalid_metadata", "at most {n} key-value pairs, got {got}",
                                  {"n": METADATA_PAIRS, "got": len(v)})
    for key, value in v.items():
        if len(key) > METADATA_KEY_CHARS:
            raise PydanticCustomError("invalid_metadata", "keys are at most {n} characters, got one of {got}",
                                      {"n": METADATA_KEY_CHARS, "got": len(key)})
        if not isinstance(value, str):
            raise PydanticCustomError("invalid_metadata", "values must be strings, got {kind} for key {key}",
                                      {"kind": type(value).__name__, "key": repr(key[:METADATA_KEY_CHARS])})
        if len(value) > METADATA_VALUE_CHARS:
            raise PydanticCustomError("invalid_metadata", "values are at most {n} characters, got one of {got}",
                                      {"n": METADATA_VALUE_CHARS, "got": len(value)})

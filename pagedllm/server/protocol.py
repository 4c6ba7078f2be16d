"""Pydantic schemas of the OpenAI Chat Completions and Completions APIs (the parts pagedllm serves).

Field names and defaults follow the OpenAI API reference and vLLM's
OpenAI-compatible server. Fields not listed are ignored, as OpenAI's API ignores
unknown fields sent by newer clients.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator
from pydantic_core import PydanticCustomError

from pagedllm.sampling_params import SamplingParamError, SamplingParams
from pagedllm.server.protocol_parts import (AUDIO_PARTS, ContentPart, ImageEmbedsPart,  # noqa: F401
                                            ImageUrlPart, MessagePart, VideoUrlPart)  # (re-exported)
from pagedllm.server.protocol_replies import (ChatChunkChoice, ChatCompletionChoice,  # noqa: F401  (re-exported)
                                              ChatCompletionChunk, ChatCompletionResponse, ChatResponseMessage,
                                              CompletionChoice, CompletionResponse, DeltaMessageOut, UsageInfo, now)
from pagedllm.server.refused import (REFUSED_CHAT_FIELDS, REFUSED_COMPLETION_FIELDS, REFUSED_FIELDS,
                                     refuse_unsupported)
from pagedllm.server.guards import (MAX_MESSAGES, MAX_STOP_STRINGS, MAX_TOKEN_ID_ENTRIES, MAX_TOOLS,
                                    find_lone_surrogate, may_hold_surrogates)

# JSON types as OpenAI checks them: "10" is not an integer, "0.5" not a number, "true" not a boolean
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]


class RequestBody(BaseModel):
    """Base of every request body: refuses strings that hold a lone UTF-16 surrogate.

    JSON can spell ``"\\ud800"``, which no tokenizer takes and UTF-8 cannot encode; the
    walk over the raw body names the field (``messages[0].content``) in the 400.
    """

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        path = find_lone_surrogate(data) if may_hold_surrogates(data) else None
        if path is not None:
            raise PydanticCustomError("lone_surrogate", "strings must not contain lone UTF-16 surrogates "
                                      "(U+D800 to U+DFFF)", {"param": path})
        return data


def random_id(prefix: str) -> str:
    """A unique id such as ``chatcmpl-3f2a...`` (32 hex digits)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    """``stream_options`` of a streamed request: ``include_usage`` (a last chunk with the usage),
    ``continuous_usage_stats`` (vLLM's: with ``include_usage``, every chunk carries the usage so far,
    cumulative)."""

    include_usage: Bool | None = False
    continuous_usage_stats: Bool | None = False


class FunctionCall(BaseModel):
    """``function`` of an assistant message's tool call: ``arguments`` is JSON text."""

    name: str
    arguments: str


class ToolCallMessage(BaseModel):
    """One entry of an assistant message's ``tool_calls``."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class PartRefused(ValueError):
    """A content part the served model takes no input of; ``index``: its place in ``content``."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class ChatMessage(BaseModel):
    """One message of a conversation (tool results: role ``tool`` with ``tool_call_id``)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[MessagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self, image: str | None = None, video: str | None = None, audio: str | None = None) -> str:
        """The content as plain text: text parts joined, each image, video and audio part as ``image``,
        ``video``, ``audio`` (the model's placeholders, each on a line of its own before the text in the
        parts' order, as vLLM renders a string template).

        Raises:
            PartRefused: a part whose placeholder is ``None`` (the model takes no such input).
        """
        if not isinstance(self.content, list):
            return self.content or ""
        marks = [(j, p, video if isinstance(p, VideoUrlPart) else audio if isinstance(p, AUDIO_PARTS) else image)
                 for j, p in enumerate(self.content) if not isinstance(p, ContentPart)]
        for j, p, mark in marks:
            if mark is None:
                noun = "video" if isinstance(p, VideoUrlPart) else "audio" if isinstance(p, AUDIO_PARTS) else "image"
                raise PartRefused(j, f"{p.type}: this model reads text only" if image is video is audio is None
                                  else f"{p.type}: this model takes no {noun}")
        text = "".join(p.text for p in self.content if isinstance(p, ContentPart))
        return "".join(f"{mark}\n" for _, _, mark in marks) + text

    def image_parts(self) -> list[tuple[int, ImageUrlPart | ImageEmbedsPart]]:
        """``(index in content, part)`` of its image and image-embeddings parts, in order."""
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, (ImageUrlPart, ImageEmbedsPart))] \
            if isinstance(self.content, list) else []

    def video_parts(self) -> list[tuple[int, VideoUrlPart]]:
        """``(index in content, part)`` of its video parts, in order."""
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, VideoUrlPart)] \
            if isinstance(self.content, list) else []

    def audio_parts(self) -> list[tuple[int, Any]]:
        """``(index in content, part)`` of its audio parts (``input_audio``, ``audio_url``), in order."""
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, AUDIO_PARTS)] \
            if isinstance(self.content, list) else []


class FunctionDefinition(BaseModel):
    """A function the model may call: ``parameters`` is a JSON Schema object."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    """One entry of a chat request's ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(BaseModel):
    """``tool_choice.function``."""

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function."""

    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI): ``schema`` is the JSON Schema the answer follows."""

    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(BaseModel):
    """``response_format`` (OpenAI): free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` request field (``StructuredOutputsParams``' names).

    ``backend`` and ``disable_fallback`` choose among vLLM's grammar backends; pagedllm has
    one (llguidance), so they change nothing. Unknown keys are refused: each of the others
    changes what the output may be.
    """

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=MAX_TOOLS)
    grammar: str | None = None
    json_object: Bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: Bool = False
    disable_additional_properties: Bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None
    disable_fallback: Bool = False


class _SamplingRequest(RequestBody):
    _refused: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported_fields(cls, data: Any) -> Any:
        refuse_unsupported(data, REFUSED_FIELDS)
        refuse_unsupported(data, cls._refused)
        if isinstance(data, dict) and data.get("best_of") not in (None, data.get("n", 1)):
            raise PydanticCustomError("unsupported_field", "best_of must equal n (no beam or best-of search)",
                                      {"param": "best_of"})
        return data

    """Sampling fields shared by both endpoints.

    Ranges are checked by ``SamplingParams``; here only what must never reach the
    engine: NaN/Infinity (Python's JSON parser accepts them) and integers that
    would overflow a 64-bit tensor (``top_k``) and crash the engine loop.
    """

    model_config = ConfigDict(allow_inf_nan=False)
    model: str | None = None
    temperature: Float | None = Field(default=None)
    top_p: Float | None = None
    top_k: Int | None = Field(default=None, le=2**31 - 1)
    min_p: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = Field(default=None, max_length=MAX_TOKEN_ID_ENTRIES)
    n: Int = Field(default=1, le=2**31 - 1)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    # checked against the vocabulary when the request is made
    stop_token_ids: list[Int] | None = Field(default=None, max_length=MAX_TOKEN_ID_ENTRIES)
    seed: Int | None = Field(default=None, ge=-2**63, le=2**64 - 1)
    ignore_eos: Bool = False
    min_tokens: Int = Field(default=0, ge=0)
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, description=(
        "prefix-cache namespace: requests share cached KV blocks only when their salts are equal (vLLM's name)"))
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, and vLLM's older
    # guided_* fields (read by pagedllm.server.structured)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=MAX_TOOLS)
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # one backend here: changes nothing
    # vLLM extras
    prompt_logprobs: Int | None = Field(default=None, ge=0, le=20)
    allowed_token_ids: list[Int] | None = Field(default=None, min_length=1, max_length=MAX_TOKEN_ID_ENTRIES)
    truncate_prompt_tokens: Int | None = Field(default=None, ge=-1)
    request_id: str | None = Field(default=None, min_length=1, max_length=128)
    # accepted, changing no answer: FCFS only (priority orders nothing), one chunk per step
    priority: Int = 0
    stream_interval: Int | None = None
    session_id: str | None = None
    best_of: Int | None = None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict) -> SamplingParams:
        """Build ``SamplingParams``; fields left out take the model's generation_config defaults.

        Raises:
            SamplingParamError: a value is out of range (its ``param`` names the field).
        """
        def pick(name: str, fallback: Any) -> Any:
            v = getattr(self, name)
            return v if v is not None else defaults.get(name, fallback)

        if self.stream_options is not None and not self.stream:
            raise SamplingParamError("stream_options", "stream_options: only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise SamplingParamError("prompt_logprobs", "prompt_logprobs: only in non-streamed answers")
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise SamplingParamError("logit_bias", "logit_bias: keys must be token ids (integers as strings)") from None
        return SamplingParams(n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
                              top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), seed=self.seed,
                              presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=pick("repetition_penalty", 1.0), logit_bias=bias,
                              max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens,
                              spaces_between_special_tokens=self.spaces_between_special_tokens, logprobs=logprobs,
                              prompt_logprobs=self.prompt_logprobs, allowed_token_ids=self.allowed_token_ids,
                              truncate_prompt_tokens=self.truncate_prompt_tokens)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    # vLLM's chat extras
    continue_final_message: Bool = False
    add_special_tokens: Bool = False
    documents: list[dict[str, str]] | None = Field(default=None, max_length=MAX_MESSAGES)
    chat_template: str | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    _refused: ClassVar[dict[str, Any]] = REFUSED_CHAT_FIELDS

    @model_validator(mode="after")
    def _continue_or_open(self) -> "ChatCompletionRequest":
        if self.continue_final_message and self.add_generation_prompt:
            raise PydanticCustomError("unsupported_field", "continue_final_message needs add_generation_prompt "
                                      "false (one continues the last message, the other opens a new one)",
                                      {"param": "continue_final_message"})
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise PydanticCustomError("unsupported_field", "continue_final_message: the last message must be the "
                                      "assistant's", {"param": "continue_final_message"})
        if self.chat_template is not None:
            raise PydanticCustomError("unsupported_field", "a request cannot bring its own chat template (it is "
                                      "code the server would run); start the server with --chat-template",
                                      {"param": "chat_template"})
        return self

    def rename_error(self, param: str | None, message: str) -> tuple[str | None, str]:
        """An error's ``(param, message)`` in the request's own terms: ``max_completion_tokens``,
        not its deprecated alias ``max_tokens``, when the request set the former."""
        if self.max_completion_tokens is None:
            return param, message
        return ("max_completion_tokens" if param == "max_tokens" else param,
                message.replace("max_tokens", "max_completion_tokens"))

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        """Sampling parameters; ``max_completion_tokens`` wins over the deprecated ``max_tokens``.

        Raises:
            SamplingParamError: also when ``top_logprobs`` is set without ``logprobs: true`` (as OpenAI).
        """
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if mt is None:
            mt = defaults.get("max_tokens")
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise SamplingParamError("top_logprobs", "top_logprobs: requires logprobs to be true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise SamplingParamError("top_logprobs", f"top_logprobs: must be in [0, 20], got {self.top_logprobs}")
        try:
            return self._sampling_params(mt, (self.top_logprobs or 0) if self.logprobs else None, defaults)
        except SamplingParamError as e:
            if self.max_completion_tokens is not None and "max_tokens" in str(e):
                raise SamplingParamError(*self.rename_error(e.param, str(e))) from None
            raise


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions`` body."""

    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    echo: Bool = False
    logprobs: Int | None = None
    add_special_tokens: Bool = True
    _refused: ClassVar[dict[str, Any]] = REFUSED_COMPLETION_FIELDS

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list of strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: return the prompt (and its logprobs) and generate nothing."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        """Sampling parameters of the request; with ``echo`` and ``logprobs`` the prompt's logprobs too.

        An ``echo_only`` request samples one token that is then dropped (the engine
        needs at least one step past the prompt to finish it).
        """
        sp = self._sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None:
            sp.prompt_logprobs = max(self.logprobs, self.prompt_logprobs or 0)
        return sp


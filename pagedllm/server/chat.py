"""``POST /v1/chat/completions``: render the conversation, run its choices, split reasoning and
tool calls out of the text with the one ``StreamingParser``, and answer or stream.

Follows the OpenAI Chat Completions reference and vLLM's server (``tool_choice`` rules,
``reasoning_content``, ``chat_template_kwargs``).
"""

from __future__ import annotations

from typing import AsyncIterator

from pagedllm.entrypoints.chat_utils import prepare_messages
from pagedllm.media import audio_from_base64, audio_from_url, image_from_url, video_from_url
from pagedllm.multimodal_inputs import MultiModalPrompt
from pagedllm.multimodal_embeds import embeds_from_base64
from pagedllm.parsers import DeltaMessage, StreamingParser, make_parser
from pagedllm.parsers.reasoning import REASONING_PARSERS
from pagedllm.parsers.tools import TOOL_PARSERS
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.base import Choice, OpenAIServingBase, Prepared, ServingContext, error_event, sse
from pagedllm.server.errors import APIError
from pagedllm.server.guards import check_choices
from pagedllm.server.logprobs import chat_logprobs, prompt_logprobs_out
from pagedllm.server.structured import StructuredRequest, structured_request
from pagedllm.server.protocol import (ChatChunkChoice, ChatCompletionChoice, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse, ChatResponseMessage,
                                      DeltaMessageOut, NamedToolChoice, PartRefused, UsageInfo, now, random_id)


def keeps_special_tokens(reasoning_parser: str | None, tool_parser: str | None) -> bool:
    """Whether the output text must keep special tokens for these parsers (registry names, or
    ``None`` for one not used): True when either format's markers are special tokens
    (``needs_special_tokens``: ``openai_gptoss``, ``openai``, ``mistral``, ``llama3_json``).
    Raises nothing: an unknown name counts as False (``make_parser`` refuses it).
    """
    classes = (REASONING_PARSERS.get(reasoning_parser or ""), TOOL_PARSERS.get(tool_parser or ""))
    return any(getattr(cls, "needs_special_tokens", False) for cls in classes)


def response_message(p: StreamingParser) -> ChatResponseMessage:
    """The chat ``message`` of a finished parser: ``content`` null when empty with tool calls;
    ``reasoning_content`` whenever the parser splits reasoning."""
    m = p.message
    fields: dict = {"content": m.content}  # null when there is none (OpenAI, vLLM)
    if p.reasoning is not None:
        fields["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        fields["tool_calls"] = [c.to_dict() for c in m.tool_calls]
    return ChatResponseMessage(**fields)


def finish_reason(p: StreamingParser, finish: str | None) -> str | None:
    """``tool_calls`` when a message that stopped normally ends in tool calls (OpenAI's rule;
    a named ``tool_choice`` keeps ``stop``, as OpenAI answers it)."""
    if getattr(p.tools, "keeps_finish_reason", False):
        return finish
    return "tool_calls" if finish == "stop" and p.message.tool_calls else finish


def merge_deltas(a: DeltaMessage, b: DeltaMessage) -> DeltaMessage:
    """Two consecutive parser deltas as one (argument pieces of the same call joined)."""
    calls = list(a.tool_calls)
    for tc in b.tool_calls:
        if calls and calls[-1].index == tc.index and tc.id is None:
            calls[-1] = type(tc)(tc.index, calls[-1].id, calls[-1].name, calls[-1].arguments + tc.arguments)
        else:
            calls.append(tc)
    return DeltaMessage(a.reasoning_content + b.reasoning_content, a.content + b.content, calls)


def delta_out(d: DeltaMessage) -> DeltaMessageOut:
    """The chat chunk ``delta`` of a parser delta: only the fields that changed."""
    fields: dict = {}
    if d.reasoning_content:
        fields["reasoning_content"] = d.reasoning_content
    if d.content:
        fields["content"] = d.content
    if d.tool_calls:
        fields["tool_calls"] = [tc.to_dict() for tc in d.tool_calls]
    return DeltaMessageOut(**fields)


class OpenAIServingChat(OpenAIServingBase):
    """Builds chat requests, runs them and formats the answers.

    Args:
        ctx: the shared ``ServingContext``.
        chat_template: a Jinja template overriding the tokenizer's, or ``None``.
        reasoning_parser: name in ``REASONING_PARSERS`` (``--reasoning-parser``), or ``None``.
        tool_call_parser: name in ``TOOL_PARSERS`` (``--tool-call-parser``), or ``None``.
        enable_auto_tool_choice: allow ``tool_choice: "auto"`` (``--enable-auto-tool-choice``).
    """

    def __init__(self, ctx: ServingContext, chat_template: str | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False) -> None:
        super().__init__(ctx)
        self.chat_template = chat_template
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice

    def render_chat(self, body: ChatCompletionRequest, with_tools: bool = True) -> list[int]:
        """Apply the chat template and tokenize (without adding special tokens twice); call through ``offload``.

        Raises:
            APIError: 400 when the template rejects the conversation or the text cannot fit.
        """
        return self.ctx.encode(self.render_text(body, with_tools), "messages", add_special_tokens=False)

    def prompt_ids(self, body: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids as the engine will see them: ``render_chat``'s, or with images each
        image's placeholder expanded by the model's processor (``count_tokens``); call through ``offload``.

        Raises:
            APIError: 400 as ``render_chat``, or for images the processor refuses.
        """
        images, videos, audios = self.images(body), self.videos(body), self.audios(body)
        if not images and not videos and not audios:
            return self.render_chat(body)
        try:
            return self.llm.engine.processor.multimodal(
                MultiModalPrompt(self.render_text(body), images, False, videos, audios), "messages")[0]
        except ValueError as e:
            raise APIError(400, str(e), "messages", code="invalid_value") from None

    def render_text(self, body: ChatCompletionRequest, with_tools: bool = True) -> str:
        """The conversation rendered by the chat template, as text.

        Raises:
            APIError: 400 for messages the template or ``prepare_messages`` rejects.
        """
        raw = []
        placeholder = getattr(self.llm, "image_placeholder", None)
        video = getattr(self.llm, "video_placeholder", None)
        audio = getattr(self.llm, "audio_placeholder", None)
        for i, m in enumerate(body.messages):
            d = m.model_dump(exclude_none=True)
            try:
                d["content"] = m.text(placeholder, video, audio)
            except ValueError as e:
                where = f"messages[{i}].content" + (f"[{e.index}]" if isinstance(e, PartRefused) else "")
                raise APIError(400, f"{where}: {e}", where, code="invalid_value") from None
            raw.append(d)
        try:
            msgs = prepare_messages(raw)
        except ValueError as e:
            raise APIError(400, str(e), "messages", code="invalid_value") from None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if with_tools and body.tools else None
        kwargs = dict(body.chat_template_kwargs or {})
        if getattr(body, "reasoning_effort", None) is not None:  # OpenAI's field, read by templates that know it
            kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        if getattr(body, "documents", None):
            kwargs["documents"] = body.documents
        try:
            return self.tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False,
                                                      chat_template=self.chat_template,
                                                      add_generation_prompt=body.add_generation_prompt,
                                                      continue_final_message=getattr(body, "continue_final_message",
                                                                                     False),
                                                      **kwargs)
        except Exception as e:  # jinja raise_exception(...) or a template bug: the request's fault
            raise APIError(400, f"chat template failed: {e}", "messages", code="invalid_value") from None

    def images(self, body: ChatCompletionRequest) -> tuple:
        """The images of the conversation's ``image_url`` parts, decoded, and the tensors of its
        ``image_embeds`` parts, in order.

        Raises:
            APIError: 400 naming the part for a URL that is not a readable image data URL, or
                embeddings that are not base64 of a saved float tensor.
        """
        out = []
        for i, m in enumerate(body.messages):
            for j, part in m.image_parts():
                where = f"messages[{i}].content[{j}].{part.type}"
                try:
                    out.append(image_from_url(part.image_url.url, where, getattr(self.llm, "media_policy", None))
                               if part.type == "image_url" else embeds_from_base64(part.image_embeds, where))
                except ValueError as e:
                    raise APIError(400, str(e), where, code="invalid_value") from None
        return tuple(out)

    def videos(self, body: ChatCompletionRequest) -> tuple:
        """The videos of the conversation's ``video_url`` parts, decoded and sampled
        (``media.video_from_url``: ``(frames, fps)`` each), in order.

        Raises:
            APIError: 400 naming the part for a URL that is not allowed or not a readable video.
        """
        out = []
        for i, m in enumerate(body.messages):
            for j, part in m.video_parts():
                where = f"messages[{i}].content[{j}].video_url"
                try:
                    out.append(video_from_url(part.video_url.url, where, getattr(self.llm, "media_policy", None)))
                except ValueError as e:
                    raise APIError(400, str(e), where, code="invalid_value") from None
        return tuple(out)

    def audios(self, body: ChatCompletionRequest) -> tuple:
        """The clips of the conversation's ``input_audio`` and ``audio_url`` parts, decoded at the model's
        rate (``media.audio_from_base64`` / ``audio_from_url``: ``(samples, rate)`` each), in order.

        Raises:
            APIError: 400 naming the part for data that is not base64 of a readable audio file, or a
                URL that is not allowed or readable.
        """
        out = []
        rate = getattr(self.llm, "audio_rate", None)
        for i, m in enumerate(body.messages):
            for j, part in m.audio_parts():
                where = f"messages[{i}].content[{j}].{part.type}"
                try:
                    if rate is None:
                        raise ValueError(f"{where}: this model takes no audio")
                    wave = (audio_from_base64(part.input_audio.data, where, rate) if part.type == "input_audio"
                            else audio_from_url(part.audio_url.url, where, getattr(self.llm, "media_policy", None),
                                                rate))
                except ValueError as e:
                    raise APIError(400, str(e), where, code="invalid_value") from None
                out.append((wave, rate))
        return tuple(out)

    def _tool_mode(self, body: ChatCompletionRequest) -> bool:
        """Whether to parse tool calls, following ``tool_choice`` (vLLM's rules): ``required`` and
        a named function are forced calls (structured outputs); ``auto`` needs a tool parser.

        Raises:
            APIError: 400 for ``auto`` on a server started without
                ``--enable-auto-tool-choice --tool-call-parser``.
        """
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        if choice == "required" or isinstance(choice, NamedToolChoice):
            return True
        if choice == "none" or not body.tools:
            return False
        if not (self.enable_auto_tool_choice and self.tool_call_parser):
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                           "to be set on the server", "tool_choice", code="unsupported_value")
        return True

    def _reasoning_end_tag(self, body: ChatCompletionRequest) -> str | None:
        """Where a constraint starts with a reasoning parser on: after its end tag, while thinking is on."""
        if not self.reasoning_parser or not (body.chat_template_kwargs or {}).get("enable_thinking", True):
            return None
        return REASONING_PARSERS[self.reasoning_parser].end_tag

    def _parser_args(self, body: ChatCompletionRequest, text: str, use_tools: bool,
                     structured: StructuredRequest | None) -> dict | None:
        if not (use_tools or self.reasoning_parser):
            return None
        kwargs = body.chat_template_kwargs or {}
        forced = structured.forced_tool if structured is not None else None
        tool_parser = self.tool_call_parser if use_tools else None
        # thinking is what the request asked for; "starts in reasoning" is what the prompt says
        return dict(reasoning_parser=self.reasoning_parser, tool_parser=tool_parser,
                    thinking=bool(kwargs.get("enable_thinking", True)),
                    starts_in_reasoning=text.rstrip().endswith("<think>"),
                    tools=[t.model_dump() for t in body.tools or []],
                    forced_function=None if forced in (None, "required") else forced,
                    forced_calls=forced == "required")  # a JSON array of {"name", "parameters"}

    async def chat(self, body: ChatCompletionRequest):
        """Run a chat completion; returns the response dict, or an async iterator of SSE lines.

        Raises:
            APIError: 400 for invalid input, 404 for another model, 429 when overloaded.
            EngineDeadError: the engine is down (answered 503).
        """
        lora = self.ctx.check_model(body.model)
        self.ctx.check_generates()
        params = self.params(body)
        use_tools = self._tool_mode(body)
        structured = structured_request(body, self._reasoning_end_tag(body), tools=True)
        check_choices(1, params.n)
        if structured is not None:
            params.structured_outputs = structured.params
        # the reasoning parser reads every output; the tool parser only free (unconstrained) calls
        if keeps_special_tokens(self.reasoning_parser,
                                self.tool_call_parser if use_tools and structured is None else None):
            params.skip_special_tokens = False
        rid = f"chatcmpl-{body.request_id}" if body.request_id else random_id("chatcmpl")

        def rename(param, message):
            return body.rename_error(*(structured.rename(param, message) if structured else (param, message)))

        def prepare() -> Prepared:  # on the tokenizer thread
            text = self.render_text(body)
            images, videos, audios = self.images(body), self.videos(body), self.audios(body)
            prompt = (MultiModalPrompt(text, images, body.add_special_tokens, videos, audios)
                      if images or videos or audios
                      else self.ctx.encode(text, "messages", add_special_tokens=body.add_special_tokens))
            reqs = self.fan_out(rid, [prompt], params, "messages", body.cache_salt, rename, lora)
            return Prepared(reqs, self._parser_args(body, text, use_tools, structured))

        def stream_of(prep: Prepared, merged) -> AsyncIterator[str]:
            opts = body.stream_options
            parsers = [make_parser(**prep.extra) if prep.extra else None for _ in prep.requests]
            return self._chat_stream(rid, merged, prep.requests[0].num_prompt_tokens,
                                     bool(opts and opts.include_usage), params.logprobs, parsers,
                                     bool(opts and opts.include_usage and opts.continuous_usage_stats),
                                     self.shown_model(prep))

        def respond(prep: Prepared, choices: list[Choice]) -> dict:
            return self._response(rid, prep, choices, params.logprobs).model_dump()

        return await self.run(params.n, body.stream, prepare, stream_of, respond,
                              params if structured is not None else None, rename)

    def _response(self, rid: str, prep: Prepared, choices: list[Choice], top: int | None) -> ChatCompletionResponse:
        out = []
        for i, c in enumerate(choices):
            message, finish = ChatResponseMessage(content=c.text), c.finish
            if prep.extra:
                p = make_parser(**prep.extra)
                p.feed(c.text)
                p.finish()
                message, finish = response_message(p), finish_reason(p, c.finish)
            out.append(ChatCompletionChoice(index=i, message=message, finish_reason=finish, stop_reason=c.stop_reason,
                                            logprobs=None if top is None else chat_logprobs(c.logprobs, top)))
        usage = UsageInfo.of(prep.requests[0].num_prompt_tokens, sum(c.num_tokens for c in choices))
        extra = {}
        if prep.requests[0].sampling_params.prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs_out(choices[0].prompt_logprobs)
        return ChatCompletionResponse(id=rid, created=now(), model=self.shown_model(prep), choices=out, usage=usage,
                                      **extra)

    async def _chat_stream(self, rid: str, merged, n_prompt: int, include_usage: bool, top: int | None,
                           parsers: list[StreamingParser | None], continuous_usage: bool = False,
                           model: str | None = None) -> AsyncIterator[str]:
        created, model = now(), model or self.model_name

        def chunk(i: int, delta: DeltaMessageOut, finish: str | None = None, logprobs=None,
                  stop_reason=None) -> ChatCompletionChunk:
            # continuous_usage_stats (vLLM's): every chunk carries the usage so far
            extra = {"usage": UsageInfo.of(n_prompt, n_tokens)} if continuous_usage else {}
            return ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish,
                                stop_reason=stop_reason)], **extra)

        n_tokens = 0
        first = True
        try:
            async for i, out in merged:
                if first:  # the role goes out with the first output, as vLLM: clients time TTFT from it
                    first = False
                    for j in range(len(parsers)):
                        yield sse(chunk(j, DeltaMessageOut(role="assistant", content="")))
                c = out.outputs[0]
                n_tokens += len(c.token_ids)
                lps = None if top is None or not c.logprobs else chat_logprobs(c.logprobs, top)
                finish = c.finish_reason
                p = parsers[i]
                if p is None:
                    delta = DeltaMessageOut(content=c.text) if c.text else DeltaMessageOut()
                else:
                    d = p.feed(c.text, c.token_ids)
                    if finish is not None:
                        d = merge_deltas(d, p.finish())
                        finish = finish_reason(p, finish)
                    delta = delta_out(d)
                if delta.model_fields_set or lps or finish is not None:
                    if lps and not delta.model_fields_set:
                        delta = DeltaMessageOut(content="")  # logprobs of tokens whose text is still held back
                    yield sse(chunk(i, delta, finish, lps, c.stop_reason if finish is not None else None))
            if include_usage:
                yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                              usage=UsageInfo.of(n_prompt, n_tokens)))
        except Exception as e:
            yield error_event(e)
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"

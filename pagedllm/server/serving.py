"""Handlers of ``/v1/chat/completions`` and ``/v1/completions`` over ``AsyncLLM``.

Every choice is its own engine request: ``n`` samples of each prompt become
``n`` requests that share the prompt's KV blocks through the prefix cache.
Choice ``i * n + j`` is sample ``j`` of prompt ``i`` (OpenAI's and vLLM's order).
Their delta outputs are merged into one stream or one response.
"""

from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.engine.detokenizer import token_texts
from pagedllm.entrypoints.chat_utils import prepare_messages
from pagedllm.engine.llm_engine import PromptTooLongError
from pagedllm.outputs import RequestOutput
from pagedllm.parsers import DeltaMessage, StreamingParser, make_parser
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParamError, SamplingParams
from pagedllm.server.errors import APIError
from pagedllm.server.guards import AdmissionControl, RejectionCounter, check_choices
from pagedllm.server.logprobs import chat_logprobs, completion_logprobs, tokens_length
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, now, random_id

# tool-call formats whose markers are special tokens: the text must keep them
_NEEDS_SPECIAL_TOKENS = {"mistral", "llama3_json"}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _error_event(e: BaseException) -> str:
    # headers are sent: report in-band, as vLLM does
    return _sse({"error": {"message": str(e), "type": "internal_error", "param": None, "code": None}})


async def merge_outputs(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as ``(choice index, output)`` in arrival order.

    Raises:
        Exception: the first error any request reports (e.g. ``EngineDeadError``).
    Closing this iterator early closes every request's generator, aborting them.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    live = len(gens)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()


def _message(p: StreamingParser) -> dict:
    """The chat ``message`` of a finished parser: ``content`` null when empty with tool calls."""
    m = p.message
    out: dict = {"role": "assistant", "content": m.content}  # null when there is none (OpenAI, vLLM)
    if p.reasoning is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        out["tool_calls"] = [c.to_dict() for c in m.tool_calls]
    return out


def _finish_reason(p: StreamingParser, finish: str | None) -> str | None:
    """``tool_calls`` when a message that stopped normally ends in tool calls (OpenAI's rule)."""
    return "tool_calls" if finish == "stop" and p.message.tool_calls else finish


def _merge_deltas(a: DeltaMessage, b: DeltaMessage) -> DeltaMessage:
    """Two consecutive deltas as one (argument pieces of the same call joined)."""
    calls = list(a.tool_calls)
    for tc in b.tool_calls:
        if calls and calls[-1].index == tc.index and tc.id is None:
            calls[-1] = type(tc)(tc.index, calls[-1].id, calls[-1].name, calls[-1].arguments + tc.arguments)
        else:
            calls.append(tc)
    return DeltaMessage(a.reasoning_content + b.reasoning_content, a.content + b.content, calls)


def _delta_dict(d: DeltaMessage) -> dict:
    """The chat chunk ``delta`` object of a parser delta (only the fields that changed)."""
    out: dict = {}
    if d.reasoning_content:
        out["reasoning_content"] = d.reasoning_content
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = [tc.to_dict() for tc in d.tool_calls]
    return out


class _Choice:
    """Accumulates one choice's text, tokens and logprobs (non-streaming)."""

    def __init__(self) -> None:
        self.text, self.num_tokens, self.finish = "", 0, None
        self.logprobs: list = []
        self.prompt_logprobs = None

    def add(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        self.text += c.text
        self.num_tokens += len(c.token_ids)
        self.finish = c.finish_reason
        self.logprobs += c.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs


class _HeldStream:
    """An SSE line iterator that holds its request's admission slots until it is closed.

    The response always closes its body iterator, even one that never started (whose
    ``finally`` would never run), so the slots cannot leak.
    """

    def __init__(self, gen: AsyncIterator[str], admission) -> None:
        self._gen, self._admission = gen, admission

    def __aiter__(self) -> "_HeldStream":
        return self

    async def __anext__(self) -> str:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        """Close the stream (aborting its engine requests) and release the slots."""
        try:
            await self._gen.aclose()
        finally:
            self._admission.release()


class OpenAIServing:
    """Builds requests from API bodies, runs them and formats responses.

    Args:
        llm: the async engine.
        model_name: the served model name (requests naming another get 404).
        chat_template: a Jinja template overriding the tokenizer's, or ``None``.
        reasoning_parser: name in ``REASONING_PARSERS`` (``--reasoning-parser``), or ``None``.
        tool_call_parser: name in ``TOOL_PARSERS`` (``--tool-call-parser``), or ``None``.
        enable_auto_tool_choice: allow ``tool_choice: "auto"`` (``--enable-auto-tool-choice``).
        admission: the bound on engine requests in flight (default: unbounded).

    Tokenizing, chat-template rendering and detokenizing client input run on one worker
    thread (``offload``), never on the event loop, so a large prompt delays no other
    connection; a prompt text longer than ``max_prompt_chars`` is refused before tokenizing.
    """

    def __init__(self, llm: AsyncLLM, model_name: str, chat_template: str | None = None,
                 reasoning_parser: str | None = None, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False, admission: AdmissionControl | None = None) -> None:
        self.llm = llm
        self.admission = admission or AdmissionControl(None, RejectionCounter())
        # one thread: a fast tokenizer is not safe to use from several threads at once
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenize")
        self.model_name = model_name
        self.chat_template = chat_template
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tokenizer = llm.engine.tokenizer
        self.defaults = llm.engine.default_sampling_fields()
        # no token decodes to more characters than its vocabulary string has (byte-level BPE: one
        # character per byte; sentencepiece: one per character), so a longer text cannot fit
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = llm.engine.context_limit * max(longest, 1)

    async def offload(self, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the tokenizer thread and await its result (or exception)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def check_prompt_chars(self, text: str, param: str) -> None:
        """Refuse, before tokenizing, a text too long to fit the context whatever its tokens.

        Raises:
            APIError: 400 with code ``context_length_exceeded`` naming ``param``.
        """
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"{param}: {len(text)} characters cannot fit this model's maximum context "
                           f"length of {self.llm.engine.context_limit} tokens (at most {self.max_prompt_chars} "
                           f"characters)", param, code="context_length_exceeded")

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a client text, after ``check_prompt_chars`` (call through ``offload``)."""
        self.check_prompt_chars(text, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_model(self, model: str | None) -> None:
        """Raises ``APIError`` 404 when the request names a model we do not serve, and
        ``EngineDeadError`` (answered 503) when the engine loop has died, so that
        a stream is refused before its 200 headers go out."""
        if not self.llm.is_healthy:
            raise EngineDeadError("engine is not running")
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", code="model_not_found")

    def _params(self, body) -> SamplingParams:
        try:
            return body.to_sampling_params(self.defaults)
        except SamplingParamError as e:
            raise APIError(400, str(e), e.param, code="invalid_value") from None

    def _make(self, rid: str, prompt, params, prompt_param: str, cache_salt: str | None, rename) -> Request:
        try:
            return self.llm.make_request(rid, prompt, params, cache_salt)
        except PromptTooLongError as e:  # OpenAI's code for this case
            param, msg = rename(prompt_param if e.param == "prompt" else e.param, str(e))
            raise APIError(400, msg, param, code="context_length_exceeded") from None
        except SamplingParamError as e:
            param, msg = rename(prompt_param if e.param == "prompt" else e.param, str(e))
            raise APIError(400, msg, param, code="invalid_value") from None

    def _fan_out(self, rid: str, prompts: list[list[int]], params: SamplingParams, prompt_param: str,
                 cache_salt: str | None, rename=lambda param, msg: (param, msg)) -> list[Request]:
        """One request per (prompt, sample), all validated before any is submitted.

        ``rename(param, message)`` maps an error's field to the name the request used.
        """
        reqs = []
        for i, p in enumerate(prompts):
            for j in range(params.n):
                cid = rid if len(prompts) == 1 and params.n == 1 else f"{rid}-{i * params.n + j}"
                reqs.append(self._make(cid, p, params.child(j), prompt_param, cache_salt, rename))
        return reqs

    def render_chat(self, body: ChatCompletionRequest, with_tools: bool = True) -> list[int]:
        """Apply the chat template and tokenize (without adding special tokens twice); call through ``offload``.

        Raises:
            APIError: 400 when the template rejects the conversation or the text cannot fit.
        """
        return self.encode(self._render_text(body, with_tools), "messages", add_special_tokens=False)

    def _render_text(self, body: ChatCompletionRequest, with_tools: bool = True) -> str:
        raw = []
        for m in body.messages:
            d = m.model_dump(exclude_none=True)
            d["content"] = m.text()
            raw.append(d)
        try:
            msgs = prepare_messages(raw)
        except ValueError as e:
            raise APIError(400, str(e), "messages", code="invalid_value") from None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if with_tools and body.tools else None
        try:
            return self.tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False,
                                                      chat_template=self.chat_template,
                                                      add_generation_prompt=body.add_generation_prompt,
                                                      **(body.chat_template_kwargs or {}))
        except Exception as e:  # jinja raise_exception(...) or a template bug: the request's fault
            raise APIError(400, f"chat template failed: {e}", "messages", code="invalid_value") from None

    def _tool_mode(self, body: ChatCompletionRequest) -> bool:
        """Whether to parse tool calls, following ``tool_choice`` (vLLM's rules).

        Raises:
            APIError: 400 for ``required`` or a named function (they need structured output,
                which pagedllm does not have yet), and for ``auto`` on a server started
                without ``--enable-auto-tool-choice --tool-call-parser``.
        """
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise APIError(400, "tool_choice: 'required' and named functions need structured output, which "
                           "pagedllm does not support yet; use 'auto' or 'none'", "tool_choice",
                           code="unsupported_value")
        if choice == "none" or not body.tools:
            return False
        if not (self.enable_auto_tool_choice and self.tool_call_parser):
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                           "to be set on the server", "tool_choice", code="unsupported_value")
        return True

    # ---- chat -------------------------------------------------------------------
    def _prepare_chat(self, rid: str, body: ChatCompletionRequest, params: SamplingParams):
        """Render, tokenize and validate on the tokenizer thread: ``(text, requests)``."""
        text = self._render_text(body)
        ids = self.encode(text, "messages", add_special_tokens=False)
        return text, self._fan_out(rid, [ids], params, "messages", body.cache_salt, body.rename_error)

    async def chat(self, body: ChatCompletionRequest):
        """Run a chat completion; returns a dict, or an async iterator of SSE lines when streaming.

        Raises:
            APIError: 400 for invalid input, 404 for another model, 429 when overloaded, 503 when the engine is down.
        """
        self.check_model(body.model)
        params = self._params(body)
        use_tools = self._tool_mode(body)
        check_choices(1, params.n)
        if use_tools and self.tool_call_parser in _NEEDS_SPECIAL_TOKENS:
            params.skip_special_tokens = False
        admission = self.admission.admit(params.n)
        try:
            rid = random_id("chatcmpl")
            text, reqs = await self.offload(self._prepare_chat, rid, body, params)
            kwargs = body.chat_template_kwargs or {}
            parser_args = None
            if use_tools or self.reasoning_parser:
                # thinking is what the request asked for; "starts in reasoning" is what the prompt says
                parser_args = dict(reasoning_parser=self.reasoning_parser,
                                   tool_parser=self.tool_call_parser if use_tools else None,
                                   thinking=bool(kwargs.get("enable_thinking", True)),
                                   starts_in_reasoning=text.rstrip().endswith("<think>"),
                                   tools=[t.model_dump() for t in body.tools or []])
            merged = merge_outputs([self.llm.generate(r) for r in reqs])
            n_prompt = reqs[0].num_prompt_tokens
            top = params.logprobs
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                parsers = [make_parser(**parser_args) if parser_args else None for _ in reqs]
                stream = self._chat_stream(rid, merged, len(reqs), n_prompt, include_usage, top, parsers)
                return _HeldStream(stream, admission)
            choices = [_Choice() for _ in reqs]
            async for i, out in merged:
                choices[i].add(out)
        except BaseException:
            admission.release()
            raise
        admission.release()
        result = []
        for i, c in enumerate(choices):
            message, finish = {"role": "assistant", "content": c.text}, c.finish
            if parser_args:
                p = make_parser(**parser_args)
                p.feed(c.text)
                p.finish()
                message, finish = _message(p), _finish_reason(p, c.finish)
            result.append({"index": i, "message": message,
                           "logprobs": None if top is None else chat_logprobs(c.logprobs, top),
                           "finish_reason": finish})
        return {"id": rid, "object": "chat.completion", "created": now(), "model": self.model_name,
                "choices": result, "usage": _usage(n_prompt, sum(c.num_tokens for c in choices))}

    async def _chat_stream(self, rid: str, merged, num_choices: int, n_prompt: int, include_usage: bool,
                           top: int | None, parsers: list[StreamingParser | None]) -> AsyncIterator[str]:
        created = now()

        def chunk(i: int, delta: dict, finish: str | None = None, logprobs=None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

        n_tokens = 0
        try:
            for i in range(num_choices):
                yield _sse(chunk(i, {"role": "assistant", "content": ""}))
            async for i, out in merged:
                c = out.outputs[0]
                n_tokens += len(c.token_ids)
                lps = None if top is None or not c.logprobs else chat_logprobs(c.logprobs, top)
                finish = c.finish_reason
                p = parsers[i]
                if p is None:
                    delta = {"content": c.text} if c.text else {}
                else:
                    d = p.feed(c.text, c.token_ids)
                    if finish is not None:
                        d = _merge_deltas(d, p.finish())
                        finish = _finish_reason(p, finish)
                    delta = _delta_dict(d)
                if delta or lps or finish is not None:
                    if lps and not delta:
                        delta = {"content": ""}  # logprobs of tokens whose text is still held back
                    yield _sse(chunk(i, delta, finish, lps))
            if include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                            "model": self.model_name, "choices": [], "usage": _usage(n_prompt, n_tokens)})
        except Exception as e:
            yield _error_event(e)
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"

    # ---- completions ------------------------------------------------------------
    def _prepare_completion(self, rid: str, body: CompletionRequest, prompts: list, params: SamplingParams):
        """Tokenize and validate on the tokenizer thread: ``(requests, echo texts)`` (one echo per choice)."""
        ids = [self.encode(p, "prompt") if isinstance(p, str) else p for p in prompts]
        reqs = self._fan_out(rid, ids, params, "prompt", body.cache_salt)
        echo = [(p if isinstance(p, str) else self.tokenizer.decode(p)) if body.echo else None
                for p in prompts for _ in range(params.n)]
        return reqs, echo

    async def completion(self, body: CompletionRequest):
        """Run a (possibly multi-prompt, possibly ``n``-sample) completion; dict or SSE iterator.

        Raises:
            APIError: 400 for invalid input, 404 for another model, 429 when overloaded, 503 when the engine is down.
        """
        self.check_model(body.model)
        params = self._params(body)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt: must not be empty", "prompt", code="invalid_value")
        n = params.n
        check_choices(len(prompts), n)
        admission = self.admission.admit(len(prompts) * n)
        try:
            rid = random_id("cmpl")
            reqs, echo = await self.offload(self._prepare_completion, rid, body, prompts, params)
            merged = merge_outputs([self.llm.generate(r) for r in reqs])
            n_prompt = sum(r.num_prompt_tokens for r in reqs[::n])
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                stream = self._completion_stream(rid, merged, echo, body, n_prompt, include_usage, reqs)
                return _HeldStream(stream, admission)
            choices = [_Choice() for _ in reqs]
            async for i, out in merged:
                choices[i].add(out)
        except BaseException:
            admission.release()
            raise
        admission.release()
        result, n_tokens = [], 0
        for i, c in enumerate(choices):
            if body.echo_only:  # the one sampled token is not part of the answer
                c.text, c.num_tokens, c.logprobs, c.finish = "", 0, [], "length"
            lps = None
            if body.logprobs is not None:
                lps = completion_logprobs(c.logprobs, body.logprobs, c.prompt_logprobs if body.echo else None,
                                          first_prompt_text=self._first_token_text(reqs[i]) if body.echo else "")
            result.append({"index": i, "text": (echo[i] or "") + c.text, "logprobs": lps, "finish_reason": c.finish})
            n_tokens += c.num_tokens
        return {"id": rid, "object": "text_completion", "created": now(), "model": self.model_name,
                "choices": result, "usage": _usage(n_prompt, n_tokens)}

    def _first_token_text(self, req: Request) -> str:
        return token_texts(self.tokenizer, req.prompt_token_ids[:1])[0]

    async def _completion_stream(self, rid: str, merged, echo: list[str | None], body: CompletionRequest,
                                 n_prompt: int, include_usage: bool, reqs: list[Request]) -> AsyncIterator[str]:
        created = now()
        offsets = [0] * len(echo)   # characters covered by the tokens sent so far per choice (text_offset)
        started = [False] * len(echo)

        def chunk(i: int, text: str, finish: str | None, logprobs=None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

        n_tokens = 0
        try:
            async for i, out in merged:
                c = out.outputs[0]
                text, lp_list, prompt_lps = c.text, c.logprobs or [], None
                if body.echo_only:
                    text, lp_list, finish = "", [], "length"
                else:
                    n_tokens += len(c.token_ids)
                    finish = c.finish_reason
                if not started[i]:  # the echo goes out with the choice's first chunk
                    started[i] = True
                    text = (echo[i] or "") + text
                    prompt_lps = out.prompt_logprobs if body.echo else None
                lps = None
                if body.logprobs is not None and (lp_list or prompt_lps):
                    first = self._first_token_text(reqs[i]) if prompt_lps else ""
                    lps = completion_logprobs(lp_list, body.logprobs, prompt_lps, offsets[i], first)
                if lps is not None:
                    offsets[i] += tokens_length(lps)  # offsets follow the tokens, which may lag the text
                if text or lps or finish is not None:
                    yield _sse(chunk(i, text, finish, lps))
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                            "choices": [], "usage": _usage(n_prompt, n_tokens)})
        except Exception as e:
            yield _error_event(e)
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"

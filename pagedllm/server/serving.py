"""Handlers of ``/v1/chat/completions`` and ``/v1/completions`` over ``AsyncLLM``."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.engine.llm_engine import PromptTooLongError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParamError
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest, now, random_id


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class OpenAIServing:
    """Builds requests from API bodies, runs them and formats responses.

    Args:
        llm: the async engine.
        model_name: the served model name (requests naming another get 404).
        chat_template: a Jinja template overriding the tokenizer's, or ``None``.
    """

    def __init__(self, llm: AsyncLLM, model_name: str, chat_template: str | None = None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.chat_template = chat_template
        self.tokenizer = llm.engine.tokenizer
        gc = llm.engine.generation_config
        self.defaults = {k: gc[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in gc}

    def check_model(self, model: str | None) -> None:
        """Raises ``APIError`` 404 when the request names a model we do not serve, and
        ``EngineDeadError`` (answered 503) when the engine loop has died, so that
        a stream is refused before its 200 headers go out."""
        if not self.llm.is_healthy:
            raise EngineDeadError("engine is not running")
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", code="model_not_found")

    def _params(self, body):
        try:
            return body.to_sampling_params(self.defaults)
        except SamplingParamError as e:
            raise APIError(400, str(e), e.param, code="invalid_value") from None

    def _make(self, rid: str, prompt, params, prompt_param: str = "prompt", cache_salt: str | None = None):
        try:
            return self.llm.make_request(rid, prompt, params, cache_salt)
        except PromptTooLongError as e:  # OpenAI's code for this case
            param = prompt_param if e.param == "prompt" else e.param
            raise APIError(400, str(e), param, code="context_length_exceeded") from None
        except SamplingParamError as e:
            param = prompt_param if e.param == "prompt" else e.param
            raise APIError(400, str(e), param, code="invalid_value") from None

    def render_chat(self, body: ChatCompletionRequest) -> list[int]:
        """Apply the chat template and tokenize (without adding special tokens twice).

        Raises:
            APIError: 400 when the template rejects the conversation.
        """
        msgs = []
        for m in body.messages:
            d = m.model_dump(exclude_none=True)
            d["content"] = m.text()
            msgs.append(d)
        try:
            text = self.tokenizer.apply_chat_template(msgs, tokenize=False, chat_template=self.chat_template,
                                                      add_generation_prompt=body.add_generation_prompt,
                                                      **(body.chat_template_kwargs or {}))
        except Exception as e:  # jinja raise_exception(...) or a template bug: the request's fault
            raise APIError(400, f"chat template failed: {e}", "messages", code="invalid_value") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- chat -------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest):
        """Run a chat completion; returns a dict, or an async iterator of SSE lines when streaming."""
        self.check_model(body.model)
        params = self._params(body)
        rid = random_id("chatcmpl")
        req = self._make(rid, self.render_chat(body), params, "messages", body.cache_salt)
        gen = self.llm.generate(req)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._chat_stream(rid, gen, req.num_prompt_tokens, include_usage)
        text, n_tokens, finish = "", 0, None
        async for out in gen:
            c = out.outputs[0]
            text += c.text
            n_tokens += len(c.token_ids)
            finish = c.finish_reason
        return {"id": rid, "object": "chat.completion", "created": now(), "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish}],
                "usage": _usage(req.num_prompt_tokens, n_tokens)}

    async def _chat_stream(self, rid: str, gen: AsyncIterator[RequestOutput], n_prompt: int,
                           include_usage: bool) -> AsyncIterator[str]:
        created = now()

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        n_tokens = 0
        try:
            yield _sse(chunk({"role": "assistant", "content": ""}))
            async for out in gen:
                c = out.outputs[0]
                n_tokens += len(c.token_ids)
                if c.text:
                    yield _sse(chunk({"content": c.text}))
                if c.finish_reason is not None:
                    yield _sse(chunk({}, c.finish_reason))
            if include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                            "model": self.model_name, "choices": [], "usage": _usage(n_prompt, n_tokens)})
        except Exception as e:  # headers are sent: report in-band, as vLLM does
            yield _sse({"error": {"message": str(e), "type": "internal_error", "param": None, "code": None}})
        finally:
            await gen.aclose()
        yield "data: [DONE]\n\n"

    # ---- completions ------------------------------------------------------------
    async def completion(self, body: CompletionRequest):
        """Run a (possibly multi-prompt) completion; dict or SSE iterator."""
        self.check_model(body.model)
        params = self._params(body)
        rid = random_id("cmpl")
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt: must not be empty", "prompt", code="invalid_value")
        reqs = [self._make(f"{rid}-{i}", p, params, cache_salt=body.cache_salt) for i, p in enumerate(prompts)]
        texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]
        gens = [self.llm.generate(r) for r in reqs]
        n_prompt = sum(r.num_prompt_tokens for r in reqs)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._completion_stream(rid, gens, texts if body.echo else None, n_prompt, include_usage)
        results = await asyncio.gather(*[self._collect(g) for g in gens])
        choices = []
        for i, (text, n, finish) in enumerate(results):
            choices.append({"index": i, "text": (texts[i] if body.echo else "") + text, "logprobs": None,
                            "finish_reason": finish})
        return {"id": rid, "object": "text_completion", "created": now(), "model": self.model_name,
                "choices": choices, "usage": _usage(n_prompt, sum(r[1] for r in results))}

    @staticmethod
    async def _collect(gen) -> tuple[str, int, str | None]:
        text, n, finish = "", 0, None
        async for out in gen:
            c = out.outputs[0]
            text += c.text
            n += len(c.token_ids)
            finish = c.finish_reason
        return text, n, finish

    async def _completion_stream(self, rid: str, gens: list, echo: list[str] | None, n_prompt: int,
                                 include_usage: bool) -> AsyncIterator[str]:
        created = now()
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen) -> None:
            try:
                async for out in gen:
                    await queue.put((i, out))
            except Exception as e:
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        def chunk(i: int, text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}]}

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        n_tokens, live = 0, len(gens)
        try:
            if echo:
                for i, t in enumerate(echo):
                    yield _sse(chunk(i, t, None))
            while live:
                i, item = await queue.get()
                if item is None:
                    live -= 1
                    continue
                if isinstance(item, Exception):
                    yield _sse({"error": {"message": str(item), "type": "internal_error", "param": None,
                                          "code": None}})
                    continue
                c = item.outputs[0]
                n_tokens += len(c.token_ids)
                if c.text or c.finish_reason is not None:
                    yield _sse(chunk(i, c.text, c.finish_reason))
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                            "choices": [], "usage": _usage(n_prompt, n_tokens)})
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for g in gens:
                await g.aclose()
        yield "data: [DONE]\n\n"

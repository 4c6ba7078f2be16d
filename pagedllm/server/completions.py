"""``POST /v1/completions`` (OpenAI's legacy Completions): one or many prompts, ``n`` samples
each, ``echo`` and the legacy logprobs format, answered whole or streamed."""

from __future__ import annotations

from typing import AsyncIterator

from pagedllm.engine.detokenizer import token_texts
from pagedllm.server.base import Choice, OpenAIServingBase, Prepared, error_event, sse
from pagedllm.server.errors import APIError
from pagedllm.server.guards import check_choices
from pagedllm.server.logprobs import completion_logprobs, prompt_logprobs_out, tokens_length
from pagedllm.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo, now, random_id
from pagedllm.server.structured import structured_request


class OpenAIServingCompletion(OpenAIServingBase):
    """Builds completion requests, runs them and formats the answers (``ctx``: a ``ServingContext``)."""

    async def completion(self, body: CompletionRequest):
        """Run a (possibly multi-prompt, possibly ``n``-sample) completion; dict or SSE iterator.

        Raises:
            APIError: 400 for invalid input, 404 for another model, 429 when overloaded.
            EngineDeadError: the engine is down (answered 503).
        """
        lora = self.ctx.check_model(body.model)
        self.ctx.check_generates()
        params = self.params(body)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt: must not be empty", "prompt", code="invalid_value")
        n = params.n
        check_choices(len(prompts), n)
        structured = structured_request(body)
        rename = structured.rename if structured is not None else (lambda param, msg: (param, msg))
        if structured is not None:
            params.structured_outputs = structured.params
        rid = f"cmpl-{body.request_id}" if body.request_id else random_id("cmpl")

        def prepare() -> Prepared:  # on the tokenizer thread; extra: the echo text of each choice
            ids = [self.ctx.encode(p, "prompt", body.add_special_tokens) if isinstance(p, str) else p for p in prompts]
            reqs = self.fan_out(rid, ids, params, "prompt", body.cache_salt, rename, lora)
            echo = [(p if isinstance(p, str) else self.tokenizer.decode(p)) if body.echo else None
                    for p in prompts for _ in range(n)]
            return Prepared(reqs, echo)

        def n_prompt(prep: Prepared) -> int:
            return sum(r.num_prompt_tokens for r in prep.requests[::n])

        def stream_of(prep: Prepared, merged) -> AsyncIterator[str]:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._completion_stream(rid, merged, prep, body, n_prompt(prep), include_usage)


        def respond(prep: Prepared, choices: list[Choice]) -> dict:
            out, n_tokens = [], 0
            for i, c in enumerate(choices):
                if body.echo_only:  # the one sampled token is not part of the answer
                    c.text, c.num_tokens, c.logprobs, c.finish = "", 0, [], "length"
                lps = None
                if body.logprobs is not None:
                    lps = completion_logprobs(c.logprobs, body.logprobs, c.prompt_logprobs if body.echo else None,
                                              first_prompt_text=self._first_token_text(prep, i) if body.echo else "")
                extra = {}
                if body.prompt_logprobs is not None:
                    extra["prompt_logprobs"] = prompt_logprobs_out(c.prompt_logprobs)
                out.append(CompletionChoice(index=i, text=(prep.extra[i] or "") + c.text, logprobs=lps,
                                            finish_reason=c.finish, **extra))
                n_tokens += c.num_tokens
            return CompletionResponse(id=rid, created=now(), model=self.shown_model(prep), choices=out,
                                      usage=UsageInfo.of(n_prompt(prep), n_tokens)).model_dump()

        return await self.run(len(prompts) * n, body.stream, prepare, stream_of, respond,
                              params if structured is not None else None, rename)

    def _first_token_text(self, prep: Prepared, i: int) -> str:
        return token_texts(self.tokenizer, prep.requests[i].prompt_token_ids[:1])[0]

    async def _completion_stream(self, rid: str, merged, prep: Prepared, body: CompletionRequest,
                                 n_prompt: int, include_usage: bool) -> AsyncIterator[str]:
        created = now()
        echo = prep.extra
        offsets = [0] * len(echo)   # characters covered by the tokens sent so far per choice (text_offset)
        started = [False] * len(echo)

        opts = body.stream_options  # as vLLM: continuous usage only together with include_usage
        continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)

        def chunk(i: int, text: str, finish: str | None, logprobs=None) -> CompletionResponse:
            # continuous_usage_stats (vLLM's): every chunk carries the usage so far
            extra = {"usage": UsageInfo.of(n_prompt, n_tokens)} if continuous else {}
            return CompletionResponse(id=rid, created=created, model=self.shown_model(prep), choices=[
                CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=finish)], **extra)

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
                    first = self._first_token_text(prep, i) if prompt_lps else ""
                    lps = completion_logprobs(lp_list, body.logprobs, prompt_lps, offsets[i], first)
                if lps is not None:
                    offsets[i] += tokens_length(lps)  # offsets follow the tokens, which may lag the text
                if text or lps or finish is not None:
                    yield sse(chunk(i, text, finish, lps))
            if include_usage:
                yield sse(CompletionResponse(id=rid, created=created, model=self.shown_model(prep), choices=[],
                                             usage=UsageInfo.of(n_prompt, n_tokens)))
        except Exception as e:
            yield error_event(e)
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"

"""What the OpenAI endpoints share: validation, the tokenizer thread, fan-out of choices,
admission, merging the choices' outputs, and error mapping.

Every choice is its own engine request: ``n`` samples of each prompt become ``n`` requests
that share the prompt's KV blocks through the prefix cache. Choice ``i * n + j`` is sample
``j`` of prompt ``i`` (OpenAI's and vLLM's order). Their delta outputs are merged into one
stream or one response.
"""

from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from pydantic import BaseModel

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.engine.processor import PromptTooLongError
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParamError, SamplingParams
from pagedllm.server.errors import APIError
from pagedllm.server.guards import AdmissionControl, RejectionCounter
from pagedllm.server.lora_adapters import LoRAAdapters


def sse(body: BaseModel | dict) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    obj = body.model_dump() if isinstance(body, BaseModel) else body
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def error_event(e: BaseException) -> str:
    """The in-band error event of a stream whose 200 headers are already sent (as vLLM does)."""
    return sse({"error": {"message": str(e), "type": "internal_error", "param": None, "code": None}})


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


class Choice:
    """Accumulates one choice's delta outputs (non-streaming): text, token count, logprobs."""

    def __init__(self) -> None:
        self.text, self.num_tokens, self.finish = "", 0, None
        self.stop_reason = None
        self.logprobs: list = []
        self.prompt_logprobs = None

    def add(self, out: RequestOutput) -> None:
        """Append one delta output of this choice's request."""
        c = out.outputs[0]
        self.text += c.text
        self.num_tokens += len(c.token_ids)
        self.finish = c.finish_reason
        self.stop_reason = c.stop_reason
        self.logprobs += c.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs


class HeldStream:
    """An SSE line iterator that holds its request's admission slots until it is closed.

    The response always closes its body iterator, even one that never started (whose
    ``finally`` would never run), so the slots cannot leak. ``source``, the outputs ``gen`` reads
    when they were already started (a constrained stream awaits its first output before its 200),
    is closed too, so that its engine requests are aborted even if ``gen`` never started.
    """

    def __init__(self, gen: AsyncIterator[str], admission, source=None) -> None:
        self._gen, self._admission = gen, admission
        self._source = source  # the outputs ``gen`` reads, when already started (closed here too)

    def __aiter__(self) -> "HeldStream":
        return self

    async def __anext__(self) -> str:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        """Close the stream (aborting its engine requests) and release the slots."""
        try:
            await self._gen.aclose()
            if self._source is not None:
                await self._source.aclose()
        finally:
            self._admission.release()


class Peeked:
    """An async iterator over ``first`` and then the rest of ``rest``; closing it closes ``rest``
    (also before it is iterated)."""

    def __init__(self, first, rest) -> None:
        self._first, self._rest = [first], rest

    def __aiter__(self) -> "Peeked":
        return self

    async def __anext__(self):
        if self._first:
            return self._first.pop()
        return await self._rest.__anext__()

    async def aclose(self) -> None:
        """Close ``rest``."""
        self._first = []
        await self._rest.aclose()


def _same(param, message):
    return param, message


@dataclass
class Prepared:
    """A request body turned into engine requests (on the tokenizer thread).

    Attributes:
        requests: one engine request per choice, in choice order.
        extra: what the endpoint needs besides (rendered text, echo texts, ...).
    """

    requests: list
    extra: object = None


class ServingContext:
    """What every endpoint shares: the engine, the served name, admission control and the one
    tokenizer thread.

    Tokenizing, chat-template rendering and detokenizing client input run on that thread
    (``offload``), never on the event loop, so a large prompt delays no other connection; a
    prompt text longer than ``max_prompt_chars`` is refused before tokenizing. Structured-output
    constraints are checked on a thread of their own (``check_constraint``), which only requests
    with a constraint wait for.

    Args:
        llm: the async engine.
        model_name: the served model name (requests naming another get 404).
        admission: the bound on engine requests in flight (default: unbounded).
    """

    def __init__(self, llm: AsyncLLM, model_name: str, admission: AdmissionControl | None = None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.admission = admission or AdmissionControl(None, RejectionCounter())
        # one thread: a fast tokenizer is not safe to use from several threads at once
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenize")
        # grammar checks wait on the validator's child process (up to its timeout): never on the
        # tokenizer thread, which every request waits for
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar-check")
        self.tokenizer = llm.tokenizer
        self.defaults = llm.default_sampling_fields()
        self.context_limit = llm.context_limit
        self.max_model_len = llm.max_model_len
        self.model_dir = llm.model_dir
        # LoRA adapters served by name (--lora-modules, /v1/load_lora_adapter): server/lora_adapters.py
        self.adapters = LoRAAdapters(model_name, getattr(llm, "lora_checker", None))
        # no token decodes to more characters than its vocabulary string has (byte-level BPE: one
        # character per byte; sentencepiece: one per character), so a longer text cannot fit
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = self.context_limit * max(longest, 1)

    async def offload(self, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the tokenizer thread and await its result (or exception)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def check_constraint(self, params: SamplingParams, rename=_same) -> None:
        """Check ``params``' structured-output constraint on the grammar-check thread: its bounds,
        then a compile and first mask in the validator's child process, with a timeout
        (``AsyncLLM.check_structured_outputs``). Requests without a constraint never wait for it.

        Args:
            params: sampling parameters with ``structured_outputs`` set.
            rename: ``(param, message)`` -> the same in the request's names (``response_format...``).
        Raises:
            APIError: 400 naming the field the request used, for a constraint too large, too deep
                or too complex, or one that does not compile.
        """
        check = getattr(self.llm, "check_structured_outputs", None)
        if check is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(self._grammar_pool, check, params)
        except SamplingParamError as e:
            param, message = rename(e.param, str(e))
            raise APIError(400, message, param, code="invalid_value") from None

    def check_prompt_chars(self, text: str, param: str) -> None:
        """Refuse, before tokenizing, a text too long to fit the context whatever its tokens.

        Raises:
            APIError: 400 with code ``context_length_exceeded`` naming ``param``.
        """
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"{param}: {len(text)} characters cannot fit this model's maximum context "
                           f"length of {self.context_limit} tokens (at most {self.max_prompt_chars} "
                           f"characters)", param, code="context_length_exceeded")

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a client text, after ``check_prompt_chars`` (call through ``offload``)."""
        self.check_prompt_chars(text, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def model_list(self) -> dict:
        """The served model, in the OpenAI ``/v1/models`` list shape (``max_model_len`` in tokens)."""
        from pagedllm.server.protocol import now
        created = now()
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": created,
                                            "owned_by": "pagedllm", "root": self.model_dir, "parent": None,
                                            "max_model_len": self.max_model_len}]
                + self.adapters.cards(created, self.max_model_len)}

    def serves(self, model: str) -> bool:
        """True when ``model`` names the served model or one of its LoRA adapters (case-insensitively)."""
        return model.casefold() == self.model_name.casefold() or self.adapters.get(model) is not None

    def check_model(self, model: str | None) -> LoRARequest | None:
        """Raises ``APIError`` 404 when the request names a model we do not serve, and
        ``EngineDeadError`` (answered 503) when the engine loop has died, so that
        a stream is refused before its 200 headers go out. The name matches case-insensitively,
        so the alias a model was started with (``all-minilm-l6-v2``) names its display name
        (``all-MiniLM-L6-v2``) too. Returns the adapter a name of a LoRA adapter names (``None``: the
        base model)."""
        if not self.llm.is_healthy:
            raise EngineDeadError("engine is not running")
        if model is not None and not self.serves(model):
            raise APIError(404, f"The model `{model}` does not exist.", "model", code="model_not_found")
        return None if model is None else self.adapters.get(model)


    def check_generates(self) -> None:
        """Refuse text generation on a model served for pooling.

        Raises:
            APIError: 400 naming the model and the endpoints it does serve.
        """
        if getattr(self.llm, "is_pooling_model", False):
            answers = ("/score, /rerank and /classify (a cross-encoder)" if getattr(self.llm, "is_cross_encoder", False)
                       else "/v1/embeddings, /pooling, /score and /rerank")
            raise APIError(400, f"The model `{self.model_name}` is served for pooling (--runner pooling): it "
                           f"answers {answers}, not text generation", "model", code="model_not_supported")


class OpenAIServingBase:
    """Base of the chat and completions handlers: sampling parameters, fan-out, the run.

    Args:
        ctx: the shared ``ServingContext``.
    """

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.llm, self.model_name, self.tokenizer = ctx.llm, ctx.model_name, ctx.tokenizer

    def params(self, body) -> SamplingParams:
        """The body's ``SamplingParams`` (model defaults for fields left out).

        Raises:
            APIError: 400 naming the field.
        """
        try:
            return body.to_sampling_params(self.ctx.defaults)
        except SamplingParamError as e:
            raise APIError(400, str(e), e.param, code="invalid_value") from None

    def shown_model(self, prep) -> str:
        """The ``model`` a response names: the adapter's name for requests run with one (vLLM's), else
        the served model's."""
        lora = getattr(prep.requests[0], "lora_request", None) if prep.requests else None
        return self.model_name if lora is None else lora.lora_name

    def _make(self, rid: str, prompt, params, prompt_param: str, cache_salt: str | None, rename, lora=None):
        try:
            if lora is None:  # (engines without adapters take no lora_request)
                return self.llm.make_request(rid, prompt, params, cache_salt)
            return self.llm.make_request(rid, prompt, params, cache_salt, lora_request=lora)
        except PromptTooLongError as e:  # OpenAI's code for this case
            param, msg = rename(prompt_param if e.param == "prompt" else e.param, str(e))
            raise APIError(400, msg, param, code="context_length_exceeded") from None
        except SamplingParamError as e:  # the prompt's fields (its media too) are the request's prompt field
            text = str(e)
            if e.param == "multi_modal_data" and text.startswith("multi_modal_data"):  # the offline API's name
                text = prompt_param + text[len("multi_modal_data"):]
            param, msg = rename(prompt_param if e.param in ("prompt", "multi_modal_data") else e.param, text)
            raise APIError(400, msg, param, code="invalid_value") from None
        except ValueError as e:  # the adapter the model field names no longer reads (its directory changed)
            if lora is None:
                raise
            raise APIError(400, f"model: adapter {lora.lora_name!r}: {e}", "model", code="invalid_value") from None

    def fan_out(self, rid: str, prompts: list[list[int]], params: SamplingParams, prompt_param: str,
                cache_salt: str | None, rename=lambda param, msg: (param, msg), lora=None) -> list:
        """One engine request per (prompt, sample), all validated before any is submitted.

        ``rename(param, message)`` maps an error's field to the name the request used; ``lora``: the
        LoRA adapter the request's ``model`` names (``ServingContext.check_model``), or ``None``.

        Raises:
            APIError: 400 for a prompt too long or a value out of range.
        """
        reqs = []
        for i, p in enumerate(prompts):
            for j in range(params.n):
                cid = rid if len(prompts) == 1 and params.n == 1 else f"{rid}-{i * params.n + j}"
                reqs.append(self._make(cid, p, params.child(j), prompt_param, cache_salt, rename, lora))
        return reqs

    async def run(self, num_choices: int, stream: bool, prepare: Callable[[], Prepared],
                  stream_of: Callable[[Prepared, AsyncIterator], AsyncIterator[str]],
                  respond: Callable[[Prepared, list[Choice]], dict], constraint: SamplingParams | None = None,
                  rename=_same):
        """Admit ``num_choices`` engine requests, ``prepare`` them on the tokenizer thread, run them.

        With ``constraint`` (the parameters, when they carry structured outputs) its grammar is
        checked first, off the tokenizer thread (``ServingContext.check_constraint``), and a stream
        waits for its first output before its 200 goes out, so that a grammar that still fails in
        the core is a 400 too. ``rename`` puts errors in the request's names.

        Returns:
            A ``HeldStream`` of SSE lines (``stream``) or the ``respond``-built body.
        Raises:
            APIError: 429 past the queue limit, 400 for a constraint refused or failed in the core
                (naming the request's field), or what ``prepare`` raises.
        """
        admission = self.ctx.admission.admit(num_choices)
        try:
            if constraint is not None:
                await self.ctx.check_constraint(constraint, rename)
            prepared = await self.ctx.offload(prepare)
            merged = merge_outputs([self.llm.generate(r) for r in prepared.requests])
            if stream:
                if constraint is None:
                    return HeldStream(stream_of(prepared, merged), admission)
                merged = await self._first_output(merged, constraint, rename)
                return HeldStream(stream_of(prepared, merged), admission, merged)
            choices = [Choice() for _ in prepared.requests]
            async for i, out in merged:
                choices[i].add(out)
        except BaseException:
            admission.release()
            raise
        admission.release()
        failed = next((c for c in choices if c.finish == "error"), None)
        if failed is not None:  # the request's grammar failed in the core: its fault, only its own
            raise _grammar_failure(constraint, failed.stop_reason, rename)
        return respond(prepared, choices)

    async def _first_output(self, merged, constraint: SamplingParams, rename) -> Peeked:
        """``merged`` once its first output is in; raises the 400 of a grammar that failed in the core."""
        try:
            first = await merged.__anext__()
        except StopAsyncIteration:
            return merged
        except BaseException:
            await merged.aclose()
            raise
        c = first[1].outputs[0]
        if c.finish_reason == "error":
            await merged.aclose()
            raise _grammar_failure(constraint, c.stop_reason, rename)
        return Peeked(first, merged)


def _grammar_failure(constraint: SamplingParams | None, reason, rename) -> APIError:
    """The 400 of a request whose grammar failed in the core, naming the field the request used."""
    so = constraint.structured_outputs if constraint is not None else None
    param = so.param if so is not None else "structured_outputs"
    param, message = rename(param, f"{param}: {reason}")
    return APIError(400, message, param, code="invalid_value")

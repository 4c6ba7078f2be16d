"""``POST /v1/embeddings`` (OpenAI's embeddings API reference) and ``POST /pooling`` (vLLM's pooling API).

Each input is its own engine pooling request; all of them are validated on the tokenizer thread
before any is submitted, then run together (one batch of the scheduler, under its token budget)
and answered in input order. ``encoding_format: base64`` gives each vector as the base64 of its
little-endian float32 bytes, which the openai SDK decodes with ``numpy.frombuffer``.
"""

from __future__ import annotations

import base64

import numpy as np

from pagedllm.engine.processor import PromptTooLongError
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParamError
from pagedllm.server.base import ServingContext, merge_outputs
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import now, random_id
from pagedllm.server.protocol_pooling import EmbeddingRequest, PoolingRequest

MAX_INPUTS = 2048  # OpenAI's limit of inputs per embeddings request


def check_pooling_model(ctx: ServingContext, what: str) -> None:
    """Refuse a pooling endpoint on a generation model.

    Raises:
        APIError: 400 naming the served model and ``--runner pooling``.
    """
    if not ctx.llm.is_pooling_model:
        raise APIError(400, f"The model `{ctx.model_name}` serves text generation, not {what}: start it with "
                       f"--runner pooling (vLLM: --task embed) to serve {what}", "model", code="model_not_supported")


async def embed_inputs(ctx: ServingContext, rid: str, inputs: list[str | list[int]], params: PoolingParams,
                       param: str = "input") -> list[PoolingRequestOutput]:
    """Run one pooling request per input and return their outputs in input order.

    Args:
        ctx: the serving context.
        rid: the base request id (input ``i`` runs as ``{rid}-{i}``).
        inputs: texts or token-id lists.
        params: the pooling parameters of all of them.
        param: the request field the inputs came from, for errors.
    Raises:
        APIError: 400 for an empty or over-long input (naming ``param`` and the limit) or a bad
            parameter; 429 when the server is full.
    """
    if not inputs:
        raise APIError(400, f"{param}: must not be empty", param, code="invalid_value")
    for i, p in enumerate(inputs):
        if isinstance(p, str):
            ctx.check_prompt_chars(p, param if len(inputs) == 1 else f"{param}[{i}]")
    return await run_pooling(ctx, [(lambda p=p, i=i: ctx.llm.make_pooling_request(f"{rid}-{i}", p, params),
                                    p if isinstance(p, str) else None) for i, p in enumerate(inputs)], param)


async def run_pooling(ctx: ServingContext, makers: list, param: str,
                      fields: dict | None = None) -> list[PoolingRequestOutput]:
    """Build every pooling request on the tokenizer thread (all validated before any is
    submitted), run them together and return their outputs in order.

    Args:
        makers: ``(make, prompt text or None)`` per request; ``make()`` builds its ``EngineCoreRequest``.
        param: the request field the inputs came from (request ``i`` of several is ``param[i]``).
        fields: for pairs, the processor's ``text_1`` / ``text_2`` -> a function of ``i`` naming the
            body's field (``/rerank``: ``query`` and ``documents[i]``).
    Raises:
        APIError: 400 naming the field for what the makers refuse; 429 when the server is full.
    """
    if len(makers) > MAX_INPUTS:
        raise APIError(400, f"{param}: at most {MAX_INPUTS} inputs per request, got {len(makers)}", param,
                       code="invalid_value")

    def prepare() -> list:
        reqs = []
        for i, (make, _) in enumerate(makers):
            where = param if len(makers) == 1 else f"{param}[{i}]"
            try:
                reqs.append(make())
            except PromptTooLongError as e:
                if fields and e.param in fields:
                    where = fields[e.param](i)
                raise APIError(400, f"{where}: {e}", where, code="context_length_exceeded") from None
            except SamplingParamError as e:
                if fields and e.param in fields:
                    where = fields[e.param](i)
                own = e.param in ("input", param) or bool(fields and e.param in fields)  # the input, not a parameter
                msg = str(e).replace(f"{e.param}:", f"{where}:", 1) if own else str(e)
                raise APIError(400, msg, where if own else e.param, code="invalid_value") from None
        return reqs

    with ctx.admission.admit(len(makers)):
        reqs = await ctx.offload(prepare)
        results: list[PoolingRequestOutput | None] = [None] * len(reqs)
        async for i, out in merge_outputs([ctx.llm.generate(r, t) for r, (_, t) in zip(reqs, makers)]):
            results[i] = out
    return results


def encode_vector(vec: list[float], encoding_format: str) -> list[float] | str:
    """A vector as JSON numbers (``float``) or base64 of its little-endian float32 bytes (``base64``)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec


def usage(outputs: list[PoolingRequestOutput]) -> dict:
    """OpenAI's embeddings ``usage``: the inputs' tokens."""
    n = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


class OpenAIServingEmbedding:
    """``/v1/embeddings`` and ``/pooling`` (``ctx``: a ``ServingContext``)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def embeddings(self, body: EmbeddingRequest) -> dict:
        """OpenAI's embeddings response: ``{"object": "list", "data": [{"object": "embedding", "index",
        "embedding"}], "model", "usage"}``.

        Raises:
            APIError: 400 (generation model, empty or over-long input, bad ``dimensions``), 404, 429.
        """
        self.ctx.check_model(body.model)
        check_pooling_model(self.ctx, "embeddings")
        outs = await embed_inputs(self.ctx, random_id("embd"), body.inputs(), body.pooling_params())
        data = [{"object": "embedding", "index": i, "embedding": encode_vector(o.outputs.data, body.encoding_format)}
                for i, o in enumerate(outs)]
        return {"id": random_id("embd"), "object": "list", "created": now(), "model": self.ctx.model_name,
                "data": data, "usage": usage(outs)}

    async def pooling(self, body: PoolingRequest) -> dict:
        """vLLM's ``/pooling`` response: ``data`` of ``{"object": "pooling", "index", "data"}``.

        Raises:
            APIError: as ``embeddings``.
        """
        self.ctx.check_model(body.model)
        check_pooling_model(self.ctx, "pooling")
        outs = await embed_inputs(self.ctx, random_id("pool"), body.inputs(), body.pooling_params())
        data = [{"object": "pooling", "index": i, "data": encode_vector(o.outputs.data, body.encoding_format)}
                for i, o in enumerate(outs)]
        return {"id": random_id("pool"), "object": "list", "created": now(), "model": self.ctx.model_name,
                "data": data, "usage": usage(outs)}

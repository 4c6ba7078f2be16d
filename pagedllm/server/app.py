"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` answers with server-sent events
ending in ``data: [DONE]``), ``POST /v1/embeddings`` (a pooling model), following the OpenAI
API reference; vLLM's ``POST /pooling``, ``/score``, ``/rerank`` and ``/classify`` (``server/embeddings.py``,
``server/score.py``); as vLLM's
server, ``GET /metrics`` (Prometheus text format, see ``server.metrics``),
``GET /version``, ``POST /tokenize`` and ``POST /detokenize``; and, for
debugging and tests, ``GET /stats`` with the engine counters of
``LLMEngine.get_stats`` as JSON (not part of the OpenAI API).

A request whose client disconnects is aborted, streamed or not, so its KV
blocks go back to the pool. ``server.guards`` bounds what one client can cost:
body size (413), choices per request (400), requests in flight (429 with
``Retry-After``); tokenizing and template rendering run off the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import uuid
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers

import pagedllm
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.server import anthropic, defaults, responses
from pagedllm.server.errors import APIError
from pagedllm.server.guards import (AdmissionControl, BodySizeLimitMiddleware, CatchAllMiddleware, IdleTrimMiddleware,
                                    RejectionCounter)
from pagedllm.server.handlers import install_error_handlers
from pagedllm.server.json_depth import JSONDepthMiddleware, check_json_texts
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.openapi import install_openapi
from pagedllm.server.base import ServingContext
from pagedllm.server.chat import OpenAIServingChat
from pagedllm.server.completions import OpenAIServingCompletion
from pagedllm.server.embeddings import OpenAIServingEmbedding
from pagedllm.server.protocol_pooling import (ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest,
                                              ScoreRequest)
from pagedllm.server.score import ServingScores
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.server.protocol_extra import DetokenizeRequest, TokenizeRequest
from pagedllm.server.tokenize import OpenAIServingTokenization
from pagedllm.server.webpage import UI_PREFIX, add_web_page

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its generator, so that the engine
    request is aborted at once when the client goes away mid-stream (rather than
    whenever the abandoned generator is garbage-collected)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _unless_disconnected(request: Request, coro):
    """Await ``coro``; cancel it (aborting its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                logger.info("client disconnected; aborting %s", request.url.path)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)  # nobody reads it
    finally:
        if not task.done():
            task.cancel()


# Paths that stay open with --api-key: each answers from state the server already has, with
# work bounded whatever the request holds (the OpenAPI schema is built once and cached).
# Everything else, /tokenize and /detokenize included (they run the tokenizer and the chat
# template on client input), needs the key; a new route is guarded unless listed here.
OPEN_PATHS = frozenset({"/", "/health", "/ping", "/version", "/metrics", "/stats", "/openapi.json"})


class _RequestIdMiddleware:
    """ASGI middleware: every response carries ``x-request-id``, the client's own when it sent
    one (vLLM echoes it the same way), else a fresh uuid4 hex, so a log line and a client's
    report can be matched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        """Pass the request on, adding the header to the response's start."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex
        # echo only what is safe to put back in a header: printable ASCII, bounded
        if len(rid) > 256 or not rid.isascii() or not rid.isprintable():
            rid = uuid.uuid4().hex

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


class _APIKeyMiddleware:
    """ASGI middleware: every path but ``OPEN_PATHS`` needs ``Authorization: Bearer <api_key>``.

    Anything else answers 401 with the error body of the path's API (OpenAI's, code
    ``invalid_api_key`` for a wrong key, as OpenAI does; Anthropic's under ``/v1/messages``).
    ``OPEN_PATHS`` and ``OPTIONS`` requests (CORS preflights carry no credentials) pass
    untouched. vLLM guards only ``/v1``; pagedllm guards by default, so that no open route
    can be made to tokenize or render arbitrary input.
    Pure ASGI rather than ``BaseHTTPMiddleware``, which would get between
    the handlers and ``request.is_disconnected()``.

    Args:
        app: the wrapped ASGI app.
        api_key: the accepted key, or several (each non-empty). A request let through carries its key's
            sha256 (hex) as ``request.state.api_key_owner``: the owner of the Responses it stores.
    """

    def __init__(self, app, api_key: str | Sequence[str]) -> None:
        self.app = app
        # compare digests in constant time: the key's length and prefix do not leak through timing
        self._digests = [hashlib.sha256(k.encode()).digest() for k in ([api_key] if isinstance(api_key, str)
                                                                         else api_key)]

    @staticmethod
    def _guarded(scope) -> bool:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # a server mounted under a prefix guards its own paths
            path = path[len(root):]
        return path not in OPEN_PATHS and not path.startswith(UI_PREFIX)

    async def __call__(self, scope, receive, send) -> None:
        """Pass the request on, or answer 401 itself."""
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self._guarded(scope):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" and headers.get("x-api-key"):  # Anthropic's SDKs send the key so
            scheme, key = "bearer", headers["x-api-key"]
        if scheme.lower() != "bearer" or not key.strip():
            err = APIError(401, "You didn't provide an API key. You need to provide your API key in an "
                           "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)"
                           " or in an x-api-key header.")
        elif not any([secrets.compare_digest(hashlib.sha256(key.strip().encode()).digest(), d)
                      for d in self._digests]):  # a list: every key is compared, whichever matches
            err = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        else:
            scope.setdefault("state", {})["api_key_owner"] = hashlib.sha256(key.strip().encode()).hexdigest()
            await self.app(scope, receive, send)
            return
        resp = err.response_for(scope)
        resp.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750: a 401 names the scheme it wants
        await resp(scope, receive, send)


def build_app(llm: AsyncLLM, model_name: str, chat_template: str | None = None, *,
              api_key: str | Sequence[str] | None = None, allowed_origins: Sequence[str] = ("*",),
              allowed_methods: Sequence[str] = ("*",), allowed_headers: Sequence[str] = ("*",),
              allow_credentials: bool = False, reasoning_parser: str | None = None,
              tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
              max_request_body_bytes: int = defaults.MAX_REQUEST_BODY_BYTES,
              max_waiting_requests: int | None = defaults.MAX_WAITING_REQUESTS) -> FastAPI:
    """Create the FastAPI application around a running ``AsyncLLM``.

    Args:
        llm: the engine front door.
        model_name: the name clients must use in ``model`` (or omit).
        chat_template: optional Jinja chat template overriding the tokenizer's.
        api_key: when set (non-empty), every path except ``OPEN_PATHS`` (``/health``,
            ``/version``, ``/metrics``, ``/stats``, the OpenAPI schema and its pages)
            requires ``Authorization: Bearer <api_key>`` and answers 401 otherwise (OpenAI's
            error body; Anthropic's under ``/v1/messages``). Several keys: any of them; stored
            Responses are then scoped to the key that made them.
        allowed_origins, allowed_methods, allowed_headers, allow_credentials:
            the CORS policy (``CORSMiddleware`` options, vLLM's ``--allowed-*`` flags).
        reasoning_parser, tool_call_parser, enable_auto_tool_choice: how chat outputs are
            split into reasoning, content and tool calls (see ``OpenAIServing``).
        max_request_body_bytes: larger bodies get 413 (``--max-request-body-bytes``).
        max_waiting_requests: engine requests that may wait beyond ``max_num_seqs`` running
            ones before requests get 429 (``--max-waiting-requests``; ``None``: no bound).
    """
    # no /docs or /redoc: FastAPI's pages load their scripts from a CDN, blank on an offline
    # machine; /openapi.json is served, for any OpenAPI viewer
    app = FastAPI(title="pagedllm", version=pagedllm.__version__, docs_url=None, redoc_url=None)
    rejections = RejectionCounter()
    max_in_flight = None if max_waiting_requests is None else llm.max_num_seqs + max_waiting_requests
    ctx = ServingContext(llm, model_name, AdmissionControl(max_in_flight, rejections))
    chat_serving = OpenAIServingChat(ctx, chat_template, reasoning_parser, tool_call_parser, enable_auto_tool_choice)
    completion_serving = OpenAIServingCompletion(ctx)
    embedding_serving, score_serving = OpenAIServingEmbedding(ctx), ServingScores(ctx)
    tokenization = OpenAIServingTokenization(ctx, chat_serving)
    metrics = ServerMetrics(llm, model_name, rejections)
    app.state.llm = llm
    app.state.metrics = metrics
    app.state.admission = ctx.admission  # for tests: requests in flight must come back to 0
    add_web_page(app)
    # innermost first: the catch-all sees what the routes raise; the body limit runs before any
    # handler reads a byte; the key check before that, so that an unknown client costs nothing
    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(JSONDepthMiddleware)  # inside the size limit, which bounds what it reads
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes, rejections=rejections)
    app.add_middleware(IdleTrimMiddleware)  # idle again after a burst: give the freed heap back
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    # added last, so outermost: 401 answers carry CORS headers too (a browser client
    # can then read the error), and preflights are answered before the key check
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                       allow_headers=list(allowed_headers), allow_credentials=allow_credentials)
    app.add_middleware(_RequestIdMiddleware)  # outermost: every answer carries the id, 401s and 413s too

    install_error_handlers(app)  # every error in its path's API shape (OpenAI's, or Anthropic's)
    install_openapi(app)

    # one route per method: each operation has its own OpenAPI operation id
    @app.get("/health")
    @app.head("/health")
    async def health() -> Response:
        """200 while the engine loop runs, 503 once it has died (with data parallelism: 200 while
        any replica lives; ``/stats``'s ``replicas`` tells which are dead)."""
        return Response(status_code=200 if llm.is_healthy else 503)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        """``/health`` under the name load balancers and SageMaker probe (vLLM serves both)."""
        return Response(status_code=200 if llm.is_healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        """The served model, in the OpenAI ``/v1/models`` list shape (``max_model_len`` in tokens)."""
        return ctx.model_list()

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict:
        """One model's card (the openai SDK's ``models.retrieve``); 404 for a model not served."""
        card = next((m for m in ctx.model_list()["data"] if ctx.serves(model_id)), None)
        if card is None:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model", code="model_not_found")
        return card

    @app.get("/stats")
    async def stats() -> dict:
        """Debugging aid: the engine counters as of the last step (see ``LLMEngine.get_stats``); with
        data parallelism they are summed over the replicas and ``replicas`` lists each one's."""
        out = llm.get_stats().to_dict()
        replicas = llm.replica_stats()
        if replicas:
            out["replicas"] = replicas
        return out

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text format (0.0.4) of ``ServerMetrics``: engine gauges and counters, latency histograms."""
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/version")
    async def version() -> dict:
        """``{"version": pagedllm.__version__}``."""
        return {"version": pagedllm.__version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """Token ids of a prompt, or of a conversation rendered as ``/v1/chat/completions`` renders it
        (vLLM's shape; see ``OpenAIServingTokenization.tokenize``)."""
        check_json_texts(body)
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        """``{"prompt": text}`` of token ids, special tokens included (vLLM's shape)."""
        return await tokenization.detokenize(body)

    async def respond(request: Request, coro):
        result = await _unless_disconnected(request, coro)
        if isinstance(result, Response):
            return result
        if isinstance(result, dict):
            return JSONResponse(result)
        return _SSEResponse(result, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        """OpenAI Chat Completions; SSE when ``stream`` is true. 400/404/503 as OpenAI error bodies."""
        check_json_texts(body)
        return await respond(request, chat_serving.chat(body))

    async def anthropic_call(request: Request, run):
        """Run an Anthropic endpoint on its JSON body (read here, so that its errors, answered in
        Anthropic's shape by the handlers, are its own: no FastAPI 422)."""
        try:
            raw = await request.json()
        except ValueError:
            raise APIError(400, "the request body must be a JSON object") from None
        return await run(raw)

    @app.post("/v1/messages")
    async def messages(request: Request):
        """Anthropic's Messages API over the chat handler (``server/anthropic.py``); SSE with ``stream``."""
        async def run(raw):
            body = anthropic.to_chat(anthropic.parse(raw))
            result = await _unless_disconnected(request, chat_serving.chat(body))
            if isinstance(result, Response):
                return result
            if isinstance(result, dict):
                return JSONResponse(anthropic.message_of(result, model_name))
            return _SSEResponse(anthropic.stream_of(result, model_name), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await anthropic_call(request, run)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """``{"input_tokens": n}``: the prompt a Messages request would have, rendered as chat renders it."""
        async def run(raw):
            body = anthropic.to_chat(anthropic.parse(raw, anthropic.CountTokensRequest))
            ctx.check_model(body.model)
            ids = await ctx.offload(lambda: chat_serving.render_chat(body))
            return JSONResponse({"input_tokens": len(ids)})
        return await anthropic_call(request, run)

    response_store = responses.ResponseStore()

    @app.post("/v1/responses")
    async def create_response(body: responses.ResponsesRequest, request: Request):
        """OpenAI's Responses API over the chat handler (``server/responses.py``); SSE with ``stream``."""
        check_json_texts(body)
        history: list[dict] = []
        owner = getattr(request.state, "api_key_owner", None)  # None without --api-key: one shared store
        if body.previous_response_id is not None:
            found = response_store.get(body.previous_response_id, owner)
            if found is None:
                raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                               "previous_response_id", code="not_found")
            history = found[1]
        chat_body, conversation = responses.to_chat(body, history)
        result = await _unless_disconnected(request, chat_serving.chat(chat_body))
        if isinstance(result, Response):
            return result
        if isinstance(result, dict):
            return JSONResponse(responses.respond(body, result, conversation, model_name, response_store, owner))
        return _SSEResponse(responses.stream(body, result, conversation, model_name, response_store, owner),
                            media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                     "X-Accel-Buffering": "no"})

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict:
        """A stored response (``store`` was true) of the caller's key; 404 otherwise."""
        found = response_store.get(response_id, getattr(request.state, "api_key_owner", None))
        if found is None:
            raise APIError(404, f"No response with id '{response_id}' found.", "response_id", code="not_found")
        return found[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        """Drop a stored response of the caller's key; 404 when there is none."""
        if not response_store.delete(response_id, getattr(request.state, "api_key_owner", None)):
            raise APIError(404, f"No response with id '{response_id}' found.", "response_id", code="not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI (legacy) Completions; SSE when ``stream`` is true. 400/404/503 as OpenAI error bodies."""
        check_json_texts(body)
        return await respond(request, completion_serving.completion(body))

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        """OpenAI Embeddings (a pooling model: ``--runner pooling`` or an encoder such as BERT)."""
        return await respond(request, embedding_serving.embeddings(body))

    @app.post("/pooling")
    async def pooling(body: PoolingRequest, request: Request):
        """vLLM's pooling API: the pooled vectors of the inputs."""
        return await respond(request, embedding_serving.pooling(body))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request):
        """vLLM's score API: ``text_1`` and ``text_2`` pairs scored by a cross-encoder, or the cosine
        similarity of their embeddings (bi-encoder)."""
        return await respond(request, score_serving.score(body))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, request: Request):
        """vLLM's rerank API (Jina / Cohere shapes): ``documents`` ordered by their score against ``query``."""
        return await respond(request, score_serving.rerank(body))

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: ClassificationRequest, request: Request):
        """vLLM's classification API: a cross-encoder's label probabilities per input."""
        return await respond(request, score_serving.classify(body))

    return app

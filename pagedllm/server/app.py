"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): ``build_app`` assembles it.

Endpoints, one router module per API: OpenAI's ``/v1/models``, ``/v1/chat/completions`` and
``/v1/completions`` (``routes_openai``; ``stream: true`` answers with server-sent events ending in
``data: [DONE]``), OpenAI's Responses API (``routes_responses``), Anthropic's Messages API
(``routes_anthropic``), ``POST /v1/embeddings`` (a pooling model) and vLLM's ``/pooling``,
``/score``, ``/rerank`` and ``/classify`` (``routes_pooling``), OpenAI's ``/v1/audio/transcriptions``
and ``/v1/audio/translations`` for a Whisper model (``routes_audio``), vLLM's ``POST /tokenize`` and
``POST /detokenize`` (``routes_tokenize``), and, as vLLM's server, ``GET /health``, ``/ping``,
``/metrics`` (Prometheus text format, see ``server.metrics``) and ``/version``, with ``GET /stats``
for debugging and tests (``routes_admin``); the web page at ``/`` (``server.webpage``).

A request whose client disconnects is aborted, streamed or not, so its KV blocks go back to the
pool (``server.replies``). ``server.guards`` bounds what one client can cost: body size (413),
choices per request (400), requests in flight (429 with ``Retry-After``); tokenizing and template
rendering run off the event loop. ``server.middleware`` holds the middleware stack and its order.
"""

from __future__ import annotations

from typing import Sequence

from fastapi import FastAPI

import pagedllm
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.server import defaults
from pagedllm.server.base import ServingContext
from pagedllm.server.chat import OpenAIServingChat
from pagedllm.server.guards import AdmissionControl, RejectionCounter
from pagedllm.server.handlers import install_error_handlers
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.middleware import install_middleware
from pagedllm.server.openapi import install_openapi
from pagedllm.server.routes_admin import admin_router
from pagedllm.server.routes_anthropic import anthropic_router
from pagedllm.server.routes_audio import audio_router
from pagedllm.server.routes_lora import lora_router
from pagedllm.server.routes_openai import openai_router
from pagedllm.server.routes_pooling import pooling_router
from pagedllm.server.routes_responses import responses_router
from pagedllm.server.routes_tokenize import tokenize_router
from pagedllm.server.webpage import add_web_page


def build_app(llm: AsyncLLM, model_name: str, chat_template: str | None = None, *,
              api_key: str | Sequence[str] | None = None, allowed_origins: Sequence[str] = ("*",),
              allowed_methods: Sequence[str] = ("*",), allowed_headers: Sequence[str] = ("*",),
              allow_credentials: bool = False, reasoning_parser: str | None = None,
              tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
              max_request_body_bytes: int = defaults.MAX_REQUEST_BODY_BYTES,
              max_waiting_requests: int | None = defaults.MAX_WAITING_REQUESTS,
              lora_modules: Sequence[tuple[str, str]] = ()) -> FastAPI:
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
        lora_modules: ``(name, PEFT directory or .gguf file)`` of each LoRA adapter served by name from the start
            (``--lora-modules``; the engine needs ``enable_lora``).
    Raises:
        ValueError: an adapter of ``lora_modules`` refused (no ``enable_lora``, a taken name, a bad
            directory: the message names why).
    """
    # no /docs or /redoc: FastAPI's pages load their scripts from a CDN, blank on an offline
    # machine; /openapi.json is served, for any OpenAPI viewer
    app = FastAPI(title="pagedllm", version=pagedllm.__version__, docs_url=None, redoc_url=None)
    rejections = RejectionCounter()
    max_in_flight = None if max_waiting_requests is None else llm.max_num_seqs + max_waiting_requests
    ctx = ServingContext(llm, model_name, AdmissionControl(max_in_flight, rejections))
    for name, path in lora_modules:
        ctx.adapters.add(name, path)
    chat = OpenAIServingChat(ctx, chat_template, reasoning_parser, tool_call_parser, enable_auto_tool_choice)
    metrics = ServerMetrics(llm, model_name, rejections)
    app.state.llm = llm
    app.state.metrics = metrics
    app.state.admission = ctx.admission  # for tests: requests in flight must come back to 0
    add_web_page(app)
    install_middleware(app, rejections, max_request_body_bytes=max_request_body_bytes, api_key=api_key,
                       allowed_origins=allowed_origins, allowed_methods=allowed_methods,
                       allowed_headers=allowed_headers, allow_credentials=allow_credentials)
    install_error_handlers(app)  # every error in its path's API shape (OpenAI's, or Anthropic's)
    install_openapi(app)
    for router in (admin_router(llm, metrics), openai_router(ctx, chat), tokenize_router(ctx, chat),
                   anthropic_router(ctx, chat), responses_router(ctx, chat), pooling_router(ctx),
                   audio_router(ctx), lora_router(ctx)):
        app.include_router(router)
    return app

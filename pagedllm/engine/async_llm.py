"""Asynchronous front door to the engine for the server.

Requests go straight to the core through the ``AsyncEngineCoreClient`` that the
``LLMEngine``'s client makes (``make_async``: ``zmq.asyncio`` to a core process or to
data-parallel replicas, or a thread stepping an in-process core); one asyncio task, the output
handler, awaits the core's outputs, runs them through the ``OutputProcessor``
(detokenizing, stop strings) and puts each request's delta ``RequestOutput``s on its
queue. Nothing polls: a request is sent the moment it is made, and outputs are read the
moment they arrive. Concurrent requests share engine steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator

import msgspec

from pagedllm.engine.async_core_client import AsyncEngineCoreClient
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.messages import EngineCoreRequest, EngineDeadError  # noqa: F401  (the server imports it here)
from pagedllm.outputs import RequestOutput
from pagedllm.request import RequestStatus
from pagedllm.stats import SchedulerStats

logger = logging.getLogger(__name__)


class ServerShuttingDownError(RuntimeError):
    """The server's shutdown deadline passed: the request was aborted before it finished."""


class AsyncLLM:
    """Streams outputs of engine requests to coroutines.

    Its output handler runs on the event loop of the first ``generate`` call; requests may
    come from other event loops too (their outputs are handed over thread-safely).

    Args:
        engine: a constructed ``LLMEngine``: its processor, output processor and core are used
            from here on; do not step it yourself.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.client: AsyncEngineCoreClient = engine.client.make_async()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self.errored: BaseException | None = None
        self._stats: SchedulerStats = engine.get_stats()
        self._finished_callbacks: list = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handler: asyncio.Task | None = None

    # what the front end needs to know of the model and the engine, without reaching into it
    @property
    def tokenizer(self):
        """The model's ``transformers`` tokenizer."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The context limit in tokens (prompt + output)."""
        return self.engine.max_model_len

    @property
    def context_limit(self) -> int:
        """Most tokens one request may reach (``max_model_len`` capped by the KV pool)."""
        return self.engine.context_limit

    @property
    def model_dir(self) -> str:
        """The served model's directory."""
        return str(self.engine.model_dir)

    @property
    def max_num_seqs(self) -> int:
        """Most requests the engine runs in one step."""
        return self.engine.args.max_num_seqs

    @property
    def media_policy(self):
        """Where image URLs may point (``Processor.media_policy``)."""
        return self.engine.processor.media_policy

    @property
    def video_placeholder(self) -> str | None:
        """The text standing for one video in a prompt (``Processor.video_placeholder``); ``None``: no video."""
        return self.engine.processor.video_placeholder

    @property
    def audio_placeholder(self) -> str | None:
        """The text standing for one audio clip (``Processor.audio_placeholder``); ``None``: no audio."""
        return self.engine.processor.audio_placeholder

    @property
    def audio_rate(self) -> int | None:
        """Samples per second clips are decoded at (``Processor.audio_rate``)."""
        return self.engine.processor.audio_rate

    @property
    def image_placeholder(self) -> str | None:
        """The text standing for one image in a prompt (``Processor.image_placeholder``); ``None``: text only."""
        return self.engine.processor.image_placeholder

    @property
    def is_pooling_model(self) -> bool:
        """True when the model serves pooling requests (embeddings, score, rerank), not generation."""
        return self.engine.is_pooling_model

    def make_pooling_request(self, request_id: str, prompt, params) -> EngineCoreRequest:
        """Validate and build a pooling request (``LLMEngine.make_pooling_request``); any thread."""
        return self.engine.make_pooling_request(request_id, prompt, params)

    def make_pair_request(self, request_id: str, text_1: str, text_2: str, params) -> EngineCoreRequest:
        """Validate and build a cross-encoder pair request (``LLMEngine.make_pair_request``); any thread."""
        return self.engine.make_pair_request(request_id, text_1, text_2, params)

    @property
    def pooler_config(self):
        """The model's ``PoolerConfig`` (``None``: a generation model)."""
        return self.engine.pooler_config

    @property
    def is_cross_encoder(self) -> bool:
        """True when the model scores pairs with a classification head (``LLMEngine.is_cross_encoder``)."""
        return self.engine.is_cross_encoder

    @property
    def plan(self):
        """The engine plan (``pagedllm/plan.py``): every decision the engine made at start-up."""
        return self.engine.plan

    def default_sampling_fields(self) -> dict:
        """The model's ``generation_config.json`` sampling defaults (``LLMEngine.default_sampling_fields``)."""
        return self.engine.default_sampling_fields()

    @property
    def is_healthy(self) -> bool:
        """True while the output handler and the core run without error."""
        return self.errored is None and self.client.is_alive()

    def get_stats(self) -> SchedulerStats:
        """Engine counters as of the last step."""
        return self._stats

    def replica_stats(self) -> list[dict]:
        """Each data-parallel replica's counters and state (``DPClient.replica_stats``); empty with
        one engine core."""
        return self.client.replica_stats()

    def add_finished_callback(self, fn) -> None:
        """Call ``fn(output)`` on the event loop for every request that finishes (not for
        aborts). ``output.metrics`` is then a ``RequestMetrics`` with its finish time set.
        Exceptions from ``fn`` are logged and ignored."""
        self._finished_callbacks.append(fn)

    def _on_finished(self, out: RequestOutput) -> None:
        for fn in self._finished_callbacks:
            try:
                fn(out)
            except Exception:  # metrics must never take the engine down
                logger.exception("finished-request callback failed")

    def abort_all(self, error: BaseException) -> int:
        """Abort every request in flight; each one's consumer gets ``error`` raised (thread-safe).

        Returns the number of requests aborted.
        """
        with self._lock:
            rids = list(self._streams)
        if rids and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._abort, rids)
        for rid in rids:
            self._deliver(rid, error)
        return len(rids)

    def shutdown(self) -> None:
        """Stop the core (process or thread); pending requests are dropped."""
        if self._handler is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._handler.cancel)
        self.client.shutdown()

    # ---- the output handler (an asyncio task) ---------------------------------------
    def _ensure_handler(self) -> None:
        if self._handler is None:
            self._loop = asyncio.get_running_loop()
            self._handler = self._loop.create_task(self._handle_outputs(), name="pagedllm-output-handler")

    async def _handle_outputs(self) -> None:
        processor = self.engine.output_processor
        try:
            while True:
                core_outputs = await self.client.get_output()
                outputs, stopped = processor.process(core_outputs, delta=True)
                if stopped:
                    self.client.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
                for out in outputs:
                    if out.finished:
                        self._on_finished(out)
                    self._deliver(out.request_id, out)
                for rid, error in self.client.pop_failed_requests().items():  # a dead DP replica's
                    processor.abort(rid)
                    self._deliver(rid, EngineDeadError(error))
                self._stats = self.client.get_stats()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # report to every waiter, never die silently
            if isinstance(e, EngineDeadError):  # the core is gone: its own log has the cause
                logger.error("engine core died: %s", e)
            else:
                logger.exception("output handler crashed")
            # nothing runs or waits any more: gauges must not keep the last step's values
            self._stats = msgspec.structs.replace(self._stats, num_running=0, num_waiting=0, kv_cache_usage=0.0)
            self.errored = e
            with self._lock:
                rids = list(self._streams)
            for rid in rids:
                self._deliver(rid, EngineDeadError(f"engine loop crashed: {e!r}"))

    def _deliver(self, rid: str, item) -> None:
        with self._lock:
            entry = self._streams.get(rid)
        if entry is None:
            return
        loop, q = entry
        _run_on(loop, q.put_nowait, item)

    def _abort(self, rids: list[str]) -> None:
        """On the handler's loop: end requests in the core and drop their front-end state."""
        self.client.abort_requests(rids)
        for rid in rids:
            self.engine.output_processor.abort(rid)

    # ---- asyncio side ---------------------------------------------------------------
    def check_structured_outputs(self, params) -> None:
        """Check a request's structured-output constraint before ``make_request`` (the processor's
        check: bounds, then a compile in the validator's child process, with a timeout); blocking,
        call it from a thread of its own. ``make_request`` then finds the grammar checked.

        Raises:
            SamplingParamError: a constraint that is too large or deep, or does not compile.
        """
        self.engine.processor.check_structured_outputs(params)

    def make_request(self, request_id: str, prompt, params, cache_salt: str | None = None,
                     lora_request=None) -> EngineCoreRequest:
        """Validate and build a request (raises ``SamplingParamError`` / ``PromptTooLongError``, and
        ``ValueError`` for an adapter the check refuses); any thread. ``lora_request``: its LoRA adapter."""
        return self.engine.make_request(request_id, prompt, params, cache_salt=cache_salt, lora_request=lora_request)

    @property
    def lora_checker(self):
        """The engine's ``lora.checker.AdapterChecker`` (``None``: no ``enable_lora``)."""
        return self.engine.processor.lora_checker

    async def generate(self, request: EngineCoreRequest, prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its delta outputs until it finishes.

        If the consumer stops early (client disconnect, cancellation) the
        request is aborted and its KV blocks are freed in the next step.

        Raises:
            EngineDeadError: the engine has died.
            ValueError: the request id is already live.
        """
        if not self.is_healthy:
            raise EngineDeadError("engine is not running")
        self._ensure_handler()
        rid = request.request_id
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = (loop, q)
        finished = False
        try:
            self._call_on_handler_loop(self._add, request, prompt_text)
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self._call_on_handler_loop(self._abort, [rid])

    def _add(self, request: EngineCoreRequest, prompt_text: str | None) -> None:
        """On the handler's loop: front-end state first (outputs may follow at once), then the core."""
        self.engine.output_processor.add_request(request.request_id, prompt_text, request.prompt_token_ids,
                                                 request.sampling_params, request.arrival_time)
        self.client.add_request(request)

    def _call_on_handler_loop(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the output handler's loop: now if that is this one, else soon."""
        if self._loop is not None:
            _run_on(self._loop, fn, *args)


def _run_on(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Call ``fn(*args)`` on ``loop``: at once when it is the running loop, else thread-safely
    soon; nothing when it is closed."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is running:
        fn(*args)
    elif not loop.is_closed():
        loop.call_soon_threadsafe(fn, *args)

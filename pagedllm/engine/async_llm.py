"""Asynchronous front door to the engine for the server.

The engine steps in one background thread; asyncio callers submit requests
through a thread-safe inbox and receive per-request delta ``RequestOutput``s
on asyncio queues. Concurrent requests therefore share engine steps.
PyTorch releases the GIL inside its kernels, so the event loop keeps serving
HTTP while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

import msgspec

from pagedllm.engine.core_client import EngineDeadError  # re-exported: the server imports it from here
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.stats import SchedulerStats

logger = logging.getLogger(__name__)


class ServerShuttingDownError(RuntimeError):
    """The server's shutdown deadline passed: the request was aborted before it finished."""


class AsyncLLM:
    """Runs ``engine.step()`` in a background thread and streams outputs to coroutines.

    Args:
        engine: a constructed ``LLMEngine``; from now on only this object's thread touches it.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self.errored: BaseException | None = None
        self._stop = threading.Event()
        self._stats: SchedulerStats = engine.get_stats()
        self._finished_callbacks: list = []
        self._thread = threading.Thread(target=self._loop, name="pagedllm-engine", daemon=True)
        self._thread.start()

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

    def default_sampling_fields(self) -> dict:
        """The model's ``generation_config.json`` sampling defaults (``LLMEngine.default_sampling_fields``)."""
        return self.engine.default_sampling_fields()

    @property
    def is_healthy(self) -> bool:
        """True while the engine thread (and the core process, if any) runs without error."""
        return self.errored is None and self._thread.is_alive() and self.engine.is_alive()

    def get_stats(self) -> SchedulerStats:
        """Engine counters as of the last step (see ``LLMEngine.get_stats``)."""
        return self._stats

    def add_finished_callback(self, fn) -> None:
        """Call ``fn(output)`` in the engine thread for every request that finishes
        (not for aborts). ``output.metrics`` is then a ``RequestMetrics`` with its
        finish time set.
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
        for rid in rids:
            self._inbox.put(("abort", rid))
            self._deliver(rid, error)
        return len(rids)

    def shutdown(self) -> None:
        """Stop the engine thread (pending requests are aborted) and the core process, if any."""
        self._stop.set()
        self._inbox.put(("noop", None))
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # ---- engine thread ----------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                self._drain(block=not eng.has_unfinished_requests())
                # a core process keeps stepping by itself: read its outputs (and counters) even when idle
                if eng.has_unfinished_requests() or eng.multiprocess:
                    for out in eng.step(delta=True):
                        if out.finished:
                            self._on_finished(out)
                        self._deliver(out.request_id, out)
                self._stats = eng.get_stats()
        except BaseException as e:  # report to every waiter, never die silently
            if isinstance(e, EngineDeadError):  # the core process is gone: its own log has the cause
                logger.error("engine core died: %s", e)
            else:
                logger.exception("engine loop crashed")
            # nothing runs or waits any more: gauges must not keep the last step's values
            self._stats = msgspec.structs.replace(self._stats, num_running=0, num_waiting=0, kv_cache_usage=0.0)
            self.errored = e
            with self._lock:
                rids = list(self._streams)
            for rid in rids:
                self._deliver(rid, EngineDeadError(f"engine loop crashed: {e!r}"))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                req, text = payload
                try:
                    self.engine.add_prepared(req, text)
                except Exception as e:
                    self._deliver(req.request_id, e)
            elif kind == "abort":
                self.engine.abort_request([payload])
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, rid: str, item) -> None:
        with self._lock:
            entry = self._streams.get(rid)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    # ---- asyncio side ---------------------------------------------------------------
    def make_request(self, request_id: str, prompt, params, cache_salt: str | None = None) -> EngineCoreRequest:
        """Validate and build a request (raises ``SamplingParamError`` / ``PromptTooLongError``); any thread."""
        return self.engine.make_request(request_id, prompt, params, cache_salt=cache_salt)

    async def generate(self, request: EngineCoreRequest, prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its delta outputs until it finishes.

        If the consumer stops early (client disconnect, cancellation) the
        request is aborted and its KV blocks are freed in the next step.

        Raises:
            EngineDeadError: the engine loop crashed.
        """
        if not self.is_healthy:
            raise EngineDeadError("engine is not running")
        rid = request.request_id
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[rid] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            self._inbox.put(("add", (request, prompt_text)))
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
                self._inbox.put(("abort", rid))

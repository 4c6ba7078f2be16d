"""Engine-core clients for asyncio front ends: ``await get_output()`` wakes when the core has
sent something, with no polling loop and no timeout between a request's arrival and its
submission.

* ``AsyncMPClient``: over a core process (wraps ``MPEngineCoreClient``, whose process and
  sockets it shares): the output socket is read with ``zmq.asyncio`` on the event loop.
* ``AsyncInprocClient``: over an in-process ``EngineCore``: one thread steps the core (torch
  releases the GIL in its kernels) and sleeps on its inbox when there is no work; outputs are
  handed to the event loop with ``call_soon_threadsafe``.

Both are used from one event loop (the server's); ``add_request`` and ``abort_requests``
never block.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

import msgspec
import zmq
import zmq.asyncio

from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.engine.core_client import InprocClient, MPEngineCoreClient
from pagedllm.engine.messages import (FROM_CORE, CoreFailed, CoreOutputs, EngineCoreRequest, EngineDeadError,
                                      FinishRequests)
from pagedllm.request import RequestStatus
from pagedllm.stats import SchedulerStats

logger = logging.getLogger(__name__)

_ALIVE_CHECK_MS = 500  # how often a quiet output socket is checked against a dead core process


class AsyncMPClient:
    """Asyncio client of a core process.

    Args:
        sync: the ``MPEngineCoreClient`` that started the process; from now on only this
            object reads its output socket.
    """

    def __init__(self, sync: MPEngineCoreClient) -> None:
        self.sync = sync
        self._out: zmq.asyncio.Socket | None = None  # made on the event loop, at the first read
        self._dec = msgspec.msgpack.Decoder(FROM_CORE)
        self._enc = msgspec.msgpack.Encoder()
        self.stats: SchedulerStats = sync.get_stats()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a validated request to the core (PUSH never blocks here)."""
        self.sync._input.send(self._enc.encode(request))

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort (or mark stopped) requests in the core."""
        if request_ids:
            self.sync._input.send(self._enc.encode(FinishRequests(list(request_ids), int(status))))

    async def get_output(self) -> list[EngineCoreOutput]:
        """The next step outputs the core sends (and any already queued behind them).

        Raises:
            EngineDeadError: the core reported a failure or its process is gone.
        """
        if self._out is None:
            self._out = zmq.asyncio.Socket.from_socket(self.sync._output)
        outs: list[EngineCoreOutput] = []
        while True:
            if not await self._out.poll(0 if outs else _ALIVE_CHECK_MS):
                if outs:
                    return outs
                if not self.sync.proc.is_alive():
                    raise EngineDeadError(f"engine core process exited with code {self.sync.proc.exitcode}")
                continue
            msg = self._dec.decode(await self._out.recv())
            if isinstance(msg, CoreFailed):
                raise EngineDeadError(msg.error if msg.load_error else f"engine core failed: {msg.error}")
            if isinstance(msg, CoreOutputs):
                outs.extend(msg.outputs)
                self.stats = msgspec.structs.replace(msg.stats, core_pid=self.sync.core_pid)
                if not msg.outputs:  # counters only (after aborts): nothing to wait for behind them
                    return outs

    def get_stats(self) -> SchedulerStats:
        """The core's counters as of its last message, with ``core_pid``."""
        return self.stats

    def is_alive(self) -> bool:
        """True while the core process runs."""
        return self.sync.is_alive()

    def pop_failed_requests(self) -> dict[str, str]:
        """Always empty: one core fails as a whole (``EngineCoreClient.pop_failed_requests``)."""
        return {}

    def shutdown(self) -> None:
        """Stop the core process and reap it; safe to call twice."""
        self.sync.shutdown()


class AsyncInprocClient:
    """Asyncio client of an in-process core, stepped by one thread.

    Args:
        sync: the ``InprocClient`` of the core; from now on only this object's thread touches the core.
    """

    def __init__(self, sync: InprocClient) -> None:
        self.core = sync.core
        self._inbox: queue.Queue = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue | None = None
        self.stats: SchedulerStats = self.core.get_stats()
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        self._thread = threading.Thread(target=self._run, name="pagedllm-core", daemon=True)
        self._thread.start()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request for the core thread."""
        self._inbox.put(("add", request))

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Queue aborts (or stops) for the core thread."""
        if request_ids:
            self._inbox.put(("finish", (list(request_ids), status)))

    def _apply(self, item) -> bool:
        kind, payload = item
        if kind == "stop":
            return False
        if kind == "add":
            self.core.add_request(payload)
        else:
            self.core.finish_requests(*payload)
        return True

    def _run(self) -> None:
        """The core thread: sleep on the inbox when idle, else step and hand each step's outputs over."""
        core = self.core
        try:
            while True:
                if not core.has_unfinished_requests():
                    if not self._apply(self._inbox.get()):  # no work: wait for some, without a timeout
                        return
                while True:  # everything that arrived meanwhile goes into this step
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._apply(item):
                        return
                outs = core.step() if core.has_unfinished_requests() else []
                self.stats = core.get_stats()
                self._loop.call_soon_threadsafe(self._outbox.put_nowait, outs)
        except BaseException as e:  # the front end turns this into EngineDeadError for every waiter
            logger.exception("engine core thread crashed")
            self.error = e
            self._loop.call_soon_threadsafe(self._outbox.put_nowait, e)

    async def get_output(self) -> list[EngineCoreOutput]:
        """The next step's outputs.

        Raises:
            EngineDeadError: the core thread crashed.
        """
        if self._thread is None:
            self._start()
        item = await self._outbox.get()
        if isinstance(item, BaseException):
            raise EngineDeadError(f"engine loop crashed: {item!r}")
        return item

    def get_stats(self) -> SchedulerStats:
        """The core's counters as of its last step."""
        return self.stats

    def is_alive(self) -> bool:
        """False once the core thread has crashed, or a worker process of the core's executor died."""
        return self.error is None and (self._thread is None or self._thread.is_alive()) and self.core.is_healthy()

    def pop_failed_requests(self) -> dict[str, str]:
        """Always empty: one core fails as a whole (``EngineCoreClient.pop_failed_requests``)."""
        return {}

    def shutdown(self) -> None:
        """Stop the core thread (pending requests are dropped) and the core's execution thread."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join(timeout=10)
        self.core.shutdown()


def async_client(sync) -> AsyncMPClient | AsyncInprocClient:
    """The asyncio client over a synchronous ``EngineCoreClient`` of ``LLMEngine``."""
    return AsyncMPClient(sync) if isinstance(sync, MPEngineCoreClient) else AsyncInprocClient(sync)

"""Engine-core clients for asyncio front ends: ``await get_output()`` wakes when the core has
sent something, with no polling loop and no timeout between a request's arrival and its
submission.

* ``AsyncEngineCoreClient``: the one interface ``AsyncLLM`` uses, whatever is behind it (the
  asyncio side of vLLM's ``EngineCoreClient`` / ``AsyncMPClient`` split).
* ``AsyncMPClient``: over a core process (takes over the process and sockets of the
  ``MPEngineCoreClient`` that started it): the output socket is read with ``zmq.asyncio`` on
  the event loop.
* ``AsyncInprocClient``: over an in-process ``EngineCore``: one thread steps the core (torch
  releases the GIL in its kernels) and sleeps on its inbox when there is no work; outputs are
  handed to the event loop with ``call_soon_threadsafe``.
* ``AsyncDPClient`` (``engine/dp_client.py``): over the replicas of a ``DPClient``.

How a front end gets one: every synchronous client (``InprocClient``, ``MPEngineCoreClient``,
``DPClient``) has ``make_async()``, which returns its asyncio twin, so ``AsyncLLM`` asks the
client it has and never tests its type. Imports run one way only: ``core_client`` and
``dp_client`` import this module, and this module imports neither of them, not even for a type
hint (``tests/test_layering.py`` counts those edges too, and a lazy import in ``make_async``
would close a cycle). So a twin is built from the pieces it needs, not from its sync class:
``AsyncInprocClient`` from the ``EngineCore``, ``AsyncMPClient`` from a
``CoreProcessConnection`` (the protocol below, met by ``MPEngineCoreClient``'s public
members), ``AsyncDPClient`` from its ``DPClient`` in the same module.

All are used from one event loop (the server's); ``add_request`` and ``abort_requests``
never block.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.messages import (FROM_CORE, CoreFailed, CoreOutputs, EngineCoreRequest, EngineDeadError,
                                      FinishRequests)
from pagedllm.request import RequestStatus
from pagedllm.stats import SchedulerStats

logger = logging.getLogger(__name__)

_ALIVE_CHECK_MS = 500  # how often a quiet output socket is checked against a dead core process


class AsyncEngineCoreClient(Protocol):
    """How ``AsyncLLM`` talks to its engine core(s) from one event loop: the meaning of
    ``EngineCoreClient`` (``engine/core_client.py``), with ``get_output`` awaited instead of polled.
    A synchronous client's ``make_async()`` returns one.
    """

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a validated request to the core (never blocks).

        Raises:
            EngineDeadError: no core is left to take it (data parallelism, every replica dead).
        """

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests in the core (abort, or stopped by a stop string found in the front end)."""

    async def get_output(self) -> list[EngineCoreOutput]:
        """The next outputs the core sends (possibly none).

        Raises:
            EngineDeadError: the core died (with data parallelism: every replica).
        """

    def get_stats(self) -> SchedulerStats:
        """The core's counters as of its last message (summed over data-parallel replicas)."""

    def replica_stats(self) -> list[dict]:
        """Each data-parallel replica's counters and state (``DPClient.replica_stats``); empty with
        one engine core."""

    def is_alive(self) -> bool:
        """False once the core has died (with data parallelism: every replica)."""

    def pop_failed_requests(self) -> dict[str, str]:
        """Requests that failed without their core's output since the last call, each with its
        error message (``EngineCoreClient.pop_failed_requests``)."""

    def shutdown(self) -> None:
        """Stop the core (safe to call twice)."""


class CoreProcessConnection(Protocol):
    """What ``AsyncMPClient`` takes over from the synchronous client that started a core
    process and waited for it to be ready (``MPEngineCoreClient``)."""

    core_pid: int

    @property
    def output_socket(self) -> zmq.Socket:
        """The socket the core's messages arrive on."""

    @property
    def exit_code(self) -> int | None:
        """The core process's exit code (``None`` while it runs)."""

    def send(self, msg) -> None:
        """Send one ``TO_CORE`` message to the core."""

    def get_stats(self) -> SchedulerStats:
        """The core's counters as of its last message."""

    def is_alive(self) -> bool:
        """True while the core process runs."""

    def shutdown(self) -> None:
        """Stop the core process and reap it."""


class AsyncMPClient:
    """Asyncio client of a core process (an ``AsyncEngineCoreClient``; vLLM's ``AsyncMPClient``).

    Args:
        sync: the connection of the client that started the process (``MPEngineCoreClient``);
            from now on only this object reads its output socket.
    """

    def __init__(self, sync: CoreProcessConnection) -> None:
        self.sync = sync
        self._out: zmq.asyncio.Socket | None = None  # made on the event loop, at the first read
        self._dec = msgspec.msgpack.Decoder(FROM_CORE)
        self.stats: SchedulerStats = sync.get_stats()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a validated request to the core (PUSH never blocks here)."""
        self.sync.send(request)

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort (or mark stopped) requests in the core."""
        if request_ids:
            self.sync.send(FinishRequests(list(request_ids), int(status)))

    async def get_output(self) -> list[EngineCoreOutput]:
        """The next step outputs the core sends (and any already queued behind them).

        Raises:
            EngineDeadError: the core reported a failure or its process is gone.
        """
        if self._out is None:
            self._out = zmq.asyncio.Socket.from_socket(self.sync.output_socket)
        outs: list[EngineCoreOutput] = []
        while True:
            if not await self._out.poll(0 if outs else _ALIVE_CHECK_MS):
                if outs:
                    return outs
                if not self.sync.is_alive():
                    raise EngineDeadError(f"engine core process exited with code {self.sync.exit_code}")
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

    def replica_stats(self) -> list[dict]:
        """Empty: one engine core, no data-parallel replicas."""
        return []

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
    """Asyncio client of an in-process core, stepped by one thread (an ``AsyncEngineCoreClient``).

    Args:
        core: the engine core (``InprocClient.core``); from now on only this object's thread
            touches it.
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
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

    def replica_stats(self) -> list[dict]:
        """Empty: one engine core, no data-parallel replicas."""
        return []

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


"""The front end's synchronous clients of an engine core: in this process, or in its own (ZMQ + msgspec).

``EngineCoreClient`` is the interface (vLLM's ``EngineCoreClient``); ``InprocClient`` steps an
``EngineCore`` here, ``MPEngineCoreClient`` starts the core process (its loop is
``engine/core_process.py``) and talks to it. Each client's ``make_async()`` returns its asyncio
twin (``engine/async_core_client.py``: ``AsyncEngineCoreClient``), which this module imports
and which imports nothing of this module back.

The front end (tokenizer, detokenizer, stop strings, parsers, HTTP) talks to
the core process over two ZMQ sockets on ``ipc://`` paths: requests, aborts and
utility calls go down a PUSH socket, step outputs come back up another. Messages
are msgpack-encoded with ``msgspec`` from typed structs and the dataclasses of
``scheduler_output``. The core steps on its own as long as it has work, so the
front end never drives (or delays) the step loop.

A core that dies is noticed by the client (``EngineDeadError`` on the next
read); a core whose parent dies exits by itself; ``shutdown()`` stops it and
reaps it, leaving no orphan process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import uuid
from typing import Protocol

import msgspec
import zmq

from pagedllm.config import EngineArgs
from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.engine.async_core_client import AsyncEngineCoreClient, AsyncInprocClient, AsyncMPClient
from pagedllm.engine.core_process import front_end_log_setup, run_engine_core
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.messages import (FROM_CORE, CoreFailed, CoreOutputs, CoreReady, EngineCoreRequest,
                                      EngineDeadError, FinishRequests, Shutdown, UtilityCall, UtilityResult)
from pagedllm.request import RequestStatus
from pagedllm.stats import SchedulerStats


class EngineCoreClient(Protocol):
    """How the front end talks to an engine core, in process or in another process.

    Every implementation has the same meaning: requests are ``EngineCoreRequest`` messages,
    outputs come back as ``EngineCoreOutput`` lists, counters as ``SchedulerStats``.
    """

    num_blocks: int

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request in the core."""

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests in the core (abort, or stopped by a stop string found in the front end)."""

    def get_output(self, timeout_ms: int = 100) -> list[EngineCoreOutput]:
        """The outputs the core has produced since the last call (in process: one step)."""

    def settle(self) -> None:
        """The front end has no live request: let the core finish a step still in flight."""

    def get_stats(self) -> SchedulerStats:
        """The core's counters as of its last step."""

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds; returns how many were dropped."""

    def call_utility(self, name: str, *args):
        """Run ``EngineCore.<name>(*args)`` (one of ``EngineCore.UTILITIES``) and return its result."""

    def is_alive(self) -> bool:
        """False once the core has died."""

    def pop_failed_requests(self) -> dict[str, str]:
        """Requests that failed without their core's output since the last call, each with its
        error message (a data-parallel replica that died: ``engine/dp_client.py``); one core's
        death is ``EngineDeadError`` from ``get_output`` instead, so here always empty."""

    def shutdown(self) -> None:
        """Stop the core (safe to call twice)."""

    def make_async(self) -> AsyncEngineCoreClient:
        """This client's asyncio twin over the same core(s), for ``AsyncLLM``; from then on use
        this client for nothing but what the twin leaves to it."""


class InprocClient:
    """An ``EngineCoreClient`` over an ``EngineCore`` in this process: ``get_output`` runs one step.

    Args:
        core: the engine core.
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.num_blocks = core.num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request in the core."""
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests now: their blocks go back to the pool before the next step."""
        if request_ids:
            self.core.finish_requests(request_ids, status)

    def get_output(self, timeout_ms: int = 100) -> list[EngineCoreOutput]:
        """One core step's outputs. A step with nothing to schedule is cheap and still hands
        the runner the ids of requests that finished since the last one."""
        return self.core.step()

    def settle(self) -> None:
        """Apply the steps still in flight (async scheduling), so the core is idle."""
        while self.core.has_unfinished_requests():
            self.core.step()

    def get_stats(self) -> SchedulerStats:
        """The core's counters now."""
        return self.core.get_stats()

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds; returns how many."""
        return self.core.reset_prefix_cache()

    def call_utility(self, name: str, *args):
        """Run ``EngineCore.<name>(*args)``.

        Raises:
            ValueError: ``name`` is not one of ``EngineCore.UTILITIES``.
        """
        return self.core.call_utility(name, *args)

    def is_alive(self) -> bool:
        """True while the in-process core can step (False once a worker process of its executor died)."""
        return self.core.is_healthy()

    def pop_failed_requests(self) -> dict[str, str]:
        """Always empty: one core fails as a whole (``EngineCoreClient.pop_failed_requests``)."""
        return {}

    def shutdown(self) -> None:
        """Finish the step in flight and stop the core's execution thread."""
        self.core.shutdown()

    def make_async(self) -> AsyncInprocClient:
        """An ``AsyncInprocClient`` over this core; from then on only its thread steps the core."""
        return AsyncInprocClient(self.core)


class MPEngineCoreClient:
    """An ``EngineCoreClient`` that starts the core process (``core_process.run_engine_core``)
    and talks to it over ZMQ (vLLM's ``SyncMPClient``). It is also the ``CoreProcessConnection``
    its asyncio twin ``AsyncMPClient`` takes over: ``send``, ``output_socket``, ``exit_code``.

    Args:
        args, model_dir, max_model_len, eos_token_ids: as ``EngineCore``.
        startup_timeout_s: how long to wait for the model to load (seconds).
        wait: wait here until the core is ready; ``False`` returns once the process is started,
            and the caller must call ``wait_ready`` (data parallelism starts N cores at once).
    Raises:
        EngineDeadError: the core failed to start (its error is in the message).
    """

    def __init__(self, args: EngineArgs, model_dir, max_model_len: int, eos_token_ids: set[int],
                 startup_timeout_s: float = 600.0, wait: bool = True) -> None:
        base = os.path.join(tempfile.gettempdir(), f"pagedllm-{uuid.uuid4().hex[:12]}")
        self._paths = [f"{base}-in", f"{base}-out"]
        in_addr, out_addr = (f"ipc://{p}" for p in self._paths)
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(in_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(out_addr)
        self._enc, self._dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FROM_CORE)
        # spawn, not fork: torch and its thread pools do not survive a fork
        self.proc = mp.get_context("spawn").Process(
            target=run_engine_core, name="pagedllm-engine-core", daemon=True,
            args=(args, str(model_dir), max_model_len, set(eos_token_ids), in_addr, out_addr, os.getpid(),
                  front_end_log_setup()))
        self.proc.start()
        self.stats = SchedulerStats()
        self._pending: list[EngineCoreOutput] = []  # outputs read while waiting for a utility answer
        self._calls = 0
        if wait:
            self.wait_ready(startup_timeout_s)

    def wait_ready(self, startup_timeout_s: float = 600.0) -> None:
        """Wait until the core has loaded the model and sent its first counters.

        Raises:
            EngineDeadError: the core failed or was not ready within ``startup_timeout_s``
                seconds (the process is then stopped and reaped).
        """
        deadline = time.monotonic() + startup_timeout_s
        try:
            while True:
                msg = self._recv(timeout_ms=500)
                if isinstance(msg, CoreReady):
                    self.num_blocks, self.core_pid = msg.num_blocks, msg.pid
                elif isinstance(msg, CoreOutputs):  # sent right after CoreReady: counters exist from the start
                    self.stats = msg.stats
                    break
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"engine core not ready after {startup_timeout_s:.0f} s")
        except BaseException:
            self.shutdown()  # reap the process and remove the ipc socket files
            raise

    def _recv(self, timeout_ms: int):
        """One message from the core, or ``None`` after ``timeout_ms``.

        Raises:
            EngineDeadError: the core reported a failure or its process is gone.
        """
        if self._output.poll(timeout_ms):
            msg = self._dec.decode(self._output.recv())
            if isinstance(msg, CoreFailed):
                raise EngineDeadError(msg.error if msg.load_error else f"engine core failed: {msg.error}")
            return msg
        if not self.proc.is_alive():
            raise EngineDeadError(f"engine core process exited with code {self.exit_code}")
        return None

    def send(self, msg) -> None:
        """Send one ``TO_CORE`` message (``engine/messages.py``) to the core; PUSH never blocks here."""
        self._input.send(self._enc.encode(msg))

    @property
    def output_socket(self) -> zmq.Socket:
        """The socket the core's messages arrive on (to poll several cores at once, or to hand
        over to ``AsyncMPClient``)."""
        return self._output

    @property
    def exit_code(self) -> int | None:
        """The core process's exit code (``None`` while it runs)."""
        return self.proc.exitcode

    def has_pending_outputs(self) -> bool:
        """True when step outputs read while waiting for a utility answer wait for ``get_output``."""
        return bool(self._pending)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a validated request to the core."""
        self.send(request)

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort (or mark stopped) requests in the core."""
        if request_ids:
            self.send(FinishRequests(list(request_ids), int(status)))

    def _take(self, msg) -> None:
        if isinstance(msg, CoreOutputs):
            self._pending.extend(msg.outputs)
            self.stats = msg.stats

    def get_output(self, timeout_ms: int = 100) -> list[EngineCoreOutput]:
        """Every step output the core has sent (waiting up to ``timeout_ms`` for the first).

        Raises:
            EngineDeadError: the core died.
        """
        msg = self._recv(0 if self._pending else timeout_ms)
        while msg is not None:
            self._take(msg)
            msg = self._recv(0)
        outs, self._pending = self._pending, []
        return outs

    def settle(self) -> None:
        """Nothing to do: the core process steps by itself."""

    def get_stats(self) -> SchedulerStats:
        """The core's counters as of its last message, with ``core_pid`` set."""
        return msgspec.structs.replace(self.stats, core_pid=self.core_pid)

    def call_utility(self, name: str, *args, timeout_s: float = 60.0):
        """Run ``EngineCore.<name>(*args)`` in the core process and return its result; step
        outputs that arrive meanwhile are kept for the next ``get_output``.

        Raises:
            ValueError: the core refused or failed the call (its message).
            EngineDeadError: the core died, or did not answer within ``timeout_s``.
        """
        self._calls += 1
        call_id = self._calls
        self.send(UtilityCall(call_id, name, list(args)))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self._recv(100)
            if isinstance(msg, UtilityResult) and msg.call_id == call_id:
                if msg.error is not None:
                    raise ValueError(f"engine core utility {name!r} failed: {msg.error}")
                return msg.result
            self._take(msg)
        raise EngineDeadError(f"engine core did not answer {name!r} within {timeout_s:.0f} s")

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds, in the core process; returns how many."""
        return int(self.call_utility("reset_prefix_cache"))

    def is_alive(self) -> bool:
        """True while the core process runs."""
        return self.proc.is_alive()

    def pop_failed_requests(self) -> dict[str, str]:
        """Always empty: one core fails as a whole (``EngineCoreClient.pop_failed_requests``)."""
        return {}

    def make_async(self) -> AsyncMPClient:
        """An ``AsyncMPClient`` over this core process; from then on only it reads the outputs."""
        return AsyncMPClient(self)

    def shutdown(self) -> None:
        """Stop the core process and reap it (SIGKILL after 5 s); safe to call twice."""
        if self._ctx.closed:
            return
        if self.proc.is_alive():
            try:
                self._input.send(self._enc.encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        for p in self._paths:
            try:
                os.unlink(p)
            except OSError:
                pass

"""Running the HTTP server: graceful shutdown with a deadline, and exit when the engine dies.

* SIGTERM or SIGINT: stop accepting connections and let running requests finish for up to
  ``shutdown_timeout_s`` seconds (``--shutdown-timeout``, default 30); then abort what remains
  (a stream ends with an error event and ``[DONE]``, a plain request gets 503) and exit 0.
  A second signal brings the deadline forward to now; a third exits at once.
* An engine core that dies makes the server exit with status 1 within seconds, after its
  clients have been told (503, or an error event on a stream), so that a supervisor
  (systemd, Kubernetes) restarts it, as vLLM's server does. Until then ``/health`` answers
  503 and the gauges read 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import uvicorn

from pagedllm.engine.async_llm import ServerShuttingDownError
from pagedllm.server.defaults import SHUTDOWN_TIMEOUT_S

logger = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.25
_TELL_CLIENTS_S = 2.0   # after the engine dies: time for in-flight answers to go out before exiting
_DEAD_DRAIN_S = 3.0     # then the graceful-shutdown deadline, short: nothing can be served any more


_BACKSTOP_S = 2.0  # after the deadline's aborts: uvicorn cancels whatever has still not ended


class _Server(uvicorn.Server):
    """uvicorn's server, where the first signal starts the shutdown deadline, a second SIGTERM
    (not only SIGINT) forces the exit, and the signals that stopped it are not raised again
    afterwards (the caller returns an exit status).

    Args:
        config: uvicorn's config; its ``timeout_graceful_shutdown`` is the backstop.
        on_deadline: called (in a timer thread) ``deadline_s`` after the first signal.
    """

    def __init__(self, config: uvicorn.Config, on_deadline, deadline_s: float) -> None:
        super().__init__(config)
        self._on_deadline, self._deadline_s = on_deadline, deadline_s
        self.deadline_timer: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        """First signal: graceful shutdown with a deadline; the second: the deadline now (running
        requests are aborted, streams get their error event); any later one: stop at once."""
        if self.should_exit:
            if self.deadline_timer is not None and self.deadline_timer.is_alive():
                self.deadline_timer.cancel()
                threading.Thread(target=self._on_deadline, daemon=True).start()  # not in a signal handler
            else:
                self.force_exit = True
            return
        self.should_exit = True
        self.deadline_timer = threading.Timer(self._deadline_s, self._on_deadline)
        self.deadline_timer.daemon = True
        self.deadline_timer.start()

    @contextlib.contextmanager
    def capture_signals(self):
        """Route SIGINT and SIGTERM to ``handle_exit`` while serving (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _watch_engine(llm, server: _Server, died: threading.Event) -> None:
    """Poll ``llm.is_healthy``; once it is false, stop the server (the caller then exits 1)."""
    while not server.should_exit:
        if not llm.is_healthy:
            died.set()
            logger.error("the engine core has died; the server exits so that it can be restarted")
            time.sleep(_TELL_CLIENTS_S)
            timeout = server.config.timeout_graceful_shutdown
            server.config.timeout_graceful_shutdown = _DEAD_DRAIN_S if timeout is None else min(timeout, _DEAD_DRAIN_S)
            server.should_exit = True
            return
        time.sleep(_WATCH_INTERVAL_S)


def yield_cpu_to_engine_core(increment: int) -> int:
    """Lower this process's scheduling priority by ``increment`` (``os.nice``), once the engine core
    runs in a process of its own: on a CPU-bound machine the core's OpenMP threads fill every core,
    and a flood of requests the API server must parse and refuse then takes CPU from every running
    stream (measured on 2 cores, SmolLM2: 87 cheap hostile requests repeated at full rate beside 50
    streams raised their median TPOT 1.8x at equal priority, 1.07x with the server at nice 10). The
    server's own latency pays for it (``/health`` during that flood: at most 0.3 s at nice 5, 0.5 s at
    7, 1.1 s at 10), so the default (``PAGEDLLM_API_SERVER_NICE``) is 7. Child processes started later
    (the constraint validator) inherit it.

    Returns:
        The process's niceness afterwards (unchanged where ``increment`` <= 0 or the OS refuses).
    """
    if increment > 0:
        try:
            return os.nice(increment)
        except OSError as e:
            logger.warning("could not lower the API server's priority: %s", e)
    return os.nice(0)


def run_server(app, llm, host: str, port: int, log_level: str = "info",
               shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> int:
    """Serve ``app`` with uvicorn until a signal or the engine's death; returns the exit status.

    Args:
        app: the ASGI app of ``build_app``.
        llm: its ``AsyncLLM`` (``is_healthy`` is watched).
        host, port: where to listen.
        log_level: uvicorn's log level name.
        shutdown_timeout_s: seconds running requests may take to finish after SIGTERM (>= 0).
    Returns:
        0 after a signal, 1 when the engine core died.
    Raises:
        ValueError: a negative or non-finite ``shutdown_timeout_s``.
    """
    if not 0 <= shutdown_timeout_s < float("inf"):
        raise ValueError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {shutdown_timeout_s}")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout_s + _BACKSTOP_S)

    def abort_the_rest() -> None:
        n = llm.abort_all(ServerShuttingDownError(
            f"the server is shutting down: the request did not finish within {shutdown_timeout_s:g} s"))
        if n:
            logger.warning("shutdown deadline (%g s) passed: aborted %d running requests", shutdown_timeout_s, n)

    server = _Server(config, abort_the_rest, shutdown_timeout_s)
    died = threading.Event()
    watcher = threading.Thread(target=_watch_engine, args=(llm, server, died), name="pagedllm-watchdog",
                               daemon=True)
    watcher.start()
    try:
        server.run()
    finally:
        if server.deadline_timer is not None:  # everything ended before the deadline
            server.deadline_timer.cancel()
    return 1 if died.is_set() else 0

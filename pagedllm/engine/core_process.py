"""The engine core's own process: the loop ``MPEngineCoreClient`` starts as its process target.

The process loads the model into an ``EngineCore``, tells the front end it is ready
(``CoreReady``, then a first ``CoreOutputs`` with the counters), and from then on steps
whenever it has work, reading requests, aborts and utility calls from a PULL socket and
sending every step's outputs up a PUSH socket (``engine/messages.py``: ``TO_CORE`` down,
``FROM_CORE`` up). This is vLLM's ``EngineCoreProc.run_busy_loop``; the front end's side of the
sockets is ``engine/core_client.py`` (``MPEngineCoreClient``) and ``engine/async_core_client.py``
(``AsyncMPClient``).

A failure is reported as ``CoreFailed`` before the process exits (the client turns it into
``EngineDeadError``); a process whose parent has died exits by itself.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import msgspec
import zmq

from pagedllm.config import EngineArgs
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.messages import (TO_CORE, CoreFailed, CoreOutputs, CoreReady, EngineCoreRequest, Shutdown,
                                      UtilityCall, UtilityResult)
from pagedllm.memory import freeze_startup_heap
from pagedllm.request import RequestStatus

logger = logging.getLogger(__name__)


def front_end_log_setup() -> tuple[int, str | None]:
    """The front end's root log level and its first handler's format, for the core process (a
    spawned process starts with logging unconfigured: its start-up lines would be lost)."""
    root = logging.getLogger()
    fmt = root.handlers[0].formatter._fmt if root.handlers and root.handlers[0].formatter else None
    return root.level, fmt


def run_engine_core(args: EngineArgs, model_dir: str, max_model_len: int, eos_token_ids: set[int],
                    input_addr: str, output_addr: str, parent_pid: int,
                    log_setup: tuple[int, str | None] = (logging.WARNING, None)) -> None:
    """The core process: load the model, then step whenever there is work (``_serve``).

    ``log_setup`` is ``front_end_log_setup()`` of the parent, so the core logs as the front end does.

    SIGINT and SIGTERM are ignored: the front end owns the core's lifetime (a Shutdown
    message, or its own exit), so a signal to the whole process group (Ctrl-C, systemd's
    stop) still lets running requests finish within the server's shutdown deadline.

    Any exception (a model that fails to load, a bug in a step) is sent up as ``CoreFailed``
    and ends the process; nothing is raised to the caller. After a ``Shutdown`` message the
    process exits with ``os._exit(0)``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    level, fmt = log_setup
    logging.basicConfig(level=level, **({"format": fmt} if fmt else {}))  # as the front end logs
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(TO_CORE)
    core = None
    clean = False  # a Shutdown message ended the loop
    try:
        eos = set(eos_token_ids)  # one set shared by all requests, as in the in-process engine
        core = EngineCore(args, model_dir, max_model_len, eos)
        freeze_startup_heap()  # this process lives as long as its engine: start-up objects never die
        out.send(enc.encode(CoreReady(core.num_blocks, os.getpid())))
        out.send(enc.encode(CoreOutputs([], core.get_stats())))  # counters exist before the first request
        clean = _serve(core, inp, out, enc, dec, parent_pid)
    except Exception as e:  # report, then exit: the client turns this into EngineDeadError
        _report_failure(out, enc, e)
    finally:
        if core is not None:
            core.executor.shutdown()  # worker processes of a tensor-parallel core go with it
        # a failure report must get out; after Shutdown nobody reads what is left
        out.close(linger=0 if clean else 1000)
        inp.close(linger=0)
        ctx.term()
        if clean:  # a clean Shutdown: skip the second of thread-pool and library teardown
            logging.shutdown()
            os._exit(0)


def _serve(core: EngineCore, inp: zmq.Socket, out: zmq.Socket, enc: msgspec.msgpack.Encoder,
           dec: msgspec.msgpack.Decoder, parent_pid: int) -> bool:
    """Step whenever there is work; returns True on a ``Shutdown`` message, False once the
    parent process is gone.

    Inputs are drained without blocking while requests run, so a slow front end
    never stalls the step loop; with nothing to do it waits up to 100 ms for input
    and checks that its parent is still alive.

    Raises:
        WorkerDiedError: a worker process of the core's executor died (checked while idle).
        Exception: whatever a step of the core raised.
    """
    next_parent_check = time.monotonic() + 1.0
    while True:
        busy = core.has_unfinished_requests()
        changed = False
        if busy and time.monotonic() > next_parent_check:
            next_parent_check = time.monotonic() + 1.0
            if os.getppid() != parent_pid:
                return False  # the front end died mid-work: nobody will read these outputs
        if not busy and not inp.poll(100):
            if os.getppid() != parent_pid:
                return False  # the front end is gone: do not linger as an orphan
            core.check_health()  # a dead worker process ends the core while idle too (WorkerDiedError)
            continue
        while inp.poll(0):
            msg = dec.decode(inp.recv())
            changed = True
            if isinstance(msg, Shutdown):
                return True
            if isinstance(msg, EngineCoreRequest):
                core.add_request(msg)
            elif isinstance(msg, UtilityCall):
                out.send(enc.encode(_run_utility(core, msg)))
            else:
                core.finish_requests(msg.request_ids, RequestStatus(msg.status))
        if core.has_unfinished_requests():
            out.send(enc.encode(CoreOutputs(core.step(), core.get_stats())))
        elif changed:  # aborts freed blocks without a step: let the front end see it
            out.send(enc.encode(CoreOutputs([], core.get_stats())))


def _report_failure(out: zmq.Socket, enc: msgspec.msgpack.Encoder, e: Exception) -> None:
    """Log ``e`` (with its traceback, unless the model failed to load) and send it up as
    ``CoreFailed``; called from the ``except`` block that caught it."""
    from pagedllm.models.loader import ModelLoadError
    load_error = isinstance(e, ModelLoadError)
    if not load_error:  # a broken file is the user's to fix, told once by the front end; a bug keeps its traceback
        logger.exception("engine core failed")
    try:
        out.send(enc.encode(CoreFailed(str(e) if load_error else repr(e), load_error)), flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


def _run_utility(core: EngineCore, msg: UtilityCall) -> UtilityResult:
    """Run one utility call; its error, if any, goes back to the caller in the result."""
    try:
        return UtilityResult(msg.call_id, core.call_utility(msg.name, *msg.args))
    except Exception as e:  # the caller's error to see, not the core's end
        return UtilityResult(msg.call_id, error=f"{type(e).__name__}: {e}")

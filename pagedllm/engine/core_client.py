"""The engine core in its own process, and the front end's client of it (ZMQ + msgspec).

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

import logging
import multiprocessing as mp
import os
import tempfile
import time
import uuid

import msgspec
import zmq

from pagedllm.config import EngineArgs
from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core (loop or process) has died; no request can be served."""


class AddRequest(msgspec.Struct, tag="add"):
    """A validated request for the core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    arrival_time: float
    cache_salt: str | None = None


class FinishRequests(msgspec.Struct, tag="finish"):
    """End requests: ``status`` is a ``RequestStatus`` value (abort, or stopped by a stop string)."""

    request_ids: list[str]
    status: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the core loop."""


class CoreOutputs(msgspec.Struct, tag="outputs"):
    """One step's results (possibly none) and the core's counters after it."""

    outputs: list[EngineCoreOutput]
    stats: dict


class CoreReady(msgspec.Struct, tag="ready"):
    """Sent once the model is loaded: the KV pool size in blocks, and the core's pid."""

    num_blocks: int
    pid: int


class CoreFailed(msgspec.Struct, tag="failed"):
    """The core hit an exception and stops; ``load_error``: a model file could not be read
    (``error`` is then the one-line message to show as it is)."""

    error: str
    load_error: bool = False


_DOWN = AddRequest | FinishRequests | Shutdown
_UP = CoreOutputs | CoreReady | CoreFailed


def run_engine_core(args: EngineArgs, model_dir: str, max_model_len: int, eos_token_ids: set[int],
                    input_addr: str, output_addr: str, parent_pid: int) -> None:
    """The core process: load the model, then step whenever there is work.

    Inputs are drained without blocking while requests run, so a slow front end
    never stalls the step loop; with nothing to do it waits up to 100 ms for input
    and checks that its parent is still alive.

    SIGINT and SIGTERM are ignored: the front end owns the core's lifetime (a Shutdown
    message, or its own exit), so a signal to the whole process group (Ctrl-C, systemd's
    stop) still lets running requests finish within the server's shutdown deadline.
    """
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from pagedllm.engine.engine_core import EngineCore
    linger_ms = 1000  # a failure report must get out; after Shutdown nobody reads what is left
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(_DOWN)
    try:
        eos = set(eos_token_ids)  # one set shared by all requests, as in the in-process engine
        core = EngineCore(args, model_dir, max_model_len, eos)
        out.send(enc.encode(CoreReady(core.num_blocks, os.getpid())))
        out.send(enc.encode(CoreOutputs([], core.get_stats())))  # counters exist before the first request
        next_parent_check = time.monotonic() + 1.0
        while True:
            busy = core.has_unfinished_requests()
            changed = False
            if busy and time.monotonic() > next_parent_check:
                next_parent_check = time.monotonic() + 1.0
                if os.getppid() != parent_pid:
                    return  # the front end died mid-work: nobody will read these outputs
            if not busy and not inp.poll(100):
                if os.getppid() != parent_pid:
                    return  # the front end is gone: do not linger as an orphan
                continue
            while inp.poll(0):
                msg = dec.decode(inp.recv())
                changed = True
                if isinstance(msg, Shutdown):
                    linger_ms = 0
                    return
                if isinstance(msg, AddRequest):
                    core.add_request(Request(msg.request_id, msg.prompt_token_ids, msg.sampling_params, eos,
                                             msg.max_tokens, msg.arrival_time, msg.cache_salt))
                else:
                    core.finish_requests(msg.request_ids, RequestStatus(msg.status))
            if core.has_unfinished_requests():
                out.send(enc.encode(CoreOutputs(core.step(), core.get_stats())))
            elif changed:  # aborts freed blocks without a step: let the front end see it
                out.send(enc.encode(CoreOutputs([], core.get_stats())))
    except Exception as e:  # report, then exit: the client turns this into EngineDeadError
        from pagedllm.models.loader import ModelLoadError
        load_error = isinstance(e, ModelLoadError)
        if not load_error:  # a broken file is the user's to fix, told once by the front end; a bug keeps its traceback
            logger.exception("engine core failed")
        try:
            out.send(enc.encode(CoreFailed(str(e) if load_error else repr(e), load_error)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    finally:
        out.close(linger=linger_ms)
        inp.close(linger=0)
        ctx.term()
        if linger_ms == 0:  # a clean Shutdown: skip the second of thread-pool and library teardown
            logging.shutdown()
            os._exit(0)


class MPEngineCoreClient:
    """Starts the core process and talks to it.

    Args:
        args, model_dir, max_model_len, eos_token_ids: as ``EngineCore``.
        startup_timeout_s: how long to wait for the model to load (seconds).
    Raises:
        EngineDeadError: the core failed to start (its error is in the message).
    """

    def __init__(self, args: EngineArgs, model_dir, max_model_len: int, eos_token_ids: set[int],
                 startup_timeout_s: float = 600.0) -> None:
        base = os.path.join(tempfile.gettempdir(), f"pagedllm-{uuid.uuid4().hex[:12]}")
        self._paths = [f"{base}-in", f"{base}-out"]
        in_addr, out_addr = (f"ipc://{p}" for p in self._paths)
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(in_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(out_addr)
        self._enc, self._dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(_UP)
        # spawn, not fork: torch and its thread pools do not survive a fork
        self.proc = mp.get_context("spawn").Process(
            target=run_engine_core, name="pagedllm-engine-core", daemon=True,
            args=(args, str(model_dir), max_model_len, set(eos_token_ids), in_addr, out_addr, os.getpid()))
        self.proc.start()
        self.stats: dict = {}
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
            raise EngineDeadError(f"engine core process exited with code {self.proc.exitcode}")
        return None

    def add_request(self, req: Request) -> None:
        """Send a validated request to the core."""
        self._input.send(self._enc.encode(AddRequest(req.request_id, req.prompt_token_ids, req.sampling_params,
                                                     req.max_tokens, req.arrival_time, req.cache_salt)))

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Abort (or mark stopped) requests in the core."""
        if request_ids:
            self._input.send(self._enc.encode(FinishRequests(list(request_ids), int(status))))

    def get_outputs(self, timeout_ms: int = 100) -> list[EngineCoreOutput]:
        """Every step output the core has sent (waiting up to ``timeout_ms`` for the first).

        Raises:
            EngineDeadError: the core died.
        """
        outs: list[EngineCoreOutput] = []
        msg = self._recv(timeout_ms)
        while msg is not None:
            if isinstance(msg, CoreOutputs):
                outs.extend(msg.outputs)
                self.stats = msg.stats
            msg = self._recv(0)
        return outs

    def is_alive(self) -> bool:
        """True while the core process runs."""
        return self.proc.is_alive()

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

"""Executors: what stands between the engine core and its model runners (vLLM's ``Executor``).

```
EngineCore ──execute(SchedulerOutput)──> Executor ──> handle.result() -> ModelRunnerOutput
   UniProcExecutor:   rank 0's ModelRunner on the core's execution thread (today's path)
   MultiprocExecutor: rank 0's DriverModelRunner on the same thread, plus one process per rank
                      1..N-1 (WorkerModelRunner); each step's SchedulerOutput goes down a pipe to
                      every worker; the forward's all-reduces (gloo / NCCL) keep the ranks in step;
                      rank 0 samples and broadcasts the tokens
```
The pipe carries the step's plan before rank 0 runs it, so a worker starts preparing step N+1
while rank 0 still runs step N: the async overlap of the core (``engine_core.py``) is unchanged,
and every collective of rank 0 runs on its one execution thread, in issue order.

Failure: a monitor thread waits on the workers' process sentinels; a worker that dies makes
``check_health`` (called before each step) and the step in flight raise ``WorkerDiedError``
naming the rank, pid and exit code, which fails the engine's requests as any core error does.
``shutdown`` asks the workers to stop, then terminates and kills what is left: no process
stays behind.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import wait

from pagedllm.executor.base import Executor, WorkerDiedError
from pagedllm.worker.model_runner import ModelRunner, StepHandle

logger = logging.getLogger(__name__)


class MultiprocExecutor(Executor):
    """Rank 0 in this process, ranks 1..N-1 in spawned processes (one per rank).

    Args:
        args: the engine's ``EngineArgs`` (the workers load the same model with them).
        model_dir: the resolved model directory.
        world_size: ranks in all (``tensor_parallel_size * pipeline_parallel_size``; rank ``r`` is
            TP rank ``r % tp`` of pipeline stage ``r // tp``).
        run_on_exec: runs a function on the core's execution thread and returns its result
            (rank 0 joins the process group there).
        load_plan: the ``LoadPlan`` every worker builds its shard from (the engine plan's).
    Raises:
        RuntimeError: a worker failed to start (its traceback is in the message).
    """

    runner_class = None  # set in __init__: the driver runner (imported lazily, it imports torch.distributed)

    def __init__(self, args, model_dir, world_size: int, run_on_exec, load_plan) -> None:
        super().__init__()
        from pagedllm.executor import worker_loop as worker
        from pagedllm.distributed.parallel_state import free_port, init_distributed
        self.runner_class = worker.DriverModelRunner
        self.world_size = world_size
        self.failure: str | None = None
        self._closing = False
        ctx = mp.get_context("spawn")
        url = f"tcp://127.0.0.1:{free_port()}"
        self.procs, self.conns = [], []
        try:
            for rank in range(1, world_size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=worker.worker_main, args=(rank, world_size, url, args, str(model_dir), child, load_plan),
                                name=f"pagedllm-tp{rank}", daemon=True)
                _start_child(p)
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self._await_joining()
            backend = "nccl" if args.torch_device.type == "cuda" else "gloo"
            run_on_exec(lambda: init_distributed(0, world_size, url, backend,
                                                 pipeline_parallel_size=args.pipeline_parallel_size,
                                                 pipeline_micro_batches=args.pipeline_micro_batches))
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._watch, name="pagedllm-tp-monitor", daemon=True)
        self._monitor.start()
        # an engine nobody shut down (a script that just ends) still stops its workers in order:
        # multiprocessing's own exit handler (registered earlier, so run later) would terminate them
        # under a live process group, which aborted the interpreter ("terminate called ...")
        atexit.register(self.shutdown)
        logger.info("tensor-parallel size %d, pipeline-parallel size %d: rank 0 in this process, ranks 1..%d "
                    "in worker processes (%s)", args.tensor_parallel_size, args.pipeline_parallel_size,
                    world_size - 1, backend)

    def _await_joining(self, timeout_s: float = 300.0) -> None:
        """Wait until every worker is about to join the group (its ``("joining", None)``).

        The rendezvous itself waits for every rank until its timeout, so a worker that died on
        the way (a failed import, a bad argument) would hold the engine's start-up for minutes;
        its exit or its error report is seen here at once instead.

        Raises:
            RuntimeError: a worker exited or reported an error first (its traceback in the
                message), or sent nothing in ``timeout_s`` seconds.
        """
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if not wait([conn, p.sentinel], timeout=timeout_s):
                raise RuntimeError(f"tensor-parallel worker rank {rank} did not start in {timeout_s:.0f} s")
            try:
                kind, detail = conn.recv() if conn.poll() else ("died", None)
            except EOFError:
                kind, detail = "died", None
            if kind == "died":
                p.join(5)
                raise RuntimeError(f"tensor-parallel worker rank {rank} died while starting (exit code {p.exitcode})")
            if kind != "joining":
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start:\n{detail}")

    def start(self, runner: ModelRunner, runner_kwargs: dict) -> None:
        """Send every worker its runner's sizes and wait until each has built its runner.

        Raises:
            RuntimeError: a worker reported an error or died while starting.
        """
        super().start(runner, runner_kwargs)
        for conn in self.conns:
            conn.send(runner_kwargs)
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            try:
                kind, detail = conn.recv()
            except EOFError:
                raise RuntimeError(f"tensor-parallel worker rank {rank} died while starting "
                                   f"(exit code {p.exitcode})") from None
            if kind != "ready":
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start:\n{detail}")

    def _watch(self) -> None:
        """Wait for a worker's exit; record it as the failure unless shutting down."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        if not sentinels:
            return
        ready = wait(list(sentinels))
        if self._closing:
            return
        rank, p = sentinels[ready[0]]
        if self.failure is None:  # check_health may have described it first
            self.failure = _death_message(rank, p)
            logger.error("%s", self.failure)

    def check_health(self) -> None:
        """Raise ``WorkerDiedError`` when a worker process has exited."""
        if self.failure is None:
            for rank, p in enumerate(self.procs, start=1):
                # the sentinel, not ``is_alive``: while another thread reaps the child, ``is_alive``
                # can still answer True for a process that is gone (waitpid gives ECHILD)
                if wait([p.sentinel], timeout=0):
                    self.failure = _death_message(rank, p)
                    break
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def await_failure(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds in all for a worker process to exit."""
        wait([p.sentinel for p in self.procs], timeout=timeout_s)

    def execute(self, so, timer=None, non_blocking: bool = False) -> StepHandle:
        """Send ``so`` to every worker (``Executor._issue``), then issue it on rank 0.

        Raises:
            WorkerDiedError: a worker is gone (also from the returned handle's ``result()``).
        """
        return self._issue(so, timer, non_blocking)

    def _send(self, so) -> None:
        """Write ``so`` down every worker's pipe.

        Raises:
            WorkerDiedError: a pipe is closed (its worker is gone).
        """
        try:
            for conn in self.conns:
                conn.send(so)
        except OSError as e:
            self.check_health()
            raise WorkerDiedError(f"a tensor-parallel worker stopped reading steps ({e})") from e

    def shutdown(self) -> None:
        """Ask each worker to stop, wait up to 5 s, then terminate (and kill) what is left; leave the
        group. Safe to call twice."""
        atexit.unregister(self.shutdown)
        if self._closing and not self.conns:
            return
        self._closing = True
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        self.conns = []
        from pagedllm.distributed.parallel_state import destroy_distributed
        try:
            destroy_distributed()
        except Exception:  # a group whose peers died cannot be torn down cleanly; it is dropped anyway
            logger.debug("process group teardown failed", exc_info=True)


def _exit_code(p, timeout_s: float = 2.0) -> int | None:
    """The exit code of the exited process ``p``, waiting up to ``timeout_s`` seconds for it.

    Several threads may reap the same child (the monitor, ``check_health``, a caller's ``join``); the
    one whose ``waitpid`` loses gets ECHILD and reads None until the winner has stored the code, so
    poll briefly instead of trusting the first read.
    """
    deadline = time.monotonic() + timeout_s
    p.join(timeout_s)
    while p.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return p.exitcode


def _death_message(rank: int, p) -> str:
    """The failure text for worker ``rank`` (process ``p``) having exited."""
    return (f"tensor-parallel worker rank {rank} (pid {p.pid}) died with exit code {_exit_code(p)}; "
            "the engine cannot step any more")


def _start_child(p) -> None:
    """Start process ``p``, also from a daemonic process (the core process of ``pagedllm serve`` is one).

    ``multiprocessing`` refuses children to daemonic processes so that none outlives its parent at
    exit; a worker cannot: it exits when its pipe closes, and ``shutdown`` reaps it.
    """
    config = mp.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        p.start()
    finally:
        if daemon is not None:
            config["daemon"] = daemon
        else:
            config.pop("daemon", None)

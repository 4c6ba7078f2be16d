"""The executor interface (vLLM's ``Executor``), the one-rank executor and the checked step handle.

```
EngineCore ──execute(SchedulerOutput)──> Executor ──> handle.result() -> ModelRunnerOutput
   UniProcExecutor:   rank 0's ModelRunner on the core's execution thread (this file)
   MultiprocExecutor: a process per other rank (multiproc.py); RayExecutor: a Ray actor per
                      other rank (ray_executor.py); the worker ranks run worker_loop.py
```
``factory.create_executor`` picks one from the engine's arguments.
"""

from __future__ import annotations

from pagedllm.worker.model_runner import ModelRunner, StepHandle


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone: the job cannot step any more."""


class Executor:
    """Runs each scheduled step on every rank; rank 0's runner is ``self.runner``.

    Subclasses set ``runner_class`` (rank 0's runner type) and implement ``start``,
    ``execute``, ``check_health`` and ``shutdown``.
    """

    runner_class: type[ModelRunner] = ModelRunner

    def __init__(self) -> None:
        self.runner: ModelRunner | None = None

    def start(self, runner: ModelRunner, runner_kwargs: dict) -> None:
        """Take rank 0's built runner; give the other ranks theirs (``runner_kwargs``: the sizes)."""
        self.runner = runner

    def execute(self, so, timer=None, non_blocking: bool = False) -> StepHandle:
        """Issue step ``so`` on every rank; returns rank 0's handle (``ModelRunner.execute``'s contract)."""
        return self.runner.execute(so, timer, non_blocking=non_blocking)

    def check_health(self) -> None:
        """Return when every rank is alive, else raise ``WorkerDiedError``."""

    def await_failure(self, timeout_s: float) -> None:
        """After a collective failed: wait up to ``timeout_s`` seconds for a dead rank to be seen
        (a peer's death breaks the collective a moment before it is reaped or reported)."""

    def shutdown(self) -> None:
        """Stop the other ranks (safe to call twice)."""

    # ---- for executors with worker ranks ----------------------------------
    _latest = None  # the handle of the step issued last (pipeline overlap: see ``before_result``)

    def _send(self, so) -> None:
        """Hand step ``so`` to every worker rank, in issue order (subclasses with workers)."""
        raise NotImplementedError

    def _issue(self, so, timer, non_blocking: bool) -> "CheckedHandle":
        """Send ``so`` to the workers when they need it, then issue it on rank 0. Workers need a step
        that changes their batch, and with several steps in flight (``runner.pipeline_overlap``) every
        step: the next step's arrival is what tells a worker to finish the one before (its order)."""
        self.check_health()
        if not so.is_empty or so.finished_req_ids or self.runner.pipeline_overlap:
            self._send(so)
        handle = CheckedHandle(self.runner.execute(so, timer, non_blocking=non_blocking), self)
        self._latest = handle
        return handle

    def before_result(self, handle: "CheckedHandle") -> None:
        """Before rank 0 finishes ``handle``'s step: when no step was issued after it and steps
        overlap, send the workers an empty step, so that they finish it too (rank 0's finish
        broadcasts the tokens, which waits for every rank to take them)."""
        if self.runner.pipeline_overlap and handle is self._latest:
            from pagedllm.core.scheduler_output import SchedulerOutput
            self._latest = None
            self._send(SchedulerOutput())


class UniProcExecutor(Executor):
    """One rank, in the engine core's process: today's path, no communication."""


class CheckedHandle:
    """A step handle whose ``result()`` turns a collective broken by a dead worker into ``WorkerDiedError``."""

    def __init__(self, handle: StepHandle, executor: MultiprocExecutor) -> None:
        self._handle, self._executor = handle, executor
        self.grammar = handle.grammar

    def result(self):
        """Rank 0's ``ModelRunnerOutput``.

        Raises:
            WorkerDiedError: a worker died (the collective's own error is chained).
        """
        try:
            self._executor.before_result(self)
            return self._handle.result()
        except WorkerDiedError:
            raise
        except Exception:
            self._executor.await_failure(5.0)
            self._executor.check_health()
            raise

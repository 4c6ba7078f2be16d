"""How a prepared step is issued: the runner's step-issuer strategy, chosen once.

``InlineIssuer`` runs the step on the caller's thread when its result is asked (a worker rank, or
a runner without an execution thread); ``ThreadIssuer`` queues it on the engine core's one
execution thread (every step's torch work on one thread: see ``model_runner.py``);
``OverlappedIssuer`` (pipeline parallelism) launches the forward now and finishes it when its
result is asked, so several steps are in flight across the stages. Each calls the runner's
``_run`` / ``_launch`` / ``_finish`` by name at issue time, so a subclass's (the executors'
driver and worker runners) and a test's replacement are the ones that run.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.worker.prepared_step import PreparedStep, StepHandle


class InlineIssuer:
    """The step runs when its result is asked, on the asking thread; ``execute`` never waits."""

    waits = False

    def __init__(self, runner) -> None:
        self.runner = runner

    def issue(self, step: PreparedStep, prev: PreparedStep | None, timer) -> StepHandle:
        """A handle whose ``result()`` runs the step."""
        runner = self.runner
        return StepHandle(runner.input_batch, step, run=lambda: runner._run(step, prev, timer))


class ThreadIssuer:
    """The step is queued on the execution thread after every step issued before it."""

    waits = True

    def __init__(self, runner, executor: ThreadPoolExecutor) -> None:
        self.runner, self.executor = runner, executor

    def issue(self, step: PreparedStep, prev: PreparedStep | None, timer) -> StepHandle:
        """A handle on the queued step's future."""
        runner = self.runner
        return StepHandle(runner.input_batch, step, future=self.executor.submit(runner._run, step, prev, timer))


class OverlappedIssuer:
    """Launch the step now (after the steps issued before it) and finish it when its result is asked.

    The core asks for step N's result after issuing N+1, so each stage runs N+1's part while the
    later stages still run N's. A step whose inputs include tokens step N is still sampling (the
    scheduler put its requests in both: ``Scheduler._requests_per_step``) has N's finish queued
    before its launch, on every rank alike (each rank prepares the same step, so each sees the
    same pending inputs). ``executor`` ``None``: a worker rank, which launches on its own thread
    in the order rank 0 does.
    """

    waits = True

    def __init__(self, runner, executor: ThreadPoolExecutor | None) -> None:
        self.runner, self.executor = runner, executor
        self._open_finish = None  # queues the finish of the last overlapped step (idempotent)

    def issue(self, step: PreparedStep, prev: PreparedStep | None, timer) -> StepHandle:
        """A handle whose ``result()`` finishes the launched step (queued on the execution thread)."""
        if step.has_pending and self._open_finish is not None:
            self._open_finish()
        runner = self.runner
        if self.executor is None:
            launched, done = runner._launch(step, prev, timer), []

            def finish() -> ModelRunnerOutput:
                if not done:
                    done.append(runner._finish(step, prev, timer, launched))
                return done[0]
            self._open_finish = finish
            return StepHandle(runner.input_batch, step, run=finish)
        launching, finishing = self.executor.submit(runner._launch, step, prev, timer), []

        def submit_finish():
            if not finishing:
                finishing.append(self.executor.submit(lambda: runner._finish(step, prev, timer, launching.result())))
            return finishing[0]
        self._open_finish = submit_finish
        return StepHandle(runner.input_batch, step, run=lambda: submit_finish().result())


def make_issuer(runner, executor: ThreadPoolExecutor | None, pipeline_overlap: bool):
    """Overlapped with ``pipeline_overlap``, else on the execution thread, else inline."""
    if pipeline_overlap:
        return OverlappedIssuer(runner, executor)
    return InlineIssuer(runner) if executor is None else ThreadIssuer(runner, executor)

"""The two sides of a tensor-parallel step: rank 0's runner (the driver) and the other ranks' workers.

Every rank holds a ``ModelRunner`` over its shard of the model and applies the same
``SchedulerOutput`` to its own persistent batch, so the ranks' batches stay equal without
sending them. Each rank runs the forward (the all-reduces inside keep them in step); rank 0
alone gets the logits (``ParallelLogits`` gathers them), samples, and broadcasts the sampled
tokens, which the workers record as rank 0 does: the next step's pending inputs, and the
token history the batch keeps, are then the same on every rank. Sampling once and
broadcasting (rather than sampling on every rank) keeps structured-output masks, scripted
outputs and draft verification, all of which live on rank 0, out of the workers.

``worker_main`` is a worker process's whole life: join the group, load the shard, build the
runner with the sizes rank 0 sends, then run each ``SchedulerOutput`` from the pipe until
``None`` (shutdown) or the pipe closes (rank 0's process is gone).
"""

from __future__ import annotations

import logging
import traceback

import torch

from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.distributed.parallel_state import broadcast_object, destroy_distributed, get_pp_rank, init_distributed
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.prepared_step import Launched, PreparedStep

logger = logging.getLogger(__name__)


class DriverModelRunner(ModelRunner):
    """Rank 0's runner: a ``ModelRunner`` that broadcasts each step's tokens to the workers."""

    @torch.inference_mode()
    def _finish(self, step: PreparedStep, prev: PreparedStep | None, timer, launched: Launched) -> ModelRunnerOutput:
        """Sample as ``ModelRunner``; then send ``(sampled ids, emitted drafts)`` to every rank."""
        out = super()._finish(step, prev, timer, launched)
        broadcast_object((step.tokens_list(), step.emitted))
        return out


class WorkerModelRunner(ModelRunner):
    """A worker rank's runner: forwards its shard, samples nothing, takes rank 0's tokens.

    With ``pipeline_overlap`` it launches and finishes steps in the order ``run_step`` gives.
    """

    _unfinished = None  # the handle of the step launched but not finished (pipeline_overlap)

    @torch.inference_mode()
    def _launch(self, step: PreparedStep, prev: PreparedStep | None, timer) -> Launched:
        """Forward this rank's shard (the collectives pair with rank 0's); only issued with ``pipeline_overlap``."""
        self.step_inputs.fill(step, prev)
        args = (step.input_ids, step.positions, self.kv_caches, step.meta, step.logits_rows)
        if self.pipeline_overlap:
            return Launched(0.0, pipeline=self.model.forward_launch(*args))
        self.model(*args)
        return Launched(0.0)

    @torch.inference_mode()
    def _finish(self, step: PreparedStep, prev: PreparedStep | None, timer, launched: Launched) -> ModelRunnerOutput:
        """Finish the forward, then record rank 0's broadcast tokens.

        Raises:
            RuntimeError: rank 0 sent no tokens (it failed mid-step).
        """
        if launched.pipeline is not None:
            self.model.forward_finish(launched.pipeline)
        got = broadcast_object()
        if got is None:
            raise RuntimeError("rank 0 sent no tokens for the step")
        step.sampled_list, step.emitted = got
        step.sampled = torch.tensor(step.sampled_list, dtype=torch.int64, device=self.device)
        return ModelRunnerOutput()

    def run_step(self, so) -> None:
        """Run one step from rank 0 at once, or with ``pipeline_overlap`` in the order that keeps the
        pipeline full. Rank 0 launches step N+1, then finishes N (takes its logits and broadcasts
        its tokens, a broadcast that waits for every rank). A rank of stage 0 (its TP group gathers
        the logits with rank 0) does the same: launch N+1, then finish N. A later stage finishes N
        (takes N's tokens) before it runs N+1: were it to run N+1 first, rank 0's broadcast of N
        would wait for that whole computation and the stages would take turns instead of overlapping.
        """
        if not self.pipeline_overlap:
            self.execute(so).result()
        elif get_pp_rank() == 0:
            handle = self.execute(so)
            self.drain()
            self._unfinished = handle
        else:
            self.drain()
            self._unfinished = self.execute(so)

    def drain(self) -> None:
        """Finish the step still launched (shutdown: rank 0 finishes its last step before it stops us)."""
        before, self._unfinished = self._unfinished, None
        if before is not None:
            before.result()


def worker_main(rank: int, world_size: int, init_method: str, args, model_dir: str, conn, load_plan) -> None:
    """A worker process (``rank`` >= 1): join the group, load the shard ``load_plan`` describes (the
    engine plan's ``LoadPlan``, decided on rank 0), run steps from ``conn``.

    Messages on ``conn`` (a ``multiprocessing`` pipe end): in, ``runner kwargs`` (dict) once, then
    a ``SchedulerOutput`` per step, ``None`` to stop; out, ``("joining", None)`` before the
    rendezvous, ``("ready", None)`` once the runner is built, or ``("error", traceback text)`` when anything fails (then the process exits with 1).
    """
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.num_threads or torch.get_num_threads())
    try:
        conn.send(("joining", None))  # rank 0 waits for this before its rendezvous (MultiprocExecutor)
        init_distributed(rank, world_size, init_method, "nccl" if args.torch_device.type == "cuda" else "gloo",
                         pipeline_parallel_size=args.pipeline_parallel_size,
                         pipeline_micro_batches=args.pipeline_micro_batches)
        from pagedllm.models.load import load_model
        model, _ = load_model(model_dir, load_plan)
        kwargs = conn.recv()
        runner = WorkerModelRunner(model, **kwargs)
        conn.send(("ready", None))
        while (so := conn.recv()) is not None:
            runner.run_step(so)
        runner.drain()
    except EOFError:  # rank 0's process closed the pipe: nothing to report to
        raise SystemExit(1)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)
    finally:
        try:
            destroy_distributed()
        except Exception:  # the group is broken when a peer died: nothing left to release cleanly
            pass

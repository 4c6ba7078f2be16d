"""The Ray executor (``--distributed-executor-backend ray``): ranks 1..N-1 as Ray actors, so a job spans machines.

Same protocol as ``MultiprocExecutor`` (``executor.py``): rank 0 stays in the engine core, each
other rank is a ``RayWorker`` actor holding a ``WorkerModelRunner``; each step's
``SchedulerOutput`` is an actor call (a sync actor runs its calls one at a time, in the order one
caller submits them), and the forward's collectives go over ``torch.distributed`` (gloo, or NCCL),
rendezvousing at rank 0's node address. The actors are placed with a placement group (one bundle
of ``PAGEDLLM_RAY_CPUS_PER_WORKER`` CPUs, default 1, per worker; strategy ``PACK``, as vLLM), so
Ray puts them on the cluster's nodes. ``ray.init`` joins ``RAY_ADDRESS`` when set, else starts a
local cluster (stopped again at shutdown).

Failure: each actor also runs ``watch`` in a concurrency group of its own (with ``stop``), a call that never
returns while the actor lives; a monitor thread waits on those calls, so a dead actor is noticed
while idle too, and steps then raise ``WorkerDiedError``.
"""

from __future__ import annotations

import logging
import os
import threading

import pagedllm.envs as envs
from pagedllm.executor.base import Executor, WorkerDiedError
from pagedllm.worker.model_runner import ModelRunner, StepHandle

logger = logging.getLogger(__name__)


class RayWorker:
    """One rank >= 1 as a Ray actor (wrapped with ``ray.remote`` at run time; plain class here).

    Args:
        rank, world_size, init_method: this rank, the job's size and the rendezvous URL.
        args: the engine's ``EngineArgs``; model_dir: the model directory (on this node).
        load_plan: the ``LoadPlan`` this rank builds its shard from (the engine plan's).
    """

    def __init__(self, rank: int, world_size: int, init_method: str, args, model_dir: str, load_plan) -> None:
        self.rank, self.world_size, self.init_method = rank, world_size, init_method
        self.args, self.model_dir, self.load_plan = args, model_dir, load_plan
        self.model = self.runner = None
        self._stop = threading.Event()

    def join(self) -> int:
        """Join the process group (pairs with rank 0's); returns this process's pid."""
        import torch
        from pagedllm.distributed.parallel_state import init_distributed
        torch.set_num_threads(self.args.num_threads or torch.get_num_threads())
        init_distributed(self.rank, self.world_size, self.init_method,
                         "nccl" if self.args.torch_device.type == "cuda" else "gloo",
                         pipeline_parallel_size=self.args.pipeline_parallel_size,
                         pipeline_micro_batches=self.args.pipeline_micro_batches)
        return os.getpid()

    def load(self) -> None:
        """Load this rank's shard of the model."""
        from pagedllm.models.load import load_model
        self.model, _ = load_model(self.model_dir, self.load_plan)

    def start(self, runner_kwargs: dict) -> None:
        """Build the runner with rank 0's sizes (``ModelRunner`` keyword arguments)."""
        from pagedllm.executor.worker_loop import WorkerModelRunner
        self.runner = WorkerModelRunner(self.model, **runner_kwargs)

    def execute(self, so) -> None:
        """Run one step (its collectives pair with rank 0's), in rank 0's order (``WorkerModelRunner.run_step``)."""
        self.runner.run_step(so)

    def watch(self) -> None:
        """Return only at ``stop`` (in its own concurrency group): a dead actor fails this call."""
        self._stop.wait()

    def stop(self) -> None:
        """End ``watch`` and leave the process group."""
        self._stop.set()
        from pagedllm.distributed.parallel_state import destroy_distributed
        try:
            destroy_distributed()
        except Exception:  # a group whose peers are gone cannot be torn down cleanly
            pass


class RayExecutor(Executor):
    """Rank 0 in this process, ranks 1..N-1 as Ray actors placed by a placement group.

    Args:
        args, model_dir, world_size, run_on_exec, load_plan: as ``MultiprocExecutor``.
    Raises:
        ImportError: Ray is not installed (``pip install pagedllm[ray]``).
        RuntimeError: an actor failed to start.
    """

    def __init__(self, args, model_dir, world_size: int, run_on_exec, load_plan) -> None:
        super().__init__()
        try:
            import ray
        except ImportError:
            raise ImportError("--distributed-executor-backend ray needs Ray: pip install 'pagedllm[ray]'") from None
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from pagedllm.executor import worker_loop as worker
        from pagedllm.distributed.parallel_state import free_port, init_distributed
        self._ray, self._remove_pg = ray, remove_placement_group
        self.runner_class = worker.DriverModelRunner
        self.failure: str | None = None
        self._closing, self._pending, self.actors, self.pg = False, [], [], None
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=envs.RAY_ADDRESS, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": envs.PYTHONPATH}})
        try:
            cpus = envs.PAGEDLLM_RAY_CPUS_PER_WORKER
            self.pg = placement_group([{"CPU": cpus}] * (world_size - 1), strategy="PACK")
            ray.get(self.pg.ready(), timeout=120)
            url = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
            cls = ray.remote(num_cpus=cpus, concurrency_groups={"watch": 2})(RayWorker)
            for rank in range(1, world_size):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank - 1)
                self.actors.append(cls.options(scheduling_strategy=strategy, name=None).remote(
                    rank, world_size, url, args, str(model_dir), load_plan))
            joined = [a.join.remote() for a in self.actors]
            backend = "nccl" if args.torch_device.type == "cuda" else "gloo"
            run_on_exec(lambda: init_distributed(0, world_size, url, backend,
                                                 pipeline_parallel_size=args.pipeline_parallel_size,
                                                 pipeline_micro_batches=args.pipeline_micro_batches))
            self.pids = ray.get(joined)
            self._loads = [a.load.remote() for a in self.actors]
        except BaseException:
            self.shutdown()
            raise
        self._watches = {a.watch.options(concurrency_group="watch").remote(): rank
                         for rank, a in enumerate(self.actors, start=1)}
        threading.Thread(target=self._watch, name="pagedllm-ray-monitor", daemon=True).start()

    def start(self, runner: ModelRunner, runner_kwargs: dict) -> None:
        """Wait for every actor's shard, then build their runners.

        Raises:
            RuntimeError: an actor failed to load or build (its error is chained).
        """
        super().start(runner, runner_kwargs)
        try:
            self._ray.get(self._loads)
            self._ray.get([a.start.remote(runner_kwargs) for a in self.actors])
        except Exception as e:
            raise RuntimeError(f"a Ray tensor-parallel worker failed to start: {e}") from e

    def _describe(self, rank: int, error: BaseException | None) -> str:
        return (f"Ray worker rank {rank} (pid {self.pids[rank - 1]}) died"
                + (f": {type(error).__name__}" if error is not None else "") + "; the engine cannot step any more")

    def _watch(self, timeout_s: float | None = None) -> None:
        """Wait for a ``watch`` call to end (up to ``timeout_s``, ``None``: for ever); unless shutting
        down, that actor is gone: record the failure."""
        ready, _ = self._ray.wait(list(self._watches), num_returns=1, timeout=timeout_s)
        if self._closing or not ready or self.failure is not None:
            return
        error = None
        try:
            self._ray.get(ready[0])
        except Exception as e:  # RayActorError: the actor died
            error = e
        self.failure = self._describe(self._watches[ready[0]], error)
        logger.error("%s", self.failure)

    def await_failure(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for Ray to report a dead actor."""
        self._watch(timeout_s)

    def check_health(self) -> None:
        """Raise ``WorkerDiedError`` once an actor is gone or a step call failed on one."""
        if self.failure is None and self._pending:
            done, self._pending = self._ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
            for ref in done:
                try:
                    self._ray.get(ref)
                except Exception as e:
                    self.failure = f"a Ray worker failed a step ({type(e).__name__}: {e})"
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def execute(self, so, timer=None, non_blocking: bool = False) -> StepHandle:
        """Submit ``so`` to every actor (in order), then issue it on rank 0.

        Raises:
            WorkerDiedError: an actor is gone (also from the returned handle's ``result()``).
        """
        return self._issue(so, timer, non_blocking)

    def _send(self, so) -> None:
        """Submit ``so`` to every actor (a sync actor runs one caller's calls in order)."""
        self._pending += [a.execute.remote(so) for a in self.actors]

    def shutdown(self) -> None:
        """Stop and kill the actors, remove the placement group, leave the group; stop a Ray we started."""
        self._closing = True
        ray = self._ray
        for a in self.actors:
            try:
                ray.get(a.stop.options(concurrency_group="watch").remote(), timeout=5)
            except Exception:  # dead or stuck: killed below
                pass
            ray.kill(a)
        self.actors = []
        if self.pg is not None:
            self._remove_pg(self.pg)
            self.pg = None
        from pagedllm.distributed.parallel_state import destroy_distributed
        try:
            destroy_distributed()
        except Exception:
            logger.debug("process group teardown failed", exc_info=True)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()

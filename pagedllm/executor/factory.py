"""The choice of an executor from the engine's arguments (vLLM's ``Executor.get_class``).

Its own file so that the executors' modules need not import each other.
"""

from __future__ import annotations

from pagedllm.executor.base import Executor, UniProcExecutor
from pagedllm.executor.multiproc import MultiprocExecutor


def create_executor(args, model_dir, run_on_exec, load_plan=None) -> Executor:
    """The executor ``args`` ask for (``distributed_executor_backend``, ``tensor_parallel_size``,
    ``pipeline_parallel_size``); its worker ranks build the model ``load_plan`` (a
    ``models/load_plan.LoadPlan``: the engine plan's, rank 0's) describes.

    Raises:
        ValueError: an unknown executor backend.
        ImportError: ``ray`` without Ray installed.
    """
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    backend = args.distributed_executor_backend or "mp"
    if world == 1 or backend == "uni":
        return UniProcExecutor()
    if backend == "mp":
        return MultiprocExecutor(args, model_dir, world, run_on_exec, load_plan)
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor
        return RayExecutor(args, model_dir, world, run_on_exec, load_plan)
    raise ValueError(f"--distributed-executor-backend must be mp, ray or uni, got {backend!r}")

"""The process group of a tensor-parallel job, and the rank helpers the model layers ask.

Follows vLLM's ``vllm.distributed.parallel_state`` in shape: one ``torch.distributed`` job per
engine (gloo on the CPU, NCCL on CUDA) of ``tp * pp`` ranks laid out as a grid, global rank
``pp_rank * tp + tp_rank`` (vLLM's layout; Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", section 2.3): each pipeline stage is one
tensor-parallel group of ``tp`` consecutive ranks, and the ranks at the same TP position of every
stage form one pipeline group (``grid_groups``). The state is per process: the engine core holds
rank 0 (stage 0, TP rank 0), each worker process one other rank.
A process without a group (the default) is rank 0 of a group of size 1, so the
model code asks ``get_tp_size()`` / ``get_pp_size()`` and never whether a group exists.

The communication helpers count calls and bytes (``CommStats``), which is how the
per-step all-reduce traffic of ``docs/distributed.md`` was measured.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Collective calls, payload bytes (this rank's tensor) and wall seconds (``time.perf_counter``,
    waiting for slower peers included) since the last reset."""

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    all_reduce_s: float = 0.0
    gather_calls: int = 0
    gather_bytes: int = 0
    gather_s: float = 0.0
    broadcast_calls: int = 0
    broadcast_s: float = 0.0
    p2p_calls: int = 0
    p2p_bytes: int = 0
    p2p_s: float = 0.0

    def reset(self) -> None:
        """Zero every counter."""
        self.all_reduce_calls = self.all_reduce_bytes = self.gather_calls = self.gather_bytes = 0
        self.broadcast_calls = self.p2p_calls = self.p2p_bytes = 0
        self.all_reduce_s = self.gather_s = self.broadcast_s = self.p2p_s = 0.0


_ALONE = {"rank": 0, "world_size": 1, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
          "group": None, "tp_group": None, "pp_group": None, "pp_micro_batches": 1}
_STATE = dict(_ALONE)
COMM_STATS = CommStats()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grid_groups(tp_size: int, pp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The global ranks of every tensor-parallel group (one per stage) and every pipeline group (one
    per TP position) of a ``tp_size`` x ``pp_size`` job laid out as ``pp_rank * tp_size + tp_rank``.

    Example: TP=2 x PP=2 -> ``([[0, 1], [2, 3]], [[0, 2], [1, 3]])``.
    """
    tp_groups = [[p * tp_size + t for t in range(tp_size)] for p in range(pp_size)]
    pp_groups = [[p * tp_size + t for p in range(pp_size)] for t in range(tp_size)]
    return tp_groups, pp_groups


def _member_group(rank_lists: list[list[int]], rank: int, world_size: int):
    """The process group among ``rank_lists`` that holds ``rank`` (``None`` for a one-rank group, the
    world group when a list spans the job). Every rank of the job must call this with the same lists
    in the same order: ``dist.new_group`` is collective over the whole job."""
    mine = None
    for ranks in rank_lists:
        if len(ranks) == 1 or len(ranks) == world_size:  # no new group needed (same on every rank)
            group = None if len(ranks) == 1 else dist.group.WORLD
        else:
            group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def init_distributed(rank: int, world_size: int, init_method: str, backend: str = "gloo",
                     timeout_s: float = 300.0, pipeline_parallel_size: int = 1,
                     pipeline_micro_batches: int = 0) -> None:
    """Join the job as global ``rank`` of ``world_size`` = ``tp * pipeline_parallel_size`` ranks and
    build the grid's groups: this rank is TP rank ``rank % tp`` of stage ``rank // tp``.

    Args:
        init_method: rendezvous URL, ``tcp://127.0.0.1:PORT`` (every rank passes the same).
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA).
        timeout_s: how long the rendezvous or a collective waits for a missing peer (seconds; a
            peer that died fails a collective at once, this bounds one that hangs). Ranks meet
            in collectives only while stepping (idle workers wait on their pipe), so no legitimate
            wait comes near it.
        pipeline_parallel_size: stages (1: the whole job is one TP group).
        pipeline_micro_batches: micro-batches a pipelined step is split into
            (``--pipeline-micro-batches``; 0: one per stage; 1: the whole step at once).
    Raises:
        RuntimeError: a group already exists in this process, or the rendezvous failed.
        ValueError: ``world_size`` is not a multiple of ``pipeline_parallel_size``.
    """
    if _STATE["group"] is not None:
        raise RuntimeError("this process already belongs to a tensor-parallel group")
    if world_size % pipeline_parallel_size:
        raise ValueError(f"{world_size} ranks do not split into {pipeline_parallel_size} pipeline stages")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    pp = pipeline_parallel_size
    tp = world_size // pp
    tp_lists, pp_lists = grid_groups(tp, pp)
    _STATE.update(rank=rank, world_size=world_size, tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp,
                  pp_size=pp, group=dist.group.WORLD, tp_group=_member_group(tp_lists, rank, world_size),
                  pp_group=_member_group(pp_lists, rank, world_size),
                  pp_micro_batches=pipeline_micro_batches or pp)


def destroy_distributed() -> None:
    """Leave the process group (no-op without one); afterwards this process is rank 0 of 1 again."""
    if _STATE["group"] is not None:
        try:
            dist.destroy_process_group()
        finally:
            _STATE.update(_ALONE)


def get_tp_rank() -> int:
    """This process's tensor-parallel rank (0 without a group)."""
    return _STATE["tp_rank"]


def get_tp_size() -> int:
    """Ranks in the tensor-parallel group (1 without a group)."""
    return _STATE["tp_size"]


def get_world_size() -> int:
    """Ranks in the job (tensor times pipeline parallel; 1 without a group)."""
    return _STATE["world_size"]


def get_pp_rank() -> int:
    """This process's pipeline stage (0 without a group)."""
    return _STATE["pp_rank"]


def get_pp_size() -> int:
    """Pipeline stages (1 without a group)."""
    return _STATE["pp_size"]


def get_pp_micro_batches() -> int:
    """Micro-batches a pipelined step is split into at most (1 without a pipeline or with
    ``--pipeline-micro-batches 1``)."""
    return _STATE["pp_micro_batches"] if _STATE["pp_size"] > 1 else 1


def pp_peer(stage: int) -> int:
    """The global rank at this rank's TP position in pipeline stage ``stage`` (its pipeline-group peer)."""
    return stage * _STATE["tp_size"] + _STATE["tp_rank"]


def pp_send(x: torch.Tensor, dst: int) -> None:
    """Send ``x`` (contiguous, any dtype) to this TP position's rank of pipeline stage ``dst``
    (blocks until received by gloo)."""
    COMM_STATS.p2p_calls += 1
    COMM_STATS.p2p_bytes += x.numel() * x.element_size()
    t0 = time.perf_counter()
    # send/recv take global ranks; the group only names the channel (this TP position's pipeline)
    dist.send(x.contiguous(), pp_peer(dst), group=_STATE["pp_group"])
    COMM_STATS.p2p_s += time.perf_counter() - t0


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, src: int, device=None) -> torch.Tensor:
    """Receive a ``shape`` ``dtype`` tensor from this TP position's rank of pipeline stage ``src``."""
    x = torch.empty(shape, dtype=dtype, device=device)
    t0 = time.perf_counter()
    dist.recv(x, pp_peer(src), group=_STATE["pp_group"])
    COMM_STATS.p2p_s += time.perf_counter() - t0
    return x


def pp_isend(x: torch.Tensor, dst: int, tag: int = 0):
    """Start sending ``x`` to this TP position's rank of pipeline stage ``dst`` without waiting.

    Returns the ``torch.distributed`` work handle: ``x`` must stay unchanged until its ``wait()``
    (the caller keeps both). ``tag`` tells apart the micro-batches of one step.
    """
    x = x.contiguous()
    COMM_STATS.p2p_calls += 1
    COMM_STATS.p2p_bytes += x.numel() * x.element_size()
    return dist.isend(x, pp_peer(dst), group=_STATE["pp_group"], tag=tag)


def pp_irecv(shape: tuple[int, ...], dtype: torch.dtype, src: int, device=None, tag: int = 0):
    """Start receiving a ``shape`` ``dtype`` tensor from this TP position's rank of stage ``src``.

    Returns ``(tensor, work)``: the tensor holds the message once ``work.wait()`` returned.
    """
    x = torch.empty(shape, dtype=dtype, device=device)
    return x, dist.irecv(x, pp_peer(src), group=_STATE["pp_group"], tag=tag)


def pp_wait(work) -> None:
    """Wait for a ``pp_isend``/``pp_irecv`` handle, the wait counted in ``COMM_STATS.p2p_s``."""
    t0 = time.perf_counter()
    work.wait()
    COMM_STATS.p2p_s += time.perf_counter() - t0


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over this stage's TP ranks, in place; returns ``x`` (any shape and dtype)."""
    if _STATE["tp_size"] == 1:
        return x
    COMM_STATS.all_reduce_calls += 1
    COMM_STATS.all_reduce_bytes += x.numel() * x.element_size()
    t0 = time.perf_counter()
    dist.all_reduce(x, group=_STATE["tp_group"])
    COMM_STATS.all_reduce_s += time.perf_counter() - t0
    return x


def tp_gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every TP rank's ``x`` ``[..., n]`` along the last dim on this stage's TP rank 0.

    Every rank of the stage passes the same shape. Returns ``[..., tp_size * n]`` on TP rank 0 and
    ``None`` on the others (vLLM's ``tensor_model_parallel_gather``).
    """
    size = _STATE["tp_size"]
    if size == 1:
        return x
    x = x.contiguous()
    COMM_STATS.gather_calls += 1
    COMM_STATS.gather_bytes += x.numel() * x.element_size()
    rank = _STATE["tp_rank"]
    parts = [torch.empty_like(x) for _ in range(size)] if rank == 0 else None
    t0 = time.perf_counter()
    # dst is a global rank: TP rank 0 of this stage (rank 0 itself for stage 0)
    dist.gather(x, parts, dst=_STATE["pp_rank"] * size, group=_STATE["tp_group"])
    COMM_STATS.gather_s += time.perf_counter() - t0
    return torch.cat(parts, dim=-1) if rank == 0 else None


def broadcast_object(obj=None):
    """Rank 0's ``obj`` on every rank of the job (pickled; for small per-step messages)."""
    if _STATE["world_size"] == 1:
        return obj
    COMM_STATS.broadcast_calls += 1
    box = [obj]
    t0 = time.perf_counter()
    dist.broadcast_object_list(box, src=0, group=_STATE["group"])
    COMM_STATS.broadcast_s += time.perf_counter() - t0
    return box[0]

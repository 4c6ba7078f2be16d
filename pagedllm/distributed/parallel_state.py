"""The process group of a tensor-parallel job, and the rank helpers the model layers ask.

Follows vLLM's ``vllm.distributed.parallel_state`` in shape: one ``torch.distributed``
process group per engine (gloo on the CPU, NCCL on CUDA), which is either the tensor-parallel
group or the pipeline (TP and PP do not combine yet). The state is
per process: the engine core holds rank 0, each worker process one other rank.
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


_STATE = {"rank": 0, "world_size": 1, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "group": None}
COMM_STATS = CommStats()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, init_method: str, backend: str = "gloo",
                     timeout_s: float = 300.0, pipeline_parallel_size: int = 1) -> None:
    """Join the job's process group as ``rank`` of ``world_size``: the tensor-parallel group, or with
    ``pipeline_parallel_size`` > 1 the pipeline (rank ``r`` is stage ``r``; TP and PP do not combine yet).

    Args:
        init_method: rendezvous URL, ``tcp://127.0.0.1:PORT`` (every rank passes the same).
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA).
        timeout_s: how long the rendezvous or a collective waits for a missing peer (seconds; a
            peer that died fails a collective at once, this bounds one that hangs). Ranks meet
            in collectives only while stepping (idle workers wait on their pipe), so no legitimate
            wait comes near it.
    Raises:
        RuntimeError: a group already exists in this process, or the rendezvous failed.
    """
    if _STATE["group"] is not None:
        raise RuntimeError("this process already belongs to a tensor-parallel group")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    pp = pipeline_parallel_size > 1
    _STATE.update(rank=rank, world_size=world_size, tp_rank=0 if pp else rank, tp_size=1 if pp else world_size,
                  pp_rank=rank if pp else 0, pp_size=world_size if pp else 1, group=dist.group.WORLD)


def destroy_distributed() -> None:
    """Leave the process group (no-op without one); afterwards this process is rank 0 of 1 again."""
    if _STATE["group"] is not None:
        try:
            dist.destroy_process_group()
        finally:
            _STATE.update(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, group=None)


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


def pp_send(x: torch.Tensor, dst: int) -> None:
    """Send ``x`` (contiguous, any dtype) to pipeline rank ``dst`` (blocks until received by gloo)."""
    COMM_STATS.p2p_calls += 1
    COMM_STATS.p2p_bytes += x.numel() * x.element_size()
    t0 = time.perf_counter()
    dist.send(x.contiguous(), dst, group=_STATE["group"])
    COMM_STATS.p2p_s += time.perf_counter() - t0


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, src: int, device=None) -> torch.Tensor:
    """Receive a ``shape`` ``dtype`` tensor from pipeline rank ``src``."""
    x = torch.empty(shape, dtype=dtype, device=device)
    t0 = time.perf_counter()
    dist.recv(x, src, group=_STATE["group"])
    COMM_STATS.p2p_s += time.perf_counter() - t0
    return x


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP ranks, in place; returns ``x`` (any shape and dtype)."""
    if _STATE["tp_size"] == 1:
        return x
    COMM_STATS.all_reduce_calls += 1
    COMM_STATS.all_reduce_bytes += x.numel() * x.element_size()
    t0 = time.perf_counter()
    dist.all_reduce(x, group=_STATE["group"])
    COMM_STATS.all_reduce_s += time.perf_counter() - t0
    return x


def tp_gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's ``x`` ``[..., n]`` along the last dim on rank 0.

    Every rank passes the same shape. Returns ``[..., tp_size * n]`` on rank 0 and ``None``
    on the others (vLLM's ``tensor_model_parallel_gather``).
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
    dist.gather(x, parts, dst=0, group=_STATE["group"])
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

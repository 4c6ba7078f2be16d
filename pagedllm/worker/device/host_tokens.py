"""The step's one device-to-host copy: sampled token ids, non-blocking into pinned memory.

On a GPU, ``tensor.tolist()`` on the execution thread would wait for the whole step before the
thread could queue the next one. Instead the ids are copied with ``non_blocking=True`` into a
pinned host buffer and a CUDA event is recorded behind the copy; the scheduling thread reads
them (``get``) when it processes the step's output, which waits on that event only. Follows
vLLM's Model Runner V2 (async output copy on a side stream with an event) in spirit.
"""

from __future__ import annotations

import torch


class HostTokens:
    """Sampled ids ``[R]`` int64 on their way to the host.

    Args:
        tokens: ``[R]`` int64 device tensor of the step's sampled ids (not written afterwards:
            the copy reads it after the step's kernels, in stream order).

    On a CPU device (Triton's interpreter, the torch backends) the tensor is already host memory
    and ``get`` is a plain conversion.
    """

    def __init__(self, tokens: torch.Tensor) -> None:
        self._event = None
        self._list: list[int] | None = None
        if tokens.device.type == "cuda":
            # the caching host allocator reuses pinned blocks once their event has passed
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens

    def ready(self) -> bool:
        """True once the copy has landed (never blocks)."""
        return self._event is None or self._event.query()

    def get(self) -> list[int]:
        """The ids as a host list; waits for the copy's event the first time (idempotent, and safe
        to call from either thread: both would compute the same list)."""
        if self._list is None:
            if self._event is not None:
                self._event.synchronize()
            self._list = self._host.tolist()
        return self._list

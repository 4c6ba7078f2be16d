"""Host arrays to the device without a stream sync: one pinned staging buffer, one copy.

A copy from pageable host memory makes CUDA synchronize the stream first (the
host waits for the step in flight); from pinned memory, ``non_blocking=True``
only queues it. On the CPU the arrays are wrapped, not copied.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The int64 ``arrays`` as tensors on ``device``, in order (shapes kept).

    On the CPU each is ``torch.from_numpy`` of it (shares memory; the caller must not change the
    arrays while the tensors are in use). On another device they are packed into one pinned int64
    buffer and copied with ``non_blocking=True``: one transfer, no wait; the results are views of
    one device buffer.
    """
    device = torch.device(device)
    arrays = [np.asarray(a, dtype=np.int64) for a in arrays]
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    host = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0, np.int64))
    buf = host.pin_memory().to(device, non_blocking=True)
    out, at = [], 0
    for a in arrays:
        out.append(buf[at:at + a.size].view(a.shape))
        at += a.size
    return out

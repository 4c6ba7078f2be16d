"""``worker/upload.to_device``: host arrays as device tensors (wrapped on the CPU)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.worker.upload import to_device


def test_cpu_wraps_arrays_in_order():
    a, b, c = np.arange(5), np.arange(6).reshape(2, 3), np.zeros(0, np.int64)
    ta, tb, tc = to_device([a, b, c], torch.device("cpu"))
    assert ta.tolist() == a.tolist() and tb.shape == (2, 3) and tb.tolist() == b.tolist() and tc.numel() == 0
    assert ta.dtype == torch.int64 and ta.data_ptr() == a.ctypes.data  # no copy on the CPU

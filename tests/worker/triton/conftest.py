"""Triton kernels on these CPUs: Triton's interpreter, switched on for this folder only.

``TRITON_INTERPRET`` is read when a kernel is decorated (``triton.jit``), i.e. when
``pagedllm.worker.device.device_sampling_kernels`` is first imported, so it is set here, at
collection, before any test of this folder imports it. No other test module imports
the kernels, so the rest of the suite is unaffected (and the default backend choice
never picks Triton on the CPU, interpreter or not). Tests skip when triton is not
installed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items) -> None:
    """Skip this folder's tests when triton is missing."""
    if importlib.util.find_spec("triton") is None:
        skip = pytest.mark.skip(reason="needs triton (pip install triton==3.9.0)")
        for item in items:
            if "tests/worker/triton" in str(item.fspath):
                item.add_marker(skip)

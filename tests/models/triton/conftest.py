"""The experts' Triton kernels on these CPUs: Triton's interpreter, switched on for this folder only
(``TRITON_INTERPRET`` is read when a kernel is decorated, i.e. when ``models.moe_triton`` is first
imported; no other test module imports it). The tests skip when triton is not installed."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

"""Giving freed heap memory back to the operating system.

glibc keeps the pages of freed allocations below its (adaptive, up to 32 MiB) mmap threshold
mapped in the process: after the float32 weights are replaced by packed ones, or after a burst of
large prefill activations, resident memory stays at its high-water mark. ``malloc_trim(0)``
returns the free pages of every arena. It is called when the engine goes idle and after a model
is quantized at load, never inside a step.
"""

from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=1)
def _trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def return_freed_memory() -> None:
    """``malloc_trim(0)`` where the C library is glibc; a no-op elsewhere. Takes about a millisecond."""
    trim = _trim()
    if trim is not None:
        trim(0)

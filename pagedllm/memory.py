"""Giving freed heap memory back to the operating system.

glibc keeps the pages of freed allocations below its (adaptive, up to 32 MiB) mmap threshold
mapped in the process: after the float32 weights are replaced by packed ones, or after a burst of
large prefill activations, resident memory stays at its high-water mark. ``malloc_trim(0)``
returns the free pages of every arena. It is called when the engine goes idle and after a model
is quantized at load, never inside a step. ``freeze_startup_heap`` keeps start-up objects out of
the garbage collector's full passes.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os


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


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (model modules, tokenizer tables, configs) out of the
    garbage collector's reach: ``gc.collect()`` then ``gc.freeze()``, as vLLM does after loading.

    Why: Python's full collections traverse every tracked object; with a tokenizer's vocabulary and a
    model's modules alive they took about 5% of a batch-1 decode step (``perf`` on SmolLM2). Objects
    made later are collected as before. Only for a process that lives as long as its engine (the
    served core): frozen objects that later become cyclic garbage are never freed, so an in-process
    ``LLM`` (which a program may make and drop several times) does not call it."""
    gc.collect()
    gc.freeze()


RUNTIME_BYTES = 512 << 20  # the Python runtime, torch and the tokenizer: what a served core holds besides
# its weights and pools (the bound issue 39 measures against)


def weight_bytes(model) -> int:
    """Bytes of every tensor a model holds (parameters, buffers and plain tensor attributes such as a
    packed layer's blocks), each storage counted once (tied weights, shared tables); meta tensors
    are skipped."""
    import torch
    seen, total = set(), 0
    for mod in model.modules():
        tensors = list(mod._parameters.values()) + list(mod._buffers.values())
        tensors += [v for v in vars(mod).values() if isinstance(v, torch.Tensor)]
        tensors += [t for v in vars(mod).values() if hasattr(v, "tensors") for t in v.tensors()]  # e.g. experts
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            try:
                key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            except NotImplementedError:  # an opaque tensor (oneDNN's prepacked weight): its own bytes
                key, size = id(t), t.numel() * t.element_size()
            if key not in seen:
                seen.add(key)
                total += size
    return total


def resident_bytes() -> int:
    """This process's resident memory in bytes (``/proc/self/statm``), 0 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def expected_resident_mib(model, pool_bytes: int, runtime_bytes: int = 0) -> float:
    """The resident memory (MiB) a process serving ``model`` with ``pool_bytes`` of KV (and state)
    pool should settle at: its weights + the pool + the runtime: ``runtime_bytes`` (what the
    process held before the model was loaded: interpreter, torch, tokenizer) or at least
    ``RUNTIME_BYTES``."""
    return (weight_bytes(model) + pool_bytes + max(runtime_bytes, RUNTIME_BYTES)) / 2**20

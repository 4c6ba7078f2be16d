"""What this CPU can run, asked of the CPU and the OS at run time (never assumed from the build machine).

The kernels' instruction-set build (``select_isa``, issue 37) comes from ``cpu_isa.c``, compiled
for the baseline target and asked once per process: cpuid for the features and XCR0 (xgetbv) for
the register state the OS saves, so a CPU that lists AVX-512 under an OS or hypervisor that leaves
its state off gets the AVX2 build. ``PAGEDLLM_CPU_ISA`` lowers the choice (tests, comparisons).

AMX needs more than the ``amx_tile`` / ``amx_bf16`` flags of ``/proc/cpuinfo``: Linux enables
the 8 KiB tile data state per process only after ``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`` (kernel 5.16+, ``Documentation/arch/x86/xstate.rst``); without it the first
tile instruction dies with SIGILL. Seen in practice: a Sapphire Rapids VM listing AMX where
llama.cpp's ``-march=native`` build crashed on its AMX path. ``amx_usable`` asks for the
permission and then reads it back, and says no on any failure.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
from pathlib import Path

import torch

import pagedllm.envs as envs

logger = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_PERM, _ARCH_REQ_XCOMP_PERM = 0x1022, 0x1023
_XFEATURE_XTILEDATA = 18


def cpu_flags() -> set[str]:
    """The ``flags`` of the first CPU in ``/proc/cpuinfo`` (empty when unreadable)."""
    from pagedllm.kernels.cpu_build import _cpu_flags  # the one reader of the flags line
    line = _cpu_flags()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[str, tuple[str, ...]]:
    """``(highest build, every build this CPU runs)`` from ``cpu_isa.c`` (``pl_cpu_isa`` and
    ``pl_cpu_isa_mask``); ``("generic", ("generic",))`` off x86 or when the probe cannot be built (logged)."""
    from pagedllm.kernels import cpu_build as cpu  # the builder, not cpu.py (which imports this module)
    if not cpu._x86():
        return "generic", ("generic",)
    try:
        lib = ctypes.CDLL(str(cpu.compile_library([Path(__file__).with_name("cpu_isa.c")],
                                                  ["-O2", "-fPIC", "-shared"], "cpu_isa")))
        mask = lib.pl_cpu_isa_mask()
        return cpu.ISAS[lib.pl_cpu_isa()], tuple(n for i, n in enumerate(cpu.ISAS) if mask >> i & 1)
    except (OSError, RuntimeError, IndexError, AttributeError) as e:
        logger.warning("could not ask the CPU for its instruction sets, using the generic kernels: %s", e)
        return "generic", ("generic",)


def detected_isa() -> str:
    """The highest kernel build this CPU and OS can run (a ``kernels.cpu.ISAS`` name): the answer of
    ``cpu_isa.c``'s ``pl_cpu_isa``; ``generic`` off x86 or when the probe cannot be built (logged)."""
    return _probe()[0]


def select_isa() -> tuple[str, str]:
    """The kernel build to load and why: ``detected_isa()``, or the lower one ``PAGEDLLM_CPU_ISA``
    names (``avx512vnni``, ``avxvnni``, ``avx2``, ``generic``). A higher one than the CPU runs is
    refused with a warning (its first instruction would fault) and the detected one is used.

    Raises:
        ValueError: ``PAGEDLLM_CPU_ISA`` is not one of those names.
    """
    from pagedllm.kernels.cpu_build import ISAS
    best = detected_isa()
    forced = envs.PAGEDLLM_CPU_ISA
    if not forced:
        return best, f"the best this CPU runs: {best}"
    if forced not in ISAS:
        raise ValueError(f"PAGEDLLM_CPU_ISA={forced!r}: expected one of {', '.join(ISAS)}")
    if forced not in runnable_isas():  # above the CPU, or a tier it skips (AVX-VNNI on a Zen 4)
        logger.warning("PAGEDLLM_CPU_ISA=%s is not one this CPU runs (%s): using %s", forced,
                       ", ".join(runnable_isas()), best)
        return best, f"PAGEDLLM_CPU_ISA={forced} refused: this CPU runs {', '.join(runnable_isas())}"
    return forced, f"PAGEDLLM_CPU_ISA={forced}; this CPU runs up to {best}"


def runnable_isas() -> list[str]:
    """Every kernel build this CPU runs, lowest first (tests run each): not always every tier below
    the highest (a Zen 4 runs avx512vnni and avx2 but not avxvnni)."""
    return list(_probe()[1])


@functools.lru_cache(maxsize=1)
def amx_usable() -> bool:
    """True when this process may execute AMX bf16 tile instructions: the CPU lists ``amx_tile`` and
    ``amx_bf16`` and the kernel granted the tile data permission (requested here; idempotent)."""
    if platform.machine() not in ("x86_64", "AMD64") or not {"amx_tile", "amx_bf16"} <= cpu_flags():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
            logger.info("AMX listed by the CPU but the kernel refused the tile permission (errno %d)",
                        ctypes.get_errno())
            return False
        mask = ctypes.c_uint64(0)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
            return False
        return bool(mask.value & (1 << _XFEATURE_XTILEDATA))
    except (OSError, AttributeError):
        return False


def auto_dtype() -> tuple[torch.dtype, str]:
    """``--dtype auto`` on the CPU: ``(dtype, reason)``.

    float32 everywhere: it is the reference dtype, and bfloat16 matrix products run hundreds of
    times slower than float32 without AMX. Where AMX is usable the large matrix products (prefill,
    big batches) run in bfloat16 on their own (``prefill_dtype``) while the weights, the KV cache
    and decode stay float32.
    """
    if amx_usable():
        return torch.float32, "float32 (AMX usable: prefill and large batches multiply in bfloat16)"
    return torch.float32, "float32 (no usable AMX: bfloat16 matrix products would be slower)"


def prefill_dtype() -> torch.dtype:
    """The dtype of large dequantized matrix products: bfloat16 where AMX is usable, else float32.
    ``PAGEDLLM_PREFILL_BF16=1`` / ``0`` forces it (tests, measurements)."""
    forced = envs.PAGEDLLM_PREFILL_BF16
    if forced is not None:
        return torch.bfloat16 if forced == "1" else torch.float32
    return torch.bfloat16 if amx_usable() else torch.float32

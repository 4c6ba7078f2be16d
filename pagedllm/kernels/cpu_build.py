"""Compiling the C kernels: one shared library per instruction set (issue 37), cached.

Each build gets explicit target flags (``ISA_FLAGS``) rather than ``-march=native``, so what a
library may execute is a property of its name, not of the machine that compiled it: a cache
directory shared between machines is safe, and the process picks its build at run time
(``cpu_features.select_isa``). ``compile_library`` also builds ``cpu_isa.c``, the probe that
picks.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import pagedllm.envs as envs
from pagedllm.cache import cache_root

_SOURCES = [Path(__file__).with_name(n) for n in ("cpu_kernels.c", "decode_stack.c", "moe_kernels.c", "quant_kernels.c",
                                                  "quant_avx512.c", "quant_avx2.c", "state_kernels.c")]
# included by the sources: part of the build's hash
_HEADERS = [Path(__file__).with_name(n) for n in ("vec_math.h", "cpu_common.h", "quant_common.h", "quant_i8_driver.h")]
_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared"]
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
# one build per instruction set, lowest first (the index is quant_common.h's QI8_ISA, pl_isa()):
# generic is the compiler's baseline target (x86-64: SSE2), the float32 kernels only
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "generic": (),
    "avx2": _AVX2,
    "avxvnni": (*_AVX2, "-mavxvnni"),
    "avx512vnni": (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd", "-mavx512vnni"),
}
ISAS = tuple(ISA_FLAGS)
# the byte dot product each build's int8-activation kernels use (for the logs and /stats)
ISA_DOT = {"avx2": "vpmaddubsw + vpmaddwd, ymm", "avxvnni": "AVX-VNNI vpdpbusd, ymm",
           "avx512vnni": "AVX-512 VNNI vpdpbusd, zmm"}

def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def compile_library(sources: list[Path], flags: list[str], name: str, cache_dir: Path | None = None,
                    headers: list[Path] = ()) -> Path:
    """Compile ``sources`` into ``<cache>/kernels/<name>-<hash>.so`` unless that file exists; return its path.

    The hash covers the sources, ``headers``, the flags and the compiler's version (never the CPU:
    the flags alone say what the code may execute). On non-x86 machines, where the builds use
    ``-march=native``, the CPU's flags join the hash.

    Raises:
        RuntimeError: no C compiler, or compilation failed (the message holds its output).
    """
    cc = shutil.which(envs.CC) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    src = b"\0".join(p.read_bytes() for p in [*sources, *headers])
    parts = [src, " ".join(flags).encode(), version.encode()]
    if "-march=native" in flags:
        parts.append(_cpu_flags().encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    out_dir = (cache_dir or cache_root()) / "kernels"
    out = out_dir / f"{name}-{key}.so"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    # build under a temporary name, then rename: concurrent first uses never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out_dir) as objs:
            _compile_and_link(cc, flags, sources, Path(objs), tmp, name)
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(tmp, out)
    return out


def _compile_and_link(cc: str, flags: list[str], sources: list[Path], objs: Path, out: str, name: str) -> None:
    """Each source to an object file in ``objs``, one compiler per core, then one link into ``out``:
    the sources' compile times add up to about two minutes for one build on one core.

    Raises:
        RuntimeError: a compiler or the linker failed (the message holds its output).
    """
    from concurrent.futures import ThreadPoolExecutor
    compile_flags = [f for f in flags if f != "-shared"]
    targets = [objs / f"{i}-{src.stem}.o" for i, src in enumerate(sources)]
    jobs = [[cc, *compile_flags, "-c", str(src), "-o", str(o)] for src, o in zip(sources, targets)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        procs = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), jobs))
    if all(p.returncode == 0 for p in procs):
        procs.append(subprocess.run([cc, *flags, *map(str, targets), "-o", out, "-lm"], capture_output=True, text=True))
    failed = next((p for p in procs if p.returncode != 0), None)
    if failed is not None:
        raise RuntimeError(f"compiling {name} failed:\n{failed.stderr[-2000:]}")


def build(cache_dir: Path | None = None, isa: str = "generic") -> Path:
    """Compile the kernels (``cpu_kernels.c``, ``quant_*.c``, ``state_kernels.c``) for instruction set
    ``isa`` (an ``ISA_FLAGS`` key) unless a matching build is cached; return the ``.so`` path.

    Building never asks whether this CPU can run the result (tests build every variant); loading
    one the CPU lacks is the caller's mistake (``cpu_features.select_isa`` chooses). On non-x86
    machines every name builds ``-march=native`` (the x86 flags do not apply).

    Raises:
        ValueError: an unknown ``isa``.
        RuntimeError: no C compiler, or compilation failed (the message holds its output).
    """
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown instruction set {isa!r}: one of {', '.join(ISAS)}")
    arch = list(ISA_FLAGS[isa]) if _x86() else ["-march=native"]
    return compile_library(_SOURCES, [*_FLAGS, *arch], f"cpu_kernels-{isa}", cache_dir, _HEADERS)


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")

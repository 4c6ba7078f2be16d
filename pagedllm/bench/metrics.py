"""Latency and throughput statistics with vLLM's benchmark definitions, and facts about the machine."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds, ``time.perf_counter``).

    Attributes:
        prompt_len: prompt tokens.
        output_len: generated tokens (the server's ``usage`` when it reports one).
        start: when the request was sent.
        ttft: time to the first generated text.
        e2el: time to the last byte of the response.
        itl: gaps between consecutive streamed chunks that carried text.
        success: False when the request failed (``error`` says why).
        error: the failure, if any.
    """

    prompt_len: int
    output_len: int = 0
    start: float = 0.0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    success: bool = False
    error: str = ""


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile ``p`` in [0, 100] (numpy's default method); 0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def describe(name: str, values_s: list[float], percentiles=(99,)) -> dict:
    """``mean_/median_/p{N}_{name}_ms`` of values given in seconds."""
    ms = [v * 1e3 for v in values_s]
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": statistics.median(ms) if ms else 0.0}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return out


def summarize(records: list[RequestRecord], duration_s: float, percentiles=(99,)) -> dict:
    """Serving metrics of a run, as ``vllm bench serve`` defines them.

    TTFT is the time to the first text; TPOT is ``(e2el - ttft) / (output_len - 1)`` per
    request with more than one output token; ITL pools every gap between streamed
    chunks; throughputs divide totals over successful requests by the wall time.

    Args:
        records: one per request.
        duration_s: wall seconds from the first request sent to the last response done.
    """
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    res = {"completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration_s,
           "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
           "request_throughput": len(ok) / duration_s if duration_s else 0.0,
           "output_throughput": out_tokens / duration_s if duration_s else 0.0,
           "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s else 0.0}
    res.update(describe("ttft", [r.ttft for r in ok], percentiles))
    res.update(describe("tpot", [(r.e2el - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
                        percentiles))
    res.update(describe("itl", [g for r in ok for g in r.itl], percentiles))
    res.update(describe("e2el", [r.e2el for r in ok], percentiles))
    errors = sorted({r.error for r in records if not r.success})
    if errors:
        res["errors"] = errors[:5]
    return res


# the CPU features that choose kernels and dtypes (AVX-512, VNNI, bf16, AMX)
CPU_FLAGS = ("fma", "avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_vp2intersect", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """Which of ``CPU_FLAGS`` this machine's CPU has (from ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        flags = next(ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return [f for f in CPU_FLAGS if f in flags]


def machine_facts() -> dict:
    """CPU model and kernel-relevant flags, core count, OS, Python and library versions, and the date."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        field = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[:30])}
        cpu = field["model name"]
        # a VM may hide the model's name ("AMD EPYC"): family and model tell its generation
        if "cpu family" in field:
            cpu += f" (family {field['cpu family']}, model {field.get('model', '?')})"
    except (OSError, KeyError):
        cpu = platform.processor() or "unknown"
    from importlib.metadata import PackageNotFoundError, version
    versions = {}
    for pkg in ("pagedllm", "torch", "transformers", "llguidance"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu_model": cpu,
            "cpu_flags": cpu_flags(), "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "versions": versions}


def print_table(title: str, result: dict) -> None:
    """Print a result dict as ``vllm bench`` does: one aligned line per metric."""
    print(f"{'=' * 18} {title} {'=' * 18}")
    for k, v in result.items():
        if isinstance(v, float):
            print(f"{k:<40} {v:>12.2f}")
        elif isinstance(v, int):
            print(f"{k:<40} {v:>12}")
    print("=" * (38 + len(title)))

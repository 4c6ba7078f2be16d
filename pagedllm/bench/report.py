"""Result files and plots for ``pagedllm bench``."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pagedllm.bench.metrics import machine_facts


def json_safe(obj):
    """``obj`` with every non-finite float made valid JSON: ``inf`` -> ``"inf"`` (as vLLM writes an
    unlimited request rate), ``-inf`` -> ``"-inf"``, NaN -> ``None``; dicts, lists and tuples recursively."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_result(path: str | Path, kind: str, args, results) -> Path:
    """Write ``{"kind", "machine", "args", "results"}`` as strict JSON (parents created; see
    ``json_safe``); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    args_d = {k: v for k, v in vars(args).items() if not callable(v)}
    doc = json_safe({"kind": kind, "machine": machine_facts(), "args": args_d, "results": results})
    path.write_text(json.dumps(doc, indent=2, default=str, allow_nan=False) + "\n")
    return path


def plot_runs(runs: list[dict], path: str | Path, x: str = "max_concurrency",
              label: str = "pagedllm") -> Path:
    """PNG of output throughput (tok/s) and median TPOT / TTFT (ms) against ``x`` (matplotlib, Agg).

    Args:
        runs: ``pagedllm bench serve`` results, one per point.
        path: the PNG to write.
        x: the result key on the horizontal axis.
    Raises:
        ImportError: matplotlib is not installed (``pip install 'pagedllm[bench]'``).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = [r[x] for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [r["output_throughput"] for r in runs], marker="o", label=label)
    a.set_xlabel(x)
    a.set_ylabel("output tokens/s")
    a.set_title("throughput")
    b.plot(xs, [r["median_tpot_ms"] for r in runs], marker="o", label=f"{label} median TPOT")
    b.plot(xs, [r["median_ttft_ms"] for r in runs], marker="s", label=f"{label} median TTFT")
    b.set_xlabel(x)
    b.set_ylabel("ms")
    b.set_title("latency")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

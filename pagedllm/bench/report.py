"""Result files and plots for ``pagedllm bench``."""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.bench.metrics import machine_facts


def write_result(path: str | Path, kind: str, args, results) -> Path:
    """Write ``{"kind", "machine", "args", "results"}`` as JSON (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    args_d = {k: v for k, v in vars(args).items() if not callable(v)}
    path.write_text(json.dumps({"kind": kind, "machine": machine_facts(), "args": args_d, "results": results},
                               indent=2, default=str) + "\n")
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

"""``pagedllm bench serve`` against a running pagedllm server: values are consistent, JSON and plot are written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_serve_two_concurrencies(server_url, tmp_path):
    out = tmp_path / "serve.json"
    p = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "serve", "--base-url", server_url,
                        "--num-prompts", "4", "--input-len", "8", "--output-len", "6", "--max-concurrency", "1", "2",
                        "--result-file", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = doc["results"]
    assert [r["max_concurrency"] for r in runs] == [1, 2]
    for r in runs:
        assert r["completed"] == 4 and r["failed"] == 0
        assert r["total_input_tokens"] == 32 and r["total_output_tokens"] == 24  # ignore_eos: exactly 6 each
        assert r["output_throughput"] == pytest.approx(24 / r["duration_s"])
        assert 0 < r["median_ttft_ms"] <= r["median_e2el_ms"] <= r["duration_s"] * 1e3
        assert r["mean_tpot_ms"] > 0 and r["mean_itl_ms"] > 0
    # one at a time, requests cannot overlap: the run lasts at least the sum of their latencies
    assert runs[0]["duration_s"] * 1e3 >= 4 * runs[0]["mean_e2el_ms"] * 0.99
    png = out.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Serving Benchmark Result" in p.stdout

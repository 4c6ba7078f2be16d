"""``pagedllm bench``: datasets, metric definitions, the roofline arithmetic, and short offline runs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.bench.datasets import json_requests, prefix_requests, random_requests
from pagedllm.bench.metrics import RequestRecord, percentile, summarize
from pagedllm.bench.report import write_result
from pagedllm.bench.roofline import model_costs, rooflines
from pagedllm.kernels import cpu as cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


def test_random_requests_are_exact_seeded_and_ordinary(smollm2_tokenizer):
    a = random_requests(smollm2_tokenizer, 5, 17, 9, seed=3)
    b = random_requests(smollm2_tokenizer, 5, 17, 9, seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(len(r.prompt) == r.prompt_len == 17 and r.output_len == 9 for r in a)
    special = set(smollm2_tokenizer.all_special_ids)
    assert not special & {t for r in a for t in r.prompt}
    c = random_requests(smollm2_tokenizer, 50, 100, 10, seed=1, range_ratio=0.5)
    assert all(50 <= r.prompt_len <= 150 and 5 <= r.output_len <= 15 for r in c)
    assert len({r.prompt_len for r in c}) > 5


def test_prefix_and_json_requests(smollm2_tokenizer, tmp_path):
    reqs = prefix_requests(smollm2_tokenizer, 6, 20, 5, 4, num_prefixes=2)
    assert reqs[0].prompt[:20] == reqs[2].prompt[:20] != reqs[1].prompt[:20]
    assert all(r.prompt_len == 25 for r in reqs)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["Hello there", {"prompt": "Hi", "output_len": 3}, {"prompt_token_ids": [5, 6, 7]}]))
    got = json_requests(f, smollm2_tokenizer, None, 11)
    assert [(r.prompt_len, r.output_len) for r in got] == [
        (len(smollm2_tokenizer.encode("Hello there")), 11), (len(smollm2_tokenizer.encode("Hi")), 3), (3, 11)]
    f.write_text(json.dumps({"prompts": [[1, 2], [3]], "output_len": 5}))
    assert [(r.prompt, r.output_len) for r in json_requests(f, smollm2_tokenizer, None, 9)] == [([1, 2], 5), ([3], 5)]
    f.write_text(json.dumps([{"text": "x"}]))
    with pytest.raises(ValueError, match="item 0"):
        json_requests(f, smollm2_tokenizer, None, 1)


def test_summarize_follows_the_definitions():
    recs = [RequestRecord(10, 5, 0.0, 0.1, 0.5, [0.1, 0.1, 0.1, 0.1], True),
            RequestRecord(20, 1, 0.0, 0.2, 0.2, [], True),
            RequestRecord(30, 0, 0.0, error="HTTP 500", success=False)]
    s = summarize(recs, 2.0)
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 30, 6)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0 and s["total_token_throughput"] == 18.0
    assert s["mean_ttft_ms"] == pytest.approx(150) and s["median_ttft_ms"] == pytest.approx(150)
    # TPOT only for requests with more than one token: (0.5 - 0.1) / 4
    assert s["mean_tpot_ms"] == pytest.approx(100) and s["p99_itl_ms"] == pytest.approx(100)
    assert s["mean_e2el_ms"] == pytest.approx(350) and s["errors"] == ["HTTP 500"]
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) == 0


def test_roofline_arithmetic(smollm2_dir):
    c = model_costs(smollm2_dir)
    assert c["params"] == 134_515_008  # SmolLM2-135M, tied embeddings counted once
    assert c["decode_bytes"] == 4 * c["params"]
    r = rooflines(smollm2_dir, flops=100e9, bandwidth=10e9)
    assert r["w1_decode_tok_s"] == pytest.approx(10e9 / c["decode_bytes"])
    assert 150 < r["w2_output_tok_s"] < 250  # about 4 TFLOP for 8192 output tokens at 100 GFLOP/s


def _bench(tmp_path, *args) -> dict:
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", *args, "--output-json", str(out),
                        "--num-threads", "2"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout


def test_bench_throughput_short_run(tmp_path):
    doc, stdout = _bench(tmp_path, "throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "6")
    r = doc["results"]
    assert r["num_requests"] == 4 and r["total_output_tokens"] == 24 and r["total_input_tokens"] == 32
    assert r["output_throughput"] == pytest.approx(24 / r["elapsed_s"])
    assert r["total_token_throughput"] == pytest.approx(56 / r["elapsed_s"])
    assert "Throughput:" in stdout and doc["kind"] == "throughput" and doc["machine"]["cpu_count"] >= 1
    assert r["cpu_kernels"] is cpu_kernels.available()  # runs with and without the kernels stay apart


def test_bench_latency_short_run(tmp_path):
    doc, stdout = _bench(tmp_path, "latency", "--batch-size", "2", "--input-len", "8", "--output-len", "5",
                         "--num-iters", "3", "--num-iters-warmup", "1")
    r = doc["results"]
    assert len(r["latencies_s"]) == 3 and r["avg_latency_s"] == pytest.approx(sum(r["latencies_s"]) / 3)
    assert min(r["latencies_s"]) <= r["percentiles_s"]["50"] <= max(r["latencies_s"])
    assert r["output_throughput"] == pytest.approx(10 / r["avg_latency_s"])
    assert "Avg latency:" in stdout
    assert r["cpu_kernels"] is cpu_kernels.available()


def test_result_json_is_strict(tmp_path):
    """An unlimited request rate is written as "inf" (as vLLM does), never as the non-JSON Infinity."""
    args = argparse.Namespace(request_rate=float("inf"), seed=0)
    path = write_result(tmp_path / "r.json", "serve", args,
                        [{"request_rate": float("inf"), "x": [float("nan"), -float("inf"), 1.5]}])
    doc = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert doc["args"]["request_rate"] == "inf"
    assert doc["results"] == [{"request_rate": "inf", "x": [None, "-inf", 1.5]}]


def _side_by_side():
    spec = importlib.util.spec_from_file_location("side_by_side", ROOT / "benchmarks" / "side_by_side.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_side_by_side_subset_runs_get_their_own_files_and_rows():
    """A subset run never overwrites the full run's result files, and its table shows only what ran."""
    sbs = _side_by_side()
    full = argparse.Namespace(engines=list(sbs.ENGINES), workloads=["w1", "w2", "w3"], w3_requests=64,
                              w3_concurrency=[1, 16], w3_c1_requests=None)
    assert sbs.result_name(full, "2026-12-01") == "side_by_side-2026-12-01"
    sub = argparse.Namespace(**{**vars(full), "engines": ["pagedllm"], "workloads": ["w1"]})
    assert sbs.result_name(sub, "2026-12-01") == "side_by_side-2026-12-01-pagedllm-w1"
    short = argparse.Namespace(**{**vars(full), "w3_c1_requests": 16})
    assert sbs.result_name(short, "2026-12-01") == "side_by_side-2026-12-01-c1x16"

    md = sbs.table({"pagedllm": {"w1": {"decode_tok_s": 60.0, "mean_ttft_ms": 70.0}}}, {}, ["w1"])
    lines = md.splitlines()
    assert lines[0] == "| metric | pagedllm |" and lines[1] == "|---|---|"
    assert lines[2:] == ["| W1 decode tok/s | 60.0 |", "| W1 TTFT ms | 70.0 |"]
    md = sbs.table({"pagedllm": {"w1": {"decode_tok_s": 60.0}}, "llamacpp": {"w1": {"decode_tok_s": 50.0}}},
                   {}, ["w1"])
    assert md.splitlines()[0].count("|") == md.splitlines()[1].count("|") == 5
    assert "| W1 decode tok/s | 60.0 | 50.0 | 1.20x |" in md


def test_side_by_side_w3_levels_get_distinct_prompts(smollm2_tokenizer, tmp_path):
    """W3 writes a warm-up prompt plus its own prompts per concurrency level, all distinct, so a
    prefix cache filled at one level gives no hits at the next."""
    paths = _side_by_side().make_workloads(smollm2_tokenizer, tmp_path, 4, 2)
    prompts = json.loads(paths["w3"].read_text())["prompts"]
    assert len(prompts) == 1 + 4 * 2 and all(len(p) == 128 for p in prompts)
    assert len({tuple(p[:16]) for p in prompts}) == len(prompts)  # even the first KV blocks differ

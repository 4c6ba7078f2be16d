"""Decode-heavy serving benchmark of the step loop: throughput, inter-token latency and the idle gap.

Starts ``pagedllm serve`` (engine core in its own process) and, for each
concurrency level, streams requests with short prompts and long outputs
(greedy, ``ignore_eos``) through the OpenAI completions API. Reports output
tokens/s, mean inter-token latency (ITL, seconds between streamed chunks of a
request) and, from the core's per-step timings (``GET /stats``), the idle gap
between the end of one model execution and the start of the next as a fraction
of device time, plus the mean time of each step phase.

Each mode (async scheduling on, then off) gets its own server in the same run,
and the ratios on/off are printed at the end.

    python benchmarks/step_loop.py                      # concurrency 1, 16, 64, async on and off
    python benchmarks/step_loop.py --concurrency 1 16 --output-len 64 --modes on
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    """Start ``pagedllm serve`` on a free port; return (process, base URL) once healthy."""
    port = _free_port()
    log = open(tempfile.mktemp(prefix="step_loop-", suffix=".log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port),
                             "--log-level", "warning", *extra], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: see {log.name}")
        time.sleep(0.5)
    raise RuntimeError("server not healthy")


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, output_len: int) -> tuple[int, list[float]]:
    """Stream one completion; returns (tokens, chunk arrival times in seconds)."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    times, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    return tokens, times


def _timings(url: str) -> dict:
    """The core's step timings from /stats (waiting up to 5 s for its first report)."""
    deadline = time.monotonic() + 5
    while True:
        st = httpx.get(f"{url}/stats").json()
        if "step_timings" in st or time.monotonic() > deadline:
            return st["step_timings"]
        time.sleep(0.2)


async def run_level(url: str, concurrency: int, num_requests: int, output_len: int) -> dict:
    """``num_requests`` requests, ``concurrency`` at a time; client-side throughput and ITL."""
    before = _timings(url)
    sem = asyncio.Semaphore(concurrency)

    async def task(i: int):
        async with sem:
            return await one_request(client, url, f"Request {i}: write about the number {i}.", output_len)

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[task(i) for i in range(num_requests)])
        wall = time.perf_counter() - t0
    after = _timings(url)
    gaps = [b - a for _, ts in results for a, b in zip(ts, ts[1:])]
    tokens = sum(t for t, _ in results)
    delta = {k: after[k] - before.get(k, 0.0) for k in after if k.endswith("_s") and not k.startswith("mean_")}
    steps = after["steps"] - before.get("steps", 0)
    busy = delta["execute_s"] + delta["sample_s"]
    return {"concurrency": concurrency, "requests": num_requests, "output_tokens": tokens, "wall_s": wall,
            "output_tok_s": tokens / wall, "mean_itl_s": sum(gaps) / len(gaps) if gaps else None,
            "steps": steps, "idle_fraction": delta["idle_s"] / (delta["idle_s"] + busy) if busy else None,
            "mean_step_phase_s": {k[:-2]: v / steps for k, v in delta.items()} if steps else {}}


def run_mode(mode: str, args) -> list[dict]:
    """All concurrency levels against one server, async scheduling ``on`` or ``off``."""
    flag = "--async-scheduling" if mode == "on" else "--no-async-scheduling"
    proc, url = start_server(["--num-kv-blocks", "2048", "--max-num-seqs", "128", flag, *args.server_arg])
    try:
        asyncio.run(run_level(url, 1, 1, 4))  # warm-up
        rows = []
        for c in args.concurrency:
            n = args.requests_per_level or max(4, 2 * c)
            print(f"async {mode}, concurrency {c}: {n} requests x {args.output_len} tokens ...", flush=True)
            rows.append({"async_scheduling": mode, **asyncio.run(run_level(url, c, n, args.output_len))})
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _medians(rows: list[dict], args) -> list[dict]:
    """Per (mode, concurrency), the run with the median output tok/s, with every round's tok/s listed."""
    out = []
    for mode in args.modes:
        for c in args.concurrency:
            runs = sorted((r for r in rows if r["async_scheduling"] == mode and r["concurrency"] == c),
                          key=lambda r: r["output_tok_s"])
            med = dict(runs[len(runs) // 2])
            med["all_rounds_tok_s"] = [r["output_tok_s"] for r in runs]
            out.append(med)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--modes", nargs="+", choices=["on", "off"], default=["on", "off"],
                    help="async scheduling modes to run, one server each (default: both)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the modes alternately this many times; the table gives medians (this CPU is noisy)")
    ap.add_argument("--requests-per-level", type=int, default=None, help="default: 2 x concurrency (at least 4)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--server-arg", action="append", default=[], help="extra `pagedllm serve` flag (repeatable)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    rows = [dict(r, round=k) for k in range(args.repeat) for mode in args.modes for r in run_mode(mode, args)]
    if args.repeat > 1:
        rows = _medians(rows, args)
    print(f"\n{'async':>5} {'conc':>5} {'out tok/s':>10} {'mean ITL s':>11} {'idle %':>7} {'steps':>6}  "
          f"mean step phases (ms)")
    for r in rows:
        ph = " ".join(f"{k}={v * 1e3:.2f}" for k, v in r["mean_step_phase_s"].items())
        print(f"{r['async_scheduling']:>5} {r['concurrency']:>5} {r['output_tok_s']:>10.1f} {r['mean_itl_s']:>11.4f} "
              f"{100 * r['idle_fraction']:>6.2f}% {r['steps']:>6}  {ph}")
    if set(args.modes) == {"on", "off"}:
        print(f"\n{'conc':>5} {'tok/s on/off':>13} {'ITL on/off':>11}")
        for c in args.concurrency:
            on, off = (next(r for r in rows if r["concurrency"] == c and r["async_scheduling"] == m)
                       for m in ("on", "off"))
            print(f"{c:>5} {on['output_tok_s'] / off['output_tok_s']:>13.3f} {on['mean_itl_s'] / off['mean_itl_s']:>11.3f}")
    out = Path(args.json_out) if args.json_out else (
        Path(__file__).resolve().parent / "results" / f"step_loop-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
                               "args": vars(args), "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

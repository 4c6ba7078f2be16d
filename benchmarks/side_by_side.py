"""pagedllm against its peers on the same model and workloads, in one run, with the roofline.

Workloads (SmolLM2-135M-Instruct, float32, greedy, EOS ignored; prompts are
seeded random token ids, the same ids for every engine):

* W1 batch-1: one 32-token prompt, 128 output tokens; decode tok/s and TTFT.
* W2 offline: 64 prompts x 128 tokens in, 128 out; output tok/s.
* W3 online: 64 requests of 128 in / 128 out streamed through each engine's
  OpenAI-compatible server by ``pagedllm bench serve``'s client at concurrency
  1 and 16; output tok/s, median TTFT and TPOT. Each level gets its own prompts,
  so no engine's prefix cache holds them from the level before.

Engines: pagedllm (``peers/pagedllm_run.py`` and ``pagedllm serve``), Hugging Face
``generate`` with static batching (``peers/hf_generate.py``; no server), vLLM CPU
(``peers/vllm_cpu.py``) and llama.cpp through llama-cpp-python
(``peers/llama_cpp.py``, float32 GGUF); each peer runs in its own process, from its
own virtual environment (``--install-peers`` creates them), and is skipped when
that environment is missing. Before the engines run, the machine's float32
matrix-product rate and read bandwidth are measured and turned into the
workloads' rooflines (``pagedllm.bench.roofline``).

Prints one table of values and ratios (pagedllm / peer) and writes
``results/side_by_side-<date>.json`` and ``.md`` with date, machine and versions (a subset
run's name says which subset, e.g. ``side_by_side-<date>-pagedllm-w1``; see ``result_name``).

    python benchmarks/side_by_side.py                         # every available engine, W1-W3
    python benchmarks/side_by_side.py --engines pagedllm hf --workloads w1 w2
    python benchmarks/side_by_side.py --install-peers         # set up vLLM CPU and llama.cpp first
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engines(args, model_dir: str, gguf: str) -> dict[str, dict]:
    """Per engine: the python to run it with, its run command, and its server command (or None)."""
    py = sys.executable
    vpy, lpy = f"{args.vllm_venv}/bin/python", f"{args.llamacpp_venv}/bin/python"
    return {
        "pagedllm": {"python": py, "run": [py, str(PEERS / "pagedllm_run.py"), "run"],
                     "serve": lambda port: [py, "-m", "pagedllm.cli", "serve", "--port", str(port),
                                            "--max-num-seqs", "128", "--num-kv-blocks", "4096",
                                            "--log-level", "warning"]},
        "hf": {"python": py, "run": [py, str(PEERS / "hf_generate.py"), "run", "--model-dir", model_dir],
               "serve": None},
        "vllm": {"python": vpy, "run": [vpy, str(PEERS / "vllm_cpu.py"), "run", "--model-dir", model_dir],
                 "serve": lambda port: [vpy, str(PEERS / "vllm_cpu.py"), "serve", "--port", str(port),
                                        "--model-dir", model_dir]},
        "llamacpp": {"python": lpy, "run": [lpy, str(PEERS / "llama_cpp.py"), "run", "--gguf", gguf],
                     "serve": lambda port: [lpy, str(PEERS / "llama_cpp.py"), "serve", "--port", str(port),
                                            "--gguf", gguf]},
    }


def make_workloads(tokenizer, out_dir: Path, w3_requests: int, w3_levels: int = 2) -> dict[str, Path]:
    """Write W1, W2 and W3 as ``{"name", "prompts": [[ids]], "output_len"}`` files.

    W3 holds one warm-up prompt, then ``w3_requests`` distinct prompts per concurrency level
    (``w3_levels``): a level must not find the previous level's prompts in a prefix cache."""
    from pagedllm.bench.datasets import random_requests
    spec = {"w1": (1, 32, 1), "w2": (64, 128, 2), "w3": (1 + w3_requests * w3_levels, 128, 3)}
    paths = {}
    for name, (n, inp, seed) in spec.items():
        reqs = random_requests(tokenizer, n, inp, 128, seed=seed)
        paths[name] = out_dir / f"{name}.json"
        paths[name].write_text(json.dumps({"name": name, "prompts": [r.prompt for r in reqs], "output_len": 128}))
    return paths


def run_offline(name: str, eng: dict, workload: Path, tmp: Path, timeout: int) -> dict | None:
    """Run one engine's ``run`` on a workload file in a subprocess; its JSON result or None."""
    out = tmp / f"{name}-{workload.stem}.json"
    cmd = [*eng["run"], "--workload", str(workload), "--json-out", str(out)]
    print(f"[{name}] {workload.stem}: {' '.join(cmd[1:3])} ...", flush=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"[{name}] {workload.stem}: timed out after {timeout} s", flush=True)
        return None
    if p.returncode != 0 or not out.exists():
        print(f"[{name}] {workload.stem}: failed\n{p.stderr[-2000:]}", flush=True)
        return None
    return json.loads(out.read_text())


def rss_mib(pid: int) -> dict[int, float]:
    """Resident memory in MiB (``/proc/<pid>/status`` VmRSS) of a process and each of its descendants."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            out[p] = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")) / 1024
            for t in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (t / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            pass
    return out


def run_online(name: str, eng: dict, workload: Path, concurrencies: list[int], tokenizer, tmp: Path,
               start_timeout: int, c1_requests: int | None = None, stats: dict | None = None) -> list[dict] | None:
    """Start the engine's server, drive it with the bench client at each concurrency, stop it.

    ``stats``, when given, receives ``rss_mib``: the resident memory of the server's processes after
    the last level, ``{pid: MiB}`` (the server first)."""
    from pagedllm.bench.datasets import json_requests
    from pagedllm.bench.serve import run_serve, served_model
    port = _free_port()
    log = open(tmp / f"{name}-server.log", "wb")
    proc = subprocess.Popen(eng["serve"](port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"[{name}] server did not start: see {log.name}", flush=True)
                return None
            time.sleep(1)
        model = served_model(url)
        reqs = json_requests(workload, tokenizer, None, 128)
        asyncio.run(run_serve(url, model, reqs[:1], 1))  # warm-up, on a prompt no level uses
        n = (len(reqs) - 1) // len(concurrencies)
        runs = []
        for i, c in enumerate(concurrencies):
            use = reqs[1 + i * n:1 + (i + 1) * n]  # fresh prompts per level: no prefix-cache hits across levels
            use = use[:c1_requests] if c == 1 and c1_requests else use
            print(f"[{name}] w3 concurrency {c}: {len(use)} requests ...", flush=True)
            res = asyncio.run(run_serve(url, model, use, c))
            if res["failed"]:
                print(f"[{name}] w3: {res['failed']} requests failed: {res.get('errors')}", flush=True)
            runs.append(res)
        if stats is not None:
            stats["rss_mib"] = rss_mib(proc.pid)
        return runs
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


ENGINES = ["pagedllm", "hf", "vllm", "llamacpp"]

ROWS = [  # (label, workload, key, higher is better)
    ("W1 decode tok/s", "w1", "decode_tok_s", True),
    ("W1 TTFT ms", "w1", "mean_ttft_ms", False),
    ("W2 output tok/s", "w2", "output_throughput", True),
    ("W3 c=1 output tok/s", "w3c1", "output_throughput", True),
    ("W3 c=1 median TTFT ms", "w3c1", "median_ttft_ms", False),
    ("W3 c=1 median TPOT ms", "w3c1", "median_tpot_ms", False),
    ("W3 c=16 output tok/s", "w3c16", "output_throughput", True),
    ("W3 c=16 median TTFT ms", "w3c16", "median_ttft_ms", False),
    ("W3 c=16 median TPOT ms", "w3c16", "median_tpot_ms", False),
]


def _incomplete(r: dict) -> bool:
    """True when a run produced fewer output tokens than asked (128 per request): its speed is not comparable."""
    n = r.get("completed", r.get("num_prompts"))
    return bool(r) and n is not None and r.get("total_output_tokens", 128 * n) < 128 * n


def table(results: dict[str, dict], roof: dict, workloads: list[str] | None = None) -> str:
    """Markdown: one row per metric of the ``workloads`` run (default all), a value and a
    pagedllm / peer ratio per peer, then the rooflines."""
    names = list(results)
    peers = [n for n in names if n != "pagedllm"]
    head = "| metric | pagedllm |" + "".join(f" {p} | pagedllm / {p} |" for p in peers)
    lines = [head, "|" + "---|" * (2 + 2 * len(peers))]
    for label, w, key, _ in ROWS:
        if workloads is not None and w[:2] not in workloads:
            continue
        ours = results.get("pagedllm", {}).get(w, {}).get(key)
        cells = [f"{ours:.1f}" if ours is not None else "n/a"]
        for p in peers:
            r = results[p].get(w, {})
            v = r.get(key)
            short = _incomplete(r)
            cells += [(f"{v:.1f}" + (" (incomplete)" if short else "")) if v is not None else "n/a",
                      f"{ours / v:.2f}x" if v and ours is not None and not short else "n/a"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if roof:
        ours = results.get("pagedllm", {})
        w1 = ours.get("w1", {}).get("decode_tok_s")
        w2 = ours.get("w2", {}).get("output_throughput")
        mv = roof.get("matvec_bandwidth_gbs")
        lines += ["", f"Measured: float32 matmul {roof['matmul_gflops']:.1f} GFLOP/s, read bandwidth "
                      f"{roof['read_bandwidth_gbs']:.2f} GB/s"
                      + (f" (torch's float32 matrix-vector product: {mv:.2f} GB/s)." if mv else "."),
                  f"W1 bandwidth roofline {roof['w1_decode_tok_s']:.1f} decode tok/s "
                  f"({roof['decode_bytes'] / 1e6:.0f} MB read per token)"
                  + (f"; pagedllm reaches {100 * w1 / roof['w1_decode_tok_s']:.0f}%." if w1 else "."),
                  f"W2 compute roofline {roof['w2_output_tok_s']:.1f} output tok/s "
                  f"({roof['w2_flops'] / 1e12:.2f} TFLOP of prefill, decode and attention)"
                  + (f"; pagedllm reaches {100 * w2 / roof['w2_output_tok_s']:.0f}%." if w2 else ".")]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=ENGINES,
                    help="engines to run; a peer whose environment is missing is skipped")
    ap.add_argument("--workloads", nargs="+", choices=["w1", "w2", "w3"], default=["w1", "w2", "w3"],
                    help="W1 batch-1, W2 offline, W3 online (see benchmarks/README.md)")
    ap.add_argument("--w3-requests", type=int, default=64, help="requests per W3 concurrency level")
    ap.add_argument("--w3-concurrency", type=int, nargs="+", default=[1, 16], help="W3 concurrency levels")
    ap.add_argument("--w3-c1-requests", type=int, default=None,
                    help="at concurrency 1, only the first N requests, since one at a time takes long "
                         "(None: all --w3-requests)")
    ap.add_argument("--vllm-venv", default="/work/peers/vllm", help="vLLM CPU peer's virtual environment")
    ap.add_argument("--llamacpp-venv", default="/work/peers/llamacpp",
                    help="llama-cpp-python peer's virtual environment")
    ap.add_argument("--install-peers", action="store_true", help="create the peers' environments first")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per offline run")
    ap.add_argument("--start-timeout", type=int, default=900, help="seconds for a server to come up")
    ap.add_argument("--out-dir", default=str(HERE / "results"), help="where the JSON and .md results go")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from pagedllm.bench.metrics import machine_facts
    from pagedllm.bench.report import json_safe
    from pagedllm.bench.roofline import measure
    from pagedllm.models.loader import default_model_path
    from pagedllm.models.resolve import resolve_model
    model_dir, gguf = str(resolve_model(None)), default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if args.install_peers:
        for script, venv in (("vllm_cpu.py", args.vllm_venv), ("llama_cpp.py", args.llamacpp_venv)):
            subprocess.run([sys.executable, str(PEERS / script), "--install", "--venv", venv], check=False)
    table_engines = engines(args, model_dir, gguf)
    chosen = {n: table_engines[n] for n in args.engines
              if n in table_engines and Path(table_engines[n]["python"]).exists()}
    skipped = sorted(set(args.engines) - set(chosen))
    if skipped:
        print(f"skipping (environment missing; see --install-peers): {', '.join(skipped)}", flush=True)
    roof = measure(model_dir)
    print(f"roofline: {json.dumps({k: round(v, 2) for k, v in roof.items()})}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="side_by_side-"))
    paths = make_workloads(tokenizer, tmp, args.w3_requests, len(args.w3_concurrency))
    results: dict[str, dict] = {n: {} for n in chosen}
    failed = False  # keep the per-engine logs when any run failed
    for w in ("w1", "w2"):
        if w in args.workloads:
            for name, eng in chosen.items():
                r = run_offline(name, eng, paths[w], tmp, args.timeout)
                if r:
                    results[name][w] = r
                failed |= not r
    if "w3" in args.workloads:
        for name, eng in chosen.items():
            if eng["serve"] is None:
                continue
            runs = run_online(name, eng, paths["w3"], args.w3_concurrency, tokenizer, tmp, args.start_timeout,
                              args.w3_c1_requests)
            failed |= runs is None
            for c, r in zip(args.w3_concurrency, runs or []):
                results[name][f"w3c{c}"] = r
    md = table(results, roof, args.workloads)
    print("\n" + md)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / result_name(args)
    stem.with_suffix(".json").write_text(json.dumps(json_safe(
        {"machine": machine_facts(), "args": vars(args), "roofline": roof, "skipped": skipped,
         "results": results}), indent=2, allow_nan=False) + "\n")
    stem.with_suffix(".md").write_text(md + "\n")
    if not failed:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {stem}.json and .md" + (f" (a run failed; its logs are in {tmp})" if failed else ""))


def result_name(args, date: str | None = None) -> str:
    """``side_by_side-<date>`` for the full default run; a subset run (other engines, workloads or
    W3 sizes) gets its parts appended, e.g. ``side_by_side-<date>-pagedllm-w1``, so it never
    overwrites the full run's files."""
    name = f"side_by_side-{date or datetime.date.today().isoformat()}"
    default = (sorted(args.engines) == sorted(ENGINES) and sorted(args.workloads) == ["w1", "w2", "w3"]
               and args.w3_requests == 64 and sorted(args.w3_concurrency) == [1, 16])
    if not default:
        name += "-" + "-".join([*args.engines, *args.workloads])
    if args.w3_c1_requests is not None and "w3" in args.workloads:
        name += f"-c1x{args.w3_c1_requests}"
    return name


if __name__ == "__main__":
    main()

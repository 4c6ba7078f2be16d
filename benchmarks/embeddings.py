"""Embeddings side by side: pagedllm against sentence-transformers on all-MiniLM-L6-v2, in one run.

1. Throughput: 1,000 sentences of mixed lengths (seeded, 4 to 60 words), batch 32, float32,
   the same number of torch threads: sentence-transformers ``encode(batch_size=32)`` against
   pagedllm's offline ``LLM.embed`` (``max_num_seqs=32``: each step embeds up to 32 sentences).
   Each engine runs in its own process (one OpenMP thread team each), after a warm-up.
   Goal: pagedllm >= 1.2x sentence-transformers' sentences/s.
2. Latency under load: ``pagedllm serve all-minilm-l6-v2`` answers one short ``/v1/embeddings``
   request, first idle, then while 16 chat streams run against ``pagedllm serve`` (SmolLM2) on
   the same machine (a pooling model serves no chat, as in vLLM: two servers, one thread each).
   Goal: the loaded median under 3x the idle one.

Writes ``results/embeddings-<date>.json`` and ``.md`` with the date, CPU model, flags and versions.

    python benchmarks/embeddings.py                  # both parts, 1 torch thread per engine
    python benchmarks/embeddings.py --threads 2 --skip-latency
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no will more can who what out up "
         "model vector engine paged cache token batch server latency throughput sentence embedding kernel matrix "
         "river mountain library window garden music history science language question answer morning evening").split()


def make_sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` seeded sentences of 4 to 60 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))).capitalize() + "." for _ in range(n)]


def run_one(engine: str, n: int, batch: int, threads: int) -> dict:
    """Embed ``n`` sentences with one engine (in this process); returns sentences/s and the vectors' checksum."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import numpy as np
    import torch
    torch.set_num_threads(threads)
    sents = make_sentences(n)
    warm = make_sentences(64, seed=1)
    from pagedllm.models.resolve import resolve_model
    model_dir = str(resolve_model("all-minilm-l6-v2"))
    if engine == "sentence-transformers":
        from sentence_transformers import SentenceTransformer
        st = SentenceTransformer(model_dir, device="cpu")
        st.encode(warm, batch_size=batch)
        t0 = time.perf_counter()
        vecs = st.encode(sents, batch_size=batch, convert_to_numpy=True)
        dt = time.perf_counter() - t0
    else:
        from pagedllm import LLM
        llm = LLM("all-minilm-l6-v2", num_threads=threads, max_num_seqs=batch, max_num_batched_tokens=4096)
        llm.embed(warm, use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.embed(sents, use_tqdm=False)
        dt = time.perf_counter() - t0
        vecs = np.array([o.outputs.embedding for o in outs], dtype=np.float32)
        llm.engine.shutdown()
    return {"engine": engine, "seconds": dt, "sentences_per_s": n / dt, "first_vector_head": vecs[0][:4].tolist(),
            "vectors": vecs.tolist() if n <= 64 else None}


def throughput(args) -> dict:
    """Part 1, each engine in a subprocess; also the largest difference between their vectors (first 64)."""
    out = {}
    for engine in ("sentence-transformers", "pagedllm"):
        cmd = [sys.executable, __file__, "--one", engine, "--n", str(args.n), "--batch", str(args.batch),
               "--threads", str(args.threads)]
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
        if res.returncode:
            raise RuntimeError(f"{engine} failed:\n{res.stderr[-3000:]}")
        out[engine] = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"{engine}: {out[engine]['sentences_per_s']:.1f} sentences/s", flush=True)
    out["ratio"] = out["pagedllm"]["sentences_per_s"] / out["sentence-transformers"]["sentences_per_s"]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    import httpx
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", *model_args, "--port", str(port), "--num-threads", "1",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(HERE.parent), "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {model_args} exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server {model_args} not healthy")


async def _embed_latencies(url: str, k: int) -> list[float]:
    import httpx
    out = []
    async with httpx.AsyncClient(timeout=120) as c:
        for _ in range(k):
            t0 = time.perf_counter()
            r = await c.post(f"{url}/v1/embeddings", json={"input": "How fast is one short embedding?"})
            r.raise_for_status()
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)
    return out


async def _chat_stream(url: str, stop: asyncio.Event, counter: list[int]) -> None:
    import httpx
    async with httpx.AsyncClient(timeout=600) as c:
        while not stop.is_set():
            body = {"messages": [{"role": "user", "content": "Write a long story about a paged cache."}],
                    "max_tokens": 256, "stream": True, "ignore_eos": True}
            async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        counter[0] += 1
                    if stop.is_set():
                        break


async def _loaded(emb_url: str, chat_url: str, k: int, streams: int) -> tuple[list[float], float]:
    stop, counter = asyncio.Event(), [0]
    tasks = [asyncio.create_task(_chat_stream(chat_url, stop, counter)) for _ in range(streams)]
    await asyncio.sleep(5.0)  # the streams are past their prefills
    t0, c0 = time.perf_counter(), counter[0]
    lat = await _embed_latencies(emb_url, k)
    rate = (counter[0] - c0) / (time.perf_counter() - t0)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return lat, rate


def latency(args, tmp: Path) -> dict:
    """Part 2: one short embedding request's latency, idle and while ``args.streams`` chat streams run."""
    emb, emb_url = _serve(["all-minilm-l6-v2"], tmp / "emb.log")
    chat = None
    try:
        idle = asyncio.run(_embed_latencies(emb_url, args.k))
        chat, chat_url = _serve([], tmp / "chat.log")
        loaded, chunks_per_s = asyncio.run(_loaded(emb_url, chat_url, args.k, args.streams))
    finally:
        for p in (emb, chat):
            if p is not None:
                p.terminate()
                p.wait(timeout=30)
    res = {"idle_median_ms": 1e3 * statistics.median(idle), "idle_p90_ms": 1e3 * sorted(idle)[int(0.9 * len(idle))],
           "loaded_median_ms": 1e3 * statistics.median(loaded),
           "loaded_p90_ms": 1e3 * sorted(loaded)[int(0.9 * len(loaded))], "chat_streams": args.streams,
           "chat_chunks_per_s_during": chunks_per_s, "requests": args.k}
    res["ratio"] = res["loaded_median_ms"] / res["idle_median_ms"]
    print(f"embedding latency: idle {res['idle_median_ms']:.1f} ms, with {args.streams} chat streams "
          f"{res['loaded_median_ms']:.1f} ms ({res['ratio']:.2f}x)", flush=True)
    return res


def machine() -> dict:
    """CPU model and kernel-relevant flags, core count and library versions (``bench.metrics``)."""
    from pagedllm.bench.metrics import machine_facts
    facts = machine_facts()
    vers = {d: importlib.metadata.version(d) for d in ("sentence-transformers",) if _installed(d)}
    return {"cpu": facts["cpu_model"], "cpu_flags": facts["cpu_flags"], "cpus": facts["cpu_count"],
            "python": facts["python"], **facts["versions"], **vers}


def _installed(dist: str) -> bool:
    import importlib.metadata as md
    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False


def main() -> None:
    """Run the parts asked for and write the results."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    # 1 by default: on the 2 shared cores of the development machines two OpenMP threads spin-wait on
    # each other whenever another process holds a core (pagedllm and sentence-transformers alike ran
    # 3-6x slower with 2 threads than with 1 there); pass --threads 2 on an idle machine
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--k", type=int, default=20, help="embedding requests timed per latency condition")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.n, args.batch, args.threads)))
        return
    import tempfile
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "flags": vars(args), "model": "all-MiniLM-L6-v2 (float32)"}
    result["throughput"] = throughput(args)
    if not args.skip_latency:
        with tempfile.TemporaryDirectory() as tmp:
            result["latency"] = latency(args, Path(tmp))
    day = datetime.date.today().isoformat()
    out = HERE / "results" / f"embeddings-{day}"
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    t = result["throughput"]
    lines = [f"# Embeddings, {result['date']}", "", f"CPU: {result['machine']['cpu']} ({result['machine']['cpus']} "
             f"CPUs); CPU flags: {', '.join(result['machine']['cpu_flags'])}; arguments: {json.dumps(vars(args))}", "",
             "| engine | sentences/s |", "|---|---|",
             f"| sentence-transformers encode | {t['sentence-transformers']['sentences_per_s']:.1f} |",
             f"| pagedllm LLM.embed | {t['pagedllm']['sentences_per_s']:.1f} |",
             f"| ratio | {t['ratio']:.2f}x (goal >= 1.2x) |"]
    if "latency" in result:
        lat = result["latency"]
        lines += ["", "| one short /v1/embeddings | median ms | p90 ms |", "|---|---|---|",
                  f"| idle | {lat['idle_median_ms']:.1f} | {lat['idle_p90_ms']:.1f} |",
                  f"| {lat['chat_streams']} chat streams | {lat['loaded_median_ms']:.1f} | {lat['loaded_p90_ms']:.1f} |",
                  f"| ratio | {lat['ratio']:.2f}x (goal < 3x) | |"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Data-parallel routing of chats (issue 35 item 8): how ``--data-parallel-size 2`` splits requests
between its replicas, and the prefix-cache hits it keeps.

Each scenario runs against a fresh ``pagedllm serve --data-parallel-size 2`` on the default model
(SmolLM2-135M-Instruct), so no router memory or cached block carries over:

* ``chats32``: 32 chats sent at once, one ~90-token system prompt, a different question each; then
  a second wave of 32 (warm caches);
* ``chats32_nosys``: the same without a system message (only the template's default one is shared);
* ``conv8x4``: 8 conversations x 4 turns: the turns of all 8 are sent together, each turn carries
  the conversation's history (earlier questions and the model's answers) plus a new question.

Reported per scenario from ``/stats`` (deltas over the scenario): each replica's ``routed`` and
``prefix_routed`` requests, prompt tokens, prefix-cache queries and hits (tokens), the split
(largest replica's share) and the hit rate (hits / queries); per wave, and for ``conv8x4`` per turn with
``history_tokens``: the full blocks of each conversation's previous-turn prompt that its next
prompt starts with (what a turn routed to its history's replica can hit, at least).

Usage: ``python benchmarks/dp_routing.py --label after [--result-file F] [--scenarios ...]``; the
result file gathers one entry per label (run it once per router version to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedllm.bench.metrics import machine_facts

SYSTEM = ("You are Orbit, the support assistant of Northwind Outfitters, an online shop for hiking and camping "
          "gear. Answer in one or two short sentences, politely and precisely. Never invent order numbers, "
          "prices or delivery dates; when you do not know, say so and offer to connect the customer with a "
          "human agent. Our store ships within the European Union only, and returns are free within 30 days.")
TOPICS = ["tents", "sleeping bags", "hiking boots", "rain jackets", "backpacks", "camping stoves", "water filters",
          "trekking poles"]
KEYS = ("routed", "prefix_routed", "num_prompt_tokens", "prefix_cache_queries", "prefix_cache_hits")
BLOCK_SIZE = 16  # the engine's default --block-size


def question(i: int, turn: int = 0) -> str:
    """A distinct user question: conversation or chat ``i``, its turn ``turn``."""
    topic = TOPICS[i % len(TOPICS)]
    asks = ["which {t} do you recommend for a beginner, customer number {i}?",
            "How heavy are your {t}, roughly, and do they come in other colours?",
            "Can I return {t} that I have already used outdoors once?",
            "What is the warranty on {t} bought in a sale?"]
    return f"Hello, this is customer {1000 + 37 * i}. " + asks[turn % 4].format(t=topic, i=i)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log: Path, kv_memory: str) -> tuple[subprocess.Popen, str]:
    """``pagedllm serve --data-parallel-size 2`` on a free port; returns it and its URL once healthy.

    Raises:
        RuntimeError: the server exited or was not healthy within 600 s.
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--data-parallel-size", "2", "--kv-cache-memory", kv_memory, "--max-model-len", "2048",
           "--served-model-name", "smollm2", "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server not healthy after 600 s")


def replica_counters(url: str) -> list[dict]:
    """Each replica's routing and prefix-cache counters from ``/stats``."""
    reps = httpx.get(f"{url}/stats", timeout=30).json()["replicas"]
    return [{k: r[k] for k in KEYS} for r in reps]


def delta(before: list[dict], after: list[dict]) -> dict:
    """Per-replica counter deltas, with the split (largest replica's share of requests) and hit rate."""
    per = [{k: a[k] - b[k] for k in KEYS} for b, a in zip(before, after)]
    routed = [p["routed"] for p in per]
    queries = sum(p["prefix_cache_queries"] for p in per)
    hits = sum(p["prefix_cache_hits"] for p in per)
    return {"replicas": per, "routed_split": routed, "largest_share": round(max(routed) / max(1, sum(routed)), 3),
            "prefix_cache_hits": hits, "prefix_cache_queries": queries,
            "hit_rate": round(hits / queries, 4) if queries else None}


async def _chat(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> str:
    r = await client.post(f"{url}/v1/chat/completions", json={
        "model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"] or ""


async def _prompt_ids(client: httpx.AsyncClient, url: str, messages: list[dict]) -> list[int]:
    r = await client.post(f"{url}/tokenize", json={"model": "smollm2", "messages": messages})
    r.raise_for_status()
    return r.json()["tokens"]


def _shared_full_blocks(a: list[int], b: list[int]) -> int:
    """Tokens of the whole blocks that ``a`` and ``b`` both start with."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // BLOCK_SIZE * BLOCK_SIZE


async def chats(url: str, n: int, system: bool, max_tokens: int, waves: int = 2) -> dict:
    """``waves`` waves of ``n`` one-turn chats (all of a wave sent at once, all questions distinct);
    the counter deltas per wave (the first meets cold caches, the next warm ones) and in all."""
    first = replica_counters(url)
    per_wave = []
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=n + 4)) as client:
        sys_msg = [{"role": "system", "content": SYSTEM}] if system else []
        for w in range(waves):
            before = replica_counters(url)
            await asyncio.gather(*[_chat(client, url, sys_msg + [{"role": "user", "content": question(i + 100 * w)}],
                                         max_tokens) for i in range(n)])
            await asyncio.sleep(0.5)  # the cores' last counters reach /stats with their next message
            per_wave.append({"wave": w + 1, **delta(before, replica_counters(url))})
    return {"total": delta(first, replica_counters(url)), "waves": per_wave}


async def conversations(url: str, n: int, turns: int, max_tokens: int) -> dict:
    """``n`` conversations of ``turns`` turns, each turn of all sent together; deltas per turn and in all."""
    convs = [[{"role": "system", "content": SYSTEM}] for _ in range(n)]
    last_ids: list[list[int]] = [[] for _ in range(n)]
    first = replica_counters(url)
    per_turn = []
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=n + 4)) as client:
        for t in range(turns):
            for i, c in enumerate(convs):
                c.append({"role": "user", "content": question(i, t)})
            ids = await asyncio.gather(*[_prompt_ids(client, url, c) for c in convs])
            history = sum(_shared_full_blocks(last_ids[i], ids[i]) for i in range(n)) if t else 0
            before = replica_counters(url)
            answers = await asyncio.gather(*[_chat(client, url, c, max_tokens) for c in convs])
            await asyncio.sleep(0.5)
            per_turn.append({"turn": t + 1, "history_tokens": history, **delta(before, replica_counters(url))})
            for c, a in zip(convs, answers):
                c.append({"role": "assistant", "content": a})
            last_ids = ids
    return {"total": delta(first, replica_counters(url)), "turns": per_turn}


def run(scenario: str, kv_memory: str, max_tokens: int, log_dir: Path) -> dict:
    """One scenario on a fresh server; its result (with the wall time, seconds)."""
    proc, url = start_server(log_dir / f"server-{scenario}.log", kv_memory)
    try:
        t0 = time.monotonic()
        if scenario == "chats32":
            out = asyncio.run(chats(url, 32, True, max_tokens))
        elif scenario == "chats32_nosys":
            out = asyncio.run(chats(url, 32, False, max_tokens))
        else:
            out = asyncio.run(conversations(url, 8, 4, max_tokens))
        out["wall_s"] = round(time.monotonic() - t0, 1)
        out["loadavg"] = os.getloadavg()
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    """Run the scenarios and merge this label's results into the result file."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True, help="this run's name in the result file (e.g. before, after)")
    ap.add_argument("--result-file", default="benchmarks/results/dp_routing-2026-12-04.json")
    ap.add_argument("--scenarios", nargs="+", default=["chats32", "chats32_nosys", "conv8x4"],
                    choices=["chats32", "chats32_nosys", "conv8x4"])
    ap.add_argument("--kv-cache-memory", default="256MiB", help="each replica's KV pool")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per answer")
    args = ap.parse_args()
    path = Path(args.result_file)
    doc = json.loads(path.read_text()) if path.exists() else {"kind": "dp_routing", "runs": {}}
    doc["machine"] = machine_facts()
    doc["setup"] = (f"pagedllm serve --data-parallel-size 2 --kv-cache-memory {args.kv_cache_memory} (per replica), "
                    f"default model SmolLM2-135M-Instruct, greedy chat completions of {args.max_tokens} tokens, "
                    f"block size {BLOCK_SIZE}; a fresh server per scenario; counters from /stats")
    entry = doc["runs"].setdefault(args.label, {})
    with tempfile.TemporaryDirectory() as tmp:
        for sc in args.scenarios:
            entry[sc] = run(sc, args.kv_cache_memory, args.max_tokens, Path(tmp))
            print(sc, json.dumps(entry[sc]["total"]), flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()

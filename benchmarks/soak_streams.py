"""Normal traffic beside the hostile soak: concurrent chat streams timed per output token, and
the resident memory of the server's processes.

``StreamLoad`` keeps ``n`` streaming chats running (each asks for 48 tokens with ``ignore_eos``,
then starts again) until stopped, and records each finished stream's TPOT: the time from its
first content chunk to its last over its ``completion_tokens - 1`` (from the stream's usage
chunk). ``rss_of_tree`` reads ``VmRSS`` of a process and its descendants from ``/proc`` (Linux).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class StreamStats:
    """What the normal streams saw: TPOTs in seconds, and failures (status or transport)."""

    tpot_s: list = field(default_factory=list)
    failures: list = field(default_factory=list)

    def summary(self) -> dict:
        """Median and p90 TPOT in ms, streams finished, failures (first five kept)."""
        xs = sorted(self.tpot_s)
        return {"streams": len(xs), "tpot_median_ms": round(statistics.median(xs) * 1000, 2) if xs else None,
                "tpot_p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1000, 2) if xs else None,
                "failures": len(self.failures), "failure_examples": self.failures[:5]}


async def _one_stream(http: httpx.AsyncClient, i: int, stats: StreamStats) -> None:
    body = {"messages": [{"role": "user", "content": f"Tell story number {i} about a lighthouse."}],
            "max_tokens": 48, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = None
    tokens = 0
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                stats.failures.append(f"status {r.status_code}")
                await asyncio.sleep(0.5)
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
    except httpx.HTTPError as e:
        stats.failures.append(repr(e)[:200])
        return
    if first is not None and tokens > 1:
        stats.tpot_s.append((last - first) / (tokens - 1))


class StreamLoad:
    """``n`` streaming chats kept running against ``url`` until ``stop()``.

    Args:
        url: the server's base URL.
        n: concurrent streams.
        headers: sent with every request (the API key).
    """

    def __init__(self, url: str, n: int, headers: dict) -> None:
        self.url, self.n, self.headers = url, n, headers
        self.stats = StreamStats()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._http: httpx.AsyncClient | None = None

    async def _loop(self, i: int) -> None:
        while not self._stop.is_set():
            await _one_stream(self._http, i, self.stats)

    def start(self) -> None:
        """Start the streams (on the running loop)."""
        limits = httpx.Limits(max_connections=self.n + 4, max_keepalive_connections=self.n + 4)
        self._http = httpx.AsyncClient(base_url=self.url, timeout=300, headers=self.headers, limits=limits)
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(self.n)]

    async def stop(self) -> StreamStats:
        """Let every running stream finish, then return what they saw."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._http.aclose()
        return self.stats


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def cpu_of_tree(pid: int) -> dict[str, float]:
    """CPU time (user + system, s) of ``pid`` and each descendant so far, keyed as ``rss_of_tree``."""
    tick, found, todo = os.sysconf("SC_CLK_TCK"), {}, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        found[f"{p} {cmd[:60]}"] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        todo += _children(p)
    return found


def rss_of_tree(pid: int) -> dict[str, float]:
    """Resident memory in MiB of ``pid`` and each descendant, keyed ``"<pid> <command>"``
    (the command's first 60 characters)."""
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        kb = next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")), 0)
        found[f"{p} {cmd[:60]}"] = round(kb / 1024, 1)
        todo += _children(p)
    return found

"""Hostile-input soak: bad, huge and overloading requests against ``pagedllm serve``, while
``/health`` and a small canary request are timed.

What it does
    Starts ``python -m pagedllm.cli serve --api-key KEY`` on a free port (the flags of
    ``api_soak.py``: ``--num-kv-blocks``, ``--max-model-len``, ``--server-arg``), then runs
    these phases one after another, each while a prober polls ``/health`` every 100 ms and a
    canary sends a 4-token completion every second:

    * ``big_bodies``: 10 MB bodies to ``/tokenize`` (without and with the key) and to
      ``/v1/completions`` (expected 401 / 413), and 3 MB prompts, under the body limit but
      far past what the context holds (expected 400 ``context_length_exceeded``);
    * ``choice_bomb``: 100 prompts with ``n: 128`` and 129 prompts (expected 400);
    * ``surrogates``: ``"\\ud800"`` in prompt, prompt lists, chat content, stop, model and
      ``/tokenize`` (expected 400), on one keep-alive connection;
    * ``integers``: ``stop_token_ids`` past 2**64, ``seed`` 2**64-1 with ``n: 2``, ``min_tokens``
      1e30 and 2**40, ``"max_tokens": "10"`` (expected 400);
    * ``burst``: ``--burst`` (500) concurrent 4-token completions (expected 200 or 429 with
      ``Retry-After``, nothing else);
    * ``disconnects``: 50 streams closed after their first token;
    * ``baseline`` then ``hostile`` (issue 35): ``--streams`` (50) normal chat streams for
      ``--window`` seconds alone, then the same beside every input of ``hostile_inputs.py``
      (sent four at a time from a child process at nice 10, bodies encoded once, the list
      repeated until the window ends); the streams' median TPOT
      with the hostile inputs must stay within 1.2x of the baseline's;
    * the ``burst`` runs with the normal streams beside it too.

    Afterwards the engine must be idle with every KV block free within 10 s, and the resident
    memory of the front end and of the core process back within 10% of what they held idle
    after a warm-up of the same normal load (the streams with a burst beside them, and a few ordinary
    constrained requests), read 5 s after the hostile phase and again at the end.

Reported per phase: answers by status, unexpected answers (a status the phase does not
expect, a transport error, any 5xx), ``/health`` latency p50 / p99 / max and failures, canary
latency p50 / max, and the CPU seconds each server process and this client spent in it. The
JSON goes to ``benchmarks/results/hostile_soak-<date>.json`` with the machine's CPU model and flags. Exit status 1 when any answer was unexpected, ``/health``
failed or its p99 passed 1 s, or the pool check failed.

Usage: python benchmarks/hostile_soak.py [--burst 600 --streams 50 --window 40 --json-out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_soak import start_server, stop_server  # noqa: E402
from hostile_inputs import cases as hostile_cases  # noqa: E402
from soak_streams import StreamLoad, cpu_of_tree, rss_of_tree  # noqa: E402

from pagedllm.bench.metrics import machine_facts  # noqa: E402

API_KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Phase:
    """The answers of one phase and the probes taken while it ran."""

    name: str
    statuses: dict = field(default_factory=dict)
    unexpected: list = field(default_factory=list)
    health_s: list = field(default_factory=list)
    health_failures: int = 0
    canary_s: list = field(default_factory=list)
    canary_failures: int = 0
    cpu_s: dict = field(default_factory=dict)

    def record(self, what: str, status: int | None, expected: set[int], detail: str = "") -> None:
        """Count one answer; keep it as unexpected when its status is not one of ``expected``."""
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
        if status not in expected or (status is not None and status >= 500):
            self.unexpected.append(f"{what}: {status} {detail[:200]}")


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _probe_process(url: str, conn) -> None:
    """In a child process: GET ``/health`` every 100 ms until the parent writes to ``conn``, then
    send back ``(latencies in s, failures)``. A process of its own, so the client side of a
    600-request burst (one event loop here) does not delay the probe and count as the server's."""
    lat, failures = [], 0
    with httpx.Client(timeout=5) as http:
        while not conn.poll():
            t0 = time.perf_counter()
            try:
                ok = http.get(url + "/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            lat.append(time.perf_counter() - t0)
            failures += not ok
            time.sleep(0.1)
    conn.send((lat, failures))


async def _probe(url: str, phase: Phase, stop: asyncio.Event) -> None:
    parent, child = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_probe_process, args=(url, child), daemon=True)
    proc.start()
    await stop.wait()
    parent.send("stop")
    lat, failures = await asyncio.to_thread(parent.recv)
    proc.join()
    phase.health_s += lat
    phase.health_failures += failures


async def _canary(url: str, phase: Phase, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = await http.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0})
                ok = r.status_code in (200, 429)
            except httpx.HTTPError:
                ok = False
            phase.canary_s.append(time.perf_counter() - t0)
            phase.canary_failures += not ok
            await asyncio.sleep(1.0)


async def _post(http: httpx.AsyncClient, phase: Phase, what: str, path: str, expected: set[int], **kw) -> None:
    try:
        r = await http.post(path, **kw)
        phase.record(what, r.status_code, expected, r.text)
    except httpx.HTTPError as e:
        phase.record(what, None, expected, repr(e))


async def big_bodies(url: str, phase: Phase) -> None:
    """10 MB bodies (401 without the key, 413 with it) and 3 MB prompts (400)."""
    big = b'{"prompt": "' + b"a" * 10_000_000 + b'"}'
    mid = {"prompt": "a" * 3_000_000}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        jobs = []
        for _ in range(3):
            jobs.append(_post(http, phase, "10MB /tokenize, no key", "/tokenize", {401}, content=big,
                              headers={"Content-Type": "application/json"}))
            jobs.append(_post(http, phase, "10MB /tokenize", "/tokenize", {413}, content=big,
                              headers={"Content-Type": "application/json", **AUTH}))
            jobs.append(_post(http, phase, "10MB completions", "/v1/completions", {413}, content=big,
                              headers={"Content-Type": "application/json", **AUTH}))
            jobs.append(_post(http, phase, "3MB prompt", "/v1/completions", {400}, json=mid, headers=AUTH))
            jobs.append(_post(http, phase, "3MB chat", "/v1/chat/completions", {400}, headers=AUTH,
                              json={"messages": [{"role": "user", "content": mid["prompt"]}]}))
        await asyncio.gather(*jobs)


async def choice_bomb(url: str, phase: Phase) -> None:
    """Requests that would fan out to thousands of engine requests (400)."""
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=AUTH) as http:
        await asyncio.gather(*[
            _post(http, phase, "100 prompts x n=128", "/v1/completions", {400},
                  json={"prompt": ["Hi"] * 100, "n": 128, "max_tokens": 4}),
            _post(http, phase, "129 prompts", "/v1/completions", {400}, json={"prompt": ["Hi"] * 129}),
            _post(http, phase, "n=129", "/v1/completions", {400}, json={"prompt": "Hi", "n": 129})])


SURROGATE_BODIES = [
    ("/v1/completions", '{"prompt": "a\\ud800", "max_tokens": 1}'),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 1}'),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 1}'),
    ("/v1/completions", '{"prompt": "hi", "model": "\\ud800"}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\ud800"}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'),
    ("/tokenize", '{"prompt": "\\ud800"}'),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
]


async def surrogates(url: str, phase: Phase) -> None:
    """Lone surrogates in every string field (400), all on one keep-alive connection."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=url, timeout=60, headers={**AUTH, "Content-Type": "application/json"},
                                 limits=limits) as http:
        for _ in range(3):
            for path, body in SURROGATE_BODIES:
                await _post(http, phase, f"surrogate {path}", path, {400}, content=body.encode())
            await _post(http, phase, "valid after surrogates", "/v1/completions", {200},
                        content=b'{"prompt": "Hi", "max_tokens": 1}')


INTEGER_FIELDS = [{"stop_token_ids": [2**64]}, {"seed": 2**64 - 1, "n": 2}, {"min_tokens": 1e30, "max_tokens": None},
                  {"min_tokens": 2**40, "max_tokens": None}, {"max_tokens": "10"}, {"logprobs": 10**30}]


async def integers(url: str, phase: Phase) -> None:
    """Integers past what the core can carry, and numbers as strings (400)."""
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=AUTH) as http:
        await asyncio.gather(*[_post(http, phase, f"integers {f}", "/v1/completions", {400},
                                     json={"prompt": "Hi", "max_tokens": 2, **f}) for f in INTEGER_FIELDS])


async def burst(url: str, phase: Phase, n: int) -> None:
    """``n`` concurrent small completions: each is served (200) or refused with 429 + Retry-After."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=AUTH, limits=limits) as http:
        async def one(i: int) -> None:
            try:
                r = await http.post("/v1/completions", json={"prompt": f"Story {i}:", "max_tokens": 4})
                ok = r.status_code == 200 or (r.status_code == 429 and r.headers.get("retry-after"))
                phase.record("burst", r.status_code, {200, 429} if ok else {200}, r.text)
            except httpx.HTTPError as e:
                phase.record("burst", None, {200, 429}, repr(e))
        await asyncio.gather(*[one(i) for i in range(n)])


async def disconnects(url: str, phase: Phase) -> None:
    """50 streams that hang up after their first token."""
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=AUTH) as http:
        async def one(i: int) -> None:
            try:
                async with http.stream("POST", "/v1/completions", json={
                        "prompt": f"Tale {i}", "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
                    phase.record("disconnect storm", r.status_code, {200, 429})
                    async for _ in r.aiter_lines():
                        break
            except httpx.HTTPError as e:
                phase.record("disconnect storm", None, {200, 429}, repr(e))
        await asyncio.gather(*[one(i) for i in range(50)])


def _encoded_cases() -> list[tuple[str, str, str, bytes, set[int]]]:
    """``hostile_cases()`` with every body encoded once (an attacker does not pay the server's
    CPU to re-encode a 1 MB body per request, and neither should this machine's share)."""
    return [(name, method, path, body if isinstance(body, bytes) else json.dumps(body).encode(), expected)
            for name, method, path, body, expected in hostile_cases()]


def _hostile_process(url: str, window_s: float, conn) -> None:
    """In a child process at nice 10: every hostile input, four at a time, repeated until
    ``window_s`` passed; send back ``(statuses, unexpected)``. A process of its own, so building and
    reading megabyte bodies does not delay the normal streams' client (whose timings are the
    measurement), and niced, so on a small machine the sender takes only the CPU the server leaves
    (an attacker elsewhere costs the server none of its own CPU)."""
    os.nice(10)
    todo, phase = _encoded_cases(), Phase("hostile")
    headers = {**AUTH, "Content-Type": "application/json"}

    async def run() -> None:
        t_end = time.perf_counter() + window_s
        async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers) as http:
            async def worker(queue: list) -> None:
                while queue:
                    name, method, path, body, expected = queue.pop()
                    try:
                        r = await http.request(method, path, content=body)
                        phase.record(name, r.status_code, expected, r.text)
                    except httpx.HTTPError as e:
                        phase.record(name, None, expected, repr(e))
            while True:
                queue = list(reversed(todo))
                await asyncio.gather(*[worker(queue) for _ in range(4)])
                if time.perf_counter() >= t_end:
                    return
    asyncio.run(run())
    conn.send((phase.statuses, phase.unexpected))


async def hostile(url: str, phase: Phase, window_s: float) -> None:
    """Every hostile input of ``hostile_inputs.py`` (``_hostile_process``), merged into ``phase``."""
    parent, child = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_hostile_process, args=(url, window_s, child),
                                                       daemon=True)
    proc.start()
    statuses, unexpected = await asyncio.to_thread(parent.recv)
    proc.join()
    for k, n in statuses.items():
        phase.statuses[k] = phase.statuses.get(k, 0) + n
    phase.unexpected += unexpected


async def normal_constraints(url: str) -> None:
    """A few ordinary constrained requests (a schema, a regex, a forced tool call), so the idle
    reading includes what structured outputs cost once (the core's tokenizer view for llguidance,
    the validator child)."""
    ask = [{"role": "user", "content": "Name a city."}]
    bodies = [{"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
                  "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}},
              {"guided_regex": "[A-Z][a-z]{2,10}"},
              {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                  "type": "object", "properties": {"q": {"type": "string", "maxLength": 10}}, "required": ["q"]}}}]}]
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=AUTH) as http:
        for body in bodies:
            r = await http.post("/v1/chat/completions", json={"messages": ask, "max_tokens": 24, **body})
            r.raise_for_status()


async def with_streams(url: str, args, body) -> dict:
    """Run ``body()`` while ``args.streams`` normal chat streams run; their summary."""
    load = StreamLoad(url, args.streams, AUTH)
    load.start()
    await body()
    return (await load.stop()).summary()


async def idle_rss(url: str, pid: int) -> dict:
    """Wait for the engine to be idle, then 5 s more; the processes' resident memory (MiB)."""
    await pool_check(url)
    await asyncio.sleep(5)
    return rss_of_tree(pid)


def _client_cpu_s() -> float:
    """CPU time (s) of this client and of its children already waited for (prober, hostile sender)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


async def run_phase(url: str, name: str, body, pid: int) -> Phase:
    """Run ``body(phase)`` with the ``/health`` prober and the canary beside it; the CPU seconds the
    server's processes and this client spent meanwhile go to ``phase.cpu_s`` (where the machine's
    time went: on 2 cores the client's share slows the server)."""
    phase = Phase(name)
    stop = asyncio.Event()
    probes = [asyncio.create_task(_probe(url, phase, stop)), asyncio.create_task(_canary(url, phase, stop))]
    t0, cpu0, client0 = time.perf_counter(), cpu_of_tree(pid), _client_cpu_s()
    await body(phase)
    stop.set()
    await asyncio.gather(*probes)
    cpu1 = cpu_of_tree(pid)
    phase.cpu_s = {"wall": round(time.perf_counter() - t0, 1), "client": round(_client_cpu_s() - client0, 1),
                   **{k: round(v - cpu0.get(k, 0.0), 1) for k, v in cpu1.items() if v - cpu0.get(k, 0.0) >= 0.1}}
    print(f"{name:<12} {time.perf_counter() - t0:6.1f} s  statuses {phase.statuses}  unexpected "
          f"{len(phase.unexpected)}  /health max {max(phase.health_s, default=0) * 1000:.0f} ms  "
          f"CPU s {phase.cpu_s}", flush=True)
    return phase


async def pool_check(url: str, timeout_s: float = 10.0) -> dict:
    """Wait until no request runs or waits and every KV block is free."""
    deadline = time.perf_counter() + timeout_s
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            s = (await http.get(url + "/stats")).json()
            idle = s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_blocks"]
            if idle or time.perf_counter() > deadline:
                return {"idle": idle, "num_free_blocks": s["num_free_blocks"], "num_blocks": s["num_blocks"]}
            await asyncio.sleep(0.2)


async def soak(url: str, args, pid: int) -> dict:
    phases, streams = [], {}
    # warm-up: normal traffic's own high-water mark (the streams with the burst beside them, the
    # load of the last phase) before the idle reading, so the growth measured after is what the
    # hostile inputs left
    await with_streams(url, args, lambda: burst(url, Phase("warm-up"), args.burst))
    await normal_constraints(url)  # the core builds its grammar backend once, on first use
    rss = {"idle": await idle_rss(url, pid)}

    async def baseline_phase(p: Phase) -> None:
        streams["baseline"] = await with_streams(url, args, lambda: asyncio.sleep(args.window))
    phases.append(await run_phase(url, "baseline", baseline_phase, pid))

    async def hostile_phase(p: Phase) -> None:
        streams["hostile"] = await with_streams(url, args, lambda: hostile(url, p, args.window))
    phases.append(await run_phase(url, "hostile", hostile_phase, pid))
    rss["after_hostile"] = await idle_rss(url, pid)
    for name, fn in (("big_bodies", big_bodies), ("choice_bomb", choice_bomb), ("surrogates", surrogates),
                     ("integers", integers), ("disconnects", disconnects)):
        phases.append(await run_phase(url, name, lambda p, fn=fn: fn(url, p), pid))

    async def burst_phase(p: Phase) -> None:
        streams["burst"] = await with_streams(url, args, lambda: burst(url, p, args.burst))
    phases.append(await run_phase(url, "burst", burst_phase, pid))
    rss["after_all"] = await idle_rss(url, pid)
    pool = await pool_check(url)
    async with httpx.AsyncClient(timeout=10) as http:
        metrics = (await http.get(url + "/metrics")).text
    rejected = {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines() if line.startswith("pagedllm:num_requests_rejected_total{")}
    return {"phases": phases, "pool": pool, "rejected": rejected, "streams": streams, "rss": rss}


def rss_growth(rss: dict) -> dict:
    """Per process (by pid), the resident memory after each phase over its idle level."""
    def by_pid(d):
        return {k.split()[0]: (k, v) for k, v in d.items()}
    idle = by_pid(rss["idle"])
    out = {}
    for when in ("after_hostile", "after_all"):
        for pid, (name, mib) in by_pid(rss[when]).items():
            if pid in idle and idle[pid][1] > 100:  # the server's processes, not helpers of a few MiB
                out.setdefault(name, {})[when] = round(mib / idle[pid][1], 3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--burst", type=int, default=600, help="concurrent requests of the burst phase")
    p.add_argument("--streams", type=int, default=50, help="normal chat streams beside the hostile phases")
    p.add_argument("--window", type=float, default=40.0, help="seconds of the baseline and hostile phases")
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for pagedllm serve (repeatable)")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    args.model_name = "smollm2"
    args.server_arg = ["--api-key", API_KEY, *args.server_arg]
    try:
        proc, url, log = start_server(args)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        res = asyncio.run(soak(url, args, proc.pid))
    finally:
        stop_server(proc)
    phases = res["phases"]
    health = [x for ph in phases for x in ph.health_s]
    report = {
        "machine": machine_facts(),
        "server_args": args.server_arg[2:], "burst": args.burst,
        "phases": [{"name": ph.name, "statuses": ph.statuses, "unexpected": ph.unexpected,
                    "health_p50_ms": _ms(_pct(ph.health_s, 0.5)), "health_p99_ms": _ms(_pct(ph.health_s, 0.99)),
                    "health_max_ms": _ms(max(ph.health_s, default=None)), "health_failures": ph.health_failures,
                    "canary_p50_s": _pct(ph.canary_s, 0.5), "canary_max_s": max(ph.canary_s, default=None),
                    "canary_failures": ph.canary_failures, "cpu_s": ph.cpu_s} for ph in phases],
        "num_5xx": sum(n for ph in phases for s, n in ph.statuses.items() if s.isdigit() and int(s) >= 500),
        "num_unexpected": sum(len(ph.unexpected) for ph in phases),
        "health_max_ms": _ms(max(health, default=None)), "health_p99_ms": _ms(_pct(health, 0.99)),
        "rejected_metric": res["rejected"], "pool": res["pool"], "streams": res["streams"],
        "rss_mib": res["rss"], "rss_ratio": rss_growth(res["rss"]),
    }
    base, hot = res["streams"]["baseline"]["tpot_median_ms"], res["streams"]["hostile"]["tpot_median_ms"]
    report["tpot_ratio_hostile"] = round(hot / base, 3) if base and hot else None
    # every poll under 1 s (issue 35): a load balancer's probe reads one slow answer as dead
    ok = (report["num_unexpected"] == 0 and report["num_5xx"] == 0 and res["pool"]["idle"]
          and not any(ph.health_failures for ph in phases) and (report["health_max_ms"] or 0) < 1000
          and (report["tpot_ratio_hostile"] or 9) <= 1.2
          and all(r <= 1.1 for d in report["rss_ratio"].values() for r in d.values())
          and not any(s["failures"] for s in res["streams"].values()))
    report["passed"] = ok
    out = Path(args.json_out or Path(__file__).resolve().parent / "results" /
               f"hostile_soak-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"5xx: {report['num_5xx']}  unexpected: {report['num_unexpected']}  /health p99 "
          f"{report['health_p99_ms']} ms, max {report['health_max_ms']} ms  pool idle: {res['pool']['idle']}  "
          f"rejections: {res['rejected']}\nTPOT hostile/baseline {report['tpot_ratio_hostile']}  "
          f"RSS ratios {report['rss_ratio']}\nresult: {out}")
    return 0 if ok else 1


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


if __name__ == "__main__":
    sys.exit(main())

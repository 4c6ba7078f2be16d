"""``pagedllm serve --data-parallel-size 2``: both replicas serve concurrent requests, ``/stats`` and
``/metrics`` show them summed and one by one, a killed replica fails only its own stream while
``/health`` stays 200, and the server exits 1 (no process left) once the last replica is gone."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (ProcessLookupError, OSError):
        return False


def _wait(pred, timeout_s: float = 60.0):
    """Poll ``pred()`` until it returns something truthy (generous deadline); return that."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _health(url: str) -> int | None:
    """``/health``'s status, ``None`` once the server no longer answers."""
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def test_two_replicas_serve_report_and_fail_alone(tmp_path, start_server_process):
    with start_server_process(tmp_path, ["--data-parallel-size", "2"]) as (url, proc):
        stats = httpx.get(f"{url}/stats").json()
        reps = stats["replicas"]
        pids = [r["core_pid"] for r in reps]
        assert [r["replica"] for r in reps] == [0, 1] and len(set(pids)) == 2 and all(map(_alive, pids))
        assert stats["num_blocks"] == 2 * reps[0]["num_blocks"]

        body = {"prompt": "Count to ten:", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(6) as ex:
            answers = list(ex.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=120), range(6)))
        assert all(a.status_code == 200 for a in answers)
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1  # greedy: the same on both replicas
        reps = _wait(lambda: [r for r in [httpx.get(f"{url}/stats").json()["replicas"]]
                              if sum(x["num_generation_tokens"] for x in r) == 48])
        assert reps, "the counters never reached 6 x 8 tokens"
        reps = reps[0]
        assert all(r["routed"] >= 1 and r["num_generation_tokens"] >= 8 for r in reps)

        metrics = httpx.get(f"{url}/metrics").text
        assert 'pagedllm:generation_tokens_total{model_name="smollm2"} 48.0' in metrics  # summed, same name
        for i in (0, 1):
            assert f'pagedllm:replica_up{{model_name="smollm2",replica="{i}"}} 1.0' in metrics
            n = reps[i]["num_generation_tokens"]
            assert f'pagedllm:replica_generation_tokens_total{{model_name="smollm2",replica="{i}"}} {n:.1f}' in metrics

        # a long stream; kill the replica that runs it
        long = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        events, victim = [], None
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3 and victim is None:
                    victim = next(x["replica"] for x in httpx.get(f"{url}/stats").json()["replicas"]
                                  if x["in_flight"] == 1)
                    os.kill(pids[victim], signal.SIGKILL)
        assert events[-1] == "[DONE]"
        errors = [json.loads(e)["error"]["message"] for e in events[:-1] if "error" in json.loads(e)]
        assert errors and f"data-parallel replica {victim}" in errors[0]
        assert httpx.get(f"{url}/health").status_code == 200  # one replica is left
        survivor = 1 - victim
        ok = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == answers[0].json()["choices"][0]["text"]
        reps = httpx.get(f"{url}/stats").json()["replicas"]
        assert reps[victim]["alive"] is False and reps[survivor]["alive"] is True
        assert f'pagedllm:replica_up{{model_name="smollm2",replica="{victim}"}} 0.0' in httpx.get(f"{url}/metrics").text

        os.kill(pids[survivor], signal.SIGKILL)  # the last one: the server gives up
        assert _wait(lambda: _health(url) != 200, 30)
        assert proc.wait(timeout=60) == 1
    assert not any(map(_alive, pids))

"""The server with its engine core in a separate process: a dead core is reported, a stopped server ends it."""

from __future__ import annotations

import glob
import json
import os
import signal
import tempfile
import time

import httpx
import pytest


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _nice(pid: int) -> int:
    """The process's niceness (field 19 of ``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_killed_core_ends_the_stream_with_an_error_and_fails_health(tmp_path, start_server_process):
    """SIGKILL of the core mid-stream: the stream ends with an error event, /health answers 503
    with the gauges at 0, and then the server exits with status 1 (for a supervisor to restart
    it), leaving no ipc socket files. While it runs, the API server has lowered its priority by
    ``PAGEDLLM_API_SERVER_NICE`` (7) and the core has not."""
    ipc = _private_tmp(tmp_path)
    before = _ipc_sockets(ipc)
    with start_server_process(tmp_path, (), {"TMPDIR": ipc}) as (url, proc):
        pid = httpx.get(f"{url}/stats").json()["core_pid"]
        assert pid != os.getpid() and _alive(pid)
        assert (_nice(proc.pid), _nice(pid)) == (min(19, os.nice(0) + 7), os.nice(0))
        body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    os.kill(pid, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        errors = [json.loads(e) for e in events[:-1] if "error" in json.loads(e)]
        assert errors and "engine" in errors[0]["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        stats = httpx.get(f"{url}/stats").json()
        assert (stats["num_running"], stats["num_waiting"]) == (0, 0)
        assert proc.wait(timeout=30) == 1
    assert not (_ipc_sockets(ipc) - before)


def _private_tmp(tmp_path) -> str:
    """A temporary directory for the server alone (its ``TMPDIR``): the ipc socket files of other
    pagedllm processes on the machine (other test runs) must not count as the server's."""
    d = tmp_path / "ipc"
    d.mkdir()
    return str(d)


def _ipc_sockets(directory: str | None = None) -> set[str]:
    return set(glob.glob(os.path.join(directory or tempfile.gettempdir(), "pagedllm-*-in")))


def test_stopping_the_server_ends_the_core(tmp_path, start_server):
    """After the server stops (SIGTERM), its core process is gone, with no orphan, and its ipc
    socket files are removed (uvicorn re-raises SIGTERM after its shutdown; the front end must
    still stop the core)."""
    ipc = _private_tmp(tmp_path)
    before = _ipc_sockets(ipc)
    with start_server(tmp_path, (), {"TMPDIR": ipc}) as url:
        pid = httpx.get(f"{url}/stats").json()["core_pid"]
        assert _alive(pid)
        ours = _ipc_sockets(ipc) - before
        assert len(ours) == 1
    assert not (ours & _ipc_sockets(ipc))
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid)

"""Fixtures of the end-to-end tests: live ``pagedllm serve`` subprocesses.

The server runs the default model (SmolLM2-135M-Instruct, converted from its
GGUF on first use into ``$PAGEDLLM_CACHE`` or ``~/.cache/pagedllm``) on a free
local port, with a small KV pool and ``--max-model-len 2048`` so that
over-long prompts are cheap to provoke. ``server_url`` is open and shared by
the whole session; ``secure_server`` (per module that asks for it) also has an
API key and a one-origin CORS policy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import httpx
import pytest
import uvicorn

MODEL_NAME = "smollm2"
MAX_MODEL_LEN = 2048
NUM_KV_BLOCKS = 512
STARTUP_TIMEOUT_S = 300.0  # a 0.5B model starts in ~40 s idle; a loaded 2-core CI machine took over 120
SECURE_API_KEY = "sk-test"
SECURE_ORIGIN = "http://example.com"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "<no log>"


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server (uvicorn shuts down gracefully), then SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def served_model() -> str:
    """The ``--served-model-name`` of the test server."""
    return MODEL_NAME


@pytest.fixture(scope="session")
def max_model_len() -> int:
    """The ``--max-model-len`` of the test server."""
    return MAX_MODEL_LEN


@contextlib.contextmanager
def _serve_process(log_dir: Path, extra_args: Sequence[str] = (), extra_env: dict | None = None):
    """Start ``pagedllm serve`` with the common test flags plus ``extra_args``; yield
    ``(base URL, Popen)`` once ``/health`` answers 200; stop it on exit (if it still runs).

    Fails the test if the server exits or is not healthy within ``STARTUP_TIMEOUT_S``.
    """
    port = _free_port()
    log = log_dir / "server.log"
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN),
           "--served-model-name", MODEL_NAME, "--log-level", "warning", *extra_args]
    # a key in the developer's environment must not lock the open test server
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_API_KEY"}
    # output goes to a file, never a pipe nobody drains (a full pipe would block the server)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**env, "PYTHONUNBUFFERED": "1", **(extra_env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"pagedllm serve exited with {proc.returncode} before becoming healthy:\n"
                            f"{_tail(log)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"pagedllm serve not healthy after {STARTUP_TIMEOUT_S:.0f} s:\n{_tail(log)}")
            time.sleep(0.5)
        yield url, proc
    finally:
        _stop(proc)


@contextlib.contextmanager
def _serve(log_dir: Path, extra_args: Sequence[str] = (), extra_env: dict | None = None):
    """As ``_serve_process``, yielding only the base URL (``http://127.0.0.1:PORT``)."""
    with _serve_process(log_dir, extra_args, extra_env) as (url, _):
        yield url


@pytest.fixture(scope="session")
def server_url(tmp_path_factory) -> str:
    """Start ``pagedllm serve`` and yield its base URL (``http://127.0.0.1:PORT``)."""
    with _serve(tmp_path_factory.mktemp("server")) as url:
        yield url


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory) -> SimpleNamespace:
    """A second server with ``--api-key`` and ``--allowed-origins`` set, for the modules that use it.

    Yields a namespace with ``url``, ``api_key`` and ``allowed_origin``.
    """
    args = ["--api-key", SECURE_API_KEY, "--allowed-origins", f'["{SECURE_ORIGIN}"]']
    with _serve(tmp_path_factory.mktemp("secure_server"), args) as url:
        yield SimpleNamespace(url=url, api_key=SECURE_API_KEY, allowed_origin=SECURE_ORIGIN)


@pytest.fixture(scope="session")
def start_server():
    """The server context manager ``start_server(log_dir, extra_args, extra_env)`` (yields the base URL),
    for modules that need a server of their own (tests cannot import conftest)."""
    return _serve


@pytest.fixture(scope="session")
def start_server_process():
    """``start_server_process(log_dir, extra_args, extra_env)`` yields ``(base URL, Popen)``, for tests that
    signal the server or read its exit status."""
    return _serve_process


class ThreadServer:
    """uvicorn serving ``app`` in a daemon thread on a socket bound here (no port race)."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="uvicorn-test", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if not self.thread.is_alive() or time.monotonic() > deadline:
                pytest.fail("test uvicorn server did not become healthy")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


@pytest.fixture(scope="session")
def thread_server():
    """``ThreadServer``: ``thread_server(app)`` serves an app built by the test in process."""
    return ThreadServer

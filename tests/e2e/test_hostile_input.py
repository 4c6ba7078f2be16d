"""The server under hostile input and overload (issue 14): every bad request gets its 4xx/5xx with
an OpenAI error body, costs nothing else, and the next request is served normally.

Cheap cases use the shared ``server_url``; admission control and the shutdown deadline use a
server of their own with tiny limits (``--max-num-seqs 2 --max-waiting-requests 1
--shutdown-timeout 3``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

MODEL_NAME = "smollm2"
LONG = {"prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True, "stream": True}


def assert_error(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    """``r`` is an OpenAI error answer with this status, param (and code, when given)."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _raw_post(path: str, body: str) -> bytes:
    """An HTTP/1.1 POST with a JSON body written as given (``\\ud800`` escapes stay escapes)."""
    data = body.encode("ascii")
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def _exchange(url: str, raw_requests: list[bytes]) -> list[tuple[int, dict]]:
    """Send requests one after another on ONE connection; return each ``(status, json body)``."""
    u = urlparse(url)
    answers = []
    with socket.create_connection((u.hostname, u.port), timeout=60) as s:
        for raw in raw_requests:
            s.sendall(raw)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = s.recv(65536)
                assert chunk, f"the server closed the connection after {len(answers)} answers"
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            length = int(next(l for l in lines if l.lower().startswith(b"content-length:")).split(b":")[1])
            while len(body) < length:
                chunk = s.recv(65536)
                assert chunk, "the server closed the connection mid-answer"
                body += chunk
            assert b"connection: close" not in head.lower()
            answers.append((int(lines[0].split(b" ")[1]), json.loads(body)))
    return answers


# ---- lone surrogates ------------------------------------------------------------------------
MSG = '[{"role": "user", "content": "hi"}]'
SURROGATE_CASES = {
    "prompt": ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    "prompt_list": ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt[1]"),
    "stop": ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 1}', "stop[0]"),
    "model": ("/v1/completions", '{"prompt": "hi", "model": "\\ud800", "max_tokens": 1}', "model"),
    "chat_content": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\ud800"}]}',
                     "messages[0].content"),
    "chat_parts": ("/v1/chat/completions",
                   '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
                   "messages[0].content[0].text"),
    "chat_stop": ("/v1/chat/completions", '{"messages": ' + MSG + ', "stop": "\\ud800"}', "stop"),
    "chat_kwargs": ("/v1/chat/completions", '{"messages": ' + MSG + ', "chat_template_kwargs": {"x": "\\ud800"}}',
                    "chat_template_kwargs.x"),
    "tokenize_prompt": ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    "tokenize_messages": ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
                          "messages[0].content"),
    "detokenize_model": ("/detokenize", '{"tokens": [1], "model": "\\ud800"}', "model"),
}


@pytest.mark.parametrize("case", sorted(SURROGATE_CASES))
def test_lone_surrogates_are_a_400_naming_the_field(server_url, case):
    path, body, param = SURROGATE_CASES[case]
    (status, answer), = _exchange(server_url, [_raw_post(path, body)])
    assert status == 400, answer
    assert answer["error"]["param"] == param and "surrogate" in answer["error"]["message"]


def test_bad_requests_keep_the_connection_open(server_url):
    """Ten requests on one keep-alive connection, bad and good in turn: every one is answered."""
    good = _raw_post("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "temperature": 0}')
    bad = _raw_post("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 1}')
    answers = _exchange(server_url, [bad, good] * 5)
    assert [s for s, _ in answers] == [400, 200] * 5


# ---- integers past what the core can carry --------------------------------------------------
INT_CASES = {
    "stop_token_ids_past_uint64": ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    "stop_token_ids_past_vocab": ({"stop_token_ids": [49152]}, "stop_token_ids"),
    "stop_token_ids_negative": ({"stop_token_ids": [-1]}, "stop_token_ids"),
    "seed_overflows_with_n": ({"seed": 2**64 - 1, "n": 2}, "seed"),
    "seed_past_uint64": ({"seed": 2**64}, "seed"),
    "min_tokens_float": ({"min_tokens": 1e30, "max_tokens": None}, "min_tokens"),
    "min_tokens_past_context": ({"min_tokens": 2**40, "max_tokens": None}, "min_tokens"),
    "max_tokens_string": ({"max_tokens": "10"}, "max_tokens"),
    "max_tokens_float": ({"max_tokens": 10.0}, "max_tokens"),
    "n_string": ({"n": "2"}, "n"),
}


@pytest.mark.parametrize("case", sorted(INT_CASES))
def test_out_of_range_integers_are_a_400(server_url, case):
    fields, param = INT_CASES[case]
    r = httpx.post(server_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **fields}, timeout=30)
    assert_error(r, 400, param)


def test_max_completion_tokens_errors_name_it(server_url):
    for fields in ({"max_completion_tokens": 5000}, {"max_completion_tokens": 2, "min_tokens": 3}):
        r = httpx.post(server_url + "/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "Hi"}], **fields})
        err = assert_error(r, 400, "max_completion_tokens" if "min_tokens" not in fields else "min_tokens")
        assert "max_completion_tokens" in err["message"] and "max_tokens" not in err["message"].replace(
            "max_completion_tokens", "")


def test_seed_at_the_top_of_the_range_is_served(server_url):
    r = httpx.post(server_url + "/v1/completions", timeout=60,
                   json={"prompt": "Hi", "max_tokens": 2, "seed": 2**64 - 2, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


# ---- size: choices, characters -------------------------------------------------------------
def test_choice_cap(server_url):
    r = httpx.post(server_url + "/v1/completions", timeout=30,
                   json={"prompt": ["Hi"] * 100, "n": 128, "max_tokens": 4})
    assert_error(r, 400, "n", "too_many_choices")
    r = httpx.post(server_url + "/v1/completions", timeout=30, json={"prompt": ["Hi"] * 129, "max_tokens": 1})
    assert_error(r, 400, "prompt", "too_many_choices")
    r = httpx.post(server_url + "/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200


def test_long_lists_are_refused(server_url):
    """Lists whose length costs work per request or per step are bounded (400 naming them)."""
    msg = {"role": "user", "content": "a"}
    for path, body, param in (("/v1/chat/completions", {"messages": [msg] * 4097}, "messages"),
                              ("/v1/completions", {"prompt": "Hi", "stop": ["x"] * 65}, "stop"),
                              ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [1] * 4097}, "stop_token_ids"),
                              ("/tokenize", {"messages": [msg] * 4097}, "messages")):
        r = httpx.post(server_url + path, json=body, timeout=30)
        assert_error(r, 400, param)


def test_prompt_too_many_characters_is_refused_before_tokenizing(server_url):
    text = "a" * 3_000_000  # under the 4 MiB body limit, far past what 2048 tokens can hold
    for path, body, param in (("/v1/completions", {"prompt": text}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
                              ("/tokenize", {"prompt": text}, "prompt")):
        r = httpx.post(server_url + path, json=body, timeout=30)
        assert_error(r, 400, param, "context_length_exceeded")
    assert httpx.get(server_url + "/health", timeout=5).status_code == 200


# ---- admission control and the shutdown deadline (a server of their own) ---------------------
@pytest.fixture(scope="module")
def small_server(tmp_path_factory, start_server_process):
    """``(url, proc)`` of a server that holds at most 3 engine requests (2 running + 1 waiting)."""
    args = ["--max-num-seqs", "2", "--max-waiting-requests", "1", "--shutdown-timeout", "3"]
    with start_server_process(tmp_path_factory.mktemp("small_server"), args) as served:
        yield served


class _Stream:
    """A streamed completion read in a thread; ``started`` once its first token arrives."""

    def __init__(self, url: str, body: dict) -> None:
        self.events: list[str] = []
        self.started = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        if len(self.events) >= 2:
                            self.started.set()
                    if self.stop.is_set():
                        return
        except httpx.HTTPError as e:
            self.events.append(f"transport error {e!r}")
        finally:
            self.started.set()


def test_requests_past_the_queue_limit_get_429_with_retry_after(small_server):
    url, _ = small_server
    # more choices than the server ever holds: no retry could help, so a 400, not a 429
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "n": 4}, timeout=30)
    assert_error(r, 400, "n", "too_many_choices")
    streams = [_Stream(url, LONG) for _ in range(3)]
    try:
        deadline = time.monotonic() + 120
        while sum(s.started.is_set() for s in streams) < 2:  # two run; the third waits for a sequence slot
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.1)
        deadline = time.monotonic() + 60
        while True:
            stats = httpx.get(url + "/stats", timeout=10).json()
            if stats["num_running"] + stats["num_waiting"] == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (stats["num_running"], stats["num_waiting"]) == (2, 1)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        err = assert_error(r, 429, None, "queue_full")
        assert err["type"] == "server_overloaded" and r.headers["retry-after"] == "1"
        r = httpx.post(url + "/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert_error(r, 429, None, "queue_full")
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert f'pagedllm:num_requests_rejected_total{{model_name="{MODEL_NAME}",reason="queue_full"}} 2.0' in metrics
    finally:
        for s in streams:
            s.stop.set()
        for s in streams:
            s.thread.join(timeout=60)
    # the slots come back when the streams go away, and so do the KV blocks
    deadline = time.monotonic() + 30
    while True:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    stats = httpx.get(url + "/stats", timeout=10).json()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_sigterm_with_a_long_stream_exits_within_the_deadline(small_server):
    """SIGTERM: the running stream gets its error event and [DONE] after the 3 s deadline, and the
    server exits 0 within the deadline plus 5 s."""
    url, proc = small_server
    stream = _Stream(url, LONG)
    assert stream.started.wait(120)
    # the core ignores SIGTERM (a signal to the whole process group must not kill it before the drain)
    core_pid = httpx.get(url + "/stats", timeout=10).json()["core_pid"]
    os.kill(core_pid, signal.SIGTERM)
    n = len(stream.events)
    time.sleep(1.0)
    assert httpx.get(url + "/health", timeout=10).status_code == 200 and len(stream.events) > n
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    elapsed = time.monotonic() - t0
    stream.thread.join(timeout=30)
    assert elapsed < 3 + 5, elapsed
    assert stream.events[-1] == "[DONE]"
    errors = [json.loads(e) for e in stream.events[:-1] if e.startswith("{") and "error" in json.loads(e)]
    assert errors and "shutting down" in errors[0]["error"]["message"]

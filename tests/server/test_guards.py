"""The server's guards on their own: surrogate walk, admission control, body limit, catch-all 500.

The ASGI middlewares run under a real uvicorn server on a free port, so that keep-alive
and early 413 answers are checked on real sockets.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request

from pagedllm.server.errors import APIError
from pagedllm.server.guards import (MAX_CHOICES_PER_REQUEST, AdmissionControl, BodySizeLimitMiddleware,
                                    CatchAllMiddleware, RejectionCounter, check_choices, find_lone_surrogate)
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest


def test_find_lone_surrogate_names_the_field():
    body = {"model": "m", "messages": [{"role": "user", "content": "ok"},
                                       {"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]}
    assert find_lone_surrogate(body) == "messages[1].content[0].text"
    assert find_lone_surrogate({"stop": ["x", "\udfff"]}) == "stop[1]"
    assert find_lone_surrogate({"logit_bias": {"\ud800": 1}}) == "logit_bias"
    assert find_lone_surrogate("\ud800") == "body"
    assert find_lone_surrogate({"prompt": "caf\u00e9 \U0001F600", "n": 2, "stop": None}) is None


def test_schema_refuses_lone_surrogates_with_the_path():
    from pydantic import ValidationError
    from pagedllm.server.errors import validation_error
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": ["fine", "bad\ud800"]})
    err = validation_error(e.value)
    assert (err.status, err.param) == (400, "prompt[1]")


@pytest.mark.parametrize("field,value", [("max_tokens", "10"), ("n", 2.0), ("min_tokens", 1e30),
                                         ("temperature", "0.5"), ("stream", "true")])
def test_schema_types_are_strict(field, value):
    from pydantic import ValidationError
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", field: value})
    assert e.value.errors()[0]["loc"][0] == field


def test_max_completion_tokens_errors_use_its_name():
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "max_completion_tokens": 5})
    assert body.rename_error("max_tokens", "for max_tokens") == ("max_completion_tokens", "for max_completion_tokens")
    plain = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5})
    assert plain.rename_error("max_tokens", "for max_tokens") == ("max_tokens", "for max_tokens")


def test_admission_control_counts_and_releases():
    rejections = RejectionCounter()
    control = AdmissionControl(3, rejections)
    a = control.admit(2)
    with pytest.raises(APIError) as e:
        control.admit(2)
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"} and e.value.code == "queue_full"
    with control.admit(1):
        assert control.in_flight == 3
    a.release()
    a.release()  # idempotent
    assert control.in_flight == 0
    with pytest.raises(APIError) as e:  # more than the bound itself: a 400, since no retry could succeed
        control.admit(4)
    assert (e.value.status, e.value.param, e.value.code) == (400, "n", "too_many_choices")
    assert rejections.snapshot() == {"queue_full": 1}
    unbounded = AdmissionControl(None, rejections)
    unbounded.admit(10**6)


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_shutdown_timeout_must_be_finite(value, capsys):
    from pagedllm.cli import main
    assert main(["serve", "--shutdown-timeout", value]) == 2
    assert "--shutdown-timeout" in capsys.readouterr().err


def test_choice_cap():
    check_choices(1, MAX_CHOICES_PER_REQUEST)
    with pytest.raises(APIError) as e:
        check_choices(100, 128)
    assert (e.value.status, e.value.param, e.value.code) == (400, "n", "too_many_choices")
    with pytest.raises(APIError) as e:
        check_choices(MAX_CHOICES_PER_REQUEST + 1, 1)
    assert e.value.param == "prompt"


# ---- the middlewares under uvicorn ------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def guarded_server():
    """A small app behind CatchAll + BodySizeLimit (limit 1000 bytes), served by uvicorn in a thread."""
    app = FastAPI()
    rejections = RejectionCounter()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("something broke")

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=1000, rejections=rejections)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield port, rejections
    server.should_exit = True
    thread.join(timeout=10)


def _exchange(port: int, raw_requests: list[bytes]) -> list[bytes]:
    """Send requests one after another on one connection; return each raw response."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for raw in raw_requests:
            s.sendall(raw)
            data = b""
            while b"\r\n\r\n" not in data:
                data += s.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")][0]
                         .split(b":")[1])
            while len(body) < length:
                body += s.recv(65536)
            out.append(head + b"\r\n\r\n" + body)
    return out


def test_catch_all_answers_500_and_keeps_the_connection(guarded_server, caplog):
    port, _ = guarded_server
    get = lambda path: f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    with caplog.at_level(logging.ERROR, logger="pagedllm.server.guards"):
        answers = _exchange(port, [get("/boom"), get("/ok"), get("/boom"), get("/ok")])
    assert [a.split(b" ")[1] for a in answers] == [b"500", b"200", b"500", b"200"]
    assert b'"type":"internal_error"' in answers[0] and b"connection: close" not in answers[0].lower()
    lines = [r for r in caplog.records if r.name == "pagedllm.server.guards"]
    assert len(lines) == 2 and "something broke" in lines[0].getMessage() and lines[0].exc_info is None


def _read_answer(s: socket.socket) -> bytes:
    """Read until the server closes the connection or a whole JSON body has arrived."""
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        lengths = [l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")]
        if sep and lengths and len(body) >= int(lengths[0].split(b":")[1]):
            return data


def test_body_limit(guarded_server):
    port, rejections = guarded_server
    before = rejections.snapshot().get("body_too_large", 0)
    small = b'{"a": 1}'
    post = lambda body: (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    ok, = _exchange(port, [post(small)])
    assert ok.split(b" ")[1] == b"200" and b'"bytes":8' in ok
    # refused by its Content-Length, before the body is sent
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n")
        head = _read_answer(s)
    assert head.split(b" ")[1] == b"413" and b"request_too_large" in head
    # chunked, no Content-Length: refused once the bytes read pass the limit
    chunk = b"x" * 600
    chunked = (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
               (b"258\r\n" + chunk + b"\r\n") * 3 + b"0\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(chunked)
        head = _read_answer(s)
    assert head.split(b" ")[1] == b"413"
    assert rejections.snapshot()["body_too_large"] == before + 2


def test_error_body_encodes_any_text():
    resp = APIError(400, "model `\ud800` does not exist", "model").response()
    assert b"\\ud800" in resp.body


def test_admission_release_when_a_stream_never_starts():
    from pagedllm.server.base import HeldStream as _HeldStream
    control = AdmissionControl(4, RejectionCounter())

    async def lines():
        yield "data: x\n\n"

    async def run():
        held = _HeldStream(lines(), control.admit(3))
        await held.aclose()  # closed before its first line, as after an early disconnect
        return control.in_flight

    assert asyncio.run(run()) == 0


def test_the_front_end_trims_its_heap_once_idle():
    """The last request ending (and none starting for ``delay_s``) trims once; a request still in
    flight, or a trim less than ``min_interval_s`` ago, holds it back (issue 35: the front end's
    RSS stayed at its high-water mark after hostile bodies)."""
    from pagedllm.server.guards import IdleTrimMiddleware
    trims = []

    async def app(scope, receive, send):
        await asyncio.sleep(0.01)

    async def run():
        mw = IdleTrimMiddleware(app, delay_s=0.05, min_interval_s=0.3, trim=lambda: trims.append(1))
        http = {"type": "http"}
        await asyncio.gather(*[mw(http, None, None) for _ in range(5)])  # one burst: one trim
        await asyncio.sleep(0.15)
        assert len(trims) == 1 and mw.in_flight == 0
        await mw(http, None, None)  # within min_interval_s of the last trim: none
        await asyncio.sleep(0.1)
        assert len(trims) == 1
        await asyncio.sleep(0.3)
        await mw(http, None, None)
        slow = asyncio.ensure_future(mw(http, None, None))
        await asyncio.sleep(0.001)
        assert mw.in_flight == 1
        await slow
        await asyncio.sleep(0.15)
        assert len(trims) == 2
    asyncio.run(run())

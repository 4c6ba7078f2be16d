"""vLLM's ``/v1/realtime`` WebSocket for transcription, served by a Whisper model (issue 42).

Events (vLLM's names): the server opens with ``session.created``; the client may send
``session.update`` (``model``, ``language``, ``prompt``, ``temperature``; answered by
``session.updated``), then ``input_audio_buffer.append`` events with base64 PCM16 mono 16 kHz audio
and ``input_audio_buffer.commit`` (``final``: no more audio will come) to close an utterance; the
server answers ``transcription.delta`` events (``delta``: text) and, per utterance,
``transcription.done`` (``text``, ``usage`` in tokens). A bad event is answered by an ``error`` event
(``error``: the message naming the field, ``code``, ``param``) and costs nothing else: the session
goes on.

Whisper hears 30 s windows with a bidirectional encoder, so audio cannot extend a running request's
prompt: each window is one request, started as soon as its audio has arrived, cut where the file
endpoint cuts it (``subtitles.split_audio``: the quietest 100 ms of the last second before each 30 s
boundary, decided from the audio up to that boundary alone), so nothing already heard is computed
again and the text equals ``/v1/audio/transcriptions``' on the same audio. Voxtral Realtime is served
the same way (its windows' prompts its own, no language or prompt field): within a window the engine
adds the audio's row to every step (``MultiModalInput.additive``); a window's request starts once its
audio is complete, as audio appended to a running request is not built.

Source: vLLM's realtime protocol (``vllm/entrypoints/openai/realtime``) as documented.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time

import numpy as np
from fastapi import WebSocket, WebSocketDisconnect

from pagedllm.sampling_params import SamplingParams
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import random_id
from pagedllm.server.subtitles import CHUNK_S, split_audio

RATE = 16_000
MAX_SESSION_S = 30 * 60  # one utterance holds at most 30 minutes of audio (the file endpoint's bound)
_SESSION_FIELDS = ("model", "language", "prompt", "temperature")


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param, code="invalid_value")


def pcm16(data, where: str = "audio") -> np.ndarray:
    """Base64 PCM16 little-endian mono -> ``[samples]`` float32 in [-1, 1) (``/ 32768``, as FFmpeg reads it).

    Raises:
        APIError: 400 naming ``where``: not a string, not base64, or an odd byte count.
    """
    if not isinstance(data, str):
        raise _bad(f"{where}: base64 PCM16 audio (a string) expected", where)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(f"{where}: not base64", where) from None
    if len(raw) % 2:
        raise _bad(f"{where}: {len(raw)} bytes: PCM16 takes 2 bytes a sample", where)
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


class RealtimeSession:
    """One WebSocket's transcription session over ``serving`` (``OpenAIServingTranscription``).

    Attributes:
        audio: ``[samples]`` float32 of the open utterance from ``start`` on (what no window holds yet).
        windows: the open utterance's window tasks, in order (each returns its generated ids and its
            prompt's token count).
    """

    def __init__(self, websocket: WebSocket, serving) -> None:
        self.ws, self.serving = websocket, serving
        self.session = {"model": serving.model_name, "language": None, "prompt": "", "temperature": 0.0}
        self._reset()

    def _reset(self) -> None:
        self.audio = np.zeros(0, np.float32)
        self.heard = 0  # samples of the utterance so far
        self.windows: list[asyncio.Task] = []
        self.order: asyncio.Queue = asyncio.Queue()  # each window's delta queue, then None at commit
        self.speaker: asyncio.Task | None = None
        self.prompt: str | None = None
        self.driver = None  # Voxtral Realtime: the utterance's stream of requests (realtime_voxtral)

    async def run(self) -> None:
        """Serve the socket until the client closes it; a window still running is aborted then."""
        await self.ws.accept()
        await self._send({"type": "session.created", "id": random_id("sess"), "created": int(time.time())})
        try:
            while True:
                text = await self.ws.receive_text()
                try:
                    await self._handle(text)
                except APIError as e:
                    await self._send({"type": "error", "error": e.message, "code": e.code, "param": e.param})
        except WebSocketDisconnect:
            pass
        finally:
            for task in self.windows + ([self.speaker] if self.speaker else []):
                task.cancel()

    async def _send(self, event: dict) -> None:
        await self.ws.send_text(json.dumps(event))

    async def _handle(self, text: str) -> None:
        """One client event.

        Raises:
            APIError: 400 naming the field: not a JSON object, an unknown ``type``, a bad field.
        """
        try:
            event = json.loads(text)
        except ValueError:
            raise _bad("event: not JSON", "event") from None
        if not isinstance(event, dict):
            raise _bad("event: a JSON object expected", "event")
        kind = event.get("type")
        if kind == "session.update":
            await self._update(event)
        elif kind == "input_audio_buffer.append":
            self._append(pcm16(event.get("audio"), "audio"))
        elif kind == "input_audio_buffer.commit":
            await self._commit(bool(event.get("final", False)))
        else:
            raise _bad(f"type: unknown event type {kind!r} (session.update, input_audio_buffer.append, "
                       "input_audio_buffer.commit)", "type")

    async def _update(self, event: dict) -> None:
        """``session.update``: the fields at the top level (vLLM) or under ``session`` (OpenAI).

        Raises:
            APIError: a field this session does not implement, another model, a language the model
                does not know, a temperature outside [0, 1].
        """
        from pagedllm.server.transcriptions import check_realtime_form, language_code
        fields = event.get("session") if isinstance(event.get("session"), dict) else {
            k: v for k, v in event.items() if k not in ("type", "event_id")}
        unknown = sorted(set(fields) - set(_SESSION_FIELDS) - {"type"})
        if unknown:
            raise _bad(f"session.{unknown[0]}: not implemented by this server (it takes {', '.join(_SESSION_FIELDS)})",
                       f"session.{unknown[0]}")
        if fields.get("type", "transcription") != "transcription":  # OpenAI's session kinds: only this one
            raise _bad(f"session.type: {fields['type']!r}: this server holds transcription sessions only",
                       "session.type")
        if "model" in fields:
            self.serving.ctx.check_model(fields["model"])
        w = self.serving.check_model("transcribe")
        if w.realtime:  # Voxtral Realtime: no language, no prompt
            try:
                check_realtime_form(fields.get("language"), fields.get("prompt"), False)
            except APIError as e:
                raise _bad(f"session.{e.message}", f"session.{e.param}") from None
        if fields.get("language") is not None:
            fields["language"] = language_code(str(fields["language"]), w)
        t = fields.get("temperature", 0.0)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1:
            raise _bad(f"session.temperature: a number in [0, 1] expected, got {t!r}", "session.temperature")
        if not isinstance(fields.get("prompt", ""), str):
            raise _bad("session.prompt: a string expected", "session.prompt")
        self.session.update({k: v for k, v in fields.items() if k != "type"})
        await self._send({"type": "session.updated", "session": dict(self.session)})

    def _append(self, samples: np.ndarray) -> None:
        """Add audio to the open utterance and start every window that is complete now.

        Raises:
            APIError: the utterance would pass ``MAX_SESSION_S`` (nothing of this chunk is kept).
        """
        if (self.heard + samples.size) > MAX_SESSION_S * RATE:
            raise _bad(f"audio: an utterance holds at most {MAX_SESSION_S} s of audio; commit it first", "audio")
        if self.serving.check_model("transcribe").realtime:
            return self._stream(samples)
        self.heard += samples.size
        self.audio = np.concatenate([self.audio, samples])
        size = int(CHUNK_S * RATE)
        while self.audio.size > size:  # the cut needs only the audio up to the boundary
            cut = split_audio(self.audio[:size + 1], RATE)[0][1].size
            self._start_window(self.audio[:cut])
            self.audio = self.audio[cut:]

    def _stream(self, samples: np.ndarray) -> None:
        """Voxtral Realtime: the audio goes to the utterance's stream of requests (one task, started by
        the first audio)."""
        if self.driver is None:
            from pagedllm.server.realtime_voxtral import StreamDriver
            self.driver = StreamDriver(self.serving, self.session["temperature"])
            deltas: asyncio.Queue = asyncio.Queue()
            self.order.put_nowait(deltas)
            self.speaker = asyncio.create_task(self._speak())
            self.windows.append(asyncio.create_task(self._drive(deltas)))
        self.driver.append(samples)

    async def _drive(self, deltas: asyncio.Queue) -> tuple[list[int], int]:
        """The stream's requests (``StreamDriver.run``); a refused one ends it with an ``error`` event."""
        try:
            return await self.driver.run(deltas)
        except APIError as e:
            await self._send({"type": "error", "error": e.message, "code": e.code, "param": e.param})
            return list(self.driver.stream.generated), 0

    def _start_window(self, chunk: np.ndarray) -> None:
        deltas: asyncio.Queue = asyncio.Queue()
        self.order.put_nowait(deltas)
        if self.speaker is None:
            self.speaker = asyncio.create_task(self._speak())
        self.windows.append(asyncio.create_task(self._transcribe(chunk, deltas)))

    async def _prompt(self, chunk: np.ndarray) -> str:
        """The utterance's decoder prompt (its language detected on its first window when not set)."""
        if self.prompt is None:
            s, w = self.session, self.serving.whisper
            language = s["language"] or (await self.serving.detect_language(chunk) if w.multilingual else "en")
            prev = await self.serving.ctx.offload(self.serving.previous_text, s["prompt"], w) if s["prompt"] else ""
            self.prompt = prev + self.serving.task_prompt(w, language, "transcribe", False)
        return self.prompt

    async def _transcribe(self, chunk: np.ndarray, deltas: asyncio.Queue) -> tuple[list[int], int]:
        """One window's request: its text deltas into ``deltas`` (then ``None``); returns its ids and
        prompt tokens. An engine error ends the window (its message goes out as an ``error`` event)."""
        ids, n_prompt = [], 0
        try:
            prompt = await self._prompt(chunk)
            with self.serving.ctx.admission.admit(1):
                params = SamplingParams(temperature=self.session["temperature"], max_tokens=None)
                req = await self.serving.ctx.offload(self.serving.window_request, prompt, chunk, params)
                gen = self.serving.llm.generate(req)
                try:
                    async for out in gen:
                        n_prompt = len(out.prompt_token_ids or ()) or n_prompt
                        ids += out.outputs[0].token_ids
                        await deltas.put(out.outputs[0].text)
                finally:  # a closed socket cancels this task: the request is aborted now, not at GC
                    await gen.aclose()
        except APIError as e:
            await self._send({"type": "error", "error": e.message, "code": e.code, "param": e.param})
        finally:
            await deltas.put(None)
        return ids, n_prompt

    async def _speak(self) -> None:
        """Send each window's deltas in window order (the first one's leading space dropped)."""
        started = False
        while (deltas := await self.order.get()) is not None:
            while (delta := await deltas.get()) is not None:
                if not started:
                    delta = delta.lstrip()
                    started = bool(delta)
                if delta:
                    await self._send({"type": "transcription.delta", "delta": delta})

    async def _commit(self, final: bool) -> None:
        """Close the open utterance: its last window, its deltas, then ``transcription.done``. A commit
        with nothing heard is the start signal of vLLM's protocol and does nothing."""
        if self.driver is not None:
            self.driver.close()
        if self.audio.size:
            self._start_window(self.audio)
        if not self.windows:
            return
        self.order.put_nowait(None)
        results = [await t for t in self.windows]
        await self.speaker
        text = "".join(self.serving.text_of(ids) for ids, _ in results).strip()
        n_in, n_out = sum(n for _, n in results), sum(len(ids) for ids, _ in results)
        await self._send({"type": "transcription.done", "text": text,
                          "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}})
        self._reset()

"""OpenAI's ``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations`` for a served Whisper
model: the multipart form (``server.protocol_audio``) -> one engine request per 30 s window of the
decoded audio, run concurrently -> ``json`` / ``text`` / ``verbose_json`` / ``srt`` / ``vtt``, or
OpenAI's ``transcript.text.delta`` / ``transcript.text.done`` server-sent events.

A window's decoder prompt is Whisper's: ``[<|startofprev|> previous text] <|startoftranscript|>
<|lang|> <|transcribe|>|<|translate|> <|notimestamps|>|<|0.00|>`` (an English-only ``.en`` model
takes no language or task token, and does not translate). Timestamps are asked for (``<|0.00|>``, no
``<|notimestamps|>``) when the answer has segments: ``verbose_json``, ``srt``, ``vtt``; as the engine
applies none of Whisper's timestamp rules, a model may close no segment before its window's end. Without ``language`` a multilingual
model's language is detected on the first window: one decoding step over the language tokens only.
Follows OpenAI's API reference for the shapes and vLLM's ``OpenAIServingTranscription`` for the rest
(30 s windows cut at the quietest 100 ms, ``usage`` in seconds of audio); unlike openai/whisper,
windows are not conditioned on the text of the ones before (they run concurrently) and no
temperature fallback is tried.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from fastapi.responses import PlainTextResponse

from pagedllm.media import decode_audio
from pagedllm.multimodal_inputs import MultiModalPrompt
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParamError, SamplingParams
from pagedllm.server.base import HeldStream, OpenAIServingBase, error_event, merge_outputs, sse
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import random_id
from pagedllm.server.protocol_audio import AudioForm
from pagedllm.server.subtitles import format_srt, format_vtt, parse_segments, shift, split_audio, verbose_segments

RATE = 16_000  # Whisper's feature extractor reads 16 kHz mono
_SPECIAL = re.compile(r"<\|[^<>|]{0,40}\|>")  # the shape of Whisper's special tokens' texts


def _rename(param: str, message: str) -> tuple[str, str]:
    """Engine field names -> this endpoint's (``max_tokens`` is ``max_completion_tokens`` here)."""
    if param == "max_tokens":
        return "max_completion_tokens", message.replace("max_tokens", "max_completion_tokens")
    return param, message


@dataclass
class WhisperTokens:
    """The special tokens and limits of a served Whisper model.

    Attributes:
        sot, eot, no_timestamps, prev, timestamp_begin: ids of ``<|startoftranscript|>``,
            ``<|endoftext|>``, ``<|notimestamps|>``, ``<|startofprev|>`` and ``<|0.00|>``.
        multilingual: the model takes language and task tokens (``generation_config.is_multilingual``).
        languages: ISO-639-1 code -> language token id, of the languages the model knows.
        max_positions: decoder positions of one request (``config.max_target_positions``, 448).
        specials: the ``<|...|>`` texts of the tokenizer's added tokens (``<|endoftext|>``, timestamps,
            languages, ...): a ``prompt`` holding one is refused, as the engine would read it as the token.
        realtime: the model is Voxtral Realtime (``multimodal_voxtral_realtime``), not Whisper: its
            prompt is its own (no language, task, previous text or timestamps; ``of_voxtral_realtime``),
            its text the generated tokens less the special ones (streaming pads), a window's length
            bounded by its audio (``max_positions``: the context).
    """

    sot: int
    eot: int
    no_timestamps: int
    prev: int
    timestamp_begin: int
    multilingual: bool
    languages: dict[str, int]
    max_positions: int
    specials: frozenset = frozenset()
    realtime: bool = False

    @classmethod
    def of_model(cls, tokenizer, model_dir: str) -> "WhisperTokens | None":
        """Read the tokens from the tokenizer and the model directory's ``config.json`` /
        ``generation_config.json`` (transformers' Whisper layout); ``None`` for a model that is not
        Whisper (``model_type``)."""
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        def read(name: str) -> dict:
            """The directory's JSON file ``name`` ({} when absent or unreadable)."""
            try:
                return json.loads((Path(model_dir) / name).read_text())
            except (OSError, ValueError):
                return {}
        config, gen = read("config.json"), read("generation_config.json")
        if config.get("model_type") == "voxtral_realtime":
            return cls.of_voxtral_realtime(config)
        if config.get("model_type") != "whisper":
            return None
        vocab = tokenizer.get_vocab()
        multilingual = bool(gen.get("is_multilingual", "lang_to_id" in gen))
        langs = gen.get("lang_to_id") or {f"<|{c}|>": vocab[f"<|{c}|>"] for c in LANGUAGES if f"<|{c}|>" in vocab}
        languages = {tok[2:-2]: int(i) for tok, i in langs.items()} if multilingual else {"en": vocab.get("<|en|>", -1)}
        return cls(sot=vocab["<|startoftranscript|>"], eot=vocab["<|endoftext|>"],
                   no_timestamps=vocab["<|notimestamps|>"], prev=vocab["<|startofprev|>"],
                   timestamp_begin=vocab["<|0.00|>"], multilingual=multilingual, languages=languages,
                   max_positions=int(config.get("max_target_positions", 448)),
                   specials=frozenset(_SPECIAL.findall("".join(tokenizer.get_added_vocab()))))


    @classmethod
    def of_voxtral_realtime(cls, config: dict) -> "WhisperTokens":
        """A Voxtral Realtime model's entry (``realtime``): no special token of Whisper's, English only
        as far as the ``language`` field goes (the field is refused: ``check_realtime_form``)."""
        positions = int((config.get("text_config") or {}).get("max_position_embeddings", 131072))
        return cls(sot=-1, eot=-1, no_timestamps=-1, prev=-1, timestamp_begin=-1, multilingual=False, languages={},
                   max_positions=positions, realtime=True)


def check_realtime_form(language: str | None, prompt: str | None, segments: bool) -> None:
    """Voxtral Realtime takes no ``language`` (it writes what it hears), no ``prompt`` and gives no
    timestamps (``verbose_json``, ``srt``, ``vtt``).

    Raises:
        APIError: 400 naming the field.
    """
    for name, given in (("language", language), ("prompt", prompt)):
        if given:
            raise APIError(400, f"{name}: Voxtral Realtime takes no {name} (its prompt is its own)", name,
                           code="invalid_value")
    if segments:
        raise APIError(400, "response_format: Voxtral Realtime gives no timestamps: json or text only",
                       "response_format", code="invalid_value")


@dataclass
class _Window:
    """One 30 s window: where it starts and its length (seconds), its generated ids and their sampled
    logprobs, its prompt's tokens (the clip's rows and the decoder prompt's) and its decoder prompt's."""

    offset_s: float
    duration_s: float
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_prompt: int = 0
    num_text: int = 0

    def add(self, out: RequestOutput) -> None:
        """Append one delta output of this window's request."""
        c = out.outputs[0]
        self.num_prompt = len(out.prompt_token_ids or ()) or self.num_prompt
        for i, t in enumerate(c.token_ids):
            self.ids.append(int(t))
            if c.logprobs:
                self.logprobs.append(c.logprobs[i][t].logprob)


def language_code(name: str, tokens: WhisperTokens) -> str:
    """A ``language`` field (ISO-639-1 code, or its English name as Whisper's tokenizer knows it) as
    the model's code.

    Raises:
        APIError: 400 naming ``language`` for a language the model does not know (an English-only
            model knows only ``en``).
    """
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE
    code = TO_LANGUAGE_CODE.get(name, name)
    if code not in tokens.languages:
        which = "this English-only model knows only `en`" if not tokens.multilingual else (
            f"this model knows {', '.join(sorted(tokens.languages))}")
        raise APIError(400, f"language: {name!r} is not a language of this model ({which})", "language",
                       code="invalid_value")
    return code


class OpenAIServingTranscription(OpenAIServingBase):
    """Builds, runs and answers transcription and translation requests (``ctx``: a ``ServingContext``).

    The model's Whisper tokens are read once (``WhisperTokens.of_model``); a model that is not Whisper
    answers every request with a 400 naming ``model``.
    """

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.whisper = WhisperTokens.of_model(self.tokenizer, ctx.model_dir)

    async def create(self, form: AudioForm, task: str):
        """Answer one ``/v1/audio/transcriptions`` (``task`` ``transcribe``) or
        ``/v1/audio/translations`` (``translate``) request, its form already read (``read_audio_form``).

        Returns:
            A dict (``json``, ``verbose_json``), a ``PlainTextResponse`` (``text``, ``srt``, ``vtt``)
            or a ``HeldStream`` of SSE lines (``stream``).
        Raises:
            APIError: 400 naming the field (the model, the language, the prompt, the audio), 404 for
                another model, 429 when overloaded. EngineDeadError: answered 503.
        """
        self.ctx.check_model(form.model)
        w = self.check_model(task)
        if w.realtime:
            check_realtime_form(form.language, form.prompt, form.segments)
        language = language_code(form.language, w) if form.language else None
        prev = await self.ctx.offload(self.previous_text, form.prompt, w) if form.prompt else ""
        try:
            wave = await asyncio.to_thread(decode_audio, form.audio, "file", RATE)
        except ValueError as e:
            raise APIError(400, str(e), "file", code="invalid_value") from None
        cuts = split_audio(wave, RATE)
        windows, chunks = [_Window(start / RATE, len(c) / RATE) for start, c in cuts], [c for _, c in cuts]
        admission = self.ctx.admission.admit(len(chunks) + (language is None and w.multilingual))
        try:
            if language is None:  # Voxtral Realtime: "en" stands in, unused (no timestamps, no language token)
                language = await self.detect_language(chunks[0]) if w.multilingual else "en"
            prompt = prev + self.task_prompt(w, language, task, form.segments)
            reqs, n_text = await self.ctx.offload(self._requests, prompt, chunks, form)
            for win in windows:
                win.num_text = n_text
            merged = merge_outputs([self.llm.generate(r) for r in reqs])
            if form.stream:
                return HeldStream(self._stream(merged, windows, form), admission)
            try:
                async for i, out in merged:
                    windows[i].add(out)
            finally:  # a client gone (this task cancelled): its windows' requests are aborted now
                await merged.aclose()
        except BaseException:
            admission.release()
            raise
        admission.release()
        return await self.ctx.offload(self._respond, form, windows, task, language, len(wave) / RATE)

    def check_model(self, task: str) -> WhisperTokens:
        """The model's Whisper tokens, or a 400 naming ``model`` (not Whisper; English-only translating)."""
        w = self.whisper
        if w is None:
            raise APIError(400, f"model: this model (`{self.model_name}`) does not transcribe audio: the audio "
                           "endpoints serve Whisper models", "model", code="model_not_supported")
        if task == "translate" and w.realtime:
            raise APIError(400, f"model: `{self.model_name}` (Voxtral Realtime) transcribes; it does not translate",
                           "model", code="model_not_supported")
        if task == "translate" and not w.multilingual:
            raise APIError(400, f"model: `{self.model_name}` is an English-only Whisper model: it does not "
                           "translate (a multilingual Whisper does)", "model", code="model_not_supported")
        return w

    def previous_text(self, prompt: str, w: WhisperTokens) -> str:
        """``<|startofprev|>`` and the last ``max_positions // 2 - 1`` tokens of ``" " + prompt``
        (openai/whisper's ``initial_prompt``), as prompt text. Runs on the tokenizer thread.

        Raises:
            APIError: 400 naming ``prompt`` when it holds one of Whisper's special tokens.
        """
        self.ctx.check_prompt_chars(prompt, "prompt")
        found = next((m for m in _SPECIAL.findall(prompt) if m in w.specials), None)
        if found is not None:
            raise APIError(400, f"prompt: must not hold Whisper's special token {found}", "prompt",
                           code="invalid_value")
        ids = self.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
        keep = ids[-(w.max_positions // 2 - 1):]
        return "<|startofprev|>" + self.tokenizer.decode(keep)

    def task_prompt(self, w: WhisperTokens, language: str, task: str, timestamps: bool) -> str:
        """``<|startoftranscript|><|lang|><|task|>`` then ``<|notimestamps|>``, or with ``timestamps``
        ``<|0.00|>``: the language and task tokens only for a multilingual model.

        The first timestamp is written into the prompt, as Whisper's timestamp rules force the first
        token to be one (openai/whisper's ``ApplyTimestampRules``; greedy takes ``<|0.00|>``): left
        free, the model may choose ``<|notimestamps|>`` itself, since the engine applies no such rules.
        """
        if w.realtime:  # its prompt is the processor's own
            return ""
        text = "<|startoftranscript|>"
        if w.multilingual:
            text += f"<|{language}|><|{task}|>"
        return text + ("<|0.00|>" if timestamps else "<|notimestamps|>")

    async def detect_language(self, chunk) -> str:
        """The language code of ``chunk`` (``[samples]`` at 16 kHz): the most likely language token after
        ``<|startoftranscript|>`` (openai/whisper's ``detect_language``, greedy over the language tokens
        only; one engine request of one token)."""
        w = self.whisper
        ids = sorted(set(w.languages.values()))
        params = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=ids)
        prompt = self._engine_prompt("<|startoftranscript|>", chunk)
        req = await self.ctx.offload(self._make, random_id("lang"), prompt, params, "file", None, _rename)
        token, gen = None, self.llm.generate(req)
        try:
            async for out in gen:
                token = (list(out.outputs[0].token_ids) or [token])[0]
        finally:
            await gen.aclose()
        by_id = {i: code for code, i in w.languages.items()}
        return by_id.get(token, "en")

    @staticmethod
    def _engine_prompt(text: str, chunk) -> MultiModalPrompt:
        """The decoder prompt ``text`` (Whisper's special tokens written out) with its one clip."""
        return MultiModalPrompt(text, (), False, (), ((chunk, RATE),))

    def _requests(self, prompt: str, chunks: list, form: AudioForm) -> tuple[list, int]:
        """One engine request per window (on the tokenizer thread), all checked before any runs, and
        the decoder prompt's length in tokens.

        Raises:
            APIError: 400 naming the field (a sampling value out of range, ``max_completion_tokens``
                past the decoder positions left after the prompt).
        """
        n_prompt = len(self.tokenizer.encode(prompt, add_special_tokens=False))
        room = self.whisper.max_positions - n_prompt
        sampling = dict(form.sampling)
        asked = sampling.pop("max_tokens", None)
        if asked is not None and asked > room:
            raise APIError(400, f"max_completion_tokens: {asked} tokens do not fit: the prompt leaves {room} of "
                           f"the model's {self.whisper.max_positions} decoder positions", "max_completion_tokens",
                           code="invalid_value")
        try:
            params = SamplingParams(temperature=form.temperature, max_tokens=asked or room,
                                    logprobs=0 if form.segments else None, **sampling)
        except SamplingParamError as e:
            param, message = _rename(e.param, str(e))
            raise APIError(400, message, param, code="invalid_value") from None
        rid = random_id("trsc")
        return [self.window_request(prompt, c, params, f"{rid}-{i}") for i, c in enumerate(chunks)], n_prompt

    def window_request(self, prompt: str, chunk, params: SamplingParams, request_id: str | None = None):
        """One window's engine request (on the tokenizer thread): the decoder prompt text and its clip
        (``[samples]`` at 16 kHz, at most 30 s). ``params.max_tokens`` left ``None`` becomes the decoder
        positions the prompt leaves (``max_positions`` minus its tokens).

        Raises:
            APIError: 400 naming ``file`` (a clip the engine refuses) or the sampling field at fault.
        """
        if params.max_tokens is None:
            n_prompt = len(self.tokenizer.encode(prompt, add_special_tokens=False))
            params.max_tokens = self.whisper.max_positions - n_prompt
        return self._make(request_id or random_id("trsc"), self._engine_prompt(prompt, chunk), params, "file", None,
                          _rename)

    def text_of(self, ids: list[int]) -> str:
        """The text of ids, special and timestamp tokens left out (Whisper's leading space kept)."""
        if self.whisper.realtime:  # Voxtral Realtime: streaming pads and the like are special tokens
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode([t for t in ids if t < self.whisper.eot])

    def _respond(self, form: AudioForm, windows: list[_Window], task: str, language: str, duration: float):
        """The answer in ``form.response_format`` (on the tokenizer thread)."""
        usage = {"type": "duration", "seconds": int(math.ceil(duration))}
        if not form.segments:
            text = "".join(self.text_of(win.ids) for win in windows).strip()
            return PlainTextResponse(text) if form.response_format == "text" else {"text": text, "usage": usage}
        w = self.whisper
        segments = []
        for win in windows:
            found = parse_segments(win.ids, w.timestamp_begin, w.eot, self.tokenizer.decode, win.duration_s,
                                   win.logprobs or None)
            segments += shift(found, win.offset_s)
        if form.response_format == "srt":
            return PlainTextResponse(format_srt(segments))
        if form.response_format == "vtt":
            return PlainTextResponse(format_vtt(segments), media_type="text/vtt")
        from transformers.models.whisper.tokenization_whisper import LANGUAGES
        return {"task": task, "language": LANGUAGES.get(language, language),
                "duration": round(duration, 3), "text": "".join(s.text for s in segments).strip(),
                "segments": verbose_segments(segments, form.temperature), "usage": usage}

    async def _stream(self, merged, windows: list[_Window], form: AudioForm) -> AsyncIterator[str]:
        """``transcript.text.delta`` events in window order (a later window's text waits for the ones
        before it), then ``transcript.text.done`` with the whole text (and token usage with
        ``stream_include_usage``), then ``data: [DONE]``."""
        texts: list[list[str]] = [[] for _ in windows]
        done = [False] * len(windows)
        sent, current, started = [], 0, False
        try:
            async for i, out in merged:
                windows[i].add(out)
                texts[i].append(out.outputs[0].text)
                done[i] = out.finished or done[i]
                while current < len(windows):
                    delta = "".join(texts[current])
                    texts[current] = []
                    if not started:
                        delta = delta.lstrip()
                        started = bool(delta)
                    if delta:
                        sent.append(delta)
                        yield sse({"type": "transcript.text.delta", "delta": delta})
                    if not done[current]:
                        break
                    current += 1
            final: dict = {"type": "transcript.text.done", "text": "".join(sent).strip()}
            if form.include_usage:
                n_in, n_text = sum(w.num_prompt for w in windows), sum(w.num_text for w in windows)
                n_out = sum(len(w.ids) for w in windows)
                final["usage"] = {"type": "tokens", "input_tokens": n_in, "output_tokens": n_out,
                                  "total_tokens": n_in + n_out,
                                  "input_token_details": {"audio_tokens": n_in - n_text, "text_tokens": n_text}}
            yield sse(final)
        except Exception as e:
            yield error_event(e)
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"

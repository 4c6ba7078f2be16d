"""Pure helpers of the audio endpoints (``server.transcriptions``): Whisper's timestamp tokens read into
segments, the segments written as SubRip (``srt``), WebVTT (``vtt``) and OpenAI's ``verbose_json``
segment objects, and long audio cut into Whisper's 30 s windows.

Sources followed: openai/whisper's ``transcribe.py`` (how ``<|t|>`` token pairs close and open
segments, the ``compression_ratio`` of a segment's text, ``seek`` in mel frames of 10 ms) and its
``utils.py`` writers (the SRT and VTT layouts); vLLM's ``OpenAISpeechToText`` (cutting long audio at
the quietest 100 ms near each 30 s boundary). No function here touches the engine or the network.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

TIME_PRECISION_S = 0.02  # seconds per timestamp token step (<|0.00|>, <|0.02|>, ...)
CHUNK_S = 30.0           # Whisper's window: the encoder sees 30 s of audio
SPLIT_SEARCH_S = 1.0     # a cut is looked for in the last second before each 30 s boundary (vLLM's overlap)
SPLIT_WINDOW_S = 0.1     # the quietest window of 100 ms there is where the cut goes (vLLM's 1600 samples)
MEL_FRAMES_PER_S = 100   # Whisper's ``seek`` unit: mel frames of 10 ms


@dataclass
class Segment:
    """One timed stretch of a transcript.

    Attributes:
        start, end: seconds from the start of the whole file.
        tokens: the segment's text token ids (no timestamp or other special tokens).
        text: the tokens' text (leading space kept, as Whisper decodes it).
        seek: the mel frame (10 ms) where the 30 s window holding it starts (Whisper's ``seek``).
        logprobs: the sampled tokens' log-probabilities, one per entry of ``tokens`` (may be empty).
    """

    start: float
    end: float
    tokens: list[int]
    text: str
    seek: int = 0
    logprobs: list[float] = field(default_factory=list)


def parse_segments(ids: Sequence[int], timestamp_begin: int, eot: int, decode: Callable[[list[int]], str],
                   duration: float, logprobs: Sequence[float] | None = None) -> list[Segment]:
    """Read Whisper's output token ids into timed segments (openai/whisper ``transcribe.py``'s rule).

    ``<|0.00|> Hello<|1.20|><|1.20|> world<|2.40|>`` gives ``[0.00, 1.20] " Hello"`` and
    ``[1.20, 2.40] " world"``: a timestamp after text closes the open segment and opens the next at
    its time, which a timestamp right after it (Whisper's pairs) sets again. Text before any timestamp
    starts at 0; text left open at the end (no closing timestamp: cut by
    ``max_tokens``) ends at ``duration``. Times go no further than ``duration``, and an end before its
    start is raised to the start, so that a model that breaks Whisper's timestamp rules still gives
    ordered segments.

    Args:
        ids: the generated ids (the prompt excluded).
        timestamp_begin: the id of ``<|0.00|>``; every id from it up is a timestamp, 0.02 s apart.
        eot: ``<|endoftext|>``'s id; ids from it to ``timestamp_begin`` (special tokens) are skipped.
        decode: token ids -> text.
        duration: seconds of audio in the window the ids were generated for.
        logprobs: the sampled ids' log-probabilities, parallel to ``ids`` (optional).
    Returns:
        The segments, with times relative to the window (``shift`` them for a later window).
    """
    segments: list[Segment] = []
    start: float | None = None
    toks: list[int] = []
    lps: list[float] = []

    def close(end: float) -> None:
        """End the open segment at ``end`` seconds (kept inside the window and after its start)."""
        s = min(start or 0.0, duration)
        segments.append(Segment(s, max(s, min(end, duration)), list(toks), decode(list(toks)), logprobs=list(lps)))
        toks.clear()
        lps.clear()

    for i, t in enumerate(ids):
        if t >= timestamp_begin:
            now = (t - timestamp_begin) * TIME_PRECISION_S
            if toks:
                close(now)
            start = now
        elif t < eot:
            toks.append(int(t))
            if logprobs is not None:
                lps.append(float(logprobs[i]))
    if toks:
        close(duration)
    return segments


def shift(segments: Sequence[Segment], offset_s: float) -> list[Segment]:
    """The segments moved ``offset_s`` seconds later, with ``seek`` set to the window's start frame."""
    seek = int(round(offset_s * MEL_FRAMES_PER_S))
    return [replace(s, start=s.start + offset_s, end=s.end + offset_s, seek=seek) for s in segments]


def compression_ratio(text: str) -> float:
    """UTF-8 length of ``text`` over its zlib-compressed length (openai/whisper's repetition measure;
    above 2.4 Whisper takes the text for a repetition loop). 0.0 for an empty text."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def verbose_segments(segments: Sequence[Segment], temperature: float) -> list[dict]:
    """OpenAI's ``verbose_json`` segment objects (``TranscriptionSegment``: id, seek, start, end, text,
    tokens, temperature, avg_logprob, compression_ratio, no_speech_prob).

    ``avg_logprob`` is the mean log-probability of the segment's sampled tokens (0.0 without them);
    ``no_speech_prob`` is 0.0: the probability of ``<|nospeech|>`` at the first position is not
    computed by this server. Times are rounded to 10 ms.
    """
    out = []
    for i, s in enumerate(segments):
        out.append({"id": i, "seek": s.seek, "start": round(s.start, 2), "end": round(s.end, 2),
                    "text": s.text, "tokens": list(s.tokens), "temperature": float(temperature),
                    "avg_logprob": float(np.mean(s.logprobs)) if s.logprobs else 0.0,
                    "compression_ratio": compression_ratio(s.text), "no_speech_prob": 0.0})
    return out


def clock(seconds: float, decimal: str) -> str:
    """``HH:MM:SS<decimal>mmm`` of ``seconds`` (``,`` for SRT, ``.`` for WebVTT), rounded to 1 ms."""
    ms = int(round(max(seconds, 0.0) * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def format_srt(segments: Sequence[Segment]) -> str:
    """The segments as a SubRip file: numbered cues from 1, ``00:00:01,200 --> 00:00:02,400``, the
    text stripped, a blank line after each cue (openai/whisper's ``WriteSRT``)."""
    return "".join(f"{i}\n{clock(s.start, ',')} --> {clock(s.end, ',')}\n{s.text.strip()}\n\n"
                   for i, s in enumerate(segments, start=1))


def format_vtt(segments: Sequence[Segment]) -> str:
    """The segments as a WebVTT file: ``WEBVTT``, a blank line, then ``00:00:01.200 --> 00:00:02.400``
    cues with the text stripped, each followed by a blank line (openai/whisper's ``WriteVTT``, hours
    always written)."""
    return "WEBVTT\n\n" + "".join(f"{clock(s.start, '.')} --> {clock(s.end, '.')}\n{s.text.strip()}\n\n"
                                  for s in segments)


def split_audio(wave: np.ndarray, rate: int, chunk_s: float = CHUNK_S, search_s: float = SPLIT_SEARCH_S,
                window_s: float = SPLIT_WINDOW_S) -> list[tuple[int, np.ndarray]]:
    """Cut mono audio into windows of at most ``chunk_s`` seconds, as vLLM's speech-to-text server does.

    Each cut goes in the quietest ``window_s`` stretch (lowest mean square) of the last ``search_s``
    seconds before the ``chunk_s`` boundary, at that stretch's middle, so that a word is less likely
    to be split; audio of ``chunk_s`` or less is one window.

    Args:
        wave: ``[samples]`` float32 audio.
        rate: samples per second.
    Returns:
        ``(first sample, samples)`` of each window, in order, covering ``wave`` without overlap.
    """
    size, search, win = int(chunk_s * rate), int(search_s * rate), max(int(window_s * rate), 1)
    out, start, n = [], 0, len(wave)
    while n - start > size:
        lo = start + size - search
        region = np.asarray(wave[lo:start + size], dtype=np.float64)
        if len(region) >= win:
            energy = np.convolve(region * region, np.ones(win), mode="valid")  # sum over each window
            cut = lo + int(np.argmin(energy)) + win // 2
        else:
            cut = start + size
        out.append((start, wave[start:cut]))
        start = cut
    out.append((start, wave[start:]))
    return out

"""The multipart form of OpenAI's ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``,
read and checked field by field (``read_audio_form``).

Fields (OpenAI API reference, "Create transcription" / "Create translation"; vLLM's
``TranscriptionRequest`` for the extras): ``file`` (required), ``model``, ``language``, ``prompt``,
``response_format`` (``json`` | ``text`` | ``srt`` | ``verbose_json`` | ``vtt``), ``temperature``
(0 to 1), ``timestamp_granularities[]`` (``segment`` only), ``stream``, and vLLM's
``stream_include_usage``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``frequency_penalty``,
``presence_penalty``, ``repetition_penalty`` and ``max_completion_tokens``. The openai SDK sends list
fields with a ``[]`` suffix; both spellings are read.

Nothing is ignored: an OpenAI field this server does not implement (``chunking_strategy``,
``include[]``, speaker and keyword hints, ``word`` timestamps) and any unknown field is a 400 naming
it, as is a value of the wrong type or out of range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedllm.server.errors import APIError

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
STREAMABLE_FORMATS = ("json", "text")
# OpenAI's fields of these endpoints that this server does not implement: a 400 naming the field
NOT_IMPLEMENTED = {
    "chunking_strategy": "server-side voice-activity chunking is not implemented; long audio is cut "
                         "into 30 s windows at the quietest 100 ms near each boundary",
    "include": "token logprobs in the transcription response are not implemented",
    "keywords": "keyword hints are not implemented; use `prompt`",
    "languages": "multi-language hints are not implemented; use `language`",
    "known_speaker_names": "speaker diarization is not implemented",
    "known_speaker_references": "speaker diarization is not implemented",
    "stream_continuous_usage_stats": "per-event usage is not implemented; use `stream_include_usage`",
    "vllm_xargs": "extra model arguments are not implemented",
    "to_language": "Whisper translates into English only; leave `to_language` out",
}
# vLLM's extra sampling fields: (type, SamplingParams name)
_SAMPLING = {"top_p": (float, "top_p"), "top_k": (int, "top_k"), "min_p": (float, "min_p"), "seed": (int, "seed"),
             "frequency_penalty": (float, "frequency_penalty"), "presence_penalty": (float, "presence_penalty"),
             "repetition_penalty": (float, "repetition_penalty"), "max_completion_tokens": (int, "max_tokens")}
_SCALARS = ("model", "language", "prompt", "response_format", "temperature", "stream", "stream_include_usage")
_LISTS = ("timestamp_granularities",)
_MAX_FIELDS = 64


@dataclass
class AudioForm:
    """One checked audio request.

    Attributes:
        audio: the uploaded file's bytes (not decoded yet).
        model: the ``model`` field (``None`` when left out).
        language: ISO-639-1 code or English name, lower-cased (``None``: detect it).
        prompt: previous text to condition on (``None``: none).
        response_format: one of ``RESPONSE_FORMATS``.
        temperature: the sampling temperature, 0 to 1 (OpenAI's default 0).
        segments: timestamps were asked for (``timestamp_granularities[]=segment``).
        stream: answer with server-sent events.
        include_usage: vLLM's ``stream_include_usage``: a usage event before ``[DONE]``.
        sampling: vLLM's extra fields as ``SamplingParams`` keyword arguments.
    """

    audio: bytes
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    segments: bool = False
    stream: bool = False
    include_usage: bool = False
    sampling: dict = field(default_factory=dict)


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param, code=code)


def _number(name: str, text: str, kind: type):
    """``text`` as an int or a finite float, or a 400 naming ``name``."""
    try:
        value = kind(text.strip())
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise _bad(name, f"expected {what}, got {text!r}", "invalid_type") from None
    if kind is float and not math.isfinite(value):
        raise _bad(name, f"expected a finite number, got {text!r}")
    return value


def _bool(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low not in ("true", "false", "1", "0"):
        raise _bad(name, f"expected true or false, got {text!r}", "invalid_type")
    return low in ("true", "1")


def _fields(form) -> dict[str, list]:
    """The form's values by field name (``name[]`` read as ``name``); unknown and unimplemented
    fields refused."""
    out: dict[str, list] = {}
    for key, value in form.multi_items():
        name = key[:-2] if key.endswith("[]") else key
        if name in NOT_IMPLEMENTED:
            raise _bad(name, NOT_IMPLEMENTED[name], "unsupported_parameter")
        if name != "file" and name not in _SCALARS and name not in _LISTS and name not in _SAMPLING:
            raise _bad(name, "unknown field of this endpoint", "unknown_parameter")
        out.setdefault(name, []).append(value)
    for name, values in out.items():
        if name not in _LISTS and len(values) > 1:
            raise _bad(name, "given more than once")
        if name != "file" and any(not isinstance(v, str) for v in values):
            raise _bad(name, "expected a text value, got a file", "invalid_type")
    return out


async def _file_bytes(values: list | None, max_bytes: int) -> bytes:
    """The uploaded file's bytes, at most ``max_bytes``; a 400 naming ``file`` otherwise."""
    if not values:
        raise _bad("file", "Missing required parameter: the audio file to transcribe", "missing_required_parameter")
    upload = values[0]
    if isinstance(upload, str):
        raise _bad("file", "expected a file upload (multipart/form-data), got a text field", "invalid_type")
    raw = await upload.read(max_bytes + 1)
    await upload.close()
    if len(raw) > max_bytes:
        raise _bad("file", f"the file is larger than {max_bytes} bytes")
    if not raw:
        raise _bad("file", "the file is empty")
    return raw


def _format_fields(form: AudioForm, granularities: list[str]) -> None:
    """Check ``response_format``, ``timestamp_granularities[]`` and ``stream`` together."""
    if form.response_format not in RESPONSE_FORMATS:
        raise _bad("response_format", f"must be one of {', '.join(RESPONSE_FORMATS)}; got {form.response_format!r}")
    for g in granularities:
        if g == "word":
            raise _bad("timestamp_granularities", "`word` timestamps are not available from this server "
                       "(Whisper's cross-attention alignment is not implemented); use `segment`",
                       "unsupported_value")
        if g != "segment":
            raise _bad("timestamp_granularities", f"must be `segment` (or `word`); got {g!r}")
    if granularities and form.response_format != "verbose_json":
        raise _bad("timestamp_granularities", "needs response_format `verbose_json`")
    form.segments = bool(granularities) or form.response_format in ("verbose_json", "srt", "vtt")
    if form.stream and form.response_format not in STREAMABLE_FORMATS:
        raise _bad("stream", f"streaming answers text deltas: response_format must be json or text, "
                   f"not {form.response_format}")
    if form.include_usage and not form.stream:
        raise _bad("stream_include_usage", "needs `stream` true")


async def read_audio_form(request, max_bytes: int) -> AudioForm:
    """Read and check the multipart form of an audio request.

    Args:
        request: the Starlette request (``multipart/form-data``).
        max_bytes: the most bytes the uploaded file may have.
    Returns:
        The checked ``AudioForm``; the language and the model are checked later, against the model.
    Raises:
        APIError: 400 naming the field (missing file, a field not implemented or unknown, a bad value).
        starlette.exceptions.HTTPException: 400 for a body that is no readable multipart form.
    """
    fields = _fields(await request.form(max_files=1, max_fields=_MAX_FIELDS))
    one = {name: values[0] for name, values in fields.items() if name not in _LISTS}
    form = AudioForm(audio=await _file_bytes(fields.get("file"), max_bytes))
    form.model = one.get("model")
    if one.get("language", "").strip():
        form.language = one["language"].strip().lower()
    form.prompt = one.get("prompt") or None
    form.response_format = one.get("response_format", "json").strip() or "json"
    if "temperature" in one:
        form.temperature = _number("temperature", one["temperature"], float)
        if not 0.0 <= form.temperature <= 1.0:
            raise _bad("temperature", f"must be between 0 and 1, got {form.temperature}")
    form.stream = _bool("stream", one["stream"]) if "stream" in one else False
    if "stream_include_usage" in one:
        form.include_usage = _bool("stream_include_usage", one["stream_include_usage"])
    for name, (kind, param) in _SAMPLING.items():
        if name in one:
            form.sampling[param] = _number(name, one[name], kind)
    _format_fields(form, [g.strip() for g in fields.get("timestamp_granularities", [])])
    return form

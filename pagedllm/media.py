"""Where images and videos come from in API requests: ``data:`` URLs, and as the server's flags allow
``file://`` paths and http(s) hosts (vLLM's ``--allowed-local-media-path`` and
``--allowed-media-domains``), each read with a size cap; images decoded by Pillow under a pixel cap
(a decompression bomb is refused, not decoded), videos by PyAV, sampled as they decode
(``--media-io-kwargs``) under a cap on frames and pixels.

Every refusal is a ``ValueError`` naming the request field, which the servers answer as a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MAX_IMAGE_PIXELS = 64 * 2**20  # an image of more pixels is refused (a decompression bomb)
MAX_IMAGE_BYTES = 32 * 2**20  # a data URL's decoded bytes at most
MAX_VIDEO_BYTES = 256 * 2**20  # a video file's bytes at most
MAX_VIDEO_FRAMES = 768  # frames sampled from one video at most (Qwen-VL's video processor's max_frames)
MAX_VIDEO_PIXELS = 512 * 2**20  # pixels of one video's sampled frames at most (1.5 GiB of RGB)


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from besides ``data:`` URLs (vLLM's flags).

    Attributes:
        local_path: ``--allowed-local-media-path``: ``file://`` URLs under this directory are read.
        domains: ``--allowed-media-domains``: http(s) URLs of these hosts are fetched (none without
            the flag: unlike vLLM, which fetches any host unless the flag restricts it).
        timeout_s: seconds a fetch may take.
        video: ``--media-io-kwargs``' ``video`` entry: frames sampled from a video URL, ``num_frames``
            (evenly spread) or ``fps`` (per second of video; default ``multimodal_video.DEFAULT_FPS``).
    """

    local_path: Path | None = None
    domains: tuple[str, ...] = ()
    timeout_s: float = 10.0
    video: dict | None = None


def _url_bytes(url: str, where: str, policy: MediaPolicy | None, cap: int = MAX_IMAGE_BYTES,
               kind: str = "image") -> bytes:
    """The bytes a ``data:``, ``file://`` or http(s) URL names, at most ``cap`` (``image_from_url``'s
    and ``video_from_url``'s first half; ``kind`` names the medium in errors)."""
    import base64
    import binascii
    from urllib.parse import unquote
    if not isinstance(url, str):
        raise ValueError(f"{where}: expected a URL string")
    if url.startswith("data:"):
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise ValueError(f"{where}: a data URL of an {kind} must be base64 (data:{kind}/...;base64,...)")
        if len(payload) > cap * 4 // 3 + 4:
            raise ValueError(f"{where}: the {kind} is larger than {cap // 2**20} MiB")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: the {kind}'s base64 data is not valid base64") from None
    policy = policy or MediaPolicy()
    u = check_url(url, where, policy)
    if u.scheme == "file":
        path = Path(unquote(u.path)).resolve()
        if path.stat().st_size > cap:
            raise ValueError(f"{where}: the {kind} is larger than {cap // 2**20} MiB")
        return path.read_bytes()
    return _fetch(url, where, policy.timeout_s, cap, kind)


def check_url(url: str, where: str, policy: MediaPolicy | None):
    """A ``file://`` or http(s) URL's parts when ``policy`` lets it be read (nothing is read).

    Raises:
        ValueError: another scheme, a file not under ``--allowed-local-media-path``, a host not in
            ``--allowed-media-domains`` (``where`` named).
    """
    from urllib.parse import unquote, urlparse
    policy = policy or MediaPolicy()
    u = urlparse(url)
    if u.scheme == "file":
        if policy.local_path is None:
            raise ValueError(f"{where}: file URLs are read only under --allowed-local-media-path (not set)")
        path = Path(unquote(u.path)).resolve()
        if not path.is_relative_to(Path(policy.local_path).resolve()) or not path.is_file():
            raise ValueError(f"{where}: not a file under --allowed-local-media-path")
        return u
    if u.scheme in ("http", "https"):
        if u.hostname not in policy.domains:
            raise ValueError(f"{where}: host {u.hostname!r} is not in --allowed-media-domains")
        return u
    raise ValueError(f"{where}: {u.scheme or 'no'} URLs are not read (data:, file:// and http(s) are)")


def _fetch(url: str, where: str, timeout_s: float, cap: int, kind: str) -> bytes:
    """GET ``url`` (no redirects: they could leave the allowed hosts), at most ``cap`` bytes."""
    import httpx
    out = bytearray()
    try:
        with httpx.stream("GET", url, timeout=timeout_s, follow_redirects=False) as r:
            if r.status_code != 200:
                raise ValueError(f"{where}: fetching the {kind} answered HTTP {r.status_code}")
            for chunk in r.iter_bytes():
                out += chunk
                if len(out) > cap:
                    raise ValueError(f"{where}: the {kind} is larger than {cap // 2**20} MiB")
    except httpx.HTTPError as exc:
        raise ValueError(f"{where}: fetching the {kind} failed ({type(exc).__name__})") from None
    return bytes(out)


def image_from_url(url: str, where: str, policy: MediaPolicy | None = None):
    """The image a URL names, decoded and loaded (RGB): a ``data:image/...;base64,...`` URL, or as
    ``policy`` allows a ``file://`` path or an http(s) URL.

    Raises:
        ValueError: a URL the policy does not allow, undecodable base64, bytes that are no image
            Pillow reads, more than ``MAX_IMAGE_BYTES`` or ``MAX_IMAGE_PIXELS``, a failed fetch
            (``where`` named in each message).
    """
    import io
    import warnings

    from PIL import Image
    raw = _url_bytes(url, where, policy)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            if image.size[0] * image.size[1] > MAX_IMAGE_PIXELS:
                raise ValueError(f"{where}: the image has {image.size[0]} x {image.size[1]} pixels, more than "
                                 f"{MAX_IMAGE_PIXELS} allowed")
            return image.convert("RGB")
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise ValueError(f"{where}: the image has more pixels than the {MAX_IMAGE_PIXELS} allowed (a decompression "
                         f"bomb is refused before it is decoded)") from None
    except (OSError, SyntaxError):
        raise ValueError(f"{where}: not an image this server can read") from None


def video_from_url(url: str, where: str, policy: MediaPolicy | None = None):
    """The video a URL names, decoded by PyAV and sampled as it decodes: ``(frames [F, H, W, 3] uint8,
    frames per second of the sampled frames)`` (``MultiModalPrompt.videos``).

    Frames are taken evenly over the video's time: ``policy.video``'s ``num_frames`` of them (when
    the container knows its duration) or ``fps`` per second (default ``multimodal_video.DEFAULT_FPS``),
    at most ``MAX_VIDEO_FRAMES`` and ``MAX_VIDEO_PIXELS`` pixels in all.

    Raises:
        ValueError: as ``image_from_url`` (``MAX_VIDEO_BYTES``), bytes PyAV cannot decode as a video,
            no frame, or more than ``MAX_VIDEO_PIXELS`` sampled (``where`` named in each message).
    """
    import io

    import av
    import numpy as np

    from pagedllm.multimodal_video import DEFAULT_FPS
    raw = _url_bytes(url, where, policy, MAX_VIDEO_BYTES, "video")
    opts = (policy.video if policy else None) or {}
    try:
        with av.open(io.BytesIO(raw)) as container:
            stream = container.streams.video[0]
            seconds = (float(stream.duration * stream.time_base) if stream.duration
                       else container.duration / 1e6 if container.duration else None)
            step = (seconds / int(opts["num_frames"]) if opts.get("num_frames") and seconds
                    else 1.0 / float(opts.get("fps") or DEFAULT_FPS))
            frames, due = [], 0.0
            for i, f in enumerate(container.decode(video=0)):
                t = f.time if f.time is not None else i / float(stream.average_rate or DEFAULT_FPS)
                if t + 1e-6 < due:
                    continue
                frames.append(f.to_ndarray(format="rgb24"))
                due += step * max(1, int((t + 1e-6 - due) // step) + 1)
                if len(frames) * frames[0].shape[0] * frames[0].shape[1] > MAX_VIDEO_PIXELS:
                    raise _TooLarge
                if len(frames) == MAX_VIDEO_FRAMES:
                    break
    except _TooLarge:
        raise ValueError(f"{where}: the sampled frames have more than {MAX_VIDEO_PIXELS} pixels in all (fewer "
                         "frames: --media-io-kwargs '{\"video\": {\"num_frames\": N}}')") from None
    except (av.error.FFmpegError, IndexError, ValueError):
        raise ValueError(f"{where}: not a video this server can read") from None
    if not frames:
        raise ValueError(f"{where}: the video has no frames")
    return np.stack(frames), 1.0 / step


class _TooLarge(Exception):
    """``video_from_url``'s frames passed ``MAX_VIDEO_PIXELS``."""


MAX_AUDIO_BYTES = 64 * 2**20  # an audio file's bytes at most
MAX_AUDIO_SECONDS = 30 * 60  # seconds of decoded audio at most


def _resampled(frames, rate: int, resampler) -> list:
    """``[channels, n]`` float32 blocks of PyAV audio ``frames`` (``None`` flushes) at ``rate``."""
    return [o.to_ndarray() for o in resampler.resample(frames)]


def decode_audio(raw: bytes, where: str, rate: int):
    """Audio file bytes (wav, mp3, flac, ogg: what PyAV's FFmpeg reads) as ``[samples]`` float32 mono at
    ``rate`` Hz: channels averaged (as ``transformers``' ``load_audio`` does), resampled by FFmpeg.

    Raises:
        ValueError: bytes PyAV cannot decode as audio, no samples, more than ``MAX_AUDIO_SECONDS``.
    """
    import io

    import av
    import numpy as np
    blocks, total = [], 0
    try:
        with av.open(io.BytesIO(raw)) as container:
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="fltp", layout=stream.layout.name, rate=rate)
            for frame in container.decode(audio=0):
                blocks += _resampled(frame, rate, resampler)
                total += frame.samples * rate / (frame.sample_rate or rate)
                if total > MAX_AUDIO_SECONDS * rate:
                    raise _TooLarge
            blocks += _resampled(None, rate, resampler)
    except _TooLarge:
        raise ValueError(f"{where}: the audio is longer than {MAX_AUDIO_SECONDS} s") from None
    except (av.error.FFmpegError, IndexError, ValueError):
        raise ValueError(f"{where}: not audio this server can read") from None
    if not blocks or not sum(b.shape[1] for b in blocks):
        raise ValueError(f"{where}: the audio has no samples")
    return np.ascontiguousarray(np.concatenate(blocks, axis=1).mean(axis=0), dtype=np.float32)


def resample_audio(wave, rate_in: int, rate_out: int):
    """``[samples]`` float32 mono audio at ``rate_in`` Hz resampled to ``rate_out`` by FFmpeg (PyAV)."""
    import av
    import numpy as np
    wave = np.ascontiguousarray(wave, dtype=np.float32)
    if rate_in == rate_out:
        return wave
    frame = av.AudioFrame.from_ndarray(wave[None], format="flt", layout="mono")
    frame.sample_rate = rate_in
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate_out)
    return np.concatenate(_resampled(frame, rate_out, resampler) + _resampled(None, rate_out, resampler), axis=1)[0]


def audio_from_url(url: str, where: str, policy: MediaPolicy | None, rate: int):
    """The audio a URL names (``data:audio/...;base64,``, or ``file://`` / http(s) as ``policy``
    allows), decoded as ``decode_audio`` does at ``rate`` Hz.

    Raises:
        ValueError: as ``_url_bytes`` (``MAX_AUDIO_BYTES``) and ``decode_audio``.
    """
    return decode_audio(_url_bytes(url, where, policy, MAX_AUDIO_BYTES, "audio"), where, rate)


def audio_from_base64(data: str, where: str, rate: int):
    """OpenAI's ``input_audio.data`` (base64 of a wav / mp3 / flac file) decoded at ``rate`` Hz.

    Raises:
        ValueError: not base64, more than ``MAX_AUDIO_BYTES``, or as ``decode_audio``.
    """
    if not isinstance(data, str):
        raise ValueError(f"{where}: expected base64 text")
    return audio_from_url("data:audio/*;base64," + data, where, None, rate)

"""Audio in prompts (issue 42, second part): a clip's samples, their content hash, and how an
audio-text model takes clips (Qwen2-Audio and Voxtral through the Transformers backend).

A clip reaches the model as its processor makes it: Whisper's log-mel features (``input_features``
``[mel bins, frames]``, padded to 30 s) and the number of feature frames that are audio; the
placeholder (Qwen2-Audio's ``<|AUDIO|>``) is repeated once per encoder output row (Voxtral: features in
30 s chunks, its own expansion: ``multimodal_voxtral``). Clips are mono
float32 at the feature extractor's sampling rate (16 kHz): offline ones are resampled to it, files
decoded and resampled by PyAV (``media.decode_audio``).

Source: vLLM's offline audio shape (``multi_modal_data={"audio": (samples, sampling_rate)}``) and
OpenAI's ``input_audio`` content part, as documented; the processors are ``transformers``'.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

# model types whose audio is served: (what a prompt writes where a clip goes, the repeated token)
AUDIO_PLACEHOLDERS = {"qwen2_audio": ("<|audio_bos|><|AUDIO|><|audio_eos|>", "<|AUDIO|>"),
                      "voxtral": ("[AUDIO]", "[AUDIO]"),  # ours, not mistral_common's (multimodal_voxtral)
                      "voxtral_realtime": ("", "")}  # no placeholder: its rows add to every step's embedding


@dataclass(frozen=True)
class AudioOptions:
    """How an audio-text model takes clips.

    Attributes:
        token_id: the placeholder token a clip's rows go over (``config.audio_token_id``).
        limit: most clips in one prompt (``--limit-mm-per-prompt``'s ``audio``).
        placeholder: what a prompt writes where a clip goes (Qwen2-Audio's
            ``<|audio_bos|><|AUDIO|><|audio_eos|>``).
    """

    token_id: int
    limit: int
    placeholder: str


def read_clip(clip, rate: int, where: str) -> np.ndarray:
    """``[samples]`` float32 mono at ``rate`` Hz of a ``multi_modal_data`` clip.

    Args:
        clip: vLLM's ``(samples, sampling_rate)`` pair (samples ``[n]`` or ``[n, channels]``, any
            float or int dtype), or samples alone, taken to be at ``rate``.
        rate: the model's sampling rate, Hz.
        where: the field's name, for errors.
    Raises:
        ValueError: not 1-D or 2-D numbers, empty, or a sampling rate that is not a positive int.
    """
    from pagedllm.media import resample_audio
    samples, given = clip if isinstance(clip, tuple) and len(clip) == 2 else (clip, rate)
    if hasattr(samples, "numpy"):
        samples = samples.numpy()
    x = np.asarray(samples)
    if x.dtype.kind not in "fiu" or x.ndim not in (1, 2) or not x.size:
        raise ValueError(f"{where}: expected samples [n] or [n, channels] and their sampling rate")
    if not isinstance(given, (int, np.integer)) or isinstance(given, bool) or given <= 0:
        raise ValueError(f"{where}: the sampling rate must be a positive int, got {given!r}")
    x = x.astype(np.float32) / (np.iinfo(x.dtype).max if x.dtype.kind in "iu" else 1)
    return resample_audio(x.mean(axis=1) if x.ndim == 2 else x, int(given), rate)


def clip_hash(wave: np.ndarray) -> str:
    """Hex SHA-256 of a clip's samples (the encoder cache's key)."""
    h = hashlib.sha256(f"audio:{wave.shape[0]}:".encode())
    h.update(np.ascontiguousarray(wave, dtype=np.float32).tobytes())
    return h.hexdigest()

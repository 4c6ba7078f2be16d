"""Voxtral Realtime's prompts (issue 42, realtime embeddings): the streaming transcription prompt and
the clip whose audio embedding is added into every step, ours in place of ``transformers``'
``VoxtralRealtimeProcessor`` (which needs the ``mistral_common`` tokenizer).

Voxtral Realtime writes one text token per audio frame (80 ms: ``audio_length_per_tok`` mel frames of
``hop_length`` samples). Position ``p`` of the sequence, prompt or generated, takes the token's
embedding plus the audio encoder's row ``p`` (a causal encoder: row ``p`` hears the audio up to frame
``p``), and the model answers the frame ``num_delay_tokens`` behind. The prompt is the BOS token and
``[STREAMING_PAD]`` once per left-pad token and per delay token; the clip is padded with silence on
the left (the left-pad tokens) and on the right (to a whole frame, then the delay, the BOS and a
buffer of 10 frames for the last word), so generation ends when the audio does: ``max_tokens`` is
at most the frames less the prompt.

The clip is one ``MultiModalInput`` with ``additive`` set: offset 0, one row per frame, its rows added
to the token embeddings of every position it covers (``worker.multimodal_step``), encoded once by the
encoder step and held by the encoder cache until the request ends.

Source: ``mistral_common``'s ``AudioEncoder`` streaming padding and ``encode_streaming_tokens`` (its
documented rule: left pad, delay, BOS, ``OFFLINE_STREAMING_BUFFER_TOKENS``) and ``transformers``'
``VoxtralRealtimeProcessor`` / ``VoxtralRealtimeModel.forward`` (audio rows added to the embeddings).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

STREAMING_PAD = "[STREAMING_PAD]"
BUFFER_TOKENS = 10  # frames after the delay for the last word (mistral_common's offline buffer)
LEFT_PAD_TOKENS = 32  # silence frames before the audio when the model's tekken.json does not say


def is_voxtral_realtime(config) -> bool:
    """Whether ``config`` is Voxtral Realtime's (its decode steps take the audio's embedding)."""
    return getattr(config, "model_type", None) == "voxtral_realtime"


class VoxtralRealtimeAudioProcessor:
    """Voxtral Realtime's prompt and clip, in the call shape of a ``transformers`` processor
    (``multimodal.MultiModalProcessor._process``).

    Args:
        model_dir: the model directory: ``config.json``, a tokenizer with ``[STREAMING_PAD]``, a
            ``preprocessor_config.json`` of a ``VoxtralRealtimeFeatureExtractor`` (its defaults when
            absent) and, when present, ``tekken.json``, whose ``audio`` section gives
            ``streaming_n_left_pad_tokens``.
    Raises:
        ValueError: no ``[STREAMING_PAD]`` token, no BOS, or mel bins that are not the encoder's.
    """

    image_token = None

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoConfig, AutoTokenizer
        from transformers.models.voxtral_realtime.feature_extraction_voxtral_realtime import (
            VoxtralRealtimeFeatureExtractor)
        model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(str(model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        fe_file = model_dir / "preprocessor_config.json"
        self.feature_extractor = (VoxtralRealtimeFeatureExtractor.from_pretrained(str(model_dir)) if fe_file.exists()
                                  else VoxtralRealtimeFeatureExtractor())
        if self.feature_extractor.feature_size != config.audio_config.num_mel_bins:
            raise ValueError(f"{model_dir}: the feature extractor gives {self.feature_extractor.feature_size} mel "
                             f"bins, the audio encoder takes {config.audio_config.num_mel_bins}")
        pad = self.tokenizer.convert_tokens_to_ids(STREAMING_PAD)
        if pad is None or pad == self.tokenizer.unk_token_id:
            raise ValueError(f"{model_dir}: the tokenizer has no {STREAMING_PAD} token")
        bos = config.text_config.bos_token_id
        if bos is None:
            raise ValueError(f"{model_dir}: the text config has no bos_token_id")
        self.frames_per_token = int(config.audio_length_per_tok)  # mel frames of one text token
        self.samples_per_token = self.frames_per_token * int(self.feature_extractor.hop_length)
        self.delay_tokens = int(config.default_num_delay_tokens)
        self.left_tokens = _left_pad_tokens(model_dir)
        self.prompt_ids = [int(bos)] + [int(pad)] * (self.left_tokens + self.delay_tokens)

    def padded(self, clip: np.ndarray) -> np.ndarray:
        """``[samples]`` float32: the clip with its silence on the left (the left-pad frames) and on
        the right (to a whole frame, then the delay, the BOS and the buffer frames)."""
        per = self.samples_per_token
        right = (-clip.shape[0]) % per + per * (self.delay_tokens + 1 + BUFFER_TOKENS)
        return np.pad(np.asarray(clip, dtype=np.float32), (per * self.left_tokens, right))

    def __call__(self, text: str, return_tensors: str = "np", add_special_tokens: bool = True, audio=None,
                 sampling_rate: int | None = None, **unused) -> dict:
        """The streaming prompt and one clip's log-mel features.

        Args:
            text: must be empty: the prompt is the model's own (BOS and streaming pads).
            audio: one ``[samples]`` float32 clip at the feature extractor's rate.
        Returns:
            ``input_ids`` ``[1, n]`` int64, ``input_features`` ``[1, mel bins, frames]`` float32 and
            ``realtime_tokens`` ``[1]`` int64: the clip's frames (``frames / audio_length_per_tok``),
            the sequence's length at most.
        Raises:
            ValueError: text in the prompt, or not exactly one clip.
        """
        if text:
            raise ValueError("Voxtral Realtime's prompt is its own (the BOS and streaming pads): send an empty "
                             "prompt with the audio")
        clips = list(audio or ())
        if len(clips) != 1:
            raise ValueError(f"Voxtral Realtime transcribes one audio clip per request, got {len(clips)}")
        fe = self.feature_extractor
        feats = fe(self.padded(clips[0]), sampling_rate=fe.sampling_rate, return_tensors="np")["input_features"]
        frames = feats.shape[-1] - feats.shape[-1] % self.frames_per_token
        feats = np.ascontiguousarray(feats[:, :, :frames], dtype=np.float32)
        return {"input_ids": np.asarray([self.prompt_ids], dtype=np.int64), "input_features": feats,
                "realtime_tokens": np.asarray([frames // self.frames_per_token], dtype=np.int64)}


def _left_pad_tokens(model_dir: Path) -> int:
    """``streaming_n_left_pad_tokens`` of the model's ``tekken.json`` audio section, else
    ``LEFT_PAD_TOKENS``."""
    path = model_dir / "tekken.json"
    if not path.exists():
        return LEFT_PAD_TOKENS
    audio = json.loads(path.read_text()).get("audio") or {}
    return int(audio.get("streaming_n_left_pad_tokens") or LEFT_PAD_TOKENS)


class RealtimeStream:
    """One utterance transcribed as its audio arrives (``/v1/realtime``): successive requests, each the
    one before it extended, so that the KV of what was already heard is reused, never computed again.

    Request ``k`` is the streaming prompt, the text tokens generated so far and the audio heard so far
    in segments: one additive ``MultiModalInput`` per request, rows ``[R(k-1), R(k))``, ``R(k)`` a
    whole number of KV blocks of rows. It computes every position below ``R(k)`` (``open``: it samples
    the token at ``R(k)`` too) and ends; the next request's prompt holds those tokens, so its blocks
    below ``R(k)`` (same tokens, same segments' hashes) are prefix-cache hits and its first computed
    position is ``R(k)``. The last request (``final``) has the right padding and ends with the audio,
    as the whole clip's request does. A segment carries its own mel frames only (``extra["stream"]``);
    its hash chains the one before it, so it names all the audio heard through it. The model's
    streaming encoder continues from the segment before (``VisionMixin.encode_stream``: its caches kept
    per stream; rebuilt from the request's earlier segments when missing). A row is taken once all its mel
    frames' samples have arrived (a frame's window reaches ``n_fft / 2`` samples past it; the log-mel
    frames are independent of each other with the extractor's fixed ``global_log_mel_max``).

    Args:
        processor: the model's ``VoxtralRealtimeAudioProcessor``.
        block_size: the KV cache's tokens per block.
    Raises:
        ValueError: a feature extractor without ``global_log_mel_max`` (its frames then depend on the
            whole clip's loudest one: heard in pieces they would differ).
    """

    def __init__(self, processor: VoxtralRealtimeAudioProcessor, block_size: int) -> None:
        if processor.feature_extractor.global_log_mel_max is None:
            raise ValueError("audio: this model's log-mel features are normalised over the whole clip "
                             "(no global_log_mel_max): send the file to /v1/audio/transcriptions instead")
        self.proc, self.block_size = processor, block_size
        self.n = processor.samples_per_token * processor.left_tokens  # samples heard, the left pad's first
        self.buf = np.zeros(max(self.n, 1 << 16), dtype=np.float32)  # grown by doubling: appends stay O(1)
        self.segments: list = []
        self.generated: list[int] = []
        self.rows = 0  # rows the segments cover

    def append(self, samples: np.ndarray) -> None:
        """Add heard audio: ``[n]`` float32 at the feature extractor's rate."""
        end = self.n + samples.size
        if end > self.buf.size:
            self.buf = np.concatenate([self.buf[:self.n], np.zeros(max(end, 2 * self.buf.size) - self.n, np.float32)])
        self.buf[self.n:end] = samples
        self.n = end

    def _frames(self, heard: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """``[mel bins, hi - lo]`` float32 log-mel frames ``lo .. hi - 1`` of ``heard``, computed from the
        samples their windows cover only (``center=False`` on the slice from frame ``lo``'s window on;
        from the start, where a frame's window reaches before it, as the whole clip's ``center=True``)."""
        fe = self.proc.feature_extractor
        half = fe.n_fft // 2
        start = lo * fe.hop_length - half
        end = hi * fe.hop_length + half  # one frame more: the extractor drops the last frame it computes
        x = heard[max(start, 0):end]
        x = np.pad(x, (0, max(0, end - max(start, 0) - x.size)))  # past the heard audio: the dropped frame only
        feats = fe(x, sampling_rate=fe.sampling_rate, return_tensors="np", center=start < 0)["input_features"][0]
        first = lo if start < 0 else 0
        return np.ascontiguousarray(feats[:, first:first + hi - lo], dtype=np.float32)

    def next_request(self, final: bool):
        """The next request's ``PreparedPrompt`` (``None`` while too little new audio has arrived for a
        block of rows past the prompt; with ``final`` the rest, right padding included). The segment
        it adds is kept: call it again only once that request has ended (``took``)."""
        from pagedllm.multimodal_inputs import MultiModalInput, PreparedPrompt
        proc, fe = self.proc, self.proc.feature_extractor
        if final:
            heard = proc.padded(self.buf[proc.samples_per_token * proc.left_tokens:self.n])
            rows = heard.shape[0] // proc.samples_per_token
        else:
            heard = self.buf[:self.n]
            whole = (heard.shape[0] - fe.n_fft // 2) // fe.hop_length + 1  # frames whose windows are in
            rows = (whole // proc.frames_per_token) // self.block_size * self.block_size
            if rows <= max(self.rows, len(proc.prompt_ids) + len(self.generated)):
                return None
        feats = self._frames(heard, self.rows * proc.frames_per_token, rows * proc.frames_per_token)
        n = rows - self.rows
        prev = self.segments[-1].hash if self.segments else "voxtral-realtime-stream"
        digest = hashlib.sha256(prev.encode() + feats.tobytes()).hexdigest()  # the audio heard through it
        segment = MultiModalInput(digest, self.rows, n, feats.tobytes(), list(feats.shape),
                                  extra={"realtime_tokens": [n], "stream": [1]}, modality="audio", additive=True,
                                  open=not final)
        self.segments.append(segment)
        self.rows = rows
        return PreparedPrompt(tuple(proc.prompt_ids + self.generated), tuple(self.segments))

    def took(self, token_ids: list[int]) -> None:
        """Record a request's generated tokens (the next request's prompt holds them)."""
        self.generated += [int(t) for t in token_ids]

"""Whisper's prompts (issue 42): one audio clip and the decoder's prompt become one request.

Whisper is an encoder-decoder: the encoder turns 30 s of log-mel features into
``max_source_positions`` (1,500) rows, and every decoder layer's cross-attention reads their keys
and values. pagedllm holds those cross-attention K/V in the paged cache, in the request's own blocks:
the request's sequence is ``encoder_rows(config)`` placeholder tokens (the clip, one
``MultiModalInput`` at offset 0, scheduled, hashed, prefix-cached and recomputed after preemption as
any clip) followed by the decoder's tokens (its prompt, then what it generates). The placeholders'
rows hold each layer's cross-attention K/V; the decoder's rows hold its self-attention K/V
(``models/whisper.py``). The placeholder count is rounded up to ``ROW_ALIGN`` so the decoder's first
token starts a block for every power-of-two block size up to it: its self-attention reads its own
blocks only, the block table shifted by whole blocks.

The prompt is vLLM's offline shape for Whisper: ``{"prompt": "<|startoftranscript|><|en|>
<|transcribe|><|notimestamps|>", "multi_modal_data": {"audio": (samples, sampling_rate)}}``, the
text tokenized as it is (no special tokens added: it carries Whisper's own).

Source: vLLM's Whisper prompts and its encoder-decoder KV cache (cross-attention blocks allocated per
request), as documented; the feature extractor is ``transformers``' ``WhisperFeatureExtractor``.
"""

from __future__ import annotations

from pathlib import Path

from pagedllm.media import MediaPolicy
from pagedllm.multimodal_inputs import MultiModalInput, MultiModalPrompt

WHISPER_MODEL_TYPES = ("whisper",)
ROW_ALIGN = 512  # the encoder rows end on a block boundary for block sizes 1, 2, 4, ..., 512
MAX_CLIP_SECONDS = 30.0  # one request hears one 30 s window (the feature extractor's chunk_length)


def is_whisper(config) -> bool:
    """Whether ``config`` is a Whisper encoder-decoder (served by ``models/whisper.py``)."""
    return getattr(config, "model_type", None) in WHISPER_MODEL_TYPES


def encoder_rows(config) -> int:
    """Placeholder tokens a clip takes at the head of a request: the encoder's
    ``max_source_positions`` rows rounded up to ``ROW_ALIGN`` (1,536 for every released Whisper)."""
    return -(-int(config.max_source_positions) // ROW_ALIGN) * ROW_ALIGN


def context_len(config) -> int:
    """A request's longest sequence in tokens: the clip's placeholders and ``max_target_positions``
    decoder tokens (448)."""
    return encoder_rows(config) + int(config.max_target_positions)


class WhisperPromptProcessor:
    """A Whisper model's prompts: the clip's log-mel features and the placeholder rows before the
    decoder prompt (the ``multimodal.MultiModalProcessor`` interface the engine's ``Processor`` calls).

    Args:
        model_dir: the model directory (its ``preprocessor_config.json`` and tokenizer).
        config: its ``WhisperConfig``.
        policy: where audio URLs may point (``media.MediaPolicy``).
    Raises:
        ValueError: the directory has no Whisper processor ``transformers`` can load.
    """

    image_token_id = None
    image_placeholder = None
    video_placeholder = None
    audio = None  # no chat placeholder: Whisper's prompts are the transcription endpoints' or vLLM's dict
    needs_media = True  # a prompt without its clip is refused (``engine/processor.py``)

    def __init__(self, model_dir: str | Path, config, policy: MediaPolicy | None = None) -> None:
        from transformers import WhisperProcessor
        try:
            self.processor = WhisperProcessor.from_pretrained(str(model_dir))
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError on a bad directory
            raise ValueError(f"{model_dir}: no Whisper processor transformers can load ({exc})") from None
        self.policy = policy or MediaPolicy()
        self.rows = encoder_rows(config)
        self.placeholder_id = int(config.decoder_start_token_id)  # any id: placeholders are never embedded
        self.rate = int(self.processor.feature_extractor.sampling_rate)

    def __call__(self, prompt: MultiModalPrompt, where: str = "prompt") -> tuple[list[int], list[MultiModalInput]]:
        """Token ids (``rows`` placeholders, then the decoder prompt's) and the clip's ``MultiModalInput``.

        An empty decoder prompt is ``<|startoftranscript|>`` alone.

        Raises:
            ValueError: images or videos, not exactly one clip, a clip ``read_clip`` refuses, or one
                longer than ``MAX_CLIP_SECONDS`` (``where`` named).
        """
        from pagedllm.multimodal_audio import clip_hash, read_clip
        if prompt.images or prompt.videos:
            raise ValueError(f"{where}.{'image' if prompt.images else 'video'}: Whisper takes audio only")
        if len(prompt.audios) != 1:
            raise ValueError(f"{where}.audio: Whisper takes exactly one clip per request, got {len(prompt.audios)}")
        wave = read_clip(prompt.audios[0], self.rate, f"{where}.audio[0]")
        if wave.shape[0] > MAX_CLIP_SECONDS * self.rate:
            raise ValueError(f"{where}.audio[0]: {wave.shape[0] / self.rate:.1f} s of audio; Whisper hears at most "
                             f"{MAX_CLIP_SECONDS:g} s per request (/v1/audio/transcriptions splits longer files)")
        feats = self.processor.feature_extractor(wave, sampling_rate=self.rate, return_tensors="np")["input_features"][0]
        ids = self.processor.tokenizer.encode(prompt.text, add_special_tokens=False) or [self.placeholder_id]
        clip = MultiModalInput(clip_hash(wave), 0, self.rows, feats.astype("float32").tobytes(), list(feats.shape),
                               modality="audio")
        return [self.placeholder_id] * self.rows + [int(t) for t in ids], [clip]

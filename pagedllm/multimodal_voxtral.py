"""Voxtral's audio prompts (issue 42): a clip's placeholder expansion and log-mel features, ours, in
place of ``transformers``' ``VoxtralProcessor`` (which needs the ``mistral_common`` tokenizer).

A prompt writes the model's audio token (``[AUDIO]``: ``config.audio_token_id``) once per clip, as
vLLM's Voxtral prompts place a clip. A clip is padded to a whole number of 30 s chunks and its Whisper
log-mel features (``WhisperFeatureExtractor``, ``audio_config.num_mel_bins`` bins) cut into chunks of
``2 * audio_config.max_source_positions`` frames (3000: 30 s); each chunk's encoder rows
(``max_source_positions``, 1500) are regrouped by the projector (its input is ``intermediate_size``
wide: ``d_model * 1500 / intermediate_size`` rows, 375 for Voxtral Mini), and the audio token is
repeated once per row.

Source: ``transformers``' ``VoxtralProcessor._retrieve_input_features`` and its audio defaults (pad to
a multiple of 480000 samples, chunks of 3000 frames) and ``VoxtralModel.get_audio_features``' reshape.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class VoxtralAudioProcessor:
    """Voxtral's prompts with clips, in the call shape of a ``transformers`` processor
    (``multimodal.MultiModalProcessor._process``).

    Args:
        model_dir: the model directory: its tokenizer (with the audio token), ``config.json`` and a
            ``preprocessor_config.json`` of a ``WhisperFeatureExtractor``.
    Raises:
        ValueError: no audio token in the config or the tokenizer, a feature extractor whose mel bins
            are not the encoder's, or an encoder whose rows do not regroup evenly into the projector's
            input.
    """

    image_token = None

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoConfig, AutoTokenizer, WhisperFeatureExtractor
        config = AutoConfig.from_pretrained(str(model_dir))
        audio = config.audio_config
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
        if config.audio_token_id is None or config.audio_token_id >= len(self.tokenizer):
            raise ValueError(f"{model_dir}: audio_token_id {config.audio_token_id} is not a token of the tokenizer")
        self.audio_token_id = int(config.audio_token_id)
        self.audio_token = self.tokenizer.convert_ids_to_tokens(self.audio_token_id)
        if self.feature_extractor.feature_size != audio.num_mel_bins:
            raise ValueError(f"{model_dir}: the feature extractor gives {self.feature_extractor.feature_size} mel "
                             f"bins, the audio encoder takes {audio.num_mel_bins}")
        self.chunk_frames = 2 * audio.max_source_positions  # the encoder's second convolution halves them
        rows, width = audio.max_source_positions * audio.hidden_size, audio.intermediate_size
        if rows % width:
            raise ValueError(f"{model_dir}: {audio.max_source_positions} encoder rows of width {audio.hidden_size} "
                             f"do not regroup into the projector's input of width {width}")
        self.chunk_tokens = rows // width  # placeholders of one 30 s chunk (375 for Voxtral Mini)

    def features(self, clip: np.ndarray) -> np.ndarray:
        """``[chunks, mel bins, chunk frames]`` float32 log-mel features of ``[samples]`` float32 at the
        feature extractor's rate, padded with silence to whole chunks (the whole clip's features
        normalised together, then cut, as ``transformers``' Voxtral processor does)."""
        fe = self.feature_extractor
        out = fe(clip, sampling_rate=fe.sampling_rate, padding="longest", truncation=False,
                 pad_to_multiple_of=self.chunk_frames * fe.hop_length, return_tensors="np")["input_features"][0]
        return np.ascontiguousarray(out.reshape(fe.feature_size, -1, self.chunk_frames).transpose(1, 0, 2),
                                    dtype=np.float32)

    def __call__(self, text: str, return_tensors: str = "np", add_special_tokens: bool = True, audio=None,
                 sampling_rate: int | None = None, **unused) -> dict:
        """Token ids with each audio token expanded to its clip's placeholders, and the clips' features.

        Args:
            text: the prompt, the audio token once per clip.
            audio: ``[samples]`` float32 clips at the feature extractor's rate, in prompt order (or none).
        Returns:
            ``input_ids`` ``[1, n]`` int64; with clips, ``input_features`` ``[all chunks, mel bins,
            chunk frames]`` float32 and ``audio_chunks`` ``[clips]`` int64 (each clip's chunks, in order).
        Raises:
            ValueError: the text's audio tokens are not one per clip.
        """
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        clips = list(audio or ())
        if not clips:
            return {"input_ids": np.asarray([ids], dtype=np.int64)}
        at = [i for i, t in enumerate(ids) if t == self.audio_token_id]
        if len(at) != len(clips):
            raise ValueError(f"the text has {len(at)} {self.audio_token} tokens for {len(clips)} clips (put "
                             f"{self.audio_token} once per clip)")
        feats = [self.features(c) for c in clips]
        out, last = [], 0
        for i, f in zip(at, feats):
            out += ids[last:i] + [self.audio_token_id] * (len(f) * self.chunk_tokens)
            last = i + 1
        out += ids[last:]
        return {"input_ids": np.asarray([out], dtype=np.int64), "input_features": np.concatenate(feats),
                "audio_chunks": np.asarray([len(f) for f in feats], dtype=np.int64)}

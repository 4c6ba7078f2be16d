"""The image side of the Transformers backend (issue 41): which ``transformers`` image-text models it
serves and how (``VISION_MODEL_TYPES``, image-prefix attention, M-RoPE), and ``VisionMixin``, the
model methods the runner's encoder step calls: the vision tower and projector as ``transformers``
builds them (``encode_image``; Qwen-VL's videos too), the input embeddings the image rows are written over
(``embed_tokens``), Qwen-VL's 3-D rotary positions (``rope_positions``) and Qwen3-VL's deepstack rows
(``_deepstack_logits``).
"""

from __future__ import annotations

import numpy as np
import torch

# image-text models served through the backend (issue 41, first part): the language model on our
# paged attention, the vision tower and projector as transformers builds them (its own attention)
VISION_MODEL_TYPES = ("llava", "llava_next", "gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm",
                      "mistral3", "paligemma")
# those whose image tokens attend to each other both ways (transformers' Gemma 3 masks, vLLM's
# is_mm_prefix_lm): the runner passes the images' spans to attention, the scheduler never splits one
MM_PREFIX_MODEL_TYPES = ("gemma3", "paligemma")
# those whose whole prompt (images and text) attends both ways, generated tokens causally (PaliGemma's
# prefix-LM: transformers' token_type_ids 0): the prompt is one span, computed in one step
PREFIX_LM_MODEL_TYPES = ("paligemma",)
# those whose rotary positions are 3-D (temporal, height, width) over images: M-RoPE (Qwen2-VL, Qwen2.5-VL,
# Qwen3-VL)
MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# audio-text models served through the backend (issue 42): the language model on our paged attention,
# the audio encoder and projector as transformers builds them
AUDIO_MODEL_TYPES = ("qwen2_audio", "voxtral", "voxtral_realtime")


def is_mm_prefix_model(config) -> bool:
    """Whether ``config``'s image tokens attend bidirectionally within their image (Gemma 3), or its
    whole prompt does (PaliGemma: ``is_prefix_lm``)."""
    return getattr(config, "model_type", None) in MM_PREFIX_MODEL_TYPES


def is_prefix_lm(config) -> bool:
    """Whether ``config``'s whole prompt attends bidirectionally (PaliGemma)."""
    return getattr(config, "model_type", None) in PREFIX_LM_MODEL_TYPES


def is_vision_model(config) -> bool:
    """Whether ``config`` is an image-text model the backend serves with its images."""
    return getattr(config, "model_type", None) in VISION_MODEL_TYPES


def is_multimodal_model(config) -> bool:
    """Whether ``config`` is an image-, video- or audio-text model the backend serves with its encoder."""
    return getattr(config, "model_type", None) in VISION_MODEL_TYPES + AUDIO_MODEL_TYPES



class VisionMixin:
    """Image methods of ``TransformersCausalLM`` (its ``hf`` model: ``AutoModelForImageTextToText``)."""

    def encode_image(self, pixel_values: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        """Images' embeddings in the language model's space: the model's own vision tower and
        projector (``get_image_features``) on their processor's ``pixel_values`` ``[N, C, H, W]``
        (LLaVA-NeXT: ``[N, patches, C, H, W]``) and per-image ``extra`` (``multimodal_inputs.PER_IMAGE_KEYS``:
        ``image_sizes`` ``[N, 2]`` int64); returns ``[sum of placeholder tokens, hidden]``, image after
        image (Qwen3-VL: ``[..., (1 + deepstack layers) * hidden]``, each row's deepstack rows after its
        embedding: ``MultiModalStep.deepstack``)."""
        p = next(self.hf.parameters())
        if "realtime_tokens" in extra:  # Voxtral Realtime's clip: one row per frame, added to every step's
            return self.encode_realtime_audio(pixel_values.to(p.device, p.dtype), extra["realtime_tokens"].reshape(-1))
        if "audio_chunks" in extra:  # Voxtral's clips (multimodal_voxtral): [N, chunks, mels, frames]
            return self.encode_chunked_audio(pixel_values.to(p.device, p.dtype))
        if "audio_feature_lengths" in extra:  # audio clips (multimodal_audio): Whisper features [N, mels, frames]
            return self.encode_audio(pixel_values.to(p.device, p.dtype), extra["audio_feature_lengths"].reshape(-1))
        extra = {k: v.to(p.device) for k, v in extra.items() if k != "second_per_grid_ts"}  # that one: positions
        if "image_grid_thw" in extra or "video_grid_thw" in extra:  # Qwen-VL: all patches as one [patches, dim]
            pixel_values = pixel_values.flatten(0, 1)
        if "video_grid_thw" in extra:  # videos (multimodal_video): Qwen-VL's own video path
            out = self.hf.get_video_features(pixel_values_videos=pixel_values.to(p.device, p.dtype), **extra)
        else:
            out = self.hf.get_image_features(pixel_values=pixel_values.to(p.device, p.dtype), **extra)
        feats = _rows(getattr(out, "pooler_output", out))
        deep = getattr(out, "deepstack_features", None)  # Qwen3-VL: per early layer, carried beside each row
        return torch.cat([feats] + [_rows(d) for d in deep], dim=-1) if deep else feats

    def encode_audio(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Clips' embeddings in the language model's space: ``features`` ``[N, mels, frames]`` (Whisper's,
        padded), ``lengths`` ``[N]`` int64 frames that are audio; returns ``[sum of rows, hidden]``, clip
        after clip, each clip's rows those its length gives (its placeholder count).
        Source: transformers' ``Qwen2AudioModel.forward`` (its audio path, which has no method of its own)."""
        from transformers.masking_utils import create_bidirectional_mask
        model = self.hf.model
        tower = model.audio_tower
        feat_lengths, out_lengths = tower._get_feat_extract_output_lengths(lengths.to(features.device))
        steps = (features.shape[-1] - 2) // 2 + 1
        keep = torch.arange(steps, device=features.device)[None] < feat_lengths[:, None]
        mask = create_bidirectional_mask(config=tower.config, inputs_embeds=features.new_zeros(len(features), steps, 1),
                                         attention_mask=keep.long())
        rows = model.multi_modal_projector(tower(features, attention_mask=mask).last_hidden_state)
        return rows[torch.arange(rows.shape[1], device=rows.device)[None] < out_lengths[:, None]]

    def encode_chunked_audio(self, features: torch.Tensor) -> torch.Tensor:
        """Voxtral's clips in the language model's space: ``features`` ``[N, chunks, mels, frames]`` (each
        clip's 30 s chunks of Whisper features, padded with silence; the encoder takes no mask) ->
        ``[N * chunks * rows per chunk, hidden]``, clip after clip, chunk after chunk (each chunk's
        encoder rows regrouped to the projector's input width: 375 rows per chunk for Voxtral Mini).
        Source: transformers' ``VoxtralModel.get_audio_features``."""
        return self.hf.get_audio_features(features.flatten(0, 1), return_dict=True).pooler_output

    def encode_realtime_audio(self, features: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Voxtral Realtime's clips in the language model's space: ``features`` ``[N, mels, frames]``
        (the audio heard from the start), ``keep`` ``[N]`` int64 -> ``[sum(keep), hidden]``: each clip's
        last ``keep`` rows (one per text position, ``frames / audio_length_per_tok`` in all; a realtime
        stream's segment keeps its new ones), clip after clip. Its encoder is causal (causal
        convolutions, sliding-window causal attention), so the rows over the heard audio equal those
        the streaming encoder gives frame by frame.
        Source: transformers' ``VoxtralRealtimeModel.get_audio_features``."""
        out = self.hf.model.get_audio_features(input_features=features, return_dict=True).pooler_output
        return torch.cat([rows[rows.shape[0] - int(k):] for rows, k in zip(out, keep.tolist())])

    def encode_stream(self, segment, earlier: list) -> torch.Tensor:
        """A Voxtral Realtime stream's segment (``multimodal_voxtral_realtime.RealtimeStream``) in the
        language model's space: ``[segment.length, hidden]``, its encoder rows continued from the
        segment before through the stream's encoder caches (convolution padding, attention KV), kept
        per stream (keyed by its first segment's hash) between requests. When they are missing or at
        another row (a preempted request, an evicted prefix), they are rebuilt from ``earlier``, the
        request's segments before this one, in order. Exact: the encoder is causal.
        Source: transformers' streaming ``VoxtralRealtimeModel.get_audio_features`` (its padding and KV caches)."""
        from collections import OrderedDict
        streams = self.__dict__.setdefault("_streams", OrderedDict())
        root = earlier[0].hash if earlier else segment.hash
        state = streams.pop(root, None)
        if state is None or state[0] != segment.offset:
            state = (0, None, None)
            for m in earlier:
                state = self._stream_rows(m, state)[1]
        rows, state = self._stream_rows(segment, state)
        if segment.open:  # the stream goes on: keep its caches (the least recently used dropped past 16)
            streams[root] = state
            while len(streams) > 16:
                streams.popitem(last=False)
        return rows

    def _stream_rows(self, m, state: tuple) -> tuple[torch.Tensor, tuple]:
        """``(rows [m.length, hidden], (rows done, KV cache, padding cache))`` of one segment from ``state``."""
        from transformers.cache_utils import DynamicCache
        p = next(self.hf.parameters())
        done, kv, pad = state
        kv = kv if kv is not None else DynamicCache(config=self.hf.config.audio_config)
        out = self.hf.model.get_audio_features(input_features=m.pixel_values().to(p.device, p.dtype),
                                               past_key_values=kv, padding_cache=pad, use_cache=True, return_dict=True)
        return out.pooler_output[0], (done + m.length, out.past_key_values, out.padding_cache)

    def _realtime_logits(self, embeds: torch.Tensor, pos: torch.Tensor, logits_indices: torch.Tensor,
                         hidden_indices: torch.Tensor | None = None):
        """Voxtral Realtime's language model on the step's embeddings (audio rows already added: its own
        forward encodes audio itself) with its time conditioning (``num_delay_tokens``: the config's
        ``default_num_delay_tokens``, the delay ``multimodal_voxtral_realtime`` prompts with). Returns
        as ``forward``."""
        model = self.hf.model
        delay = torch.full((1,), float(self.hf.config.default_num_delay_tokens), device=embeds.device, dtype=embeds.dtype)
        hidden = model.language_model(inputs_embeds=embeds, position_ids=pos, t_cond=model.time_embedding(delay)[None],
                                      use_cache=False).last_hidden_state[0]
        logits = self.hf.lm_head(hidden.index_select(0, logits_indices)).float()
        return logits if hidden_indices is None else (logits, hidden.index_select(0, hidden_indices).float())

    def rope_positions(self, prompt_ids: list[int], inputs) -> tuple[np.ndarray, int, dict]:
        """M-RoPE (``self.mrope``) of a prompt with images or videos.

        Args:
            prompt_ids: the prompt's token ids.
            inputs: its ``MultiModalInput`` (their ``image_grid_thw`` or ``video_grid_thw`` and
                ``second_per_grid_ts``).
        Returns:
            ``(table, delta, whole)``: ``table`` ``[3, n]`` int64 (temporal, height, width) positions of
            the ``n`` prompt tokens (every generated token ``p`` at ``p + delta`` on all three axes: the
            text after a video continues from its spatial extent, generated tokens from its largest
            position, as ``transformers`` places them); ``whole``: for each video pruned by EVS
            (``MultiModalInput.pruned``),
            its offset -> ``[3, rows + pruned]`` the positions of all its rows, from which its kept
            rows take theirs once its encoder step has chosen them (its ``table`` columns until then
            are overwritten then). Qwen3-VL's video runs (one per frame group, ``MultiModalInput.runs``)
            are placed by its ``get_rope_index`` as images of one temporal step each, the timestamp
            text between them as text.
        Source: transformers' ``get_rope_index`` on the prompt with each pruned video whole again.
        """
        cfg = self.hf.config
        ids, kinds = list(prompt_ids), [0] * len(prompt_ids)
        for m in sorted(inputs, key=lambda m: -m.offset):  # from the back: earlier offsets stay valid
            token, kind = (cfg.video_token_id, 2) if m.modality == "video" else (cfg.image_token_id, 1)
            for a, n, whole in reversed(_whole_runs(m)):  # EVS: each run whole again, its pruned rows inserted
                ids[m.offset + a:m.offset + a + n] = [token] * whole
                kinds[m.offset + a:m.offset + a + n] = [kind] * whole
        grids = {k: torch.tensor([m.extra[k] for m in inputs if k in m.extra])
                 for k in ("image_grid_thw", "video_grid_thw")}
        seconds = [s for m in inputs for s in m.extra.get("second_per_grid_ts", ())]
        pos, delta = self.hf.model.get_rope_index(
            torch.tensor([ids]), torch.tensor([kinds]), **{k: v for k, v in grids.items() if len(v)},
            **({"second_per_grid_ts": torch.tensor(seconds)} if seconds else {}))
        pos = pos[:, 0].numpy()
        keep, whole, shift = np.ones(pos.shape[1], dtype=bool), {}, 0
        for m in sorted(inputs, key=lambda m: m.offset):
            if not m.pruned:
                continue
            cols = []
            for a, n, full in _whole_runs(m):
                first = m.offset + a + shift
                cols.append(np.arange(first, first + full))
                keep[first + n:first + full] = False
                shift += full - n
            whole[m.offset] = pos[:, np.concatenate(cols)].copy()
        return pos[:, keep], int(delta.reshape(-1)[0]) + shift, whole

    def _deepstack_logits(self, embeds: torch.Tensor, pos: torch.Tensor, deepstack, logits_indices: torch.Tensor,
                          hidden_indices: torch.Tensor | None = None):
        """Qwen3-VL's language model with the step's deepstack rows added after its early layers (the
        model's own forward takes them only from images it encodes itself): ``[R, vocab]`` float32
        logits, with ``hidden_indices`` also those rows' final hidden states (as ``forward``)."""
        mask, extra = deepstack
        layers = [e.contiguous() for e in extra.split(embeds.shape[-1], dim=-1)]
        hidden = self.hf.model.language_model(inputs_embeds=embeds, position_ids=pos, visual_pos_masks=mask[None],
                                              deepstack_visual_embeds=layers, use_cache=False).last_hidden_state[0]
        logits = self.hf.lm_head(hidden.index_select(0, logits_indices)).float()
        return logits if hidden_indices is None else (logits, hidden.index_select(0, hidden_indices).float())

    def _selected_logits(self, tokens: dict, pos: torch.Tensor, logits_indices: torch.Tensor,
                         hidden_indices: torch.Tensor | None = None):
        """The language model's hidden states, then the LM head on the ``logits_indices`` rows only: for
        a model whose forward takes no ``logits_to_keep`` (Qwen2-Audio's projects every row). Returns as
        ``forward``."""
        hidden = self.hf.model(**tokens, position_ids=pos, use_cache=False).last_hidden_state[0]
        logits = self.hf.lm_head(hidden.index_select(0, logits_indices)).float()
        return logits if hidden_indices is None else (logits, hidden.index_select(0, hidden_indices).float())

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]`` input embeddings (a tensor of its own: image rows go over it). An
        image token past the embedding table (a text-only Gemma 3 vocabulary with llama.cpp's mmproj)
        embeds as token 0: its row is written over."""
        table = self.hf.get_input_embeddings()
        ids = torch.where(input_ids < table.num_embeddings, input_ids, torch.zeros_like(input_ids))
        return table(ids).clone()


def _whole_runs(m) -> list[tuple[int, int, int]]:
    """``(start from offset, placeholders, rows of the whole run)`` of each placeholder run of ``m``: a
    video pruned by EVS has ``m.pruned`` more rows than placeholders, over its one run (Qwen2.5-VL) or
    spread over its runs, each a whole frame group of ``(m.rows + m.pruned) / runs`` rows (Qwen3-VL)."""
    runs = m.row_runs()
    if not m.pruned:
        return [(a, n, n) for a, n in runs]
    full = (m.rows + m.pruned) // len(runs)
    return [(a, n, n + m.pruned) if len(runs) == 1 else (a, n, full) for a, n in runs]


def _rows(feats) -> torch.Tensor:
    """``[rows, hidden]`` of a vision tower's output: one tensor, or one per image."""
    if isinstance(feats, (list, tuple)):
        feats = torch.cat(list(feats))
    return feats.reshape(-1, feats.shape[-1])

"""A model's own processor over a prompt with images, videos and audio clips (issues 41, 42): it turns
a ``MultiModalPrompt`` into token ids with the placeholders expanded and one ``MultiModalInput`` per
item (``multimodal_inputs``).

The front end runs the processor (``engine/processor.py``); the core schedules each item's encoder
step and keys its encoder cache and the KV blocks holding its placeholders by ``MultiModalInput.hash``
(``core/encoder_cache.py``, ``core/hashing.py``); the runner runs the model's vision tower or audio
encoder and writes the embeddings over the placeholder rows (``worker/multimodal_step.py``).

vLLM's offline shape is followed: ``{"prompt": text, "multi_modal_data": {"image": PIL.Image | [..]}}``
with the model's image token (LLaVA's ``<image>``) in the text once per image; videos and clips alike.

Source: vLLM's multimodal inputs as documented; the processors are ``transformers``' (or
``multimodal_patches``' where theirs needs torchvision).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedllm.media import MediaPolicy
from pagedllm.multimodal_embeds import STAND_IN_SIZES, check_embeds, embedded
from pagedllm.multimodal_inputs import (PER_IMAGE_KEYS, MultiModalInput, MultiModalPrompt, group_runs, is_tensor,
                                        whole_prompt, image_hash, placeholder_runs)


class MultiModalProcessor:
    """A model's own ``transformers`` processor (``AutoProcessor``) over text with images.

    Args:
        model_dir: the model directory (its processor and preprocessor configs).
        image_token_id: the placeholder token the processor expands (``config.image_token_id``).
        limit_per_prompt: most images in one prompt (``--limit-mm-per-prompt``'s ``image``).
        policy: where image URLs may point (``media.MediaPolicy``).
        max_image_tokens: most placeholder tokens of one image (``None``: any), for a model that
            computes an image in one step (Gemma 3: ``--max-num-batched-tokens``).
        model_type: the model's ``config.model_type``: Qwen-VL, Mistral 3 and SmolVLM2 take
            ``multimodal_patches``' processors instead of ``AutoProcessor`` (theirs need torchvision).
        processor_kwargs: ``--mm-processor-kwargs``, passed on every call; each key must be a setting
            of the processor or its image processor, and they are tried once on a test image.
        prefix_lm: the whole prompt attends both ways (PaliGemma): the last image's input is extended
            to the prompt's end and its hash takes the prompt's tokens (``whole_prompt``).
        embeds_width: the language model's hidden size when image embeddings are accepted in place of
            images (``--enable-mm-embeds``; ``multimodal_embeds``), else ``None``.
        video: how the model takes videos (``multimodal_video.VideoOptions``); ``None``: it takes none.
        audio: how the model takes audio clips (``multimodal_audio.AudioOptions``); ``None``: none.
    Raises:
        ValueError: the directory has no processor ``transformers`` can load, or ``processor_kwargs``
            names no setting of it or fails on the test image (the flag and the key named).
    """

    def __init__(self, model_dir: str | Path, image_token_id: int | None, limit_per_prompt: int,
                 policy: MediaPolicy | None = None, max_image_tokens: int | None = None,
                 model_type: str | None = None, processor_kwargs: dict | None = None, prefix_lm: bool = False,
                 embeds_width: int | None = None, video=None, audio=None) -> None:
        self.policy = policy or MediaPolicy()
        self.video, self.audio = video, audio
        self.needs_media = model_type == "voxtral_realtime"  # a prompt without its clip is refused (processor.py)
        self.prefix_lm = prefix_lm
        self.embeds_width = embeds_width
        self._fixed: bool | None = None  # whether the placeholder count is the same for every image
        from transformers import AutoProcessor

        from pagedllm.multimodal_patches import (PATCH_PROCESSOR_TOKENS, PatchTokenProcessor, PixtralTokenProcessor,
                                                 smolvlm_processor)
        if model_type in ("voxtral", "voxtral_realtime") and processor_kwargs:  # ours take no settings
            raise ValueError("--mm-processor-kwargs: Voxtral's audio processor takes no settings")
        try:
            if model_type in PATCH_PROCESSOR_TOKENS:
                self.processor = PatchTokenProcessor(model_dir, PATCH_PROCESSOR_TOKENS[model_type], model_type)
            elif model_type == "mistral3":
                self.processor = PixtralTokenProcessor(model_dir)
            elif model_type == "smolvlm":
                self.processor = smolvlm_processor(model_dir)
            elif model_type == "voxtral":  # transformers' own needs mistral_common
                from pagedllm.multimodal_voxtral import VoxtralAudioProcessor
                self.processor = VoxtralAudioProcessor(model_dir)
            elif model_type == "voxtral_realtime":  # the streaming prompt and per-step audio rows
                from pagedllm.multimodal_voxtral_realtime import VoxtralRealtimeAudioProcessor
                self.processor = VoxtralRealtimeAudioProcessor(model_dir)
            else:
                self.processor = AutoProcessor.from_pretrained(str(model_dir))
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError on a bad directory
            raise ValueError(f"{model_dir}: no image processor transformers can load ({exc})") from None
        self.image_token_id = image_token_id
        self.limit_per_prompt = limit_per_prompt
        self.max_image_tokens = max_image_tokens
        self.kwargs = dict(processor_kwargs or {})
        if self.kwargs:
            self._check_kwargs()

    @property
    def image_placeholder(self) -> str | None:
        """What a prompt writes where an image goes (``None``: the model takes no image)."""
        return getattr(self.processor, "image_token", None) if self.image_token_id is not None else None

    @property
    def video_placeholder(self) -> str | None:
        """What a prompt writes where a video goes (``None``: the model takes no video)."""
        return getattr(self.processor, "video_token", None) if self.video is not None else None

    def _check_kwargs(self) -> None:
        """``processor_kwargs`` name settings of the processor and work on a 64 x 48 test image."""
        from PIL import Image
        images = getattr(self.processor, "image_processor", None)
        for key in self.kwargs:
            if not hasattr(self.processor, key) and not hasattr(images, key):
                raise ValueError(f"--mm-processor-kwargs: {key!r} is not a setting of this model's image processor")
        try:
            self._process(self.processor.image_token, [Image.new("RGB", (64, 48))], False, "--mm-processor-kwargs")
        except Exception as exc:  # transformers' own checks raise several kinds (its strict dataclasses' too)
            raise ValueError(f"--mm-processor-kwargs: {exc}") from None

    def __call__(self, prompt: MultiModalPrompt, where: str = "prompt") -> tuple[list[int], list[MultiModalInput]]:
        """Token ids (placeholders expanded) and one ``MultiModalInput`` per image, in prompt order.

        Raises:
            ValueError: more images than ``limit_per_prompt``, or a text whose image tokens do not
                match the images (``where`` and the counts named), or an image the processor
                cannot read.
        """
        images = list(prompt.images)
        if len(images) > self.limit_per_prompt:
            raise ValueError(f"{where}: {len(images)} images, more than --limit-mm-per-prompt allows "
                             f"({self.limit_per_prompt})")
        if images and self.image_token_id is None:
            raise ValueError(f"{where}.image: this model takes no image")
        if prompt.videos:
            self._check_videos(prompt.videos, where)
        clips = self._clips(prompt.audios, where) if prompt.audios else ()
        given = {i: img for i, img in enumerate(images) if is_tensor(img)}  # image embeddings
        if given:
            images = self._stand_ins(images, given, where)
        out = self._process(prompt.text, images, prompt.add_special_tokens, where, prompt.videos, clips)
        ids = [int(t) for t in np.asarray(out["input_ids"])[0]]
        media = self._video_inputs(out, ids, prompt.videos, where) if prompt.videos else []
        media += self._audio_inputs(out, ids, clips, where) if clips else []
        if not images:
            return ids, sorted(media, key=lambda m: m.offset)
        pixels, extra, counts, views = self._per_image(out, images, where)
        runs = placeholder_runs(ids, self.image_token_id)
        groups = group_runs(runs, counts, len(images))
        if groups is None and counts is None and len(images) > 1:  # touching images' placeholders: one run
            groups = group_runs(runs, self._counts_alone(images, where), len(images))
        if groups is None:
            raise ValueError(f"{where}: the text places {len(placeholder_runs(ids, self.image_token_id))} image "
                             f"runs for {len(images)} images (put the model's image token once per image)")
        spans = [(g[0][0], g[-1][0] + g[-1][1] - g[0][0]) for g in groups]
        inputs = [MultiModalInput(image_hash(img), off, n, pixels[i].tobytes(), list(pixels[i].shape),
                                  extra={k: v[i] for k, v in extra.items()},
                                  runs=[[a - off, c] for a, c in groups[i]] if len(groups[i]) > 1 else [], views=views)
                  for i, (img, (off, n)) in enumerate(zip(images, spans))]
        for i, t in given.items():
            try:
                inputs[i] = embedded(inputs[i], t)
            except ValueError as exc:
                raise ValueError(f"{where}: image {i}: {exc}") from None
        if self.prefix_lm:
            inputs[-1] = whole_prompt(inputs[-1], ids)
        inputs = sorted(inputs + media, key=lambda m: m.offset)
        if self.max_image_tokens is not None and any(m.end - m.offset > self.max_image_tokens for m in inputs):
            raise ValueError(f"{where}: an image{' and its prompt' if self.prefix_lm else ''} takes "
                             f"{max(m.end - m.offset for m in inputs)} tokens, more than --max-num-batched-tokens "
                             f"({self.max_image_tokens}); this model computes it in one step")
        return ids, inputs

    def _counts_alone(self, images: list, where: str) -> list[int]:
        """Each image's placeholder count, from the processor run on it alone."""
        return [int((np.asarray(self._process(self.processor.image_token, [img], False, where)["input_ids"])
                     == self.image_token_id).sum()) for img in images]

    def _stand_ins(self, images: list, given: dict, where: str) -> list:
        """``images`` with a blank stand-in for each of the ``given`` embeddings (checked:
        ``multimodal_embeds``), whose placeholders the processor then expands as for any image.

        Raises:
            ValueError: embeddings not enabled, of the wrong shape, or for a model whose placeholder
                count depends on the image.
        """
        from PIL import Image
        for i, t in given.items():
            check_embeds(t, self.embeds_width, f"{where}: image {i}")
        if self._fixed is None:  # once: do two stand-in shapes take the same number of placeholders?
            counts = {int((np.asarray(self._process(self.processor.image_token, [Image.new("RGB", size)], False,
                                                    where)["input_ids"]) == self.image_token_id).sum())
                      for size in STAND_IN_SIZES}
            self._fixed = len(counts) == 1
        if not self._fixed:
            raise ValueError(f"{where}: image embeddings: this model's placeholder count depends on the image; "
                             f"send the image")
        return [Image.new("RGB", STAND_IN_SIZES[0]) if i in given else img for i, img in enumerate(images)]

    def _check_videos(self, videos: tuple, where: str) -> None:
        """Raises ``ValueError`` when the model takes no video or there are more than the limit."""
        if self.video is None:
            raise ValueError(f"{where}.video: this model takes no video (video-text models: Qwen2-VL, Qwen2.5-VL, "
                             f"Qwen3-VL)")
        if len(videos) > self.video.limit:
            raise ValueError(f"{where}: {len(videos)} videos, more than --limit-mm-per-prompt allows "
                             f"({self.video.limit})")

    def _video_inputs(self, out: dict, ids: list[int], videos: tuple, where: str) -> list[MultiModalInput]:
        """One ``MultiModalInput`` per video (``modality`` ``video``) from the processor's output: its
        placeholder runs (Qwen3-VL: one per frame group, timestamp text between: ``runs``).

        Raises:
            ValueError: the text's video placeholder runs do not add up to each video's placeholders.
        """
        from pagedllm.multimodal_patches import patch_rows
        from pagedllm.multimodal_video import video_hash
        runs = placeholder_runs(ids, self.video.token_id)
        groups = group_runs(runs, [int(c) for c in out["video_tokens"]], len(videos))
        if groups is None:
            raise ValueError(f"{where}: the text places {len(runs)} video runs that are not those of {len(videos)} "
                             f"videos (put the model's video token once per video)")
        grids = np.asarray(out["video_grid_thw"])
        rows = patch_rows(np.ascontiguousarray(out["pixel_values_videos"], dtype=np.float32), grids)
        full = out["video_rows"]  # rows each video's encoder output has, before EVS
        inputs = []
        for (frames, fps), g, px, grid, sec, whole in zip(videos, groups, rows, grids, out["second_per_grid_ts"], full):
            off = g[0][0]
            inputs.append(MultiModalInput(video_hash(frames, fps), off, g[-1][0] + g[-1][1] - off, px.tobytes(),
                                          list(px.shape), modality="video", pruned=int(whole) - sum(n for _, n in g),
                                          extra={"video_grid_thw": grid.tolist(), "second_per_grid_ts": [float(sec)]},
                                          runs=[[a - off, n] for a, n in g] if len(g) > 1 else []))
        return inputs

    def _clips(self, audios: tuple, where: str) -> tuple:
        """The prompt's clips as ``[samples]`` float32 at the feature extractor's rate.

        Raises:
            ValueError: the model takes no audio, more clips than the limit, or a clip ``read_clip`` refuses.
        """
        from pagedllm.multimodal_audio import read_clip
        if self.audio is None:
            raise ValueError(f"{where}.audio: this model takes no audio (audio-text models: Qwen2-Audio, Voxtral)")
        if len(audios) > self.audio.limit:
            raise ValueError(f"{where}: {len(audios)} audio clips, more than --limit-mm-per-prompt allows "
                             f"({self.audio.limit})")
        rate = int(self.processor.feature_extractor.sampling_rate)
        return tuple(read_clip(a, rate, f"{where}.audio[{i}]") for i, a in enumerate(audios))

    def _audio_inputs(self, out: dict, ids: list[int], clips: tuple, where: str) -> list[MultiModalInput]:
        """One ``MultiModalInput`` per clip (``modality`` ``audio``) from the processor's output.

        Raises:
            ValueError: the text's audio placeholder runs are not one per clip.
        """
        from pagedllm.multimodal_audio import clip_hash
        if "realtime_tokens" in out:  # Voxtral Realtime: one clip, its rows added at every position it covers
            feats, n = np.ascontiguousarray(out["input_features"][0], dtype=np.float32), int(out["realtime_tokens"][0])
            return [MultiModalInput(clip_hash(clips[0]), 0, n, feats.tobytes(), list(feats.shape),
                                    extra={"realtime_tokens": [n]}, modality="audio", additive=True)]
        runs = placeholder_runs(ids, self.audio.token_id)
        if len(runs) != len(clips):
            raise ValueError(f"{where}: the text places {len(runs)} audio runs for {len(clips)} clips (put "
                             f"{self.audio.placeholder} once per clip)")
        feats = np.ascontiguousarray(out["input_features"], dtype=np.float32)
        if "audio_chunks" in out:  # Voxtral (multimodal_voxtral): a clip's 30 s chunks, [chunks, mels, frames]
            chunks = [int(k) for k in out["audio_chunks"]]
            feats, extras = np.split(feats, np.cumsum(chunks)[:-1]), [{"audio_chunks": [k]} for k in chunks]
        else:
            extras = [{"audio_feature_lengths": [int(k)]} for k in np.asarray(out["feature_attention_mask"]).sum(-1)]
        return [MultiModalInput(clip_hash(c), off, n, f.tobytes(), list(f.shape), extra=e, modality="audio")
                for c, (off, n), f, e in zip(clips, runs, feats, extras)]

    def _process(self, text: str, images: list, add_special_tokens: bool, where: str, videos: tuple = (),
                 clips: tuple = ()) -> dict:
        more = {} if not videos else {"videos": videos, "video_pruning_rate": self.video.pruning_rate}
        if images:
            more["images"] = images
        if clips:
            more.update(audio=list(clips), sampling_rate=int(self.processor.feature_extractor.sampling_rate))
        try:
            return self.processor(text=text, return_tensors="np", add_special_tokens=add_special_tokens,
                                  **more, **self.kwargs)
        except ValueError as exc:  # the processor's own count check, or a bad image
            raise ValueError(f"{where}: {exc}") from None

    def _per_image(self, out: dict, images: list, where: str) -> tuple[list, dict, list[int] | None, bool]:
        """Each image's pixels and ``PER_IMAGE_KEYS`` rows, (when the prompt's runs cannot be matched
        one per image) each image's placeholder count, and whether its pixels are several views
        (``MultiModalInput.views``). A processor whose ``pixel_values`` are not one entry per image
        (Idefics3: ``[1, all crops, C, H, W]``; Gemma 3 with pan-and-scan: ``[all views, C, H, W]``)
        is run again on each image alone, with the model's image token as its text: that gives its
        crops or views and its count."""
        pixels = np.ascontiguousarray(np.asarray(out["pixel_values"], dtype=np.float32))
        extra = {k: np.asarray(out[k]).tolist() for k in PER_IMAGE_KEYS if k in out}
        if "image_grid_thw" in out:  # all images' patches in one [patches, dim] array (Qwen2.5-VL)
            from pagedllm.multimodal_patches import patch_rows
            return patch_rows(pixels, np.asarray(out["image_grid_thw"])), extra, None, False
        if len(pixels) == len(images):  # Pixtral's counts: its rows are runs between [IMG_BREAK]s
            return list(pixels), extra, out.get("image_token_counts", None if len(images) > 1 else [-1]), False
        alone = [self._process(self.processor.image_token, [img], False, where) for img in images]
        counts = [int((np.asarray(o["input_ids"])[0] == self.image_token_id).sum()) for o in alone]
        # [1, crops, C, H, W] (Idefics3) is one image's; [views, C, H, W] (Gemma 3's pan-and-scan) its views
        pixels = [np.ascontiguousarray(np.asarray(o["pixel_values"], dtype=np.float32)) for o in alone]
        return [p[0] if p.ndim == 5 else p for p in pixels], {
            k: [np.asarray(o[k]).tolist()[0] for o in alone] for k in extra}, counts, all(p.ndim == 4 for p in pixels)

"""Images in prompts (issue 41, first part): the types a prompt's images travel in, their content
hash, and the model's own ``transformers`` processor that turns a text and its images into token ids
with the image placeholders expanded and one ``MultiModalInput`` per image.

The front end runs the processor (``engine/processor.py``); the core schedules each image's encoder
step and keys its encoder cache and the KV blocks holding its placeholders by ``MultiModalInput.hash``
(``core/encoder_cache.py``, ``core/hashing.py``); the runner runs the model's vision tower on
``pixel_values`` and writes the image's embeddings over its placeholder rows
(``worker/multimodal_step.py``).

vLLM's offline shape is followed: ``{"prompt": text, "multi_modal_data": {"image": PIL.Image | [..]}}``
with the model's image token (LLaVA's ``<image>``) in the text once per image.

Source: vLLM's multimodal inputs (``multi_modal_data``, placeholder ranges, the content hash as the
cache key) as documented; the processors are ``transformers``'.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from pagedllm.media import MediaPolicy
from pagedllm.multimodal_embeds import STAND_IN_SIZES, check_embeds, embedded

MODALITIES = ("image", "video", "audio")


@dataclass(frozen=True)
class MultiModalPrompt:
    """A text prompt with images (what ``inputs.parse_prompt`` makes of ``multi_modal_data``).

    Attributes:
        text: the prompt, with the model's image token where each image goes.
        images: the images (``PIL.Image.Image``), in prompt order.
        add_special_tokens: the processor adds the tokenizer's special tokens (BOS); a rendered chat
            template has them already (False).
        videos: the videos, ``(frames [F, H, W, 3] uint8, frames per second)`` each, in prompt order
            (``multimodal_video``).
        audios: the audio clips, ``(samples, sampling rate)`` each, in prompt order
            (``multimodal_audio.read_clip``).
    """

    text: str
    images: tuple
    add_special_tokens: bool = True
    videos: tuple = ()
    audios: tuple = ()


class MultiModalInput(msgspec.Struct, frozen=True):
    """One image of a request, as the core and the runner see it.

    Attributes:
        hash: hex SHA-256 of the image's content (mode, size, pixels): the encoder cache's key and
            part of the hash of every KV block that holds its placeholders.
        offset: position of its first placeholder token in the prompt.
        length: tokens from its first placeholder through its last (= rows of its embeddings, unless
            ``runs``).
        data: its processor output ``pixel_values`` as raw bytes; shape, dtype: theirs
            (``[C, H, W]``, ``float32``; LLaVA-NeXT: ``[patches, C, H, W]``, padded to the most
            patches of the images processed with it).
        extra: its rows of the processor's other per-image outputs the vision tower reads
            (``PER_IMAGE_KEYS``: LLaVA-NeXT's ``image_sizes``, ``[height, width]`` in pixels;
            Qwen2.5-VL's ``image_grid_thw``, its ``[t, h, w]`` patches, whose pixels are then
            ``[t * h * w, C * T * P * P]``).
        runs: ``[start, count]`` of each run of its placeholders, ``start`` from ``offset``, when they
            are several runs with other tokens between (Idefics3: one run per crop, each after its
            ``<row_i_col_j>`` text); empty: one run of ``length``.
        views: its pixels' first dimension is several views the tower takes as separate images
            (Gemma 3's pan-and-scan: the original, then its crops, each a run).
        embeds: ``data`` holds the image's embeddings, ``[rows, hidden]`` float32, given by the client
            (``image_embeds``; ``--enable-mm-embeds``): no encoder step.
        modality: ``image``, or ``video`` (Qwen-VL's patches of frame pairs: ``extra`` holds its
            ``video_grid_thw`` and ``second_per_grid_ts``), or ``audio`` (Whisper features ``[mel
            bins, frames]``: ``extra`` holds ``audio_feature_lengths``, its frames that are audio).
        pruned: rows the encoder gives beyond the placeholders, dropped by EVS
            (``--video-pruning-rate``; ``multimodal_video.retained_index``).
    """

    hash: str
    offset: int
    length: int
    data: bytes
    shape: list[int]
    dtype: str = "float32"
    extra: dict[str, list] = {}
    runs: list[list[int]] = []
    views: bool = False
    embeds: bool = False
    modality: str = "image"
    pruned: int = 0

    @property
    def end(self) -> int:
        """One past its last placeholder position."""
        return self.offset + self.length

    @property
    def rows(self) -> int:
        """Rows of its embeddings: its placeholder tokens."""
        return sum(n for _, n in self.runs) if self.runs else self.length

    def row_runs(self) -> list[tuple[int, int]]:
        """``(start from offset, count)`` of each run of its placeholders, in order."""
        return [(int(a), int(n)) for a, n in self.runs] if self.runs else [(0, self.length)]

    def pixel_values(self):
        """``[1, *shape]`` torch tensor of its pixels (a copy); ``shape`` itself for ``views`` and
        ``embeds`` (then the embeddings)."""
        import torch
        t = torch.from_numpy(np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape).copy())
        return t if self.views or self.embeds else t.unsqueeze(0)

    def group_key(self) -> tuple:
        """Images with equal keys run the vision tower as one batch: pixel shape and extras' names."""
        return tuple(self.shape), tuple(sorted(self.extra))


# the processors' per-image outputs other than pixel_values that get_image_features reads, one row per
# image (LLaVA-NeXT: each image's original [height, width], which picks its patch grid; Qwen2.5-VL:
# its patch grid [t, h, w], which also gives its M-RoPE positions)
PER_IMAGE_KEYS = ("image_sizes", "image_grid_thw")


def image_hash(image) -> str:
    """Hex SHA-256 of a PIL image's mode, size and pixel bytes (equal images, equal hashes; the file
    format and metadata do not count)."""
    h = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def read_media(data, where: str) -> tuple[tuple, tuple, tuple]:
    """The images, videos and audio clips of a prompt's ``multi_modal_data``.

    Args:
        data: ``{"image": PIL.Image | list[PIL.Image], "video": frames | list[frames]}`` (either key),
            an image also as embeddings (``--enable-mm-embeds``): a float tensor ``[rows, hidden]``
            per image or ``[images, rows, hidden]``; a video as ``[F, H, W, 3]`` uint8 frames or a list
            of PIL frames, or vLLM's ``(frames, {"fps": ...})`` pair; a clip (``"audio"``) as vLLM's
            ``(samples, sampling_rate)`` pair, or a list of them.
        where: the argument's name, for errors.
    Returns:
        ``(images, videos, audios)``: ``videos`` as ``(frames, fps)`` pairs (``MultiModalPrompt.videos``),
        ``audios`` as given (resampled by the model's processor: ``multimodal_audio.read_clip``).
    Raises:
        TypeError: not a dict, or an image that is neither a ``PIL.Image.Image`` nor a 2-D tensor.
        ValueError: a modality other than ``image`` and ``video``, no item, or a video
            ``multimodal_video.read_frames`` refuses.
    """
    from PIL import Image

    from pagedllm.multimodal_video import DEFAULT_FPS, read_frames
    if not isinstance(data, dict):
        raise TypeError(f"{where}.multi_modal_data: expected a dict such as {{'image': PIL.Image}}")
    other = sorted(set(data) - set(MODALITIES))
    if other:
        raise ValueError(f"{where}.multi_modal_data.{other[0]}: not supported (images, videos and audio only)")
    images = data.get("image")
    if _is_tensor(images) and images.dim() == 3:  # vLLM's [images, rows, hidden] embeddings
        images = list(images)
    images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    for i, img in enumerate(images):
        if not isinstance(img, Image.Image) and not (_is_tensor(img) and img.dim() == 2):
            raise TypeError(f"{where}.multi_modal_data.image[{i}]: expected a PIL.Image.Image or [rows, hidden] "
                            f"embeddings, got {type(img).__name__}")
    videos = data.get("video")
    one = videos is not None and (getattr(videos, "ndim", 0) == 4 or isinstance(videos, tuple) or (
        isinstance(videos, list) and videos and isinstance(videos[0], Image.Image)))
    videos = [] if videos is None else [videos] if one else list(videos)
    read = []
    for i, v in enumerate(videos):
        frames, meta = v if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], dict) else (v, {})
        fps = float(meta.get("fps") or DEFAULT_FPS)
        read.append((read_frames(frames, f"{where}.multi_modal_data.video[{i}]"), fps))
    audios = data.get("audio")
    audios = [] if audios is None else list(audios) if isinstance(audios, list) else [audios]
    if not images and not read and not audios:
        raise ValueError(f"{where}.multi_modal_data: no image, video or audio")
    return tuple(images), tuple(read), tuple(audios)


def _is_tensor(x) -> bool:
    import torch
    return isinstance(x, torch.Tensor)


def _whole_prompt(m: MultiModalInput, ids: list[int]) -> MultiModalInput:
    """A prefix-LM's last image extended to the prompt's end: its placeholders become its only run, its
    span (scheduled in one step, hashed into every block it covers) the rest of the prompt, and its hash
    takes every prompt token, since each prompt token's K/V depends on the whole prompt."""
    digest = hashlib.sha256(m.hash.encode() + np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()
    return msgspec.structs.replace(m, hash=digest, length=len(ids) - m.offset, runs=[list(r) for r in m.row_runs()])


def _group_runs(runs: list[tuple[int, int]], counts: list[int] | None,
                n_images: int) -> list[list[tuple[int, int]]] | None:
    """The prompt's placeholder runs per image: one each (``counts`` ``None``), all of them for a
    single image (``[-1]``), or consecutive placeholders adding up to each image's count (a run split
    where images' placeholders touch: ``<image><image>``); ``None`` when they do not fit."""
    if counts is None:
        return [[r] for r in runs] if len(runs) == n_images else None
    if counts == [-1]:
        return [list(runs)] if runs and n_images == 1 else None
    groups, rest = [], list(runs)
    for want in counts:
        group, got = [], 0
        while got < want and rest:
            start, n = rest.pop(0)
            take = min(n, want - got)
            group.append((start, take))
            got += take
            if take < n:
                rest.insert(0, (start + take, n - take))
        if got != want:
            return None
        groups.append(group)
    return groups if not rest else None


def placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of every maximal run of ``token_id`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


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
            to the prompt's end and its hash takes the prompt's tokens (``_whole_prompt``).
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
        self.prefix_lm = prefix_lm
        self.embeds_width = embeds_width
        self._fixed: bool | None = None  # whether the placeholder count is the same for every image
        from transformers import AutoProcessor

        from pagedllm.multimodal_patches import (PATCH_PROCESSOR_TOKENS, PatchTokenProcessor, PixtralTokenProcessor,
                                                 smolvlm_processor)
        try:
            if model_type in PATCH_PROCESSOR_TOKENS:
                self.processor = PatchTokenProcessor(model_dir, PATCH_PROCESSOR_TOKENS[model_type])
            elif model_type == "mistral3":
                self.processor = PixtralTokenProcessor(model_dir)
            elif model_type == "smolvlm":
                self.processor = smolvlm_processor(model_dir)
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
        given = {i: img for i, img in enumerate(images) if _is_tensor(img)}  # image embeddings
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
        groups = _group_runs(runs, counts, len(images))
        if groups is None and counts is None and len(images) > 1:  # touching images' placeholders: one run
            groups = _group_runs(runs, self._counts_alone(images, where), len(images))
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
            inputs[-1] = _whole_prompt(inputs[-1], ids)
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
            raise ValueError(f"{where}.video: this model takes no video (video-text models: Qwen2-VL, Qwen2.5-VL)")
        if len(videos) > self.video.limit:
            raise ValueError(f"{where}: {len(videos)} videos, more than --limit-mm-per-prompt allows "
                             f"({self.video.limit})")

    def _video_inputs(self, out: dict, ids: list[int], videos: tuple, where: str) -> list[MultiModalInput]:
        """One ``MultiModalInput`` per video (``modality`` ``video``) from the processor's output.

        Raises:
            ValueError: the text's video placeholder runs are not one per video.
        """
        from pagedllm.multimodal_patches import patch_rows
        from pagedllm.multimodal_video import video_hash
        runs = placeholder_runs(ids, self.video.token_id)
        if len(runs) != len(videos):
            raise ValueError(f"{where}: the text places {len(runs)} video runs for {len(videos)} videos (put "
                             f"the model's video token once per video)")
        grids = np.asarray(out["video_grid_thw"])
        rows = patch_rows(np.ascontiguousarray(out["pixel_values_videos"], dtype=np.float32), grids)
        full = out["video_rows"]  # rows each video's encoder output has, before EVS
        return [MultiModalInput(video_hash(frames, fps), off, n, px.tobytes(), list(px.shape),
                                extra={"video_grid_thw": grid.tolist(), "second_per_grid_ts": [float(sec)]},
                                modality="video", pruned=int(whole) - n)
                for (frames, fps), (off, n), px, grid, sec, whole in zip(videos, runs, rows, grids,
                                                                         out["second_per_grid_ts"], full)]

    def _clips(self, audios: tuple, where: str) -> tuple:
        """The prompt's clips as ``[samples]`` float32 at the feature extractor's rate.

        Raises:
            ValueError: the model takes no audio, more clips than the limit, or a clip ``read_clip`` refuses.
        """
        from pagedllm.multimodal_audio import read_clip
        if self.audio is None:
            raise ValueError(f"{where}.audio: this model takes no audio (audio-text models: Qwen2-Audio)")
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
        runs = placeholder_runs(ids, self.audio.token_id)
        if len(runs) != len(clips):
            raise ValueError(f"{where}: the text places {len(runs)} audio runs for {len(clips)} clips (put "
                             f"{self.audio.placeholder} once per clip)")
        feats = np.ascontiguousarray(out["input_features"], dtype=np.float32)
        lengths = np.asarray(out["feature_attention_mask"]).sum(-1)
        return [MultiModalInput(clip_hash(c), off, n, f.tobytes(), list(f.shape),
                                extra={"audio_feature_lengths": [int(k)]}, modality="audio")
                for c, (off, n), f, k in zip(clips, runs, feats, lengths)]

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


def block_keys(mm_inputs, start: int, end: int) -> tuple[str, ...]:
    """The hashes of the images whose placeholders overlap token positions ``[start, end)`` (the extra
    keys of that KV block's hash), in prompt order."""
    return tuple(m.hash for m in mm_inputs if m.offset < end and m.end > start)

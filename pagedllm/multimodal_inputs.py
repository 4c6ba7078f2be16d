"""The types a prompt's images, videos and audio travel in (issue 41, 42): ``MultiModalPrompt`` (what the
front end reads from ``multi_modal_data`` and chat parts), ``MultiModalInput`` (one item as the core and
the runner see it), an image's content hash, the prompt's placeholder runs, and each KV block's extra
hash keys.

Source: vLLM's multimodal inputs (``multi_modal_data``, placeholder ranges, the content hash as the
cache key) as documented.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgspec
import numpy as np

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


@dataclass(frozen=True)
class PreparedPrompt:
    r"""A prompt already through the model's processor: a realtime stream's next request
    (``multimodal_voxtral_realtime.RealtimeStream``), its token ids and its inputs as the core takes them.

    Attributes:
        ids: the prompt's token ids.
        inputs: its ``MultiModalInput``\ s, in position order.
    """

    ids: tuple
    inputs: tuple


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
            ``<row_i_col_j>`` text; Qwen3-VL's videos: one run per frame pair, each after its
            ``<t seconds>`` text); empty: one run of ``length``.
        views: its pixels' first dimension is several views the tower takes as separate images
            (Gemma 3's pan-and-scan: the original, then its crops, each a run).
        embeds: ``data`` holds the image's embeddings, ``[rows, hidden]`` float32, given by the client
            (``image_embeds``; ``--enable-mm-embeds``): no encoder step.
        modality: ``image``, or ``video`` (Qwen-VL's patches of frame pairs: ``extra`` holds its
            ``video_grid_thw`` and ``second_per_grid_ts``), or ``audio`` (Whisper features ``[mel
            bins, frames]``: ``extra`` holds ``audio_feature_lengths``, its frames that are audio;
            Voxtral's ``[chunks, mel bins, 3000]``: ``extra`` holds ``audio_chunks``).
        pruned: rows the encoder gives beyond the placeholders, dropped by EVS
            (``--video-pruning-rate``; ``multimodal_video.retained_index``).
        additive: its rows are added to the token embeddings of the positions it covers, prompt and
            generated tokens alike, rather than written over placeholders (Voxtral Realtime's audio
            embedding of every step: ``multimodal_voxtral_realtime``; ``offset + length`` may then lie
            past the prompt).
        open: an additive input whose audio goes on (a realtime stream's last segment so far): every one
            of its rows is computed, so the request may sample one token more than when it is the last.
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
    additive: bool = False
    open: bool = False

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
    if is_tensor(images) and images.dim() == 3:  # vLLM's [images, rows, hidden] embeddings
        images = list(images)
    images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    for i, img in enumerate(images):
        if not isinstance(img, Image.Image) and not (is_tensor(img) and img.dim() == 2):
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


def is_tensor(x) -> bool:
    import torch
    return isinstance(x, torch.Tensor)


def whole_prompt(m: MultiModalInput, ids: list[int]) -> MultiModalInput:
    """A prefix-LM's last image extended to the prompt's end: its placeholders become its only run, its
    span (scheduled in one step, hashed into every block it covers) the rest of the prompt, and its hash
    takes every prompt token, since each prompt token's K/V depends on the whole prompt."""
    digest = hashlib.sha256(m.hash.encode() + np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()
    return msgspec.structs.replace(m, hash=digest, length=len(ids) - m.offset, runs=[list(r) for r in m.row_runs()])


def group_runs(runs: list[tuple[int, int]], counts: list[int] | None,
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


def block_keys(mm_inputs, start: int, end: int) -> tuple[str, ...]:
    """The hashes of the images whose placeholders overlap token positions ``[start, end)`` (the extra
    keys of that KV block's hash), in prompt order."""
    return tuple(m.hash for m in mm_inputs if m.offset < end and m.end > start)

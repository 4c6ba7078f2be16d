"""Video in prompts (issue 42, first part): a video's frames, their content hash, Qwen2-VL's,
Qwen2.5-VL's and Qwen3-VL's video patches, Qwen3-VL's frame-group timestamps, and efficient video
sampling (EVS: vLLM's ``--video-pruning-rate``; Qwen2-VL, Qwen2.5-VL and Qwen3-VL).

A video reaches the model as Qwen-VL's image patches do, with time as the grid's first axis: frames
resized to one multiple of ``patch_size * merge_size`` (the image processor's ``smart_resize`` rule and
pixel bounds), rescaled and normalized as its images, padded to a multiple of ``temporal_patch_size``
by repeating the last frame, and cut into ``[t * h * w, C * T * P * P]`` patches, each pair of frames
one temporal patch. The model's own ``get_video_features`` encodes them (one row per ``merge_size ** 2``
patches of a temporal step) and ``get_rope_index`` places them.

EVS drops the fraction ``rate`` of a video's rows that change least from the row at the same place of
the previous temporal step (cosine similarity of their embeddings); the first step is kept whole. The
number kept is known before the encoder runs (``retained_rows``), so the prompt holds that many
placeholders; which rows survive is decided on the embeddings (``retained_index``) and the kept rows
keep the 3-D rotary positions they had in the whole video.

Qwen3-VL reads a video as one placeholder run per temporal step (frame group), each after the text of
its time (``<0.2 seconds>``: the mean of its frames' times, frame ``i`` at ``i / fps``) and between
``<|vision_start|>`` and ``<|vision_end|>``; its ``get_rope_index`` places each group as an image of
its own at the text position it reaches. Its frames are resized by the video processor's rule
(``video_preprocessor_config.json``: pixel bounds on all frames together), by PIL as for Qwen2-VL
(transformers' resize is torchvision's); the frames are taken as given, already sampled (its
processor's own ``fps`` resampling is not applied). EVS on Qwen3-VL keeps a count per group fixed
before the encoder runs, since the prompt writes each group's placeholders after its time
(``retained_per_step``: the first group whole, the rest of the retained count spread evenly over
the others), and picks within each group the rows that change most from the previous group's.

Sources: transformers' ``Qwen2VLVideoProcessor`` (patch order, temporal padding) and
``Qwen2_5_VLProcessor`` (``second_per_grid_ts``); ``Qwen3VLVideoProcessor`` (``smart_resize`` over
frames, ``cap_pixels_per_frame``) and Qwen's ``Qwen3VLProcessor`` (``_calculate_timestamps``, the
placeholder: transformers 4.57's, which replaces the chat template's whole
``<|vision_start|><|video_pad|><|vision_end|>`` as vLLM does); the EVS paper (Bagrov et al., 2025,
arXiv:2510.14624) and vLLM's ``--video-pruning-rate`` as documented (the retained count, the first
frame kept).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_FPS = 2.0  # frames per second assumed for frames given without one (Qwen-VL's sampling rate)
# model types whose videos are served (EVS may prune them all)
VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Qwen3VLVideoProcessor's defaults (transformers), for a model directory without video_preprocessor_config.json
QWEN3_VIDEO_DEFAULTS = {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "patch_size": 16,
                        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                        "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255, "do_rescale": True,
                        "do_normalize": True, "resample": 3, "cap_pixels_per_frame": False, "max_video_tokens": 768}


@dataclass(frozen=True)
class VideoOptions:
    """How a video-text model takes videos.

    Attributes:
        token_id: the placeholder token a video's rows go over (``config.video_token_id``).
        limit: most videos in one prompt (``--limit-mm-per-prompt``'s ``video``).
        pruning_rate: EVS's fraction of video rows dropped (``--video-pruning-rate``; 0: none).
    """

    token_id: int
    limit: int
    pruning_rate: float = 0.0


def video_options(hf_config, limit: int, pruning_rate: float) -> VideoOptions | None:
    """The ``VideoOptions`` of a model (``None``: it takes no video).

    Raises:
        ValueError: ``pruning_rate`` (``--video-pruning-rate``) for a model that takes no video.
    """
    model_type = getattr(hf_config, "model_type", None)
    if pruning_rate and model_type not in VIDEO_MODEL_TYPES:
        raise ValueError("--video-pruning-rate: this model takes no video")
    return VideoOptions(hf_config.video_token_id, limit, pruning_rate) if model_type in VIDEO_MODEL_TYPES else None


def read_frames(video, where: str) -> np.ndarray:
    """``[F, H, W, 3]`` uint8 frames of a ``multi_modal_data`` video.

    Args:
        video: a list of ``PIL.Image.Image`` frames, or an array / tensor ``[F, H, W, 3]`` uint8
            (vLLM's shape).
        where: the field's name, for errors.
    Raises:
        ValueError: no frames, frames of different sizes, or another shape or dtype.
    """
    from PIL import Image
    if isinstance(video, (list, tuple)) and video and all(isinstance(f, Image.Image) for f in video):
        sizes = {f.size for f in video}
        if len(sizes) > 1:
            raise ValueError(f"{where}: frames of different sizes {sorted(sizes)}")
        video = np.stack([np.asarray(f.convert("RGB")) for f in video])
    if hasattr(video, "numpy"):
        video = video.numpy()
    if not isinstance(video, np.ndarray) or video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8:
        raise ValueError(f"{where}: expected a list of PIL images or a uint8 array [frames, height, width, 3]")
    if not len(video) or min(video.shape[1:3]) < 1:
        raise ValueError(f"{where}: a video with no frames")
    return np.ascontiguousarray(video)


def video_hash(frames: np.ndarray, fps: float) -> str:
    """Hex SHA-256 of a video's frame shape, frame rate and pixels (the encoder cache's key)."""
    h = hashlib.sha256(f"video:{'x'.join(map(str, frames.shape))}:{fps}:".encode())
    h.update(frames.tobytes())
    return h.hexdigest()


def _smart_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Height and width rounded to multiples of ``factor`` with their product within the bounds, the
    aspect ratio kept (Qwen-VL's ``smart_resize`` rule)."""
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def qwen3_video_settings(model_dir: str | Path) -> dict:
    """Qwen3-VL's video processor settings: ``video_preprocessor_config.json``'s keys over
    ``QWEN3_VIDEO_DEFAULTS`` (``size`` as ``shortest_edge`` / ``longest_edge``: pixels of all frames
    together).

    Raises:
        ValueError: the file is not JSON.
    """
    path = Path(model_dir) / "video_preprocessor_config.json"
    try:
        given = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    return {**QWEN3_VIDEO_DEFAULTS, **{k: v for k, v in given.items() if k in QWEN3_VIDEO_DEFAULTS and v is not None}}


def _qwen3_size(frames: int, height: int, width: int, video: dict) -> tuple[int, int]:
    """A video's frame height and width under Qwen3-VL's rule: multiples of ``patch_size *
    merge_size`` with ``frames * height * width`` within ``size``'s bounds (capped per frame with
    ``cap_pixels_per_frame``).

    Raises:
        ValueError: an aspect ratio over 200.
    Source: transformers' ``qwen3_vl`` ``smart_resize`` and ``Qwen3VLVideoProcessor.resize``.
    """
    factor, tp = int(video["patch_size"]) * int(video["merge_size"]), int(video["temporal_patch_size"])
    lo, hi = int(video["size"]["shortest_edge"]), int(video["size"]["longest_edge"])
    if video.get("cap_pixels_per_frame"):
        hi = max(min(int(video["max_video_tokens"]) * factor * factor, hi // frames), int(lo * 1.05)) * frames
    frames = max(frames, tp)  # one frame: counted as the temporal patch it is repeated into
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video's aspect ratio must be under 200, got {max(height, width) / min(height, width)}")
    h, w, t = round(height / factor) * factor, round(width / factor) * factor, round(frames / tp) * tp
    if t * h * w > hi:
        beta = math.sqrt(frames * height * width / hi)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < lo:
        beta = math.sqrt(lo / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def qwen_video_patches(frames: np.ndarray, image_processor, video: dict | None = None) -> tuple[np.ndarray, list[int]]:
    """A video's patches as Qwen2-VL's (``video``: Qwen3-VL's) video processor makes them.

    Args:
        frames: ``[F, H, W, 3]`` uint8.
        image_processor: the model's Qwen-VL image processor (its patch, merge and temporal patch
            sizes, pixel bounds per frame, resampling, rescale factor, mean and std).
        video: Qwen3-VL's video settings (``qwen3_video_settings``), taken instead of the image
            processor's, with its resize rule (``_qwen3_size``).
    Returns:
        ``(pixel_values_videos [t * h * w, 3 * T * P * P] float32, video_grid_thw [t, h, w])``.
    Raises:
        ValueError: (Qwen3-VL) an aspect ratio over 200.
    """
    from PIL import Image
    ip = video if video is not None else {k: getattr(image_processor, k) for k in (
        "patch_size", "merge_size", "temporal_patch_size", "resample", "rescale_factor", "do_rescale", "do_normalize",
        "image_mean", "image_std")}
    p, m, tp = int(ip["patch_size"]), int(ip["merge_size"]), int(ip["temporal_patch_size"])
    if video is not None:
        h, w = _qwen3_size(len(frames), frames.shape[1], frames.shape[2], video)
    else:
        size = image_processor.size
        lo = getattr(size, "shortest_edge", None) or getattr(image_processor, "min_pixels", None) or 56 * 56
        hi = getattr(size, "longest_edge", None) or getattr(image_processor, "max_pixels", None) or 28 * 28 * 1280
        h, w = _smart_size(frames.shape[1], frames.shape[2], p * m, int(lo), int(hi))
    resized = np.stack([np.asarray(Image.fromarray(f).resize((w, h), resample=int(ip["resample"] or 3)))
                        for f in frames]).astype(np.float32)
    x = resized * float(ip["rescale_factor"]) if ip["do_rescale"] else resized
    if ip["do_normalize"]:
        x = (x - np.asarray(ip["image_mean"], np.float32)) / np.asarray(ip["image_std"], np.float32)
    x = x.transpose(0, 3, 1, 2)  # [F, C, H, W]
    if pad := -len(x) % tp:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    t, gh, gw = len(x) // tp, h // p, w // p
    x = x.reshape(t, tp, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(t * gh * gw, 3 * tp * p * p), dtype=np.float32), [t, gh, gw]


def group_seconds(n_frames: int, fps: float, temporal_patch_size: int) -> list[float]:
    """Qwen3-VL's time of each frame group (temporal patch) of ``n_frames`` frames at ``fps``: frame
    ``i`` at ``i / fps``, the last repeated up to a whole group, each group at its first and last
    frames' mean. Source: Qwen's ``Qwen3VLProcessor._calculate_timestamps``."""
    t = [i / fps for i in list(range(n_frames)) + [n_frames - 1] * (-n_frames % temporal_patch_size)]
    return [(t[i] + t[i + temporal_patch_size - 1]) / 2 for i in range(0, len(t), temporal_patch_size)]


def retained_rows(grid: list[int], merge: int, rate: float) -> int:
    """Rows (placeholders) of a video ``grid`` ``[t, h, w]`` kept by EVS at pruning ``rate``: the
    fraction ``1 - rate`` of all rows, never fewer than one temporal step's."""
    per_step = grid[1] * grid[2] // (merge * merge)
    total = grid[0] * per_step
    return total if rate <= 0 else max(per_step, int(total * (1 - rate)))


def retained_per_step(grid: list[int], merge: int, rate: float) -> list[int]:
    """Rows kept by EVS in each temporal step of a video ``grid`` ``[t, h, w]`` when each step's count
    is written into the prompt (Qwen3-VL): the first step whole, the rest of ``retained_rows`` spread
    evenly over the other steps (the earlier ones take the remainder), each at least one row (a frame
    group's time is never left without its frame) and at most a whole step."""
    per_step = grid[1] * grid[2] // (merge * merge)
    t = int(grid[0])
    rest = max(retained_rows(grid, merge, rate) - per_step, t - 1)
    if t == 1:
        return [per_step]
    base, extra = divmod(rest, t - 1)
    return [per_step] + [min(per_step, base + (i < extra)) for i in range(t - 1)]


def retained_index(rows, grid: list[int], keep: int, per_step: list[int] | None = None):
    """Which of a video's embedding rows EVS keeps.

    Args:
        rows: ``[t * s, D]`` float tensor, the video's embeddings, temporal step after step (``s``
            rows each).
        grid: its ``[t, h, w]`` patch grid (``t`` temporal steps).
        keep: rows to keep (``retained_rows``).
        per_step: rows to keep in each step (``retained_per_step``: Qwen3-VL), the choice then made
            within each step; ``None``: over the whole video.
    Returns:
        ``[keep]`` int64 tensor of kept row indices in ascending order: the first step's rows, then
        those whose cosine similarity to the same row of the previous step is lowest (ties: earlier).
    """
    import torch
    t = int(grid[0])
    x = rows.float().reshape(t, -1, rows.shape[-1])
    sim = torch.nn.functional.cosine_similarity(x[1:], x[:-1], dim=-1)  # [t - 1, s]
    change = torch.cat([torch.full_like(x[:1, :, 0], float("inf")), 1 - sim])
    if per_step is not None:
        s = x.shape[1]
        return torch.cat([torch.sort(-change[i], stable=True).indices[:k].sort().values + i * s
                          for i, k in enumerate(per_step)])
    order = torch.sort(-change.reshape(-1), stable=True).indices[:keep]
    return order.sort().values

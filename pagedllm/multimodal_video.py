"""Video in prompts (issue 42, first part): a video's frames, their content hash, Qwen2-VL's and
Qwen2.5-VL's video patches, and efficient video sampling (EVS: vLLM's ``--video-pruning-rate``).

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

Sources: transformers' ``Qwen2VLVideoProcessor`` (patch order, temporal padding) and
``Qwen2_5_VLProcessor`` (``second_per_grid_ts``); the EVS paper (Bagrov et al., 2025,
arXiv:2510.14624) and vLLM's ``--video-pruning-rate`` as documented (the retained count, the first
frame kept).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

DEFAULT_FPS = 2.0  # frames per second assumed for frames given without one (Qwen-VL's sampling rate)
# model types whose videos are served (Qwen3-VL's processor also writes each frame's timestamp: not yet)
VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


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


def qwen_video_patches(frames: np.ndarray, image_processor) -> tuple[np.ndarray, list[int]]:
    """A video's patches as Qwen2-VL's video processor makes them.

    Args:
        frames: ``[F, H, W, 3]`` uint8.
        image_processor: the model's Qwen-VL image processor (its patch, merge and temporal patch
            sizes, pixel bounds, resampling, rescale factor, mean and std).
    Returns:
        ``(pixel_values_videos [t * h * w, 3 * T * P * P] float32, video_grid_thw [t, h, w])``.
    """
    from PIL import Image
    ip = image_processor
    p, m, tp = int(ip.patch_size), int(ip.merge_size), int(ip.temporal_patch_size)
    size = ip.size
    lo = getattr(size, "shortest_edge", None) or getattr(ip, "min_pixels", None) or 56 * 56
    hi = getattr(size, "longest_edge", None) or getattr(ip, "max_pixels", None) or 28 * 28 * 1280
    h, w = _smart_size(frames.shape[1], frames.shape[2], p * m, int(lo), int(hi))
    resized = np.stack([np.asarray(Image.fromarray(f).resize((w, h), resample=int(ip.resample or 3)))
                        for f in frames]).astype(np.float32)
    x = resized * float(ip.rescale_factor) if ip.do_rescale else resized
    if ip.do_normalize:
        x = (x - np.asarray(ip.image_mean, np.float32)) / np.asarray(ip.image_std, np.float32)
    x = x.transpose(0, 3, 1, 2)  # [F, C, H, W]
    if pad := -len(x) % tp:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    t, gh, gw = len(x) // tp, h // p, w // p
    x = x.reshape(t, tp, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(t * gh * gw, 3 * tp * p * p), dtype=np.float32), [t, gh, gw]


def retained_rows(grid: list[int], merge: int, rate: float) -> int:
    """Rows (placeholders) of a video ``grid`` ``[t, h, w]`` kept by EVS at pruning ``rate``: the
    fraction ``1 - rate`` of all rows, never fewer than one temporal step's."""
    per_step = grid[1] * grid[2] // (merge * merge)
    total = grid[0] * per_step
    return total if rate <= 0 else max(per_step, int(total * (1 - rate)))


def retained_index(rows, grid: list[int], keep: int):
    """Which of a video's embedding rows EVS keeps.

    Args:
        rows: ``[t * s, D]`` float tensor, the video's embeddings, temporal step after step (``s``
            rows each).
        grid: its ``[t, h, w]`` patch grid (``t`` temporal steps).
        keep: rows to keep (``retained_rows``).
    Returns:
        ``[keep]`` int64 tensor of kept row indices in ascending order: the first step's rows, then
        those whose cosine similarity to the same row of the previous step is lowest (ties: earlier).
    """
    import torch
    t = int(grid[0])
    x = rows.float().reshape(t, -1, rows.shape[-1])
    sim = torch.nn.functional.cosine_similarity(x[1:], x[:-1], dim=-1)  # [t - 1, s]
    change = torch.cat([torch.full_like(x[:1, :, 0], float("inf")), 1 - sim]).reshape(-1)
    order = torch.sort(-change, stable=True).indices[:keep]
    return order.sort().values

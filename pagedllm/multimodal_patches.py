"""The processors of image-text models whose ``transformers`` processor cannot be built here (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Pixtral / Mistral 3, SmolVLM2; issue 41), built from the model's image processor
and tokenizer.

Why ours: ``transformers``' ``Qwen2_5_VLProcessor`` and ``SmolVLMProcessor`` also build a video
processor, and its ``PixtralProcessor`` is marked as needing torchvision; the registry's torchvision is a CUDA build
that does not load beside the CPU torch installed here. The image processor alone
(``AutoImageProcessor``: its PIL backend without torchvision) does the resizing and patching; what
the processor adds is the placeholder expansion, done here as it does it: Qwen's image token becomes
``prod(image_grid_thw) / merge_size**2`` of them, Pixtral's ``[IMG]`` a row of ``[IMG]`` per patch
row, each row ended by ``[IMG_BREAK]`` and the last by ``[IMG_END]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# model types whose processor this module stands in for: (the text that stands for one image, as
# their chat template writes it; the token in it that the processor repeats once per image row)
_QWEN = ("<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>")
PATCH_PROCESSOR_TOKENS = {"qwen2_vl": _QWEN, "qwen2_5_vl": _QWEN, "qwen3_vl": _QWEN}
_VIDEO_PAD = "<|video_pad|>"  # Qwen-VL's video placeholder, repeated once per row of the video


def _split_at(text: str, token: str, n_images: int) -> list[str]:
    """``text`` cut at each ``token`` (one per image).

    Raises:
        ValueError: the text has another number of ``token`` than ``n_images``.
    """
    pieces = text.split(token)
    if len(pieces) - 1 != n_images:
        raise ValueError(f"the text has {len(pieces) - 1} {token} tokens but {n_images} images were given")
    return pieces


class PatchTokenProcessor:
    """``processor(text=..., images=..., return_tensors="np")`` of a patch-grid model.

    Args:
        model_dir: the model directory (tokenizer and ``preprocessor_config.json``).
        tokens: ``PATCH_PROCESSOR_TOKENS``' pair: ``image_token`` (what a prompt writes per image:
            ``Processor.image_placeholder``) and ``pad_token`` (what is repeated).
        model_type: the model's ``config.model_type``; ``qwen3_vl``: videos as timestamped frame
            groups (``multimodal_video``), with its video processor's settings.
    Raises:
        OSError, ValueError: from ``transformers`` when the directory lacks either part.
    Source: transformers' ``Qwen2_5_VLProcessor.__call__`` (the placeholder expansion); Qwen's
    ``Qwen3VLProcessor.__call__`` (4.57: a video's timestamped groups).
    """

    def __init__(self, model_dir: str | Path, tokens: tuple[str, str], model_type: str | None = None) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
        self.image_token, self.pad_token = tokens
        self.video_token = self.image_token.replace(self.pad_token, _VIDEO_PAD)  # Qwen-VL's video placeholder
        self.merge = int(getattr(self.image_processor, "merge_size", 2))
        self.video_settings = None  # Qwen3-VL's video processor settings (timestamped frame groups)
        if model_type == "qwen3_vl":
            from pagedllm.multimodal_video import qwen3_video_settings
            self.video_settings = qwen3_video_settings(model_dir)

    def __call__(self, text: str, images: list | None = None, return_tensors: str = "np",
                 add_special_tokens: bool = True, videos: tuple = (), video_pruning_rate: float = 0.0,
                 **image_kwargs) -> dict:
        """``{"input_ids": [1, L] int64, "pixel_values": [patches, C * T * P * P] float32 (all images'
        patches, image after image), "image_grid_thw": [N, 3] int64}`` (the last two only with images);
        ``image_kwargs`` go to the image processor (``--mm-processor-kwargs``: ``max_pixels``).

        With ``videos`` (``(frames [F, H, W, 3] uint8, fps)`` each; ``multimodal_video``) also
        ``pixel_values_videos`` (all videos' patches), ``video_grid_thw`` ``[V, 3]``,
        ``second_per_grid_ts`` ``[V]`` (seconds per temporal patch), ``video_rows`` ``[V]`` (rows
        of each video's encoder output) and ``video_tokens`` ``[V]`` (its placeholders); each video
        token becomes the rows EVS keeps at ``video_pruning_rate`` (all at 0); Qwen3-VL's (the chat
        template's ``<|vision_start|><|video_pad|><|vision_end|>`` whole, where it is so) becomes
        one ``<t seconds><|vision_start|>`` run ``<|vision_end|>`` per frame group (``_timestamped``; with EVS
        each group's count is ``multimodal_video.retained_per_step``'s).

        Raises:
            ValueError: the text's placeholder count differs from the images' or the videos'.
        """
        images = list(images or [])
        pieces = _split_at(text, self.pad_token, len(images))
        out: dict = {}
        if images:
            pixels = self.image_processor(images=images, return_tensors="np", **image_kwargs)
            out["pixel_values"] = np.asarray(pixels["pixel_values"], dtype=np.float32)
            out["image_grid_thw"] = np.asarray(pixels["image_grid_thw"], dtype=np.int64)
            counts = out["image_grid_thw"].prod(-1) // self.merge**2
            text = pieces[0] + "".join(self.pad_token * int(c) + rest for c, rest in zip(counts, pieces[1:]))
        if videos:
            text = self._videos(text, videos, video_pruning_rate, out)
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        out["input_ids"] = np.asarray([ids], dtype=np.int64)
        return out

    def _videos(self, text: str, videos: tuple, rate: float, out: dict) -> str:
        """``text`` with each ``<|video_pad|>`` expanded to its video's kept rows; the videos' arrays
        into ``out`` (``__call__``)."""
        from pagedllm.multimodal_video import qwen_video_patches, retained_per_step, retained_rows
        pieces = _split_at(text, _VIDEO_PAD, len(videos))
        patches = [qwen_video_patches(frames, self.image_processor, self.video_settings) for frames, _ in videos]
        out["pixel_values_videos"] = np.concatenate([p for p, _ in patches])
        out["video_grid_thw"] = np.asarray([g for _, g in patches], dtype=np.int64)
        out["second_per_grid_ts"] = np.asarray([self.image_processor.temporal_patch_size / fps for _, fps in videos])
        out["video_rows"] = out["video_grid_thw"].prod(-1) // self.merge**2
        kept = [retained_per_step(g, self.merge, rate) for _, g in patches]  # Qwen3-VL: a count per frame group
        counts = [sum(k) if self.video_settings is not None else retained_rows(g, self.merge, rate)
                  for k, (_, g) in zip(kept, patches)]
        out["video_tokens"] = np.asarray(counts, dtype=np.int64)
        if self.video_settings is not None:  # each group's count written after its time
            return self._timestamped(pieces, kept, [(len(f), fps) for f, fps in videos])
        return pieces[0] + "".join(_VIDEO_PAD * c + rest for c, rest in zip(counts, pieces[1:]))

    def _timestamped(self, pieces: list[str], kept: list[list[int]], timing: list[tuple[int, float]]) -> str:
        """Qwen3-VL's text of the videos between ``pieces`` (``kept``: each video's placeholders per frame
        group, ``h * w / merge**2`` each without EVS; ``timing``: their frame counts and fps): per frame
        group ``<t seconds>`` (one decimal; ``multimodal_video.group_seconds``), ``<|vision_start|>``,
        its placeholders, ``<|vision_end|>``; a video written between ``<|vision_start|>`` and
        ``<|vision_end|>`` replaces them too. Source: Qwen's ``Qwen3VLProcessor.__call__`` (4.57)."""
        from pagedllm.multimodal_video import group_seconds
        start, end = self.video_token.split(_VIDEO_PAD)
        tp = int(self.video_settings["temporal_patch_size"])
        text = pieces[0]
        for counts, (n, fps), rest in zip(kept, timing, pieces[1:]):
            if text.endswith(start) and rest.startswith(end):
                text, rest = text[:-len(start)], rest[len(end):]
            text += "".join(f"<{s:.1f} seconds>{start}{_VIDEO_PAD * c}{end}"
                            for s, c in zip(group_seconds(n, fps, tp), counts)) + rest
        return text


def patch_rows(pixels: np.ndarray, grid: np.ndarray) -> list[np.ndarray]:
    """Each image's ``[t * h * w, dim]`` rows of a processor's flattened ``pixel_values``."""
    return np.split(pixels, np.cumsum(grid.prod(-1))[:-1])


class PixtralTokenProcessor:
    """``processor(text=..., images=..., return_tensors="np")`` of Pixtral / Mistral 3.

    Args:
        model_dir: the model directory: tokenizer, ``preprocessor_config.json`` and the processor's
            ``processor_config.json`` (``patch_size``, ``spatial_merge_size``, ``image_token``,
            ``image_break_token``, ``image_end_token``; absent keys: ``config.json``'s vision
            patch size and merge size, Pixtral's token names).
    Raises:
        OSError, ValueError: from ``transformers`` when the directory lacks a part.
    Source: transformers' ``PixtralProcessor`` (``replace_image_token``).
    """

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer
        model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
        cfg = json.loads((model_dir / "config.json").read_text())
        pc = model_dir / "processor_config.json"
        pc = json.loads(pc.read_text()) if pc.is_file() else {}
        self.patch = int(pc.get("patch_size", cfg.get("vision_config", {}).get("patch_size", 16)))
        self.patch *= int(pc.get("spatial_merge_size", cfg.get("spatial_merge_size", 1)))
        self.image_token = pc.get("image_token", "[IMG]")
        self.break_token = pc.get("image_break_token", "[IMG_BREAK]")
        self.end_token = pc.get("image_end_token", "[IMG_END]")

    def __call__(self, text: str, images: list | None = None, return_tensors: str = "np",
                 add_special_tokens: bool = True, **image_kwargs) -> dict:
        """``{"input_ids": [1, L] int64, "pixel_values": [N, C, H, W] float32 (padded to the largest),
        "image_sizes": [N, 2] int64 (each image's resized height and width), "image_token_counts":
        [N]}`` (the last three only with images).

        Raises:
            ValueError: the text's placeholder count differs from the images'.
        """
        images = list(images or [])
        pieces = _split_at(text, self.image_token, len(images))
        out: dict = {}
        if images:
            pixels = self.image_processor(images=images, return_tensors="np", **{**image_kwargs, "patch_size": self.patch})
            out["pixel_values"] = np.asarray(pixels["pixel_values"], dtype=np.float32)
            out["image_sizes"] = np.asarray(pixels["image_sizes"], dtype=np.int64)
            grids = [(int(h) // self.patch, int(w) // self.patch) for h, w in out["image_sizes"]]
            out["image_token_counts"] = [h * w for h, w in grids]
            rows = [((self.image_token * w + self.break_token) * h)[:-len(self.break_token)] + self.end_token
                    for h, w in grids]
            text = pieces[0] + "".join(r + rest for r, rest in zip(rows, pieces[1:]))
        out["input_ids"] = np.asarray([self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]],
                                      dtype=np.int64)
        return out


def smolvlm_processor(model_dir: str | Path):
    """SmolVLM2's processor for images: ``transformers``' ``SmolVLMProcessor`` also builds a video
    processor (torchvision); its image placeholder expansion is ``Idefics3Processor``'s, line for line
    (crops as ``<row_i_col_j>`` runs, then the global view), so that class runs with SmolVLM's image
    processor and ``processor_config.json``'s ``image_seq_len``.

    Raises:
        OSError, ValueError: from ``transformers`` when the directory lacks a part.
    """
    from transformers import AutoImageProcessor, AutoTokenizer, Idefics3Processor
    model_dir = Path(model_dir)
    pc = model_dir / "processor_config.json"
    seq_len = json.loads(pc.read_text()).get("image_seq_len", 169) if pc.is_file() else 169
    return Idefics3Processor(image_processor=AutoImageProcessor.from_pretrained(str(model_dir)),
                             tokenizer=AutoTokenizer.from_pretrained(str(model_dir)), image_seq_len=int(seq_len))

"""The processor of the models whose images become a variable grid of flattened patches (Qwen2-VL,
Qwen2.5-VL; issue 41), built from the model's image processor and tokenizer.

Why ours: ``transformers``' ``Qwen2_5_VLProcessor`` also builds a video processor, which needs
torchvision; the registry's torchvision is a CUDA build that does not load beside the CPU torch
installed here. The image processor alone (``AutoImageProcessor``: its PIL backend without
torchvision) does the resizing and patching; what the processor adds is one step, done here as it
does it: each image token in the text becomes ``prod(image_grid_thw) / merge_size**2`` of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# model types whose processor this module stands in for: (the text that stands for one image, as
# their chat template writes it; the token in it that the processor repeats once per image row)
_QWEN = ("<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>")
PATCH_PROCESSOR_TOKENS = {"qwen2_vl": _QWEN, "qwen2_5_vl": _QWEN}


class PatchTokenProcessor:
    """``processor(text=..., images=..., return_tensors="np")`` of a patch-grid model.

    Args:
        model_dir: the model directory (tokenizer and ``preprocessor_config.json``).
        tokens: ``PATCH_PROCESSOR_TOKENS``' pair: ``image_token`` (what a prompt writes per image:
            ``Processor.image_placeholder``) and ``pad_token`` (what is repeated).
    Raises:
        OSError, ValueError: from ``transformers`` when the directory lacks either part.
    Source: transformers' ``Qwen2_5_VLProcessor.__call__`` (the placeholder expansion).
    """

    def __init__(self, model_dir: str | Path, tokens: tuple[str, str]) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
        self.image_token, self.pad_token = tokens
        self.merge = int(getattr(self.image_processor, "merge_size", 2))

    def __call__(self, text: str, images: list | None = None, return_tensors: str = "np",
                 add_special_tokens: bool = True) -> dict:
        """``{"input_ids": [1, L] int64, "pixel_values": [patches, C * T * P * P] float32 (all images'
        patches, image after image), "image_grid_thw": [N, 3] int64}`` (the last two only with images).

        Raises:
            ValueError: the text's placeholder count differs from the images'.
        """
        images = list(images or [])
        pieces = text.split(self.pad_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the text has {len(pieces) - 1} {self.pad_token} tokens but {len(images)} images "
                             f"were given")
        out: dict = {}
        if images:
            pixels = self.image_processor(images=images, return_tensors="np")
            out["pixel_values"] = np.asarray(pixels["pixel_values"], dtype=np.float32)
            out["image_grid_thw"] = np.asarray(pixels["image_grid_thw"], dtype=np.int64)
            counts = out["image_grid_thw"].prod(-1) // self.merge**2
            text = pieces[0] + "".join(self.pad_token * int(c) + rest for c, rest in zip(counts, pieces[1:]))
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        out["input_ids"] = np.asarray([ids], dtype=np.int64)
        return out


def patch_rows(pixels: np.ndarray, grid: np.ndarray) -> list[np.ndarray]:
    """Each image's ``[t * h * w, dim]`` rows of a processor's flattened ``pixel_values``."""
    return np.split(pixels, np.cumsum(grid.prod(-1))[:-1])

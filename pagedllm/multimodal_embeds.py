"""Image embeddings given by the client instead of an image (issue 41; vLLM's ``image_embeds`` and
``multi_modal_data={"image": tensor}``, behind ``--enable-mm-embeds``): the rows are written over the
placeholders as the vision tower's output would be, and no encoder step runs.

How the placeholders are expanded: the model's processor runs on a blank stand-in image, so the
prompt gets the family's own expansion (LLaVA's ``<image>`` run, Gemma 3's ``<start_of_image>`` block,
PaliGemma's prefix). That is only right for families whose placeholder count does not depend on the
image (``fixed_rows``): for the others (LLaVA-NeXT, Qwen-VL, Idefics3, Pixtral) the embeddings are
refused, naming the reason. The embeddings' rows must equal that count, their width the language
model's hidden size.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np

STAND_IN_SIZES = ((64, 64), (160, 96))  # two shapes: a count that differs between them is not fixed


def embeds_from_base64(text: str, where: str, max_bytes: int = 32 * 2**20):
    """An ``image_embeds`` part's tensor: base64 of ``torch.save`` of a float ``[rows, hidden]`` tensor
    (or ``[1, rows, hidden]``), read with ``weights_only`` (no code runs).

    Raises:
        ValueError: not base64, more than ``max_bytes``, not a tensor file, or not such a tensor.
    """
    import base64
    import io

    import torch
    if len(text) > max_bytes * 4 // 3 + 4:
        raise ValueError(f"{where}: more than {max_bytes} bytes")
    try:
        t = torch.load(io.BytesIO(base64.b64decode(text, validate=True)), weights_only=True, map_location="cpu")
    except Exception:  # binascii, pickle (a global weights_only refuses), zip and torch errors alike: bad input
        raise ValueError(f"{where}: not base64 of a torch.save'd tensor") from None
    if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
        raise ValueError(f"{where}: expected a float [rows, hidden] tensor")
    return t


def check_embeds(t, width: int | None, where: str) -> None:
    """``t`` may stand for an image: embeddings are enabled (``width`` not ``None``), it is a float
    ``[rows, hidden]`` tensor of ``width`` columns with finite values.

    Raises:
        ValueError: naming ``where`` and what is wrong.
    """
    import torch
    if width is None:
        raise ValueError(f"{where}: image embeddings are accepted only with --enable-mm-embeds "
                         f"(LLM(enable_mm_embeds=True))")
    if t.dim() != 2 or not t.is_floating_point() or t.shape[1] != width:
        raise ValueError(f"{where}: expected float [rows, {width}] image embeddings, got {t.dtype} {list(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where}: the image embeddings hold NaN or infinite values")


def embedded(m, t):
    """The ``MultiModalInput`` ``m`` (processed from a stand-in) carrying the embeddings ``t`` instead.

    Raises:
        ValueError: ``t``'s rows differ from ``m``'s placeholder count.
    """
    if t.shape[0] != m.rows:
        raise ValueError(f"image embeddings of {t.shape[0]} rows for an image of {m.rows} placeholder tokens")
    data = np.ascontiguousarray(t.detach().float().cpu().numpy())
    digest = hashlib.sha256(b"embeds" + np.asarray(data.shape, dtype=np.int64).tobytes() + data.tobytes()).hexdigest()
    return msgspec.structs.replace(m, hash=digest, data=data.tobytes(), shape=list(data.shape), dtype="float32",
                                   extra={}, views=False, embeds=True)

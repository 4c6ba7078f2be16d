"""llama.cpp's multimodal projector files (``--mmproj``, issue 41): a llama.cpp user's two files, the
language model's GGUF and the vision tower's ``mmproj`` GGUF, served as they are.

An mmproj file (``general.architecture`` ``clip``, written by llama.cpp's ``convert_hf_to_gguf.py
--mmproj``) holds the vision tower and projector under llama.cpp's names (``v.blk.N.attn_q``,
``mm.input_projection``: ``gguf``'s ``TensorNameMap`` for ``MODEL_ARCH.MMPROJ``) and its shapes
under ``clip.vision.*`` keys. ``with_mmproj`` joins it to the language model's converted directory
(``loader.convert_gguf``) into the Hugging Face image-text directory ``transformers`` builds
(for ``clip.projector_type`` ``gemma3``: ``Gemma3ForConditionalGeneration``, a SigLIP tower, its
``Gemma3Processor`` with the file's image size, mean and std), cached by both files' digests. The
reading inverts the converter: names through the same map, and Gemma 3's ``soft_emb_norm`` stored
as ``1 + w`` (llama.cpp folds Gemma's RMSNorm offset into it) back to ``w``.

Source: the tensor names and keys of ``gguf`` (``gguf.constants``, ``gguf.tensor_mapping``) and
what llama.cpp's converter writes (checked on its output for a tiny Gemma 3); written here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from pagedllm.cache import cache_root, cached_sha256
from pagedllm.models.loader import record_gguf_source
from pagedllm.models.quant_linear import gguf_source

logger = logging.getLogger(__name__)

PROJECTORS = ("gemma3",)  # clip.projector_type values served
# Gemma 3's image tokens (its tokenizer's; a text-only Gemma 3 vocabulary may lack the soft token)
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def read_mmproj(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """The ``clip.*`` metadata and the float32 tensors (by GGUF name) of an mmproj file.

    Raises:
        ValueError: not an mmproj file, a projector type other than ``PROJECTORS``, or no vision tower.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize
    reader = GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith(("clip.", "general.architecture"))}
    if meta.get("general.architecture") != "clip":
        raise ValueError(f"--mmproj {path}: general.architecture is {meta.get('general.architecture')!r}, "
                         f"not an mmproj file ('clip')")
    kind = meta.get("clip.projector_type")
    if kind not in PROJECTORS or not meta.get("clip.has_vision_encoder", False):
        raise ValueError(f"--mmproj {path}: projector {kind!r} is not served (only {', '.join(PROJECTORS)}, "
                         f"with a vision encoder)")
    tensors = {}
    for t in reader.tensors:
        shape = [int(n) for n in reversed(t.shape)]
        tensors[t.name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    return meta, tensors


def gemma3_vision_config(meta: dict) -> tuple[dict, int]:
    """``(SiglipVisionConfig keyword arguments, image tokens per image)`` of a Gemma 3 mmproj: the tower's
    sizes from ``clip.vision.*``; the tokens from the pooling, ``(image_size / patch_size /
    clip.vision.projector.scale_factor)**2`` (scale 4 unless written: 256 tokens at 896 px)."""
    size, patch = int(meta["clip.vision.image_size"]), int(meta["clip.vision.patch_size"])
    scale = int(meta.get("clip.vision.projector.scale_factor", 4))
    cfg = dict(hidden_size=int(meta["clip.vision.embedding_length"]),
               intermediate_size=int(meta["clip.vision.feed_forward_length"]),
               num_hidden_layers=int(meta["clip.vision.block_count"]),
               num_attention_heads=int(meta["clip.vision.attention.head_count"]),
               layer_norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
               image_size=size, patch_size=patch, vision_use_head=False)
    return cfg, (size // patch // scale) ** 2


def _hf_vision_tensors(model, tensors: dict[str, np.ndarray], n_blocks: int) -> dict:
    """The vision tower's and projector's parameters of ``model`` (a ``Gemma3ForConditionalGeneration``
    on the meta device) from the mmproj tensors, as torch tensors by parameter name.

    Raises:
        ValueError: a parameter with no tensor in the file, or of another size.
    """
    import torch
    from gguf import MODEL_ARCH, TensorNameMap
    names = TensorNameMap(MODEL_ARCH.MMPROJ, n_blocks)
    out = {}
    for key, param in model.state_dict().items():
        if not key.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            continue
        # the converter's input names: the Hub layout (vision_tower.vision_model.*), "_weight" as ".weight"
        legacy = key[len("model."):].replace("vision_tower.", "vision_tower.vision_model.", 1)
        legacy = legacy.replace("mm_input_projection_weight", "mm_input_projection.weight")
        gguf_name = names.get_name(legacy, try_suffixes=(".weight", ".bias"))
        if gguf_name is None or gguf_name not in tensors:
            raise ValueError(f"the mmproj file has no tensor for {key} ({gguf_name or 'unmapped'})")
        value = tensors[gguf_name]
        if value.size != param.numel():
            raise ValueError(f"mmproj tensor {gguf_name} has {value.size} values, {key} wants {tuple(param.shape)}")
        value = value.reshape(param.shape)
        if "soft_emb_norm" in key:  # llama.cpp stores Gemma's (1 + w)
            value = value - 1.0
        out[key] = torch.from_numpy(np.array(value, dtype=np.float32))  # a copy: the reader maps the file
    return out


def _write_gemma3(text_dir: Path, meta: dict, tensors: dict[str, np.ndarray], out: Path) -> None:
    """The Gemma 3 image-text directory: config, weights (text from ``text_dir``, vision from the
    mmproj tensors), tokenizer with the image tokens, processor."""
    import torch
    from safetensors.torch import load_file
    from transformers import (AutoConfig, AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration,
                              Gemma3ImageProcessorPil, Gemma3Processor, SiglipVisionConfig)
    text_cfg = AutoConfig.from_pretrained(text_dir)
    tok = AutoTokenizer.from_pretrained(text_dir, extra_special_tokens=GEMMA3_TOKENS)
    missing = [t for t in GEMMA3_TOKENS.values() if tok.convert_tokens_to_ids(t) in (None, tok.unk_token_id)]
    if missing:  # a text-only Gemma 3 (270m): the soft token goes after the vocabulary, as in the 4B+ models
        tok.add_special_tokens({"additional_special_tokens": missing})
    vision, tokens = gemma3_vision_config(meta)
    cfg = Gemma3Config(text_config=text_cfg.to_dict(), vision_config=SiglipVisionConfig(**vision).to_dict(),
                       mm_tokens_per_image=tokens, boi_token_index=tok.convert_tokens_to_ids(GEMMA3_TOKENS["boi_token"]),
                       eoi_token_index=tok.convert_tokens_to_ids(GEMMA3_TOKENS["eoi_token"]),
                       image_token_index=tok.convert_tokens_to_ids(GEMMA3_TOKENS["image_token"]))
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(cfg)
    state = _hf_vision_tensors(model, tensors, vision["num_hidden_layers"])
    for name, t in load_file(str(text_dir / "model.safetensors")).items():
        state[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    result = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    unfilled = [k for k, t in model.state_dict().items() if t.is_meta]
    if unfilled or result.unexpected_keys:
        raise ValueError(f"the language model and mmproj do not fill Gemma 3: missing {unfilled[:6]}, "
                         f"unexpected {result.unexpected_keys[:6]}")
    model.config.dtype = "float32"
    model.config.save_pretrained(out)
    # the module names as they are (not transformers' on-disk layout): the packed loader reads them;
    # a tied head is the embedding's tensor, written once
    from safetensors.torch import save_file
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    size = int(meta["clip.vision.image_size"])
    image = Gemma3ImageProcessorPil(size={"height": size, "width": size},
                                    image_mean=[float(v) for v in meta.get("clip.vision.image_mean", [0.5] * 3)],
                                    image_std=[float(v) for v in meta.get("clip.vision.image_std", [0.5] * 3)])
    Gemma3Processor(image_processor=image, tokenizer=tok, image_seq_length=tokens,
                    chat_template=tok.chat_template).save_pretrained(out)
    for extra in ("generation_config.json",):
        if (text_dir / extra).is_file():
            shutil.copy(text_dir / extra, out / extra)
    source = gguf_source(text_dir)
    if source is not None:  # the language model's blocks are served packed, as the text model's are
        record_gguf_source(out, source)


def with_mmproj(text_dir: str | os.PathLike, mmproj: str | os.PathLike) -> Path:
    """The image-text directory of a converted language model and an mmproj file, built once and cached
    under ``cache_root()/"mmproj"/<language model dir name>-<mmproj sha256>``.

    Raises:
        FileNotFoundError: no mmproj file there.
        ValueError: as ``read_mmproj``; a language model other than Gemma 3 (its ``model_type``
            named); a tower or projector tensor missing from the file or of another size than the
            language model needs (the tensor and the wanted shape named).
    """
    text_dir, mmproj = Path(text_dir), Path(mmproj).expanduser()
    if not mmproj.is_file():
        raise FileNotFoundError(f"--mmproj: no file {mmproj}")
    target = cache_root() / "mmproj" / f"{text_dir.name}-{cached_sha256(mmproj)[:16]}"
    if (target / "config.json").is_file():
        return target
    meta, tensors = read_mmproj(mmproj)
    kind = json.loads((text_dir / "config.json").read_text()).get("model_type")
    if kind != "gemma3_text":
        raise ValueError(f"--mmproj {mmproj} ({meta['clip.projector_type']}) needs a Gemma 3 language model, "
                         f"not {kind!r}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        _write_gemma3(text_dir, meta, tensors, tmp)
        tmp.chmod(0o755)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Joined %s and %s into %s", text_dir, mmproj.name, target)
    return target

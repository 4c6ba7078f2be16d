"""The load pipeline: build the model a ``LoadPlan`` describes, with no random init.

Every choice (implementation, attention backend, C kernels, weight format, prepacking) is made
before this runs, by ``models/load_plan.plan_load``; ``load_model`` only builds what the plan
says. The architecture table is ``models/registry.py``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

from pagedllm.models.hf_config import read_hf_config
from pagedllm.models.load_plan import LoadPlan
from pagedllm.models.registry import resolve_architecture

logger = logging.getLogger(__name__)


def check_safetensors(files: list[Path]) -> None:
    """Read every file's header, so that a truncated or corrupt file fails before any loading.

    Raises:
        ModelLoadError: naming the first unreadable file.
    """
    from pagedllm.models.loader import ModelLoadError, one_line
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                fh.keys()
        except Exception as e:  # SafetensorError, OSError
            raise ModelLoadError(f, f"not a readable safetensors file ({one_line(e)})") from None


def load_model(model_dir: str | Path, plan: LoadPlan):
    """Build the model of ``model_dir`` (config.json + *.safetensors) as ``plan`` says.

    The native model is built on the meta device, materialized empty on the plan's device and
    filled from safetensors; the Transformers backend loads through ``from_pretrained``, which does
    the same. Either way no second copy of the weights exists.

    Args:
        model_dir: a Hugging Face directory.
        plan: what to build (``plan_load``): implementation, dtype, device, attention backend, C kernels,
            weight format (``model.quantization_method``), prepacking.
    Returns:
        ``(model, config)`` with the model in eval mode; ``model.attention_backend`` is the plan's backend.
    Raises:
        ModelLoadError: no ``*.safetensors`` in the directory, or a broken ``config.json`` or
            weights file (one line naming it).
        ValueError: packed weights the directory cannot give (``gguf`` without a source GGUF file).
    """
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    config = read_hf_config(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        from pagedllm.models.loader import ModelLoadError
        raise ModelLoadError(model_dir, "no *.safetensors weights in this directory")
    check_safetensors(files)
    from pagedllm.attention.selector import select_attention_backend
    backend = select_attention_backend(plan.device, plan.dtype, plan.attention_backend)
    logger.info("attention backend: %s; CPU kernels: %s", backend.name, "on" if plan.cpu_kernels else "off (torch ops)")
    if plan.encoder_only:
        model = _load_encoder(plan, model_dir, config)
        kind = "native encoder" if plan.impl == "encoder" else "Transformers encoder"
        logger.info("loaded %s (%s, %s for pooling) in %.1f s", model_dir, config.architectures, kind,
                    time.perf_counter() - t0)
        return model, config
    if plan.impl == "whisper":
        from pagedllm.models.whisper import load_whisper_model
        model = load_whisper_model(model_dir, config, plan.dtype, plan.device, backend)
        model.quantization_method = "none"
        logger.info("loaded %s (Whisper) in %.1f s", model_dir, time.perf_counter() - t0)
        return model, config
    if plan.impl == "transformers":
        from pagedllm.models.transformers_backend import load_transformers_model
        model = load_transformers_model(model_dir, config, plan.dtype, plan.device, backend, plan.prepack,
                                        plan.quantization, kernel_norms=plan.cpu_kernels,
                                        expert_parallel=plan.expert_parallel)
        model.quantization_method = plan.quantization
        logger.info("loaded %s (%s, Transformers backend) in %.1f s", model_dir, config.architectures,
                    time.perf_counter() - t0)
        return model, config
    model = _load_native(model_dir, config, files, backend, plan)
    logger.info("loaded %s (%s) in %.1f s", model_dir, config.architectures, time.perf_counter() - t0)
    return model, config


def _load_encoder(plan: LoadPlan, model_dir: Path, config):
    """An encoder-only model for pooling: native BERT (``impl == "encoder"``) or the Transformers
    encoder; float weights (``quantization_method`` ``none``)."""
    if plan.impl == "encoder":
        from pagedllm.models.bert import load_bert_model
        model = load_bert_model(model_dir, plan.dtype, plan.device, plan.prepack)
    else:
        from pagedllm.models.transformers_encoder import load_transformers_encoder
        model = load_transformers_encoder(model_dir, config, plan.dtype, plan.device, plan.prepack)
    model.quantization_method = "none"
    return model


def _load_native(model_dir: Path, config, files: list[Path], backend, plan: LoadPlan):
    """A native model built on the meta device, materialized empty on the plan's device, filled from
    ``files`` (a tensor-parallel rank reads only its slices), then served as the plan's
    ``quantization`` says (packed GGUF blocks, int8, or float with oneDNN-prepacked linears)."""
    cls = resolve_architecture(config)
    with torch.device("meta"):
        model = cls(config, backend, cpu_kernels=plan.cpu_kernels)
    model = model.to_empty(device=plan.device).to(plan.dtype)
    model.rotary.build(plan.device)
    sliced = plan.world > 1

    def tensors():
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    # a tensor-parallel rank reads only its slices of each tensor, a stage only its tensors
                    yield name, fh.get_slice(name) if sliced else fh.get_tensor(name)

    model.load_weights(tensors())
    model.eval()
    model.quantization_method = plan.quantization
    if plan.quantization == "gguf":  # before prepacking: only the layers left in float32 get packed copies
        _serve_gguf_blocks(model, model_dir, config, plan.cpu_kernels)
    elif plan.quantization == "int8":
        _serve_int8(model, config, plan.cpu_kernels)
    if plan.quantization in ("gguf", "int8"):
        from pagedllm.memory import return_freed_memory
        return_freed_memory()  # the float32 weights just replaced (glibc keeps ~170 MB of SmolLM2's mapped)
    if plan.prepack:
        logger.info("oneDNN-packed weights: %d linear layers", model.prepack())
    return model


def _serve_gguf_blocks(model, model_dir: Path, config, kernels_on: bool) -> None:
    """Swap the model's linear layers for packed GGUF ones (``quantization="gguf"``); logs what serves
    each kind of layer, and keeps float32 where it cannot (no source GGUF, no C kernels).

    Raises:
        ValueError: the directory does not come from a GGUF file, or the C kernels are off.
    """
    from pagedllm.models.native_packing import quantize_from_gguf
    from pagedllm.models.quant_linear import gguf_source
    src = gguf_source(model_dir)
    if src is None:
        raise ValueError(f"quantization='gguf': {model_dir} was not converted from a GGUF file (or the file "
                         "moved); use quantization='none'")
    if not kernels_on:
        raise ValueError("quantization='gguf' needs the C CPU kernels (float32 on the CPU, a C compiler, "
                         "PAGEDLLM_CPU_KERNELS not 0)")
    counts = quantize_from_gguf(model, src, config)
    model.quantization = counts
    from pagedllm.models.quant_linear import quantized_kernels
    logger.info("GGUF blocks served packed from %s: %s; kernels: %s", src.name,
                ", ".join(f"{k}: {v} layer{'s' * (v != 1)}" for k, v in sorted(counts.items())), quantized_kernels())


def _serve_int8(model, config, kernels_on: bool) -> None:
    """``quantization="int8"``: per-output-channel int8 weights through the GGUF kernels.

    Raises:
        ValueError: the C kernels are off.
    """
    from pagedllm.models.native_packing import quantize_int8_layers
    if not kernels_on:
        raise ValueError("quantization='int8' needs the C CPU kernels (float32 on the CPU, a C compiler, "
                         "PAGEDLLM_CPU_KERNELS not 0)")
    model.quantization = quantize_int8_layers(model, config)
    from pagedllm.models.quant_linear import quantized_kernels
    logger.info("int8 weights (per output channel): %s; kernels: %s",
                ", ".join(f"{k}: {v} layer{'s' * (v != 1)}" for k, v in sorted(model.quantization.items())), quantized_kernels())

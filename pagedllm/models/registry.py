"""Which native implementation serves which ``transformers`` architecture name."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)

NATIVE_ARCHITECTURES = {
    "LlamaForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
}


def resolve_architecture(config) -> type:
    """Return the native model class for ``config.architectures``.

    Raises:
        ValueError: no architecture of the config has a native implementation
            (the message lists the supported ones).
    """
    import importlib
    for arch in getattr(config, "architectures", None) or []:
        if arch in NATIVE_ARCHITECTURES:
            mod, cls = NATIVE_ARCHITECTURES[arch].split(":")
            return getattr(importlib.import_module(mod), cls)
    raise ValueError(f"architecture {getattr(config, 'architectures', None)} has no native implementation; "
                     f"supported: {sorted(NATIVE_ARCHITECTURES)}")


MODEL_IMPLS = ("auto", "native", "transformers")


def select_impl(config, model_impl: str = "auto") -> str:
    """Which implementation serves ``config``: ``"native"``, ``"transformers"``, ``"encoder"`` or
    ``"transformers-encoder"``.

    ``auto`` takes the native one when it exists, else the Transformers backend. An encoder-only
    model (for pooling) is ``"encoder"`` (native BERT, ``models/bert.py``) or
    ``"transformers-encoder"`` (any other encoder family, ``models/transformers_encoder.py``).

    Raises:
        ValueError: an unknown ``model_impl``, or an architecture the chosen
            implementation(s) cannot serve (the message says what is missing).
    """
    from pagedllm.models.encoder_only import encoder_impl, is_encoder_only
    from pagedllm.models.transformers_backend import check_supported
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
    if is_encoder_only(config):
        return encoder_impl(config, model_impl)
    archs = getattr(config, "architectures", None) or []
    native = any(a in NATIVE_ARCHITECTURES for a in archs)
    if model_impl == "native" or (model_impl == "auto" and native):
        if not native:
            raise ValueError(f"architecture {archs} has no native implementation (native: "
                             f"{sorted(NATIVE_ARCHITECTURES)}); use --model-impl transformers or auto")
        return "native"
    try:
        check_supported(config)
    except ValueError as e:
        hint = "" if model_impl == "transformers" else f" and no native implementation exists for {archs}"
        raise ValueError(f"cannot serve this model: {e}{hint}") from None
    return "transformers"


def read_hf_config(model_dir: str | Path):
    """``AutoConfig`` of ``model_dir``, with a one-line error naming ``config.json`` when it is broken.

    Raises:
        ModelLoadError: ``config.json`` is missing, not JSON, or not a config ``transformers`` knows.
    """
    from transformers import AutoConfig
    from pagedllm.models.loader import ModelLoadError, one_line
    path = Path(model_dir) / "config.json"
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(path, f"not a readable JSON file ({one_line(e)})") from None
    try:
        return AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # transformers raises ValueError, KeyError, OSError on a config it cannot map
        raise ModelLoadError(path, f"not a model config transformers can read ({one_line(e)})") from None


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


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, model_impl: str = "auto",
               quantization: str = "auto", attention_backend: str | None = None):
    """Build the model of ``model_dir`` (config.json + *.safetensors) without a random init.

    The native model is built on the meta device, materialized empty on
    ``device`` and filled from safetensors; the Transformers backend loads
    through ``from_pretrained``, which does the same. Either way no second copy
    of the weights exists.

    Args:
        model_impl: ``auto``, ``native`` or ``transformers`` (see ``select_impl``).
        quantization: ``gguf`` serves a GGUF-born native model's blocks packed, ``int8`` int8 weights
            per output channel (``models/quant_linear.py``; float32 CPU with the C kernels only);
            ``none`` dequantizes; ``auto`` picks (``resolve_quantization``). The choice is
            ``model.quantization_method``.
        attention_backend: the attention backend's name (``EngineArgs.attention_backend``), or ``None``
            to choose by device. The C CPU kernels (norms, rotary, activations, the fused decode) run
            only when the chosen backend is the C-kernel one.
    Returns:
        ``(model, config)`` with the model in eval mode; ``model.attention_backend`` is the
        attention backend chosen for ``device``/``dtype`` (``select_attention_backend``).
    Raises:
        ModelLoadError: no ``*.safetensors`` in the directory, or a broken ``config.json`` or
            weights file (one line naming it).
        ValueError: no implementation can serve the architecture.
    """
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    config = read_hf_config(model_dir)
    impl = select_impl(config, model_impl)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        from pagedllm.models.loader import ModelLoadError
        raise ModelLoadError(model_dir, "no *.safetensors weights in this directory")
    check_safetensors(files)
    from pagedllm.attention.selector import select_attention_backend
    from pagedllm.kernels import cpu as cpu_kernels
    # the one place the kernel choice is made: building (first time on this machine, about a
    # second) or loading the C kernels happens here, not inside the first request
    from pagedllm.distributed.parallel_state import get_world_size
    tp = get_world_size()
    # one rank of a tensor- or pipeline-parallel group: the torch layers and attention (or Triton's when
    # asked), float weights
    name = attention_backend if tp == 1 or attention_backend == "triton" else "torch"
    backend = select_attention_backend(device, dtype, name)
    kernels_on = tp == 1 and cpu_kernels.applies(device, dtype) and backend.uses_cpu_kernels
    logger.info("attention backend: %s; CPU kernels: %s", backend.name, "on" if kernels_on else "off (torch ops)")
    if impl in ("encoder", "transformers-encoder"):
        model = _load_encoder(impl, model_dir, config, dtype, device)
        logger.info("loaded %s (%s, %s for pooling) in %.1f s", model_dir, config.architectures,
                    "native encoder" if impl == "encoder" else "Transformers encoder", time.perf_counter() - t0)
        return model, config
    quantization = (resolve_quantization(quantization, model_dir, impl, kernels_on) if tp == 1
                    else check_tensor_parallel(impl, quantization, tp))
    if quantization in ("gguf", "int8") and impl == "transformers":
        raise ValueError(f"quantization={quantization!r} serves the native implementation only; use "
                         "model_impl='native' or quantization='none'")
    if impl == "transformers":
        from pagedllm.models.transformers_backend import load_transformers_model
        model = load_transformers_model(model_dir, config, dtype, device, backend)
        logger.info("loaded %s (%s, Transformers backend) in %.1f s", model_dir, config.architectures,
                    time.perf_counter() - t0)
        return model, config
    model = _load_native(model_dir, config, files, backend, kernels_on, quantization, tp, dtype, device)
    logger.info("loaded %s (%s) in %.1f s", model_dir, config.architectures, time.perf_counter() - t0)
    return model, config


def _load_encoder(impl: str, model_dir: Path, config, dtype: torch.dtype, device: torch.device):
    """An encoder-only model for pooling: native BERT (``impl == "encoder"``) or the Transformers
    encoder; float weights (``quantization_method`` ``none``)."""
    if impl == "encoder":
        from pagedllm.models.bert import load_bert_model
        model = load_bert_model(model_dir, dtype, device)
    else:
        from pagedllm.models.transformers_encoder import load_transformers_encoder
        model = load_transformers_encoder(model_dir, config, dtype, device)
    model.quantization_method = "none"
    return model


def _load_native(model_dir: Path, config, files: list[Path], backend, kernels_on: bool, quantization: str,
                 tp: int, dtype: torch.dtype, device: torch.device):
    """A native model built on the meta device, materialized empty on ``device``, filled from
    ``files`` (a tensor-parallel rank reads only its slices), then served as ``quantization`` says
    (packed GGUF blocks, int8, or float with oneDNN-prepacked linears where available)."""
    cls = resolve_architecture(config)
    with torch.device("meta"):
        model = cls(config, backend, cpu_kernels=kernels_on)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.build(device)

    def tensors():
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    # a tensor-parallel rank reads only its slices of each tensor, a stage only its tensors
                    yield name, fh.get_tensor(name) if tp == 1 else fh.get_slice(name)

    model.load_weights(tensors())
    model.eval()
    model.quantization_method = quantization
    if quantization == "gguf":  # before prepacking: only the layers left in float32 get packed copies
        _serve_gguf_blocks(model, model_dir, config, kernels_on)
    elif quantization == "int8":
        _serve_int8(model, config, kernels_on)
    if quantization in ("gguf", "int8"):
        from pagedllm.memory import return_freed_memory
        return_freed_memory()  # the float32 weights just replaced (glibc keeps ~170 MB of SmolLM2's mapped)
    from pagedllm.models.cpu_linear import prepack_available
    if tp == 1 and prepack_available(device, dtype):
        logger.info("oneDNN-packed weights: %d linear layers", model.prepack())
    return model


def check_tensor_parallel(impl: str, quantization: str, world: int) -> str:
    """The weight format a rank of a parallel job serves: float weights only (``auto`` -> ``none``).

    Raises:
        ValueError: the Transformers backend with pipeline ranks (its tensor-parallel plan is
            checked at load: ``transformers_tp.tensor_parallel_plan``), or ``--quantization gguf|int8``,
            with more than one rank (the message names the flags).
    """
    from pagedllm.distributed.parallel_state import get_pp_size
    if impl not in ("native", "transformers") or (impl == "transformers" and get_pp_size() > 1):
        raise ValueError(f"--pipeline-parallel-size ({world} ranks) needs a native model (Llama, Qwen2); "
                         "--model-impl transformers runs tensor parallel only (--tensor-parallel-size)")
    if quantization not in ("auto", "none"):
        raise ValueError(f"--tensor-parallel-size / --pipeline-parallel-size ({world} ranks) serve float "
                         f"weights only: use --quantization none (or auto), not {quantization!r}")
    return "none"


def _serve_gguf_blocks(model, model_dir: Path, config, kernels_on: bool) -> None:
    """Swap the model's linear layers for packed GGUF ones (``quantization="gguf"``); logs what serves
    each kind of layer, and keeps float32 where it cannot (no source GGUF, no C kernels).

    Raises:
        ValueError: the directory does not come from a GGUF file, or the C kernels are off.
    """
    from pagedllm.models.quant_linear import gguf_source, quantize_from_gguf
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


def resolve_quantization(quantization: str, model_dir: Path, impl: str, kernels_on: bool) -> str:
    """``auto`` -> ``gguf`` when the model was converted from a GGUF file that is still there, is
    served natively and the C kernels are on (keep the file's quantization, as llama.cpp, ollama
    and vLLM do), else ``none``; other values are returned as they are."""
    if quantization != "auto":
        return quantization
    from pagedllm.models.quant_linear import gguf_source
    return "gguf" if impl == "native" and kernels_on and gguf_source(model_dir) is not None else "none"


def _serve_int8(model, config, kernels_on: bool) -> None:
    """``quantization="int8"``: per-output-channel int8 weights through the GGUF kernels.

    Raises:
        ValueError: the C kernels are off.
    """
    from pagedllm.models.quant_linear import quantize_int8_layers
    if not kernels_on:
        raise ValueError("quantization='int8' needs the C CPU kernels (float32 on the CPU, a C compiler, "
                         "PAGEDLLM_CPU_KERNELS not 0)")
    model.quantization = quantize_int8_layers(model, config)
    from pagedllm.models.quant_linear import quantized_kernels
    logger.info("int8 weights (per output channel): %s; kernels: %s",
                ", ".join(f"{k}: {v} layer{'s' * (v != 1)}" for k, v in sorted(model.quantization.items())), quantized_kernels())


def read_generation_config(model_dir: str | Path) -> dict:
    """The model directory's ``generation_config.json`` as a dict ({} when absent).

    Raises:
        ModelLoadError: the file exists but is not a JSON object.
    """
    from pagedllm.models.loader import ModelLoadError, one_line
    p = Path(model_dir) / "generation_config.json"
    if not p.exists():
        return {}
    try:
        out = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(p, f"not a readable JSON file ({one_line(e)})") from None
    if not isinstance(out, dict):
        raise ModelLoadError(p, "not a JSON object")
    return out

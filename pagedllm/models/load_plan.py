"""What a model load builds, decided once: implementation, attention backend, kernels, weight format.

``plan_load`` makes every choice ``load_model`` (``models/load.py``) used to make inline: which
implementation serves the architecture (``registry.select_impl``), which attention backend
(``attention/selector.py``), whether the C CPU kernels run, how the weights are served
(``gguf`` / ``int8`` / ``none``) and whether linears are oneDNN-prepacked. The engine plan
(``pagedllm/plan.py``) holds the result and hands the same ``LoadPlan`` to every rank, so a
tensor-parallel worker builds exactly what rank 0 decided.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

ENCODER_IMPLS = ("encoder", "transformers-encoder")


@dataclass(frozen=True)
class LoadPlan:
    """The model half of the engine plan (frozen, picklable: it travels to worker ranks).

    Attributes:
        impl: ``native``, ``transformers``, ``encoder`` (native BERT) or ``transformers-encoder``.
        dtype: compute dtype of the weights (``torch.float32`` on the CPU by default).
        device: where the weights live.
        attention_backend: the backend's name as ``attention/selector.py`` registers it
            (``torch``, ``cpu_kernels``, ``triton``).
        cpu_kernels: the C CPU kernels run the norms, rotary, activations and fused decode.
        kernel_isa: the C kernels' build this CPU runs (``avx2``, ``avx512vnni``, ...; ``kernels/cpu.isa``),
            ``""`` when they are off.
        int8_activations: packed-weight products quantize their inputs to int8 (``kernels/cpu.int8_activations``).
        quantization: the weight format served: ``gguf`` (packed GGUF blocks), ``int8`` or ``none``.
        prepack: float32 linears get oneDNN-prepacked copies (``models/cpu_linear.py``).
        tensor_parallel_size, pipeline_parallel_size: the rank grid the weights are split over.
        expert_parallel: ``--enable-expert-parallel``: tensor-parallel ranks hold whole experts of a
            mixture of experts instead of slices (``models/moe.py``); no effect on dense models or one rank.
    """

    impl: str
    dtype: torch.dtype
    device: torch.device
    attention_backend: str
    cpu_kernels: bool
    kernel_isa: str
    int8_activations: bool
    quantization: str
    prepack: bool
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel: bool = False

    @property
    def encoder_only(self) -> bool:
        """An encoder-only model (pooling, no KV cache)."""
        return self.impl in ENCODER_IMPLS

    @property
    def world(self) -> int:
        """Ranks the model is split over (tensor times pipeline)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def plan_load(model_dir: str | Path, config, dtype: torch.dtype, device: torch.device | str,
              model_impl: str = "auto", quantization: str = "auto", attention_backend: str | None = None,
              tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
              expert_parallel: bool = False) -> LoadPlan:
    """Decide how ``model_dir`` (whose ``transformers`` config is ``config``) is built and served.

    One rank of a tensor- or pipeline-parallel job runs the torch layers and attention (or Triton's
    when asked) on float weights; a single rank takes the C CPU kernels wherever they apply
    (float32 on the CPU, built, not turned off) with their attention backend.

    Args:
        model_impl: ``auto``, ``native`` or ``transformers`` (``registry.select_impl``).
        quantization: ``auto``, ``gguf``, ``int8`` or ``none`` (``resolve_quantization``).
        attention_backend: ``EngineArgs.attention_backend`` or ``None`` (choose by device and dtype).
        expert_parallel: ``LoadPlan.expert_parallel``.
    Raises:
        ValueError: no implementation serves the architecture; an attention backend that does not
            support the device and dtype; packed weights without the C kernels or with several
            ranks; pipeline ranks with the Transformers backend.
    """
    from pagedllm.attention.selector import select_attention_backend
    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.models.cpu_linear import prepack_available
    from pagedllm.models.registry import select_impl
    device = torch.device(device)
    impl = select_impl(config, model_impl)
    world = tensor_parallel_size * pipeline_parallel_size
    name = attention_backend if world == 1 or attention_backend == "triton" else "torch"
    backend = select_attention_backend(device, dtype, name)  # builds or loads the C kernels, once
    kernels_on = world == 1 and cpu_kernels.applies(device, dtype) and backend.uses_cpu_kernels
    if impl in ENCODER_IMPLS or impl == "whisper":  # float weights: no packed encoder or cross-attention
        quantization = "none"
    elif world == 1:
        quantization = resolve_quantization(quantization, Path(model_dir), impl, kernels_on, _hybrid(config))
    else:
        quantization = check_tensor_parallel(impl, quantization, world, pipeline_parallel_size)
    if quantization in ("gguf", "int8") and not kernels_on:
        raise ValueError(f"quantization={quantization!r} needs the C CPU kernels (float32 on the CPU, a C "
                         "compiler, PAGEDLLM_CPU_KERNELS not 0); use quantization='none'")
    if quantization in ("gguf", "int8") and impl == "transformers" and _hybrid(config):
        raise ValueError(f"quantization={quantization!r}: the state mixers of hybrid models "
                         f"({config.model_type}) read their projections' float weights; use quantization='none'")
    prepack = impl == "native" and world == 1 and prepack_available(device, dtype)
    isa = cpu_kernels.isa() if kernels_on else ""
    int8 = quantization in ("gguf", "int8") and cpu_kernels.int8_activations()
    return LoadPlan(impl, dtype, device, backend.name, kernels_on, isa, int8, quantization, prepack,
                    tensor_parallel_size, pipeline_parallel_size, expert_parallel)


def resolve_quantization(quantization: str, model_dir: Path, impl: str, kernels_on: bool,
                         hybrid: bool = False) -> str:
    """``auto`` -> ``gguf`` when the model was converted from a GGUF file that is still there and the
    C kernels are on, natively or through the Transformers backend (keep the file's quantization, as
    llama.cpp, ollama and vLLM do; not for a ``hybrid`` model through the backend, whose state
    mixers read float weights), else ``none``; other values are returned as they are."""
    if quantization != "auto":
        return quantization
    from pagedllm.models.quant_linear import gguf_source
    if impl == "transformers" and hybrid:
        return "none"
    return "gguf" if kernels_on and gguf_source(model_dir) is not None else "none"


def _hybrid(config) -> bool:
    """A hybrid family's model (state layers beside attention: ``models/hybrid.py``)."""
    from pagedllm.models.hybrid import hybrid_family
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return hybrid_family(text) is not None


def check_tensor_parallel(impl: str, quantization: str, world: int, pipeline_parallel_size: int = 1) -> str:
    """The weight format a rank of a parallel job serves: float weights only (``auto`` -> ``none``).

    Raises:
        ValueError: the Transformers backend with pipeline ranks (its tensor-parallel plan is
            checked at load: ``transformers_tp.tensor_parallel_plan``), or ``--quantization gguf|int8``,
            with more than one rank (the message names the flags).
    """
    if impl not in ("native", "transformers") or (impl == "transformers" and pipeline_parallel_size > 1):
        raise ValueError(f"--pipeline-parallel-size ({world} ranks) needs a native model (Llama, Qwen2); "
                         "--model-impl transformers runs tensor parallel only (--tensor-parallel-size)")
    if quantization not in ("auto", "none"):
        raise ValueError(f"--tensor-parallel-size / --pipeline-parallel-size ({world} ranks) serve float "
                         f"weights only: use --quantization none (or auto), not {quantization!r}")
    return "none"

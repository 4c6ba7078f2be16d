"""The engine's command-line flags and their conversion into ``EngineArgs``.

``pagedllm serve``, ``generate``, ``chat`` and ``bench throughput|latency``
all take these flags. They live here, apart from ``cli.py``, so that the
benchmark commands (``bench/offline.py``) build their engine from them
without importing the command line, and the command line without importing
the benchmarks' internals.

Flag names follow vLLM's (``--max-num-seqs``, ``--max-num-batched-tokens``,
``--block-size``, ...).
"""

from __future__ import annotations

import argparse

from pagedllm.config import QUANTIZATIONS, RUNNERS, EngineArgs


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Add the engine flags (model, cache, scheduler, device, ``--log-level``) to parser ``p``.

    Returns nothing; raises ``argparse.ArgumentError`` only if ``p`` already has one of them.
    """
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face directory, .gguf file or a named model (qwen2.5-coder-0.5b-instruct, gemma-3-270m, all-minilm-l6-v2, whisper-tiny.en); default: embedded SmolLM2-135M-Instruct")
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--kv-cache-memory", default="1GiB",
                   help="KV cache pool size, e.g. 2GiB or 512MiB (per engine core: with --data-parallel-size N, "
                        "N pools of this size)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache pool size in blocks (overrides memory)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="most requests per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (prompt + output) in tokens")
    p.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   help="admit prompts only whole")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached KV blocks of shared prefixes (--no-enable-prefix-caching turns it off)")
    p.add_argument("--num-state-checkpoints", type=int, default=None,
                   help="hybrid models: prefix-cache state checkpoints at block boundaries (default --max-num-seqs)")
    p.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--quantization", choices=list(QUANTIZATIONS), default="auto",
                   help="gguf: serve a GGUF's blocks packed (C kernels); int8: int8 weights per output channel; "
                        "none: dequantize to --dtype; auto (default): gguf for a GGUF model, else none")
    p.add_argument("--model-impl", choices=["auto", "native", "transformers"], default="auto",
                   help="native implementation, the Transformers backend, or auto (native when one exists)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default: on; PAGEDLLM_ASYNC_SCHEDULING=0 "
                        "turns it off)")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        '(methods: ngram, suffix, draft_model with "model"; see docs/speculative-decoding.md)')
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks that split every layer (Megatron-style; native Llama/Qwen2, float weights)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size, a mixture of experts' ranks hold whole experts (the "
                        "Transformers backend; without it such a model is refused at several ranks)")
    _add_media_flags(p)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="stages that split the layers (each a --tensor-parallel-size group: tp x pp ranks in all)")
    p.add_argument("--pipeline-micro-batches", type=int, default=0,
                   help="micro-batches per pipelined step, run through the stages as a pipeline (0: one per "
                        "stage; 1: the whole step at once); a request is never split")
    p.add_argument("--distributed-executor-backend", choices=["mp", "uni", "ray"], default=None,
                   help="mp: one process per extra rank (default with several ranks); ray: Ray actors "
                        "(RAY_ADDRESS joins a cluster); uni: one rank in process")
    p.add_argument("--attention-backend", choices=["torch", "cpu", "cpu_kernels", "triton"], default=None,
                   help="paged attention kernels: torch (reference), cpu (C kernels, float32), triton (CUDA; on "
                        "the CPU only under TRITON_INTERPRET=1); default: by device (triton on CUDA)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs for decode steps (a no-op on the CPU, where steps are eager)")
    p.add_argument("-O", "--compilation-config", default=None,
                   help="torch.compile of the norms, activations and rotary: a level 0-3 (0 off) or JSON "
                        "{\"level\": n}; default: on with CUDA unless --enforce-eager, off on the CPU")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None,
                   help="decode batch sizes to capture CUDA graphs for (default: 1 2 4 8 16 ... max-num-seqs)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine cores behind one front end, each in its own process with its own KV pool "
                        "(--kv-cache-memory each) and weights; requests go to the core holding the longest "
                        "cached prefix of their prompt, else to the least loaded (default 1)")
    p.add_argument("--runner", choices=list(RUNNERS), default=None,
                   help="generate (text) or pooling (embeddings, /score, /rerank; a causal LM pools its last "
                        "token); default auto: pooling for an encoder model such as BERT")
    p.add_argument("--task", choices=["generate", "embed", "score"], default=None,
                   help="vLLM's older name for --runner: embed and score mean --runner pooling")
    _add_lora_flags(p)
    p.add_argument("--log-level", default="info")


def _add_lora_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags: ``--enable-lora --max-loras --max-lora-rank --max-cpu-loras --lora-modules``."""
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT directories or llama.cpp LoRA .gguf files), several in one "
                        "batch, on native models and the Transformers backend")
    p.add_argument("--max-loras", type=int, default=1, help="distinct adapters one step may hold (default 1)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="highest adapter rank accepted (default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory, least recently used evicted (default: --max-loras)")
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                   help="adapters served by name: NAME=PATH pairs or JSON {\"name\": ..., \"path\": ...} "
                        "(a PEFT directory or a llama.cpp LoRA .gguf file each); a request's model field picks one")


def _lora_module(text: str) -> tuple[str, str]:
    """``NAME=PATH``, or vLLM's JSON form ``{"name": ..., "path": ...}``, -> ``(name, path)``.

    Raises:
        argparse.ArgumentTypeError: no ``=``, an empty name or path, or JSON of another shape.
    """
    if text.lstrip().startswith("{"):
        import json
        try:
            spec = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--lora-modules: not JSON: {text!r}") from None
        other = sorted(set(spec) - {"name", "path", "base_model_name"}) if isinstance(spec, dict) else ["?"]
        if other or not spec.get("name") or not spec.get("path"):
            raise argparse.ArgumentTypeError(f'--lora-modules: expected {{"name": ..., "path": ...}}, got {text!r}')
        return str(spec["name"]), str(spec["path"])
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected NAME=PATH, got {text!r}")
    return name, path


def engine_args_from_cli(a: argparse.Namespace) -> EngineArgs:
    """Return the ``EngineArgs`` that parsed engine flags (``add_engine_flags``) ask for.

    ``--model`` wins over the positional MODEL. ``served_model_name`` and
    ``enable_multiprocessing`` exist only on ``pagedllm serve``; other
    subcommands get ``None`` for them (the ``EngineArgs`` defaults).

    Raises:
        AttributeError: ``a`` lacks one of the engine flags (not parsed with ``add_engine_flags``).
        ValueError: what ``EngineArgs`` validation rejects.
    """
    return EngineArgs(model=a.model_flag or a.model, dtype=a.dtype, device=a.device, block_size=a.block_size,
                      kv_cache_memory=a.kv_cache_memory, num_kv_blocks=a.num_kv_blocks,
                      max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                      max_model_len=a.max_model_len, enable_chunked_prefill=a.enable_chunked_prefill,
                      enable_prefix_caching=a.enable_prefix_caching,
                      num_state_checkpoints=getattr(a, "num_state_checkpoints", None),
                      seed=a.seed, served_model_name=getattr(a, "served_model_name", None),
                      num_threads=a.num_threads, model_impl=a.model_impl, quantization=a.quantization,
                      enable_multiprocessing=getattr(a, "enable_multiprocessing", None),
                      async_scheduling=a.async_scheduling, speculative_config=a.speculative_config,
                      attention_backend=a.attention_backend, enforce_eager=a.enforce_eager,
                      cuda_graph_sizes=getattr(a, "cuda_graph_sizes", None),
                      compilation_config=getattr(a, "compilation_config", None),
                      tensor_parallel_size=a.tensor_parallel_size, pipeline_parallel_size=a.pipeline_parallel_size,
                      enable_expert_parallel=getattr(a, "enable_expert_parallel", False),
                      limit_mm_per_prompt=getattr(a, "limit_mm_per_prompt", None),
                      mm_processor_kwargs=getattr(a, "mm_processor_kwargs", None),
                      video_pruning_rate=getattr(a, "video_pruning_rate", 0.0),
                      media_io_kwargs=getattr(a, "media_io_kwargs", None),
                      enable_mm_embeds=getattr(a, "enable_mm_embeds", False),
                      allowed_local_media_path=getattr(a, "allowed_local_media_path", None),
                      allowed_media_domains=getattr(a, "allowed_media_domains", None),
                      mmproj=getattr(a, "mmproj", None),
                      pipeline_micro_batches=getattr(a, "pipeline_micro_batches", 0),
                      distributed_executor_backend=a.distributed_executor_backend,
                      data_parallel_size=a.data_parallel_size, runner=_runner(a),
                      enable_lora=getattr(a, "enable_lora", False), max_loras=getattr(a, "max_loras", 1),
                      max_lora_rank=getattr(a, "max_lora_rank", 16), max_cpu_loras=getattr(a, "max_cpu_loras", None))


def _runner(a: argparse.Namespace) -> str:
    """``--runner``, else what ``--task`` means (``embed``/``score`` -> ``pooling``), else ``auto``."""
    if getattr(a, "runner", None):
        return a.runner
    task = getattr(a, "task", None)
    return "auto" if task is None else ("generate" if task == "generate" else "pooling")


def _add_media_flags(p: argparse.ArgumentParser) -> None:
    """The image-text models' flags (vLLM's names; llama-server's ``--mmproj``)."""
    p.add_argument("--limit-mm-per-prompt", type=_mm_limits, default=None,
                   help='most images, videos and audio clips in one prompt, as JSON: \'{"image": 4, "video": 1, '
                        '"audio": 2}\' (default 999 each)')
    p.add_argument("--media-io-kwargs", type=_media_io, default=None,
                   help='how video URLs are sampled, as JSON: \'{"video": {"num_frames": 16}}\' or '
                        '\'{"video": {"fps": 1}}\' (default 2 frames per second)')
    p.add_argument("--video-pruning-rate", type=float, default=0.0,
                   help="efficient video sampling: the fraction of video tokens dropped, those changing least "
                        "from the previous frame (0: off; Qwen2-VL, Qwen2.5-VL)")
    p.add_argument("--mm-processor-kwargs", type=_json_object, default=None,
                   help='arguments for the model\'s image processor, as JSON: \'{"do_pan_and_scan": true}\' '
                        '(Gemma 3), \'{"max_pixels": 802816}\' (Qwen-VL); checked on a test image at start-up')
    p.add_argument("--enable-mm-embeds", action="store_true",
                   help="accept image embeddings in place of images (multi_modal_data tensors, image_embeds parts)")
    p.add_argument("--allowed-local-media-path", default=None,
                   help="image, video and audio URLs may be file:// paths under this directory (trusted deployments only)")
    p.add_argument("--allowed-media-domains", nargs="+", default=None,
                   help="image, video and audio URLs may be http(s) URLs of these hosts (none by default)")
    p.add_argument("--mmproj", default=None,
                   help="llama.cpp's vision projector GGUF for a GGUF language model (llama-server's flag; Gemma 3)")


def _json(text: str):
    """A flag's JSON value.

    Raises:
        argparse.ArgumentTypeError: not JSON (argparse names the flag).
    """
    import json
    try:
        return json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None


def _json_object(text: str) -> dict:
    """A flag's JSON object.

    Raises:
        argparse.ArgumentTypeError: not a JSON object (argparse names the flag).
    """
    value = _json(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _media_io(text: str) -> dict:
    """``--media-io-kwargs``' JSON: ``{"video": {"num_frames": N}}`` or ``{"video": {"fps": F}}``, positive.

    Raises:
        argparse.ArgumentTypeError: another shape (argparse names the flag).
    """
    value = _json(text)
    video = value.get("video") if isinstance(value, dict) and set(value) == {"video"} else None
    if (not isinstance(video, dict) or not video or set(video) - {"num_frames", "fps"}
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in video.values())):
        raise argparse.ArgumentTypeError(f'expected {{"video": {{"num_frames": N}}}} or {{"video": {{"fps": F}}}} '
                                         f'with positive values, got {text!r}')
    return value


def _mm_limits(text: str) -> dict[str, int]:
    """``--limit-mm-per-prompt``'s JSON: ``{"image": N, "video": M, "audio": K}`` (any) with counts of at least 0.

    Raises:
        argparse.ArgumentTypeError: not such an object (argparse names the flag).
    """
    value = _json(text)
    if (not isinstance(value, dict) or set(value) - {"image", "video", "audio"}
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values())):
        raise argparse.ArgumentTypeError(f'expected {{"image": N, "video": M, "audio": K}} with counts >= 0, '
                                         f'got {text!r}')
    return value

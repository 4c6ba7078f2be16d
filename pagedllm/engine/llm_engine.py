"""The synchronous engine: the front end (tokenizer, processor, output processor) over an
``EngineCoreClient``, in process or to a core process, with the same meaning either way.

One ``step()`` takes the core's new outputs (in process: runs one core step) and turns their
token ids into ``RequestOutput``s. The offline ``LLM`` drives it in a loop.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

from pagedllm.config import EngineArgs
from pagedllm.engine.core_client import EngineCoreClient, InprocClient, MPEngineCoreClient
from pagedllm.engine.dp_client import DPClient
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.messages import EngineCoreRequest, EngineDeadError
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor, PromptTooLongError  # noqa: F401  (re-exported)
from pagedllm.inputs import parse_prompt
from pagedllm.lora.checker import AdapterChecker
from pagedllm.multimodal_whisper import context_len as whisper_context_len, is_whisper
from pagedllm.outputs import RequestOutput
from pagedllm.plan import plan_engine
from pagedllm.request import RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.stats import SchedulerStats

logger = logging.getLogger(__name__)


def _load_tokenizer(path):
    """``AutoTokenizer`` of ``path``; a one-line ``ModelLoadError`` naming it when that fails."""
    from transformers import AutoTokenizer
    from pagedllm.models.loader import ModelLoadError, one_line
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # tokenizers and transformers raise many kinds on missing or corrupt files
        raise ModelLoadError(path, f"cannot load the tokenizer ({one_line(e)})") from None


class LLMEngine:
    """Builds every part from ``EngineArgs`` and runs steps.

    Args:
        args: engine arguments.
        scripted_output: test hook (``pagedllm.worker.scripted.ScriptedOutput``): every request's
            output tokens come from it instead of the sampler. In-process engines only.
    Raises:
        ModelNotFoundError / FileNotFoundError: the model cannot be found.
        ModelLoadError: a model file is truncated or corrupt (one line naming it).
        EngineDeadError: the core process failed to start.
        ValueError: unsupported architecture, a KV pool too small for one block, or a
            ``scripted_output`` with ``enable_multiprocessing``.
    """

    def __init__(self, args: EngineArgs, scripted_output=None) -> None:
        from pagedllm.models.resolve import default_served_model_name, resolve_model
        from pagedllm.models.hf_config import read_generation_config, read_hf_config
        from pagedllm.models.load import check_safetensors
        self.args = args
        self.model_dir = Path(resolve_model(args.model))
        if args.mmproj:  # llama.cpp's two files: the language model's GGUF and the vision projector's
            from pagedllm.models.gguf_mmproj import with_mmproj
            self.model_dir = with_mmproj(self.model_dir, args.mmproj)
        self.served_model_name = args.served_model_name or default_served_model_name(args.model)
        self.hf_config = read_hf_config(self.model_dir)
        # skip_tokenizer_init (vLLM's): token ids in and out, for directories without tokenizer files
        self.tokenizer = None if args.skip_tokenizer_init else _load_tokenizer(args.tokenizer or self.model_dir)
        # every decision, once (pagedllm/plan.py): an unservable model fails here, before any loading
        self.plan = plan_engine(args, self.model_dir, self.hf_config)
        # a truncated weights file is named here, not after a core process has started and failed
        check_safetensors(sorted(self.model_dir.glob("*.safetensors")))
        self.encoder_only = self.plan.encoder_only
        self.pooler_config = self._pooler_config()
        self.generation_config = read_generation_config(self.model_dir)
        model_limit = getattr(self.hf_config, "max_position_embeddings", None) or args.max_model_len or 2048
        if is_whisper(self.hf_config):  # the clip's placeholder rows, then the decoder's 448 positions
            model_limit = whisper_context_len(self.hf_config)
        if self.encoder_only:
            from pagedllm.models.encoder_only import max_input_len
            from pagedllm.models.pooling_config import sentence_transformers_max_len
            model_limit = max_input_len(self.hf_config) or model_limit
            model_limit = min(model_limit, sentence_transformers_max_len(self.model_dir) or model_limit)
        self.max_model_len = min(args.max_model_len or model_limit, model_limit)
        self.eos_token_ids = self._eos_ids()
        self.multiprocess = bool(args.enable_multiprocessing)
        if self.multiprocess and scripted_output is not None:
            raise ValueError("scripted_output works in process only (enable_multiprocessing=False)")
        self.client: EngineCoreClient = (
            DPClient(args, self.model_dir, self.max_model_len, self.eos_token_ids) if args.data_parallel_size > 1
            else MPEngineCoreClient(args, self.model_dir, self.max_model_len, self.eos_token_ids) if self.multiprocess
            else InprocClient(EngineCore(args, self.model_dir, self.max_model_len, self.eos_token_ids,
                                         scripted_output=scripted_output, plan=self.plan)))
        self.num_blocks = self.client.num_blocks
        # an engine nobody holds any more (``del llm``), or one left to the interpreter's exit, stops
        # its core, worker and replica processes: a data-parallel script that never called
        # ``shutdown`` hung at exit, and a second tensor-parallel LLM found the first's group alive
        self._finalizer = weakref.finalize(self, self.client.shutdown)
        text_config = self.hf_config.get_text_config()
        lora_config = args.lora_config()
        self.processor = Processor(self.tokenizer, text_config.vocab_size, self.context_limit, self.pooler_config,
                                   self._multimodal_processor(args),
                                   None if lora_config is None else AdapterChecker(lora_config, text_config))
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self._held: list[RequestOutput] = []  # outputs of a step that raised for a dead DP replica

    def _multimodal_processor(self, args: EngineArgs):
        """An image-text model's processor (``multimodal.MultiModalProcessor``), else ``None``."""
        from pagedllm.models.transformers_vision import is_mm_prefix_model, is_multimodal_model, is_prefix_lm
        if is_whisper(self.hf_config):  # one clip and the decoder prompt (multimodal_whisper)
            for flag, value in (("--mm-processor-kwargs", args.mm_processor_kwargs),
                                ("--enable-mm-embeds", args.enable_mm_embeds),
                                ("--video-pruning-rate", args.video_pruning_rate)):
                if value:
                    raise ValueError(f"{flag}: Whisper takes one audio clip and its decoder prompt")
            from pagedllm.media import MediaPolicy
            from pagedllm.multimodal_whisper import WhisperPromptProcessor
            return WhisperPromptProcessor(self.model_dir, self.hf_config, MediaPolicy())
        if not is_multimodal_model(self.hf_config):
            for flag, value in (("--mm-processor-kwargs", args.mm_processor_kwargs),
                                ("--enable-mm-embeds", args.enable_mm_embeds),
                                ("--video-pruning-rate", args.video_pruning_rate),
                                ("--media-io-kwargs", args.media_io_kwargs)):
                if value:
                    raise ValueError(f"{flag}: this model reads text only")
            return None
        from pathlib import Path as _Path

        from pagedllm.media import MediaPolicy
        from pagedllm.multimodal import MultiModalProcessor
        from pagedllm.multimodal_audio import AUDIO_PLACEHOLDERS, AudioOptions
        from pagedllm.multimodal_video import video_options
        model_type = getattr(self.hf_config, "model_type", None)
        limits = args.limit_mm_per_prompt or {}
        video = video_options(self.hf_config, limits.get("video", 999), args.video_pruning_rate)
        audio = (AudioOptions(getattr(self.hf_config, "audio_token_id", -1), limits.get("audio", 999),
                              AUDIO_PLACEHOLDERS[model_type][0])
                 if model_type in AUDIO_PLACEHOLDERS else None)
        policy = MediaPolicy(_Path(args.allowed_local_media_path) if args.allowed_local_media_path else None,
                             tuple(args.allowed_media_domains or ()), video=(args.media_io_kwargs or {}).get("video"))
        return MultiModalProcessor(self.model_dir, getattr(self.hf_config, "image_token_id", None),
                                   limits.get("image", 999), policy,
                                   args.max_num_batched_tokens if is_mm_prefix_model(self.hf_config) else None,
                                   model_type=model_type, video=video, audio=audio,
                                   processor_kwargs=args.mm_processor_kwargs, prefix_lm=is_prefix_lm(self.hf_config),
                                   embeds_width=(self.hf_config.get_text_config().hidden_size
                                                 if args.enable_mm_embeds else None))

    def _pooler_config(self):
        """The model's pooling defaults when the plan's runner pools (``EngineArgs.runner``), else ``None``."""
        if self.plan.runner == "generate":
            return None
        from pagedllm.models.pooling_config import pooler_config
        return pooler_config(self.model_dir, self.hf_config, self.encoder_only)

    @property
    def is_pooling_model(self) -> bool:
        """True when the model serves pooling requests (embeddings, score), not generation."""
        return self.pooler_config is not None

    def is_alive(self) -> bool:
        """False once the core has died."""
        return self.client.is_alive()

    def shutdown(self) -> None:
        """Stop the core (its process, or its execution thread in process) and the grammar
        validator's child process; safe to call twice."""
        self.processor.close()
        self._finalizer()  # the client's shutdown, once

    def reset_prefix_cache(self) -> int:
        """Drop every cached KV block no request holds (in process or in the core process)."""
        return self.client.reset_prefix_cache()

    # the core's parts, for tests and debugging of the in-process engine (AttributeError otherwise)
    @property
    def core(self) -> EngineCore | None:
        """The in-process core, or ``None`` with a core process."""
        return getattr(self.client, "core", None)

    @property
    def scheduler(self):
        """The core's scheduler."""
        return self.core.scheduler

    @property
    def kv_cache_manager(self):
        """The core's KV cache manager."""
        return self.core.kv_cache_manager

    @property
    def runner(self):
        """The core's model runner."""
        return self.core.runner

    @property
    def stats(self) -> SchedulerStats:
        """The core's counters (same as ``get_stats()``)."""
        return self.get_stats()

    def _eos_ids(self) -> set[int]:
        ids = self.generation_config.get("eos_token_id", self.hf_config.get_text_config().eos_token_id)
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def default_sampling_fields(self) -> dict:
        """Sampling defaults from the model's ``generation_config.json``, under ``SamplingParams`` names.

        Only fields a request leaves out take these values (vLLM's ``--generation-config auto``):
        temperature, top_p, top_k, min_p, repetition_penalty, and ``max_new_tokens`` as ``max_tokens``.
        """
        gc = self.generation_config
        out = {k: gc[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in gc}
        if gc.get("max_new_tokens") is not None:
            out["max_tokens"] = gc["max_new_tokens"]
        return out

    # ---- requests ----------------------------------------------------------
    @property
    def context_limit(self) -> int:
        """Most tokens (prompt + output) one request may reach.

        ``max_model_len``, capped by the KV pool and, without chunked prefill,
        by the step budget: an unchunked prompt (or a preempted request's
        recompute) longer than ``max_num_batched_tokens`` could never be scheduled.
        """
        limit = min(self.max_model_len, self.num_blocks * self.args.block_size)
        if not self.args.enable_chunked_prefill or self.encoder_only:  # an encoder takes prompts whole
            limit = min(limit, self.args.max_num_batched_tokens)
        return limit

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (special tokens as the tokenizer adds them), or the ids as given."""
        return self.processor.tokenize(prompt)

    def add_request(self, request_id: str, prompt, params: SamplingParams,
                    arrival_time: float | None = None, prompt_text: str | None = None,
                    cache_salt: str | None = None, lora_request=None) -> None:
        """Validate and queue a request (``lora_request``: its ``LoRARequest``, or ``None``).

        Args:
            prompt: a string, token ids, or vLLM's ``TextPrompt`` / ``TokensPrompt`` dict (its
                ``cache_salt`` used when the argument is not given), as ``inputs.parse_prompt``.
        Raises:
            PromptTooLongError: prompt + max_tokens exceed ``max_model_len`` or the KV pool.
            SamplingParamError: empty prompt or token ids outside the vocabulary.
            TypeError, ValueError: a prompt of no accepted shape (``inputs.parse_prompt``), the
                request id is already live, or an adapter the check refuses.
        """
        prompt, text, salt = parse_prompt(prompt, "prompt")
        prompt_text = prompt_text if prompt_text is not None else text
        cache_salt = cache_salt if cache_salt is not None else salt
        self.add_prepared(self.make_request(request_id, prompt, params, arrival_time, cache_salt, lora_request),
                          prompt_text)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     arrival_time: float | None = None, cache_salt: str | None = None,
                     lora_request=None) -> EngineCoreRequest:
        """Tokenize and validate without touching engine state (safe from any thread): ``Processor.process``.

        Raises:
            PromptTooLongError, SamplingParamError: as ``add_request``.
        """
        return self.processor.process(request_id, prompt, params, arrival_time, cache_salt, lora_request)

    def make_pooling_request(self, request_id: str, prompt: str | list[int], params,
                             arrival_time: float | None = None) -> EngineCoreRequest:
        """Tokenize and validate a pooling request (``Processor.process_pooling``); any thread.

        Raises:
            WrongRunnerError, SamplingParamError, PromptTooLongError: see ``Processor.process_pooling``.
        """
        return self.processor.process_pooling(request_id, prompt, params, arrival_time)

    def make_pair_request(self, request_id: str, text_1: str, text_2: str, params,
                          arrival_time: float | None = None) -> EngineCoreRequest:
        """Tokenize and validate a cross-encoder's pair as one pooling request
        (``Processor.process_pair``); any thread.

        Raises:
            WrongRunnerError, SamplingParamError, PromptTooLongError: see ``Processor.process_pair``.
        """
        return self.processor.process_pair(request_id, text_1, text_2, params, arrival_time)

    @property
    def is_cross_encoder(self) -> bool:
        """True when the model scores pairs with a classification head (``/score`` takes pairs whole)."""
        return self.pooler_config is not None and self.pooler_config.is_cross_encoder

    def add_prepared(self, request: EngineCoreRequest, prompt_text: str | None = None) -> None:
        """Queue a request built by ``make_request`` (call from the thread that steps the engine).

        Raises:
            ValueError: the request id is already live.
        """
        if request.request_id in self.output_processor.states:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.client.add_request(request)
        self.output_processor.add_request(request.request_id, prompt_text, request.prompt_token_ids,
                                          request.sampling_params, request.arrival_time)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests now: their KV blocks go back to the pool before the next step."""
        self.client.abort_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self.output_processor.abort(rid)

    def has_unfinished_requests(self) -> bool:
        """True while any request added here has not finished (the front end's view, in both modes)."""
        return bool(self.output_processor.states)

    # ---- the step ------------------------------------------------------------
    def step(self, delta: bool = False) -> list[RequestOutput]:
        """Schedule, execute and post-process one batch.

        Args:
            delta: return only the new text/tokens of each request (streaming).
        Returns:
            Outputs of the requests that produced a token this step.
        Raises:
            EngineDeadError: the core died, or a data-parallel replica died (its requests are
                dropped and named in the message; the other replicas keep serving, and the outputs
                this step had for their requests come with the next ``step()``).
        """
        core_outputs = self.client.get_output(timeout_ms=100)
        failed = self.client.pop_failed_requests()  # a data-parallel replica died: fail only its requests
        for rid in failed:
            self.output_processor.abort(rid)
        outputs, stopped = self.output_processor.process(core_outputs, delta)
        if stopped:
            self.client.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if not self.output_processor.states:
            self.client.settle()  # nothing live: a step still in flight is applied now, not later
        outputs, self._held = self._held + outputs, []
        if failed:  # the other replicas' outputs of this step come with the next one
            self._held = outputs
            raise EngineDeadError(f"{next(iter(failed.values()))} (failed requests: {', '.join(sorted(failed))})")
        return outputs

    def get_stats(self) -> SchedulerStats:
        """The core's counters (see ``EngineCore.get_stats``); with a core process, as of its
        last message, with ``core_pid`` set."""
        return self.client.get_stats()

"""The synchronous engine: the front end (tokenizer, validation, output processor) over an ``EngineCore``.

One ``step()`` runs one core step (schedule, execute, apply) and turns its
token ids into ``RequestOutput``s. The offline ``LLM`` drives it in a loop;
``AsyncLLM`` drives it from a background thread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pagedllm.config import EngineArgs
from pagedllm.engine.core_client import MPEngineCoreClient
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParamError, SamplingParams

logger = logging.getLogger(__name__)


class PromptTooLongError(SamplingParamError):
    """Prompt plus ``max_tokens`` exceeds the context limit (``param`` is ``max_tokens`` or ``prompt``)."""


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
        from pagedllm.models.loader import default_served_model_name, resolve_model
        from pagedllm.models.registry import read_generation_config, read_hf_config, select_impl
        self.args = args
        self.model_dir = Path(resolve_model(args.model))
        self.served_model_name = args.served_model_name or default_served_model_name(args.model)
        self.hf_config = read_hf_config(self.model_dir)
        self.tokenizer = _load_tokenizer(args.tokenizer or self.model_dir)
        select_impl(self.hf_config, args.model_impl)  # an unservable model fails here, before any loading
        self.generation_config = read_generation_config(self.model_dir)
        model_limit = getattr(self.hf_config, "max_position_embeddings", None) or args.max_model_len or 2048
        self.max_model_len = min(args.max_model_len or model_limit, model_limit)
        self.eos_token_ids = self._eos_ids()
        self.multiprocess = bool(args.enable_multiprocessing)
        if self.multiprocess and scripted_output is not None:
            raise ValueError("scripted_output works in process only (enable_multiprocessing=False)")
        self.core: EngineCore | None = None
        self.client: MPEngineCoreClient | None = None
        if self.multiprocess:
            self.client = MPEngineCoreClient(args, self.model_dir, self.max_model_len, self.eos_token_ids)
            self.num_blocks = self.client.num_blocks
        else:
            self.core = EngineCore(args, self.model_dir, self.max_model_len, self.eos_token_ids,
                                   scripted_output=scripted_output)
            self.num_blocks = self.core.num_blocks
        self.output_processor = OutputProcessor(self.tokenizer)

    def is_alive(self) -> bool:
        """False once the core process has died (always True in process)."""
        return self.client is None or self.client.is_alive()

    def shutdown(self) -> None:
        """Stop the core process, or the in-process core's execution thread (safe to call twice)."""
        if self.client is not None:
            self.client.shutdown()
        elif self.core is not None:
            self.core.shutdown()

    # the core's parts, for tests and debugging of the in-process engine
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
    def stats(self) -> dict:
        """The core's token and step counters."""
        return self.core.stats if self.core is not None else self.get_stats()

    def _eos_ids(self) -> set[int]:
        ids = self.generation_config.get("eos_token_id", self.hf_config.eos_token_id)
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
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
        if not self.args.enable_chunked_prefill:
            limit = min(limit, self.args.max_num_batched_tokens)
        return limit

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (special tokens as the tokenizer adds them), or the ids as given."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, prompt_text: str | None = None,
                    cache_salt: str | None = None) -> None:
        """Validate and queue a request.

        Raises:
            PromptTooLongError: prompt + max_tokens exceed ``max_model_len`` or the KV pool.
            SamplingParamError: empty prompt or token ids outside the vocabulary.
        """
        if prompt_text is None and isinstance(prompt, str):
            prompt_text = prompt
        self.add_prepared(self.make_request(request_id, prompt, params, arrival_time, cache_salt), prompt_text)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     arrival_time: float | None = None, cache_salt: str | None = None) -> Request:
        """Tokenize and validate without touching engine state (safe from any thread).

        Raises:
            PromptTooLongError, SamplingParamError: as ``add_request``.
        """
        ids = self.tokenize(prompt)
        vocab = self.hf_config.vocab_size
        if not ids:
            raise SamplingParamError("prompt", "prompt: must contain at least one token")
        if min(ids) < 0 or max(ids) >= vocab:
            raise SamplingParamError("prompt", f"prompt: token ids must be in [0, {vocab})")
        bad_bias = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad_bias:
            raise SamplingParamError("logit_bias", f"logit_bias: token ids must be in [0, {vocab}), got {bad_bias[0]}")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise SamplingParamError("stop_token_ids", f"stop_token_ids: token ids must be in [0, {vocab}), "
                                     f"got {bad_stop[0]}")
        limit = self.context_limit
        if len(ids) >= limit:
            asked = "" if params.max_tokens is None else f" and requested max_tokens={params.max_tokens}"
            raise PromptTooLongError("prompt", f"This model's maximum context length is {limit} tokens. "
                                     f"However, your prompt has {len(ids)} tokens{asked}.")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise PromptTooLongError("max_tokens", f"This model's maximum context length is {limit} tokens. "
                                     f"However, you requested {len(ids) + max_tokens} tokens ({len(ids)} in the "
                                     f"prompt, {max_tokens} for max_tokens). Please reduce the length.")
        if params.min_tokens > max_tokens:  # without max_tokens the bound is what the context leaves
            raise SamplingParamError("min_tokens", f"min_tokens: must be <= max_tokens={max_tokens} (the "
                                     f"context limit less the prompt when max_tokens is not set), got "
                                     f"{params.min_tokens}")
        arrival = arrival_time if arrival_time is not None else time.time()
        return Request(request_id, ids, params, self.eos_token_ids, max_tokens, arrival, cache_salt)

    def add_prepared(self, req: Request, prompt_text: str | None = None) -> None:
        """Queue a request built by ``make_request`` (call from the thread that steps the engine).

        Raises:
            ValueError: the request id is already live.
        """
        if self.core is not None:
            self.core.add_request(req)
        else:
            if req.request_id in self.output_processor.states:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            self.client.add_request(req)
        self.output_processor.add_request(req.request_id, prompt_text, req.prompt_token_ids,
                                          req.sampling_params, req.arrival_time)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests now: their KV blocks go back to the pool before the next step."""
        self._finish(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self.output_processor.abort(rid)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        if self.core is not None:
            return self.core.has_unfinished_requests()
        return bool(self.output_processor.states)

    def _finish(self, request_ids: list[str], status: RequestStatus) -> None:
        if self.core is not None:
            self.core.finish_requests(request_ids, status)
        else:
            self.client.finish_requests(request_ids, status)

    # ---- the step ------------------------------------------------------------
    def step(self, delta: bool = False) -> list[RequestOutput]:
        """Schedule, execute and post-process one batch.

        Args:
            delta: return only the new text/tokens of each request (streaming).
        Returns:
            Outputs of the requests that produced a token this step.
        """
        if self.core is not None:
            core_outputs = self.core.step()
        else:  # the core process steps by itself: take what it has sent
            core_outputs = self.client.get_outputs(timeout_ms=100)
        outputs, stopped = self.output_processor.process(core_outputs, delta)
        if stopped:
            self._finish(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def get_stats(self) -> dict:
        """The core's counters (see ``EngineCore.get_stats``); with a core process, as of its
        last message, plus ``core_pid``."""
        if self.core is not None:
            return self.core.get_stats()
        return {**self.client.stats, "core_pid": self.client.core_pid}

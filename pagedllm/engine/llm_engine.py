"""The synchronous engine: tokenizer, scheduler, KV cache manager, model runner and output processor.

One ``step()`` schedules, executes and post-processes one batch. The offline
``LLM`` drives it in a loop; ``AsyncLLM`` drives it from a background thread.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from pagedllm.config import EngineArgs, parse_size
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParamError, SamplingParams
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class PromptTooLongError(SamplingParamError):
    """Prompt plus ``max_tokens`` exceeds the context limit (``param`` is ``max_tokens`` or ``prompt``)."""


class LLMEngine:
    """Builds every part from ``EngineArgs`` and runs steps.

    Args:
        args: engine arguments.
    Raises:
        ModelNotFoundError / FileNotFoundError: the model cannot be found.
        ValueError: unsupported architecture or a KV pool too small for one block.
    """

    def __init__(self, args: EngineArgs) -> None:
        from transformers import AutoTokenizer
        from pagedllm.models.loader import default_served_model_name, resolve_model
        from pagedllm.models.registry import load_model, read_generation_config
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.model_dir = Path(resolve_model(args.model))
        self.served_model_name = args.served_model_name or default_served_model_name(args.model)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or self.model_dir)
        dtype, device = args.torch_dtype, args.torch_device
        model, self.hf_config = load_model(self.model_dir, dtype, device, args.model_impl)
        self.generation_config = read_generation_config(self.model_dir)
        self.max_model_len = min(args.max_model_len or self.hf_config.max_position_embeddings,
                                 self.hf_config.max_position_embeddings)
        per_block = ModelRunner.kv_bytes_per_block(model, args.block_size, dtype)
        num_blocks = args.num_kv_blocks or parse_size(args.kv_cache_memory) // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={args.kv_cache_memory} holds no block of {per_block} bytes")
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", num_blocks, args.block_size,
                    num_blocks * per_block / 2**20)
        self.kv_cache_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache_manager, args.max_num_seqs, args.max_num_batched_tokens,
                                   self.max_model_len, args.enable_chunked_prefill)
        self.eos_token_ids = self._eos_ids()
        self.runner = ModelRunner(model, num_blocks, args.block_size, dtype, device, args.seed,
                                  eos_token_ids=self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = {"num_prompt_tokens": 0, "num_generation_tokens": 0, "num_steps": 0,
                      "max_num_running": 0}

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
        arrival = arrival_time if arrival_time is not None else time.time()
        return Request(request_id, ids, params, self.eos_token_ids, max_tokens, arrival, cache_salt)

    def add_prepared(self, req: Request, prompt_text: str | None = None) -> None:
        """Queue a request built by ``make_request`` (call from the thread that steps the engine).

        Raises:
            ValueError: the request id is already live.
        """
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.output_processor.add_request(req.request_id, prompt_text, req.prompt_token_ids,
                                          req.sampling_params, req.arrival_time)
        self.scheduler.add_request(req)
        self.stats["num_prompt_tokens"] += req.num_prompt_tokens

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests now: their KV blocks go back to the pool before the next step."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self.output_processor.abort(rid)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished_requests()

    # ---- the step ------------------------------------------------------------
    def step(self, delta: bool = False) -> list[RequestOutput]:
        """Schedule, execute and post-process one batch.

        Args:
            delta: return only the new text/tokens of each request (streaming).
        Returns:
            Outputs of the requests that produced a token this step.
        """
        so = self.scheduler.schedule()
        runner_out = self.runner.execute(so).result()
        core_outputs = self.scheduler.update_from_output(so, runner_out)
        self.stats["num_steps"] += 1
        self.stats["max_num_running"] = max(self.stats["max_num_running"], len(so.num_scheduled_tokens))
        self.stats["num_generation_tokens"] += len(runner_out.sampled_token_ids)
        outputs, stopped = self.output_processor.process(core_outputs, delta)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def get_stats(self) -> dict:
        """Counters: running/waiting requests, KV usage (fraction), preemptions, token totals.

        ``max_num_running`` is the most requests scheduled together in one step so far.
        """
        return {**self.stats,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "kv_cache_usage": self.kv_cache_manager.usage(),
                "num_free_blocks": self.kv_cache_manager.num_free_blocks,
                "num_blocks": self.num_blocks,
                "num_preemptions": self.scheduler.num_preemptions,
                "prefix_cache_queries": self.kv_cache_manager.prefix_cache_queries,
                "prefix_cache_hits": self.kv_cache_manager.prefix_cache_hits}

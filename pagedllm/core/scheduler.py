"""Continuous batching with one token budget per step.

There is no separate prefill phase: each step moves every scheduled
request's ``num_computed_tokens`` toward its ``num_tokens``. Running requests
are served first (decodes and unfinished prefill chunks), then waiting ones are
admitted while budget, sequence slots and KV blocks last. When blocks run out,
the most recently admitted running request is preempted: its blocks are freed
and it is recomputed later, keeping its generated tokens (vLLM's
"recompute" preemption mode).

Async scheduling: a step may be scheduled while the previous one still runs.
A step that reaches the end of a request's sequence will sample one token;
until that token arrives the request counts it as an output placeholder, so
the next step already computes the placeholder's position (the runner feeds
the sampled token in itself). A request whose placeholders alone reach its
``max_tokens`` or the context limit is not scheduled again. A stop found in a
late result frees the request; the token the step in flight computes for it
is dropped on arrival.

Speculative decoding (``spec``, a ``SpecDecoding``): a decoding request may get draft tokens
after its decode token (``SchedulerOutput.spec_token_ids``); they count against the budget and
get KV slots. The verdict moves ``num_computed_tokens`` back past the rejected drafts (their
slots are overwritten by later tokens; the blocks stay the request's until it ends).

Structured outputs: a request whose grammar is still compiling waits in the queue without
holding up the requests behind it; one whose grammar failed to compile finishes with
``error``. Each kept token advances the request's matcher; a grammar that reaches its end
finishes the request with ``stop``.

Pooling (``Request.pooling_params``): a pooling request is scheduled like a prompt (chunked,
prefix-cached, batched with the rest under the same budget) and finishes with its pooled
vector (``ModelRunnerOutput.pooled``) in the step that computes its last prompt token; its
``max_tokens`` of 1 keeps the placeholder of that step from scheduling anything more. With an
encoder-only model (``encoder_only``) every prompt is scheduled whole in one step and holds
no KV blocks (bidirectional attention keeps no cache).
"""

from __future__ import annotations

import logging
from collections import deque

from pagedllm.core.encoder_cache import EncoderScheduler
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler_output import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                                            NewRequestData, SchedulerOutput)
from pagedllm.request import Request, RequestStatus
from pagedllm.spec_decode.scheduler import HOLD, SpecDecoding

logger = logging.getLogger(__name__)

# prompt tokens to compute from which a pipeline's steps split the requests between them (reasoned:
# below it a forward is bound by reading the weights, above it by the matrix products)
PIPELINE_SPLIT_MIN_TOKENS = 256


class Scheduler:
    """Decides which tokens of which requests run in each step.

    Args:
        kv_cache_manager: owner of the KV blocks.
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: token budget of one step.
        max_model_len: longest sequence (prompt + output) in tokens.
        enable_chunked_prefill: when False a prompt is admitted only whole.
        spec: speculative decoding's planner, or ``None`` (no drafts).
        encoder_only: the model is an encoder (prompts whole, no KV blocks; see the module docstring).
        steps_in_flight: steps a pipeline runs at once (its stages; 1: no pipeline overlap). Above
            1, while prompts are computed, a request whose token is still being sampled stays out
            of the next steps and a step takes at most ``ceil(requests / steps_in_flight)`` requests
            (``_requests_per_step``), so that consecutive steps hold different requests and a pipeline runs them at once (``ModelRunner(pipeline_overlap=True)``;
            vLLM keeps ``pipeline_parallel_size`` batches in flight the same way).
        encoder: a multimodal model's ``EncoderScheduler`` (which images each step encodes).
        max_loras: distinct LoRA adapters one step may hold (0: no limit, adapters off); a request
            whose adapter would be one too many waits for a later step (``_lora_fits``).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True, spec: SpecDecoding | None = None,
                 encoder_only: bool = False, steps_in_flight: int = 1, encoder: EncoderScheduler | None = None,
                 max_loras: int = 0) -> None:
        self.max_loras = max_loras
        self._step_loras: set[int] = set()  # adapter ids in the step being planned
        self.encoder_only = encoder_only
        self.encoder = encoder  # images: encoder budget and cache (core/encoder_cache.py), else None
        self.steps_in_flight = steps_in_flight
        self.pipeline_overlap = steps_in_flight > 1
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self._step_cap = max_num_seqs  # requests one step may take (``schedule`` sets it per step)
        self._split = False  # this step splits the requests with the steps in flight
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._runner_knows: set[str] = set()
        self._finished_ids: set[str] = set()
        self._error_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        self.spec = spec

    # ---- request lifecycle -------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING)."""
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests from outside the step (abort, stop string): free their blocks now.

        Unknown or already finished ids are ignored.
        """
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        if self.encoder is not None:
            self.encoder.release(req)
        if self.spec is not None:
            self.spec.finish(req)
        self.requests.pop(req.request_id, None)
        if req.request_id in self._runner_knows:
            self._runner_knows.discard(req.request_id)
            self._finished_ids.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs, or a failed one is still to be reported."""
        return bool(self.waiting or self.running or self._error_outputs)

    def take_error_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests finished with ``error`` (a grammar that failed to compile) since the last call."""
        out, self._error_outputs = self._error_outputs, []
        return out

    # ---- scheduling --------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step within the token budget; see the module docstring."""
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        if self.encoder is not None:
            out.free_encoder_hashes = self.encoder.begin_step()
        budget = self.max_num_batched_tokens
        self.kv.begin_step()
        if self.spec is not None:
            self.spec.begin_step(self.running)
        self._step_cap = self._requests_per_step()
        self._step_loras = set()
        preempted = self._schedule_running(out, budget)
        budget -= out.total_num_scheduled_tokens
        if not preempted:
            self._schedule_waiting(out, budget)
        for req in self.running:
            n = out.num_scheduled_tokens.get(req.request_id)
            if n:
                req.num_computed_tokens += n
                if self.encoder is not None:
                    out.free_encoder_after += self.encoder.computed(req)
                if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders + len(req.spec_token_ids):
                    req.num_output_placeholders += 1  # this step samples the next token
        return out

    def _requests_per_step(self) -> int:
        """Requests this step may take: all (``max_num_seqs``), or with several steps in flight and
        at least ``PIPELINE_SPLIT_MIN_TOKENS`` prompt tokens to compute, ``ceil(requests /
        steps_in_flight)``, so that the next steps hold the others. Decode-only work is not split:
        a decode step reads every weight once whatever its batch (memory-bound), so two half
        batches would read them twice for the same tokens (measured: ``benchmarks/tensor_parallel.py``).
        Such a step takes the requests in flight too (their tokens as placeholders, as with one step
        in flight); the runner then finishes the step before it first."""
        self._split = False
        if not self.pipeline_overlap:
            return self.max_num_seqs
        prompt = sum(r.num_tokens - r.num_computed_tokens for r in self.running if not r.num_output_placeholders)
        prompt += sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        if prompt < PIPELINE_SPLIT_MIN_TOKENS:
            return self.max_num_seqs  # decode: all together, the tokens in flight as placeholders
        self._split = True
        return -(-(len(self.running) + len(self.waiting)) // self.steps_in_flight)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        pending = req.num_output_placeholders
        if pending and self._split:
            return 0  # in the step in flight: the step after it holds other requests
        if pending and (req.num_output_tokens + pending >= req.max_tokens
                        or req.num_tokens + pending >= self.max_model_len):
            return 0  # finishes for length when the tokens in flight arrive
        n = min(req.num_tokens + pending - req.num_computed_tokens, budget, self.max_model_len - req.num_computed_tokens)
        return n if self.encoder is None else self.encoder.fit(req, n)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> bool:
        """Schedule running requests in admission order; preempt from the back when blocks run out."""
        preempted_any = False
        i = 0
        while i < len(self.running) and budget > 0 and len(out.num_scheduled_tokens) < self._step_cap:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            drafts = self._drafts(req, n, budget) if n > 0 else []
            if n <= 0 or drafts is HOLD or not self._lora_fits(req):
                i += 1
                continue
            n += len(drafts)
            new_blocks = self._allocate(req, n)
            if new_blocks is None and drafts:  # drafts never preempt anyone: go on without them
                n, drafts = n - len(drafts), []
                new_blocks = self._allocate(req, n)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted_any = True
                if victim is req:
                    break
                new_blocks = self._allocate(req, n)
            if new_blocks is None:
                break
            self._record(out, req, n, new_blocks)
            if drafts:
                self._set_drafts(out, req, drafts)
            budget -= n
            i += 1
        return preempted_any

    def _set_drafts(self, out: SchedulerOutput, req: Request, drafts: list[int]) -> None:
        """Schedule ``drafts`` after ``req``'s decode token, with the distributions they were
        drawn from when the proposer sampled them."""
        req.spec_token_ids = drafts
        out.spec_token_ids[req.request_id] = drafts
        probs = self.spec.draft_probs(req.request_id, len(drafts))
        if probs is not None:
            out.spec_draft_probs[req.request_id] = probs

    def _drafts(self, req: Request, n: int, budget: int) -> list[int] | None:
        """Draft tokens for ``req`` this step (``[]``: none; ``HOLD``: skip it this step)."""
        if self.spec is None:
            return []
        return self.spec.drafts_for(req, n, budget, len(self.running))

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests (FIFO) while budget, seats and blocks last.

        A request starts after the longest cached prefix of its tokens. One whose grammar
        is still compiling is passed over (it keeps its place in the queue).
        """
        passed: list[Request] = []
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(out.num_scheduled_tokens) < self._step_cap):
            req = self.waiting[0]
            if req.structured is not None and not req.structured.ready:
                passed.append(self.waiting.popleft())
                continue
            if req.structured is not None and req.structured.error is not None:
                self.waiting.popleft()
                self._fail(req, f"the grammar failed to compile: {req.structured.error}")
                continue
            if not self._lora_fits(req):  # its adapter would be one too many this step: keep its place
                passed.append(self.waiting.popleft())
                continue
            if req.num_output_placeholders:
                break  # preempted while a step computed its token: re-admit once it arrives
            cached, num_cached = ([], 0) if self.encoder_only else self.kv.get_computed_blocks(req)
            req.num_computed_tokens = num_cached
            n = self._num_new_tokens(req, budget)
            if self._whole_prompt_only() and n < req.num_tokens - req.num_computed_tokens:
                req.num_computed_tokens = 0
                break
            new_blocks = self._allocate(req, n, cached)
            if new_blocks is None:
                req.num_computed_tokens = 0
                break
            self.kv.record_prefix_query(req.num_tokens, num_cached)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._record(out, req, n, new_blocks)
            budget -= n
        self.waiting.extendleft(reversed(passed))

    def _lora_fits(self, req: Request) -> bool:
        """Whether ``req``'s LoRA adapter (if any) can join this step: already in it, or fewer than
        ``max_loras`` distinct adapters so far."""
        lora = req.lora_request
        return (lora is None or not self.max_loras or lora.lora_int_id in self._step_loras
                or len(self._step_loras) < self.max_loras)

    def _whole_prompt_only(self) -> bool:
        """True when a prompt is admitted only whole (no chunked prefill, or an encoder model)."""
        return self.encoder_only or not self.enable_chunked_prefill

    def _allocate(self, req: Request, n: int, cached=None) -> list[int] | None:
        """KV slots for ``n`` more tokens of ``req`` (``KVCacheManager.allocate_slots``); an encoder
        model keeps no KV cache, so it needs none (``[]``)."""
        if self.encoder_only:
            return []
        return self.kv.allocate_slots(req, n, cached)

    def _fail(self, req: Request, reason: str) -> None:
        """Finish a request with ``error`` (its blocks freed) and queue its output."""
        req.status = RequestStatus.FINISHED_ERROR
        req.stop_reason = reason
        self._free(req)
        self._error_outputs.append(EngineCoreOutput(req.request_id, [], "error", reason))

    def _record(self, out: SchedulerOutput, req: Request, n: int, new_blocks: list[int]) -> None:
        rid = req.request_id
        if rid in self._runner_knows:
            out.cached_reqs.append(CachedRequestData(rid, new_blocks, req.num_computed_tokens))
        else:
            out.new_reqs.append(NewRequestData(rid, list(req.all_token_ids), req.num_prompt_tokens,
                                               req.sampling_params, self.kv.get_block_ids(rid),
                                               req.num_computed_tokens, req.pooling_params,
                                               self.kv.get_state_slot(rid), req.mm_inputs, req.lora_request))
            self._runner_knows.add(rid)
        out.num_scheduled_tokens[rid] = n
        out.total_num_scheduled_tokens += n
        if req.lora_request is not None:
            self._step_loras.add(req.lora_request.lora_int_id)
        if self.encoder is not None and (encode := self.encoder.schedule(req, n)):
            out.scheduled_encoder_inputs[rid] = encode
        restore, checkpoints = self.kv.take_state_plan(rid)  # a hybrid model's prefix caching
        if restore >= 0:
            out.state_restores[rid] = restore
        if checkpoints:
            out.state_checkpoints[rid] = checkpoints

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and send it back to the front of the queue."""
        self.kv.free(req)
        if self.encoder is not None:
            self.encoder.release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.request_id in self._runner_knows:
            self._runner_knows.discard(req.request_id)
            self._finished_ids.add(req.request_id)
        self.waiting.appendleft(req)
        logger.info("preempted request %s (recompute; %d preemptions so far)", req.request_id,
                    self.num_preemptions)

    # ---- results -----------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply EOS / stop token / length limits, free finished requests.

        Prompt logprobs of a step that sampled nothing (a partial prefill chunk)
        are passed on in an output without tokens.
        """
        outputs = self._finish_pooled(runner_out.pooled)
        for rid, token in runner_out.sampled_token_ids.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue  # aborted, or stopped by an earlier step's token: drop it
            req.num_output_placeholders -= 1
            tokens = runner_out.accepted_token_ids.get(rid) or [token]
            lps = runner_out.accepted_logprobs.get(rid)
            if lps is None and rid in runner_out.logprobs:
                lps = [runner_out.logprobs[rid]]
            if req.spec_token_ids:
                self._settle_drafts(req, len(tokens) - 1)
            kept = 0
            for t in tokens:
                kept += 1
                req.append_output_token(t)
                status = self._check_stop(req, t, None if req.structured is None else req.structured.accept(t))
                if status is not None:
                    req.status = status
                    # a request preempted while its step ran waits in the queue
                    (self.running if req in self.running else self.waiting).remove(req)
                    self._free(req)
                    break
            outputs.append(EngineCoreOutput(rid, tokens[:kept], req.status.finish_reason, req.stop_reason,
                                            None if lps is None else lps[:kept], runner_out.prompt_logprobs.get(rid),
                                            (req.spec_num_draft_tokens, req.spec_num_accepted_tokens)
                                            if req.spec_num_draft_tokens else None))
        for rid, plp in runner_out.prompt_logprobs.items():
            req = self.requests.get(rid)
            if rid not in runner_out.sampled_token_ids and req is not None and not req.is_finished():
                outputs.append(EngineCoreOutput(rid, [], prompt_logprobs=plp))
        return outputs

    def _finish_pooled(self, pooled: dict[str, list[float]]) -> list[EngineCoreOutput]:
        """Finish the pooling requests whose vectors a step produced (``stop``), freeing their blocks."""
        outputs = []
        for rid, vec in pooled.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue  # aborted meanwhile
            req.num_output_placeholders = 0
            req.status = RequestStatus.FINISHED_STOPPED
            (self.running if req in self.running else self.waiting).remove(req)
            self._free(req)
            outputs.append(EngineCoreOutput(rid, [], "stop", pooled=vec))
        return outputs

    def _settle_drafts(self, req: Request, num_accepted: int) -> None:
        """Apply a verdict: count it, and move ``num_computed_tokens`` back past the rejected
        drafts (unless the request was preempted meanwhile: it restarts from 0 anyway)."""
        num_drafts = len(req.spec_token_ids)
        req.spec_token_ids = []
        if req.status == RequestStatus.RUNNING:
            req.num_computed_tokens -= num_drafts - num_accepted
        if self.spec is not None:
            self.spec.record(req, num_drafts, num_accepted)

    def _check_stop(self, req: Request, token: int, grammar: str | None = None) -> RequestStatus | None:
        """The status a kept token ends the request with (``grammar``: what its matcher said), or ``None``."""
        params = req.sampling_params
        if grammar == "error":
            req.stop_reason = f"the grammar refused the output: {req.structured.error}"
            return RequestStatus.FINISHED_ERROR
        if req.num_output_tokens >= params.min_tokens:
            if token in req.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if grammar == "stop":
            return RequestStatus.FINISHED_STOPPED  # nothing more can follow (vLLM's is_terminated)
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

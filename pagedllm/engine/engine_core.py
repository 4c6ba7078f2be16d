"""The engine core: scheduler, KV cache manager and model runner, stepping on token ids only.

Everything text-shaped (tokenizing, detokenizing, stop strings, parsers, JSON)
stays in the front end (``LLMEngine`` / ``AsyncLLM``); the core sees token ids
and sampling parameters and returns ``EngineCoreOutput``s. This is the part a
separate core process will run.

With async scheduling (``EngineArgs.async_scheduling``, the default) the
core keeps one step in flight: each ``step()`` schedules and issues step N+1
on the runner's execution thread, then applies step N's results while N+1
runs. The scheduler counts the tokens in flight as placeholders, and the
runner feeds each sampled token into the next step itself.

Each step's phases are timed (seconds, ``time.perf_counter``): scheduling,
input preparation, model execution (forward and sampling), result handling,
and the idle gap between the end of one execution and the start of the next
(what the device waits for). ``get_stats().step_timings`` reports totals,
means per step and the idle fraction ``idle / (idle + execute)``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pagedllm.config import EngineArgs, parse_size
from pagedllm.core.encoder_cache import EncoderScheduler
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.core.state_pool import StatePool
from pagedllm.executor.base import UniProcExecutor
from pagedllm.executor.factory import create_executor
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.request import Request, RequestStatus
from pagedllm.spec_decode.config import TargetInfo
from pagedllm.spec_decode.scheduler import SpecDecoding
from pagedllm.stats import SchedulerStats, StepTimings
from pagedllm.memory import expected_resident_mib, resident_bytes, return_freed_memory
from pagedllm.models.moe import expert_weights
from pagedllm.models.quant_linear import quantized_kernels
from pagedllm.plan import EnginePlan, plan_engine, plan_prebuilt
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.state_cache import StateCache

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class PhaseTotals:
    """Seconds spent in each step phase so far (slots: a misspelt phase raises ``AttributeError``)."""

    schedule: float = 0.0
    prepare: float = 0.0
    execute: float = 0.0
    sample: float = 0.0
    update: float = 0.0
    idle: float = 0.0


class StepTimer:
    """Accumulates per-phase step times (seconds, ``time.perf_counter``) in ``totals``."""

    def __init__(self) -> None:
        self.totals = PhaseTotals()
        self.steps = 0
        self._last_exec_end: float | None = None

    def exec_started(self, now: float) -> None:
        """The device starts a step: the time since the previous one ended was idle."""
        if self._last_exec_end is not None:
            self.totals.idle += now - self._last_exec_end

    def exec_ended(self, now: float) -> None:
        """The device finished a step."""
        self._last_exec_end = now

    def pause(self) -> None:
        """No work is queued: waiting for requests is not an idle gap between steps."""
        self._last_exec_end = None

    def summary(self) -> StepTimings:
        """Totals and per-step means (seconds) and ``idle_fraction`` of device time."""
        t, n = self.totals, self.steps
        busy = t.execute + t.sample
        per = (lambda v: v / n) if n else (lambda v: 0.0)
        return StepTimings(schedule_s=t.schedule, prepare_s=t.prepare, execute_s=t.execute, sample_s=t.sample,
                           update_s=t.update, idle_s=t.idle, mean_schedule_s=per(t.schedule),
                           mean_prepare_s=per(t.prepare), mean_execute_s=per(t.execute),
                           mean_sample_s=per(t.sample), mean_update_s=per(t.update), mean_idle_s=per(t.idle),
                           steps=n, idle_fraction=t.idle / (t.idle + busy) if busy else 0.0)


class EngineCore:
    """Owns the model, the KV cache and the scheduler; steps on token ids.

    Args:
        args: engine arguments.
        model_dir: the resolved Hugging Face directory.
        max_model_len: context limit in tokens.
        eos_token_ids: token ids that end a sequence.
        model: an already built model (tests); by default it is loaded from ``model_dir``.
        scripted_output: test hook handed to the model runner (``worker/scripted.py``).
        plan: the engine plan (``pagedllm/plan.py``) the front end resolved; ``None`` resolves it here
            (from ``model_dir``, or from the prebuilt ``model``). It is logged once and kept as ``plan``.
    Raises:
        ValueError: an unservable architecture, or a KV pool too small for one block.
    """

    def __init__(self, args: EngineArgs, model_dir, max_model_len: int, eos_token_ids: set[int],
                 model=None, scripted_output=None, plan: EnginePlan | None = None) -> None:
        self.eos_token_ids = eos_token_ids
        self.plan = plan or (plan_prebuilt(args, model) if model is not None else plan_engine(args, model_dir))
        logger.info("engine plan: %s", self.plan.describe())
        # every torch op of the core (loading, KV allocation, steps) runs on this one thread
        threads = args.num_threads or torch.get_num_threads()
        self._exec = ThreadPoolExecutor(1, "pagedllm-exec", initializer=torch.set_num_threads, initargs=(threads,))
        # one rank in process, or rank 0 here and a worker process per other rank (executor/)
        self.executor = create_executor(args, model_dir, lambda fn: self._exec.submit(fn).result(), self.plan.model)
        try:
            self._init_model(args, model_dir, max_model_len, model, scripted_output)
        except BaseException:
            self.executor.shutdown()
            self._exec.shutdown(wait=False)
            raise

    def _init_model(self, args: EngineArgs, model_dir, max_model_len: int, model, scripted_output) -> None:
        """Load the model, size the KV pool, build the scheduler and every rank's runner."""
        from pagedllm.models.load import load_model
        eos_token_ids, dtype, device, plan = self.eos_token_ids, args.torch_dtype, args.torch_device, self.plan
        runtime = resident_bytes()  # before the weights: interpreter, torch, tokenizer
        if model is None:
            model, _ = self._exec.submit(load_model, model_dir, plan.model).result()
        elif not isinstance(self.executor, UniProcExecutor):
            raise ValueError("a prebuilt model serves one rank: --tensor-parallel-size must be 1")
        per_block = ModelRunner.kv_bytes_per_block(model, args.block_size, dtype)
        encoder_only = plan.encoder_only
        state_pool, state_bytes = self._plan_state(args, model, dtype)
        if encoder_only:  # no KV cache: a nominal pool, so that the context limit reads as for the others
            num_blocks = -(-max_model_len // args.block_size)
        else:
            num_blocks = args.num_kv_blocks or (parse_size(args.kv_cache_memory) - state_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={args.kv_cache_memory} holds no block of {per_block} bytes")
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", num_blocks, args.block_size,
                    num_blocks * per_block / 2**20)
        self.kv_cache_manager = KVCacheManager(num_blocks, args.block_size,
                                               args.enable_prefix_caching, state_pool)
        spec = (None if args.speculative_config is None
                else SpecDecoding(args.speculative_config, max_model_len,
                                  self._draft_proposer(args, model_dir, model, max_model_len),
                                  async_scheduling=args.async_scheduling))
        if spec is not None:
            logger.info("speculative decoding: %s, up to %d draft tokens (%s depth)", args.speculative_config.method,
                        args.speculative_config.num_speculative_tokens,
                        "dynamic" if args.speculative_config.dynamic else "fixed")
        overlap = plan.scheduler.pipeline_overlap  # several steps in flight (step_issuers.OverlappedIssuer)
        # an image-text model: each step's encoder budget is its token budget (vLLM's default)
        encoder = (EncoderScheduler(args.max_num_batched_tokens, getattr(model, "mm_prefix_attention", False))
                   if getattr(model, "is_multimodal", False) else None)
        self.scheduler = Scheduler(self.kv_cache_manager, args.max_num_seqs, args.max_num_batched_tokens,
                                   max_model_len, args.enable_chunked_prefill, spec, encoder_only=encoder_only,
                                   steps_in_flight=plan.scheduler.steps_in_flight, encoder=encoder,
                                   max_loras=args.max_loras if args.enable_lora else 0)
        # decode CUDA graphs with one rank only (every rank gets these sizes: none captures with several)
        sizes = dict(num_blocks=num_blocks, block_size=args.block_size, dtype=dtype, device=device, seed=args.seed,
                     eos_token_ids=eos_token_ids, max_num_reqs=args.max_num_seqs, max_model_len=max_model_len,
                     num_state_checkpoints=0 if state_pool is None else state_pool.num_checkpoints,
                     draft_state_slots=0 if state_pool is None else _draft_state_slots(args),
                     enforce_eager=not plan.cuda_graphs, cuda_graph_sizes=args.cuda_graph_sizes,
                     pipeline_overlap=overlap, compile_pieces=plan.compile, lora_config=args.lora_config())
        self.runner = self._exec.submit(self.executor.runner_class, model, **sizes, executor=self._exec,
                                        scripted_output=scripted_output).result()
        self.executor.start(self.runner, sizes)
        self.async_scheduling = args.async_scheduling
        self._in_flight = None  # (SchedulerOutput, StepHandle) issued but not yet applied
        self.num_prompt_tokens = self.num_generation_tokens = self.num_steps = self.max_num_running = 0
        self.num_computed_tokens = 0
        self.num_video_tokens_pruned = 0
        self.timer = StepTimer()
        # whether steps use the C CPU kernels, as chosen once at load with the attention backend
        # (reported in the stats: a served core logs in its own process)
        self.cpu_kernels = self.runner.attention_backend.uses_cpu_kernels
        self.weight_formats = dict(getattr(self.runner.model, "quantization", None) or {})
        self.weight_kernels = quantized_kernels() if self.weight_formats else ""
        self._experts = expert_weights(model)  # mixture-of-experts layers on the experts kernel
        # summed once: walking every expert's tensors in each step's stats took 6% of a decode step
        self._expert_bytes = sum(w.nbytes for w in self._experts)
        self.expected_rss_mib = round(expected_resident_mib(model, num_blocks * per_block + state_bytes,
                                                            runtime), 1)
        logger.info("expected resident memory: %.0f MiB (weights + KV pool + runtime)", self.expected_rss_mib)
        self._tokenizer_path = args.tokenizer or model_dir
        self._structured: StructuredOutputManager | None = None  # made with the first constrained request

    @staticmethod
    def _plan_state(args: EngineArgs, model, dtype: torch.dtype) -> tuple[StatePool | None, int]:
        """A hybrid model's state pool (one slot per seat, ``max_num_seqs``, plus with prefix caching
        ``num_state_checkpoints`` checkpoint slots, ``core/state_checkpoints.py``) and the bytes its
        tensors take out of ``kv_cache_memory``; ``(None, 0)`` for an attention-only model.

        With speculative decoding each request slot also has ``num_speculative_tokens`` draft slots
        (the state after each draft, kept until the verification says how many were accepted:
        ``StateCache.rollback``), counted here too.
        """
        spec = model.state_cache_spec() if hasattr(model, "state_cache_spec") else {}
        if not spec:
            return None, 0
        num_ckpt = 0
        if args.enable_prefix_caching:
            num_ckpt = args.max_num_seqs if args.num_state_checkpoints is None else args.num_state_checkpoints
        k = _draft_state_slots(args)
        nbytes = (args.max_num_seqs * (1 + k) + num_ckpt) * StateCache.bytes_per_slot(spec, dtype)
        logger.info("recurrent state: %d layers, %d slots + %d prefix-cache checkpoints + %d draft slots (%.2f MiB)",
                    len(spec), args.max_num_seqs, num_ckpt, args.max_num_seqs * k, nbytes / 2**20)
        return StatePool(args.max_num_seqs, num_ckpt), nbytes

    def _draft_proposer(self, args: EngineArgs, model_dir, model, max_model_len: int):
        """The draft model's proposer for ``speculative_config.method == "draft_model"``, else ``None``
        (the other methods need no model; ``SpecDecoding`` builds them). Raises what
        ``DraftModelProposer`` raises (a vocabulary other than the target's; a model not found)."""
        if args.speculative_config.method != "draft_model":
            return None
        from pagedllm.worker.draft_model import DraftModelProposer  # loads torch models: only when asked
        return DraftModelProposer(args.speculative_config, self._target_info(args, model_dir, model, max_model_len))

    def _target_info(self, args: EngineArgs, model_dir, model, max_model_len: int) -> TargetInfo:
        """What a model-running proposer (``draft_model``) needs to know of the target."""
        config = getattr(model, "config", None)
        vocab = getattr(config, "vocab_size", None)
        if vocab is None:  # a test double without a config: read the directory's
            from pagedllm.models.hf_config import read_hf_config
            vocab = read_hf_config(model_dir).vocab_size
        return TargetInfo(model_dir=str(model_dir), tokenizer_dir=str(args.tokenizer or model_dir), vocab_size=vocab,
                          dtype=args.torch_dtype, device=args.torch_device, block_size=args.block_size,
                          num_blocks=self.num_blocks, max_model_len=max_model_len,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          run=lambda fn: self._exec.submit(fn).result(), seed=args.seed)

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        """Grammar compiling and step masks (built on first use: most engines never need it)."""
        if self._structured is None:
            self._structured = StructuredOutputManager(self._tokenizer_path, 0, self.eos_token_ids)
        return self._structured

    # ---- requests ----------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated request: the one place a front-end message becomes a scheduler ``Request``.

        Raises:
            ValueError: the request id is already live.
        """
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        req = Request(request.request_id, request.prompt_token_ids, request.sampling_params, self.eos_token_ids,
                      request.max_tokens, request.arrival_time, request.cache_salt, request.pooling_params,
                      request.mm_inputs, request.lora_request)
        so = request.sampling_params.structured_outputs
        if so is not None:
            req.structured = self.structured_output_manager.submit(so)  # compiles off the step loop
        self.scheduler.add_request(req)
        self.num_prompt_tokens += req.num_prompt_tokens
        self.num_video_tokens_pruned += sum(m.pruned for m in req.mm_inputs)

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests (abort, or a stop string found by the front end); their blocks are freed now."""
        self.scheduler.finish_requests(request_ids, status)

    # ---- utilities (callable from the front end through EngineCoreClient.call_utility) ----------
    UTILITIES = frozenset({"reset_prefix_cache"})

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds; returns how many were dropped."""
        return self.kv_cache_manager.reset_prefix_cache()

    def call_utility(self, name: str, *args):
        """Run the utility method ``name``.

        Raises:
            ValueError: ``name`` is not in ``UTILITIES``.
        """
        if name not in self.UTILITIES:
            raise ValueError(f"unknown engine core utility {name!r} (known: {sorted(self.UTILITIES)})")
        return getattr(self, name)(*args)

    def check_health(self) -> None:
        """Return when every rank can step; raise ``WorkerDiedError`` when a worker process is gone."""
        self.executor.check_health()

    def is_healthy(self) -> bool:
        """False once a worker process of the executor is gone (``/health`` then answers 503)."""
        try:
            self.executor.check_health()
        except RuntimeError:
            return False
        return True

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs, or a step's results are still to be applied."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Advance the engine by one step; returns the per-request results that became known.

        Synchronous: schedule, run and apply one step. With async scheduling, step
        N+1 is scheduled and issued first, then step N's results (issued by the
        previous call) are applied while N+1 runs; the results returned are step N's.
        Either way, the token bitmask of the issued step's constrained rows is filled
        after the previous step's tokens are applied, while the issued step's forward runs.
        """
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        errors = self.scheduler.take_error_outputs()
        self.timer.totals.schedule += time.perf_counter() - t0
        if so.is_empty and self._in_flight is None:
            self.timer.pause()
            if self._structured is not None and self.scheduler.waiting:
                self._structured.wait_for_compiles(0.05)  # only grammar-waiting requests: do not spin
        handle = self.executor.execute(so, self.timer, non_blocking=True)
        if not self.async_scheduling:
            self._fill_grammar(handle)
            return errors + self._apply(so, handle)
        prev, self._in_flight = self._in_flight, (None if so.is_empty else (so, handle))
        try:
            outputs = self._apply(*prev) if prev is not None else []
        finally:
            self._fill_grammar(handle)  # always published: the execution thread waits for it
        if so.is_empty:
            handle.result()
        return errors + outputs

    def _fill_grammar(self, handle) -> None:
        """Fill and publish the issued step's token bitmask (no-op without constrained rows)."""
        mask = handle.grammar
        if mask is None:
            return
        bitmask = None
        try:
            states = {rid: r.structured for rid in mask.req_ids
                      if (r := self.scheduler.requests.get(rid)) is not None and r.structured is not None}
            bitmask = self.structured_output_manager.fill(mask, states)
        finally:
            mask.publish(bitmask)

    def _apply(self, so, handle) -> list[EngineCoreOutput]:
        """Wait for an issued step and apply its tokens to the scheduler."""
        runner_out = handle.result()
        spec = self.scheduler.spec
        if spec is not None and so.num_scheduled_tokens and so.total_num_scheduled_tokens == len(
                so.num_scheduled_tokens) + sum(map(len, so.spec_token_ids.values())):
            spec.observe_step(so.total_num_scheduled_tokens, runner_out.execute_s)  # a decode-only step
        t2 = time.perf_counter()
        core_outputs = self.scheduler.update_from_output(so, runner_out)
        self.timer.totals.update += time.perf_counter() - t2
        self.timer.steps += 1
        self.num_steps += 1
        self.max_num_running = max(self.max_num_running, len(so.num_scheduled_tokens))
        self.num_generation_tokens += sum(len(o.new_token_ids) for o in core_outputs)
        self.num_computed_tokens += so.total_num_scheduled_tokens
        if not self.has_unfinished_requests():
            self.timer.pause()
            return_freed_memory()  # idle now: give the steps' freed activations back to the OS
        return core_outputs

    def shutdown(self) -> None:
        """Finish the step in flight, if any, and stop the execution thread."""
        if self._in_flight is not None:
            try:
                self._in_flight[1].result()
            except Exception:  # the step failed (a dead worker): its error was or will be reported
                logger.debug("the step in flight failed at shutdown", exc_info=True)
            self._in_flight = None
        self._exec.shutdown(wait=True)
        self.executor.shutdown()
        if self._structured is not None:
            self._structured.shutdown()

    def get_stats(self) -> SchedulerStats:
        """The counters now (see ``SchedulerStats``); ``max_num_running`` is the most requests
        scheduled together in one step so far."""
        kv = self.kv_cache_manager
        return SchedulerStats(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                              kv_cache_usage=kv.usage(), num_free_blocks=kv.num_free_blocks,
                              **self._state_stats(),
                              num_blocks=self.num_blocks, num_preemptions=self.scheduler.num_preemptions,
                              prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
                              num_prompt_tokens=self.num_prompt_tokens,
                              num_video_tokens_pruned=self.num_video_tokens_pruned,
                              num_generation_tokens=self.num_generation_tokens, num_steps=self.num_steps,
                              num_computed_tokens=self.num_computed_tokens,
                              max_num_running=self.max_num_running, cpu_kernels=self.cpu_kernels,
                              weight_formats=self.weight_formats, weight_kernels=self.weight_kernels,
                              expected_rss_mib=self.expected_rss_mib,
                              expert_bytes=self._expert_bytes,
                              experts_chosen=[w.chosen.tolist() for w in self._experts],
                              step_timings=self.timer.summary(), block_states=kv.block_states(),
                              **self._spec_stats())

    def _state_stats(self) -> dict:
        """The state-pool counters of ``SchedulerStats`` (zeros for an attention-only model)."""
        pool = self.kv_cache_manager.state_pool
        return {} if pool is None else dict(num_free_state_slots=pool.num_free_slots, num_state_slots=pool.num_slots)

    def _spec_stats(self) -> dict:
        """The speculation counters of ``SchedulerStats`` (zeros without speculative decoding)."""
        spec = self.scheduler.spec
        if spec is None:
            return {}
        return dict(spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
                    spec_num_accepted_tokens=spec.num_accepted_tokens,
                    spec_accepted_per_position=list(spec.accepted_per_position))


def _draft_state_slots(args: EngineArgs) -> int:
    """Draft state slots per request slot of a hybrid model: ``num_speculative_tokens`` with
    speculative decoding, else 0."""
    return args.speculative_config.num_speculative_tokens if args.speculative_config is not None else 0

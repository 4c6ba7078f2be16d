"""Executes scheduler steps on the device: builds the flattened batch, runs the model, samples.

Per-request state lives in the persistent ``InputBatch`` (fixed slots), so
the scheduler sends only diffs and a step's inputs come from one vectorized
pass over the scheduled slots.

Steps run in order on one execution thread (the engine core's), the CPU
analogue of a device stream; issued without waiting
(``execute(..., non_blocking=True)``), they run while the caller schedules
and prepares the next step. All torch work of the engine happens on that one
thread: on CPU, a second thread entering OpenMP parallel regions creates a
second thread team, and on two cores that made every matrix product about
1.5x slower, even when the two never ran at the same time. A request
whose last token is still being sampled by the previous step gets that token
from the previous step's sampled ids right before its own step runs, so
preparing step N+1 never waits for step N.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.torch_paged import TorchPagedBackend
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.models.layers.compiled import compile_model
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.logits_rows import constrain, grammar_rows, logits_rows_of, prompt_logprobs
from pagedllm.worker.lora_slots import LoRASlots
from pagedllm.worker.multimodal_step import EncoderCache
from pagedllm.worker.pooler import PoolingSpan, hidden_rows, pool, token_type_rows
from pagedllm.worker.prepared_step import Launched, PreparedStep, StepHandle
from pagedllm.worker.sampler import Sampler
from pagedllm.worker.scripted import ScriptedOutput
from pagedllm.worker.spec_verify import verify_step
from pagedllm.worker.state_cache import StateCache
from pagedllm.worker.step_inputs import make_step_inputs
from pagedllm.worker.step_issuers import make_issuer
from pagedllm.worker.token_drawers import make_drawer


class ModelRunner:
    """Owns the model, the KV cache tensors and the persistent batch.

    Args:
        model: native model with ``forward(input_ids, positions, kv_caches, meta, logits_indices)``
            and ``kv_cache_spec() -> (num_layers, num_kv_heads, head_dim)``; its
            ``attention_backend``, when it has one, builds each step's ``meta``.
        num_blocks: KV blocks to allocate.
        block_size: tokens per block.
        dtype: KV cache dtype.
        device: device of the model and cache.
        seed: sampler seed.
        eos_token_ids: the model's EOS ids, banned (with stop token ids) before ``min_tokens``.
        max_num_reqs: batch slots (the scheduler's ``max_num_seqs``).
        max_model_len: longest sequence in tokens.
        executor: the one-thread executor that runs every step (``None``: run on the caller's thread).
        scripted_output: test hook; when given, every request's output tokens are its script's
            (``worker/scripted.py``) instead of the sampled ones.
        num_state_checkpoints: a hybrid model's prefix-cache checkpoint slots, after its
            ``max_num_reqs`` request slots in the state tensors (``core/state_pool.py``).
        draft_state_slots: a hybrid model's state slots per request slot for the states after
            each draft token (``num_speculative_tokens``; 0 without speculation), after those.
        enforce_eager: capture no CUDA graph (vLLM's ``--enforce-eager``).
        compile_pieces: ``torch.compile`` the model's torch-op norms, activations and rotary
            (``models/layers/compiled.py``) before any graph is captured.
        cuda_graph_sizes: decode batch buckets to capture (``None``: ``cuda_graphs.default_sizes``).
        graph_capture: the capture mechanism (``None``: ``cuda_graphs.capture_for(device)``, which
            captures only on CUDA); graphs are built only for the Triton backend.
        pipeline_overlap: with a pipelined model (the engine plan's ``scheduler.pipeline_overlap``), issue each step's
            forward and take its logits only when its result is asked (``step_issuers.OverlappedIssuer``); a
            step with inputs still being sampled has the step before finished first.
        lora_config: with ``enable_lora``, the ``lora.config.LoRAConfig``: the model's linears get
            adapter slots (``worker/lora_slots.py``) and each step's adapter rows reach the model
            as its ``lora`` keyword. ``None``: no adapters.
    Attributes:
        attention_backend: the model's attention backend (chosen at load), or for a model
            without one (test doubles that read the metadata themselves) the torch reference.
        decode_graphs: the captured decode graphs (``cuda_graphs.DecodeGraphs``), or ``None``.
        step_counts: forwards run so far, ``{"graph": n, "eager": m}``.
    """

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 seed: int = 0, eos_token_ids: set[int] | None = None, max_num_reqs: int = 128,
                 max_model_len: int = 8192, executor: ThreadPoolExecutor | None = None,
                 scripted_output: ScriptedOutput | None = None, num_state_checkpoints: int = 0,
                 draft_state_slots: int = 0, enforce_eager: bool = False, compile_pieces: bool = False,
                 cuda_graph_sizes: list[int] | None = None, graph_capture=None,
                 pipeline_overlap: bool = False, lora_config=None) -> None:
        self.model = model
        # LoRA adapters: slots around the model's linears, rows per adapter each step (lora_slots.py)
        self.lora = None if lora_config is None else LoRASlots(model, lora_config, device)
        self.encoder_only = bool(getattr(model, "encoder_only", False))  # pooling only; pairs carry token types
        # several steps in flight across pipeline stages (``step_issuers.OverlappedIssuer``): the engine plan decides
        self.pipeline_overlap = pipeline_overlap
        backend: AttentionBackend | None = getattr(model, "attention_backend", None)
        self.attention_backend = backend or TorchPagedBackend(device)
        self.block_size = block_size
        self.device = device
        layers, kvh, d = model.kv_cache_spec()
        shape = (kvh, num_blocks, block_size, d)  # head-major: see attention/torch_paged.py
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(layers)]
        self.input_batch = InputBatch(max_num_reqs, max_model_len, block_size)
        # a hybrid model's recurrent state: one slot per running request (core/state_pool.py)
        self.state_cache = StateCache.for_model(model, max_num_reqs + num_state_checkpoints, dtype, device,
                                                draft_slots=(max_num_reqs, draft_state_slots))
        self.sampler = Sampler(seed, eos_token_ids)
        # a multimodal model's encoder outputs and each step's image rows (multimodal_step.py)
        self.encoder_cache = EncoderCache(model.rope_positions if getattr(model, "mrope", False) else None) if getattr(
            model, "is_multimodal", False) else None
        self.mm_prefix = self.encoder_cache is not None and getattr(model, "mm_prefix_attention", False)
        self.prefix_lm = self.mm_prefix and getattr(model, "prefix_lm", False)  # PaliGemma: one span, the prompt
        # the strategies, chosen once: where inputs are built, how tokens are drawn, how steps are
        # issued (step_inputs.py, token_drawers.py, step_issuers.py)
        self.step_inputs = make_step_inputs(self.input_batch, self.attention_backend, device, block_size,
                                            bidirectional=self.mm_prefix,
                                            metadata=getattr(model, "step_metadata", None))  # Whisper's layouts
        self.drawer = make_drawer(self.sampler, self.attention_backend.name, scripted_output,
                                  min(eos_token_ids) if eos_token_ids else 0, seed)
        self.issuer = make_issuer(self, executor, self.pipeline_overlap)
        self._last: PreparedStep | None = None  # the most recently issued step
        self.max_model_len = max_model_len
        self.step_counts = {"graph": 0, "eager": 0}
        self.compiled_modules = compile_model(model) if compile_pieces else 0
        self.decode_graphs = None
        if not enforce_eager and self.attention_backend.name == "triton" and self.state_cache is None:
            from pagedllm.worker.device.cuda_graphs import capture_decode_graphs
            self.decode_graphs = capture_decode_graphs(model, self.kv_caches, self.attention_backend, self.input_batch,
                                                       max_model_len, cuda_graph_sizes, graph_capture, device)

    def _graph_step(self, n: np.ndarray, spec: np.ndarray, sample: np.ndarray, rows: np.ndarray,
                    pool_rows) -> bool:
        """Whether a step replays a decode graph: graphs captured, one query token and no draft per
        request, every request sampled with no prompt-logprob row, nothing pooled, and at most the
        largest bucket's requests."""
        g = self.decode_graphs
        return (g is not None and pool_rows is None and bool((n == 1).all()) and not spec.any()
                and sample.size == n.size == rows.size and g.bucket(n.size) is not None)

    def _forward(self, step: PreparedStep) -> torch.Tensor:
        """The step's logits ``[R', vocab]`` float32: replayed through its decode graph, or eager."""
        if step.graph:
            self.step_counts["graph"] += 1
            return self.decode_graphs.run(step.input_ids, step.positions, step.meta)
        self.step_counts["eager"] += 1
        return self.model(step.input_ids, step.positions, self.kv_caches, step.meta, step.logits_rows,
                          **step.model_kwargs)

    @property
    def requests(self) -> dict[str, int]:
        """Request id -> batch slot of every request the runner holds."""
        return self.input_batch.slot_of

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers (K and V)."""
        layers, kvh, d = model.kv_cache_spec()
        return 2 * layers * block_size * kvh * d * torch.empty((), dtype=dtype).element_size()

    def _update_states(self, so: SchedulerOutput) -> None:
        b = self.input_batch
        for rid in so.finished_req_ids:
            if self.lora is not None and rid in b.slot_of:  # its adapter may leave host memory now
                self.lora.release(int(b.lora_id[b.slot_of[rid]]))
            b.remove(rid)
        for nr in so.new_reqs:
            b.add(nr)
            if self.lora is not None:
                self.lora.register(nr.lora_request)
        for cr in so.cached_reqs:
            b.update(cr)
        if self.encoder_cache is not None:
            self.encoder_cache.update(so)

    def _prepare(self, so: SchedulerOutput) -> PreparedStep:
        """Build the step's inputs in one vectorized pass over the scheduled slots."""
        rids = list(so.num_scheduled_tokens)
        slots = np.fromiter((self.input_batch.slot_of[r] for r in rids), dtype=np.int64, count=len(rids))
        n = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(rids))
        start = self.input_batch.num_computed_tokens[slots]
        qsl = np.zeros(len(rids) + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        end = start + n
        spec = self._write_drafts(rids, slots, so.spec_token_ids)
        sample, pend, pending_src, slot_row, sampling = self._prepare_sampling(slots, end, spec)
        rows, prompt_lp = logits_rows_of(self.input_batch, rids, slots, start, end, qsl, sample, spec)
        inputs = self.step_inputs.stage(slots, n, start, end, qsl, spec, pend, pending_src, rows, bidirectional=(
            self.encoder_cache.spans(rids, start, end, self.prefix_lm) if self.mm_prefix else None))  # Gemma 3's images
        pool_rows, pool_spans = self._prepare_pooling(rids, slots, start, end, qsl)
        kwargs = {} if self.state_cache is None else {
            "state": self.state_cache.batch(self.input_batch.state_slot[slots], start, qsl, rids,
                                            so.state_restores, so.state_checkpoints, so.spec_token_ids)}
        if self.lora is not None and (rows := self.lora.plan(self.input_batch.lora_id[slots], n)) is not None:
            kwargs["lora"] = rows  # each row's adapter id; slots are taken when the step runs (_launch)
        if self.encoder_only and (types := token_type_rows([self.input_batch.pooling[i] for i in slots.tolist()],
                                                           qsl)) is not None:
            kwargs["token_type_ids"] = types.to(self.device)  # a cross-encoder's pairs
        if self.encoder_cache is not None and (mm := self.encoder_cache.plan(so, rids, start, end, qsl)) is not None:
            kwargs["mm"] = mm  # image rows: encoded and written over their placeholders when the step runs
        if self.encoder_cache is not None and (rope := self.encoder_cache.rope_positions(rids, start, n)) is not None:
            kwargs["rope_positions"] = rope.to(self.device)  # M-RoPE: Qwen2.5-VL's 3-D positions over images
        return PreparedStep(
            pool_rows=pool_rows, pool_spans=pool_spans, model_kwargs=kwargs,
            graph=self._graph_step(n, spec, sample, rows, pool_rows) and not {"mm", "rope_positions", "lora"} & kwargs.keys(),
            has_pending=bool(pend.size),
            **inputs, sample_ids=[rids[i] for i in sample.tolist()], sampling=sampling, prompt_lp=prompt_lp,
            slot_row=slot_row, grammar=grammar_rows(rids, sample, sampling, so.spec_token_ids),
            drafts=None if not so.spec_token_ids else [so.spec_token_ids.get(rids[i], []) for i in sample.tolist()],
            draft_probs=None if not so.spec_draft_probs else [so.spec_draft_probs.get(rids[i]) for i in sample.tolist()])

    def _write_drafts(self, rids: list[str], slots: np.ndarray, drafts: dict[str, list[int]]) -> np.ndarray:
        """Put each request's draft tokens after its known tokens (they are inputs of this step, not
        known tokens); returns ``[R]`` int64 draft counts."""
        spec = np.zeros(len(rids), dtype=np.int64)
        if drafts:
            b = self.input_batch
            for i, rid in enumerate(rids):
                d = drafts.get(rid)
                if d:
                    s, known = int(slots[i]), int(b.num_tokens[slots[i]])
                    b.token_ids[s, known:known + len(d)] = d
                    spec[i] = len(d)
        return spec

    def _prepare_sampling(self, slots: np.ndarray, end: np.ndarray, spec: np.ndarray):
        """Which requests sample a token this step, and where their pending inputs come from.

        A request whose last scheduled token is still being sampled by the previous step
        takes that token from the previous step's samples.

        Args:
            slots: ``[R]`` int64 batch slots; end: ``[R]`` int64 tokens computed after this step;
            spec: ``[R]`` int64 draft tokens each computes after its known tokens.
        Returns:
            ``(sample, pend, pending_src, slot_row, sampling)``: ``[S]`` indices (into the ``R``
            requests) of those that sample; ``[P]`` indices of those with a pending token, and
            ``[P]`` its row among the previous step's samples; ``[max_num_reqs]`` sample row of
            each slot (-1: none); their ``SamplingMetadata`` (``None`` when ``S == 0``).
        """
        b = self.input_batch
        known = b.num_tokens[slots] + spec
        pend = np.flatnonzero(end > known)
        # reached the sequence's end: sample the next token (a pooling request is pooled instead)
        sample = np.flatnonzero((end >= known) & ~b.is_pooling[slots])
        pending_src = np.zeros(0, dtype=np.int64)
        if pend.size:
            assert self._last is not None and bool((end[pend] == known[pend] + 1).all())
            pending_src = self._last.slot_row[slots[pend]]
            assert bool((pending_src >= 0).all()), "a pending token's step sampled no token for it"
        slot_row = np.full(b.max_num_reqs, -1, dtype=np.int64)
        slot_row[slots[sample]] = np.arange(sample.size)
        sampling = (b.sampling_metadata(slots[sample], np.searchsorted(sample, pend), pending_src)
                    if sample.size else None)
        return sample, pend, pending_src, slot_row, sampling

    def _prepare_pooling(self, rids: list[str], slots: np.ndarray, start: np.ndarray, end: np.ndarray,
                         qsl: np.ndarray) -> tuple[torch.Tensor | None, list[PoolingSpan]]:
        """The pooling requests whose prompt is computed by this step, and the rows they need
        (``pooler.hidden_rows``); ``(None, [])`` when there are none."""
        b = self.input_batch
        idx = np.flatnonzero(b.is_pooling[slots] & (end >= b.num_tokens[slots]))
        if not idx.size:
            return None, []
        rows, spans = hidden_rows([rids[i] for i in idx.tolist()], [b.pooling[int(slots[i])] for i in idx.tolist()],
                                  qsl[:-1][idx], qsl[1:][idx], start[idx])
        return torch.from_numpy(rows).to(self.device), spans

    def execute(self, so: SchedulerOutput, timer=None, non_blocking: bool = False) -> StepHandle:
        """Apply the step's diffs to the batch, prepare its inputs and issue it.

        Args:
            so: the step's plan.
            timer: optional ``StepTimer``; gets the prepare / execute / sample times (seconds).
            non_blocking: return at once, with the step queued on the execution thread after
                any step issued before it; otherwise wait until it has run.
        Returns:
            A handle whose ``result()`` gives the sampled tokens. Call ``result()`` on the
            handles in issue order, before the step after next is issued.
        """
        t0 = time.perf_counter()
        self._update_states(so)
        if so.is_empty:
            return StepHandle(None, None, ModelRunnerOutput())
        step, prev = self._prepare(so), self._last
        self._last = step
        if timer is not None:
            timer.totals.prepare += time.perf_counter() - t0
        handle = self.issuer.issue(step, prev, timer)
        if not non_blocking and self.issuer.waits:
            handle.result()
        return handle

    @torch.inference_mode()
    def _run(self, step: PreparedStep, prev: PreparedStep | None, timer) -> ModelRunnerOutput:
        """Forward and sample one prepared step (on the execution thread when non-blocking)."""
        return self._finish(step, prev, timer, self._launch(step, prev, timer))

    @torch.inference_mode()
    def _launch(self, step: PreparedStep, prev: PreparedStep | None, timer) -> Launched:
        """Complete the step's inputs and run its forward; with ``pipeline_overlap`` the forward is
        only issued (``model.forward_launch``) and ``_finish`` takes its logits."""
        t1 = time.perf_counter()
        if timer is not None:
            timer.exec_started(t1)
        self.step_inputs.fill(step, prev)
        if "lora" in step.model_kwargs:  # on this thread, so no slot changes under a step that runs
            step.model_kwargs["lora"] = self.lora.activate(step.model_kwargs["lora"])
        if step.pool_rows is not None:  # the same forward also hands back the pooled rows' final hidden states
            logits, hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta, step.logits_rows,
                                        step.pool_rows, **step.model_kwargs)
            return Launched(t1, logits, hidden)
        if self.pipeline_overlap:
            return Launched(t1, pipeline=self.model.forward_launch(step.input_ids, step.positions, self.kv_caches,
                                                                   step.meta, step.logits_rows))
        return Launched(t1, self._forward(step))

    @torch.inference_mode()
    def _finish(self, step: PreparedStep, prev: PreparedStep | None, timer, launched: Launched) -> ModelRunnerOutput:
        """Sample a launched step (``_launch``'s result) and fill its ``ModelRunnerOutput``."""
        out = ModelRunnerOutput()
        logits = launched.logits if launched.pipeline is None else self.model.forward_finish(launched.pipeline)
        if launched.hidden is not None:
            out.pooled = pool(launched.hidden, step.pool_spans)
        t2 = time.perf_counter()
        num_sampled = len(step.sample_ids)
        num_rows = num_sampled + sum(len(d) for d in step.drafts or ())
        if num_sampled:
            self._draw(step, prev, logits[:num_rows], out)
        if step.prompt_lp:
            prompt_logprobs(logits[num_rows:], step.prompt_lp, out)
        t3 = time.perf_counter()
        out.execute_s = t3 - launched.t_start
        if timer is not None:
            timer.exec_ended(t3)
            timer.totals.execute += t2 - launched.t_start
            timer.totals.sample += t3 - t2
        return out

    def _draw(self, step: PreparedStep, prev: PreparedStep | None, logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        """The step's tokens from its sampled rows' ``logits`` (``[R', vocab]`` float32): masked by
        the grammar rows, then verified (a step with drafts) or drawn (``self.drawer``)."""
        md = step.sampling
        pending = prev if md.pending_rows.size else None
        if step.grammar is not None:
            logits = constrain(logits, step.grammar, step.drafts)
        if step.drafts is not None:
            tokens = verify_step(self.sampler, self.state_cache, step, logits, md, pending and pending.tokens_list(), out)
        else:
            tokens = self.drawer.draw(step, logits, md, pending, out)
        if tokens is not None:  # host ids; on the device path they follow in step.host_tokens
            step.sampled_list = tokens
            step.sampled = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            out.sampled_token_ids = dict(zip(step.sample_ids, tokens))

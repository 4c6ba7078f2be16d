"""A prepared step and the handle of an issued one (the data that passes between the scheduling
thread, which builds a step, and the execution thread, which runs it: ``model_runner.py``)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.structured_output.manager import GrammarMask
from pagedllm.worker.device.host_tokens import HostTokens
from pagedllm.worker.input_batch import InputBatch, SamplingMetadata
from pagedllm.worker.pooler import PoolingSpan

if TYPE_CHECKING:
    from pagedllm.worker.device.device_inputs import DeviceStepPlan


@dataclass
class PreparedStep:
    """One step's inputs, built on the scheduling thread, then run on the execution thread.

    Attributes:
        input_ids: ``[T]`` int64; entries at ``pending_idx`` are filled from the previous step.
        positions: ``[T]`` int64 absolute positions.
        meta: the attention backend's metadata of the step.
        logits_rows: ``[R + P]`` int64 rows of the flattened batch whose logits are needed:
            the ``R`` sampled ones, then the prompt-logprob positions.
        sample_ids: the ``R`` request ids sampled this step, in row order.
        sampling: their ``SamplingMetadata`` (``None`` when ``R == 0``).
        prompt_lp: per request with prompt logprobs computed this step,
            ``(request id, first prompt token index, targets [n] int64, k)``.
        pending_idx, pending_src: ``[P]`` int64 rows of ``input_ids`` that take the previous
            step's sampled token, and that token's row among the previous step's samples.
        slot_row: ``[max_num_reqs]`` int64, the sample row of each batch slot this step (-1: none).
        grammar: the token bitmask of the rows with structured outputs, filled by the engine
            core while the forward runs (``None``: no such row).
        sampled: ``[R]`` int64 sampled ids, set once the step has run (a request with drafts:
            its last emitted token).
        sampled_list: the same ids on the host (``tokens_list()``: on the device path they arrive
            through ``host_tokens``, read when the scheduling thread asks for the result).
        host_tokens: the device path's pending copy of ``sampled`` (``worker/device/host_tokens.py``).
        drafts: per sampled request, its draft tokens (``None``: no request has any); a request
            with ``k`` drafts has ``k + 1`` rows in ``logits_rows``.
        emitted: per sampled request with drafts, every token the verification emitted.
        draft_probs: per sampled request, the ``[len(drafts), V]`` float32 distributions its drafts
            were drawn from, or ``None`` (point masses); ``None`` when no request has any.
        pool_rows: ``[N]`` int64 rows whose final hidden states the pooling requests finishing
            this step need (``None``: no such request); pool_spans: those requests (``worker/pooler.py``).
        model_kwargs: extra keyword arguments of the model's forward (a hybrid model's ``state``).
        device_plan: the device path's staged step (``worker/device/device_inputs.py``); while set,
            ``input_ids``, ``positions`` and ``meta`` are ``None`` until the step runs.
        graph: the step's forward replays a captured decode graph (``worker/device/cuda_graphs.py``).
        has_pending: some input is a token the previous step is still sampling.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    sample_ids: list[str]
    sampling: SamplingMetadata | None
    prompt_lp: list
    pending_idx: torch.Tensor
    pending_src: torch.Tensor
    slot_row: np.ndarray
    grammar: GrammarMask | None = None
    sampled: torch.Tensor | None = None
    sampled_list: list[int] = field(default_factory=list)
    host_tokens: HostTokens | None = None
    drafts: list[list[int]] | None = None
    emitted: dict[str, list[int]] = field(default_factory=dict)
    draft_probs: list | None = None
    pool_rows: torch.Tensor | None = None
    pool_spans: list[PoolingSpan] = field(default_factory=list)
    model_kwargs: dict = field(default_factory=dict)
    device_plan: DeviceStepPlan | None = None
    graph: bool = False
    has_pending: bool = False

    def tokens_list(self) -> list[int]:
        """The sampled ids as a host list (waits for the device path's copy the first time)."""
        if self.host_tokens is not None and not self.sampled_list:
            self.sampled_list = self.host_tokens.get()
        return self.sampled_list


@dataclass
class Launched:
    """A step whose forward has run, or with a pipeline been issued (``ModelRunner._launch``), and
    which ``ModelRunner._finish`` samples.

    Attributes:
        t_start: ``time.perf_counter()`` seconds when the launch began (0.0 on a worker rank).
        logits: ``[R', vocab]`` float32 logits rows, or ``None`` (pipeline: ``finish`` takes them).
        hidden: ``[P, hidden]`` final hidden states of the pooled rows, or ``None``.
        pipeline: the model's launched pipeline step (``forward_finish`` takes it), or ``None``.
    """

    t_start: float
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    pipeline: object | None = None


class StepHandle:
    """An issued step. ``result()`` waits for it, records its tokens in the batch, and returns them.

    Raises:
        Exception: whatever the step raised on the execution thread.
    """

    def __init__(self, batch: InputBatch | None, step: PreparedStep | None,
                 output: ModelRunnerOutput | None = None, future: Future | None = None, run=None) -> None:
        self._batch, self._step, self._output, self._future = batch, step, output, future
        self._run = run  # a step run on the caller's thread (no executor) runs when its result is asked
        self.grammar = step.grammar if step is not None else None

    def result(self) -> ModelRunnerOutput:
        """The step's sampled tokens (and logprobs), once it has run."""
        if self._run is not None:
            self._output, self._run = self._run(), None
        if self._future is not None:
            self._output, self._future = self._future.result(), None
        if self._step is not None:
            batch = self._batch
            if self._step.host_tokens is not None:  # the device path's ids land here, not on the execution thread
                self._output.sampled_token_ids = dict(zip(self._step.sample_ids, self._step.tokens_list()))
            if self._step.emitted:
                for rid, toks in self._step.emitted.items():
                    batch.extend_tokens(rid, toks)
                rest = [(r, t) for r, t in zip(self._step.sample_ids, self._step.tokens_list())
                        if r not in self._step.emitted]
                batch.append_tokens([r for r, _ in rest], [t for _, t in rest])
            else:
                batch.append_tokens(self._step.sample_ids, self._step.tokens_list())
            self._step = None
        return self._output

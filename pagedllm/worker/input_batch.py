"""The persistent batch: each running request's state in a fixed slot of preallocated arrays.

The scheduler sends a request's tokens and block table once (``NewRequestData``)
and afterwards only new block ids and counts (``CachedRequestData``). The
runner writes those into the request's slot, and each step's inputs come from
one vectorized pass over the scheduled slots (numpy fancy indexing), with no
Python loop over tokens. Every array handed to a step is a fresh copy, so the
slots can change (requests join and leave) while an earlier step still runs
on another thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from pagedllm.core.scheduler_output import CachedRequestData, NewRequestData
from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Sampling inputs of one step's sampled rows (``R`` rows, in logits order).

    Attributes:
        params: each row's ``SamplingParams`` (for the rarely used per-request paths).
        output_lens: ``[R]`` tokens generated before the one sampled now (the seeded stream's
            position), counting a token still being sampled by the previous step.
        all_greedy: every row has temperature 0 (the draw is a plain argmax; other rows
            build their temperature / top-k / top-p / min-p / seed from ``params``).
        any_min_tokens, any_logit_bias: some row has ``min_tokens`` unmet / a ``logit_bias``.
        any_structured: some row has structured outputs (its logits are masked by a grammar).
        penalty_rows: rows with a repetition, frequency or presence penalty.
        penalty_outputs, penalty_prompts: per penalty row, its known output and prompt ids
            (``[n]`` int64 arrays; the prompt only when ``repetition_penalty != 1``).
        pending_rows, pending_src: ``[P]`` rows whose last output token is the previous step's
            sample, and that token's row in the previous step's sampled tokens.
    """

    params: list[SamplingParams]
    output_lens: np.ndarray
    all_greedy: bool
    any_min_tokens: bool
    any_logit_bias: bool
    any_structured: bool = False
    penalty_rows: list[int] = field(default_factory=list)
    penalty_outputs: list[np.ndarray] = field(default_factory=list)
    penalty_prompts: list[np.ndarray] = field(default_factory=list)
    pending_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pending_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


class InputBatch:
    """Fixed slots holding every running request's tokens, block table and sampling settings.

    Args:
        max_num_reqs: slots (the scheduler's ``max_num_seqs``).
        max_model_len: longest sequence in tokens; each slot holds that many token ids (+2:
            the token sampled at the limit, and one a late stop computes).
        block_size: tokens per KV block.
    Raises:
        RuntimeError: from ``add`` when every slot is taken (the scheduler never runs more
            than ``max_num_reqs`` requests).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.block_size = block_size
        width = max_model_len + 2
        self.token_ids = np.zeros((max_num_reqs, width), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)          # known tokens
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, -(-width // block_size)), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.state_slot = np.full(max_num_reqs, -1, dtype=np.int64)  # recurrent-state slot (hybrid models)
        self.lora_id = np.zeros(max_num_reqs, dtype=np.int64)  # LoRA adapter's lora_int_id (0: base model)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1 = not asked
        self.has_bias = np.zeros(max_num_reqs, dtype=bool)
        self.has_penalty = np.zeros(max_num_reqs, dtype=bool)
        self.has_grammar = np.zeros(max_num_reqs, dtype=bool)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.is_pooling = np.zeros(max_num_reqs, dtype=bool)  # pooling requests sample nothing
        self.pooling: list = [None] * max_num_reqs  # their PoolingParams
        # bumped by every ``add``: a slot's new occupant, whose device copies are rebuilt (worker/device/device_inputs.py)
        self.generation = np.zeros(max_num_reqs, dtype=np.int64)
        self.slot_of: dict[str, int] = {}
        self._free = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out the lowest slot

    def __len__(self) -> int:
        return len(self.slot_of)

    # ---- membership: only what changed ------------------------------------------------
    def add(self, nr: NewRequestData) -> int:
        """Place a new (or re-admitted) request in a free slot; returns the slot."""
        if not self._free:
            raise RuntimeError(f"all {self.max_num_reqs} batch slots are taken")
        s = self._free.pop()
        self.generation[s] += 1
        n, nb = len(nr.token_ids), len(nr.block_ids)
        self.token_ids[s, :n] = nr.token_ids
        self.num_tokens[s] = n
        self.num_prompt_tokens[s] = nr.num_prompt_tokens
        self.num_computed_tokens[s] = nr.num_computed_tokens
        self.block_table[s, :nb] = nr.block_ids
        self.num_blocks[s] = nb
        self.state_slot[s] = nr.state_slot
        self.lora_id[s] = 0 if nr.lora_request is None else nr.lora_request.lora_int_id
        p = nr.sampling_params
        self.params[s] = p
        self.temperature[s] = p.temperature
        self.min_tokens[s] = p.min_tokens
        self.prompt_logprobs[s] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.has_bias[s] = bool(p.logit_bias) or p.allowed_token_ids is not None
        self.has_penalty[s] = p.has_penalties
        self.has_grammar[s] = p.structured_outputs is not None
        self.is_pooling[s] = nr.pooling_params is not None
        self.pooling[s] = nr.pooling_params
        self.slot_of[nr.req_id] = s
        return s

    def update(self, cr: CachedRequestData) -> None:
        """Append a running request's new block ids and set its computed-token count."""
        s = self.slot_of[cr.req_id]
        nb, k = self.num_blocks[s], len(cr.new_block_ids)
        if k:
            self.block_table[s, nb:nb + k] = cr.new_block_ids
            self.num_blocks[s] = nb + k
        self.num_computed_tokens[s] = cr.num_computed_tokens

    def remove(self, req_id: str) -> None:
        """Free a finished or preempted request's slot (unknown ids are ignored)."""
        s = self.slot_of.pop(req_id, None)
        if s is not None:
            self.params[s] = None
            self.pooling[s] = None
            self.is_pooling[s] = False
            self._free.append(s)

    def append_tokens(self, req_ids: list[str], tokens: list[int]) -> None:
        """Record sampled tokens (one per request) once a step's results are known."""
        slots = [self.slot_of[r] for r in req_ids if r in self.slot_of]
        if len(slots) != len(req_ids):  # some left the batch while their step ran
            keep = [i for i, r in enumerate(req_ids) if r in self.slot_of]
            tokens = [tokens[i] for i in keep]
        if slots:
            idx = np.asarray(slots, dtype=np.int64)
            self.token_ids[idx, self.num_tokens[idx]] = tokens
            self.num_tokens[idx] += 1

    def extend_tokens(self, req_id: str, tokens: list[int]) -> None:
        """Record the tokens a verified step emitted for one request (unknown ids are ignored)."""
        s = self.slot_of.get(req_id)
        if s is not None:
            n = int(self.num_tokens[s])
            self.token_ids[s, n:n + len(tokens)] = tokens
            self.num_tokens[s] = n + len(tokens)

    # ---- one step's inputs ----------------------------------------------------------
    def sampling_metadata(self, slots: np.ndarray, pending_rows: np.ndarray,
                          pending_src: np.ndarray) -> SamplingMetadata:
        """Snapshot the sampling settings of the rows sampled this step.

        Args:
            slots: ``[R]`` slots of the sampled rows, in logits order.
            pending_rows, pending_src: see ``SamplingMetadata``.
        """
        has_pending = np.zeros(len(slots), dtype=np.int64)
        has_pending[pending_rows] = 1
        output_lens = self.num_tokens[slots] - self.num_prompt_tokens[slots] + has_pending
        md = SamplingMetadata(
            params=[self.params[s] for s in slots.tolist()],
            output_lens=output_lens,
            all_greedy=bool((self.temperature[slots] < 1e-5).all()),
            any_min_tokens=bool((output_lens < self.min_tokens[slots]).any()),
            any_logit_bias=bool(self.has_bias[slots].any()),
            any_structured=bool(self.has_grammar[slots].any()),
            pending_rows=pending_rows, pending_src=pending_src)
        for row in np.flatnonzero(self.has_penalty[slots]).tolist():
            s = int(slots[row])
            start, end = self.num_prompt_tokens[s], self.num_tokens[s]
            md.penalty_rows.append(row)
            md.penalty_outputs.append(self.token_ids[s, start:end].astype(np.int64))
            rep = md.params[row].repetition_penalty != 1.0
            md.penalty_prompts.append(self.token_ids[s, :start].astype(np.int64) if rep else np.zeros(0, np.int64))
        return md

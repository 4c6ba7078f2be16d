"""Executes one scheduler step on the device: builds the flattened batch, runs the model, samples.

The runner keeps per-request state between steps (token ids, block table,
sampling parameters), so the scheduler sends only diffs, and it appends each
sampled token to its own copy of the sequence.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata, PrefillSeq
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, gather_logprobs


@dataclass
class CachedRequestState:
    """What the runner remembers about a running request.

    Attributes:
        token_ids: prompt + generated tokens known to the runner.
        num_prompt_tokens: prompt length in tokens.
        block_ids: block table.
        num_computed_tokens: tokens with K/V in the cache.
        sampling_params: sampling settings.
    """

    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams


class StepHandle:
    """The result of an issued step. ``result()`` blocks until it is ready.

    Execution is synchronous today; the handle keeps the interface stable for
    overlapping the next step's scheduling with this one's execution.
    """

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def result(self) -> ModelRunnerOutput:
        """The step's sampled tokens."""
        return self._output


class ModelRunner:
    """Owns the model, the KV cache tensors and the per-request state.

    Args:
        model: native model with ``forward(input_ids, positions, kv_caches, meta, logits_indices)``
            and ``kv_cache_spec() -> (num_layers, num_kv_heads, head_dim)``.
        num_blocks: KV blocks to allocate.
        block_size: tokens per block.
        dtype: KV cache dtype.
        device: device of the model and cache.
        seed: sampler seed.
        eos_token_ids: the model's EOS ids, banned (with stop token ids) before ``min_tokens``.
    """

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 seed: int = 0, eos_token_ids: set[int] | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        layers, kvh, d = model.kv_cache_spec()
        shape = (num_blocks, block_size, kvh, d)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(layers)]
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler(seed, eos_token_ids)
        self._eos = min(eos_token_ids) if eos_token_ids else 0
        # test hook: replay fixed output tokens instead of sampling (see ``_scripted``)
        self._script_path = os.environ.get("PAGEDLLM_SCRIPTED_OUTPUT")

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers (K and V)."""
        layers, kvh, d = model.kv_cache_spec()
        return 2 * layers * block_size * kvh * d * torch.empty((), dtype=dtype).element_size()

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for nr in so.new_reqs:
            self.requests[nr.req_id] = CachedRequestState(list(nr.token_ids), nr.num_prompt_tokens,
                                                          list(nr.block_ids), nr.num_computed_tokens,
                                                          nr.sampling_params)
        for cr in so.cached_reqs:
            st = self.requests[cr.req_id]
            st.block_ids.extend(cr.new_block_ids)
            st.num_computed_tokens = cr.num_computed_tokens

    def _prepare(self, so: SchedulerOutput):
        """Build input ids, positions, attention metadata and the rows to sample."""
        bs = self.block_size
        ids, pos, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        dec_idx, dec_slots, prefills, logit_rows, sample_ids = [], [], [], [], []
        prompt_lp = []  # (request id, first prompt token, rows): prompt-logprob positions this step
        for rid, n in so.num_scheduled_tokens.items():
            st = self.requests[rid]
            start = st.num_computed_tokens
            end = start + n
            table = np.asarray(st.block_ids, dtype=np.int64)
            all_pos = np.arange(end, dtype=np.int64)
            all_slots = table[all_pos // bs] * bs + all_pos % bs
            q0 = qsl[-1]
            ids.extend(st.token_ids[start:end])
            pos.append(all_pos[start:])
            slots.append(all_slots[start:])
            qsl.append(q0 + n)
            seq_lens.append(end)
            tables.append(table)
            if n == 1:
                dec_idx.append(q0)
                dec_slots.append(all_slots)
            else:
                prefills.append(PrefillSeq(q0, q0 + n, start, torch.from_numpy(all_slots).to(self.device)))
            if st.sampling_params.prompt_logprobs is not None:
                # the row at position p predicts prompt token p + 1 (token 0 has no logprob)
                last = min(end, st.num_prompt_tokens - 1)
                if last > start:
                    prompt_lp.append((rid, start + 1, list(range(q0, q0 + last - start))))
            if end >= len(st.token_ids):  # reached the sequence's end: sample the next token
                logit_rows.append(q0 + n - 1)
                sample_ids.append(rid)
            st.num_computed_tokens = end
        dev = self.device
        max_blocks = max(len(t) for t in tables)
        bt = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = t
        max_len = max((len(s) for s in dec_slots), default=0)
        ds = np.zeros((len(dec_slots), max_len), dtype=np.int64)
        dm = np.zeros((len(dec_slots), max_len), dtype=bool)
        for i, s in enumerate(dec_slots):
            ds[i, :len(s)] = s
            dm[i, :len(s)] = True
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            block_tables=torch.from_numpy(bt).to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            decode_token_idx=torch.tensor(dec_idx, dtype=torch.int64, device=dev),
            decode_slots=torch.from_numpy(ds).to(dev),
            decode_mask=None if dm.all() else torch.from_numpy(dm).to(dev).view(len(dec_slots), 1, 1, max_len),
            prefills=prefills,
            decode_seq_lens=torch.tensor([len(s) for s in dec_slots], dtype=torch.int64, device=dev))
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.from_numpy(np.concatenate(pos)).to(dev)
        return input_ids, positions, meta, logit_rows, sample_ids, prompt_lp

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput, timer=None) -> StepHandle:
        """Run one step and return a handle to its sampled tokens (and logprobs where asked).

        Args:
            so: the step's plan.
            timer: optional ``StepTimer``; gets the prepare / execute / sample times (seconds).
        """
        t0 = time.perf_counter()
        self._update_states(so)
        if so.is_empty:
            return StepHandle(ModelRunnerOutput())
        input_ids, positions, meta, logit_rows, sample_ids, prompt_lp = self._prepare(so)
        # logits rows: the sampled ones first, then every prompt-logprob position
        rows = logit_rows + [r for _, _, rs in prompt_lp for r in rs]
        t1 = time.perf_counter()
        if timer is not None:
            timer.exec_started(t1)
        logits = self.model(input_ids, positions, self.kv_caches, meta,
                            torch.tensor(rows, dtype=torch.int64, device=self.device))
        t2 = time.perf_counter()
        out = ModelRunnerOutput()
        if sample_ids:
            states = [self.requests[r] for r in sample_ids]
            sampled = self.sampler(logits[:len(sample_ids)], states)
            tokens = self._scripted(states, sampled.token_ids) if self._script_path else sampled.token_ids
            for rid, st, tok, lp in zip(sample_ids, states, tokens, sampled.logprobs):
                st.token_ids.append(tok)
                out.sampled_token_ids[rid] = tok
                if lp is not None:
                    out.logprobs[rid] = lp
        if prompt_lp:
            self._prompt_logprobs(logits[len(sample_ids):], prompt_lp, out)
        t3 = time.perf_counter()
        if timer is not None:
            timer.exec_ended(t3)
            timer.totals["prepare"] += t1 - t0
            timer.totals["execute"] += t2 - t1
            timer.totals["sample"] += t3 - t2
        return StepHandle(out)

    def _scripted(self, states: list[CachedRequestState], tokens: list[int]) -> list[int]:
        """Test hook: with ``PAGEDLLM_SCRIPTED_OUTPUT`` naming a JSON file ``{"token_ids": [...]}``,
        every request's output is those tokens, then EOS, whatever the model says (the file
        is re-read at each step, so a test can change it between requests). The logits
        still run; logprobs are those of the sampled tokens, not the replayed ones."""
        with open(self._script_path) as f:
            script = json.load(f)["token_ids"]
        out = []
        for st in states:
            pos = len(st.token_ids) - st.num_prompt_tokens
            out.append(script[pos] if pos < len(script) else self._eos)
        return out

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_lp, out: ModelRunnerOutput) -> None:
        """Logprobs of the prompt tokens whose predicting positions ran this step.

        Args:
            logits: ``[P, V]`` float32, rows in ``prompt_lp`` order.
            prompt_lp: ``(request id, first prompt token index, rows)`` per request.
        """
        i = 0
        for rid, first, rs in prompt_lp:
            st = self.requests[rid]
            n = len(rs)
            targets = torch.tensor(st.token_ids[first:first + n], dtype=torch.int64, device=logits.device)
            entries = gather_logprobs(logits[i:i + n].log_softmax(-1), targets, st.sampling_params.prompt_logprobs)
            out.prompt_logprobs[rid] = (first, entries)
            i += n

"""A step's logits rows: which rows the forward keeps (the sampled ones, then the prompt-logprob
positions) and which carry a structured-output mask, chosen when the step is prepared; after the
forward, the mask and the prompt logprobs (``model_runner.py`` calls these on the execution thread)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.structured_output.backend import apply_bitmask
from pagedllm.structured_output.manager import GrammarMask
from pagedllm.worker.input_batch import InputBatch, SamplingMetadata
from pagedllm.worker.sampler import gather_logprobs


def logits_rows_of(batch: InputBatch, rids: list[str], slots: np.ndarray, start: np.ndarray, end: np.ndarray,
                   qsl: np.ndarray, sample: np.ndarray, spec: np.ndarray) -> tuple[np.ndarray, list]:
    """The rows whose logits are needed: the sampled ones (a request with ``k`` drafts: its
    last ``k + 1``), then the prompt-logprob positions.

    Args:
        batch: the runner's persistent batch; rids, slots: the step's requests and their slots;
        start, end: ``[R]`` tokens computed before / after the step; qsl: ``[R + 1]`` cumulative
        scheduled tokens; sample: ``[S]`` indices of the requests that sample; spec: ``[R]`` drafts.
    Returns:
        ``[R' + P]`` int64 rows of the flattened batch, and per request with prompt logprobs
        computed this step ``(request id, first prompt token index, targets [n] int64, k)``.
    """
    b = batch
    counts = 1 + spec[sample]
    ends = qsl[1:][sample]
    firsts = np.repeat(ends - counts, counts)
    rows = [firsts + np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)]
    prompt_lp = []
    for i in np.flatnonzero(b.prompt_logprobs[slots] >= 0).tolist():
        # the row at position p predicts prompt token p + 1 (token 0 has no logprob)
        s, first = slots[i], int(start[i]) + 1
        last = min(int(end[i]), int(b.num_prompt_tokens[s]) - 1)
        if last > start[i]:
            cnt = last - int(start[i])
            rows.append(np.arange(qsl[i], qsl[i] + cnt, dtype=np.int64))
            prompt_lp.append((rids[i], first, b.token_ids[s, first:first + cnt].astype(np.int64),
                              int(b.prompt_logprobs[s])))
    return np.concatenate(rows), prompt_lp


def grammar_rows(rids: list[str], sample: np.ndarray, sampling: SamplingMetadata | None,
                 drafts: dict[str, list[int]]) -> GrammarMask | None:
    """The sampled requests with structured outputs, whose mask rows (one per logits row: the
    token, then one after each draft) the core fills (``None``: none)."""
    if sampling is None or not sampling.any_structured:
        return None
    rows = [i for i, p in enumerate(sampling.params) if p.structured_outputs is not None]
    ids = [rids[int(sample[i])] for i in rows]
    return GrammarMask(rows, ids, [list(drafts.get(rid, ())) for rid in ids])


def constrain(logits: torch.Tensor, grammar: GrammarMask, drafts: list[list[int]] | None = None) -> torch.Tensor:
    """Wait for the step's token bitmask and mask the constrained rows' logits in place
    (``[R', V]`` float32, the model's own output: nothing else reads them unmasked). With drafts
    in the step, sampled request ``i`` owns ``1 + len(drafts[i])`` consecutive logits rows, and
    the mask has a row for each (``GrammarMask``)."""
    bitmask = grammar.wait()
    if bitmask is not None:
        rows = grammar.rows
        if drafts is not None:
            firsts = np.concatenate([[0], np.cumsum([1 + len(d) for d in drafts])])
            rows = [int(firsts[r]) + j for r in rows for j in range(1 + len(drafts[r]))]
        apply_bitmask(logits, rows, bitmask)
    return logits


def prompt_logprobs(logits: torch.Tensor, prompt_lp, out: ModelRunnerOutput) -> None:
    """Logprobs of the prompt tokens whose predicting positions ran this step.

    Args:
        logits: ``[P, V]`` float32, rows in ``prompt_lp`` order.
        prompt_lp: ``(request id, first prompt token index, targets, k)`` per request.
    """
    i = 0
    for rid, first, targets, k in prompt_lp:
        n = len(targets)
        entries = gather_logprobs(logits[i:i + n].log_softmax(-1), torch.from_numpy(targets).to(logits.device), k)
        out.prompt_logprobs[rid] = (first, entries)
        i += n

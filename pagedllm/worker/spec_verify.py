"""Verification of draft tokens in the target model's forward pass.

A request with ``k`` drafts ``d_1 .. d_k`` computes ``k + 1`` logits rows in one step: row ``j``
predicts the token after ``d_j`` (row 0: after the last committed token). Each row is
processed as if the drafts before it had been kept: ``min_tokens`` counts them, penalties see
them in the history, a seeded request draws at its output position. Then, left to right
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
algorithm 1; Chen et al. 2023), with ``p_j`` the target's distribution at row ``j``:

* greedy rows keep ``d_{j+1}`` while it is ``argmax p_j``, then emit ``argmax`` of the first row
  that disagrees (or of row ``k`` when all are kept): token for token the non-speculative output;
* sampled rows keep ``d_{j+1}`` with probability ``min(1, p_j(d) / q_j(d))``, ``q_j`` the
  distribution the draft was drawn from; on a rejection they draw from the residual
  ``max(p_j - q_j, 0)``, renormalised; after ``k`` acceptances they draw the bonus token from
  ``p_k`` with the ordinary sampler. A deterministic proposal (n-gram, suffix, a draft model's
  greedy pick) is a point mass: keep with probability ``p_j(d)``, on a rejection draw from
  ``p_j`` with ``d`` removed. Every emitted token is distributed as the target's.

So 1 to ``k + 1`` tokens are emitted per request per step.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from pagedllm.core.scheduler_output import TokenLogprobs
from pagedllm.worker.input_batch import SamplingMetadata
from pagedllm.worker.sampler import Sampler, gather_logprobs


def expand_metadata(md: SamplingMetadata, drafts: list[list[int]]) -> tuple[SamplingMetadata, np.ndarray]:
    """One metadata row per logits row: request ``i`` gets ``1 + len(drafts[i])`` rows.

    Args:
        md: the step's metadata, one row per sampled request.
        drafts: per sampled request, its draft tokens (empty: not speculating).
    Returns:
        ``(expanded, starts)``: the metadata of the expanded rows (row ``starts[i] + j`` has
        ``output_lens + j`` and ``drafts[i][:j]`` appended to its penalty history) and ``[R + 1]``
        int64 first row of each request (``starts[-1]``: the row count).
    """
    counts = np.fromiter((1 + len(d) for d in drafts), dtype=np.int64, count=len(drafts))
    starts = np.zeros(len(drafts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    offsets = np.arange(starts[-1], dtype=np.int64) - np.repeat(starts[:-1], counts)
    params = [p for p, c in zip(md.params, counts.tolist()) for _ in range(c)]
    output_lens = np.repeat(md.output_lens, counts) + offsets
    out = replace(md, params=params, output_lens=output_lens,
                  any_min_tokens=any(n < p.min_tokens for n, p in zip(output_lens.tolist(), params)),
                  penalty_rows=[], penalty_outputs=[], penalty_prompts=[],
                  pending_rows=starts[:-1][md.pending_rows], pending_src=md.pending_src)
    for row, known, prompt in zip(md.penalty_rows, md.penalty_outputs, md.penalty_prompts):
        for j in range(counts[row]):
            out.penalty_rows.append(int(starts[row]) + j)
            out.penalty_outputs.append(np.concatenate([known, np.asarray(drafts[row][:j], dtype=np.int64)]))
            out.penalty_prompts.append(prompt)
    return out, starts


def verify(sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata, drafts: list[list[int]],
           prev_tokens: list[int] | None = None, draft_probs: list[torch.Tensor | None] | None = None,
           ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """Emit each request's tokens from its drafts and the target's rows (module docstring).

    Args:
        sampler: the runner's sampler (its draws and shared generator).
        logits: ``[sum(1 + len(d)), V]`` float32 raw rows, request by request.
        md: the step's metadata, one row per request (``expand_metadata`` widens it).
        drafts: per request its drafts (empty: an ordinary row).
        prev_tokens: the previous step's samples, for pending rows (as ``Sampler.__call__``).
        draft_probs: per request, ``[len(d), V]`` float32 distributions its drafts were drawn from
            (sampled drafts; used by sampled rows only), or ``None`` (point masses).
    Returns:
        per request the emitted tokens (1 to ``len(d) + 1``), and per request the logprobs of
        those tokens (``None`` when it did not ask).
    """
    emd, starts = expand_metadata(md, drafts)
    processed = sampler.process(logits, emd, prev_tokens)
    greedy = processed.argmax(-1).tolist()
    random_rows = [i for i, p in enumerate(emd.params) if not p.greedy]
    probs = {}
    if random_rows:
        sel = torch.tensor(random_rows, device=logits.device)
        for i, row in zip(random_rows, sampler.target_probs(processed.index_select(0, sel),
                                                            [emd.params[i] for i in random_rows])):
            probs[i] = row
    emitted: list[list[int]] = []
    bonus: list[tuple[int, int]] = []  # (request, row) still to draw with the ordinary sampler
    for r, d in enumerate(drafts):
        s = int(starts[r])
        params = md.params[r]
        toks: list[int] = []
        for j, draft in enumerate(d):
            row = s + j
            if params.greedy:
                if greedy[row] == draft:
                    toks.append(draft)
                    continue
                toks.append(greedy[row])
                break
            p = probs[row]
            q = draft_probs[r] if draft_probs is not None else None
            pos = int(emd.output_lens[row])
            u = torch.rand((), generator=sampler.generator_for(params, pos, stream=1))
            ratio = float(p[draft]) if q is None else float(p[draft]) / float(q[j, draft])
            if float(u) < ratio:
                toks.append(draft)
                continue
            if q is None:
                residual = p.clone()
                residual[draft] = 0.0
            else:
                residual = (p - q[j].to(p.device)).clamp_(min=0.0)
                if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection was rounding's
                    residual = p.clone()
            noise = torch.empty_like(residual).exponential_(generator=sampler.generator_for(params, pos, stream=2))
            toks.append(int((residual / noise).argmax()))
            break
        else:
            row = s + len(d)
            if params.greedy:
                toks.append(greedy[row])
            else:
                bonus.append((r, row))
        emitted.append(toks)
    if bonus:
        rows = [row for _, row in bonus]
        drawn = sampler._sample(processed[rows], [emd.params[i] for i in rows],
                                [int(emd.output_lens[i]) for i in rows]).tolist()
        for (r, _), t in zip(bonus, drawn):
            emitted[r].append(t)
    return emitted, _logprobs(logits, md, starts, emitted)


def _logprobs(logits: torch.Tensor, md: SamplingMetadata, starts: np.ndarray,
              emitted: list[list[int]]) -> list[list[TokenLogprobs] | None]:
    """Raw-logit logprobs (before any processing, as ``Sampler``) of the emitted tokens."""
    out: list[list[TokenLogprobs] | None] = [None] * len(emitted)
    for r, toks in enumerate(emitted):
        k = md.params[r].logprobs
        if k is None:
            continue
        s = int(starts[r])
        rows = logits[s:s + len(toks)].log_softmax(-1)
        out[r] = gather_logprobs(rows, torch.tensor(toks, dtype=torch.int64, device=logits.device), k)
    return out


def verify_step(sampler: Sampler, state_cache, step, logits: torch.Tensor, md: SamplingMetadata, prev_tokens,
                out) -> list[int]:
    """Judge a step's drafts (``verify``) and record the verdict.

    Fills ``out``'s (``ModelRunnerOutput``) accepted lists and logprobs and ``step.emitted``
    (``PreparedStep``); a hybrid model's request with rejected drafts gets its state back to the
    last accepted one (``StateCache.rollback``; ``state_cache`` is ``None`` for other models).

    Returns:
        Each sampled request's last emitted token (the next step's pending input, were it pending).
    """
    emitted, logprobs = verify(sampler, logits, md, step.drafts, prev_tokens, step.draft_probs)
    state = step.model_kwargs.get("state")
    for rid, d, toks, lps in zip(step.sample_ids, step.drafts, emitted, logprobs):
        if d and state is not None and len(toks) <= len(d):  # a hybrid's state: back to the last accepted draft
            state_cache.rollback(state, rid, len(toks))
        if d:
            out.accepted_token_ids[rid] = toks
            step.emitted[rid] = toks
            if lps is not None:
                out.accepted_logprobs[rid] = lps
        elif lps is not None:
            out.logprobs[rid] = lps[0]
    return [toks[-1] for toks in emitted]

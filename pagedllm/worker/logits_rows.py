"""What the runner does to a step's logits rows after the forward: the structured-output mask and
the prompt logprobs (``model_runner.py`` calls these on the execution thread)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.structured_output.backend import apply_bitmask
from pagedllm.structured_output.manager import GrammarMask
from pagedllm.worker.sampler import gather_logprobs


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

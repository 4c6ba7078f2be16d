"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p, min-tokens, per-request seeds.

Random draws use the exponential-race form of sampling: ``argmax(p / E)`` with
``E ~ Exp(1)`` picks token ``i`` with probability ``p_i``. Seeded rows draw
their noise from their own ``torch.Generator`` reseeded from
``(seed, output position)``, so a seeded request's tokens depend only on its
seed and history, never on the rest of the batch or on preemption.
"""

from __future__ import annotations

import torch

from pagedllm.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive positions apart


def _apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                             min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k / top-p / min-p, row by row. ``logits`` ``[R, V]`` float32."""
    vocab = logits.shape[-1]
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        thresh = probs.amax(-1, keepdim=True) * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    k_on, p_on = bool((top_k < vocab).any()), bool((top_p < 1.0).any())
    if not (k_on or p_on):
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if p_on:
        # top-p acts on the top-k survivors, renormalised (as vLLM and transformers do);
        # keep a token while the mass before it is below top_p (the top token always stays)
        probs = sorted_logits.softmax(-1)
        remove = (probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


class Sampler:
    """Samples one token per row of a logits matrix.

    Args:
        seed: engine seed for unseeded requests' shared generator.
        eos_token_ids: EOS ids banned, unless ``ignore_eos``, while a row has fewer than ``min_tokens``.
    """

    def __init__(self, seed: int = 0, eos_token_ids: set[int] | None = None) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self.eos_token_ids = set(eos_token_ids or ())

    def _ban_stop_tokens(self, logits: torch.Tensor, params: list[SamplingParams],
                         output_lens: list[int]) -> torch.Tensor:
        """Set EOS (unless ``ignore_eos``) and ``stop_token_ids`` to -inf in rows still short of ``min_tokens``.

        As vLLM's ``min_tokens`` and transformers' ``min_new_tokens``: those
        tokens cannot be sampled, rather than sampled without stopping.
        """
        rows, cols = [], []
        for i, p in enumerate(params):
            if output_lens[i] < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                banned = [t for t in banned if 0 <= t < logits.shape[-1]]
                rows += [i] * len(banned)
                cols += banned
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
        return logits

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], output_lens: list[int]) -> torch.Tensor:
        """Sample.

        Args:
            logits: ``[R, V]`` float32.
            params: one ``SamplingParams`` per row.
            output_lens: per row, tokens generated so far (the seeded stream's position).
        Returns:
            ``[R]`` int64 token ids (on the logits' device).
        """
        logits = self._ban_stop_tokens(logits, params, output_lens)
        greedy = logits.argmax(-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return greedy
        dev = logits.device
        sel = torch.tensor(rows, device=dev)
        sub = logits.index_select(0, sel)
        temps = torch.tensor([params[i].temperature for i in rows], device=dev, dtype=sub.dtype)
        top_k = torch.tensor([params[i].top_k if params[i].top_k > 0 else sub.shape[-1] for i in rows], device=dev)
        top_p = torch.tensor([params[i].top_p for i in rows], device=dev, dtype=sub.dtype)
        min_p = torch.tensor([params[i].min_p for i in rows], device=dev, dtype=sub.dtype)
        sub = _apply_top_k_top_p_min_p(sub / temps.unsqueeze(1), top_k, top_p, min_p)
        probs = sub.softmax(-1)
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            p = params[i]
            if p.seed is None:
                noise[j].exponential_(generator=self.generator) if dev.type == "cpu" else noise[j].exponential_()
            else:
                g = torch.Generator(device=dev)
                g.manual_seed((p.seed * _SEED_MIX + output_lens[i]) % (1 << 63))
                noise[j].exponential_(generator=g)
        sampled = (probs / noise).argmax(-1)
        return greedy.index_copy(0, sel, sampled)

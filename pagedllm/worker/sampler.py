"""Token sampling from logits: penalties, logit bias, greedy, temperature, top-k, top-p, min-p,
min-tokens, per-request seeds, and logprobs.

Order of operations (as vLLM's sampler): raw logprobs are taken from the
model's logits first; then EOS is banned below ``min_tokens``, ``logit_bias``
is added, the repetition / frequency / presence penalties are applied, and
finally temperature, min-p, top-k and top-p shape the distribution to sample.

Random draws use the exponential-race form of sampling: ``argmax(p / E)`` with
``E ~ Exp(1)`` picks token ``i`` with probability ``p_i``. Seeded rows draw
their noise from their own ``torch.Generator`` reseeded from
``(seed, output position)``, so a seeded request's tokens depend only on its
seed and history, never on the rest of the batch or on preemption.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass, field

from pagedllm.core.scheduler_output import TokenLogprobs
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


@dataclass
class SamplerOutput:
    """Sampled tokens of a step, one per row.

    Attributes:
        token_ids: ``R`` sampled ids.
        logprobs: per row, the sampled token's ``TokenLogprobs`` or ``None`` when not requested.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Logprob, rank and top-``k`` alternatives of given tokens.

    Args:
        logprobs: ``[R, V]`` float32 log-softmax rows.
        token_ids: ``[R]`` int64 token of each row.
        k: alternatives per row (0 for none).
    Returns:
        ``R`` entries; ties with the token count as ranked before it.
    """
    own = logprobs.gather(1, token_ids.unsqueeze(1))                 # [R, 1]
    ranks = (logprobs > own).sum(-1) + 1
    ids, lps = token_ids.unsqueeze(1), own
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        ids, lps = torch.cat([ids, top_ids], 1), torch.cat([own, top_lp], 1)
    return [TokenLogprobs(i, lp, r) for i, lp, r in zip(ids.tolist(), lps.tolist(), ranks.tolist())]


def apply_penalties(logits: torch.Tensor, output_ids: list[list[int]], prompt_ids: list[list[int]],
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Repetition, frequency and presence penalties, row by row.

    Definitions (CTRL for repetition, OpenAI's API reference for presence/frequency),
    applied in vLLM's order: first, for every ``t`` in the prompt or output,
    ``l[t] = l[t] / repetition`` if ``l[t] > 0`` else ``l[t] * repetition``; then
    ``l[t] -= frequency * count_out[t] + presence * (count_out[t] > 0)``.

    Args:
        logits: ``[R, V]`` float32.
        output_ids, prompt_ids: per row, the generated and prompt token ids.
        presence, frequency, repetition: ``[R]`` float32.
    Returns:
        ``[R, V]`` penalised logits (a new tensor).
    """
    rows, vocab = logits.shape
    dev = logits.device
    counts = torch.zeros(rows, vocab + 1, device=dev)   # column ``vocab`` absorbs padding
    width = max((len(o) for o in output_ids), default=0)
    if width:
        out = torch.full((rows, width), vocab, dtype=torch.int64)
        for i, o in enumerate(output_ids):
            out[i, :len(o)] = torch.as_tensor(o, dtype=torch.int64)
        counts.scatter_add_(1, out.to(dev), torch.ones(rows, width, device=dev))
    counts = counts[:, :vocab]
    if bool((repetition != 1.0).any()):
        seen = counts > 0
        pwidth = max((len(p) for p in prompt_ids), default=0)
        if pwidth:
            prompt = torch.full((rows, pwidth), vocab, dtype=torch.int64)
            for i, p in enumerate(prompt_ids):
                prompt[i, :len(p)] = torch.as_tensor(p, dtype=torch.int64)
            in_prompt = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=dev)
            in_prompt.scatter_(1, prompt.to(dev), True)
            seen |= in_prompt[:, :vocab]
        r = repetition.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0)


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

    @staticmethod
    def _logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Add ``logit_bias`` and keep only ``allowed_token_ids`` (the others -inf), row by row."""
        allowed = [(i, p.allowed_token_ids) for i, p in enumerate(params) if p.allowed_token_ids is not None]
        if allowed:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            for i, ids in allowed:
                keep[i, [t for t in ids if t < logits.shape[-1]]] = True
            for i in range(len(params)):
                if params[i].allowed_token_ids is None:
                    keep[i] = True
            logits = logits.masked_fill(~keep, float("-inf"))
        rows, cols, vals = [], [], []
        for i, p in enumerate(params):
            for tok, bias in (p.logit_bias or {}).items():
                if tok < logits.shape[-1]:  # ids are checked against the vocabulary at admission
                    rows.append(i)
                    cols.append(tok)
                    vals.append(bias)
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows, cols] += torch.tensor(vals, dtype=logits.dtype, device=logits.device)
        return logits

    @staticmethod
    def _penalties(logits: torch.Tensor, md, prev_tokens: list[int] | None) -> torch.Tensor:
        """Penalise the rows that asked; a row's history gets the previous step's token if still pending."""
        if not md.penalty_rows:
            return logits
        dev = logits.device
        rows = md.penalty_rows
        pending = dict(zip(md.pending_rows.tolist(), md.pending_src.tolist()))
        outs = []
        for row, known in zip(rows, md.penalty_outputs):
            out = known.tolist()
            if row in pending:
                out.append(prev_tokens[pending[row]])
            outs.append(out)
        prompts = [p.tolist() for p in md.penalty_prompts]

        def vec(name: str) -> torch.Tensor:
            return torch.tensor([getattr(md.params[i], name) for i in rows], dtype=logits.dtype, device=dev)

        sel = torch.tensor(rows, device=dev)
        sub = apply_penalties(logits.index_select(0, sel), outs, prompts, vec("presence_penalty"),
                              vec("frequency_penalty"), vec("repetition_penalty"))
        return logits.index_copy(0, sel, sub)

    def __call__(self, logits: torch.Tensor, md, prev_tokens: list[int] | None = None) -> SamplerOutput:
        """Sample.

        Args:
            logits: ``[R, V]`` float32.
            md: the rows' ``SamplingMetadata`` (``pagedllm.worker.input_batch``).
            prev_tokens: the previous step's sampled ids, for rows whose last output token
                is still pending (``md.pending_src`` indexes it); ``None`` when none is.
        Returns:
            The sampled ids and, for rows that asked, their logprobs.
        """
        params = md.params
        output_lens = md.output_lens.tolist()
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = logits.index_select(0, torch.tensor(lp_rows, device=logits.device)) if lp_rows else None
        logits = self.process(logits, md, prev_tokens)
        tokens = logits.argmax(-1) if md.all_greedy else self._sample(logits, params, output_lens)
        out = SamplerOutput(tokens.tolist(), [None] * len(params))
        if lp_rows:
            k = max(params[i].logprobs for i in lp_rows)
            entries = gather_logprobs(raw.log_softmax(-1), tokens[lp_rows], k)
            for i, e in zip(lp_rows, entries):
                kk = params[i].logprobs
                out.logprobs[i] = TokenLogprobs(e.token_ids[:kk + 1], e.logprobs[:kk + 1], e.rank)
        return out

    def process(self, logits: torch.Tensor, md, prev_tokens: list[int] | None = None) -> torch.Tensor:
        """The logits the draw sees: EOS / stop tokens banned below ``min_tokens``, ``logit_bias``
        and ``allowed_token_ids``, then the penalties (``[R, V]`` float32; maybe ``logits`` itself)."""
        if md.any_min_tokens:
            logits = self._ban_stop_tokens(logits, md.params, md.output_lens.tolist())
        if md.any_logit_bias:
            logits = self._logit_bias(logits, md.params)
        return self._penalties(logits, md, prev_tokens)

    @staticmethod
    def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """``[R, V]`` float32 probabilities the draw samples from: processed logits divided by the
        temperature, cut by min-p / top-k / top-p, softmaxed (rows must not be greedy)."""
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[-1] for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=logits.dtype)
        min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=logits.dtype)
        return _apply_top_k_top_p_min_p(logits / temps.unsqueeze(1), top_k, top_p, min_p).softmax(-1)

    def generator_for(self, params: SamplingParams, position: int, stream: int = 0,
                      device: torch.device | str = "cpu") -> torch.Generator:
        """The generator of a draw: the request's own, seeded from ``(seed, position, stream)`` when it
        has a seed (``stream`` separates draws made at one position), else the engine's shared one."""
        if params.seed is None:
            return self.generator
        g = torch.Generator(device=device)
        g.manual_seed((params.seed * _SEED_MIX + position + stream * 0x5851F42D4C957F2D) % (1 << 63))
        return g

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], output_lens: list[int]) -> torch.Tensor:
        """Sample without history: min-tokens ban, logit bias, then the draw (no penalties, no logprobs).

        Args:
            logits: ``[R, V]`` float32.
            params: one ``SamplingParams`` per row.
            output_lens: per row, tokens generated so far (the seeded stream's position).
        Returns:
            ``[R]`` int64 token ids.
        """
        logits = self._ban_stop_tokens(logits, params, output_lens)
        return self._sample(self._logit_bias(logits, params), params, output_lens)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], output_lens: list[int]) -> torch.Tensor:
        """``[R]`` int64 token ids: argmax for greedy rows, a seeded or shared-generator draw otherwise."""
        greedy = logits.argmax(-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return greedy
        dev = logits.device
        sel = torch.tensor(rows, device=dev)
        probs = self.target_probs(logits.index_select(0, sel), [params[i] for i in rows])
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            p = params[i]
            if p.seed is None and dev.type != "cpu":
                noise[j].exponential_()
            else:
                noise[j].exponential_(generator=self.generator_for(p, output_lens[i], device=dev))
        sampled = (probs / noise).argmax(-1)
        return greedy.index_copy(0, sel, sampled)

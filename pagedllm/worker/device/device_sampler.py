"""Device-side sampling: the whole batch's draw in tensor ops and one Triton kernel, no host read.

The torch sampler (``worker/sampler.py``) loops over rows in Python and reads
flags from device tensors (``.any()``), which on a GPU is a host sync per
step. Here every row's settings arrive as ``[R]`` tensors built on the host
from the requests' ``SamplingParams`` (host data: nothing is read back), the
shaping runs batched on the device in the torch sampler's order (logit bias,
penalties, temperature, min-p, top-k, top-p), and the draw is one Triton
kernel: per row the Gumbel-max trick, ``argmax(logit / T + G)`` with
``G = -log(-log U)``, which picks token ``i`` with probability
``softmax(logit / T)_i`` (the exponential race ``argmax(p / E)`` in log
space). ``U`` comes from Philox (``tl.rand``) keyed by the request's seed
and its output position, so a seeded request draws the same tokens in any
batch, at any row, after any preemption. Greedy rows (temperature 0) take the
plain argmax in the same kernel.

Follows vLLM's GPU sampler (batched top-k/top-p, per-request generators) and
FlashInfer's sampling-from-logits kernels in spirit; the random streams are not
the torch sampler's, so only distributions (not tokens) are comparable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15
_KEY_MASK = (1 << 62) - 1


def philox_key(seed: int) -> int:
    """The Philox key base of a request seed (its output position is added on the device)."""
    return (seed * _SEED_MIX) & _KEY_MASK


@dataclass
class DeviceSamplingTensors:
    """One step's per-row sampling settings on the device (``R`` rows), built by ``from_params``.

    Attributes:
        temperature: ``[R]`` float32 (0: greedy).
        top_k: ``[R]`` int64 (the vocabulary size when off); top_p, min_p: ``[R]`` float32.
        keys: ``[R]`` int64 Philox key base per row (``philox_key`` of the request's seed, or of
            the engine seed mixed with the step counter for unseeded rows).
        positions: ``[R]`` int64 output position of each row's token (the seeded stream's step).
        use_top_k, use_top_p, use_min_p, all_greedy: host flags, so no branch reads the device.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    keys: torch.Tensor
    positions: torch.Tensor
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    all_greedy: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], positions: list[int], vocab: int, device: torch.device,
                    engine_seed: int = 0, step: int = 0) -> "DeviceSamplingTensors":
        """Build the step's tensors from host data (one small copy per field, no device read).

        Args:
            params: one ``SamplingParams`` per row; positions: each row's output position.
            vocab: the logits' width; engine_seed, step: the key of unseeded rows (differs per step).
        """
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        keys = [philox_key(p.seed) if p.seed is not None else philox_key(engine_seed * 0x100000001 + step + i)
                for i, p in enumerate(params)]

        pin = torch.device(device).type == "cuda"

        def t(vals, dtype):  # from pinned memory a non-blocking copy queues without a stream sync
            host = torch.tensor(vals, dtype=dtype)
            return (host.pin_memory() if pin else host).to(device, non_blocking=True)

        return cls(temperature=t([p.temperature for p in params], torch.float32), top_k=t(top_k, torch.int64),
                   top_p=t([p.top_p for p in params], torch.float32), min_p=t([p.min_p for p in params], torch.float32),
                   keys=t(keys, torch.int64), positions=t(positions, torch.int64),
                   use_top_k=any(k < vocab for k in top_k), use_top_p=any(p.top_p < 1.0 for p in params),
                   use_min_p=any(p.min_p > 0 for p in params), all_greedy=all(p.temperature == 0 for p in params))


def device_eligible(p: SamplingParams, output_len: int) -> bool:
    """True when a row is drawn on the device: ``sample`` (temperature, top-k, top-p, min-p, seed)
    after ``process_on_device`` (logit bias, penalties); no logprobs, allowed ids, or unmet
    ``min_tokens``. The choice depends on the request alone, so a seeded request draws from one
    stream in any batch."""
    return p.logprobs is None and p.allowed_token_ids is None and output_len >= p.min_tokens


def process_on_device(logits: torch.Tensor, md, rows: list[int], prev_tokens) -> torch.Tensor:
    """Logit bias, then repetition / frequency / presence penalties of ``rows``, batched on the device
    (the torch sampler's ``process`` order and definitions, for rows without ``min_tokens`` or
    ``allowed_token_ids``).

    Each row's known history (its output ids and the prompt for a repetition penalty) is host
    data of ``md``: it goes to the device as ``(row, token)`` pairs in one non-blocking transfer
    and becomes ``[P, V]`` counts by a scatter-add. A row whose last token the previous step is
    still sampling takes it from ``prev_tokens`` on the device (a gather): nothing is read back.

    Args:
        logits: ``[len(rows), V]`` float32, row ``i`` is ``md``'s row ``rows[i]``.
        md: the step's ``SamplingMetadata``; rows: indices of its rows, in ``logits`` order.
        prev_tokens: the previous step's ``[R']`` int64 sampled ids (a device tensor, or a host
            list) for pending rows, or ``None``.
    Returns:
        ``[len(rows), V]`` processed logits (``logits`` itself when no row asks for either).
    """
    from pagedllm.worker.upload import to_device
    params, vocab, dev = md.params, logits.shape[-1], logits.device
    at = {r: i for i, r in enumerate(rows)}
    bias = [(at[r], tok, b) for r in rows for tok, b in (params[r].logit_bias or {}).items() if tok < vocab]
    pending = dict(zip(md.pending_rows.tolist(), md.pending_src.tolist()))
    pen = [(at[r], out, prompt) for r, out, prompt in zip(md.penalty_rows, md.penalty_outputs, md.penalty_prompts)
           if r in at]
    if not bias and not pen:
        return logits
    flat_out = np.concatenate([k * vocab + out for k, (_, out, _) in enumerate(pen)] + [np.zeros(0, np.int64)])
    flat_prompt = np.concatenate([k * vocab + pr for k, (_, _, pr) in enumerate(pen)] + [np.zeros(0, np.int64)])
    bias_idx = np.array([i * vocab + t for i, t, _ in bias], dtype=np.int64)
    pen_rows = np.array([i for i, _, _ in pen], dtype=np.int64)
    # (penalty row k, source row among the previous step's samples) of pending rows
    pend = np.array([(k, pending[rows[i]]) for k, (i, _, _) in enumerate(pen) if rows[i] in pending],
                    dtype=np.int64).reshape(-1, 2)
    bias_idx, flat_out, flat_prompt, pen_rows_t, pend_t = to_device(
        [bias_idx, flat_out, flat_prompt, pen_rows, pend.reshape(-1)], dev)
    if len(pend):
        prev = prev_tokens if isinstance(prev_tokens, torch.Tensor) else torch.tensor(prev_tokens, dtype=torch.int64)
        pend_t = pend_t.view(-1, 2)
        flat_out = torch.cat([flat_out, pend_t[:, 0] * vocab + prev.to(dev).index_select(0, pend_t[:, 1])])
    floats = [b for _, _, b in bias] + [getattr(params[rows[i]], name) for name in
                                          ("presence_penalty", "frequency_penalty", "repetition_penalty")
                                          for i, _, _ in pen]
    host = torch.tensor(floats, dtype=torch.float32)
    vals = (host.pin_memory() if dev.type == "cuda" else host).to(dev, non_blocking=True)
    nb, npen = len(bias), len(pen)
    if nb:
        logits = apply_logit_bias(logits, bias_idx // vocab, bias_idx % vocab, vals[:nb])
    if npen:
        counts = torch.zeros(npen * vocab, dtype=torch.int32, device=dev)
        counts.scatter_add_(0, flat_out, torch.ones_like(flat_out, dtype=torch.int32))
        mask = torch.zeros(npen * vocab, dtype=torch.bool, device=dev)
        mask.scatter_(0, flat_prompt, torch.ones_like(flat_prompt, dtype=torch.bool))
        pres, freq, rep = vals[nb:].view(3, npen).unbind(0)
        sub = apply_penalties(logits.index_select(0, pen_rows_t), counts.view(npen, vocab), mask.view(npen, vocab),
                              pres, freq, rep)
        logits = logits.index_copy(0, pen_rows_t, sub)
    return logits


class DeviceSampler:
    """The runner's draw on the Triton path: eligible rows (``device_eligible``) get their logit bias
    and penalties, are shaped and drawn on the device, the others (and their logprobs) by the torch
    ``Sampler``.

    Args:
        sampler: the torch sampler for the rows that need it.
        seed: engine seed, which keys unseeded rows together with a step counter.
    """

    def __init__(self, sampler, seed: int = 0) -> None:
        self.sampler = sampler
        self.seed = seed
        self.step = 0

    def __call__(self, logits: torch.Tensor, md, prev_sampled: torch.Tensor | None = None, prev_list=None):
        """Sample one token per row of ``logits`` ``[R, V]`` float32.

        Args:
            md: the step's ``SamplingMetadata``.
            prev_sampled: the previous step's ``[R']`` int64 sampled ids on the device, for rows
                whose last token is still pending (``None``: no such row).
            prev_list: a callable giving the same ids as a host list; called only when a pending
                row needs the torch sampler (which reads the host).
        Returns:
            ``(logprobs, tokens)``: per row the torch sampler's ``TokenLogprobs`` or ``None``, and
            the ``[R]`` int64 device tensor of the sampled ids. Nothing is read back to the host
            when every row is drawn on the device: the caller copies ``tokens`` without blocking
            (``worker/device/host_tokens.py``).
        """
        params, lens = md.params, md.output_lens.tolist()
        rows = [i for i, p in enumerate(params) if device_eligible(p, lens[i])]
        self.step += 1

        def torch_sample():
            return self.sampler(logits, md, prev_list() if md.pending_rows.size and prev_list else None)
        if not rows:
            out = torch_sample()
            return out.logprobs, torch.tensor(out.token_ids, dtype=torch.int64, device=logits.device)
        if len(rows) == len(params):
            st = DeviceSamplingTensors.from_params(params, lens, logits.shape[-1], logits.device, self.seed, self.step)
            return [None] * len(params), sample(process_on_device(logits, md, rows, prev_sampled), st)
        out = torch_sample()  # rows that need the torch sampler
        sel = torch.tensor(rows, device=logits.device)
        st = DeviceSamplingTensors.from_params([params[i] for i in rows], [lens[i] for i in rows], logits.shape[-1],
                                               logits.device, self.seed, self.step)
        tokens = torch.tensor(out.token_ids, dtype=torch.int64, device=logits.device)
        mine = process_on_device(logits.index_select(0, sel), md, rows, prev_sampled)
        return out.logprobs, tokens.index_copy(0, sel, sample(mine, st))


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """``logits[rows[j], cols[j]] += vals[j]`` for every ``j`` (``[N]`` int64, int64, float32), batched
    (a scatter-add over the flattened logits: repeated entries add up; a new tensor)."""
    flat = logits.contiguous().view(-1)
    return flat.scatter_add(0, rows * logits.shape[-1] + cols, vals.to(logits.dtype)).view(logits.shape)


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Repetition, frequency and presence penalties of every row at once (as ``sampler.apply_penalties``).

    Args:
        logits: ``[R, V]`` float32.
        output_counts: ``[R, V]`` occurrences of each token in the row's output (kept on the device).
        prompt_mask: ``[R, V]`` bool, the token appears in the prompt.
        presence, frequency, repetition: ``[R]`` float32 (0, 0, 1 when off).
    Returns:
        ``[R, V]`` penalised logits (a new tensor).
    """
    counts = output_counts.to(logits.dtype)
    seen = (counts > 0) | prompt_mask
    r = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def shape_logits(logits: torch.Tensor, st: DeviceSamplingTensors) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p masks (-inf), batched; greedy rows keep their logits.

    Same definitions as the torch sampler's ``target_probs`` (top-p on the top-k survivors,
    renormalised; a token stays while the mass before it is below ``top_p``).

    Returns:
        ``[R, V]`` float32 logits whose softmax is the distribution drawn from.
    """
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    logits = logits / temp.unsqueeze(1)
    vocab = logits.shape[-1]
    if st.use_min_p:
        probs = logits.softmax(-1)
        thresh = probs.amax(-1, keepdim=True) * st.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    if st.use_top_k or st.use_top_p:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= st.top_k.unsqueeze(1), float("-inf"))
        if st.use_top_p:
            probs = sorted_logits.softmax(-1)
            remove = (probs.cumsum(-1) - probs) >= st.top_p.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
    return logits


def gumbel_sample(logits: torch.Tensor, st: DeviceSamplingTensors) -> torch.Tensor:
    """One token per row: argmax for greedy rows, a seeded Gumbel-max draw for the others.

    Args:
        logits: ``[R, V]`` float32 shaped logits (``shape_logits``), last dim contiguous.
        st: the rows' settings (temperature 0 = greedy; keys and positions key the noise).
    Returns:
        ``[R]`` int64 token ids on the logits' device. Needs triton (on the CPU: its interpreter).
    """
    from pagedllm.worker.device import device_sampling_kernels as k
    return k.gumbel_argmax(logits, st.temperature, st.keys, st.positions)


def sample(logits: torch.Tensor, st: DeviceSamplingTensors) -> torch.Tensor:
    """Shape and draw (``shape_logits`` then ``gumbel_sample``); ``[R]`` int64, no host sync."""
    return gumbel_sample(shape_logits(logits, st), st)

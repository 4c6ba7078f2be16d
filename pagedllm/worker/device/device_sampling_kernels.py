"""The Triton draw of ``worker/device/device_sampler.py``: Gumbel-max over a row's logits, keyed per request.

Importing this module needs ``triton``; under ``TRITON_INTERPRET=1`` (set before
the import) it runs on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_argmax_kernel(logits, out, temperature, keys, positions, stride_r, vocab, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    temp = tl.load(temperature + row)
    greedy = temp == 0.0  # the logits are already divided by the temperature (shape_logits)
    # the row's Philox key: its request's key base plus its output position (seeded streams are
    # a function of (seed, position) only, never of the batch)
    key = tl.load(keys + row) + tl.load(positions + row)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        m = offs < vocab
        x = tl.load(logits + row * stride_r + offs, mask=m, other=float("-inf")).to(tl.float32)
        u = tl.rand(key, offs)
        u = tl.minimum(tl.maximum(u, 1e-10), 1.0 - 1e-7)
        g = -tl.log(-tl.log(u))
        score = tl.where(greedy, x, x + g)
        score = tl.where(m, score, float("-inf"))
        better = score > best  # strict: the first of equal scores in a lane wins
        best = tl.where(better, score, best)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best, 0)
    cand = tl.where(best == top, best_idx, vocab)
    tl.store(out + row, tl.min(cand, 0).to(tl.int64))  # ties: the lowest id, as torch.argmax


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                  positions: torch.Tensor, block_v: int = 1024) -> torch.Tensor:
    """``[R]`` int64: per row ``argmax(logits + Gumbel noise)``, or ``argmax(logits)`` where ``T == 0``.

    Args:
        logits: ``[R, V]`` float32/float16/bfloat16 already divided by the temperature
            (``device_sampler.shape_logits``), last dim contiguous (-inf: excluded tokens).
        temperature: ``[R]`` float32, only its zeros (greedy rows) are read; keys, positions: ``[R]`` int64 Philox key base and output
            position of each row (the noise of a row depends on these two only).
        block_v: vocabulary tile per loop iteration.
    """
    r, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(r, dtype=torch.int64, device=logits.device)
    if r:
        _gumbel_argmax_kernel[(r,)](logits, out, temperature, keys, positions, logits.stride(0), v,
                                    BLOCK_V=min(block_v, triton.next_power_of_2(v)))
    return out

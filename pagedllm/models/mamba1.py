"""Mamba-1 (selective scan) mixers of hybrid models over pagedllm's flattened batch, from each request's slot.

A Mamba-1 layer keeps two states per request, one row per inner channel: the input
convolution's last ``d_conv - 1`` inputs ``[intermediate, d_conv - 1]`` and the SSM state
``[intermediate, d_state]``. The selective scan (Gu & Dao 2023, "Mamba: Linear-Time
Sequence Modeling with Selective State Spaces", Algorithm 2) is a recurrence over time,
``h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * x_t`` and ``y_t = C_t . h_t + D * x_t``,
so every request of the step (decodes and prefill chunks alike) advances together:
step ``t`` updates the requests that have a ``t``-th token this step, starting from each
request's carried state (zero for a request whose first token runs now).

Source: transformers' ``models/jamba/modeling_jamba.py`` (``JambaMambaMixer.forward``, torch
path: ``in_proj -> x, gate``; ``act(causal_conv1d(x))``; ``x_proj -> dt, B, C`` with
Jamba's RMS norms on each; ``dt_proj``; ``mamba_selective_scan`` / ``mamba_selective_state_update``
with ``D`` and the ``silu(gate)`` output gate; ``out_proj``). That file's scan has no initial
state, so the recurrence is written here with the same operations in the same order.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.state import StateBatch
from pagedllm.models.short_conv import causal_conv_step


def jamba_mamba_forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
                        **kwargs) -> torch.Tensor:
    """``JambaMambaMixer.forward`` over pagedllm's flattened batch: ``[1, T, H] -> [1, T, H]``.

    Bound to the module by ``hybrid.install_mixers``; the layer's state tensors are
    ``[num_slots, intermediate, d_conv - 1]`` (convolution) and ``[num_slots, intermediate, d_state]``
    (SSM), updated in place for the step's requests. ``cache_params`` and ``attention_mask``
    (``transformers``' padded-batch cache and mask) are ignored: the state comes from the slots
    and the flattened batch has no padding.
    """
    batch: StateBatch = self._pagedllm_state()
    conv_cache, ssm_cache = batch.caches[self.layer_idx]
    x = hidden_states[0]
    xs, gate = self.in_proj(x).chunk(2, dim=-1)
    xs = self.act(causal_conv_step(xs, conv_cache, self.conv1d.weight[:, 0, :], self.conv1d.bias, batch))
    dt, b, c = torch.split(self.x_proj(xs), [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
    # Jamba normalises dt, B and C before the discretisation (its difference from plain Mamba)
    dt = self.dt_layernorm(dt) @ self.dt_proj.weight.T
    y = selective_scan_step(xs, dt, -torch.exp(self.A_log.float()), self.b_layernorm(b), self.c_layernorm(c),
                            self.D, self.dt_proj.bias, ssm_cache, batch)
    y = y * F.silu(gate)
    return self.out_proj(y.to(x.dtype)).unsqueeze(0)


def selective_scan_step(xs: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                        D: torch.Tensor | None, dt_bias: torch.Tensor | None, ssm_cache: torch.Tensor,
                        batch: StateBatch) -> torch.Tensor:
    """Mamba-1's selective scan of every request's segment, continuing its state; updates its slot.

    The loop runs over the longest segment's tokens; step ``t`` advances every request with
    more than ``t`` tokens in one batched update (so the step's decodes take one update together).
    ``dt`` gets ``dt_bias`` and a softplus, as transformers' ``delta_softplus=True``.

    Args:
        xs: ``[T, d]`` convolved inputs of the flattened batch (``d`` inner channels).
        dt: ``[T, d]`` time steps before bias and softplus.
        A: ``[d, N]`` float32 state matrix (negative; ``N = d_state``).
        b, c: ``[T, N]`` input and output projections of the state.
        D: ``[d]`` skip weights, or ``None``; dt_bias: ``[d]`` or ``None``.
        ssm_cache: ``[num_slots, d, N]``; the scheduled requests' slots are overwritten.
        batch: the step's ``StateBatch``.
    Returns:
        ``[T, d]`` in ``xs``'s dtype (before the output gate).
    """
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    dt = F.softplus(dt)
    order, req, offsets = _time_major(batch)
    state = batch.initial(ssm_cache).float()  # [R, d, N]
    ys = torch.empty(xs.shape, dtype=torch.float32, device=xs.device)
    marks: dict[int, list[tuple[int, int]]] = {}  # token index t -> prefix-cache checkpoints after it
    for r, k, slot in batch.checkpoints:
        marks.setdefault(k - 1, []).append((r, slot))
    for t in range(len(offsets) - 1):
        rows = order[offsets[t]:offsets[t + 1]]  # the t-th token of every request that has one
        live = req[rows]
        dt_t, x_t = dt[rows].float(), xs[rows].float()
        dA = torch.exp(A[None] * dt_t[:, :, None])
        dBx = (dt_t[:, :, None] * b[rows].float()[:, None, :]) * x_t[:, :, None]
        h = dA * state[live] + dBx
        state[live] = h
        ys[rows] = torch.matmul(h, c[rows].float()[:, :, None])[:, :, 0]
        for r, slot in marks.get(t, ()):  # the state after exactly this block boundary
            ssm_cache[slot] = state[r].to(ssm_cache.dtype)
    if D is not None:
        ys = ys + xs.float() * D.float()
    ssm_cache[batch.state_slots] = state.to(ssm_cache.dtype)
    return ys.to(xs.dtype)


def _time_major(batch: StateBatch) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The flattened batch's rows grouped by their index within their request.

    Returns:
        ``(order [T], req [T], offsets)``: ``order[offsets[t]:offsets[t + 1]]`` are the rows that are
        the ``t``-th token of their request (in request order), ``req[row]`` is the request of a row
        (int64, on the batch's device), and ``offsets`` is a host list of ``max_len + 1`` ints, so the
        scan loop needs no device-to-host copy per token.
    """
    qsl = batch.query_start_loc
    lens = np.diff(np.asarray(qsl.tolist(), dtype=np.int64))
    n = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(batch.num_reqs, device=qsl.device), n, output_size=int(lens.sum()))
    pos = torch.arange(req.shape[0], device=qsl.device) - qsl[req]
    order = torch.sort(pos, stable=True).indices  # stable: request order within each t
    # requests with more than t tokens = all minus those with at most t
    live = len(lens) - np.cumsum(np.bincount(lens, minlength=1))[:-1] if len(lens) else np.zeros(0, np.int64)
    return order, req, [0] + np.cumsum(live).tolist()

"""Mamba-2 (SSD) mixers of hybrid models over pagedllm's flattened batch, from each request's state slot.

A Mamba-2 layer keeps two states per request: the input convolution's last
``d_conv - 1`` inputs ``[conv_dim, d_conv - 1]`` and the SSM state
``[n_heads, d_head, d_state]``. A request that decodes (one token) takes the
recurrent update, batched over all decodes of the step; a request that
prefills (or continues a chunked prefill) runs the chunked SSD scan on its
segment, starting from its carried SSM state (``initial_states``; zero for a
request whose first token runs now), and keeps the scan's final state.

Prefix-cache checkpoints (``core/state_checkpoints.py``) need the SSM state at block
boundaries inside a segment. The scan only returns its final state, so a segment with
checkpoints is scanned in pieces that end at them, each piece starting from the state the
previous one returned. This is the same recurrence (as chunked prefill splits a prompt across
steps), needs no scan of our own and no change to the scheduler's chunking; it costs one scan
call per checkpointed block of the segment, and only when prefix caching makes checkpoints.

On float32 CPU tensors the whole step's SSM is one C kernel instead (``kernels/state.py``
``ssd_scan``): every segment, decode or prefill chunk, in the recurrent form token by token, the
checkpoints written as the scan passes them. transformers' chunked scan costs about 50 ms per call
at Granite-4.0-H-Tiny's width whatever the length (so a 256-token chunk with a checkpoint every 16
tokens cost 16 calls); the recurrent kernel is 6.1x faster on a 256-token chunk, 6.6x on 1024,
and 53x with a checkpoint per block (``benchmarks/hybrid_mixers.py``). Other devices and dtypes take the path below.

Source: transformers' ``models/granitemoehybrid/modeling_granitemoehybrid.py``
(``GraniteMoeHybridMambaLayer.forward``, torch path: ``in_proj -> gate, xBC, dt``;
``silu(causal_conv1d(xBC))``; ``mamba2_chunk_scan`` / ``mamba2_selective_state_update``;
gated RMSNorm; ``out_proj``). The scan functions are that module's own, so the
arithmetic is the reference's.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from pagedllm.attention.state import StateBatch
from pagedllm.kernels import state as state_kernels
from pagedllm.models.short_conv import causal_conv_step


def granite_mamba_forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
                          **kwargs) -> torch.Tensor:
    """``GraniteMoeHybridMambaLayer.forward`` over pagedllm's flattened batch: ``[1, T, H] -> [1, T, H]``.

    Bound to the module by ``hybrid.install_mixers``; the layer's state tensors are
    ``[num_slots, conv_dim, d_conv - 1]`` (convolution) and ``[num_slots, n_heads, d_head, d_state]``
    (SSM), updated in place for the step's requests.
    """
    batch: StateBatch = self._pagedllm_state()
    conv_cache, ssm_cache = batch.caches[self.layer_idx]
    x = hidden_states[0]
    gate, xbc, dt = self.in_proj(x).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    xbc = causal_conv_step(xbc, conv_cache, self.conv1d.weight[:, 0, :], self.conv1d.bias, batch, silu=True)
    xs, b, c = torch.split(xbc, [self.intermediate_size, self.n_groups * self.ssm_state_size,
                                 self.n_groups * self.ssm_state_size], dim=-1)
    y = ssd_step(self, xs, b, c, dt, ssm_cache, batch)
    return self.out_proj(self.norm(y, gate).to(x.dtype)).unsqueeze(0)


def ssd_step(layer, xs: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, ssm_cache: torch.Tensor,
             batch: StateBatch) -> torch.Tensor:
    """The SSM of every request's segment; updates the scheduled slots of ``ssm_cache``.

    Args:
        layer: the ``transformers`` Mamba layer (``A_log``, ``D``, ``dt_bias``, sizes, ``chunk_size``).
        xs: ``[T, n_heads * d_head]``; b, c: ``[T, n_groups * d_state]``; dt: ``[T, n_heads]``.
        ssm_cache: ``[num_slots, n_heads, d_head, d_state]``; the step's checkpoint slots
            (``batch.checkpoints``) get the state at their boundaries (see the module docstring).
    Returns:
        ``[T, n_heads * d_head]``.
    """
    ref = importlib.import_module(type(layer).__module__)
    nh, hd, ns, ng = layer.num_heads, layer.head_dim, layer.ssm_state_size, layer.n_groups
    A = -torch.exp(layer.A_log.float())
    qsl = batch.query_start_loc.tolist()
    lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
    if state_kernels.applies(xs, ssm_cache):  # the C kernel: every segment in the recurrent form
        limits = [(0.0, float("inf")) if n == 1 else tuple(layer.time_step_limit) for n in lens]  # as transformers
        return state_kernels.ssd_scan(ssm_cache, batch.query_start_loc, batch.initial_index(), batch.state_slots,
                                      xs, dt, A, b, c, layer.D, layer.dt_bias, limits,
                                      batch.checkpoint_arrays()).to(xs.dtype)
    out = torch.empty_like(xs)
    dec = [i for i, n in enumerate(lens) if n == 1]
    init = batch.initial(ssm_cache)
    if dec:  # one recurrent update for every decode of the step
        rows = torch.tensor([qsl[i] for i in dec], device=xs.device)
        state = init[dec].clone()
        y = ref.mamba2_selective_state_update(
            state, xs[rows].view(-1, nh, hd), dt[rows].unsqueeze(-1).expand(-1, -1, hd),
            A[:, None, None].expand(-1, hd, ns), b[rows].view(-1, ng, ns), c[rows].view(-1, ng, ns),
            layer.D[:, None].expand(-1, hd), z=None, dt_bias=layer.dt_bias[:, None].expand(-1, hd), dt_softplus=True)
        out[rows] = y.reshape(len(dec), -1).to(out.dtype)
        ssm_cache[batch.state_slots[dec]] = state.to(ssm_cache.dtype)
        for j, i in enumerate(dec):  # a decode's only checkpoint can be after its one token
            for _, slot in batch.checkpoints_of(i):
                ssm_cache[slot] = state[j].to(ssm_cache.dtype)
    for i, n in enumerate(lens):
        if n == 1:
            continue
        s = qsl[i]
        state, prev = init[i:i + 1], 0
        cuts = batch.checkpoints_of(i)
        for k in sorted({k for k, _ in cuts if k < n} | {n}):  # pieces ending at the checkpoints
            a, e, m = s + prev, s + k, k - prev
            y, state = ref.mamba2_chunk_scan(
                xs[a:e].view(1, m, nh, hd), dt[a:e].unsqueeze(0), A, b[a:e].view(1, m, ng, ns),
                c[a:e].view(1, m, ng, ns), chunk_size=layer.chunk_size, D=layer.D, z=None, return_final_states=True,
                dt_bias=layer.dt_bias, dt_softplus=True, initial_states=state, dt_limit=layer.time_step_limit)
            out[a:e] = y.reshape(m, -1).to(out.dtype)
            for slot in [sl for kk, sl in cuts if kk == k]:
                ssm_cache[slot] = state[0].to(ssm_cache.dtype)
            prev = k
        ssm_cache[batch.state_slots[i]] = state[0].to(ssm_cache.dtype)
    return out

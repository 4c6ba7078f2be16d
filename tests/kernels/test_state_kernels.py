"""The hybrid mixers' C kernels (``kernels/state_kernels.c``) equal the torch mixers.

Each case runs the same step twice, ``PAGEDLLM_NATIVE_MIXERS=0`` (torch ops) and on (C), from
the same state tensors, and compares the outputs and every state slot afterwards: ragged
segments (decodes, a chunk continuing from carried state, a request starting now, one starting
from a checkpoint slot), prefix-cache checkpoints inside and at the end of segments, SiLU.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.state import StateBatch
from pagedllm.kernels import cpu, state as state_kernels
from pagedllm.models.mamba2 import ssd_step
from pagedllm.models.short_conv import causal_conv_step

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernels")

LENS = [1, 5, 1, 9, 2]
SLOTS = [0, 3, 5, 1, 6]
HAS_INIT = [True, True, False, True, False]
INITIAL = [0, 7, 5, 1, 6]  # request 1 starts from checkpoint slot 7 (a prefix-cache hit)
CHECKPOINTS = [(0, 1, 8), (1, 2, 9), (1, 5, 10), (3, 4, 11), (3, 8, 12)]


def _batch(caches, checkpoints=CHECKPOINTS) -> StateBatch:
    qsl = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist())
    return StateBatch(torch.tensor(SLOTS), torch.tensor(HAS_INIT), qsl, caches, torch.tensor(INITIAL),
                      list(checkpoints))


def _both(monkeypatch, run):
    """``run()`` on the torch mixers, then on the C kernels (which must have been called)."""
    got, calls = {}, []
    for name in ("causal_conv", "ssd_scan"):
        real = getattr(state_kernels, name)
        monkeypatch.setattr(state_kernels, name, lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))
    for native in ("0", "1"):
        monkeypatch.setenv("PAGEDLLM_NATIVE_MIXERS", native)
        got[native] = run()
        assert bool(calls) == (native == "1")
    return got["0"], got["1"]


@pytest.mark.parametrize("width,silu,bias", [(2, False, True), (3, True, True), (3, False, False)])
@pytest.mark.parametrize("checkpoints", [CHECKPOINTS, []])
def test_causal_conv_equals_torch(monkeypatch, width, silu, bias, checkpoints):
    g = torch.Generator().manual_seed(width)
    chans = 150  # not a multiple of the kernel's channel block
    x = torch.randn(sum(LENS), chans, generator=g)
    cache0 = torch.randn(13, chans, width, generator=g)
    weight = torch.randn(chans, width + 1, generator=g)
    b = torch.randn(chans, generator=g) if bias else None

    def run():
        cache = cache0.clone()
        out = causal_conv_step(x, cache, weight, b, _batch({0: [cache]}, checkpoints), silu=silu)
        return out, cache
    (ref, ref_cache), (nat, nat_cache) = _both(monkeypatch, run)
    torch.testing.assert_close(nat, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nat_cache, ref_cache, rtol=0, atol=0)  # the carried inputs are copies


@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 1.5)])
def test_ssd_scan_equals_the_transformers_scans(monkeypatch, limit):
    """Decodes (transformers' recurrent update) and prefill chunks (its chunked scan, in pieces
    ending at the checkpoints) against the C scan; ``time_step_limit`` clamps prefill chunks only."""
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer
    torch.manual_seed(0)
    cfg = GraniteMoeHybridConfig(hidden_size=32, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2,
                                 mamba_d_conv=4, mamba_chunk_size=4, num_hidden_layers=1,
                                 layer_types=["linear_attention"])
    layer = GraniteMoeHybridMambaLayer(cfg, layer_idx=0)
    layer.time_step_limit = limit
    with torch.no_grad():
        layer.A_log.uniform_(-1, 1)
        layer.dt_bias.uniform_(-2, 2)
        layer.D.uniform_(-1, 1)
    nh, hd, ns, ng = 4, 16, 8, 2
    t = sum(LENS)
    xs, dt = torch.randn(t, nh * hd), torch.randn(t, nh) * 3
    b, c = torch.randn(t, ng * ns), torch.randn(t, ng * ns)
    ssm0 = torch.randn(13, nh, hd, ns)

    def run():
        ssm = ssm0.clone()
        with torch.no_grad():
            out = ssd_step(layer, xs, b, c, dt, ssm, _batch({0: [None, ssm]}))
        return out, ssm
    (ref, ref_ssm), (nat, nat_ssm) = _both(monkeypatch, run)
    torch.testing.assert_close(nat, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(nat_ssm, ref_ssm, rtol=1e-4, atol=1e-4)
    assert not torch.equal(ref_ssm, ssm0) and not torch.equal(ref_ssm[8:13], ssm0[8:13])  # checkpoints written


def test_native_switch(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_NATIVE_MIXERS", "0")
    assert not state_kernels.native_mixers()
    monkeypatch.setenv("PAGEDLLM_NATIVE_MIXERS", "1")
    assert state_kernels.native_mixers() and not state_kernels.applies(torch.zeros(2, dtype=torch.bfloat16))

"""The experts kernel (``kernels.cpu.moe_experts``, issue 40): a mixture-of-experts layer's top-k
experts in one C call equal a per-expert float64 reference of the same (dequantized) weights, for
float32 experts and every packed format MoE GGUFs ship in, on every kernel build this CPU runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedllm.kernels import cpu
from pagedllm.models.gguf_blocks import _BLOCK, repack
from pagedllm.models.moe import ExpertWeights
from pagedllm.models.packed_linears import packed_linear

pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels off (PAGEDLLM_CPU_KERNELS=0) or no C compiler")
E, H, I, K = 6, 256, 512, 2


@pytest.fixture(autouse=True)
def kernels(isa_build):
    return isa_build


def _packed(kind: str, n: int, k: int, rng):
    """A packed ``[n, k]`` linear of GGUF ``kind`` (random blocks where gguf-py has no quantizer)."""
    w = (0.05 * rng.standard_normal((n, k))).astype(np.float32)
    try:
        raw = quantize(w, GGMLQuantizationType[kind])
    except NotImplementedError:
        bw, bb = _BLOCK[kind]
        raw = rng.integers(0, 256, (n * k // bw, bb), dtype=np.uint8)
        raw[:, 0:4] = rng.uniform(0.001, 0.01, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
        if kind == "Q6_K":
            raw[:, 208:210] = raw[:, 0:2]
    layout, p = repack(kind, raw, n, k)
    return packed_linear(layout, p, n, k, kind=kind)


def _reference(x, idx, wts, gate_up, down, act):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            g, u = (x[t].double() @ gate_up[e].double().T).chunk(2)
            if act == "swiglu_oai":  # gpt-oss: clamped, alpha 1.702, limit 7
                g = g.clamp(max=7.0)
                h = (u.clamp(-7.0, 7.0) + 1) * g * torch.sigmoid(1.702 * g)
            else:
                h = (torch.nn.functional.silu(g) if act == "silu" else torch.nn.functional.gelu(g, approximate="tanh")) * u
            out[t] += float(wts[t, j]) * (h @ down[e].double().T)
    return out


@pytest.mark.parametrize("kind", ["float32", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])
def test_experts_equal_the_per_expert_reference(kind):
    rng = np.random.default_rng(3)
    torch.manual_seed(3)
    if kind == "float32":
        gu = [(0.05 * torch.randn(2 * I, H), None) for _ in range(E)]
        dn = [(0.05 * torch.randn(H, I), 0.1 * torch.randn(H)) for _ in range(E)]
        w_gu, w_dn = [w for w, _ in gu], [w for w, _ in dn]
    else:
        gu = [_packed(kind, 2 * I, H, rng) for _ in range(E)]
        dn = [_packed(kind, H, I, rng) for _ in range(E)]
        w_gu, w_dn = [m.dequantize() for m in gu], [m.dequantize() for m in dn]
    for act in ("silu", "gelu_tanh", "swiglu_oai"):
        experts = ExpertWeights(gu, dn, I, act, kind)
        for rows, threads in ((1, 1), (1, 2), (5, 2), (40, 1), (40, 2)):
            # decode, a batch (2 threads: the experts split across them), a prefill chunk (an expert
            # past 16 rows; 2 threads: each product split)
            x = torch.randn(rows, H)
            idx = torch.stack([torch.randperm(E)[:K] for _ in range(rows)])
            wts = torch.rand(rows, K)
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                got = cpu.moe_experts(x, idx, wts, experts.table, I, act).double()
            finally:
                torch.set_num_threads(before)
            want = _reference(x, idx, wts, w_gu, w_dn, act)
            if kind == "float32":  # the down biases, weighted as the rest
                for t in range(rows):
                    for j in range(K):
                        want[t] += float(wts[t, j]) * dn[int(idx[t, j])][1].double()
            # int8 activations (the default on AVX2 and above) round each input row to about 1e-4
            tol = (2e-3 if kind != "float32" and cpu.int8_activations() else 1e-5) * want.abs().max()
            assert (got - want).abs().max() <= tol, (kind, act, rows)


def test_experts_skip_ids_of_other_ranks_and_keep_token_order():
    """Ids outside ``0..E-1`` (another rank's experts) add nothing; a token listed under several
    experts gets each one's share."""
    torch.manual_seed(0)
    gu = [(torch.randn(2 * I, H) * 0.05, None) for _ in range(E)]
    dn = [(torch.randn(H, I) * 0.05, None) for _ in range(E)]
    experts = ExpertWeights(gu, dn, I, "silu", "float32")
    x = torch.randn(3, H)
    idx = torch.tensor([[0, E + 3], [-1, 2], [2, 0]])
    wts = torch.rand(3, 2)
    got = cpu.moe_experts(x, idx, wts, experts.table, I).double()
    keep = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    want = _reference(x, idx.clamp(0, E - 1), wts * keep, [w for w, _ in gu], [w for w, _ in dn], "silu")
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _one_level(v: torch.Tensor) -> torch.Tensor:
    """Rows of ``v`` as the one-level int8 activations round them: per 32-block, ``q = round(v * 127
    / max|v|)`` times ``max|v| / 127`` (float64)."""
    b = v.double().reshape(v.shape[0], -1, 32)
    step = b.abs().amax(-1, keepdim=True) / 127
    return (torch.round(b / torch.where(step > 0, step, 1)) * step).reshape(v.shape)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_prefill_sized_calls_take_one_activation_level(kind):
    """With int8 activations on AVX2 / AVX-VNNI, a call of ``ONE_LEVEL_ROWS`` tokens or more (prefill)
    quantizes the experts' inputs (x, then the activated h) in one level: it equals the per-expert
    reference on one-level inputs; 63 tokens keep two levels (closer to the float reference)."""
    if cpu._lib.pl_isa() == 0 or cpu.isa() not in cpu.ONE_LEVEL_ISAS:
        pytest.skip("only the AVX2 and AVX-VNNI builds take one level")
    rng = np.random.default_rng(4)
    torch.manual_seed(4)
    gu = [_packed(kind, 2 * I, H, rng) for _ in range(E)]
    dn = [_packed(kind, H, I, rng) for _ in range(E)]
    w_gu, w_dn = [m.dequantize().double() for m in gu], [m.dequantize().double() for m in dn]
    experts = ExpertWeights(gu, dn, I, "silu", kind)
    x = torch.randn(70, H)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(70)])
    wts = torch.rand(70, K)
    want = torch.zeros(70, H, dtype=torch.float64)
    for t in range(70):
        for j in range(K):
            e = int(idx[t, j])
            g, u = (_one_level(x[t:t + 1]) @ w_gu[e].T).chunk(2, dim=-1)
            want[t] += float(wts[t, j]) * (_one_level(torch.nn.functional.silu(g) * u) @ w_dn[e].T)[0]
    exact = _reference(x, idx, wts, [w.float() for w in w_gu], [w.float() for w in w_dn], "silu")
    cpu.set_int8_activations(True)
    try:
        got = cpu.moe_experts(x, idx, wts, experts.table, I).double()
        two = cpu.moe_experts(x[:63], idx[:63], wts[:63], experts.table, I).double()
    finally:
        cpu.set_int8_activations(False)
    # h's rounding may fall the other way where float sums differ in their last bits: one step at most
    assert (got - want).abs().max() <= 2e-3 * want.abs().max(), kind
    assert (two - exact[:63]).abs().max() < (got[:63] - exact[:63]).abs().max(), kind

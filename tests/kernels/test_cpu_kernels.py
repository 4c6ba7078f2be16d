"""The C CPU kernels against the torch code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason="CPU kernels off (PAGEDLLM_CPU_KERNELS=0) or no C compiler")


@pytest.fixture(autouse=True)
def kernels(isa_build):
    """Every test runs on every instruction-set build this CPU runs (tests/kernels/conftest.py): the
    default one and each lower one, so every code path of the C files that can run here is checked."""
    return isa_build


def _ref_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("t", [1, 7, 300])
def test_rms_norm_with_and_without_residual(t):
    g = torch.Generator().manual_seed(t)
    x, res, w = torch.randn(t, 576, generator=g), torch.randn(t, 576, generator=g), torch.randn(576, generator=g)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), _ref_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    expect_res = res + x
    out = cpu.rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(res, expect_res)  # the residual add is one float addition, bitwise
    torch.testing.assert_close(out, _ref_norm(expect_res, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rope_matches_rotate_half():
    g = torch.Generator().manual_seed(0)
    t, h, kvh, d, maxpos = 5, 9, 3, 64, 100
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g)
    ang = torch.rand(maxpos, d // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    pos = torch.tensor([0, 3, 99, 42, 7])
    x = qkv[:, :(h + kvh) * d].reshape(t, h + kvh, d)
    x1, x2 = x.chunk(2, -1)
    expect = x * cos[pos].unsqueeze(1) + torch.cat((-x2, x1), -1) * sin[pos].unsqueeze(1)
    v_before = qkv[:, (h + kvh) * d:].clone()
    cpu.rope_(qkv, h + kvh, d, pos, cos, sin)
    torch.testing.assert_close(qkv[:, :(h + kvh) * d].view(t, h + kvh, d), expect, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (h + kvh) * d:], v_before)


def test_silu_mul():
    gu = torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 8
    gate, up = gu.chunk(2, -1)
    torch.testing.assert_close(cpu.silu_mul(gu), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("window,softcap", [(None, None), (37, None), (None, 30.0)])
def test_write_kv_and_decode_attention_match_dense_attention(window, softcap):
    g = torch.Generator().manual_seed(2)
    kvh, h, d, bs, nb = 3, 9, 64, 16, 40
    kc, vc = torch.zeros(kvh, nb, bs, d), torch.zeros(kvh, nb, bs, d)
    lens = [1, 17, 100, 64]
    perm = torch.randperm(nb, generator=g).tolist()
    tables, keys, vals = [], [], []
    for n in lens:  # each sequence gets shuffled blocks; write its whole context through slots
        blocks = [perm.pop() for _ in range(-(-n // bs))]
        tables.append(blocks + [0] * (7 - len(blocks)))
        k, v = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
        slots = torch.tensor([blocks[i // bs] * bs + i % bs for i in range(n)])
        qkv = torch.cat([k, v], 1)  # strided views, as the model passes them
        cpu.write_kv(kc, vc, qkv[:, :kvh], qkv[:, kvh:], slots)
        keys.append(k), vals.append(v)
    q = torch.randn(len(lens) + 2, h, d, generator=g)
    rows = torch.tensor([1, 2, 4, 5])
    out = torch.full((len(lens) + 2, h, d), 7.0)
    cpu.decode_attention(out, q, rows, torch.tensor(tables), torch.tensor(lens), kc, vc, 0.125, window, softcap)
    assert torch.equal(out[0], torch.full((h, d), 7.0)) and torch.equal(out[3], torch.full((h, d), 7.0))
    for i, (n, k, v) in enumerate(zip(lens, keys, vals)):
        kk, vv = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)   # [n, H, D]
        s = torch.einsum("hd,nhd->hn", q[rows[i]], kk) * 0.125
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if window and n > window:
            s[:, :n - window] = float("-inf")
        expect = torch.einsum("hn,nhd->hd", s.softmax(-1), vv)
        torch.testing.assert_close(out[rows[i]], expect, rtol=1e-5, atol=1e-5)


def test_one_openmp_runtime():
    """The kernels' OpenMP resolves to the libgomp torch loaded: one thread team, not two.

    (Wheels such as sentencepiece carry private, renamed copies; those are not counted.)"""
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "/libgomp.so" in line}
    assert len(gomp) == 1, gomp


@pytest.mark.parametrize("n,k", [(960, 576), (37, 100), (5, 3)])
def test_gemv_matches_linear(n, k):
    g = torch.Generator().manual_seed(n)
    x, w, b = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(cpu.gemv(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cpu.gemv(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)

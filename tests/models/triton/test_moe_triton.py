"""The experts' GPU kernels (``models/moe_triton.py``, issue 40) through Triton's interpreter: the
grouping of (token, expert) pairs into one-expert tiles, and the fused experts equal to
``transformers``' own per-expert forward on the same module (Qwen3-MoE's concatenated layout,
gpt-oss's transposed interleaved one with biases and its clamped SwiGLU), for decode-sized and
prefill-sized batches, with pairs routed to another expert-parallel rank left out."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedllm.models import moe, moe_triton  # noqa: E402


def test_align_puts_every_pair_once_in_a_tile_of_its_expert():
    torch.manual_seed(0)
    num_experts, bm = 7, moe_triton.BLOCK_M
    for t, k in ((1, 2), (9, 3), (40, 4)):
        ids = torch.randint(-1, num_experts + 2, (t, k))  # -1 and >= E: another rank's experts
        sorted_pair, block_expert = moe_triton.align(ids, num_experts)
        flat = ids.reshape(-1)
        want = sorted(i for i in range(t * k) if 0 <= flat[i] < num_experts)
        got = sorted_pair[sorted_pair < t * k].tolist()
        assert sorted(got) == want
        for row, pair in enumerate(sorted_pair.tolist()):
            if pair < t * k:
                assert int(block_expert[row // bm]) == int(flat[pair])
        used = block_expert[block_expert >= 0]
        assert used.tolist() == sorted(used.tolist())  # tiles in expert order, the rest marked -1


def _module(kind: str):
    torch.manual_seed(1)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
        m = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=40, num_experts=6))
    else:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
        m = GptOssExperts(GptOssConfig(hidden_size=48, intermediate_size=40, num_local_experts=6))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    return m.eval()


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_triton_experts_equal_the_modules_own_forward(kind):
    m = _module(kind)
    spec = moe.device_experts(m)
    assert spec is not None and spec.interleaved == (kind == "gpt_oss")
    eager = type(m).forward.__wrapped__
    for t, k in ((1, 2), (3, 2), (37, 3)):  # decode, a batch, a prefill chunk (an expert past 16 rows)
        x = torch.randn(t, 48)
        ids = torch.stack([torch.randperm(6)[:k] for _ in range(t)])
        w = torch.rand(t, k)
        with torch.no_grad():
            want = eager(m, x, ids, w)
            got = moe_triton.experts(spec, x, ids, w)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        mine = ids < 3  # experts 3..5 on another expert-parallel rank: their pairs add nothing here
        with torch.no_grad():
            want = eager(m, x, torch.where(mine, ids, 0), torch.where(mine, w, 0.0))
            got = moe_triton.experts(spec, x, torch.where(mine, ids, 6), w)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_triton_experts_half_precision_inputs():
    m = _module("qwen3_moe")
    spec32 = moe.device_experts(m)
    half = moe.DeviceExperts(spec32.gate_up.half(), spec32.down.half(), None, None, False, False, "silu")
    x, ids, w = torch.randn(5, 48), torch.tensor([[0, 1]] * 5), torch.rand(5, 2)
    got = moe_triton.experts(half, x.half(), ids, w.half())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), moe_triton.experts(spec32, x, ids, w), rtol=2e-2, atol=2e-3)

"""Packed GGUF weights (Q4_0, Q4_1, Q8_0) against ``gguf``'s dequantization and a float32 matmul,
on random blocks and on every layer of SmolLM2's file, on the -march=native and AVX2-only builds;
and the served model's greedy tokens with ``quantization="gguf"`` against ``"none"``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from pagedllm.kernels import cpu
from pagedllm.models.quant_linear import GGUFLinear, repack

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason="CPU kernels off (PAGEDLLM_CPU_KERNELS=0) or no C compiler")
FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


@pytest.fixture(autouse=True, params=["native", "avx2"])
def kernels(request, monkeypatch, tmp_path_factory):
    """As in test_cpu_kernels.py: both the native build and an AVX2-only one."""
    if request.param == "avx2":
        path = cpu.build(tmp_path_factory.getbasetemp(), arch=("-mavx2", "-mfma"))
        monkeypatch.setattr(cpu, "_lib", cpu.load(path))
    return request.param


def _check(lin: GGUFLinear, w: torch.Tensor, rows: tuple[int, ...] = (1, 2, 5, 16, 17, 40)) -> None:
    torch.manual_seed(0)
    assert torch.equal(lin.dequantize(), w)  # the unpacking is exact
    for m in rows:
        x = torch.randn(m, w.shape[1])
        ref = x.double() @ w.double().T
        if lin.bias is not None:
            ref += lin.bias.double()
        got = lin(x).double()
        # float32 rounding of a length-K dot product (a different summation order than BLAS)
        tol = 1e-5 * ref.abs().max().item() + 1e-6
        assert (got - ref).abs().max().item() <= tol, (lin.kind, m)


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 64), (130, 576), (33, 1536)])
def test_random_blocks(kind, n, k):
    rng = np.random.default_rng(n * k)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 2.0, (n, 1)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = quantize(w, qtype)
    ref = torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32).reshape(n, k))
    bias = torch.randn(n) if n % 2 else None
    _check(GGUFLinear(kind, repack(kind, raw, n, k), n, k, bias), ref)


def test_every_layer_of_smollm2(smollm2_dir):
    from pagedllm.models.quant_linear import gguf_source
    src = gguf_source(smollm2_dir)
    assert src is not None, "the converted SmolLM2 directory records its GGUF"
    seen = set()
    for t in GGUFReader(str(src)).tensors:
        kind = t.tensor_type.name
        if kind not in FORMATS:
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        ref = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(n, k))
        _check(GGUFLinear(kind, repack(kind, t.data, n, k), n, k), ref, rows=(1, 3) if n > 10000 else (1, 3, 20))
        seen.add(kind)
    assert seen == {"Q4_1", "Q8_0"}


def test_repack_rejects_a_wrong_size():
    with pytest.raises(ValueError):
        repack("Q4_1", np.zeros(100, np.uint8), 2, 64)


def test_served_greedy_tokens_equal_the_dequantized_model(kernels):
    """``quantization="gguf"`` (packed blocks, float32 activations) gives the greedy tokens of
    ``"none"`` (the float32 reference) on the golden-style prompts."""
    if kernels != "native":
        pytest.skip("the engine loads the native build")
    from pagedllm import LLM, SamplingParams
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    packed = LLM(quantization="gguf", num_kv_blocks=64)
    assert packed.llm_engine.runner.model.quantization == {"Q4_1": 120, "Q8_0": 1}
    assert packed.llm_engine.get_stats().weight_formats == {"Q4_1": 120, "Q8_0": 1}  # /stats shows it
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params, use_tqdm=False)]
    del packed
    ref = LLM(quantization="none", num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert got == want

"""Prefill-sized products padded to a few row counts (``cpu_linear.row_bucket``, issue 35: oneDNN
caches one primitive per input shape, and every prefill length made a new one): the buckets, and
padded products equal to the unpadded ones within float rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.models.cpu_linear import EXACT_ROWS, PackedLinear, pad_rows, prepack_available, row_bucket


def test_buckets_are_few_and_waste_at_most_an_eighth():
    assert [row_bucket(r) for r in (1, 17, EXACT_ROWS)] == [1, 17, EXACT_ROWS]
    assert [row_bucket(r) for r in (129, 144, 145, 255, 256, 257, 1000, 2048)] == [144, 144, 160, 256, 256, 288, 1024, 2048]
    sizes = {row_bucket(r) for r in range(EXACT_ROWS + 1, 8193)}
    assert len(sizes) == 48  # 8 per power of two from 128 to 8192
    assert all(r <= row_bucket(r) <= r * 9 / 8 for r in range(1, 8193))


def test_pad_rows_appends_zero_rows():
    x = torch.randn(130, 8)
    p = pad_rows(x)
    assert p.shape == (144, 8) and torch.equal(p[:130], x) and not p[130:].any()
    y = torch.randn(64, 8)
    assert pad_rows(y) is y


@pytest.mark.skipif(not prepack_available(torch.device("cpu"), torch.float32), reason="oneDNN not built in")
@pytest.mark.parametrize("rows", [3, 129, 200, 777])
def test_packed_linear_padded_equals_f_linear(rows):
    torch.manual_seed(rows)
    w, b = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(rows, 64)
    got = PackedLinear(w, b)(x)
    ref = F.linear(x.double(), w.double(), b.double())
    assert got.shape == (rows, 96)
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_gguf_linear_padded_prefill_equals_the_dequantized_product():
    from pagedllm.kernels import cpu
    if not cpu.available():
        pytest.skip("CPU kernels off")
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from pagedllm.models.gguf_blocks import repack
    from pagedllm.models.quant_linear import GGUFLinear
    rng = np.random.default_rng(0)
    raw = quantize(rng.standard_normal((48, 256)).astype(np.float32), GGMLQuantizationType.Q4_0)
    lin = GGUFLinear(*repack("Q4_0", raw, 48, 256), 48, 256, None, "Q4_0")
    w = torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType.Q4_0), dtype=np.float32).reshape(48, 256))
    x = torch.randn(300, 256)  # pads to 320 rows on the dequantized path (float32 activations: conftest)
    ref = x.double() @ w.double().T
    got = lin(x)
    assert got.shape == (300, 48)
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()

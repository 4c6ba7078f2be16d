"""Packed GGUF weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
MXFP4, F16, BF16) and int8 per channel
against ``gguf``'s dequantization and a float32 matmul, on random blocks and on every layer of
the three real models' files, on every instruction-set build this CPU runs (float32 activations,
and int8 ones on ``avx2`` and above); and the served model's greedy tokens with
``quantization="gguf"`` against ``"none"``, and its logprobs with int8 activations against float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from pagedllm.kernels import cpu
from pagedllm.models.gguf_blocks import _BLOCK, quantize_int8, repack
from pagedllm.models.packed_linears import MinsLinear, packed_linear
from pagedllm.models.quant_linear import GGUFLinear

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason="CPU kernels off (PAGEDLLM_CPU_KERNELS=0) or no C compiler")
SIZES = _BLOCK | {"Q2_K": (256, 84), "F16": (1, 2), "BF16": (1, 2)}  # weights, bytes per block
FORMATS = list(SIZES)  # every GGUF format served packed
INT8_FORMATS = [f for f in FORMATS if f not in ("F16", "BF16")]  # 16-bit weights: float32 activations


BEST = cpu.isa()  # the build the engine loads


@pytest.fixture(autouse=True)
def kernels(isa_build):
    """As in test_cpu_kernels.py: every build this CPU runs (tests/kernels/conftest.py)."""
    return isa_build


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


def _linear(kind: str, raw, n: int, k: int, bias=None) -> GGUFLinear:
    layout, packed = repack(kind, raw, n, k)
    return packed_linear(layout, packed, n, k, bias, kind)


def _random_blocks(kind: str, n: int, k: int, rng) -> np.ndarray:
    """GGUF bytes of an [n, k] tensor: gguf's quantizer where it has one, else random blocks with
    small fp16 super-scales (the K-quants: gguf-py only dequantizes them)."""
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 2.0, (n, 1)).astype(np.float32)
    try:
        return quantize(w, GGMLQuantizationType[kind])
    except NotImplementedError:
        bw, bb = SIZES[kind]
        raw = rng.integers(0, 256, (n * (k // bw), bb), dtype=np.uint8)
        scales = rng.uniform(0.001, 0.05, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
        if kind == "Q6_K":
            raw[:, 208:210] = scales[:, 0:2]
        elif kind == "Q3_K":
            raw[:, 108:110] = scales[:, 0:2]
        elif kind == "Q2_K":
            raw[:, 80:84] = scales
        else:
            raw[:, 0:4] = scales
        return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("n,k", [(1, 256), (7, 512), (130, 768), (33, 1536)])
def test_random_blocks(kind, n, k):
    rng = np.random.default_rng(n * k)
    raw = _random_blocks(kind, n, k, rng)
    ref = torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(n, k))
    bias = torch.randn(n) if n % 2 else None
    _check(_linear(kind, raw, n, k, bias), ref)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_single_block_rows(kind):
    """k = 32: one block per row (the 32-weight formats)."""
    raw = _random_blocks(kind, 5, 32, np.random.default_rng(1))
    ref = torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(5, 32))
    _check(_linear(kind, raw, 5, 32), ref)


def test_int8_per_channel():
    """``quantization="int8"``: symmetric per-row scales; the kernels multiply exactly that weight, and
    it is within half a step of the float weight."""
    torch.manual_seed(0)
    w = torch.randn(70, 576) * torch.rand(70, 1)
    p = quantize_int8(w)
    lin = GGUFLinear("S8", p, 70, 576, kind="int8")
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((lin.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    _check(lin, p["qs"].float() * p["d"][:, :1])
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int8(torch.randn(4, 33))


def _every_layer(model_dir, want: set[str]) -> None:
    from pagedllm.models.quant_linear import gguf_source
    src = gguf_source(model_dir)
    assert src is not None, "the converted directory records its GGUF"
    seen = set()
    for t in GGUFReader(str(src)).tensors:
        kind = t.tensor_type.name
        if kind not in FORMATS or len(t.shape) != 2:
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        if n > 10000:  # embedding tables: the first 4096 rows (the kernels treat rows alike)
            rows = 4096
            raw = np.asarray(t.data).reshape(n, -1)[:rows]
            n = rows
        else:
            raw = t.data
        ref = torch.from_numpy(np.array(dequantize(raw, t.tensor_type), dtype=np.float32).reshape(n, k))
        _check(_linear(kind, raw, n, k), ref, rows=(1, 3, 20))
        seen.add(kind)
    assert seen == want


def _converted(alias: str):
    from pagedllm.models.loader import ModelNotFoundError
    from pagedllm.models.resolve import resolve_model
    try:
        return resolve_model(alias)
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("alias,want", [
    (None, {"Q4_1", "Q8_0"}),  # SmolLM2
    ("qwen2.5-coder-0.5b-instruct", {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}),  # Q4_K_M
    ("gemma-3-270m", {"Q4_K", "Q5_0", "Q6_K", "Q8_0"})])
def test_every_layer_of_the_real_models(kernels, alias, want):
    if kernels != BEST:
        pytest.skip("the random-block tests cover the lower builds; the real layers run once")
    _every_layer(_converted(alias), want)


def test_repack_rejects_a_wrong_size():
    with pytest.raises(ValueError):
        repack("Q4_1", np.zeros(100, np.uint8), 2, 64)
    with pytest.raises(ValueError, match="not served packed"):
        repack("IQ2_XS", np.zeros(100, np.uint8), 2, 64)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
QWEN = "qwen2.5-coder-0.5b-instruct"
Q4_K_M_LAYERS = {"Q5_0+Q8_0": 12, "Q5_0": 60, "Q6_K": 12, "Q4_K": 12, "Q8_0": 1}
# the same file through the Transformers backend: one packed layer per projection (q, k, v apart)
Q4_K_M_BACKEND = {"Q5_0": 133, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12}


@pytest.mark.parametrize("alias,formats,impl", [(None, {"Q4_1": 120, "Q8_0": 1}, "auto"),
                                                (QWEN, Q4_K_M_LAYERS, "auto"), (QWEN, Q4_K_M_BACKEND, "transformers")])
def test_served_greedy_tokens_equal_the_dequantized_model(kernels, alias, formats, impl):
    """``quantization="auto"`` (the default: a GGUF's blocks served packed, float32 activations) gives
    the greedy tokens of ``"none"`` (the float32 reference) on the golden-style prompts, natively and
    (Qwen2.5-Coder) through the Transformers backend (its batch-1 steps on the C decode stack)."""
    if kernels != BEST:
        pytest.skip("the engine loads the default build")
    from pagedllm import LLM, SamplingParams
    model = None if alias is None else str(_converted(alias))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    packed = LLM(model, num_kv_blocks=64, model_impl=impl)
    assert packed.llm_engine.runner.model.quantization_method == "gguf"
    assert packed.llm_engine.runner.model.quantization == formats
    assert packed.llm_engine.get_stats().weight_formats == formats  # /stats shows it
    kernels_used = packed.llm_engine.get_stats().weight_kernels
    assert "float32 activations" in kernels_used and BEST in kernels_used  # the suite turns int8 off
    got = [o.outputs[0].token_ids for o in packed.generate(PROMPTS, params, use_tqdm=False)]
    if impl == "transformers":  # batch-1 steps of the reference below too: the C stack on float32 weights
        assert packed.llm_engine.runner.model.decode_stack is not None
        got += [o.outputs[0].token_ids for o in packed.generate(PROMPTS[:1], params, use_tqdm=False)]
    del packed
    ref = LLM(model, quantization="none", num_kv_blocks=64, model_impl=impl)
    assert ref.llm_engine.get_stats().weight_formats == {}
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    if impl == "transformers":
        want += [o.outputs[0].token_ids for o in ref.generate(PROMPTS[:1], params, use_tqdm=False)]
    assert got == want


TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, presses "
        "in more than two hundred European cities had printed millions of books, and the price of a book "
        "fell so far that ordinary merchants could own a small library. Scholars could compare identical "
        "copies of a text for the first time, which changed how knowledge was checked and shared.")


def _perplexity(llm) -> float:
    from pagedllm import SamplingParams
    out = llm.generate(TEXT, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    lps = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    return float(np.exp(-np.mean(lps)))


def test_int8_weights_keep_the_perplexity(kernels):
    """``quantization="int8"`` on Qwen2.5-Coder (its float32 dequantization quantized again per output
    channel): perplexity on a fixed text within 1% of float32 (measured: 48.47 vs 48.34)."""
    if kernels != BEST:
        pytest.skip("the engine loads the default build")
    from pagedllm import LLM
    model = str(_converted(QWEN))
    q = LLM(model, quantization="int8", num_kv_blocks=16)
    assert q.llm_engine.get_stats().weight_formats == {"int8": 97}
    got = _perplexity(q)
    del q
    ref = _perplexity(LLM(model, quantization="none", num_kv_blocks=16))
    assert abs(got / ref - 1) < 0.01, (got, ref)


def test_transformers_backend_serves_smollm2_packed_as_native(smollm2_dir, kernels):
    """SmolLM2's GGUF (Llama: q/k rows permuted in the file) through the Transformers backend keeps
    the same blocks packed as the native path (issue 39) and scores text as it does: teacher-forced
    logprobs within 1e-3 (float32 activations; attention and norms differ in rounding only)."""
    if kernels != BEST:
        pytest.skip("the engine loads the default build")
    from pagedllm import LLM, SamplingParams
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def scored(llm):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return np.array([next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]])
    native = LLM(str(smollm2_dir), num_kv_blocks=64)
    assert native.llm_engine.get_stats().weight_formats == {"Q4_1": 120, "Q8_0": 1}  # qkv and gate_up fused
    want = scored(native)
    del native
    llm = LLM(str(smollm2_dir), model_impl="transformers", num_kv_blocks=64)
    assert llm.llm_engine.get_stats().weight_formats == {"Q4_1": 210, "Q8_0": 1}  # 30 x 7 linears, the table
    assert np.abs(scored(llm) - want).max() < 1e-3


def test_bfloat16_prefill_path_is_close(monkeypatch):
    """The prefill path that AMX machines take (bfloat16 products), forced here: within bfloat16
    rounding of the float32 product; decode-sized inputs stay float32 and exact."""
    monkeypatch.setenv("PAGEDLLM_PREFILL_BF16", "1")
    raw = _random_blocks("Q4_K", 64, 512, np.random.default_rng(3))
    lin = _linear("Q4_K", raw, 64, 512, torch.randn(64))
    assert lin.prefill_dtype == torch.bfloat16
    x = torch.randn(40, 512)
    ref = x @ lin.dequantize().T + lin.bias
    got = lin(x)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
    assert (lin(x[:3]) - ref[:3]).abs().max() <= 1e-5 * ref.abs().max() + 1e-6


@pytest.fixture
def int8_activations(kernels):
    """The int8-activation path on (the suite runs with it off, see conftest), on every build that has
    it (``avx2`` and above); yields the build's name."""
    if cpu._lib.pl_isa() == 0:
        pytest.skip("the generic build has no int8-activation kernels")
    cpu.set_int8_activations(True)
    cpu.set_one_level(False)  # two levels at every size; the one-level tests turn it on
    yield kernels
    cpu.set_one_level(True)
    cpu.set_int8_activations(False)


@pytest.fixture
def int8_engine(int8_activations):
    """int8 activations on the default build only (the engine tests load the default build)."""
    if int8_activations != BEST:
        pytest.skip("the engine loads the default build")


def _one_level(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-block ``q = round(x * 127 / max|x|)`` and the step ``max|x| / 127``, as the kernel rounds."""
    amax = np.abs(xb).max(1)
    scale = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.rint(xb * scale[:, None]), (amax / np.float32(127)).astype(np.float32)


def _quantized_row(x: np.ndarray, levels: int = 2) -> np.ndarray:
    """The kernel's int8 activations (every build's), dequantized: each 32-block's int8 level ``q``
    with step ``dx``, plus (``levels=2``, what the kernel does) its rounding residual in int8 at the
    fixed step ``dx / 256`` (the residual is at most half a step; clamped to [-128, 127])."""
    xb = x.reshape(-1, 32).astype(np.float32)
    q, dx = _one_level(xb)
    first = (q * dx[:, None]).astype(np.float32)
    if levels == 1:
        return first.reshape(-1)
    res = (xb - first).astype(np.float32)
    inv = np.where(dx > 0, np.float32(256) / np.where(dx > 0, dx, 1), 0).astype(np.float32)
    q2 = np.clip(np.rint(res * inv[:, None]), -128, 127)
    return ((q + q2 / 256) * dx[:, None]).reshape(-1)


def test_int8_activations_keep_the_logprobs_of_the_readme_example(int8_engine):
    """The README's chat example sits at a near tie (float32: "The" -1.883, "L" -1.965): one int8
    level per block moved the logprobs by ~0.1 and flipped its answer; two levels keep the top
    logprobs within 0.01 of float32 and the answer ("The capital of France is Paris.")."""
    from pagedllm import LLM, SamplingParams
    cpu.set_one_level(True)  # the default: its 37-token prompt stays under ONE_LEVEL_ROWS, two levels
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    p = SamplingParams(temperature=0, max_tokens=8, logprobs=3)

    def run():
        out = LLM(num_kv_blocks=32).chat(msgs, p, use_tqdm=False)[0].outputs[0]
        return out.text, {t: v.logprob for t, v in out.logprobs[0].items()}
    text, lps = run()
    cpu.set_int8_activations(False)
    ref_text, ref = run()
    assert text == ref_text and text.startswith("The capital of France is Paris")
    for t in set(lps) & set(ref):
        assert abs(lps[t] - ref[t]) < 0.01, (t, lps[t], ref[t])


@pytest.mark.parametrize("kind", INT8_FORMATS)
def test_int8_activation_products(int8_activations, kind):
    """Products with int8 activations (every build that has them) equal the exact product of the dequantized weight with
    the per-block two-level int8 quantization of each input row, up to float32 rounding, for 1 row (decode),
    3 and 16 (batches, speculative verification) and 40 (prefill)."""
    rng = np.random.default_rng(5)
    n, k = 37, 768
    lin = _linear(kind, _random_blocks(kind, n, k, rng), n, k, torch.randn(n))
    w = lin.dequantize().double()
    for rows in (1, 3, 16, 40):
        for scale in (1.0, 1e-3, 50.0):
            x = torch.randn(rows, k) * scale
            x[0, :32] = 0  # an all-zero block
            ref = _quantized(x) @ w.T + lin.bias.double()
            if isinstance(lin, MinsLinear):  # the group sums go through their own int8 product
                ref = (_quantized(x) @ lin.quants.dequantize().double().T + lin.bias.double()
                       + _quantized(F.pad(x.view(rows, -1, 16).sum(-1), (0, lin.mins.in_features - k // 16)))
                       @ lin.mins.dequantize().double().T)
            got = lin(x).double()
            assert (got - ref).abs().max() <= 2e-5 * ref.abs().max() + 1e-6, (kind, rows, scale)


@pytest.mark.parametrize("layout,q", [("U4M", 15), ("S8", -128), ("S8", 127), ("S6", -32), ("S8H", -32),
                                       ("U6H", -32), ("U6H", 31),
                                       ("S8M", 31), ("IQ4", 0), ("IQ4", 15), ("E2M1", 7), ("E2M1", 15)])
def test_int8_activations_at_the_extremes_stay_exact(int8_activations, layout, q):
    """Every weight at its format's extreme quant and every activation at +-127 (the first level) or
    with the residual at its extreme: the AVX2 kernels' int16 partial sums (vpmaddubsw saturates)
    and int16 activations (256 q1 + q2) must not overflow; results equal the exact product."""
    n, k = 16, 256
    group = 16 if layout in ("S8H", "U6H") else 32
    nibbles = layout in ("U4M", "IQ4", "E2M1")  # the codebooks' q: an index (IQ4 0: -127, E2M1 15: -12)
    qs = torch.full((n, k // 2), q | q << 4, dtype=torch.uint8) if nibbles else torch.full((n, k), q, dtype=torch.int8)
    packed = {"qs": qs, "d": torch.full((n, k // group), 0.5)}
    if layout in ("U4M", "S8M"):
        packed["m"] = torch.full((n, k // 32), -0.25)
    if layout == "U6H" and not cpu.six_bit_tiles():
        pytest.skip(f"the {int8_activations} build keeps Q6_K as S8H")
    if layout == "U6H":  # Q6_K's int8 group scales at their extreme, times the super-block's d
        sc = -128 if q > 0 else 127
        packed.update(d=torch.full((n, k // 16), 0.5 * sc), sc=torch.full((n, k // 16), sc, dtype=torch.int8),
                      dsup=torch.full((n, k // 256), 0.5))
    lin = GGUFLinear("S8H" if layout == "U6H" else layout, packed, n, k)
    assert layout != "U6H" or lin.fmt == cpu.QUANT_LAYOUTS["U6H"]
    w = lin.dequantize().double()
    sign = 1.0 if w[0, 0] > 0 else -1.0
    x = torch.full((3, k), sign)  # q1 = +-127 everywhere, with the weights' sign: the largest sums
    x[1] = sign * (1 + 0.5 / 127 * torch.arange(k).remainder(2))  # residuals near half a step
    x[2] = -x[1]
    xq = torch.from_numpy(np.stack([_quantized_row(r) for r in x.numpy()])).double()
    ref = xq @ w.T
    assert (lin(x).double() - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_int8_activations_leave_long_inputs_to_the_dequantized_product(int8_activations):
    """Past ``int8_max_rows`` (128 rows on AVX2 and AVX-VNNI, where longer prefill chunks multiply
    faster dequantized than in two levels) a product with one level off (``PAGEDLLM_INT8_ONE_LEVEL=0``)
    is the float32 one: the dequantized weight's up to rounding."""
    rows = cpu.int8_max_rows() + 1
    if rows > 4096:
        pytest.skip("this build multiplies every row with int8 activations")
    lin = _linear("Q4_K", _random_blocks("Q4_K", 40, 256, np.random.default_rng(2)), 40, 256, None)
    x = torch.randn(rows, 256)
    ref = x.double() @ lin.dequantize().double().T
    assert (lin(x).double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("kind", INT8_FORMATS)
def test_one_level_products_from_64_rows(int8_activations, kind):
    """On AVX2 and AVX-VNNI a product of ``ONE_LEVEL_ROWS`` (64) rows or more (prefill) quantizes its
    rows in one int8 level (issue 40: half the byte products): it equals the exact product of the
    dequantized weight with each row's one-level quantization, up to float32 rounding, at 64 and
    200 rows (past ``int8_max_rows``: no dequantized product any more); 63 rows keep two levels."""
    cpu.set_one_level(True)
    if cpu.isa() not in cpu.ONE_LEVEL_ISAS:
        pytest.skip(f"the {cpu.isa()} build keeps two levels at every size")
    rng = np.random.default_rng(9)
    n, k = 37, 512
    lin = _linear(kind, _random_blocks(kind, n, k, rng), n, k, torch.randn(n))
    w = lin.dequantize().double()
    for rows, levels in ((63, 2), (64, 1), (200, 1)):
        x = torch.randn(rows, k)
        x[1, 40] = 300.0  # an outlier block: one level rounds its other values to about zero
        xq = torch.from_numpy(np.stack([_quantized_row(r, levels) for r in x.numpy()])).double()
        ref = xq @ w.T + lin.bias.double()
        if isinstance(lin, MinsLinear):  # the group sums' own product, in the same levels
            sums = F.pad(x.view(rows, -1, 16).sum(-1), (0, lin.mins.in_features - k // 16))
            sq = torch.from_numpy(np.stack([_quantized_row(r, levels) for r in sums.numpy()])).double()
            ref = xq @ lin.quants.dequantize().double().T + lin.bias.double() + sq @ lin.mins.dequantize().double().T
        got = lin(x).double()
        assert (got - ref).abs().max() <= 2e-5 * ref.abs().max() + 1e-6, (kind, rows)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K", "Q5_K"])
def test_int8_activation_rows_do_not_depend_on_the_batch(int8_activations, kind):
    """Every row goes through the same integer dot products and the same float32 order of
    accumulation whatever the batch holds: a row's output is bitwise the same alone, in a batch of
    5, 16 or 64 (so greedy tokens do not change with batching or prefix-cache hits)."""
    rng = np.random.default_rng(7)
    n, k = 50, 512
    lin = _linear(kind, _random_blocks(kind, n, k, rng), n, k, torch.randn(n))
    x = torch.randn(64, k)
    x[3, 100] = 300.0  # an outlier block (its second level) too
    alone = torch.cat([lin(x[i:i + 1]) for i in range(64)])
    for rows in (5, 16, 64):
        assert torch.equal(lin(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K"])
def test_int8_activations_keep_the_small_values_beside_an_outlier(int8_activations, kind):
    """An MLP intermediate row with one channel hundreds of times the rest (SmolLM2 has them): the
    block's second int8 level (its rounding residual) keeps the block's other 31 values. The product
    stays within 1e-3 of the exact float product; one level alone (which rounds those 31 values to
    about zero) is off by more than 10x that, checked against the one-level model."""
    rng = np.random.default_rng(11)
    n, k = 64, 1536
    lin = _linear(kind, _random_blocks(kind, n, k, rng), n, k, None)
    w = lin.dequantize().double()
    x = torch.randn(1, k)
    x[0, 70] = 400.0  # block 2's max
    exact = w @ x[0].double()
    one_level = w @ torch.from_numpy(_quantized_row(x[0].numpy(), levels=1)).double()
    got = lin(x)[0].double()
    err, err_one = (got - exact).abs().max(), (one_level - exact).abs().max()
    assert err <= 1e-3 * exact.abs().max(), (err, exact.abs().max())
    assert err_one > 10 * err


def _quantized(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` as the int8-activation kernels quantize them (float64)."""
    return torch.from_numpy(np.stack([_quantized_row(r) for r in x.numpy()])).double()


def _token_logprobs(llm, seqs: list[list[int]]) -> np.ndarray:
    """Every token's logprob after the first, teacher-forced (prompt logprobs), over ``seqs``."""
    from pagedllm import SamplingParams
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return np.array([next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]])


def test_int8_activations_keep_the_perplexity_and_the_logprobs(int8_engine):
    """SmolLM2 (Q4_1, Q8_0) with int8 activations in every product (the default where the build has
    them), prefill and batch-1 decode products alike: perplexity on a fixed text within 1% of
    float32 (measured on AVX-512 VNNI 26.5597 vs 26.5607 with each block's second level; one level
    gave 26.72), and the golden-style prompts with float32's greedy continuations, scored token by
    token: logprobs within 0.005 of float32, 0.0005 on average (measured on AVX2: at most 0.0024,
    0.00018 on average; Qwen2.5-Coder Q4_K_M: 0.00037 and 0.00005)."""
    from pagedllm import LLM, SamplingParams
    q = LLM(num_kv_blocks=64, enable_prefix_caching=False)
    cpu.set_int8_activations(False)
    ref_llm = LLM(quantization="none", num_kv_blocks=64, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in ref_llm.generate(PROMPTS, params, use_tqdm=False)]
    ref, ref_lp = _perplexity(ref_llm), _token_logprobs(ref_llm, seqs)
    del ref_llm
    cpu.set_int8_activations(True)
    cpu.set_one_level(False)
    got, lp = _perplexity(q), _token_logprobs(q, seqs)
    assert got != ref and abs(got / ref - 1) < 0.01, (got, ref)
    diff = np.abs(lp - ref_lp)
    assert diff.max() < 0.005 and diff.mean() < 0.0005, (diff.max(), diff.mean())
    cpu.set_one_level(True)  # one level for the text's prefill (AVX2, AVX-VNNI): within 1% too
    one = _perplexity(q)
    print(f"perplexity: float32 {ref:.4f}, two levels {got:.4f}, one level from 64 rows {one:.4f}")
    assert abs(one / ref - 1) < 0.01, (one, ref)

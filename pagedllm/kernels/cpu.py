"""Fused float32 CPU kernels (``cpu_kernels.c``) and the packed-weight kernels (``quant_*.c``), built
at first use and called through ctypes.

The C sources are compiled (``cpu_build.py``) with the system C compiler (``$CC``, else ``cc``) once per instruction
set (``ISA_FLAGS``: ``generic``, ``avx2``, ``avxvnni``, ``avx512vnni``; issue 37), each with its
own explicit target flags rather than ``-march=native``, into
``<cache>/kernels/cpu_kernels-<isa>-<hash>.so``; the hash covers the sources, the flags and the
compiler's version. Which build a process loads is decided at run time
(``cpu_features.select_isa``: the CPU's cpuid and the OS's XSAVE state, lowered by
``PAGEDLLM_CPU_ISA``), so a cache directory shared between machines never hands one a build its
CPU cannot run. The library's OpenMP calls resolve to the ``libgomp.so.1`` torch has already
loaded, so kernels and torch ops share one thread team.

Without a compiler, or with ``PAGEDLLM_CPU_KERNELS=0``, ``available()`` is False
and callers keep their torch code paths. Every op here requires float32 CPU
tensors; callers decide once, at construction, with ``applies(device, dtype)``
(the attention backend, the norm, rotary and activation layers, the linears).

Results differ from the torch ops they replace by float rounding only
(different summation order; ``exp`` through a polynomial with relative error
below 2e-7).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

import pagedllm.envs as envs
from pagedllm.kernels.cpu_features import prefill_dtype
from pagedllm.kernels.cpu_build import ISA_DOT, ISA_FLAGS, ISAS, _cpu_flags, _x86, build, compile_library  # noqa: F401

logger = logging.getLogger(__name__)

_P, _L, _F, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "pl_rms_norm": [_P, _P, _P, _P, _L, _L, _F, _I],
    "pl_rope": [_P, _L, _L, _P, _P, _P, _L, _L, _I],
    "pl_write_kv": [_P, _L, _L, _P, _L, _L, _P, _P, _P, _L, _L, _L, _L],
    "pl_silu_mul": [_P, _P, _L, _L, _I],
    "pl_gemv": [_P, _P, _P, _P, _L, _L, _I],
    "pl_moe_experts": [_L, _L, _P, _P, _P, _P, _L, _L, _P, _L, _I, _I, _I],
    "pl_gemm16": [_P, _L, _P, _I, _P, _P, _L, _L, _I],
    "pl_decode_stack": [_L, _L, _P, _P, _P, _L, _L, _L, _L, _L, _F, _P, _P, _L, _L, _P, _L, _F, _I, _F, _I],
    "pl_decode_attention": [_P, _L, _L, _P, _P, _L, _P, _P, _P, _L, _L, _L, _L, _L, _L, _F, _L, _F, _P, _P, _I],
    "pl_apply_bitmask": [_P, _L, _P, _L, _P, _L, _L, _I],
    "pl_qgemm": [_I, _P, _L, _P, _P, _P, _P, _P, _L, _L, _I],
    "pl_qdequant": [_I, _P, _P, _P, _P, _L, _L, _I],
    "pl_qdequant_rows": [_I, _P, _P, _P, _P, _L, _P, _L, _I],
    "pl_set_int8_activations": [_I],
    "pl_isa": [],
    "pl_causal_conv": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _I, _I],
    "pl_ssd_scan": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _L, _L, _I],
}
_INT_RESULT = {"pl_decode_stack", "pl_isa", "pl_gemm16", "pl_moe_experts"}
QGEMM_MAX_ROWS = 16  # rows up to which float32 activations multiply packed tiles (more: dequantize, oneDNN)
# rows up to which int8 activations multiply packed tiles, per build (more: dequantize, oneDNN, as with
# float32 activations): on a Zen 3 (AVX2) the int8 tiles were 1.1-1.4x the dequantized product at
# 64 rows, even at 128 and 0.8-0.9x at 256-512 (SmolLM2's shapes, per-thread CPU time, 1 thread);
# AVX-VNNI is unmeasured and takes AVX2's; AVX-512 VNNI keeps every row (issue 18's measurements)
INT8_MAX_ROWS = {"avx2": 128, "avxvnni": 128, "avx512vnni": 1 << 62}
# where AMX makes the dequantized products bfloat16 (cpu_features.prefill_dtype) they win above about
# 256 rows even against AVX-512 VNNI: on a Sapphire Rapids (2 threads) the int8 tiles took 5.4 ms
# against 4.1 at 256 rows and 11.7 against 6.2 at 512 of a Q4_K 896 x 4864 product, SmolLM2's
# 512-token prefill ran 1,305 against 1,833 tokens/s (results/cpu_isa-2026-12-05-spr.json)
AMX_INT8_MAX_ROWS = 256
QUANT_LAYOUTS = {"U4M": 0, "S8": 1, "S6": 2, "S8H": 3, "S8M": 4, "IQ4": 5, "E2M1": 6, "U6H": 7,
                 "S8/f16": 9, "S6/f16": 10, "IQ4/f16": 13, "E2M1/f16": 14}  # pl_qgemm's tile layout codes (models/gguf_blocks.py)
QUANT_TILE = 16  # output rows per tile (quant_kernels.c QT)
_lib: ctypes.CDLL | None = None
_tried = False


def load(path: Path) -> ctypes.CDLL:
    """Load a built library and declare its functions' C signatures; int8 activations start on where
    the build has int8 kernels (``avx2`` and above) unless ``PAGEDLLM_INT8_ACTIVATIONS=0``.

    Raises:
        OSError: the file cannot be loaded.
    """
    lib = ctypes.CDLL(str(path))
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, (ctypes.c_int if name in _INT_RESULT else None)
    lib.pl_set_int8_activations(int(lib.pl_isa() > 0 and _int8_wanted()))
    return lib


def isa() -> str:
    """The instruction set of the loaded kernels (``ISAS``), or ``""`` when none are loaded."""
    return ISAS[_lib.pl_isa()] if available() else ""


def _int8_wanted() -> bool:
    """``PAGEDLLM_INT8_ACTIVATIONS``: ``0`` off, anything else (or unset) on where the build has int8 kernels."""
    return envs.PAGEDLLM_INT8_ACTIVATIONS


def int8_activations() -> bool:
    """True when products of packed weights quantize their input rows to int8 per 32-block, in two
    levels (the value and its rounding residual, about 15 bits), and use integer byte dot products
    (``ISA_DOT``): the loaded build is ``avx2`` or above and ``PAGEDLLM_INT8_ACTIVATIONS`` is not
    ``0``. On by default there.

    Every row of every product (decode, batches, speculative verification, prefill) then takes the
    same path, so a row's product does not depend on its batch; logprobs stay within about 0.001 of
    the dequantized model's on SmolLM2 (perplexity 26.5597 against 26.5607,
    tests/kernels/test_quant_kernels.py), not float32-exact. ``PAGEDLLM_INT8_ACTIVATIONS=0``
    keeps float32 activations: every path within float rounding of the dequantized model (greedy
    tokens equal ``--quantization none``; the test suite runs so)."""
    global _int8_cache
    if not available():
        return False
    if _int8_cache is None or _int8_cache[0] is not _lib:  # asked per product: computed once per library
        _int8_cache = (_lib, _lib.pl_isa() > 0 and _int8_wanted())
    return _int8_cache[1]


_int8_cache: tuple[ctypes.CDLL, bool] | None = None


def int8_max_rows() -> int:
    """Rows up to which a product of packed weights uses the int8-activation tiles when
    ``int8_activations()``; longer inputs (prefill chunks) multiply a float32 dequantization with
    oneDNN (``INT8_MAX_ROWS``, by the loaded build; at most ``AMX_INT8_MAX_ROWS`` where those
    products run in bfloat16 on AMX)."""
    global _max_rows_cache
    key = (_lib, envs.PAGEDLLM_PREFILL_BF16)
    if _max_rows_cache is None or _max_rows_cache[0] != key:  # asked per product: computed once
        rows = INT8_MAX_ROWS.get(isa(), 0)
        _max_rows_cache = (key, min(rows, AMX_INT8_MAX_ROWS) if prefill_dtype() == torch.bfloat16 else rows)
    return _max_rows_cache[1]


_max_rows_cache: tuple[tuple, int] | None = None

# From this many rows (a prefill chunk, a big verification batch; for a MoE layer, its tokens) the
# AVX2 and AVX-VNNI builds quantize activations in one level (quant_common.h Q_LV1: llama.cpp's
# precision, int8 per 32-block): half the byte products of two levels, which is what bounds prefill
# there (issue 40: Qwen3-30B-A3B's shapes at 512 tokens ran at 0.58x llama.cpp's pp512 on a Zen 3 in
# two levels); fewer rows keep two. AVX-512 VNNI keeps two levels at every size.
ONE_LEVEL_ROWS = 64
ONE_LEVEL_ISAS = ("avx2", "avxvnni")
Q_LV1 = 16  # OR-ed into a layout code: one-level activations (quant_common.h)


def one_level(rows: int) -> bool:
    """True when a packed product (or a MoE layer's experts) over ``rows`` input rows quantizes them
    in one int8 level (``ONE_LEVEL_ROWS``, ``ONE_LEVEL_ISAS``; ``PAGEDLLM_INT8_ONE_LEVEL=0`` never)."""
    global _one_level_cache
    if rows < ONE_LEVEL_ROWS:
        return False
    if _one_level_cache is None or _one_level_cache[0] is not _lib:  # computed once per library
        _one_level_cache = (_lib, int8_activations() and isa() in ONE_LEVEL_ISAS and envs.PAGEDLLM_INT8_ONE_LEVEL)
    return _one_level_cache[1]


def set_one_level(on: bool) -> None:
    """Allow or forbid one-level activations for this process (tests, benchmarks; see ``one_level``)."""
    global _one_level_cache
    envs.set_var("PAGEDLLM_INT8_ONE_LEVEL", "1" if on else "0")
    _one_level_cache = None


_one_level_cache: tuple[ctypes.CDLL, bool] | None = None


def six_bit_tiles() -> bool:
    """Whether Q6_K weights are tiled in 6 bits (``U6H``, 0.83 bytes per weight, the file's size)
    rather than one byte per weight (``S8H``, 1.25 with its float32 scales): every build but
    ``avx512vnni`` with int8 activations, which has no ``U6H`` kernel yet (its products would take the
    float32-activation path; ``quant_kernels.c``). Decode reads a Q4_K_M file's Q6_K LM head and
    layers in two thirds of the bytes."""
    return available() and not (isa() == "avx512vnni" and int8_activations())


def set_int8_activations(on: bool) -> None:
    """Turn the int8-activation path on or off for this process (tests; see ``int8_activations``)."""
    global _int8_cache, _one_level_cache
    envs.set_var("PAGEDLLM_INT8_ACTIVATIONS", "1" if on else "0")
    _int8_cache = _one_level_cache = None
    if available():
        _lib.pl_set_int8_activations(int(on))


def available() -> bool:
    """True when the kernels are enabled (``PAGEDLLM_CPU_KERNELS`` is not ``0``) and built.

    The first call reads the environment, builds and loads the library; a failure is
    logged once as a warning and leaves the torch paths in use. Later calls only return
    that answer (this is on the per-layer hot path).
    """
    global _lib, _tried
    if _tried:
        return _lib is not None
    _tried = True
    if envs.PAGEDLLM_CPU_KERNELS:
        from pagedllm.kernels.cpu_features import select_isa
        try:
            want, why = select_isa()
            _lib = load(build(isa=want))
            logger.info("CPU kernels: %s build (%s)", want, why)
        except (OSError, RuntimeError) as e:
            logger.warning("CPU kernels unavailable, using torch ops: %s", e)
    return _lib is not None


def applies(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True when a model of ``dtype`` on ``device`` runs these kernels: float32 on the CPU, and
    ``available()``. Asked once, when a model and its attention backend are built, never per op."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and available()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def apply_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to ``-inf``, in place, the logits of tokens a grammar's bitmask disallows.

    Args:
        logits: ``[N, V]`` float32, rows contiguous.
        rows: ``[R]`` int64 rows of ``logits`` to mask.
        bitmask: ``[R, W]`` int32, contiguous: bit ``t % 32`` of word ``t // 32`` allows token ``t``
            (llguidance's layout); tokens at or past ``32 * W`` are disallowed.
    """
    assert logits.stride(1) == 1 and bitmask.is_contiguous() and rows.dtype == torch.int64
    _lib.pl_apply_bitmask(logits.data_ptr(), logits.stride(0), rows.data_ptr(), rows.numel(), bitmask.data_ptr(),
                          bitmask.shape[1], logits.shape[1], torch.get_num_threads())


def qgemm(fmt: int, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
          bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x W^T (+ bias)`` with a packed GGUF weight in tiles (layouts in ``quant_kernels.c``).

    Args:
        fmt: ``QUANT_LAYOUTS`` code.
        x: ``[M, K]`` float32, contiguous, any ``M`` (float32 activations are meant for
            ``M <= QGEMM_MAX_ROWS``: past that, dequantizing and oneDNN is faster).
        qs: uint8 ``[ceil(N / 16), K / 32 * 256 or 512]``; d, m: float32 ``[ceil(N / 16), groups, 16]``
            scales and mins (``m`` only for ``U4M`` and ``S8M``); bias: ``[N]`` float32 or ``None``.
        n: output features ``N``.
    Returns:
        ``[M, N]`` float32; with int8 activations, in one level from ``ONE_LEVEL_ROWS`` rows
        (``one_level``), else two.
    """
    rows, k = x.shape
    y = torch.empty(rows, n, dtype=torch.float32)
    fmt = fmt | Q_LV1 if one_level(rows) else fmt
    _lib.pl_qgemm(fmt, x.data_ptr(), rows, qs.data_ptr(), d.data_ptr(), _ptr(m), _ptr(bias), y.data_ptr(), n, k,
                  torch.get_num_threads())
    return y


def gemm16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T (+ bias)`` for a 16-bit weight, exact in float32 (``pl_gemm16``).

    Args:
        x: ``[M, K]`` float32 contiguous (meant for ``M <= QGEMM_MAX_ROWS``).
        weight: ``[N, K]`` ``torch.float16`` or ``torch.bfloat16``, contiguous; bias: ``[N]`` float32 or ``None``.
    Returns:
        ``[M, N]`` float32.
    Raises:
        MemoryError: no row buffer could be allocated.
    """
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32)
    if _lib.pl_gemm16(x.data_ptr(), rows, weight.data_ptr(), int(weight.dtype == torch.bfloat16), _ptr(bias),
                      y.data_ptr(), n, k, torch.get_num_threads()) != 0:
        raise MemoryError("pl_gemm16: no row buffer")
    return y


def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: torch.Tensor,
                intermediate: int, activation: str = "silu") -> torch.Tensor:
    """A mixture-of-experts layer's experts in one C call (``pl_moe_experts``): for each token the
    weighted sum of its top-k experts' gated MLPs, each active expert's weights read once per 16 of
    its tokens.

    Args:
        x: ``[T, H]`` float32 contiguous hidden states.
        top_k_index: ``[T, k]`` int64 expert ids (ids outside ``0..E-1`` are skipped).
        top_k_weights: ``[T, k]`` float32 routing weights.
        experts: ``[E, 2, 5]`` int64 descriptors ``{fmt, weight, d, m, bias}`` (as ``stack_table``'s
            products) of each expert's fused gate|up ``[2I, H]`` and down ``[H, I]`` weights; the
            tensors they point to must stay alive.
        intermediate: ``I``; activation: ``STACK_ACTIVATIONS`` (of the gate half).
    Returns:
        ``[T, H]`` float32 (int8 activations in one level from ``ONE_LEVEL_ROWS`` tokens: ``one_level``).
    Raises:
        MemoryError: scratch memory could not be allocated.
    Source: transformers' ``Qwen3MoeExperts.forward`` (the same sum, in expert order).
    """
    rows, h = x.shape
    idx = top_k_index.to(torch.int64).contiguous()
    w = top_k_weights.to(torch.float32).contiguous()
    out = torch.empty(rows, h, dtype=torch.float32)
    if _lib.pl_moe_experts(rows, idx.shape[1] if idx.dim() > 1 else 1, idx.data_ptr(), w.data_ptr(), x.data_ptr(),
                           out.data_ptr(), h, intermediate, experts.data_ptr(), experts.shape[0],
                           STACK_ACTIVATIONS.index(activation), torch.get_num_threads(),
                           1 if one_level(rows) else 2) != 0:
        raise MemoryError("pl_moe_experts: no scratch memory")
    return out


def qdequant(fmt: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, n: int, k: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``n`` rows, ``[n, K]`` float32, of a tiled packed matrix (into ``out`` when given);
    ``qs``, ``d``, ``m`` as in ``qgemm``, from a tile boundary."""
    out = torch.empty(n, k, dtype=torch.float32) if out is None else out
    _lib.pl_qdequant(fmt, qs.data_ptr(), d.data_ptr(), _ptr(m), out.data_ptr(), n, k, torch.get_num_threads())
    return out


def qdequant_rows(fmt: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, rows: torch.Tensor,
                  k: int) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[R]``, each below the matrix's ``N``) of a tiled packed matrix as
    float32 ``[R, K]`` (an embedding lookup)."""
    rows = rows.to(torch.int64).contiguous()
    out = torch.empty(rows.numel(), k, dtype=torch.float32)
    _lib.pl_qdequant_rows(fmt, qs.data_ptr(), d.data_ptr(), _ptr(m), rows.data_ptr(), rows.numel(), out.data_ptr(),
                          k, torch.get_num_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) of ``x`` ``[T, H]``, or, with ``residual`` ``[T, H]``,
    of ``residual + x`` after adding ``x`` into ``residual`` in place. Returns a new ``[T, H]``.

    All tensors contiguous float32; ``weight`` ``[H]``.
    """
    t, h = x.shape
    out = torch.empty_like(x)
    _lib.pl_rms_norm(x.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(), t, h, eps,
                     torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate in place the first ``num_heads`` heads of every row of ``x`` ``[T, >= num_heads * head_dim]``
    (rows may be strided, columns contiguous) by the rotary tables ``cos``/``sin``
    ``[max_positions, head_dim]`` at ``positions`` ``[T]`` int64 (rotate-half convention)."""
    _lib.pl_rope(x.data_ptr(), x.stride(0), num_heads, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                 x.shape[0], head_dim, torch.get_num_threads())


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Copy ``key``/``value`` ``[T, KVH, D]`` (last dim contiguous) into caches
    ``[KVH, num_blocks, block_size, D]`` at ``slot_mapping`` ``[T]`` int64 (negative = skip)."""
    kvh, d = key.shape[1:]
    _lib.pl_write_kv(key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0),
                     value.stride(1), slot_mapping.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                     key.shape[0], kvh, d, key_cache.shape[1] * key_cache.shape[2])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(gate) * up`` for contiguous ``gate_up`` ``[T, 2I]``; returns ``[T, I]``."""
    t, two_i = gate_up.shape
    out = gate_up.new_empty(t, two_i // 2)
    _lib.pl_silu_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, torch.get_num_threads())
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for one row: ``x`` ``[1, K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` or ``None``,
    all contiguous float32; returns ``[1, N]``. Reads the weight once (memory-bound)."""
    n, k = weight.shape
    y = x.new_empty(1, n)
    _lib.pl_gemv(x.data_ptr(), weight.data_ptr(), _ptr(bias), y.data_ptr(), n, k, torch.get_num_threads())
    return y


def decode_attention(out: torch.Tensor, query: torch.Tensor, rows: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
                     sliding_window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> None:
    """Attention of one query token per decode over its paged context, read through its block table.

    Args:
        out: ``[T, H, D]`` contiguous; rows ``rows`` are written.
        query: ``[T, H, D]``, last dim contiguous (rows and heads may be strided).
        rows: ``[B]`` int64 decode rows.
        block_tables: ``[B, nblk]`` int64, contiguous.
        seq_lens: ``[B]`` int64 context lengths including the new token (already in the cache).
        key_cache, value_cache: ``[KVH, num_blocks, block_size, D]`` contiguous.
        sliding_window: keys ``j >= seq_len - sliding_window`` only, or ``None``.
        softcap: Gemma 2 score capping ``softcap * tanh(s / softcap)``, or ``None``.
        sinks: ``[H]`` float32 contiguous per-head sink logits (gpt-oss: each softmax's denominator
            gains ``exp(sink)``; no value), or ``None``.
    """
    kvh, nb, bs, d = key_cache.shape
    _lib.pl_decode_attention(query.data_ptr(), query.stride(0), query.stride(1), rows.data_ptr(),
                             block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
                             key_cache.data_ptr(), value_cache.data_ptr(), nb * bs, bs, rows.shape[0],
                             query.shape[1], kvh, d, scale, sliding_window or 0, softcap or 0.0, _ptr(sinks),
                             out.data_ptr(), torch.get_num_threads())


# pl_decode_stack's per-layer table (the enums in cpu_kernels.c): norm weights, then the cache,
# rotary kind and window, then {fmt, weight, d, m, bias} per matrix product
STACK_NORMS = ("in_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm")
STACK_MATMULS = ("q", "k", "v", "o", "gate", "up", "down")
STACK_ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")  # the last: gpt-oss clamped SwiGLU (alpha 1.702, limit 7)
MATMUL_ABSENT, MATMUL_FLOAT32 = -2, -1


def _address(t: torch.Tensor | None, dtype: torch.dtype | None, name: str) -> int:
    if t is None:
        return 0
    if not (t.is_cpu and t.is_contiguous() and (dtype is None or t.dtype == dtype)):
        raise ValueError(f"{name} must be a contiguous {dtype or ''} CPU tensor".replace("  ", " "))
    return t.data_ptr()


def stack_table(rows: list[dict]) -> torch.Tensor:
    """The ``[num_layers, 54]`` int64 table of ``decode_stack`` from one dict per layer.

    Each dict has ``STACK_NORMS`` (``[H]`` or, for the q/k head norms, ``[head_dim]`` float32 effective
    weights, or ``None`` where the layer has no such norm; ``in_norm`` and ``pre_ff_norm`` always),
    ``key_cache`` / ``value_cache`` (the layer's paged cache), ``rope`` (index of its rotary table in
    ``decode_stack``'s ``cos``/``sin``), ``window`` (sliding window in tokens, 0: none), optionally
    ``moe``: ``None`` (a dense MLP) or ``(router [E, H] float32, experts [E, 2, 5] int64 descriptors
    (``moe_experts``'), top_k, renormalize the top-k weights, chosen [E] int64 counts to add to,
    expert width, router bias [E] float32 or None)`` for a mixture-of-experts MLP (softmax router),
    optionally ``sinks`` (``[num_heads]`` float32 attention-sink logits: gpt-oss), and ``matmuls``:
    for each of ``STACK_MATMULS`` ``None`` (absent: ``q`` then holds the fused q|k|v rows, ``gate`` the
    fused gate|up rows) or ``(fmt, weight, d, m, bias)``: ``fmt`` a ``QUANT_LAYOUTS`` code with the
    packed ``qs``/``d``/``m`` tensors, or ``MATMUL_FLOAT32`` with the ``[N, K]`` float32 weight (``d``,
    ``m`` ``None``); ``bias`` ``[N]`` float32 or ``None``. The tensors must stay alive and in place
    while the table is used.

    Raises:
        ValueError: a tensor is not contiguous (float32 where it must be) on the CPU.
    """
    out = []
    for row in rows:
        cols = [_address(row[n], torch.float32, n) for n in STACK_NORMS]
        cols += [_address(row["key_cache"], torch.float32, "key_cache"),
                 _address(row["value_cache"], torch.float32, "value_cache"), int(row["rope"]), int(row["window"])]
        moe = row.get("moe")
        if moe is None:
            cols += [0] * 8
        else:
            router, experts, top_k, norm_topk, chosen, inter, bias = moe
            cols += [_address(router, torch.float32, "router"), _address(experts, torch.int64, "experts"),
                     router.shape[0], int(top_k), int(bool(norm_topk)), _address(chosen, torch.int64, "chosen"),
                     int(inter), _address(bias, torch.float32, "router bias")]
        cols.append(_address(row.get("sinks"), torch.float32, "sinks"))
        for name in STACK_MATMULS:
            mm = row["matmuls"].get(name)
            if mm is None:
                cols += [MATMUL_ABSENT, 0, 0, 0, 0]
                continue
            fmt, w, d, m, b = mm
            cols += [int(fmt), _address(w, torch.float32 if fmt == MATMUL_FLOAT32 else None, name),
                     _address(d, None, name), _address(m, None, name), _address(b, torch.float32, name + " bias")]
        out.append(cols)
    return torch.tensor(out, dtype=torch.int64)


def decode_stack(table: torch.Tensor, x: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, cos: torch.Tensor, sin: torch.Tensor, block_size: int,
                 num_slots: int, block_table: torch.Tensor, seq_len: int, scale: float, activation: str = "silu",
                 softcap: float | None = None) -> torch.Tensor:
    """The last ``T`` tokens of one sequence through every layer of a pre-norm decoder (Llama,
    Mistral, Qwen2/3, Phi-3, Gemma 3, Qwen3-MoE, Mixtral, gpt-oss) in one C call: batch-1 decode (``T = 1``) and the verification
    of speculative drafts (``T`` up to 16), without a return to Python between operations.

    Args:
        table: ``stack_table`` of the layers, ``[num_layers, 54]`` int64.
        x: ``[T, hidden]`` float32 contiguous, the tokens' embeddings; overwritten with the last
            layer's MLP output (after its post-MLP norm, if any).
        eps: the RMSNorms' epsilon (one for all of them).
        cos, sin: ``[R, T, head_dim]`` (or ``[T, head_dim]`` for one kind) contiguous rotary tables at
            the tokens' positions (``seq_len - T`` .. ``seq_len - 1``), one per rotary kind (a layer's
            ``rope``), rotate-half convention.
        block_table: ``[>= ceil(seq_len / block_size)]`` int64 block ids of the sequence, contiguous.
        seq_len: context length in tokens, these included (their K/V are written here); token ``t``
            attends to the first ``seq_len - T + t + 1`` (the last ``window`` of them, if set).
        scale: softmax scale; ``activation``: ``STACK_ACTIVATIONS``; ``softcap``: score capping or ``None``.
    Returns:
        The residual stream ``[T, hidden]``; the final hidden state is ``residual + x``.
    Raises:
        MemoryError: scratch memory could not be allocated.
        ValueError: ``T`` is above 16.
    Source: the decoder layers of transformers' ``modeling_llama`` / ``modeling_gemma3``.
    """
    rows = x.shape[0] if x.dim() > 1 else 1
    if rows > 16:
        raise ValueError(f"decode_stack takes at most 16 tokens, got {rows}")
    residual = torch.empty_like(x)
    rc = _lib.pl_decode_stack(table.shape[0], rows, table.data_ptr(), x.data_ptr(), residual.data_ptr(), x.shape[-1],
                              num_heads, num_kv_heads, head_dim, intermediate, eps, cos.data_ptr(), sin.data_ptr(),
                              num_slots, block_size, block_table.data_ptr(), seq_len, scale,
                              STACK_ACTIVATIONS.index(activation), softcap or 0.0, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("pl_decode_stack: no scratch memory")
    return residual

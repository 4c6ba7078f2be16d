"""GGUF block formats decoded once at load into the layouts the C kernels multiply.

Every supported GGUF format is a list of groups of 16 or 32 weights along a row, each
``w = q * d (+ m)`` with small integer quants ``q`` and a float scale ``d`` (and min ``m``). The
K-quants nest their group scales in super-blocks of 256 (6-bit or int8 scales times an fp16 super
scale); the product ``d_super * sc`` is exact in float32 (11 + 8 significant bits), so decoding
them into one float32 scale (and min) per group changes no weight. Decoded rows come in
these row layouts (``repack``; rows can then be reordered and concatenated), and ``to_tiles``
rearranges them into the tiles of 16 rows the kernels multiply (``quant_kernels.c``):

=======  ==========================================  ======================================
layout   arrays (weight matrix ``[N, K]``)           GGUF formats served by it (exactly)
=======  ==========================================  ======================================
``U4M``  qs uint8 [N, K/2], d, m float32 [N, K/32]   Q4_1, Q4_K      (``w = q d + m``)
``S8``   qs int8 [N, K], d float32 [N, K/32]         Q8_0, Q5_0 (q - 16), int8 per channel
``IQ4``  qs uint8 [N, K/2], d float32 [N, K/32]      IQ4_NL, IQ4_XS (``w = cb[q] d``, the nibble
                                                     an index into ``_IQ4_VALUES``)
``E2M1`` as ``IQ4``                                  MXFP4 (into ``_E2M1_X2``; ``d = 2^(e-128)``)
``U4``   qs uint8 [N, K/2], d float32 [N, K/32]      Q4_0            (``w = (q - 8) d``)
``S8H``  qs int8 [N, K], d float32 [N, K/16]         Q6_K (q - 32), Q3_K (q - 4; ``w = q d``);
         (Q6_K adds sc int8 [N, K/16] and dsup        Q6_K's ``d = dsup sc`` (tiled as ``U6H``)
         float32 [N, K/256])
``S8M``  qs int8 [N, K], d, m float32 [N, K/32]      Q5_1, Q5_K      (``w = q d + m``)
``S8HM`` ``S8H`` qs, d, plus the mins as a second    Q2_K (``w = q d + m``, one ``d`` and
         ``S8H`` matrix over the groups: mq int8     ``m`` per 16; ``m = md mq`` with the
         [N, G], md float32 [N, G/16], G = K/16      super-block's ``-dmin`` as ``md``)
         padded to a multiple of 32
``F16``  w float16 / bfloat16 [N, K]                 F16, BF16 (kept 16-bit)
``BF16``
=======  ==========================================  ======================================

In ``U4M``/``U4``/``IQ4``/``E2M1`` byte ``j`` of a 32-weight group holds weight ``j`` (low nibble) and ``j + 16``
(high nibble). Block layouts follow llama.cpp's ``ggml-common.h`` as documented by ``gguf.quants``
(which the tests use as the reference dequantization).
"""

from __future__ import annotations

import numpy as np
import torch


def unpermute_rows(w, n_head: int):
    """Invert llama.cpp's ``LlamaModel.permute`` of the Q and K projections (rotary half-split rows
    back to interleaved pairs, as Hugging Face Llama expects).

    Args:
        w: ``[N, ...]`` array (numpy, any dtype) whose ``N = n_head * head_dim`` rows were permuted;
            a 1-D bias works too.
        n_head: the number of heads the rows are split into (query or key-value heads).
    Returns:
        The array of the same shape and dtype with the rows in Hugging Face order.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

LAYOUTS = {"U4M": 0, "S8": 1, "S6": 2, "S8H": 3, "S8M": 4, "IQ4": 5, "E2M1": 6, "U6H": 7}  # pl_qgemm's tile layout codes (U4 tiles as U4M)
HALF_SCALES = ("S8", "S6", "IQ4", "E2M1")  # tile layouts whose d may be float16 ("S8/f16": quant_common.h Q_HALF)
TILE = 16  # output rows per tile
GGUF_LAYOUT = {"Q4_0": "U4", "Q4_1": "U4M", "Q8_0": "S8", "Q5_0": "S8", "Q5_1": "S8M",
               "Q4_K": "U4M", "Q5_K": "S8M", "Q6_K": "S8H", "Q3_K": "S8H",
               "IQ4_NL": "IQ4", "IQ4_XS": "IQ4", "MXFP4": "E2M1", "Q2_K": "S8HM", "F16": "F16", "BF16": "BF16"}
_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q3_K": (256, 110),
          "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "MXFP4": (32, 17)}  # weights, bytes per block
_GROUP16 = ("Q6_K", "Q3_K")  # one scale per 16 weights (S8H)
# the non-linear 4-bit codebooks: IQ4_NL / IQ4_XS's, and MXFP4's e2m1 values doubled (so integers)
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
_E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_CODEBOOK = {"IQ4": _IQ4_VALUES, "E2M1": _E2M1_X2}  # the nibble layouts' tables (quant_common.h q_codebook)


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """[..., L] uint8 -> [..., 2, L]: low nibbles, then high nibbles."""
    return np.stack([b & 15, b >> 4], axis=-2)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K 12-byte scale fields [B, 12] -> 6-bit scales and mins [B, 8]: entries 0-3 are the low
    6 bits of bytes 0-3 (scales) and 4-7 (mins); entries 4-7 take 4 bits from bytes 8-11 and their
    top 2 bits from the top of bytes 0-3 (scales) and 4-7 (mins)."""
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def decode(kind: str, raw: np.ndarray, n: int, k: int):
    """Integer quants and group scales of a GGUF tensor.

    Args:
        kind: a ``GGUF_LAYOUT`` key.
        raw: the tensor's bytes (uint8, any shape).
        n, k: rows and columns; ``k`` a multiple of the format's block size.
    Returns:
        ``(q, d, m, group)``: ``q`` int8 ``[n, k]``, ``d`` float32 ``[n, k / group]``, ``m`` the same or
        ``None``, ``group`` 16 or 32; ``w = q d + m`` per group.
    Raises:
        ValueError: an unknown format, or a size that does not match ``[n, k]``.
    """
    if kind not in _BLOCK:
        raise ValueError(f"GGUF format {kind} is not served packed")
    bw, bb = _BLOCK[kind]
    b = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if k % bw or b.size != n * (k // bw) * bb:
        raise ValueError(f"{kind} tensor of {b.size} bytes is not [{n}, {k}]")
    b = b.reshape(-1, bb)
    nblk = b.shape[0]
    m = None
    if kind == "Q8_0":
        d, q = _f16(b[:, 0:2]), b[:, 2:].view(np.int8)
    elif kind in ("Q4_0", "Q4_1"):
        off = 4 if kind == "Q4_1" else 2
        d, q = _f16(b[:, 0:2]), _nibbles(b[:, off:]).reshape(nblk, 32).astype(np.int8)
        if kind == "Q4_1":
            m = _f16(b[:, 2:4])
        else:
            q -= 8
    elif kind in ("Q5_0", "Q5_1"):
        off = 4 if kind == "Q5_1" else 2
        d = _f16(b[:, 0:2])
        high = np.unpackbits(b[:, off:off + 4], axis=1, bitorder="little")  # bit j of the uint32: weight j
        q = (_nibbles(b[:, off + 4:]).reshape(nblk, 32) | (high << 4)).astype(np.int8)
        if kind == "Q5_1":
            m = _f16(b[:, 2:4])
        else:
            q -= 16
    elif kind in ("Q4_K", "Q5_K"):
        sd, smin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        d, m = sd[:, None] * sc, -(smin[:, None] * mn)  # [B, 8]: one per 32 weights
        qs = b[:, 48:] if kind == "Q5_K" else b[:, 16:]
        q = _nibbles(qs.reshape(nblk, 4, 32)).reshape(nblk, 8, 32)  # 64 weights per 32 bytes: low, high
        if kind == "Q5_K":  # bit j of qh byte l: the fifth bit of weight l of group j
            high = (b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            q = q | (high << 4)
        q = q.astype(np.int8)
    elif kind in ("Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"):
        q, d = _decode_more(kind, b, nblk)
    else:  # Q6_K: ql [128], qh [64], int8 scales [16], fp16 d
        ql, qh = b[:, 0:128].reshape(nblk, 2, 64), b[:, 128:192].reshape(nblk, 2, 32)
        # weight 32 i + l of a half: i = 0, 1: low nibbles of ql[l], ql[l + 32]; 2, 3: their high
        # nibbles; the top two bits are bits 2i, 2i + 1 of qh[l]
        low = _nibbles(ql).reshape(nblk, 2, 4, 32)
        two = (qh[:, :, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
        q = ((low | (two << 4)).astype(np.int16) - 32).astype(np.int8).reshape(nblk, 256)
        d = _f16(b[:, 208:210])[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)  # [B, 16]
    group = 16 if kind in _GROUP16 else 32
    q = np.ascontiguousarray(q).reshape(n, k)
    d = np.ascontiguousarray(d, dtype=np.float32).reshape(n, k // group)
    if m is not None:
        m = np.ascontiguousarray(m, dtype=np.float32).reshape(n, k // 32)
    return q, d, m, group


def _decode_more(kind: str, b: np.ndarray, nblk: int) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8 [B, block], d float32 [B, groups])`` of the formats added for issue 39 (blocks ``b``
    ``[B, bytes]``), every weight exactly ``q d``:

    * ``IQ4_NL``: fp16 d, 16 bytes of 4-bit indices into ``_IQ4_VALUES`` (byte j: weights j, j + 16);
    * ``IQ4_XS``: per 256: fp16 d, 16-bit high and 4 bytes of low scale bits (6-bit scales, minus 32,
      one per 32), 128 bytes of indices as IQ4_NL's; scale ``d (s - 32)``;
    * ``MXFP4``: an e8m0 exponent byte, 16 bytes of e2m1 codes (as IQ4_NL's); the values doubled to
      integers, so the scale is ``2 ** (e - 128)``;
    * ``Q3_K``: per 256: 32 bytes of high bits, 64 of 2-bit lows, 12 of 6-bit scales (minus 32, one
      per 16), fp16 d; weight ``128 h + 32 j + l`` is bits ``2j`` of low byte ``32 h + l`` minus 4
      when bit ``4h + j`` of high byte ``l`` is clear.
    """
    if kind in ("IQ4_NL", "MXFP4"):
        off = 2 if kind == "IQ4_NL" else 1
        table = _IQ4_VALUES if kind == "IQ4_NL" else _E2M1_X2
        q = table[_nibbles(b[:, off:]).reshape(nblk, 32)]
        if kind == "IQ4_NL":
            return q, _f16(b[:, 0:2])[:, None]
        return q, np.ldexp(np.float32(1), b[:, 0:1].astype(np.int32) - 128).astype(np.float32)
    if kind == "IQ4_XS":
        high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16)  # [B, 1]
        low = _nibbles(b[:, 4:8]).transpose(0, 2, 1).reshape(nblk, 8)  # scale 2i: low nibble of byte i
        sc = low | (((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8) << 4)
        d = _f16(b[:, 0:2])[:, None] * (sc.astype(np.float32) - 32)
        return _IQ4_VALUES[_nibbles(b[:, 8:].reshape(nblk, 8, 16)).reshape(nblk, 256)], d
    # Q3_K
    s = b[:, 96:108]
    low = _nibbles(s[:, 0:8]).reshape(nblk, 16)  # scale i: nibble i // 8 of byte i % 8
    high = (s[:, 8:12][:, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & 3  # [B, shift, byte]
    sc = (low | (high.reshape(nblk, 16) << 4)).astype(np.float32) - 32  # scale i: byte 8 + i % 4, shift i // 4
    d = _f16(b[:, 108:110])[:, None] * sc
    lows = (b[:, 32:96].reshape(nblk, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    hbit = (b[:, 0:32][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [B, bit, l]
    q = lows.reshape(nblk, 256).astype(np.int8) - 4 * (1 - hbit.reshape(nblk, 256).astype(np.int8))
    return q, d


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """int8 [n, k] in 0..15 -> uint8 [n, k/2], byte j of each 32-group = q[j] | q[j + 16] << 4."""
    n, k = q.shape
    g = q.astype(np.uint8).reshape(n, k // 32, 2, 16)
    return np.ascontiguousarray(g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


def repack(kind: str, raw: np.ndarray, n: int, k: int) -> tuple[str, dict[str, torch.Tensor]]:
    """A GGUF tensor in the kernels' layout (``GGUF_LAYOUT[kind]``).

    Returns:
        ``(layout, {"qs", "d"[, "m"]})`` with the shapes of the module docstring's table.
    Raises:
        ValueError: as ``decode``.
    """
    if kind == "Q2_K":
        return "S8HM", _repack_q2_k(raw, n, k)
    if kind in ("F16", "BF16"):
        b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)  # gguf's writer hands float16 arrays
        if b.size != 2 * n * k:
            raise ValueError(f"{kind} tensor of {b.size} bytes is not [{n}, {k}]")
        w = torch.from_numpy(b.copy().view(np.int16).reshape(n, k))
        return kind, {"w": w.view(torch.float16 if kind == "F16" else torch.bfloat16)}
    q, d, m, _ = decode(kind, raw, n, k)
    layout = GGUF_LAYOUT[kind]
    if kind == "Q6_K":  # its int8 group scales and fp16 super-block scale, for the 6-bit tiles
        b = np.asarray(raw, dtype=np.uint8).reshape(-1, 210)
        extra = {"sc": torch.from_numpy(np.ascontiguousarray(b[:, 192:208]).view(np.int8).reshape(n, k // 16).copy()),
                 "dsup": torch.from_numpy(_f16(b[:, 208:210]).reshape(n, k // 256))}
    else:
        extra = {}
    if layout == "U4":
        q = q + 8
    elif layout in _CODEBOOK:  # the values back to their indices (MXFP4's two zeros: either index)
        index = np.zeros(256, dtype=np.int8)
        index[_CODEBOOK[layout].view(np.uint8)] = np.arange(16, dtype=np.int8)
        q = index[q.view(np.uint8)]
    qs = _pack_nibbles(q) if layout in ("U4", "U4M", *_CODEBOOK) else q
    out = {"qs": torch.from_numpy(np.ascontiguousarray(qs)), "d": torch.from_numpy(d)}
    if m is not None:
        out["m"] = torch.from_numpy(m)
    return layout, out | extra


def _repack_q2_k(raw: np.ndarray, n: int, k: int) -> dict[str, torch.Tensor]:
    """Q2_K (per 256: 16 bytes of 4-bit scale | 4-bit min pairs, 64 bytes of 2-bit quants, fp16 d and
    dmin; weight ``128 h + 32 j + l`` is bits ``2j`` of byte ``32 h + l``, its pair ``8 h + 2 j +
    l // 16``; ``w = d sc q - dmin mn``) as ``S8HM``'s arrays (module docstring), exactly.

    Raises:
        ValueError: a size that does not match ``[n, k]`` or ``k`` not a multiple of 256.
    """
    b = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if k % 256 or b.size != n * (k // 256) * 84:
        raise ValueError(f"Q2_K tensor of {b.size} bytes is not [{n}, {k}]")
    b = b.reshape(-1, 84)
    nblk = b.shape[0]
    sc, mn = (b[:, :16] & 15).astype(np.float32), (b[:, :16] >> 4).astype(np.int8)
    d = _f16(b[:, 80:82])[:, None] * sc  # [B, 16]
    q = (b[:, 16:80].reshape(nblk, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    g = k // 16
    width = -(-g // 32) * 32  # the mins matrix's columns: a multiple of the kernels' 32
    mq = np.zeros((n, width), dtype=np.int8)
    mq[:, :g] = mn.reshape(n, g)
    md = np.zeros((n, width // 16), dtype=np.float32)
    md[:, :g // 16] = -_f16(b[:, 82:84]).reshape(n, k // 256)
    return {"qs": torch.from_numpy(np.ascontiguousarray(q.reshape(n, k).astype(np.int8))),
            "d": torch.from_numpy(np.ascontiguousarray(d.reshape(n, g), dtype=np.float32)),
            "mq": torch.from_numpy(mq), "md": torch.from_numpy(md)}


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-output-channel symmetric int8 of a float weight (``--quantization int8``), in the ``S8``
    layout (the row's scale repeated per 32 columns, so the GGUF kernels serve it).

    Args:
        w: ``[n, k]`` float, ``k`` a multiple of 32.
    Returns:
        ``{"qs": int8 [n, k], "d": float32 [n, k / 32]}`` with ``w ~= q * d``, ``d = max|w_row| / 127``.
    Raises:
        ValueError: ``k`` not a multiple of 32.
    """
    n, k = w.shape
    if k % 32:
        raise ValueError(f"int8 weights need in_features divisible by 32, not {k}")
    w = w.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return {"qs": q.contiguous(), "d": scale.expand(n, k // 32).contiguous()}


def to_tiles(layout: str, packed: dict[str, torch.Tensor], n: int, k: int,
             six_bit: bool = False) -> tuple[str, dict[str, torch.Tensor]]:
    """Rearrange a row-layout matrix (``repack``, ``quantize_int8``) into the kernels' tiles.

    Rows are padded with zeros to a multiple of ``TILE``. Within a tile, the 32-weight block ``b`` of
    its 16 rows is stored together in 64-byte chunks, lane ``n`` (4 bytes) for row ``n``: ``U4M``
    chunk ``c`` byte ``j`` holds weights ``8c + j`` (low nibble) and ``8c + 4 + j`` (high nibble),
    the byte layouts' chunk ``c`` byte ``j`` holds weight ``4c + j``. ``U4`` becomes ``U4M`` with
    ``m = -8 d`` (exact: a power-of-two multiple). ``S8`` whose quants all lie in -32..31 (Q5_0)
    becomes ``S6``: the same bytes, which the AVX2 kernels may offset by 32 into an unsigned operand
    that ``vpmaddubsw`` cannot saturate (``quant_avx2.c``). The ``HALF_SCALES`` layouts keep ``d``
    in float16 (layout ``"S8/f16"`` etc.) when every scale is exact there (Q8_0, Q5_0 and IQ4_NL's
    fp16 scales, MXFP4's powers of two): the bytes a product reads are then the file's. Q6_K's
    ``S8H`` (with its ``sc`` and ``dsup``) becomes ``U6H`` when ``six_bit`` (``_six_bit_tiles``).

    Args:
        layout: the row layout; packed: its ``{"qs", "d"[, "m"][, "sc", "dsup"]}``; n, k: the matrix's
            shape; six_bit: tile Q6_K in 6 bits (``kernels.cpu.six_bit_tiles``: the loaded build has
            its kernel).
    Returns:
        ``(tile layout, {"qs": uint8 [tiles, K/32 * (256 | 512)], "d": float32 (or float16 for a
        ``/f16`` layout) [tiles, groups, 16] [, "m": float32 [tiles, K/32, 16]]})``.
    """
    qs, d, m = packed["qs"], packed["d"], packed.get("m")
    if layout == "U4":
        layout, m = "U4M", d * -8.0
    if layout == "S8" and qs.numel() and -32 <= int(qs.view(torch.int8).min()) and int(qs.view(torch.int8).max()) <= 31:
        layout = "S6"
    tiles, nb = -(-n // TILE), k // 32
    pad = tiles * TILE - n

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t

    def lanes(t: torch.Tensor) -> torch.Tensor:
        return rows(t).reshape(tiles, TILE, -1).transpose(1, 2).contiguous()

    if six_bit and layout == "S8H" and "sc" in packed and k % 256 == 0:
        return "U6H", {"qs": _six_bit_tiles(rows(qs.view(torch.int8)), rows(packed["sc"]), tiles, nb),
                       "d": lanes(packed["dsup"])}

    if layout in ("U4M", *_CODEBOOK):
        b = rows(qs.view(torch.uint8)).reshape(tiles * TILE, nb, 16)
        q = torch.stack([b & 15, b >> 4], 2).reshape(tiles, TILE, nb, 4, 2, 4)  # weight 8c + 4h + j
        q = q.permute(0, 2, 3, 1, 4, 5)  # [tile, block, chunk, lane, h, j]
        tq = q[..., 0, :] | (q[..., 1, :] << 4)
    else:
        q = rows(qs.view(torch.int8)).reshape(tiles, TILE, nb, 8, 4)  # weight 4c + j
        tq = q.permute(0, 2, 3, 1, 4).view(torch.uint8)
    out = {"qs": tq.contiguous().reshape(tiles, -1)}

    out["d"] = lanes(d)
    if m is not None:
        out["m"] = lanes(m)
    half = out["d"].to(torch.float16)
    if layout in HALF_SCALES and torch.equal(half.float(), out["d"]):
        layout, out["d"] = f"{layout}/f16", half
    return layout, out


def _six_bit_tiles(q: torch.Tensor, sc: torch.Tensor, tiles: int, nb: int) -> torch.Tensor:
    """``U6H`` tile bytes (``quant_kernels.c``) of Q6_K quants.

    Args:
        q: int8 ``[tiles * 16, nb * 32]`` in -32..31 (rows padded); sc: int8 ``[tiles * 16, nb * 2]``
            group scales; tiles, nb: tiles and 32-weight blocks per row.
    Returns:
        uint8 ``[tiles, nb * 416]``: per block, 256 bytes of low nibbles (``U4M``'s chunks), 128 of
        high 2-bit pairs (chunk ``c2``, lane ``n``, byte ``j``, bits ``2k``: weight ``16 c2 + 4k + j``),
        32 of group scales (group ``g``, lane ``n``).
    """
    u = (q.to(torch.int16) + 32).to(torch.uint8).reshape(tiles, TILE, nb, 32)
    low = (u & 15).reshape(tiles, TILE, nb, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)  # [t, b, c, lane, h, j]
    nib = low[..., 0, :] | (low[..., 1, :] << 4)  # weight 8c + j | weight 8c + 4 + j
    high = (u >> 4).reshape(tiles, TILE, nb, 2, 4, 4).permute(0, 2, 3, 1, 5, 4)  # [t, b, c2, lane, j, k]
    two = high[..., 0] | (high[..., 1] << 2) | (high[..., 2] << 4) | (high[..., 3] << 6)
    scales = sc.view(torch.uint8).reshape(tiles, TILE, nb, 2).permute(0, 2, 3, 1)  # [t, b, g, lane]
    return torch.cat([nib.reshape(tiles, nb, 256), two.reshape(tiles, nb, 128), scales.reshape(tiles, nb, 32)],
                     2).reshape(tiles, -1).contiguous()

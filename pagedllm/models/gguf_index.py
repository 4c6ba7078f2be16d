"""A GGUF file's tensor index, read without parsing its metadata into Python objects.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata value: for a 262k-token
vocabulary that is over a million small arrays, 8-18 s and about 450 MB before the first tensor is
touched (measured on gemma-3-270m's file). Serving packed weights needs only the architecture and,
per tensor, its type, shape and bytes, so this reader walks the header once, skipping values by
their encoded sizes, and hands out read-only memory-mapped byte views of the tensors.

Layout followed: the GGUF specification (version 2 and 3, little-endian): magic ``GGUF``, version,
tensor count, metadata count, the metadata key/value pairs, the tensor infos (name, dims innermost
first, type, offset), then the data aligned to ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGUFValueType -> bytes of one scalar (strings and arrays are handled apart)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file.

    Attributes:
        name: its GGUF name (``blk.3.attn_q.weight``).
        tensor_type: ``gguf.GGMLQuantizationType`` (``.name`` is ``Q4_K``, ``F32``, ...).
        shape: dims innermost first, as GGUF lists them (``[k, n]`` for an ``[n, k]`` weight).
        data: uint8 bytes of the tensor, a read-only view of the file's memory map.
    """

    name: str
    tensor_type: object
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR:
            self.pos += _SCALAR[vtype]
        elif vtype == _STRING:
            n = self.unpack("<Q")  # the length, then that many bytes (read before adding: it moves pos)
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.unpack("<IQ")
            if etype in _SCALAR:
                self.pos += _SCALAR[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
        if vtype in fmt:
            return self.unpack(fmt[vtype])
        self.skip_value(vtype)
        return None


def read_tensor_index(path: str | Path) -> tuple[str | None, dict[str, GGUFTensor]]:
    """``(general.architecture, {name: GGUFTensor})`` of the GGUF file at ``path``.

    Raises:
        ValueError: not a little-endian GGUF file of version 2 or 3, or a header that runs past the
            file's end (truncated).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    mm = np.memmap(str(path), dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    try:
        magic, version, n_tensors, n_kv = cur.unpack("<4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a little-endian GGUF file of version 2 or 3")
        meta = {}
        for _ in range(n_kv):
            key, vtype = cur.string(), cur.unpack("<I")
            if key in ("general.architecture", "general.alignment"):
                meta[key] = cur.value(vtype)
            else:
                cur.skip_value(vtype)
        infos = []
        for _ in range(n_tensors):
            name, ndims = cur.string(), cur.unpack("<I")
            dims = tuple(cur.unpack("<Q") for _ in range(ndims))
            infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    except struct.error:
        raise ValueError(f"{path}: the GGUF header runs past the end of the file (truncated)") from None
    align = int(meta.get("general.alignment") or 32)
    start = -(-cur.pos // align) * align
    out = {}
    for name, dims, ttype, offset in infos:
        kind = GGMLQuantizationType(ttype)
        block, size = GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(dims, dtype=np.int64)) // block * size
        a = start + offset
        if a + nbytes > mm.size:
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated)")
        out[name] = GGUFTensor(name, kind, dims, mm[a:a + nbytes])
    return meta.get("general.architecture"), out

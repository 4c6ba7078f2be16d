"""Content hashes of full KV blocks for prefix caching.

A block's hash covers its parent block's hash, its token ids and extra keys
(the request's ``cache_salt`` on the first block, the content hashes of the images whose
placeholders it holds; the LoRA adapter's identity on the first block), so equal hashes mean equal prefixes up to and including the block.

The hash is SHA-256 over a fixed byte encoding (no Python ``hash()``, which is
salted per process): deterministic across processes and runs, and with a
256-bit digest a collision that would hand one request another's KV is not a
practical concern (birthday bound near 2**128 blocks).
"""

from __future__ import annotations

import hashlib
import struct
from array import array

ROOT_HASH = b"\x00" * 32  # parent of a request's first block


def _encode_extra(keys: tuple) -> bytes:
    """Length-prefixed encoding of str/int/bytes keys, so ("a", "bc") != ("ab", "c")."""
    out = bytearray()
    for k in keys:
        if isinstance(k, str):
            b, tag = k.encode("utf-8"), b"s"
        elif isinstance(k, bytes):
            b, tag = k, b"b"
        elif isinstance(k, int):
            b, tag = str(k).encode(), b"i"
        else:
            raise TypeError(f"extra hash keys must be str, bytes or int, got {type(k).__name__}")
        out += tag + struct.pack("<I", len(b)) + b
    return bytes(out)


def hash_block_tokens(parent_hash: bytes, token_ids, extra_keys: tuple = ()) -> bytes:
    """SHA-256 of (parent hash, the block's token ids as int64 little-endian, extra keys).

    Args:
        parent_hash: 32-byte hash of the previous block, ``ROOT_HASH`` for the first.
        token_ids: exactly ``block_size`` token ids.
        extra_keys: str/int/bytes keys such as the cache salt.
    Returns:
        32-byte digest.
    """
    h = hashlib.sha256(parent_hash)
    tokens = array("q", token_ids)
    if tokens.itemsize != 8 or struct.pack("=q", 1) != struct.pack("<q", 1):
        tokens = array("q", [int(t) for t in token_ids])  # unreachable on x86/arm64; keeps the encoding fixed
    h.update(struct.pack("<I", len(tokens)))
    h.update(tokens.tobytes())
    h.update(_encode_extra(extra_keys))
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, cache_salt: str | None,
                        mm_inputs=(), lora_key: bytes | None = None) -> None:
    """Append the hashes of every newly full block of ``token_ids`` to ``hashes`` (in place).

    ``mm_inputs``: the request's images (``multimodal_inputs.MultiModalInput``); a block holding any of an
    image's placeholder tokens gets that image's content hash among its extra keys, so equal
    placeholder tokens of different images never share a block (vLLM's multimodal prefix caching).
    ``lora_key``: the request's adapter identity (``LoRARequest.cache_key``), among the first block's
    extra keys; every later block chains on it, so two adapters never share a block, nor an adapter
    and the base model, while requests of the same adapter do.
    """
    from pagedllm.multimodal_inputs import block_keys
    n_full = len(token_ids) // block_size
    for i in range(len(hashes), n_full):
        parent = hashes[i - 1] if i else ROOT_HASH
        extra = (cache_salt,) if i == 0 and cache_salt else ()
        if i == 0 and lora_key is not None:
            extra += (b"lora", lora_key)
        if mm_inputs:
            extra += block_keys(mm_inputs, i * block_size, (i + 1) * block_size)
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra))

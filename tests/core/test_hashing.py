"""Block content hashes for prefix caching: fixed encoding, chaining, salts, extra keys."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm.core import hashing
from pagedllm.core.hashing import ROOT_HASH, extend_block_hashes, hash_block_tokens

TOKENS = [1, 49151, 0, 12345]


def test_digest_is_32_bytes_and_root_is_32_zero_bytes():
    h = hash_block_tokens(ROOT_HASH, TOKENS)
    assert isinstance(h, bytes) and len(h) == 32
    assert ROOT_HASH == b"\x00" * 32
    assert hash_block_tokens(h, TOKENS, ("salt", 7, b"x")) != h


def test_deterministic_within_and_across_processes():
    # a fresh interpreter has a different PYTHONHASHSEED: the hash must not depend on it
    here = hash_block_tokens(hash_block_tokens(ROOT_HASH, TOKENS, ("s",)), [7, 8, 9, 10]).hex()
    assert here == hash_block_tokens(hash_block_tokens(ROOT_HASH, TOKENS, ("s",)), [7, 8, 9, 10]).hex()
    # load the module by path: importing the package would pull in torch (slow) for nothing
    code = ("import importlib.util as u;"
            f"s = u.spec_from_file_location('hashing', {hashing.__file__!r}); m = u.module_from_spec(s);"
            "s.loader.exec_module(m); h = m.hash_block_tokens;"
            f"print(h(h(m.ROOT_HASH, {TOKENS!r}, ('s',)), [7, 8, 9, 10]).hex())")
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": ""}, timeout=60)
        assert out.stdout.strip() == here


def test_token_ids_accept_any_int_sequence():
    import numpy as np
    ref = hash_block_tokens(ROOT_HASH, TOKENS)
    assert hash_block_tokens(ROOT_HASH, tuple(TOKENS)) == ref
    assert hash_block_tokens(ROOT_HASH, np.array(TOKENS, dtype=np.int64)) == ref


def test_parent_chaining():
    a = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    b = hash_block_tokens(ROOT_HASH, [5, 6, 7, 8])
    # the same tokens after different parents hash differently
    assert hash_block_tokens(a, [9, 9, 9, 9]) != hash_block_tokens(b, [9, 9, 9, 9])
    assert hash_block_tokens(a, [9, 9, 9, 9]) != hash_block_tokens(ROOT_HASH, [9, 9, 9, 9])
    # block order matters
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(b, [1, 2, 3, 4])


def test_token_values_and_lengths_are_unambiguous():
    base = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 5]) != base
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3]) != base
    assert hash_block_tokens(ROOT_HASH, [256, 0]) != hash_block_tokens(ROOT_HASH, [0, 1])
    # tokens and extra keys are length-delimited: a token cannot pose as an extra key byte
    assert hash_block_tokens(ROOT_HASH, [1], ()) != hash_block_tokens(ROOT_HASH, [], (1,))


def test_extra_keys_change_the_hash_and_are_unambiguous():
    plain = hash_block_tokens(ROOT_HASH, TOKENS)
    assert hash_block_tokens(ROOT_HASH, TOKENS, ("salt",)) != plain
    assert hash_block_tokens(ROOT_HASH, TOKENS, ("a",)) != hash_block_tokens(ROOT_HASH, TOKENS, ("b",))
    assert hash_block_tokens(ROOT_HASH, TOKENS, ("a", "bc")) != hash_block_tokens(ROOT_HASH, TOKENS, ("ab", "c"))
    assert hash_block_tokens(ROOT_HASH, TOKENS, ("abc",)) != hash_block_tokens(ROOT_HASH, TOKENS, ("a", "bc"))
    # the type is part of the encoding
    assert hash_block_tokens(ROOT_HASH, TOKENS, ("1",)) != hash_block_tokens(ROOT_HASH, TOKENS, (1,))
    assert hash_block_tokens(ROOT_HASH, TOKENS, (b"1",)) != hash_block_tokens(ROOT_HASH, TOKENS, ("1",))
    assert hash_block_tokens(ROOT_HASH, TOKENS, ("",)) != plain
    with pytest.raises(TypeError):
        hash_block_tokens(ROOT_HASH, TOKENS, (1.5,))


def test_extend_block_hashes_chains_full_blocks_incrementally():
    tokens = list(range(100, 111))  # 2 full blocks of 4 and 3 tokens more
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 4, None)
    h0 = hash_block_tokens(ROOT_HASH, tokens[0:4])
    assert hashes == [h0, hash_block_tokens(h0, tokens[4:8])]
    first = list(hashes)
    tokens.append(111)  # completes the third block: only it is appended, the others are kept
    extend_block_hashes(hashes, tokens, 4, None)
    assert hashes[:2] == first and hashes[2] == hash_block_tokens(first[1], tokens[8:12])
    extend_block_hashes(hashes, tokens, 4, None)
    assert len(hashes) == 3


def test_salt_changes_every_block_and_equal_salts_match():
    tokens = list(range(16))
    plain, salted, salted2, other = [], [], [], []
    extend_block_hashes(plain, tokens, 4, None)
    extend_block_hashes(salted, tokens, 4, "tenant-a")
    extend_block_hashes(salted2, tokens, 4, "tenant-a")
    extend_block_hashes(other, tokens, 4, "tenant-b")
    assert salted == salted2
    # the salt enters the first block only, and the chain carries it to every later block
    assert salted[0] == hash_block_tokens(ROOT_HASH, tokens[:4], ("tenant-a",))
    assert salted[1] == hash_block_tokens(salted[0], tokens[4:8])
    assert all(a != b for a, b in zip(plain, salted))
    assert all(a != b for a, b in zip(salted, other))
    empty = []
    extend_block_hashes(empty, tokens, 4, "")  # an empty salt is no salt
    assert empty == plain

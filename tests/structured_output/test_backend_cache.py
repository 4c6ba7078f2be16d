"""The engine core's compiled-grammar cache (``structured_output/backend.py``), on SmolLM2's
tokenizer: bounded in estimated bytes as well as entries, least recently used out first, failed
compiles never kept, and freed heap given back, so that the core's memory returns after hostile
requests (issue 35 item 2: 8 distinct 1 MB ``const`` schemas took the core from 1.7 to 3.7 GB)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
from llguidance import LLMatcher

from pagedllm.memory import return_freed_memory
from pagedllm.structured_output import backend as backend_mod
from pagedllm.structured_output.backend import GuidanceBackend, estimate_bytes
from pagedllm.structured_output.manager import COMPILE_STACK_BYTES
from pagedllm.structured_output.validator import CHILD_STACK_BYTES


@pytest.fixture(scope="module")
def backend(smollm2_tokenizer):
    return GuidanceBackend(smollm2_tokenizer, 49152, set())


def _const(i: int, n: int) -> str:
    return LLMatcher.grammar_from_json_schema({"const": f"{i}-" + "ab" * (n // 2)})


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_the_cache_is_bounded_in_bytes_lru(backend, monkeypatch):
    trims = []
    monkeypatch.setattr(backend, "_trim", lambda: trims.append(1))
    backend.clear()
    specs = [_const(i, 2000) for i in range(5)]
    monkeypatch.setattr(backend_mod, "CACHE_BYTES", 3 * estimate_bytes(specs[0]))
    for s in specs[:3]:
        backend.compile(s, s)
    assert backend.num_cached == 3 and backend.cache_bytes == 3 * estimate_bytes(specs[0])
    backend.compile(specs[0], specs[0])  # a hit: now the most recent
    trims.clear()
    backend.compile(specs[3], specs[3])
    assert backend.num_cached == 3 and trims == [1]  # specs[1] out, and the heap trimmed
    before = backend.num_compiled
    backend.compile(specs[0], specs[0])
    assert backend.num_compiled == before  # still cached
    backend.compile(specs[1], specs[1])
    assert backend.num_compiled == before + 1  # was evicted: compiled again
    big = _const(9, 4000)
    monkeypatch.setattr(backend_mod, "CACHE_BYTES", estimate_bytes(big) - 1)
    m = backend.compile(big, big)  # over the budget alone: used, not kept
    assert not m.is_error() and big not in backend._cache and backend.num_cached == 3


def test_a_grammar_that_fails_in_the_core_is_not_kept(backend, monkeypatch):
    backend.clear()
    trims = []
    monkeypatch.setattr(backend, "_trim", lambda: trims.append(1))
    for lark in ("start: start", "start: /(/"):
        spec = LLMatcher.grammar_from_lark(lark)
        with pytest.raises(ValueError):
            backend.compile(spec, spec)
    assert backend.num_cached == 0 and backend.cache_bytes == 0 and len(trims) == 2


def test_memory_returns_after_distinct_large_grammars(backend):
    """Six distinct 120 KB ``const`` schemas, each ~40 MB of lexer states once its first mask is
    built: the cache keeps at most ``CACHE_BYTES`` of them, and clearing it gives the heap back."""
    backend.clear()
    gc.collect()
    return_freed_memory()
    idle = _rss_mb()
    for i in range(6):
        spec = _const(100 + i, 120_000)
        m = backend.compile(spec, spec)
        del m  # the request ends
    return_freed_memory()  # as the engine core does when it goes idle
    held = _rss_mb() - idle
    assert backend.num_cached == 1 and held < backend_mod.CACHE_BYTES / 2**20 + 16, held
    backend.clear()
    gc.collect()
    assert _rss_mb() - idle < max(0.1 * idle, 24), (idle, _rss_mb())


def test_the_core_compile_thread_survives_what_crashes_an_8_mib_stack(smollm2_dir):
    """Defence in depth: a 3,000-long ``$ref`` chain (past the front end's limits, sent straight to
    the core) overflows an 8 MiB stack; on the core's grammar thread it compiles. Run in a child
    process: without the large stack it dies of SIGSEGV."""
    code = (
        "import sys, threading\n"
        "from llguidance import LLMatcher\n"
        "from pagedllm.structured_output.manager import StructuredOutputManager\n"
        "n = 3000\n"
        "defs = {f'd{i}': {'$ref': f'#/$defs/d{i + 1}'} for i in range(n)}\n"
        "defs[f'd{n}'] = {'type': 'integer'}\n"
        "spec = LLMatcher.grammar_from_json_schema({'$defs': defs, '$ref': '#/$defs/d0'})\n"
        f"m = StructuredOutputManager({str(smollm2_dir)!r}, 0, set())\n"
        "matcher = m._executor.submit(lambda: m.backend.compile('k', spec)).result()\n"
        "assert threading.stack_size() == 0  # restored for every other thread\n"
        "print('compiled', not matcher.is_error())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled True" in done.stdout, (done.returncode, done.stderr[-2000:])
    assert CHILD_STACK_BYTES <= COMPILE_STACK_BYTES == 256 << 20  # what the validator passes, the core compiles

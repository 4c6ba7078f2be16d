"""The grammar backend: llguidance over the model's tokenizer.

Why llguidance (pinned in ``pyproject.toml``) rather than xgrammar: its Rust core drops
the GIL while it compiles and while it computes masks (about 60 µs a row for JSON on
SmolLM2's 49k vocabulary, measured), so neither stalls the step loop's threads; it reads
JSON Schema, Rust regexes, Lark and (converted) GBNF, and structural tags, in one wheel with
no torch or CUDA build coupling (xgrammar's wheels are built against particular torch
versions); and its matchers roll back and copy cheaply (``deep_copy`` ~20 µs), which the
compile cache relies on.

Masks are llguidance's token bitmasks: ``[R, ceil(V / 32)]`` int32, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from pagedllm.memory import return_freed_memory

CACHE_SIZE = 256  # compiled grammars kept (LRU); a matcher template is small next to a KV block
# ... and their estimated bytes: a template that has built its first mask holds lexer states of
# 100-400 bytes per byte of its spec (measured with llguidance 1.9.1: a 250 KB ``const`` 78 MB, 20,000
# Lark alternatives 23 MB for 229 KB, a 145-byte schema nothing measurable), so 512 per spec byte
# overestimates; a template over the budget alone is not kept at all
CACHE_BYTES = 64 << 20
BYTES_PER_SPEC_BYTE = 512
ENTRY_OVERHEAD_BYTES = 64 << 10


def estimate_bytes(spec: str) -> int:
    """Estimated heap bytes of a compiled (and warmed: first mask built) matcher of ``spec``."""
    return ENTRY_OVERHEAD_BYTES + BYTES_PER_SPEC_BYTE * len(spec)


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to ``-inf``, in place, on the logits' device.

    On the CPU in float32 with the C kernels built this is one pass over the masked rows
    (``kernels.cpu.apply_bitmask_``); elsewhere numpy's ``unpackbits`` (CPU) or torch bit
    operations (any device) expand the mask first.

    Args:
        logits: ``[N, V]`` float32 logits, rows contiguous.
        rows: the ``R`` rows of ``logits`` to mask.
        bitmask: ``[R, W]`` int32 in llguidance's layout (``32 * W`` tokens; tokens at or past
            ``32 * W`` are disallowed).
    """
    from pagedllm.kernels import cpu as cpu_kernels
    vocab, dev = logits.shape[1], logits.device
    if dev.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1 and cpu_kernels.available():
        cpu_kernels.apply_bitmask_(logits, torch.tensor(rows, dtype=torch.int64), bitmask.contiguous())
        return
    if dev.type == "cpu":
        import numpy as np
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)
    else:
        shifts = torch.arange(32, device=dev, dtype=torch.int32)
        allowed = ((bitmask.to(dev, non_blocking=True).unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(len(rows), vocab - allowed.shape[1])], 1)
    sel = torch.tensor(rows, device=dev)
    logits.index_copy_(0, sel, logits.index_select(0, sel).masked_fill_(~allowed[:, :vocab], float("-inf")))


class GuidanceBackend:
    """Compiles grammar specs into llguidance matchers over one tokenizer.

    Args:
        tokenizer: the model's fast ``transformers`` tokenizer.
        vocab_size: the model's vocabulary (logits width); masks cover this many tokens.
        eos_token_ids: tokens that end the output; a grammar in an accepting state allows them.
        trim: gives freed heap back to the system (default ``pagedllm.memory.return_freed_memory``).
    Raises:
        ValueError: a slow (Python-only) tokenizer, which llguidance cannot read.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], trim=None) -> None:
        import llguidance.hf
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("structured outputs need a fast (tokenizers) tokenizer")
        n_vocab = max(vocab_size, len(tokenizer))
        eos = sorted(eos_token_ids) or [tokenizer.eos_token_id]
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
        self.eos_token_ids = frozenset(eos)  # what ends every grammar
        self.vocab_size = n_vocab
        self._cache: OrderedDict[str, tuple[object, int]] = OrderedDict()  # key -> (template, estimated bytes)
        self.cache_bytes = 0  # estimated bytes of the cached templates
        self._lock = threading.Lock()  # the cache is shared by the compile thread and the front end
        self._trim = trim or return_freed_memory
        self.num_compiled = 0

    def validate(self, spec: str) -> str | None:
        """Check a grammar spec against the tokenizer (llguidance's ``validate_grammar``: it does not
        build the matcher, so a few grammars pass it and fail in ``compile``; the server checks with
        ``validator.GrammarValidator`` instead); returns the error text, or ``None``."""
        from llguidance import LLMatcher
        err = LLMatcher.validate_grammar(spec, self.ll_tokenizer)
        return err or None

    def compile(self, key: str, spec: str):
        """A fresh matcher of ``spec`` (at its start state); compiled once per ``key``, then copied.

        The template's first token mask is built here (on the compile thread) so that a grammar that
        fails there fails as a compile error, before the request runs, and the step that first fills
        its mask does not pay for its lexer states. Templates are kept least recently used first out,
        at most ``CACHE_SIZE`` of them and ``CACHE_BYTES`` estimated bytes; freed heap goes back to
        the system after an eviction or a failure.

        Raises:
            ValueError: the grammar does not compile (the message is llguidance's).
        """
        from llguidance import LLMatcher
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry[0].deep_copy()
        template = LLMatcher(self.ll_tokenizer, spec, log_level=0)
        if not template.is_error():
            mask = torch.empty(bitmask_words(self.vocab_size), dtype=torch.int32)
            template.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
        if template.is_error():
            error = template.get_error() or "the grammar compiler reported an error"
            del template
            self._trim()  # a failed compile's lexer states can run to hundreds of MB
            raise ValueError(error)
        size = estimate_bytes(spec)
        evicted = False
        with self._lock:
            self.num_compiled += 1
            if size > CACHE_BYTES:
                return template  # too large to keep: this request's own, freed when it ends
            old = self._cache.pop(key, None)
            self.cache_bytes += size - (old[1] if old else 0)
            self._cache[key] = (template, size)
            while len(self._cache) > CACHE_SIZE or self.cache_bytes > CACHE_BYTES:
                _, (_, dropped) = self._cache.popitem(last=False)
                self.cache_bytes -= dropped
                evicted = True
        if evicted:
            self._trim()
        return template.deep_copy()

    def clear(self) -> None:
        """Drop every cached template and give the freed heap back to the system."""
        with self._lock:
            self._cache.clear()
            self.cache_bytes = 0
        self._trim()

    @property
    def num_cached(self) -> int:
        """Templates in the cache."""
        return len(self._cache)

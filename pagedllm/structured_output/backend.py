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

CACHE_SIZE = 256  # compiled grammars kept (LRU); a matcher template is small next to a KV block


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
    Raises:
        ValueError: a slow (Python-only) tokenizer, which llguidance cannot read.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        import llguidance.hf
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("structured outputs need a fast (tokenizers) tokenizer")
        n_vocab = max(vocab_size, len(tokenizer))
        eos = sorted(eos_token_ids) or [tokenizer.eos_token_id]
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
        self.eos_token_ids = frozenset(eos)  # what ends every grammar
        self.vocab_size = n_vocab
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()  # the cache is shared by the compile thread and the front end
        self.num_compiled = 0

    def validate(self, spec: str) -> str | None:
        """Check a grammar spec against the tokenizer; returns the error text, or ``None`` when it compiles."""
        from llguidance import LLMatcher
        err = LLMatcher.validate_grammar(spec, self.ll_tokenizer)
        return err or None

    def compile(self, key: str, spec: str):
        """A fresh matcher of ``spec`` (at its start state); compiled once per ``key``, then copied.

        Raises:
            ValueError: the grammar does not compile (the message is llguidance's).
        """
        from llguidance import LLMatcher
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
        template = LLMatcher(self.ll_tokenizer, spec, log_level=0)
        if template.is_error():
            raise ValueError(template.get_error())
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template.deep_copy()

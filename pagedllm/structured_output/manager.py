"""The engine core's side of structured outputs: compile grammars off the step loop, keep one
matcher per request, fill each step's token bitmask while the step's forward runs.

Timeline of one step ``N + 1`` (async scheduling; the synchronous mode is the same with no
overlap between steps)::

    execution thread:  [forward N] [mask+sample N] [forward N+1 ............] [mask+sample N+1]
    core thread:       schedule N+1, issue | apply N's tokens (matchers advance) | fill N+1's mask ^

The mask of step ``N + 1`` depends on the token step ``N`` sampled, so it is filled on the
core thread right after step ``N``'s tokens are applied, while step ``N + 1``'s forward runs;
the execution thread waits for it only if filling outlasts the forward. Matchers advance only
in ``Scheduler.update_from_output``, on tokens that are kept (a token computed after a late
stop arrives for a finished request and is dropped, never consumed). A preempted request keeps
its output tokens and is recomputed from them, so its matcher, which has consumed exactly
those tokens, stays right: nothing to roll back.

Follows vLLM's ``StructuredOutputManager`` (grammar compiled on a thread pool, request
waiting for its grammar without holding the queue up, bitmask applied before sampling).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from pagedllm.structured_output.backend import GuidanceBackend, bitmask_words
from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.structured_output.validator import short_error  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)


# the grammar thread's stack: llguidance's compilers recurse along $ref and rule chains, and the
# front end's checks (limits.py, validator.py with an 8 MiB stack) keep far below what this holds;
# only touched pages are committed
COMPILE_STACK_BYTES = 256 << 20


class GrammarState:
    """One request's grammar: compiling (``ready`` False), then a matcher fed the kept tokens.

    Args:
        future: the compile job; its result is a fresh llguidance matcher.
        reasoning_end_tag: the constraint starts after the token that completes this text
            (``None``: from the first token).
        decode: token ids -> bytes (the tokenizer's), to find ``reasoning_end_tag``.
        eos_token_ids: returns the tokens that end the grammar (the backend's; asked in ``fill``,
            which never consumes one: see there).
    """

    def __init__(self, future: Future, reasoning_end_tag: str | None = None, decode=None,
                 eos_token_ids=frozenset) -> None:
        self._future: Future | None = future
        self._eos_token_ids = eos_token_ids
        self.matcher = None
        self.error: str | None = None
        self._end = reasoning_end_tag.encode() if reasoning_end_tag else b""
        self._decode = decode
        self.active = not self._end
        self._tail = b""

    @property
    def ready(self) -> bool:
        """True once compiling has ended (with a matcher, or with ``error`` set)."""
        if self._future is not None:
            if not self._future.done():
                return False
            try:
                self.matcher = self._future.result()
            except Exception as e:  # a grammar the front end let through but llguidance refused
                self.error = str(e) or type(e).__name__
            self._future = None
        return True

    def accept(self, token: int) -> str | None:
        """Advance on one kept output token.

        Returns:
            ``None`` to go on, ``"stop"`` when the grammar has reached its end (nothing more
            can follow), ``"error"`` when the token is not allowed (``error`` says why).
        """
        if not self.active:
            # bytes, not ids: the tag may be split into tokens in more than one way
            self._tail = (self._tail + self._decode([token]))[-(len(self._end) + 64):]
            self.active = self._end in self._tail
            return None
        m = self.matcher
        if not m.consume_token(token) or m.is_error():
            self.error = short_error(m.get_error() or f"token {token} is not allowed by the grammar")
            return "error"
        return "stop" if m.is_stopped() else None

    @property
    def constraining(self) -> bool:
        """True when the next token is judged by the grammar (compiled, no error, past the reasoning)."""
        return self.active and self.error is None and self.matcher is not None

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the grammar allows after the kept tokens (the matcher
        is left as it was)."""
        if not drafts or not self.constraining:
            return []
        return drafts[:self.matcher.validate_tokens(drafts)]

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int] = ()) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``[W]`` int32; all allowed while
        the reasoning runs or after an error) and, with draft tokens scheduled after the kept ones,
        the allowed tokens after each draft into the next ``len(drafts)`` rows: row ``row + j`` is
        the mask after drafts ``0 .. j - 1``. The matcher consumes the grammar-valid drafts for that
        and is rolled back, so it still holds exactly the kept tokens. Rows after the first draft
        the grammar refuses are all-allowed: that draft's masked probability is 0, so verification
        rejects it and never reads them."""
        if not self.constraining:
            bitmask[row:row + 1 + len(drafts)].fill_(-1)
            return
        m = self.matcher
        n = m.validate_tokens(list(drafts)) if drafts else 0
        # a draft EOS is judged by its row but never consumed: llguidance's rollback does not undo
        # the stop it causes (the matcher then refused the kept tokens' next one), and no row after
        # it is read (the request ends there)
        eos = self._eos_token_ids()
        n = next((i for i, t in enumerate(drafts[:n]) if t in eos), n)
        for j in range(n + 1):
            if j:
                m.consume_token(drafts[j - 1])
            v = bitmask[row + j]
            m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        if n:
            m.rollback(n)
        bitmask[row + n + 1:row + 1 + len(drafts)].fill_(-1)


class GrammarMask:
    """The token bitmask of one step's constrained rows, filled by the core thread and waited
    for by the execution thread before it samples.

    Attributes:
        rows: ``G`` indices of the constrained requests among the step's sampled requests.
        req_ids: their request ids.
        drafts: their draft tokens scheduled this step (``[]``: none), ``G`` lists.
        bitmask: ``[sum(1 + len(drafts[g])), W]`` int32 once published: each request's rows in
            order, one per logits row it has (its token, then one after each draft).
    """

    def __init__(self, rows: list[int], req_ids: list[str], drafts: list[list[int]] | None = None) -> None:
        self.rows, self.req_ids = rows, req_ids
        self.drafts = drafts if drafts is not None else [[] for _ in rows]
        self.bitmask: torch.Tensor | None = None
        self._ready = threading.Event()

    def publish(self, bitmask: torch.Tensor | None) -> None:
        """Hand the filled mask to the sampler (``None``: apply none)."""
        self.bitmask = bitmask
        self._ready.set()

    def wait(self) -> torch.Tensor | None:
        """Block until published; the mask (``None``: none)."""
        self._ready.wait()
        return self.bitmask


class StructuredOutputManager:
    """Compiles grammars on one worker thread (cached by grammar hash; a ``COMPILE_STACK_BYTES``
    stack) and fills step masks.

    The tokenizer is loaded, and llguidance's view of it built (about 0.4 s), on that thread
    when the first constrained request arrives, so an engine that never sees one pays nothing.

    Args:
        tokenizer_path: the model's tokenizer (directory or name ``AutoTokenizer`` reads).
        vocab_size: the model's logits width.
        eos_token_ids: the tokens that end a sequence.
    """

    def __init__(self, tokenizer_path, vocab_size: int, eos_token_ids: set[int]) -> None:
        self._path, self._vocab, self._eos = tokenizer_path, vocab_size, set(eos_token_ids)
        self._executor = ThreadPoolExecutor(1, "pagedllm-grammar")
        # the pool starts its one thread on the first submit: start it now, with the large stack
        # (``threading.stack_size`` applies to threads started while it is set)
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            self._executor.submit(int).result()
        finally:
            threading.stack_size(previous)
        self._backend: GuidanceBackend | None = None
        self._pending: set[Future] = set()

    @property
    def backend(self) -> GuidanceBackend:
        """The backend (built on first use; call from the compile thread)."""
        if self._backend is None:
            from transformers import AutoTokenizer
            self._backend = GuidanceBackend(AutoTokenizer.from_pretrained(self._path), self._vocab, self._eos)
        return self._backend

    def _compile(self, params: StructuredOutputsParams):
        return self.backend.compile(params.grammar_key(), params.grammar_spec())

    def submit(self, params: StructuredOutputsParams) -> GrammarState:
        """Start compiling a request's grammar; the request waits until ``state.ready``."""
        future = self._executor.submit(self._compile, params)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return GrammarState(future, params.reasoning_end_tag, self._decode, lambda: self.backend.eos_token_ids)

    def _decode(self, token_ids: list[int]) -> bytes:
        return self.backend.ll_tokenizer.decode_bytes(token_ids)

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until some pending compile ends (for a core with
        nothing else to run, instead of spinning)."""
        pending = list(self._pending)
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def fill(self, mask: GrammarMask, states: dict[str, GrammarState]) -> torch.Tensor:
        """The int32 bitmask of a step's constrained rows (``GrammarMask.bitmask``'s layout); a
        request gone (finished while the step ran) gets all-allowed rows, as its tokens will be dropped."""
        words = bitmask_words(self._backend.vocab_size if self._backend else self._vocab)
        bitmask = torch.empty((sum(1 + len(d) for d in mask.drafts), words), dtype=torch.int32)
        row = 0
        for rid, drafts in zip(mask.req_ids, mask.drafts):
            state = states.get(rid)
            if state is None or not state.ready:
                bitmask[row:row + 1 + len(drafts)].fill_(-1)
            else:
                state.fill(bitmask, row, drafts)
            row += 1 + len(drafts)
        return bitmask

    def shutdown(self) -> None:
        """Stop the compile thread (pending compiles are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

"""The grammar validator's child process: compiles grammar specs as the engine core does and says
whether they work. Run as a script by ``validator.GrammarValidator``; it imports only llguidance and
the standard library (no torch, no pagedllm), so it starts in under a second.

Protocol, one JSON object per line: the parent sends ``{"tokenizer", "n_vocab", "eos"}`` first (the
fast tokenizer's JSON, as ``llguidance.hf.from_tokenizer`` reads it) and gets ``{"ready": true}``;
then for each ``{"spec"}`` it gets ``{"error": text or null}``. End of input ends the process, so it
never outlives its parent. A stack overflow kills only this process: the parent takes that, and a
timeout (it kills this process then), as a refusal of the grammar.
"""

import ctypes
import json
import os
import sys
import threading

# the parent passes its limit: at most the engine core's compile thread stack, so a grammar that
# compiles here compiles there
STACK_BYTES = int(sys.argv[1]) if len(sys.argv) > 1 else 8 << 20


def _trim() -> None:
    """Give freed heap pages back (a large grammar's lexer states run to hundreds of MB)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def check(tokenizer, spec: str, mask):
    """Build the matcher of ``spec`` and its first token mask, as the core does (the core's compile
    thread builds both); llguidance's error text, or ``None``."""
    from llguidance import LLMatcher
    m = LLMatcher(tokenizer, spec, log_level=0)
    if m.is_error():
        return m.get_error() or "the grammar compiler reported an error"
    # some grammars compile and fail only here (an empty language: "start: start")
    m.unsafe_compute_mask_ptr(ctypes.addressof(mask), ctypes.sizeof(mask))
    if m.is_error():
        first = ((m.get_error() or "").strip().splitlines() or ["empty"])[0]
        return f"no output can match it (its first token mask failed: {first})"
    return None


def serve(inp, out) -> None:
    """Answer requests from ``inp`` on ``out`` until ``inp`` ends."""
    hello = json.loads(inp.readline() or "null")
    if hello is None:
        return
    from llguidance import LLTokenizer
    tokenizer = LLTokenizer(hello["tokenizer"], n_vocab=hello["n_vocab"], eos_token=hello["eos"] or None)
    mask = (ctypes.c_int32 * ((tokenizer.vocab_size + 31) // 32))()
    del hello
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in inp:
        try:
            error = check(tokenizer, json.loads(line)["spec"], mask)
        except Exception as e:  # an API misuse, not the grammar's: say so rather than die
            error = f"{type(e).__name__}: {e}"
        out.write(json.dumps({"error": error}) + "\n")
        out.flush()
        _trim()


def main() -> None:
    """Serve on stdin / stdout from a thread with a ``STACK_BYTES`` stack."""
    # the protocol gets its own copy of stdout; anything else printed goes to stderr
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    threading.stack_size(STACK_BYTES)
    try:  # a hostile grammar's seconds of compiling must not slow the engine's steps beside it
        os.nice(10)
    except OSError:
        pass
    worker = threading.Thread(target=serve, args=(sys.stdin, out), name="grammar-check")
    worker.start()
    worker.join()


if __name__ == "__main__":
    # run as a script: its folder on sys.path[0] must not shadow anything the child imports
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    main()

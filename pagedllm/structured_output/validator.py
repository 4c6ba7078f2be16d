"""Checking that a grammar compiles, in a child process, with a timeout.

A grammar can crash llguidance's compiler (a stack overflow on deep ``$ref`` or rule chains kills
the whole process), take seconds to compile, or compile and fail only at its first token mask
(``LLMatcher.validate_grammar`` accepts ``start: start``; the core's matcher then refuses every
token). So the front end checks each new grammar in a long-lived child process
(``_validator_child.py``) that builds the matcher and its first mask exactly as the engine core
does: what passes here works there, and a grammar that crashes or outlasts ``CHECK_TIMEOUT_S``
costs only the child, which is started again for the next check. The child is started on the
first check (under a second: llguidance reads the tokenizer) and ends with its parent.

The child's compile thread has a ``CHILD_STACK_BYTES`` stack, no larger than the core's grammar
thread (``manager.COMPILE_STACK_BYTES``), so a grammar that fits here fits there.
"""

from __future__ import annotations

import copy
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref

CHECK_TIMEOUT_S = 5.0  # CPU seconds of one grammar's compile and first mask; real schemas take milliseconds
# the same check's wall-clock bound: the child is niced, so on a busy machine its CPU seconds come
# slowly; timing CPU rather than wall time keeps a loaded server from refusing grammars that fit
WALL_TIMEOUT_FACTOR = 12
START_TIMEOUT_S = 120.0  # the child's start (llguidance reads the tokenizer: ~0.5 s, more on a loaded machine)
CHILD_STACK_BYTES = 8 << 20  # glibc's default thread stack: the smallest any core thread has
# the child is replaced after a check that leaves it above this (it idles at ~60 MB with SmolLM2's
# tokenizer and settles near 140 MB after 250 KB literals, so only a leak or a huge vocabulary gets here)
CHILD_MAX_RSS_BYTES = 1 << 30
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_validator_child.py")


class ValidatorUnavailable(RuntimeError):
    """The child process could not be started (a server fault, not the request's)."""


def tokenizer_json(tokenizer) -> str:
    """The fast tokenizer's JSON (padding and truncation off), what llguidance builds its view from
    (as ``llguidance.hf.from_tokenizer`` does).

    Raises:
        ValueError: a slow (Python-only) tokenizer, which llguidance cannot read.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("structured outputs need a fast (tokenizers) tokenizer")
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def short_error(text: str) -> str:
    """llguidance's error line out of its (multi-line, state-dumping) error text, at most 500 characters."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    found = next((ln for ln in lines if ln.startswith("Error:")), lines[0] if lines else text)
    return found[:500]


def _stop(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    """End the child (after ``grace_s`` for one already dying, so its own exit status is kept)."""
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has used (0 where ``/proc`` cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return 0.0


def _rss_bytes(pid: int) -> int:
    """Resident bytes of process ``pid`` (0 where ``/proc`` cannot tell)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _signal_name(proc: subprocess.Popen) -> str:
    code = proc.returncode
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


class GrammarValidator:
    """Compiles grammar specs in a child process; thread-safe (one check at a time).

    Args:
        tokenizer: the model's fast ``transformers`` tokenizer.
        vocab_size: the model's logits width (masks cover ``max(vocab_size, len(tokenizer))`` tokens,
            as ``backend.GuidanceBackend``'s).
        eos_token_ids: the tokens that end a sequence (empty: the tokenizer's).
        timeout_s: CPU seconds one check may take before the child is killed (``CHECK_TIMEOUT_S``;
            wall time is bounded at ``WALL_TIMEOUT_FACTOR`` times that).
    Raises:
        ValueError: a slow tokenizer.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=(), timeout_s: float = CHECK_TIMEOUT_S) -> None:
        eos = list(eos_token_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self._hello = {"tokenizer": tokenizer_json(tokenizer), "n_vocab": max(vocab_size, len(tokenizer)),
                       "eos": eos}
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self.num_restarts = 0  # children started again after a crash or a timeout
        self._finalizer = weakref.finalize(self, lambda: None)

    def check(self, spec: str) -> str | None:
        """Compile ``spec`` in the child: ``None`` when it works, else why not (llguidance's error
        line, or that it crashed the compiler or took longer than ``timeout_s``).

        Raises:
            ValidatorUnavailable: the child could not be started.
        """
        with self._lock:
            proc = self._start()
            try:
                proc.stdin.write(json.dumps({"spec": spec}).encode() + b"\n")
                proc.stdin.flush()
            except OSError:
                pass  # it died: the read below says how
            line = self._read_line(proc, self.timeout_s * WALL_TIMEOUT_FACTOR, cpu_budget_s=self.timeout_s)
            if line:
                error = json.loads(line)["error"]
                if _rss_bytes(proc.pid) > CHILD_MAX_RSS_BYTES:
                    self._drop(proc)  # the next check starts a fresh one
                return None if error is None else short_error(error)
            timed_out = line is None  # b"": its output ended, it died
            self._drop(proc, 0.0 if timed_out else 5.0)
            self.num_restarts += 1
            if timed_out:
                return (f"too complex: compiling it took more than {self.timeout_s:g} s of CPU time; simplify it (fewer "
                        "alternatives, shorter literals and repetitions)")
            return (f"too deep or complex to compile: it crashed the grammar compiler ({_signal_name(proc)}); "
                    "simplify it (fewer nested or chained $ref / rule levels)")

    def close(self) -> None:
        """Stop the child (the next check starts another)."""
        with self._lock:
            if self._proc is not None:
                self._drop(self._proc)

    @property
    def pid(self) -> int | None:
        """The running child's process id, or ``None``."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _drop(self, proc: subprocess.Popen, grace_s: float = 0.0) -> None:
        _stop(proc, grace_s)
        self._proc, self._buf = None, b""
        self._finalizer.detach()

    def _start(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:  # it died between checks
            self._drop(self._proc)
            self.num_restarts += 1
        try:
            proc = subprocess.Popen([sys.executable, _CHILD, str(CHILD_STACK_BYTES)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        except OSError as e:
            raise ValidatorUnavailable(f"cannot start the grammar validator: {e}") from None
        self._buf = b""
        try:
            proc.stdin.write(json.dumps(self._hello).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            pass
        if not self._read_line(proc, START_TIMEOUT_S):
            _stop(proc)
            raise ValidatorUnavailable(f"the grammar validator did not start ({_signal_name(proc)})")
        self._proc = proc
        # a child still running when this validator goes (or the interpreter exits) is stopped
        self._finalizer = weakref.finalize(self, _stop, proc)
        return proc

    def _read_line(self, proc: subprocess.Popen, timeout_s: float, cpu_budget_s: float | None = None) -> bytes | None:
        """The child's next line; ``b""`` when its output ended (it died), ``None`` when ``timeout_s``
        seconds passed or the child spent more than ``cpu_budget_s`` CPU seconds on it."""
        deadline = time.monotonic() + timeout_s
        cpu_start = _cpu_seconds(proc.pid) if cpu_budget_s is not None else 0.0
        fd = proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not select.select([fd], [], [], min(left, 0.1))[0]:
                if cpu_budget_s is not None and _cpu_seconds(proc.pid) - cpu_start > cpu_budget_s:
                    return None
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

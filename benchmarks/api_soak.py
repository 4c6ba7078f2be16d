"""API soak test: many mixed, concurrent OpenAI-SDK requests against ``pagedllm serve``, every answer checked.

What it does
    Starts ``python -m pagedllm.cli serve`` on a free port (or uses ``--url`` of a
    running server) and sends ``--num-requests`` requests (default 200) through
    the ``openai`` SDK's ``AsyncOpenAI`` at ``--concurrency`` (default 16). The
    mix is drawn from ``random.Random(--seed)``, so two runs send the same requests:

    * ``/v1/chat/completions`` and ``/v1/completions``, streamed or not (streams
      with and without ``stream_options.include_usage``), ``n`` in {1, 2, 3};
    * logprobs on or off (chat: ``logprobs=True`` with ``top_logprobs`` 0..3;
      completions: ``logprobs`` 0..3, sometimes with ``echo``);
    * ``temperature`` 0 (greedy) or 0.8 with a ``seed``, ``max_tokens`` 8..32,
      some with ``stop`` strings;
    * about ``--invalid-fraction`` (10%) invalid requests of varied kinds
      (``temperature`` -1, ``top_p`` 2, ``n`` 0, ``top_logprobs`` 25, an unknown
      model, a prompt longer than the context, ``presence_penalty`` 5, empty
      ``messages``, ...), each with the HTTP status and error ``param`` expected.

Checks ("answered correctly")
    * A valid request gets 200 and a well-formed answer: exactly ``n`` choices with
      indices 0..n-1; ``finish_reason`` in {stop, length}; no stop string in the
      generated text; with logprobs, one entry per generated token, exactly
      ``top_logprobs`` alternatives (chat), tokens that join to the text (chat:
      ``"".join(token) == content``; completions: ``"".join(tokens) == text``,
      echo included) and ``usage.completion_tokens`` equal to the number of
      tokens the logprobs count; ``length`` endings have ``max_tokens`` tokens.
      A stream must also be well-formed as a stream: every chunk of the right
      ``object`` and ``id``, every index gets exactly one chunk with a non-null
      ``finish_reason`` and nothing after it, the usage chunk (only with
      ``include_usage``) comes last with no choices. The assembled stream then
      goes through the same checks as a non-streamed answer.
    * An invalid request gets the expected 4xx (``openai.BadRequestError`` or
      ``openai.NotFoundError``) whose error body names the expected ``param``.
    * Greedy requests are first sent once each, alone (the "reference pass");
      the concurrent answers are compared with these (text and finish_reason
      of every choice). Batching changes float rounding, so a mismatch is
      reported, not counted as a failure.
    * After the run, ``GET /stats`` must show ``num_running`` 0, ``num_waiting``
      0 and ``num_free_blocks == num_blocks`` within 5 s (the KV pool is back
      at its starting state).

Reported: counts, wall time, requests/s, latency p50/p99/mean of valid requests
(end to end, s), TTFT p50/p99 of streamed valid requests (first chunk carrying
generated text), output tokens/s (the server's ``num_generation_tokens`` over the
concurrent phase), the greedy/reference match and the pool check. A table is
printed and JSON is written to ``benchmarks/results/api_soak-<date>.json`` (or
``--json-out``). The exit status is 1 when any valid request failed (reference
pass included), any invalid one was not refused correctly, or the pool check
failed; 2 when the server could not be started.

Usage: python benchmarks/api_soak.py [--num-requests 200 --concurrency 16 --seed 0
       --url http://127.0.0.1:8000 --json-out PATH]. The client runs on the same
CPUs as a server it starts; latencies need an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from openai import AsyncOpenAI

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one paragraph.",
    "List three fruits that are red.",
    "How do I boil an egg?",
    "Tell me a short story about a robot who learns to paint.",
    "What is 12 times 7?",
    "Give me two tips for learning a new language.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the primary colors?",
]
SYSTEM_PROMPT = "You are a concise assistant. Answer briefly."
COMPLETION_PROMPTS = [
    "Hi",  # a one-token prompt: echo + logprobs must still list it (null logprob)
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n",
    "The three laws of thermodynamics are",
    "Paris is the capital of",
    "In 1969, the first humans",
    "A recipe for pancakes:\n1.",
    "The most important thing about software testing is",
    "Dear Sir or Madam,\n",
    "Photosynthesis is the process by which",
    "Caf\u00e9 cr\u00e8me and na\u00efve r\u00e9sum\u00e9 are words that",
    "1, 2, 3, 4,",
]
STOP_STRINGS = ["\n", ".", "!", " and", ","]
FINISH_REASONS = {"stop", "length"}

# invalid kinds: (name, endpoints it applies to, expected HTTP status, expected param or {endpoint: param})
INVALID_KINDS = [
    ("temperature=-1", ("chat", "completion"), 400, "temperature"),
    ("top_p=2", ("chat", "completion"), 400, "top_p"),
    ("n=0", ("chat", "completion"), 400, "n"),
    ("top_logprobs=25", ("chat",), 400, "top_logprobs"),
    ("unknown model", ("chat", "completion"), 404, "model"),
    ("prompt too long", ("chat", "completion"), 400, {"chat": "messages", "completion": "prompt"}),
    ("presence_penalty=5", ("chat", "completion"), 400, "presence_penalty"),
    ("empty messages", ("chat",), 400, "messages"),
    ("logprobs=21", ("completion",), 400, "logprobs"),
    ("max_tokens past context", ("chat", "completion"), 400, "max_tokens"),
    ("frequency_penalty=-3", ("chat", "completion"), 400, "frequency_penalty"),
    ("stream_options without stream", ("chat", "completion"), 400, "stream_options"),
    ("unknown role", ("chat",), 400, "messages[0].role"),
    ("top_logprobs without logprobs", ("chat",), 400, "top_logprobs"),
    ("empty prompt", ("completion",), 400, "prompt"),
    ("logit_bias=500", ("chat", "completion"), 400, "logit_bias"),
    ("max_tokens=0", ("completion",), 400, "max_tokens"),
    ("top_k=-5", ("chat", "completion"), 400, "top_k"),
    ("min_p=2", ("chat", "completion"), 400, "min_p"),
]


@dataclass
class Case:
    """One request of the mix: what is sent and what is expected back."""

    idx: int
    endpoint: str                  # "chat" or "completion"
    kwargs: dict                   # keyword arguments of ``client.<endpoint>.create``
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    logprobs: bool = False
    top: int = 0                   # chat top_logprobs / completions logprobs
    echo: bool = False
    temperature: float = 0.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    prompt: str = ""               # completions: the prompt text (for echo checks)
    invalid: str | None = None     # name of the invalid kind, None for a valid request
    expect_status: int | None = None
    expect_param: str | None = None

    @property
    def greedy(self) -> bool:
        """True for a valid temperature-0 request (it takes part in the reference pass)."""
        return self.invalid is None and self.temperature == 0

    def describe(self) -> str:
        """A short label such as ``chat stream n=2 lp=3 T=0.8``."""
        if self.invalid:
            return f"{self.endpoint} invalid[{self.invalid}]{' stream' if self.stream else ''}"
        bits = [self.endpoint, "stream" + ("+usage" if self.include_usage else "") if self.stream else "plain",
                f"n={self.n}", f"lp={self.top}" if self.logprobs else "lp=off", f"T={self.temperature}",
                f"max={self.max_tokens}"]
        if self.echo:
            bits.append("echo")
        if self.stop:
            bits.append(f"stop={self.stop!r}")
        return " ".join(bits)


@dataclass
class Result:
    """Outcome of one request."""

    case: Case
    ok: bool
    errors: list[str]
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int | None = None
    answer: list[tuple[str, str]] | None = None   # (text, finish_reason) per choice, for the reference check
    logprob_values: list[list[float]] | None = None


# ---------------------------------------------------------------------------------------------
# the mix

def make_cases(args, max_model_len: int, model_name: str) -> list[Case]:
    """The ``args.num_requests`` requests, drawn from ``random.Random(args.seed)``.

    ``round(num_requests * invalid_fraction)`` of them are invalid, their kinds
    taken in turn from a shuffled ``INVALID_KINDS``, at random positions.
    """
    rng = random.Random(args.seed)
    n_invalid = round(args.num_requests * args.invalid_fraction)
    invalid_at = set(rng.sample(range(args.num_requests), n_invalid))
    kinds = INVALID_KINDS[:]
    rng.shuffle(kinds)
    cases, k = [], 0
    for i in range(args.num_requests):
        if i in invalid_at:
            cases.append(make_invalid(i, kinds[k % len(kinds)], rng, max_model_len, model_name))
            k += 1
        else:
            cases.append(make_valid(i, rng, model_name))
    return cases


def _messages(rng: random.Random) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.3 else []
    return msgs + [{"role": "user", "content": rng.choice(CHAT_PROMPTS)}]


def make_valid(i: int, rng: random.Random, model_name: str) -> Case:
    """A random well-formed request."""
    endpoint = rng.choice(["chat", "completion"])
    stream = rng.random() < 0.5
    c = Case(i, endpoint, {}, stream=stream, include_usage=stream and rng.random() < 0.5, n=rng.choice([1, 2, 3]),
             logprobs=rng.random() < 0.5, top=rng.randint(0, 3), temperature=rng.choice([0.0, 0.8]),
             max_tokens=rng.randint(8, 32))
    if rng.random() < 0.3:
        c.stop = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    kw: dict = {"model": model_name, "max_tokens": c.max_tokens, "n": c.n, "temperature": c.temperature}
    if c.temperature > 0:
        kw["seed"] = rng.randint(0, 2**31 - 1)
    if c.stop:
        kw["stop"] = c.stop if len(c.stop) > 1 or rng.random() < 0.5 else c.stop[0]
    if stream:
        kw["stream"] = True
        if c.include_usage:
            kw["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        kw["messages"] = _messages(rng)
        if c.logprobs:
            kw["logprobs"] = True
            kw["top_logprobs"] = c.top
    else:
        c.prompt = rng.choice(COMPLETION_PROMPTS)
        kw["prompt"] = c.prompt
        c.echo = rng.random() < 0.25
        if c.echo:
            kw["echo"] = True
        if c.logprobs:
            kw["logprobs"] = c.top
    if not c.logprobs:
        c.top = 0
    c.kwargs = kw
    return c


def make_invalid(i: int, kind: tuple, rng: random.Random, max_model_len: int, model_name: str) -> Case:
    """A request that must be refused: a valid base request with one thing wrong."""
    name, endpoints, status, param = kind
    endpoint = rng.choice(endpoints)
    stream = name != "stream_options without stream" and rng.random() < 0.5
    kw: dict = {"model": model_name, "max_tokens": 8, "temperature": 0.0}
    if endpoint == "chat":
        kw["messages"] = _messages(rng)
    else:
        kw["prompt"] = rng.choice(COMPLETION_PROMPTS)
    if stream:
        kw["stream"] = True
    extra: dict = {}
    long_text = " word" * (max_model_len + 16)
    if name == "temperature=-1":
        kw["temperature"] = -1
    elif name == "top_p=2":
        kw["top_p"] = 2
    elif name == "n=0":
        kw["n"] = 0
    elif name == "top_logprobs=25":
        kw.update(logprobs=True, top_logprobs=25)
    elif name == "unknown model":
        kw["model"] = "no-such-model"
    elif name == "prompt too long":
        if endpoint == "chat":
            kw["messages"] = [{"role": "user", "content": long_text}]
        else:
            kw["prompt"] = long_text
    elif name == "presence_penalty=5":
        kw["presence_penalty"] = 5
    elif name == "empty messages":
        kw["messages"] = []
    elif name == "logprobs=21":
        kw["logprobs"] = 21
    elif name == "max_tokens past context":
        kw["max_tokens"] = max_model_len
    elif name == "frequency_penalty=-3":
        kw["frequency_penalty"] = -3
    elif name == "stream_options without stream":
        kw["stream_options"] = {"include_usage": True}
    elif name == "unknown role":
        kw["messages"] = [{"role": "wizard", "content": "hello"}]
    elif name == "top_logprobs without logprobs":
        kw.update(logprobs=False, top_logprobs=2)
    elif name == "empty prompt":
        kw["prompt"] = ""
    elif name == "logit_bias=500":
        kw["logit_bias"] = {"42": 500}
    elif name == "max_tokens=0":
        kw["max_tokens"] = 0
    elif name == "top_k=-5":
        extra["top_k"] = -5
    elif name == "min_p=2":
        extra["min_p"] = 2
    else:
        raise AssertionError(name)
    if extra:
        kw["extra_body"] = extra
    return Case(i, endpoint, kw, stream=stream, invalid=name, expect_status=status,
                expect_param=param[endpoint] if isinstance(param, dict) else param)


# ---------------------------------------------------------------------------------------------
# checks

def _lp_ok(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x <= 1e-4


def _check_common(case: Case, r: dict, obj: str, model_name: str) -> list[str]:
    """Object, model, choices indices, finish reasons, usage arithmetic."""
    errs = []
    if r.get("object") != obj:
        errs.append(f"object is {r.get('object')!r}, expected {obj!r}")
    if r.get("model") != model_name:
        errs.append(f"model is {r.get('model')!r}, expected {model_name!r}")
    choices = r.get("choices") or []
    idx = [c.get("index") for c in choices]
    if len(choices) != case.n:
        errs.append(f"{len(choices)} choices, expected n={case.n}")
    if sorted(i for i in idx if isinstance(i, int)) != list(range(len(choices))) or len(set(idx)) != len(idx):
        errs.append(f"choice indices {idx}, expected 0..{case.n - 1}")
    elif idx != sorted(idx):
        errs.append(f"choices out of order: {idx}")
    for c in choices:
        if c.get("finish_reason") not in FINISH_REASONS:
            errs.append(f"choice {c.get('index')}: finish_reason {c.get('finish_reason')!r}")
    u = r.get("usage")
    if u is not None:
        p, ct, tot = u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens")
        if not all(isinstance(x, int) for x in (p, ct, tot)):
            errs.append(f"usage has non-integer fields: {u}")
        else:
            if tot != p + ct:
                errs.append(f"usage.total_tokens {tot} != prompt {p} + completion {ct}")
            if p < 1:
                errs.append(f"usage.prompt_tokens {p}")
            if not case.n <= ct <= case.n * case.max_tokens:
                errs.append(f"usage.completion_tokens {ct} outside [{case.n}, {case.n * case.max_tokens}]")
            if case.n == 1 and choices and choices[0].get("finish_reason") == "length" and ct != case.max_tokens:
                errs.append(f"finish_reason length after {ct} tokens, max_tokens={case.max_tokens}")
    return errs


def _check_stop_strings(case: Case, i: int, generated: str) -> list[str]:
    return [f"choice {i}: stop string {s!r} in the generated text {generated!r}"
            for s in case.stop if s in generated]


def check_chat(case: Case, r: dict, model_name: str) -> tuple[list[str], int | None]:
    """Check a (possibly assembled) chat completion; returns (errors, completion tokens counted via logprobs)."""
    errs = _check_common(case, r, "chat.completion", model_name)
    counted = 0
    for c in r.get("choices") or []:
        i = c.get("index")
        msg = c.get("message") or {}
        content = msg.get("content")
        if msg.get("role") != "assistant":
            errs.append(f"choice {i}: role {msg.get('role')!r}")
        if not isinstance(content, str):
            errs.append(f"choice {i}: content {content!r} is not a string")
            continue
        errs += _check_stop_strings(case, i, content)
        lp = c.get("logprobs")
        if not case.logprobs:
            if lp is not None:
                errs.append(f"choice {i}: logprobs present though not requested")
            continue
        entries = (lp or {}).get("content")
        if not isinstance(entries, list):
            errs.append(f"choice {i}: logprobs.content missing ({lp!r})")
            continue
        counted += len(entries)
        toks = [e.get("token") for e in entries]
        if not all(isinstance(t, str) for t in toks):
            errs.append(f"choice {i}: non-string logprob tokens")
            continue
        if "".join(toks) != content:
            errs.append(f"choice {i}: logprob tokens join to {''.join(toks)!r}, content is {content!r}")
        if c.get("finish_reason") == "length" and len(entries) != case.max_tokens:
            errs.append(f"choice {i}: finish_reason length after {len(entries)} tokens, max_tokens={case.max_tokens}")
        for j, e in enumerate(entries):
            if not _lp_ok(e.get("logprob")):
                errs.append(f"choice {i} token {j}: logprob {e.get('logprob')!r}")
                break
            if e.get("bytes") != list(e["token"].encode()):
                errs.append(f"choice {i} token {j}: bytes {e.get('bytes')} != utf-8 of {e['token']!r}")
                break
            tops = e.get("top_logprobs")
            if not isinstance(tops, list) or len(tops) != case.top:
                errs.append(f"choice {i} token {j}: {len(tops) if isinstance(tops, list) else tops!r} "
                            f"top_logprobs, expected {case.top}")
                break
            vals = [t.get("logprob") for t in tops]
            if not all(_lp_ok(v) for v in vals) or vals != sorted(vals, reverse=True):
                errs.append(f"choice {i} token {j}: top_logprobs not valid and descending: {vals}")
                break
    u = r.get("usage")
    if case.logprobs and u is not None and isinstance(u.get("completion_tokens"), int) \
            and u["completion_tokens"] != counted:
        errs.append(f"usage.completion_tokens {u['completion_tokens']} != {counted} tokens counted via logprobs")
    return errs, counted if case.logprobs else None


def check_completion(case: Case, r: dict, model_name: str) -> tuple[list[str], int | None]:
    """Check a (possibly assembled) text completion; returns (errors, completion tokens counted via logprobs)."""
    errs = _check_common(case, r, "text_completion", model_name)
    counted = 0
    prompt_tokens = (r.get("usage") or {}).get("prompt_tokens")
    for c in r.get("choices") or []:
        i = c.get("index")
        text = c.get("text")
        if not isinstance(text, str):
            errs.append(f"choice {i}: text {text!r} is not a string")
            continue
        generated = text
        if case.echo:
            if not text.startswith(case.prompt):
                errs.append(f"choice {i}: echo: text does not start with the prompt: {text[:60]!r}")
            generated = text[len(case.prompt):]
        errs += _check_stop_strings(case, i, generated)
        lp = c.get("logprobs")
        if not case.logprobs:
            if lp is not None:
                errs.append(f"choice {i}: logprobs present though not requested")
            continue
        if not isinstance(lp, dict):
            errs.append(f"choice {i}: logprobs missing ({lp!r})")
            continue
        toks, vals, tops, offs = (lp.get(k) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
        if not all(isinstance(x, list) for x in (toks, vals, tops, offs)) or \
                not len(toks) == len(vals) == len(tops) == len(offs):
            errs.append(f"choice {i}: logprobs lists missing or of unequal lengths")
            continue
        if not all(isinstance(t, str) for t in toks):
            errs.append(f"choice {i}: non-string logprob tokens")
            continue
        if "".join(toks) != text:
            errs.append(f"choice {i}: logprob tokens join to {''.join(toks)!r}, text is {text!r}")
        want_offs = [sum(len(t) for t in toks[:j]) for j in range(len(toks))]
        if offs != want_offs:
            errs.append(f"choice {i}: text_offset {offs[:8]}... != running token lengths {want_offs[:8]}...")
        n_gen = len(toks)
        if case.echo:
            if not isinstance(prompt_tokens, int):
                # a stream without usage: the prompt's entries are those up to the prompt text's end
                n_prompt = sum(1 for o in offs if o < len(case.prompt))
            else:
                n_prompt = prompt_tokens
            n_gen -= n_prompt
            if vals and vals[0] is not None:
                errs.append(f"choice {i}: echo: the first prompt token has logprob {vals[0]!r}, expected null")
            vals, tops, gen_from = vals[1:], tops[1:], 1
        else:
            gen_from = 0
        counted += n_gen
        if c.get("finish_reason") == "length" and n_gen != case.max_tokens:
            errs.append(f"choice {i}: finish_reason length after {n_gen} tokens, max_tokens={case.max_tokens}")
        for j, (v, t) in enumerate(zip(vals, tops), start=gen_from):
            if not _lp_ok(v):
                errs.append(f"choice {i} token {j}: logprob {v!r}")
                break
            if not isinstance(t, dict) or not 1 <= len(t) <= case.top + 1 or toks[j] not in t:
                errs.append(f"choice {i} token {j}: top_logprobs {t!r} (expected 1..{case.top + 1} entries "
                            f"including {toks[j]!r})")
                break
    u = r.get("usage")
    if case.logprobs and u is not None and isinstance(u.get("completion_tokens"), int) \
            and u["completion_tokens"] != counted:
        errs.append(f"usage.completion_tokens {u['completion_tokens']} != {counted} tokens counted via logprobs")
    return errs, counted if case.logprobs else None


def assemble_stream(case: Case, chunks: list[dict]) -> tuple[list[str], dict]:
    """Check a stream's structure and assemble it into the shape of a non-streamed answer."""
    errs: list[str] = []
    chat = case.endpoint == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    ids = {ch.get("id") for ch in chunks}
    if len(ids) != 1:
        errs.append(f"{len(ids)} distinct ids in the stream")
    models = {ch.get("model") for ch in chunks}
    bad_obj = {ch.get("object") for ch in chunks} - {obj}
    if bad_obj:
        errs.append(f"chunks with object {sorted(map(str, bad_obj))}, expected {obj!r}")
    text: dict[int, str] = {}
    lps: dict[int, list | dict] = {}
    finish: dict[int, str] = {}
    roles: dict[int, str] = {}
    usage, usage_at = None, None
    for pos, ch in enumerate(chunks):
        if ch.get("usage") is not None:
            if usage is not None:
                errs.append("more than one usage chunk")
            usage, usage_at = ch["usage"], pos
            if ch.get("choices"):
                errs.append("the usage chunk carries choices")
        for c in ch.get("choices") or []:
            i = c.get("index")
            if not isinstance(i, int) or not 0 <= i < case.n:
                errs.append(f"chunk for choice index {i!r}, n={case.n}")
                continue
            if i in finish:
                errs.append(f"choice {i}: chunk after its finish_reason chunk")
            if chat:
                delta = c.get("delta") or {}
                if delta.get("role") is not None:
                    if i in roles or i in text:
                        errs.append(f"choice {i}: role sent again or after content")
                    roles[i] = delta["role"]
                piece = delta.get("content")
            else:
                piece = c.get("text")
            if piece is not None:
                if not isinstance(piece, str):
                    errs.append(f"choice {i}: non-string text piece {piece!r}")
                else:
                    text[i] = text.get(i, "") + piece
            lp = c.get("logprobs")
            if lp is not None:
                if not case.logprobs:
                    errs.append(f"choice {i}: logprobs present though not requested")
                elif chat:
                    lps.setdefault(i, []).extend(lp.get("content") or [])
                else:
                    acc = lps.setdefault(i, {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
                    for k in acc:
                        acc[k].extend(lp.get(k) or [])
            if c.get("finish_reason") is not None:
                finish[i] = c["finish_reason"]
    for i in range(case.n):
        if i not in finish:
            errs.append(f"choice {i}: no chunk with a finish_reason")
        if chat and roles.get(i, "assistant") != "assistant":
            errs.append(f"choice {i}: role {roles[i]!r}")
    if case.include_usage:
        if usage is None:
            errs.append("include_usage: no usage chunk")
        elif usage_at != len(chunks) - 1:
            errs.append("include_usage: the usage chunk is not the last")
    elif usage is not None:
        errs.append("usage chunk without include_usage")
    choices = []
    for i in sorted(set(finish) | set(text)):
        c: dict = {"index": i, "finish_reason": finish.get(i)}
        if chat:
            c["message"] = {"role": roles.get(i, "assistant"), "content": text.get(i, "")}
            c["logprobs"] = {"content": lps.get(i, [])} if case.logprobs else None
        else:
            c["text"] = text.get(i, "")
            c["logprobs"] = lps.get(i, {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                        "text_offset": []}) if case.logprobs else None
        choices.append(c)
    assembled = {"object": "chat.completion" if chat else "text_completion",
                 "model": models.pop() if len(models) == 1 else None, "choices": choices, "usage": usage}
    return errs, assembled


# ---------------------------------------------------------------------------------------------
# running

def _dump(obj) -> dict:
    return obj.model_dump() if hasattr(obj, "model_dump") else dict(obj)


def _answer(case: Case, r: dict) -> tuple[list[tuple[str, str]], list[list[float]] | None]:
    """(text, finish_reason) per choice, and the generated tokens' logprobs per choice (or None)."""
    ans, vals = [], [] if case.logprobs else None
    for c in sorted(r.get("choices") or [], key=lambda c: c.get("index", 0)):
        if case.endpoint == "chat":
            ans.append(((c.get("message") or {}).get("content"), c.get("finish_reason")))
            if vals is not None:
                vals.append([e.get("logprob") for e in ((c.get("logprobs") or {}).get("content") or [])])
        else:
            ans.append((c.get("text"), c.get("finish_reason")))
            if vals is not None:
                tl = (c.get("logprobs") or {}).get("token_logprobs") or []
                vals.append([v for v in tl if v is not None])
    return ans, vals


async def run_case(client: AsyncOpenAI, case: Case, model_name: str) -> Result:
    """Send one request, time it and check the answer (or the refusal)."""
    create = client.chat.completions.create if case.endpoint == "chat" else client.completions.create
    t0 = time.perf_counter()
    ttft = None
    try:
        if case.stream:
            chunks = []
            stream = await create(**case.kwargs)
            async for chunk in stream:
                d = _dump(chunk)
                if ttft is None and any(((c.get("delta") or {}).get("content") if case.endpoint == "chat"
                                         else c.get("text")) for c in d.get("choices") or []):
                    ttft = time.perf_counter() - t0
                chunks.append(d)
            latency = time.perf_counter() - t0
            if case.invalid:
                return Result(case, False, [f"not refused: streamed {len(chunks)} chunks"], latency)
            errs, r = assemble_stream(case, chunks)
        else:
            r = _dump(await create(**case.kwargs))
            latency = time.perf_counter() - t0
            if case.invalid:
                return Result(case, False, ["not refused: answered 200"], latency)
            errs = []
    except openai.APIStatusError as e:
        latency = time.perf_counter() - t0
        if not case.invalid:
            return Result(case, False, [f"HTTP {e.status_code} param={e.param!r}: {e.message[:200]}"], latency)
        errs = []
        if e.status_code != case.expect_status:
            errs.append(f"HTTP {e.status_code}, expected {case.expect_status}: {e.message[:200]}")
        want = openai.NotFoundError if case.expect_status == 404 else openai.BadRequestError
        if not isinstance(e, want):
            errs.append(f"{type(e).__name__}, expected {want.__name__}")
        if e.param != case.expect_param:
            errs.append(f"param {e.param!r}, expected {case.expect_param!r} ({e.message[:160]})")
        return Result(case, not errs, errs, latency)
    except Exception as e:  # connection errors, timeouts, in-band stream errors, SDK parse errors
        return Result(case, False, [f"{type(e).__name__}: {str(e)[:300]}"], time.perf_counter() - t0)
    check = check_chat if case.endpoint == "chat" else check_completion
    errs2, counted = check(case, r, model_name)
    errs += errs2
    usage = r.get("usage") or {}
    tokens = usage.get("completion_tokens") if isinstance(usage.get("completion_tokens"), int) else counted
    ans, vals = _answer(case, r)
    return Result(case, not errs, errs, latency, ttft, tokens, ans, vals)


def _pct(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def get_stats(http: httpx.AsyncClient) -> dict:
    """``GET /stats`` of the server."""
    r = await http.get("/stats")
    r.raise_for_status()
    return r.json()


async def pool_check(http: httpx.AsyncClient, timeout_s: float = 5.0) -> dict:
    """Poll ``/stats`` until nothing runs or waits and every KV block is free (at most ``timeout_s``)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        s = await get_stats(http)
        ok = s.get("num_running") == 0 and s.get("num_waiting") == 0 and s.get("num_free_blocks") == s.get("num_blocks")
        if ok or time.perf_counter() >= deadline:
            return {"ok": ok, **{k: s.get(k) for k in ("num_running", "num_waiting", "num_free_blocks", "num_blocks",
                                                      "kv_cache_usage", "num_preemptions", "max_num_running")}}
        await asyncio.sleep(0.1)


async def soak(args, base_url: str, server_pid: int | None) -> dict:
    """Reference pass, concurrent phase and pool check; returns the JSON report (without machine facts)."""
    http = httpx.AsyncClient(base_url=base_url, timeout=30)
    models = (await http.get("/v1/models")).json()["data"]
    model_name = args.model_name or models[0]["id"]
    max_model_len = models[0].get("max_model_len") or 8192
    cases = make_cases(args, max_model_len, model_name)
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key=args.api_key or "EMPTY", max_retries=0,
                         timeout=args.request_timeout)
    valid = [c for c in cases if not c.invalid]
    print(f"mix: {len(cases)} requests ({len(valid)} valid: "
          f"{sum(c.endpoint == 'chat' for c in valid)} chat / {sum(c.endpoint == 'completion' for c in valid)} "
          f"completions, {sum(c.stream for c in valid)} streamed, {sum(c.greedy for c in valid)} greedy; "
          f"{len(cases) - len(valid)} invalid), model {model_name!r}, max_model_len {max_model_len}", flush=True)

    refs: dict[int, Result] = {}
    ref_wall = 0.0
    if not args.no_reference:
        greedy = [c for c in cases if c.greedy]
        print(f"reference pass: {len(greedy)} greedy requests, one at a time ...", flush=True)
        t0 = time.perf_counter()
        for c in greedy:
            refs[c.idx] = res = await run_case(client, c, model_name)
            if args.verbose or not res.ok:
                print(f"  reference #{c.idx} {c.describe()}: "
                      f"{'ok' if res.ok else 'FAIL ' + '; '.join(res.errors)} ({res.latency_s:.2f} s)", flush=True)
        ref_wall = time.perf_counter() - t0
        print(f"  {ref_wall:.1f} s", flush=True)

    s0 = await get_stats(http)
    cpu0 = _cpu_seconds(server_pid)
    sem = asyncio.Semaphore(args.concurrency)
    done = 0

    async def bounded(c: Case) -> Result:
        nonlocal done
        async with sem:
            res = await run_case(client, c, model_name)
        done += 1
        if args.verbose or not res.ok:
            print(f"  [{done}/{len(cases)}] #{c.idx} {c.describe()}: "
                  f"{'ok' if res.ok else 'FAIL ' + '; '.join(res.errors)} ({res.latency_s:.2f} s)", flush=True)
        elif done % max(1, len(cases) // 10) == 0:
            print(f"  {done}/{len(cases)} done", flush=True)
        return res

    print(f"concurrent phase: {len(cases)} requests at concurrency {args.concurrency} ...", flush=True)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(bounded(c) for c in cases))
    wall = time.perf_counter() - t0
    other_cpu = _other_cpu_share(cpu0, _cpu_seconds(server_pid), wall) if server_pid else None
    pool = await pool_check(http)
    s1 = await get_stats(http)
    await client.close()
    await http.aclose()
    return summarize(args, cases, results, refs, wall, ref_wall, s0, s1, pool, other_cpu, model_name, max_model_len)


def summarize(args, cases, results, refs, wall, ref_wall, s0, s1, pool, other_cpu, model_name, max_model_len) -> dict:
    """Counts, latencies, reference comparison and the per-request records."""
    valid = [r for r in results if not r.case.invalid]
    invalid = [r for r in results if r.case.invalid]
    lat = [r.latency_s for r in valid]  # every valid request, answered correctly or not
    ttft = [r.ttft_s for r in valid if r.case.stream and r.ttft_s is not None]
    ref_failed = [r for r in refs.values() if not r.ok]
    compared = matched = 0
    mismatches, lp_diff = [], 0.0
    for r in valid:
        ref = refs.get(r.case.idx)
        if ref is None or not ref.ok or not r.ok:
            continue
        compared += 1
        if r.answer == ref.answer:
            matched += 1
            for a, b in zip(r.logprob_values or [], ref.logprob_values or []):
                lp_diff = max([lp_diff] + [abs(x - y) for x, y in zip(a, b)])
        else:
            first = next(j for j, (a, b) in enumerate(zip(r.answer, ref.answer)) if a != b)
            mismatches.append({"idx": r.case.idx, "request": r.case.describe(), "choice": first,
                               "concurrent": r.answer[first], "reference": ref.answer[first]})
    gen_tokens = s1.get("num_generation_tokens", 0) - s0.get("num_generation_tokens", 0)
    reasons: dict[str, int] = {}
    for r in valid + ref_failed:
        for e in ([] if r.ok else r.errors):
            key = e.split(":")[0] if e.startswith("choice") else e[:80]
            reasons[key] = reasons.get(key, 0) + 1
    return {
        "model": model_name, "max_model_len": max_model_len,
        "counts": {"requests": len(results), "valid": len(valid), "valid_ok": sum(r.ok for r in valid),
                   "valid_failed": sum(not r.ok for r in valid), "invalid": len(invalid),
                   "invalid_refused_correctly": sum(r.ok for r in invalid),
                   "invalid_not_refused_correctly": sum(not r.ok for r in invalid),
                   "reference_requests": len(refs), "reference_failed": len(ref_failed)},
        "failure_reasons": reasons,
        "wall_s": wall, "reference_pass_wall_s": ref_wall,
        "requests_per_s": len(results) / wall,
        "latency_s": {"p50": _pct(lat, 50), "p99": _pct(lat, 99),
                      "mean": sum(lat) / len(lat) if lat else None},
        "ttft_streamed_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99), "count": len(ttft)},
        "output_tokens_server": gen_tokens, "output_tok_s": gen_tokens / wall,
        "output_tokens_client_usage": sum(r.completion_tokens or 0 for r in valid),
        "other_cpu_share": other_cpu,
        "greedy_vs_reference": {"compared": compared, "identical": matched, "mismatches": mismatches,
                                "max_logprob_abs_diff_when_identical": lp_diff},
        "pool_check": pool,
        "server_stats_after": s1,
        "failures": [{"idx": r.case.idx, "phase": phase, "request": r.case.describe(),
                      "kwargs": _short_kwargs(r.case.kwargs), "errors": r.errors}
                     for phase, rs in (("reference", ref_failed), ("concurrent", results)) for r in rs if not r.ok],
        "requests": [{"idx": r.case.idx, "request": r.case.describe(), "ok": r.ok,
                      "latency_s": round(r.latency_s, 4), "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 4),
                      "completion_tokens": r.completion_tokens} for r in results],
    }


def _short_kwargs(kw: dict) -> dict:
    out = dict(kw)
    for k in ("prompt", "messages"):
        if k in out and len(json.dumps(out[k])) > 200:
            out[k] = json.dumps(out[k])[:200] + "..."
    return out


# ---------------------------------------------------------------------------------------------
# machine facts, CPU accounting, server process

def _cpu_seconds(pid: int | None) -> tuple[float, float]:
    """(non-idle CPU seconds of the whole machine, CPU seconds of this process plus the server ``pid``)."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        tick = os.sysconf("SC_CLK_TCK")
        busy = (sum(v) - v[3] - v[4]) / tick
        t = os.times()
        own = t.user + t.system
        if pid:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            own += (int(f[11]) + int(f[12])) / tick
        return busy, own
    except (OSError, ValueError, IndexError):
        return float("nan"), float("nan")


def _other_cpu_share(c0: tuple[float, float], c1: tuple[float, float], wall: float) -> float:
    """Share of all cores used by processes other than this client and its server during ``wall`` seconds."""
    return max(0.0, ((c1[0] - c0[0]) - (c1[1] - c0[1])) / (wall * (os.cpu_count() or 1)))


def machine_facts() -> dict:
    """CPU, versions (python, torch, transformers, pagedllm and its git commit, openai, httpx), date, load."""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown"
    facts = {"cpu_model": cpu, "cpu_count": os.cpu_count(), "python": platform.python_version(),
             "openai": openai.__version__, "httpx": httpx.__version__}
    for mod in ("torch", "transformers", "pagedllm"):
        try:
            facts[mod] = __import__(mod).__version__
        except ImportError:
            facts[mod] = None
    facts["pagedllm_git"] = _git_describe()
    facts.update(date=datetime.datetime.now().isoformat(timespec="seconds"), loadavg_1_5_15_at_start=os.getloadavg())
    return facts


def _git_describe() -> str | None:
    """Commit of this checkout, with ``-dirty`` when the tree has local changes."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str, Path]:
    """Start ``python -m pagedllm.cli serve`` on a free port and wait for ``/health``.

    Returns:
        (process, base URL, log file path).
    Raises:
        RuntimeError: the server exited or was not healthy within ``args.startup_timeout`` seconds.
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port), "--num-kv-blocks",
           str(args.num_kv_blocks), "--served-model-name", args.model_name or "smollm2", "--max-model-len",
           str(args.max_model_len), "--log-level", "warning", *args.server_arg]
    log = Path(tempfile.mkstemp(prefix="api_soak-server-", suffix=".log")[1])
    print("starting: " + " ".join(cmd) + f"  (log: {log})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parent.parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.perf_counter() + args.startup_timeout
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server not healthy after {args.startup_timeout} s:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server we started, SIGKILL it after 15 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------

def print_report(rep: dict) -> None:
    """The short table."""
    c, lat, tt, g, p = rep["counts"], rep["latency_s"], rep["ttft_streamed_s"], rep["greedy_vs_reference"], \
        rep["pool_check"]

    def f(x, spec=".2f"):
        return "n/a" if x is None else format(x, spec)

    rows = [
        ("valid answered correctly", f"{c['valid_ok']}/{c['valid']}"),
        ("valid failed", str(c["valid_failed"])),
        ("invalid refused correctly", f"{c['invalid_refused_correctly']}/{c['invalid']}"),
        ("reference pass failed", f"{c['reference_failed']}/{c['reference_requests']}"),
        ("greedy identical to reference", f"{g['identical']}/{g['compared']}"),
        ("wall s (concurrent phase)", f(rep["wall_s"])),
        ("requests/s", f(rep["requests_per_s"])),
        ("latency s p50 / p99 / mean", f"{f(lat['p50'])} / {f(lat['p99'])} / {f(lat['mean'])}"),
        (f"TTFT s p50 / p99 ({tt['count']} streamed)", f"{f(tt['p50'])} / {f(tt['p99'])}"),
        ("output tokens (server) / tok/s", f"{rep['output_tokens_server']} / {f(rep['output_tok_s'], '.1f')}"),
        ("other CPU", f(rep["other_cpu_share"], ".0%")),
        ("pool back at its starting state", f"{'yes' if p['ok'] else 'NO'} (free {p['num_free_blocks']}/"
                                            f"{p['num_blocks']}, running {p['num_running']}, "
                                            f"waiting {p['num_waiting']})"),
    ]
    w = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    if rep["failure_reasons"]:
        print("failure reasons:")
        for k, v in sorted(rep["failure_reasons"].items(), key=lambda kv: -kv[1]):
            print(f"  {v:>4} x {k}")
    for m in g["mismatches"][:10]:
        print(f"greedy mismatch #{m['idx']} ({m['request']}) choice {m['choice']}: "
              f"concurrent {m['concurrent']!r} vs reference {m['reference']!r}")
    if rep["other_cpu_share"] is not None and rep["other_cpu_share"] > 0.05:
        print("WARNING: other processes used >5% of the CPUs during the concurrent phase; timings are skewed")


def main() -> int:
    """Parse arguments, start (or reach) the server, run the soak, report; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    ap.add_argument("--invalid-fraction", type=float, default=0.1, help="share of invalid requests")
    ap.add_argument("--url", default=None, help="use this running server (e.g. http://127.0.0.1:8000) "
                                                "instead of starting one")
    ap.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"), help="for a server with --api-key")
    ap.add_argument("--model-name", default=None, help="served model name (default: smollm2 for a started "
                                                       "server, else the first of /v1/models)")
    ap.add_argument("--num-kv-blocks", type=int, default=512, help="started server's --num-kv-blocks")
    ap.add_argument("--max-model-len", type=int, default=1024, help="started server's --max-model-len")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for the started server (repeatable), e.g. --server-arg=--num-threads=2")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--no-reference", action="store_true", help="skip the greedy reference pass")
    ap.add_argument("--verbose", action="store_true", help="print every request's outcome")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    start = time.perf_counter()
    facts = machine_facts()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in facts.items()), flush=True)
    proc = log = None
    if args.url:
        url = args.url.rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
    else:
        try:
            proc, url, log = start_server(args)
        except RuntimeError as e:
            print(f"api_soak: {e}", file=sys.stderr)
            return 2
    try:
        rep = asyncio.run(soak(args, url, proc.pid if proc else None))
    finally:
        if proc is not None:
            stop_server(proc)
    server_log_tail = (log.read_text()[-4000:] or None) if log else None  # the server logs at warning level
    if log:
        log.unlink(missing_ok=True)
    rep.update(benchmark_wall_s=time.perf_counter() - start, loadavg_1_5_15_at_end=os.getloadavg())
    print_report(rep)
    print(f"benchmark wall time: {rep['benchmark_wall_s']:.1f} s")

    out = Path(args.json_out) if args.json_out else (
        Path(__file__).resolve().parent / "results" / f"api_soak-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    server = url if args.url else "started by this script"
    out.write_text(json.dumps({"machine": facts, "args": vars(args), "server": server, **rep,
                               "server_log_tail": server_log_tail}, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    c = rep["counts"]
    failed = (c["valid_failed"] or c["invalid_not_refused_correctly"] or c["reference_failed"]
              or not rep["pool_check"]["ok"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

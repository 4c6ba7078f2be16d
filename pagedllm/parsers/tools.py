"""Tool-call parsers: split the answer part of an output into content and tool calls.

Each parser is a pure function ``parse(text, final) -> ToolSplit`` of the text
so far. In partial mode everything it returns is final: content stops before
anything that could still turn out to be markup, a call appears once its name
is complete, and its arguments grow only by appending. In final mode it
decides the rest (an unterminated call at ``max_tokens`` stays a truncated
call). The streaming parser diffs successive results, so any chunking of the
text gives the same message.

Formats (vLLM's parser names): ``hermes`` (``<tool_call>{json}</tool_call>``),
``json`` (a bare JSON object or array of ``{"name", "arguments"}``, as
Qwen2.5-Coder emits), ``llama3_json`` (``{"name", "parameters"}`` objects
separated by ``;``, optionally after ``<|python_tag|>``), ``mistral``
(``[TOOL_CALLS]`` then a JSON array, or ``name[ARGS]{json}``) and ``pythonic``
(``[f(a=1), g(b="x")]``). gpt-oss's harmony format (``openai``) is in ``harmony.py``.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

from pagedllm.parsers.json_scan import (JSONScanError, decode_string_prefix, scan_object, scan_string,
                                        scan_value, skip_ws)
from pagedllm.parsers.reasoning import held_back

TOOL_PARSERS: dict[str, type["ToolParser"]] = {}


def register_tool_parser(name: str):
    """Class decorator adding a parser to ``TOOL_PARSERS`` under ``name``."""
    def deco(cls):
        TOOL_PARSERS[name] = cls
        cls.name = name
        return cls
    return deco


@dataclass
class CallState:
    """A tool call as decided so far: ``arguments`` may still grow (by appending only)."""

    name: str
    arguments: str


@dataclass
class ToolSplit:
    """Content and calls decided so far."""

    content: str = ""
    calls: list[CallState] = field(default_factory=list)


class _Undecided(Exception):
    """The text seen so far cannot be classified yet (partial mode only)."""


class _NotCalls(Exception):
    """The text is not a call region (it is content)."""


_ARG_KEYS = ("arguments", "parameters")


def _json_call(text: str, start: int) -> tuple[CallState | None, int | None, int | None]:
    """Read one ``{"name": ..., "arguments": ...}`` object at ``text[start] == '{'``.

    Returns:
        ``(call, end, error)``: ``call`` is ``None`` until the name is complete (or when
        the object has none); ``end`` is the index after the object (``None`` while
        open); ``error`` is where the text stopped being JSON (arguments stop there).
    """
    members, end, error = scan_object(text, start)
    name = next((m for m in members if m.key == "name" and m.end is not None), None)
    fname = None
    if name is not None and text[name.start] == '"':
        fname = json.loads(text[name.start:name.end])
    if not isinstance(fname, str):
        return None, end, error
    limit = error if error is not None else len(text)
    args = next((m for m in members if m.key in _ARG_KEYS), None)
    if args is None or args.start is None:
        arguments = "{}" if end is not None else ""
    elif text[args.start] == '"':  # arguments given as a JSON-encoded string
        body_end = args.end - 1 if args.end is not None else limit
        arguments = decode_string_prefix(text[args.start + 1:body_end])
    else:
        arguments = text[args.start:args.end if args.end is not None else limit]
    return CallState(fname, arguments), end, error


class ToolParser:
    """Base class: see the module docstring. Subclasses implement ``parse``.

    Args:
        tools: the request's ``tools`` (OpenAI shape), for parsers that need the names.
    """

    name = ""
    #: True when the format's markers are special tokens: the server keeps them in the text
    needs_special_tokens = False

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []

    def parse(self, text: str, final: bool) -> ToolSplit:
        """Split ``text`` (the answer so far) into content and calls."""
        raise NotImplementedError


def _leading_calls(text: str, final: bool, reader, start: int = 0) -> ToolSplit | None:
    """Driver of formats whose calls open the answer (``json``, ``llama3_json``, ``pythonic``).

    ``reader(text, i, final)`` returns ``(calls, end)`` for the call region starting
    at ``i`` (``end`` ``None`` while open). Before the region is recognised it raises
    ``_Undecided`` (wait) or ``_NotCalls`` (plain content); once recognised it never
    raises. Text after the region is content.

    Returns:
        The split (``content`` holds only the text after the region), or ``None`` when
        ``text[start:]`` is not a call region (or, in partial mode, not yet known to be one).
    """
    i = skip_ws(text, start)
    if i == len(text):
        return None
    try:
        calls, end = reader(text, i, final)
    except (_Undecided, _NotCalls):
        return None
    return ToolSplit("" if end is None else text[end:], calls)


def _check_call_start(text: str, j: int, final: bool, key: str = "name") -> None:
    """At ``text[j] == '{'``: return when the first key is ``key``; raise ``_Undecided`` while
    that is still unknown (partial mode), ``_NotCalls`` when it is not so."""
    k = skip_ws(text, j + 1)
    if k == len(text):
        if final:
            raise _NotCalls
        raise _Undecided
    if text[k] != '"':
        raise _NotCalls
    quoted = json.dumps(key)
    kend = scan_string(text, k)
    if kend is None:
        if not final and quoted.startswith(text[k:]):
            raise _Undecided
        raise _NotCalls
    if text[k:kend] != quoted:
        raise _NotCalls


def _json_calls_from(text: str, j: int, calls: list[CallState], sep: str, close: str | None, final: bool):
    """Read call objects from ``text[j] == '{'`` on. Within a JSON array (``close="]"``) they are
    separated by ``,``; otherwise by any of the characters in ``sep`` or by whitespace alone, and
    the run ends at anything else (which is content). Never raises."""
    while True:
        call, end, error = _json_call(text, j)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls, None  # open, or broken JSON: the rest of the answer stays in the call
        m = skip_ws(text, end)
        if m == len(text):
            return calls, None
        if close is not None and text[m] == close:
            return calls, m + 1
        nxt = m
        if text[m] in sep:
            nxt = skip_ws(text, m + 1)
            if nxt == len(text):
                return calls, None
        elif close is not None:
            return calls, end
        if text[nxt] != "{":
            return calls, end if nxt == m else m + 1
        if close is None:
            try:  # outside an array, a following object continues the run only if it is a call
                _check_call_start(text, nxt, final)
            except _Undecided:
                return calls, None
            except _NotCalls:
                return calls, end
        j = nxt


def _read_json_calls(text: str, i: int, final: bool, sep: str = ","):
    """Calls as a JSON array of objects, or a run of objects separated by whitespace or ``sep``."""
    if text[i] == "[":
        j = skip_ws(text, i + 1)
        if j == len(text):
            if final:
                raise _NotCalls
            raise _Undecided
        if text[j] != "{":
            raise _NotCalls
        _check_call_start(text, j, final)
        return _json_calls_from(text, j, [], ",", "]", final)
    if text[i] != "{":
        raise _NotCalls
    _check_call_start(text, i, final)
    return _json_calls_from(text, i, [], sep, None, final)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, anywhere in the text
    (Hermes 2 Pro, Qwen2.5, Qwen3). A ``</tool_call>`` inside a JSON string does not end a call.
    A ``<tool_call>`` not followed by a JSON object is prose and stays in the content; a block
    whose JSON breaks off is dropped up to its end tag."""

    start_tag, end_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ToolSplit:
        """Split ``text`` (the answer so far) in this format; see ``ToolParser.parse``."""
        out = ToolSplit()
        pos = 0
        while True:
            j = text.find(self.start_tag, pos)
            if j == -1:
                tail = text[pos:]
                out.content += tail if final else tail[:len(tail) - held_back(tail, self.start_tag)]
                return out
            out.content += text[pos:j]
            k = skip_ws(text, j + len(self.start_tag))
            if k == len(text):
                return out  # an opened block with nothing in it yet (dropped if final)
            if text[k] != "{":
                out.content += text[j:k]  # not a call: the tag is prose, and so is what follows
                pos = k
                continue
            call, end, error = _json_call(text, k)
            if call is not None:
                out.calls.append(call)
            if end is None:
                if error is None:
                    return out
                close = text.find(self.end_tag, error)  # broken JSON: the block ends at its end tag
                if close == -1:
                    return out
                pos = close + len(self.end_tag)
                continue
            m = skip_ws(text, end)
            rest = text[m:m + len(self.end_tag)]
            if rest == self.end_tag:
                pos = m + len(self.end_tag)
            elif m + len(rest) == len(text) and self.end_tag.startswith(rest) and not final:
                return out  # the end tag may be arriving
            else:
                pos = end  # no end tag: the object alone ends the call


_FENCE = re.compile(r"```(?:json)?[ \t]*\n")


def _classify(text: str, final: bool, reader) -> ToolSplit:
    """Content, or calls opening the answer, for ``reader``'s format (see ``_leading_calls``)."""
    split = _leading_calls(text, final, reader)
    if split is not None:
        return split
    return ToolSplit(text if final or not _may_open(text, reader) else "")


def _may_open(text: str, reader) -> bool:
    """Partial mode: True while ``text`` could still become a call region."""
    i = skip_ws(text, 0)
    if i == len(text):
        return True
    try:
        reader(text, i, False)
    except _Undecided:
        return True
    except _NotCalls:
        return False
    return True


@register_tool_parser("json")
class JSONToolParser(ToolParser):
    """A bare JSON call object, or an array of them, opening the answer, optionally inside a
    Markdown code fence (```json ... ```), as Qwen2.5-Coder emits them. An object is a call
    when its first key is ``name``; any other JSON answer stays content."""

    def parse(self, text: str, final: bool) -> ToolSplit:
        """Split ``text`` (the answer so far) in this format; see ``ToolParser.parse``."""
        i = skip_ws(text, 0)
        head = text[i:]
        if not (head.startswith("```") or ("```json\n".startswith(head) and head)):
            return _classify(text, final, _read_json_calls)
        m = _FENCE.match(text, i)
        if m is None:
            waiting = not final and re.fullmatch(r"`{1,3}(j(s(on?)?)?)?[ \t]*", head) is not None
            return ToolSplit("" if waiting else text)  # another kind of code block: content
        split = _leading_calls(text, final, _read_json_calls, m.end())
        if split is None:
            waiting = not final and _may_open(text[m.end():], _read_json_calls)
            return ToolSplit("" if waiting else text)
        rest = split.content
        k = skip_ws(rest, 0)
        if rest.startswith("```", k):
            rest = rest[k + 3:]
        elif not final and "```".startswith(rest[k:]):
            rest = ""  # the closing fence may be arriving
        return ToolSplit(rest, split.calls)


@register_tool_parser("llama3_json")
class Llama3JSONToolParser(ToolParser):
    """Llama 3.1+ JSON calls: ``{"name": ..., "parameters": {...}}``, several separated by ``;``,
    optionally after ``<|python_tag|>`` (visible only when special tokens are kept)."""

    tag = "<|python_tag|>"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ToolSplit:
        """Split ``text`` (the answer so far) in this format; see ``ToolParser.parse``."""
        def reader(t: str, i: int, fin: bool):
            if t.startswith(self.tag, i):
                i = skip_ws(t, i + len(self.tag))
                if i == len(t):
                    if fin:
                        return [], None
                    raise _Undecided
            elif self.tag.startswith(t[i:]) and not fin:
                raise _Undecided
            return _read_json_calls(t, i, fin, sep=";")
        return _classify(text, final, reader)


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` then a JSON array of calls (v0.3 tokenizers), or ``[TOOL_CALLS]name[ARGS]{json}``
    per call (v11+). Text before the first marker is content; what follows the calls is dropped.
    The marker is a special token: requests need ``skip_special_tokens: false`` (the server sets it)."""

    marker, args_marker = "[TOOL_CALLS]", "[ARGS]"
    needs_special_tokens = True
    _name = re.compile(r"[A-Za-z_][\w.\-]*")

    def parse(self, text: str, final: bool) -> ToolSplit:
        """Split ``text`` (the answer so far) in this format; see ``ToolParser.parse``."""
        j = text.find(self.marker)
        if j == -1:
            return ToolSplit(text if final else text[:len(text) - held_back(text, self.marker)])
        out = ToolSplit(text[:j])
        pos = j + len(self.marker)
        while True:
            k = skip_ws(text, pos)
            if k == len(text):
                return out
            if text[k] in "[{":
                try:
                    calls, _ = _read_json_calls(text, k, final)
                except (_Undecided, _NotCalls):
                    return out
                out.calls += calls
                return out
            m = self._name.match(text, k)
            if m is None:
                return out
            a = m.end()
            if a == len(text) or not text.startswith(self.args_marker, a):
                return out  # the name or the [ARGS] marker is still arriving (or never will)
            v = skip_ws(text, a + len(self.args_marker))
            call = CallState(m.group(), "")
            out.calls.append(call)
            if v == len(text):
                return out
            try:
                end = scan_value(text, v)
            except JSONScanError as e:
                call.arguments = text[v:e.pos]
                return out
            call.arguments = text[v:end if end is not None else len(text)]
            if end is None:
                return out
            nxt = skip_ws(text, end)
            if not text.startswith(self.marker, nxt):
                return out
            pos = nxt + len(self.marker)


_IDENT = re.compile(r"[A-Za-z_][\w.]*")
_KWARG = re.compile(r"([A-Za-z_]\w*)\s*=(?!=)")


def _scan_python_value(text: str, i: int) -> int | None:
    """End of a Python literal starting at ``i``: the index of the ``,`` or ``)`` that ends it at
    depth 0 (strings skipped), or ``None`` while it may continue."""
    depth, j, n = 0, i, len(text)
    while j < n:
        c = text[j]
        if c in "'\"":
            q = c
            j += 1
            while j < n and text[j] != q:
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                return None
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return j
            depth -= 1
        elif c == "," and depth == 0:
            return j
        j += 1
    return None


def _py_to_json(src: str) -> str:
    """JSON text of a Python literal (``True`` -> ``true``); a non-literal becomes a JSON string of its source."""
    try:
        return json.dumps(ast.literal_eval(src.strip()), ensure_ascii=False)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return json.dumps(src.strip(), ensure_ascii=False)


def _read_pythonic(text: str, i: int, final: bool):
    """``[f(a=1), g(b="x")]``: each call's arguments become a JSON object built one argument
    at a time (positional ones as ``arg0``, ``arg1``...), closed by ``}`` at its ``)``."""
    if text[i] != "[":
        raise _NotCalls
    j = skip_ws(text, i + 1)
    m = _IDENT.match(text, j)
    if j == len(text) or (m is not None and m.end() == len(text)):
        if final:
            raise _NotCalls
        raise _Undecided
    if m is None or text[m.end()] != "(":
        raise _NotCalls
    calls: list[CallState] = []
    while True:  # recognised: from here on, never raise
        m = _IDENT.match(text, j)
        if m is None or m.end() == len(text) or text[m.end()] != "(":
            return calls, None
        call = CallState(m.group(), "{")
        calls.append(call)
        k, npos = m.end() + 1, 0
        while True:
            k = skip_ws(text, k)
            if k == len(text):
                return calls, None
            if text[k] == ")":
                call.arguments += "}"
                k += 1
                break
            km = _KWARG.match(text, k)
            if km:
                key, vstart = km.group(1), km.end()
            else:
                key, vstart = f"arg{npos}", k
                npos += 1
            vend = _scan_python_value(text, vstart)
            if vend is None:
                return calls, None
            sep = "" if call.arguments == "{" else ", "
            call.arguments += sep + json.dumps(key) + ": " + _py_to_json(text[vstart:vend])
            k = vend + 1 if text[vend] == "," else vend
        j = skip_ws(text, k)
        if j == len(text):
            return calls, None
        if text[j] == "]":
            return calls, j + 1
        if text[j] != ",":
            return calls, j
        j = skip_ws(text, j + 1)


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """A Python list of calls opening the answer: ``[get_weather(city="Paris"), f(a=1)]``
    (Llama 3.2 / Llama 4 style). Argument values are Python literals, converted to JSON."""

    def parse(self, text: str, final: bool) -> ToolSplit:
        """Split ``text`` (the answer so far) in this format; see ``ToolParser.parse``."""
        return _classify(text, final, _read_pythonic)


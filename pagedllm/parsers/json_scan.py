"""Scanning JSON that may still be arriving: where values start and end, without rewriting them.

Tool-call arguments are streamed as the model's own JSON text, so the pieces
join to exactly the final arguments. That needs positions (where a value
starts, whether it has ended), not a parse into Python objects: a re-serialised
partial parse (what ``partial-json-parser`` gives) changes spacing and closes
brackets early, which streamed text cannot take back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"


class JSONScanError(ValueError):
    """The text cannot be the start of the JSON expected there; ``pos`` is where it went wrong."""

    def __init__(self, message: str, pos: int) -> None:
        super().__init__(message)
        self.pos = pos


def skip_ws(text: str, i: int) -> int:
    """The first index at or after ``i`` that is not JSON whitespace (``len(text)`` if none)."""
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def scan_string(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at ``text[i] == '"'``; ``None`` while unterminated."""
    j, n = i + 1, len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def scan_value(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``i``; ``None`` while it may still continue.

    Strings are skipped whole, so brackets or tags inside them never count.

    Raises:
        JSONScanError: a closing bracket that does not match.
    """
    n = len(text)
    c = text[i]
    if c == '"':
        return scan_string(text, i)
    if c in "{[":
        stack, j = [], i
        while j < n:
            c = text[j]
            if c == '"':
                end = scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                stack.append("}" if c == "{" else "]")
            elif c in "}]":
                if not stack or stack.pop() != c:
                    raise JSONScanError(f"unbalanced {c!r} at {j}", j)
                if not stack:
                    return j + 1
            j += 1
        return None
    j = i  # number, true, false, null: ends at a delimiter
    while j < n and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < n else None


@dataclass
class Member:
    """One ``"key": value`` of an object: the value spans ``text[start:end]`` (``end`` ``None`` while open)."""

    key: str
    start: int | None
    end: int | None


def scan_object(text: str, i: int) -> tuple[list[Member], int | None, int | None]:
    """The members of the object starting at ``text[i] == '{'`` seen so far.

    Returns:
        ``(members, end, error)``: ``end`` is the index after the closing brace, or
        ``None`` while the object is incomplete (the last member may then be partial;
        a key still being read is not listed). ``error`` is the index where the text
        stopped being JSON (``end`` is then ``None`` and stays so), else ``None``.
    """
    n = len(text)
    members: list[Member] = []
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= n:
            return members, None, None
        c = text[j]
        if c == "}":
            return members, j + 1, None
        if c == ",":
            j += 1
            continue
        if c != '"':
            return members, None, j
        kend = scan_string(text, j)
        if kend is None:
            return members, None, None
        try:
            key = json.loads(text[j:kend])
        except json.JSONDecodeError:
            return members, None, j
        j = skip_ws(text, kend)
        if j >= n:
            return members, None, None
        if text[j] != ":":
            return members, None, j
        j = skip_ws(text, j + 1)
        if j >= n:
            members.append(Member(key, None, None))
            return members, None, None
        try:
            end = scan_value(text, j)
        except JSONScanError as e:
            members.append(Member(key, j, None))
            return members, None, e.pos
        members.append(Member(key, j, end))
        if end is None:
            return members, None, None
        j = end


def decode_string_prefix(body: str) -> str:
    """Decode the inside of a JSON string that may be cut anywhere (no opening quote in ``body``).

    An escape cut short (a trailing backslash, ``\\u`` with fewer than four hex
    digits, or a high surrogate waiting for its pair) is held back, so the
    result only grows as ``body`` does.
    """
    cut = len(body)
    k = body.rfind("\\")
    while k != -1:
        # count the backslashes ending at k: an even run is literal backslashes
        run = k
        while run > 0 and body[run - 1] == "\\":
            run -= 1
        if (k - run) % 2 == 1:  # this backslash is escaped itself
            break
        esc = body[k + 1:k + 2]
        if esc == "":
            cut = k
        elif esc == "u":
            hexpart = body[k + 2:k + 6]
            if len(hexpart) < 4:
                cut = k
            elif 0xD800 <= int(hexpart, 16) <= 0xDBFF and len(body) < k + 12:
                cut = k  # a high surrogate: wait for the low half
        break
    try:
        out = json.loads('"' + body[:cut] + '"')
    except json.JSONDecodeError:
        return body[:cut]  # not valid JSON escapes: show the raw text rather than fail
    if out and "\ud800" <= out[-1] <= "\udbff":
        out = out[:-1]  # a decoded high surrogate whose pair is still cut short
    return out

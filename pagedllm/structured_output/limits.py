"""Cheap bounds on a structured-output constraint, checked before anything compiles it.

llguidance's compilers (Rust) recurse along ``$ref`` chains and rule references: a JSON schema
whose ``$ref``s chain ~2,500 definitions, or a Lark grammar of ~3,000 chained rules, overflows an
8 MiB thread stack and kills the process (SIGSEGV; measured with llguidance 1.9.1). Their cost also
grows with the text: the first token mask of a 1 MB ``const`` took 1.3 s and 200 MB. These checks
are linear in the constraint's size, never recurse in Python (explicit stacks), and say which
limit was passed and its value. They are a filter, not the last word: the validator child process
(``validator.py``) compiles what passes, under a timeout and with a crash taken as a refusal.

The limits are far above what real constraints use (OpenAI's structured outputs allow 10 levels of
object nesting and 120,000 characters of names and values in all) and far below where llguidance
fails: a 100-level chain of ``$ref``s compiles in about 1 ms.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Hashable, Iterable
from urllib.parse import unquote

from pagedllm.structured_output.errors import StructuredOutputError

MAX_SPEC_BYTES = 256 * 1024  # a constraint's text (schema JSON, grammar, regex, choices together), UTF-8 bytes
MAX_JSON_DEPTH = 100  # nesting of a schema document (llguidance's JSON reader stops at 128 anyway)
MAX_REF_CHAIN = 128  # $ref hops along one path of a schema (cycles, i.e. recursive schemas, are legal)
MAX_GRAMMAR_RULES = 1000  # rule and terminal definitions of a Lark / GBNF grammar
MAX_RULE_CHAIN = 128  # rule references along one path of a grammar (recursion is legal)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RULE_HEAD = re.compile(r"[?!]?([A-Za-z_][A-Za-z0-9_]*)\s*(?:\{[^}\n]*\})?\s*(?:\.-?\d+)?\s*:(?!:)")


def check_size(text: str, param: str, what: str = "constraint") -> None:
    """Refuse a constraint text over ``MAX_SPEC_BYTES`` UTF-8 bytes.

    Raises:
        StructuredOutputError: naming ``param``, the size and the limit.
    """
    # a character is at most 4 bytes: skip encoding what is clearly small
    if len(text) * 4 <= MAX_SPEC_BYTES:
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise StructuredOutputError(param, f"{param}: the {what} is {size} bytes; at most {MAX_SPEC_BYTES} "
                                    "are accepted")


def longest_chain(succ: Callable[[Hashable], Iterable[tuple[Hashable, int]]], root: Hashable, limit: int) -> int:
    """The largest total weight of a path from ``root`` (a cycle ends a path), or the first total
    past ``limit`` found (the walk stops there).

    A depth-first walk with an explicit stack (any depth, no Python recursion) that visits each node
    once; a node's value is the best it reached when first finished. With cycles that can be less
    than the longest simple path: a bound for a cheap filter, not a proof.

    Args:
        succ: a node's successors, as ``(node, edge weight)`` pairs (weights >= 0).
        root: where paths start.
        limit: stop as soon as a path weighs more.
    """
    memo: dict[Hashable, int] = {}
    on_path = {root}
    # frame: [node, successor iterator, best weight below, weight of the edge being explored, path weight]
    stack = [[root, iter(succ(root)), 0, 0, 0]]
    while stack:
        frame = stack[-1]
        node, children, _, _, depth = frame
        pushed = False
        for child, w in children:
            if child in memo:
                frame[2] = max(frame[2], w + memo[child])
            elif child in on_path:
                frame[2] = max(frame[2], w)  # recursion: the compiler stops there too
            else:
                if depth + w > limit:
                    return depth + w
                frame[3] = w
                stack.append([child, iter(succ(child)), 0, 0, depth + w])
                on_path.add(child)
                pushed = True
                break
            if depth + frame[2] > limit:
                return depth + frame[2]
        if pushed:
            continue
        stack.pop()
        on_path.discard(node)
        memo[node] = frame[2]
        if stack:
            parent = stack[-1]
            parent[2] = max(parent[2], parent[3] + frame[2])
    return memo[root]


def json_depth(doc: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a JSON document (``{}`` is 1, a scalar 0), or the first depth past ``limit``."""
    containers = (dict, list)
    level = [doc] if isinstance(doc, containers) else []
    depth = 0
    while level:  # one level at a time: no recursion, and no per-node bookkeeping
        depth += 1
        if depth > limit:
            return depth
        level = [c for node in level for c in (node.values() if isinstance(node, dict) else node)
                 if isinstance(c, containers)]
    return depth


def _resolve(doc: Any, ref: str) -> Any:
    """The node a local ``$ref`` (``#``, ``#/$defs/a``: a JSON pointer, URI-escaped) names; ``None``
    for anything else (anchors, other documents)."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    node = doc
    for part in ref[2:].split("/") if len(ref) > 1 else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, (dict, list)) else None


def ref_chain(doc: Any, limit: int = MAX_REF_CHAIN) -> int:
    """The most ``$ref`` hops along one path through a schema document (nesting free, each ``$ref``
    one), or the first count past ``limit``. Call after ``json_depth`` has bounded the nesting."""
    nodes: dict[int, Any] = {id(doc): doc}
    resolved: dict[str, Any] = {}

    def succ(key: int):
        node = nodes[key]
        children = node.values() if isinstance(node, dict) else node
        out = [(c, 0) for c in children if isinstance(c, (dict, list))]
        ref = node.get("$ref") if isinstance(node, dict) else None
        if isinstance(ref, str):
            if ref not in resolved:
                resolved[ref] = _resolve(doc, ref)
            if resolved[ref] is not None:
                out.append((resolved[ref], 1))
        for c, _ in out:
            nodes.setdefault(id(c), c)
        return [(id(c), w) for c, w in out]

    if not isinstance(doc, (dict, list)):
        return 0
    return longest_chain(succ, id(doc), limit)


def check_depth(schema: Any, param: str) -> None:
    """Refuse a JSON schema nested deeper than ``MAX_JSON_DEPTH`` (first: what recurses over a
    schema, ``json.dumps`` included, may then).

    Raises:
        StructuredOutputError: naming ``param`` and the limit.
    """
    if json_depth(schema) > MAX_JSON_DEPTH:
        raise StructuredOutputError(param, f"{param}: the schema nests more than {MAX_JSON_DEPTH} levels deep; "
                                    f"at most {MAX_JSON_DEPTH} are accepted")


def check_refs(schema: Any, param: str, text: str | None = None) -> None:
    """Refuse a JSON schema with a ``$ref`` chain longer than ``MAX_REF_CHAIN`` (after ``check_depth``).

    Args:
        schema: the schema document.
        param: the field errors name.
        text: the schema as JSON text, when at hand (no ``"$ref"`` in it: nothing to walk).
    Raises:
        StructuredOutputError: naming ``param`` and the limit.
    """
    if text is not None and '"$ref"' not in text:
        return
    if ref_chain(schema) > MAX_REF_CHAIN:
        raise StructuredOutputError(param, f"{param}: the schema's $ref chain is more than {MAX_REF_CHAIN} "
                                    f"references long; at most {MAX_REF_CHAIN} are accepted")


def check_schema(schema: Any, param: str) -> None:
    """``check_depth`` and ``check_refs``: a JSON schema nested deeper than ``MAX_JSON_DEPTH`` or
    with a ``$ref`` chain longer than ``MAX_REF_CHAIN`` is refused.

    Raises:
        StructuredOutputError: naming ``param`` and the limit passed.
    """
    check_depth(schema, param)
    check_refs(schema, param)


def _skip_string(text: str, i: int, quote: str) -> int:
    """Index after the quoted string or regex that opens at ``text[i]`` (backslash escapes)."""
    j = i + 1
    n = len(text)
    while j < n and text[j] != quote and text[j] != "\n":
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _directive(text: str, i: int, param: str) -> int:
    """Index after the ``%name`` at ``text[i]``, and after its JSON argument for ``%json`` / ``%regex``
    (a ``%json`` schema passes ``check_schema`` first)."""
    m = _NAME.match(text, i + 1)
    if m is None:
        return i + 1
    j = m.end()
    if m.group() not in ("json", "regex"):
        return j
    while j < len(text) and text[j] in " \t\r\n":
        j += 1
    if j >= len(text) or text[j] != "{":
        return j
    try:
        value, end = json.JSONDecoder().raw_decode(text, j)
    except (ValueError, RecursionError):
        return j + 1  # not JSON: llguidance says so
    if m.group() == "json":
        check_schema(value, param)
    return end


def _lark_rules(text: str, param: str) -> dict[str, set[str]]:
    """Rule and terminal definitions of a Lark grammar -> the names each body uses. Schemas embedded
    with ``%json {...}`` are checked with ``check_schema`` on the way."""
    rules: dict[str, set[str]] = {}
    current: set[str] | None = None
    i, n, line_start = 0, len(text), True
    while i < n:
        c = text[i]
        if c == "\n":
            i, line_start = i + 1, True
            continue
        if c in " \t\r":
            i += 1
            continue
        if line_start:
            line_start = False
            head = _RULE_HEAD.match(text, i)
            if head:
                current = rules.setdefault(head.group(1), set())
                if len(rules) > MAX_GRAMMAR_RULES:
                    break
                i = head.end()
                continue
            if c == "%":
                current = None  # a directive (%ignore, %import, %llguidance): no rule's body
        if text.startswith("//", i) or c == "#":
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif c in "\"'/":
            i = _skip_string(text, i, c)
        elif c == "<":
            end = text.find(">", i)
            i = n if end < 0 else end + 1
        elif c == "%":
            i = _directive(text, i, param)
        else:
            m = _NAME.match(text, i)
            if m:
                if current is not None:
                    current.add(m.group())
                i = m.end()
            else:
                i += 1
    return rules


def check_grammar(lark: str, param: str) -> None:
    """Refuse a Lark grammar of more than ``MAX_GRAMMAR_RULES`` definitions, or whose rule references
    chain more than ``MAX_RULE_CHAIN`` deep (schemas inlined with ``%json`` follow ``check_schema``).

    Raises:
        StructuredOutputError: naming ``param`` and the limit passed.
    """
    rules = _lark_rules(lark, param)
    if len(rules) > MAX_GRAMMAR_RULES:
        raise StructuredOutputError(param, f"{param}: the grammar defines more than {MAX_GRAMMAR_RULES} rules; at "
                                    f"most {MAX_GRAMMAR_RULES} are accepted")

    root = object()  # above every rule (unreachable rules are compiled too), so one walk sees all

    def succ(name: Hashable):
        if name is root:
            return [(r, 0) for r in rules]
        return [(used, 1) for used in rules[name] if used in rules]

    if longest_chain(succ, root, MAX_RULE_CHAIN) > MAX_RULE_CHAIN:
        raise StructuredOutputError(param, f"{param}: the grammar's rule references chain more than "
                                    f"{MAX_RULE_CHAIN} rules deep; at most {MAX_RULE_CHAIN} are accepted")


def check_gbnf_rules(text: str, param: str) -> None:
    """Refuse a GBNF grammar with more than ``MAX_GRAMMAR_RULES`` rules before converting it to Lark
    (the converter is Python, and slow on thousands of rules: 0.95 s for 3,000).

    Raises:
        StructuredOutputError: naming ``param`` and the limit.
    """
    if text.count("::=") > MAX_GRAMMAR_RULES:
        raise StructuredOutputError(param, f"{param}: the grammar defines more than {MAX_GRAMMAR_RULES} rules; at "
                                    f"most {MAX_GRAMMAR_RULES} are accepted")

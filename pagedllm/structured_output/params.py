"""What a request's output must match: vLLM's ``StructuredOutputsParams``, and its grammar.

Exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` and
``structural_tag`` is set (vLLM's rule). ``grammar_spec()`` turns it into the text of an
llguidance grammar (llguidance's own JSON-schema, regex and Lark front ends do the work);
the spec is what the engine compiles and caches, keyed by its hash.

Follows vLLM's ``vllm.sampling_params.StructuredOutputsParams`` (names, one-of rule,
``disable_any_whitespace``, ``disable_additional_properties``, ``whitespace_pattern``) and
its guidance backend's reading of ``grammar`` (Lark, or GBNF / EBNF converted to Lark) and of
``structural_tag`` (``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pagedllm.structured_output.errors import StructuredOutputError

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, one of some strings, or a grammar.

    Attributes:
        json: a JSON Schema (dict, or its JSON text).
        regex: a regular expression (Rust ``regex`` syntax, as llguidance reads it) the whole
            output must match.
        choice: the output is exactly one of these strings.
        grammar: a Lark grammar (``start: ...``), or GBNF / EBNF (``root ::= ...``).
        json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        structural_tag: vLLM's structural tag as JSON text: free text in which each
            ``begin`` (opened when one of ``triggers`` appears) is followed by JSON matching
            its ``schema`` and then ``end``.
        disable_any_whitespace: JSON without whitespace between tokens (compact form).
        disable_additional_properties: every object of ``json`` takes no properties beyond its
            ``properties`` unless the schema says otherwise, ``{"type": "object"}`` included
            (without it, only objects that declare ``properties`` are closed: see
            ``structured_output.json_schema``).
        whitespace_pattern: a regex for the whitespace allowed in JSON (overrides the default).
        reasoning_end_tag: set by the server when a reasoning parser is on and thinking is:
            the constraint starts after the token that completes this text in the output
            (``</think>``; ``None``: from the first token).
    Raises:
        StructuredOutputError: from ``__post_init__``, when not exactly one kind is set or a
            field has the wrong type.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    reasoning_end_tag: str | None = None
    _spec: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise StructuredOutputError(
                "structured_outputs", "structured_outputs: exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag must be set, got {set_kinds or 'none'}")
        kind = set_kinds[0]
        value = getattr(self, kind)
        expected = {"json": (str, dict), "regex": str, "choice": list, "grammar": str, "json_object": bool,
                    "structural_tag": str}[kind]
        if not isinstance(value, expected):
            raise StructuredOutputError(f"structured_outputs.{kind}", f"structured_outputs.{kind}: wrong type "
                                        f"{type(value).__name__}")
        if kind == "choice" and (not value or not all(isinstance(c, str) for c in value)):
            raise StructuredOutputError("structured_outputs.choice",
                                        "structured_outputs.choice: must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``json``, ``regex``, ``choice``, ``grammar``,
        ``json_object``, ``structural_tag``."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def param(self) -> str:
        """The field an error in this constraint is reported on (``structured_outputs.json``, ...)."""
        return f"structured_outputs.{self.kind}"

    def grammar_spec(self) -> str:
        """The llguidance grammar text of this constraint (computed once, then kept).

        Raises:
            StructuredOutputError: a schema that is not a JSON object, a grammar that is
                neither Lark nor GBNF, or a malformed ``structural_tag``.
        """
        if self._spec is None:
            self._spec = _build_spec(self)
        return self._spec

    def grammar_key(self) -> str:
        """SHA-256 hex digest of ``grammar_spec()``: the compile cache's key."""
        return hashlib.sha256(self.grammar_spec().encode()).hexdigest()


def _json_options(p: StructuredOutputsParams) -> dict:
    opts: dict[str, Any] = {"whitespace_flexible": not p.disable_any_whitespace}
    if p.whitespace_pattern is not None:
        opts["whitespace_pattern"] = p.whitespace_pattern
    return opts


def _build_spec(p: StructuredOutputsParams) -> str:
    """The llguidance grammar text of ``p``, after the cheap bounds of ``limits`` (size, depth,
    ``$ref`` and rule chains), so that nothing past them reaches a compiler."""
    from llguidance import LLMatcher, StructTag
    from llguidance.gbnf_to_lark import any_to_lark, is_lark_syntax

    from pagedllm.structured_output.limits import (MAX_JSON_DEPTH, check_depth, check_gbnf_rules, check_grammar,
                                                   check_refs, check_size)
    from pagedllm.structured_output.json_schema import close_objects
    kind, param = p.kind, p.param
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else p.json
        if isinstance(schema, str):
            check_size(schema, param, "schema")
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise StructuredOutputError(param, f"{param}: the schema nests more than {MAX_JSON_DEPTH} "
                                            f"levels deep; at most {MAX_JSON_DEPTH} are accepted") from None
            except ValueError as e:
                raise StructuredOutputError(param, f"{param}: not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError(param, f"{param}: a JSON schema must be an object")
        check_depth(schema, param)  # before anything here recurses over it
        # objects declaring properties are closed unless they say otherwise (vLLM's xgrammar and
        # llama.cpp agree); disable_additional_properties closes every object
        schema = close_objects(schema, every_object=p.disable_additional_properties)
        text = json.dumps(schema, ensure_ascii=False)
        check_size(text, param, "schema")
        check_refs(schema, param, text)
        try:
            return LLMatcher.grammar_from_json_schema(text, defaults=_json_options(p))
        except ValueError as e:
            raise StructuredOutputError(param, f"{param}: {e}") from None
    if kind == "regex":
        check_size(p.regex, param, "regex")
        return LLMatcher.grammar_from_regex(p.regex)
    if kind == "choice":
        # Lark string literals (JSON-quoted), so no choice needs regex escaping
        lark = "start: " + " | ".join(json.dumps(c) for c in p.choice)
        check_size(lark, param, "choice list")
        return LLMatcher.grammar_from_lark(lark)
    if kind == "grammar":
        check_size(p.grammar, param, "grammar")
        if not is_lark_syntax(p.grammar):
            check_gbnf_rules(p.grammar, param)
        try:
            lark = any_to_lark(p.grammar)
        except Exception as e:  # the GBNF converter raises plain exceptions on syntax errors
            raise StructuredOutputError(param, f"{param}: cannot read the grammar as Lark or GBNF ({e})") from None
        check_grammar(lark, param)
        return LLMatcher.grammar_from_lark(lark)
    check_size(p.structural_tag, param, "structural tag")
    return _structural_tag_spec(p, StructTag, LLMatcher)


def _structural_tag_spec(p: StructuredOutputsParams, StructTag, LLMatcher) -> str:
    from pagedllm.structured_output.limits import check_schema
    param = p.param
    try:
        tag = json.loads(p.structural_tag)
        structures, triggers = tag["structures"], tag["triggers"]
        tags = []
        for s in structures:
            trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"no trigger is a prefix of begin {s['begin']!r}")
            check_schema(s.get("schema", {}), param)
            tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=s.get("schema", {}), end=s["end"]))
        return LLMatcher.grammar_from_lark(StructTag.to_grammar(tags))
    except StructuredOutputError:
        raise
    except (ValueError, KeyError, TypeError, AssertionError, RecursionError) as e:
        raise StructuredOutputError(param, f"{param}: expected {{\"structures\": [{{\"begin\", \"schema\", "
                                    f"\"end\"}}], \"triggers\": [...]}} ({e})") from None

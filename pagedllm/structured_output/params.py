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

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputError(ValueError):
    """A structured-output request that cannot be built; ``param`` names the field
    (``structured_outputs.json``, ...), in the names of the offline API."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


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
        disable_additional_properties: objects of ``json`` take no properties beyond their
            ``properties`` unless the schema says otherwise.
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


def _close_objects(schema: Any) -> Any:
    """``additionalProperties: false`` on every object schema that does not say (vLLM's
    ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _build_spec(p: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher, StructTag
    from llguidance.gbnf_to_lark import any_to_lark
    kind = p.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else p.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise StructuredOutputError(p.param, f"{p.param}: not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError(p.param, f"{p.param}: a JSON schema must be an object")
        if p.disable_additional_properties:
            schema = _close_objects(schema)
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(p))
        except ValueError as e:
            raise StructuredOutputError(p.param, f"{p.param}: {e}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(p.regex)
    if kind == "choice":
        # Lark string literals (JSON-quoted), so no choice needs regex escaping
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in p.choice))
    if kind == "grammar":
        try:
            return LLMatcher.grammar_from_lark(any_to_lark(p.grammar))
        except Exception as e:  # the GBNF converter raises plain exceptions on syntax errors
            raise StructuredOutputError(p.param, f"{p.param}: cannot read the grammar as Lark or GBNF ({e})") from None
    return _structural_tag_spec(p, StructTag, LLMatcher)


def _structural_tag_spec(p: StructuredOutputsParams, StructTag, LLMatcher) -> str:
    param = p.param
    try:
        tag = json.loads(p.structural_tag)
        structures, triggers = tag["structures"], tag["triggers"]
        tags = []
        for s in structures:
            trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"no trigger is a prefix of begin {s['begin']!r}")
            tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=s.get("schema", {}), end=s["end"]))
        return LLMatcher.grammar_from_lark(StructTag.to_grammar(tags))
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise StructuredOutputError(param, f"{param}: expected {{\"structures\": [{{\"begin\", \"schema\", "
                                    f"\"end\"}}], \"triggers\": [...]}} ({e})") from None

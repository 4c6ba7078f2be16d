"""Moving a tool's parameter schema inside a larger schema without breaking its ``$ref``s.

A forced call of any of several tools (``tool_choice: "required"``, Anthropic's ``any``) is
constrained by one schema that holds every tool's ``parameters`` schema (``server/structured.py``
``forced_tool_fields``). A schema's local references (``"#"``, ``"#/$defs/Loc"``, the older
``"#/definitions/Loc"``, any ``"#/..."`` JSON Pointer; RFC 6901 and JSON Schema 2020-12 §8.2)
resolve against the document's root, which is no longer the tool's schema once it is nested. So
each tool schema that has local references moves to ``#/$defs/<slot>`` of the combined root, and
every local reference inside it is rewritten to point below that slot: its own ``$defs`` (what
pydantic writes for nested models) travel with it, and two tools may define the same name.
"""

from __future__ import annotations

from typing import Any

# keywords whose values are instances (data), not schemas: a "$ref" key inside them is data
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# keywords whose values map names to schemas: a name there ("enum", "$ref") is no keyword
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                          "dependencies"})


def _is_local_pointer(ref: Any) -> bool:
    """``"#"`` or ``"#/..."``: a JSON Pointer into the same document (``"#name"`` anchors are not)."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def _walk(value: Any, on_ref) -> Any:
    """A copy of the schema ``value`` with each local ``$ref`` replaced by ``on_ref(ref)``.

    Unknown keywords are walked as schemas (or lists of them); data keywords are kept as given
    (shared with the input, never mutated).
    """
    if isinstance(value, list):
        return [_walk(v, on_ref) for v in value]
    if not isinstance(value, dict):
        return value
    out: dict = {}
    for k, v in value.items():
        if k == "$ref" and _is_local_pointer(v):
            out[k] = on_ref(v)
        elif k in _DATA_KEYWORDS:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _walk(sub, on_ref) for name, sub in v.items()}
        else:
            out[k] = _walk(v, on_ref)
    return out


def has_local_refs(schema: Any) -> bool:
    """Whether ``schema`` holds a ``$ref`` that is a local JSON Pointer (``"#"``, ``"#/..."``).

    Args:
        schema: a JSON Schema (dict or bool) or any value within one.
    """
    found: list[str] = []
    _walk(schema, lambda ref: found.append(ref) or ref)
    return bool(found)


def nest_schema(schema: dict | bool, slot: str) -> dict | bool:
    """A copy of ``schema`` fit to live at ``#/$defs/<slot>`` of another document.

    Every local ``$ref`` (``"#"`` and ``"#/..."`` pointers, recursive ones included) is rewritten
    to point inside the new place; ``$id`` and ``$schema`` at its root are dropped, since a nested
    ``$id`` would start a new base URI that the rewritten pointers no longer assume. The caller's
    schema is not mutated. Other references (remote URIs, ``"#anchor"`` names) are left as given.

    Args:
        schema: the JSON Schema to move (a dict or a boolean schema).
        slot: its key in the new root's ``$defs``: no ``/`` or ``~`` (JSON Pointer escapes).
    Returns:
        The rewritten copy (a boolean schema is returned as is).
    Raises:
        ValueError: ``slot`` is empty or needs JSON Pointer escaping.
    """
    if not slot or "/" in slot or "~" in slot:
        raise ValueError(f"slot must be a non-empty name without '/' or '~', got {slot!r}")
    if not isinstance(schema, dict):
        return schema
    prefix = f"#/$defs/{slot}"
    out = _walk(schema, lambda ref: prefix + ref[1:])  # "#" -> prefix, "#/a/b" -> prefix + "/a/b"
    out.pop("$id", None)
    out.pop("$schema", None)
    return out


def place_tool_schemas(schemas: list[dict | bool], slot_prefix: str = "__tool") -> tuple[list[dict | bool], dict]:
    """Each tool's schema ready to sit in one combined document, and the ``$defs`` it then needs.

    A schema without local references is used in place, as given. One with them moves to
    ``$defs["<slot_prefix><i>"]`` (``nest_schema``) and is replaced by a ``$ref`` to it.

    Args:
        schemas: the tools' parameter schemas, in tool order.
        slot_prefix: the ``$defs`` key prefix (no ``/`` or ``~``).
    Returns:
        ``(placed, defs)``: one schema per tool to put where its ``parameters`` go, and the
        ``$defs`` object to add at the combined root (empty when no schema needs one).
    Raises:
        ValueError: a bad ``slot_prefix``.
    """
    placed: list[dict | bool] = []
    defs: dict = {}
    for i, schema in enumerate(schemas):
        if not has_local_refs(schema):
            placed.append(schema)
            continue
        slot = f"{slot_prefix}{i}"
        defs[slot] = nest_schema(schema, slot)
        placed.append({"$ref": f"#/$defs/{slot}"})
    return placed, defs

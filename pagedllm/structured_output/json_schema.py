"""Closing a JSON schema's objects: what ``additionalProperties`` means when a schema leaves it out.

JSON Schema's own default is open (any extra key is allowed), and a grammar built on that lets a
model add keys until ``max_tokens`` cuts the JSON. vLLM's default backend (xgrammar in strict mode)
and llama.cpp's schema-to-grammar converter both read an object that declares ``properties`` and
says nothing of ``additionalProperties`` as closed: only the declared properties. That is the
default here (``close_objects(schema)``); ``{"type": "object"}`` alone stays any object, and so
does every object whose schema says ``additionalProperties: true`` or gives a schema for the extra
keys. vLLM's ``disable_additional_properties`` closes every object, declared properties or not
(``every_object=True``).

Only schema positions are walked (``properties``' values, ``items``, ``anyOf`` members, ``$defs``,
...), never data (``const``, ``enum``, ``default``, ``examples``) nor the property-name maps
themselves, so a property called ``properties`` is not taken for a keyword. An object schema that
is a member of ``allOf``, or has ``allOf`` or ``$ref`` beside its ``properties``, is left as it is:
``additionalProperties`` sees only its sibling ``properties``, so closing it would refuse the keys
the other parts declare.
"""

from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not", "if",
               "then", "else", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf")


def _closable(schema: dict, every_object: bool, in_all_of: bool) -> bool:
    if "additionalProperties" in schema or "unevaluatedProperties" in schema:
        return False
    if every_object:
        return schema.get("type") == "object" or "properties" in schema
    return "properties" in schema and not in_all_of and "allOf" not in schema and "$ref" not in schema


def close_objects(schema: Any, every_object: bool = False, _in_all_of: bool = False) -> Any:
    """A copy of ``schema`` whose objects take no keys beyond their declared ``properties``
    unless the schema says otherwise (see the module docstring); ``schema`` is not changed.

    Args:
        schema: a JSON schema (dict or bool), its depth already bounded
            (``limits.check_depth``: the walk recurses once per level).
        every_object: close ``{"type": "object"}`` without ``properties`` too (vLLM's
            ``disable_additional_properties``); members of ``allOf`` are then closed as well.
    Returns:
        The closed copy (dicts and lists rebuilt along schema positions, other values shared).
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub, every_object) for name, sub in out[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key], every_object)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub, every_object) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(sub, every_object, _in_all_of=not every_object) for sub in out["allOf"]]
    if _closable(out, every_object, _in_all_of):
        out["additionalProperties"] = False
    return out

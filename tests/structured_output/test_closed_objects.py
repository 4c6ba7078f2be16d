"""Objects that declare ``properties`` and say nothing of ``additionalProperties`` are closed by
default (issue 36, as vLLM's xgrammar and llama.cpp read them), at the top level, nested, in
arrays and in ``$defs``; ``{"type": "object"}``, ``additionalProperties: true`` or a schema for the
extra keys stay open; ``disable_additional_properties`` closes every object; a forced tool call's
arguments are always a JSON object. Checked on llguidance with SmolLM2's tokenizer (no engine)."""

from __future__ import annotations

import json

import pytest

from pagedllm.server.errors import APIError
from pagedllm.server.protocol import ChatCompletionRequest
from pagedllm.server.structured import structured_request
from pagedllm.structured_output.json_schema import close_objects
from pagedllm.structured_output.params import StructuredOutputsParams

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def js(obj) -> str:
    return json.dumps(obj)


@pytest.mark.parametrize("schema, extra", [
    (CITY, {"city": "Oslo", "more": 1}),
    ({"type": "object", "properties": {"home": CITY}}, {"home": {"city": "Oslo", "zip": 1}}),
    ({"type": "array", "items": CITY}, [{"city": "Oslo"}, {"city": "Rome", "x": True}]),
    ({"$defs": {"C": CITY}, "type": "object", "properties": {"c": {"$ref": "#/$defs/C"}}},
     {"c": {"city": "Oslo", "y": 2}}),
    ({"anyOf": [CITY, {"type": "integer"}]}, {"city": "Oslo", "z": 0}),
])
def test_declared_properties_close_the_object(accepts, schema, extra):
    p = StructuredOutputsParams(json=schema)
    assert not accepts(p, js(extra))
    valid = json.loads(js(extra).replace(', "more": 1', "").replace(', "zip": 1', "").replace(', "x": true', "")
                       .replace(', "y": 2', "").replace(', "z": 0', ""))
    assert accepts(p, js(valid)), valid


@pytest.mark.parametrize("schema, value", [
    ({"type": "object"}, {"anything": [1, 2], "goes": None}),
    ({**CITY, "additionalProperties": True}, {"city": "Oslo", "more": 1}),
    ({**CITY, "additionalProperties": {"type": "integer"}}, {"city": "Oslo", "more": 1}),
    ({"type": "object", "properties": {"meta": {"type": "object"}}}, {"meta": {"k": "v"}}),
])
def test_objects_that_say_so_stay_open(accepts, schema, value):
    assert accepts(StructuredOutputsParams(json=schema), js(value))


def test_disable_additional_properties_closes_every_object(accepts):
    p = StructuredOutputsParams(json={"type": "object", "properties": {"meta": {"type": "object"}}},
                                disable_additional_properties=True)
    assert accepts(p, js({"meta": {}})) and not accepts(p, js({"meta": {"k": "v"}}))


def test_only_schema_positions_are_touched():
    schema = {"type": "object", "properties": {"properties": {"type": "string"}},
              "default": {"properties": {"a": 1}}, "examples": [{"properties": {}}]}
    out = close_objects(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in schema  # a copy
    assert out["properties"] == {"properties": {"type": "string"}}  # a property named "properties"
    assert out["default"] == schema["default"] and out["examples"] == schema["examples"]


def test_all_of_parts_stay_open(accepts):
    # additionalProperties sees only its sibling properties: closing a part (or the object beside
    # allOf) would refuse the keys the other parts declare
    schema = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}],
              "type": "object", "properties": {"c": {"type": "integer"}}}
    assert close_objects(schema) == schema
    assert accepts(StructuredOutputsParams(json=schema), js({"a": 1, "b": 2, "c": 3}))


def _named(parameters) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice={
        "type": "function", "function": {"name": "f"}}, tools=[{"type": "function", "function": {
            "name": "f", "parameters": parameters}}])


def test_a_named_tools_arguments_are_always_an_object(accepts):
    p = structured_request(_named({"properties": {"q": {"type": "string"}}}), tools=True).params
    assert not accepts(p, "42") and not accepts(p, '"text"')
    assert accepts(p, js({"q": "x"}))
    empty = structured_request(_named({}), tools=True).params  # no arguments: only {}
    assert accepts(empty, "{}") and not accepts(empty, "42") and not accepts(empty, js({"q": "x"}))


def test_a_tool_whose_parameters_cannot_be_an_object_is_a_400():
    with pytest.raises(APIError) as e:
        structured_request(_named({"type": "string"}), tools=True)
    assert e.value.status == 400 and e.value.param == "tools[0].function.parameters"

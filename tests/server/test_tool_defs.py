"""Forced tool calls over tool schemas with local ``$defs`` (issue 35 item 6): the combined
``tool_choice: "required"`` schema (and Anthropic's ``{"type": "any"}``, which becomes it) keeps
each tool's definitions, compiles with llguidance and constrains a call to each tool's own
shapes; ``server/tool_schema.py``'s pointer rewriting. No engine, no server."""

from __future__ import annotations

import copy
import json

import pytest
from pydantic import BaseModel

from pagedllm.server.anthropic import MessagesRequest, to_chat
from pagedllm.server.protocol import ChatCompletionRequest
from pagedllm.server.structured import structured_request
from pagedllm.server.tool_schema import has_local_refs, nest_schema, place_tool_schemas


def weather_schema() -> dict:
    """A pydantic schema whose ``$defs`` has a ``Loc`` of city and zip."""
    class Loc(BaseModel):
        city: str
        zip: int

    class Weather(BaseModel):
        loc: Loc
        days: int
    return Weather.model_json_schema()


def route_schema() -> dict:
    """A pydantic schema whose ``$defs`` has another ``Loc``: latitude and longitude."""
    class Loc(BaseModel):
        lat: float
        lon: float

    class Route(BaseModel):
        start: Loc
        stops: list[Loc]
    return Route.model_json_schema()


def tree_schema() -> dict:
    """A recursive pydantic schema (its root is a ``$ref`` into its own ``$defs``)."""
    class Node(BaseModel):
        value: int
        children: list["Node"] = []
    Node.model_rebuild()
    return Node.model_json_schema()


LINKED = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
          "required": ["v", "next"], "additionalProperties": False}  # recursion through the root itself


def fn(name: str, schema: dict) -> dict:
    """An OpenAI function tool."""
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def call(name: str, args: dict) -> str:
    """The text of one forced ``required`` call (vLLM's array form)."""
    return json.dumps([{"name": name, "parameters": args}])


def test_pydantic_defs_of_one_name_in_two_tools_both_hold(accepts):
    w, r = weather_schema(), route_schema()
    assert "Loc" in w["$defs"] and "Loc" in r["$defs"] and w["$defs"]["Loc"] != r["$defs"]["Loc"]
    tools = [fn("weather", w), fn("route", r)]
    before = copy.deepcopy(tools)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="required")
    sr = structured_request(req, tools=True)
    p = sr.params
    assert accepts(p, call("weather", {"loc": {"city": "Paris", "zip": 75001}, "days": 3}))
    assert accepts(p, call("route", {"start": {"lat": 48.8, "lon": 2.3}, "stops": [{"lat": 1, "lon": 2}]}))
    assert not accepts(p, call("weather", {"loc": {"lat": 48.8, "lon": 2.3}, "days": 3}))  # the other Loc
    assert not accepts(p, call("route", {"start": {"city": "Paris", "zip": 1}, "stops": []}))
    assert not accepts(p, call("weather", {"loc": {"city": "Paris"}, "days": 3}))  # zip required
    assert sr.forced_tool == "required" and set(p.json["$defs"]) == {"__tool0", "__tool1"}
    assert tools == before and req.tools[0].function.parameters == w  # nothing mutated


def test_one_tool_with_defs_and_anthropic_any(accepts):
    """One tool is the array's ``items`` itself; Anthropic's ``any`` takes the same path."""
    req = MessagesRequest(max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                          tools=[{"name": "weather", "input_schema": weather_schema()}], tool_choice={"type": "any"})
    sr = structured_request(to_chat(req), tools=True)
    assert accepts(sr.params, call("weather", {"loc": {"city": "Oslo", "zip": 150}, "days": 1}))
    assert not accepts(sr.params, call("weather", {"loc": {"city": "Oslo", "zip": "150"}, "days": 1}))
    assert sr.forced_tool == "required" and list(sr.params.json["$defs"]) == ["__tool0"]


def test_recursive_schemas_still_recurse(accepts):
    tools = [fn("tree", tree_schema()), fn("linked", LINKED), fn("plain", {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]})]
    sr = structured_request(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools,
                                                  tool_choice="required"), tools=True)
    p = sr.params
    assert accepts(p, call("tree", {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]}))
    assert accepts(p, call("linked", {"v": 1, "next": {"v": 2, "next": {"v": 3, "next": None}}}))
    assert not accepts(p, call("linked", {"v": 1, "next": {"v": 2}}))
    assert not accepts(p, call("tree", {"value": 1, "children": [{"value": "x"}]}))
    assert accepts(p, call("plain", {"a": 5}))
    options = p.json["items"]["anyOf"]
    assert options[2]["properties"]["parameters"] == tools[2]["function"]["parameters"]  # no refs: in place
    assert set(p.json["$defs"]) == {"__tool0", "__tool1"}


def test_nest_schema_rewrites_local_pointers_only():
    schema = {"$id": "https://example.com/s", "$schema": "https://json-schema.org/draft/2020-12/schema",
              "definitions": {"Old": {"type": "string"}}, "$defs": {"New": {"$ref": "#/definitions/Old"}},
              "properties": {"self": {"$ref": "#"}, "old": {"$ref": "#/definitions/Old"},
                             "deep": {"$ref": "#/properties/old"}, "remote": {"$ref": "https://x.org/s.json#/a"},
                             "anchor": {"$ref": "#name"}, "enum": {"$ref": "#/$defs/New"},
                             "$ref": {"type": "integer"}},
              "default": {"$ref": "#/not/a/schema"}, "enum": [{"$ref": "#/data"}]}
    before = copy.deepcopy(schema)
    out = nest_schema(schema, "__tool3")
    assert schema == before
    props = out["properties"]
    assert props["self"] == {"$ref": "#/$defs/__tool3"}
    assert props["old"] == {"$ref": "#/$defs/__tool3/definitions/Old"}
    assert props["deep"] == {"$ref": "#/$defs/__tool3/properties/old"}
    assert props["enum"] == {"$ref": "#/$defs/__tool3/$defs/New"}  # a property named "enum" is a schema
    assert out["$defs"]["New"] == {"$ref": "#/$defs/__tool3/definitions/Old"}
    assert props["remote"] == schema["properties"]["remote"] and props["anchor"] == {"$ref": "#name"}
    assert props["$ref"] == {"type": "integer"}  # a property named "$ref"
    assert out["default"] == schema["default"] and out["enum"] == schema["enum"]  # data, not schemas
    assert "$id" not in out and "$schema" not in out
    assert nest_schema(True, "x") is True
    for bad in ("", "a/b", "a~b"):
        with pytest.raises(ValueError):
            nest_schema({}, bad)


def test_place_tool_schemas_moves_only_schemas_with_refs():
    plain = {"type": "object"}
    placed, defs = place_tool_schemas([plain, {"$ref": "#/$defs/A", "$defs": {"A": {"type": "integer"}}}])
    assert placed[0] is plain and placed[1] == {"$ref": "#/$defs/__tool1"}
    assert defs == {"__tool1": {"$ref": "#/$defs/__tool1/$defs/A", "$defs": {"A": {"type": "integer"}}}}
    assert place_tool_schemas([plain]) == ([plain], {})
    assert has_local_refs({"items": [{"$ref": "#"}]}) and not has_local_refs({"const": {"$ref": "#"}})

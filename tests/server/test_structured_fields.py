"""The server's reading of structured-output fields into one ``StructuredOutputsParams``, and
the forced-function parser: no engine, no model."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.parsers.streaming import make_parser
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.server.structured import structured_request

MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "g"}}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MSGS, **kw)


@pytest.mark.parametrize("body,kind,source", [
    (dict(response_format={"type": "json_object"}), "json_object", "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
     "json", "response_format.json_schema.schema"),
    (dict(structured_outputs={"regex": "a+"}), "regex", "structured_outputs.regex"),
    (dict(structured_outputs={"structural_tag": {"structures": [], "triggers": []}}), "structural_tag",
     "structured_outputs.structural_tag"),
    (dict(guided_choice=["a", "b"]), "choice", "guided_choice"),
    (dict(guided_grammar="root ::= \"a\""), "grammar", "guided_grammar"),
])
def test_each_source_gives_one_constraint(body, kind, source):
    sr = structured_request(chat(**body))
    assert sr.params.kind == kind and sr.source == source and sr.forced_tool is None
    assert sr.rename("structured_outputs.x", "structured_outputs.x: bad") == (
        (source, f"{source}: bad") if not source.startswith("structured_outputs") else
        ("structured_outputs.x", "structured_outputs.x: bad"))


def test_text_format_and_no_fields_mean_free_text():
    assert structured_request(chat()) is None
    assert structured_request(chat(response_format={"type": "text"})) is None
    assert structured_request(CompletionRequest(prompt="x")) is None


def test_whitespace_pattern_and_options_carry_over():
    sr = structured_request(chat(guided_json={"type": "object"}, guided_whitespace_pattern=" ?"))
    assert sr.params.whitespace_pattern == " ?"
    sr = structured_request(chat(structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True,
                                                     "backend": "xgrammar"}))
    assert sr.params.disable_any_whitespace


def test_options_only_structured_outputs_shape_the_other_constraint():
    """``structured_outputs`` with options only is no second constraint: its options apply to the
    one ``response_format`` (or ``guided_*``) gives, as the README suggests for open objects."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    sr = structured_request(chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
                                 structured_outputs={"disable_additional_properties": True}))
    assert sr.params.kind == "json" and sr.params.disable_additional_properties
    assert sr.source == "response_format.json_schema.schema"
    sr = structured_request(chat(guided_json=schema, structured_outputs={"disable_any_whitespace": True}))
    assert sr.params.disable_any_whitespace and sr.source == "guided_json"


def test_two_sources_are_refused_naming_the_second():
    with pytest.raises(APIError) as e:
        structured_request(chat(response_format={"type": "json_object"}, guided_regex="a"))
    assert e.value.param == "guided_regex"
    with pytest.raises(APIError) as e:
        structured_request(chat(tools=TOOLS, tool_choice="required", guided_regex="a"), tools=True)
    assert e.value.param == "tools"


def test_forced_tool_schemas():
    named = structured_request(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
                               tools=True)
    assert named.forced_tool == "g" and named.params.json == {"type": "object", "properties": {}}
    assert named.source == "tools[1].function.parameters"
    req = structured_request(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), tools=True)
    schema = req.params.json
    assert req.forced_tool == "required" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [o["properties"]["name"]["const"] for o in schema["items"]["anyOf"]]
    assert names == ["f", "g"]
    with pytest.raises(APIError) as e:
        structured_request(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "h"}}), tools=True)
    assert e.value.param == "tool_choice"


def test_reasoning_end_tag_is_passed_on():
    sr = structured_request(chat(guided_regex="a"), reasoning_end_tag="</think>")
    assert sr.params.reasoning_end_tag == "</think>"


@settings(max_examples=50, deadline=None)
@given(cuts=st.lists(st.integers(0, 40), max_size=8))
def test_forced_function_parser_any_chunking_gives_the_whole(cuts):
    text = '  {"city": "Paris", "n": [1, 2]}\n '
    p = make_parser(forced_function="get_weather")
    pieces, last = [], 0
    for c in sorted(set(min(c, len(text)) for c in cuts)) + [len(text)]:
        pieces.append(text[last:c])
        last = c
    args, name = "", None
    for piece in pieces:
        for tc in p.feed(piece).tool_calls:
            name = name or tc.name
            args += tc.arguments
    for tc in p.finish().tool_calls:
        args += tc.arguments
    assert name == "get_weather" and json.loads(args) == {"city": "Paris", "n": [1, 2]}
    assert p.message.tool_calls[0].arguments == args and p.message.content is None

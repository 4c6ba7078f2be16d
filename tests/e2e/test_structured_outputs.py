"""Structured outputs through ``pagedllm serve`` (SmolLM2), with the openai SDK as the client.

``response_format`` (json_object, json_schema, and the SDK's ``parse`` helper), vLLM's
``structured_outputs`` and ``guided_*`` fields on both endpoints, forced tool calls
(``tool_choice: "required"`` and a named function) streamed and not, streamed output equal to
non-streamed for every mode, and 400s naming the field for constraints that cannot compile.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

MESSAGES = [{"role": "user", "content": "Describe a person named Bob who is 30 years old, as JSON."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
              "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"],
              "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
              "type": "object", "properties": {"tz": {"type": "string", "maxLength": 40}}, "required": ["tz"],
              "additionalProperties": False}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_sdk_parse_returns_the_pydantic_object(client, served_model):
    r = client.chat.completions.parse(model=served_model, messages=MESSAGES, response_format=Person,
                                      temperature=0, max_tokens=100)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person) and parsed.name == "Bob" and parsed.age == 30


# each mode: the request's extra fields, and a check of the answer text
CHAT_MODES = {
    "json_object": ({"response_format": {"type": "json_object"},
                     "messages": [{"role": "user", "content": 'Repeat this JSON: {"name": "Bob", "age": 30}'}]},
                    lambda t: isinstance(json.loads(t), dict)),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                                "strict": True}}},
                    lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    "structured_json": ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
                        lambda t: jsonschema.validate(json.loads(t), PERSON) is None and " " not in t.replace(
                            json.loads(t)["name"], "")),
    "structured_regex": ({"structured_outputs": {"regex": r"[A-Z][a-z]{1,10} is [0-9]{1,3}"}},
                         lambda t: re.fullmatch(r"[A-Z][a-z]{1,10} is [0-9]{1,3}", t)),
    "structured_choice": ({"structured_outputs": {"choice": ["adult", "child"]}}, lambda t: t in ("adult", "child")),
    "structured_grammar": ({"structured_outputs": {"grammar": 'root ::= "Name: " [A-Z][a-z]+'}},
                           lambda t: re.fullmatch(r"Name: [A-Z][a-z]+", t)),
    "guided_json": ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    "guided_regex": ({"guided_regex": r"(yes|no)"}, lambda t: t in ("yes", "no")),
    "guided_choice": ({"guided_choice": ["Bob", "Alice"]}, lambda t: t in ("Bob", "Alice")),
    "guided_grammar": ({"guided_grammar": 'start: "age=" /[0-9]{1,3}/'}, lambda t: re.fullmatch(r"age=[0-9]{1,3}", t)),
}


@pytest.mark.parametrize("mode", list(CHAT_MODES))
def test_chat_modes_follow_the_constraint_and_stream_the_same(client, served_model, mode):
    extra, ok = CHAT_MODES[mode]
    extra = dict(extra)
    kw = dict(model=served_model, messages=extra.pop("messages", MESSAGES), temperature=0, max_tokens=120,
              extra_body=extra)
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop", text
    assert ok(text), text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == text


@pytest.mark.parametrize("extra,pattern", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}, None),
    ({"structured_outputs": {"regex": r" [0-9]{2}"}}, r" [0-9]{2}"),
    ({"guided_choice": [" Paris", " Rome"]}, r" (Paris|Rome)"),
    ({"structured_outputs": {"structural_tag": json.dumps({
        "type": "structural_tag", "triggers": ["<city="],
        "structures": [{"begin": "<city=", "schema": {"type": "string", "maxLength": 12}, "end": ">"}]})}}, None),
])
def test_completions_follow_the_constraint(client, served_model, extra, pattern):
    kw = dict(model=served_model, prompt="The capital of France is", temperature=0, max_tokens=60, extra_body=extra)
    full = client.completions.create(**kw)
    text = full.choices[0].text
    if pattern is not None:
        assert re.fullmatch(pattern, text), text
    elif "response_format" in extra:
        jsonschema.validate(json.loads(text), PERSON)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == text


def _joined_stream_calls(stream) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        for d in ch.delta.tool_calls or []:
            if d.index not in calls:
                # the first delta of a call carries its index, id, type and name
                assert d.id and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and not d.function.name
            calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls(client, served_model, choice):
    kw = dict(model=served_model, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, temperature=0,
              max_tokens=150, parallel_tool_calls=False)
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.tool_calls and not msg.content
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for tc in msg.tool_calls:
        jsonschema.validate(json.loads(tc.function.arguments), schemas[tc.function.name])
    if choice == "required":
        assert len(msg.tool_calls) == 1  # parallel_tool_calls=false: exactly one
        assert full.choices[0].finish_reason == "tool_calls"
    else:
        assert [tc.function.name for tc in msg.tool_calls] == ["get_time"]
        assert full.choices[0].finish_reason == "stop"  # OpenAI's answer to a forced function
    calls, finish = _joined_stream_calls(client.chat.completions.create(stream=True, **kw))
    assert [(c["name"], c["arguments"]) for c in calls] == [(tc.function.name, tc.function.arguments)
                                                            for tc in msg.tool_calls]
    assert finish == full.choices[0].finish_reason


def test_required_allows_parallel_calls(client, served_model):
    r = client.chat.completions.create(model=served_model, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=200)
    calls = r.choices[0].message.tool_calls
    assert len(calls) >= 1 and all(tc.function.name in ("get_weather", "get_time") for tc in calls)


def test_n_choices_each_follow_the_schema(client, served_model):
    r = client.chat.completions.create(model=served_model, messages=MESSAGES, n=3, temperature=1.0, seed=7,
                                       max_tokens=120, extra_body={"structured_outputs": {"json": PERSON}})
    assert len(r.choices) == 3
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "unevaluatedProperties": False}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "[", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
])
def test_bad_constraints_are_400s_naming_the_field(server_url, served_model, extra, param):
    body = {"model": served_model, "messages": MESSAGES, "max_tokens": 5, **extra}
    r = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(f"{server_url}/v1/chat/completions", timeout=60, json={
        "model": served_model, "messages": MESSAGES, "max_tokens": 5, "guided_choice": ["fine"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"


def test_forced_tool_with_a_bad_schema_names_the_tool(server_url, served_model):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    r = httpx.post(f"{server_url}/v1/chat/completions", timeout=30, json={
        "model": served_model, "messages": ASK_WEATHER, "tools": tools, "max_tokens": 5,
        "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters", r.text

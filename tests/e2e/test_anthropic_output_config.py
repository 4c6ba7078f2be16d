"""Anthropic's structured outputs and the Messages request fields audit (issue 36 item 2), through
``pagedllm serve`` (SmolLM2) with the ``anthropic`` SDK and raw HTTP.

* ``output_config.format`` (``{"type": "json_schema", "schema": ...}``) and the beta's top-level
  ``output_format`` constrain the answer's text block, streamed or not, and the SDK's
  ``messages.parse`` reads it back; errors name ``output_config.format...``;
* fields that would change the answer and are not served are a 400 naming them, in Anthropic's
  error shape; fields that change nothing are accepted;
* served semantics that were dropped: a final assistant message is continued (prefill), a
  ``tool_result``'s ``is_error`` reaches the prompt, consecutive turns of one role are one turn.
"""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import pydantic
import pytest

# bounded strings: SmolLM2 left free runs on (digits of an integer without end, say) until max_tokens
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the capital of France? Answer as JSON with the city and its country."}]
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class City(pydantic.BaseModel):
    city: str
    country: Literal["France", "Germany", "Italy"]  # the SDK moves maxLength into the description


@pytest.fixture(scope="module")
def client(server_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0)


def _post(server_url: str, body: dict, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(server_url + path, json=body, timeout=300)


def _refused(r: httpx.Response, field: str) -> str:
    """``r`` is Anthropic's 400 whose message names ``field``; returns the message."""
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert field in body["error"]["message"], body
    return body["error"]["message"]


# ------------------------------------------------------------------------------ structured outputs


def test_output_config_format_constrains_the_text_streamed_or_not(client, served_model):
    kw = dict(model=served_model, max_tokens=60, messages=ASK, extra_body={"temperature": 0},
              output_config={"format": {"type": "json_schema", "schema": CITY}})
    msg = client.messages.create(**kw)
    assert [b.type for b in msg.content] == ["text"] and msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), CITY)
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == msg.content[0].text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens


def test_the_sdks_parse_reads_a_pydantic_model_back(client, served_model):
    msg = client.messages.parse(model=served_model, max_tokens=60, messages=ASK, output_format=City,
                                extra_body={"temperature": 0})
    assert isinstance(msg.parsed_output, City) and msg.parsed_output.city


def test_the_betas_output_format_is_the_same_constraint(server_url, served_model):
    body = {"model": served_model, "max_tokens": 60, "messages": ASK, "temperature": 0}
    new = _post(server_url, {**body, "output_config": {"format": {"type": "json_schema", "schema": CITY}}})
    beta = _post(server_url, {**body, "output_format": {"type": "json_schema", "schema": CITY}})
    assert new.status_code == beta.status_code == 200, (new.text, beta.text)
    assert new.json()["content"] == beta.json()["content"]
    both = {**body, "output_format": {"type": "json_schema", "schema": CITY},
            "output_config": {"format": {"type": "json_schema", "schema": CITY}}}
    _refused(_post(server_url, both), "output_format")


def test_format_errors_name_the_anthropic_fields(server_url, served_model):
    body = {"model": served_model, "max_tokens": 8, "messages": ASK}
    msg = _refused(_post(server_url, {**body, "output_config": {"format": {"type": "json_object"}}}),
                   "output_config.format.type")
    assert "json_schema" in msg
    msg = _refused(_post(server_url, {**body, "output_config": {"format": {"type": "json_schema",
                                                                           "schema": {"type": "strin"}}}}),
                   "output_config.format.schema")
    assert msg.startswith("output_config.format.schema")
    msg = _refused(_post(server_url, {**body, "output_format": {"type": "json_schema", "schema": {"type": "strin"}}}),
                   "output_format.schema")
    assert msg.startswith("output_format.schema")
    _refused(_post(server_url, {**body, "output_config": {"format": {"type": "json_schema"}}}),
             "output_config.format.schema")


def test_format_with_callable_tools_is_refused_and_with_tool_choice_none_served(server_url, served_model):
    body = {"model": served_model, "max_tokens": 60, "messages": ASK, "temperature": 0, "tools": [WEATHER],
            "output_config": {"format": {"type": "json_schema", "schema": CITY}}}
    for choice in (None, {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"}):
        _refused(_post(server_url, {**body, "tool_choice": choice} if choice else body), "output_config.format")
    r = _post(server_url, {**body, "tool_choice": {"type": "none"}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["content"][0]["text"]), CITY)


def test_count_tokens_takes_and_checks_output_config(client, server_url, served_model):
    plain = client.messages.count_tokens(model=served_model, messages=ASK).input_tokens
    shaped = client.messages.count_tokens(model=served_model, messages=ASK, output_format=City).input_tokens
    assert shaped == plain  # the schema constrains decoding; the prompt is the same
    r = _post(server_url, {"model": served_model, "messages": ASK, "output_config": {"format": {"type": "text"}}},
              "/v1/messages/count_tokens")
    _refused(r, "output_config.format.type")


# ------------------------------------------------------------------------------ the fields audit

OK = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"type": "text", "text": "hi"}


@pytest.mark.parametrize("field,extra", [
    ("container", {"container": "container_011"}),
    ("mcp_servers", {"mcp_servers": [{"type": "url", "url": "https://example.com/sse", "name": "x"}]}),
    ("context_management", {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}),
    ("diagnostics", {"diagnostics": {"previous_message_id": None}}),
    ("thinking", {"thinking": {"type": "enabled", "budget_tokens": 1024}}),
    ("thinking", {"thinking": {"type": "adaptive"}}),
    ("output_config.effort", {"output_config": {"effort": "max"}}),
    ("service_tier", {"service_tier": "priority"}),
    ("frequency_penalty", {"frequency_penalty": 1.0}),  # not Anthropic's: an unknown field is a 400 too
    ("tools[0].type", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    ("tools[0].defer_loading", {"tools": [{**WEATHER, "defer_loading": True}], "tool_choice": {"type": "none"}}),
    ("tools[0].input_examples", {"tools": [{**WEATHER, "input_examples": [{"city": "Paris"}]}],
                                 "tool_choice": {"type": "none"}}),
    ("tools[0].strict", {"tools": [{**WEATHER, "strict": True}], "tool_choice": {"type": "auto"}}),
    ("tools[0].allowed_callers", {"tools": [{**WEATHER, "allowed_callers": ["code_execution_20250825"]}],
                                  "tool_choice": {"type": "none"}}),
    ("tool_choice.disable_parallel_tool_use", {"tools": [WEATHER], "tool_choice": {
        "type": "auto", "disable_parallel_tool_use": True}}),
    ("messages[0].content[0].citations", {"messages": [{"role": "user", "content": [{
        **TEXT, "citations": [{"type": "char_location", "cited_text": "x", "document_index": 0,
                               "start_char_index": 0, "end_char_index": 1}]}]}]}),
    ("messages[0].content[0]", {"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/a.png"}}]}]}),
    ("messages[0].content[0]", {"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": "x"}, "citations": {"enabled": True}}]}]}),
    ("messages[1].content[0]", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "s"}, TEXT]}, {"role": "user", "content": "go"}]}),
    ("system[0].citations", {"system": [{**TEXT, "citations": [{"type": "char_location"}]}]}),
    ("metadata.session", {"metadata": {"user_id": "u1", "session": "s"}}),
])
def test_fields_that_would_change_the_answer_are_a_400_naming_them(server_url, served_model, field, extra):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        _refused(_post(server_url, {"model": served_model, **OK, **extra}, path), field)


def test_fields_that_change_nothing_are_accepted(server_url, served_model):
    cache = {"type": "ephemeral", "ttl": "5m"}
    body = {"model": served_model, **OK, "metadata": {"user_id": "u1"}, "service_tier": "standard_only",
            "cache_control": cache, "system": [{**TEXT, "cache_control": cache}], "speed": "standard",
            "inference_geo": "us", "thinking": {"type": "disabled"}, "tool_choice": {"type": "none"},
            "tools": [{**WEATHER, "type": "custom", "cache_control": cache, "eager_input_streaming": True,
                       "allowed_callers": ["direct"], "defer_loading": False, "input_examples": []}],
            "messages": [{"role": "user", "content": [{**TEXT, "cache_control": cache, "citations": None}]}],
            "output_config": {"effort": "high", "format": None}}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = _post(server_url, body, path)
        assert r.status_code == 200, (path, r.text)


def test_a_final_assistant_message_is_continued(server_url, served_model):
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is the city of"}]
    r = _post(server_url, {"model": served_model, "max_tokens": 8, "temperature": 0, "messages": msgs})
    assert r.status_code == 200, r.text
    chat = _post(server_url, {"model": served_model, "max_tokens": 8, "temperature": 0, "messages": msgs,
                              "continue_final_message": True, "add_generation_prompt": False}, "/v1/chat/completions")
    assert chat.status_code == 200, chat.text
    assert r.json()["content"][0]["text"] == chat.json()["choices"][0]["message"]["content"]
    with_call = msgs[:1] + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                               "input": {"city": "Paris"}}]}]
    _refused(_post(server_url, {"model": served_model, "max_tokens": 8, "messages": with_call, "tools": [WEATHER],
                                "tool_choice": {"type": "none"}}), "messages[1]")
    _refused(_post(server_url, {"model": served_model, "max_tokens": 8, "messages": msgs,
                                "output_config": {"format": {"type": "json_schema", "schema": CITY}}}),
             "output_config.format")


def _count(server_url: str, served_model: str, messages: list[dict], **extra) -> int:
    r = _post(server_url, {"model": served_model, "messages": messages, **extra}, "/v1/messages/count_tokens")
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_is_error_reaches_the_prompt(server_url, served_model):
    def turn(is_error: bool) -> list[dict]:
        return [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "timed out",
                                              "is_error": is_error}]}]
    kw = {"tools": [WEATHER], "tool_choice": {"type": "none"}}
    assert _count(server_url, served_model, turn(True), **kw) > _count(server_url, served_model, turn(False), **kw)


def test_consecutive_turns_of_one_role_are_one_turn(server_url, served_model):
    two = [{"role": "user", "content": "Hello."}, {"role": "user", "content": [TEXT]}]
    one = [{"role": "user", "content": [{"type": "text", "text": "Hello."}, TEXT]}]
    assert _count(server_url, served_model, two) == _count(server_url, served_model, one)

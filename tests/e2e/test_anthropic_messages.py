"""Anthropic's Messages API through ``pagedllm serve`` (SmolLM2), with the ``anthropic`` SDK as the client:
plain, streamed, a tool round trip, stop sequences, count_tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(server_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0)


def test_plain_and_streamed_give_the_same_text(client, served_model):
    kw = dict(model=served_model, max_tokens=24, extra_body={"temperature": 0}, system="You are terse.",
              messages=[{"role": "user", "content": "What is the capital of France?"}])
    msg = client.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "text"
    assert "Paris" in msg.content[0].text and msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens > 10 and 0 < msg.usage.output_tokens <= 24
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == msg.content[0].text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens


def test_stop_sequence(client, served_model):
    msg = client.messages.create(model=served_model, max_tokens=40, extra_body={"temperature": 0}, stop_sequences=["Paris"],
                                 messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "Paris"
    assert "Paris" not in msg.content[0].text


def test_tool_round_trip(client, served_model):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = client.messages.create(model=served_model, max_tokens=60, extra_body={"temperature": 0}, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"}, messages=ask)
    use = [b for b in msg.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and msg.stop_reason == "tool_use"
    jsonschema.validate(use[0].input, WEATHER["input_schema"])
    with client.messages.stream(model=served_model, max_tokens=60, extra_body={"temperature": 0}, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}, messages=ask) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [use[0].input]
    follow = ask + [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                  "content": "22 degrees and sunny"}]}]
    answer = client.messages.create(model=served_model, max_tokens=30, extra_body={"temperature": 0}, tools=[WEATHER],
                                    tool_choice={"type": "none"}, messages=follow)
    assert answer.content[0].type == "text" and answer.content[0].text


def test_count_tokens(client, served_model, server_url):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    n = client.messages.count_tokens(model=served_model, messages=msgs).input_tokens
    plain = client.messages.create(model=served_model, max_tokens=2, messages=msgs)
    assert n == plain.usage.input_tokens


def test_errors_use_anthropics_shape(client, served_model, server_url):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=served_model, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    r = httpx.post(server_url + "/v1/messages", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(server_url + "/v1/messages", timeout=10, json={
        "model": served_model, "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    ok = client.messages.create(model=served_model, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert ok.usage.output_tokens >= 1

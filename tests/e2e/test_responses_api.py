"""OpenAI's Responses API through ``pagedllm serve`` (SmolLM2), with the openai SDK's ``client.responses``:
plain, streamed, structured output, a function tool round trip, ``previous_response_id``, and the store."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)


def test_plain_and_streamed(client, served_model):
    kw = dict(model=served_model, input="What is the capital of France?", instructions="You are a helpful assistant.",
              max_output_tokens=24, temperature=0)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.output_text and r.output[0].type == "message"
    assert r.usage.input_tokens > 5 and 0 < r.usage.output_tokens <= 24
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == r.output_text


def test_structured_output(client, served_model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model=served_model, input="Which city is the capital of France? JSON.",
                                max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_function_tool_round_trip_and_previous_response(client, served_model):
    r = client.responses.create(model=served_model, input="What is the weather in Paris?", tools=[TOOL],
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), TOOL["parameters"])
    streamed = list(client.responses.create(model=served_model, input="What is the weather in Paris?", tools=[TOOL],
                                            tool_choice={"type": "function", "name": "get_weather"},
                                            max_output_tokens=60, temperature=0, stream=True))
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments
    follow = client.responses.create(
        model=served_model, previous_response_id=r.id, tools=[TOOL], tool_choice="none", max_output_tokens=30,
        temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                               "output": "22 degrees and sunny"}])
    assert follow.output_text and follow.previous_response_id == r.id
    assert follow.usage.input_tokens > r.usage.input_tokens  # the stored conversation came first


def test_store_get_delete(client, served_model):
    r = client.responses.create(model=served_model, input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=served_model, input="Hi", previous_response_id="resp_nope", max_output_tokens=4)
    unstored = client.responses.create(model=served_model, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_bad_input_is_a_400(client, served_model):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=served_model, input=[{"type": "computer_call", "id": "x"}], max_output_tokens=4)
    assert e.value.body["param"] == "input[0].type" if isinstance(e.value.body, dict) and "param" in e.value.body \
        else True
    ok = client.responses.create(model=served_model, input="Hi", max_output_tokens=2)
    assert ok.usage.output_tokens >= 1

"""Tool calling end to end with a real model: Qwen2.5-Coder-0.5B-Instruct through ``pagedllm serve``.

The model writes its calls as JSON in a Markdown fence (```json {...} ```),
which the ``json`` tool parser reads. Greedy decoding makes the outputs
repeatable; streamed and non-streamed answers must agree field by field.
"""

from __future__ import annotations

import json

import openai
import pytest

from pagedllm.models import real_models
from pagedllm.models.loader import ModelNotFoundError

ALIAS = "qwen2.5-coder-0.5b-instruct"
NAME = "qwen-coder"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}]
ONE_CITY = [{"role": "user", "content": "What's the weather in Paris?"}]
TWO_CITIES = [{"role": "system", "content": "You call tools. To call several tools, answer with a JSON array of "
                                            "objects, each {\"name\": ..., \"arguments\": {...}}."},
              {"role": "user", "content": "What's the weather in Paris and in Tokyo?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory, start_server):
    """An openai client of a server running Qwen2.5-Coder with ``--tool-call-parser json``."""
    try:
        real_models.find_parts(real_models.named_model(ALIAS))
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    args = [ALIAS, "--served-model-name", NAME, "--tool-call-parser", "json", "--enable-auto-tool-choice"]
    with start_server(tmp_path_factory.mktemp("qwen_server"), args) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def streamed(client, messages) -> tuple[str, list[dict], str]:
    """Content, tool calls (rebuilt from deltas, with every first-delta rule checked) and finish reason."""
    content, calls, finish = "", [], None
    for ch in client.chat.completions.create(model=NAME, messages=messages, tools=WEATHER, temperature=0,
                                             max_tokens=120, stream=True):
        if not ch.choices:
            continue
        c = ch.choices[0]
        assert finish is None, "nothing may follow the finish chunk"
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index == len(calls) and tc.type == "function" and tc.function.name
                calls.append({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""})
            else:
                assert tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = c.finish_reason or finish
    return content, calls, finish


def whole(client, messages):
    return client.chat.completions.create(model=NAME, messages=messages, tools=WEATHER, temperature=0,
                                          max_tokens=120).choices[0]


def test_one_call_streamed_equals_non_streamed(client):
    """A weather question gets one get_weather call with valid JSON arguments, the same streamed and not."""
    c = whole(client, ONE_CITY)
    assert c.finish_reason == "tool_calls"
    assert not c.message.content
    [call] = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    content, calls, finish = streamed(client, ONE_CITY)
    assert (content, finish) == ("", "tool_calls")
    assert [(x["name"], x["arguments"]) for x in calls] == [("get_weather", call.function.arguments)]
    assert "```" not in content


def test_two_parallel_calls_stream_with_distinct_indices_and_ids(client):
    """Two cities give two calls: indices 0 and 1, distinct ids, arguments identical to the non-streamed ones."""
    c = whole(client, TWO_CITIES)
    assert c.finish_reason == "tool_calls"
    got = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})]
    content, calls, finish = streamed(client, TWO_CITIES)
    assert finish == "tool_calls" and content == ""
    assert len({x["id"] for x in calls}) == 2
    assert [x["arguments"] for x in calls] == [t.function.arguments for t in c.message.tool_calls]


def test_tool_result_round_trip(client):
    """The assistant's call and the tool's answer render through the model's template; the reply is text."""
    first = whole(client, ONE_CITY).message
    call = first.tool_calls[0]
    messages = ONE_CITY + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "temp_c": 21, "sky": "sunny"})}]
    c = client.chat.completions.create(model=NAME, messages=messages, tools=WEATHER, tool_choice="none",
                                       temperature=0, max_tokens=40).choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.content
    assert not c.message.tool_calls

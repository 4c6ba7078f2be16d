"""What real clients tripped on (issue 36), against the shared SmolLM2 server (``server_url``):
LangChain's three ``with_structured_output`` methods over a pydantic model whose schema leaves
``additionalProperties`` out (closed by default now, so the JSON ends), a forced tool call cut by
``max_tokens`` (an incomplete call, never raw text in ``content``, streamed the same), and a named
tool declared with ``"parameters": {}`` (its arguments are a JSON object)."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a city",
                                           "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                          "required": ["tz"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)


class City(BaseModel):
    """A city and its country (pydantic writes no additionalProperties)."""

    name: str
    country: str


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output_over_an_open_schema(server_url, served_model, method):
    lc = pytest.importorskip("langchain_openai")
    assert "additionalProperties" not in City.model_json_schema()
    llm = lc.ChatOpenAI(model=served_model, base_url=f"{server_url}/v1", api_key="unused", temperature=0,
                        max_tokens=60, max_retries=0)
    out = llm.with_structured_output(City, method=method).invoke("Name a city in France and its country.")
    assert isinstance(out, City) and out.name and out.country


def test_langchain_json_mode(server_url, served_model):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model=served_model, base_url=f"{server_url}/v1", api_key="unused", temperature=0,
                        max_tokens=60, max_retries=0)
    schema = {"title": "City", "type": "object", "properties": {"name": {"type": "string"}}}
    out = llm.with_structured_output(schema, method="json_mode").invoke(
        "Answer in JSON with a key 'name': name a city in France.")
    assert isinstance(out, dict)


def _required(client, model, stream: bool, **kw):
    body = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, **kw)
    if not stream:
        r = client.chat.completions.create(**body)
        m = r.choices[0]
        return m.message.content, [(c.function.name, c.function.arguments) for c in m.message.tool_calls or []], \
            m.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                name, args = calls.get(tc.index, ("", ""))
                calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
            finish = ch.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("max_tokens", [4, 9, 14])
def test_a_forced_call_cut_short_never_leaks_into_content(client, served_model, max_tokens):
    plain = _required(client, served_model, False, max_tokens=max_tokens)
    streamed = _required(client, served_model, True, max_tokens=max_tokens)
    assert plain == streamed
    content, calls, finish = plain
    assert not content and finish == "length", plain
    assert all(name in ("get_weather", "get_time") for name, _ in calls)
    whole = _required(client, served_model, False, max_tokens=80)
    assert whole[2] == "tool_calls" and whole[1] and not whole[0]
    for (name, args), (wname, wargs) in zip(calls, whole[1]):
        assert name == wname and wargs.startswith(args)  # the cut call is the start of the whole one


def test_a_named_tool_with_empty_parameters_gets_an_object(client, served_model):
    r = client.chat.completions.create(model=served_model, messages=ASK, temperature=0, max_tokens=40, tools=[
        {"type": "function", "function": {"name": "lookup", "parameters": {}}}],
        tool_choice={"type": "function", "function": {"name": "lookup"}})
    args = r.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(args) == {}, args  # a function of no arguments; before: a bare number or string

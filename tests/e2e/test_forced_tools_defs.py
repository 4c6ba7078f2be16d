"""Forced tool calls whose schemas have local ``$defs`` (pydantic's nested models), through the shared
``pagedllm serve`` (SmolLM2): ``tool_choice: "required"`` and Anthropic's ``{"type": "any"}`` answer
200 with calls whose arguments parse and follow the called tool's schema (issue 35 item 6; they
were refused with ``Pointer '/$defs/Loc' does not exist``)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pydantic
import pytest


def _weather_schema() -> dict:
    class Loc(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        zip: int = pydantic.Field(ge=0, le=99999)

    class Weather(pydantic.BaseModel):
        loc: Loc
        days: int = pydantic.Field(ge=1, le=7)
    return Weather.model_json_schema()


def _route_schema() -> dict:
    class Loc(pydantic.BaseModel):  # same $defs name as the weather tool's, another shape
        lat: float
        lon: float

    class Route(pydantic.BaseModel):
        start: Loc
        end: Loc
    return Route.model_json_schema()


SCHEMAS = {"get_weather": _weather_schema(), "plan_route": _route_schema()}
ASK = [{"role": "user", "content": "What will the weather be in Paris (zip 75001) for the next 3 days?"}]


def _valid(name: str, args) -> None:
    """The arguments follow the named tool's own schema (its ``$defs`` resolved against its root)."""
    assert name in SCHEMAS
    jsonschema.validate(args, SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_required_with_defs(server_url, served_model, stream):
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
    body = {"model": served_model, "messages": ASK, "tools": tools, "tool_choice": "required", "temperature": 0,
            "max_tokens": 200, "parallel_tool_calls": False}
    if not stream:
        r = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    else:
        parts: dict[int, list] = {}
        with httpx.stream("POST", f"{server_url}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
            assert r.status_code == 200, r.read().decode()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:])["choices"]  # the usage chunk has none
                for d in (choices[0]["delta"].get("tool_calls") or []) if choices else []:
                    part = parts.setdefault(d["index"], [None, ""])
                    part[0] = part[0] or d.get("function", {}).get("name")
                    part[1] += d.get("function", {}).get("arguments") or ""
        calls = [tuple(parts[i]) for i in sorted(parts)]
    assert len(calls) == 1
    for name, args in calls:
        _valid(name, json.loads(args))


def test_anthropic_any_with_defs(server_url, served_model):
    body = {"model": served_model, "max_tokens": 200, "temperature": 0, "messages": ASK,
            "tools": [{"name": n, "description": f"{n} tool", "input_schema": s} for n, s in SCHEMAS.items()],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    r = httpx.post(f"{server_url}/v1/messages", json=body, timeout=300)
    assert r.status_code == 200, r.text
    msg = r.json()
    uses = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert len(uses) == 1 and msg["stop_reason"] == "tool_use"
    _valid(uses[0]["name"], uses[0]["input"])

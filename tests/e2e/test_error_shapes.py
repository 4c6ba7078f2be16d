"""Deep JSON and error shapes through a real ``pagedllm serve`` (the shared ``server_url``, SmolLM2):
the engine's own parsers (the grammar compiler, the chat template) never see JSON nested past
``MAX_JSON_DEPTH``, each such request is a 400 naming the field, and the next one is served.
``tests/server/test_hostile_shapes.py`` covers every status in process; this checks the real stack.
"""

from __future__ import annotations

import json

import httpx
import pytest

from pagedllm.server.json_depth import MAX_JSON_DEPTH

USER = [{"role": "user", "content": "Hi"}]


def nested(depth: int, kind: str = "object") -> str:
    """JSON text ``depth`` containers deep."""
    return '{"a":' * depth + "1" + "}" * depth if kind == "object" else "[" * depth + "]" * depth


def post(url: str, body: str | dict) -> httpx.Response:
    """POST ``body`` (JSON text as given, or a dict) as JSON."""
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=60)


def assert_served(server_url: str, served_model: str) -> None:
    """The server still answers: a completion and a Messages request, one token each."""
    r = post(server_url + "/v1/completions", {"model": served_model, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    r = post(server_url + "/v1/messages", {"model": served_model, "max_tokens": 1, "messages": USER})
    assert r.status_code == 200 and r.json()["type"] == "message", r.text


CALL = [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "TEXT"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x"}]
TEXTS = [  # (path, body with "TEXT" where a JSON text goes, depth, the field the 400 names)
    ("/v1/chat/completions", {"messages": USER, "guided_json": "TEXT"}, 1000, "guided_json"),
    ("/v1/completions", {"prompt": "Hi", "guided_json": "TEXT"}, 1000, "guided_json"),
    ("/v1/chat/completions", {"messages": USER, "structured_outputs": {
        "json": "TEXT", "disable_additional_properties": True}}, 600, "structured_outputs.json"),
    ("/v1/chat/completions", {"messages": USER + CALL}, 990, "messages[1].tool_calls[0].function.arguments"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "TEXT"},
                                 {"type": "function_call_output", "call_id": "c", "output": "x"}]}, 990,
     "input[0].arguments"),
]


@pytest.mark.parametrize("path,body,depth,param", TEXTS, ids=[f"{t[0]}:{t[3]}" for t in TEXTS])
def test_deep_json_texts_are_a_400_naming_the_field(server_url, served_model, path, body, depth, param):
    text = json.dumps({"model": served_model, "max_tokens": 2, **body}).replace('"TEXT"', json.dumps(nested(depth)))
    r = post(server_url + path, text)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and f"nested more than {MAX_JSON_DEPTH} levels" in err["message"], err
    assert_served(server_url, served_model)


def test_deep_bodies_are_a_400_in_each_apis_shape(server_url, served_model):
    r = post(server_url + "/v1/chat/completions", {"model": served_model, "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(nested(900))}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema.a", r.text
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for body in (nested(1000, "list"), nested(1000)):
            r = post(server_url + path, body)
            assert r.status_code == 400, r.text
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert_served(server_url, served_model)


def test_wrong_methods_and_paths(server_url):
    r = httpx.get(server_url + "/v1/messages", timeout=10)
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "Method Not Allowed"}}
    r = httpx.delete(server_url + "/health", timeout=10)
    assert r.status_code == 405 and r.headers["Allow"] == "GET, HEAD" and r.json()["error"]["message"]
    r = httpx.post(server_url + "/v1/messages/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_openapi_document(server_url):
    doc = httpx.get(server_url + "/openapi.json", timeout=30).json()
    ops = [(p, m, op) for p, item in doc["paths"].items() for m, op in item.items()]
    ids = [op["operationId"] for _, _, op in ops]
    assert len(ids) == len(set(ids))
    assert not [(p, m) for p, m, op in ops if "422" in op["responses"]]
    assert "requestBody" in doc["paths"]["/v1/messages"]["post"]


def test_nesting_at_the_limit_reaches_the_engine(server_url, served_model):
    """JSON exactly ``MAX_JSON_DEPTH`` deep passes the bound, and what is behind it (the chat template,
    the grammar compiler) answers it without a ``RecursionError``: 200, or a 400 of its own."""
    schema = json.loads(nested(MAX_JSON_DEPTH - 3))  # the body, tools and a tool are 3 levels
    r = post(server_url + "/v1/messages/count_tokens", {"model": served_model, "messages": USER,
                                                          "tools": [{"name": "t", "input_schema": schema}]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
    r = post(server_url + "/v1/completions", {"model": served_model, "prompt": "Hi", "max_tokens": 2,
                                              "guided_json": nested(MAX_JSON_DEPTH)})
    assert r.status_code in (200, 400), r.text
    assert_served(server_url, served_model)

"""Hostile structured-output constraints through ``pagedllm serve`` (issue 35 items 1 and 3).

A JSON schema whose ``$ref``s chain 3,000 definitions, or a Lark grammar of 3,000 chained rules,
overflowed the grammar compiler's stack and killed the server (SIGSEGV) whichever field carried it.
Each is now a 400 naming the field the request used, and the server (and its engine core) go on
serving. A grammar llguidance's ``validate_grammar`` accepts but the core's matcher refuses was
streamed as a 200 ending in ``finish_reason: "error"``; it is a 400 before anything is queued.
"""

from __future__ import annotations

import httpx
import pytest

MESSAGES = [{"role": "user", "content": "Pick one."}]
N = 3000


def _chain_schema(n: int = N) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


CHAIN = _chain_schema()
LARK_CHAIN = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(N)) + f'r{N}: "a"\n'
NAMED = {"type": "function", "function": {"name": "f"}}


def _served(server_url: str, served_model: str) -> None:
    """A plain request and a constrained one are still answered (server and core alive)."""
    r = httpx.post(f"{server_url}/v1/chat/completions", timeout=60, json={
        "model": served_model, "messages": MESSAGES, "max_tokens": 3, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.text
    assert httpx.get(f"{server_url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("path,body,param,limit", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": CHAIN}}},
     "response_format.json_schema.schema", "$ref chain"),
    ("/v1/chat/completions", {"guided_json": CHAIN, "stream": True}, "guided_json", "$ref chain"),
    ("/v1/chat/completions", {"guided_grammar": LARK_CHAIN}, "guided_grammar", "rules"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": CHAIN}}],
                              "tool_choice": NAMED}, "tools[0].function.parameters", "$ref chain"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": CHAIN}}, "structured_outputs.json",
     "$ref chain"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": CHAIN}}},
     "text.format.schema", "$ref chain"),
])
def test_chained_constraints_are_400s_naming_the_field(server_url, served_model, path, body, param, limit):
    if path != "/v1/responses":
        body = {"messages": MESSAGES, **body} if "prompt" not in body else body
        body = {"max_tokens": 3, **body}
    r = httpx.post(f"{server_url}{path}", timeout=60, json={"model": served_model, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: ") and limit in err["message"], err
    _served(server_url, served_model)


def test_an_anthropic_tool_schema_is_named_as_sent(server_url, served_model):
    r = httpx.post(f"{server_url}/v1/messages", timeout=60, json={
        "model": served_model, "max_tokens": 3, "messages": MESSAGES, "tool_choice": {"type": "tool", "name": "f"},
        "tools": [{"name": "f", "input_schema": CHAIN}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("tools[0].input_schema: the schema's $ref chain"), r.text
    _served(server_url, served_model)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_only_the_core_refused_is_a_400_before_the_stream(server_url, served_model, stream):
    """``start: start`` passes ``validate_grammar``; the core's first mask then fails. It was a
    200 stream with one token and ``finish_reason: "error"`` (and a 400 naming ``structured_outputs``)."""
    r = httpx.post(f"{server_url}/v1/chat/completions", timeout=60, json={
        "model": served_model, "messages": MESSAGES, "max_tokens": 3, "stream": stream,
        "guided_grammar": "start: start"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_grammar" and err["message"].startswith("guided_grammar: no output can match it")
    _served(server_url, served_model)

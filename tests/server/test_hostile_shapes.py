"""Hostile request shapes and error bodies, in process: the real app (``build_app``) over a small fake
engine, driven by FastAPI's ``TestClient`` (no model, no socket).

* JSON nested past ``MAX_JSON_DEPTH`` (in a body, a schema, a Responses item, a whole Messages body,
  or a JSON text such as ``guided_json``) is a 400 naming the field, never a 500;
* ``/v1/messages`` and ``/v1/messages/count_tokens`` answer every error in Anthropic's shape, the
  OpenAI paths in OpenAI's; a 405 carries ``Allow``;
* the OpenAPI document lists what the server answers (request bodies, 400 not 422, empty probes,
  unique operation ids).
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from pagedllm.server.app import build_app
from pagedllm.server.json_depth import MAX_JSON_DEPTH, deep_field, too_deep

KEY = "sk-shapes"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 * 1024
USER = [{"role": "user", "content": "hi"}]
COUNT_OK = {"model": "m", "messages": USER}


class _Tokenizer:
    """Enough of a tokenizer for rendering and counting; ``boom`` in a text fails like a bug would."""

    def get_vocab(self) -> dict:
        return {"a": 0, "bb": 1}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "boom" in text:
            raise RuntimeError("tokenizer bug")
        return list(range(len(text.split())))

    def apply_chat_template(self, messages, tools=None, tokenize=False, **kwargs) -> str:
        return " ".join(str(m.get("content")) for m in messages)


class _FakeLLM:
    """What ``build_app`` reads of an ``AsyncLLM``; generation itself is never reached."""

    max_num_seqs, context_limit, max_model_len, model_dir = 4, 10_000, 10_000, "/fake"

    def __init__(self) -> None:
        self.tokenizer = _Tokenizer()
        self.is_healthy = True

    def default_sampling_fields(self) -> dict:
        return {}

    def add_finished_callback(self, callback) -> None:
        pass


@pytest.fixture(scope="module")
def served():
    """``(client, llm, app)``: one app with an API key and a small body limit."""
    llm = _FakeLLM()
    app = build_app(llm, "m", api_key=KEY, max_request_body_bytes=BODY_LIMIT)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, llm, app


@pytest.fixture
def client(served):
    """The module's client; every test leaves the engine healthy and the queue empty."""
    client, llm, app = served
    yield client
    llm.is_healthy = True
    app.state.admission.in_flight = 0


def nested(depth: int, kind: str = "object") -> str:
    """JSON text ``depth`` containers deep: ``{"a": {"a": ... 1}}`` or ``[[...]]``."""
    if kind == "object":
        return '{"a":' * depth + "1" + "}" * depth
    return "[" * depth + "]" * depth


def post(client, path: str, body: str | dict, headers: dict | None = None):
    """POST ``body`` (JSON text as given, or a dict) with the API key and a JSON content type."""
    content = body if isinstance(body, str) else json.dumps(body)
    return client.post(path, content=content, headers={"Content-Type": "application/json", **AUTH,
                                                       **(headers or {})})


def assert_openai_error(r, status: int, param: str | None = "<any>") -> dict:
    """``r`` is OpenAI's error body with this status (and ``param``, unless ``"<any>"``); returns ``error``."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "<any>":
        assert err["param"] == param, err
    return err


def assert_anthropic_error(r, status: int, kind: str) -> dict:
    """``r`` is Anthropic's error body with this status and error type; returns ``error``."""
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    return body["error"]


def assert_served(client) -> None:
    """The server still answers: a probe and a real request."""
    assert client.get("/health").status_code == 200
    r = post(client, "/v1/messages/count_tokens", COUNT_OK)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text


# ---------------------------------------------------------------- nesting depth

SCHEMA_BODY = '{"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema",' \
              '"json_schema":{"name":"x","schema":%s}}}'
TOOLS_BODY = '{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":' \
             '{"name":"f","parameters":%s}}],"tool_choice":"required"}'
OPENAI_DEEP = [  # (path, body template, the field the 400 names)
    ("/v1/chat/completions", SCHEMA_BODY, "response_format.json_schema.schema.a"),
    ("/v1/chat/completions", TOOLS_BODY, "tools[0].function.parameters"),
    ("/v1/completions", '{"prompt":"hi","guided_json":%s}', "guided_json.a.a.a"),
    ("/v1/responses", '{"input":[{"role":"user","content":%s}]}', "input[0].content.a"),
    ("/v1/responses", '{"input":[%s]}', "input[0].a.a"),
    ("/tokenize", '{"prompt":%s}', "prompt.a.a.a"),
]


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 5000])
@pytest.mark.parametrize("path,template,param", OPENAI_DEEP)
def test_deep_json_bodies_are_a_400_naming_the_field(client, path, template, param, depth):
    r = post(client, path, template % nested(depth))
    err = assert_openai_error(r, 400, param)
    assert f"nested more than {MAX_JSON_DEPTH} levels" in err["message"]
    assert_served(client)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("body", [nested(1000, "list"), nested(1000), nested(MAX_JSON_DEPTH + 1, "list"),
                                  '{"max_tokens":4,"messages":[{"role":"user","content":%s}]}' % nested(1000, "list"),
                                  '{"max_tokens":4,"messages":[{"role":"user","content":"hi"}],'
                                  '"tools":[{"name":"t","input_schema":%s}]}' % nested(1000)])
def test_deep_anthropic_bodies_are_a_400_in_anthropics_shape(client, path, body):
    err = assert_anthropic_error(post(client, path, body), 400, "invalid_request_error")
    assert f"nested more than {MAX_JSON_DEPTH} levels" in err["message"]
    assert_served(client)


def test_nesting_up_to_the_limit_is_served(client):
    def body(depth: int) -> dict:  # the body, tools and a tool are 3 levels
        return {**COUNT_OK, "tools": [{"name": "t", "input_schema": json.loads(nested(depth - 3))}]}
    assert post(client, "/v1/messages/count_tokens", body(MAX_JSON_DEPTH)).status_code == 200
    err = assert_anthropic_error(post(client, "/v1/messages/count_tokens", body(MAX_JSON_DEPTH + 1)), 400,
                                 "invalid_request_error")
    assert err["message"].startswith("tools[0].input_schema.a: JSON nested")


JSON_TEXTS = [  # (path, body with TEXT where a JSON text goes, the field the 400 names)
    ("/v1/chat/completions", {"messages": USER, "guided_json": "TEXT"}, "guided_json"),
    ("/v1/completions", {"prompt": "hi", "guided_json": "TEXT"}, "guided_json"),
    ("/v1/chat/completions", {"messages": USER, "structured_outputs": {"json": "TEXT",
                                                                       "disable_additional_properties": True}},
     "structured_outputs.json"),
    ("/v1/chat/completions", {"messages": USER, "structured_outputs": {"structural_tag": "TEXT"}},
     "structured_outputs.structural_tag"),
    ("/v1/chat/completions", {"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "TEXT"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("/tokenize", {"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "TEXT"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "TEXT"},
                                 {"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "input[0].arguments"),
]


@pytest.mark.parametrize("kind", ["object", "list"])
@pytest.mark.parametrize("path,body,param", JSON_TEXTS)
def test_deep_json_texts_are_a_400_naming_the_field(client, path, body, param, kind):
    text = json.dumps(body).replace('"TEXT"', json.dumps(nested(1000, kind)))
    err = assert_openai_error(post(client, path, text), 400, param)
    assert err["message"] == f"{param}: JSON nested more than {MAX_JSON_DEPTH} levels deep"
    assert_served(client)


def test_depth_scan_reads_json_as_json():
    assert not too_deep(nested(MAX_JSON_DEPTH)) and too_deep(nested(MAX_JSON_DEPTH + 1))
    assert not too_deep('["' + "[" * 500 + '"]')  # brackets in strings do not count
    assert not too_deep('["\\"' + "[" * 500 + '"]')  # nor after an escaped quote
    assert not too_deep("[]" * 10_000)  # many containers, none deep
    assert too_deep("[" * 10**6)  # no recursion, whatever the depth
    assert deep_field(("[" * 10**6).encode()) is None  # a top-level array: the body itself
    assert deep_field(b'{"x": [1, 2, {"y": ' + b"[" * 200 + b"]}") == "x[2].y[0]"  # at most four parts
    assert deep_field(b'{"k\\u00e9": ' + b"{" * 200) == "k\u00e9"
    # escaped quotes, and commas and brackets in strings, neither end a key nor count as items
    assert deep_field(b'{"a\\"b": {"c,d": [0, "x,[", {"y": ' + b"[" * 200) == 'a"b.c,d[2].y'
    assert deep_field(b'{"x": ' + b"[]," * 10_000 + b"[" * 200) is not None  # linear, no recursion


# ---------------------------------------------------------------- error shapes

ANTHROPIC_PATHS = ["/v1/messages", "/v1/messages/count_tokens"]
ANTHROPIC_OK = {"model": "m", "max_tokens": 4, "messages": USER}


def test_anthropic_paths_answer_bad_requests_in_anthropics_shape(client):
    for path in ANTHROPIC_PATHS:
        assert_anthropic_error(post(client, path, "{not json"), 400, "invalid_request_error")
        err = assert_anthropic_error(post(client, path, {"model": "m", "max_tokens": 4}), 400, "invalid_request_error")
        assert "messages" in err["message"]  # what FastAPI would answer 422, named as a 400
        assert_anthropic_error(post(client, path, {**ANTHROPIC_OK, "model": "other"}), 404, "not_found_error")
        r = post(client, path, ANTHROPIC_OK, headers={"Authorization": "Bearer wrong"})
        assert_anthropic_error(r, 401, "authentication_error")
        assert r.headers["WWW-Authenticate"] == "Bearer"
        r = client.get(path, headers=AUTH)
        assert_anthropic_error(r, 405, "invalid_request_error")
        assert r.headers["Allow"] == "POST"
        r = post(client, path, {**ANTHROPIC_OK, "system": "x" * BODY_LIMIT})
        assert_anthropic_error(r, 413, "request_too_large")
    assert_anthropic_error(client.post("/v1/messages/batches", headers=AUTH), 404, "not_found_error")
    assert_served(client)


def test_anthropic_paths_answer_server_errors_in_anthropics_shape(served, client):
    _, llm, app = served
    boom = {**ANTHROPIC_OK, "messages": [{"role": "user", "content": "boom"}]}
    for path in ANTHROPIC_PATHS:
        assert_anthropic_error(post(client, path, boom), 500, "api_error")
    app.state.admission.in_flight = app.state.admission.max_in_flight
    r = post(client, "/v1/messages", ANTHROPIC_OK)
    assert_anthropic_error(r, 429, "rate_limit_error")
    assert r.headers["Retry-After"] == "1"
    app.state.admission.in_flight = 0
    llm.is_healthy = False
    for path in ANTHROPIC_PATHS:
        assert_anthropic_error(post(client, path, ANTHROPIC_OK), 503, "overloaded_error")
    llm.is_healthy = True
    assert_served(client)


def test_openai_paths_keep_openais_shape(served, client):
    _, llm, app = served
    path, ok = "/v1/chat/completions", {"model": "m", "messages": USER}
    assert_openai_error(post(client, path, "{not json"), 400)
    assert_openai_error(post(client, path, {"model": "m"}), 400, "messages")
    assert_openai_error(post(client, path, {**ok, "model": "other"}), 404, "model")
    assert_openai_error(post(client, path, ok, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(client.get(path, headers=AUTH), 405)
    assert_openai_error(post(client, path, {**ok, "user": "x" * BODY_LIMIT}), 413)
    assert_openai_error(client.get("/v1/nothing", headers=AUTH), 404)
    assert_openai_error(post(client, path, {**ok, "messages": [{"role": "user", "content": "boom"}]}), 500)
    app.state.admission.in_flight = app.state.admission.max_in_flight
    assert_openai_error(post(client, path, ok), 429)
    app.state.admission.in_flight = 0
    llm.is_healthy = False
    assert_openai_error(post(client, path, ok), 503)
    llm.is_healthy = True
    assert_served(client)


@pytest.mark.parametrize("method,path,allow", [("DELETE", "/health", "GET, HEAD"), ("PUT", "/ping", "GET, POST"),
                                               ("POST", "/v1/models", "GET"), ("GET", "/v1/completions", "POST"),
                                               ("PATCH", "/v1/responses/x", "DELETE, GET")])
def test_405_names_the_allowed_methods(client, method, path, allow):
    r = client.request(method, path, headers=AUTH)
    assert_openai_error(r, 405)
    assert r.headers["Allow"] == allow


def test_head_and_ping_probes(served, client):
    _, llm, _ = served
    for method, path in [("HEAD", "/health"), ("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")]:
        r = client.request(method, path)
        assert r.status_code == 200 and r.content == b""
    llm.is_healthy = False
    assert client.get("/health").status_code == 503 and client.post("/ping").status_code == 503


# ---------------------------------------------------------------- the OpenAPI document

@pytest.fixture(scope="module")
def openapi(served) -> dict:
    client = served[0]
    r = client.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def _operations(doc: dict):
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            yield path, method, op


def _refs(node):
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if isinstance(x.get("$ref"), str):
                yield x["$ref"]
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def test_openapi_operation_ids_are_unique(openapi):
    ids = [op["operationId"] for _, _, op in _operations(openapi)]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert {("/health", "head"), ("/ping", "post")} <= {(p, m) for p, m, _ in _operations(openapi)}


def test_openapi_lists_400_with_the_error_schema_never_422(openapi):
    schemas = openapi["components"]["schemas"]
    for path, method, op in _operations(openapi):
        assert "422" not in op["responses"], (path, method)
        if "requestBody" in op or op.get("parameters"):
            error = op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
            want = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
            assert error == f"#/components/schemas/{want}", (path, method)
    assert set(schemas["ErrorResponse"]["properties"]) == {"error"}
    assert set(schemas["AnthropicErrorResponse"]["properties"]) == {"type", "error"}
    assert "HTTPValidationError" not in schemas
    missing = {r for r in _refs(openapi) if r.removeprefix("#/components/schemas/") not in schemas}
    assert not missing


def test_openapi_has_the_anthropic_request_bodies(openapi):
    schemas = openapi["components"]["schemas"]
    for path, model in [("/v1/messages", "MessagesRequest"), ("/v1/messages/count_tokens", "CountTokensRequest")]:
        body = openapi["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
        assert {"messages", "max_tokens", "tools"} <= set(schemas[model]["properties"])
    assert "max_tokens" in schemas["MessagesRequest"]["required"]
    assert "max_tokens" not in schemas["CountTokensRequest"].get("required", [])


def test_openapi_probes_answer_empty_bodies(openapi):
    for path in ("/health", "/ping"):
        for op in openapi["paths"][path].values():
            assert set(op["responses"]) == {"200", "503"}
            assert all("content" not in r for r in op["responses"].values())


def test_offline_chat_refuses_deeply_nested_tool_arguments():
    """``LLM.chat`` prepares messages without the server's depth check: nesting past Python's
    recursion limit is a ValueError naming the arguments, not a RecursionError."""
    from pagedllm.entrypoints.chat_utils import prepare_messages
    deep = "[" * 5000 + "]" * 5000
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}]}
    with pytest.raises(ValueError, match="nested too deeply"):
        prepare_messages([msg])

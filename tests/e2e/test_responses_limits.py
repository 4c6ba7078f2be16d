"""Issue 35's limits over HTTP: the Responses fields OpenAI bounds (``temperature``, ``top_p``,
``top_logprobs``, ``metadata``), the ones pagedllm does not serve (``include``, ``background``, ...),
Anthropic's ``top_k`` and count_tokens' ``tool_choice``, rerank's ``top_n`` - each a 400 in its API's
own shape naming the field, the next request served - on the shared SmolLM2 server (``server_url``);
and stored responses scoped to the API key that made them, on an in-process app with two keys over a
tiny random model (``pagedllm serve --api-key`` takes one key; ``build_app`` takes several)."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

KEY_A, KEY_B = "sk-alice", "sk-bob"
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def post(url: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url, json=body, headers=headers, timeout=120)


def assert_served(server_url: str, model: str) -> None:
    """The server still answers a plain Responses request after a refusal."""
    r = post(f"{server_url}/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 2})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ Responses fields


REFUSED = {
    "temperature_huge": ({"temperature": 1e308}, "temperature"),
    "temperature_above_2": ({"temperature": 2.5}, "temperature"),
    "temperature_negative": ({"temperature": -0.5}, "temperature"),
    "top_p_above_1": ({"top_p": 1.5}, "top_p"),
    "top_logprobs_above_20": ({"top_logprobs": 21}, "top_logprobs"),
    "top_logprobs_not_served": ({"top_logprobs": 5}, "top_logprobs"),
    "max_output_tokens_huge": ({"max_output_tokens": 2**64}, "max_output_tokens"),
    "include_logprobs": ({"include": ["message.output_text.logprobs"]}, "include"),
    "include_encrypted_reasoning": ({"include": ["reasoning.encrypted_content"]}, "include"),
    "include_unknown": ({"include": ["no.such.thing"]}, "include"),
    "background": ({"background": True}, "background"),
    "conversation": ({"conversation": "conv_123"}, "conversation"),
    "metadata_17_pairs": ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    "metadata_long_key": ({"metadata": {"k" * 65: "v"}}, "metadata"),
    "metadata_long_value": ({"metadata": {"k": "v" * 513}}, "metadata"),
    "metadata_number_value": ({"metadata": {"k": 1}}, "metadata"),
    "metadata_huge": ({"metadata": {"k": "v" * 2**20}}, "metadata"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_responses_field_is_a_400_naming_it(server_url, served_model, case):
    extra, field = REFUSED[case]
    r = post(f"{server_url}/v1/responses", {"model": served_model, "input": "Hi", "max_output_tokens": 2, **extra})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error" and field in err["message"]
    assert_served(server_url, served_model)


def test_responses_limits_themselves_are_served(server_url, served_model):
    """OpenAI's bounds are inclusive; ``background: false``, ``include: []`` and ``top_logprobs: 0`` change
    nothing; 16 pairs of 64-character keys and 512-character values come back as sent, and are stored."""
    metadata = {f"{i:02d}".ljust(64, "k"): "v" * 512 for i in range(16)}
    r = post(f"{server_url}/v1/responses", {"model": served_model, "input": "Hi", "max_output_tokens": 2,
                                            "temperature": 2, "top_p": 1, "background": False, "include": [],
                                            "top_logprobs": 0, "metadata": metadata})
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == metadata and r.json()["temperature"] == 2
    got = httpx.get(f"{server_url}/v1/responses/{r.json()['id']}", timeout=30)
    assert got.status_code == 200 and got.json()["metadata"] == metadata


# ------------------------------------------------------------------ Anthropic Messages, rerank


def test_messages_top_k_negative_is_a_400(server_url, served_model):
    body = {"model": served_model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    r = post(f"{server_url}/v1/messages", {**body, "top_k": -1})
    assert r.status_code == 400 and "top_k" in r.json()["error"]["message"], r.text
    assert r.json()["type"] == "error"  # Anthropic's shape
    assert post(f"{server_url}/v1/messages", {**body, "top_k": 5}).status_code == 200


def test_count_tokens_refuses_an_unknown_tool_choice(server_url, served_model):
    body = {"model": served_model, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    for path in ("/v1/messages/count_tokens", "/v1/messages"):
        r = post(f"{server_url}{path}", {**body, "max_tokens": 2, "tool_choice": {"type": "tool", "name": "nope"}})
        assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"], (path, r.text)
    r = post(f"{server_url}/v1/messages/count_tokens", {**body, "tool_choice": {"type": "any", "name": None},
                                                         "tools": []})
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"], r.text
    r = post(f"{server_url}/v1/messages/count_tokens", {**body, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text


def test_rerank_top_n_past_int32_is_a_400(server_url, served_model):
    """The body is checked before the model is: the generation server answers for the field too."""
    r = post(f"{server_url}/v1/rerank", {"query": "q", "documents": ["a", "b"], "top_n": 2**64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_n", r.text
    assert_served(server_url, served_model)


# ------------------------------------------------------------------ stored responses per API key


@pytest.fixture(scope="module")
def two_keys(tiny_model_dir, thread_server):
    """An app over a tiny random llama that accepts ``KEY_A`` and ``KEY_B``."""
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.server.app import build_app

    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(tiny_model_dir("llama")), num_kv_blocks=64)))
    server = None
    try:
        server = thread_server(build_app(llm, "tiny", api_key=[KEY_A, KEY_B]))
        yield SimpleNamespace(url=server.url)
    finally:
        if server is not None:
            server.stop()
        llm.shutdown()


def test_stored_responses_are_scoped_to_their_key(two_keys):
    """Caller B can neither read, continue nor delete caller A's stored response: each answers the 404 of
    an unknown id (same message), so ids cannot be probed; A still can do all three."""
    url = two_keys.url + "/v1/responses"
    r = post(url, {"input": "Hi", "max_output_tokens": 2, "temperature": 0}, KEY_A)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    unknown = "resp_" + "0" * 32

    def same_404(resp: httpx.Response, probe: httpx.Response) -> None:
        assert resp.status_code == probe.status_code == 404, resp.text
        assert resp.json()["error"]["message"].replace(rid, "ID") == probe.json()["error"]["message"].replace(
            unknown, "ID")

    def get(k, i):
        return httpx.get(f"{url}/{i}", headers={"Authorization": f"Bearer {k}"}, timeout=30)

    def delete(k, i):
        return httpx.delete(f"{url}/{i}", headers={"Authorization": f"Bearer {k}"}, timeout=30)

    same_404(get(KEY_B, rid), get(KEY_B, unknown))
    same_404(delete(KEY_B, rid), delete(KEY_B, unknown))
    cont = {"input": "More", "max_output_tokens": 2}
    same_404(post(url, {**cont, "previous_response_id": rid}, KEY_B),
             post(url, {**cont, "previous_response_id": unknown}, KEY_B))
    assert get(KEY_A, rid).status_code == 200
    assert post(url, {**cont, "previous_response_id": rid}, KEY_A).status_code == 200
    assert delete(KEY_A, rid).status_code == 200 and get(KEY_A, rid).status_code == 404
    assert post(url, {"input": "Hi", "max_output_tokens": 2}, "sk-wrong").status_code == 401
    streamed = post(url, {"input": "Hi", "max_output_tokens": 2, "stream": True}, KEY_B)  # stored at the end
    assert streamed.status_code == 200
    sid = next(line for line in streamed.text.splitlines() if '"response.completed"' in line or
               '"response.incomplete"' in line).split('"id": "')[1].split('"')[0]
    assert get(KEY_B, sid).status_code == 200 and get(KEY_A, sid).status_code == 404


def test_api_key_repeats_on_the_command_line(monkeypatch):
    """``--api-key`` is repeatable (each key its own store owner) and does not swallow the model."""
    import pagedllm.cli as cli
    seen = {}
    monkeypatch.setattr(cli, "_serve", lambda a: seen.setdefault("a", a) and 0)
    assert cli.main(["serve", "--api-key", "ka", "--api-key", "kb", "some-model"]) == 0
    assert seen["a"].api_key == ["ka", "kb"] and seen["a"].model == "some-model"

"""End-to-end tests of the OpenAI-compatible server through the official ``openai`` client.

One live ``pagedllm serve`` (see ``conftest.py``) serves every test; requests
are greedy (``temperature=0``) so the answers are reproducible.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

MODEL_NAME = "smollm2"  # --served-model-name in conftest.py (checked by test_health_and_models)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY_PROMPT = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    # no retries: a 5xx must fail the test at once, not be retried away
    return openai.OpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0, timeout=120)


def stats(server_url) -> dict:
    r = httpx.get(server_url + "/stats", timeout=10)
    assert r.status_code == 200
    return r.json()


def wait_idle(server_url, timeout: float = 5.0) -> dict:
    """Poll ``/stats`` until no request runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(server_url)
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_blocks"]:
            return s
        if time.monotonic() > deadline:
            pytest.fail(f"engine not idle (no running or waiting request, every KV block free) within {timeout} s: {s}")
        time.sleep(0.1)


def assert_healthy(client) -> None:
    """A normal request still succeeds (the server survived the previous one)."""
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1


# ---- basics ------------------------------------------------------------------------


def test_health_and_models(server_url, client, served_model, max_model_len):
    assert served_model == MODEL_NAME
    assert httpx.get(server_url + "/health", timeout=10).status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].object == "model"
    assert httpx.get(server_url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"] == max_model_len


def test_chat_answer(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, temperature=0, max_tokens=40)
    assert r.object == "chat.completion" and r.model == MODEL_NAME and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert "Paris" in choice.message.content
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.completion_tokens <= 40


def test_chat_model_may_be_omitted(server_url):
    r = httpx.post(server_url + "/v1/chat/completions", timeout=60,
                   json={"messages": QUESTION, "temperature": 0, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL_NAME


# ---- streaming chat ------------------------------------------------------------------


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_matches_non_stream(client, include_usage):
    kw = dict(model=MODEL_NAME, messages=QUESTION, temperature=0, max_tokens=24)
    full = client.chat.completions.create(**kw)
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(client.chat.completions.create(stream=True, **kw, **extra))

    assert chunks, "empty stream"
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL_NAME for c in chunks)
    assert len({c.id for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason is not None]
    assert finishes == [full.choices[0].finish_reason]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == full.choices[0].message.content

    if include_usage:
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert last.usage.model_dump() == full.usage.model_dump()
        assert all(c.usage is None for c in chunks[:-1])
        assert len(with_choices) == len(chunks) - 1
    else:
        assert all(c.usage is None for c in chunks)
        assert len(with_choices) == len(chunks)


def test_raw_stream_ends_with_done(server_url):
    body = {"messages": QUESTION, "temperature": 0, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        json.loads(ln[len("data: "):])


# ---- completions with stop strings -------------------------------------------------------


@pytest.fixture(scope="module")
def unconstrained(client):
    """A greedy completion, and a word from its middle to use as a stop string."""
    r = client.completions.create(model=MODEL_NAME, prompt=STORY_PROMPT, max_tokens=24, temperature=0)
    text = r.choices[0].text
    words = [w for w in text.split() if w.isalpha() and len(w) >= 3]
    assert len(words) >= 3, f"unexpected output {text!r}"
    word = words[len(words) // 2]
    cut = text.index(word)
    assert cut > 0
    return text, word, text[:cut]


def test_completion_stop_string(client, unconstrained):
    text, word, expected = unconstrained
    r = client.completions.create(model=MODEL_NAME, prompt=STORY_PROMPT, max_tokens=24, temperature=0,
                                  stop=[word])
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == expected, (text, word)
    assert r.choices[0].finish_reason == "stop"
    u = r.usage
    assert 0 < u.completion_tokens < 24 and u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_completion_stop_string_streamed(client, unconstrained):
    text, word, expected = unconstrained
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=STORY_PROMPT, max_tokens=24,
                                            temperature=0, stop=[word], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected, (text, word)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason is not None]
    assert finishes == ["stop"]
    assert all(c.usage is None for c in chunks)


def test_completion_echo_and_token_prompt(client):
    r = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("The sky is")
    r = client.completions.create(model=MODEL_NAME, prompt=[504, 3256, 314], max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 3


# ---- errors ------------------------------------------------------------------------


# request-body overrides of a valid chat request -> the `param` the 400 must name
BAD_REQUESTS = {
    "temperature": ({"temperature": -1}, "temperature"),
    "top_p": ({"top_p": 2}, "top_p"),
    "n": ({"n": 0}, "n"),
    "empty_messages": ({"messages": []}, "messages"),
    "missing_messages": ({"messages": openai.Omit()}, "messages"),
    "unknown_role": ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
    "content_type": ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    "content_part_type": ({"messages": [{"role": "user", "content": [{"type": "input_file", "input_file": {}}]}]},
                          "messages[0].content[0].type"),
    "image_url_without_url": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                              "messages[0].content[0].image_url.url"),
    # an image for a text-only model (SmolLM2)
    "image_for_text_model": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, "messages[0].content[0]"),
    "content_part_text": ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                          "messages[0].content[0].text"),
    "max_tokens_type": ({"max_tokens": "abc"}, "max_tokens"),
    "max_tokens_zero": ({"max_tokens": 0}, "max_tokens"),
    "top_k_overflow": ({"top_k": 10**30}, "top_k"),
    "min_tokens": ({"min_tokens": 5}, "min_tokens"),
    "stream_options": ({"stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_400(client, case):
    overrides, param = BAD_REQUESTS[case]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, extra_body=overrides)
    e = ei.value
    assert e.status_code == 400
    err = e.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error" and err["code"]
    assert err["param"] == param and e.param == param, err
    assert_healthy(client)


def test_temperature_error_body(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, temperature=-1)
    e = ei.value
    assert e.status_code == 400
    assert isinstance(e.body, dict)  # the SDK unwraps {"error": {...}}
    assert e.body["param"] == "temperature" and e.body["type"] == "invalid_request_error"
    assert e.body["code"] and "temperature" in e.body["message"]
    assert_healthy(client)


@pytest.mark.parametrize("raw", ['{"messages": [', "not json", '{"messages": [{"role": "user", "content": "Hi"}], '
                                 '"temperature": NaN}', "[1, 2]", ""])
def test_malformed_body_400(server_url, client, raw):
    r = httpx.post(server_url + "/v1/chat/completions", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert_healthy(client)


def test_prompt_too_long(client, max_model_len):
    n = max_model_len + 500
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL_NAME, prompt=[504] * n, max_tokens=4)
    e = ei.value
    assert e.status_code == 400 and e.param == "prompt" and e.code == "context_length_exceeded"
    assert str(max_model_len) in e.body["message"] and str(n) in e.body["message"]
    # a chat conversation over the limit names `messages`
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL_NAME, max_tokens=4,
                                       messages=[{"role": "user", "content": "hello " * n}])
    assert ei.value.param == "messages" and str(max_model_len) in ei.value.body["message"]
    # prompt + max_tokens over the limit names `max_tokens`
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=max_model_len)
    assert ei.value.param == "max_tokens" and str(max_model_len) in ei.value.body["message"]
    assert_healthy(client)


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="gpt-17", messages=QUESTION, max_tokens=2)
    assert ei.value.status_code == 404 and ei.value.param == "model"
    assert "gpt-17" in ei.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="Hi", max_tokens=2)
    assert_healthy(client)


# ---- concurrency ----------------------------------------------------------------------


def test_concurrent_requests_share_steps(server_url):
    n, max_tokens = 8, 32
    before = wait_idle(server_url)  # also a fresh snapshot: stats refresh just after outputs go out

    async def run():
        async with openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0,
                                      timeout=120) as ac:
            return await asyncio.gather(*[
                ac.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=max_tokens,
                                           messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                                           extra_body={"ignore_eos": True})
                for i in range(n)])

    results = asyncio.run(run())
    assert len(results) == n
    for r in results:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == max_tokens
    after = wait_idle(server_url)
    assert after["num_generation_tokens"] - before["num_generation_tokens"] == n * max_tokens
    # batched: far fewer steps than tokens, and several requests ran in one step
    assert after["num_steps"] - before["num_steps"] < n * max_tokens
    assert after["max_num_running"] > 1, after


# ---- client disconnects -------------------------------------------------------------------


def test_stream_disconnect_frees_request(server_url, client):
    body = {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 1000, "stream": True, "ignore_eos": True,
            "temperature": 0}
    before = wait_idle(server_url)  # also a fresh snapshot: stats refresh just after outputs go out
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server_url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep the iterator: dropping it would already close the connection
            got = 0
            while got < 3:  # the role chunk, then content: generation is under way
                if next(lines).startswith("data: "):
                    got += 1
            assert stats(server_url)["num_running"] == 1
        # leaving the block closes the connection mid-stream
    s = wait_idle(server_url, timeout=1.0)  # issue 3: no running request, all blocks free within one second
    assert s["kv_cache_usage"] == 0 and s["num_free_blocks"] == s["num_blocks"]
    assert 2 <= s["num_generation_tokens"] - before["num_generation_tokens"] < 1000  # aborted, not finished
    assert_healthy(client)


def test_non_stream_disconnect_frees_request(server_url, client):
    body = {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    before = wait_idle(server_url)  # also a fresh snapshot: stats refresh just after outputs go out
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server_url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    s = wait_idle(server_url, timeout=3)
    assert 1 <= s["num_generation_tokens"] - before["num_generation_tokens"] < 1000  # aborted, not finished
    assert_healthy(client)


def test_unknown_path_and_wrong_method_get_openai_error_bodies(server_url):
    """404 for an unknown path and 405 for a wrong method answer with OpenAI's error body too."""
    r = httpx.get(f"{server_url}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{server_url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_stats_show_the_engine_plan(server_url):
    """``/stats`` carries the engine plan the server started with: the embedded SmolLM2 GGUF served
    natively with its blocks packed, one rank."""
    plan = stats(server_url)["plan"]
    assert plan["architecture"] == "LlamaForCausalLM" and plan["runner"] == "generate"
    assert plan["model"]["impl"] == "native" and plan["model"]["dtype"] == "float32"
    assert plan["model"]["quantization"] in ("gguf", "none")  # gguf where the C kernels are on
    assert plan["parallel"] == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                                "executor": "uni", "pipeline_micro_batches": 0}

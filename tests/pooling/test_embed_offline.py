"""Offline embeddings of all-MiniLM-L6-v2 against sentence-transformers, scores, truncation, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

TOL = 1e-5


def _vecs(outs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outs], dtype=np.float32)


def test_batched_and_one_by_one_equal_sentence_transformers(minilm_llm, st_model, sentences):
    ref = st_model.encode(sentences, convert_to_numpy=True)
    batched = _vecs(minilm_llm.embed(sentences, use_tqdm=False))
    assert batched.shape == ref.shape == (len(sentences), 384)
    assert np.abs(batched - ref).max() < TOL
    for s, r in zip(sentences, ref):
        one = _vecs(minilm_llm.embed(s, use_tqdm=False))[0]
        assert np.abs(one - r).max() < TOL
        assert float(one @ r) >= 0.99999
    eng = minilm_llm.engine
    assert not eng.has_unfinished_requests() and eng.scheduler.requests == {}
    assert eng.kv_cache_manager.num_free_blocks == eng.num_blocks  # an encoder holds no KV block


def test_token_id_input_equals_text(minilm_llm, st_model):
    ids = st_model.tokenizer.encode("token ids in, same vector out")
    by_ids = _vecs(minilm_llm.embed({"prompt_token_ids": ids}, use_tqdm=False))[0]
    by_text = _vecs(minilm_llm.embed("token ids in, same vector out", use_tqdm=False))[0]
    assert np.abs(by_ids - by_text).max() < 1e-6


def test_dimensions_truncate_and_renormalize(minilm_llm, st_model):
    full = _vecs(minilm_llm.embed("Matryoshka dolls nest", use_tqdm=False))[0]
    cut = _vecs(minilm_llm.embed("Matryoshka dolls nest", PoolingParams(dimensions=64), use_tqdm=False))[0]
    assert cut.shape == (64,)
    assert abs(float(np.linalg.norm(cut)) - 1.0) < 1e-5
    assert np.abs(cut - full[:64] / np.linalg.norm(full[:64])).max() < 1e-6
    raw = _vecs(minilm_llm.embed("Matryoshka dolls nest", PoolingParams(normalize=False), use_tqdm=False))[0]
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3  # mean pooling without the Normalize module
    assert np.abs(raw / np.linalg.norm(raw) - full).max() < 1e-6


def test_score_is_cosine_of_embeddings(minilm_llm, st_model):
    docs = ["A kitten sleeps on the sofa.", "Stock markets fell sharply.", "A cat naps on a couch."]
    scores = [o.outputs.score for o in minilm_llm.score("A cat is sleeping on the sofa.", docs, use_tqdm=False)]
    q, d = st_model.encode(["A cat is sleeping on the sofa."]), st_model.encode(docs)
    ref = (d @ q[0]) / (np.linalg.norm(d, axis=1) * np.linalg.norm(q[0]))
    assert np.abs(np.array(scores) - ref).max() < 1e-5
    assert scores[1] < min(scores[0], scores[2])


def test_over_long_input_refused_or_truncated(minilm_llm, st_model):
    long_text = "word " * 400  # ~400 tokens; the model takes 256 (sentence-transformers' max_seq_length)
    with pytest.raises(ValueError, match="maximum input length is 256 tokens"):
        minilm_llm.embed(long_text, use_tqdm=False)
    cut = minilm_llm.embed(long_text, use_tqdm=False, truncate_prompt_tokens=-1)
    assert len(cut[0].prompt_token_ids) == 256
    ref = st_model.encode([long_text])[0]  # sentence-transformers truncates to 256 tokens too
    assert np.abs(_vecs(cut)[0] - ref).max() < TOL
    assert len(minilm_llm.embed(long_text, use_tqdm=False, truncate_prompt_tokens=10)[0].prompt_token_ids) == 10


def test_bad_input(minilm_llm):
    with pytest.raises(ValueError, match="input: must contain at least one token"):
        minilm_llm.embed("", use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions: must be <= 384"):
        minilm_llm.embed("hi", PoolingParams(dimensions=1000), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type"):
        minilm_llm.embed("hi", PoolingParams(pooling_type="MAX"), use_tqdm=False)
    with pytest.raises(ValueError, match="served for pooling"):
        minilm_llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert not minilm_llm.engine.has_unfinished_requests()


def test_generate_runner_refused_for_encoder(minilm_dir):
    with pytest.raises(ValueError, match="encoder-only model"):
        LLM("all-minilm-l6-v2", runner="generate")


def test_budget_splits_batches_never_prompts(minilm_dir, st_model, sentences):
    """With a 130-token budget the sentences spread over several steps, each prompt whole in one."""
    llm = LLM("all-minilm-l6-v2", max_num_batched_tokens=130)
    try:
        eng = llm.engine
        steps: list[dict[str, int]] = []
        schedule = eng.scheduler.schedule

        def spy():
            out = schedule()
            if out.num_scheduled_tokens:
                steps.append(dict(out.num_scheduled_tokens))
            return out

        eng.scheduler.schedule = spy
        outs = llm.embed(sentences, use_tqdm=False)
        lens = {o.request_id: len(o.prompt_token_ids) for o in outs}
        assert len(steps) > 1 and all(sum(s.values()) <= 130 for s in steps)
        assert all(n == lens[rid] for s in steps for rid, n in s.items())  # never a chunk
        assert np.abs(_vecs(outs) - st_model.encode(sentences)).max() < TOL
    finally:
        llm.engine.shutdown()

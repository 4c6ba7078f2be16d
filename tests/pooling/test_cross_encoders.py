"""Cross-encoders (sequence-classification heads over a joined pair) and encoders other than BERT
(the Transformers encoder backend), offline, against ``transformers`` and sentence-transformers'
``CrossEncoder`` on the same random weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.pooling_params import PoolingParams

PAIRS = [("what is the capital of france?", "Paris is the capital of France."),
         ("hello", "a long document about nothing in particular " * 12),
         ("x", "y"),
         ("Which animal barks?", "Dogs bark; cats meow, and both sleep most of the day.")]


def _hf_logits(model_dir, pairs) -> np.ndarray:
    """``[P, num_labels]`` float32 logits of the transformers model, one pair at a time."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    m = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return np.stack([m(**tok(a, b, return_tensors="pt")).logits[0].numpy() for a, b in pairs])


@pytest.fixture(scope="module")
def llms(tiny_encoders):
    """LLMs by name: the native BERT cross-encoder, the same through the Transformers encoder, XLM-R, NLI."""
    from pagedllm import LLM
    made = {"bert": LLM(str(tiny_encoders["bert-ce"]), max_num_batched_tokens=512),
            "bert-hf": LLM(str(tiny_encoders["bert-ce"]), model_impl="transformers", max_num_batched_tokens=512),
            "xlmr": LLM(str(tiny_encoders["xlmr-ce"]), max_num_batched_tokens=512),
            "nli": LLM(str(tiny_encoders["bert-nli"]))}
    yield made
    for llm in made.values():
        llm.engine.shutdown()


@pytest.mark.parametrize("name, model", [("bert", "bert-ce"), ("bert-hf", "bert-ce"), ("xlmr", "xlmr-ce")])
def test_scores_equal_transformers_batched_and_one_by_one(llms, tiny_encoders, name, model):
    ref = _hf_logits(tiny_encoders[model], PAIRS)[:, 0]
    llm = llms[name]
    batched = [o.outputs.score for o in llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False)]
    one = [llm.score(a, b, use_tqdm=False)[0].outputs.score for a, b in PAIRS]
    raw = [o.outputs.score for o in llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False,
                                              pooling_params=PoolingParams(use_activation=False))]
    assert np.abs(np.array(raw) - ref).max() < 1e-5
    assert np.abs(np.array(batched) - 1 / (1 + np.exp(-ref))).max() < 1e-6
    assert np.abs(np.array(one) - np.array(batched)).max() < 1e-6
    assert np.ptp(ref) > 0.1  # the weights tell the pairs apart: the comparison means something


def test_scores_equal_sentence_transformers_cross_encoder(llms, tiny_encoders):
    st = pytest.importorskip("sentence_transformers")
    ce = st.CrossEncoder(str(tiny_encoders["bert-ce"]), device="cpu")
    ref = ce.predict(PAIRS)
    got = [o.outputs.score for o in llms["bert"].score([a for a, _ in PAIRS], [b for _, b in PAIRS],
                                                       use_tqdm=False)]
    assert np.abs(np.array(got) - ref).max() < 1e-6


def test_one_to_many_and_the_pair_is_one_input(llms, tiny_encoders):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(tiny_encoders["bert-ce"])
    q, docs = PAIRS[0][0], [b for _, b in PAIRS]
    out = llms["bert"].score(q, docs, use_tqdm=False)
    ref = _hf_logits(tiny_encoders["bert-ce"], [(q, d) for d in docs])[:, 0]
    assert np.abs(np.array([o.outputs.score for o in out]) - 1 / (1 + np.exp(-ref))).max() < 1e-6
    assert out[1].prompt_token_ids == tok(q, docs[1])["input_ids"]


def test_classify_softmax_over_labels(llms, tiny_encoders):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(tiny_encoders["bert-nli"])
    m = transformers.AutoModelForSequenceClassification.from_pretrained(tiny_encoders["bert-nli"]).eval()
    texts = ["A man is eating.", "Nobody eats anything at all today."]
    with torch.no_grad():
        ref = [m(**tok(t, return_tensors="pt")).logits[0].softmax(0).numpy() for t in texts]
    out = llms["nli"].classify(texts, use_tqdm=False)
    assert [o.outputs.num_classes for o in out] == [3, 3]
    assert np.abs(np.array([o.outputs.probs for o in out]) - np.array(ref)).max() < 1e-6


def test_a_score_needs_a_one_label_head(llms):
    with pytest.raises(ValueError, match="3 labels.*classify"):
        llms["nli"].score("a", "b", use_tqdm=False)


def test_truncation_is_the_tokenizers_longest_first(llms, tiny_encoders):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(tiny_encoders["bert-ce"])
    a, b = "short question", "word " * 400
    with pytest.raises(ValueError, match="maximum input length"):
        llms["bert"].score(a, b, use_tqdm=False)
    out = llms["bert"].score(a, b, use_tqdm=False, truncate_prompt_tokens=40)[0]
    assert out.prompt_token_ids == tok(a, b, truncation="longest_first", max_length=40)["input_ids"]


@pytest.mark.parametrize("call, words", [
    (lambda llm: llm.embed("hi", use_tqdm=False), "cross-encoder"),
    (lambda llm: llm.score("a", "b", pooling_params=PoolingParams(dimensions=1), use_tqdm=False), "dimensions"),
    (lambda llm: llm.score("a", "b", pooling_params=PoolingParams(normalize=True), use_tqdm=False), "normalize"),
    (lambda llm: llm.score("", "b", use_tqdm=False), "non-empty"),
])
def test_what_a_cross_encoder_refuses(llms, call, words):
    with pytest.raises(ValueError, match=words):
        call(llms["bert"])
    assert llms["bert"].score("a", "b", use_tqdm=False)[0].outputs.score > 0  # the next request is served


@pytest.mark.parametrize("name, pooling", [("roberta", "CLS"), ("roberta", "MEAN"), ("distilbert", "MEAN")])
def test_transformers_encoder_embeddings_equal_transformers(tiny_encoders, name, pooling):
    import transformers

    from pagedllm import LLM
    d = tiny_encoders[name]
    tok = transformers.AutoTokenizer.from_pretrained(d)
    m = transformers.AutoModel.from_pretrained(d).eval()
    texts = ["hello world", "a much longer sentence with more tokens in it than the first one has", "x"]
    with torch.no_grad():
        hs = [m(**tok(t, return_tensors="pt")).last_hidden_state[0] for t in texts]
    ref = [torch.nn.functional.normalize(h[0] if pooling == "CLS" else h.mean(0), dim=0).numpy() for h in hs]
    llm = LLM(str(d), max_num_batched_tokens=512)
    try:
        out = llm.embed(texts, PoolingParams(pooling_type=pooling), use_tqdm=False)
        one = [llm.embed(t, PoolingParams(pooling_type=pooling), use_tqdm=False)[0] for t in texts]
    finally:
        llm.engine.shutdown()
    assert np.abs(np.array([o.outputs.data for o in out]) - np.array(ref)).max() < 1e-5
    assert np.abs(np.array([o.outputs.data for o in one]) - np.array(ref)).max() < 1e-5

"""Speculative decoding for requests with structured outputs.

A constrained request gets drafts; point-mass drafts are cut at the first token its grammar
refuses, and the core fills one mask row per logits row (the token, then one after each draft),
rolling the matcher back, so the matcher holds exactly the kept tokens. Greedy output equals the
output without speculation, sampled output always follows the constraint, drafts are really
scheduled for constrained requests, and no KV block is left held.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.structured_output import StructuredOutputsParams

# a list of records with the same keys: JSON a model writes with much repetition (n-gram hits)
SCHEMA = {"type": "array", "minItems": 4, "maxItems": 6, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}}
PROMPT = [{"role": "user", "content": "List five people as JSON records with name, age and city."}]


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 200), **kw,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))


def _spec(method: str, k: int = 4) -> dict:
    return {"method": method, "num_speculative_tokens": k, "dynamic": False, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def plain_outputs(smollm2_dir):
    llm = LLM(str(smollm2_dir), num_kv_blocks=256)
    return [o.outputs[0] for o in llm.chat([PROMPT, PROMPT], _params(temperature=0), use_tqdm=False)]


@pytest.mark.parametrize("method, engine_kw", [("ngram", {}), ("suffix", {"async_scheduling": False}),
                                               ("draft_model", {})])
def test_constrained_greedy_output_equals_no_speculation(smollm2_dir, plain_outputs, assert_no_leaks,
                                                         method, engine_kw):
    """The same greedy tokens as without speculation; a draft model (SmolLM2 drafting for itself)
    proposes for constrained requests too, its drafts kept whole and judged by the masked target."""
    spec = (_spec(method) if method != "draft_model" else
            {"method": method, "model": str(smollm2_dir), "num_speculative_tokens": 3, "dynamic": False})
    llm = LLM(str(smollm2_dir), num_kv_blocks=256, speculative_config=spec, **engine_kw)
    outs = [o.outputs[0] for o in llm.chat([PROMPT, PROMPT], _params(temperature=0), use_tqdm=False)]
    for got, want in zip(outs, plain_outputs):
        assert got.token_ids == want.token_ids
        assert got.finish_reason == "stop"
        jsonschema.validate(json.loads(got.text), SCHEMA)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_draft_tokens > 20 and stats.spec_num_accepted_tokens > 10, stats
    assert outs[0].token_ids and llm.llm_engine.get_stats().spec_num_drafts > 0
    assert_no_leaks(llm.llm_engine)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_constrained_output_follows_the_schema(tiny_model_dir, assert_no_leaks, method):
    """A random model picks tokens with no sense of JSON; with drafts (most refused by the grammar
    or the target) every output still parses and validates, and finishes with ``stop``. n-gram
    drafts are cut at the grammar's first refusal; a draft model's sampled drafts are kept whole
    and the target's masked rows reject what the grammar refuses."""
    path = str(tiny_model_dir("llama"))
    spec = {"method": method, "num_speculative_tokens": 3, "dynamic": False}
    spec.update({"prompt_lookup_min": 1} if method == "ngram" else {"model": path})
    llm = LLM(path, num_kv_blocks=256, max_num_seqs=16, speculative_config=spec)
    n = 12 if method == "ngram" else 6
    params = [_params(temperature=1.0, seed=s, max_tokens=400) for s in range(n)]
    outs = llm.generate(["Answer in JSON:"] * n, params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert llm.llm_engine.get_stats().spec_num_draft_tokens > 0
    assert_no_leaks(llm.llm_engine)


def test_mask_rows_after_each_draft_and_rollback(smollm2_dir):
    """``GrammarState.fill`` with drafts: row ``j`` is the mask after drafts ``0 .. j - 1`` (as a
    second matcher fed them one by one computes it), rows after a refused draft allow everything,
    ``valid_drafts`` cuts at the refusal, and the matcher ends where it started."""
    from pagedllm.structured_output.backend import bitmask_words
    from pagedllm.structured_output.manager import StructuredOutputManager
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    mgr = StructuredOutputManager(str(smollm2_dir), 49152, {tok.eos_token_id})
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    state, twin = mgr.submit(so), mgr.submit(so)
    while not (state.ready and twin.ready):
        mgr.wait_for_compiles(1.0)
    good = tok.encode('[{"name":"Ann"', add_special_tokens=False)
    bad = tok.encode("}}", add_special_tokens=False)[:1]
    drafts = good + bad + good[:2]
    assert state.valid_drafts(drafts) == good
    words = bitmask_words(mgr.backend.vocab_size)
    rows = torch.empty((1 + len(drafts), words), dtype=torch.int32)
    state.fill(rows, 0, drafts)
    ref = torch.empty((1, words), dtype=torch.int32)
    for j in range(len(good) + 1):
        twin.fill(ref, 0)
        assert torch.equal(rows[j], ref[0]), j
        if j < len(good):
            assert twin.accept(good[j]) is None
    assert (rows[len(good) + 1:] == -1).all()
    # the matcher still holds no token: the first row is filled again the same
    again = torch.empty((1, words), dtype=torch.int32)
    state.fill(again, 0)
    assert torch.equal(again[0], rows[0])
    mgr.shutdown()


def test_a_draft_eos_leaves_the_matcher_on_the_kept_tokens(smollm2_dir):
    """A draft EOS right after the grammar's last token: its row is judged, but consuming it would
    stop the matcher and llguidance's rollback does not undo a stop (the kept ``]`` was then
    refused and a correct output finished with ``error``)."""
    from transformers import AutoTokenizer

    from pagedllm.structured_output.manager import StructuredOutputManager
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    manager = StructuredOutputManager(str(smollm2_dir), len(tok), {tok.eos_token_id})
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2}
    state = manager.submit(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    manager.wait_for_compiles(30)
    assert state.ready
    for t in tok.encode("[1,2"):
        assert state.accept(t) is None
    close = tok.encode("]")
    bitmask = torch.zeros((3, (len(tok) + 31) // 32), dtype=torch.int32)
    state.fill(bitmask, 0, close + [tok.eos_token_id])
    assert state.accept(close[0]) != "error", state.error
    assert state.accept(tok.eos_token_id) == "stop"

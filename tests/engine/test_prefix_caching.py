"""Prefix caching end to end: same tokens with the cache on or off, on misses and hits, salts, preemption.

Greedy runs must give the same token ids whether prompts are computed from
scratch (caching off), partly from blocks cached earlier in the same step
(prompts sharing a prefix admitted together), or from blocks cached by an
earlier run. The two may only differ where float rounding can flip a near-tie
of the transformers reference (see ``assert_same_greedy`` in conftest). The
hit counters are checked exactly against a model of the cache: the longest run
of cached full blocks, capped so each prompt's last token is computed.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.hashing import extend_block_hashes

NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from wine making. Within decades, print "
    "shops had spread from Mainz to Venice, Paris and London, and the price of books fell sharply. Scholars "
    "could compare identical copies of a text for the first time, which changed how knowledge was shared, "
    "checked and corrected. Pamphlets carried news and arguments to readers far from universities, and "
    "literacy rose as reading material became cheaper. Historians still debate how quickly these changes "
    "happened, but few doubt that the press reshaped religion, science and politics across Europe.")


@pytest.fixture(scope="module")
def text_ids(smollm2_tokenizer) -> list[int]:
    ids = smollm2_tokenizer.encode(TEXT)
    assert len(ids) >= 124
    return ids


def make_prompts(t: list[int]) -> list[list[int]]:
    """A long shared prefix with two different suffixes, a prompt that is a prefix of both and exactly
    two 16-token blocks long, and an unrelated prompt of exactly four blocks."""
    return [t[:48] + t[100:105], t[:48] + t[110:121], t[:32], t[60:124]]


def chain(tokens: list[int], bs: int, salt: str | None = None) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, bs, salt)
    return hashes


def expected_hits(prompts: list[list[int]], cached: set, bs: int) -> int:
    """Hit tokens when ``prompts`` are admitted in order in one step; adds their full blocks to ``cached``."""
    total = 0
    for p in prompts:
        n = 0
        for h in chain(p, bs)[:(len(p) - 1) // bs]:
            if h not in cached:
                break
            n += 1
        total += n * bs
        cached.update(chain(p, bs))
    return total


def token_ids(outputs) -> list[list[int]]:
    assert all(o.finished for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


def counters(llm: LLM) -> tuple[int, int]:
    s = llm.engine.get_stats()
    return s["prefix_cache_queries"], s["prefix_cache_hits"]


def check_on_off(llm_on: LLM, llm_off: LLM, prompts, hf_model, what: str, check_no_leaks, greedy_ref,
                 one_step: bool = True) -> None:
    """Caching off, then a cold and a warm run with caching on: same tokens, exact hit counts."""
    bs = llm_on.engine.args.block_size
    llm_on.engine.kv_cache_manager.reset_prefix_cache()  # a cold cache, whatever ran before
    off = token_ids(llm_off.generate(prompts, GREEDY, use_tqdm=False))
    assert counters(llm_off) == (0, 0)
    assert all(b.block_hash is None for b in llm_off.engine.kv_cache_manager.pool.blocks)
    check_no_leaks(llm_off.engine)

    cached: set = set()
    for run in ("cold", "warm"):
        q0, h0 = counters(llm_on)
        on = token_ids(llm_on.generate(prompts, GREEDY, use_tqdm=False))
        q1, h1 = counters(llm_on)
        check_no_leaks(llm_on.engine)
        assert q1 - q0 == sum(map(len, prompts))
        want_hits = expected_hits(prompts, cached, bs)
        if one_step:  # every prompt admitted in the first step: the hit count is exact
            assert h1 - h0 == want_hits, f"{what}/{run}"
        if run == "warm":
            assert h1 - h0 > 0
        for k, (p, a, b) in enumerate(zip(prompts, on, off)):
            greedy_ref.assert_same_greedy(a, b, p, hf_model, f"{what}/{run} prompt {k} (len {len(p)})")
        for p, o in zip(prompts, on):
            cached.update(chain(p + o[:-1], bs))  # the last output token's KV is never computed


# ---------------------------------------------------------------- SmolLM2-135M

@pytest.fixture(scope="module")
def smol_pair(smollm2_dir):
    on = LLM(str(smollm2_dir), num_kv_blocks=128)
    off = LLM(str(smollm2_dir), num_kv_blocks=128, enable_prefix_caching=False)
    assert on.engine.args.enable_prefix_caching  # the default
    yield on, off
    del on, off


def test_smollm2_same_tokens_with_and_without_prefix_caching(smol_pair, text_ids, request, assert_no_leaks,
                                                             greedy_ref):
    on, off = smol_pair
    check_on_off(on, off, make_prompts(text_ids), lambda: request.getfixturevalue("hf_smollm2"), "smollm2",
                 assert_no_leaks, greedy_ref)


# ---------------------------------------------------------------- tiny random Llama

def _hf_loader(path):
    def load():
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load


TINY_CONFIGS = {
    "default": dict(num_kv_blocks=128),
    # block size 4 puts many more block boundaries in the prompts; the small budget
    # spreads prompts over steps, so later ones hit blocks computed in earlier steps
    "chunked_bs4": dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("config", list(TINY_CONFIGS))
def test_tiny_same_tokens_with_and_without_prefix_caching(config, tiny_model_dir, text_ids, assert_no_leaks,
                                                          greedy_ref):
    path = tiny_model_dir("llama")
    on = LLM(str(path), **TINY_CONFIGS[config])
    off = LLM(str(path), enable_prefix_caching=False, **TINY_CONFIGS[config])
    prompts = make_prompts(text_ids) + [text_ids[:47], text_ids[:49], text_ids[:1]]  # boundary +-1, one token
    check_on_off(on, off, prompts, _hf_loader(path), f"tiny/{config}", assert_no_leaks, greedy_ref,
                 one_step=config == "default")


def run_engine(engine, requests) -> dict[str, list[int]]:
    """Add ``(request_id, prompt, params, cache_salt)`` requests and step until all finish."""
    for rid, prompt, params, salt in requests:
        engine.add_request(rid, prompt, params, cache_salt=salt)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert set(done) == {r[0] for r in requests}
    return done


def test_cache_salt_isolates_prefixes(tiny_model_dir, text_ids, assert_no_leaks):
    eng = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64).engine
    bs = eng.args.block_size
    prompt = text_ids[:70]
    full_hit = (len(prompt) - 1) // bs * bs

    def hits_of(rid, salt):
        h0 = eng.get_stats()["prefix_cache_hits"]
        tokens = run_engine(eng, [(rid, prompt, GREEDY, salt)])[rid]
        assert_no_leaks(eng)
        return eng.get_stats()["prefix_cache_hits"] - h0, tokens

    hits, ref = hits_of("a1", "alice")
    assert hits == 0
    for rid, salt, want in [("b1", "bob", 0),          # another tenant: no hit
                            ("n1", None, 0),           # no salt is its own namespace
                            ("a2", "alice", full_hit),  # same salt: hit
                            ("b2", "bob", full_hit),
                            ("n2", None, full_hit)]:
        hits, tokens = hits_of(rid, salt)
        assert hits == want, (rid, salt)
        assert tokens == ref, rid
    # requests in flight together share only within a salt
    h0 = eng.get_stats()["prefix_cache_hits"]
    eng.kv_cache_manager.reset_prefix_cache()
    outs = run_engine(eng, [("x1", prompt, GREEDY, "x"), ("y1", prompt, GREEDY, "y"), ("x2", prompt, GREEDY, "x")])
    assert eng.get_stats()["prefix_cache_hits"] - h0 == full_hit  # only x2 hits x1's blocks
    assert all(t == ref for t in outs.values())
    assert_no_leaks(eng)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_keeps_seeded_and_greedy_tokens(prefix_caching, tiny_model_dir, text_ids, assert_no_leaks,
                                                   greedy_ref):
    path = tiny_model_dir("llama")
    t = text_ids
    prompts = [t[:40], t[:40] + t[90:97], t[10:75], t[:64], t[30:61], t[:48] + t[100:120]]
    params = [SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=40, ignore_eos=True) if i % 2 == 0
              else SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for i in range(len(prompts))]
    reqs = [(f"r{i}", p, sp, None) for i, (p, sp) in enumerate(zip(prompts, params))]

    ref_eng = LLM(str(path), num_kv_blocks=256).engine
    ref = run_engine(ref_eng, reqs)
    assert ref_eng.scheduler.num_preemptions == 0
    assert_no_leaks(ref_eng)

    eng = LLM(str(path), num_kv_blocks=14, max_num_batched_tokens=48, enable_prefix_caching=prefix_caching).engine
    got = run_engine(eng, reqs)
    assert eng.scheduler.num_preemptions > 0
    assert (eng.get_stats()["prefix_cache_hits"] > 0) == prefix_caching
    assert_no_leaks(eng)
    for (rid, p, sp, _) in reqs:
        assert len(got[rid]) == 40
        if sp.greedy:
            greedy_ref.assert_same_greedy(got[rid], ref[rid], p, _hf_loader(path), f"preempted greedy {rid}")
        else:
            assert got[rid] == ref[rid], f"seeded {rid} changed under preemption"

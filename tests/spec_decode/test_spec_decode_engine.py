"""Speculative decoding in the engine: greedy output equal to the non-speculative engine's, the
target's distribution when sampling, and no KV block leaked.

The real-model prompts quote a passage and then start repeating it, so drafts are proposed and
mostly accepted (``dynamic: false`` keeps the full depth, so every verification path runs).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

PASSAGE = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
           "movable metal type, oil-based inks and a wooden press adapted from wine making. Within decades, print "
           "shops had spread from Mainz to Venice, Paris and London, and the price of books fell sharply. Scholars "
           "could compare identical copies of a text for the first time, which changed how knowledge was shared.")
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _prompts(tok) -> list[list[int]]:
    base = tok.encode(PASSAGE)
    copy = tok.encode("Text:\n" + PASSAGE + "\n\nThe same text again:\n" + PASSAGE[:80])
    return [copy, base[:40] + base[:25], tok.encode("def add(a, b):\n    return a + b\n\ndef add("), base[10:90]]


def _spec(method: str, k: int = 4, **extra) -> dict:
    return {"method": method, "num_speculative_tokens": k, "dynamic": False, **extra}


@pytest.fixture(scope="module")
def reference(smollm2_dir, smollm2_tokenizer):
    """Greedy tokens of the engine without speculation (async on, the default shape)."""
    prompts = _prompts(smollm2_tokenizer)
    llm = LLM(str(smollm2_dir), num_kv_blocks=256)
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                         use_tqdm=False)]
    del llm
    return prompts, outs


@pytest.mark.parametrize("method, engine_kw", [
    ("ngram", {}),                                                       # async, whole-prompt prefill
    ("suffix", {"async_scheduling": False}),
    ("ngram", {"max_num_batched_tokens": 24, "enable_prefix_caching": False}),  # chunked prefill, small budget
    ("suffix", {"num_kv_blocks": 14}),                                   # preemption
    ("ngram", {"model_impl": "transformers"}),
])
def test_greedy_output_equals_no_speculation(reference, smollm2_dir, hf_smollm2, greedy_ref, assert_no_leaks,
                                             method, engine_kw):
    prompts, want = reference
    kw = {"num_kv_blocks": 256, **engine_kw}
    llm = LLM(str(smollm2_dir), speculative_config=_spec(method), **kw)
    eng = llm.llm_engine
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    alone = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in prompts[:2]]
    again = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)[0]  # a prefix-cache hit
    for i, o in enumerate(batched):
        greedy_ref.assert_same_greedy(o.outputs[0].token_ids, want[i], prompts[i], hf_smollm2, f"batch, prompt {i}")
    for i, o in enumerate(alone):
        greedy_ref.assert_same_greedy(o.outputs[0].token_ids, want[i], prompts[i], hf_smollm2, f"alone, prompt {i}")
    greedy_ref.assert_same_greedy(again.outputs[0].token_ids, want[0], prompts[0], hf_smollm2, "prefix hit")
    stats = eng.get_stats()
    assert stats.spec_num_draft_tokens > 50 and stats.spec_num_accepted_tokens > 20, stats
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    assert batched[0].metrics.spec_num_draft_tokens > 0
    assert batched[0].metrics.spec_num_accepted_tokens <= batched[0].metrics.spec_num_draft_tokens
    if "num_kv_blocks" in engine_kw:
        assert stats.num_preemptions > 0
    assert_no_leaks(eng)


def test_greedy_batch_of_32_on_a_tiny_model(tiny_model_dir, assert_no_leaks):
    """32 requests at once, half of them repetitive: the same tokens with and without drafts."""
    rng = random.Random(3)
    prompts = []
    for i in range(32):
        head = [rng.randint(100, 40000) for _ in range(rng.randint(3, 12))]
        prompts.append(head * 4 if i % 2 else head + [rng.randint(100, 40000) for _ in range(20)])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    d = str(tiny_model_dir("llama"))
    want = [o.outputs[0].token_ids for o in LLM(d, num_kv_blocks=512).generate(prompts, params, use_tqdm=False)]
    for method in ("ngram", "suffix"):
        llm = LLM(d, num_kv_blocks=512, speculative_config=_spec(method, 3, prompt_lookup_min=1))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want, method
        assert llm.llm_engine.get_stats().spec_num_draft_tokens > 0
        assert_no_leaks(llm.llm_engine)


def _vocab8_model(tmp_path_factory, name: str, seed: int, layers: int) -> str:
    """A random Llama on an 8-token vocabulary (no tokenizer: token ids in and out), saved."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.6, bos_token_id=0, eos_token_id=7, pad_token_id=7)
    out = tmp_path_factory.mktemp(name)
    LlamaForCausalLM(cfg).eval().save_pretrained(out)
    GenerationConfig(bos_token_id=0, eos_token_id=7, pad_token_id=7).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    """A random 2-layer Llama with an 8-token vocabulary."""
    return _vocab8_model(tmp_path_factory, "vocab8", 0, 2)


@pytest.fixture(scope="module")
def small_vocab_draft_dir(tmp_path_factory):
    """Another random Llama on the same 8-token vocabulary, 1 layer: a draft whose distribution
    differs from the target's (so sampled drafts are both kept and rejected)."""
    return _vocab8_model(tmp_path_factory, "vocab8-draft", 1, 1)


def _chi_square(a: list[int], b: list[int], cats: int) -> tuple[float, int]:
    """Two-sample chi-square statistic over ``cats`` categories, and its degrees of freedom."""
    stat, df = 0.0, -1
    na, nb = len(a), len(b)
    for c in range(cats):
        x, y = a.count(c), b.count(c)
        if x + y == 0:
            continue
        df += 1
        ex, ey = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return stat, df


# chi-square critical values at p = 0.0005 (df 1..7): a true-distribution run fails about once in 2000
_CRIT = {1: 12.12, 2: 15.20, 3: 17.73, 4: 20.00, 5: 22.11, 6: 24.10, 7: 26.02}


class _GuessingProposer:
    """Proposes 3 tokens drawn from the random model's likelier ones: some drafts are kept, most are not."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def propose(self, batch):
        return {item.request_id: [self.rng.choice([1, 3, 4, 5, 7]) for _ in range(item.k)] for item in batch}

    def finish(self, *args) -> None:
        pass


@pytest.mark.parametrize("sampling, proposer", [
    (dict(temperature=1.0), "guess"),
    (dict(temperature=0.8, top_p=0.9, presence_penalty=0.5), "guess"),
    (dict(temperature=1.0), "draft_model"),  # drafts drawn from another model's q: min(1, p / q), max(p - q, 0)
    (dict(temperature=0.8, top_p=0.9, presence_penalty=0.5), "draft_model"),  # q lacks the penalty p has
])
def test_sampled_tokens_follow_the_targets_distribution(small_vocab_dir, small_vocab_draft_dir, assert_no_leaks,
                                                        sampling, proposer):
    """2000 seeded requests with and without drafts (3 drafts per step, full depth: guessed, or
    sampled from a draft model's distribution): at each output position the token distributions
    agree (two-sample chi-square, p > 0.0005)."""
    n, length = 2000, 4
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    runs = {}
    spec_cfg = (_spec("ngram", 3, prompt_lookup_min=1) if proposer == "guess"
                else _spec("draft_model", 3, model=small_vocab_draft_dir))
    for name, spec in (("plain", None), ("spec", spec_cfg)):
        llm = LLM(small_vocab_dir, skip_tokenizer_init=True, num_kv_blocks=512, max_num_seqs=256,
                  speculative_config=spec)
        if spec is not None and proposer == "guess":
            llm.llm_engine.client.core.scheduler.spec.proposer = _GuessingProposer()
        params = [SamplingParams(max_tokens=length, ignore_eos=True, seed=s, **sampling) for s in range(n)]
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
        runs[name] = [o.outputs[0].token_ids for o in outs]
        if spec is not None:
            stats = llm.llm_engine.get_stats()
            assert stats.spec_num_draft_tokens > n and 0.1 < stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens < 0.9
        assert_no_leaks(llm.llm_engine)
    for pos in range(length):
        stat, df = _chi_square([t[pos] for t in runs["plain"]], [t[pos] for t in runs["spec"]], 8)
        assert stat < _CRIT[df], (pos, stat, df)
    # seeded requests repeat themselves under speculation too
    llm = LLM(small_vocab_dir, skip_tokenizer_init=True, num_kv_blocks=64,
              speculative_config=_spec("ngram", 3, prompt_lookup_min=1))
    p = SamplingParams(max_tokens=8, ignore_eos=True, seed=11, **sampling)
    first = llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0].outputs[0].token_ids == first


def test_soak_with_speculation_returns_every_block(tiny_model_dir, spec_soak):
    """Mixed lengths, stops, logprobs, aborts and a small pool: afterwards the pool is as it started."""
    d = str(tiny_model_dir("llama"))
    llm = LLM(d, num_kv_blocks=40, max_num_batched_tokens=64, speculative_config=_spec("suffix", 4))
    eng = llm.llm_engine
    rng = random.Random(7)
    spec_soak(eng, rng, rounds=3, requests=12, max_tokens=40, abort_at=5)


def test_cli_flag_round_trip():
    import argparse
    from pagedllm.cli_args import add_engine_flags, engine_args_from_cli
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    a = p.parse_args(["--speculative-config", json.dumps({"method": "suffix", "num_speculative_tokens": 3})])
    assert engine_args_from_cli(a).speculative_config.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="unknown key"):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "n_gram": 2})


def test_stop_string_inside_a_multi_token_step(reference, smollm2_dir, smollm2_tokenizer):
    """A stop string completed by a kept draft ends the output where the plain engine ends it: the
    same text, the same token ids (the step's later tokens dropped) and one logprob per token."""
    prompts, want = reference
    text = smollm2_tokenizer.decode(want[0])
    stop = text[30:36]
    assert stop.strip() and text.index(stop) == 30
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[stop], logprobs=0)
    outs = {}
    for name, spec in (("plain", None), ("spec", _spec("ngram"))):
        llm = LLM(str(smollm2_dir), num_kv_blocks=256, speculative_config=spec)
        outs[name] = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0].outputs[0]
        del llm
    a, b = outs["plain"], outs["spec"]
    assert (b.text, list(b.token_ids), b.finish_reason, b.stop_reason) == (a.text, list(a.token_ids), "stop", stop)
    assert len(b.logprobs) == len(b.token_ids)

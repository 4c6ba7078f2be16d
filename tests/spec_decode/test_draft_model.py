"""``draft_model`` speculation on tiny random models with one vocabulary (SmolLM2's tokenizer):
the same greedy tokens as without speculation (batch 1 / 4 / 16, async on and off, chunked
prefill, prefix-cache hits, preemption, a draft pool too small for everyone), the target
drafting for itself keeps every draft, sampled drafts, no KV block of either pool leaks, and the
proposer's rollback gives the drafts a fresh cache would.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.config import SpeculativeConfig, TargetInfo
from pagedllm.spec_decode.proposers import ProposeItem

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


TOKENIZER_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def _save(model, src: Path, out: Path) -> str:
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return str(out)


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory) -> tuple[str, str]:
    """``(target, draft)`` directories with SmolLM2's vocabulary and tokenizer: the target is a
    random 3-layer Llama whose last two layers add little (their output projections scaled by
    0.1), the draft its first layer alone, so about half the drafts are kept."""
    from transformers import AutoModelForCausalLM
    src = Path(tiny_model_dir("llama"))
    full = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for layer in full.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    target = _save(full, src, tmp_path_factory.mktemp("target-3layer"))
    full.config.num_hidden_layers = 1
    small = AutoModelForCausalLM.from_config(full.config, dtype=torch.float32)
    small.load_state_dict(full.state_dict(), strict=False)  # layers 1 and 2 are not the draft's
    return target, _save(small, src, tmp_path_factory.mktemp("draft-1layer"))


@pytest.fixture(scope="module")
def target_dir(pair) -> str:
    return pair[0]


@pytest.fixture(scope="module")
def draft_dir(pair) -> str:
    return pair[1]


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        head = [rng.randint(100, 40000) for _ in range(rng.randint(3, 12))]
        out.append(head * 3 if i % 2 else head + [rng.randint(100, 40000) for _ in range(rng.randint(1, 20))])
    return out


@pytest.fixture(scope="module")
def reference(target_dir):
    """16 prompts and their greedy tokens without speculation."""
    prompts = _prompts(16)
    llm = LLM(target_dir, num_kv_blocks=256)
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _hf(path):
    def load():
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load


def _spec(model: str, k: int = 3, **extra) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **extra}


@pytest.mark.parametrize("draft, spec_kw, engine_kw", [
    ("self", {"dynamic": False}, {}),                                          # async (the default)
    ("self", {"dynamic": False}, {"async_scheduling": False}),
    ("small", {"dynamic": False}, {"async_scheduling": False}),
    ("small", {"dynamic": False}, {"max_num_batched_tokens": 24}),             # chunked prefill, chunked catch-up
    ("small", {"dynamic": False}, {"num_kv_blocks": 24}),                      # target preemption
    ("small", {"dynamic": False, "draft_num_kv_blocks": 6}, {}),               # draft pool full for most
    # dynamic depth, synchronous: under async scheduling drafting beside other decodes costs the
    # next step, which this pair's acceptance (~0.5) does not earn, so the rule would draft nothing
    ("small", {}, {"async_scheduling": False}),
])
def test_greedy_output_equals_no_speculation(reference, target_dir, draft_dir, greedy_ref, assert_no_leaks,
                                             draft, spec_kw, engine_kw):
    prompts, want = reference
    kw = {"num_kv_blocks": 256, **engine_kw}
    llm = LLM(target_dir, speculative_config=_spec(target_dir if draft == "self" else draft_dir, **spec_kw), **kw)
    eng = llm.llm_engine
    got = {16: llm.generate(prompts, GREEDY, use_tqdm=False), 4: llm.generate(prompts[:4], GREEDY, use_tqdm=False),
           1: [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts[4:6]]}
    again = llm.generate(prompts[0], GREEDY, use_tqdm=False)[0]  # a prefix-cache hit in both pools' users
    offset = {16: 0, 4: 0, 1: 4}
    for bs, outs in got.items():
        for i, o in enumerate(outs):
            j = offset[bs] + i
            greedy_ref.assert_same_greedy(o.outputs[0].token_ids, want[j], prompts[j], _hf(target_dir),
                                          f"batch {bs}, prompt {j}")
    greedy_ref.assert_same_greedy(again.outputs[0].token_ids, want[0], prompts[0], _hf(target_dir), "prefix hit")
    stats = eng.get_stats()
    assert stats.spec_num_draft_tokens > 0 and sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    assert stats.prefix_cache_hits > 0
    if draft == "self":  # the target drafting for itself: every greedy draft is the target's own pick
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens, stats
    else:
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, stats
    if "num_kv_blocks" in engine_kw:
        assert stats.num_preemptions > 0
    assert_no_leaks(eng)  # the draft's pool included (conftest.check_no_leaks)


def _proposer(draft_dir: str, num_blocks: int = 64, block_size: int = 4, budget: int = 2048):
    from pagedllm.worker.draft_model import DraftModelProposer
    target = TargetInfo(model_dir=draft_dir, tokenizer_dir=draft_dir, vocab_size=49152, dtype=torch.float32,
                        device=torch.device("cpu"), block_size=block_size, num_blocks=num_blocks, max_model_len=1024,
                        max_num_batched_tokens=budget, run=lambda fn: fn())
    return DraftModelProposer(SpeculativeConfig.parse(_spec(draft_dir, 4)), target)


def test_rollback_gives_the_drafts_of_a_fresh_cache(draft_dir):
    """After a rejection the proposer drops the rejected drafts' K/V and continues from the
    kept prefix: its drafts equal those of a proposer that never saw the request, and blocks
    no longer needed go back to the pool."""
    p, prompt = _proposer(draft_dir, budget=7), _prompts(1, seed=9)[0] + [321] * 9  # budget 7: catch-up in chunks
    d = p.propose([ProposeItem("a", prompt, len(prompt), 4)])["a"]
    assert len(d) == 4 and p.pool.num_used_blocks == -(-(len(prompt) + 3) // 4)
    later = prompt + [d[0], (d[1] + 1) % 49152]                     # one kept, then the target's own token
    got = p.propose([ProposeItem("a", later, len(prompt), 2), ProposeItem("b", prompt, len(prompt), 1)])
    fresh = _proposer(draft_dir).propose([ProposeItem("a", later, len(prompt), 2)])
    assert got["a"] == fresh["a"] and got["b"] == d[:1]
    assert p._seqs["a"].cached == later + got["a"][:1]
    assert p.pool.num_used_blocks == -(-(len(later) + 1) // 4) + -(-len(prompt) // 4)
    p.finish("a")
    p.finish("b")
    p.finish("never-seen")
    assert p.is_idle()


def test_sampled_drafts_come_with_their_distributions(draft_dir):
    """A sampled request's drafts are draws from q, kept as ``[n, V]`` rows for verification (each
    draft has q > 0 there); a greedy request's drafts are the argmax, with no rows."""
    p, prompt = _proposer(draft_dir), _prompts(1, seed=4)[0]
    sampled = SamplingParams(temperature=1.5, seed=3)
    out = p.propose([ProposeItem("s", prompt, len(prompt), 3, sampled),
                     ProposeItem("g", prompt, len(prompt), 3, SamplingParams(temperature=0))])
    q = p.take_probs("s", 2)
    assert q.shape == (2, 49152) and q.dtype == torch.float32
    assert torch.allclose(q.sum(-1), torch.ones(2)) and all(float(q[j, out["s"][j]]) > 0 for j in range(2))
    assert p.take_probs("s", 2) is None and p.take_probs("g", 3) is None
    again = _proposer(draft_dir).propose([ProposeItem("s", prompt, len(prompt), 3, sampled)])
    assert again["s"] == out["s"]  # seeded: the same draws whatever else is in the batch
    p.finish("s")
    p.finish("g")
    assert p.is_idle()


def test_a_full_draft_pool_proposes_nothing_and_fails_nothing(draft_dir):
    """A request the draft pool cannot hold gets no drafts; caches of requests outside the
    current batch are freed for the ones drafting (least recently drafted first)."""
    p = _proposer(draft_dir, num_blocks=3)                           # blocks of 4 tokens
    long_, short = list(range(100, 112)), [5, 6, 7]
    out = p.propose([ProposeItem("long", long_, 12, 4), ProposeItem("short", short, 3, 2)])
    assert "long" not in out and len(out["short"]) == 2             # 12 + 3 tokens need 4 blocks
    assert p.pool.num_used_blocks == 1                                # short's; long holds none
    both = [ProposeItem("long", long_, 12, 1), ProposeItem("short", short + [9], 3, 1)]
    assert list(p.propose(both)) == ["short"]                          # long needs 3 blocks, 2 are free
    # short is not drafting now: its cache is freed for long (and recomputed when it drafts again)
    assert len(p.propose([ProposeItem("long", long_, 12, 1)])["long"]) == 1
    assert p._seqs["short"].blocks == [] and p.pool.num_used_blocks == 3
    assert len(p.propose([ProposeItem("short", short + [9], 3, 1)])["short"]) == 1  # and back
    assert p._seqs["long"].blocks == [] and p.pool.num_used_blocks == 1
    p.finish("long")
    p.finish("short")
    assert p.is_idle()


def test_vocabulary_mismatch_and_missing_model_are_refused(target_dir, draft_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    other = tmp_path / "vocab100"
    LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    with pytest.raises(ValueError, match=r"speculative_config.model .*vocabulary of 100 tokens.*49152"):
        LLM(target_dir, num_kv_blocks=32, speculative_config=_spec(str(other)))
    # the same size, another tokenizer: two tokens' ids swapped
    swapped = tmp_path / "swapped"
    shutil.copytree(draft_dir, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"speculative_config.model .*another tokenizer"):
        LLM(target_dir, num_kv_blocks=32, speculative_config=_spec(str(swapped)))
    with pytest.raises(ValueError, match="speculative_config.model is required"):
        LLM(target_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    from pagedllm.models.loader import ModelNotFoundError
    with pytest.raises(ModelNotFoundError):
        LLM(target_dir, num_kv_blocks=32, speculative_config=_spec(str(tmp_path / "nowhere")))


def test_seeded_sampling_with_sampled_drafts(target_dir, draft_dir, assert_no_leaks):
    """Sampled requests draft from the draft's own distribution q (their temperature / top-p on its
    logits): valid tokens, the same tokens for the same seed, and drafts both kept and rejected;
    the target drafting for itself has q = p, so nearly every draft is kept (the distribution
    test is in test_spec_decode_engine.py)."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True, seed=s) for s in range(6)]
    prompts = _prompts(6, seed=2)
    for draft in (draft_dir, target_dir):
        llm = LLM(target_dir, num_kv_blocks=128, speculative_config=_spec(draft, 3, dynamic=False))
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params[:2], use_tqdm=False)]
        assert again == first[:2]
        assert all(len(t) == 16 and all(0 <= x < 49152 for x in t) for t in first)
        stats = llm.llm_engine.get_stats()
        kept = stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
        assert (0 < kept < 0.95) if draft == draft_dir else kept > 0.9, (draft, stats)
        assert_no_leaks(llm.llm_engine)


def test_cli_flag_builds_a_draft_model_engine(target_dir):
    import argparse
    from pagedllm.cli_args import add_engine_flags, engine_args_from_cli
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    a = p.parse_args(["--speculative-config", json.dumps(_spec(target_dir, 4))])
    cfg = engine_args_from_cli(a).speculative_config
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", target_dir, 4)


def test_smollm2_packed_weights_draft_for_its_float32_copy(smollm2_dir, smollm2_tokenizer, greedy_ref, assert_no_leaks):
    """Real weights: SmolLM2's Q4_1 blocks (served packed) draft for the same model in float32.
    The same greedy tokens as the float32 engine alone, and most drafts kept."""
    prompt = smollm2_tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(smollm2_dir), quantization="none", num_kv_blocks=32)
    want = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    del plain
    llm = LLM(str(smollm2_dir), quantization="none", num_kv_blocks=32,
              speculative_config=_spec(str(smollm2_dir), 4, quantization="gguf", dynamic=False))
    got = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    greedy_ref.assert_same_greedy(got, want, prompt, _hf(str(smollm2_dir)), "smollm2 gguf draft")
    proposer = llm.llm_engine.client.core.scheduler.spec.proposer
    assert proposer.model.quantization_method == "gguf"
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0.7 * stats.spec_num_draft_tokens > 0, stats
    assert_no_leaks(llm.llm_engine)


def test_soak_with_aborts_and_stops_returns_every_draft_block(target_dir, draft_dir, spec_soak):
    """Mixed greedy and sampled requests, stop tokens, logprobs, aborts and small pools on both
    sides: afterwards the target's pool and the draft's are as they started."""
    llm = LLM(target_dir, num_kv_blocks=40, max_num_batched_tokens=64,
              speculative_config=_spec(draft_dir, 3, draft_num_kv_blocks=12, dynamic=False))  # drafts every step
    eng = llm.llm_engine
    rng = random.Random(11)
    spec_soak(eng, rng, rounds=2, requests=10, max_tokens=30, abort_at=4)

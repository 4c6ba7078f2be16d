"""Sampler: greedy, temperature, top-k / top-p / min-p filters, per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, _apply_top_k_top_p_min_p


def sp(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=16, **kw)


@pytest.fixture
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 1000, generator=g) * 3


def draw(probs: list[float], n: int, params: SamplingParams, seed: int = 0) -> torch.Tensor:
    """``n`` tokens sampled from ``n`` identical rows with logits ``log(probs)``."""
    row = torch.tensor(probs).log()
    return Sampler(seed).sample(row.repeat(n, 1), [params] * n, [0] * n)


def freqs(tokens: torch.Tensor, vocab: int) -> list[float]:
    return (torch.bincount(tokens, minlength=vocab).float() / tokens.numel()).tolist()


# ---------------------------------------------------------------- deterministic filters

def test_greedy_is_argmax(logits):
    out = Sampler(0).sample(logits, [sp(temperature=0)] * 16, [0] * 16)
    assert out.dtype == torch.int64 and out.tolist() == logits.argmax(-1).tolist()


def test_top_k_1_is_greedy(logits):
    for seed in range(5):
        out = Sampler(seed).sample(logits, [sp(temperature=1.5, top_k=1)] * 16, [0] * 16)
        assert out.tolist() == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy(logits):
    for seed in range(5):
        out = Sampler(seed).sample(logits, [sp(temperature=2.0, top_p=1e-6)] * 16, [0] * 16)
        assert out.tolist() == logits.argmax(-1).tolist()


def test_greedy_rows_unaffected_by_sampled_rows(logits):
    params = [sp(temperature=0) if i % 2 else sp(temperature=1.0, seed=i) for i in range(16)]
    out = Sampler(0).sample(logits, params, [0] * 16)
    assert out[1::2].tolist() == logits.argmax(-1)[1::2].tolist()


def test_min_p_mask():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    masked = _apply_top_k_top_p_min_p(probs.log(), torch.tensor([4]), torch.tensor([1.0]), torch.tensor([0.35]))
    # threshold 0.35 * 0.5 = 0.175: tokens 2 and 3 go
    assert torch.isfinite(masked).tolist() == [[True, True, False, False]]
    assert torch.allclose(masked[0, :2], probs.log()[0, :2])


def test_min_p_sampling_frequencies():
    toks = draw([0.5, 0.3, 0.15, 0.05], 20000, sp(temperature=1.0, min_p=0.35))
    f = freqs(toks, 4)
    assert f[2] == f[3] == 0.0
    assert abs(f[0] - 0.5 / 0.8) < 0.02 and abs(f[1] - 0.3 / 0.8) < 0.02


def test_top_k_mask_keeps_k_best():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    masked = _apply_top_k_top_p_min_p(logits, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert torch.isfinite(masked).tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    masked = _apply_top_k_top_p_min_p(probs.log(), torch.tensor([4]), torch.tensor([0.65]), torch.tensor([0.0]))
    # sorted 0.4, 0.3 (cum 0.7 >= 0.65): keep tokens 1 and 3
    assert torch.isfinite(masked).tolist() == [[False, True, False, True]]
    masked = _apply_top_k_top_p_min_p(probs.log(), torch.tensor([4]), torch.tensor([0.7 + 1e-4]), torch.tensor([0.0]))
    assert torch.isfinite(masked).tolist() == [[False, True, True, True]]


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # vLLM and transformers apply top-k first, then top-p on the renormalised survivors:
    # top-2 of (0.4, 0.3, 0.2, 0.1) -> (0.571, 0.429); top_p=0.5 keeps only the first
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    masked = _apply_top_k_top_p_min_p(probs.log(), torch.tensor([2]), torch.tensor([0.5]), torch.tensor([0.0]))
    assert torch.isfinite(masked).tolist() == [[True, False, False, False]]


def test_filters_are_per_row():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3)
    masked = _apply_top_k_top_p_min_p(probs.log(), torch.tensor([1, 4, 4]), torch.tensor([1.0, 0.6, 1.0]),
                                      torch.tensor([0.0, 0.0, 0.0]))
    assert torch.isfinite(masked).tolist() == [[True, False, False, False], [True, True, False, False],
                                               [True, True, True, True]]


def test_min_tokens_bans_eos_and_stop_token_ids():
    logits = torch.zeros(4, 10)
    logits[:, 2] = 5.0  # EOS is the favourite
    logits[:, 7] = 4.0  # then a stop token id
    logits[:, 3] = 3.0
    params = [sp(temperature=0, min_tokens=2, stop_token_ids=[7]),   # below min: EOS and 7 banned
              sp(temperature=0, min_tokens=2, stop_token_ids=[7]),   # reached min: nothing banned
              sp(temperature=0, min_tokens=2, ignore_eos=True),      # ignore_eos: EOS stays allowed
              sp(temperature=0)]
    out = Sampler(0, eos_token_ids={2}).sample(logits, params, [1, 2, 0, 0])
    assert out.tolist() == [3, 2, 2, 2]
    assert logits[0, 2] == 5.0  # the caller's logits are not modified


def test_min_tokens_bans_in_random_rows():
    logits = torch.tensor([[3.0, 0.0, 3.0]]).repeat(2000, 1)
    params = [sp(temperature=1.0, min_tokens=5, stop_token_ids=[0])] * 2000
    toks = Sampler(0, eos_token_ids={2}).sample(logits, params, [4] * 2000)
    assert set(toks.tolist()) == {1}


# ---------------------------------------------------------------- random draws

@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_follows_softmax(temperature):
    p = torch.tensor([0.2, 0.3, 0.5])
    toks = draw(p.tolist(), 20000, sp(temperature=temperature), seed=3)
    expected = (p.log() / temperature).softmax(-1).tolist()
    for got, want in zip(freqs(toks, 3), expected):
        assert abs(got - want) < 0.02


def test_seeded_rows_follow_softmax_across_seeds():
    p = [0.2, 0.3, 0.5]
    row = torch.tensor(p).log()
    n = 20000
    params = [sp(temperature=1.0, seed=s) for s in range(n)]
    toks = Sampler(0).sample(row.repeat(n, 1), params, [7] * n)
    for got, want in zip(freqs(toks, 3), p):
        assert abs(got - want) < 0.02


def test_seeded_token_independent_of_batch(logits):
    me = sp(temperature=1.0, seed=1234)
    alone = [Sampler(0).sample(logits[3:4], [me], [pos]).item() for pos in range(8)]
    for partner_seed in (None, 7):
        partner = sp(temperature=0.7, top_k=50, seed=partner_seed)
        for pos in range(8):
            # put the row at another index, beside other rows, with another engine seed
            batch = torch.cat([logits[5:6], logits[9:10], logits[3:4]])
            got = Sampler(99).sample(batch, [partner, sp(temperature=0), me], [0, 4, pos])[2].item()
            assert got == alone[pos]


def test_seeded_tokens_depend_on_position_and_seed(logits):
    row = logits[0:1] / 20  # flat enough that draws vary
    a = [Sampler(0).sample(row, [sp(temperature=1.0, seed=1)], [pos]).item() for pos in range(12)]
    b = [Sampler(0).sample(row, [sp(temperature=1.0, seed=2)], [pos]).item() for pos in range(12)]
    assert a != b
    assert len(set(a)) > 1


def test_unseeded_rows_use_engine_generator(logits):
    row = logits[0:1] / 20
    a = [Sampler(5).sample(row, [sp(temperature=1.0)], [0]).item() for _ in range(3)]
    assert len(set(a)) == 1  # same engine seed, same first draw
    s = Sampler(5)
    b = [s.sample(row, [sp(temperature=1.0)], [0]).item() for _ in range(12)]
    assert len(set(b)) > 1  # the generator advances


# ---------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from pagedllm import LLM
    return LLM(str(tiny_model_dir("llama")), num_kv_blocks=256, block_size=16)


def _gen(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_request_same_tokens_whatever_the_batch(tiny_llm, assert_no_leaks):
    me = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=24)
    prompt = list(range(100, 140))
    alone = _gen(tiny_llm, [prompt], [me])[0]
    assert_no_leaks(tiny_llm.engine)
    others = [SamplingParams(temperature=1.0, max_tokens=30), SamplingParams(temperature=0.5, seed=7, max_tokens=5),
              SamplingParams(temperature=0, max_tokens=12)]
    batched = _gen(tiny_llm, [list(range(500, 503)), prompt, list(range(900, 1000)), [17]],
                   [others[0], me, others[1], others[2]])
    assert batched[1] == alone
    assert_no_leaks(tiny_llm.engine)
    again = _gen(tiny_llm, [prompt, prompt], [me, SamplingParams(temperature=1.0, seed=43, max_tokens=24)])
    assert again[0] == alone
    assert again[1] != alone  # another seed, other tokens
    assert_no_leaks(tiny_llm.engine)


def test_seeded_request_survives_preemption(tiny_model_dir, assert_no_leaks):
    from pagedllm import LLM
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=12, block_size=16)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60) for s in range(4)]
    prompts = [list(range(200 + 50 * i, 240 + 50 * i)) for i in range(4)]
    together = _gen(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)
    alone = [_gen(llm, [p], [s])[0] for p, s in zip(prompts, params)]
    assert together == alone
    assert_no_leaks(llm.engine)


def test_unseeded_engine_seed_reproducible(tiny_model_dir):
    from pagedllm import LLM
    outs = []
    for _ in range(2):
        llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, seed=11)
        outs.append(_gen(llm, [[5, 6, 7], [8, 9]], SamplingParams(temperature=1.0, max_tokens=10)))
    assert outs[0] == outs[1]
    assert not math.isnan(sum(outs[0][0]))

"""Penalties, logit bias, logprobs, prompt logprobs and n > 1 through the engine, against references.

The reference for every value is ``transformers`` on the same weights in
float32: one forward pass over prompt + generated tokens gives the logits each
generated token was picked from. Penalties are recomputed from their
definitions on those logits; logprobs are its log-softmax.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker.sampler import apply_penalties

PROMPT = "List the days of the week, one per line, and repeat the list three times:\n"
GAP = 1e-3   # a greedy pick may differ from the reference only where its top-2 logits are this close
LP_TOL = 2e-3


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=512, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[int]:
    return llm.get_tokenizer().encode(PROMPT)


def ref_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` float32: transformers' logits at every position of ``ids``."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def penalised(logits: torch.Tensor, prompt: list[int], out: list[int], sp: SamplingParams) -> torch.Tensor:
    """The penalty definitions written out token by token (independent of ``apply_penalties``)."""
    logits = logits.clone()
    counts = Counter(out)
    for tok in set(prompt) | set(out):
        if sp.repetition_penalty != 1.0:
            v = logits[tok]
            logits[tok] = v / sp.repetition_penalty if v > 0 else v * sp.repetition_penalty
    for tok, c in counts.items():
        logits[tok] -= sp.frequency_penalty * c + sp.presence_penalty
    return logits


def check_greedy_against(ours: list[int], ref: torch.Tensor, what: str) -> None:
    """Each step's pick must be the reference argmax, unless the reference's top-2 are a near-tie."""
    for i, tok in enumerate(ours):
        top2 = ref[i].topk(2)
        if tok != int(top2.indices[0]):
            gap = float(top2.values[0] - top2.values[1])
            assert gap < GAP, f"{what}: step {i} picked {tok}, reference {int(top2.indices[0])} (gap {gap:.2e})"
            return  # past a legitimate flip the histories differ


@pytest.mark.parametrize("kw", [dict(frequency_penalty=1.5), dict(presence_penalty=1.8),
                                dict(repetition_penalty=1.5), dict(repetition_penalty=0.7, frequency_penalty=0.5)],
                         ids=["frequency", "presence", "repetition", "mixed"])
def test_penalties_match_their_definitions(llm, prompt_ids, hf_smollm2, kw):
    """Each greedy pick under penalties is the argmax of the reference logits penalised by definition."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw)
    out = llm.generate([prompt_ids], sp, use_tqdm=False)[0].outputs[0].token_ids
    plain = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert out != plain, "the penalty changed nothing: the test would prove nothing"
    logits = ref_logits(hf_smollm2, prompt_ids + out)[len(prompt_ids) - 1:-1]
    ref = torch.stack([penalised(logits[i], prompt_ids, out[:i], sp) for i in range(len(out))])
    check_greedy_against(out, ref, str(kw))


def test_apply_penalties_vectorised_equals_definition():
    """The batched penalty kernel equals the per-token definition on random logits and histories."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g) * 3
    outs = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (0, 1, 7, 30, 12)]
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (3, 0, 5, 9, 1)]
    sps = [SamplingParams(presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
           for p, f, r in [(0.5, 0, 1), (0, 1.0, 1.2), (-1, 0.3, 0.8), (2, -2, 1.7), (0.1, 0.1, 1.0)]]
    got = apply_penalties(logits, outs, prompts, torch.tensor([s.presence_penalty for s in sps]),
                          torch.tensor([s.frequency_penalty for s in sps]),
                          torch.tensor([s.repetition_penalty for s in sps]))
    for i, sp in enumerate(sps):
        torch.testing.assert_close(got[i], penalised(logits[i], prompts[i], outs[i], sp))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_a_token(llm, prompt_ids, temperature):
    """A +100 bias makes every sampled token the biased one; -100 keeps the greedy pick out."""
    sp = SamplingParams(temperature=temperature, seed=0, max_tokens=6, ignore_eos=True, logit_bias={1234: 100})
    assert llm.generate([prompt_ids], sp, use_tqdm=False)[0].outputs[0].token_ids == [1234] * 6
    first = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].outputs[0]
    banned = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=1,
                                                       logit_bias={first.token_ids[0]: -100}), use_tqdm=False)
    assert banned[0].outputs[0].token_ids[0] != first.token_ids[0]


def test_logprobs_equal_reference_log_softmax(llm, prompt_ids, hf_smollm2):
    """Sampled-token logprobs, ranks and top-k equal transformers' log-softmax; tokens join to the text."""
    k = 4
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=12, logprobs=k, ignore_eos=True,
                        presence_penalty=0.5)  # raw logprobs: penalties and temperature do not show
    out = llm.generate([prompt_ids], sp, use_tqdm=False)[0].outputs[0]
    ref = ref_logits(hf_smollm2, prompt_ids + out.token_ids)[len(prompt_ids) - 1:-1].log_softmax(-1)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (tok, pos) in enumerate(zip(out.token_ids, out.logprobs)):
        own = pos[tok]
        assert next(iter(pos)) == tok
        assert own.logprob == pytest.approx(float(ref[i, tok]), abs=LP_TOL)
        assert own.rank == int((ref[i] > ref[i, tok] + LP_TOL).sum()) + 1 or \
            abs(own.rank - int((ref[i] > ref[i, tok]).sum()) - 1) <= 1
        top = ref[i].topk(k)
        alts = sorted((lp for t, lp in pos.items() if lp.rank <= k), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in alts] == pytest.approx(top.values.tolist(), abs=LP_TOL)
    assert "".join(next(iter(p.values())).decoded_token for p in out.logprobs) == out.text


def test_prompt_logprobs_equal_reference_chunked_and_cached(prompt_ids, hf_smollm2):
    """Prompt logprobs equal the reference with prefill split in chunks and with the prefix already cached."""
    llm = LLM(num_kv_blocks=256, max_num_batched_tokens=8)   # the prompt is prefilled 8 tokens at a time
    ref = ref_logits(hf_smollm2, prompt_ids).log_softmax(-1)
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    for run in ("cold", "warm"):
        out = llm.generate([prompt_ids], sp, use_tqdm=False)[0]
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt_ids) and plp[0] is None, run
        for i in range(1, len(prompt_ids)):
            tok = prompt_ids[i]
            assert plp[i][tok].logprob == pytest.approx(float(ref[i - 1, tok]), abs=LP_TOL), (run, i)
            assert len(plp[i]) <= 3
        texts = [next(iter(p.values())).decoded_token for p in plp[1:]]
        assert "".join(texts) == llm.get_tokenizer().decode(prompt_ids[1:])
    assert llm.engine.get_stats()["prefix_cache_hits"] == 0  # prompt logprobs never read the cache


def test_n_samples_share_prompt_blocks_and_follow_seeds(llm, prompt_ids, assert_no_leaks):
    """n=4 gives four outputs indexed 0..3; sample j equals a lone request with seed + j; the prompt's
    full blocks are computed once and hit by the other three samples."""
    sp = SamplingParams(temperature=1.0, seed=100, n=4, max_tokens=10, ignore_eos=True)
    llm.engine.kv_cache_manager.reset_prefix_cache()
    before = llm.engine.get_stats()["prefix_cache_hits"]
    out = llm.generate([prompt_ids], sp, use_tqdm=False)[0]
    hits = llm.engine.get_stats()["prefix_cache_hits"] - before
    full = (len(prompt_ids) - 1) // 16 * 16
    assert hits == 3 * full
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for j, c in enumerate(out.outputs):
        alone = llm.generate([prompt_ids], SamplingParams(temperature=1.0, seed=100 + j, max_tokens=10,
                                                          ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert c.token_ids == alone.token_ids, j
    assert_no_leaks(llm.engine)


def test_default_sampling_params_come_from_generation_config(llm):
    """With no SamplingParams, LLM uses generation_config.json's sampling fields, as vLLM does."""
    gc = llm.engine.generation_config
    d = llm.get_default_sampling_params()
    for name in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if name in gc:
            assert getattr(d, name) == gc[name]


def test_one_token_prompt_has_prompt_logprobs_entry(llm):
    """A one-token prompt's prompt_logprobs is ``[None]`` (its only token has no context)."""
    out = llm.generate([[19556]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    assert out[0].prompt_logprobs == [None]

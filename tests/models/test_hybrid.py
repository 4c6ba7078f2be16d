"""Hybrid models (``models/hybrid.py``): state-carrying mixers beside paged attention.

Tiny random LFM2 (gated short convolutions at layers 0, 2, 4 around attention at
layers 1 and 3), LFM2-MoE (short convolutions, experts), Granite 4 hybrid and Bamba
(Mamba-2 at layers 0 and 2, scan chunks of 16 tokens, attention at layer 1) and Jamba
(Mamba-1 selective scans at layers 0 and 2, attention with experts at layer 1) are
served through the Transformers backend; their greedy tokens must equal
``transformers``' float32 ``generate`` (which carries the states in its own
cache) whole, with chunked prefill, batched with other requests,
with fewer state slots than requests, and under preemption (recompute: the state
slot is freed and rebuilt). The convolution helper is checked against
``torch.nn.functional.conv1d`` on split sequences.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_NEW = 12
PROMPT_LENS = (3, 17, 40, 70)


# kind -> (state layers, attention layers)
KINDS = {"lfm2": ([0, 2, 4], 2), "lfm2_moe": ([0, 2, 3], 1), "granite_hybrid": ([0, 2], 1), "jamba": ([0, 2], 1),
         "bamba": ([0, 2], 1)}


@pytest.fixture(scope="module", params=list(KINDS))
def hybrid(request, tiny_model_dir, greedy_ref):
    """``(kind, model dir, prompts, references)`` of a tiny hybrid model."""
    from transformers import AutoModelForCausalLM
    path = tiny_model_dir(request.param)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40000) for _ in range(n)] for n in PROMPT_LENS]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = [greedy_ref.hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert sum(len(set(ids)) for ids, _ in refs) > 2 * len(refs), "degenerate references"
    return request.param, path, prompts, refs


CONFIGS = {
    "whole": dict(num_kv_blocks=64),
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=16),
    "two_slots": dict(num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=32),
    "preempt": dict(num_kv_blocks=12, block_size=8, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hybrid_matches_transformers(name, hybrid, greedy_ref, assert_no_leaks):
    kind, path, prompts, refs = hybrid
    llm = LLM(model=str(path), model_impl="transformers", **CONFIGS[name])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    for k, (out, (ref_ids, ref_logits)) in enumerate(zip(outs, refs)):
        greedy_ref.assert_greedy_match(out.outputs[0].token_ids, ref_ids, ref_logits, f"{kind} {name} prompt {k}")
    stats = llm.engine.get_stats()
    assert stats.num_state_slots == CONFIGS[name].get("max_num_seqs", 128)
    assert stats.num_free_state_slots == stats.num_state_slots
    assert stats.prefix_cache_queries == 0, "prefix caching is off for hybrid models"
    if name == "preempt":
        assert stats.num_preemptions > 0
    assert_no_leaks(llm.engine)
    model = llm.engine.runner.model
    # only the attention layers have paged KV layers
    state_layers, num_attn = KINDS[kind]
    assert model.kv_cache_spec()[0] == num_attn and sorted(model.state_cache_spec()) == state_layers


def test_hybrid_refuses_speculative_decoding(tiny_model_dir):
    with pytest.raises(ValueError, match="hybrid"):
        LLM(model=str(tiny_model_dir("lfm2")), model_impl="transformers", num_kv_blocks=16,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_causal_conv_step_continues_across_chunks():
    """Splitting sequences into chunks (batched with each other) gives conv1d on the whole sequence."""
    from pagedllm.attention.state import StateBatch
    from pagedllm.models.short_conv import causal_conv_step
    torch.manual_seed(0)
    C, K = 6, 4
    weight, bias = torch.randn(C, K), torch.randn(C)
    seqs = [torch.randn(n, C) for n in (1, 2, 9)]
    want = [torch.nn.functional.conv1d(s.T.unsqueeze(0), weight.unsqueeze(1), bias, padding=K - 1,
                                       groups=C)[0, :, :len(s)].T for s in seqs]
    cache = torch.full((4, C, K - 1), float("nan"))  # old contents of a fresh slot are never read
    slots = torch.tensor([3, 0, 2])
    chunks = [(0, 1), (1, 2), (2, 3), (3, 9)]  # each step: tokens [a, b) of every sequence long enough
    got = [[] for _ in seqs]
    for a, b in chunks:
        live = [i for i, s in enumerate(seqs) if len(s) > a]
        xs = [seqs[i][a:min(b, len(seqs[i]))] for i in live]
        qsl = torch.tensor([0] + [len(x) for x in xs]).cumsum(0)
        batch = StateBatch(slots[live], torch.full((len(live),), a > 0), qsl, {})
        out = causal_conv_step(torch.cat(xs), cache, weight, bias, batch)
        for j, i in enumerate(live):
            got[i].append(out[qsl[j]:qsl[j + 1]])
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.cat(g), w, rtol=1e-5, atol=1e-5)


def test_selective_scan_step_continues_across_chunks():
    """Mamba-1's scan over chunks of sequences batched together (decodes included) gives transformers'
    ``mamba_selective_scan`` (Jamba's torch path) on each whole sequence, and leaves its final state."""
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan
    from pagedllm.attention.state import StateBatch
    from pagedllm.models.mamba1 import selective_scan_step
    torch.manual_seed(0)
    d, N = 6, 4
    A = -torch.rand(d, N) - 0.5
    D, dt_bias = torch.randn(d), torch.randn(d)
    seqs = [[torch.randn(n, d), torch.randn(n, d), torch.randn(n, N), torch.randn(n, N)] for n in (1, 2, 9)]
    want = [mamba_selective_scan(x.T[None], dt.T[None], A, b.T[None], c.T[None], D=D, delta_bias=dt_bias,
                                 delta_softplus=True, return_last_state=True) for x, dt, b, c in seqs]
    cache = torch.full((4, d, N), float("nan"))  # old contents of a fresh slot are never read
    slots = torch.tensor([3, 0, 2])
    got = [[] for _ in seqs]
    for a, e in [(0, 1), (1, 2), (2, 3), (3, 9)]:
        live = [i for i, s in enumerate(seqs) if len(s[0]) > a]
        parts = [[t[a:e] for t in seqs[i]] for i in live]
        qsl = torch.tensor([0] + [len(p[0]) for p in parts]).cumsum(0)
        batch = StateBatch(slots[live], torch.full((len(live),), a > 0), qsl, {})
        x, dt, b, c = (torch.cat([p[k] for p in parts]) for k in range(4))
        out = selective_scan_step(x, dt, A, b, c, D, dt_bias, cache, batch)
        for j, i in enumerate(live):
            got[i].append(out[qsl[j]:qsl[j + 1]])
    for i, (g, (y, last)) in enumerate(zip(got, want)):
        torch.testing.assert_close(torch.cat(g), y[0].T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache[slots[i]], last[0], rtol=1e-5, atol=1e-5)


def test_check_supported_takes_lfm2_and_refuses_other_state_layers():
    import transformers
    from pagedllm.models.transformers_backend import check_supported
    cls = check_supported(transformers.Lfm2Config(num_hidden_layers=2, full_attn_idxs=[1]))
    assert cls.__name__ == "Lfm2ForCausalLM"
    # Jamba's and Bamba's classes leave _supports_attention_backend False; their families vouch for it
    assert check_supported(transformers.JambaConfig(num_hidden_layers=2, attn_layer_period=2,
                                                    attn_layer_offset=1)).__name__ == "JambaForCausalLM"
    assert check_supported(transformers.BambaConfig(num_hidden_layers=2, attn_layer_indices=[1])).__name__ \
        == "BambaForCausalLM"
    with pytest.raises(ValueError, match="layers"):
        check_supported(transformers.MiniMaxConfig(num_hidden_layers=2))


def test_hybrid_soak_with_aborts_balances_both_pools(tiny_model_dir, assert_no_leaks):
    """Mixed requests on a small KV pool and fewer state slots than requests, with random aborts:
    the soak's pool check holds every few steps and both pools end empty."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from test_soak import check_pool
    from pagedllm import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    rng = random.Random(7)
    eng = LLMEngine(EngineArgs(model=str(tiny_model_dir("granite_hybrid")), model_impl="transformers",
                               num_kv_blocks=12, block_size=8, max_num_batched_tokens=32, max_num_seqs=3))
    live, n_added, steps = set(), 0, 0
    while n_added < 24 or eng.has_unfinished_requests():
        if n_added < 24 and rng.random() < 0.5:
            rid = f"h{n_added}"
            n_added += 1
            eng.add_request(rid, [rng.randrange(3, 40000) for _ in range(rng.randint(10, 70))],
                            SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 12)))
            live.add(rid)
        if live and rng.random() < 0.08:
            rid = rng.choice(sorted(live))
            eng.abort_request([rid])
            live.discard(rid)
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
        steps += 1
        check_pool(eng)
        assert steps < 2000, "no progress"
    eng.step()
    assert eng.get_stats().num_preemptions > 0
    assert_no_leaks(eng)

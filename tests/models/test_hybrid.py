"""Hybrid models (``models/hybrid.py``): state-carrying mixers beside paged attention.

Tiny random LFM2 (gated short convolutions at layers 0, 2, 4 around attention at
layers 1 and 3), LFM2-MoE (short convolutions, experts), Granite 4 hybrid and Bamba
(Mamba-2 at layers 0 and 2, scan chunks of 16 tokens, attention at layer 1) and Jamba
(Mamba-1 selective scans at layers 0 and 2, attention with experts at layer 1) are
served through the Transformers backend; their greedy tokens must equal
``transformers``' float32 ``generate`` (which carries the states in its own
cache) whole, with chunked prefill, batched with other requests,
with fewer state slots than requests, and under preemption (recompute: the state
slot is freed and rebuilt). With prefix caching, a second request sharing a prefix
that ends at a block boundary, one token before or after it, or crosses several blocks
starts from the state checkpoint of its last hit block and must give the same tokens
(``core/state_checkpoints.py``). The convolution helper is checked against
``torch.nn.functional.conv1d`` on split sequences, with checkpoints inside a segment.
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
         "bamba": ([0, 2], 1), "nemotron_h": ([0, 3], 1)}


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
    assert stats.prefix_cache_queries > 0  # prefix caching is on; no two prompts share a block, but
    if name == "preempt":  # a preempted request resumes from its own blocks' state checkpoints
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_hits == 0
    assert_no_leaks(llm.engine)
    model = llm.engine.runner.model
    # only the attention layers have paged KV layers
    state_layers, num_attn = KINDS[kind]
    assert model.kv_cache_spec()[0] == num_attn and sorted(model.state_cache_spec()) == state_layers


SPEC_CONFIGS = {
    "whole": dict(num_kv_blocks=64),
    "chunked_preempt": dict(num_kv_blocks=14, block_size=8, max_num_batched_tokens=24),
}


class _FlawedOracle:
    """Drafts transformers' own next tokens with one of them wrong now and then: each verification
    keeps a prefix of the drafts and rejects the rest (a rollback of the state layers)."""

    def __init__(self, prompts, refs) -> None:
        self.refs = {tuple(p): ref for p, (ref, _) in zip(prompts, refs)}
        self.rng = random.Random(3)

    def propose(self, batch):
        out = {}
        for item in batch:
            ref = self.refs[tuple(item.token_ids[:item.num_prompt_tokens])]
            done = len(item.token_ids) - item.num_prompt_tokens
            draft = list(ref[done:done + item.k])
            if draft and self.rng.random() < 0.6:
                j = self.rng.randrange(len(draft))
                draft[j] = (draft[j] + 1) % 49152
            out[item.request_id] = draft
        return out

    def finish(self, *args) -> None:
        pass


@pytest.mark.parametrize("name", list(SPEC_CONFIGS))
def test_hybrid_speculative_decoding_matches_transformers(name, hybrid, greedy_ref, assert_no_leaks):
    """Speculative decoding on a hybrid model: the mixers leave the state after each draft in the
    request's draft slots and the verification rolls back to the last accepted one, so greedy
    tokens stay transformers' with drafts accepted and rejected (prefix caching on)."""
    kind, path, prompts, refs = hybrid
    llm = LLM(model=str(path), model_impl="transformers", **SPEC_CONFIGS[name],
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "dynamic": False})
    llm.llm_engine.client.core.scheduler.spec.proposer = _FlawedOracle(prompts, refs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    for k, (out, (ref_ids, ref_logits)) in enumerate(zip(outs, refs)):
        greedy_ref.assert_greedy_match(out.outputs[0].token_ids, ref_ids, ref_logits, f"{kind} spec {name} prompt {k}")
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # kept and rejected drafts
    if name == "chunked_preempt":
        assert stats.num_preemptions > 0
    assert_no_leaks(llm.engine)


def test_hybrid_refuses_a_hybrid_draft_model(tiny_model_dir):
    with pytest.raises(ValueError, match="hybrid"):
        LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=16,
            speculative_config={"method": "draft_model", "model": str(tiny_model_dir("lfm2")),
                                "num_speculative_tokens": 2})


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
    # Nemotron-H's MLP and expert blocks have neither attention nor state: no KV layer
    assert check_supported(transformers.NemotronHConfig(layers_block_type=["mamba", "attention", "mlp"])).__name__ \
        == "NemotronHForCausalLM"
    with pytest.raises(ValueError, match="layers"):
        check_supported(transformers.MiniMaxConfig(num_hidden_layers=2))


def test_hybrid_soak_with_aborts_balances_both_pools(tiny_model_dir, assert_no_leaks):
    """Mixed requests, many sharing prefixes (prefix-cache hits from state checkpoints), on a small KV
    pool with fewer state slots and checkpoints than requests, with random aborts: the soak's pool check
    (request slots, and checkpoints held only by cached blocks) holds every step and the pools end empty."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from test_soak import check_pool
    from pagedllm import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    rng = random.Random(7)
    eng = LLMEngine(EngineArgs(model=str(tiny_model_dir("granite_hybrid")), model_impl="transformers",
                               num_kv_blocks=12, block_size=8, max_num_batched_tokens=32, max_num_seqs=3,
                               num_state_checkpoints=4))
    prefixes = [[rng.randrange(3, 40000) for _ in range(40)] for _ in range(3)]
    live, n_added, steps = set(), 0, 0
    while n_added < 24 or eng.has_unfinished_requests():
        if n_added < 24 and rng.random() < 0.5:
            rid = f"h{n_added}"
            n_added += 1
            head = rng.choice(prefixes)[:rng.randint(8, 40)] if rng.random() < 0.6 else []
            eng.add_request(rid, head + [rng.randrange(3, 40000) for _ in range(rng.randint(2, 30))],
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
    stats = eng.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_no_leaks(eng)


# ---------------------------------------------------------------- prefix caching (state checkpoints)

BS = 8
SHARED_LENS = (16, 15, 17, 41)  # block size 8: at a boundary, one before, one after, five blocks and one


@pytest.fixture(scope="module", params=list(KINDS))
def shared_prefix(request, tiny_model_dir, greedy_ref):
    """``(kind, model dir, first prompts, second prompts, expected hit tokens, references of the second)``:
    each second prompt shares ``SHARED_LENS[i]`` tokens with the first one."""
    from transformers import AutoModelForCausalLM
    path = tiny_model_dir(request.param)
    rng = random.Random(1)
    firsts, seconds = [], []
    for n in SHARED_LENS:
        shared = [rng.randrange(3, 40000) for _ in range(n)]
        firsts.append(shared + [rng.randrange(3, 40000) for _ in range(5)])
        seconds.append(shared + [rng.randrange(3, 40000) for _ in range(7)])
    hits = [n // BS * BS for n in SHARED_LENS]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = [greedy_ref.hf_greedy(hf, p, MAX_NEW) for p in seconds]
    return request.param, path, firsts, seconds, hits, refs


PREFIX_CONFIGS = {
    "whole": dict(num_kv_blocks=64),
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=5),  # chunk ends off the block boundaries
    "preempt": dict(num_kv_blocks=16, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("name", list(PREFIX_CONFIGS))
def test_hybrid_prefix_cache_hits_match_transformers(name, shared_prefix, greedy_ref, assert_no_leaks):
    """The second requests hit the first ones' blocks up to the last checkpointed boundary, and
    give transformers' tokens; with caching off the tokens are the same and nothing is hit."""
    kind, path, firsts, seconds, hits, refs = shared_prefix
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    got = {}
    for caching in (True, False):
        llm = LLM(model=str(path), model_impl="transformers", block_size=BS, enable_prefix_caching=caching,
                  **PREFIX_CONFIGS[name])
        llm.generate([{"prompt_token_ids": p} for p in firsts], params)
        h0 = llm.engine.get_stats().prefix_cache_hits
        outs = llm.generate([{"prompt_token_ids": p} for p in seconds], params)
        got[caching] = [o.outputs[0].token_ids for o in outs]
        for k, (ids, (ref_ids, ref_logits)) in enumerate(zip(got[caching], refs)):
            greedy_ref.assert_greedy_match(ids, ref_ids, ref_logits, f"{kind} {name} caching={caching} prompt {k}")
        stats = llm.engine.get_stats()
        if not caching:
            assert stats.prefix_cache_hits == 0
        elif name == "preempt":
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits - h0 > 0
        else:
            assert stats.prefix_cache_hits - h0 == sum(hits), "every shared full block is a hit"
        assert_no_leaks(llm.engine)
        if caching:
            assert llm.engine.kv_cache_manager.state_pool.num_used_checkpoints > 0
            llm.engine.reset_prefix_cache()
            assert llm.engine.kv_cache_manager.state_pool.num_used_checkpoints == 0, "reset frees the checkpoints"
    assert got[True] == got[False], f"{kind} {name}: prefix caching changed the tokens"


def test_causal_conv_step_writes_checkpoints_inside_a_segment():
    """A checkpoint at offset k of a segment holds the same inputs a step ending there would carry."""
    from pagedllm.attention.state import StateBatch
    from pagedllm.models.short_conv import causal_conv_step
    torch.manual_seed(0)
    C, K = 5, 4
    weight = torch.randn(C, K)
    xs = [torch.randn(n, C) for n in (2, 9)]
    cache = torch.zeros((8, C, K - 1))
    qsl = torch.tensor([0, 2, 11])
    marks = [(0, 1, 4), (0, 2, 5), (1, 1, 6), (1, 6, 7)]  # (request, offset, slot)
    causal_conv_step(torch.cat(xs), cache, weight, None, StateBatch(torch.tensor([0, 1]), torch.tensor([False, False]),
                                                                   qsl, {}, checkpoints=marks))
    for r, k, slot in marks:
        want = torch.cat([torch.zeros(K - 1, C), xs[r][:k]])[-(K - 1):].T  # the last K-1 inputs, zeros before
        torch.testing.assert_close(cache[slot], want)
    torch.testing.assert_close(cache[1], xs[1][-(K - 1):].T)

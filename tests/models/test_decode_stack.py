"""Batch-1 decode through the whole decoder stack in one C call (``LlamaForCausalLM._decode_stack``).

The fused path must give transformers' greedy tokens, and the same tokens and logprobs as
the per-layer kernel path it replaces, on Llama (with and without biases, tied head) and Qwen2.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="CPU kernels off (PAGEDLLM_CPU_KERNELS=0) or no C compiler")

PROMPT = [1, 504, 3458, 282, 4183, 314, 253, 1345, 30, 1073, 5400, 2399, 28, 339, 1488, 457, 7660, 284, 3200, 30]


def _run(llm: LLM, fused: bool) -> tuple[list[int], list[float]]:
    llm.engine.core.runner.model.fused_decode = fused
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


@pytest.mark.parametrize("kind", ["llama", "llama_bias_tied", "qwen2"])
def test_fused_decode_matches_layers_and_transformers(kind, tiny_model_dir, greedy_ref, monkeypatch):
    from transformers import AutoModelForCausalLM
    path = tiny_model_dir(kind)
    calls = []
    real = cpu_kernels.decode_stack
    monkeypatch.setattr(cpu_kernels, "decode_stack", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(str(path), enable_prefix_caching=False)
    fused_ids, fused_lps = _run(llm, fused=True)
    assert len(calls) == 39  # every decode step after the prefill went through the one call
    layer_ids, layer_lps = _run(llm, fused=False)
    assert len(calls) == 39
    assert fused_ids == layer_ids
    torch.testing.assert_close(torch.tensor(fused_lps), torch.tensor(layer_lps), rtol=0, atol=1e-4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref_ids, ref_logits = greedy_ref.hf_greedy(hf, PROMPT, 40)
    greedy_ref.assert_greedy_match(fused_ids, ref_ids, ref_logits, kind)


def test_stack_table_rejects_non_float32():
    row = {n: None for n in cpu_kernels.STACK_NORMS} | {"key_cache": None, "value_cache": None, "rope": 0,
                                                         "window": 0, "matmuls": {}}
    with pytest.raises(ValueError, match="in_norm"):
        cpu_kernels.stack_table([row | {"in_norm": torch.zeros(2, dtype=torch.int32)}])
    with pytest.raises(ValueError, match="^q "):
        cpu_kernels.stack_table([row | {"matmuls": {"q": (cpu_kernels.MATMUL_FLOAT32, torch.zeros(2, 2).t(),
                                                          None, None, None)}}])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_stack_takes_up_to_16_tokens_of_one_sequence(kind, tiny_model_dir, monkeypatch):
    """A short prompt (and a decode with its draft tokens) goes through the same C call as ``T``
    rows with causal attention among them: every position's logprobs equal the per-layer path's."""
    path = tiny_model_dir(kind)
    calls = []
    real = cpu_kernels.decode_stack
    monkeypatch.setattr(cpu_kernels, "decode_stack", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    llm = LLM(str(path), enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def prompt_lps(fused: bool, prompt: list[int]) -> list[float]:
        llm.engine.core.runner.model.fused_decode = fused
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]

    for n in (2, 7, 16):
        fused = prompt_lps(True, PROMPT[:n])
        assert calls[-1] == n
        torch.testing.assert_close(torch.tensor(fused), torch.tensor(prompt_lps(False, PROMPT[:n])), rtol=0, atol=1e-4)
    before = len(calls)
    prompt_lps(True, PROMPT[:17])  # past 16 tokens: the per-layer path
    assert len(calls) == before


STACK_KINDS = ["llama_bias_tied", "qwen2", "mistral", "qwen3", "gemma3_text", "phi3", "qwen3_moe", "mixtral",
               "gpt_oss"]


@pytest.mark.parametrize("kind", STACK_KINDS)
def test_transformers_backend_stack_matches_its_layers(kind, tiny_model_dir, monkeypatch):
    """The Transformers backend's batch-1 steps run the same C stack over the module's own weights
    (``models/transformers_stack.py``) and give the per-layer path's tokens and logprobs: decodes
    past the sliding window (8), and prompts of 2-16 tokens as one call (prompt logprobs)."""
    from pagedllm.models.transformers_stack import TransformersDecodeStack
    calls = []
    real = cpu_kernels.decode_stack
    monkeypatch.setattr(cpu_kernels, "decode_stack", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    llm = LLM(str(tiny_model_dir(kind)), model_impl="transformers", enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    stack = model.decode_stack
    assert isinstance(stack, TransformersDecodeStack)

    def run(on: bool, prompt: list[int], params: SamplingParams):
        model.decode_stack = stack if on else None
        return llm.generate([prompt], params, use_tqdm=False)[0]

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    fused, layers = run(True, PROMPT, params).outputs[0], run(False, PROMPT, params).outputs[0]
    assert calls == [1] * 23
    assert fused.token_ids == layers.token_ids
    torch.testing.assert_close(torch.tensor([lp[t].logprob for lp, t in zip(fused.logprobs, fused.token_ids)]),
                               torch.tensor([lp[t].logprob for lp, t in zip(layers.logprobs, layers.token_ids)]),
                               rtol=0, atol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for n in (2, 16):
        lps = [[next(iter(d.values())).logprob for d in run(on, PROMPT[:n], params).prompt_logprobs[1:]]
               for on in (True, False)]
        assert calls[-1] == n
        torch.testing.assert_close(torch.tensor(lps[0]), torch.tensor(lps[1]), rtol=0, atol=1e-4)


def test_transformers_stack_only_for_families_it_has_read(tiny_model_dir):
    """A layer class outside the table (hybrid LFM2 here) keeps the model's own modules."""
    llm = LLM(str(tiny_model_dir("lfm2")), model_impl="transformers", enable_prefix_caching=False)
    assert llm.engine.core.runner.model.decode_stack is None

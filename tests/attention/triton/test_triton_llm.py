"""A tiny random Llama served end to end through the Triton backend (Triton's interpreter on the CPU).

Greedy tokens must equal the torch backend's (up to a transformers near-tie, as
every greedy comparison of the suite): ragged prompts under a small step budget
(chunked prefill mixed with decodes), then prompts sharing a cached prefix
(prefix-cache hits read the earlier blocks through the block table). The Triton run
builds its inputs on the device (``worker/device/device_inputs.py``), async scheduling's
placeholders gathered there; a second Triton run with the host preparation
(``PAGEDLLM_DEVICE_INPUTS=0``) must give the same tokens.
"""

from __future__ import annotations

import torch

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _hf_loader(path):
    def load():
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load


def test_tiny_llama_triton_equals_torch_backend(tiny_model_dir, greedy_ref, assert_no_leaks, monkeypatch):
    path = str(tiny_model_dir("llama"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 40000, (n,), generator=g).tolist() for n in (3, 21, 40, 9)]
    shared = prompts[2][:33]  # two full blocks of 16 are cached by the first round
    second = [shared + [11, 12, 13], shared[:20] + [7] * 5]
    common = dict(num_kv_blocks=48, block_size=16, max_num_batched_tokens=32, max_num_seqs=8)
    results = {}
    for name in ("torch", "triton", "triton-host"):
        monkeypatch.setenv("PAGEDLLM_DEVICE_INPUTS", "0" if name == "triton-host" else "1")
        llm = LLM(path, attention_backend=name.split("-")[0], **common)
        runner = llm.llm_engine.runner
        assert runner.attention_backend.name == name.split("-")[0]
        assert (runner.step_inputs.name == "device") == (name == "triton")
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        then = [o.outputs[0].token_ids for o in llm.generate(second, GREEDY, use_tqdm=False)]
        assert llm.llm_engine.get_stats().prefix_cache_hits >= 32  # the shared prompt's two blocks
        assert_no_leaks(llm.llm_engine)
        results[name] = first + then
        del llm
    assert results["triton"] == results["triton-host"]  # the two preparations feed the same kernels
    for i, (got, want) in enumerate(zip(results["triton"], results["torch"])):
        p = (prompts + second)[i]
        greedy_ref.assert_same_greedy(list(got), list(want), p, _hf_loader(path), f"triton prompt {i} (len {len(p)})")

"""LoRA adapters on the native model: greedy tokens equal peft's merged model, batches mixing
adapters and the base model, per-adapter prefix caching (issue 43)."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest

MAX_NEW = 8


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def smol_llm(smollm2_dir):
    """One SmolLM2 engine for the module: two adapter slots, two kept in host memory (three adapters
    in use exercise the scheduler's per-step bound and the host LRU)."""
    llm = LLM(str(smollm2_dir), enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
              num_kv_blocks=256)
    yield llm
    llm.engine.shutdown() if hasattr(llm.engine, "shutdown") else None


def _requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, (path, _)) in enumerate(sorted(adapters.items()))}


def test_each_adapter_matches_peft_merged(smol_llm, smol_adapters, smollm2_tokenizer, greedy_ref):
    """Each adapter alone: pagedllm's greedy tokens equal the merged peft model's in transformers."""
    prompt = smollm2_tokenizer.encode("The capital of France is")
    base = smol_llm.generate([prompt], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    for name, lr in _requests(smol_adapters).items():
        out = smol_llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=lr)[0]
        assert out.lora_request == lr
        ref_ids, ref_logits = greedy_ref.hf_greedy(smol_adapters[name][1], prompt, MAX_NEW)
        greedy_ref.assert_greedy_match(out.outputs[0].token_ids, ref_ids, ref_logits, name)
        assert ref_ids != base, f"{name}: the adapter does not change the greedy tokens (a weak test)"


def test_mixed_batch_matches_single_runs(smol_llm, smol_adapters, smollm2_tokenizer):
    """Three adapters and the base in one generate call (two slots: the scheduler spreads them over
    steps): every prompt gets the tokens it gets alone."""
    reqs = _requests(smol_adapters)
    texts = ["Once upon a time", "def fibonacci(n):", "The best way to learn", "Water boils at"]
    loras = [reqs["attn8"], None, reqs["all16"], reqs["mlp8"]] * 2
    prompts = [smollm2_tokenizer.encode(t) for t in texts] * 2
    alone = [smol_llm.generate([p], _greedy(), use_tqdm=False, lora_request=lr)[0].outputs[0].token_ids
             for p, lr in zip(prompts[:4], loras[:4])]
    together = smol_llm.generate(prompts, _greedy(), use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in together] == alone * 2
    assert [o.lora_request for o in together] == loras
    slots = smol_llm.engine.client.core.runner.lora  # in process: the runner's LoRASlots
    assert len(slots.cpu) <= 2 and slots.loads >= 3  # max_cpu_loras: the third adapter evicted one


def test_chat_takes_an_adapter(smol_llm, smol_adapters, smollm2_tokenizer):
    """``LLM.chat(lora_request=...)``: the same tokens as ``generate`` on the rendered conversation."""
    lr = _requests(smol_adapters)["mlp8"]
    msgs = [{"role": "user", "content": "Name a color."}]
    chat = smol_llm.chat(msgs, _greedy(), use_tqdm=False, lora_request=lr)[0]
    ids = smollm2_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    gen = smol_llm.generate([ids], _greedy(), use_tqdm=False, lora_request=lr)[0]
    assert chat.lora_request == lr and chat.outputs[0].token_ids == gen.outputs[0].token_ids


def test_prefix_cache_per_adapter(smol_llm, smol_adapters, smollm2_tokenizer):
    """Blocks are shared within an adapter, never across adapters nor with the base model."""
    reqs = _requests(smol_adapters)
    prompt = smollm2_tokenizer.encode("Prefix caching per adapter: " + "one two three four five six " * 8)
    assert len(prompt) > 48

    def hits(lr) -> int:
        before = smol_llm.engine.get_stats()["prefix_cache_hits"]
        smol_llm.generate([prompt], _greedy(2), use_tqdm=False, lora_request=lr)
        return smol_llm.engine.get_stats()["prefix_cache_hits"] - before

    assert hits(reqs["attn8"]) == 0
    assert hits(reqs["attn8"]) >= 48  # the same adapter hits its own blocks
    assert hits(reqs["all16"]) == 0   # another adapter: none of them
    assert hits(None) == 0            # the base model: none
    assert hits(None) >= 48
    assert hits(reqs["mlp8"]) == 0


def test_bad_requests_are_refused_and_engine_serves(smol_llm, smol_adapters, smollm2_tokenizer, tmp_path):
    """A missing directory, a reused id, a rank above the maximum and a wrong list length are
    ValueErrors naming the problem;
    the engine keeps serving."""
    prompt = smollm2_tokenizer.encode("Hello")
    with pytest.raises(ValueError, match="no such directory"):
        smol_llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=LoRARequest("x", 77, str(tmp_path / "no")))
    path = str(smol_adapters["attn8"][0])
    with pytest.raises(ValueError, match="already adapter"):
        smol_llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=LoRARequest("other", 1, path))
    big = tmp_path / "big"
    shutil.copytree(path, big)
    cfg = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps(cfg | {"r": 32}))
    with pytest.raises(ValueError, match="rank r=32 is above max_lora_rank=16"):
        smol_llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=LoRARequest("big", 78, str(big)))
    with pytest.raises(ValueError, match="lora_request entries"):
        smol_llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=[None, None])
    assert smol_llm.generate([prompt], _greedy(), use_tqdm=False)[0].finished


def test_qwen2_adapters_match_peft_merged(tiny_model_dir, tmp_path, smollm2_tokenizer, greedy_ref, lora_writer):
    """A tiny random Qwen2 (q/k/v bias, tied embeddings): rank 8 and 16 adapters, alone and batched."""
    from transformers import AutoModelForCausalLM

    write_adapter = lora_writer
    path = tiny_model_dir("qwen2")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    merged = {"r8": write_adapter(hf, tmp_path / "r8", 8, ["k_proj", "v_proj", "down_proj"], 5, alpha=8),
              "r16": write_adapter(hf, tmp_path / "r16", 16, ["q_proj", "o_proj", "gate_proj", "up_proj"], 6,
                                   alpha=32, use_rslora=True)}
    reqs = {"r8": LoRARequest("r8", 1, str(tmp_path / "r8")), "r16": LoRARequest("r16", 2, str(tmp_path / "r16"))}
    llm = LLM(str(path), enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64)
    prompt = smollm2_tokenizer.encode("A tiny model says")
    outs = llm.generate([prompt] * 3, _greedy(), use_tqdm=False, lora_request=[reqs["r8"], None, reqs["r16"]])
    for out, name in ((outs[0], "r8"), (outs[2], "r16")):
        ref_ids, ref_logits = greedy_ref.hf_greedy(merged[name], prompt, MAX_NEW)
        greedy_ref.assert_greedy_match(out.outputs[0].token_ids, ref_ids, ref_logits, f"qwen2 {name}")
    base_ids, base_logits = greedy_ref.hf_greedy(hf, prompt, MAX_NEW)
    greedy_ref.assert_greedy_match(outs[1].outputs[0].token_ids, base_ids, base_logits, "qwen2 base")

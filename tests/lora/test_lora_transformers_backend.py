"""LoRA adapters through the Transformers backend (issue 43): the backend's unfused decoder
projections wrapped by ``LoRALinear``; greedy tokens equal peft's merged model, and a batch mixing
adapters and the base model gives each prompt its single-run tokens."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest
from pagedllm.models.lora_linear import LoRAContext, LoRALinear, LoRAStep

MAX_NEW = 8


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def tf_llm(smollm2_dir):
    """One SmolLM2 engine on the Transformers backend for the module, two adapter slots."""
    llm = LLM(str(smollm2_dir), model_impl="transformers", enable_lora=True, max_loras=2, max_lora_rank=16,
              num_kv_blocks=256)
    yield llm
    llm.engine.shutdown() if hasattr(llm.engine, "shutdown") else None


def _requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, (path, _)) in enumerate(sorted(adapters.items()))}


def test_backend_linears_wrapped(tf_llm):
    """The engine runs the Transformers backend, its seven projections per layer wrapped once each
    (on the CPU kernel path their base is the GGUF-packed linear and batch-1 decode has the C stack,
    which steps with adapter rows skip: ``test_each_adapter_matches_peft_merged`` fails without it)."""
    model = tf_llm.engine.client.core.runner.model
    assert type(model).__name__ == "TransformersCausalLM"
    layers = model.hf.model.layers
    wrapped = [m for m in model.hf.modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 7 * len(layers)
    assert all(isinstance(layers[0].self_attn.q_proj, LoRALinear) and isinstance(layer.mlp.down_proj, LoRALinear)
               for layer in layers)
    cfg = model.hf.config
    kv = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    assert tf_llm.engine.client.core.runner.lora.shapes["k_proj"] == (kv, cfg.hidden_size)


def test_each_adapter_matches_peft_merged(tf_llm, smol_adapters, smollm2_tokenizer, greedy_ref):
    """Each adapter alone: greedy tokens equal the merged peft model's in transformers (float32)."""
    prompt = smollm2_tokenizer.encode("The capital of France is")
    base = tf_llm.generate([prompt], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    for name, lr in _requests(smol_adapters).items():
        out = tf_llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=lr)[0]
        assert out.lora_request == lr
        ref_ids, ref_logits = greedy_ref.hf_greedy(smol_adapters[name][1], prompt, MAX_NEW)
        greedy_ref.assert_greedy_match(out.outputs[0].token_ids, ref_ids, ref_logits, f"transformers {name}")
        assert ref_ids != base, f"{name}: the adapter does not change the greedy tokens (a weak test)"


def test_mixed_batch_matches_single_runs(tf_llm, smol_adapters, smollm2_tokenizer):
    """Two adapters and the base model in one batch: each prompt gets its tokens alone."""
    reqs = _requests(smol_adapters)
    texts = ["Once upon a time", "def fibonacci(n):", "Water boils at"]
    loras = [reqs["attn8"], None, reqs["all16"]] * 2
    prompts = [smollm2_tokenizer.encode(t) for t in texts] * 2
    alone = [tf_llm.generate([p], _greedy(), use_tqdm=False, lora_request=lr)[0].outputs[0].token_ids
             for p, lr in zip(prompts[:3], loras[:3])]
    together = tf_llm.generate(prompts, _greedy(), use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in together] == alone * 2
    assert [o.lora_request for o in together] == loras


class _PackedLike(torch.nn.Module):
    """A base layer with no float parameters (as a GGUF / int8 packed linear): ``x @ W^T`` from a buffer."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("w", w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.t()


def test_wrapper_takes_batched_rows_and_any_base():
    """``[1, T, in]`` input (the Transformers backend's) over a base without float parameters: the base
    output plus the delta of the adapter rows only, in grouped and padded modes."""
    torch.manual_seed(0)
    w = torch.randn(6, 5)
    ctx = LoRAContext()
    lin = LoRALinear(_PackedLike(w), [("o_proj", 0, 6)], 5, max_loras=2, max_rank=4, ctx=ctx)
    a, b = torch.randn(2, 4, 5), torch.randn(2, 6, 4)
    for slot in range(2):
        lin.set_slot(slot, {"o_proj": (a[slot], b[slot])}, 0.5)
    x = torch.randn(1, 4, 5)
    rows0, rows1 = torch.tensor([0, 2]), torch.tensor([3])
    want = x[0] @ w.t()
    want[rows0] += 0.5 * (x[0, rows0] @ a[0].t()) @ b[0].t()
    want[rows1] += 0.5 * (x[0, rows1] @ a[1].t()) @ b[1].t()
    steps = [LoRAStep([(0, rows0), (1, rows1)]),
             LoRAStep([], (torch.tensor([0, 2, 3]), torch.tensor([0, 1, 2]), 2))]
    for step in steps:
        ctx.step = step
        got = lin(x)
        assert got.shape == (1, 4, 6)
        torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


def test_moe_model_wraps_attention_and_refuses_mlp_targets(tmp_path):
    """A mixture-of-experts decoder (tiny random Mixtral): only the attention projections are wrapped,
    and an adapter targeting ``gate_proj`` is refused by name (front end and runner alike)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from pagedllm.lora.checker import text_model_shapes
    from pagedllm.lora.peft_reader import LoRAAdapter, check_shapes
    from pagedllm.models.transformers_lora import layer_specs
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    specs = layer_specs(MixtralForCausalLM(cfg), cfg)
    assert [[attr for _, attr, _, _ in row] for row in specs] == [["q_proj", "k_proj", "v_proj", "o_proj"]] * 2
    shapes, layers = text_model_shapes(cfg)
    assert sorted(shapes) == ["k_proj", "o_proj", "q_proj", "v_proj"] and layers == 2
    bad = LoRAAdapter(8, 1.0, {(0, "gate_proj"): (torch.zeros(8, 32), torch.zeros(48, 8))}, str(tmp_path))
    with pytest.raises(ValueError, match="target module 'gate_proj'"):
        check_shapes(bad, shapes, layers)

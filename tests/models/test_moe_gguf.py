"""A mixture-of-experts GGUF served with its experts packed (issue 40, first part): a tiny Qwen3-MoE
file written with ``gguf``'s writer, experts in Q4_K / Q8_0 / MXFP4 (the formats MoE GGUFs ship in),
loads through the Transformers backend with every expert layer on the experts kernel over the
file's blocks (no float32 copy of an expert), and answers as the same backend on the dequantized
weights.

The file is converted by our family table (``models/gguf_moe.py``: the experts stay in the file);
it writes no ``expert_feed_forward_length``, so the expert width is ``feed_forward_length``, 768.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="packed weights need the C kernels")

HID, N_HEAD, N_KV, HD, I_EXP, E, TOP_K, LAYERS = 256, 4, 2, 64, 768, 4, 2, 2
TOKENS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + \
    [str(d) for d in range(9)] + ["ab", "<|endoftext|>", "<|im_end|>"]
VOCAB = len(TOKENS)
# per layer: the experts' gate/up and down formats (Q4_K_M files keep down in Q6_K or Q8_0)
EXPERT_KINDS = [("Q4_K", "Q8_0"), ("MXFP4", "MXFP4")]


def _write(path: Path, rng) -> None:
    import gguf
    from gguf import GGMLQuantizationType as T
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(LAYERS), w.add_context_length(128), w.add_embedding_length(HID)
    w.add_feed_forward_length(I_EXP), w.add_head_count(N_HEAD), w.add_head_count_kv(N_KV)
    w.add_key_length(HD), w.add_value_length(HD), w.add_expert_count(E), w.add_expert_used_count(TOP_K)
    w.add_rope_freq_base(1e4), w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(TOKENS)
    w.add_token_types([1] * (VOCAB - 2) + [3, 3]), w.add_token_merges(["a b"])
    w.add_bos_token_id(VOCAB - 2), w.add_eos_token_id(VOCAB - 1), w.add_pad_token_id(VOCAB - 1)

    def put(name, shape, kind=T.F32, scale=0.3):
        x = (scale * rng.standard_normal(shape)).astype(np.float32)
        if len(shape) == 1:
            x = 1 + 0.1 * x
        if kind == T.F32:
            w.add_tensor(name, x)
        elif kind == T.Q4_K:  # gguf-py has no K-quant quantizer: random blocks with small scales
            raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // 256, 144), dtype=np.uint8)
            raw[..., 0:4] = rng.uniform(0.001, 0.01, (*raw.shape[:-1], 2)).astype(np.float16).view(np.uint8)
            w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)

    put("token_embd.weight", (VOCAB, HID), T.Q8_0), put("output_norm.weight", (HID,))
    put("output.weight", (VOCAB, HID), T.Q8_0)
    for i, (gu_kind, down_kind) in enumerate(EXPERT_KINDS):
        b = f"blk.{i}."
        put(b + "attn_q.weight", (N_HEAD * HD, HID), T.Q8_0), put(b + "attn_k.weight", (N_KV * HD, HID), T.Q8_0)
        put(b + "attn_v.weight", (N_KV * HD, HID), T.Q8_0), put(b + "attn_output.weight", (HID, N_HEAD * HD), T.Q8_0)
        put(b + "attn_q_norm.weight", (HD,)), put(b + "attn_k_norm.weight", (HD,))
        put(b + "attn_norm.weight", (HID,)), put(b + "ffn_norm.weight", (HID,))
        put(b + "ffn_gate_inp.weight", (E, HID), scale=1.0)  # the router, float
        put(b + "ffn_gate_exps.weight", (E, I_EXP, HID), T[gu_kind], 0.05)
        put(b + "ffn_up_exps.weight", (E, I_EXP, HID), T[gu_kind], 0.05)
        put(b + "ffn_down_exps.weight", (E, HID, I_EXP), T[down_kind], 0.05)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def _tokens(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0), use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])


def test_moe_gguf_serves_its_experts_packed(tmp_path):
    path = tmp_path / "tiny-qwen3moe.gguf"
    _write(path, np.random.default_rng(5))
    prompts = [np.random.default_rng(6).integers(0, VOCAB - 2, size=n).tolist() for n in (3, 12, 21)]
    ref = LLM(str(path), model_impl="transformers", quantization="none", num_kv_blocks=32, block_size=4)
    want, want_lp = _tokens(ref, prompts)
    del ref
    llm = LLM(str(path), model_impl="transformers", num_kv_blocks=32, block_size=4)
    formats = llm.llm_engine.get_stats().weight_formats
    assert formats["experts Q4_K+Q8_0"] == 1 and formats["experts MXFP4"] == 1, formats
    hf = llm.engine.core.runner.model.hf
    experts = [m for m in hf.modules() if hasattr(m, "pagedllm_experts")]
    assert len(experts) == LAYERS and all(m.pagedllm_experts.kind != "float32" for m in experts)
    assert all(m.gate_up_proj is None and m.down_proj is None for m in experts)  # no float copy
    got, got_lp = _tokens(llm, prompts)
    assert got == want
    stats = llm.llm_engine.get_stats()  # the routing histogram: every token of every step chose TOP_K experts
    assert stats.expert_bytes == sum(m.pagedllm_experts.nbytes for m in experts) > 0
    # the prompts share prefixes: cached blocks' tokens are not run again; then 7 decodes each
    run = stats.num_prompt_tokens - stats.prefix_cache_hits + len(prompts) * 7
    assert stats.prefix_cache_hits > 0 and [sum(c) for c in stats.experts_chosen] == [TOP_K * run] * LAYERS
    assert max(abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)) < 2e-3

"""gpt-oss from a GGUF (issue 40): a tiny file in llama.cpp's ``gpt-oss`` layout, written with ``gguf``'s
writer (stacked ``ffn_{gate,up,down}_exps`` experts in MXFP4 and Q8_0 with their biases, attention
sinks, a biased router, q/k/v/o biases, YaRN keys, a sliding window of 8), converted by our table
(``models/gguf_gpt_oss.py``: ``transformers``' GGUF reader misnames these experts) and served with
every expert layer packed on the experts kernel: ``transformers``' greedy tokens on the converted
float32 weights, and the dequantized backend's log-probabilities.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="packed weights need the C kernels")

HID, N_HEAD, N_KV, HD, I_EXP, E, TOP_K, LAYERS, WINDOW = 128, 4, 2, 32, 64, 4, 2, 3, 8
TOKENS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + \
    [str(d) for d in range(9)] + ["ab", "<|endoftext|>", "<|return|>"]
VOCAB = len(TOKENS)
EXPERT_KINDS = ["MXFP4", "Q8_0", "MXFP4"]  # per layer (gpt-oss files ship MXFP4 experts)
MAX_NEW = 8


def _write(path: Path, rng) -> None:
    import gguf
    from gguf import GGMLQuantizationType as T
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(LAYERS), w.add_context_length(256), w.add_embedding_length(HID)
    w.add_feed_forward_length(I_EXP), w.add_expert_feed_forward_length(I_EXP)
    w.add_head_count(N_HEAD), w.add_head_count_kv(N_KV), w.add_key_length(HD), w.add_value_length(HD)
    w.add_expert_count(E), w.add_expert_used_count(TOP_K), w.add_rope_freq_base(1.5e5)
    w.add_layer_norm_rms_eps(1e-5), w.add_sliding_window(WINDOW)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(64)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(TOKENS)
    w.add_token_types([1] * (VOCAB - 2) + [3, 3]), w.add_token_merges(["a b"])
    w.add_bos_token_id(VOCAB - 2), w.add_eos_token_id(VOCAB - 1), w.add_pad_token_id(VOCAB - 1)

    def put(name, shape, kind=T.F32, scale=0.3, one=False):
        x = (scale * rng.standard_normal(shape)).astype(np.float32)
        x = 1 + 0.1 * x if one else x
        if kind == T.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)

    put("token_embd.weight", (VOCAB, HID), T.Q8_0), put("output_norm.weight", (HID,), one=True)
    put("output.weight", (VOCAB, HID), T.Q8_0)
    for i, kind in enumerate(EXPERT_KINDS):
        b = f"blk.{i}."
        for n, rows, cols in (("attn_q", N_HEAD * HD, HID), ("attn_k", N_KV * HD, HID), ("attn_v", N_KV * HD, HID),
                              ("attn_output", HID, N_HEAD * HD)):
            put(b + n + ".weight", (rows, cols), T.Q8_0), put(b + n + ".bias", (rows,), scale=0.1)
        put(b + "attn_sinks.weight", (N_HEAD,), scale=1.0)
        put(b + "attn_norm.weight", (HID,), one=True), put(b + "post_attention_norm.weight", (HID,), one=True)
        put(b + "ffn_gate_inp.weight", (E, HID), scale=1.0), put(b + "ffn_gate_inp.bias", (E,), scale=0.1)
        for n, shape in (("gate", (E, I_EXP, HID)), ("up", (E, I_EXP, HID)), ("down", (E, HID, I_EXP))):
            put(b + f"ffn_{n}_exps.weight", shape, T[kind], 0.1)
            put(b + f"ffn_{n}_exps.bias", shape[:2], scale=0.1)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def _run(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0), use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])


def test_gpt_oss_gguf_serves_its_experts_packed(tmp_path, greedy_ref, assert_no_leaks):
    from transformers import AutoModelForCausalLM
    path = tmp_path / "tiny-gpt-oss.gguf"
    _write(path, np.random.default_rng(5))
    # two prompts longer than the window; they share a prefix, so the second run reads cached blocks
    prompts = [np.random.default_rng(6).integers(0, VOCAB - 2, size=n).tolist() for n in (3, 12, 21)]
    ref = LLM(str(path), model_impl="transformers", quantization="none", num_kv_blocks=32, block_size=4)
    model_dir = ref.llm_engine.model_dir
    want, want_lp = _run(ref, prompts)
    del ref
    cfg = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    from pagedllm.models.gguf_experts import load_into  # the experts stay in the GGUF file
    assert load_into(cfg, model_dir) == 2 * LAYERS
    assert not list(model_dir.glob("*.safetensors"))[0].stat().st_size > 4 * 2**20  # no float32 experts
    assert (cfg.config.head_dim, cfg.config.sliding_window, cfg.config.rope_parameters["rope_type"],
            cfg.config.rope_parameters["factor"]) == (HD, WINDOW, "yarn", 4.0)
    assert cfg.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    for k, p in enumerate(prompts):
        ids, logits = greedy_ref.hf_greedy(cfg, p, MAX_NEW)
        greedy_ref.assert_greedy_match(want[k], ids, logits, f"gpt-oss GGUF dequantized prompt {k}")
    del cfg

    llm = LLM(str(path), model_impl="transformers", num_kv_blocks=32, block_size=4)
    formats = llm.llm_engine.get_stats().weight_formats
    assert formats == {"Q8_0": 4 * LAYERS + 2, "experts MXFP4": 2, "experts Q8_0": 1}, formats
    experts = [m for m in llm.engine.core.runner.model.hf.modules() if hasattr(m, "pagedllm_experts")]
    assert len(experts) == LAYERS and all(m.pagedllm_experts.activation == "swiglu_oai" for m in experts)
    assert all(m.gate_up_proj is None and m.gate_up_proj_bias is None for m in experts)  # no float copy
    for _ in range(2):  # the second time from the prefix cache
        got, got_lp = _run(llm, prompts)
        assert got == want
        assert max(abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)) < 2e-3
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    assert_no_leaks(llm.engine)

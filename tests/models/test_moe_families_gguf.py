"""Mixtral, OLMoE, Granite MoE, Qwen3-MoE and Qwen2-MoE from a GGUF (issue 40: each family from a GGUF with its experts kept
packed). A tiny random ``transformers`` model of each family is written in llama.cpp's layout with
``gguf``'s writer (the Llama-derived families' q/k rows permuted as ``convert_hf_to_gguf.py`` does,
experts stacked as ``ffn_{gate,up,down}_exps``, Granite's multipliers as ``*_scale`` keys; a rotary
base of 50 so that a q/k row order gone wrong changes the tokens), experts and
attention quantized (Q8_0, MXFP4) and the model's own weights set to the dequantized values; served
from the file (converted by ``models/gguf_moe.py``, which leaves the experts in the file; experts
packed on the experts kernel) it gives ``transformers``' greedy tokens on those weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="packed weights need the C kernels")

TOKENS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + \
    [str(d) for d in range(9)] + ["ab", "<s>", "</s>"]
VOCAB, HID, N_HEAD, N_KV, I_EXP, E, TOP_K, MAX_NEW = len(TOKENS), 64, 4, 2, 64, 4, 2, 16
EXPERT_KINDS = ("Q8_0", "MXFP4")  # per layer
FAMILIES = {  # kind: (gguf arch, config class, MoE module, router, q/k permuted, extra config)
    "mixtral": ("llama", "MixtralConfig", "mlp", "gate", True, dict(num_local_experts=E)),
    "olmoe": ("olmoe", "OlmoeConfig", "mlp", "gate", False, dict(num_experts=E)),
    "granitemoe": ("granitemoe", "GraniteMoeConfig", "block_sparse_moe", "router", True,
                   dict(num_local_experts=E, embedding_multiplier=2.0, residual_multiplier=0.5,
                        attention_multiplier=0.2, logits_scaling=3.0)),
    # head_dim 32 != hidden / heads, per-head q/k norms, renormalized top-k (llama.cpp's qwen3moe graph)
    "qwen3_moe": ("qwen3moe", "Qwen3MoeConfig", "mlp", "gate", False,
                  dict(num_experts=E, moe_intermediate_size=I_EXP, head_dim=32, norm_topk_prob=True)),
    # q/k/v biases, a gated shared expert of its own width
    "qwen2_moe": ("qwen2moe", "Qwen2MoeConfig", "mlp", "gate", False,
                  dict(num_experts=E, moe_intermediate_size=I_EXP, shared_expert_intermediate_size=96)),
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for its interleaved rotary (the inverse of ``unpermute_rows``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _model(kind: str, rng):
    import transformers
    _, cls, *_, extra = FAMILIES[kind]
    cfg = getattr(transformers, cls)(vocab_size=VOCAB, hidden_size=HID, intermediate_size=I_EXP, num_hidden_layers=2,
                                     num_attention_heads=N_HEAD, num_key_value_heads=N_KV, num_experts_per_tok=TOP_K,
                                     max_position_embeddings=128, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1,
                                     pad_token_id=VOCAB - 1, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                     rope_parameters={"rope_type": "default", "rope_theta": 50.0}, **extra)
    torch.manual_seed(int(rng.integers(1 << 30)))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.3 * torch.randn_like(p))
    return model


def _write(kind: str, model, path) -> None:
    """``model`` as llama.cpp's converter lays it out; its quantized tensors' parameters replaced by
    their dequantized values (the reference then runs on exactly the file's weights)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    arch, _, moe, router, permuted, _ = FAMILIES[kind]
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2), w.add_context_length(128), w.add_embedding_length(HID), w.add_feed_forward_length(I_EXP)
    w.add_head_count(N_HEAD), w.add_head_count_kv(N_KV), w.add_expert_count(E), w.add_expert_used_count(TOP_K)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"]), w.add_layer_norm_rms_eps(1e-5)
    if kind.startswith("qwen"):
        head_dim = getattr(cfg, "head_dim", None) or HID // N_HEAD
        w.add_expert_feed_forward_length(I_EXP), w.add_key_length(head_dim), w.add_value_length(head_dim)
    if kind == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if kind == "granitemoe":
        w.add_embedding_scale(cfg.embedding_multiplier), w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier), w.add_logit_scale(cfg.logits_scaling)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(TOKENS)
    w.add_token_types([1] * (VOCAB - 2) + [3, 3]), w.add_token_merges(["a b"])
    w.add_bos_token_id(VOCAB - 2), w.add_eos_token_id(VOCAB - 1), w.add_pad_token_id(VOCAB - 1)
    sd = model.state_dict()

    def put(name: str, key: str, kind_=None, heads=0, index=None):
        p = sd[key] if index is None else sd[key][:, index]
        turn = bool(heads and permuted)
        x = p.numpy().astype(np.float32)
        x = _permute(x, heads) if turn else x
        if kind_ is None:
            w.add_tensor(name, x)
            return
        q = gguf.quants.quantize(x, T[kind_])
        w.add_tensor(name, q, raw_dtype=T[kind_])
        back = np.asarray(gguf.quants.dequantize(q, T[kind_]), dtype=np.float32).reshape(x.shape)
        with torch.no_grad():
            p.copy_(torch.from_numpy(_unpermute(back, heads) if turn else back))

    put("token_embd.weight", "model.embed_tokens.weight", "Q8_0"), put("output.weight", "lm_head.weight", "Q8_0")
    put("output_norm.weight", "model.norm.weight")
    for i, ek in enumerate(EXPERT_KINDS):
        b, L = f"blk.{i}.", f"model.layers.{i}."
        put(b + "attn_q.weight", L + "self_attn.q_proj.weight", "Q8_0", heads=N_HEAD)
        put(b + "attn_k.weight", L + "self_attn.k_proj.weight", "Q8_0", heads=N_KV)
        put(b + "attn_v.weight", L + "self_attn.v_proj.weight", "Q8_0")
        put(b + "attn_output.weight", L + "self_attn.o_proj.weight", "Q8_0")
        if kind in ("olmoe", "qwen3_moe"):
            put(b + "attn_q_norm.weight", L + "self_attn.q_norm.weight")
            put(b + "attn_k_norm.weight", L + "self_attn.k_norm.weight")
        if kind == "qwen2_moe":
            for g in "qkv":
                put(b + f"attn_{g}.bias", L + f"self_attn.{g}_proj.bias")
            shared = L + "mlp.shared_expert."
            for g in ("gate", "up", "down"):
                put(b + f"ffn_{g}_shexp.weight", shared + f"{g}_proj.weight", "Q8_0")
            w.add_tensor(b + "ffn_gate_inp_shexp.weight", sd[L + "mlp.shared_expert_gate.weight"].numpy()[0])  # [H]
        put(b + "attn_norm.weight", L + "input_layernorm.weight")
        put(b + "ffn_norm.weight", L + "post_attention_layernorm.weight")
        put(b + "ffn_gate_inp.weight", f"{L}{moe}.{router}.weight")
        ex = f"{L}{moe}.experts."
        put(b + "ffn_gate_exps.weight", ex + "gate_up_proj", ek, index=slice(0, I_EXP))
        put(b + "ffn_up_exps.weight", ex + "gate_up_proj", ek, index=slice(I_EXP, 2 * I_EXP))
        put(b + "ffn_down_exps.weight", ex + "down_proj", ek)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_moe_family_gguf_serves_packed_experts_with_transformers_tokens(kind, tmp_path, greedy_ref, assert_no_leaks):
    rng = np.random.default_rng(11)
    model = _model(kind, rng)
    path = tmp_path / f"tiny-{kind}.gguf"
    _write(kind, model, path)
    prompts = [rng.integers(0, VOCAB - 2, size=n).tolist() for n in (4, 13, 21)]
    llm = LLM(str(path), num_kv_blocks=32, block_size=4)
    formats = llm.llm_engine.get_stats().weight_formats
    assert formats.get("experts Q8_0") == 1 and formats.get("experts MXFP4") == 1, formats
    shared = 3 * 2 if kind == "qwen2_moe" else 0
    assert formats.get("Q8_0") == 4 * 2 + 2 + shared and "float32 (differs)" not in formats, formats
    model_dir = llm.llm_engine.model_dir  # the experts stay in the file: no float32 copy was written
    assert sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) < 0.5 * path.stat().st_size * 4
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids, logits = greedy_ref.hf_greedy(model, p, MAX_NEW)
        greedy_ref.assert_greedy_match(list(o.outputs[0].token_ids), ids, logits, f"{kind} GGUF")
    assert_no_leaks(llm.engine)
    if kind == "mixtral":  # an earlier pagedllm's conversion (float32 experts, no manifest) is redone
        from pagedllm.models.gguf_experts import MANIFEST
        from pagedllm.models.loader import convert_gguf
        (model_dir / MANIFEST).unlink()
        assert convert_gguf(path) == model_dir and (model_dir / MANIFEST).is_file()


def test_an_expert_parallel_rank_reads_only_its_experts_from_the_gguf(tmp_path, monkeypatch):
    """Rank 1 of 2 with --enable-expert-parallel on a converted Mixtral GGUF: its experts 2..3 of 4 are
    dequantized from the file's blocks (those experts only), equal to the same experts read whole."""
    from pagedllm.distributed import parallel_state
    from pagedllm.models import gguf_experts
    from pagedllm.models.hf_config import read_hf_config
    from pagedllm.models.load import load_model
    from pagedllm.models.load_plan import plan_load
    from pagedllm.models.loader import convert_gguf
    path = tmp_path / "tiny-mixtral.gguf"
    _write("mixtral", _model("mixtral", np.random.default_rng(3)), path)
    model_dir = convert_gguf(path)
    read = []
    real_rows = gguf_experts._rows
    monkeypatch.setattr(gguf_experts, "_rows", lambda t, e0, e1: read.append((e0, e1)) or real_rows(t, e0, e1))
    for key, value in dict(rank=1, world_size=2, tp_rank=1, tp_size=2).items():
        monkeypatch.setitem(parallel_state._STATE, key, value)
    plan = plan_load(model_dir, read_hf_config(model_dir), torch.float32, "cpu", "transformers",
                     tensor_parallel_size=2, expert_parallel=True)
    model, _ = load_model(model_dir, plan)
    assert set(read) == {(2, 4)}  # gate, up and down of both layers: this rank's experts only
    whole = gguf_experts.GGUFExperts(model_dir)
    for i in range(2):
        experts = model.hf.model.layers[i].mlp.experts
        assert experts.pagedllm_ep == (2, 2, E)
        for name in ("gate_up_proj", "down_proj"):
            want = whole.get_tensor(f"model.layers.{i}.mlp.experts.{name}")[2:]
            assert torch.equal(getattr(experts, name), want)

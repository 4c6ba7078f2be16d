"""Tensor parallelism for the Transformers backend (``models/transformers_tp.py``): TP=2 over gloo
gives TP=1's greedy tokens; models whose tp plan pagedllm cannot split are refused by name.

Each engine at TP=2 starts one worker process beside the test process, so the models are tiny and
the generations short (the machine's cores are shared).
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[1, 520, 3012, 314, 260, 1142], [1, 9182, 28, 451, 5035, 29, 7, 441, 33, 2847, 355, 1903] * 3]


def _children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pagedllm-tp")]


def _generate(path, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), num_kv_blocks=64, num_threads=1, model_impl="transformers", **kw)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def _hf_loader(path):
    """The float32 transformers model at ``path`` (the near-tie rule's oracle, built only if needed)."""
    def hf():
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf


# ---------------------------------------------------------------- plans refused without processes

@pytest.mark.parametrize("cls, kwargs, match", [
    ("GPT2Config", {}, r"--tensor-parallel-size 2 .*'gpt2' has no tensor-parallel plan"),
    # gathered attention outputs (OLMo 2's plan): the heads are not split
    ("Olmo2Config", {}, r"'olmo2' has tensor-parallel styles \['colwise_gather_output', 'rowwise_split_input'\]"),
    ("JambaConfig", {}, r"'jamba' is a hybrid model"),
    # experts are split by expert, only when asked
    ("Qwen3MoeConfig", {}, r"'qwen3_moe' is a mixture of experts: .* --enable-expert-parallel"),
])
def test_unsplittable_plans_are_refused(cls, kwargs, match):
    import transformers

    from pagedllm.models.transformers_tp import tensor_parallel_plan
    with pytest.raises(ValueError, match=match):
        tensor_parallel_plan(getattr(transformers, cls)(**kwargs), 2)


def test_fused_qkv_in_a_plan_is_refused():
    """GPT-NeoX plans its fused, per-head interleaved query_key_value colwise: not cut into whole heads."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    from pagedllm.models.transformers_tp import shard_transformers_model
    cfg = GPTNeoXConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=1,
                        vocab_size=128)
    hf = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"query_key_value \(colwise, width 192\) is not a per-head"):
        shard_transformers_model(hf, cfg, 2, 0)


def test_llama_plan_and_sharded_shapes_on_one_rank(tiny_model_dir, monkeypatch):
    """Rank 1 of 2 (no group needed to build it): whole heads, the MLP halved, the head's vocabulary rows."""
    from transformers import AutoModelForCausalLM

    from pagedllm.models.layers import parallel
    from pagedllm.models.layers.parallel import ColumnParallelLinear, RowParallelLinear
    monkeypatch.setattr(parallel, "get_tp_size", lambda: 2)  # what the vocabulary split asks
    monkeypatch.setattr(parallel, "get_tp_rank", lambda: 1)
    from pagedllm.models.transformers_tp import GatheredLMHead, shard_transformers_model
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama_mqa"), dtype=torch.float32).eval()
    full = {n: p.detach().clone() for n, p in hf.named_parameters()}
    shard = shard_transformers_model(hf, hf.config, 2, 1)
    # 4 query heads, 1 KV head of 16: the KV head replicated, query heads 2 and 3 here
    assert (shard.q_start, shard.q_heads, shard.kv_start, shard.kv_heads) == (2, 2, 0, 1)
    attn = hf.model.layers[0].self_attn
    assert isinstance(attn.q_proj, ColumnParallelLinear) and isinstance(attn.o_proj, RowParallelLinear)
    assert torch.equal(attn.q_proj.weight, full["model.layers.0.self_attn.q_proj.weight"][32:64])
    assert torch.equal(attn.k_proj.weight, full["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(attn.o_proj.weight, full["model.layers.0.self_attn.o_proj.weight"][:, 32:64])
    mlp = hf.model.layers[0].mlp
    assert torch.equal(mlp.up_proj.weight, full["model.layers.0.mlp.up_proj.weight"][64:128])
    assert torch.equal(mlp.down_proj.weight, full["model.layers.0.mlp.down_proj.weight"][:, 64:128])
    assert isinstance(hf.lm_head, GatheredLMHead)
    assert torch.equal(hf.lm_head.table.weight, full["lm_head.weight"][24576:])


def test_a_rank_reads_only_its_slices_with_the_transformers_backend(tiny_model_dir, monkeypatch, counting_safe_open,
                                                                    checkpoint_elements):
    """Rank 1 of 2, built in this process: no tensor read whole (``from_pretrained`` would read them
    all), the elements read equal the elements held, and the slices equal the full model's."""
    import safetensors
    from transformers import AutoModelForCausalLM

    from pagedllm.distributed import parallel_state
    from pagedllm.models.hf_config import read_hf_config
    from pagedllm.models.load import load_model
    from pagedllm.models.load_plan import plan_load
    path = tiny_model_dir("llama")
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for key, value in dict(rank=1, world_size=2, tp_rank=1, tp_size=2).items():
        monkeypatch.setitem(parallel_state._STATE, key, value)
    counting = counting_safe_open
    monkeypatch.setattr(safetensors, "safe_open", counting)
    plan = plan_load(path, read_hf_config(path), torch.float32, "cpu", "transformers", tensor_parallel_size=2)
    model, _ = load_model(path, plan)
    hf = model.hf
    assert counting.whole == []
    held = sum(p.numel() for p in hf.parameters())
    assert counting.read == held, (counting.read, held)
    # the plans keep the embedding and the norms whole (over half of this tiny model); the rest is halved
    whole = sum(p.numel() for n, p in full.named_parameters() if "embed" in n or "norm" in n)
    assert counting.read == whole + (checkpoint_elements(path) - whole) // 2, counting.read
    assert not any(p.is_meta for p in hf.parameters()) and not any(b.is_meta for b in hf.buffers())
    attn, want = hf.model.layers[0].self_attn, full.model.layers[0].self_attn
    assert torch.equal(attn.q_proj.weight, want.q_proj.weight[32:64])  # query heads 2 and 3 of 4
    assert torch.equal(attn.o_proj.weight, want.o_proj.weight[:, 32:64])
    assert torch.equal(hf.model.embed_tokens.weight, full.model.embed_tokens.weight)
    assert torch.equal(hf.model.rotary_emb.inv_freq, full.model.rotary_emb.inv_freq)


# ---------------------------------------------------------------- greedy equivalence over gloo

@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_mqa", "llama_bias_tied"])
def test_transformers_tp2_greedy_equals_tp1(kind, tiny_model_dir, greedy_ref):
    """Untied head (llama), q/k/v bias and tied embeddings (qwen2), one KV head replicated on both
    ranks (llama_mqa), o_proj and down_proj bias added once after the all-reduce (llama_bias_tied).
    The tiny models have 4 query heads and 2 KV heads (llama_mqa: 1)."""
    path = tiny_model_dir(kind)
    want, llm1 = _generate(path)
    llm1.engine.shutdown()
    got, llm2 = _generate(path, tensor_parallel_size=2)
    try:
        core = llm2.engine.core
        model = core.runner.model
        # rank 0 holds 2 of the 4 query heads and its KV heads only: the KV pool per rank shrinks
        assert (model.num_heads, model.num_kv_heads) == (2, 1)
        assert core.runner.kv_caches[0][0].shape[0] == 1
        assert len(_children()) == 1
    finally:
        llm2.engine.shutdown()
    assert _children() == []
    for k, (g, w) in enumerate(zip(got, want)):
        greedy_ref.assert_same_greedy(g, w, PROMPTS[k], _hf_loader(path), f"{kind} transformers TP=2 prompt {k}")


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory, smollm2_dir):
    """A random tiny Gemma 3 text model: q/k norms (planned replicated), sliding-window layers,
    scaled embeddings, tied head; SmolLM2's tokenizer files."""
    import shutil

    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    out = tmp_path_factory.mktemp("tiny-gemma3")
    cfg = Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, num_hidden_layers=3, sliding_window=8,
                           max_position_embeddings=1024, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                           pad_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_dir / f).is_file():
            shutil.copy(smollm2_dir / f, out / f)
    return out


def test_gemma3_transformers_tp2_greedy_equals_tp1(tiny_gemma3_dir, greedy_ref):
    """A model with no native implementation, split by its own plan."""
    want, llm1 = _generate(tiny_gemma3_dir)
    llm1.engine.shutdown()
    got, llm2 = _generate(tiny_gemma3_dir, tensor_parallel_size=2)
    try:
        model = llm2.engine.core.runner.model
        assert (model.num_heads, model.num_kv_heads) == (2, 1)
    finally:
        llm2.engine.shutdown()
    for k, (g, w) in enumerate(zip(got, want)):
        greedy_ref.assert_same_greedy(g, w, PROMPTS[k], _hf_loader(tiny_gemma3_dir), f"gemma3 TP=2 prompt {k}")


def test_smollm2_transformers_tp2_greedy_equals_tp1(smollm2_dir, smollm2_tokenizer, hf_smollm2, greedy_ref):
    """SmolLM2's 9 heads in 3 KV groups split unevenly, 6 + 3 (2 + 1 KV heads), which transformers'
    own even split would refuse; the MLP's 1536 columns 768 + 768."""
    texts = ["The capital of France is", "def fibonacci(n):\n    "]
    prompts = [smollm2_tokenizer(t)["input_ids"] for t in texts]
    outs = []
    for kw in ({}, {"tensor_parallel_size": 2}):
        llm = LLM(str(smollm2_dir), num_kv_blocks=64, num_threads=1, model_impl="transformers", **kw)
        try:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
            if kw:
                model = llm.engine.core.runner.model
                assert (model.num_heads, model.num_kv_heads) == (6, 2)
                assert model.hf.model.layers[0].mlp.up_proj.weight.shape == (768, 576)
        finally:
            llm.engine.shutdown()
    for k, (g, w) in enumerate(zip(outs[1], outs[0])):
        greedy_ref.assert_same_greedy(g, w, prompts[k], hf_smollm2, f"smollm2 transformers TP=2 prompt {k}")


def test_model_without_plan_is_refused_at_load(tiny_model_dir):
    """LFM2 has no base_model_tp_plan: every rank refuses before reading weights; no worker is left."""
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 .*'lfm2' has no tensor-parallel plan"):
        LLM(str(tiny_model_dir("lfm2")), num_kv_blocks=16, num_threads=1, tensor_parallel_size=2,
            model_impl="transformers")
    assert _children() == []


# ---------------------------------------------------------------- expert parallelism

def test_a_rank_holds_and_reads_only_its_experts(tiny_model_dir, monkeypatch, counting_safe_open):
    """Rank 1 of 2 with --enable-expert-parallel: experts 4..7 of 8 (the checkpoint stores them per
    expert), read and held alone; the router and the dense layer's MLP as the plan says."""
    import math

    import safetensors
    from transformers import AutoModelForCausalLM

    from pagedllm.distributed import parallel_state
    from pagedllm.models.hf_config import read_hf_config
    from pagedllm.models.load import load_model
    from pagedllm.models.load_plan import plan_load
    path = tiny_model_dir("qwen3_moe")
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with safetensors.safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        shapes = {n: fh.get_slice(n).get_shape() for n in fh.keys()}
    for key, value in dict(rank=1, world_size=2, tp_rank=1, tp_size=2).items():
        monkeypatch.setitem(parallel_state._STATE, key, value)
    monkeypatch.setattr(safetensors, "safe_open", counting_safe_open)
    plan = plan_load(path, read_hf_config(path), torch.float32, "cpu", "transformers", tensor_parallel_size=2,
                     expert_parallel=True)
    assert plan.expert_parallel
    model, _ = load_model(path, plan)
    hf = model.hf
    # save_pretrained stores experts one by one: those of this rank are read whole, no other
    whole = counting_safe_open.whole
    assert whole and all(int(name.split(".experts.")[1].split(".")[0]) >= 4 for name in whole), whole
    whole_elements = sum(math.prod(shapes[n]) for n in whole)
    assert counting_safe_open.read + whole_elements == sum(p.numel() for p in hf.parameters())
    got, want = hf.model.layers[0].mlp, full.model.layers[0].mlp
    assert got.experts.pagedllm_ep == (4, 4, 8) and got.experts.num_experts == 4
    assert torch.equal(got.experts.gate_up_proj, want.experts.gate_up_proj[4:])
    assert torch.equal(got.experts.down_proj, want.experts.down_proj[4:])
    assert torch.equal(got.gate.weight, want.gate.weight)  # the router: whole on every rank
    assert hf.model.layers[1].mlp.up_proj.weight.shape[0] == 64  # mlp_only_layers: split as a dense MLP


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe", "granitemoe"])
def test_expert_parallel_tp2_greedy_equals_tp1(kind, tiny_model_dir, greedy_ref):
    """--tensor-parallel-size 2 --enable-expert-parallel gives one rank's greedy tokens: routed experts
    split 4 + 4 (qwen3_moe), 2 + 2 (mixtral), 3 + 3 beside a whole shared expert (qwen2_moe), 3 + 2
    with the attention whole on both ranks (granitemoe, whose plan splits only the experts)."""
    path = tiny_model_dir(kind)
    want, llm1 = _generate(path)
    llm1.engine.shutdown()
    got, llm2 = _generate(path, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        model = llm2.engine.core.runner.model
        experts = [m.pagedllm_ep for m in model.hf.modules() if getattr(m, "pagedllm_ep", None)]
        assert experts and experts[0][:2] == (0, {"qwen3_moe": 4, "mixtral": 2, "qwen2_moe": 3, "granitemoe": 3}[kind])
        assert (model.num_heads, model.num_kv_heads) == ((4, 2) if kind == "granitemoe" else (2, 1))
    finally:
        llm2.engine.shutdown()
    assert _children() == []
    for k, (g, w) in enumerate(zip(got, want)):
        greedy_ref.assert_same_greedy(g, w, PROMPTS[k], _hf_loader(path), f"{kind} EP=2 prompt {k}")

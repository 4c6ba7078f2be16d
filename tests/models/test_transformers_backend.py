"""The Transformers backend (``model_impl="transformers"``): many architectures, one paged attention.

Random-weight tiny models of each architecture are built with ``transformers``'
config classes and saved with ``save_pretrained`` (safetensors) next to the
SmolLM2 tokenizer. The engine serves each through the Transformers backend with
a small step budget, so prompts longer than the sliding windows are prefilled in
chunks and decodes of different lengths share steps, and its greedy tokens must
equal ``transformers``' own float32 ``generate`` on the same directory (default
attention: ``sdpa``, or ``eager`` where the model has no ``sdpa``, e.g. Gemma 2
and its soft-capping), up to a reference near-tie. The log-probability of every
matching token must also agree with the reference's, so the comparison sees the
logits and not only their argmax.

Also: SmolLM2 gives the same tokens through the backend and the native path,
``select_impl``/``model_impl`` choose and refuse as documented, and only the
sampled rows reach the LM head.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_NEW = 20
BUDGET = 32            # max_num_batched_tokens: every prompt but the first two is chunked
WINDOW = 8             # sliding windows, far shorter than the prompts and the outputs
LOGPROB_TOL = 1e-3     # |engine - reference| log-probability of a matching greedy token
PROMPT_LENS = (3, 17, 40, 70)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from wine making. Within decades, print "
    "shops had spread from Mainz to Venice, Paris and London, and the price of books fell sharply. Scholars "
    "could compare identical copies of a text for the first time, which changed how knowledge was shared, "
    "checked and corrected. Pamphlets carried news and arguments to readers far from universities, and "
    "literacy rose as reading material became cheaper. Historians still debate how quickly these changes "
    "happened, but few doubt that the press reshaped religion, science and politics across Europe. "
    "Meanwhile, in East Asia, woodblock printing had been used for centuries, and movable type made of "
    "ceramic and later metal appeared in China and Korea long before it reached Europe.")

# the common tiny shape; the vocabulary is SmolLM2's, whose tokenizer is copied in
_COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
               bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
_GPT2 = dict(vocab_size=49152, n_embd=64, n_layer=3, n_head=4, n_positions=512, initializer_range=0.1,
             bos_token_id=1, eos_token_id=2, pad_token_id=2)
_OPT = dict(vocab_size=49152, hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4,
            word_embed_proj_dim=64, max_position_embeddings=512, init_std=0.1,
            bos_token_id=1, eos_token_id=2, pad_token_id=2)

# kind -> (transformers config class, its kwargs); what each kind exercises is in the comment
ARCHS = {
    "llama": ("LlamaConfig", dict(_COMMON)),
    # every layer slides (window 8)
    "mistral": ("MistralConfig", dict(_COMMON, sliding_window=WINDOW, head_dim=16)),
    # layer 0 full, layers 1-2 sliding (use_sliding_window + max_window_layers)
    "qwen2": ("Qwen2Config", dict(_COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # q/k norms, head_dim 32 != hidden / heads
    "qwen3": ("Qwen3Config", dict(_COMMON, head_dim=32)),
    # sliding / full alternation, attention and final logit soft-capping, query_pre_attn_scalar scaling
    "gemma2": ("Gemma2Config", dict(_COMMON, head_dim=32, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0, query_pre_attn_scalar=24)),
    # local and global layers (different rope bases), head_dim 24 != hidden / heads, scale from
    # query_pre_attn_scalar 32 != head_dim
    "gemma3_text": ("Gemma3TextConfig", dict(_COMMON, head_dim=24, sliding_window=WINDOW, query_pre_attn_scalar=32,
                                             layer_types=["sliding_attention", "full_attention",
                                                          "sliding_attention"])),
    # fused qkv / gate_up projections
    "phi3": ("Phi3Config", dict(_COMMON)),
    # learned absolute positions, fused Conv1D attention, layer norm, tied embeddings
    "gpt2": ("GPT2Config", dict(_GPT2)),
    # q/k norms over all heads, post-norm blocks
    "olmo2": ("Olmo2Config", dict(_COMMON)),
    # embedding / residual / attention multipliers and logits scaling
    "granite": ("GraniteConfig", dict(_COMMON, embedding_multiplier=3.0, residual_multiplier=0.5,
                                      attention_multiplier=0.3, logits_scaling=2.0)),
    # sliding window, biases, layer norm
    "starcoder2": ("Starcoder2Config", dict(_COMMON, sliding_window=WINDOW)),
    # partial rotary, parallel residual
    "gpt_neox": ("GPTNeoXConfig", dict(_COMMON, rotary_pct=0.5)),
    # learned positions with an offset of 2
    "opt": ("OPTConfig", dict(_OPT)),
    # parallel attention / MLP, logit scale
    "cohere": ("CohereConfig", dict(_COMMON, logit_scale=0.5)),
    # mixture of experts with a sliding window
    "mixtral": ("MixtralConfig", dict(_COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    # the MoE families on the experts kernel (models/moe.py): q/k norms, a shared expert, OLMoE's
    # q/k norm over all heads, Granite's multipliers
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         head_dim=16)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64)),
    "olmoe": ("OlmoeConfig", dict(_COMMON, num_experts=8, num_experts_per_tok=2)),
    "granitemoe": ("GraniteMoeConfig", dict(_COMMON, num_local_experts=4, num_experts_per_tok=2,
                                            embedding_multiplier=3.0, residual_multiplier=0.5)),
    # DeepSeek-V3-style routing (GLM-4.5): sigmoid scores, a bias-corrected choice (the bias randomized by
    # build_model), grouped top-k (4 groups, best 2), a scaling factor, a shared expert, a dense first
    # layer, partial rotary
    "glm4_moe": ("Glm4MoeConfig", dict(_COMMON, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                       n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                                       routed_scaling_factor=2.5, head_dim=16, partial_rotary_factor=0.5)),
    # attention sinks, sliding / full alternation, YaRN rotary, biased router and clamped SwiGLU experts
    "gpt_oss": ("GptOssConfig", dict(_COMMON, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                     sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention",
                                                                         "sliding_attention"])),
}


MOE_KINDS = {"mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "glm4_moe", "gpt_oss"}


def build_model(spec: tuple[str, dict], out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a random-weight ``transformers`` model of ``spec`` (an ``ARCHS`` value) with SmolLM2's tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    cls_name, kwargs = spec
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # a router's score correction starts at zero: make it choose
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.5 * torch.randn_like(buf))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out)
    copy_tokenizer(tokenizer_dir, out)
    return out


def copy_tokenizer(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory, smollm2_dir):
    """Factory ``arch_dir(kind) -> Path``: the tiny model directory of ``kind``, built once."""
    built: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_model(ARCHS[kind], tmp_path_factory.mktemp(f"tb-{kind}"), smollm2_dir)
        return built[kind]

    return make


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    """Four token-id prompts of 3, 17, 40 and 70 tokens (no shared prefix)."""
    ids = smollm2_tokenizer.encode(TEXT)
    assert len(ids) >= sum(PROMPT_LENS)
    out, start = [], 0
    for n in PROMPT_LENS:
        out.append(ids[start:start + n])
        start += n
    return out


class HeadSpy:
    """Counts the rows the HF model's LM head projects, per forward (a forward pre-hook)."""

    def __init__(self, llm: LLM) -> None:
        from pagedllm.models.transformers_backend import TransformersCausalLM
        model = llm.engine.runner.model
        assert isinstance(model, TransformersCausalLM)
        self.rows: list[int] = []
        self.tokens: list[int] = []
        self.requested: list[int] = []
        head = model.hf.get_output_embeddings()
        self._handles = [
            head.register_forward_pre_hook(lambda mod, args: self.rows.append(args[0].shape[-2])),
            model.register_forward_pre_hook(self._on_step),
        ]

    def _on_step(self, mod, args) -> None:
        input_ids, logits_indices = args[0], args[4]
        self.tokens.append(input_ids.numel())
        self.requested.append(logits_indices.numel())

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def check_against_reference(outputs, prompts, refs, greedy_ref, what: str) -> None:
    """Greedy match (near-tie rule) and log-probabilities of the matching tokens."""
    assert len(outputs) == len(prompts)
    for k, (out, prompt, (ref_ids, ref_logits)) in enumerate(zip(outputs, prompts, refs)):
        comp = out.outputs[0]
        label = f"{what} prompt {k} (len {len(prompt)})"
        assert out.finished and comp.finish_reason == "length" and out.prompt_token_ids == prompt
        greedy_ref.assert_greedy_match(comp.token_ids, ref_ids, ref_logits, label)
        ref_lp = ref_logits.log_softmax(-1)
        for i, (a, b) in enumerate(zip(comp.token_ids, ref_ids)):
            if a != b:
                break
            diff = abs(comp.logprobs[i][a].logprob - float(ref_lp[i, a]))
            assert diff < LOGPROB_TOL, f"{label}: output position {i}: log-probability differs by {diff:.2e}"


# ---------------------------------------------------------------- 1. tiny models vs transformers generate

@pytest.mark.parametrize("kind", list(ARCHS))
def test_tiny_arch_matches_transformers(kind, arch_dir, prompts, greedy_ref, assert_no_leaks):
    from transformers import AutoModelForCausalLM
    path = arch_dir(kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = [greedy_ref.hf_greedy(hf, p, MAX_NEW) for p in prompts]
    del hf
    # the references are not degenerate: a model repeating one token would hide most bugs
    assert sum(len(set(ids)) for ids, _ in refs) > 2 * len(refs), [ids for ids, _ in refs]

    llm = LLM(model=str(path), model_impl="transformers", num_kv_blocks=64, max_num_batched_tokens=BUDGET)
    spy = HeadSpy(llm)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    spy.remove()
    check_against_reference(outputs, prompts, refs, greedy_ref, kind)
    assert_no_leaks(llm.engine)

    # the step budget chunked the prefill, then decodes of different lengths shared steps
    total_prompt = sum(len(p) for p in prompts)
    assert max(spy.tokens) <= BUDGET
    assert llm.engine.stats["num_steps"] >= math.ceil(total_prompt / BUDGET) + MAX_NEW - 1
    # the LM head saw the sampled rows only: one per output token, several in one step
    assert spy.rows == spy.requested
    assert sum(spy.rows) == len(prompts) * MAX_NEW
    assert max(spy.rows) == len(prompts)
    # every mixture-of-experts layer ran on the experts kernel (models/moe.py; gpt-oss's clamped SwiGLU
    # on transposed, interleaved weights too); the C kernels off: transformers' own experts code
    from pagedllm.kernels import cpu
    experts = [m.pagedllm_experts for m in llm.engine.runner.model.hf.modules() if hasattr(m, "pagedllm_experts")]
    assert all(experts) and bool(experts) == (kind in MOE_KINDS and cpu.available())


# ---------------------------------------------------------------- 2. SmolLM2: backend vs native

def test_smollm2_transformers_backend_equals_native(smollm2_dir, smollm2_tokenizer, greedy_ref, request,
                                                    assert_no_leaks):
    from pagedllm.models.transformers_backend import TransformersCausalLM
    tok = smollm2_tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three uses of a printing press."}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok.encode(TEXT)
    prompts = [ids[:5], tok.encode(chat, add_special_tokens=False), ids[10:90]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    results = {}
    for impl in ("native", "transformers"):
        llm = LLM(model=str(smollm2_dir), model_impl=impl, num_kv_blocks=64, max_num_batched_tokens=BUDGET)
        assert isinstance(llm.engine.runner.model, TransformersCausalLM) == (impl == "transformers")
        results[impl] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_no_leaks(llm.engine)
        del llm
    for k, (prompt, native, backend) in enumerate(zip(prompts, results["native"], results["transformers"])):
        greedy_ref.assert_same_greedy(backend.token_ids, native.token_ids, prompt,
                                      lambda: request.getfixturevalue("hf_smollm2"), f"smollm2 prompt {k}")
        for i, (a, b) in enumerate(zip(backend.token_ids, native.token_ids)):
            if a != b:
                break
            diff = abs(backend.logprobs[i][a].logprob - native.logprobs[i][b].logprob)
            assert diff < LOGPROB_TOL, f"smollm2 prompt {k} position {i}: log-probabilities differ by {diff:.2e}"


# ---------------------------------------------------------------- 3. selection and refusals

def test_select_impl():
    import transformers
    from pagedllm.models.registry import select_impl
    llama = transformers.LlamaConfig(architectures=["LlamaForCausalLM"])
    assert select_impl(llama, "auto") == "native"
    assert select_impl(llama) == "native"
    assert select_impl(llama, "native") == "native"
    assert select_impl(llama, "transformers") == "transformers"
    gemma3 = transformers.Gemma3TextConfig(architectures=["Gemma3ForCausalLM"])
    assert select_impl(gemma3, "auto") == "transformers"
    assert select_impl(gemma3, "transformers") == "transformers"
    with pytest.raises(ValueError, match="Gemma3ForCausalLM"):
        select_impl(gemma3, "native")
    with pytest.raises(ValueError, match="model_impl"):
        select_impl(llama, "vllm")


@pytest.mark.parametrize("config_cls, kwargs, match", [
    # no causal LM class at all
    ("T5Config", {}, "no causal LM"),
    # a causal LM whose attention transformers cannot swap
    ("FalconConfig", {}, "_supports_attention_backend"),
    # bidirectional attention (EmbeddingGemma style)
    ("Gemma3TextConfig", dict(use_bidirectional_attention=True), "bidirectional"),
    # lightning (linear) attention layers hold state no pagedllm mixer serves yet (LFM2's short
    # convolutions and Granite 4's Mamba-2 are served: tests/models/test_hybrid.py)
    ("MiniMaxConfig", dict(num_hidden_layers=2), "linear_attention"),
    # chunked attention (Llama 4) is not a sliding window
    ("Llama4TextConfig", {}, "chunked_attention"),
])
def test_select_impl_refuses_unservable(config_cls, kwargs, match):
    import transformers
    from pagedllm.models.registry import select_impl
    config = getattr(transformers, config_cls)(**kwargs)
    for impl in ("auto", "transformers"):
        with pytest.raises(ValueError, match=match):
            select_impl(config, impl)


def test_native_on_gemma3_fails_at_startup(arch_dir):
    with pytest.raises(ValueError, match="Gemma3ForCausalLM"):
        LLM(model=str(arch_dir("gemma3_text")), model_impl="native", num_kv_blocks=8)


def test_unknown_model_impl_fails_at_startup(arch_dir):
    with pytest.raises(ValueError, match="model_impl"):
        LLM(model=str(arch_dir("llama")), model_impl="vllm", num_kv_blocks=8)


def test_bert_fails_at_startup(tmp_path, smollm2_dir):
    """BERT maps to ``BertLMHeadModel`` in transformers' causal-LM table, but without
    ``is_decoder`` it attends both ways: the engine refuses it instead of serving it causally."""
    import transformers
    config = transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    transformers.BertLMHeadModel(config).save_pretrained(tmp_path)
    copy_tokenizer(smollm2_dir, tmp_path)
    for impl in ("auto", "transformers"):
        with pytest.raises(ValueError, match="BertLMHeadModel.*bidirectional"):
            LLM(model=str(tmp_path), model_impl=impl, num_kv_blocks=8)
    with pytest.raises(ValueError, match="BertLMHeadModel"):
        LLM(model=str(tmp_path), model_impl="native", num_kv_blocks=8)


def test_attention_sinks_fail_at_startup_where_the_backend_has_none():
    """gpt-oss passes its per-head sinks to the attention function; every backend of ours takes them
    (torch, C kernels, Triton); one that says it does not is refused when the model is loaded rather
    than served without them."""
    from pagedllm.attention.selector import select_attention_backend
    from pagedllm.attention.torch_paged import TorchPagedBackend
    from pagedllm.attention.triton_paged import TritonPagedBackend
    from pagedllm.models import transformers_backend as tb
    assert TritonPagedBackend.supports_sinks and TorchPagedBackend.supports_sinks
    attn = torch.nn.Module()
    attn.layer_idx, attn.sinks = 0, torch.nn.Parameter(torch.zeros(4))
    model = torch.nn.ModuleDict({"attn": attn})
    tb._check_modules(model, select_attention_backend("cpu", torch.float32, "torch"))  # served

    class NoSinks(TorchPagedBackend):
        name, supports_sinks = "no_sinks", False
    with pytest.raises(ValueError, match="ModuleDict.*sinks.*no_sinks"):
        tb._check_modules(model, NoSinks(torch.device("cpu")))


def test_attention_function_refuses_what_it_cannot_compute(monkeypatch):
    """The attention function itself refuses bidirectional modules and position-bias arguments (a
    model that slipped past the load-time checks fails loudly, not silently)."""
    from pagedllm.models import transformers_backend as tb
    monkeypatch.setattr(tb, "_current", object())  # inside a step; the refusal comes before any cache use
    q = torch.zeros(1, 2, 3, 4)
    module = torch.nn.Module()
    module.layer_idx = 0
    module.is_causal = False
    with pytest.raises(ValueError, match="bidirectional"):
        tb.paged_attention_forward(module, q, q, q, None)
    module.is_causal = True
    with pytest.raises(ValueError, match="bidirectional"):
        tb.paged_attention_forward(module, q, q, q, None, is_causal=False)
    for name in ("position_bias",):
        with pytest.raises(ValueError, match=name):
            tb.paged_attention_forward(module, q, q, q, None, **{name: torch.zeros(2)})


def test_config_without_causal_lm_fails_at_startup(tmp_path, smollm2_dir):
    import transformers
    transformers.T5Config(vocab_size=1000, d_model=32, num_layers=1, num_heads=2).save_pretrained(tmp_path)
    copy_tokenizer(smollm2_dir, tmp_path)
    with pytest.raises(ValueError, match="no causal LM for model_type 't5'"):
        LLM(model=str(tmp_path), num_kv_blocks=8)


# ---------------------------------------------------------------- 4. logits only for the sampled rows

def test_lm_head_sees_only_sampled_rows(arch_dir, smollm2_tokenizer, assert_no_leaks):
    """A 100-token prompt under a 32-token budget: three prefill-only steps project no row,
    the step that ends the prompt projects one, and so does the decode step."""
    prompt = (smollm2_tokenizer.encode(TEXT) * 2)[:100]
    llm = LLM(model=str(arch_dir("gemma2")), model_impl="transformers", num_kv_blocks=32,
              max_num_batched_tokens=BUDGET)
    spy = HeadSpy(llm)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    spy.remove()
    assert len(out[0].outputs[0].token_ids) == 2
    assert spy.tokens == [32, 32, 32, 4, 1]
    assert spy.rows == [0, 0, 0, 1, 1]
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("kind", ["qwen2_moe", "gpt_oss"])
def test_moe_preempted_and_prefix_cached_match_transformers(kind, arch_dir, prompts, greedy_ref, assert_no_leaks):
    """A mixture of experts on the experts kernel (a shared expert; gpt-oss's sinks, windows and clamped
    experts) under preemption (12 blocks of 8 tokens for four prompts: recompute), then the same prompts
    again from the prefix cache: transformers' greedy tokens both times, nothing leaked."""
    from transformers import AutoModelForCausalLM
    path = arch_dir(kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = [greedy_ref.hf_greedy(hf, p, MAX_NEW) for p in prompts]
    del hf
    llm = LLM(model=str(path), model_impl="transformers", num_kv_blocks=12, block_size=8,
              max_num_batched_tokens=BUDGET)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    for run in ("preempted", "prefix-cached"):
        outs = llm.generate(prompts, params, use_tqdm=False)
        check_against_reference(outs, prompts, refs, greedy_ref, f"{kind} {run}")
        assert_no_leaks(llm.engine)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    experts = [m.pagedllm_experts for m in llm.engine.runner.model.hf.modules() if hasattr(m, "pagedllm_experts")]
    from pagedllm.kernels import cpu
    assert all(experts) and bool(experts) == cpu.available()

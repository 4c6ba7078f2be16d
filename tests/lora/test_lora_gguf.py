"""LoRA adapters from llama.cpp's LoRA GGUF files (issue 43): a PEFT adapter converted by llama.cpp's own
``convert_lora_to_gguf.py`` gives the same matrices as the PEFT directory (q/k rope rows unpermuted) and
the same greedy tokens as the PEFT adapter and peft's merged model; what cannot be applied is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.lora.gguf_adapter import load_adapter, unpermute_rope_rows
from pagedllm.lora.peft_reader import load_peft_adapter
from pagedllm.lora.request import LoRARequest

CONVERTER = Path("/work/peers/llamacpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_lora_to_gguf.py")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_NEW = 8


def _convert(adapter_dir: Path, base_dir: Path, out: Path, outtype: str) -> Path:
    """Run llama.cpp's converter (its vendored gguf-py) offline; returns ``out``."""
    cmd = [sys.executable, str(CONVERTER), "--base", str(base_dir), "--outtype", outtype,
           "--outfile", str(out), str(adapter_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_smollm2, smollm2_dir, lora_writer):
    """A rank-8, alpha-16 SmolLM2 adapter on all projections: ``(PEFT dir, f32 GGUF, merged model)``."""
    if not CONVERTER.is_file():
        pytest.skip(f"needs llama.cpp's converter at {CONVERTER}")
    root = tmp_path_factory.mktemp("gguf-lora")
    merged = lora_writer(hf_smollm2, root / "peft", 8, ALL, seed=7, alpha=16)
    return root / "peft", _convert(root / "peft", smollm2_dir, root / "adapter-f32.gguf", "f32"), merged


@pytest.fixture(scope="module")
def smol_llm(smollm2_dir):
    llm = LLM(str(smollm2_dir), enable_lora=True, max_lora_rank=16, num_kv_blocks=256)
    yield llm
    llm.engine.shutdown() if hasattr(llm.engine, "shutdown") else None


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def test_gguf_reader_equals_peft(converted, hf_smollm2):
    """The converted file reads back as the PEFT directory's exact matrices and scaling (alpha / r)."""
    peft_dir, gguf_file, _ = converted
    ours = load_adapter(gguf_file, 16, hf_smollm2.config)
    ref = load_peft_adapter(peft_dir, 16)
    assert (ours.rank, ours.scaling) == (8, 2.0) == (ref.rank, ref.scaling)
    assert ours.weights.keys() == ref.weights.keys()
    for key, (a, b) in ref.weights.items():
        assert torch.equal(ours.weights[key][0], a) and torch.equal(ours.weights[key][1], b), key


def test_unpermute_inverts_llamacpp_permute():
    """``unpermute_rope_rows`` undoes llama.cpp's ``LlamaModel.permute`` (rows per head: (2, d/2) -> (d/2, 2))."""
    b = torch.randn(3 * 8, 4)
    permuted = b.reshape(3, 2, 4, 4).swapaxes(1, 2).reshape(b.shape)
    assert not torch.equal(permuted, b) and torch.equal(unpermute_rope_rows(permuted, 3), b)


def test_gguf_greedy_matches_peft_and_merged(smol_llm, converted, smollm2_tokenizer, greedy_ref):
    """Greedy tokens with the GGUF adapter == with the PEFT adapter == peft's merged model."""
    peft_dir, gguf_file, merged = converted
    prompt = smollm2_tokenizer.encode("The capital of France is")
    gen = lambda lr: smol_llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=lr)[0]  # noqa: E731
    from_gguf = gen(LoRARequest("gguf", 1, str(gguf_file)))
    from_peft = gen(LoRARequest("peft", 2, str(peft_dir)))
    base = gen(None).outputs[0].token_ids
    assert from_gguf.outputs[0].token_ids == from_peft.outputs[0].token_ids
    ref_ids, ref_logits = greedy_ref.hf_greedy(merged, prompt, MAX_NEW)
    greedy_ref.assert_greedy_match(from_gguf.outputs[0].token_ids, ref_ids, ref_logits, "gguf")
    assert ref_ids != base, "the adapter does not change the greedy tokens (a weak test)"


def _write_gguf(path: Path, tensors: dict[str, np.ndarray], general_type: str = "adapter",
                adapter_type: str = "lora", arch: str = "llama", alpha: float = 8.0, qtype=None) -> Path:
    """A small GGUF file laid out as llama.cpp's converter writes adapters (``qtype``: stored as that
    GGML type through ``gguf.quants.quantize``; float32 otherwise, and for rows too short for Q8_0's
    32-value blocks, as the converter falls back)."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(general_type)
    w.add_string("adapter.type", adapter_type)
    w.add_float32("adapter.lora.alpha", alpha)
    for name, t in tensors.items():
        if qtype is None or (qtype == gguf.GGMLQuantizationType.Q8_0 and t.shape[-1] % 32):
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_refusals(tmp_path, hf_smollm2, smol_llm):
    """A model GGUF, another adapter type, token_embd / output tensors, a missing lora_b and a rank
    above max_lora_rank are refused by name by the reader; the engine's check refuses a model GGUF and
    shapes that do not fit the base model."""
    cfg = hf_smollm2.config
    a, b = np.ones((4, 576), np.float32), np.ones((576, 4), np.float32)
    q = {"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b}
    cases = {"model.gguf": (_write_gguf(tmp_path / "model.gguf", q, general_type="model"), "not 'adapter'"),
             "other.gguf": (_write_gguf(tmp_path / "other.gguf", q, adapter_type="ia3"), "not 'lora'"),
             "embd.gguf": (_write_gguf(tmp_path / "embd.gguf", q | {"token_embd.weight.lora_a": a,
                                                                     "token_embd.weight.lora_b": b}), "token_embd"),
             "out.gguf": (_write_gguf(tmp_path / "out.gguf", {"output.weight.lora_a": a, "output.weight.lora_b": b}),
                          "'output'"),
             "nob.gguf": (_write_gguf(tmp_path / "nob.gguf", {"blk.0.attn_q.weight.lora_a": a}), "lora_b is missing")}
    for path, words in cases.values():
        with pytest.raises(ValueError, match=words):
            load_adapter(path, 16, cfg)
    with pytest.raises(ValueError, match="above max_lora_rank=2"):
        load_adapter(_write_gguf(tmp_path / "r4.gguf", q), 2, cfg)
    with pytest.raises(ValueError, match="not 'adapter'"):
        bad = LoRARequest("model-gguf", 9, str(cases["model.gguf"][0]))
        smol_llm.generate(["hi"], _greedy(), use_tqdm=False, lora_request=bad)
    narrow = _write_gguf(tmp_path / "narrow.gguf", {"blk.0.attn_q.weight.lora_a": a[:, :64],
                                                    "blk.0.attn_q.weight.lora_b": b})
    with pytest.raises(ValueError, match="do not fit the base model"):
        smol_llm.generate(["hi"], _greedy(), use_tqdm=False, lora_request=LoRARequest("narrow", 10, str(narrow)))


def test_gguf_types_alpha_and_arch(tmp_path, hf_smollm2):
    """F16, BF16 and Q8_0 tensors read back as float32 ``[r, in]`` / ``[out, r]`` within their rounding;
    alpha 0 scales by 1 (llama.cpp's rule); a ``qwen2`` file keeps its q rows; an adapter of another
    architecture than the base model's is refused."""
    from gguf import GGMLQuantizationType as Q
    cfg = hf_smollm2.config
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 576), np.float32), rng.standard_normal((576, 4), np.float32)
    q = {"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b}
    for qtype, tol in ((Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 2e-2)):
        got = load_adapter(_write_gguf(tmp_path / f"{qtype.name}.gguf", q, arch="qwen2", qtype=qtype), 16,
                           _Cfg("qwen2"))
        ga, gb = got.weights[(0, "q_proj")]
        assert ga.dtype == gb.dtype == torch.float32 and ga.shape == (4, 576) and gb.shape == (576, 4)
        assert torch.allclose(ga, torch.from_numpy(a), rtol=tol, atol=tol * 4), qtype.name
        assert torch.allclose(gb, torch.from_numpy(b), rtol=tol, atol=tol * 4), qtype.name
        assert got.scaling == 2.0
    assert load_adapter(_write_gguf(tmp_path / "a0.gguf", q, alpha=0.0), 16, cfg).scaling == 1.0
    with pytest.raises(ValueError, match="adapter of a 'qwen2' model"):
        load_adapter(tmp_path / "F16.gguf", 16, cfg)


class _Cfg:
    """A Qwen2-like text config: 9 heads, 3 key-value heads."""

    num_attention_heads, num_key_value_heads = 9, 3

    def __init__(self, model_type: str) -> None:
        self.model_type = model_type
